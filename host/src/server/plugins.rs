//! `POST /v1/rerank` (Cohere/Jina shape): the documents parsed into candidates, scored by the
//! tenant's reranker plugin through the pipeline's one rerank, and answered with their indices.

use std::sync::Arc;
use std::time::Instant;

use http::StatusCode;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::{json_response, AppState, Response};
use crate::common::Endpoint;
use crate::pipeline::plugin_calls::debug_report;
use crate::pipeline::Error;
use crate::plugins::{Candidate, PluginKind};
use crate::tenancy::Caller;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RerankRequest {
    /// The reranker plugin's name; default: the tenant's configured reranker.
    model: Option<String>,
    query: String,
    documents: Vec<RerankDocument>,
    top_n: Option<usize>,
    #[serde(default = "yes")]
    return_documents: bool,
}

impl RerankRequest {
    fn check(&self) -> Result<(), ApiError> {
        if self.query.trim().is_empty() {
            return Err(ApiError::invalid("query", "`query` must not be empty."));
        }
        if self.documents.is_empty() {
            return Err(ApiError::invalid(
                "documents",
                "`documents` must contain at least one document.",
            ));
        }
        if self.documents.len() > 1000 {
            return Err(ApiError::invalid(
                "documents",
                "`documents` may hold at most 1000 documents.",
            ));
        }
        if self.top_n == Some(0) {
            return Err(ApiError::invalid("top_n", "`top_n` must be at least 1."));
        }
        Ok(())
    }
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RerankDocument {
    Text(String),
    /// `{"text": ..., <metadata>...}`: the other fields become candidate metadata.
    Object(serde_json::Map<String, Value>),
}

/// `POST /v1/rerank` (Cohere/Jina shape), served by the tenant's reranker plugin.
pub async fn rerank(
    state: &Arc<AppState>,
    caller: &Caller,
    body: &[u8],
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let result = rerank_inner(state, caller, body).await;
    let status = crate::tenancy::Outcome::of(&result);
    state
        .tenancy
        .record_plain(caller, "rerank", Endpoint::Rerank, started, status);
    result
}

async fn rerank_inner(
    state: &Arc<AppState>,
    caller: &Caller,
    body: &[u8],
) -> Result<Response, ApiError> {
    let tenant = &caller.tenant;
    let req: RerankRequest = serde_json::from_slice(body)?;
    req.check()?;
    let name = match (&req.model, &tenant.policy.reranker) {
        (Some(m), _) => m.clone(),
        (None, Some(r)) => r.clone(),
        (None, None) => {
            return Err(ApiError::invalid(
                "model",
                format!(
                    "Tenant `{}` has no default reranker; name a reranker plugin in `model`.",
                    tenant.name
                ),
            ))
        }
    };
    let calls = state.plugin_calls();
    let plugin = calls
        .bound(tenant, &name, PluginKind::Reranker)
        .map_err(|e| {
            let named = req.model.is_some() && matches!(e, Error::PluginMissing { .. });
            let e = ApiError::from(e);
            // A named reranker that is not installed is a missing "model", as OpenAI reports it.
            match named {
                true => ApiError {
                    status: StatusCode::NOT_FOUND,
                    ..e
                },
                false => e,
            }
        })?;
    let mut originals = Vec::with_capacity(req.documents.len());
    let mut candidates = Vec::with_capacity(req.documents.len());
    for (i, d) in req.documents.into_iter().enumerate() {
        let (text, metadata, original) = match d {
            RerankDocument::Text(t) => (t.clone(), Vec::new(), Value::String(t)),
            RerankDocument::Object(map) => {
                let Some(Value::String(text)) = map.get("text") else {
                    return Err(ApiError::invalid(
                        "documents",
                        format!("documents[{i}] needs a string `text` field."),
                    ));
                };
                let metadata = crate::plugins::metadata(map.iter().filter(|(k, _)| *k != "text"));
                (text.clone(), metadata, Value::Object(map))
            }
        };
        candidates.push(Candidate {
            id: i.to_string(),
            document_id: None,
            text,
            metadata,
            score: 0.0,
        });
        originals.push(original);
    }
    let top = req.top_n.unwrap_or(usize::MAX);
    let results = calls
        .rerank(caller, plugin, req.query, candidates, top)
        .await?;
    let results: Vec<Value> = results
        .into_iter()
        .map(|(index, score)| {
            let mut r = json!({"index": index, "relevance_score": score});
            if req.return_documents {
                r["document"] = match &originals[index] {
                    Value::String(t) => json!({"text": t}),
                    other => other.clone(),
                };
            }
            r
        })
        .collect();
    let mut body = json!({"id": format!("rerank-{:032x}", rand::random::<u128>()), "model": name, "results": results});
    if let Some(sink) = &caller.debug {
        body["gateway_debug"] = debug_report(sink, None);
    }
    Ok(json_response(StatusCode::OK, &body))
}
