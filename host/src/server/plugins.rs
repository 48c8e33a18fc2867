//! The plugin stages of a request (prompt template, output parser, `/v1/rerank`) and the
//! admin API that installs plugins. Calls run on the blocking pool: a plugin may run up to its
//! deadline, and that must not stall the runtime's I/O threads.

use std::sync::Arc;
use std::time::Instant;

use http::StatusCode;
use serde::Deserialize;
use serde_json::{json, Value};

use super::error::ApiError;
use super::{json_response, AppState, Response};
use crate::plugins::{CallError, Candidate, Plugin, PluginKind, Registry};
use crate::tenancy::{Caller, Tenant};

/// Scores `candidates` (whose ids are their indices) with the reranker `plugin`: (index,
/// score) pairs, best first, equal scores in input order, at most `top`.
pub(super) async fn rerank_order(
    state: &Arc<AppState>,
    caller: &Caller,
    plugin: Arc<Plugin>,
    query: String,
    candidates: Vec<Candidate>,
    top: usize,
) -> Result<Vec<(usize, f32)>, ApiError> {
    let scored = call(state, caller, plugin, move |p, rt, values| async move {
        p.rerank(&rt, &values, &query, &candidates).await
    })
    .await?;
    // The plugin layer checked that every id is a candidate's, once.
    let mut order: Vec<(usize, f32)> = scored
        .into_iter()
        .filter_map(|s| Some((s.id.parse::<usize>().ok()?, s.score)))
        .collect();
    order.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    order.truncate(top);
    Ok(order)
}

/// The tenant's plugin bound to `kind` under `name`.
pub fn bound(
    registry: &Registry,
    tenant: &Tenant,
    name: &str,
    kind: PluginKind,
) -> Result<Arc<Plugin>, ApiError> {
    if !tenant.allows_plugin(name) {
        return Err(ApiError::forbidden(
            "model",
            format!("Tenant `{}` may not use plugin `{name}`.", tenant.name),
        ));
    }
    let plugin = registry.get(&tenant.name, name).ok_or_else(|| {
        let why = match registry.rejection(&tenant.name, name) {
            Some(reason) => format!(" (its file was rejected: {reason})"),
            None => String::new(),
        };
        ApiError::plugin_missing(
            &tenant.name,
            format!("the {kind} plugin `{name}` is not installed{why}"),
        )
    })?;
    if plugin.kind() != kind {
        return Err(ApiError::plugin_missing(
            &tenant.name,
            format!("plugin `{name}` is a {}, not a {kind}", plugin.kind()),
        ));
    }
    Ok(plugin)
}

/// Runs the call `f` makes against `plugin` on the blocking pool (a guest computes up to its
/// deadline, which must not stall the runtime's I/O threads), with metrics and error mapping.
pub async fn call<T, F, Fut>(
    state: &Arc<AppState>,
    caller: &Caller,
    plugin: Arc<Plugin>,
    f: F,
) -> Result<T, ApiError>
where
    T: Send + 'static,
    F: FnOnce(Arc<Plugin>, Arc<crate::plugins::Runtime>, crate::plugins::TenantValues) -> Fut
        + Send
        + 'static,
    Fut: std::future::Future<Output = Result<T, CallError>> + Send + 'static,
{
    let tenant = &caller.tenant;
    let call = f(
        plugin.clone(),
        state.plugins.runtime().clone(),
        tenant.values.clone(),
    );
    let runtime = tokio::runtime::Handle::current();
    let sink = caller.debug.clone();
    let (result, elapsed) = super::blocking("plugin", move || {
        let start = Instant::now();
        let r = crate::plugins::capturing_logs(sink.as_ref(), || runtime.block_on(call));
        (r, start.elapsed())
    })
    .await?;
    caller.plugin_us.fetch_add(
        elapsed.as_micros() as u64,
        std::sync::atomic::Ordering::Relaxed,
    );
    let m = &state.metrics;
    m.plugin_calls
        .with_label_values(&[&tenant.name, &plugin.name])
        .inc();
    m.plugin_seconds
        .with_label_values(&[plugin.kind().as_str()])
        .observe(elapsed.as_secs_f64());
    result.map_err(|e| {
        m.plugin_failures
            .with_label_values(&[&tenant.name, &plugin.name, e.cause()])
            .inc();
        let mut err = ApiError::plugin(&tenant.name, &plugin.name, &e);
        err.debug = caller
            .debug
            .as_ref()
            .map(|s| Box::new(debug_report(s, None)));
        err
    })
}

/// The `gateway_debug` report for a caller that asked for one: the log lines the request's
/// plugins wrote so far and, when given, each choice's text before the output parser.
pub(super) fn debug_report(sink: &crate::common::LogSink, raw: Option<Vec<Value>>) -> Value {
    let logs = sink.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let mut report = json!({"plugin_logs": logs});
    if let Some(raw) = raw {
        report["raw_text"] = Value::Array(raw);
    }
    report
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RerankRequest {
    /// The reranker plugin's name; default: the tenant's configured reranker.
    model: Option<String>,
    query: String,
    documents: Vec<RerankDocument>,
    top_n: Option<usize>,
    #[serde(default = "yes")]
    return_documents: bool,
}

impl RerankRequest {
    fn check(&self) -> Result<(), ApiError> {
        if self.query.trim().is_empty() {
            return Err(ApiError::invalid("query", "`query` must not be empty."));
        }
        if self.documents.is_empty() {
            return Err(ApiError::invalid(
                "documents",
                "`documents` must contain at least one document.",
            ));
        }
        if self.documents.len() > 1000 {
            return Err(ApiError::invalid(
                "documents",
                "`documents` may hold at most 1000 documents.",
            ));
        }
        if self.top_n == Some(0) {
            return Err(ApiError::invalid("top_n", "`top_n` must be at least 1."));
        }
        Ok(())
    }
}

fn yes() -> bool {
    true
}

#[derive(Deserialize)]
#[serde(untagged)]
enum RerankDocument {
    Text(String),
    /// `{"text": ..., <metadata>...}`: the other fields become candidate metadata.
    Object(serde_json::Map<String, Value>),
}

/// `POST /v1/rerank` (Cohere/Jina shape), served by the tenant's reranker plugin.
pub async fn rerank(
    state: &Arc<AppState>,
    caller: &Caller,
    body: &[u8],
) -> Result<Response, ApiError> {
    let started = Instant::now();
    let result = rerank_inner(state, caller, body).await;
    let status = crate::tenancy::Outcome::of(&result);
    state
        .tenancy
        .record_plain(caller, "rerank", "rerank", started, status);
    result
}

async fn rerank_inner(
    state: &Arc<AppState>,
    caller: &Caller,
    body: &[u8],
) -> Result<Response, ApiError> {
    let tenant = &caller.tenant;
    let req: RerankRequest = serde_json::from_slice(body)?;
    req.check()?;
    let name = match (&req.model, &tenant.policy.reranker) {
        (Some(m), _) => m.clone(),
        (None, Some(r)) => r.clone(),
        (None, None) => {
            return Err(ApiError::invalid(
                "model",
                format!(
                    "Tenant `{}` has no default reranker; name a reranker plugin in `model`.",
                    tenant.name
                ),
            ))
        }
    };
    let plugin = bound(&state.plugins, tenant, &name, PluginKind::Reranker).map_err(|e| {
        // A named reranker that is not installed is a missing "model", as OpenAI reports it.
        if req.model.is_some() && e.code == Some("plugin_not_installed") {
            ApiError {
                status: StatusCode::NOT_FOUND,
                ..e
            }
        } else {
            e
        }
    })?;
    let mut originals = Vec::with_capacity(req.documents.len());
    let mut candidates = Vec::with_capacity(req.documents.len());
    for (i, d) in req.documents.into_iter().enumerate() {
        let (text, metadata, original) = match d {
            RerankDocument::Text(t) => (t.clone(), Vec::new(), Value::String(t)),
            RerankDocument::Object(map) => {
                let Some(Value::String(text)) = map.get("text") else {
                    return Err(ApiError::invalid(
                        "documents",
                        format!("documents[{i}] needs a string `text` field."),
                    ));
                };
                let metadata = crate::plugins::metadata(map.iter().filter(|(k, _)| *k != "text"));
                (text.clone(), metadata, Value::Object(map))
            }
        };
        candidates.push(Candidate {
            id: i.to_string(),
            document_id: None,
            text,
            metadata,
            score: 0.0,
        });
        originals.push(original);
    }
    let top = req.top_n.unwrap_or(usize::MAX);
    let results = rerank_order(state, caller, plugin, req.query, candidates, top).await?;
    let results: Vec<Value> = results
        .into_iter()
        .map(|(index, score)| {
            let mut r = json!({"index": index, "relevance_score": score});
            if req.return_documents {
                r["document"] = match &originals[index] {
                    Value::String(t) => json!({"text": t}),
                    other => other.clone(),
                };
            }
            r
        })
        .collect();
    let mut body = json!({"id": format!("rerank-{:032x}", rand::random::<u128>()), "model": name, "results": results});
    if let Some(sink) = &caller.debug {
        body["gateway_debug"] = debug_report(sink, None);
    }
    Ok(json_response(StatusCode::OK, &body))
}
