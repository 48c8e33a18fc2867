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
//! by sixteen rows. Each block's bytes come from the sixteen rows by five gathers (scales, then
//! four words of nibbles), which every activation row of the batch then uses.
//!
//! The activations are `q32_batch`'s (16-bit per 256 elements). Each row's integer sums are
//! exact and its float steps are the same whatever the batch, so a row's bits do not depend on
//! the rows beside it.
//!
//! Measured on SmolLM2-135M's shapes (`cargo bench --bench kernels -- step`, two threads): the
//! Q4_1 layers of a step take 8.5 ms for eight rows where the f32 kernel took 13.9–14.7, and
//! 3.1 ms for one (3.9–4.0); one row reads DRAM at 66% of the streaming rate (51%). Q5_1 stays
//! on the f32 kernel: its fifth bits would need their own unpacking here.

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
/// How far ahead (bytes of each row) the next blocks are prefetched in a decode stream.
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
        // Five rows run as six, the last repeated: the five-row loop measured twice as slow
        // as the six-row one (SmolLM2's layers, 13.6 against 9.4 ms a step).
        (5 | 6, true) => rows::<6, 1, true>(args),
        (5 | 6, false) => rows::<6, 1, false>(args),
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
    let row = |j: usize| i0 + j.min(g - 1);
    let (k, rb) = (w.cols, w.row_bytes());
    let (pairs, nb, groups) = (a.pairs, k / BLOCK, k.div_ceil(GROUP));
    let acts = a.q.as_slice();
    let mut t = 0;
    while t < nr {
        let rr = (nr - t).min(LANES);
        // Past the last row, repeat it: the extra lanes are computed and dropped.
        let offsets: [i32; LANES] = std::array::from_fn(|q| (q.min(rr - 1) * rb) as i32);
        let base = w.bytes()[(r0 + t) * rb..].as_ptr();
        // SAFETY: `tile` asserted the bounds: the gathers read bytes < nb · 20 of rows
        // < r0 + nr; activation words < pairs · 64, sums < nb and scales < groups of rows
        // < i0 + g.
        unsafe {
            let vindex = _mm512_loadu_si512(offsets.as_ptr().cast());
            let mut acc = [_mm512_setzero_ps(); G];
            for blk in 0..nb {
                let b = base.add(blk * BLOCK_BYTES);
                if P && blk % 2 == 0 {
                    for q in 0..rr {
                        _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(q * rb + PREFETCH).cast());
                    }
                }
                // Block `blk`'s activations: its 32 words (`pair`'s layout).
                let x: [*const i16; G] = std::array::from_fn(|j| {
                    acts[(row(j) * pairs + blk / 2) * PAIR + blk % 2 * 16..].as_ptr()
                });
                let mut sums = [[_mm512_setzero_si512(); C]; G];
                // Written out four times so that each word's loop is unrolled (as a loop,
                // LLVM kept it rolled for seven and eight rows and spilled) and each
                // activation pair's offset is a constant of its instruction.
                word_dots!(vindex, b, x, sums, 0, [0, 64], [4, 68]);
                word_dots!(vindex, b, x, sums, 1, [8, 72], [12, 76]);
                word_dots!(vindex, b, x, sums, 2, [16, 80], [20, 84]);
                word_dots!(vindex, b, x, sums, 3, [24, 88], [28, 92]);
                let (d, m) = scales(vindex, b);
                for j in 0..G {
                    let c = &sums[j];
                    let s = match C {
                        4 => _mm512_add_epi32(
                            _mm512_add_epi32(c[0], c[1]),
                            _mm512_add_epi32(c[2], c[3]),
                        ),
                        2 => _mm512_add_epi32(c[0], c[1]),
                        _ => c[0],
                    };
                    // The group's activation scale goes with `d` (and is already in the
                    // block's sum), so no per-group accumulator holds a register.
                    let scale = *a.scale.get_unchecked(row(j) * groups + blk * BLOCK / GROUP);
                    let ds = _mm512_mul_ps(d, _mm512_set1_ps(scale));
                    let p = _mm512_fmadd_ps(ds, _mm512_cvtepi32_ps(s), acc[j]);
                    let sum = *a.scaled_sums.get_unchecked(row(j) * nb + blk);
                    acc[j] = _mm512_fmadd_ps(m, _mm512_set1_ps(sum), p);
                }
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

/// One word of each row's nibbles (`word` 0..4 of the block at `b`) times the activation rows
/// `x`: weight pairs `u = 2·word` and `u + 1` (low nibbles, activations at byte `4u` of the
/// block in `q32_batch`'s pair layout) and `u + 8`, `u + 9` (high ones, byte `64 + 4u`), into
/// the rows' integer sums. The offsets are given as `[low, high]` per half.
macro_rules! word_dots {
    ($vindex:expr, $b:expr, $x:expr, $sums:expr, $word:literal, [$l0:literal, $h0:literal], [$l1:literal, $h1:literal]) => {{
        let v = _mm512_i32gather_epi32::<1>($vindex, $b.add(4 + 4 * $word).cast());
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

/// The sixteen rows' `d` and `m` of the block at offset `b`.
#[inline(always)]
unsafe fn scales(vindex: __m512i, b: *const u8) -> (__m512, __m512) {
    let dm = _mm512_i32gather_epi32::<1>(vindex, b.cast());
    (
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm)),
        _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32::<16>(dm))),
    )
}

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
