//! The admin API (`Authorization: Bearer <admin_token>`, compared in constant time):
//! tenant plugins, the policy file, and usage from the ledger.

use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use serde_json::{json, Value};

use super::audit::{record, Actor};
use super::error::ApiError;
use super::{json_response, AppState, Response};

pub async fn route(
    state: &Arc<AppState>,
    actor: &Actor,
    method: &http::Method,
    path: &str,
    query: Option<&str>,
    body: Option<Bytes>,
) -> Result<Response, ApiError> {
    match (method.as_str(), path) {
        (_, p) if p == "/admin/plugins" || p.starts_with("/admin/plugins/") => {
            super::plugin_admin::route(state, actor, method, path, query, body).await
        }
        ("GET", "/admin/audit") => super::audit::list(state, query).await,
        ("GET", "/admin/overview") => Ok(super::overview::overview(state)),
        ("GET", "/admin/collections") => super::admin_views::collections(state, query).await,
        ("GET", "/admin/policies") => Ok(super::policies::toml(state.tenancy.text())),
        ("PUT", "/admin/policies") => {
            let text = String::from_utf8(body.unwrap_or_default().to_vec())
                .map_err(|_| ApiError::invalid(None, "The policy file must be UTF-8 TOML."))?;
            super::policies::replace(state, actor, text, None).await
        }
        ("GET", "/admin/tenants") => super::tenants::list(state).await,
        (_, p) if p.starts_with("/admin/tenants/") => {
            let rest = &p["/admin/tenants/".len()..];
            match rest.split_once('/') {
                Some((_, k)) if k == "keys" || k.starts_with("keys/") => {
                    super::keys::route(state, actor, method, p, body).await
                }
                Some(_) => Err(ApiError::not_found(p)),
                None => super::tenants::one(state, actor, method, rest, query, body).await,
            }
        }
        (_, p) if p.starts_with("/admin/policies/versions") => {
            super::policies::versions(state, actor, method, p, query).await
        }
        ("GET", "/admin/usage") => {
            // The ledger's reads block (SQLite, or a PostgreSQL round trip).
            let (st, q) = (state.clone(), query.map(str::to_string));
            crate::pipeline::blocking("usage", move || usage(&st, q.as_deref())).await?
        }
        (_, "/admin/cache") => cache(state, actor, method, query).await,
        (
            _,
            "/admin/policies" | "/admin/usage" | "/admin/audit" | "/admin/tenants"
            | "/admin/overview",
        ) => Err(ApiError::method_not_allowed(method, path)),
        _ => Err(ApiError::not_found(path)),
    }
}

/// `GET /admin/cache[?tenant=]`: each tenant's cached answers and bytes; `DELETE
/// /admin/cache?tenant=[&model=]`: drops a tenant's answers (of one model).
async fn cache(
    state: &AppState,
    actor: &Actor,
    method: &http::Method,
    query: Option<&str>,
) -> Result<Response, ApiError> {
    let (mut tenant, mut model) = (None, None);
    for (k, v) in super::bodies::query_pairs(query) {
        match k {
            "tenant" => tenant = Some(v.to_string()),
            "model" => model = Some(v.to_string()),
            _ => {
                return Err(ApiError::invalid(
                    None,
                    format!("Unknown query parameter `{k}`; use tenant, model."),
                ))
            }
        }
    }
    // A tenant the policy no longer has may still have answers (in Redis): those can be
    // dropped, not listed.
    let unknown = tenant.as_deref().filter(|t| !state.tenancy.has_tenant(t));
    if let (Some(t), "GET") = (unknown, method.as_str()) {
        return Err(ApiError::invalid("tenant", format!("No tenant `{t}`.")));
    }
    let cache = &state.cache.cache;
    match method.as_str() {
        "GET" => {
            let tenants = tenant.map_or_else(|| state.tenancy.tenant_names(), |t| vec![t]);
            let data: Vec<Value> = cache
                .usage(&tenants)
                .await
                .into_iter()
                .map(|(t, u)| json!({"tenant": t, "entries": u.entries, "bytes": u.bytes}))
                .collect();
            let backend = cache.backend();
            Ok(json_response(
                StatusCode::OK,
                &json!({"object": "list", "backend": backend, "data": data}),
            ))
        }
        "DELETE" => {
            let Some(t) = tenant else {
                return Err(ApiError::invalid("tenant", "`tenant` is required."));
            };
            let gone = cache.clear(&t, model.as_deref()).await;
            let detail = json!({"model": model, "deleted": gone.entries, "bytes": gone.bytes});
            record(state, actor, "cache.clear", &t, detail).await;
            tracing::info!(tenant = %t, model = ?model, entries = gone.entries, "response cache cleared through the admin API");
            Ok(json_response(
                StatusCode::OK,
                &json!({"tenant": t, "model": model, "deleted": gone.entries, "bytes": gone.bytes}),
            ))
        }
        _ => Err(ApiError::method_not_allowed(method, "/admin/cache")),
    }
}

/// `GET /admin/usage?tenant=&from=&to=&group_by=day|model`; `from`/`to` are `YYYY-MM-DD` (UTC)
/// or Unix seconds, `to` exclusive.
fn usage(state: &AppState, query: Option<&str>) -> Result<Response, ApiError> {
    let Some(ledger) = &state.tenancy.ledger else {
        return Err(ApiError::invalid(
            None,
            "No usage ledger is configured (`ledger` in the config).",
        ));
    };
    let mut tenant = None;
    let (mut from, mut to, mut by_model, mut csv) = (0i64, i64::MAX, false, false);
    for (k, v) in super::bodies::query_pairs(query) {
        match k {
            "tenant" => tenant = Some(v.to_string()),
            "format" => match v {
                "json" => csv = false,
                "csv" => csv = true,
                _ => {
                    return Err(ApiError::invalid(
                        "format",
                        "`format` must be `json` or `csv`.",
                    ))
                }
            },
            "from" => from = time_param("from", v)?,
            "to" => to = time_param("to", v)?,
            "group_by" => match v {
                "day" => by_model = false,
                "model" => by_model = true,
                _ => {
                    return Err(ApiError::invalid(
                        "group_by",
                        "`group_by` must be `day` or `model`.",
                    ))
                }
            },
            _ => {
                return Err(ApiError::invalid(
                    None,
                    format!(
                        "Unknown query parameter `{k}`; use tenant, from, to, group_by, format."
                    ),
                ))
            }
        }
    }
    ledger.flush();
    let rows = ledger
        .usage(tenant.as_deref(), from, to, by_model)
        .map_err(|e| ApiError::internal(e.to_string()))?;
    if csv {
        let group = if by_model { "model" } else { "day" };
        return Ok(super::admin_views::usage_csv(group, &rows));
    }
    Ok(json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": rows}),
    ))
}

fn time_param(name: &'static str, v: &str) -> Result<i64, ApiError> {
    if let Ok(secs) = v.parse::<i64>() {
        return Ok(secs);
    }
    let bad = || {
        ApiError::invalid(
            name,
            format!("`{name}` must be YYYY-MM-DD or Unix seconds, got {v:?}."),
        )
    };
    let mut parts = v.split('-');
    let (y, m, d): (i64, i64, i64) = (
        parts.next().and_then(|x| x.parse().ok()).ok_or_else(bad)?,
        parts.next().and_then(|x| x.parse().ok()).ok_or_else(bad)?,
        parts.next().and_then(|x| x.parse().ok()).ok_or_else(bad)?,
    );
    if parts.next().is_some() || !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return Err(bad());
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Ok((era * 146_097 + doe - 719_468) * 86_400)
}
