//! The CUDA path: the network of `model.rs` with weights, activations and the paged KV pool in
//! GPU memory. Projections are cuBLAS GEMMs; attention and KV writes are our kernels
//! (`kernels/src/attention.cu`), the per-row work around them `kernels/src/layers.cu`. The
//! batch arrives as on the CPU path (block tables, start positions, tokens), so the scheduler
//! and block manager do not know which device runs the step.
//!
//! Weights are dequantized once at load into the configured dtype (GGUF Q4/Q8 and k-quants
//! alike): GEMMs on dense bf16/f16 use the tensor cores, and a quantized GPU matmul is a later
//! step. Activations live in a workspace sized for the largest step at start, before the KV
//! pool takes what is left of `gpu_memory_utilization`; the only per-step allocations are the
//! batch metadata and the attention's split-K partials, which the sizing reserves.

mod blas;
mod rows;

use std::sync::Arc;

use cudarc::cublas::sys::cudaDataType_t;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream};
use gateway_kernels::cuda::{supported, Element, Kernels, RowPlan, MAX_ROWS};
use gateway_kernels::layers::{Heads, Layers};
use gateway_kernels::{Shape, PARTITION_SIZE};
use half::{bf16, f16};

use super::batch::{BatchSeq, Pool};
use super::model::{Linear, Model, ModelShape, RopeStyle};
use super::ModelError;
use crate::config::{EngineConfig, GpuDtype};
use blas::Blas;
use rows::{DeviceRows, Rows};

/// An element type the GPU path computes in.
pub trait GpuElement: Element {
    /// The type's name for cuBLAS.
    const CUDA: cudaDataType_t;
    fn from_f32(x: f32) -> Self;
}
impl GpuElement for f32 {
    const CUDA: cudaDataType_t = cudaDataType_t::CUDA_R_32F;
    fn from_f32(x: f32) -> Self {
        x
    }
}
impl GpuElement for f16 {
    const CUDA: cudaDataType_t = cudaDataType_t::CUDA_R_16F;
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
}
impl GpuElement for bf16 {
    const CUDA: cudaDataType_t = cudaDataType_t::CUDA_R_16BF;
    fn from_f32(x: f32) -> Self {
        bf16::from_f32(x)
    }
}

/// For `map_err`: a device error with what was being done.
fn dev_err<E: std::fmt::Debug>(what: &'static str) -> impl FnOnce(E) -> ModelError {
    move |e| ModelError::Device(format!("{what}: {e:?}"))
}

/// Scratch room held back from the KV pool for what steps allocate on the fly.
const SLACK_BYTES: usize = 64 << 20;

pub enum GpuModel {
    F32(Net<f32>),
    F16(Net<f16>),
    Bf16(Net<bf16>),
}

impl GpuModel {
    /// `window` is the longest sequence the engine will run (it sizes the attention's
    /// split-K scratch).
    pub fn new(
        model: Model,
        ordinal: usize,
        e: &EngineConfig,
        window: usize,
    ) -> Result<(Self, Pool), ModelError> {
        let s = &model.shape;
        supported(s.num_heads, s.num_kv_heads, s.head_dim)
            .map_err(|e| ModelError::Device(format!("this model on CUDA: {e}")))?;
        if e.max_num_batched_tokens > MAX_ROWS {
            return Err(ModelError::Device(format!(
                "max_num_batched_tokens {} is above the CUDA path's {MAX_ROWS}",
                e.max_num_batched_tokens
            )));
        }
        // SAFETY: probing for the shared libraries only opens and closes them.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(ModelError::NoGpu(
                "no CUDA driver (libcuda.so) found on this machine".into(),
            ));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(ModelError::NoGpu(
                "cuBLAS (libcublas.so.13) not found: install the CUDA 13 libraries or add \
                 their folder to LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let ctx = CudaContext::new(ordinal)
            .map_err(|e| ModelError::NoGpu(format!("cannot open CUDA device {ordinal}: {e:?}")))?;
        // SAFETY: the engine uses one stream, so the cross-stream events cudarc would record
        // on every buffer use order nothing.
        unsafe { ctx.disable_event_tracking() };
        // Its own stream, not the legacy default one, which would serialise this engine with
        // every other engine of the process on the same GPU.
        let stream = ctx.new_stream().map_err(dev_err("creating a stream"))?;
        let (free, total) = ctx.mem_get_info().map_err(dev_err("reading free memory"))?;
        let base = Baseline {
            used: total - free,
            window,
        };
        Ok(match e.dtype {
            GpuDtype::F32 => {
                let (n, p) = Net::new(model, &ctx, stream, e, base)?;
                (Self::F32(n), p)
            }
            GpuDtype::F16 => {
                let (n, p) = Net::new(model, &ctx, stream, e, base)?;
                (Self::F16(n), p)
            }
            GpuDtype::Bf16 | GpuDtype::Auto => {
                let (n, p) = Net::new(model, &ctx, stream, e, base)?;
                (Self::Bf16(n), p)
            }
        })
    }

    pub fn forward(&mut self, seqs: &[BatchSeq]) -> Result<Vec<Vec<f32>>, ModelError> {
        match self {
            Self::F32(n) => n.forward(seqs),
            Self::F16(n) => n.forward(seqs),
            Self::Bf16(n) => n.forward(seqs),
        }
    }
}

/// What the sizing of the KV pool starts from.
#[derive(Clone, Copy)]
struct Baseline {
    /// Device memory in use before this engine uploaded anything (other processes, other
    /// engines): not counted against this engine's `gpu_memory_utilization`.
    used: usize,
    window: usize,
}

/// The dense `[rows][cols]` weight of `l`, checked against the shape the network expects so
/// that a malformed checkpoint fails at load, not as an out-of-bounds read on the GPU.
fn dense(l: &Linear, rows: usize, cols: usize, what: &str) -> Result<Vec<f32>, ModelError> {
    let (r, c, w) = l.to_f32()?;
    if (r, c) != (rows, cols) {
        return Err(ModelError::Format(format!(
            "{what} is [{r}, {c}], expected [{rows}, {cols}]"
        )));
    }
    Ok(w)
}

struct GpuLayer<T> {
    attn_norm: CudaSlice<T>,
    qkv: CudaSlice<T>,
    /// Zeros for models without a QKV bias.
    qkv_bias: CudaSlice<T>,
    o: CudaSlice<T>,
    ffn_norm: CudaSlice<T>,
    gate_up: CudaSlice<T>,
    down: CudaSlice<T>,
}

/// Activations of one step, each sized for `max_rows` tokens (`logits*` for `max_seqs`).
struct Workspace<T> {
    x: CudaSlice<T>,
    h: CudaSlice<T>,
    qkv: CudaSlice<T>,
    q: CudaSlice<T>,
    k: CudaSlice<T>,
    v: CudaSlice<T>,
    attn: CudaSlice<T>,
    gu: CudaSlice<T>,
    act: CudaSlice<T>,
    last: CudaSlice<T>,
    /// Written in f32 straight by the vocab GEMM, so the sampler sees logits as precise as
    /// the CPU path's whatever the dtype.
    logits: CudaSlice<f32>,
}

pub struct Net<T> {
    shape: ModelShape,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    attention: Kernels,
    ops: Layers,
    weights: Weights<T>,
    rope_cos: CudaSlice<f32>,
    rope_sin: CudaSlice<f32>,
    /// Per layer, K and V: `[num_blocks][block_size][num_kv_heads][head_dim]`.
    kv: Vec<(CudaSlice<T>, CudaSlice<T>)>,
    block_size: usize,
    max_rows: usize,
    max_seqs: usize,
    ws: Workspace<T>,
}

/// The network's weights in device memory.
struct Weights<T> {
    embed: CudaSlice<T>,
    /// `None` when the output projection is the embedding table (tied weights).
    lm_head: Option<CudaSlice<T>>,
    norm: CudaSlice<T>,
    layers: Vec<GpuLayer<T>>,
}

impl<T: GpuElement> Weights<T> {
    /// Dequantizes every weight to `T` and uploads it, each checked against its shape.
    fn upload(model: &Model, stream: &Arc<CudaStream>) -> Result<Self, ModelError> {
        let s = &model.shape;
        let up = |v: &[f32]| -> Result<CudaSlice<T>, ModelError> {
            let host: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
            stream
                .clone_htod(&host)
                .map_err(dev_err("uploading weights"))
        };
        let (qdim, kvdim) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
        let zeros = vec![0f32; qdim + 2 * kvdim];
        let (h, i) = (s.hidden, s.intermediate);
        let layers = model
            .layers
            .iter()
            .map(|l| {
                Ok(GpuLayer {
                    attn_norm: up(&l.attn_norm)?,
                    qkv: up(&dense(&l.qkv, qdim + 2 * kvdim, h, "qkv")?)?,
                    qkv_bias: up(l.qkv_bias.as_deref().unwrap_or(&zeros))?,
                    o: up(&dense(&l.o, h, qdim, "attn_output")?)?,
                    ffn_norm: up(&l.ffn_norm)?,
                    gate_up: up(&dense(&l.gate_up, 2 * i, h, "gate_up")?)?,
                    down: up(&dense(&l.down, h, i, "ffn_down")?)?,
                })
            })
            .collect::<Result<Vec<_>, ModelError>>()?;
        let (vocab, cols, table) = model.embed.to_f32()?;
        if (vocab, cols) != (s.vocab_size, h) {
            return Err(ModelError::Format(format!(
                "token embedding is [{vocab}, {cols}], expected [{}, {h}]",
                s.vocab_size
            )));
        }
        let embed = up(&table)?;
        drop(table);
        let lm_head = match model.embed.is_tied_to(&model.lm_head) {
            true => None,
            false => Some(up(&dense(&model.lm_head, s.vocab_size, h, "output")?)?),
        };
        Ok(Self {
            embed,
            lm_head,
            norm: up(&model.norm)?,
            layers,
        })
    }
}

impl<T: GpuElement> Workspace<T> {
    fn new(
        stream: &Arc<CudaStream>,
        s: &ModelShape,
        max_rows: usize,
        max_seqs: usize,
    ) -> Result<Self, ModelError> {
        let alloc = |n: usize| {
            stream
                .alloc_zeros::<T>(n.max(1))
                .map_err(dev_err("allocating the step workspace"))
        };
        let (qdim, kvdim) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
        Ok(Self {
            x: alloc(max_rows * s.hidden)?,
            h: alloc(max_rows * s.hidden)?,
            qkv: alloc(max_rows * (qdim + 2 * kvdim))?,
            q: alloc(max_rows * qdim)?,
            k: alloc(max_rows * kvdim)?,
            v: alloc(max_rows * kvdim)?,
            attn: alloc(max_rows * qdim)?,
            gu: alloc(max_rows * 2 * s.intermediate)?,
            act: alloc(max_rows * s.intermediate)?,
            last: alloc(max_seqs * s.hidden)?,
            logits: stream
                .alloc_zeros::<f32>(max_seqs * s.vocab_size)
                .map_err(dev_err("allocating the step workspace"))?,
        })
    }
}

/// The paged KV pool, per layer K and V, sized by what `gpu_memory_utilization` leaves after
/// this engine's weights and workspace, the attention's split-K partials for the largest step
/// at the longest window, and some slack; never more than is actually free.
#[allow(clippy::type_complexity)]
fn kv_pool<T: GpuElement>(
    ctx: &CudaContext,
    stream: &Arc<CudaStream>,
    s: &ModelShape,
    e: &EngineConfig,
    base: Baseline,
) -> Result<(Vec<(CudaSlice<T>, CudaSlice<T>)>, Pool), ModelError> {
    let (free, total) = ctx.mem_get_info().map_err(dev_err("reading free memory"))?;
    let ours = (total - free).saturating_sub(base.used);
    let parts = base.window.div_ceil(PARTITION_SIZE);
    let partials = match parts {
        1 => 0,
        _ => e.max_num_batched_tokens * s.num_heads * parts * (s.head_dim + 2) * 4,
    };
    let allowed = (total as f64 * e.gpu_memory_utilization as f64) as usize;
    let budget = allowed
        .saturating_sub(ours)
        .min(free)
        .saturating_sub(partials + SLACK_BYTES);
    let kvdim = s.num_kv_heads * s.head_dim;
    let block_bytes = 2 * s.num_layers * e.block_size * kvdim * std::mem::size_of::<T>();
    let num_blocks = budget / block_bytes;
    if num_blocks == 0 {
        return Err(ModelError::KvBudget { budget, blocks: 0 });
    }
    let per_layer = num_blocks * e.block_size * kvdim;
    let alloc = |n: usize| {
        stream
            .alloc_zeros::<T>(n)
            .map_err(dev_err("allocating the KV pool"))
    };
    let kv = (0..s.num_layers)
        .map(|_| Ok((alloc(per_layer)?, alloc(per_layer)?)))
        .collect::<Result<Vec<_>, ModelError>>()?;
    tracing::info!(
        dtype = T::NAME,
        gpu_total_mib = total >> 20,
        weights_and_workspace_mib = ours >> 20,
        kv_mib = (num_blocks * block_bytes) >> 20,
        "GPU memory laid out"
    );
    let pool = Pool {
        num_blocks,
        block_bytes,
    };
    Ok((kv, pool))
}

impl<T: GpuElement> Net<T> {
    fn new(
        model: Model,
        ctx: &Arc<CudaContext>,
        stream: Arc<CudaStream>,
        e: &EngineConfig,
        base: Baseline,
    ) -> Result<(Self, Pool), ModelError> {
        let s = model.shape.clone();
        if s.gemma.is_some() {
            return Err(ModelError::Device(
                "Gemma 3 (sliding-window layers, QK-norm, GeGLU) runs on the CPU engine only; \
                 serve it with device = \"cpu\""
                    .into(),
            ));
        }
        let blas = CudaBlas::new(stream.clone()).map_err(dev_err("cuBLAS"))?;
        let attention = Kernels::new(stream.clone()).map_err(dev_err("kernels"))?;
        let ops = Layers::new(stream.clone()).map_err(dev_err("kernels"))?;
        let (cos, sin) = model.rope_tables();
        let rope_cos = stream.clone_htod(cos).map_err(dev_err("upload"))?;
        let rope_sin = stream.clone_htod(sin).map_err(dev_err("upload"))?;
        let weights = Weights::upload(&model, &stream)?;
        drop(model);
        let (max_rows, max_seqs) = (e.max_num_batched_tokens, e.max_num_seqs);
        let ws = Workspace::new(&stream, &s, max_rows, max_seqs)?;
        let (kv, pool) = kv_pool(ctx, &stream, &s, e, base)?;
        let net = Self {
            shape: s,
            stream,
            blas,
            attention,
            ops,
            weights,
            rope_cos,
            rope_sin,
            kv,
            block_size: e.block_size,
            max_rows,
            max_seqs,
            ws,
        };
        Ok((net, pool))
    }

    fn forward(&mut self, seqs: &[BatchSeq]) -> Result<Vec<Vec<f32>>, ModelError> {
        let s = &self.shape;
        let r = Rows::new(seqs, self.block_size);
        if r.rows == 0 {
            return Ok(Vec::new());
        }
        if r.rows > self.max_rows || r.want.len() > self.max_seqs {
            return Err(ModelError::Device(format!(
                "a step of {} tokens / {} sequences exceeds the workspace ({} / {})",
                r.rows,
                r.want.len(),
                self.max_rows,
                self.max_seqs
            )));
        }
        let st = &self.stream;
        let d = r.upload(st)?;
        let step = Step {
            rows: r.rows,
            heads: Heads {
                num_heads: s.num_heads,
                num_kv_heads: s.num_kv_heads,
                head_size: s.head_dim,
                neox: s.rope_style == RopeStyle::Neox,
            },
            shape: Shape {
                rows: r.rows,
                num_heads: s.num_heads,
                num_kv_heads: s.num_kv_heads,
                head_size: s.head_dim,
                block_size: self.block_size,
                max_blocks: r.max_blocks,
                scale: 1.0 / (s.head_dim as f32).sqrt(),
            },
            plan: self.attention.plan_rows(&r.row_ctx).map_err(k_err)?,
            d: &d,
        };
        let kit = Kit {
            s,
            ops: &self.ops,
            attention: &self.attention,
            blas: Blas(&self.blas, st),
            rope: (&self.rope_cos, &self.rope_sin),
        };
        let (w, ws) = (&self.weights, &mut self.ws);
        kit.ops
            .embed(&mut ws.x, &w.embed, &d.tokens, s.hidden)
            .map_err(k_err)?;
        for (l, kv) in w.layers.iter().zip(self.kv.iter_mut()) {
            kit.layer(l, kv, ws, &step)?;
        }
        if r.want.is_empty() {
            return Ok(Vec::new());
        }
        // Only the rows whose logits are wanted go through the final norm and the vocab GEMM.
        let n = r.want.len();
        let d_want = st.clone_htod(&r.want).map_err(dev_err("upload"))?;
        kit.ops
            .gather_rows(&mut ws.last, &ws.x, &d_want, s.hidden)
            .map_err(k_err)?;
        kit.ops
            .rms_norm(&mut ws.h, &ws.last, &w.norm, s.rms_eps, n)
            .map_err(k_err)?;
        let head = w.lm_head.as_ref().unwrap_or(&w.embed);
        let dims = (n, s.hidden, s.vocab_size);
        kit.blas.gemm(&ws.h, head, &mut ws.logits, dims, false)?;
        let host = st
            .clone_dtoh(&ws.logits.slice(0..n * s.vocab_size))
            .map_err(dev_err("reading logits"))?;
        Ok(host.chunks(s.vocab_size).map(<[f32]>::to_vec).collect())
    }
}

fn k_err(e: gateway_kernels::cuda::Error) -> ModelError {
    ModelError::Device(e.to_string())
}

/// What every layer of one step shares.
struct Step<'a> {
    rows: usize,
    heads: Heads,
    shape: Shape,
    plan: RowPlan,
    d: &'a DeviceRows,
}

/// The network's kernels and constants, borrowed for one step.
struct Kit<'a> {
    s: &'a ModelShape,
    ops: &'a Layers,
    attention: &'a Kernels,
    blas: Blas<'a>,
    rope: (&'a CudaSlice<f32>, &'a CudaSlice<f32>),
}

impl Kit<'_> {
    /// One decoder layer over the step's rows, in place on `ws.x`.
    fn layer<T: GpuElement>(
        &self,
        l: &GpuLayer<T>,
        (kc, vc): &mut (CudaSlice<T>, CudaSlice<T>),
        ws: &mut Workspace<T>,
        step: &Step,
    ) -> Result<(), ModelError> {
        let (s, ops, d, rows) = (self.s, self.ops, step.d, step.rows);
        let (qdim, kvdim) = (s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim);
        let (hidden, inter) = (s.hidden, s.intermediate);
        ops.rms_norm(&mut ws.h, &ws.x, &l.attn_norm, s.rms_eps, rows)
            .map_err(k_err)?;
        let width = qdim + 2 * kvdim;
        self.blas
            .gemm(&ws.h, &l.qkv, &mut ws.qkv, (rows, hidden, width), false)?;
        let qkv = (&mut ws.q, &mut ws.k, &mut ws.v);
        ops.rope_split(qkv, &ws.qkv, &l.qkv_bias, &d.pos, self.rope, step.heads)
            .map_err(k_err)?;
        self.attention
            .reshape_and_cache(&ws.k, &ws.v, kc, vc, &d.slots, kvdim)
            .map_err(k_err)?;
        self.attention
            .paged_attention(
                &mut ws.attn,
                &ws.q,
                kc,
                vc,
                &d.tables,
                &d.row_seq,
                &d.row_ctx,
                &step.plan,
                &step.shape,
            )
            .map_err(k_err)?;
        // Residual adds are the GEMMs' beta = 1.
        self.blas
            .gemm(&ws.attn, &l.o, &mut ws.x, (rows, qdim, hidden), true)?;
        ops.rms_norm(&mut ws.h, &ws.x, &l.ffn_norm, s.rms_eps, rows)
            .map_err(k_err)?;
        let dims = (rows, hidden, 2 * inter);
        self.blas.gemm(&ws.h, &l.gate_up, &mut ws.gu, dims, false)?;
        ops.silu_mul(&mut ws.act, &ws.gu, inter, rows)
            .map_err(k_err)?;
        self.blas
            .gemm(&ws.act, &l.down, &mut ws.x, (rows, inter, hidden), true)?;
        Ok(())
    }
}
