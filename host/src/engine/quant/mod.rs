//! Matmul over GGML-quantized weights, on our own kernels, for every format GGUF models people
//! download actually use: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the k-quants Q4_K, Q5_K, Q6_K.
//!
//! candle's quantized matmul first rounds the activations to 8 bits (as llama.cpp does). For
//! small models that rounding is enough to flip greedy choices whose logits are close. Here:
//! - 32-element formats (`f32_kernels`): weights are dequantized a block at a time into
//!   registers and multiplied against unrounded f32 activations (~1e-6 of a float reference).
//! - k-quants (`k_kernels`): activations are rounded to 16-bit integers per 256 elements
//!   (error ≤ 1/65534 of the block's largest value, 256× finer than llama.cpp's 8 bits), and
//!   each 32-weight sub-block meets them in one integer multiply-add (`vpdpwssd`), with the
//!   sub-block scales folded into the weights. That halves the instructions per weight
//!   compared with dequantizing to f32, which is what decides decode speed on big models.
//!
//! A matrix may be a stack of segments in different formats (a fused Q/K/V whose V is Q6_K
//! while Q and K are Q4_K, as in most Q4_K_M files): one pass covers all of them, so fusing
//! never forces a dense copy. Segment bytes are usually a window of the memory-mapped GGUF.

/// Calls the kernel `$rows::<F, R, G, P>(args)` for a batch of `$g` (1 to 8) activation rows
/// and the prefetch flag `$p`: R = 4 weight rows walked together for batches up to four, `$rb`
/// for larger ones (R·G accumulators must fit the registers). G and P are constants, so each
/// kernel's loops are unrolled for its batch and carry no trace of prefetching when it is off.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
macro_rules! by_batch {
    ($rows:ident, $f:expr, $rb:literal, $g:expr, $p:expr, $args:expr) => {
        match ($g, $p) {
            (8, true) => $rows::<{ $f }, $rb, 8, true>($args),
            (7, true) => $rows::<{ $f }, $rb, 7, true>($args),
            (6, true) => $rows::<{ $f }, $rb, 6, true>($args),
            (5, true) => $rows::<{ $f }, $rb, 5, true>($args),
            (4, true) => $rows::<{ $f }, 4, 4, true>($args),
            (3, true) => $rows::<{ $f }, 4, 3, true>($args),
            (2, true) => $rows::<{ $f }, 4, 2, true>($args),
            (_, true) => $rows::<{ $f }, 4, 1, true>($args),
            (8, false) => $rows::<{ $f }, $rb, 8, false>($args),
            (7, false) => $rows::<{ $f }, $rb, 7, false>($args),
            (6, false) => $rows::<{ $f }, $rb, 6, false>($args),
            (5, false) => $rows::<{ $f }, $rb, 5, false>($args),
            (4, false) => $rows::<{ $f }, 4, 4, false>($args),
            (3, false) => $rows::<{ $f }, 4, 3, false>($args),
            (2, false) => $rows::<{ $f }, 4, 2, false>($args),
            (_, false) => $rows::<{ $f }, 4, 1, false>($args),
        }
    };
}
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
use by_batch;

mod aligned;
mod blocks;
mod f32_kernels;
mod k_kernels;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};

pub use blocks::{dequantize_block, Format};
use k_kernels::KActs;

use super::team::{split, split_mut, Team};

/// Weight rows per kernel call (a unit of the split across threads).
const TILE: usize = 32;
/// Activation rows sharing one pass over the weights.
const GROUP: usize = 8;

/// Where a segment's bytes live.
pub enum Bytes {
    Owned(Vec<u8>),
    /// A window of a memory-mapped file (the GGUF the model was loaded from).
    Mapped {
        map: Arc<memmap2::Mmap>,
        start: usize,
        len: usize,
    },
}

impl Bytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            Bytes::Owned(v) => v,
            Bytes::Mapped { map, start, len } => &map[*start..*start + *len],
        }
    }
}

/// Rows of one format.
pub(crate) struct Segment {
    format: Format,
    /// First row of this segment in the stacked matrix.
    row0: usize,
    rows: usize,
    cols: usize,
    data: Bytes,
}

impl Segment {
    fn row_bytes(&self) -> usize {
        self.cols / self.format.block_elems() * self.format.block_bytes()
    }

    fn bytes(&self) -> &[u8] {
        self.data.as_slice()
    }

    fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let (rb, bb, be) = (
            self.row_bytes(),
            self.format.block_bytes(),
            self.format.block_elems(),
        );
        let row = &self.bytes()[r * rb..(r + 1) * rb];
        for (b, o) in row.chunks_exact(bb).zip(out.chunks_exact_mut(be)) {
            dequantize_block(self.format, b, o);
        }
    }
}

pub struct QuantMatrix {
    rows: usize,
    cols: usize,
    segments: Vec<Segment>,
}

impl QuantMatrix {
    /// Takes a 2-D `[rows, cols]` tensor in one of the supported formats; `None` otherwise.
    pub fn from_qtensor(t: &QTensor) -> Option<Self> {
        let format = format_of(t.dtype())?;
        let &[rows, cols] = t.shape().dims() else {
            return None;
        };
        let data = t.data().ok()?.into_owned();
        Self::new(format, rows, cols, Bytes::Owned(data))
    }

    /// `None` when the byte length does not match the shape or the rows do not divide into
    /// whole blocks.
    pub fn new(format: Format, rows: usize, cols: usize, data: Bytes) -> Option<Self> {
        let be = format.block_elems();
        let ok = rows > 0
            && cols.is_multiple_of(be)
            && data.as_slice().len() == rows * cols / be * format.block_bytes();
        ok.then(|| Self {
            rows,
            cols,
            segments: vec![Segment {
                format,
                row0: 0,
                rows,
                cols,
                data,
            }],
        })
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The formats of its segments, in row order.
    pub fn formats(&self) -> Vec<Format> {
        self.segments.iter().map(|s| s.format).collect()
    }

    fn segment(&self, r: usize) -> &Segment {
        self.segments
            .iter()
            .find(|s| r < s.row0 + s.rows)
            .expect("row within the matrix")
    }

    /// Dequantizes row `r` into `out` (`cols` long).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let s = self.segment(r);
        s.dequantize_row(r - s.row0, out);
    }

    /// Stacks matrices of the same width into one (e.g. Q, K, V into QKV), whatever their
    /// formats; no bytes are copied.
    pub fn stack(parts: Vec<QuantMatrix>) -> Option<QuantMatrix> {
        let cols = parts.first()?.cols;
        if parts.iter().any(|p| p.cols != cols) {
            return None;
        }
        let mut rows = 0;
        let mut segments = Vec::new();
        for p in parts {
            for mut s in p.segments {
                s.row0 = rows;
                rows += s.rows;
                segments.push(s);
            }
        }
        Some(Self {
            rows,
            cols,
            segments,
        })
    }

    /// `out[m, rows] = x[m, cols] · selfᵀ`.
    ///
    /// Activation rows go in groups of up to eight, one pass over the weights per group: a
    /// group stays in L1 while the weights stream past it (two interleaved groups would evict
    /// each other and fall back to L2 bandwidth).
    pub fn matmul(&self, team: &Team, x: &[f32], m: usize, out: &mut [f32]) {
        let (n, k) = (self.rows, self.cols);
        assert_eq!(x.len(), m * k, "activation shape");
        assert_eq!(out.len(), m * n, "output shape");
        let kacts = self
            .segments
            .iter()
            .any(|s| s.format.is_k())
            .then(|| KActs::new(team, x, m, k));
        let kacts = kacts.as_ref();
        if m == 1 {
            self.pass(team, x, kacts, 0, 1, out, true);
            return;
        }
        // One pass (decode, verification of drafts, small batches) reads each weight once and
        // is bound by memory: prefetch. Several passes (prefill) are bound by arithmetic, and
        // prefetched weights would evict the group's activations from L1 (SmolLM2 prefill
        // fell from 975 to 670 tok/s with prefetching there).
        let prefetch = m <= GROUP;
        // Parts write their outputs transposed ([rows][g]): disjoint contiguous chunks.
        let mut out_t = vec![0f32; n * GROUP.min(m)];
        for i0 in (0..m).step_by(GROUP) {
            let g = (m - i0).min(GROUP);
            self.pass(
                team,
                &x[i0 * k..(i0 + g) * k],
                kacts,
                i0,
                g,
                &mut out_t[..n * g],
                prefetch,
            );
            for (r, col) in out_t[..n * g].chunks_exact(g).enumerate() {
                for (i, &v) in col.iter().enumerate() {
                    out[(i0 + i) * n + r] = v;
                }
            }
        }
    }

    /// One pass over all weight rows for the `g` activation rows `x` (rows `i0..` of the
    /// k-quant activations) into `dst[row][g]`.
    ///
    /// With prefetching (one pass: decode, small batches, bound by memory) each thread streams
    /// its own contiguous half of the rows, which the prefetch distance assumes. Without
    /// (prefill, bound by arithmetic) threads take tiles from a shared counter: a pass is a few
    /// milliseconds, and a vCPU that the host slows down no longer holds the other one
    /// spinning at the end of each (15% of prefill time with an even split).
    #[allow(clippy::too_many_arguments)]
    fn pass(
        &self,
        team: &Team,
        x: &[f32],
        kacts: Option<&KActs>,
        i0: usize,
        g: usize,
        dst: &mut [f32],
        prefetch: bool,
    ) {
        let n = self.rows;
        let tile = |r0: usize, end: usize, dst: &mut [f32]| {
            let mut r = r0;
            // A tile may straddle segments: each piece goes to its own format's kernel.
            while r < end {
                let s = self.segment(r);
                let e = end.min(s.row0 + s.rows);
                let d = &mut dst[(r - r0) * g..(e - r0) * g];
                match (s.format.is_k(), kacts) {
                    (true, Some(a)) => k_kernels::tile(s, r - s.row0, e - r, a, i0, g, d, prefetch),
                    _ => f32_kernels::tile(s, r - s.row0, e - r, x, g, d, prefetch),
                }
                r = e;
            }
        };
        if prefetch {
            let parts = team.threads();
            let ranges: Vec<_> = (0..parts).map(|p| split(n, TILE, p, parts)).collect();
            let slices = split_mut(dst, ranges.iter().map(|r| r.len() * g));
            team.run(&|p, _| {
                let mut dst = slices[p].lock().unwrap_or_else(|e| e.into_inner());
                let range = ranges[p].clone();
                for r0 in range.clone().step_by(TILE) {
                    let end = range.end.min(r0 + TILE);
                    let o = (r0 - range.start) * g;
                    tile(r0, end, &mut dst[o..o + (end - r0) * g]);
                }
            });
        } else {
            let tiles = n.div_ceil(TILE);
            let slices = split_mut(dst, (0..tiles).map(|t| (n - t * TILE).min(TILE) * g));
            let next = AtomicUsize::new(0);
            team.run(&|_, _| loop {
                let t = next.fetch_add(1, Ordering::Relaxed);
                let Some(slice) = slices.get(t) else { break };
                let mut dst = slice.lock().unwrap_or_else(|e| e.into_inner());
                tile(t * TILE, n.min(t * TILE + TILE), &mut dst);
            });
        }
    }
}

/// Our format for a GGML type, if we multiply it natively.
pub fn format_of(dtype: GgmlDType) -> Option<Format> {
    Some(match dtype {
        GgmlDType::Q4_0 => Format::Q4_0,
        GgmlDType::Q4_1 => Format::Q4_1,
        GgmlDType::Q5_0 => Format::Q5_0,
        GgmlDType::Q5_1 => Format::Q5_1,
        GgmlDType::Q8_0 => Format::Q8_0,
        GgmlDType::Q4K => Format::Q4K,
        GgmlDType::Q5K => Format::Q5K,
        GgmlDType::Q6K => Format::Q6K,
        _ => return None,
    })
}

#[cfg(test)]
mod tests;
