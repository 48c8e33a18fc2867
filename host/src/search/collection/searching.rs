//! The read path of a collection: filter → allowed chunk ids → BM25 and vector candidates →
//! fusion → hits materialised from the catalog (live chunks only), texts read outside its lock.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::{
    fusion, internal, Collection, Filter, Fusion, Hit, Mode, Query, SearchError, StageScores,
};

impl Collection {
    /// The tokens the embedder reads for `text` (truncated to its window).
    pub fn query_tokens(&self, text: &str) -> Result<Vec<u32>, SearchError> {
        self.embedder
            .tokenize_truncated(text)
            .map_err(SearchError::embed)
    }

    /// Ranked hits for a query; each carries the scores of the stages that found it.
    pub fn search(&self, q: &Query) -> Result<Vec<Hit>, SearchError> {
        let allowed = self.allowed(q.filter);
        if allowed.as_ref().is_some_and(|a| a.is_empty()) || q.top_k == 0 {
            return Ok(Vec::new());
        }
        let (bm25, vector) = self.first_stage(q, allowed.as_ref())?;
        let ranked = match (q.mode, q.fusion) {
            (Mode::Bm25, _) => bm25.clone(),
            (Mode::Vector, _) => vector.clone(),
            (Mode::Hybrid, Fusion::Rrf { k }) => fusion::rrf(&[&bm25, &vector], k),
            (Mode::Hybrid, Fusion::Weighted { alpha }) => fusion::weighted(&bm25, &vector, alpha),
        };
        let picked = self.pick(q, ranked, bm25, vector);
        let ids: Vec<u64> = picked.iter().map(|h| h.chunk_id).collect();
        let mut texts = self
            .reader()
            .chunk_texts(&ids)
            .map_err(|e| internal("collection store")(&e))?;
        let hits = picked
            .into_iter()
            .filter_map(|mut h| {
                h.text = texts.remove(&h.chunk_id)?;
                Some(h)
            })
            .take(q.top_k)
            .collect();
        Ok(hits)
    }

    /// The chunks a filter admits; None when there is no filter or it admits everything
    /// (`{}` costs no scan). A filter repeated before the next write is answered from the
    /// cache instead of testing every chunk's metadata again.
    fn allowed(&self, filter: Option<&Filter>) -> Option<Arc<HashSet<u64>>> {
        let f = filter.filter(|f| **f != Filter::And(Vec::new()))?;
        let cat = self.catalog.read();
        if let Some(hit) = self.filters.lock().get(f, cat.generation) {
            return Some(hit);
        }
        let ids: Arc<HashSet<u64>> = Arc::new(
            cat.chunks
                .iter()
                .filter(|(_, c)| f.matches(&c.metadata))
                .map(|(id, _)| *id)
                .collect(),
        );
        self.filters.lock().put(f, cat.generation, ids.clone());
        Some(ids)
    }

    /// BM25 and vector candidates (the one the mode does not use stays empty), each ranked.
    #[allow(clippy::type_complexity)]
    fn first_stage(
        &self,
        q: &Query,
        allowed: Option<&Arc<HashSet<u64>>>,
    ) -> Result<(Vec<(u64, f32)>, Vec<(u64, f32)>), SearchError> {
        let depth = q.candidates.max(q.top_k);
        // The query's embedding runs on the encoder thread while BM25 runs here.
        let embedding = match q.mode {
            Mode::Bm25 => None,
            _ => {
                let ids = match q.tokens {
                    Some(t) => t.to_vec(),
                    None => self.query_tokens(q.text)?,
                };
                Some(self.embedder.start(&[ids]).map_err(SearchError::embed)?)
            }
        };
        let bm25 = match q.mode {
            Mode::Vector => Vec::new(),
            _ => self
                .bm25
                .search(q.text, depth, allowed)
                .map_err(|e| internal("BM25 search")(&e))?,
        };
        let vector = match embedding {
            None => Vec::new(),
            Some(started) => {
                let v = started.wait().map_err(SearchError::embed)?;
                self.vectors.search(&v[0], depth, allowed)
            }
        };
        Ok((bm25, vector))
    }

    /// The best live chunks of `ranked` (a few spare, in case one is deleted before its text
    /// is read), chosen under the catalog lock, with each stage's score; texts come later,
    /// outside the lock.
    fn pick(
        &self,
        q: &Query,
        ranked: Vec<(u64, f32)>,
        bm25: Vec<(u64, f32)>,
        vector: Vec<(u64, f32)>,
    ) -> Vec<Hit> {
        let bm25: HashMap<u64, f32> = bm25.into_iter().collect();
        let vector: HashMap<u64, f32> = vector.into_iter().collect();
        let cat = self.catalog.read();
        ranked
            .into_iter()
            .filter_map(|(id, score)| {
                let c = cat.chunks.get(&id)?;
                Some(Hit {
                    id: c.doc.to_string(),
                    chunk_id: id,
                    start: c.start,
                    end: c.end,
                    text: String::new(),
                    metadata: c.metadata.clone(),
                    score,
                    scores: StageScores {
                        bm25: bm25.get(&id).copied(),
                        vector: vector.get(&id).copied(),
                        fused: (q.mode == Mode::Hybrid).then_some(score),
                        rerank: None,
                    },
                })
            })
            .take(q.top_k + 16)
            .collect()
    }
}

/// The chunk sets of the last few filters, each valid for the catalog generation it was
/// computed at. Most searches of an application repeat a handful of filters (a tenant's
/// account, a product line); a collection's memory for them is bounded by `IDS`.
#[derive(Default)]
pub(super) struct FilterCache {
    /// Most recently used last.
    entries: Vec<(Filter, u64, Arc<HashSet<u64>>)>,
}

impl FilterCache {
    const ENTRIES: usize = 16;
    /// Most chunk ids held across entries (~16 bytes each in a set).
    const IDS: usize = 1 << 20;

    fn get(&mut self, f: &Filter, generation: u64) -> Option<Arc<HashSet<u64>>> {
        self.entries.retain(|e| e.1 == generation);
        let at = self.entries.iter().position(|e| e.0 == *f)?;
        let e = self.entries.remove(at);
        let ids = e.2.clone();
        self.entries.push(e);
        Some(ids)
    }

    fn put(&mut self, f: &Filter, generation: u64, ids: Arc<HashSet<u64>>) {
        self.entries.retain(|e| e.1 == generation && e.0 != *f);
        self.entries.push((f.clone(), generation, ids));
        let mut held: usize = self.entries.iter().map(|e| e.2.len()).sum();
        while self.entries.len() > Self::ENTRIES || (held > Self::IDS && self.entries.len() > 1) {
            held -= self.entries.remove(0).2.len();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exists(field: &str) -> Filter {
        Filter::Exists {
            field: field.into(),
            exists: true,
        }
    }

    #[test]
    fn filter_results_are_reused_until_the_next_write() {
        let mut c = FilterCache::default();
        let ids = Arc::new(HashSet::from([1, 2, 3]));
        c.put(&exists("a"), 7, ids.clone());
        assert_eq!(c.get(&exists("a"), 7), Some(ids));
        assert_eq!(c.get(&exists("b"), 7), None);
        assert_eq!(c.get(&exists("a"), 8), None, "a write makes it stale");
        for i in 0..40 {
            c.put(&exists(&i.to_string()), 8, Arc::new(HashSet::from([i])));
        }
        assert_eq!(c.entries.len(), FilterCache::ENTRIES);
        assert!(c.get(&exists("39"), 8).is_some() && c.get(&exists("0"), 8).is_none());
    }
}
