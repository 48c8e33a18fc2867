//! What a search asks a collection and what it answers.

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::filter::Filter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Bm25,
    Vector,
    #[default]
    Hybrid,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum Fusion {
    Rrf { k: f32 },
    Weighted { alpha: f32 },
}

pub struct Query<'a> {
    pub text: &'a str,
    pub top_k: usize,
    pub mode: Mode,
    pub fusion: Fusion,
    pub filter: Option<&'a Filter>,
    /// How many candidates each first stage contributes (at least `top_k`).
    pub candidates: usize,
    /// The query's tokens from `query_tokens`, when the caller already has them (to charge the
    /// tenant before embedding); otherwise they are made here.
    pub tokens: Option<&'a [u32]>,
}

#[derive(Debug, Clone, Serialize)]
pub struct Hit {
    pub id: String,
    pub chunk_id: u64,
    /// Character offsets of the chunk in its document's text.
    pub start: usize,
    pub end: usize,
    pub text: String,
    pub metadata: Arc<Map<String, Value>>,
    pub score: f32,
    pub scores: StageScores,
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct StageScores {
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bm25: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vector: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fused: Option<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rerank: Option<f32>,
}
