//! Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 (32-weight blocks) times unrounded f32 activations: each
//! block is dequantized straight into registers and multiplied into the accumulators of
//! several activation rows, on AVX-512 (Q5_1 always; the others where the integer kernels do
//! not take them). AVX2 builds take the integer kernel `q32_avx2` for every row; a portable
//! path covers the rest.

use super::{Segment, TILE};

#[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
use crate::engine::cpu_ops::dot;

#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
use super::Format;

#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
const BLOCK: usize = 32;

/// Weight rows walked together for `g` activation rows (R·g ≤ 16 accumulators). A single
/// activation row in decode (`stream`) walks one weight row at a time, which the hardware
/// prefetcher follows: DRAM-resident Q8_0 (Gemma 3's 262k × 640 output matrix) read
/// 19.8–22.6 GB/s on two threads that way against 14–18 for four rows together; Q4_1 and
/// Q5_0, bound by their unpacking at ~7 GB/s per thread, were the same either way. A row's
/// sum takes the same steps in the same order whatever R, so results do not depend on it.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
const fn walk(g: usize, stream: bool) -> usize {
    match (g, stream) {
        (1, true) => 1,
        (1..=4, _) => 4,
        _ => 2,
    }
}

/// Rows `r0..r0 + nr` of `s` against the `g` activation rows of `x`, into `dst[row][g]`.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
pub(super) fn tile(
    s: &Segment,
    r0: usize,
    nr: usize,
    x: &[f32],
    g: usize,
    dst: &mut [f32],
    prefetch: bool,
) {
    use avx512::rows;
    debug_assert!(nr <= TILE);
    let args = (s, r0, nr, x, 0, g, dst);
    macro_rules! by_batch {
        ($f:expr) => {
            super::by_batch!(rows, $f, walk, g, prefetch, args)
        };
    }
    match s.format {
        Format::Q4_0 => by_batch!(avx512::Q4_0),
        Format::Q4_1 => by_batch!(avx512::Q4_1),
        Format::Q5_0 => by_batch!(avx512::Q5_0),
        Format::Q5_1 => by_batch!(avx512::Q5_1),
        Format::Q8_0 => by_batch!(avx512::Q8_0),
        Format::Q4K | Format::Q5K | Format::Q6K => unreachable!("k-quants use k_kernels"),
    }
}

/// Portable path: dequantize the tile, then plain dot products (vectorised by LLVM).
#[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
pub(super) fn tile(
    s: &Segment,
    r0: usize,
    nr: usize,
    x: &[f32],
    m: usize,
    dst: &mut [f32],
    _prefetch: bool,
) {
    debug_assert!(nr <= TILE);
    let k = s.cols;
    let mut buf = vec![0f32; nr * k];
    for t in 0..nr {
        s.dequantize_row(r0 + t, &mut buf[t * k..(t + 1) * k]);
    }
    for i in 0..m {
        let xr = &x[i * k..(i + 1) * k];
        for t in 0..nr {
            dst[t * m + i] = dot(&buf[t * k..(t + 1) * k], xr);
        }
    }
}

/// AVX-512 kernel: a 32-weight block dequantizes into two 16-lane registers and is multiplied
/// into G activation rows' accumulators, for R weight rows walked together (R·G = 16 of the 32
/// registers). Small batches walk four weight rows at once so independent weight streams keep
/// memory requests in flight; larger ones reuse each dequantized block across 8 rows.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
mod avx512 {
    use std::arch::x86_64::*;

    use super::{Segment, BLOCK};

    pub const Q4_0: u8 = 0;
    pub const Q4_1: u8 = 1;
    pub const Q8_0: u8 = 2;
    pub const Q5_0: u8 = 3;
    pub const Q5_1: u8 = 4;

    /// How far ahead weights are prefetched, as in `k_kernels`.
    const PREFETCH: usize = 8192;

    #[inline(always)]
    unsafe fn f16_at(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            p.cast::<u16>().read_unaligned() as i32,
        )))
    }

    /// `[byte]` for one byte permute that sends byte `i` of a 128-bit source to byte `at` of
    /// 32-bit lane `i` (the mask of `widen_u8`/`widen_i8` zeroes the lane's other bytes).
    #[cfg(target_feature = "avx512vbmi")]
    const fn lane_bytes(at: usize) -> [u8; 64] {
        let mut t = [0u8; 64];
        let mut i = 0;
        while i < 16 {
            t[4 * i + at] = i as u8;
            i += 1;
        }
        t
    }

    /// The sixteen bytes of `v` zero-extended to 32-bit lanes. With VBMI one byte permute
    /// does it: `vpmovzxbd` from a 128-bit source was the dearest step of the dequantization.
    #[inline(always)]
    unsafe fn widen_u8(v: __m128i) -> __m512i {
        #[cfg(target_feature = "avx512vbmi")]
        {
            // Byte i goes to the bottom of lane i.
            static IDX: [u8; 64] = lane_bytes(0);
            let idx = _mm512_loadu_si512(IDX.as_ptr().cast());
            _mm512_maskz_permutexvar_epi8(0x1111_1111_1111_1111, idx, _mm512_castsi128_si512(v))
        }
        #[cfg(not(target_feature = "avx512vbmi"))]
        {
            _mm512_cvtepu8_epi32(v)
        }
    }

    /// The sixteen bytes of `v` sign-extended to 32-bit lanes: the byte permute puts each
    /// byte at the top of its lane, and an arithmetic shift brings it down.
    #[inline(always)]
    unsafe fn widen_i8(v: __m128i) -> __m512i {
        #[cfg(target_feature = "avx512vbmi")]
        {
            static IDX: [u8; 64] = lane_bytes(3);
            let idx = _mm512_loadu_si512(IDX.as_ptr().cast());
            let top = _mm512_maskz_permutexvar_epi8(
                0x8888_8888_8888_8888,
                idx,
                _mm512_castsi128_si512(v),
            );
            _mm512_srai_epi32::<24>(top)
        }
        #[cfg(not(target_feature = "avx512vbmi"))]
        {
            _mm512_cvtepi8_epi32(v)
        }
    }

    /// The 32 weights of the block at `b` as two 16-lane vectors. The format is a constant so
    /// the inner loop carries no branch on it.
    #[inline(always)]
    unsafe fn dequant<const F: u8>(b: *const u8) -> [__m512; 2] {
        if F == Q8_0 {
            let vd = _mm512_set1_ps(f16_at(b));
            let f = |o: usize| {
                _mm512_mul_ps(
                    _mm512_cvtepi32_ps(widen_i8(_mm_loadu_si128(b.add(2 + o).cast()))),
                    vd,
                )
            };
            return [f(0), f(16)];
        }
        if F == Q5_0 || F == Q5_1 {
            let d = f16_at(b);
            let (min, qh, qs) = if F == Q5_1 {
                (f16_at(b.add(2)), b.add(4), b.add(8))
            } else {
                (-16.0 * d, b.add(2), b.add(6))
            };
            // Bit j of qh is the fifth bit of weight j: a lane mask for a masked add of 16.
            let h = qh.cast::<u32>().read_unaligned();
            let (vd, vm, sixteen) = (
                _mm512_set1_ps(d),
                _mm512_set1_ps(min),
                _mm512_set1_epi32(16),
            );
            let f = |v: __m512i, bits: u16| {
                let v = _mm512_mask_add_epi32(v, bits, v, sixteen);
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), vd, vm)
            };
            let [lo, hi] = nibbles(qs);
            return [f(lo, h as u16), f(hi, (h >> 16) as u16)];
        }
        let d = f16_at(b);
        let (min, qs) = if F == Q4_1 {
            (f16_at(b.add(2)), b.add(4))
        } else {
            (-8.0 * d, b.add(2))
        };
        let (vd, vm) = (_mm512_set1_ps(d), _mm512_set1_ps(min));
        nibbles(qs).map(|v| _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), vd, vm))
    }

    /// The sixteen bytes at `qs` as 32-bit lanes of their low nibbles (weights 0..16), then
    /// of their high ones (16..32): one widening for both.
    #[inline(always)]
    unsafe fn nibbles(qs: *const u8) -> [__m512i; 2] {
        let bytes = widen_u8(_mm_loadu_si128(qs.cast()));
        [
            _mm512_and_si512(bytes, _mm512_set1_epi32(0x0F)),
            _mm512_srli_epi32::<4>(bytes),
        ]
    }

    /// Weight rows `r0..r0 + nr` times activation rows `i0..i0 + G`, into `dst[row * m + i]`,
    /// walking R weight rows at a time. The activation rows stay in L1 across the whole tile.
    #[allow(clippy::type_complexity)]
    pub(super) fn rows<const F: u8, const R: usize, const G: usize, const P: bool>(
        (w, r0, nr, x, i0, m, dst): (&Segment, usize, usize, &[f32], usize, usize, &mut [f32]),
    ) {
        let k = w.cols;
        let bb = w.format.block_bytes();
        let rb = w.row_bytes();
        assert!(
            x.len() >= (i0 + G) * k && w.bytes().len() >= (r0 + nr) * rb && dst.len() >= nr * m
        );
        let xp: [*const f32; G] = std::array::from_fn(|j| x[(i0 + j) * k..].as_ptr());
        let pf = PREFETCH.div_ceil(R * rb) * R * rb;
        let mut t = 0;
        while t < nr {
            let rr = (nr - t).min(R);
            // Past the last row, repeat it: the extra results are computed and dropped.
            let rp: [*const u8; R] =
                std::array::from_fn(|q| w.bytes()[(r0 + t + q.min(rr - 1)) * rb..].as_ptr());
            // SAFETY: the assert above bounds every pointer: blocks < k / 32 of rows < r0 + nr,
            // activation offsets < k of rows < i0 + G.
            unsafe {
                let mut acc = [[_mm512_setzero_ps(); G]; R];
                for blk in 0..k / BLOCK {
                    for q in 0..R {
                        let b = rp[q].add(blk * bb);
                        // Every other block (blocks are ≤ 34 bytes): see k_kernels' PREFETCH.
                        if P && blk % 2 == 0 {
                            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(pf).cast());
                        }
                        let v = dequant::<F>(b);
                        for j in 0..G {
                            let p = xp[j].add(blk * BLOCK);
                            acc[q][j] = _mm512_fmadd_ps(v[0], _mm512_loadu_ps(p), acc[q][j]);
                            acc[q][j] =
                                _mm512_fmadd_ps(v[1], _mm512_loadu_ps(p.add(16)), acc[q][j]);
                        }
                    }
                }
                for q in 0..rr {
                    for j in 0..G {
                        dst[(t + q) * m + i0 + j] = _mm512_reduce_add_ps(acc[q][j]);
                    }
                }
            }
            t += rr;
        }
    }
}
