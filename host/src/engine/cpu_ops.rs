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

/// `out += w * x`.
#[inline]
pub fn axpy(out: &mut [f32], w: f32, x: &[f32]) {
    for (o, v) in out.iter_mut().zip(x) {
        *o = v.mul_add(w, *o);
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
    fn rms_norm_matches_definition() {
        let mut out = [0f32; 4];
        rms_norm(&[1.0, 2.0, 3.0, 4.0], &[1.0, 1.0, 2.0, 2.0], 0.0, &mut out);
        let r = (30f32 / 4.0).sqrt();
        assert!((out[3] - 8.0 / r).abs() < 1e-6 && (out[0] - 1.0 / r).abs() < 1e-6);
    }
}
