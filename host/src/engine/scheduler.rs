//! Iteration-level (continuous) batching decisions. Pure bookkeeping over sequences and the
//! block manager: no model, no I/O, no clocks, so every decision is unit-tested.
//!
//! Each step: running sequences first (oldest first), each asking for all its uncomputed tokens
//! (one for a decode, a chunk for a prefill) within the token budget; when blocks run out the
//! newest running sequence is preempted by recompute (blocks freed, pushed back to the front of
//! the queue with its generated tokens kept). Then waiting sequences are admitted while the batch
//! has room and free blocks stay above the watermark; nothing is admitted in a step that
//! preempted.
//!
//! Admission order is weighted fair queuing between owners (tenants, identified by their
//! cache salt): each request gets a virtual finish tag `max(V, owner's last tag) + 1/weight`
//! and the smallest tag goes first, so under contention owners are admitted in proportion to
//! their weights and a burst from one cannot starve another. Preempted sequences go first.

use std::collections::{HashMap, VecDeque};

use super::block_manager::{BlockId, BlockManager};

pub type SeqId = u64;

#[derive(Debug)]
pub struct Sequence {
    pub id: SeqId,
    /// Prompt followed by the tokens generated so far.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    pub num_computed: usize,
    pub blocks: Vec<BlockId>,
    /// Leading blocks already registered in the prefix cache, and the hash of the last one.
    pub num_hashed: usize,
    pub last_hash: u64,
    /// Separates prefix-cache entries of different owners (tenants); the first block's parent.
    pub cache_salt: u64,
    /// Fair-queuing finish tag while waiting (smallest is admitted first).
    pub tag: f64,
    /// Trailing tokens that are unverified speculative drafts: computed with the rest, never
    /// registered in the prefix cache, rolled back by `settle_drafts`.
    pub draft: usize,
}

impl Sequence {
    pub fn new(id: SeqId, prompt: Vec<u32>, cache_salt: u64) -> Self {
        Self {
            id,
            prompt_len: prompt.len(),
            tokens: prompt,
            num_computed: 0,
            blocks: Vec::new(),
            num_hashed: 0,
            last_hash: cache_salt,
            cache_salt,
            tag: 0.0,
            draft: 0,
        }
    }

    /// Drops the drafts (unverified tokens) at the end.
    fn drop_drafts(&mut self, n: usize) {
        let n = n.min(self.draft);
        self.tokens.truncate(self.tokens.len() - n);
        self.draft -= n;
    }

    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }
}

/// One sequence's share of a step: compute tokens `start..start + len`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scheduled {
    pub id: SeqId,
    pub start: usize,
    pub len: usize,
}

#[derive(Debug, Default)]
pub struct Step {
    pub scheduled: Vec<Scheduled>,
    pub preempted: Vec<SeqId>,
}

pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub watermark_blocks: usize,
}

pub struct Scheduler {
    cfg: SchedulerConfig,
    pub blocks: BlockManager,
    pub waiting: VecDeque<Sequence>,
    /// Admission order: the last one is the newest, the first to be preempted.
    pub running: Vec<Sequence>,
    /// Virtual time: the tag of the last admitted sequence.
    vtime: f64,
    /// Each owner's latest finish tag.
    last_tag: HashMap<u64, f64>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig, blocks: BlockManager) -> Self {
        Self {
            cfg,
            blocks,
            waiting: VecDeque::new(),
            running: Vec::new(),
            vtime: 0.0,
            last_tag: HashMap::new(),
        }
    }

    pub fn add(&mut self, mut seq: Sequence, weight: u32) {
        let last = self.last_tag.entry(seq.cache_salt).or_insert(0.0);
        seq.tag = last.max(self.vtime) + 1.0 / weight.max(1) as f64;
        *last = seq.tag;
        self.waiting.push_back(seq);
    }

    /// The waiting sequence to admit next: the smallest tag, the earliest among equals.
    fn next_waiting(&self) -> Option<usize> {
        (0..self.waiting.len()).min_by(|&a, &b| self.waiting[a].tag.total_cmp(&self.waiting[b].tag))
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn running_mut(&mut self, id: SeqId) -> Option<&mut Sequence> {
        self.running.iter_mut().find(|s| s.id == id)
    }

    /// Drops every sequence and starts over with an empty block pool.
    pub fn reset(&mut self) {
        self.waiting.clear();
        self.running.clear();
        self.blocks.reset();
    }

    /// Removes a sequence wherever it is and frees its blocks at once.
    pub fn remove(&mut self, id: SeqId) -> Option<Sequence> {
        let seq = if let Some(i) = self.running.iter().position(|s| s.id == id) {
            self.running.remove(i)
        } else {
            let i = self.waiting.iter().position(|s| s.id == id)?;
            self.waiting.remove(i)?
        };
        self.blocks.release(&seq.blocks);
        Some(seq)
    }

    fn preempt(&mut self, index: usize) -> SeqId {
        let mut seq = self.running.remove(index);
        seq.drop_drafts(seq.draft);
        self.blocks.release(&seq.blocks);
        seq.blocks.clear();
        seq.num_computed = 0;
        seq.num_hashed = 0;
        seq.last_hash = seq.cache_salt;
        seq.tag = f64::NEG_INFINITY;
        let id = seq.id;
        self.waiting.push_front(seq);
        id
    }

    /// The next engine step: running sequences first, then, unless one had to be preempted,
    /// newly admitted ones.
    pub fn schedule(&mut self) -> Step {
        let mut step = Step::default();
        let budget = self.continue_running(&mut step, self.cfg.max_num_batched_tokens);
        if step.preempted.is_empty() {
            self.admit_waiting(&mut step, budget);
        }
        step
    }

    /// Running sequences take their next chunk (a decode token, drafts, or more of a prompt)
    /// in order, as far as `budget` tokens go; out of blocks, the newest is preempted. Returns
    /// the budget left.
    fn continue_running(&mut self, step: &mut Step, mut budget: usize) -> usize {
        let mut i = 0;
        while i < self.running.len() {
            let seq = &mut self.running[i];
            // Drafts are verified whole or not at all: trim the ones the budget cannot take.
            let over = (seq.tokens.len() - seq.num_computed).saturating_sub(budget);
            seq.drop_drafts(over);
            let want = (seq.tokens.len() - seq.num_computed).min(budget);
            if want == 0 {
                i += 1;
                continue;
            }
            let need = self
                .blocks
                .blocks_for(seq.num_computed + want)
                .saturating_sub(seq.blocks.len());
            if let Some(new) = self.blocks.allocate(need) {
                let seq = &mut self.running[i];
                seq.blocks.extend(new);
                step.scheduled.push(Scheduled {
                    id: seq.id,
                    start: seq.num_computed,
                    len: want,
                });
                budget -= want;
                i += 1;
                continue;
            }
            // Out of blocks: first give up drafts, then the newest sequence gives its blocks
            // back, which may be this one.
            if self.running[i].draft > 0 {
                let d = self.running[i].draft;
                self.running[i].drop_drafts(d);
                continue;
            }
            let victim = self.running.len() - 1;
            let id = self.preempt(victim);
            step.scheduled.retain(|s| s.id != id);
            step.preempted.push(id);
        }
        budget
    }

    /// Waiting requests join, in fair order, while the batch, `budget` and the free blocks
    /// above the watermark allow; a prompt's cached prefix is taken from the prefix cache.
    fn admit_waiting(&mut self, step: &mut Step, mut budget: usize) {
        while self.running.len() < self.cfg.max_num_seqs && budget > 0 {
            let Some(next) = self.next_waiting() else {
                break;
            };
            let seq = &self.waiting[next];
            let hit = self.blocks.lookup_prefix(seq.cache_salt, &seq.tokens);
            let hits = hit.blocks;
            let cached_tokens = hits.len() * self.blocks.block_size();
            let want = (seq.tokens.len() - cached_tokens).min(budget);
            let need = self.blocks.blocks_for(cached_tokens + want) - hits.len();
            let revived = hits
                .iter()
                .filter(|&&b| self.blocks.ref_count(b) == 0)
                .count();
            if self.blocks.num_free() < need + revived + self.cfg.watermark_blocks {
                break;
            }
            let mut seq = self.waiting.remove(next).expect("index from next_waiting");
            self.vtime = self.vtime.max(seq.tag);
            for &b in &hits {
                self.blocks.acquire(b);
            }
            let new = self.blocks.allocate(need).expect("checked free blocks");
            seq.last_hash = hit.last_hash;
            seq.num_hashed = hits.len();
            seq.blocks = hits;
            seq.blocks.extend(new);
            seq.num_computed = cached_tokens;
            step.scheduled.push(Scheduled {
                id: seq.id,
                start: cached_tokens,
                len: want,
            });
            budget -= want;
            self.running.push(seq);
        }
    }

    /// Marks a scheduled chunk as computed and registers the blocks it filled in the prefix
    /// cache. Returns true when the sequence has no uncomputed tokens left (time to sample).
    pub fn complete(&mut self, s: &Scheduled) -> bool {
        let bs = self.blocks.block_size();
        let Some(i) = self.running.iter().position(|q| q.id == s.id) else {
            return false;
        };
        let seq = &mut self.running[i];
        seq.num_computed = s.start + s.len;
        while (seq.num_hashed + 1) * bs <= seq.num_computed - seq.draft {
            let range = seq.num_hashed * bs..(seq.num_hashed + 1) * bs;
            let h = self.blocks.chain_hash(seq.last_hash, &seq.tokens[range]);
            self.blocks.register(seq.blocks[seq.num_hashed], h);
            seq.last_hash = h;
            seq.num_hashed += 1;
        }
        seq.num_computed == seq.tokens.len()
    }

    /// After drafts were verified and the accepted ones re-pushed as generated tokens: K/V
    /// stays valid only for tokens before the last one, and blocks beyond what the tokens need
    /// go back to the pool (their slots held rejected drafts).
    pub fn settle_drafts(&mut self, id: SeqId) {
        let Some(seq) = self.running.iter_mut().find(|q| q.id == id) else {
            return;
        };
        seq.draft = 0;
        seq.num_computed = seq.num_computed.min(seq.tokens.len().saturating_sub(1));
        let keep = self.blocks.blocks_for(seq.tokens.len()).max(seq.num_hashed);
        if seq.blocks.len() > keep {
            let extra = seq.blocks.split_off(keep);
            self.blocks.release(&extra);
        }
    }

    /// Tokens stored in allocated blocks over their capacity, across running sequences.
    pub fn kv_utilisation(&self) -> f64 {
        let bs = self.blocks.block_size();
        let (mut used, mut cap) = (0usize, 0usize);
        for s in &self.running {
            used += s.num_computed;
            cap += s.blocks.len() * bs;
        }
        if cap == 0 {
            1.0
        } else {
            used as f64 / cap as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(blocks: usize, max_seqs: usize, budget: usize, prefix: bool) -> Scheduler {
        Scheduler::new(
            SchedulerConfig {
                max_num_seqs: max_seqs,
                max_num_batched_tokens: budget,
                watermark_blocks: 0,
            },
            BlockManager::new(blocks, 4, prefix),
        )
    }

    fn prompt(n: usize, base: u32) -> Vec<u32> {
        (0..n as u32).map(|t| t + base).collect()
    }

    fn run_step(s: &mut Scheduler) -> Step {
        let step = s.schedule();
        for sc in &step.scheduled {
            if s.complete(sc) {
                s.running_mut(sc.id).unwrap().tokens.push(7);
            }
        }
        step
    }

    #[test]
    fn admission_is_weighted_fair_between_owners() {
        // One slot: admissions happen one at a time, in tag order.
        let mut s = sched(64, 1, 64, false);
        // Owner 2 (weight 1) queued its burst first; owner 1 has weight 3.
        for i in 0..12 {
            s.add(Sequence::new(100 + i, prompt(2, 0), 2), 1);
        }
        for i in 0..12 {
            s.add(Sequence::new(i, prompt(2, 0), 1), 3);
        }
        let mut order = Vec::new();
        for _ in 0..16 {
            let step = run_step(&mut s);
            let id = step.scheduled[0].id;
            order.push(if id >= 100 { 'b' } else { 'a' });
            s.remove(id);
        }
        let a = order.iter().filter(|&&c| c == 'a').count();
        assert_eq!(a, 12, "{order:?}");
        assert!(
            !order[..4].iter().all(|&c| c == 'b'),
            "the earlier burst must not starve: {order:?}"
        );
        // An owner that was idle gets no credit for it: it joins at the current virtual time.
        // Virtual time is 4 (owner 2's fourth tag): the newcomer's tag is 5, level with owner
        // 2's next, which queued earlier; with credit from time 0 it would have jumped ahead.
        s.add(Sequence::new(200, prompt(2, 0), 3), 1);
        let mut next = || {
            let id = run_step(&mut s).scheduled[0].id;
            s.remove(id);
            id
        };
        assert_eq!([next(), next()], [104, 200]);
    }

    #[test]
    fn admits_and_batches_prefill_with_decode() {
        let mut s = sched(16, 8, 64, false);
        s.add(Sequence::new(1, prompt(5, 0), 0), 1);
        let step = run_step(&mut s);
        assert_eq!(
            step.scheduled,
            vec![Scheduled {
                id: 1,
                start: 0,
                len: 5
            }]
        );
        s.add(Sequence::new(2, prompt(3, 100), 0), 1);
        let step = run_step(&mut s);
        // Sequence 1 decodes its sampled token while sequence 2 prefills, in one step.
        assert_eq!(
            step.scheduled,
            vec![
                Scheduled {
                    id: 1,
                    start: 5,
                    len: 1
                },
                Scheduled {
                    id: 2,
                    start: 0,
                    len: 3
                }
            ]
        );
    }

    #[test]
    fn long_prompt_is_chunked_by_token_budget() {
        let mut s = sched(16, 8, 8, false);
        s.add(Sequence::new(1, prompt(20, 0), 0), 1);
        let lens: Vec<usize> = (0..3).map(|_| run_step(&mut s).scheduled[0].len).collect();
        assert_eq!(lens, vec![8, 8, 4]);
        assert_eq!(
            s.running[0].generated(),
            &[7],
            "sampled only after the last chunk"
        );
    }

    #[test]
    fn respects_max_num_seqs_and_watermark() {
        let mut s = sched(16, 2, 64, false);
        for id in 0..3 {
            s.add(Sequence::new(id, prompt(4, 0), 0), 1);
        }
        assert_eq!(run_step(&mut s).scheduled.len(), 2);
        assert_eq!(s.waiting.len(), 1);

        let mut s = Scheduler::new(
            SchedulerConfig {
                max_num_seqs: 8,
                max_num_batched_tokens: 64,
                watermark_blocks: 2,
            },
            BlockManager::new(4, 4, false),
        );
        s.add(Sequence::new(1, prompt(8, 0), 0), 1);
        s.add(Sequence::new(2, prompt(4, 0), 0), 1);
        let step = s.schedule();
        assert_eq!(
            step.scheduled.len(),
            1,
            "second would leave fewer than 2 free blocks"
        );
    }

    #[test]
    fn preempts_newest_when_blocks_run_out_and_resumes_it() {
        // 4 blocks of 4 tokens. Two sequences of 8 tokens fill the pool; the next decode needs a
        // fifth block, so the newest is preempted and the oldest keeps going.
        let mut s = sched(4, 8, 64, false);
        s.add(Sequence::new(1, prompt(8, 0), 0), 1);
        s.add(Sequence::new(2, prompt(8, 50), 0), 1);
        run_step(&mut s);
        assert_eq!(s.blocks.num_free(), 0);
        let step = run_step(&mut s);
        assert_eq!(step.preempted, vec![2]);
        assert_eq!(
            step.scheduled,
            vec![Scheduled {
                id: 1,
                start: 8,
                len: 1
            }]
        );
        assert_eq!(
            s.waiting.front().unwrap().tokens.len(),
            9,
            "generated token kept"
        );
        assert_eq!(s.waiting.front().unwrap().num_computed, 0);
        // Once sequence 1 finishes, sequence 2 is recomputed from scratch, generated token too.
        s.remove(1);
        let step = run_step(&mut s);
        assert_eq!(
            step.scheduled,
            vec![Scheduled {
                id: 2,
                start: 0,
                len: 9
            }]
        );
    }

    #[test]
    fn cancel_frees_blocks_immediately() {
        let mut s = sched(8, 8, 64, false);
        s.add(Sequence::new(1, prompt(10, 0), 0), 1);
        run_step(&mut s);
        assert_eq!(s.blocks.num_free(), 5);
        assert!(s.remove(1).is_some());
        assert_eq!(s.blocks.num_free(), 8);
        assert!(s.is_idle());
        s.add(Sequence::new(2, prompt(3, 0), 0), 1);
        assert!(
            s.remove(2).is_some(),
            "waiting sequences can be cancelled too"
        );
    }

    #[test]
    fn shared_prefix_reuses_blocks_per_salt() {
        let mut s = sched(16, 8, 64, true);
        s.add(Sequence::new(1, prompt(10, 0), 5), 1);
        run_step(&mut s);
        s.add(Sequence::new(2, prompt(10, 0), 5), 1);
        s.add(Sequence::new(3, prompt(10, 0), 6), 1);
        let step = run_step(&mut s);
        let two = step.scheduled.iter().find(|x| x.id == 2).unwrap();
        let three = step.scheduled.iter().find(|x| x.id == 3).unwrap();
        assert_eq!((two.start, two.len), (8, 2), "two full blocks reused");
        assert_eq!(
            (three.start, three.len),
            (0, 10),
            "other salt shares nothing"
        );
        let b1 = &s.running.iter().find(|x| x.id == 1).unwrap().blocks;
        let b2 = &s.running.iter().find(|x| x.id == 2).unwrap().blocks;
        assert_eq!(b1[..2], b2[..2]);
        assert_eq!(s.blocks.ref_count(b1[0]), 2);
    }

    #[test]
    fn kv_utilisation_counts_partial_blocks() {
        let mut s = sched(16, 8, 64, false);
        s.add(Sequence::new(1, prompt(6, 0), 0), 1);
        run_step(&mut s);
        assert!((s.kv_utilisation() - 6.0 / 8.0).abs() < 1e-9);
    }

    #[test]
    fn drafts_are_computed_then_rolled_back_without_entering_the_prefix_cache() {
        // Blocks of 4 tokens; a 6-token prompt, then one sampled token and 5 drafts.
        let mut s = sched(16, 4, 64, true);
        s.add(Sequence::new(1, prompt(6, 100), 0), 1);
        run_step(&mut s);
        let seq = s.running_mut(1).unwrap();
        assert_eq!((seq.tokens.len(), seq.num_computed), (7, 6));
        seq.tokens.extend([1, 2, 3, 4, 5]);
        seq.draft = 5;
        let step = s.schedule();
        assert_eq!(step.scheduled[0].len, 6, "the last token and every draft");
        assert_eq!(s.running_mut(1).unwrap().blocks.len(), 3);
        assert!(s.complete(&step.scheduled[0]));
        let seq = s.running_mut(1).unwrap();
        assert_eq!(
            seq.num_hashed, 1,
            "only blocks of verified tokens are hashed"
        );
        // Two drafts accepted, then a different token sampled: 7 + 2 + 1 tokens.
        seq.tokens.truncate(7);
        seq.tokens.extend([1, 2, 9]);
        s.settle_drafts(1);
        let seq = s.running_mut(1).unwrap();
        assert_eq!((seq.draft, seq.num_computed, seq.blocks.len()), (0, 9, 3));
        // Nothing accepted: the extra block goes back.
        seq.tokens.extend([4, 4, 4]);
        seq.draft = 3;
        let step = s.schedule();
        assert!(s.complete(&step.scheduled[0]));
        let free = s.blocks.num_free();
        let seq = s.running_mut(1).unwrap();
        seq.tokens.truncate(10);
        seq.tokens.push(5);
        s.settle_drafts(1);
        let seq = s.running_mut(1).unwrap();
        assert_eq!((seq.num_computed, seq.tokens.len()), (10, 11));
        assert_eq!(seq.blocks.len(), 3);
        assert_eq!(s.blocks.num_free(), free + 1);
    }

    #[test]
    fn drafts_are_trimmed_to_the_token_budget_and_dropped_on_preemption() {
        let mut s = sched(16, 4, 4, false);
        s.add(Sequence::new(1, prompt(3, 100), 0), 1);
        run_step(&mut s);
        let seq = s.running_mut(1).unwrap();
        seq.tokens.extend([1, 2, 3, 4, 5, 6]);
        seq.draft = 6;
        let step = s.schedule();
        assert_eq!(
            step.scheduled[0].len, 4,
            "budget 4: the last token and 3 drafts"
        );
        assert_eq!(s.running_mut(1).unwrap().draft, 3);
        assert!(s.complete(&step.scheduled[0]));
    }
}
