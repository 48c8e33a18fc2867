//! Choosing a replica: least load, unless a replica that likely holds the request's prompt
//! prefix in its KV cache is not overloaded (SGLang's cache-aware policy, with prompt prefixes
//! hashed in blocks instead of kept in a radix tree).

use std::collections::HashMap;
use std::hash::{Hash, Hasher};

/// Bytes of prompt per hashed block: prefixes are matched to this granularity.
const BLOCK: usize = 256;
/// Blocks hashed per prompt: prefixes longer than this match as this long.
const MAX_BLOCKS: usize = 64;

/// The prompt's prefix as a chain of block hashes: entry `i` stands for the first `i + 1`
/// blocks (whole ones only) of `text`, seeded by the tenant, since the gateway's prefix cache
/// is per tenant too.
pub fn prefix_chain(tenant: &str, text: &str) -> Vec<u64> {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    tenant.hash(&mut h);
    text.as_bytes()
        .chunks_exact(BLOCK)
        .take(MAX_BLOCKS)
        .map(|block| {
            block.hash(&mut h);
            h.finish()
        })
        .collect()
}

/// Which replica served each prefix last, bounded: the oldest half goes when it is full.
pub struct Affinity {
    map: HashMap<u64, (usize, u64)>,
    tick: u64,
    cap: usize,
}

impl Affinity {
    pub fn new(cap: usize) -> Self {
        Self {
            map: HashMap::new(),
            tick: 0,
            cap,
        }
    }

    /// The replica that served the longest known prefix of `chain`, and its length in blocks.
    pub fn lookup(&self, chain: &[u64]) -> Option<(usize, usize)> {
        chain
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, h)| self.map.get(h).map(|&(r, _)| (r, i + 1)))
    }

    pub fn insert(&mut self, chain: &[u64], replica: usize) {
        self.tick += 1;
        for h in chain {
            self.map.insert(*h, (replica, self.tick));
        }
        if self.map.len() > self.cap {
            let mut ticks: Vec<u64> = self.map.values().map(|&(_, t)| t).collect();
            let mid = ticks.len() / 2;
            let (_, median, _) = ticks.select_nth_unstable(mid);
            let median = *median;
            self.map.retain(|_, &mut (_, t)| t > median);
        }
    }
}

/// When a replica counts as overloaded next to the least loaded one: more than `abs`
/// requests more, and more than `rel` times as many.
pub struct Balance {
    pub abs: usize,
    pub rel: f64,
}

impl Balance {
    fn overloaded(&self, load: usize, min: usize) -> bool {
        load > min + self.abs && load as f64 > min as f64 * self.rel
    }

    /// Among `loads` (None: not available), the prefix's replica unless it is unavailable or
    /// overloaded, else the least loaded one (ties rotate with `turn`). The flag says the
    /// prefix decided.
    pub fn choose(
        &self,
        loads: &[Option<usize>],
        affine: Option<(usize, usize)>,
        turn: usize,
    ) -> Option<(usize, bool)> {
        let min = loads.iter().flatten().min().copied()?;
        if let Some((r, _)) = affine {
            if let Some(Some(load)) = loads.get(r) {
                if !self.overloaded(*load, min) {
                    return Some((r, true));
                }
            }
        }
        let n = loads.len();
        (0..n)
            .map(|k| (turn + k) % n)
            .find(|&i| loads[i] == Some(min))
            .map(|i| (i, false))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chains_share_the_blocks_of_a_shared_prefix_and_differ_by_tenant() {
        let system = "You are the CRM assistant. ".repeat(40);
        let a = prefix_chain("acme", &format!("{system}What is my quota?"));
        let b = prefix_chain("acme", &format!("{system}Who owns the Initech deal?"));
        let shared = system.len() / BLOCK;
        assert!(shared >= 3);
        assert_eq!(a[..shared], b[..shared]);
        let other = prefix_chain("globex", &format!("{system}What is my quota?"));
        assert!(a.iter().all(|h| !other.contains(h)));
        assert!(prefix_chain("acme", "short").is_empty());
    }

    #[test]
    fn longest_prefix_wins_and_the_table_stays_bounded() {
        let mut aff = Affinity::new(100);
        let base = "x".repeat(BLOCK * 4);
        aff.insert(&prefix_chain("t", &base[..BLOCK * 2]), 0);
        aff.insert(&prefix_chain("t", &base), 1);
        assert_eq!(aff.lookup(&prefix_chain("t", &base)), Some((1, 4)));
        for i in 0..200 {
            aff.insert(&prefix_chain("t", &format!("{i:0>300}")), 2);
        }
        assert!(aff.map.len() <= 101);
        // The newest entries survive.
        assert_eq!(
            aff.lookup(&prefix_chain("t", &format!("{:0>300}", 199))),
            Some((2, 1))
        );
    }

    #[test]
    fn prefix_holds_until_its_replica_is_overloaded() {
        let rule = Balance { abs: 4, rel: 1.5 };
        assert_eq!(
            rule.choose(&[Some(3), Some(0)], Some((0, 2)), 0),
            Some((0, true))
        );
        assert_eq!(
            rule.choose(&[Some(9), Some(2)], Some((0, 2)), 0),
            Some((1, false))
        );
        // Unavailable prefix replica: least loaded of the rest; ties rotate.
        assert_eq!(
            rule.choose(&[None, Some(1), Some(1)], Some((0, 2)), 0),
            Some((1, false))
        );
        assert_eq!(
            rule.choose(&[None, Some(1), Some(1)], None, 2),
            Some((2, false))
        );
        assert_eq!(rule.choose(&[None, None], None, 0), None);
    }
}
