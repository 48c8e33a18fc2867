//! `POST /v1/embeddings` (OpenAI shape): the answer of the native sentence encoder
//! (`pipeline::embeddings`), and the model card of an embedding model.

use std::sync::Arc;

use base64::Engine as _;
use http::StatusCode;
use serde_json::{json, Value};

use super::error::ApiError;
use super::{json_response, AppState, Response};
use crate::search::embedder::Embedder;
use crate::tenancy::Caller;

pub async fn embeddings(
    state: &AppState,
    caller: &Caller,
    embedder: &Arc<Embedder>,
    body: &Value,
) -> Result<Response, ApiError> {
    let done = crate::pipeline::embeddings::run(&state.tenancy, caller, embedder, body).await?;
    let data: Vec<Value> = done
        .vectors
        .into_iter()
        .enumerate()
        .map(|(index, v)| {
            let embedding = if done.base64 {
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                Value::String(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": index, "embedding": embedding})
        })
        .collect();
    let tokens = done.prompt_tokens;
    Ok(json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": data, "model": embedder.name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
    ))
}

pub fn model_card(e: &Embedder, created: u64) -> Value {
    json!({"id": e.name, "object": "model", "created": created, "owned_by": "gateway", "max_model_len": e.max_tokens, "dimensions": e.dim, "kernel": e.kernel.name()})
}
