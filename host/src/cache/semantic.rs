//! The semantic side of the response cache: per tenant and model, an HNSW index (the search
//! side's `Vectors`) over the embeddings of last user messages whose answers are stored. A
//! point belongs to a bucket, the exact hash of everything else in the request (system
//! prompt, earlier turns, tools, sampling, versions), so a lookup only compares against
//! requests that differ in their last user message alone; a bucket is small, so that search is
//! an exact scan over its live points (perfect recall). Points expire with their answer; the
//! index drops them lazily and holds at most `MAX_POINTS`, oldest out first. Each replica
//! indexes what it stored itself.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::Key;
use crate::search::vectors::Vectors;

/// Points one tenant's index of one model holds.
const MAX_POINTS: usize = 50_000;

#[derive(Default)]
pub struct Semantic {
    indexes: Mutex<HashMap<(String, String), Arc<Index>>>,
}

struct Index {
    vectors: Vectors,
    points: Mutex<Points>,
}

#[derive(Default)]
struct Points {
    next: u64,
    /// By id, which grows with time: the first is the oldest.
    by_id: BTreeMap<u64, Point>,
    buckets: HashMap<Key, HashSet<u64>>,
}

struct Point {
    bucket: Key,
    answer: Key,
    expires: Instant,
}

/// A semantic match: the answer's exact key and how similar its message was.
pub struct Match {
    pub answer: Key,
    pub similarity: f32,
}

impl Semantic {
    fn index(&self, tenant: &str, model: &str, create: bool) -> Option<Arc<Index>> {
        let mut all = self.indexes.lock();
        let k = (tenant.to_string(), model.to_string());
        if let Some(i) = all.get(&k) {
            return Some(i.clone());
        }
        create.then(|| {
            let i = Arc::new(Index {
                vectors: Vectors::build(Vec::new()),
                points: Mutex::default(),
            });
            all.insert(k, i.clone());
            i
        })
    }

    /// The most similar live point of `bucket`, if it reaches `threshold`.
    pub fn find(
        &self,
        tenant: &str,
        model: &str,
        bucket: &Key,
        vector: &[f32],
        threshold: f32,
    ) -> Option<Match> {
        let index = self.index(tenant, model, false)?;
        let allowed = {
            let mut p = index.points.lock();
            let expired = p.expired(bucket);
            if !expired.is_empty() {
                index.vectors.update(&expired, Vec::new());
            }
            p.buckets.get(bucket).cloned()?
        };
        let (id, similarity) = index
            .vectors
            .search(vector, 1, Some(&Arc::new(allowed)))
            .into_iter()
            .next()?;
        if similarity < threshold {
            return None;
        }
        let answer = index.points.lock().by_id.get(&id)?.answer;
        Some(Match { answer, similarity })
    }

    /// Indexes `vector` (unit length) for the answer stored under `answer`.
    pub fn insert(
        &self,
        tenant: &str,
        model: &str,
        bucket: Key,
        vector: Vec<f32>,
        answer: Key,
        ttl: Duration,
    ) {
        let Some(index) = self.index(tenant, model, true) else {
            return;
        };
        let (id, mut removed) = {
            let mut p = index.points.lock();
            let mut removed = p.expired(&bucket);
            // The same answer stored again: its old point goes.
            let same: Vec<u64> = p.buckets.get(&bucket).map_or(Vec::new(), |ids| {
                ids.iter()
                    .copied()
                    .filter(|id| p.by_id.get(id).is_some_and(|pt| pt.answer == answer))
                    .collect()
            });
            for id in same {
                p.remove(id);
                removed.push(id);
            }
            while p.by_id.len() >= MAX_POINTS {
                let Some(oldest) = p.by_id.keys().next().copied() else {
                    break;
                };
                p.remove(oldest);
                removed.push(oldest);
            }
            let id = p.next;
            p.next += 1;
            let expires = Instant::now() + ttl;
            p.by_id.insert(
                id,
                Point {
                    bucket,
                    answer,
                    expires,
                },
            );
            p.buckets.entry(bucket).or_default().insert(id);
            (id, removed)
        };
        removed.sort_unstable();
        index.vectors.update(&removed, vec![(id, vector)]);
    }

    /// Forgets the tenant's points (of `model` only, when given).
    pub fn clear(&self, tenant: &str, model: Option<&str>) {
        self.indexes
            .lock()
            .retain(|(t, m), _| t != tenant || model.is_some_and(|model| model != m));
    }
}

impl Points {
    /// Removes the expired points of `bucket`; returns their ids.
    fn expired(&mut self, bucket: &Key) -> Vec<u64> {
        let now = Instant::now();
        let ids: Vec<u64> = self.buckets.get(bucket).map_or(Vec::new(), |ids| {
            ids.iter()
                .copied()
                .filter(|id| self.by_id.get(id).is_none_or(|p| p.expires <= now))
                .collect()
        });
        for &id in &ids {
            self.remove(id);
        }
        ids
    }

    fn remove(&mut self, id: u64) {
        if let Some(p) = self.by_id.remove(&id) {
            if let Some(ids) = self.buckets.get_mut(&p.bucket) {
                ids.remove(&id);
                if ids.is_empty() {
                    self.buckets.remove(&p.bucket);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(v: &[f32]) -> Vec<f32> {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter().map(|x| x / n).collect()
    }

    #[test]
    fn a_near_message_in_the_same_bucket_matches() {
        let s = Semantic::default();
        let ttl = Duration::from_secs(60);
        s.insert("t", "m", [1; 32], unit(&[1.0, 0.0, 0.0, 0.0]), [9; 32], ttl);
        let near = unit(&[1.0, 0.1, 0.0, 0.0]);
        let m = s.find("t", "m", &[1; 32], &near, 0.95).expect("a match");
        assert_eq!(m.answer, [9; 32]);
        assert!(m.similarity > 0.99);
        assert!(
            s.find("t", "m", &[2; 32], &near, 0.95).is_none(),
            "another bucket"
        );
        assert!(
            s.find("u", "m", &[1; 32], &near, 0.95).is_none(),
            "another tenant"
        );
        let far = unit(&[0.0, 1.0, 0.0, 0.0]);
        assert!(s.find("t", "m", &[1; 32], &far, 0.95).is_none());
        s.clear("t", Some("other"));
        assert!(s.find("t", "m", &[1; 32], &near, 0.95).is_some());
        s.clear("t", None);
        assert!(s.find("t", "m", &[1; 32], &near, 0.95).is_none());
    }

    #[test]
    fn expired_points_do_not_match() {
        let s = Semantic::default();
        let v = unit(&[1.0, 0.0, 0.0, 0.0]);
        s.insert(
            "t",
            "m",
            [1; 32],
            v.clone(),
            [9; 32],
            Duration::from_millis(1),
        );
        std::thread::sleep(Duration::from_millis(5));
        assert!(s.find("t", "m", &[1; 32], &v, 0.5).is_none());
    }
}
