//! The paged KV cache and the CPU attention that reads it through block tables.
//!
//! Layout, per layer, for K and for V: `[num_blocks][num_kv_heads][block_size][head_dim]` f16.
//! f16 halves the bytes attention streams per context token (decode attention is bound by
//! reading the cache) and doubles the tokens a memory budget holds; values are computed and
//! accumulated in f32. Attention reads one KV head's rows at a time, so each head's rows of a
//! block are contiguous: with the heads of a position side by side instead, a head's rows were
//! 128 of every 384 bytes (SmolLM2) and the hardware prefetchers fetched the lines between.
//! A token's slot is `block * block_size + offset`; a sequence's block table maps its logical
//! block `pos / block_size` to a physical block, so sequences grow one block at a time, share
//! prefix blocks, and never need their cache copied or concatenated. The pool is allocated zeroed
//! up front (the OS hands out pages lazily, so untouched blocks cost no RSS).

use half::f16;
use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};

use super::cpu_ops::{dot, softmax};
use super::team::{split_by_cost, split_mut, Team};

mod blocked;

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

    /// Where the cached row of `kv_head` at offset `o` of physical block `block` starts.
    fn at(&self, block: usize, o: usize, kv_head: usize) -> usize {
        ((block * self.num_kv_heads + kv_head) * self.block_size + o) * self.head_dim
    }

    /// Scatters the new tokens' K and V (`[tokens][num_kv_heads][head_dim]`) into their slots.
    pub fn write(&mut self, layer: usize, slots: &[usize], k: &[f32], v: &[f32]) {
        let (d, nkv, bs) = (self.head_dim, self.num_kv_heads, self.block_size);
        // (token, KV head) rows in the order of `k` and `v`.
        let rows = k.chunks_exact(d).zip(v.chunks_exact(d));
        for (i, (k, v)) in rows.enumerate() {
            let at = self.at(slots[i / nkv] / bs, slots[i / nkv] % bs, i % nkv);
            let (kc, vc) = &mut self.layers[layer];
            kc.reinterpret_cast_mut::<f16>()[at..at + d].convert_from_f32_slice(k);
            vc.reinterpret_cast_mut::<f16>()[at..at + d].convert_from_f32_slice(v);
        }
    }

    /// Causal attention for a batch of new tokens (`q`: `[tokens][num_heads][head_dim]`), each
    /// attending to its own sequence's cached tokens up to and including itself. Query head `h`
    /// reads KV head `h / (num_heads / num_kv_heads)` (GQA/MQA). Writes `[tokens][num_heads][head_dim]`.
    ///
    /// One work item is a (token, KV head) pair, split across the team by cost. A thread takes
    /// its items' consecutive rows of a sequence in blocks (`blocked`): the queries of a
    /// block's rows and of the KV head's group are scored side by side, so a cached K or V row
    /// is widened once per block. A row's results do not depend on its block.
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
        let items = rows.len() * self.num_kv_heads;
        let span = |pos: usize| span(window, pos);
        let work_size: usize = rows.iter().map(|r| span(r.1).len()).sum::<usize>() * num_heads * d;
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
            span(rows[idx / self.num_kv_heads].1).len() + 8
        });
        let slices = split_mut(out, ranges.iter().map(|r| r.len() * group * d));
        let call = Call {
            cache: self,
            kc,
            vc,
            rows: &rows,
            seqs,
            q,
            group,
            scale,
            window,
        };
        let part = |p: usize| {
            let mut o = slices[p].lock().unwrap_or_else(|e| e.into_inner());
            call.items(ranges[p].clone(), &mut o);
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
        scratch: &mut blocked::Scratch,
    ) {
        let (d, bs) = (self.head_dim, self.block_size);
        let group = q.len() / d;
        // Offsets of each context token's K/V for this head, walking the table block by block.
        let ctx = span.len();
        let (scores, rows, offsets) = scratch.alone();
        offsets.clear();
        offsets.extend(
            table[span.start / bs..]
                .iter()
                .flat_map(|&b| (0..bs).map(move |o| self.at(b as usize, o, kv_head)))
                .skip(span.start % bs)
                .take(ctx),
        );
        scores.clear();
        scores.resize(group * ctx, 0.0);
        // One cached row at a time, widened to f32 once and used by every head of the group.
        let mut row_f32 = vec![0f32; d];
        for (j, &base) in offsets.iter().enumerate() {
            if let Some(&ahead) = offsets.get(j + PREFETCH_ROWS) {
                prefetch_row(kc, ahead, d);
                prefetch_row(vc, ahead, d);
            }
            kc[base..base + d].convert_to_f32_slice(&mut row_f32);
            for g in 0..group {
                scores[g * ctx + j] = dot(&q[g * d..(g + 1) * d], &row_f32) * scale;
            }
        }
        for g in 0..group {
            softmax(&mut scores[g * ctx..(g + 1) * ctx]);
        }
        out.fill(0.0);
        blocked::values_alone(vc, offsets, d, scores, out, rows);
    }
}

/// How many positions ahead a lone row's K and V rows are prefetched. A decode step reads
/// every sequence's cache once, from memory (SmolLM2 at concurrency 8: 21 MB a step), one
/// 128-byte row per position and KV head; left to the hardware, each position waited for its
/// row.
const PREFETCH_ROWS: usize = 8;

/// Asks for the `d` f16 values at `at` of `cache` to be brought into cache (a hint: never
/// faults, whatever the address).
#[inline(always)]
fn prefetch_row(cache: &[f16], at: usize, d: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = cache.as_ptr().wrapping_add(at).cast::<i8>();
        for line in (0..d * 2).step_by(64) {
            // SAFETY: prefetching is a hint that cannot fault, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (cache, at, d);
}

/// The positions a row at `pos` attends to: a sliding window sees the last `w`, its own
/// included.
fn span(window: Option<usize>, pos: usize) -> std::ops::Range<usize> {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))..pos + 1
}

/// One attention call's inputs, for the parts of the team.
struct Call<'a> {
    cache: &'a KvCache,
    kc: &'a [f16],
    vc: &'a [f16],
    /// (sequence, absolute position) of every batch row.
    rows: &'a [(usize, usize)],
    seqs: &'a [AttnSeq<'a>],
    q: &'a [f32],
    group: usize,
    scale: f32,
    window: Option<usize>,
}

impl Call<'_> {
    /// Items `range` ((row, KV head) pairs) into `o`: per KV head, the rows in blocks of
    /// consecutive rows of one sequence.
    fn items(&self, range: std::ops::Range<usize>, o: &mut [f32]) {
        let nkv = self.cache.num_kv_heads;
        // Blocks need head sizes in whole eights (`cpu_ops::dot`'s partial sums); any other
        // size takes every row alone, which the model loader does not otherwise refuse.
        let per_block = match self.cache.head_dim.is_multiple_of(8) {
            true => blocked::LANES / self.group.clamp(1, blocked::LANES),
            false => 1,
        };
        let mut scratch = blocked::Scratch::default();
        for kv_head in 0..nkv {
            let ts: Vec<usize> = range
                .clone()
                .filter(|idx| idx % nkv == kv_head)
                .map(|idx| idx / nkv)
                .collect();
            let rows = self.rows;
            for run in ts.chunk_by(|a, b| rows[*a].0 == rows[*b].0 && b - a == 1) {
                for ts in run.chunks(per_block) {
                    match ts {
                        [t] => self.one_row(kv_head, *t, range.start, o, &mut scratch),
                        _ => self.block(kv_head, ts, range.start, o, &mut scratch),
                    }
                }
            }
        }
    }

    /// A row alone (decode): its group's queries one dot product at a time, as cheap as a
    /// block for one row's few lanes (a block of SmolLM2's three heads decoded ~7% slower).
    /// The same arithmetic as a block's, so a row's bits do not depend on which it took.
    fn one_row(
        &self,
        kv_head: usize,
        t: usize,
        first: usize,
        o: &mut [f32],
        scratch: &mut blocked::Scratch,
    ) {
        let c = self.cache;
        let (d, group, (s, pos)) = (c.head_dim, self.group, self.rows[t]);
        let at = (t * c.num_kv_heads + kv_head) * group * d;
        c.attend_group(
            self.kc,
            self.vc,
            self.seqs[s].block_table,
            span(self.window, pos),
            kv_head,
            &self.q[at..at + group * d],
            self.scale,
            &mut o[at - first * group * d..][..group * d],
            scratch,
        );
    }

    /// Rows `ts` (consecutive, one sequence; two or more, so the group fits half the lanes)
    /// against KV head `kv_head`, into `o` (the part's output, from item `first`).
    fn block(
        &self,
        kv_head: usize,
        ts: &[usize],
        first: usize,
        o: &mut [f32],
        scratch: &mut blocked::Scratch,
    ) {
        let c = self.cache;
        let (d, group, bs) = (c.head_dim, self.group, c.block_size);
        let table = self.seqs[self.rows[ts[0]].0].block_table;
        let offset = |pos: usize| c.at(table[pos / bs] as usize, pos % bs, kv_head);
        let spans: Vec<_> = ts
            .iter()
            .map(|&t| span(self.window, self.rows[t].1))
            .collect();
        let at = |t: usize| (t * c.num_kv_heads + kv_head) * group * d;
        let qs: Vec<&[f32]> = ts.iter().map(|&t| &self.q[at(t)..][..group * d]).collect();
        // Each row's slice of the output, cut off the part's in order.
        let mut outs: Vec<&mut [f32]> = Vec::with_capacity(ts.len());
        let (mut rest, mut taken): (&mut [f32], usize) = (o, 0);
        for &t in ts {
            let start = at(t) - first * group * d;
            let (_, tail) = std::mem::take(&mut rest).split_at_mut(start - taken);
            let (mine, tail) = tail.split_at_mut(group * d);
            outs.push(mine);
            (rest, taken) = (tail, start + group * d);
        }
        let b = blocked::Block {
            kc: self.kc,
            vc: self.vc,
            offset: &offset,
            head_dim: d,
            heads: group,
            scale: self.scale,
            spans: &spans,
        };
        b.attend(&qs, &mut outs, scratch);
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

    /// A row attends alike in a prefill block and alone (as decode computes it), with and
    /// without a sliding window, with SmolLM2's group of three, a group that fills a block's
    /// lanes, and one too large to block at all.
    #[test]
    fn a_row_attends_alike_alone_and_in_a_block() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let shapes = [
            (12, 2, 128, None),
            (9, 3, 64, None),
            (4, 1, 64, Some(5)),
            (8, 1, 32, None),
            (20, 1, 32, None),
        ];
        for &(nh, nkv, d, window) in &shapes {
            let (bs, len) = (4, 23);
            let mut cache = KvCache::new(1, 8, bs, nkv, d);
            let table: Vec<u32> = (0..8).rev().collect();
            let row = nkv * d;
            let k: Vec<f32> = (0..len * row)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let v: Vec<f32> = (0..len * row)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let slots: Vec<usize> = (0..len)
                .map(|p| table[p / bs] as usize * bs + p % bs)
                .collect();
            cache.write(0, &slots, &k, &v);
            let q: Vec<f32> = (0..len * nh * d)
                .map(|_| rng.random_range(-1.0..1.0))
                .collect();
            let team = Team::new(2);
            let run = |start: usize, n: usize| {
                let seq = AttnSeq {
                    block_table: &table,
                    start,
                    len: n,
                };
                let mut out = vec![0f32; n * nh * d];
                let q = &q[start * nh * d..(start + n) * nh * d];
                cache.attention(&team, 0, q, &[seq], nh, 0.125, window, &mut out);
                out
            };
            let all = run(0, len);
            for p in 0..len {
                let alone = run(p, 1);
                assert!(
                    alone == all[p * nh * d..(p + 1) * nh * d],
                    "nh={nh} nkv={nkv} d={d} window={window:?} row {p}"
                );
            }
        }
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
