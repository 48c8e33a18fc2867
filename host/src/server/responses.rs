//! `/v1/responses`: a Responses request runs the chat pipeline (`pipeline::responses` translates
//! it, `dispatch::serve_chat` serves it, the reply or relay shapes the answer); and the stored
//! responses: `GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`.

use std::sync::Arc;

use http::{Method, StatusCode};
use serde_json::{json, Value};

use super::dispatch::serve_chat;
use super::error::ApiError;
use super::{json_response, AppState, Response};
use crate::common::Endpoint;
use crate::conversations::{Conversations, Stored};
use crate::pipeline::chat::ChatRequest;
use crate::pipeline::responses::{self, on_store, Finisher};
use crate::tenancy::Caller;

/// Most input items a page lists (OpenAI's limit).
const MAX_PAGE: usize = 100;

pub(super) async fn create(
    state: &Arc<AppState>,
    caller: &Caller,
    body: &[u8],
) -> Result<Response, ApiError> {
    let value: Value = serde_json::from_slice(body)?;
    let previous = match responses::wanted_previous(&value)? {
        None => Vec::new(),
        Some(id) => match lookup(state, caller, &id).await? {
            Some(s) => responses::continued(s),
            None => return Err(not_found(&id, Some("previous_response_id"))),
        },
    };
    let t = responses::translate(&value, previous)?;
    let finisher = Finisher::new(&t, state.conversations.clone(), &caller.tenant.name);
    let mut req = ChatRequest::from_value(t.chat)?;
    req.endpoint = Endpoint::Responses;
    req.origin = value.as_object().cloned();
    req.responses = Some(Arc::new(finisher));
    serve_chat(state, caller, req).await
}

/// `/v1/responses/{id}` (`GET`, `DELETE`) and `/v1/responses/{id}/input_items` (`GET`).
pub(super) async fn stored(
    state: &AppState,
    caller: &Caller,
    method: &Method,
    rest: &str,
    query: Option<&str>,
) -> Result<Response, ApiError> {
    let (id, items) = match rest.strip_suffix("/input_items") {
        Some(id) => (id, true),
        None => (rest, false),
    };
    if id.is_empty() || id.contains('/') {
        return Err(ApiError::not_found(&format!("/v1/responses/{rest}")));
    }
    match (method, items) {
        (&Method::GET, false) => {
            let s = lookup(state, caller, id).await?;
            let s = s.ok_or_else(|| not_found(id, None))?;
            Ok(json_response(StatusCode::OK, &s.response))
        }
        (&Method::DELETE, false) => {
            let (tenant, rid) = (caller.tenant.name.clone(), id.to_string());
            let gone = on_store(store(state)?, move |s| s.delete(&tenant, &rid)).await?;
            match gone {
                true => Ok(json_response(
                    StatusCode::OK,
                    &json!({"id": id, "object": "response", "deleted": true}),
                )),
                false => Err(not_found(id, None)),
            }
        }
        (&Method::GET, true) => input_items(state, caller, id, query).await,
        _ => Err(ApiError::method_not_allowed(
            method,
            &format!("/v1/responses/{rest}"),
        )),
    }
}

async fn input_items(
    state: &AppState,
    caller: &Caller,
    id: &str,
    query: Option<&str>,
) -> Result<Response, ApiError> {
    let (mut after, mut limit, mut descending) = (None, 20, true);
    for (k, v) in super::bodies::query_pairs(query) {
        match k {
            "after" => after = Some(v.to_string()),
            "limit" => {
                limit = v
                    .parse::<usize>()
                    .ok()
                    .filter(|l| (1..=MAX_PAGE).contains(l))
                    .ok_or_else(|| {
                        ApiError::invalid("limit", format!("`limit` must be 1 to {MAX_PAGE}."))
                    })?
            }
            "order" => {
                descending = match v {
                    "desc" => true,
                    "asc" => false,
                    _ => return Err(ApiError::invalid("order", "`order` must be asc or desc.")),
                }
            }
            // The SDK may send `include[]` for fields of items this gateway does not make.
            "include" | "include[]" => {}
            _ => {
                return Err(ApiError::invalid(
                    None,
                    format!("Unknown query parameter `{k}`; use after, limit, order."),
                ))
            }
        }
    }
    let (tenant, rid) = (caller.tenant.name.clone(), id.to_string());
    let page = on_store(store(state)?, move |s| {
        s.input_items(&tenant, &rid, after.as_deref(), limit, descending)
    })
    .await?
    .ok_or_else(|| not_found(id, None))?;
    let first = page.items.first().map(|i| i["id"].clone());
    let last = page.items.last().map(|i| i["id"].clone());
    Ok(json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": page.items, "first_id": first, "last_id": last, "has_more": page.has_more}),
    ))
}

fn store(state: &AppState) -> Result<Arc<Conversations>, ApiError> {
    state.conversations.clone().ok_or_else(|| {
        ApiError::invalid(
            None,
            "This gateway stores no responses: it has no `ledger` configured.",
        )
    })
}

/// The caller's stored response `id`; none for another tenant's, as for a missing one.
async fn lookup(state: &AppState, caller: &Caller, id: &str) -> Result<Option<Stored>, ApiError> {
    let (tenant, rid) = (caller.tenant.name.clone(), id.to_string());
    Ok(on_store(store(state)?, move |s| s.get(&tenant, &rid)).await?)
}

fn not_found(id: &str, param: Option<&'static str>) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        code: Some("not_found"),
        ..ApiError::invalid(param, format!("Response with id '{id}' not found."))
    }
}
