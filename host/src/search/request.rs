//! Search requests as clients write them: the body of `POST /v1/collections/{name}/search`,
//! and the `rag` settings of a chat request or a tenant's policy.

use serde::Deserialize;
use serde_json::{Map, Value};

use super::collection::Mode;

/// A search, as the search endpoint and RAG both take it.
#[derive(Debug, Clone, Deserialize, PartialEq)]
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

/// Retrieval for a chat request (`"rag": {...}`) or a tenant's default (`[tenants.rag]`): a
/// collection and the search to run in it, written flat (`collection` beside the search
/// fields) with no `query`, which is the last user message.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(try_from = "Map<String, Value>")]
pub struct RagSettings {
    pub collection: String,
    /// The search, with an empty query.
    search: SearchRequest,
}

/// Most chunks put into one prompt: more would crowd out the conversation.
pub const MAX_RAG_TOP_K: usize = 32;

const DEFAULT_RAG_TOP_K: usize = 4;

impl RagSettings {
    pub fn top_k(&self) -> usize {
        self.search.top_k
    }

    pub fn filter(&self) -> Option<&Value> {
        self.search.filter.as_ref()
    }

    pub fn search(&self, query: String) -> SearchRequest {
        SearchRequest {
            query,
            ..self.search.clone()
        }
    }
}

impl TryFrom<Map<String, Value>> for RagSettings {
    type Error = String;

    fn try_from(mut fields: Map<String, Value>) -> Result<Self, String> {
        let collection = match fields.remove("collection") {
            Some(Value::String(c)) => c,
            Some(other) => return Err(format!("`collection` must be a string, not {other}")),
            None => return Err("missing field `collection`".into()),
        };
        if fields.contains_key("query") {
            return Err(
                "unknown field `query`: retrieval searches with the last user message".into(),
            );
        }
        fields
            .entry("top_k")
            .or_insert(Value::from(DEFAULT_RAG_TOP_K));
        fields.insert("query".into(), Value::String(String::new()));
        let search =
            SearchRequest::deserialize(Value::Object(fields)).map_err(|e| e.to_string())?;
        Ok(Self { collection, search })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rag_settings_are_a_collection_and_a_search_without_its_query() {
        let r: RagSettings =
            serde_json::from_value(serde_json::json!({"collection": "kb", "mode": "bm25"}))
                .unwrap();
        let s = r.search("refunds".into());
        assert_eq!((r.collection.as_str(), s.query.as_str()), ("kb", "refunds"));
        assert_eq!(
            (s.top_k, s.mode, s.rrf_k),
            (DEFAULT_RAG_TOP_K, Mode::Bm25, 60.0)
        );
        let t: RagSettings = toml::from_str("collection = \"kb\"\ntop_k = 2").unwrap();
        assert_eq!(t.top_k(), 2);
        for (bad, why) in [
            (
                serde_json::json!({"mode": "bm25"}),
                "missing field `collection`",
            ),
            (
                serde_json::json!({"collection": "kb", "query": "x"}),
                "unknown field `query`",
            ),
            (
                serde_json::json!({"collection": "kb", "depth": 3}),
                "unknown field `depth`",
            ),
        ] {
            let e = serde_json::from_value::<RagSettings>(bad)
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{e}");
        }
    }
}
