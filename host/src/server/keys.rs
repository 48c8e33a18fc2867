//! A tenant's API keys through the admin API: listed, made (the key shown once; only its
//! SHA-256 goes into the policy), given an expiry, revoked. Each is an edit of the policy file
//! that keeps its formatting and comments, applied, replicated and audited like any policy
//! replace, so a revoked key is refused (401) as soon as the policy is in force.

use http::StatusCode;
use serde_json::{json, Value};
use toml_edit::{Array, InlineTable};

use super::audit::{record, Actor};
use super::error::ApiError;
use super::{json_response, AppState, Response};
use crate::tenancy::keys;

/// `/admin/tenants/{tenant}/keys[/{id}]`.
pub async fn route(
    state: &AppState,
    actor: &Actor,
    method: &http::Method,
    path: &str,
    body: Option<bytes::Bytes>,
) -> Result<Response, ApiError> {
    let parts: Vec<&str> = path.split('/').filter(|s| !s.is_empty()).collect();
    let (tenant, id) = match parts.as_slice() {
        ["admin", "tenants", t, "keys"] => (*t, None),
        ["admin", "tenants", t, "keys", id] => (*t, Some(*id)),
        _ => return Err(ApiError::not_found(path)),
    };
    if !state.tenancy.has_tenant(tenant) {
        return Err(ApiError::not_found(&format!("/admin/tenants/{tenant}")));
    }
    let body: Value = match body.filter(|b| !b.is_empty()) {
        Some(b) => serde_json::from_slice(&b)?,
        None => json!({}),
    };
    match (method.as_str(), id) {
        ("GET", None) => Ok(json_response(StatusCode::OK, &list(state, tenant)?)),
        ("POST", None) => create(state, actor, tenant, &body).await,
        ("PUT", Some(id)) => {
            let expires = expiry(&body)?;
            let text = edit(state, tenant, |ks| {
                let k = find(ks, id)?;
                match expires {
                    Some(at) => k.insert("expires_at", at.into()),
                    None => k.remove("expires_at"),
                };
                Ok(())
            })?;
            let detail = json!({"expires_at": expires});
            apply(
                state,
                actor,
                tenant,
                id,
                (text, detail, "key.expiry", StatusCode::OK),
            )
            .await
        }
        ("DELETE", Some(id)) => {
            let text = edit(state, tenant, |ks| {
                let at = position(ks, id)?;
                ks.remove(at);
                Ok(())
            })?;
            apply(
                state,
                actor,
                tenant,
                id,
                (text, Value::Null, "key.revoke", StatusCode::OK),
            )
            .await
        }
        _ => Err(ApiError::method_not_allowed(method, path)),
    }
}

/// The tenant's keys as the policy in force has them (ids, hashes, expiries; never a key).
fn list(state: &AppState, tenant: &str) -> Result<Value, ApiError> {
    let policies = crate::tenancy::policy::Policies::parse(&state.tenancy.text())
        .map_err(|e| ApiError::internal(e.to_string()))?;
    let t = policies.tenants.iter().find(|t| t.name == tenant);
    let data: Vec<Value> = t
        .map(|t| t.keys.iter())
        .into_iter()
        .flatten()
        .map(|k| json!({"id": k.id, "sha256": k.sha256, "expires_at": k.expires_at}))
        .collect();
    Ok(json!({"object": "list", "tenant": tenant, "data": data}))
}

/// `POST …/keys` `{"id": "...", "expires_at": <unix seconds>}`: a new key, shown once.
async fn create(
    state: &AppState,
    actor: &Actor,
    tenant: &str,
    body: &Value,
) -> Result<Response, ApiError> {
    let id = body["id"]
        .as_str()
        .filter(|id| !id.is_empty() && id.len() <= 64)
        .ok_or_else(|| ApiError::invalid("id", "`id` must be a string of 1 to 64 characters."))?;
    let expires = expiry(body)?;
    let (key, _) = keys::new_key(tenant, id);
    let sha256 = crate::plugins::hex(&keys::hash(&key));
    let text = edit(state, tenant, |ks| {
        if position(ks, id).is_ok() {
            return Err(ApiError::invalid(
                "id",
                format!("Tenant `{tenant}` has a key `{id}` already."),
            ));
        }
        let mut k = InlineTable::new();
        k.insert("id", id.into());
        k.insert("sha256", sha256.as_str().into());
        if let Some(at) = expires {
            k.insert("expires_at", at.into());
        }
        ks.push(k);
        Ok(())
    })?;
    let detail = json!({"sha256": sha256, "expires_at": expires});
    apply(
        state,
        actor,
        tenant,
        id,
        (text, detail, "key.create", StatusCode::CREATED),
    )
    .await?;
    Ok(json_response(
        StatusCode::CREATED,
        &json!({"tenant": tenant, "id": id, "key": key, "sha256": sha256, "expires_at": expires}),
    ))
}

/// Applies an edited policy, records the key change, answers with what changed.
async fn apply(
    state: &AppState,
    actor: &Actor,
    tenant: &str,
    id: &str,
    (text, detail, action, status): (String, Value, &str, StatusCode),
) -> Result<Response, ApiError> {
    super::policies::replace(state, actor, text, None).await?;
    record(
        state,
        actor,
        action,
        &format!("{tenant}/{id}"),
        detail.clone(),
    )
    .await;
    Ok(json_response(
        status,
        &json!({"tenant": tenant, "id": id, "action": action, "detail": detail}),
    ))
}

/// `expires_at`: Unix seconds, or null / absent for never.
fn expiry(body: &Value) -> Result<Option<i64>, ApiError> {
    match &body["expires_at"] {
        Value::Null => Ok(None),
        v => v.as_i64().filter(|s| *s > 0).map(Some).ok_or_else(|| {
            ApiError::invalid(
                "expires_at",
                "`expires_at` must be Unix seconds, or null for never.",
            )
        }),
    }
}

/// The policy in force with the tenant's `keys` edited by `f`, formatting and comments kept.
fn edit(
    state: &AppState,
    tenant: &str,
    f: impl FnOnce(&mut Array) -> Result<(), ApiError>,
) -> Result<String, ApiError> {
    let mut doc = super::policies::document(&state.tenancy.text())?;
    let t = doc
        .get_mut("tenants")
        .and_then(|t| t.as_array_of_tables_mut())
        .and_then(|ts| ts.iter_mut().find(|t| super::policies::names(t, tenant)))
        .ok_or_else(|| ApiError::not_found(&format!("/admin/tenants/{tenant}")))?;
    if !t.contains_key("keys") {
        t.insert("keys", toml_edit::value(Array::new()));
    }
    let keys = t.get_mut("keys").and_then(|k| k.as_array_mut()).ok_or_else(|| {
        ApiError::invalid(
            None,
            format!("Tenant `{tenant}`'s keys are not an inline array (`keys = [...]`): edit them in the policy file."),
        )
    })?;
    f(keys)?;
    Ok(doc.to_string())
}

fn position(keys: &Array, id: &str) -> Result<usize, ApiError> {
    keys.iter()
        .position(|k| {
            k.as_inline_table()
                .and_then(|t| t.get("id"))
                .and_then(|v| v.as_str())
                == Some(id)
        })
        .ok_or_else(|| ApiError::not_found(&format!("key `{id}`")))
}

fn find<'a>(keys: &'a mut Array, id: &str) -> Result<&'a mut InlineTable, ApiError> {
    let at = position(keys, id)?;
    keys.get_mut(at)
        .and_then(|k| k.as_inline_table_mut())
        .ok_or_else(|| ApiError::not_found(&format!("key `{id}`")))
}
