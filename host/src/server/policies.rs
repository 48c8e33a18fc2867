//! The policy through the admin API: replacing it (checked, stored for the other replicas,
//! applied, audited, its text kept as a version) and its history: every version applied this
//! way, with who applied it and when, the lines between two, and an earlier one applied again.

use bytes::Bytes;
use http::StatusCode;
use serde_json::json;

use super::audit::{record, Actor};
use super::error::ApiError;
use super::{json_response, AppState, Response};

pub fn toml(text: String) -> Response {
    http::Response::builder()
        .header(http::header::CONTENT_TYPE, "application/toml")
        .body(http_body_util::BodyExt::boxed_unsync(
            http_body_util::Full::new(Bytes::from(text)),
        ))
        .expect("static headers are valid")
}

/// Replaces the policy in force with `text` (every problem named, the policy in force stays);
/// `from` names the kept version it re-applies.
pub async fn replace(
    state: &AppState,
    actor: &Actor,
    text: String,
    from: Option<i64>,
) -> Result<Response, ApiError> {
    let version = apply(state, actor, text, from).await?;
    Ok(json_response(
        StatusCode::OK,
        &json!({"status": "applied", "version": version}),
    ))
}

/// `replace`, answering with the kept version's id (none without a log).
pub async fn apply(
    state: &AppState,
    actor: &Actor,
    text: String,
    from: Option<i64>,
) -> Result<Option<i64>, ApiError> {
    managed(state)?;
    if let Some(cluster) = state.cluster.clone() {
        state.tenancy.check(&text).map_err(rejected)?;
        let t = text.clone();
        crate::pipeline::blocking("policy store", move || cluster.put_policy(&t))
            .await?
            .map_err(|e| ApiError::store_unavailable(&e))?;
    }
    let before = state.tenancy.text();
    state.tenancy.replace(&text).map_err(rejected)?;
    tracing::info!(actor = %actor.name, "policies replaced through the admin API");
    let version = keep(state, actor, &text).await;
    let mut changes = crate::audit::line_changes(&before, &text);
    changes["version"] = json!(version);
    if let Some(from) = from {
        changes["reapplied"] = json!(from);
    }
    record(state, actor, "policy.replace", "policies", changes).await;
    Ok(version)
}

/// There is a policy file for the admin API to change.
fn managed(state: &AppState) -> Result<(), ApiError> {
    if state.tenancy.open_mode() {
        return Err(ApiError::invalid(None, "No policy file is configured (`policies` in the config); start the gateway with one to manage tenants."));
    }
    Ok(())
}

/// Whether `apply(text)` would take `text` (400 with every problem if not), applying nothing.
pub fn check(state: &AppState, text: &str) -> Result<(), ApiError> {
    managed(state)?;
    state.tenancy.check(text).map_err(rejected)
}

/// The policy in force (`text`) as an editable document, formatting and comments kept.
pub fn document(text: &str) -> Result<toml_edit::DocumentMut, ApiError> {
    text.parse()
        .map_err(|e| ApiError::internal(format!("The policy in force does not parse: {e}")))
}

/// Whether `t` is the `[[tenants]]` table of `tenant`.
pub fn names(t: &toml_edit::Table, tenant: &str) -> bool {
    t.get("name").and_then(|n| n.as_str()) == Some(tenant)
}

/// The problems of a policy text the admin API was given: 400, the policy in force stays.
fn rejected(e: crate::tenancy::policy::PolicyError) -> ApiError {
    ApiError::invalid(
        None,
        format!("Policy rejected; the policy in force stays. Problems:\n{e}"),
    )
}

/// Keeps the applied text as a version; its id, none without a log (or when it failed,
/// which is logged: the policy is applied whatever happens here).
async fn keep(state: &AppState, actor: &Actor, text: &str) -> Option<i64> {
    let audit = state.audit.clone()?;
    let (ts, who, t) = (
        crate::tenancy::unix_now(),
        actor.name.clone(),
        text.to_string(),
    );
    let kept =
        crate::pipeline::blocking("policy versions", move || audit.keep_policy(ts, &who, &t));
    match kept.await {
        Ok(Ok(id)) => Some(id),
        Ok(Err(e)) => {
            tracing::error!(error = %e, "could not keep the policy version");
            None
        }
        Err(e) => {
            tracing::error!(error = %e, "could not keep the policy version");
            None
        }
    }
}

/// `GET /admin/policies/versions`, `GET …/versions/{id}` (the TOML), `GET
/// …/versions/{id}/diff[?against={id}]` (the lines from it to another version, or to the
/// policy in force), `POST …/versions/{id}/apply`.
pub async fn versions(
    state: &AppState,
    actor: &Actor,
    method: &http::Method,
    path: &str,
    query: Option<&str>,
) -> Result<Response, ApiError> {
    let Some(audit) = state.audit.clone() else {
        return Err(ApiError::invalid(
            None,
            "No policy history: it is kept in the ledger's database (`ledger` in the config).",
        ));
    };
    let rest = path.trim_start_matches("/admin/policies/versions");
    let parts: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
    let fetch = |id: i64| {
        let audit = audit.clone();
        async move {
            crate::pipeline::blocking("policy versions", move || audit.policy(id))
                .await?
                .map_err(|e| ApiError::internal(e.to_string()))?
                .ok_or_else(|| ApiError::not_found(&format!("/admin/policies/versions/{id}")))
        }
    };
    let id = |s: &str| {
        s.parse::<i64>()
            .map_err(|_| ApiError::invalid(None, format!("`{s}` is not a policy version id.")))
    };
    match (method.as_str(), parts.as_slice()) {
        ("GET", []) => {
            let all = crate::pipeline::blocking("policy versions", move || audit.policies())
                .await?
                .map_err(|e| ApiError::internal(e.to_string()))?;
            Ok(json_response(
                StatusCode::OK,
                &json!({"object": "list", "data": all}),
            ))
        }
        ("GET", [v]) => Ok(toml(fetch(id(v)?).await?)),
        ("GET", [v, "diff"]) => {
            let from = fetch(id(v)?).await?;
            let against = super::bodies::query_pairs(query).find(|(k, _)| *k == "against");
            let to = match against {
                None | Some((_, "current")) => state.tenancy.text(),
                Some((_, other)) => fetch(id(other)?).await?,
            };
            Ok(json_response(
                StatusCode::OK,
                &crate::audit::line_changes(&from, &to),
            ))
        }
        ("POST", [v, "apply"]) => {
            let v = id(v)?;
            replace(state, actor, fetch(v).await?, Some(v)).await
        }
        _ => Err(ApiError::not_found(path)),
    }
}
