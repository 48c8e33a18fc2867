//! Who is calling the admin API (the shared `admin_token`, or a named account with a role),
//! what a viewer may not do, and the audit log of every change: recorded here, served by
//! `GET /admin/audit`.

use http::StatusCode;
use serde_json::{json, Value};

use super::error::ApiError;
use super::{json_response, AppState, Response};
use crate::audit::{Change, Query};
use crate::config::AdminRole;

/// Most entries one listing returns.
const MAX_PAGE: usize = 500;

/// An authenticated admin.
pub struct Actor {
    pub name: String,
    pub role: AdminRole,
}

/// 404 when the admin API (and so its console) is off: no token and no account.
pub fn enabled(state: &AppState) -> Result<(), ApiError> {
    if state.admin_token.is_none() && state.admin_accounts.is_empty() {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            ..ApiError::invalid(
                None,
                "The admin API is off: set `admin_token` or `[[admin.accounts]]` in the config.",
            )
        });
    }
    Ok(())
}

/// The admin behind the request's bearer token: the shared `admin_token` (an admin named
/// `admin_token`) or a named account's; 401 for anything else.
pub fn authorized(state: &AppState, headers: &http::HeaderMap) -> Result<Actor, ApiError> {
    match super::bearer(headers) {
        Some(presented) => by_token(state, presented).ok_or_else(|| {
            ApiError::unauthorized("Wrong admin token (Authorization: Bearer <token>).")
        }),
        None => Err(ApiError::unauthorized(
            "Missing admin token (Authorization: Bearer <token>).",
        )),
    }
}

/// The admin a token belongs to, if any.
pub fn by_token(state: &AppState, presented: &str) -> Option<Actor> {
    if let Some(expected) = &state.admin_token {
        if same(presented.as_bytes(), expected.as_bytes()) {
            return Some(Actor {
                name: "admin_token".into(),
                role: AdminRole::Admin,
            });
        }
    }
    let digest = crate::plugins::hex(&crate::tenancy::keys::hash(presented));
    // Every account compared, in constant time each: which one matched takes no longer.
    let mut found = None;
    for a in &state.admin_accounts {
        if same(digest.as_bytes(), a.token_sha256.as_bytes()) {
            found = Some(Actor {
                name: a.name.clone(),
                role: a.role,
            });
        }
    }
    found
}

/// Constant-time equality.
pub(super) fn same(a: &[u8], b: &[u8]) -> bool {
    let mut diff = a.len() ^ b.len();
    for (i, y) in b.iter().enumerate() {
        diff |= (a.get(i).copied().unwrap_or(0) ^ y) as usize;
    }
    diff == 0
}

/// A viewer reads; every other method is refused by the server, whatever a page shows.
pub fn permitted(actor: &Actor, method: &http::Method) -> Result<(), ApiError> {
    let reads = matches!(*method, http::Method::GET | http::Method::HEAD);
    if actor.role == AdminRole::Viewer && !reads {
        return Err(ApiError::forbidden(
            "role",
            format!(
                "Admin account `{}` is a viewer: it may read, not change anything.",
                actor.name
            ),
        ));
    }
    Ok(())
}

/// Records a change that was applied. The change stands whatever happens here: a log that
/// cannot be written is logged loudly, not turned into a failure of what already happened.
pub async fn record(state: &AppState, actor: &Actor, action: &str, target: &str, detail: Value) {
    let Some(audit) = state.audit.clone() else {
        return;
    };
    let change = Change {
        ts: crate::tenancy::unix_now(),
        actor: actor.name.clone(),
        action: action.to_string(),
        target: target.to_string(),
        detail,
    };
    let written = crate::pipeline::blocking("audit log", move || audit.record(&change)).await;
    match written {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, action, target, "could not write the audit log"),
        Err(e) => tracing::error!(error = %e, action, target, "could not write the audit log"),
    }
}

/// `GET /admin/audit[?limit=&before=&actor=&action=]`: changes, newest first.
pub async fn list(state: &AppState, query: Option<&str>) -> Result<Response, ApiError> {
    let Some(audit) = state.audit.clone() else {
        return Err(ApiError::invalid(
            None,
            "No audit log: it is kept in the ledger's database (`ledger` in the config).",
        ));
    };
    let mut q = Query {
        limit: 100,
        ..Default::default()
    };
    for (k, v) in super::bodies::query_pairs(query) {
        let number = |name: &'static str| {
            v.parse::<i64>().ok().filter(|n| *n > 0).ok_or_else(|| {
                ApiError::invalid(name, format!("`{name}` must be a positive integer."))
            })
        };
        match k {
            "limit" => q.limit = (number("limit")? as usize).min(MAX_PAGE),
            "before" => q.before = Some(number("before")?),
            "actor" => q.actor = Some(v.to_string()),
            "action" => q.action = Some(v.to_string()),
            _ => {
                return Err(ApiError::invalid(
                    None,
                    format!("Unknown query parameter `{k}`; use limit, before, actor, action."),
                ))
            }
        }
    }
    let rows = crate::pipeline::blocking("audit log", move || audit.list(&q))
        .await?
        .map_err(|e| ApiError::internal(e.to_string()))?;
    Ok(json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": rows}),
    ))
}
