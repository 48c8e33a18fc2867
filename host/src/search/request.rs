//! Search requests as clients write them: the body of `POST /v1/collections/{name}/search`,
//! and the `rag` settings of a chat request or a tenant's policy.

use serde::Deserialize;
use serde_json::Value;

use super::collection::Mode;

/// A search, as the search endpoint and RAG both take it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SearchRequest {
    pub query: String,
    #[serde(default = "default_top_k")]
    pub top_k: usize,
    #[serde(default)]
    pub mode: Mode,
    #[serde(default)]
    pub fusion: FusionKind,
    #[serde(default = "default_rrf_k")]
    pub rrf_k: f32,
    #[serde(default = "default_alpha")]
    pub alpha: f32,
    pub filter: Option<Value>,
    /// `true` for the tenant's reranker, or a reranker plugin's name.
    pub rerank: Option<RerankChoice>,
    /// First-stage depth per index (default: 50, at least `top_k`).
    pub candidates: Option<usize>,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq)]
#[serde(rename_all = "lowercase")]
pub enum FusionKind {
    #[default]
    Rrf,
    Weighted,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(untagged)]
pub enum RerankChoice {
    On(bool),
    Plugin(String),
}

fn default_top_k() -> usize {
    10
}
fn default_rrf_k() -> f32 {
    60.0
}
fn default_alpha() -> f32 {
    0.5
}

/// Retrieval for a chat request (`"rag": {...}`) or a tenant's default (`[tenants.rag]`):
/// the search settings less the query, which is the last user message.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RagSettings {
    pub collection: String,
    #[serde(default = "default_rag_top_k")]
    pub top_k: usize,
    #[serde(default)]
    pub mode: Mode,
    #[serde(default)]
    pub fusion: FusionKind,
    #[serde(default = "default_rrf_k")]
    pub rrf_k: f32,
    #[serde(default = "default_alpha")]
    pub alpha: f32,
    pub filter: Option<Value>,
    pub rerank: Option<RerankChoice>,
    pub candidates: Option<usize>,
}

/// Most chunks put into one prompt: more would crowd out the conversation.
pub const MAX_RAG_TOP_K: usize = 32;

fn default_rag_top_k() -> usize {
    4
}

impl RagSettings {
    pub fn search(&self, query: String) -> SearchRequest {
        SearchRequest {
            query,
            top_k: self.top_k,
            mode: self.mode,
            fusion: self.fusion,
            rrf_k: self.rrf_k,
            alpha: self.alpha,
            filter: self.filter.clone(),
            rerank: self.rerank.clone(),
            candidates: self.candidates,
        }
    }
}
