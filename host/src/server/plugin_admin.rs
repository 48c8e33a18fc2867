//! Tenant plugins through the admin API: what serves (with each version's calls, failures and
//! call times) and what was refused, uploads, deletes, and a rollback to the version the
//! current one replaced.

use std::sync::Arc;

use bytes::Bytes;
use http::StatusCode;
use serde_json::{json, Value};

use super::audit::{record, Actor};
use super::error::ApiError;
use super::{json_response, AppState, Response};
use crate::plugins::{Plugin, PluginKind};

/// `/admin/plugins[/<tenant>/<name>[/rollback]]`: list, upload (PUT, body = the .wasm,
/// `?kind=` optional), delete, and roll back tenant plugins.
pub async fn route(
    state: &Arc<AppState>,
    actor: &Actor,
    method: &http::Method,
    path: &str,
    query: Option<&str>,
    body: Option<Bytes>,
) -> Result<Response, ApiError> {
    let rest = path.strip_prefix("/admin/plugins").unwrap_or_default();
    let parts: Vec<&str> = rest.split('/').filter(|s| !s.is_empty()).collect();
    match (method.as_str(), parts.as_slice()) {
        ("GET", []) => Ok(list_plugins(state)),
        ("PUT", [tenant, name]) => {
            let kind = kind_param(query)?;
            let wasm = body.unwrap_or_default();
            let (status, described) = put_plugin(state, (tenant, name), kind, wasm).await?;
            let target = format!("{tenant}/{name}");
            record(state, actor, "plugin.put", &target, described.clone()).await;
            Ok(json_response(status, &described))
        }
        ("POST", [tenant, name, "rollback"]) => {
            let Some((wasm, kind)) = state.plugins.previous(tenant, name) else {
                return Err(ApiError {
                    status: StatusCode::NOT_FOUND,
                    code: Some("no_previous_version"),
                    ..ApiError::invalid(None, format!("Tenant `{tenant}`'s plugin `{name}` has no earlier version kept (versions are kept in the plugin directory, `plugins.dir`)."))
                });
            };
            let from = state.plugins.get(tenant, name).map(|p| p.sha256.clone());
            let wasm = Bytes::from(wasm);
            let (_, mut described) = put_plugin(state, (tenant, name), kind, wasm).await?;
            described["rolled_back_from"] = json!(from);
            let target = format!("{tenant}/{name}");
            record(state, actor, "plugin.rollback", &target, described.clone()).await;
            Ok(json_response(StatusCode::OK, &described))
        }
        ("DELETE", [tenant, name]) => match delete_plugin(state, tenant, name).await? {
            Ok(true) => {
                let target = format!("{tenant}/{name}");
                record(state, actor, "plugin.delete", &target, Value::Null).await;
                Ok(json_response(
                    StatusCode::OK,
                    &json!({"deleted": true, "tenant": tenant, "name": name}),
                ))
            }
            Ok(false) => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                code: Some("plugin_not_found"),
                ..ApiError::invalid(None, format!("Tenant `{tenant}` has no plugin `{name}`."))
            }),
            Err(e) => Err(ApiError {
                code: Some(e.code()),
                ..ApiError::invalid(None, e.to_string())
            }),
        },
        (_, [] | [_, _] | [_, _, "rollback"]) => Err(ApiError::method_not_allowed(method, path)),
        _ => Err(ApiError::not_found(path)),
    }
}

/// `GET /admin/plugins`: what serves, and the files refused with their reasons.
fn list_plugins(state: &AppState) -> Response {
    let list: Vec<Value> = state
        .plugins
        .list()
        .iter()
        .map(|p| {
            let mut v = describe(p);
            let previous = state.plugins.previous_info(&p.tenant, &p.name);
            v["previous"] = previous.map_or(
                Value::Null,
                |(sha256, bytes)| json!({"sha256": sha256, "bytes": bytes}),
            );
            v
        })
        .collect();
    let rejected: Vec<Value> = state
        .plugins
        .rejections()
        .into_iter()
        .map(|r| {
            let at = r.at.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
            json!({"tenant": r.tenant, "name": r.name, "sha256": r.sha256, "reason": r.reason, "rejected_at": at})
        })
        .collect();
    json_response(
        StatusCode::OK,
        &json!({"object": "list", "data": list, "rejected": rejected}),
    )
}

/// `PUT /admin/plugins/{tenant}/{name}[?kind=]`: compiles and checks the upload off the
/// runtime, stores it in the shared store first on a cluster, then swaps it in; the status
/// and the plugin as installed (what the audit log records: kind, sha256, size).
async fn put_plugin(
    state: &Arc<AppState>,
    (tenant, name): (&str, &str),
    kind: Option<PluginKind>,
    wasm: Bytes,
) -> Result<(StatusCode, Value), ApiError> {
    // A plugin for a tenant the policy does not know could never be called: it would only
    // leave files (and a folder) behind.
    if !state.tenancy.has_tenant(tenant) {
        return Err(ApiError {
            status: StatusCode::NOT_FOUND,
            code: Some("tenant_not_found"),
            ..ApiError::invalid(
                None,
                format!("No tenant `{tenant}` in the policy in force; add it there first."),
            )
        });
    }
    let existed = state.plugins.get(tenant, name).is_some();
    let (st, t, n) = (state.clone(), tenant.to_string(), name.to_string());
    let installed = crate::pipeline::blocking("plugin install", move || {
        let plugin = st.plugins.prepare(&t, &n, &wasm, kind)?;
        if let Some(cluster) = &st.cluster {
            cluster
                .put_plugin(&t, &n, plugin.kind(), &plugin.sha256, &wasm)
                .map_err(Stored::Not)?;
        }
        Ok(st.plugins.put(plugin, &wasm)?)
    })
    .await?;
    match installed {
        Ok(p) => {
            tracing::info!(tenant = %p.tenant, plugin = %p.name, kind = %p.kind(), "plugin installed through the admin API");
            let status = match existed {
                true => StatusCode::OK,
                false => StatusCode::CREATED,
            };
            Ok((status, describe(&p)))
        }
        Err(Stored::Not(e)) => Err(ApiError::store_unavailable(&e)),
        Err(Stored::Load(e @ crate::plugins::LoadError::Io(_))) => Err(ApiError {
            code: Some(e.code()),
            ..ApiError::internal(e.to_string())
        }),
        Err(Stored::Load(e)) => Err(ApiError {
            code: Some(e.code()),
            ..ApiError::invalid(
                None,
                format!("Plugin rejected; the previous version (if any) stays: {e}"),
            )
        }),
    }
}

/// `?kind=`: the kind the upload must be; absent or empty, the component's own world says.
fn kind_param(query: Option<&str>) -> Result<Option<PluginKind>, ApiError> {
    match super::bodies::query_pairs(query).find(|(k, _)| *k == "kind") {
        Some((_, "")) | None => Ok(None),
        Some((_, k)) => Ok(Some(PluginKind::parse(k).ok_or_else(|| ApiError {
            code: Some("invalid_kind"),
            ..ApiError::invalid("kind", format!("Unknown plugin kind {k:?}; use prompt-template, reranker, output-parser, logits-processor or cache-key."))
        })?)),
    }
}

/// Why an upload did not go in: the plugin, or the shared store.
enum Stored {
    Load(crate::plugins::LoadError),
    Not(crate::cluster::StoreError),
}

impl From<crate::plugins::LoadError> for Stored {
    fn from(e: crate::plugins::LoadError) -> Self {
        Stored::Load(e)
    }
}

/// Removes the plugin here and, when replicas share plugins, on every one (stored first).
async fn delete_plugin(
    state: &Arc<AppState>,
    tenant: &str,
    name: &str,
) -> Result<Result<bool, crate::plugins::LoadError>, ApiError> {
    if let (Some(cluster), true) = (&state.cluster, state.plugins.get(tenant, name).is_some()) {
        let (c, t, n) = (cluster.clone(), tenant.to_string(), name.to_string());
        crate::pipeline::blocking("plugin store", move || c.delete_plugin(&t, &n))
            .await?
            .map_err(|e| ApiError::store_unavailable(&e))?;
        // Stored, so deleted: this replica's own follower may have seen the stored delete and
        // removed the plugin before the line below runs.
        return Ok(state.plugins.remove(tenant, name).map(|_| true));
    }
    Ok(state.plugins.remove(tenant, name))
}

fn describe(p: &Plugin) -> Value {
    let loaded = p
        .loaded_at
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let s = &p.stats;
    json!({
        "tenant": &*p.tenant, "name": &*p.name, "kind": p.kind().as_str(),
        "wit_version": p.wit_version(), "sha256": p.sha256, "bytes": p.size, "loaded_at": loaded,
        "load_ms": p.load_time.as_secs_f64() * 1e3,
        "calls": s.calls(), "failures": s.failures(),
        "p50_ms": s.quantile_ms(0.5), "p99_ms": s.quantile_ms(0.99),
    })
}
