//! The encoder's per-token arithmetic: `exp` and `erf` written without branches or table
//! lookups so the loops over a row compile to AVX-512 (libm's scalar `erff` alone took several
//! seconds per 80k tokens), layer norm, GELU, softmax, and one sequence's attention.

/// e^x within ~2 ulp for x ≤ 88 (the callers pass x ≤ 0: softmax's shifted scores, erf's
/// −x²); below −87 it is the smallest normal float instead of a denormal or 0.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.3, 88.7);
    // x = n·ln2 + r, |r| ≤ ln2/2, with ln2 split in two so r keeps its low bits.
    let n = (x * std::f32::consts::LOG2_E).round_ties_even();
    let r = n.mul_add(-0.693_145_75, x);
    let r = n.mul_add(-1.428_606_8e-6, r);
    // e^r by its Taylor series to r^7: error below 2e-8 relative on |r| ≤ 0.347.
    let p = 1.0 / 5040.0;
    let p = p * r + 1.0 / 720.0;
    let p = p * r + 1.0 / 120.0;
    let p = p * r + 1.0 / 24.0;
    let p = p * r + 1.0 / 6.0;
    let p = p * r + 0.5;
    let p = p * r + 1.0;
    let p = p * r + 1.0;
    // 2^n from its exponent bits. An `as i32` cast would be scalarized (its saturation has no
    // vector instruction); adding 1.5·2^23 puts the small integer n + 127 in the low mantissa
    // bits instead, all in vector registers.
    const MAGIC: f32 = 12_582_912.0;
    let biased = n.clamp(-126.0, 127.0) + (127.0 + MAGIC);
    let scale = f32::from_bits((biased.to_bits() - MAGIC.to_bits()) << 23);
    p * scale
}

/// `x ← e^(x − max)` over `xs`, returning the sum: softmax less its division, which attention
/// leaves to its outputs. AVX-512 throughout (LLVM vectorizes `exp` 8 lanes wide here), and
/// `vscalefps` multiplies by 2^n without building the exponent's bits.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
pub fn exp_in_place(xs: &mut [f32]) -> f32 {
    use std::arch::x86_64::*;
    let (n, p) = (xs.len(), xs.as_mut_ptr());
    let full = n - n % 16;
    let mask = ((1u32 << (n % 16)) - 1) as __mmask16;
    // SAFETY: full vectors stay below `full ≤ n`; the tail is masked to the `n % 16` values
    // left (masked-off lanes are neither read nor written); the cfg guarantees AVX-512.
    unsafe {
        let mut m = _mm512_set1_ps(f32::NEG_INFINITY);
        for i in (0..full).step_by(16) {
            m = _mm512_max_ps(m, _mm512_loadu_ps(p.add(i)));
        }
        m = _mm512_mask_max_ps(m, mask, m, _mm512_maskz_loadu_ps(mask, p.add(full)));
        let max = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        let mut sum = _mm512_setzero_ps();
        for i in (0..full).step_by(16) {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p.add(i)), max));
            _mm512_storeu_ps(p.add(i), e);
            sum = _mm512_add_ps(sum, e);
        }
        let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, p.add(full)), max));
        _mm512_mask_storeu_ps(p.add(full), mask, e);
        sum = _mm512_mask_add_ps(sum, mask, sum, e);
        _mm512_reduce_add_ps(sum)
    }
}

/// `exp` on 16 lanes: the same reduction and polynomial.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
#[inline(always)]
unsafe fn exp16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let x = _mm512_min_ps(
        _mm512_max_ps(x, _mm512_set1_ps(-87.3)),
        _mm512_set1_ps(88.7),
    );
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
    let mut p = _mm512_set1_ps(1.0 / 5040.0);
    for c in [
        1.0 / 720.0,
        1.0 / 120.0,
        1.0 / 24.0,
        1.0 / 6.0,
        0.5,
        1.0,
        1.0,
    ] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    _mm512_scalef_ps(p, n)
}

/// erf(x) by Abramowitz & Stegun 7.1.26 (absolute error ≤ 1.5e-7).
#[inline(always)]
pub fn erf(x: f32) -> f32 {
    let a = x.abs();
    let t = 1.0 / 0.327_591_1f32.mul_add(a, 1.0);
    let y = 1.061_405_4f32.mul_add(t, -1.453_152_1);
    let y = y.mul_add(t, 1.421_413_8);
    let y = y.mul_add(t, -0.284_496_74);
    let y = y.mul_add(t, 0.254_829_6);
    let y = 1.0 - y * t * exp(-a * a);
    y.copysign(x)
}

/// GELU with the exact (erf) form BERT uses, in place.
pub fn gelu(xs: &mut [f32]) {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    let xs = {
        use std::arch::x86_64::*;
        let mut chunks = xs.chunks_exact_mut(16);
        for c in &mut chunks {
            // SAFETY: each chunk is 16 values; the cfg guarantees AVX-512.
            unsafe { _mm512_storeu_ps(c.as_mut_ptr(), gelu16(_mm512_loadu_ps(c.as_ptr()))) };
        }
        chunks.into_remainder()
    };
    for x in xs {
        *x = 0.5 * *x * (1.0 + erf(*x * std::f32::consts::FRAC_1_SQRT_2));
    }
}

/// `gelu` on 16 lanes (LLVM vectorizes the scalar form only 8 wide here, and GELU runs on
/// every MLP activation): `erf` as in `erf`, its division by a reciprocal estimate refined
/// by one Newton step (relative error ~1e-8 against the estimate's 2^-14).
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
#[inline(always)]
unsafe fn gelu16(x: std::arch::x86_64::__m512) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let z = _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::FRAC_1_SQRT_2));
    let a = _mm512_abs_ps(z);
    let d = _mm512_fmadd_ps(_mm512_set1_ps(0.327_591_1), a, _mm512_set1_ps(1.0));
    let e = _mm512_rcp14_ps(d);
    let t = _mm512_mul_ps(e, _mm512_fnmadd_ps(d, e, _mm512_set1_ps(2.0)));
    let mut y = _mm512_set1_ps(1.061_405_4);
    for c in [-1.453_152_1, 1.421_413_8, -0.284_496_74, 0.254_829_6] {
        y = _mm512_fmadd_ps(y, t, _mm512_set1_ps(c));
    }
    let ex = exp16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), a), a));
    // erf(|z|) = 1 - y·t·e^(-z²), given z's sign back; gelu = x · (1 + erf) / 2.
    let erf_abs = _mm512_fnmadd_ps(_mm512_mul_ps(y, t), ex, _mm512_set1_ps(1.0));
    let sign = _mm512_and_ps(z, _mm512_set1_ps(-0.0));
    let erf = _mm512_or_ps(erf_abs, sign);
    _mm512_mul_ps(
        _mm512_mul_ps(x, _mm512_set1_ps(0.5)),
        _mm512_add_ps(erf, _mm512_set1_ps(1.0)),
    )
}

/// `row = norm(row + residual) · w + b` (`residual` may be empty), as BERT's LayerNorm.
pub fn add_norm(row: &mut [f32], residual: &[f32], w: &[f32], b: &[f32], eps: f32) {
    if !residual.is_empty() {
        for (x, r) in row.iter_mut().zip(residual) {
            *x += r;
        }
    }
    let n = row.len() as f32;
    let mean = row.iter().sum::<f32>() / n;
    let var = row.iter().map(|x| (x - mean) * (x - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + eps).sqrt();
    for ((x, w), b) in row.iter_mut().zip(w).zip(b) {
        *x = (*x - mean) * inv * w + b;
    }
}

/// Softmax of `xs` in place. The max and the sum are kept per lane of 16 and combined at the
/// end: a running scalar max or sum is a chain the compiler may not reorder, so it would stay
/// scalar.
pub(super) fn softmax(xs: &mut [f32]) {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let chunks = xs.chunks_exact(16);
    let tail = chunks
        .remainder()
        .iter()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);
    for c in chunks {
        for (m, x) in lanes.iter_mut().zip(c) {
            *m = m.max(*x);
        }
    }
    let max = lanes.iter().copied().fold(tail, f32::max);
    for x in xs.iter_mut() {
        *x = exp(*x - max);
    }
    let mut sums = [0f32; 16];
    let chunks = xs.chunks_exact(16);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (s, x) in sums.iter_mut().zip(c) {
            *s += x;
        }
    }
    let inv = 1.0 / (sums.iter().sum::<f32>() + tail);
    for x in xs {
        *x *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_and_erf_match_the_standard_library() {
        let mut worst = (0f32, 0f32);
        for i in -8000..8000 {
            let x = i as f32 / 100.0;
            let rel = ((exp(x) as f64 - (x as f64).exp()) / (x as f64).exp()).abs() as f32;
            worst.0 = worst.0.max(rel);
        }
        for i in -6000..6000 {
            let x = i as f32 / 1000.0;
            worst.1 = worst
                .1
                .max((erf(x) as f64 - libm_erf(x as f64)).abs() as f32);
        }
        assert!(worst.0 < 5e-7, "exp: {}", worst.0);
        assert!(worst.1 < 1e-6, "erf: {}", worst.1);
        assert!(exp(-200.0) < 1e-37 && exp(0.0) == 1.0);
    }

    #[test]
    fn gelu_matches_its_definition() {
        let xs: Vec<f32> = (-800..800).map(|i| i as f32 / 100.0).collect();
        let mut ys = xs.clone();
        gelu(&mut ys);
        for (x, y) in xs.iter().zip(&ys) {
            let want = 0.5 * *x as f64 * (1.0 + libm_erf(*x as f64 / 2f64.sqrt()));
            assert!(
                (*y as f64 - want).abs() < 2e-6 * want.abs().max(1.0),
                "{x}: {y} vs {want}"
            );
        }
    }

    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    #[test]
    fn exp_in_place_is_softmax_less_its_division() {
        for n in [1, 15, 16, 17, 71] {
            let xs: Vec<f32> = (0..n)
                .map(|i| ((i * 13 % 31) as f32 - 15.0) / 2.0)
                .collect();
            let mut ys = xs.clone();
            let sum = exp_in_place(&mut ys);
            let max = xs.iter().copied().fold(f32::MIN, f32::max) as f64;
            let want: Vec<f64> = xs.iter().map(|&x| (x as f64 - max).exp()).collect();
            for (y, w) in ys.iter().zip(&want) {
                assert!(
                    (*y as f64 - w).abs() <= 5e-7 * w.max(1e-30),
                    "n={n}: {y} vs {w}"
                );
            }
            let total: f64 = want.iter().sum();
            assert!((sum as f64 - total).abs() < 1e-5 * total, "n={n}");
        }
    }

    /// erf by its series (|x| < 3) or continued fraction, in f64: the reference.
    fn libm_erf(x: f64) -> f64 {
        let a = x.abs();
        let v = if a < 3.0 {
            let (mut term, mut sum, mut n) = (a, a, 0.0);
            while term.abs() > 1e-17 {
                n += 1.0;
                term *= -a * a / n;
                sum += term / (2.0 * n + 1.0);
            }
            sum * 2.0 / std::f64::consts::PI.sqrt()
        } else {
            let mut f = 0.0;
            for k in (1..60).rev() {
                f = k as f64 / 2.0 / (a + f);
            }
            1.0 - (-a * a).exp() / (a + f) / std::f64::consts::PI.sqrt()
        };
        v.copysign(x)
    }
}
