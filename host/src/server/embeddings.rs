//! `POST /v1/embeddings` (OpenAI shape) over the native sentence encoder.

use std::sync::Arc;

use base64::Engine as _;
use http::StatusCode;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::openai::Prompt;
use super::{json_response, AppState, Response};
use crate::search::embedder::{EmbedError, Embedder};
use crate::tenancy::Caller;

/// OpenAI's own cap on inputs per request.
const MAX_INPUTS: usize = 2048;

#[derive(Deserialize)]
struct EmbeddingRequest {
    model: String,
    input: Prompt,
    encoding_format: Option<String>,
    dimensions: Option<usize>,
}

/// Texts to tokenize, or token lists as given: one of the two.
type Inputs = (Option<Vec<String>>, Option<Vec<Vec<u32>>>);

/// The texts or token lists of `input`, each non-empty, 1 to `MAX_INPUTS` of them.
fn inputs(input: Prompt) -> Result<Inputs, ApiError> {
    let (texts, tokens) = match input {
        Prompt::Text(t) => (Some(vec![t]), None),
        Prompt::Texts(ts) => (Some(ts), None),
        Prompt::Tokens(ids) => (None, Some(vec![ids])),
        Prompt::TokenLists(l) => (None, Some(l)),
    };
    let n = texts
        .as_ref()
        .map_or_else(|| tokens.as_ref().map_or(0, Vec::len), Vec::len);
    if n == 0 || n > MAX_INPUTS {
        return Err(ApiError::invalid(
            "input",
            format!("`input` must hold 1 to {MAX_INPUTS} items."),
        ));
    }
    if texts
        .as_ref()
        .is_some_and(|ts| ts.iter().any(|t| t.is_empty()))
        || tokens.as_ref().is_some_and(|l| l.iter().any(Vec::is_empty))
    {
        return Err(ApiError::invalid(
            "input",
            "`input` must not contain empty strings or empty token arrays.",
        ));
    }
    Ok((texts, tokens))
}

pub async fn embeddings(
    state: &Arc<AppState>,
    caller: &Caller,
    body: &[u8],
) -> Result<Response, ApiError> {
    let req: EmbeddingRequest = serde_json::from_slice(body)?;
    let embedder = state.embedder(&caller.tenant, &req.model)?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(ApiError::invalid(
                "encoding_format",
                format!("`encoding_format` must be `float` or `base64`, got {other:?}."),
            ))
        }
    };
    if let Some(d) = req.dimensions.filter(|&d| d != embedder.dim) {
        return Err(ApiError::invalid(
            "dimensions",
            format!("Model `{}` produces {}-dimensional embeddings and cannot shorten them to {d}; leave out `dimensions`.", embedder.name, embedder.dim),
        ));
    }
    let (texts, tokens) = inputs(req.input)?;
    let e = embedder.clone();
    let ids = match texts {
        Some(ts) => crate::pipeline::blocking("tokenizer", move || e.tokenize(&ts))
            .await?
            .map_err(|e| ApiError::invalid("input", e.to_string()))?,
        None => tokens.unwrap_or_default(),
    };
    let prompt_tokens: u64 = ids.iter().map(|i| i.len() as u64).sum();
    let reservation = state
        .tenancy
        .reserve_tokens(
            caller,
            &embedder.name,
            "embeddings",
            prompt_tokens,
            prompt_tokens,
        )
        .await
        .map_err(ApiError::denied)?;
    let e = embedder.clone();
    let vectors = crate::pipeline::blocking("embedding", move || e.embed(&ids))
        .await?
        .map_err(|e| match e {
            EmbedError::TooLong { .. } | EmbedError::BadToken { .. } => {
                ApiError::invalid("input", e.to_string())
            }
            other => ApiError::internal(other.to_string()),
        })
        .inspect_err(|_| reservation.end(crate::tenancy::Outcome::Failed))?;
    reservation.settle(prompt_tokens, 0, crate::tenancy::Outcome::Ok);
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = if base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    Ok(json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": data, "model": embedder.name, "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens}}),
    ))
}

pub fn model_card(e: &Embedder, created: u64) -> Value {
    json!({"id": e.name, "object": "model", "created": created, "owned_by": "gateway", "max_model_len": e.max_tokens, "dimensions": e.dim})
}
