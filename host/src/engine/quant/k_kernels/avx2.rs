//! AVX2 + FMA kernel for the many x86 machines without AVX-512BW (Zen 2/3, client Intel):
//! the same arithmetic as the AVX-512 batch kernel on 256-bit vectors. A super-block becomes
//! sixteen 16-lane i16 weight vectors with the sub-block scales folded in (even and odd
//! elements apart, as the activations are stored); `vpmaddwd` against the
//! 16-bit activations, summed in i32 per half super-block (16 products per lane, the bound the
//! module header proves), then one float conversion per half.
//!
//! Each result is summed per chunk of CHUNK super-blocks in column order, one weight row at a
//! time, so a row's bits do not depend on the batch it is in.

use std::arch::x86_64::*;

use super::super::blocks::{f16_at, k4_scales_mins};
use super::super::{Format, Segment};
use super::{KActs, CHUNK, Q4K, Q5K, Q6K, QK, SUMS};

/// Rows `r0..r0 + nr` of `s` against activation rows `i0..i0 + g` (g ≤ 8), into
/// `dst[row * g + j]`. The same signature as the other paths' `tile`; one weight row at a
/// time reads in order, so it needs no software prefetch.
#[allow(clippy::too_many_arguments)]
pub(in super::super) fn tile(
    s: &Segment,
    r0: usize,
    nr: usize,
    a: &KActs,
    i0: usize,
    g: usize,
    dst: &mut [f32],
    _walk: super::super::Walk,
) {
    let args = (s, r0, nr, a, i0, g, dst);
    match s.format {
        Format::Q4K => rows::<Q4K>(args),
        Format::Q5K => rows::<Q5K>(args),
        Format::Q6K => rows::<Q6K>(args),
        other => unreachable!("{other:?} is not a k-quant"),
    }
}

#[allow(clippy::type_complexity)]
fn rows<const F: u8>(
    (s, r0, nr, a, i0, g, dst): (&Segment, usize, usize, &KActs, usize, usize, &mut [f32]),
) {
    let (k, rb, bb) = (s.cols, s.row_bytes(), s.format.block_bytes());
    let nb = k / QK;
    let data = s.bytes();
    assert!(
        g <= 8
            && data.len() >= (r0 + nr) * rb
            && a.k == k
            && a.q().len() >= (i0 + g) * k
            && a.scale.len() >= (i0 + g) * nb
            && a.sums.len() >= (i0 + g) * nb * SUMS
            && dst.len() >= nr * g
    );
    for t in 0..nr {
        let row = &data[(r0 + t) * rb..(r0 + t + 1) * rb];
        dst[t * g..(t + 1) * g].fill(0.0);
        for c0 in (0..nb).step_by(CHUNK) {
            // SAFETY: AVX2 and FMA are enabled for this module; the assert above bounds every
            // activation row and block read (rows < i0 + g, blocks < nb).
            let acc = unsafe { chunk::<F>(row, bb, a, i0, g, c0..nb.min(c0 + CHUNK)) };
            for (j, &acc) in acc.iter().enumerate().take(g) {
                dst[t * g + j] += unsafe { hsum(acc) };
            }
        }
    }
}

/// One weight row's super-blocks `blocks` against the group's activations: 8-lane partials.
#[inline(always)]
unsafe fn chunk<const F: u8>(
    row: &[u8],
    bb: usize,
    a: &KActs,
    i0: usize,
    g: usize,
    blocks: std::ops::Range<usize>,
) -> [__m256; 8] {
    let (k, nb) = (a.k, a.k / QK);
    let mut acc = [_mm256_setzero_ps(); 8];
    let mut w = [_mm256_setzero_si256(); 16];
    for b in blocks {
        let (d, mins) = prep::<F>(&row[b * bb..(b + 1) * bb], &mut w);
        for (j, acc) in acc.iter_mut().enumerate().take(g) {
            let i = i0 + j;
            let xq = a.q()[i * k + b * QK..].as_ptr().cast::<__m256i>();
            let half = |h: usize| {
                let mut ia = _mm256_setzero_si256();
                for (v, &wv) in w.iter().enumerate().skip(8 * h).take(8) {
                    ia = _mm256_add_epi32(ia, _mm256_madd_epi16(wv, _mm256_loadu_si256(xq.add(v))));
                }
                _mm256_cvtepi32_ps(ia)
            };
            let dot = _mm256_add_ps(half(0), half(1));
            let scale = _mm256_set1_ps(d * a.scale[i * nb + b]);
            *acc = _mm256_fmadd_ps(dot, scale, *acc);
            if F != Q6K {
                let sums = _mm256_loadu_ps(a.sums[(i * nb + b) * SUMS..].as_ptr());
                *acc = _mm256_fnmadd_ps(mins, sums, *acc);
            }
        }
    }
    acc
}

/// One super-block into `w`, ordered as the activations are stored (`deinterleave`): run `r`'s even
/// elements of its first and second halves, then its odd ones, 16 per vector, scales folded
/// in. Returns `d` and `dmin·m_j` per sub-block (zero for Q6_K).
#[inline(always)]
unsafe fn prep<const F: u8>(blk: &[u8], w: &mut [__m256i; 16]) -> (f32, __m256) {
    let p = blk.as_ptr();
    let low = _mm256_set1_epi16(0xFF);
    // Q6_K's values carry an offset of 32 (zero otherwise: the subtraction folds away).
    let off = _mm256_set1_epi16(if F == Q6K { 32 } else { 0 });
    // Half `h` of run `r` (32 values as bytes) times its scales.
    let mut put = |r: usize, h: usize, v: __m256i, s: __m256i| {
        let even = _mm256_sub_epi16(_mm256_and_si256(v, low), off);
        let odd = _mm256_sub_epi16(_mm256_srli_epi16::<8>(v), off);
        w[4 * r + h] = _mm256_mullo_epi16(even, s);
        w[4 * r + 2 + h] = _mm256_mullo_epi16(odd, s);
    };
    if F == Q6K {
        let sc = |j: usize| _mm_set1_epi16(i16::from(blk[192 + j] as i8));
        for n in 0..2 {
            for (i, q) in q6k_runs(p, n).into_iter().enumerate() {
                // Elements 128n + 32i.. : half i % 2 of run 2n + i / 2; the even (and odd)
                // ones of its first 16 are in sub-block 8n + 2i, of its last 16 in the next.
                let j = 8 * n + 2 * i;
                put(2 * n + i / 2, i % 2, q, _mm256_set_m128i(sc(j + 1), sc(j)));
            }
        }
        return (f16_at(blk, 208), _mm256_setzero_ps());
    }
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    let (sc, mn) = k4_scales_mins(&blk[4..16]);
    let mins = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(mn.as_ptr().cast()))),
        _mm256_set1_ps(dmin),
    );
    let qs = if F == Q5K { p.add(48) } else { p.add(16) };
    let qh = _mm256_loadu_si256(p.add(16).cast());
    let m4 = _mm256_set1_epi8(0x0F);
    for c in 0..4 {
        let q = _mm256_loadu_si256(qs.add(32 * c).cast());
        let nib = [
            _mm256_and_si256(q, m4),
            _mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
        ];
        for (h, mut v) in nib.into_iter().enumerate() {
            let j = 2 * c + h;
            if F == Q5K {
                // Bit j of each `qh` byte is the fifth bit of that weight in sub-block j.
                let bit = _mm256_set1_epi8((1u8 << j) as i8);
                let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
                v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)));
            }
            put(c, h, v, _mm256_set1_epi16(i16::from(sc[j])));
        }
    }
    (d, mins)
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// A Q6_K block's 6-bit values for elements `128n..128n + 128`, as four runs of 32 bytes in
/// element order: low nibbles from `ql`, the two high bits from `qh` (bits 0-1, 2-3, 4-5, 6-7
/// for the four runs). 16-bit shifts are safe because the masks keep each byte's own bits.
#[inline(always)]
unsafe fn q6k_runs(b: *const u8, n: usize) -> [__m256i; 4] {
    use std::arch::x86_64::*;
    let (m4, m30) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let lo = _mm256_loadu_si256(b.add(64 * n).cast());
    let hi = _mm256_loadu_si256(b.add(64 * n + 32).cast());
    let h = _mm256_loadu_si256(b.add(128 + 32 * n).cast());
    [
        _mm256_or_si256(
            _mm256_and_si256(lo, m4),
            _mm256_and_si256(_mm256_slli_epi16(h, 4), m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(hi, m4),
            _mm256_and_si256(_mm256_slli_epi16(h, 2), m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4),
            _mm256_and_si256(h, m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(hi, 4), m4),
            _mm256_and_si256(_mm256_srli_epi16(h, 2), m30),
        ),
    ]
}
