//! What crosses the device seam: the batch a runner is given (block tables, start positions,
//! tokens) and the KV pool it reports. The scheduler builds the one and sizes the block
//! manager from the other; the CPU network (`model.rs`) and the CUDA one (`gpu/`) both take
//! the same batch, so neither knows the other nor the runner that picks between them.

/// One sequence's rows in a step.
#[derive(Debug, Clone, Copy)]
pub struct BatchSeq<'a> {
    pub block_table: &'a [u32],
    pub start: usize,
    pub tokens: &'a [u32],
    /// Return logits for this sequence's last row.
    pub want_logits: bool,
    /// With `want_logits`, also return logits for this many rows before the last (the rows
    /// of speculative drafts being verified), in row order.
    pub draft_rows: usize,
    /// Positions before this one hold the prompt's tokens: their rows take the prompt
    /// kernels (unless the prompt is shorter than `quant::PROMPT_KERNEL_MIN`, and except the
    /// rows of a short last KV block, which a cached prompt recomputes: see the CPU model's
    /// `prompt_kernel_rows`), which round differently from the kernels of generated rows (see
    /// `QuantMatrix::matmul_rows`). A sequence recomputed after preemption keeps its original
    /// prompt length, so every row takes the same kernels as the first time.
    pub prompt_len: usize,
}

/// Whether every row of `batch` is a generated one (decode, or drafts being verified): the
/// steps whose time says what verification rows cost (`spec::StepCosts`).
pub fn generated_only(batch: &[BatchSeq]) -> bool {
    batch
        .iter()
        .all(|b| b.want_logits && b.start >= b.prompt_len && b.tokens.len() == 1 + b.draft_rows)
}

/// The KV pool a runner allocated.
#[derive(Debug, Clone, Copy)]
pub struct Pool {
    pub num_blocks: usize,
    /// Bytes of one block across all layers, K and V.
    pub block_bytes: usize,
}
