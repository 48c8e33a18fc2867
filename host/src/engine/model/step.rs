//! One step's rows as the layers see them: tokens, positions, cache slots, attention spans,
//! and which rows take the prompt kernels.

use super::super::paged_attention::AttnSeq;
use super::super::quant::PROMPT_KERNEL_MIN;
use super::BatchSeq;

/// The positions, cache slots and attention spans of one step's rows.
pub(super) struct Step<'a> {
    pub(super) tokens: Vec<u32>,
    pub(super) positions: Vec<usize>,
    pub(super) slots: Vec<usize>,
    pub(super) attn_seqs: Vec<AttnSeq<'a>>,
    /// Whether each row takes the prompt kernels (`prompt_kernel_rows`).
    pub(super) prompt: Vec<bool>,
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
    pub(super) fn new(seqs: &[BatchSeq<'a>], bs: usize) -> Self {
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

    pub(super) fn rows(&self) -> usize {
        self.tokens.len()
    }
}
