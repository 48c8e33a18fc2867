//! The linear layers of a handful of tokens (a search query). Their cost is reading the
//! weights, not multiplying (16 tokens make 16 multiply-adds per weight): `gemm` would also
//! repack the whole matrix for each call, and f32 weights alone are 90 MB for MiniLM, 6 ms at
//! this machine's ~14 GB/s. So this path reads a BF16 copy of the transposed weights (half the
//! bytes; each weight rounded to 8 significant bits, the activations and sums stay f32),
//! streamed once, eight rows at a time in order so the prefetchers follow, each 16-wide slice
//! widened to f32 in registers while every token row's outputs take its eight multiply-adds.

#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
use std::arch::x86_64::{
    __m256i, __m512, _mm256_loadu_si256, _mm512_castsi512_ps, _mm512_cvtepu16_epi32,
    _mm512_fmadd_ps, _mm512_loadu_ps, _mm512_set1_ps, _mm512_slli_epi32, _mm512_storeu_ps,
};

/// 16 BF16 values widened to f32.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
#[inline(always)]
unsafe fn widen(p: *const u16) -> __m512 {
    let h = _mm256_loadu_si256(p as *const __m256i);
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
}

/// Most token rows this path takes; past it the outputs no longer stay in L2 and a blocked
/// GEMM wins.
pub const MAX_ROWS: usize = 16;

/// `out[t, n] += x[t, k] · w_t[k, n]` (`w_t` in BF16) for `t ≤ MAX_ROWS` and `n` a multiple
/// of 16; false when it does not apply (another shape, or a CPU without AVX-512), having done
/// nothing.
pub fn matmul(x: &[f32], t: usize, w_t: &[u16], n: usize, out: &mut [f32]) -> bool {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    {
        if t == 0 || t > MAX_ROWS || !n.is_multiple_of(16) {
            return false;
        }
        let k = x.len() / t;
        assert!(
            x.len() == t * k && w_t.len() == k * n && out.len() == t * n,
            "shapes"
        );
        // SAFETY: the asserts above bound every index `stream` reads or writes, and the build
        // targets AVX-512 (the cfg), so its instructions exist.
        unsafe { stream(x, t, k, w_t, n, out) };
        true
    }
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
    {
        let _ = (x, t, w_t, n, out);
        false
    }
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
unsafe fn stream(x: &[f32], t: usize, k: usize, w_t: &[u16], n: usize, out: &mut [f32]) {
    const STEP: usize = 8;
    let (x, w, o) = (x.as_ptr(), w_t.as_ptr(), out.as_mut_ptr());
    let mut i = 0;
    while i + STEP <= k {
        for c in (0..n).step_by(16) {
            let ws: [__m512; STEP] = std::array::from_fn(|b| widen(w.add((i + b) * n + c)));
            for r in 0..t {
                let xr = x.add(r * k + i);
                let mut acc = _mm512_loadu_ps(o.add(r * n + c));
                for (b, wv) in ws.iter().enumerate() {
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(*xr.add(b)), *wv, acc);
                }
                _mm512_storeu_ps(o.add(r * n + c), acc);
            }
        }
        i += STEP;
    }
    for i in i..k {
        for c in (0..n).step_by(16) {
            let wv = widen(w.add(i * n + c));
            for r in 0..t {
                let acc = _mm512_loadu_ps(o.add(r * n + c));
                let acc = _mm512_fmadd_ps(_mm512_set1_ps(*x.add(r * k + i)), wv, acc);
                _mm512_storeu_ps(o.add(r * n + c), acc);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::quant::amx::bf16;

    #[test]
    fn few_rows_match_a_plain_product() {
        let (k, n) = (43, 48);
        for t in [1, 3, 9, 16] {
            let x: Vec<f32> = (0..t * k)
                .map(|i| ((i * 7 % 13) as f32 - 6.0) / 8.0)
                .collect();
            // Quarters are exact in BF16: the product is the f32 one.
            let w: Vec<f32> = (0..k * n)
                .map(|i| ((i * 5 % 11) as f32 - 5.0) / 4.0)
                .collect();
            let w16: Vec<u16> = w.iter().map(|&v| bf16(v)).collect();
            let mut out = vec![1.0f32; t * n];
            if !matmul(&x, t, &w16, n, &mut out) {
                return; // no AVX-512 in this build: the GEMM path serves
            }
            for r in 0..t {
                for c in 0..n {
                    let want: f32 = 1.0 + (0..k).map(|i| x[r * k + i] * w[i * n + c]).sum::<f32>();
                    assert!((out[r * n + c] - want).abs() < 1e-4, "t={t} ({r},{c})");
                }
            }
        }
    }
}
