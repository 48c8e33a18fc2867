//! Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (32-weight blocks) against 16-bit activations on AVX2, for
//! CPUs without AVX-512BW: every row, prompt or generated.
//!
//! These formats took the f32 kernel there: each weight converted to a float, two activation
//! rows at most per converted block, and Q5_0/Q5_1 through the scalar block decoder. SmolLM2
//! (Q4_1) and Gemma 3 (Q5_0, Q8_0) then ran at a third of llama.cpp's speed or less on AVX2
//! (decode 35.7 against 102.3 tok/s, prefill 108 against 343). Here a block's values widen to
//! two vectors of i16 once per weight row (offsets applied: Q4_0 `q − 8`, Q5_0 `q − 16`), and
//! each activation row meets them in two `vpmaddwd`: 32 products into eight exact i32 lanes (at
//! most 4 · 128 · 32767 < 2²⁴, so the conversion to float is exact too), scaled by the block's
//! `d` in one multiply-add.
//!
//! The rows are rounded to 16-bit integers per 256 elements, as the k-quants' are (the last
//! group of a row may be shorter): a group's eight blocks add up in float, then the group's
//! scale multiplies them once. Rounded per block, every block and row took a scalar product of
//! the two scales, its broadcast and its own multiply-add, ten instructions per 32 products
//! where now there are five, and a batch of rows paid that ten times over. Q4_1/Q5_1's mins
//! add `m·Σx` per block, the sums of the same rounded activations, eight blocks in one
//! multiply-add.
//!
//! A weight row meets its activation rows one at a time with the same steps whatever the
//! group, and its blocks add up in column order, so a row's bits do not depend on its batch.

use std::arch::x86_64::*;

use super::aligned::Aligned;
use super::blocks::f16_at;
use super::rounding::{quantize_block, round_rows};
use super::{Format, Segment};
use crate::engine::team::Team;

/// Elements per block.
const BLOCK: usize = 32;
/// Elements per activation scale, and the blocks they hold.
const GROUP: usize = 256;
const PER: usize = GROUP / BLOCK;
/// How far ahead of the block being multiplied a stream of weights is prefetched (decode).
const PREFETCH: usize = 2048;

/// Activation rows rounded to 16-bit integers per 256 elements, once per matmul.
pub(super) struct Acts32 {
    k: usize,
    /// `[m][k]`, element order.
    q: Aligned<i16, 32>,
    /// `[m][groups]`: each group's scale (`x ≈ q · scale`).
    scale: Vec<f32>,
    /// `[m][groups][8]`: each block's sum of its rounded activations times its group's scale
    /// (the integers added exactly, then scaled once; zero past a short group's blocks), for
    /// the mins of Q4_1 and Q5_1.
    sums: Vec<f32>,
}

impl Acts32 {
    /// The `m` rows of `x` (`[m][k]`, `k` a multiple of 32), rows split across the team.
    pub(super) fn new(team: &Team, x: &[f32], m: usize, k: usize) -> Self {
        assert!(k.is_multiple_of(BLOCK), "rows of whole blocks");
        let (q, scale, sums) = round_rows::<GROUP, PER>(team, x, m, k, |xg, q, u| {
            let scale = quantize_block(xg, q, 32767.0);
            for (u, block) in u.iter_mut().zip(q.chunks_exact(BLOCK)) {
                *u = block.iter().map(|&v| i32::from(v)).sum::<i32>() as f32 * scale;
            }
            scale
        });
        Self { k, q, scale, sums }
    }
}

/// Rows `r0..r0 + nr` of `s` against activation rows `i0..i0 + g` (g ≤ 8) of `a`, into
/// `dst[row * g + j]`; `stream`: the weights are read once from memory (decode, small
/// batches), so they are prefetched ahead.
pub(super) fn tile(
    s: &Segment,
    (r0, nr): (usize, usize),
    a: &Acts32,
    (i0, g): (usize, usize),
    dst: &mut [f32],
    stream: bool,
) {
    by_format_and_group!(rows, s.format, g, (s, r0, nr, a, i0, dst, stream))
}

/// `$rows::<F, G>($args)` for the segment's format `$format` as its const parameter and the
/// group of `$g` (≤ 8) rows: the dispatch of this kernel and of the byte kernel
/// (`q32_bytes`), which monomorphise alike. The caller has `Format` and the format constants
/// in scope.
macro_rules! by_format_and_group {
    ($rows:ident, $format:expr, $g:expr, $args:expr) => {
        match $format {
            Format::Q4_0 => by_format_and_group!(@group $rows, Q4_0, $g, $args),
            Format::Q4_1 => by_format_and_group!(@group $rows, Q4_1, $g, $args),
            Format::Q5_0 => by_format_and_group!(@group $rows, Q5_0, $g, $args),
            Format::Q5_1 => by_format_and_group!(@group $rows, Q5_1, $g, $args),
            Format::Q8_0 => by_format_and_group!(@group $rows, Q8_0, $g, $args),
            other => unreachable!("{other:?} is a k-quant"),
        }
    };
    (@group $rows:ident, $f:ident, $g:expr, $args:expr) => {
        match $g {
            1 => $rows::<{ $f }, 1>($args),
            2 => $rows::<{ $f }, 2>($args),
            3 => $rows::<{ $f }, 3>($args),
            4 => $rows::<{ $f }, 4>($args),
            5 => $rows::<{ $f }, 5>($args),
            6 => $rows::<{ $f }, 6>($args),
            7 => $rows::<{ $f }, 7>($args),
            8 => $rows::<{ $f }, 8>($args),
            _ => unreachable!("groups hold at most eight rows"),
        }
    };
}
pub(super) use by_format_and_group;

/// The format parameter (a const generic, so each format gets its own loop).
pub(super) const Q4_0: u8 = 0;
pub(super) const Q4_1: u8 = 1;
pub(super) const Q5_0: u8 = 2;
pub(super) const Q5_1: u8 = 3;
pub(super) const Q8_0: u8 = 4;

/// Whether the format's weights are `d·q + m` (a min per block).
const fn has_min(f: u8) -> bool {
    f == Q4_1 || f == Q5_1
}

#[allow(clippy::type_complexity)]
fn rows<const F: u8, const G: usize>(
    (s, r0, nr, a, i0, dst, stream): (&Segment, usize, usize, &Acts32, usize, &mut [f32], bool),
) {
    let (k, rb, bb) = (s.cols, s.row_bytes(), s.format.block_bytes());
    let (nb, groups) = (k / BLOCK, k.div_ceil(GROUP));
    let data = s.bytes();
    assert!(
        data.len() >= (r0 + nr) * rb
            && a.k == k
            && a.q.as_slice().len() >= (i0 + G) * k
            && a.scale.len() >= (i0 + G) * groups
            && a.sums.len() >= (i0 + G) * groups * PER
            && dst.len() >= nr * G
    );
    let xq = a.q.as_slice().as_ptr();
    for t in 0..nr {
        let row = &data[(r0 + t) * rb..(r0 + t + 1) * rb];
        // SAFETY: AVX2 and FMA are enabled for this module; the assert above bounds every
        // activation row, group and block read (rows < i0 + G, blocks < nb), and a prefetch
        // never faults.
        unsafe {
            let mut acc = [_mm256_setzero_ps(); G];
            for gi in 0..groups {
                let mut part = [_mm256_setzero_ps(); G];
                let mut mins = [0f32; PER];
                for b in gi * PER..nb.min(gi * PER + PER) {
                    let blk = &row[b * bb..(b + 1) * bb];
                    if stream {
                        let ahead = blk.as_ptr().wrapping_add(PREFETCH);
                        _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                    }
                    let (w0, w1, d, m) = unpack::<F>(blk);
                    let d = _mm256_set1_ps(d);
                    mins[b % PER] = m;
                    for (j, part) in part.iter_mut().enumerate() {
                        let x = xq.add((i0 + j) * k + b * BLOCK);
                        let ia = _mm256_add_epi32(
                            _mm256_madd_epi16(w0, _mm256_load_si256(x.cast())),
                            _mm256_madd_epi16(w1, _mm256_load_si256(x.add(16).cast())),
                        );
                        *part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), d, *part);
                    }
                }
                for (j, (acc, part)) in acc.iter_mut().zip(part).enumerate() {
                    let at = (i0 + j) * groups + gi;
                    *acc = _mm256_fmadd_ps(part, _mm256_set1_ps(a.scale[at]), *acc);
                    if has_min(F) {
                        let sums = _mm256_loadu_ps(a.sums[at * PER..].as_ptr());
                        *acc = _mm256_fmadd_ps(_mm256_loadu_ps(mins.as_ptr()), sums, *acc);
                    }
                }
            }
            for (j, acc) in acc.into_iter().enumerate() {
                dst[t * G + j] = hsum(acc);
            }
        }
    }
}

/// A block's 32 values as two vectors of i16 (elements 0..16, 16..32), offsets applied, with
/// `d` and (Q4_1, Q5_1) `m`.
#[inline(always)]
unsafe fn unpack<const F: u8>(b: &[u8]) -> (__m256i, __m256i, f32, f32) {
    let d = f16_at(b, 0);
    if F == Q8_0 {
        let q = b[2..34].as_ptr();
        let lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(q.cast()));
        let hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(q.add(16).cast()));
        return (lo, hi, d, 0.0);
    }
    // Where the nibbles start, and the fifth bits' word.
    let (qs, m) = match F {
        Q4_0 => (2, 0.0),
        Q4_1 => (4, f16_at(b, 2)),
        Q5_0 => (6, 0.0),
        _ => (8, f16_at(b, 2)),
    };
    let (lo, hi) = unsigned_bytes(b, qs, F == Q5_0 || F == Q5_1);
    let off = _mm256_set1_epi16(match F {
        Q4_0 => 8,
        Q5_0 => 16,
        _ => 0,
    });
    (
        _mm256_sub_epi16(_mm256_cvtepu8_epi16(lo), off),
        _mm256_sub_epi16(_mm256_cvtepu8_epi16(hi), off),
        d,
        m,
    )
}

/// A Q4_0/Q4_1/Q5_0/Q5_1 block's unsigned values (0..15, or 0..31 with `fifth`) as bytes,
/// elements 0..16 and 16..32; `qs`: where its nibbles start (the fifth bits' word sits just
/// before them).
#[inline(always)]
pub(super) unsafe fn unsigned_bytes(b: &[u8], qs: usize, fifth: bool) -> (__m128i, __m128i) {
    let q = _mm_loadu_si128(b[qs..qs + 16].as_ptr().cast());
    let m4 = _mm_set1_epi8(0x0F);
    // Byte i holds element i in its low nibble and element i + 16 in its high one.
    let (mut lo, mut hi) = (
        _mm_and_si128(q, m4),
        _mm_and_si128(_mm_srli_epi16::<4>(q), m4),
    );
    if fifth {
        let at = qs - 4;
        let qh = u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let bits = _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(16));
        lo = _mm_or_si128(lo, _mm256_castsi256_si128(bits));
        hi = _mm_or_si128(hi, _mm256_extracti128_si256::<1>(bits));
    }
    (lo, hi)
}

/// Byte `e` all ones where bit `e` of `bits` is set, zero elsewhere.
#[inline(always)]
pub(super) unsafe fn bit_bytes(bits: u32) -> __m256i {
    // Byte e takes byte e / 8 of the word (both 128-bit lanes hold the broadcast word).
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3,
            3, 3, 3,
        ),
    );
    // Every bit but e % 8 set: all ones exactly where bit e % 8 was.
    let others = _mm256_set1_epi64x(0x7FBF_DFEF_F7FB_FDFE);
    _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi8(-1))
}

#[inline(always)]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}
