//! Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (32-weight blocks) against activations rounded to bytes, on
//! AVX2: what `ActivationBits::EightButQ8_0` (`--decode-activation-bits 8`, and `auto` there)
//! gives the first four, and `Eight` (`8-all`) Q8_0 too (`ActivationBits::Eight` says why it
//! keeps 16 bits otherwise).
//!
//! Each activation block of 32 is rounded to i8 with its own scale, as llama.cpp rounds its
//! activations for these formats (`Q8_0`, `Q8_1`), so the rounding error per weight block is
//! llama.cpp's. The 16-bit kernel (`q32_avx2`) widens every weight to i16 and multiplies twice
//! per block; on a Zen 3 it took 10–11 cycles per Q4_1 block (weights in L1) where this one
//! takes about 5, and single-stream decode of SmolLM2 (Q4_1) was 0.84x llama.cpp's there.
//!
//! Per block `b` of a weight row (scale `d_b`, offset or min `c_b`) and activation row
//! `x ≈ e_b · q`: `w·x = d_b·e_b·Σ u·q + c_b·e_b·Σ q`, with `u` the block's unsigned values
//! (0..15 or 0..31, which `vpmaddubsw` multiplies by the signed bytes, pairs under 2¹³) and
//! `c_b` = `m_b` (Q4_1, Q5_1), `−8·d_b` (Q4_0) or `−16·d_b` (Q5_0). Q8_0's signed values meet
//! the bytes as `|w|` times `x` with `w`'s sign (pairs under 2¹⁵). `e_b·Σ q` is computed once
//! per activation row; for one row (decode) the second term adds up in a scalar beside the
//! vector sum, so the two chains of multiply-adds run side by side, and for a group of rows in
//! one vector, lane j for row j (the activations' scales are stored block-major for it).
//!
//! A weight block's scales are converted and multiplied block by block. Gathered eight blocks
//! at a time into vectors they cost twice the cycles on a Zen 3 (the gather, and the products
//! stored and read back lane by lane, stall decode's one chain).
//!
//! A weight row meets its activation rows one at a time with the same steps whatever the
//! group, so a row's bits do not depend on its batch.

use std::arch::x86_64::*;

use super::aligned::Aligned;
use super::q32_avx2::{bit_bytes, by_format_and_group, hsum, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0};
use super::rounding::{quantize_block, round_rows};
use super::{Format, Segment};
use crate::engine::team::Team;

/// Elements per block (and per activation scale).
const BLOCK: usize = 32;
/// How far ahead of the block being multiplied a stream of weights is prefetched (decode).
const PREFETCH: usize = 2048;

/// Activation rows rounded to bytes per 32 elements, once per matmul.
pub(super) struct Acts8 {
    k: usize,
    m: usize,
    /// `[m][k]`, element order.
    q: Aligned<i8, 64>,
    /// `[k / 32][m]`, then `LANES` zeros: each block's scale (`x ≈ q · e`). Block-major, so a
    /// group's rows at one block are one vector load.
    e: Vec<f32>,
    /// `[k / 32][m]`, then `LANES` zeros: each block's `e·Σq`.
    s: Vec<f32>,
}

/// Lanes of a float vector (and padding after the scales, so a group's load stays inside).
const LANES: usize = 8;

impl Acts8 {
    /// The `m` rows of `x` (`[m][k]`, `k` a multiple of 32), rows split across the team.
    pub(super) fn new(team: &Team, x: &[f32], m: usize, k: usize) -> Self {
        assert!(k.is_multiple_of(BLOCK), "rows of whole blocks");
        let (q16, e, s) = round_rows::<BLOCK, 1>(team, x, m, k, |xb, q, s| {
            let e = quantize_block(xb, q, 127.0);
            s[0] = q.iter().map(|&v| i32::from(v)).sum::<i32>() as f32 * e;
            e
        });
        let mut q = Aligned::zeroed(m * k);
        // |q| ≤ 127: the narrowing is exact.
        for (o, &v) in q.as_mut_slice().iter_mut().zip(q16.as_slice()) {
            *o = v as i8;
        }
        let nb = k / BLOCK;
        let by_block = |v: Vec<f32>| {
            let mut t = vec![0f32; nb * m + LANES];
            for (i, row) in v.chunks_exact(nb.max(1)).enumerate() {
                for (b, &v) in row.iter().enumerate() {
                    t[b * m + i] = v;
                }
            }
            t
        };
        Self {
            k,
            m,
            q,
            e: by_block(e),
            s: by_block(s),
        }
    }
}

/// Rows `r0..r0 + nr` of `s` against activation rows `i0..i0 + g` (g ≤ 8) of `a`, into
/// `dst[row * g + j]`; `stream`: the weights are read once from memory (decode, small
/// batches), so they are prefetched ahead.
pub(super) fn tile(
    s: &Segment,
    (r0, nr): (usize, usize),
    a: &Acts8,
    (i0, g): (usize, usize),
    dst: &mut [f32],
    stream: bool,
) {
    by_format_and_group!(rows, s.format, g, (s, r0, nr, a, i0, dst, stream))
}

#[allow(clippy::type_complexity)]
fn rows<const F: u8, const G: usize>(
    (s, r0, nr, a, i0, dst, stream): (&Segment, usize, usize, &Acts8, usize, &mut [f32], bool),
) {
    let (k, rb, bb) = (s.cols, s.row_bytes(), s.format.block_bytes());
    let (nb, m) = (k / BLOCK, a.m);
    let data = s.bytes();
    assert!(
        data.len() >= (r0 + nr) * rb
            && a.k == k
            && i0 + G <= m
            && a.q.as_slice().len() >= m * k
            && a.e.len() == nb * m + LANES
            && a.s.len() == nb * m + LANES
            && dst.len() >= nr * G
    );
    let (xq, xe, xs) = (a.q.as_slice().as_ptr(), a.e.as_ptr(), a.s.as_ptr());
    // What the sum of `c_b·e_b·Σq` is multiplied by: Q4_0 and Q5_0 add up `d_b·e_b·Σq`.
    let offset = match F {
        Q4_0 => -8.0,
        Q5_0 => -16.0,
        _ => 1.0,
    };
    // SAFETY: AVX2 is enabled for this module.
    let (ones, zero) = unsafe { (_mm256_set1_epi16(1), _mm256_setzero_ps()) };
    for t in 0..nr {
        let row = data[(r0 + t) * rb..(r0 + t + 1) * rb].as_ptr();
        let mut acc = [zero; G];
        // The offset sums: a scalar for one row, lane j for row j of a group (the same
        // multiply-adds in the same order, so a row's bits are the same either way).
        let (mut off, mut offs) = (0f32, zero);
        for b in 0..nb {
            // SAFETY: AVX2 and FMA are enabled for this module; the assert above bounds every
            // weight block (b < nb), activation row (rows < i0 + G ≤ m) and scale read (the
            // group's eight lanes at block b end by nb·m + 8), and a prefetch never faults.
            unsafe {
                let blk = row.add(b * bb);
                if stream {
                    _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH).cast());
                }
                // `d` and (Q4_1, Q5_1) `m` in one conversion.
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(blk.cast::<i32>().read_unaligned()));
                let d = _mm_cvtss_f32(dm);
                let c = match F {
                    Q4_1 | Q5_1 => _mm_cvtss_f32(_mm_movehdup_ps(dm)),
                    _ => d,
                };
                let (u, sign) = unpack::<F>(blk);
                let at = b * m + i0;
                // `d·e` of each row: one multiply for the group, read back lane by lane.
                let mut de = [0f32; LANES];
                if G == 1 {
                    de[0] = d * *xe.add(at);
                    if F != Q8_0 {
                        off = c.mul_add(*xs.add(at), off);
                    }
                } else {
                    let e = _mm256_loadu_ps(xe.add(at));
                    _mm256_storeu_ps(de.as_mut_ptr(), _mm256_mul_ps(_mm256_set1_ps(d), e));
                    if F != Q8_0 {
                        let s = _mm256_loadu_ps(xs.add(at));
                        offs = _mm256_fmadd_ps(_mm256_set1_ps(c), s, offs);
                    }
                }
                for (j, (acc, de)) in acc.iter_mut().zip(de).enumerate() {
                    let x = _mm256_load_si256(xq.add((i0 + j) * k + b * BLOCK).cast());
                    let x = if F == Q8_0 {
                        _mm256_sign_epi8(x, sign)
                    } else {
                        x
                    };
                    let p = _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), ones);
                    *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(de), *acc);
                }
            }
        }
        let mut lanes = [off; LANES];
        if G > 1 {
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), offs) };
        }
        for (j, (acc, off)) in acc.into_iter().zip(lanes).enumerate() {
            // SAFETY: as above.
            dst[t * G + j] = unsafe { hsum(acc) } + offset * off;
        }
    }
}

/// A block's 32 values as unsigned bytes in element order (Q8_0: their magnitudes), and
/// (Q8_0) the signed values whose signs the activations take.
#[inline(always)]
unsafe fn unpack<const F: u8>(blk: *const u8) -> (__m256i, __m256i) {
    if F == Q8_0 {
        let w = _mm256_loadu_si256(blk.add(2).cast());
        return (_mm256_abs_epi8(w), w);
    }
    // Where the nibbles start (the fifth bits' word sits just before them).
    let qs = match F {
        Q4_0 => 2,
        Q4_1 => 4,
        Q5_0 => 6,
        _ => 8,
    };
    let q = _mm_loadu_si128(blk.add(qs).cast());
    let m4 = _mm_set1_epi8(0x0F);
    // Byte i holds element i in its low nibble and element i + 16 in its high one.
    let lo = _mm_and_si128(q, m4);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), m4);
    let mut u = _mm256_set_m128i(hi, lo);
    if F == Q5_0 || F == Q5_1 {
        let qh = blk.add(qs - 4).cast::<u32>().read_unaligned();
        u = _mm256_or_si256(u, _mm256_and_si256(bit_bytes(qh), _mm256_set1_epi8(16)));
    }
    (u, u)
}
