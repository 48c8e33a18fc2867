//! The paged KV cache and the CPU attention that reads it through block tables.
//!
//! Layout, per layer, for K and for V: `[num_blocks][block_size][num_kv_heads][head_dim]` f16.
//! f16 halves the bytes attention streams per context token (decode attention is bound by
//! reading the cache) and doubles the tokens a memory budget holds; values are computed and
//! accumulated in f32.
//! A token's slot is `block * block_size + offset`; a sequence's block table maps its logical
//! block `pos / block_size` to a physical block, so sequences grow one block at a time, share
//! prefix blocks, and never need their cache copied or concatenated. The pool is allocated zeroed
//! up front (the OS hands out pages lazily, so untouched blocks cost no RSS).

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use super::cpu_ops::{axpy, dot, softmax};
use super::team::{split_by_cost, split_mut, Team};

pub struct KvCache {
    /// f16 bit patterns, allocated as `u16` zeros: `vec![0u16; n]` comes from `calloc`, whose
    /// pages the OS maps lazily, while `vec![f16::ZERO; n]` would write (and so commit) every page.
    layers: Vec<(Vec<u16>, Vec<u16>)>,
    block_size: usize,
    num_kv_heads: usize,
    head_dim: usize,
    num_blocks: usize,
}

/// One sequence's part of a batched attention call.
#[derive(Debug, Clone)]
pub struct AttnSeq<'a> {
    pub block_table: &'a [u32],
    /// Position of the sequence's first new token (tokens before it are already cached).
    pub start: usize,
    /// New tokens of this sequence in the batch; their rows follow the previous sequence's.
    pub len: usize,
}

impl KvCache {
    /// Bytes one block takes across all layers, K and V.
    pub fn block_bytes(
        num_layers: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> usize {
        2 * num_layers * block_size * num_kv_heads * head_dim * std::mem::size_of::<f16>()
    }

    pub fn new(
        num_layers: usize,
        num_blocks: usize,
        block_size: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Self {
        let per_layer = num_blocks * block_size * num_kv_heads * head_dim;
        Self {
            layers: (0..num_layers)
                .map(|_| (vec![0u16; per_layer], vec![0u16; per_layer]))
                .collect(),
            block_size,
            num_kv_heads,
            head_dim,
            num_blocks,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Scatters the new tokens' K and V (`[tokens][num_kv_heads][head_dim]`) into their slots.
    pub fn write(&mut self, layer: usize, slots: &[usize], k: &[f32], v: &[f32]) {
        let row = self.num_kv_heads * self.head_dim;
        let (kc, vc) = &mut self.layers[layer];
        let (kc, vc): (&mut [f16], &mut [f16]) =
            (kc.reinterpret_cast_mut(), vc.reinterpret_cast_mut());
        for (i, &slot) in slots.iter().enumerate() {
            kc[slot * row..(slot + 1) * row].convert_from_f32_slice(&k[i * row..(i + 1) * row]);
            vc[slot * row..(slot + 1) * row].convert_from_f32_slice(&v[i * row..(i + 1) * row]);
        }
    }

    /// Causal attention for a batch of new tokens (`q`: `[tokens][num_heads][head_dim]`), each
    /// attending to its own sequence's cached tokens up to and including itself. Query head `h`
    /// reads KV head `h / (num_heads / num_kv_heads)` (GQA/MQA). Writes `[tokens][num_heads][head_dim]`.
    ///
    /// One work item is a (token, KV head) pair: the query heads of its group are scored
    /// together, so each cached K and V row is read once per group rather than once per head.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        team: &Team,
        layer: usize,
        q: &[f32],
        seqs: &[AttnSeq],
        num_heads: usize,
        scale: f32,
        window: Option<usize>,
        out: &mut [f32],
    ) {
        let d = self.head_dim;
        let group = num_heads / self.num_kv_heads;
        // (sequence, absolute position) of every batch row.
        let rows: Vec<(usize, usize)> = seqs
            .iter()
            .enumerate()
            .flat_map(|(s, seq)| (seq.start..seq.start + seq.len).map(move |p| (s, p)))
            .collect();
        let (kc, vc) = &self.layers[layer];
        let (kc, vc): (&[f16], &[f16]) = (kc.reinterpret_cast(), vc.reinterpret_cast());
        let work = |idx: usize, o: &mut [f32], scores: &mut Vec<f32>| {
            let (t, kv_head) = (idx / self.num_kv_heads, idx % self.num_kv_heads);
            let (s, pos) = rows[t];
            let qg = &q[idx * group * d..(idx + 1) * group * d];
            // A sliding window sees the last `w` positions, its own included.
            let first = window.map_or(0, |w| (pos + 1).saturating_sub(w));
            let span = first..pos + 1;
            self.attend_group(
                kc,
                vc,
                seqs[s].block_table,
                span,
                kv_head,
                qg,
                scale,
                o,
                scores,
            );
        };
        let items = rows.len() * self.num_kv_heads;
        let span = |pos: usize| window.map_or(pos + 1, |w| (pos + 1).min(w));
        let work_size: usize = rows.iter().map(|r| span(r.1)).sum::<usize>() * num_heads * d;
        // Splitting across threads costs a microsecond or two; tiny steps stay on this thread.
        let parts = if work_size < 16 * 1024 {
            1
        } else {
            team.threads().min(items)
        };
        // Equal shares of work, not of rows: in a causal prefill the last rows attend to many
        // more positions than the first (split by rows, one thread of two did three quarters of
        // a 512-token prompt's attention while the other waited). The constant is a row's
        // fixed cost (its query, output and softmax), in positions.
        let ranges = split_by_cost(items, parts, |idx| {
            span(rows[idx / self.num_kv_heads].1) + 8
        });
        let slices = split_mut(out, ranges.iter().map(|r| r.len() * group * d));
        let part = |p: usize| {
            let mut o = slices[p].lock().unwrap_or_else(|e| e.into_inner());
            let mut scores = Vec::new();
            for (i, idx) in ranges[p].clone().enumerate() {
                work(idx, &mut o[i * group * d..(i + 1) * group * d], &mut scores);
            }
        };
        if parts == 1 {
            part(0);
        } else {
            team.run(&|p, _| part(p));
        }
    }

    /// Attention of the `group` query heads in `q` (`[group][head_dim]`) that share `kv_head`,
    /// over the positions `span` of a block table.
    #[allow(clippy::too_many_arguments)]
    fn attend_group(
        &self,
        kc: &[f16],
        vc: &[f16],
        table: &[u32],
        span: std::ops::Range<usize>,
        kv_head: usize,
        q: &[f32],
        scale: f32,
        out: &mut [f32],
        scores: &mut Vec<f32>,
    ) {
        let (d, bs) = (self.head_dim, self.block_size);
        let group = q.len() / d;
        let row = self.num_kv_heads * d;
        // Offsets of each context token's K/V for this head, walking the table block by block.
        let ctx = span.len();
        let offsets = table[span.start / bs..]
            .iter()
            .flat_map(|&b| (0..bs).map(move |o| (b as usize * bs + o) * row + kv_head * d))
            .skip(span.start % bs)
            .take(ctx);
        scores.clear();
        scores.resize(group * ctx, 0.0);
        // One cached row at a time, widened to f32 once and used by every head of the group.
        let mut row_f32 = vec![0f32; d];
        for (j, base) in offsets.clone().enumerate() {
            kc[base..base + d].convert_to_f32_slice(&mut row_f32);
            for g in 0..group {
                scores[g * ctx + j] = dot(&q[g * d..(g + 1) * d], &row_f32) * scale;
            }
        }
        for g in 0..group {
            softmax(&mut scores[g * ctx..(g + 1) * ctx]);
        }
        out.fill(0.0);
        for (j, base) in offsets.enumerate() {
            vc[base..base + d].convert_to_f32_slice(&mut row_f32);
            for g in 0..group {
                axpy(&mut out[g * d..(g + 1) * d], scores[g * ctx + j], &row_f32);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Textbook attention over contiguous per-sequence K/V with a causal mask.
    #[allow(clippy::too_many_arguments)]
    fn naive(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        start: usize,
        len: usize,
        nh: usize,
        nkv: usize,
        d: usize,
        scale: f32,
    ) -> Vec<f32> {
        let mut out = vec![0f32; len * nh * d];
        for t in 0..len {
            let pos = start + t;
            for h in 0..nh {
                let kh = h / (nh / nkv);
                let qv = &q[(t * nh + h) * d..][..d];
                let s: Vec<f32> = (0..=pos)
                    .map(|j| {
                        qv.iter()
                            .zip(&k[(j * nkv + kh) * d..][..d])
                            .map(|(a, b)| a * b)
                            .sum::<f32>()
                            * scale
                    })
                    .collect();
                let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                let z: f32 = s.iter().map(|x| (x - m).exp()).sum();
                for (j, sj) in s.iter().enumerate() {
                    let w = (sj - m).exp() / z;
                    for i in 0..d {
                        out[(t * nh + h) * d + i] += w * v[(j * nkv + kh) * d + i];
                    }
                }
            }
        }
        out
    }

    #[test]
    fn paged_equals_naive_on_random_data() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for &(bs, nh, nkv, d) in &[(16, 9, 3, 64), (4, 4, 4, 32), (8, 8, 1, 16)] {
            let num_blocks = 64;
            let mut cache = KvCache::new(1, num_blocks, bs, nkv, d);
            // Three sequences: a fresh prefill, a decode after a long context, a chunk mid-prompt.
            let shapes = [(0usize, 7usize), (37, 1), (bs * 2 + 3, 5)];
            let mut free: Vec<u32> = (0..num_blocks as u32).rev().collect();
            let mut tables = Vec::new();
            let mut full_kv = Vec::new();
            for &(start, len) in &shapes {
                let total = start + len;
                // Scattered, non-contiguous physical blocks.
                let table: Vec<u32> = (0..total.div_ceil(bs))
                    .map(|_| free.remove(rng.random_range(0..free.len())))
                    .collect();
                let row = nkv * d;
                // Values the f16 cache stores exactly, so the check isolates the paging and the
                // arithmetic from the (intended) storage rounding.
                let mut rand_f16 = || f16::from_f32(rng.random_range(-1.0..1.0)).to_f32();
                let k: Vec<f32> = (0..total * row).map(|_| rand_f16()).collect();
                let v: Vec<f32> = (0..total * row).map(|_| rand_f16()).collect();
                let slots: Vec<usize> = (0..total)
                    .map(|p| table[p / bs] as usize * bs + p % bs)
                    .collect();
                cache.write(0, &slots, &k, &v);
                tables.push(table);
                full_kv.push((k, v));
            }
            let rows: usize = shapes.iter().map(|s| s.1).sum();
            let q: Vec<f32> = (0..rows * nh * d)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let seqs: Vec<AttnSeq> = shapes
                .iter()
                .zip(&tables)
                .map(|(&(start, len), t)| AttnSeq {
                    block_table: t,
                    start,
                    len,
                })
                .collect();
            let scale = 1.0 / (d as f32).sqrt();
            let mut out = vec![0f32; rows * nh * d];
            cache.attention(&Team::new(2), 0, &q, &seqs, nh, scale, None, &mut out);
            let mut row = 0;
            for (i, &(start, len)) in shapes.iter().enumerate() {
                let qs = &q[row * nh * d..(row + len) * nh * d];
                let want = naive(
                    qs,
                    &full_kv[i].0,
                    &full_kv[i].1,
                    start,
                    len,
                    nh,
                    nkv,
                    d,
                    scale,
                );
                let got = &out[row * nh * d..(row + len) * nh * d];
                let err = want
                    .iter()
                    .zip(got)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(
                    err < 1e-5,
                    "bs={bs} nh={nh} nkv={nkv} d={d} seq {i}: max error {err}"
                );
                row += len;
            }
        }
    }
}
