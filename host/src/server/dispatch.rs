//! Which model serves a chat, completion or embedding request: the one it names, or, when that one is
//! saturated (or, upstream, no replica could take it), the first model of its fallback chain
//! that can. Local models run in `completions.rs`, upstream ones in `upstream.rs`. The model
//! that served is in the `x-gateway-model` header and in the ledger.

use std::borrow::Cow;
use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;

use super::error::ApiError;
use super::upstream::{self, Forwarded};
use super::{completions, embeddings, AppState, Response};
use crate::tenancy::Caller;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Api {
    Chat,
    Completion,
    Embeddings,
}

impl Api {
    /// The path under an OpenAI base URL.
    pub(super) fn path(self) -> &'static str {
        match self {
            Api::Chat => "/chat/completions",
            Api::Completion => "/completions",
            Api::Embeddings => "/embeddings",
        }
    }

    /// The endpoint as the ledger names it.
    pub(super) fn endpoint(self) -> &'static str {
        match self {
            Api::Chat => "chat",
            Api::Completion => "completions",
            Api::Embeddings => "embeddings",
        }
    }
}

#[derive(Deserialize)]
struct Named {
    model: String,
}

pub(super) async fn serve(
    state: &Arc<AppState>,
    caller: &Caller,
    body: &[u8],
    api: Api,
) -> Result<Response, ApiError> {
    let named: Named = serde_json::from_slice(body)?;
    let chain = state.fallback_chain(&named.model);
    let last = chain.len() - 1;
    let mut exhausted = None;
    for (i, name) in chain.iter().enumerate() {
        if i > 0 && !caller.tenant.allows_model(name) {
            continue;
        }
        if i < last && saturated(state, name) {
            continue;
        }
        let body = match i {
            0 => Cow::Borrowed(body),
            _ => Cow::Owned(renamed(body, name)?),
        };
        let served = match state.upstreams.get(name) {
            Some(pool) => {
                match upstream::forward(state, caller, pool, &body, api, i < last).await {
                    Forwarded::Done(r) => r,
                    Forwarded::Exhausted(e) => {
                        exhausted = Some(e);
                        continue;
                    }
                }
            }
            None => match api {
                Api::Chat => completions::chat(state, caller, &body).await,
                Api::Completion => completions::completion(state, caller, &body).await,
                Api::Embeddings => embeddings::embeddings(state, caller, &body).await,
            },
        };
        if i > 0 {
            state
                .metrics
                .upstream
                .fallbacks
                .with_label_values(&[&named.model, name])
                .inc();
        }
        let mut response = served?;
        if let Ok(v) = http::HeaderValue::from_str(name) {
            response.headers_mut().insert("x-gateway-model", v);
        }
        return Ok(response);
    }
    Err(exhausted.unwrap_or_else(|| {
        ApiError::overloaded(format!(
            "Model `{}` and its fallbacks are saturated; retry shortly.",
            named.model
        ))
    }))
}

/// The model takes no new requests for now: a local engine's queue or every replica's is past
/// its `saturated_waiting`, or no replica is available.
fn saturated(state: &AppState, name: &str) -> bool {
    if let Some(pool) = state.upstreams.get(name) {
        return pool.saturated();
    }
    match (state.engines.get(name), state.fallbacks.get(name)) {
        (Some(engine), Some(f)) if f.saturated_waiting > 0 => {
            engine.waiting() > f.saturated_waiting
        }
        _ => false,
    }
}

/// The request body with `model` replaced, for a fallback.
fn renamed(body: &[u8], model: &str) -> Result<Vec<u8>, ApiError> {
    let mut v: serde_json::Map<String, Value> = serde_json::from_slice(body)?;
    v.insert("model".into(), Value::String(model.to_string()));
    Ok(serde_json::to_vec(&v).expect("JSON values serialize"))
}
