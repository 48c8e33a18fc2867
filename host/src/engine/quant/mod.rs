//! Matmul over GGML-quantized weights, on our own kernels, for every format GGUF models people
//! download actually use: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the k-quants Q4_K, Q5_K, Q6_K.
//!
//! candle's quantized matmul first rounds the activations to 8 bits (as llama.cpp does). For
//! small models that rounding is enough to flip greedy choices whose logits are close. Here:
//! - 32-element formats (`f32_kernels`): weights are dequantized a block at a time into
//!   registers and multiplied against unrounded f32 activations (~1e-6 of a float reference).
//!   Prompt rows on AVX-512 round them to 16 bits per 32 elements instead (`lanes::q32`), or
//!   take BF16 AMX tiles (`tiles`); generated rows of Q4_0, Q5_0, Q8_0 and Q4_1 on AVX-512
//!   meet 16-bit activations per 256 elements in integer multiply-adds (`q32_batch`, and
//!   `q4_1_batch` with weight rows across the lanes).
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
/// and the prefetch flag `$p`, walking R = `$r(G, P)` weight rows together (`$r` a const fn;
/// R·G accumulators must fit the registers). R, G and P are constants, so each kernel's loops
/// are unrolled for its batch and carry no trace of prefetching when it is off.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
macro_rules! by_batch {
    ($rows:ident, $f:expr, $r:path, $g:expr, $p:expr, $args:expr) => {
        match ($g, $p) {
            (8, true) => $rows::<{ $f }, { $r(8, true) }, 8, true>($args),
            (7, true) => $rows::<{ $f }, { $r(7, true) }, 7, true>($args),
            (6, true) => $rows::<{ $f }, { $r(6, true) }, 6, true>($args),
            (5, true) => $rows::<{ $f }, { $r(5, true) }, 5, true>($args),
            (4, true) => $rows::<{ $f }, { $r(4, true) }, 4, true>($args),
            (3, true) => $rows::<{ $f }, { $r(3, true) }, 3, true>($args),
            (2, true) => $rows::<{ $f }, { $r(2, true) }, 2, true>($args),
            (_, true) => $rows::<{ $f }, { $r(1, true) }, 1, true>($args),
            (8, false) => $rows::<{ $f }, { $r(8, false) }, 8, false>($args),
            (7, false) => $rows::<{ $f }, { $r(7, false) }, 7, false>($args),
            (6, false) => $rows::<{ $f }, { $r(6, false) }, 6, false>($args),
            (5, false) => $rows::<{ $f }, { $r(5, false) }, 5, false>($args),
            (4, false) => $rows::<{ $f }, { $r(4, false) }, 4, false>($args),
            (3, false) => $rows::<{ $f }, { $r(3, false) }, 3, false>($args),
            (2, false) => $rows::<{ $f }, { $r(2, false) }, 2, false>($args),
            (_, false) => $rows::<{ $f }, { $r(1, false) }, 1, false>($args),
        }
    };
}
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
use by_batch;

/// Calls the span kernel `$kernel::<F, G>($n, $args)` for a group of `$g` (1 to 8) activation
/// rows; G is a constant, so each instance's loops are unrolled for its group.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
macro_rules! by_group {
    ($kernel:ident, $f:expr, $g:expr, $n:expr, $args:expr) => {
        match $g {
            8 => $kernel::<{ $f }, 8>($n, $args),
            7 => $kernel::<{ $f }, 7>($n, $args),
            6 => $kernel::<{ $f }, 6>($n, $args),
            5 => $kernel::<{ $f }, 5>($n, $args),
            4 => $kernel::<{ $f }, 4>($n, $args),
            3 => $kernel::<{ $f }, 3>($n, $args),
            2 => $kernel::<{ $f }, 2>($n, $args),
            _ => $kernel::<{ $f }, 1>($n, $args),
        }
    };
}
#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
use by_group;

mod acts;
mod aligned;
pub mod amx;
mod blocks;
mod f32_kernels;
mod k_kernels;
#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
mod lanes;
#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
mod prompt;
#[cfg(not(all(target_arch = "x86_64", target_feature = "avx512bw")))]
mod prompt_bytes;
/// The 32-element formats on AVX2 (also built for tests everywhere it compiles, so this machine
/// checks it against the float reference).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    any(test, not(target_feature = "avx512bw"))
))]
mod q32_avx2;
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx512bw",
    target_feature = "avx512vl"
))]
mod q32_batch;
/// The 32-element formats on AVX2 against 8-bit activations (built as `q32_avx2` is).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    any(test, not(target_feature = "avx512bw"))
))]
mod q32_bytes;
/// Prompt rows of the 32-element formats on AVX2 (built as `q32_avx2` is).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    any(test, not(target_feature = "avx512bw"))
))]
mod q32_prompt;
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx512bw",
    target_feature = "avx512vl"
))]
mod q4_1_batch;
mod rounding;
mod step_rows;
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx512bf16",
    target_os = "linux"
))]
mod tiles;
mod untranspose;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QTensor};

pub use crate::config::PromptPrecision;
use acts::{Acts, Beside};
pub use blocks::{dequantize_block, Format};
pub use rounding::{ActivationBits, Rounding};

/// Frees the calling thread's kernel buffers kept from call to call: the outputs waiting to be
/// untransposed, and the prompt kernels' widened, packed or dequantized tiles (per thread, up
/// to 32 rows of the widest matrix each). An engine idle a while runs it on every thread of
/// its team.
pub fn release_thread_buffers() {
    untranspose::release_transposed();
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        any(test, not(target_feature = "avx512bw"))
    ))]
    q32_prompt::release();
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
    lanes::release();
    k_kernels::release();
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx512bf16",
        target_os = "linux"
    ))]
    tiles::release();
}
use untranspose::{untranspose, with_transposed};

use super::team::{split, split_mut, Shares, Team};

/// Weight rows per kernel call (a unit of the split across threads).
const TILE: usize = 32;
/// Activation rows sharing one pass over the weights.
const GROUP: usize = 8;
/// Prompts shorter than this count their rows as generated ones (the batch kernels): packing
/// a tile for a handful of rows costs more than the prompt kernels save (Qwen2.5, a 7-token
/// prompt: 99 ms to the first token on the batch kernels, 234 ms packed). A prompt's length,
/// unlike a step's count of prompt rows, does not depend on the traffic.
pub const PROMPT_KERNEL_MIN: usize = GROUP;
/// Groups per team run in prefill: a 32-row weight tile serves all of them from L2 (for
/// the widest Qwen2.5 1.5B matrix 161 KiB of weights and 573 KiB of activations).
const SPAN: usize = 4;
/// Groups per team run for prompt rows: the lanes kernel packs a tile once per span, and
/// packing cost 28% of Qwen2.5 prefill at four groups, 9% at sixteen; 512-token prefill then
/// went from 91.3 to 95.5 tok/s at thirty-two (medians of six alternating rounds). The span's
/// activations (4.6 MiB for an 8960-wide matrix) come from L3, which the kernel's broadcast
/// reads keep up with.
const PROMPT_SPAN: usize = 32;
/// Activation rows of a prompt span.
pub const PROMPT_SPAN_ROWS: usize = GROUP * PROMPT_SPAN;

/// How a kernel call meets the weights.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Walk {
    /// Each weight read once, from memory: prefetched ahead (decode, small batches).
    Stream,
    /// Prefill span `n`: each tile of weight rows meets every group of the span in turn, from
    /// L2. Spans are numbered once per process, so a kernel may keep what it derived from a
    /// tile for the span's next group.
    #[cfg_attr(
        not(all(target_arch = "x86_64", target_feature = "avx512bw")),
        allow(dead_code) // only the AVX-512 kernel keeps unpacked tiles
    )]
    Span(u64),
    /// A prefill span of prompt rows: on AVX-512 weight rows go across the lanes (`lanes`), on
    /// AVX2 activation rows do (`q32_prompt`), whose sums round differently from the other
    /// kernels'.
    #[cfg_attr(
        not(all(
            target_arch = "x86_64",
            any(
                target_feature = "avx512bw",
                all(target_feature = "avx2", target_feature = "fma")
            )
        )),
        allow(dead_code) // only these have prompt kernels
    )]
    Prompt(u64),
}

/// The next prefill span's number.
static SPANS: AtomicU64 = AtomicU64::new(0);

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

    /// Weight rows `rows` split where segments meet: (segment, first row within it, rows,
    /// offset of the piece within `rows`).
    fn pieces(
        &self,
        rows: std::ops::Range<usize>,
    ) -> impl Iterator<Item = (&Segment, usize, usize, usize)> {
        let mut r = rows.start;
        std::iter::from_fn(move || {
            (r < rows.end).then(|| {
                let s = self.segment(r);
                let e = rows.end.min(s.row0 + s.rows);
                let piece = (s, r - s.row0, e - r, r - rows.start);
                r = e;
                piece
            })
        })
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
    /// Activation rows go in groups of up to eight: a group stays in L1 while the weights
    /// stream past it (two interleaved groups would evict each other and fall back to L2
    /// bandwidth).
    pub fn matmul(&self, team: &Team, x: &[f32], m: usize, out: &mut [f32]) {
        self.batch(team, x, m, ActivationBits::Sixteen, out)
    }

    /// `matmul` with the k-quant activations rounded to `bits`.
    fn batch(&self, team: &Team, x: &[f32], m: usize, bits: ActivationBits, out: &mut [f32]) {
        let acts = self.batch_acts(team, x, m, bits);
        self.batch_with(team, &Beside { x, m, acts }, out);
    }

    /// `batch` on prepared rows.
    fn batch_with(&self, team: &Team, rows: &Beside, out: &mut [f32]) {
        let (n, x, m, acts) = (self.rows, rows.x, rows.m, &rows.acts);
        assert_eq!(out.len(), m * n, "output shape");
        if m == 0 {
            return;
        }
        if m == 1 {
            self.pass(team, x, acts, 1, out);
            return;
        }
        if m <= GROUP {
            // Parts write their outputs transposed ([rows][m]): disjoint contiguous chunks.
            return with_transposed(n * m, |out_t| {
                self.pass(team, x, acts, m, out_t);
                untranspose(out_t, (0, m), 0, n, out);
            });
        }
        self.prefill(team, x, acts, m, out, false);
    }

    /// `matmul` where `prompt[i]` marks the rows of prompt tokens. On AVX-512 those rows go
    /// through the prompt kernels (weight rows across the lanes against 16-bit activations:
    /// `lanes`, 1.2–2x the GMAC/s), whose results differ from the batch kernels' in the last
    /// bits; generated rows (decode, drafts) take the batch kernels. Each kind always takes its
    /// own kernels, however many rows of it a step has, so every row gives the same bits
    /// whatever runs beside it: a seeded request samples the same tokens whether its prompt
    /// was prefilled alone, beside other prompts or in chunks. (Prompt rows took the batch
    /// kernels below eight to a step, which made a seed's output depend on the traffic.)
    /// `rounding`: how the batch kernels round activations for k-quant weights, and whether
    /// prompt rows may take BF16 AMX tiles (`tiles`; also batch-invariant).
    pub fn matmul_rows(
        &self,
        team: &Team,
        x: &[f32],
        prompt: &[bool],
        rounding: impl Into<Rounding>,
        out: &mut [f32],
    ) {
        let rounding = rounding.into();
        #[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
        if prompt.contains(&true) {
            return self.prompt_rows(team, x, prompt, rounding, out);
        }
        #[cfg(not(all(target_arch = "x86_64", target_feature = "avx512bw")))]
        if self.splits_prompt_rows(prompt, rounding) {
            let kinds = (rounding.prompt, rounding.decode);
            return self.prompt_rows_bytes(team, x, prompt, kinds, out);
        }
        self.batch(team, x, prompt.len(), rounding.decode, out)
    }

    /// One pass over all weight rows for the `g` (≤ GROUP) activation rows `x`, into
    /// `dst[row][g]`. It reads each weight once and is bound by memory (decode, verification
    /// of drafts, small batches): weights are prefetched, and each thread streams its own
    /// contiguous share of the tiles in address order, which the prefetch distance assumes,
    /// then helps with the others' from their ends.
    fn pass(&self, team: &Team, x: &[f32], acts: &Acts, g: usize, dst: &mut [f32]) {
        let n = self.rows;
        let tiles = n.div_ceil(TILE);
        let shares = Shares::new(tiles, team.threads());
        let regions = split_mut(dst, (0..tiles).map(|t| (n - t * TILE).min(TILE) * g));
        team.run(&|p, _| {
            while let Some(t) = shares.next(p) {
                let mut d = regions[t].lock().unwrap_or_else(|e| e.into_inner());
                let rows = t * TILE..n.min((t + 1) * TILE);
                self.tile(x, acts, (0, g), rows, &mut d, Walk::Stream);
            }
        });
    }

    /// Prefill, bound by arithmetic: SPAN groups per team run (PROMPT_SPAN for `prompt`
    /// rows). Threads take 32-row weight tiles from a shared counter (a vCPU the host slows no longer holds the other spinning
    /// at the end of each run) and run every group of the span over a tile while its weights
    /// are still in L2. Nothing is prefetched: prefetched weights would evict the group's
    /// activations from L1 (SmolLM2 prefill fell from 975 to 670 tok/s with prefetching).
    fn prefill(
        &self,
        team: &Team,
        x: &[f32],
        acts: &Acts,
        m: usize,
        out: &mut [f32],
        prompt: bool,
    ) {
        let (n, k) = (self.rows, self.cols);
        let per_span = if prompt { PROMPT_SPAN } else { SPAN };
        let tiles: Vec<_> = (0..n)
            .step_by(TILE)
            .map(|r0| r0..n.min(r0 + TILE))
            .collect();
        with_transposed(n * m.min(GROUP * per_span), |out_t| {
            for p0 in (0..m).step_by(GROUP * per_span) {
                let rows = (m - p0).min(GROUP * per_span);
                let groups: Vec<_> = (p0..p0 + rows)
                    .step_by(GROUP)
                    .map(|i0| (i0, (p0 + rows - i0).min(GROUP)))
                    .collect();
                // Tile t's outputs, group after group, each `[tile rows][g]`: disjoint
                // contiguous chunks, in tile order.
                let regions = split_mut(&mut *out_t, tiles.iter().map(|t| t.len() * rows));
                let next = AtomicUsize::new(0);
                let number = SPANS.fetch_add(1, Ordering::Relaxed);
                let span = if prompt {
                    Walk::Prompt(number)
                } else {
                    Walk::Span(number)
                };
                team.run(&|_, _| loop {
                    let t = next.fetch_add(1, Ordering::Relaxed);
                    let Some(region) = regions.get(t) else { break };
                    let mut dst = region.lock().unwrap_or_else(|e| e.into_inner());
                    let len = tiles[t].len();
                    for &(i0, g) in &groups {
                        let o = (i0 - p0) * len;
                        let xg = &x[i0 * k..(i0 + g) * k];
                        self.tile(
                            xg,
                            acts,
                            (i0, g),
                            tiles[t].clone(),
                            &mut dst[o..o + g * len],
                            span,
                        );
                    }
                });
                drop(regions);
                gather(team, out_t, &tiles, rows, &mut out[p0 * n..(p0 + rows) * n]);
            }
        });
    }

    /// Weight rows `rows` times the group `x` (activation rows `i0..i0 + g` of the prepared
    /// activations), into `dst[row][g]`. A tile may straddle segments: each piece goes to its
    /// own format's kernel.
    #[allow(clippy::too_many_arguments)]
    fn tile(
        &self,
        x: &[f32],
        acts: &Acts,
        (i0, g): (usize, usize),
        rows: std::ops::Range<usize>,
        dst: &mut [f32],
        walk: Walk,
    ) {
        for (s, r0, nr, at) in self.pieces(rows) {
            let d = &mut dst[at * g..(at + nr) * g];
            if s.format.is_k() {
                let a = acts.k.as_ref().expect("k-quant activations");
                k_kernels::tile(s, r0, nr, a, i0, g, d, walk);
                continue;
            }
            #[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
            if let (Walk::Prompt(span), Some(a)) = (walk, &acts.q32) {
                lanes::q32::tile(s, (r0, nr), a, (i0, g), d, span);
                continue;
            }
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx512bw",
                target_feature = "avx512vl"
            ))]
            if let (true, Some(a)) = (q32_batch::takes(s.format), &acts.q16) {
                q32_batch::tile(s, (r0, nr), a, (i0, g), d, walk == Walk::Stream);
                continue;
            }
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx512bw",
                target_feature = "avx512vl"
            ))]
            if let (Format::Q4_1, Some(a)) = (s.format, &acts.q16) {
                q4_1_batch::tile(s, (r0, nr), a, (i0, g), d, walk == Walk::Stream);
                continue;
            }
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx2",
                target_feature = "fma",
                not(target_feature = "avx512bw")
            ))]
            if let (Some(a), true) = (&acts.p32, q32_prompt::takes(s.format)) {
                let span = match walk {
                    Walk::Stream => None,
                    Walk::Span(n) | Walk::Prompt(n) => Some(n),
                };
                q32_prompt::tile(s, (r0, nr), a, (i0, g), d, span);
                continue;
            }
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx2",
                target_feature = "fma",
                not(target_feature = "avx512bw")
            ))]
            if let (Some(a), true) = (&acts.b32, acts.bits.q32_bytes(s.format)) {
                q32_bytes::tile(s, (r0, nr), a, (i0, g), d, walk == Walk::Stream);
                continue;
            }
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx2",
                target_feature = "fma",
                not(target_feature = "avx512bw")
            ))]
            if let Some(a) = &acts.r32 {
                q32_avx2::tile(s, (r0, nr), a, (i0, g), d, walk == Walk::Stream);
                continue;
            }
            f32_kernels::tile(s, r0, nr, x, g, d, walk == Walk::Stream);
        }
    }
}

/// Writes a prefill span's results (tile after tile, group after group, each `[tile
/// rows][g]`) into its `rows` rows of the output (`[rows][n]`), split across the team (one
/// thread doing it alone left the other waiting).
fn gather(
    team: &Team,
    out_t: &[f32],
    tiles: &[std::ops::Range<usize>],
    rows: usize,
    out: &mut [f32],
) {
    let n = out.len() / rows;
    // Whole groups per thread: each group's block of a tile is read once, in order, and
    // written to its rows (reading one output row at a time across every tile strided through
    // the blocks and measured slower than the single thread it replaced).
    let parts = team.threads().min(rows.div_ceil(GROUP));
    let ranges: Vec<_> = (0..parts).map(|p| split(rows, GROUP, p, parts)).collect();
    let slices = split_mut(out, ranges.iter().map(|r| r.len() * n));
    team.run(&|p, _| {
        let Some(range) = ranges.get(p) else { return };
        let mut dst = slices[p].lock().unwrap_or_else(|e| e.into_inner());
        for i0 in range.clone().step_by(GROUP) {
            let g = (rows - i0).min(GROUP);
            let mut region = 0;
            for tile in tiles {
                let block = &out_t[region + i0 * tile.len()..][..g * tile.len()];
                untranspose(block, (i0 - range.start, g), tile.start, n, &mut dst);
                region += tile.len() * rows;
            }
        }
    });
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
