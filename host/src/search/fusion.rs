//! Fusing the BM25 and vector rankings into one. Inputs are `(chunk id, score)` lists, best
//! first; outputs likewise, ties broken by id so results are deterministic.

use std::collections::HashMap;

/// Reciprocal rank fusion (Cormack et al.): each list adds `1 / (k + rank)`, rank from 1.
/// Scale-free, so it needs no calibration between BM25 and cosine scores.
pub fn rrf(lists: &[&[(u64, f32)]], k: f32) -> Vec<(u64, f32)> {
    let mut fused: HashMap<u64, f32> = HashMap::new();
    for list in lists {
        for (rank, &(id, _)) in list.iter().enumerate() {
            *fused.entry(id).or_default() += 1.0 / (k + rank as f32 + 1.0);
        }
    }
    sorted(fused)
}

/// Convex combination of min-max normalised scores: `alpha * vector + (1 - alpha) * bm25`
/// (Weaviate's convention: alpha 1 is pure vector). A chunk missing from a list gets 0 there.
pub fn weighted(bm25: &[(u64, f32)], vector: &[(u64, f32)], alpha: f32) -> Vec<(u64, f32)> {
    let mut fused: HashMap<u64, f32> = HashMap::new();
    for (list, w) in [(bm25, 1.0 - alpha), (vector, alpha)] {
        for (id, s) in normalised(list) {
            *fused.entry(id).or_default() += w * s;
        }
    }
    sorted(fused)
}

/// Scores mapped to [0, 1] by the list's own min and max; a list of equal scores maps to 1.
fn normalised(list: &[(u64, f32)]) -> impl Iterator<Item = (u64, f32)> + '_ {
    let (lo, hi) = list
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &(_, s)| {
            (lo.min(s), hi.max(s))
        });
    let span = hi - lo;
    list.iter().map(move |&(id, s)| {
        (
            id,
            if span > f32::EPSILON {
                (s - lo) / span
            } else {
                1.0
            },
        )
    })
}

fn sorted(m: HashMap<u64, f32>) -> Vec<(u64, f32)> {
    let mut v: Vec<_> = m.into_iter().collect();
    v.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rrf_rewards_agreement() {
        let bm25 = [(1, 9.0), (2, 5.0), (3, 1.0)];
        let vec = [(3, 0.9), (1, 0.8), (4, 0.1)];
        let f = rrf(&[&bm25, &vec], 60.0);
        assert_eq!(f[0].0, 1, "first and second beats first and third");
        assert!((f[0].1 - (1.0 / 61.0 + 1.0 / 62.0)).abs() < 1e-6);
        assert_eq!(f.len(), 4);
    }

    #[test]
    fn weighted_follows_alpha() {
        let bm25 = [(1, 10.0), (2, 0.0)];
        let vec = [(2, 0.9), (1, 0.5)];
        assert_eq!(weighted(&bm25, &vec, 0.0)[0], (1, 1.0));
        assert_eq!(weighted(&bm25, &vec, 1.0)[0], (2, 1.0));
        let mid = weighted(&bm25, &vec, 0.5);
        assert_eq!(mid[0], (1, 0.5));
        assert_eq!(mid[1], (2, 0.5));
        // A single-hit list still counts fully.
        assert_eq!(weighted(&[(7, 3.0)], &[], 0.3), vec![(7, 0.7)]);
    }
}
