//! Small f32 loops on the hot path, written so that LLVM vectorises them for the build's
//! target CPU (`-C target-cpu=native`).

/// Dot product with eight independent accumulators, so a full SIMD register stays busy and the
/// sum does not serialise on one register.
#[inline]
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ac, ar) = a.split_at(a.len() & !7);
    let (bc, br) = b.split_at(ac.len());
    for (x, y) in ac.chunks_exact(8).zip(bc.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] = x[i].mul_add(y[i], acc[i]);
        }
    }
    let tail: f32 = ar.iter().zip(br).map(|(x, y)| x * y).sum();
    acc.iter().sum::<f32>() + tail
}

/// `e^x` from arithmetic and bit operations only, so loops over it vectorise (libm's `expf`
/// is a call per element). Range reduction to `r ∈ [-ln2/2, ln2/2]`, a degree-6 polynomial,
/// then scaling by `2^n` through the exponent bits: relative error below 2e-7.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    let x = x.clamp(-87.0, 88.0);
    let n = (x * std::f32::consts::LOG2_E).round();
    // ln 2 split in two so that n·ln2 is subtracted without rounding error.
    let r = x - n * 0.693_145_75 - n * 1.428_606_8e-6;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    p * f32::from_bits(pow2_bits(n))
}

/// The bits of `2^n` for a whole `n` in [-126, 127]. Adding 1.5·2²³ puts `n` in the low
/// mantissa bits exactly, so integer operations read it off: LLVM turned the saturating
/// `n as i32` into a scalar compare per element, which kept `exp`'s loops (SwiGLU, softmax)
/// half scalar.
#[inline(always)]
fn pow2_bits(n: f32) -> u32 {
    const MAGIC: f32 = 12_582_912.0;
    let biased = (n + MAGIC).to_bits().wrapping_sub(MAGIC.to_bits());
    biased.wrapping_add(127) << 23
}

/// In-place softmax. The exponentials go in a loop of their own, which vectorises; a loop
/// that also summed them (in order, as the lanes of `paged_attention::blocked` add theirs)
/// stayed scalar.
pub fn softmax(xs: &mut [f32]) {
    let max = xs.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    xs.iter_mut().for_each(|x| *x = exp(*x - max));
    let sum: f32 = xs.iter().fold(0.0, |s, &x| s + x);
    let inv = 1.0 / sum;
    xs.iter_mut().for_each(|x| *x *= inv);
}

/// `out[i] = silu(g[i]) * u[i]` (SwiGLU). Written from the gate rather than over a copy of
/// it: the copy was a memcpy of every gate row (2% of a Qwen2.5 prefill).
pub fn swiglu(out: &mut [f32], g: &[f32], u: &[f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = g / (1.0 + exp(-g)) * u;
    }
}

/// `out[i] = gelu(g[i]) * u[i]` (GeGLU), GELU in its tanh form as Gemma uses it.
pub fn geglu(out: &mut [f32], g: &[f32], u: &[f32]) {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    for ((o, &x), &u) in out.iter_mut().zip(g).zip(u) {
        // tanh(v) = 1 - 2 / (exp(2v) + 1), with the vectorisable exp above.
        let v = SQRT_2_OVER_PI * (x + 0.044715 * x * x * x);
        let t = 1.0 - 2.0 / (exp(2.0 * v) + 1.0);
        *o = 0.5 * x * (1.0 + t) * u;
    }
}

/// RMSNorm of each `w.len()`-wide row of `x`, in place (each row's scale is computed before
/// the row is written, so the result equals `rms_norm`'s).
pub fn rms_norm_in_place(x: &mut [f32], w: &[f32], eps: f32) {
    let n = w.len();
    for xr in x.chunks_mut(n) {
        let inv = 1.0 / (dot(xr, xr) / n as f32 + eps).sqrt();
        for (v, &g) in xr.iter_mut().zip(w) {
            *v = *v * inv * g;
        }
    }
}

/// RMSNorm of each `w.len()`-wide row of `x` into `out`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = w.len();
    for (xr, or) in x.chunks(n).zip(out.chunks_mut(n)) {
        let inv = 1.0 / (dot(xr, xr) / n as f32 + eps).sqrt();
        for ((o, &v), &g) in or.iter_mut().zip(xr).zip(w) {
            *o = v * inv * g;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dot_matches_naive_for_odd_lengths() {
        for n in [0, 1, 7, 8, 9, 63, 64, 100] {
            let a: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
            let b: Vec<f32> = (0..n).map(|i| 1.0 - i as f32 * 0.25).collect();
            let want: f32 = a.iter().zip(&b).map(|(x, y)| x * y).sum();
            assert!(
                (dot(&a, &b) - want).abs() <= 1e-3 * want.abs().max(1.0),
                "n={n}"
            );
        }
    }

    #[test]
    fn exponent_bits_are_those_of_the_integer_power() {
        for n in -126..=127 {
            assert_eq!(pow2_bits(n as f32), ((n + 127) as u32) << 23, "2^{n}");
        }
    }

    #[test]
    fn exp_is_accurate_over_the_useful_range() {
        let mut worst = 0f32;
        for i in -8700..=8800 {
            let x = i as f32 * 0.01;
            let (got, want) = (exp(x), x.exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 1e-6, "worst relative error {worst}");
        let mut s = [1.0, 2.0, 3.0];
        softmax(&mut s);
        let z = 1f32.exp() + 2f32.exp() + 3f32.exp();
        assert!((s[2] - 3f32.exp() / z).abs() < 1e-6 && (s.iter().sum::<f32>() - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rms_norm_matches_definition() {
        let mut out = [0f32; 4];
        rms_norm(&[1.0, 2.0, 3.0, 4.0], &[1.0, 1.0, 2.0, 2.0], 0.0, &mut out);
        let r = (30f32 / 4.0).sqrt();
        assert!((out[3] - 8.0 / r).abs() < 1e-6 && (out[0] - 1.0 / r).abs() < 1e-6);
    }
}
