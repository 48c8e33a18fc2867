//! A step's per-row metadata, built on the host and uploaded once per step.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::dev_err;
use crate::engine::batch::BatchSeq;
use crate::engine::ModelError;

/// What the kernels need to know about each token row of a step.
pub(super) struct Rows {
    pub rows: usize,
    /// The widest block table; every table is padded to it.
    pub max_blocks: usize,
    tokens: Vec<u32>,
    pos: Vec<u32>,
    /// `[seqs][max_blocks]`.
    tables: Vec<u32>,
    /// Each row's KV slot: block · block_size + offset.
    slots: Vec<i64>,
    /// Each row's sequence (index into the batch).
    row_seq: Vec<u32>,
    /// Each row's context length: its position + 1.
    pub row_ctx: Vec<u32>,
    /// The rows whose logits are wanted (each sequence's last, when asked).
    pub want: Vec<u32>,
}

/// `Rows` in device memory.
pub(super) struct DeviceRows {
    pub tokens: CudaSlice<u32>,
    pub pos: CudaSlice<u32>,
    pub tables: CudaSlice<u32>,
    pub slots: CudaSlice<i64>,
    pub row_seq: CudaSlice<u32>,
    pub row_ctx: CudaSlice<u32>,
}

impl Rows {
    pub fn new(seqs: &[BatchSeq], bs: usize) -> Self {
        let rows: usize = seqs.iter().map(|q| q.tokens.len()).sum();
        let max_blocks = seqs.iter().map(|q| q.block_table.len()).max().unwrap_or(1);
        let max_blocks = max_blocks.max(1);
        let mut r = Self {
            rows,
            max_blocks,
            tokens: Vec::with_capacity(rows),
            pos: Vec::with_capacity(rows),
            tables: vec![0u32; seqs.len() * max_blocks],
            slots: Vec::with_capacity(rows),
            row_seq: Vec::with_capacity(rows),
            row_ctx: Vec::with_capacity(rows),
            want: Vec::new(),
        };
        for (i, q) in seqs.iter().enumerate() {
            r.tables[i * max_blocks..i * max_blocks + q.block_table.len()]
                .copy_from_slice(q.block_table);
            for (j, &t) in q.tokens.iter().enumerate() {
                let p = q.start + j;
                r.tokens.push(t);
                r.pos.push(p as u32);
                r.slots
                    .push(q.block_table[p / bs] as i64 * bs as i64 + (p % bs) as i64);
                r.row_seq.push(i as u32);
                r.row_ctx.push(p as u32 + 1);
            }
            if q.want_logits {
                r.want.push((r.tokens.len() - 1) as u32);
            }
        }
        r
    }

    pub fn upload(&self, st: &Arc<CudaStream>) -> Result<DeviceRows, ModelError> {
        let up = |v: &[u32]| st.clone_htod(v).map_err(dev_err("upload"));
        Ok(DeviceRows {
            tokens: up(&self.tokens)?,
            pos: up(&self.pos)?,
            tables: up(&self.tables)?,
            slots: st.clone_htod(&self.slots).map_err(dev_err("upload"))?,
            row_seq: up(&self.row_seq)?,
            row_ctx: up(&self.row_ctx)?,
        })
    }
}
