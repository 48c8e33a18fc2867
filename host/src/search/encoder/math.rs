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
    for x in xs {
        *x = 0.5 * *x * (1.0 + erf(*x * std::f32::consts::FRAC_1_SQRT_2));
    }
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
fn softmax(xs: &mut [f32]) {
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

/// Multi-head self-attention of one sequence of `len` tokens, every token seeing every other
/// (an encoder has no mask but padding, and packed sequences have none). `qkv` holds each
/// token's query, key and value rows (`3 · dim` wide); `ctx` gets each token's `dim` outputs.
/// Both products of each head are GEMMs straight on the strided rows, so no head is copied.
pub fn attention(qkv: &[f32], len: usize, heads: usize, ctx: &mut [f32]) {
    let dim = ctx.len() / len;
    let hd = dim / heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let row = (3 * dim) as isize;
    assert_eq!(qkv.len(), len * 3 * dim, "qkv shape");
    let mut scores = vec![0f32; len * len];
    for h in 0..heads {
        let (qo, ko, vo) = (h * hd, dim + h * hd, 2 * dim + h * hd);
        // SAFETY (both calls): the pointers cover their matrices at the strides given. Q and K
        // are `len × hd` windows of `qkv` (row stride `3·dim`), read K transposed; `scores` is
        // `len × len`; V is a `len × hd` window of `qkv`; the head's `len × hd` window of `ctx`
        // has row stride `dim`. Every index stays below `len` rows of its buffer.
        unsafe {
            gemm::gemm(
                len,
                len,
                hd,
                scores.as_mut_ptr(),
                1,
                len as isize,
                false,
                qkv.as_ptr().add(qo),
                1,
                row,
                qkv.as_ptr().add(ko),
                row,
                1,
                0.0,
                scale,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
        for r in scores.chunks_exact_mut(len) {
            softmax(r);
        }
        unsafe {
            gemm::gemm(
                len,
                hd,
                len,
                ctx.as_mut_ptr().add(h * hd),
                1,
                dim as isize,
                false,
                scores.as_ptr(),
                1,
                len as isize,
                qkv.as_ptr().add(vo),
                1,
                row,
                0.0,
                1.0,
                false,
                false,
                false,
                gemm::Parallelism::None,
            );
        }
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

    #[test]
    fn attention_weighs_values_by_softmaxed_scores() {
        // One head of width 2, two tokens: token 0's query matches token 1's key.
        let qkv = [
            0.0, 4.0, /* k */ 1.0, 0.0, /* v */ 1.0, 0.0, //
            0.0, 0.0, /* k */ 0.0, 4.0, /* v */ 0.0, 1.0,
        ];
        let mut ctx = [0f32; 4];
        attention(&qkv, 2, 1, &mut ctx);
        let p = 1.0 / (1.0 + (-16.0f32 / 2f32.sqrt()).exp());
        assert!(
            (ctx[1] - p).abs() < 1e-6 && (ctx[0] - (1.0 - p)).abs() < 1e-6,
            "{ctx:?}"
        );
        assert!(
            (ctx[2] - 0.5).abs() < 1e-6 && (ctx[3] - 0.5).abs() < 1e-6,
            "{ctx:?}"
        );
    }
}
