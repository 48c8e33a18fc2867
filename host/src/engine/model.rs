//! The llama-family decoder (Llama, SmolLM, Mistral, Qwen2 with qkv bias) over a flat batch of
//! tokens from many sequences ("varlen"): every projection runs once over all rows of the step,
//! and attention reads each sequence's K/V through its block table.
//!
//! Matmuls of GGUF weights go through our kernels (`quant`), other types and dense tensors
//! through candle; the cheap elementwise work (RMSNorm, RoPE, SiLU, residuals) runs in plain
//! Rust on the rows, which avoids one candle op and allocation per step for each of them.

pub use super::batch::BatchSeq;
use std::sync::Arc;
use std::time::Instant;

use candle_core::quantized::{QMatMul, QTensor};
use candle_core::{Device, Tensor};

use super::cpu_ops::{geglu, rms_norm, rms_norm_in_place, swiglu};
use super::profile::{Phase, StepProfile};
use super::quant::{
    ActivationBits, PromptPrecision, QuantMatrix, Rounding, PROMPT_KERNEL_MIN, PROMPT_SPAN_ROWS,
};
use super::team::Team;

use super::paged_attention::{AttnSeq, KvCache};
use super::ModelError;

/// The most bytes of gate/up output one slice of a step's feed-forward block may take
/// (`Model::ffn_block`): under glibc's largest mmap threshold (32 MiB), so the buffer is reused
/// from the heap instead of mapped afresh in every layer.
const FFN_SLICE_BYTES: usize = 24 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeStyle {
    /// Rotates pairs (2i, 2i+1): llama.cpp permutes llama Q/K weights into this order in GGUF.
    Interleaved,
    /// Rotates (i, i + d/2): HF checkpoints and GGUF Qwen2.
    Neox,
}

#[derive(Debug, Clone)]
pub struct ModelShape {
    pub vocab_size: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_eps: f32,
    pub rope_theta: f32,
    pub rope_style: RopeStyle,
    pub context_length: usize,
    /// Gemma 3's differences from the llama family; `None` for llama-family models.
    pub gemma: Option<GemmaShape>,
}

/// What Gemma 3 adds to the llama-family decoder: embeddings scaled by √hidden, GeGLU (tanh
/// GELU) instead of SwiGLU, RMSNorm on each head's Q and K and after attention and the FFN,
/// and local layers that attend to a sliding window with their own RoPE base, interleaved
/// with global ones.
#[derive(Debug, Clone)]
pub struct GemmaShape {
    /// A local layer's query at position p sees keys at positions > p − `sliding_window`.
    pub sliding_window: usize,
    /// Layer i is global when (i + 1) is a multiple of this; the others are local.
    pub global_every: usize,
    /// RoPE base of the local layers (global layers use `rope_theta`).
    pub local_rope_theta: f32,
    /// Linear RoPE scaling of the global layers (positions divided by it; 1 = none).
    pub global_rope_scale: f32,
    /// `logits = cap · tanh(logits / cap)` when set.
    pub final_softcap: Option<f32>,
}

impl ModelShape {
    /// The attention window of layer `li` (`None`: the whole context).
    pub fn window(&self, li: usize) -> Option<usize> {
        let g = self.gemma.as_ref()?;
        (!(li + 1).is_multiple_of(g.global_every)).then_some(g.sliding_window)
    }
}

pub enum Linear {
    /// GGML-quantized weights our own kernels multiply (`quant`: Q4_0…Q8_0, Q4_K, Q5_K, Q6_K),
    /// possibly a stack of segments in different formats.
    Native(Arc<QuantMatrix>),
    /// Other GGML types (Q2_K, Q3_K, IQ*, F16), through candle.
    Quantized(QMatMul),
    /// Weight `[out, in]`.
    Dense(Tensor),
}

impl Linear {
    /// `x` is `[rows, in]` row-major, `prompt[i]` whether row `i` is a prompt token's (see
    /// `QuantMatrix::matmul_rows`); returns `[rows, out]`.
    fn forward(
        &self,
        (team, rounding): (&Team, Rounding),
        x: &[f32],
        prompt: &[bool],
        dev: &Device,
    ) -> Result<Vec<f32>, ModelError> {
        let rows = prompt.len();
        if let Linear::Native(w) = self {
            let mut out = vec![0f32; rows * w.rows()];
            w.matmul_rows(team, x, prompt, rounding, &mut out);
            return Ok(out);
        }
        let xt = Tensor::from_slice(x, (rows, x.len() / rows), dev)?;
        let y = match self {
            Linear::Quantized(m) => xt.apply(m)?,
            Linear::Native(_) => unreachable!("handled above"),
            Linear::Dense(w) => xt.matmul(&w.t()?)?,
        };
        Ok(y.flatten_all()?.to_vec1()?)
    }

    /// The weight dequantized, `[out][in]` row-major, with its shape (for the GPU path, which
    /// multiplies dense matrices).
    pub fn to_f32(&self) -> Result<(usize, usize, Vec<f32>), ModelError> {
        match self {
            Linear::Native(m) => Ok(dequantize_all(m)),
            Linear::Quantized(QMatMul::QTensor(t)) => dense_f32(&t.dequantize(&Device::Cpu)?),
            Linear::Quantized(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) | Linear::Dense(t) => {
                dense_f32(t)
            }
        }
    }
}

fn dequantize_all(m: &QuantMatrix) -> (usize, usize, Vec<f32>) {
    let (rows, cols) = (m.rows(), m.cols());
    let mut out = vec![0f32; rows * cols];
    for (r, o) in out.chunks_mut(cols).enumerate() {
        m.dequantize_row(r, o);
    }
    (rows, cols, out)
}

fn dense_f32(t: &Tensor) -> Result<(usize, usize, Vec<f32>), ModelError> {
    let (rows, cols) = t.dims2()?;
    let v = t
        .to_dtype(candle_core::DType::F32)?
        .flatten_all()?
        .to_vec1()?;
    Ok((rows, cols, v))
}

pub enum Embedding {
    /// Shared with a tied output projection.
    Native(Arc<QuantMatrix>),
    Quantized(QTensor),
    Dense(Tensor),
}

impl Embedding {
    /// The table dequantized, `[vocab][hidden]`, with its shape.
    pub fn to_f32(&self) -> Result<(usize, usize, Vec<f32>), ModelError> {
        match self {
            Embedding::Native(m) => Ok(dequantize_all(m)),
            Embedding::Quantized(t) => dense_f32(&t.dequantize(&Device::Cpu)?),
            Embedding::Dense(t) => dense_f32(t),
        }
    }

    /// Whether `head` is this table (tied embeddings), so a copy can be shared.
    pub fn is_tied_to(&self, head: &Linear) -> bool {
        match (self, head) {
            (Embedding::Native(e), Linear::Native(h)) => Arc::ptr_eq(e, h),
            (Embedding::Dense(e), Linear::Dense(h)) => e.id() == h.id(),
            _ => false,
        }
    }
}

pub struct Layer {
    pub attn_norm: Vec<f32>,
    /// Q, K and V projections fused into one `[q + 2 kv, hidden]` weight.
    pub qkv: Linear,
    pub qkv_bias: Option<Vec<f32>>,
    pub o: Linear,
    pub ffn_norm: Vec<f32>,
    /// Gate and up projections fused into one `[2 intermediate, hidden]` weight.
    pub gate_up: Linear,
    pub down: Linear,
    /// Gemma 3's extra norms.
    pub gemma: Option<GemmaNorms>,
}

pub struct GemmaNorms {
    /// Per-head RMSNorm weights, `head_dim` long.
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    /// Applied to the attention output and to the FFN output before each residual add.
    pub post_attn: Vec<f32>,
    pub post_ffn: Vec<f32>,
}

pub struct Model {
    pub shape: ModelShape,
    pub embed: Embedding,
    pub layers: Vec<Layer>,
    pub norm: Vec<f32>,
    pub lm_head: Linear,
    pub device: Device,
    rope_cos: Vec<f32>,
    rope_sin: Vec<f32>,
    /// Gemma 3's local-layer RoPE tables (`local_rope_theta`).
    rope_local: Option<(Vec<f32>, Vec<f32>)>,
    /// Threads that run this model's kernels.
    team: Team,
    /// How the kernels round activations for k-quant weights.
    rounding: Rounding,
    /// Where this model's steps spend their time (shared with the engine that runs it).
    profile: Arc<StepProfile>,
}

impl Model {
    pub fn new(
        shape: ModelShape,
        embed: Embedding,
        layers: Vec<Layer>,
        norm: Vec<f32>,
        lm_head: Linear,
        device: Device,
    ) -> Self {
        let scale = shape.gemma.as_ref().map_or(1.0, |g| g.global_rope_scale);
        let (rope_cos, rope_sin) = rope_table(&shape, shape.rope_theta, scale);
        let rope_local = shape
            .gemma
            .as_ref()
            .map(|g| rope_table(&shape, g.local_rope_theta, 1.0));
        Self {
            shape,
            embed,
            layers,
            norm,
            lm_head,
            device,
            rope_cos,
            rope_sin,
            rope_local,
            team: Team::new(0),
            rounding: Rounding::default(),
            profile: Arc::default(),
        }
    }

    /// RoPE cos and sin, `[position][head_dim / 2]`.
    pub fn rope_tables(&self) -> (&[f32], &[f32]) {
        (&self.rope_cos, &self.rope_sin)
    }

    /// This model with every projection dequantized to dense f32 and multiplied in f32 (the
    /// embedding table is a lookup of dequantized rows either way): the full-precision
    /// reference its kernels are measured against.
    pub fn into_dense_f32(mut self) -> Result<Self, ModelError> {
        let dense = |l: &Linear| -> Result<Linear, ModelError> {
            let (rows, cols, w) = l.to_f32()?;
            Ok(Linear::Dense(Tensor::from_vec(
                w,
                (rows, cols),
                &Device::Cpu,
            )?))
        };
        for layer in &mut self.layers {
            layer.qkv = dense(&layer.qkv)?;
            layer.o = dense(&layer.o)?;
            layer.gate_up = dense(&layer.gate_up)?;
            layer.down = dense(&layer.down)?;
        }
        self.lm_head = dense(&self.lm_head)?;
        Ok(self)
    }

    /// Compute threads for this model's kernels (0 = one per core).
    pub fn set_threads(&mut self, threads: usize) {
        self.team = Team::new(threads);
    }

    /// How the batch kernels (decode, drafts, small batches) round activations for k-quant
    /// weights (`engine.decode_activation_bits`).
    pub fn set_activation_bits(&mut self, bits: ActivationBits) {
        self.rounding.decode = bits;
    }

    /// How prompt rows meet k-quant weights (`engine.prompt_precision`).
    pub fn set_prompt_precision(&mut self, precision: PromptPrecision) {
        self.rounding.prompt = precision;
    }

    /// Where this model's forward passes count their time.
    pub fn set_profile(&mut self, profile: Arc<StepProfile>) {
        self.profile = profile;
    }

    /// `layer`'s projection `w` of `x`, timed.
    fn project(&self, w: &Linear, x: &[f32], prompt: &[bool]) -> Result<Vec<f32>, ModelError> {
        self.profile.time(Phase::Projections, || {
            w.forward(self.kernels(), x, prompt, &self.device)
        })
    }

    /// What every projection runs with.
    fn kernels(&self) -> (&Team, Rounding) {
        (&self.team, self.rounding)
    }

    /// Runs one step. Writes every row's K/V into `cache` and returns one logits row per
    /// sequence with `want_logits`, in order.
    pub fn forward(
        &self,
        seqs: &[BatchSeq],
        cache: &mut KvCache,
    ) -> Result<Vec<Vec<f32>>, ModelError> {
        let step = Step::new(seqs, cache.block_size());
        let mut x = self.embed(&step.tokens)?;
        if self.shape.gemma.is_some() {
            let scale = (self.shape.hidden as f32).sqrt();
            x.iter_mut().for_each(|v| *v *= scale);
        }
        for (li, layer) in self.layers.iter().enumerate() {
            self.attention_block(li, layer, &step, cache, &mut x)?;
            self.ffn_block(layer, &step.prompt, &mut x)?;
        }
        self.logits(seqs, &x)
    }

    /// `x += attention(norm(x))` for one layer, writing the step's K/V into `cache`.
    fn attention_block(
        &self,
        li: usize,
        layer: &Layer,
        step: &Step,
        cache: &mut KvCache,
        x: &mut [f32],
    ) -> Result<(), ModelError> {
        let s = &self.shape;
        let (hd, nh, nkv) = (s.head_dim, s.num_heads, s.num_kv_heads);
        let (qdim, kvdim, rows) = (nh * hd, nkv * hd, step.rows());
        let mut h = vec![0f32; x.len()];
        rms_norm(x, &layer.attn_norm, s.rms_eps, &mut h);
        let mut qkv = self.project(&layer.qkv, &h, &step.prompt)?;
        let width = qdim + 2 * kvdim;
        if let Some(b) = &layer.qkv_bias {
            for r in qkv.chunks_mut(width) {
                r.iter_mut().zip(b).for_each(|(x, b)| *x += b);
            }
        }
        let mut q = vec![0f32; rows * qdim];
        let mut k = vec![0f32; rows * kvdim];
        let mut v = vec![0f32; rows * kvdim];
        let local = s.window(li).is_some();
        for (r, row) in qkv.chunks(width).enumerate() {
            let (qr, kr) = (
                &mut q[r * qdim..(r + 1) * qdim],
                &mut k[r * kvdim..(r + 1) * kvdim],
            );
            qr.copy_from_slice(&row[..qdim]);
            kr.copy_from_slice(&row[qdim..qdim + kvdim]);
            v[r * kvdim..(r + 1) * kvdim].copy_from_slice(&row[qdim + kvdim..]);
            if let Some(g) = &layer.gemma {
                rms_norm_in_place(qr, &g.q_norm, s.rms_eps);
                rms_norm_in_place(kr, &g.k_norm, s.rms_eps);
            }
            self.rope(qr, step.positions[r], local);
            self.rope(kr, step.positions[r], local);
        }
        let t = Instant::now();
        cache.write(li, &step.slots, &k, &v);
        let mut attn = vec![0f32; rows * qdim];
        let scale = 1.0 / (hd as f32).sqrt();
        let window = s.window(li);
        let seqs = &step.attn_seqs;
        cache.attention(&self.team, li, &q, seqs, nh, scale, window, &mut attn);
        self.profile.add(Phase::Attention, t);
        let mut o = self.project(&layer.o, &attn, &step.prompt)?;
        if let Some(g) = &layer.gemma {
            rms_norm_in_place(&mut o, &g.post_attn, s.rms_eps);
        }
        x.iter_mut().zip(&o).for_each(|(x, o)| *x += o);
        Ok(())
    }

    /// `x += ffn(norm(x))`: SwiGLU, or Gemma's GeGLU with a norm on the output.
    ///
    /// A long prefill step goes through in slices of rows, a span of the prompt kernel each
    /// where that fits FFN_SLICE_BYTES (256 rows of Qwen2.5 1.5B: 17.5 MiB). Unsliced, the
    /// gate/up output of 512 Qwen2.5 rows (35 MiB) was mapped afresh in every layer at a page
    /// fault per 4 KiB: a quarter of a million faults per 512-token prefill. A row's result
    /// does not depend on the other rows of its matmul, so slicing changes no bits.
    fn ffn_block(&self, layer: &Layer, prompt: &[bool], x: &mut [f32]) -> Result<(), ModelError> {
        // `max(1)`: a malformed shape with no width must not divide by zero or chunk by zero.
        let per_row = (2 * self.shape.intermediate * std::mem::size_of::<f32>()).max(1);
        let rows = (FFN_SLICE_BYTES / per_row).clamp(PROMPT_KERNEL_MIN, PROMPT_SPAN_ROWS);
        let width = (rows * self.shape.hidden).max(1);
        for (x, prompt) in x.chunks_mut(width).zip(prompt.chunks(rows)) {
            self.ffn_slice(layer, prompt, x)?;
        }
        Ok(())
    }

    fn ffn_slice(&self, layer: &Layer, prompt: &[bool], x: &mut [f32]) -> Result<(), ModelError> {
        let (s, rows) = (&self.shape, prompt.len());
        let mut h = vec![0f32; x.len()];
        rms_norm(x, &layer.ffn_norm, s.rms_eps, &mut h);
        let gu = self.project(&layer.gate_up, &h, prompt)?;
        let inter = s.intermediate;
        let mut act = vec![0f32; rows * inter];
        for (a, row) in act.chunks_mut(inter).zip(gu.chunks(2 * inter)) {
            let (g, u) = row.split_at(inter);
            a.copy_from_slice(g);
            match layer.gemma {
                Some(_) => geglu(a, u),
                None => swiglu(a, u),
            }
        }
        let mut d = self.project(&layer.down, &act, prompt)?;
        if let Some(g) = &layer.gemma {
            rms_norm_in_place(&mut d, &g.post_ffn, s.rms_eps);
        }
        x.iter_mut().zip(&d).for_each(|(x, d)| *x += d);
        Ok(())
    }

    /// Only the rows whose logits are wanted go through the final norm and the vocab matmul:
    /// for a prefill chunk that is one row, not the whole prompt.
    fn logits(&self, seqs: &[BatchSeq], x: &[f32]) -> Result<Vec<Vec<f32>>, ModelError> {
        let hidden = self.shape.hidden;
        let mut last = Vec::new();
        let mut row = 0;
        for q in seqs {
            row += q.tokens.len();
            if q.want_logits {
                let first = row - 1 - q.draft_rows.min(q.tokens.len() - 1);
                last.extend_from_slice(&x[first * hidden..row * hidden]);
            }
        }
        if last.is_empty() {
            return Ok(Vec::new());
        }
        let n = last.len() / hidden;
        let mut normed = vec![0f32; last.len()];
        rms_norm(&last, &self.norm, self.shape.rms_eps, &mut normed);
        let mut logits = self.profile.time(Phase::LmHead, || {
            let generated = vec![false; n];
            self.lm_head
                .forward(self.kernels(), &normed, &generated, &self.device)
        })?;
        if let Some(cap) = self.shape.gemma.as_ref().and_then(|g| g.final_softcap) {
            logits.iter_mut().for_each(|l| *l = cap * (*l / cap).tanh());
        }
        Ok(logits
            .chunks(logits.len() / n)
            .map(<[f32]>::to_vec)
            .collect())
    }

    fn embed(&self, tokens: &[u32]) -> Result<Vec<f32>, ModelError> {
        if let Embedding::Native(m) = &self.embed {
            let k = m.cols();
            let mut out = vec![0f32; tokens.len() * k];
            for (&t, o) in tokens.iter().zip(out.chunks_mut(k)) {
                m.dequantize_row(t as usize, o);
            }
            return Ok(out);
        }
        let ids = Tensor::from_slice(tokens, tokens.len(), &self.device)?;
        let e = match &self.embed {
            Embedding::Quantized(t) => t.embedding(&ids)?,
            Embedding::Dense(t) => t.index_select(&ids, 0)?,
            Embedding::Native(_) => unreachable!("handled above"),
        };
        Ok(e.flatten_all()?.to_vec1()?)
    }

    /// Rotates every head of one row (`[heads][head_dim]`) to `pos`, with the local-layer
    /// tables when `local` and the model has them.
    fn rope(&self, x: &mut [f32], pos: usize, local: bool) {
        let hd = self.shape.head_dim;
        let half = hd / 2;
        let (cos, sin) = match (&self.rope_local, local) {
            (Some((c, s)), true) => (c, s),
            _ => (&self.rope_cos, &self.rope_sin),
        };
        let cos = &cos[pos * half..(pos + 1) * half];
        let sin = &sin[pos * half..(pos + 1) * half];
        for head in x.chunks_mut(hd) {
            match self.shape.rope_style {
                RopeStyle::Interleaved => {
                    for i in 0..half {
                        let (a, b) = (head[2 * i], head[2 * i + 1]);
                        head[2 * i] = a * cos[i] - b * sin[i];
                        head[2 * i + 1] = a * sin[i] + b * cos[i];
                    }
                }
                RopeStyle::Neox => {
                    for i in 0..half {
                        let (a, b) = (head[i], head[i + half]);
                        head[i] = a * cos[i] - b * sin[i];
                        head[i + half] = a * sin[i] + b * cos[i];
                    }
                }
            }
        }
    }
}

/// RoPE cos and sin for every position of the context, `[position][head_dim / 2]`, positions
/// divided by `scale` (linear RoPE scaling).
fn rope_table(shape: &ModelShape, theta: f32, scale: f32) -> (Vec<f32>, Vec<f32>) {
    let half = shape.head_dim / 2;
    let mut cos = Vec::with_capacity(shape.context_length * half);
    let mut sin = Vec::with_capacity(shape.context_length * half);
    for p in 0..shape.context_length {
        for i in 0..half {
            let freq = theta.powf(-((2 * i) as f32) / shape.head_dim as f32);
            let a = p as f32 / scale * freq;
            cos.push(a.cos());
            sin.push(a.sin());
        }
    }
    (cos, sin)
}

/// The positions, cache slots and attention spans of one step's rows.
struct Step<'a> {
    tokens: Vec<u32>,
    positions: Vec<usize>,
    slots: Vec<usize>,
    attn_seqs: Vec<AttnSeq<'a>>,
    /// Whether each row takes the prompt kernels (`prompt_kernel_rows`).
    prompt: Vec<bool>,
}

/// A prompt's last KV block takes the batch kernels when it holds at most this many rows:
/// they are what a full prefix-cache hit recomputes (the cache never covers a prompt's last
/// token). On the prompt kernels that recompute costs about two decode steps whatever its
/// rows (dequantizing every weight for the tiles); on the batch kernels, one for one row and
/// about 1.5 for four, beyond which they near the tiles. An uncached prefill of such a prompt
/// pays one more pass of the batch kernels (`host/scripts/bench-prefix-hit.py`).
const RECOMPUTED_ROWS: usize = 4;

/// How many of a prompt's leading rows take the prompt kernels: none of a prompt shorter than
/// `PROMPT_KERNEL_MIN`, and all but its last block's rows when that block holds at most
/// `RECOMPUTED_ROWS` (`bs` tokens a block). It depends on the prompt alone, never on what
/// the cache holds or what shares the step, so a row takes the same kernels, and gives the
/// same bits, cached or not, alone or batched, whole or in chunks.
fn prompt_kernel_rows(prompt_len: usize, bs: usize) -> usize {
    if prompt_len < PROMPT_KERNEL_MIN {
        return 0;
    }
    let last_block = (prompt_len - 1) % bs + 1;
    match last_block <= RECOMPUTED_ROWS {
        true => prompt_len - last_block,
        false => prompt_len,
    }
}

impl<'a> Step<'a> {
    fn new(seqs: &[BatchSeq<'a>], bs: usize) -> Self {
        let tokens = seqs.iter().flat_map(|q| q.tokens.iter().copied()).collect();
        let positions = seqs
            .iter()
            .flat_map(|q| q.start..q.start + q.tokens.len())
            .collect();
        let slots = seqs
            .iter()
            .flat_map(|q| {
                (q.start..q.start + q.tokens.len())
                    .map(move |p| q.block_table[p / bs] as usize * bs + p % bs)
            })
            .collect();
        let attn_seqs = seqs
            .iter()
            .map(|q| AttnSeq {
                block_table: q.block_table,
                start: q.start,
                len: q.tokens.len(),
            })
            .collect();
        let prompt = seqs
            .iter()
            .flat_map(|q| {
                let rows = prompt_kernel_rows(q.prompt_len, bs);
                (q.start..q.start + q.tokens.len()).map(move |p| p < rows)
            })
            .collect();
        Self {
            tokens,
            positions,
            slots,
            attn_seqs,
            prompt,
        }
    }

    fn rows(&self) -> usize {
        self.tokens.len()
    }
}
