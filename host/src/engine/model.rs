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

use super::buffers::{Buf, Buffers};
use super::cpu_ops::{geglu, rms_norm, rms_norm_in_place, swiglu};
use super::profile::{Phase, StepProfile};
use super::quant::{
    ActivationBits, PromptPrecision, QuantMatrix, Rounding, PROMPT_KERNEL_MIN, PROMPT_SPAN_ROWS,
};
use super::team::{split_mut, Team};

use super::paged_attention::KvCache;
use super::ModelError;

mod step;
use step::Step;

/// The most bytes of gate/up output one slice of a step's feed-forward block may take
/// (`Model::ffn_block`): it bounds the largest buffer a model keeps between steps.
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
    /// Output features (weight rows).
    fn out_features(&self) -> usize {
        match self {
            Linear::Native(m) => m.rows(),
            Linear::Quantized(QMatMul::QTensor(t)) => t.shape().dims()[0],
            Linear::Quantized(QMatMul::Tensor(t) | QMatMul::TensorF16(t)) | Linear::Dense(t) => {
                t.dims()[0]
            }
        }
    }

    /// `x` is `[rows, in]` row-major, `prompt[i]` whether row `i` is a prompt token's (see
    /// `QuantMatrix::matmul_rows`); writes `[rows, out]` into `out`.
    fn forward(
        &self,
        (team, rounding): (&Team, Rounding),
        x: &[f32],
        prompt: &[bool],
        dev: &Device,
        out: &mut [f32],
    ) -> Result<(), ModelError> {
        let rows = prompt.len();
        let xt = || Tensor::from_slice(x, (rows, x.len() / rows), dev);
        let y = match self {
            Linear::Native(w) => {
                w.matmul_rows(team, x, prompt, rounding, out);
                return Ok(());
            }
            Linear::Quantized(m) => xt()?.apply(m)?,
            Linear::Dense(w) => xt()?.matmul(&w.t()?)?,
        };
        out.copy_from_slice(&y.flatten_all()?.to_vec1::<f32>()?);
        Ok(())
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
    /// The steps' intermediates, reused from step to step.
    buffers: Buffers,
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
            buffers: Buffers::default(),
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

    /// `layer`'s projection `w` of `x`, timed, into a reused buffer.
    fn project(&self, w: &Linear, x: &[f32], prompt: &[bool]) -> Result<Buf<'_>, ModelError> {
        self.profile.time(Phase::Projections, || {
            let mut out = self.buffers.take(prompt.len() * w.out_features());
            w.forward(self.kernels(), x, prompt, &self.device, &mut out)?;
            Ok(out)
        })
    }

    /// Frees the buffers kept for the next step's intermediates (about 100 MB after a long
    /// prefill of a 1.5B model), for an engine with nothing to run.
    pub fn release_buffers(&self) {
        self.buffers.release();
        self.team
            .run(&|_, _| super::quant::release_thread_buffers());
    }

    /// `rms_norm` of `x`'s rows by `w`, across the team, into a reused buffer.
    fn norm_rows(&self, x: &[f32], w: &[f32]) -> Buf<'_> {
        let (width, eps) = (w.len(), self.shape.rms_eps);
        let mut h = self.buffers.take(x.len());
        self.team.rows_mut(&mut h, width, &|r0, h| {
            rms_norm(&x[r0 * width..r0 * width + h.len()], w, eps, h)
        });
        h
    }

    /// `x += norm(d)` row by row across the team (Gemma 3 norms a block's output, `post`,
    /// before adding it).
    fn residual(&self, x: &mut [f32], d: &mut [f32], post: Option<&[f32]>) {
        let (width, eps) = (self.shape.hidden, self.shape.rms_eps);
        if let Some(w) = post {
            self.team
                .rows_mut(d, width, &|_, d| rms_norm_in_place(d, w, eps));
        }
        self.team.rows_mut(x, width, &|r0, x| {
            let d = &d[r0 * width..r0 * width + x.len()];
            x.iter_mut().zip(d).for_each(|(x, d)| *x += d);
        });
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
        let h = self.norm_rows(x, &layer.attn_norm);
        let qkv = self.project(&layer.qkv, &h, &step.prompt)?;
        drop(h);
        let mut q = self.buffers.take(rows * qdim);
        let mut k = self.buffers.take(rows * kvdim);
        let mut v = self.buffers.take(rows * kvdim);
        self.split_heads(li, layer, step, &qkv, (&mut q, &mut k, &mut v));
        drop(qkv);
        let t = Instant::now();
        cache.write(li, &step.slots, &k, &v);
        let mut attn = self.buffers.take(rows * qdim);
        let scale = 1.0 / (hd as f32).sqrt();
        let window = s.window(li);
        let seqs = &step.attn_seqs;
        cache.attention(&self.team, li, &q, seqs, nh, scale, window, &mut attn);
        self.profile.add(Phase::Attention, t);
        drop((q, k, v));
        let mut o = self.project(&layer.o, &attn, &step.prompt)?;
        drop(attn);
        let post = layer.gemma.as_ref().map(|g| &g.post_attn[..]);
        self.residual(x, &mut o, post);
        Ok(())
    }

    /// Each row's Q, K and V out of the fused projection `qkv`, with the bias, Gemma 3's
    /// per-head norms and RoPE; rows across the team.
    fn split_heads(
        &self,
        li: usize,
        layer: &Layer,
        step: &Step,
        qkv: &[f32],
        (q, k, v): (&mut [f32], &mut [f32], &mut [f32]),
    ) {
        let s = &self.shape;
        let (qdim, kvdim) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
        let (width, rows, local) = (qdim + 2 * kvdim, step.rows(), s.window(li).is_some());
        let ranges = self.team.row_ranges(rows, rows * width);
        let qs = split_mut(q, ranges.iter().map(|r| r.len() * qdim));
        let ks = split_mut(k, ranges.iter().map(|r| r.len() * kvdim));
        let vs = split_mut(v, ranges.iter().map(|r| r.len() * kvdim));
        self.team.each(ranges.len(), &|i| {
            let mut q = qs[i].lock().unwrap_or_else(|e| e.into_inner());
            let mut k = ks[i].lock().unwrap_or_else(|e| e.into_inner());
            let mut v = vs[i].lock().unwrap_or_else(|e| e.into_inner());
            for (j, r) in ranges[i].clone().enumerate() {
                let row = &qkv[r * width..(r + 1) * width];
                let qr = &mut q[j * qdim..(j + 1) * qdim];
                let kr = &mut k[j * kvdim..(j + 1) * kvdim];
                let vr = &mut v[j * kvdim..(j + 1) * kvdim];
                qr.copy_from_slice(&row[..qdim]);
                kr.copy_from_slice(&row[qdim..qdim + kvdim]);
                vr.copy_from_slice(&row[qdim + kvdim..]);
                if let Some(b) = &layer.qkv_bias {
                    let (bq, bkv) = b.split_at(qdim);
                    let (bk, bv) = bkv.split_at(kvdim);
                    qr.iter_mut().zip(bq).for_each(|(x, b)| *x += b);
                    kr.iter_mut().zip(bk).for_each(|(x, b)| *x += b);
                    vr.iter_mut().zip(bv).for_each(|(x, b)| *x += b);
                }
                if let Some(g) = &layer.gemma {
                    rms_norm_in_place(qr, &g.q_norm, s.rms_eps);
                    rms_norm_in_place(kr, &g.k_norm, s.rms_eps);
                }
                self.rope(qr, step.positions[r], local);
                self.rope(kr, step.positions[r], local);
            }
        });
    }

    /// `x += ffn(norm(x))`: SwiGLU, or Gemma's GeGLU with a norm on the output.
    ///
    /// A long prefill step goes through in slices of rows, a span of the prompt kernel each
    /// where that fits FFN_SLICE_BYTES (256 rows of Qwen2.5 1.5B: 17.5 MiB). Unsliced, the
    /// gate/up output of 512 Qwen2.5 rows (35 MiB) was mapped afresh in every layer at a page
    /// fault per 4 KiB, before the buffers were reused. Slices of a whole span (512 rows) were
    /// no faster: the prompt kernel's packing halved, and its activations came from further
    /// out. A row's result does not depend on the other rows of its matmul, so slicing changes
    /// no bits.
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
        let (inter, rows) = (self.shape.intermediate, prompt.len());
        let h = self.norm_rows(x, &layer.ffn_norm);
        let gu = self.project(&layer.gate_up, &h, prompt)?;
        drop(h);
        let mut act = self.buffers.take(rows * inter);
        let gelu = layer.gemma.is_some();
        self.team.rows_mut(&mut act, inter, &|r0, act| {
            for (j, a) in act.chunks_mut(inter.max(1)).enumerate() {
                let (g, u) = gu[(r0 + j) * 2 * inter..][..2 * inter].split_at(inter);
                match gelu {
                    true => geglu(a, g, u),
                    false => swiglu(a, g, u),
                }
            }
        });
        drop(gu);
        let mut d = self.project(&layer.down, &act, prompt)?;
        drop(act);
        let post = layer.gemma.as_ref().map(|g| &g.post_ffn[..]);
        self.residual(x, &mut d, post);
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
        let mut logits = vec![0f32; n * self.lm_head.out_features()];
        self.profile.time(Phase::LmHead, || {
            let generated = vec![false; n];
            self.lm_head.forward(
                self.kernels(),
                &normed,
                &generated,
                &self.device,
                &mut logits,
            )
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
