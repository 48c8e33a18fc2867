//! `/v1/collections`: a tenant's search collections — create, list, delete, upsert documents
//! (JSON or JSONL), delete by id or filter, and search (the pipeline's retrieval stage). Index
//! work runs on the blocking pool.

use std::sync::Arc;

use http::{Method, StatusCode};
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::{json_response, AppState, Response};
use crate::pipeline::retrieval::index;
use crate::search::collection::{Collection, DocInput};
use crate::search::filter::Filter;
use crate::search::request::SearchRequest;
use crate::search::CreateOptions;
use crate::tenancy::Caller;

/// The caller's collection `name`, if its policy allows it.
fn open(state: &AppState, caller: &Caller, name: &str) -> Result<Arc<Collection>, ApiError> {
    Ok(state.retrieval().open(caller, name)?)
}

fn card(c: &Collection) -> Value {
    let s = &c.settings;
    json!({
        "id": c.name, "object": "collection", "created": s.created,
        "documents": c.documents(), "chunks": c.chunks(),
        "embedding_model": s.embedding_model, "dimensions": s.dimensions,
        "chunk_tokens": s.chunk_tokens, "chunk_overlap": s.chunk_overlap,
        "language": s.analysis.language, "stemming": s.analysis.stemming,
        "stop_words": s.analysis.stop_words,
    })
}

/// Routes `/v1/collections[/...]`; `rest` is the path after `/v1/collections`.
// Long, but a dispatch table: one arm of a few lines per (method, path) of the collections API.
pub async fn route(
    state: &Arc<AppState>,
    caller: &Caller,
    method: &Method,
    rest: &str,
    content_type: Option<&str>,
    body: bytes::Bytes,
) -> Result<Response, ApiError> {
    let parts: Vec<&str> = rest.trim_start_matches('/').split('/').collect();
    let tenant = caller.tenant.name.to_string();
    match (method, parts.as_slice()) {
        (&Method::GET, [""]) => {
            let data: Vec<Value> = state
                .collections
                .list(&tenant)
                .iter()
                .filter(|c| caller.tenant.allows_collection(&c.name))
                .map(|c| card(c))
                .collect();
            Ok(json_response(
                StatusCode::OK,
                &json!({"object": "list", "data": data}),
            ))
        }
        (&Method::POST, [""]) => create(state, caller, &body).await,
        (&Method::GET, [name]) => Ok(json_response(
            StatusCode::OK,
            &card(&*open(state, caller, name)?),
        )),
        (&Method::DELETE, [name]) => {
            open(state, caller, name)?;
            let (st, n) = (state.clone(), name.to_string());
            index(move || st.collections.delete(&tenant, &n)).await?;
            Ok(json_response(
                StatusCode::OK,
                &json!({"id": name, "object": "collection.deleted", "deleted": true}),
            ))
        }
        (&Method::POST, [name, "documents"]) => {
            let c = open(state, caller, name)?;
            upsert(state, caller, c, content_type, &body).await
        }
        (&Method::DELETE, [name, "documents", id]) => {
            let c = open(state, caller, name)?;
            let id = percent_decode(id);
            let n = index(move || c.delete(vec![id])).await?;
            Ok(json_response(StatusCode::OK, &json!({"deleted": n})))
        }
        (&Method::POST, [name, "documents", "delete"]) => {
            let c = open(state, caller, name)?;
            delete(c, &body).await
        }
        (&Method::POST, [name, "search"]) => {
            let c = open(state, caller, name)?;
            let req: SearchRequest = serde_json::from_slice(&body)?;
            let s = state.retrieval().search(caller, c, &req).await?;
            let n = s.query_tokens;
            Ok(json_response(
                StatusCode::OK,
                &json!({"object": "list", "data": s.hits,
                        "usage": {"prompt_tokens": n, "total_tokens": n}}),
            ))
        }
        _ => Err(ApiError::not_found(&format!("/v1/collections{rest}"))),
    }
}

/// `POST /v1/collections`: a new collection of the caller's tenant, with its chunking,
/// analysis and embedding settings.
async fn create(state: &Arc<AppState>, caller: &Caller, body: &[u8]) -> Result<Response, ApiError> {
    let tenant = caller.tenant.name.to_string();
    // Fields listed here, not flattened: `deny_unknown_fields` then catches typos.
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Create {
        name: String,
        chunk_tokens: Option<usize>,
        chunk_overlap: Option<usize>,
        language: Option<String>,
        stemming: Option<bool>,
        stop_words: Option<bool>,
        embedding_model: Option<String>,
    }
    let req: Create = serde_json::from_slice(body)?;
    let opts = CreateOptions {
        chunk_tokens: req.chunk_tokens,
        chunk_overlap: req.chunk_overlap,
        language: req.language,
        stemming: req.stemming,
        stop_words: req.stop_words,
        embedding_model: req.embedding_model,
    };
    if !caller.tenant.allows_collection(&req.name) {
        return Err(ApiError::forbidden(
            "name",
            format!("Tenant `{tenant}` may not use collection `{}`.", req.name),
        ));
    }
    let st = state.clone();
    let c = index(move || st.collections.create(&tenant, &req.name, opts)).await?;
    Ok(json_response(StatusCode::CREATED, &card(&c)))
}

/// `%xx` escapes in a path segment (document ids may hold any character).
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%' && i + 2 < b.len() {
            if let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2])) {
                out.push((h * 16 + l) as u8);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Documents from a JSON body (`{"documents": [...]}`) or JSONL (one document per line, for
/// bulk loads; chosen by content type `application/x-ndjson`/`application/jsonl`).
fn parse_documents(content_type: Option<&str>, body: &[u8]) -> Result<Vec<DocInput>, ApiError> {
    let jsonl = content_type.is_some_and(|t| {
        let t = t.split(';').next().unwrap_or("").trim();
        matches!(
            t,
            "application/x-ndjson" | "application/jsonl" | "application/json-lines"
        )
    });
    if !jsonl {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Upsert {
            documents: Vec<DocInput>,
        }
        return Ok(serde_json::from_slice::<Upsert>(body)?.documents);
    }
    let text = std::str::from_utf8(body)
        .map_err(|_| ApiError::invalid("documents", "The JSONL body is not UTF-8."))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(n, l)| {
            serde_json::from_str(l)
                .map_err(|e| ApiError::invalid("documents", format!("JSONL line {}: {e}.", n + 1)))
        })
        .collect()
}

async fn upsert(
    state: &Arc<AppState>,
    caller: &Caller,
    c: Arc<Collection>,
    content_type: Option<&str>,
    body: &[u8],
) -> Result<Response, ApiError> {
    let docs = parse_documents(content_type, body)?;
    let name = c.name.clone();
    let done = crate::pipeline::ingest::upsert(&state.stages(), caller, c, docs).await?;
    Ok(json_response(
        StatusCode::OK,
        &json!({
            "object": "collection.upsert", "collection": name,
            "documents": done.documents, "chunks": done.chunks,
            "usage": {"prompt_tokens": done.tokens, "total_tokens": done.tokens},
        }),
    ))
}

async fn delete(c: Arc<Collection>, body: &[u8]) -> Result<Response, ApiError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Delete {
        ids: Option<Vec<String>>,
        filter: Option<Value>,
        /// Must be true to delete every document (alone, or with a filter matching all).
        #[serde(default)]
        all: bool,
    }
    let req: Delete = serde_json::from_slice(body)?;
    let everything = Filter::And(Vec::new());
    let n = match (req.ids, req.filter) {
        (Some(ids), None) => index(move || c.delete(ids)).await?,
        (None, f) if f.is_some() || req.all => {
            let f = match f {
                Some(f) => Filter::parse(&f).map_err(|m| ApiError::invalid("filter", m))?,
                None => everything,
            };
            if f.matches_everything() && !req.all {
                return Err(ApiError::invalid(
                    "filter",
                    "This filter matches every document; to delete them all, add `\"all\": true`.",
                ));
            }
            index(move || c.delete_where(&f)).await?
        }
        _ => {
            return Err(ApiError::invalid(
                None,
                "Give either `ids` (a list of document ids), `filter`, or `\"all\": true`.",
            ))
        }
    };
    Ok(json_response(StatusCode::OK, &json!({"deleted": n})))
}
