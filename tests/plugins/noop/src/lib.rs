//! A reranker that does nothing: the floor of plugin invocation cost in the benchmark.

use guest_sdk::reranker::{Candidate, Guest, PluginError, Scored};

struct Plugin;

impl Guest for Plugin {
    fn rerank(_query: String, _candidates: Vec<Candidate>) -> Result<Vec<Scored>, PluginError> {
        Ok(Vec::new())
    }
}

guest_sdk::export_reranker!(Plugin);
