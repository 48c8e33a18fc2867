//! Paged-attention kernels for NVIDIA GPUs (`src/attention.cu`), the per-row layer kernels
//! around them (`src/layers.cu`), their launchers (feature `cuda`, through cudarc with the
//! driver loaded at run time), and the CPU reference they are tested against. Without the
//! feature only the reference is built.

pub mod reference;

#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "cuda")]
pub mod layers;

/// Context tokens one thread block handles; longer contexts are split into partitions and
/// combined by the reduction kernel (must match `PARTITION_SIZE` in `attention.cu`).
pub const PARTITION_SIZE: usize = 512;

/// Query heads of one KV head a thread block can serve, sharing each K/V load (the `_g<N>`
/// instantiations in `attention.cu`); larger GQA groups take several blocks.
pub const GROUP_TILES: [usize; 4] = [1, 2, 4, 8];

/// The tile a GQA group of `group` query heads per KV head is served with: the smallest that
/// holds it, else the largest (several blocks per KV head).
pub fn group_tile(group: usize) -> usize {
    GROUP_TILES
        .into_iter()
        .find(|&t| t >= group)
        .unwrap_or(GROUP_TILES[GROUP_TILES.len() - 1])
}

/// Head sizes the attention kernel is instantiated for.
pub const HEAD_SIZES: [usize; 4] = [64, 80, 96, 128];

/// The shape of one attention call over a paged cache laid out
/// `[num_blocks][block_size][num_kv_heads][head_size]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    /// Query rows: one per decoding sequence, or one per prompt token in prefill.
    pub rows: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_size: usize,
    pub block_size: usize,
    /// Columns of the block table (its row stride).
    pub max_blocks: usize,
    /// Softmax scale, usually `1 / sqrt(head_size)`.
    pub scale: f32,
}
