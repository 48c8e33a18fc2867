//! Matmul over GGML-quantized weights (Q4_0, Q4_1, Q8_0) with f32 activations.
//!
//! candle's quantized matmul first quantizes the activations to 8 bits (as llama.cpp does). For
//! small models that rounding is enough to flip greedy choices whose logits are close, and
//! candle has no SIMD path for Q4_1 at all. Here weights are dequantized a tile of rows at a
//! time into L1-resident f32 and multiplied against unrounded activations: the result matches a
//! float reference to ~1e-5, every row of a batch reuses the dequantized tile, and the loops
//! vectorise. Other quantization types fall back to candle's `QMatMul`.

use super::team::{split, split_mut, Team};
use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;

#[cfg(not(all(
    target_arch = "x86_64",
    any(
        target_feature = "avx512f",
        all(target_feature = "avx2", target_feature = "fma")
    )
)))]
use super::cpu_ops::dot;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Q4_0,
    Q4_1,
    Q8_0,
}

impl Format {
    fn block_bytes(self) -> usize {
        match self {
            Format::Q4_0 => 18,
            Format::Q4_1 => 20,
            Format::Q8_0 => 34,
        }
    }
}

const BLOCK: usize = 32;
/// Weight rows per kernel call (a unit of the split across threads).
const TILE: usize = 32;
/// Activation rows sharing one pass over the weights.
const GROUP: usize = 8;

pub struct QuantMatrix {
    format: Format,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl QuantMatrix {
    /// Takes a 2-D `[rows, cols]` tensor in one of the supported formats; `None` otherwise.
    pub fn from_qtensor(t: &QTensor) -> Option<Self> {
        let format = match t.dtype() {
            GgmlDType::Q4_0 => Format::Q4_0,
            GgmlDType::Q4_1 => Format::Q4_1,
            GgmlDType::Q8_0 => Format::Q8_0,
            _ => return None,
        };
        let &[rows, cols] = t.shape().dims() else {
            return None;
        };
        let data = t.data().ok()?.into_owned();
        Self::new(format, rows, cols, data)
    }

    pub fn new(format: Format, rows: usize, cols: usize, data: Vec<u8>) -> Option<Self> {
        (cols.is_multiple_of(BLOCK) && data.len() == rows * cols / BLOCK * format.block_bytes())
            .then_some(Self {
                format,
                rows,
                cols,
                data,
            })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.format.block_bytes()
    }

    /// Dequantizes row `r` into `out` (`cols` long).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        let row = &self.data[r * rb..(r + 1) * rb];
        let bb = self.format.block_bytes();
        for (b, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK)) {
            let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
            match self.format {
                Format::Q4_0 => {
                    let qs = &b[2..18];
                    for j in 0..16 {
                        o[j] = ((qs[j] & 0xF) as i32 - 8) as f32 * d;
                        o[j + 16] = ((qs[j] >> 4) as i32 - 8) as f32 * d;
                    }
                }
                Format::Q4_1 => {
                    let m = f16::from_le_bytes([b[2], b[3]]).to_f32();
                    let qs = &b[4..20];
                    for j in 0..16 {
                        o[j] = (qs[j] & 0xF) as f32 * d + m;
                        o[j + 16] = (qs[j] >> 4) as f32 * d + m;
                    }
                }
                Format::Q8_0 => {
                    for (o, &q) in o.iter_mut().zip(&b[2..34]) {
                        *o = q as i8 as f32 * d;
                    }
                }
            }
        }
    }

    /// `out[m, rows] = x[m, cols] · selfᵀ`.
    ///
    /// Activation rows go in groups of up to eight, one pass over the weights per group: a group stays in L1 while the weights stream past it (two interleaved groups
    /// would evict each other and fall back to L2 bandwidth).
    pub fn matmul(&self, team: &Team, x: &[f32], m: usize, out: &mut [f32]) {
        let (n, k) = (self.rows, self.cols);
        assert_eq!(x.len(), m * k, "activation shape");
        assert_eq!(out.len(), m * n, "output shape");
        if m == 1 {
            self.pass(team, x, 1, out);
            return;
        }
        // Parts write their outputs transposed ([rows][g]): disjoint contiguous chunks.
        let mut out_t = vec![0f32; n * GROUP.min(m)];
        for i0 in (0..m).step_by(GROUP) {
            let g = (m - i0).min(GROUP);
            self.pass(team, &x[i0 * k..(i0 + g) * k], g, &mut out_t[..n * g]);
            for (r, col) in out_t[..n * g].chunks_exact(g).enumerate() {
                for (i, &v) in col.iter().enumerate() {
                    out[(i0 + i) * n + r] = v;
                }
            }
        }
    }

    /// One pass over all weight rows for `g` activation rows, rows split evenly across the
    /// team, into `dst[row][g]`.
    fn pass(&self, team: &Team, x: &[f32], g: usize, dst: &mut [f32]) {
        let n = self.rows;
        let parts = team.threads();
        let ranges: Vec<_> = (0..parts).map(|p| split(n, TILE, p, parts)).collect();
        let slices = split_mut(dst, ranges.iter().map(|r| r.len() * g));
        team.run(&|p, _| {
            let mut dst = slices[p].lock().unwrap_or_else(|e| e.into_inner());
            let range = ranges[p].clone();
            for r0 in range.clone().step_by(TILE) {
                let nr = (range.end - r0).min(TILE);
                let o = (r0 - range.start) * g;
                self.tile(r0, nr, x, g, &mut dst[o..o + nr * g]);
            }
        });
    }

    /// Rows `r0..r0 + nr` against the `g` activation rows of `x`, into `dst[row][g]`.
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    fn tile(&self, r0: usize, nr: usize, x: &[f32], g: usize, dst: &mut [f32]) {
        use avx512::rows;
        // R weight rows × g activation rows per pass, R·g ≤ 16 accumulators.
        let args = (self, r0, nr, x, 0, g, dst);
        macro_rules! by_batch {
            ($f:expr) => {
                match g {
                    8 => rows::<{ $f }, 2, 8>(args),
                    7 => rows::<{ $f }, 2, 7>(args),
                    6 => rows::<{ $f }, 2, 6>(args),
                    5 => rows::<{ $f }, 2, 5>(args),
                    4 => rows::<{ $f }, 4, 4>(args),
                    3 => rows::<{ $f }, 4, 3>(args),
                    2 => rows::<{ $f }, 4, 2>(args),
                    _ => rows::<{ $f }, 4, 1>(args),
                }
            };
        }
        match self.format {
            Format::Q4_0 => by_batch!(avx512::Q4_0),
            Format::Q4_1 => by_batch!(avx512::Q4_1),
            Format::Q8_0 => by_batch!(avx512::Q8_0),
        }
    }

    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        not(target_feature = "avx512f")
    ))]
    fn tile(&self, r0: usize, nr: usize, x: &[f32], m: usize, dst: &mut [f32]) {
        let mut i0 = 0;
        while i0 < m {
            // Up to two activation rows share each dequantized weight block (register budget).
            let g = (m - i0).min(2);
            match g {
                2 => avx2::rows::<2>(self, r0, nr, x, i0, m, dst),
                _ => avx2::rows::<1>(self, r0, nr, x, i0, m, dst),
            }
            i0 += g;
        }
    }

    /// Portable path: dequantize the tile, then plain dot products (vectorised by LLVM).
    #[cfg(not(all(
        target_arch = "x86_64",
        any(
            target_feature = "avx512f",
            all(target_feature = "avx2", target_feature = "fma")
        )
    )))]
    fn tile(&self, r0: usize, nr: usize, x: &[f32], m: usize, dst: &mut [f32]) {
        let k = self.cols;
        let mut buf = vec![0f32; nr * k];
        for t in 0..nr {
            self.dequantize_row(r0 + t, &mut buf[t * k..(t + 1) * k]);
        }
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            for t in 0..nr {
                dst[t * m + i] = dot(&buf[t * k..(t + 1) * k], xr);
            }
        }
    }

    /// Stacks matrices of the same format and width into one (e.g. Q, K, V into QKV).
    pub fn stack(parts: &[QuantMatrix]) -> Option<QuantMatrix> {
        let first = parts.first()?;
        if parts
            .iter()
            .any(|p| p.format != first.format || p.cols != first.cols)
        {
            return None;
        }
        let data = parts.iter().flat_map(|p| p.data.iter().copied()).collect();
        Self::new(
            first.format,
            parts.iter().map(|p| p.rows).sum(),
            first.cols,
            data,
        )
    }
}

/// AVX2 + FMA kernel: each 32-weight block is dequantized straight into four f32 registers
/// (`w = q·d + m`; Q4_0 is the case `m = -8d`, Q8_0 `w = q·d`) and multiplied into the
/// accumulators of up to two activation rows, for four weight rows at a time.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    not(target_feature = "avx512f")
))]
mod avx2 {
    use std::arch::x86_64::*;

    use half::f16;

    use super::{Format, QuantMatrix, BLOCK};

    #[inline(always)]
    fn f16_at(b: &[u8], i: usize) -> f32 {
        f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
    }

    /// The 32 weights of one block as four 8-lane vectors.
    #[inline(always)]
    fn dequant(format: Format, b: &[u8]) -> [__m256; 4] {
        // SAFETY: every load reads inside `b`, a whole block (checked by the slice bounds below).
        unsafe {
            match format {
                Format::Q4_0 | Format::Q4_1 => {
                    let d = f16_at(b, 0);
                    let (min, qs) = match format {
                        Format::Q4_1 => (f16_at(b, 2), &b[4..20]),
                        _ => (-8.0 * d, &b[2..18]),
                    };
                    let q = _mm_loadu_si128(qs.as_ptr() as *const __m128i);
                    let mask = _mm_set1_epi8(0x0F);
                    let lo = _mm_and_si128(q, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
                    let (vd, vm) = (_mm256_set1_ps(d), _mm256_set1_ps(min));
                    let f = |v: __m128i| {
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), vd, vm)
                    };
                    [
                        f(lo),
                        f(_mm_srli_si128(lo, 8)),
                        f(hi),
                        f(_mm_srli_si128(hi, 8)),
                    ]
                }
                Format::Q8_0 => {
                    let qs = &b[2..34];
                    let vd = _mm256_set1_ps(f16_at(b, 0));
                    let f = |o: usize| {
                        let v = _mm_loadl_epi64(qs[o..o + 8].as_ptr() as *const __m128i);
                        _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), vd)
                    };
                    [f(0), f(8), f(16), f(24)]
                }
            }
        }
    }

    #[inline(always)]
    fn hsum(v: __m256) -> f32 {
        unsafe {
            let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
            let s = _mm_add_ss(s, _mm_movehdup_ps(s));
            _mm_cvtss_f32(s)
        }
    }

    /// Weight rows `r0..r0 + nr` times activation rows `i0..i0 + G`, into `dst[row * m + i]`.
    /// Four weight rows are walked together: their loads are independent streams, which keeps
    /// enough memory requests in flight for a single decode row to approach bandwidth.
    pub(super) fn rows<const G: usize>(
        w: &QuantMatrix,
        r0: usize,
        nr: usize,
        x: &[f32],
        i0: usize,
        m: usize,
        dst: &mut [f32],
    ) {
        const R: usize = 4;
        let k = w.cols;
        let bb = w.format.block_bytes();
        let rb = w.row_bytes();
        let xs: [&[f32]; G] = std::array::from_fn(|j| &x[(i0 + j) * k..(i0 + j + 1) * k]);
        let mut t = 0;
        while t < nr {
            let rr = (nr - t).min(R);
            let rows: [&[u8]; R] = std::array::from_fn(|q| {
                let r = r0 + t + q.min(rr - 1);
                &w.data[r * rb..(r + 1) * rb]
            });
            // SAFETY: loads read 8 floats at offsets < k within rows of length k (k % 32 == 0).
            unsafe {
                let mut acc = [[_mm256_setzero_ps(); G]; R];
                for blk in 0..k / BLOCK {
                    let o = blk * BLOCK;
                    for q in 0..R {
                        let v = dequant(w.format, &rows[q][blk * bb..(blk + 1) * bb]);
                        for j in 0..G {
                            let p = xs[j][o..o + BLOCK].as_ptr();
                            let s = _mm256_fmadd_ps(
                                v[1],
                                _mm256_loadu_ps(p.add(8)),
                                _mm256_mul_ps(v[0], _mm256_loadu_ps(p)),
                            );
                            let s = _mm256_fmadd_ps(
                                v[3],
                                _mm256_loadu_ps(p.add(24)),
                                _mm256_fmadd_ps(v[2], _mm256_loadu_ps(p.add(16)), s),
                            );
                            acc[q][j] = _mm256_add_ps(acc[q][j], s);
                        }
                    }
                }
                for q in 0..rr {
                    for j in 0..G {
                        dst[(t + q) * m + i0 + j] = hsum(acc[q][j]);
                    }
                }
            }
            t += rr;
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

    use super::{QuantMatrix, BLOCK};

    pub const Q4_0: u8 = 0;
    pub const Q4_1: u8 = 1;
    pub const Q8_0: u8 = 2;

    #[inline(always)]
    unsafe fn f16_at(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            p.cast::<u16>().read_unaligned() as i32,
        )))
    }

    /// The 32 weights of the block at `b` as two 16-lane vectors. The format is a constant so
    /// the inner loop carries no branch on it.
    #[inline(always)]
    unsafe fn dequant<const F: u8>(b: *const u8) -> [__m512; 2] {
        if F == Q8_0 {
            let vd = _mm512_set1_ps(f16_at(b));
            let f = |o: usize| {
                _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(2 + o).cast()))),
                    vd,
                )
            };
            return [f(0), f(16)];
        }
        let d = f16_at(b);
        let (min, qs) = if F == Q4_1 {
            (f16_at(b.add(2)), b.add(4))
        } else {
            (-8.0 * d, b.add(2))
        };
        let q = _mm_loadu_si128(qs.cast());
        let mask = _mm_set1_epi8(0x0F);
        let (vd, vm) = (_mm512_set1_ps(d), _mm512_set1_ps(min));
        let f = |v: __m128i| _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)), vd, vm);
        [
            f(_mm_and_si128(q, mask)),
            f(_mm_and_si128(_mm_srli_epi16(q, 4), mask)),
        ]
    }

    /// Weight rows `r0..r0 + nr` times activation rows `i0..i0 + G`, into `dst[row * m + i]`,
    /// walking R weight rows at a time. The activation rows stay in L1 across the whole tile.
    #[allow(clippy::type_complexity)]
    pub(super) fn rows<const F: u8, const R: usize, const G: usize>(
        (w, r0, nr, x, i0, m, dst): (&QuantMatrix, usize, usize, &[f32], usize, usize, &mut [f32]),
    ) {
        let k = w.cols;
        let bb = w.format.block_bytes();
        let rb = w.row_bytes();
        assert!(x.len() >= (i0 + G) * k && w.data.len() >= (r0 + nr) * rb && dst.len() >= nr * m);
        let xp: [*const f32; G] = std::array::from_fn(|j| x[(i0 + j) * k..].as_ptr());
        let mut t = 0;
        while t < nr {
            let rr = (nr - t).min(R);
            // Past the last row, repeat it: the extra results are computed and dropped.
            let rp: [*const u8; R] =
                std::array::from_fn(|q| w.data[(r0 + t + q.min(rr - 1)) * rb..].as_ptr());
            // SAFETY: the assert above bounds every pointer: blocks < k / 32 of rows < r0 + nr,
            // activation offsets < k of rows < i0 + G.
            unsafe {
                let mut acc = [[_mm512_setzero_ps(); G]; R];
                for blk in 0..k / BLOCK {
                    for q in 0..R {
                        let v = dequant::<F>(rp[q].add(blk * bb));
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    /// candle's quantizer writes the GGML block layout; its dequantizer is the reference.
    #[test]
    fn matches_candle_dequantize_and_float_matmul() {
        let dev = Device::Cpu;
        let (n, k) = (37, 96);
        let w: Vec<f32> = (0..n * k)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 0.2)
            .collect();
        let wt = Tensor::from_vec(w, (n, k), &dev).unwrap();
        for dtype in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0] {
            let q = QTensor::quantize(&wt, dtype).unwrap();
            let deq: Vec<f32> = q
                .dequantize(&dev)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let qm = QuantMatrix::from_qtensor(&q).unwrap();
            let mut row = vec![0f32; k];
            for r in 0..n {
                qm.dequantize_row(r, &mut row);
                assert_eq!(row, deq[r * k..(r + 1) * k], "{dtype:?} row {r}");
            }
            for m in [1, 3, 6, 9, 21, 40] {
                let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 - 6.0).collect();
                let mut out = vec![0f32; m * n];
                qm.matmul(&Team::new(2), &x, m, &mut out);
                for i in 0..m {
                    for r in 0..n {
                        let want: f32 = (0..k).map(|c| x[i * k + c] * deq[r * k + c]).sum();
                        assert!(
                            (out[i * n + r] - want).abs() < 1e-3,
                            "{dtype:?} m={m} ({i},{r})"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn stacking_concatenates_rows() {
        let a = QuantMatrix::new(Format::Q8_0, 1, 32, vec![1; 34]).unwrap();
        let b = QuantMatrix::new(Format::Q8_0, 2, 32, vec![2; 68]).unwrap();
        let s = QuantMatrix::stack(&[a, b]).unwrap();
        assert_eq!((s.rows(), s.cols()), (3, 32));
        let c = QuantMatrix::new(Format::Q4_0, 1, 32, vec![0; 18]).unwrap();
        let d = QuantMatrix::new(Format::Q8_0, 1, 32, vec![0; 34]).unwrap();
        assert!(
            QuantMatrix::stack(&[c, d]).is_none(),
            "mixed formats do not stack"
        );
    }
}
