//! Generated rows (decode, drafts, small batches) of Q4_0, Q5_0 and Q8_0 against 16-bit
//! activations, on AVX-512: the integer path the k-quants' batch kernels take.
//!
//! The f32 kernel (`f32_kernels`) turned every weight into a float and spent two multiply-adds
//! per activation row on each block: it read 42–50% of the streaming rate in decode where the
//! k-quants read 65–99%. Here the activations are rounded to 16-bit integers per 256 elements
//! (the k-quants' rounding: error ≤ 1/65534 of the group's largest value) and two blocks meet
//! them at a time: their quants unpack to one vector of 16-bit weights per half (`vpdpwssd`
//! pairs), lanes 0–7 holding block A's sums and 8–15 block B's, so one conversion and one
//! multiply-add by `[d_A ×8 | d_B ×8]` scale both blocks; the group's activation scale
//! multiplies its sums once. Each row's steps do not depend on how many rows share the pass, so
//! a row's bits are the same in any batch.
//!
//! Q8_0 (the output matrix of SmolLM2 and Gemma 3, layers of mixed files) comes here with its
//! bytes widened (`unpack_bytes`). Gemma 3 at concurrency 4 spent 13.0–13.3 ms a step on its
//! 262k-row output matrix against 17.8–18.2 on the f32 kernel (168–174 against 140–143
//! tok/s), SmolLM2's one-row vocabulary product 0.77 against 1.03 ms; at eight rows it is
//! level with the f32 kernel (per pair and row two `vpdpwssd`, a conversion and a multiply-add,
//! where floats take four multiply-adds). Weight rows across the lanes (`q4_1_batch`) would
//! share the float step, but their gathers read a 262k-row matrix too slowly for one row.
//!
//! Q4_1 does not come here: its mins cost each activation row one more multiply-add per pair,
//! and at eight rows a step this path took 30% longer than the f32 kernel (SmolLM2,
//! concurrency 8: weight products 16.7 against 12.8–14.2 ms a step). It takes `q4_1_batch`,
//! weight rows across the lanes, on these activations (with their block sums); Q5_1 stays on
//! the f32 kernel.

use std::arch::x86_64::*;

use super::aligned::Aligned;
use super::lanes::dot_acc;
use super::rounding::quantize_block;
use super::{ActivationBits, Format, Segment, TILE};
use crate::engine::team::{split, split_mut, Team};

/// Elements per block, per pair of blocks, and per activation scale.
pub(super) const BLOCK: usize = 32;
pub(super) const PAIR: usize = 2 * BLOCK;
pub(super) const GROUP: usize = 256;
/// Pairs per activation scale.
const PAIRS: usize = GROUP / PAIR;
/// How far ahead weights are prefetched, as in `k_kernels`.
const PREFETCH: usize = 8192;

/// Whether this path takes `format`.
pub(super) fn takes(format: Format) -> bool {
    matches!(format, Format::Q4_0 | Format::Q5_0 | Format::Q8_0)
}

/// Activation rows rounded for this kernel, once per matmul.
pub(super) struct Acts16 {
    /// Pairs of blocks per row (the last may hold one block).
    pub(super) pairs: usize,
    /// `[m][pairs][64]`: per pair `[A 0..16, B 0..16, A 16..32, B 16..32]` (a missing B zero),
    /// the order the weights unpack in.
    pub(super) q: Aligned<i16, 32>,
    /// `[m][groups]`: each 256-element group's scale (`x ≈ q · scale`; the last group may be
    /// shorter).
    pub(super) scale: Vec<f32>,
    /// `[m][blocks]`: each block's sum of its rounded activations (exact: |sum| < 2²⁴) times
    /// its group's scale, which the mins of Q4_1 (`q4_1_batch`) multiply.
    pub(super) scaled_sums: Vec<f32>,
}

impl Acts16 {
    /// The bounds a batch kernel on these activations relies on: weight rows `r0..r0 + nr`
    /// (at most a tile) of `s`, activation rows `i0..i0 + g`, `dst` for `[nr][g]` results.
    pub(super) fn check(
        &self,
        s: &Segment,
        (r0, nr): (usize, usize),
        (i0, g): (usize, usize),
        dst: &[f32],
    ) {
        debug_assert!(nr <= TILE);
        assert!(
            s.cols.div_ceil(PAIR) == self.pairs
                && self.q.as_slice().len() >= (i0 + g) * self.pairs * PAIR
                && self.scaled_sums.len() >= (i0 + g) * (s.cols / BLOCK)
                && s.bytes().len() >= (r0 + nr) * s.row_bytes()
                && dst.len() >= nr * g,
            "{:?} batch rows: shapes",
            s.format
        );
    }

    /// Rounds the `m` rows of `x` (`[m][k]`, `k` a multiple of 32), rows split across the team.
    pub(super) fn new(team: &Team, x: &[f32], m: usize, k: usize) -> Self {
        assert!(k.is_multiple_of(BLOCK) && x.len() == m * k);
        let (pairs, groups) = (k.div_ceil(PAIR), k.div_ceil(GROUP));
        let mut q = Aligned::zeroed(m * pairs * PAIR);
        let mut scale = vec![0f32; m * groups];
        let parts = team.threads().min(m);
        let ranges: Vec<_> = (0..parts).map(|p| split(m, 1, p, parts)).collect();
        let qs = split_mut(
            q.as_mut_slice(),
            ranges.iter().map(|r| r.len() * pairs * PAIR),
        );
        let ss = split_mut(&mut scale, ranges.iter().map(|r| r.len() * groups));
        let blocks = k / BLOCK;
        let mut sums = vec![0f32; m * blocks];
        let bs = split_mut(&mut sums, ranges.iter().map(|r| r.len() * blocks));
        let job = |p: usize, _: usize| {
            let Some(range) = ranges.get(p) else { return };
            let mut q = qs[p].lock().unwrap_or_else(|e| e.into_inner());
            let mut s = ss[p].lock().unwrap_or_else(|e| e.into_inner());
            let mut b = bs[p].lock().unwrap_or_else(|e| e.into_inner());
            let mut row = vec![0i16; k];
            for (i, r) in range.clone().enumerate() {
                let xr = &x[r * k..(r + 1) * k];
                for (g, xg) in xr.chunks(GROUP).enumerate() {
                    let at = g * GROUP;
                    s[i * groups + g] = quantize_block(
                        xg,
                        &mut row[at..at + xg.len()],
                        ActivationBits::Sixteen.max(),
                    );
                }
                for (at, block) in row.chunks_exact(BLOCK).enumerate() {
                    let sum = block.iter().map(|&v| i32::from(v)).sum::<i32>() as f32;
                    b[i * blocks + at] = sum * s[i * groups + at * BLOCK / GROUP];
                }
                let dst = &mut q[i * pairs * PAIR..(i + 1) * pairs * PAIR];
                for (e, &v) in row.iter().enumerate() {
                    let (pair, b, half, at) = (e / PAIR, e / BLOCK % 2, e % BLOCK / 16, e % 16);
                    dst[pair * PAIR + half * BLOCK + b * 16 + at] = v;
                }
            }
        };
        // A single row (decode) is rounded here rather than waking the team for it.
        if parts > 1 {
            team.run(&job);
        } else {
            job(0, 1);
        }
        Self {
            pairs,
            q,
            scale,
            scaled_sums: sums,
        }
    }
}

/// The format parameter of `rows` (a const generic, so each format gets its own loop).
const Q4_0: u8 = 0;
const Q5_0: u8 = 1;
const Q8_0: u8 = 2;

/// Weight rows walked together for `g` activation rows: each (row, activation row) keeps two
/// accumulators, so R·g ≤ 16.
const fn walk(g: usize, stream: bool) -> usize {
    match (g, stream) {
        (1, true) => 1,
        (1, false) => 4,
        (2..=4, _) => 2,
        _ => 1,
    }
}

/// Rows `r0..r0 + nr` of `s` against activation rows `i0..i0 + g` of `a`, into `dst[row][g]`.
pub(super) fn tile(
    s: &Segment,
    (r0, nr): (usize, usize),
    a: &Acts16,
    (i0, g): (usize, usize),
    dst: &mut [f32],
    prefetch: bool,
) {
    a.check(s, (r0, nr), (i0, g), dst);
    let args = (s, r0, nr, a, i0, dst);
    macro_rules! by_batch {
        ($f:expr) => {
            super::by_batch!(rows, $f, walk, g, prefetch, args)
        };
    }
    match s.format {
        Format::Q4_0 => by_batch!(Q4_0),
        Format::Q5_0 => by_batch!(Q5_0),
        Format::Q8_0 => by_batch!(Q8_0),
        other => unreachable!("{other:?} is not taken here"),
    }
}

/// Weight rows `r0..r0 + nr` times activation rows `i0..i0 + G`, into `dst[row * G + j]`,
/// R weight rows at a time.
// Index loops over the R × G accumulators: the iterator form clippy prefers decoded 3% slower
// (a Qwen2.5 Q5_0/Q8_0 mix, 14.5–15.0 against 15.1–15.5 tok/s, alternating runs).
#[allow(clippy::type_complexity, clippy::needless_range_loop)]
fn rows<const F: u8, const R: usize, const G: usize, const P: bool>(
    (w, r0, nr, a, i0, dst): (&Segment, usize, usize, &Acts16, usize, &mut [f32]),
) {
    let (k, rb, bb) = (w.cols, w.row_bytes(), w.format.block_bytes());
    let (pairs, nb, groups) = (a.pairs, w.cols / BLOCK, k.div_ceil(GROUP));
    let pf = PREFETCH.div_ceil(R * rb) * R * rb;
    let mut t = 0;
    while t < nr {
        let rr = (nr - t).min(R);
        // Past the last row, repeat it: the extra results are computed and dropped.
        let rp: [*const u8; R] =
            std::array::from_fn(|q| w.bytes()[(r0 + t + q.min(rr - 1)) * rb..].as_ptr());
        // SAFETY: `tile` asserted the bounds: blocks < nb of rows < r0 + nr, pairs < `pairs`
        // of activation rows < i0 + G; a pair's second block is read only when it exists.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); G]; R];
            for grp in 0..groups {
                let mut part = [[_mm512_setzero_ps(); G]; R];
                for pair in grp * PAIRS..pairs.min((grp + 1) * PAIRS) {
                    let both = 2 * pair + 1 < nb;
                    for q in 0..R {
                        let b = rp[q].add(2 * pair * bb);
                        if P {
                            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(pf).cast());
                        }
                        let (lo, hi, d) = if F == Q8_0 {
                            unpack_bytes(b, bb, both)
                        } else {
                            unpack::<F>(b, bb, both)
                        };
                        for j in 0..G {
                            let x = a.q.as_slice()[((i0 + j) * pairs + pair) * PAIR..].as_ptr();
                            let x_lo = _mm512_loadu_si512(x.cast());
                            let x_hi = _mm512_loadu_si512(x.add(BLOCK).cast());
                            let sum = dot_acc(dot_acc(_mm512_setzero_si512(), lo, x_lo), hi, x_hi);
                            let p = &mut part[q][j];
                            *p = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), d, *p);
                        }
                    }
                }
                for q in 0..R {
                    for j in 0..G {
                        let s = _mm512_set1_ps(a.scale[(i0 + j) * groups + grp]);
                        acc[q][j] = _mm512_fmadd_ps(part[q][j], s, acc[q][j]);
                    }
                }
            }
            for q in 0..rr {
                for j in 0..G {
                    dst[(t + q) * G + j] = _mm512_reduce_add_ps(acc[q][j]);
                }
            }
        }
        t += rr;
    }
}

/// The pair of blocks at `b` (blocks `bb` bytes apart; the second only with `both`): its
/// 16-bit weights per half (`[A 0..16, B 0..16]`, `[A 16..32, B 16..32]`, the quants less
/// their offset) and `[d_A ×8 | d_B ×8]` (zero for a missing B). One masked load takes the
/// pair (≤ 44 bytes, nothing past it) and word permutes gather the nibbles and the scales.
#[inline(always)]
unsafe fn unpack<const F: u8>(b: *const u8, bb: usize, both: bool) -> (__m512i, __m512i, __m512) {
    let (qs, qh, offset) = match F {
        Q4_0 => (2, 0, 8),
        _ => (6, 2, 16),
    };
    let len = if both { 2 * bb } else { bb };
    let pair = _mm512_maskz_loadu_epi8(u64::MAX >> (64 - len), b.cast());
    // Word indices into the pair: the lanes of A (0..8) and of B (8..16) from `at` on, in
    // steps of `step` words.
    let words = |at: usize, step: usize| {
        let idx: [u16; 32] = std::array::from_fn(|l| match l {
            0..8 => (at + step * l) as u16,
            8..16 => (bb / 2 + at + step * (l - 8)) as u16,
            _ => 0,
        });
        _mm512_castsi512_si256(_mm512_permutexvar_epi16(
            _mm512_loadu_si512(idx.as_ptr().cast()),
            pair,
        ))
    };
    let v = words(qs / 2, 1);
    let mask = _mm256_set1_epi8(0x0F);
    let (mut lo, mut hi) = (
        _mm256_and_si256(v, mask),
        _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask),
    );
    if F == Q5_0 {
        let bits = |p: *const u8| p.add(qh).cast::<u32>().read_unaligned();
        let (ha, hb) = (bits(b), if both { bits(b.add(bb)) } else { 0 });
        let sixteen = _mm256_set1_epi8(0x10);
        lo = _mm256_or_si256(
            lo,
            _mm256_maskz_mov_epi8((ha & 0xFFFF) | (hb << 16), sixteen),
        );
        hi = _mm256_or_si256(
            hi,
            _mm256_maskz_mov_epi8((ha >> 16) | (hb & 0xFFFF_0000), sixteen),
        );
    }
    let o = _mm256_set1_epi8(offset);
    (lo, hi) = (_mm256_sub_epi8(lo, o), _mm256_sub_epi8(hi, o));
    (
        _mm512_cvtepi8_epi16(lo),
        _mm512_cvtepi8_epi16(hi),
        _mm512_cvtph_ps(words(0, 0)),
    )
}

/// `unpack` for a pair of Q8_0 blocks (68 bytes, past one masked load): each block's 32
/// signed bytes in one 256-bit load, their halves interleaved by lane permutes and widened.
#[inline(always)]
unsafe fn unpack_bytes(b: *const u8, bb: usize, both: bool) -> (__m512i, __m512i, __m512) {
    let scale = |p: *const u8| _mm_set1_epi16(p.cast::<i16>().read_unaligned());
    let qa = _mm256_loadu_si256(b.add(2).cast());
    let (qb, db) = match both {
        true => (_mm256_loadu_si256(b.add(bb + 2).cast()), scale(b.add(bb))),
        false => (_mm256_setzero_si256(), _mm_setzero_si128()),
    };
    let d = _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(scale(b)), db);
    (
        _mm512_cvtepi8_epi16(_mm256_permute2x128_si256::<0x20>(qa, qb)),
        _mm512_cvtepi8_epi16(_mm256_permute2x128_si256::<0x31>(qa, qb)),
        _mm512_cvtph_ps(d),
    )
}

impl super::QuantMatrix {
    /// This kernel's activations for a pass of generated rows, when a segment takes it.
    pub(super) fn batch_acts16(&self, team: &Team, x: &[f32], m: usize) -> Option<Acts16> {
        self.segments
            .iter()
            .any(|s| takes(s.format) || s.format == Format::Q4_1)
            .then(|| Acts16::new(team, x, m, self.cols))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{quantize, reference, weights};
    use super::super::{ActivationBits, QuantMatrix};
    use crate::engine::team::Team;
    use candle_core::quantized::GgmlDType;

    /// Rows of an odd number of blocks (a pair's second block missing) and a last 256-element
    /// group cut short: against the f64 product within the 16-bit rounding of each group, and
    /// each row's bits the same alone and in batches of every size the kernels unroll for.
    #[test]
    fn odd_blocks_and_short_groups_round_per_group_and_batch_invariantly() {
        let team = Team::new(2);
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q5_0,
            GgmlDType::Q8_0,
            GgmlDType::Q4_1,
        ] {
            for k in [32, 96, 352, 1632] {
                let n = 37;
                let (q, deq) = quantize(&weights(n, k, 7), n, k, dtype);
                let qm = QuantMatrix::from_qtensor(&q).unwrap();
                let m = 11;
                // An outlier every 97 elements: groups with and without one round differently.
                let x: Vec<f32> = (0..m * k)
                    .map(|i| match i % 97 {
                        0 => -7.5,
                        _ => ((i * 29 % 17) as f32 - 8.0) * 0.07,
                    })
                    .collect();
                let run = |rows: std::ops::Range<usize>| {
                    let mut out = vec![0f32; rows.len() * n];
                    let xs = &x[rows.start * k..rows.end * k];
                    qm.batch(&team, xs, rows.len(), ActivationBits::Sixteen, &mut out);
                    out
                };
                let all = run(0..m);
                let want = reference(&x, &deq, m, n, k);
                for i in 0..m {
                    for r in 0..n {
                        let (xr, wr) = (&x[i * k..(i + 1) * k], &deq[r * k..(r + 1) * k]);
                        // Each group's rounding error: ≤ amax / 65534 per element.
                        let tol: f64 = xr
                            .chunks(256)
                            .zip(wr.chunks(256))
                            .map(|(xg, wg)| {
                                let amax = xg.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
                                let l1: f64 = wg.iter().map(|&v| v.abs() as f64).sum();
                                amax / 65534.0 * l1
                            })
                            .sum::<f64>()
                            + 1e-5 * (0..k).map(|c| (xr[c] * wr[c]).abs() as f64).sum::<f64>()
                            + 1e-5;
                        let (got, w) = (all[i * n + r] as f64, want[i * n + r]);
                        assert!(
                            (got - w).abs() <= tol,
                            "{dtype:?} k={k} ({i},{r}): {got} vs {w} (tol {tol})"
                        );
                    }
                }
                for i in 0..m {
                    assert_eq!(
                        run(i..i + 1),
                        all[i * n..(i + 1) * n],
                        "{dtype:?} k={k} row {i}"
                    );
                }
                for g in 2..=8 {
                    assert_eq!(
                        run(3..3 + g),
                        all[3 * n..(3 + g) * n],
                        "{dtype:?} k={k} {g} rows"
                    );
                }
            }
        }
    }
}
