//! Where a model's forward pass runs. The CPU path is `model.rs` over the f16 KV pool of
//! `paged_attention.rs` in RAM; the CUDA path (`gpu/`, feature `cuda`) holds weights,
//! activations and the KV pool in GPU memory. Both take the same batch (block tables, start
//! positions, tokens) and return the same logits, so the scheduler and block manager above
//! them are shared: all they learn from the device is how many blocks its pool holds.

use crate::config::{ComputeDevice, EngineConfig};

use super::batch::BatchSeq;
pub use super::batch::Pool;
use super::model::Model;
use super::paged_attention::KvCache;
use super::quant::ActivationBits;
use super::ModelError;

// One runner per engine, built once and never moved on a hot path: variant sizes do not matter.
#[allow(clippy::large_enum_variant)]
pub enum Runner {
    Cpu {
        model: Model,
        cache: KvCache,
    },
    #[cfg(feature = "cuda")]
    Cuda(super::gpu::GpuModel),
}

impl Runner {
    /// Places `model` on the configured device and allocates its KV pool: `kv_cache_bytes` on
    /// the CPU, the rest of `gpu_memory_utilization` on a GPU. `window` is the longest sequence
    /// the engine will run.
    pub fn new(
        mut model: Model,
        e: &EngineConfig,
        #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] window: usize,
    ) -> Result<(Self, Pool), ModelError> {
        match e.device {
            ComputeDevice::Cpu => {
                model.set_threads(e.threads);
                model.set_activation_bits(ActivationBits::configured(e.decode_activation_bits));
                model.set_prompt_precision(e.prompt_precision);
                let s = &model.shape;
                let block_bytes =
                    KvCache::block_bytes(s.num_layers, e.block_size, s.num_kv_heads, s.head_dim);
                let num_blocks = e.kv_cache_bytes / block_bytes;
                if num_blocks == 0 {
                    return Err(ModelError::KvBudget {
                        budget: e.kv_cache_bytes,
                        blocks: 0,
                    });
                }
                let cache = KvCache::new(
                    s.num_layers,
                    num_blocks,
                    e.block_size,
                    s.num_kv_heads,
                    s.head_dim,
                );
                let pool = Pool {
                    num_blocks,
                    block_bytes,
                };
                Ok((Runner::Cpu { model, cache }, pool))
            }
            #[cfg(feature = "cuda")]
            ComputeDevice::Cuda(ordinal) => {
                let (gpu, pool) = super::gpu::GpuModel::new(model, ordinal, e, window)?;
                Ok((Runner::Cuda(gpu), pool))
            }
            #[cfg(not(feature = "cuda"))]
            ComputeDevice::Cuda(_) => Err(ModelError::Device(
                "this gateway was built without CUDA support (build with --features cuda)".into(),
            )),
        }
    }

    /// Whether `forward` returns the logits rows of speculative drafts (`draft_rows`); the
    /// CUDA network returns only each sequence's last row.
    pub fn verifies_drafts(&self) -> bool {
        matches!(self, Runner::Cpu { .. })
    }

    /// Frees what the model keeps from step to step (its intermediates' buffers), for an
    /// engine that has had nothing to run for a while.
    pub fn release_buffers(&self) {
        match self {
            Runner::Cpu { model, .. } => model.release_buffers(),
            #[cfg(feature = "cuda")]
            Runner::Cuda(_) => {}
        }
    }

    /// One step: writes every row's K/V into the pool and returns one logits row per
    /// sequence with `want_logits`, in order.
    pub fn forward(&mut self, seqs: &[BatchSeq]) -> Result<Vec<Vec<f32>>, ModelError> {
        match self {
            Runner::Cpu { model, cache } => model.forward(seqs, cache),
            #[cfg(feature = "cuda")]
            Runner::Cuda(gpu) => gpu.forward(seqs),
        }
    }
}
