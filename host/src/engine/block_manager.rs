//! The KV block allocator: a fixed pool of blocks, reference counts, and the prefix cache.
//!
//! Invariants:
//! - a block is either referenced (`ref_count > 0`) or on the free queue, never both;
//! - a block in `cached` holds the KV of exactly the tokens its hash names, so it may be shared
//!   by any sequence whose prefix hashes the same (same salt, same tokens, same predecessors);
//! - only full blocks are ever hashed, and a sequence never writes into a hashed block, so shared
//!   blocks are read-only and need no copy-on-write.

use std::collections::hash_map::RandomState;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasher, Hash, Hasher};

pub type BlockId = u32;

/// Cached blocks covering a prompt's prefix, and the hash of the last one (the salt when
/// none), from which the sequence's hash chain continues.
#[derive(Debug, PartialEq, Eq)]
pub struct PrefixHit {
    pub blocks: Vec<BlockId>,
    pub last_hash: u64,
}

pub struct BlockManager {
    block_size: usize,
    ref_counts: Vec<u32>,
    /// Blocks with no references, least recently released first. Entries whose generation no
    /// longer matches `free_gen` are stale (the block was taken back out of the cache) and are
    /// skipped, which keeps removal from the middle O(1).
    free_queue: VecDeque<(BlockId, u32)>,
    free_gen: Vec<u32>,
    num_free: usize,
    block_hash: Vec<Option<u64>>,
    cached: HashMap<u64, BlockId>,
    prefix_caching: bool,
    hash_key: RandomState,
}

impl BlockManager {
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        assert!(num_blocks <= BlockId::MAX as usize, "block ids are u32");
        Self {
            block_size,
            ref_counts: vec![0; num_blocks],
            free_queue: (0..num_blocks as BlockId).map(|b| (b, 0)).collect(),
            free_gen: vec![0; num_blocks],
            num_free: num_blocks,
            block_hash: vec![None; num_blocks],
            cached: HashMap::new(),
            prefix_caching,
            hash_key: RandomState::new(),
        }
    }

    /// Every block free and nothing cached, as when new.
    pub fn reset(&mut self) {
        *self = Self::new(self.num_blocks(), self.block_size, self.prefix_caching);
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.ref_counts.len()
    }

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    pub fn ref_count(&self, block: BlockId) -> u32 {
        self.ref_counts[block as usize]
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }

    /// Takes `n` fresh blocks (reference count 1), evicting cached contents of the least recently
    /// released ones. `None`, with nothing taken, when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let (block, gen) = self.free_queue.pop_front().expect("num_free counts queue");
            if self.free_gen[block as usize] != gen || self.ref_counts[block as usize] != 0 {
                continue;
            }
            if let Some(h) = self.block_hash[block as usize].take() {
                if self.cached.get(&h) == Some(&block) {
                    self.cached.remove(&h);
                }
            }
            self.ref_counts[block as usize] = 1;
            self.num_free -= 1;
            out.push(block);
        }
        Some(out)
    }

    /// Adds a reference to a block found in the prefix cache, taking it off the free queue if
    /// nobody held it.
    pub fn acquire(&mut self, block: BlockId) {
        self.ref_counts[block as usize] += 1;
        if self.ref_counts[block as usize] == 1 {
            self.free_gen[block as usize] = self.free_gen[block as usize].wrapping_add(1);
            self.num_free -= 1;
            // Cache hits leave stale entries behind; drop them before the queue outgrows the pool.
            if self.free_queue.len() > 2 * self.ref_counts.len() {
                let (gens, rcs) = (&self.free_gen, &self.ref_counts);
                self.free_queue
                    .retain(|&(b, g)| gens[b as usize] == g && rcs[b as usize] == 0);
            }
        }
    }

    /// Drops one reference to each block. Blocks that reach zero go back to the free queue; the
    /// ones holding cached prefixes go to the back so they are evicted last. `blocks` is released
    /// in reverse so a sequence's tail is evicted before its (more shareable) head.
    pub fn release(&mut self, blocks: &[BlockId]) {
        for &block in blocks.iter().rev() {
            let rc = &mut self.ref_counts[block as usize];
            assert!(*rc > 0, "double free of block {block}");
            *rc -= 1;
            if *rc == 0 {
                let gen = self.free_gen[block as usize].wrapping_add(1);
                self.free_gen[block as usize] = gen;
                if self.block_hash[block as usize].is_some() {
                    self.free_queue.push_back((block, gen));
                } else {
                    self.free_queue.push_front((block, gen));
                }
                self.num_free += 1;
            }
        }
    }

    /// Hash of a full block given its predecessor's hash (or the salt for the first block).
    /// Keyed with a per-process random key: with a fixed key, a client could search for token
    /// sequences whose hash collides with another request's prefix and be served its KV.
    pub fn chain_hash(&self, parent: u64, tokens: &[u32]) -> u64 {
        let mut h = self.hash_key.build_hasher();
        parent.hash(&mut h);
        tokens.hash(&mut h);
        h.finish()
    }

    /// Cached blocks holding a prefix of `tokens`. The last token is never covered, so the
    /// caller always computes at least one token (it needs that token's logits).
    pub fn lookup_prefix(&self, salt: u64, tokens: &[u32]) -> PrefixHit {
        let mut hit = PrefixHit {
            blocks: Vec::new(),
            last_hash: salt,
        };
        if !self.prefix_caching || tokens.is_empty() {
            return hit;
        }
        let full = (tokens.len() - 1) / self.block_size;
        for chunk in tokens.chunks(self.block_size).take(full) {
            let h = self.chain_hash(hit.last_hash, chunk);
            match self.cached.get(&h) {
                Some(&b) => {
                    hit.blocks.push(b);
                    hit.last_hash = h;
                }
                None => break,
            }
        }
        hit
    }

    /// Records that `block` now holds the full block whose chained hash is `hash`.
    pub fn register(&mut self, block: BlockId, hash: u64) {
        if !self.prefix_caching {
            return;
        }
        self.block_hash[block as usize] = Some(hash);
        self.cached.entry(hash).or_insert(block);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_and_free_round_trip() {
        let mut bm = BlockManager::new(4, 16, false);
        let a = bm.allocate(3).unwrap();
        assert_eq!(bm.num_free(), 1);
        assert!(
            bm.allocate(2).is_none(),
            "cannot hand out more than is free"
        );
        assert_eq!(bm.num_free(), 1, "a failed allocation takes nothing");
        bm.release(&a);
        assert_eq!(bm.num_free(), 4);
        let b = bm.allocate(4).unwrap();
        let mut sorted = b.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            vec![0, 1, 2, 3],
            "every block comes back exactly once"
        );
    }

    #[test]
    fn refcounted_block_is_freed_by_last_holder() {
        let mut bm = BlockManager::new(2, 4, true);
        let a = bm.allocate(1).unwrap();
        bm.acquire(a[0]);
        assert_eq!(bm.ref_count(a[0]), 2);
        bm.release(&a);
        assert_eq!(bm.num_free(), 1);
        bm.release(&a);
        assert_eq!(bm.num_free(), 2);
    }

    #[test]
    #[should_panic(expected = "double free")]
    fn double_free_panics() {
        let mut bm = BlockManager::new(2, 4, false);
        let a = bm.allocate(1).unwrap();
        bm.release(&a);
        bm.release(&a);
    }

    #[test]
    fn prefix_cache_hits_full_blocks_and_survives_release() {
        let mut bm = BlockManager::new(8, 4, true);
        let tokens: Vec<u32> = (0..10).collect();
        let blocks = bm.allocate(3).unwrap();
        let h0 = bm.chain_hash(7, &tokens[0..4]);
        let h1 = bm.chain_hash(h0, &tokens[4..8]);
        bm.register(blocks[0], h0);
        bm.register(blocks[1], h1);
        bm.release(&blocks);
        // Same salt and prefix: both full blocks hit even though nobody holds them.
        assert_eq!(
            bm.lookup_prefix(7, &tokens).blocks,
            vec![blocks[0], blocks[1]]
        );
        assert_eq!(
            bm.lookup_prefix(7, &tokens).last_hash,
            h1,
            "the chain continues from the last hit"
        );
        // Another salt (another tenant) never sees them.
        assert!(bm.lookup_prefix(8, &tokens).blocks.is_empty());
        // A prompt that is exactly the cached tokens leaves its last block to be computed.
        assert_eq!(bm.lookup_prefix(7, &tokens[..8]).blocks, vec![blocks[0]]);
        // Diverging second block: only the first hits.
        let mut other = tokens.clone();
        other[5] = 99;
        assert_eq!(bm.lookup_prefix(7, &other).blocks, vec![blocks[0]]);
        // Acquiring a cached free block takes it off the free queue.
        bm.acquire(blocks[0]);
        assert_eq!(bm.num_free(), 7);
        // Allocating everything else evicts the unheld cached block but not the held one.
        let rest = bm.allocate(7).unwrap();
        assert!(!rest.contains(&blocks[0]));
        assert_eq!(bm.lookup_prefix(7, &tokens).blocks, vec![blocks[0]]);
    }

    #[test]
    fn repeated_cache_hits_do_not_grow_the_free_queue() {
        let mut bm = BlockManager::new(4, 4, true);
        let a = bm.allocate(1).unwrap();
        bm.register(a[0], 9);
        bm.release(&a);
        for _ in 0..1000 {
            bm.acquire(a[0]);
            bm.release(&a);
        }
        assert!(
            bm.free_queue.len() <= 2 * 4 + 1,
            "queue holds {}",
            bm.free_queue.len()
        );
        assert_eq!(
            bm.allocate(4).unwrap().len(),
            4,
            "every block is still handed out once"
        );
    }

    #[test]
    fn unhashed_blocks_are_reused_before_cached_ones() {
        let mut bm = BlockManager::new(2, 4, true);
        let a = bm.allocate(2).unwrap();
        bm.register(a[0], 42);
        bm.release(&a);
        let b = bm.allocate(1).unwrap();
        assert_eq!(b[0], a[1], "the uncached block goes first");
    }
}
