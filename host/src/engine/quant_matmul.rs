//! Matmul over GGML-quantized weights (Q4_0, Q4_1, Q8_0) with f32 activations.
//!
//! candle's quantized matmul first quantizes the activations to 8 bits (as llama.cpp does). For
//! small models that rounding is enough to flip greedy choices whose logits are close, and
//! candle has no SIMD path for Q4_1 at all. Here weights are dequantized a tile of rows at a
//! time into L1-resident f32 and multiplied against unrounded activations: the result matches a
//! float reference to ~1e-5, every row of a batch reuses the dequantized tile, and the loops
//! vectorise. Other quantization types fall back to candle's `QMatMul`.

use candle_core::quantized::{GgmlDType, QTensor};
use half::f16;
use rayon::prelude::*;

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
/// Weight rows dequantized together: 8 rows of a few thousand columns stay in L1/L2.
const TILE: usize = 8;

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
        (cols.is_multiple_of(BLOCK) && data.len() == rows * cols / BLOCK * format.block_bytes()).then_some(
            Self {
                format,
                rows,
                cols,
                data,
            },
        )
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn format(&self) -> Format {
        self.format
    }

    pub fn raw(&self) -> &[u8] {
        &self.data
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
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        let (n, k) = (self.rows, self.cols);
        assert_eq!(x.len(), m * k, "activation shape");
        assert_eq!(out.len(), m * n, "output shape");
        // Each task owns TILE weight rows and writes their outputs for all m activation rows,
        // transposed ([rows, m]) so that tasks write disjoint contiguous chunks.
        let mut out_t = if m == 1 {
            Vec::new()
        } else {
            vec![0f32; n * m]
        };
        let target: &mut [f32] = if m == 1 { out } else { &mut out_t };
        target.par_chunks_mut(TILE * m).enumerate().for_each_init(
            || vec![0f32; TILE * k],
            |buf, (tile, dst)| {
                let r0 = tile * TILE;
                let nr = (n - r0).min(TILE);
                for t in 0..nr {
                    self.dequantize_row(r0 + t, &mut buf[t * k..(t + 1) * k]);
                }
                for i in 0..m {
                    let xr = &x[i * k..(i + 1) * k];
                    for t in 0..nr {
                        dst[t * m + i] = dot(&buf[t * k..(t + 1) * k], xr);
                    }
                }
            },
        );
        if m > 1 {
            for (r, col) in out_t.chunks_exact(m).enumerate() {
                for (i, &v) in col.iter().enumerate() {
                    out[i * n + r] = v;
                }
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
            for m in [1, 3, 9] {
                let x: Vec<f32> = (0..m * k).map(|i| (i % 13) as f32 - 6.0).collect();
                let mut out = vec![0f32; m * n];
                qm.matmul(&x, m, &mut out);
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
