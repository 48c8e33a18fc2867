//! Generated rows (decode, drafts, small batches) of Q4_1 against 16-bit activations, on
//! AVX-512, with sixteen weight rows across the lanes.
//!
//! Q4_1's weights are `d·q + m`: per block and activation row the f32 kernel spent two
//! multiply-adds per sixteen weights, and the integer kernel of Q4_0/Q5_0 (`q32_batch`), one
//! weight row per vector, would pay a conversion and two multiply-adds per block and row for
//! the scale and the min: at eight rows a step that took 30% longer than the f32 kernel. Here
//! a vector holds sixteen weight rows' same pair of weights, so one `vpdpwssd` against a
//! broadcast pair of activations does 32 multiply-adds for sixteen rows, and the per-block
//! float step (the integer sum times `d`, plus `m` times the block's activation sum) is shared
//! by sixteen rows. Each block's five dwords (scales, then four words of nibbles) come to the
//! lanes, one row per lane, for every activation row of the batch to use: four blocks at a
//! time from 16-byte loads of each row transposed in registers (`unit`), and a short tile's
//! blocks and a row's last few by gathers.
//!
//! The activations are `q32_batch`'s (16-bit per 256 elements). Each row's integer sums are
//! exact and its float steps are the same whatever the batch, so a row's bits do not depend on
//! the rows beside it.
//!
//! Measured on SmolLM2-135M's shapes (`cargo bench --bench kernels -- step`, two threads): the
//! Q4_1 layers of a step take 8.5 ms for eight rows where the f32 kernel took 13.9–14.7, and
//! 3.1 ms for one (3.9–4.0); one row reads DRAM at 66% of the streaming rate (51%). On two
//! Zen 5 cores, where every block gathered cost about 100 cycles per sixteen rows, the loads
//! transposed in registers and the next tile prefetched took SmolLM2's whole one-row step
//! from 10.0 to 2.5 ms and eight rows from 17.2 to 7.1 ms, one row reading DRAM at 87-110% of
//! the streaming rate (gathered: 30%). Q5_1 stays on the f32 kernel: its fifth bits would need
//! their own unpacking here.

use std::arch::x86_64::*;

#[cfg(not(target_feature = "avx512vnni"))]
use super::lanes::dot_acc;
use super::q32_batch::{Acts16, BLOCK, GROUP, PAIR};
use super::Segment;

/// Weight rows per vector.
const LANES: usize = 16;
/// Bytes of a Q4_1 block: `d`, `m` (f16), then 16 bytes of nibbles (weight `i` low, `i + 16`
/// high).
const BLOCK_BYTES: usize = 20;
/// How far ahead (bytes of each row) a short tile's next blocks are prefetched in a decode
/// stream.
const PREFETCH: usize = 384;

/// Rows `r0..r0 + nr` of `s` (Q4_1) against activation rows `i0..i0 + g` of `a`, into
/// `dst[row][g]`.
pub(super) fn tile(
    s: &Segment,
    (r0, nr): (usize, usize),
    a: &Acts16,
    (i0, g): (usize, usize),
    dst: &mut [f32],
    prefetch: bool,
) {
    a.check(s, (r0, nr), (i0, g), dst);
    // The gathers' offsets are i32: sixteen rows' bytes must fit one.
    assert!(
        s.format.block_bytes() == BLOCK_BYTES && LANES * s.row_bytes() <= i32::MAX as usize,
        "q4_1 batch: shapes"
    );
    let args = (s, r0, nr, a, (i0, g), dst);
    // C: integer accumulators per activation row. A block's 16 `vpdpwssd` form one dependent
    // chain per accumulator, which a batch of one row splits four ways (the sums are exact
    // integers, so how they are split does not change the result).
    match (g, prefetch) {
        (1, true) => rows::<1, 4, true>(args),
        (1, false) => rows::<1, 4, false>(args),
        (2, true) => rows::<2, 2, true>(args),
        (2, false) => rows::<2, 2, false>(args),
        (3, true) => rows::<3, 2, true>(args),
        (3, false) => rows::<3, 2, false>(args),
        (4, true) => rows::<4, 1, true>(args),
        (4, false) => rows::<4, 1, false>(args),
        // Five rows had run as six (the gathering loop for five measured twice as slow); on
        // the loads five run alone, 4.19-4.32 against 4.51-5.65 ms as six (SmolLM2's step).
        (5, true) => rows::<5, 1, true>(args),
        (5, false) => rows::<5, 1, false>(args),
        (6, true) => rows::<6, 1, true>(args),
        (6, false) => rows::<6, 1, false>(args),
        (7, true) => rows::<7, 1, true>(args),
        (7, false) => rows::<7, 1, false>(args),
        (_, true) => rows::<8, 1, true>(args),
        (_, false) => rows::<8, 1, false>(args),
    }
}

/// Weight rows `r0..r0 + nr` (sixteen at a time) times activation rows `i0..i0 + g` (g ≤ G;
/// past g the last is repeated, computed and dropped), into `dst[row * g + j]`.
// Index loops over the G accumulators, as the other batch kernels keep them.
#[allow(clippy::type_complexity, clippy::needless_range_loop)]
fn rows<const G: usize, const C: usize, const P: bool>(
    (w, r0, nr, a, (i0, g), dst): (&Segment, usize, usize, &Acts16, (usize, usize), &mut [f32]),
) {
    debug_assert!((1..=G).contains(&g));
    let (k, rb) = (w.cols, w.row_bytes());
    let (pairs, nb) = (a.pairs, k / BLOCK);
    let at = At::<G> {
        rows: std::array::from_fn(|j| i0 + j.min(g - 1)),
        groups: k.div_ceil(GROUP),
        nb,
    };
    let acts = a.q.as_slice();
    // Block `blk`'s activations for each row: its 32 words (`pair`'s layout).
    let xs = |blk: usize| -> [*const i16; G] {
        std::array::from_fn(|j| {
            acts[(at.rows[j] * pairs + blk / 2) * PAIR + blk % 2 * 16..].as_ptr()
        })
    };
    let mut t = 0;
    while t < nr {
        let rr = (nr - t).min(LANES);
        // Past the last row, repeat it: the extra lanes are computed and dropped.
        let offsets: [i32; LANES] = std::array::from_fn(|q| (q.min(rr - 1) * rb) as i32);
        let base = w.bytes()[(r0 + t) * rb..].as_ptr();
        // Whole tiles take their blocks four at a time from plain loads; a short tile and the
        // last blocks (fewer than four) are gathered.
        let units = match rr {
            LANES => nb / UNIT,
            _ => 0,
        };
        // SAFETY: `tile` asserted the bounds: the gathers and loads read bytes < nb · 20 of
        // rows < r0 + nr (a unit's loads rows < r0 + t + 16 when sixteen are left);
        // activation words < pairs · 64, sums < nb and scales < groups of rows < i0 + g.
        unsafe {
            let vindex = _mm512_loadu_si512(offsets.as_ptr().cast());
            let mut acc = [_mm512_setzero_ps(); G];
            // A whole tile prefetches the same bytes of the next sixteen rows, the next tile
            // a thread streams (from 384 bytes ahead in its own rows, one row's decode read
            // DRAM at 64-72% of the streaming rate on Zen 5, now 90-102%); a short one, the
            // matrix's last, 384 bytes ahead.
            let ahead = match rr {
                LANES => LANES * rb,
                _ => PREFETCH,
            };
            for u in 0..units {
                let blk = u * UNIT;
                if P {
                    for b in [blk, blk + 2] {
                        prefetch(base.add(b * BLOCK_BYTES), rb, LANES, ahead);
                    }
                }
                unit::<G, C>(base.add(blk * BLOCK_BYTES), rb, blk, &xs, a, &at, &mut acc);
            }
            for blk in units * UNIT..nb {
                let b = base.add(blk * BLOCK_BYTES);
                if P && blk % 2 == 0 {
                    prefetch(b, rb, rr, ahead);
                }
                let x = xs(blk);
                let mut sums = [[_mm512_setzero_si512(); C]; G];
                let gather = |at: usize| _mm512_i32gather_epi32::<1>(vindex, b.add(at).cast());
                word!(gather(4), x, sums, 0);
                word!(gather(8), x, sums, 1);
                word!(gather(12), x, sums, 2);
                word!(gather(16), x, sums, 3);
                finish(&sums, gather(0), a, (&at, blk), &mut acc);
            }
            let mut out = [0f32; LANES];
            for j in 0..g {
                _mm512_storeu_ps(out.as_mut_ptr(), acc[j]);
                for q in 0..rr {
                    dst[(t + q) * g + j] = out[q];
                }
            }
        }
        t += rr;
    }
}

/// Blocks a whole tile takes together: four blocks of a row are 80 bytes, five 16-byte loads.
const UNIT: usize = 4;

/// Prefetches the bytes `ahead` of `b` in each of `rows` rows.
#[inline(always)]
unsafe fn prefetch(b: *const u8, rb: usize, rows: usize, ahead: usize) {
    for q in 0..rows {
        _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(q * rb + ahead).cast());
    }
}

/// Blocks `blk..blk + 4` of sixteen whole rows from `b` (row 0's first byte of block `blk`,
/// rows `rb` bytes apart) into `acc`: the same sums and float steps as four gathered blocks.
/// The sixteen rows' five 16-byte chunks are loaded and transposed in registers to the
/// vectors the gathers would give (dword `i` of every row): sixteen loads and eight unpacks
/// where a gather took 16 loads of 4 bytes, and on Zen 5 the gathers held one row's decode to
/// a third of the memory rate.
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn unit<const G: usize, const C: usize>(
    b: *const u8,
    rb: usize,
    blk: usize,
    xs: &impl Fn(usize) -> [*const i16; G],
    a: &Acts16,
    at: &At<G>,
    acc: &mut [__m512; G],
) {
    let chunk = |c: usize| transposed(b.add(16 * c), rb);
    let zero = || [[_mm512_setzero_si512(); C]; G];
    // Each block is five dwords: `d`/`m`, then four words of nibbles; chunk c holds dwords
    // 4c..4c + 4 of the 80 bytes.
    let x = [xs(blk), xs(blk + 1), xs(blk + 2), xs(blk + 3)];
    let mut sums = zero();
    let t = chunk(0);
    let dm = t[0];
    word!(t[1], x[0], sums, 0);
    word!(t[2], x[0], sums, 1);
    word!(t[3], x[0], sums, 2);
    let t = chunk(1);
    word!(t[0], x[0], sums, 3);
    finish(&sums, dm, a, (at, blk), acc);
    let (mut sums, dm) = (zero(), t[1]);
    word!(t[2], x[1], sums, 0);
    word!(t[3], x[1], sums, 1);
    let t = chunk(2);
    word!(t[0], x[1], sums, 2);
    word!(t[1], x[1], sums, 3);
    finish(&sums, dm, a, (at, blk + 1), acc);
    let (mut sums, dm) = (zero(), t[2]);
    word!(t[3], x[2], sums, 0);
    let t = chunk(3);
    word!(t[0], x[2], sums, 1);
    word!(t[1], x[2], sums, 2);
    word!(t[2], x[2], sums, 3);
    finish(&sums, dm, a, (at, blk + 2), acc);
    let (mut sums, dm) = (zero(), t[3]);
    let t = chunk(4);
    word!(t[0], x[3], sums, 0);
    word!(t[1], x[3], sums, 1);
    word!(t[2], x[3], sums, 2);
    word!(t[3], x[3], sums, 3);
    finish(&sums, dm, a, (at, blk + 3), acc);
}

/// The 16 bytes at `p` of sixteen rows `rb` bytes apart, as four vectors: vector `i` holds
/// each row's dword `i`, row q in lane q (what a gather at `p + 4i` gives).
#[inline(always)]
unsafe fn transposed(p: *const u8, rb: usize) -> [__m512i; 4] {
    // z[c] holds rows c, 4 + c, 8 + c and 12 + c in its four 128-bit lanes, so that the 4 × 4
    // transpose within each lane L leaves rows 4L..4L + 4 in order.
    let z: [__m512i; 4] = std::array::from_fn(|c| {
        let row = |l: usize| _mm_loadu_si128(p.add((4 * l + c) * rb).cast());
        let v = _mm512_castsi128_si512(row(0));
        let v = _mm512_inserti32x4::<1>(v, row(1));
        let v = _mm512_inserti32x4::<2>(v, row(2));
        _mm512_inserti32x4::<3>(v, row(3))
    });
    let (a0, a1) = (
        _mm512_unpacklo_epi32(z[0], z[1]),
        _mm512_unpackhi_epi32(z[0], z[1]),
    );
    let (a2, a3) = (
        _mm512_unpacklo_epi32(z[2], z[3]),
        _mm512_unpackhi_epi32(z[2], z[3]),
    );
    [
        _mm512_unpacklo_epi64(a0, a2),
        _mm512_unpackhi_epi64(a0, a2),
        _mm512_unpacklo_epi64(a1, a3),
        _mm512_unpackhi_epi64(a1, a3),
    ]
}

/// The activation rows a tile's blocks meet, and the activations' shape.
struct At<const G: usize> {
    rows: [usize; G],
    groups: usize,
    nb: usize,
}

/// Block `blk`'s float step for every activation row: its integer sums times `d` and the
/// group's scale, plus `m` times the block's scaled activation sum (`dm`: each row's `d`, `m`).
#[inline(always)]
#[allow(clippy::needless_range_loop)]
unsafe fn finish<const G: usize, const C: usize>(
    sums: &[[__m512i; C]; G],
    dm: __m512i,
    a: &Acts16,
    (at, blk): (&At<G>, usize),
    acc: &mut [__m512; G],
) {
    let (rows, groups, nb) = (at.rows, at.groups, at.nb);
    let d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    let m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dm)));
    for j in 0..G {
        let c = &sums[j];
        let s = match C {
            4 => _mm512_add_epi32(_mm512_add_epi32(c[0], c[1]), _mm512_add_epi32(c[2], c[3])),
            2 => _mm512_add_epi32(c[0], c[1]),
            _ => c[0],
        };
        // The group's activation scale goes with `d` (and is already in the block's sum), so
        // no per-group accumulator holds a register.
        let scale = *a
            .scale
            .get_unchecked(rows[j] * groups + blk * BLOCK / GROUP);
        let ds = _mm512_mul_ps(d, _mm512_set1_ps(scale));
        let p = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(s), acc[j]);
        let sum = *a.scaled_sums.get_unchecked(rows[j] * nb + blk);
        acc[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum), p);
    }
}

/// One word of each row's nibbles (`v`: word `W` of a block) times the activation rows `x`
/// (one block's pointers): the word's four weight pairs into the rows' integer sums.
macro_rules! word {
    ($v:expr, $x:expr, $sums:expr, 0) => {
        word_dots!($v, $x, $sums, 0, [0, 64], [4, 68])
    };
    ($v:expr, $x:expr, $sums:expr, 1) => {
        word_dots!($v, $x, $sums, 1, [8, 72], [12, 76])
    };
    ($v:expr, $x:expr, $sums:expr, 2) => {
        word_dots!($v, $x, $sums, 2, [16, 80], [20, 84])
    };
    ($v:expr, $x:expr, $sums:expr, 3) => {
        word_dots!($v, $x, $sums, 3, [24, 88], [28, 92])
    };
}
use word;

/// One word of each row's nibbles (`v`, word `word` 0..4 of a block) times the activation rows
/// `x`: weight pairs `u = 2·word` and `u + 1` (low nibbles, activations at byte `4u` of the
/// block in `q32_batch`'s pair layout) and `u + 8`, `u + 9` (high ones, byte `64 + 4u`), into
/// the rows' integer sums. The offsets are given as `[low, high]` per half; each is a constant
/// of its instruction.
macro_rules! word_dots {
    ($v:expr, $x:expr, $sums:expr, $word:literal, [$l0:literal, $h0:literal], [$l1:literal, $h1:literal]) => {{
        let v: __m512i = $v;
        let (lo, hi) = nibble_pairs(v, 0);
        for j in 0..G {
            let c = &mut $sums[j][(2 * $word) % C];
            *c = dot_pair!(*c, lo, $x[j], $l0);
            *c = dot_pair!(*c, hi, $x[j], $h0);
        }
        let (lo, hi) = nibble_pairs(v, 1);
        for j in 0..G {
            let c = &mut $sums[j][(2 * $word + 1) % C];
            *c = dot_pair!(*c, lo, $x[j], $l1);
            *c = dot_pair!(*c, hi, $x[j], $h1);
        }
    }};
}
use word_dots;

/// `acc` plus `w`'s 16-bit pairs times the pair of activations at byte `off` of `x`, broadcast
/// to every lane.
#[cfg(target_feature = "avx512vnni")]
macro_rules! dot_pair {
    ($acc:expr, $w:expr, $x:expr, $off:literal) => {{
        // Written out: from the intrinsic LLVM emitted `vpmaddwd` + `vpaddd` for all but the
        // first of a chain, two µops where `vpdpwssd` with its broadcast is one, and eight
        // rows ran at a third of the multiply rate (SmolLM2's layers, 10.3 ms a step).
        let mut acc: __m512i = $acc;
        std::arch::asm!(
            concat!("vpdpwssd {acc}, {w}, dword ptr [{x} + ", stringify!($off), "]{{1to16}}"),
            acc = inout(zmm_reg) acc,
            w = in(zmm_reg) $w,
            x = in(reg) $x,
            options(pure, readonly, nostack, preserves_flags)
        );
        acc
    }};
}
#[cfg(not(target_feature = "avx512vnni"))]
macro_rules! dot_pair {
    ($acc:expr, $w:expr, $x:expr, $off:literal) => {
        dot_acc(
            $acc,
            $w,
            _mm512_set1_epi32($x.cast::<u8>().add($off).cast::<i32>().read_unaligned()),
        )
    };
}
use dot_pair;

/// From one word of each row's nibbles (bytes `t` = 0..4 holding weights `4w + t` low and
/// `16 + 4w + t` high), the pairs of bytes `2·half`, `2·half + 1` as 16-bit weights: their low
/// nibbles (weights `4w + 2·half` and the next) and their high ones (16 further on).
#[inline(always)]
unsafe fn nibble_pairs(v: __m512i, half: usize) -> (__m512i, __m512i) {
    // Per 32-bit lane: byte 2·half to the low word, byte 2·half + 1 to the high (0x80: zero).
    const fn control(half: usize) -> [u8; 64] {
        let mut c = [0x80u8; 64];
        let mut lane = 0;
        while lane < 16 {
            c[4 * lane] = (4 * (lane % 4) + 2 * half) as u8;
            c[4 * lane + 2] = (4 * (lane % 4) + 2 * half + 1) as u8;
            lane += 1;
        }
        c
    }
    static CONTROL: [[u8; 64]; 2] = [control(0), control(1)];
    let bytes = _mm512_shuffle_epi8(v, _mm512_loadu_si512(CONTROL[half].as_ptr().cast()));
    (
        _mm512_and_si512(bytes, _mm512_set1_epi16(0x0F)),
        _mm512_srli_epi16::<4>(bytes),
    )
}

#[cfg(test)]
mod tests {
    use super::super::tests::{quantize, weights};
    use super::super::{ActivationBits, QuantMatrix};
    use crate::engine::team::Team;
    use candle_core::quantized::GgmlDType;

    /// A whole tile's blocks come from plain loads, four at a time, and a short tile's (and
    /// the last blocks') from gathers: the same weight rows give the same bits either way.
    /// Rows 32..47 (the short last tile) repeat rows 0..15 (the first whole one).
    #[test]
    fn loaded_and_gathered_blocks_give_the_same_bits() {
        let team = Team::new(2);
        let n = 47;
        for k in [96, 352, 1536] {
            let mut w = weights(n, k, 3);
            w.copy_within(0..15 * k, 32 * k);
            let (q, _) = quantize(&w, n, k, GgmlDType::Q4_1);
            let qm = QuantMatrix::from_qtensor(&q).unwrap();
            for m in [1, 3, 8] {
                let x: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.09)
                    .collect();
                let mut out = vec![f32::NAN; m * n];
                qm.batch(&team, &x, m, ActivationBits::Sixteen, &mut out);
                for i in 0..m {
                    let row = &out[i * n..(i + 1) * n];
                    assert!(row.iter().all(|v| v.is_finite()), "k {k} m {m}");
                    assert_eq!(row[..15], row[32..], "k {k} m {m} row {i}");
                }
            }
        }
    }
}
