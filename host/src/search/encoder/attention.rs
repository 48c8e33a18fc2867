//! Multi-head self-attention of one sequence of `len` tokens, every token seeing every other
//! (an encoder has no mask but padding, and packed sequences have none).
//!
//! Sequences are short (tens of tokens) and heads narrow (32 or 64): as GEMMs, each head's two
//! products were small enough that packing their operands cost as much as multiplying (a
//! quarter of the encoder's time once its linear layers ran on AMX tiles). The blocked kernel
//! (AVX-512) instead transposes the head's keys once, then takes query rows four at a time:
//! their scores against 16 keys are 16-wide multiply-adds over the head's width, and their
//! outputs 16-wide multiply-adds of each value row, every loaded key or value serving four
//! rows in registers. Softmax's division by the sum is left to the outputs, one per lane.

use super::math;

/// Query rows sharing each loaded key and value row.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
const ROWS: usize = 4;
/// Keys per score vector, and head-width lanes per output vector.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
const LANES: usize = 16;

/// Attention of one sequence: `qkv` holds each token's query, key and value rows (`3 · dim`
/// wide); `ctx` gets each token's `dim` outputs.
pub fn attention(qkv: &[f32], len: usize, heads: usize, ctx: &mut [f32]) {
    let dim = ctx.len() / len;
    assert_eq!(qkv.len(), len * 3 * dim, "qkv shape");
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    if (dim / heads).is_multiple_of(LANES) {
        // SAFETY: the shapes are checked above and the build targets AVX-512 (the cfg).
        return unsafe { blocked(qkv, len, heads, ctx) };
    }
    by_gemm(qkv, len, heads, ctx)
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
unsafe fn blocked(qkv: &[f32], len: usize, heads: usize, ctx: &mut [f32]) {
    let dim = ctx.len() / len;
    let (hd, w) = (dim / heads, 3 * dim);
    // Keys padded to whole vectors; the padding's scores are never read.
    let padded = len.next_multiple_of(LANES);
    let mut kt = vec![0f32; hd * padded];
    let mut scores = vec![0f32; ROWS * padded];
    let (qkv, kt_p, s) = (qkv.as_ptr(), kt.as_mut_ptr(), scores.as_mut_ptr());
    let scale = 1.0 / (hd as f32).sqrt();
    for h in 0..heads {
        let (qo, ko, vo) = (h * hd, dim + h * hd, 2 * dim + h * hd);
        for j in 0..len {
            for d in 0..hd {
                *kt_p.add(d * padded + j) = *qkv.add(j * w + ko + d);
            }
        }
        for i0 in (0..len).step_by(ROWS) {
            let rows = ROWS.min(len - i0);
            // A short last group repeats its last row rather than branch in the inner loops.
            let q: [*const f32; ROWS] =
                std::array::from_fn(|r| qkv.add((i0 + r.min(rows - 1)) * w + qo));
            scores_of(q, kt_p, padded, hd, scale, s);
            let mut inv = [0f32; ROWS];
            for (r, inv) in inv.iter_mut().enumerate() {
                *inv = 1.0
                    / math::exp_in_place(std::slice::from_raw_parts_mut(s.add(r * padded), len));
            }
            for c0 in (0..hd).step_by(LANES) {
                let v = qkv.add(vo + c0);
                let out: [*mut f32; ROWS] =
                    std::array::from_fn(|r| ctx.as_mut_ptr().add((i0 + r) * dim + qo + c0));
                weigh(s, padded, len, v, w, inv, &out[..rows]);
            }
        }
    }
}

/// `s[r, j] = scale · q_r · k_j` for four query rows against every key of the head (`kt`: the
/// head's keys transposed, `padded` wide), 16 keys a vector.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
#[inline(always)]
unsafe fn scores_of(
    q: [*const f32; ROWS],
    kt: *const f32,
    padded: usize,
    hd: usize,
    scale: f32,
    s: *mut f32,
) {
    use std::arch::x86_64::*;
    for j0 in (0..padded).step_by(LANES) {
        let (mut a0, mut a1, mut a2, mut a3) = (
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
        );
        for d in 0..hd {
            let k = _mm512_loadu_ps(kt.add(d * padded + j0));
            a0 = _mm512_fmadd_ps(_mm512_set1_ps(*q[0].add(d)), k, a0);
            a1 = _mm512_fmadd_ps(_mm512_set1_ps(*q[1].add(d)), k, a1);
            a2 = _mm512_fmadd_ps(_mm512_set1_ps(*q[2].add(d)), k, a2);
            a3 = _mm512_fmadd_ps(_mm512_set1_ps(*q[3].add(d)), k, a3);
        }
        let sc = _mm512_set1_ps(scale);
        for (r, a) in [a0, a1, a2, a3].into_iter().enumerate() {
            _mm512_storeu_ps(s.add(r * padded + j0), _mm512_mul_ps(a, sc));
        }
    }
}

/// `out[r] = inv[r] · Σ_j s[r, j] · v_j` over 16 lanes of the head, `v` the first value row
/// (rows `w` apart); rows past `out.len()` are computed and dropped.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
#[inline(always)]
unsafe fn weigh(
    s: *const f32,
    padded: usize,
    len: usize,
    v: *const f32,
    w: usize,
    inv: [f32; ROWS],
    out: &[*mut f32],
) {
    use std::arch::x86_64::*;
    let (mut a0, mut a1, mut a2, mut a3) = (
        _mm512_setzero_ps(),
        _mm512_setzero_ps(),
        _mm512_setzero_ps(),
        _mm512_setzero_ps(),
    );
    for j in 0..len {
        let vj = _mm512_loadu_ps(v.add(j * w));
        a0 = _mm512_fmadd_ps(_mm512_set1_ps(*s.add(j)), vj, a0);
        a1 = _mm512_fmadd_ps(_mm512_set1_ps(*s.add(padded + j)), vj, a1);
        a2 = _mm512_fmadd_ps(_mm512_set1_ps(*s.add(2 * padded + j)), vj, a2);
        a3 = _mm512_fmadd_ps(_mm512_set1_ps(*s.add(3 * padded + j)), vj, a3);
    }
    for ((a, inv), o) in [a0, a1, a2, a3].into_iter().zip(inv).zip(out) {
        _mm512_storeu_ps(*o, _mm512_mul_ps(a, _mm512_set1_ps(inv)));
    }
}

/// `attention` for head widths the blocked kernel does not take: both products of each head
/// are GEMMs straight on the strided rows.
fn by_gemm(qkv: &[f32], len: usize, heads: usize, ctx: &mut [f32]) {
    let dim = ctx.len() / len;
    let hd = dim / heads;
    let scale = 1.0 / (hd as f32).sqrt();
    let row = (3 * dim) as isize;
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
            math::softmax(r);
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

    /// The blocked kernel against a plain f64 computation, for lengths that leave a short
    /// group of rows and a partial vector of keys.
    #[test]
    fn blocked_attention_matches_a_plain_computation() {
        let (heads, hd) = (2, 32);
        let dim = heads * hd;
        for len in [1, 5, 16, 37] {
            let qkv: Vec<f32> = (0..len * 3 * dim)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
                .collect();
            let mut ctx = vec![f32::NAN; len * dim];
            attention(&qkv, len, heads, &mut ctx);
            let at = |t: usize, part: usize, h: usize, d: usize| {
                qkv[t * 3 * dim + part * dim + h * hd + d] as f64
            };
            for h in 0..heads {
                for i in 0..len {
                    let s: Vec<f64> = (0..len)
                        .map(|j| {
                            (0..hd)
                                .map(|d| at(i, 0, h, d) * at(j, 1, h, d))
                                .sum::<f64>()
                        })
                        .map(|x| x / (hd as f64).sqrt())
                        .collect();
                    let max = s.iter().copied().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
                    let sum: f64 = e.iter().sum();
                    for d in 0..hd {
                        let want: f64 = (0..len).map(|j| e[j] / sum * at(j, 2, h, d)).sum();
                        let got = ctx[i * dim + h * hd + d] as f64;
                        assert!((got - want).abs() < 1e-5, "len {len} head {h} ({i},{d})");
                    }
                }
            }
        }
    }
}
