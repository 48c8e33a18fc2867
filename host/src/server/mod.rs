//! The HTTP edge: hyper 1 over tokio, routing, body limits, OpenAI errors, SSE framing.
//! Handlers parse and validate requests into engine types; all model work happens on the
//! engine threads, so no handler blocks the runtime on compute.

mod admin;
mod admin_views;
mod audit;
mod bodies;
mod cache;
mod collections;
mod conn;
pub mod console;
mod deadlines;
mod dispatch;
pub use conn::raise_fd_limit;
mod embeddings;
pub mod error;
mod keys;
mod logprobs;
pub mod overview;
mod plugin_admin;
mod plugins;
mod policies;
mod relay;
mod reply;
mod responses;
mod routes;
mod sse;
mod state;
mod tenants;
pub use state::{AppState, Fallback, Shutdown};
pub mod tls;
mod tool_calls;

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{header, Method, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use hyper::body::Incoming;
use serde_json::json;
use tokio::net::TcpListener;

use crate::engine::Engine;
use bodies::{discard, read_body, text_response};
pub use bodies::{json_response, sse_response};
use error::ApiError;
use routes::{Endpoint, Resolved};

pub type Response = http::Response<UnsyncBoxBody<Bytes, Infallible>>;

pub const SYSTEM_FINGERPRINT: &str = concat!("fp_gateway_", env!("CARGO_PKG_VERSION"));

/// The tenant behind the request's bearer key, within its limits; `billable` requests are also
/// refused while the usage ledger cannot record them.
async fn admit(
    state: &AppState,
    headers: &http::HeaderMap,
    billable: bool,
) -> Result<crate::tenancy::Caller, ApiError> {
    let token = bearer(headers);
    let admitted = state.tenancy.admit_request(token, billable).await;
    let mut caller = admitted.map_err(ApiError::denied)?;
    if let Some(v) = headers.get("x-gateway-debug") {
        if v.as_bytes() != b"plugins" {
            return Err(ApiError::invalid(
                None,
                "`x-gateway-debug` takes one value: `plugins`.",
            ));
        }
        if !caller.tenant.policy.plugin_debug {
            return Err(ApiError::forbidden(
                "x-gateway-debug",
                format!(
                    "Tenant `{}` may not ask for plugin debugging: its policy needs `plugin_debug = true`.",
                    caller.tenant.name
                ),
            ));
        }
        caller.debug = Some(Default::default());
    }
    caller.no_cache = headers
        .get_all(header::CACHE_CONTROL)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .any(|d| {
            let d = d.trim();
            d.eq_ignore_ascii_case("no-cache") || d.eq_ignore_ascii_case("no-store")
        });
    Ok(caller)
}

/// The token of an `Authorization: Bearer <token>` header; the scheme is case-insensitive
/// (RFC 9110).
pub(super) fn bearer(headers: &http::HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.trim_start().split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

async fn route(
    state: Arc<AppState>,
    (endpoint, secure): (Endpoint, bool),
    req: &http::request::Parts,
    body: &mut Option<Incoming>,
) -> Result<Response, ApiError> {
    let path = req.uri.path();
    match endpoint {
        Endpoint::Chat
        | Endpoint::Completions
        | Endpoint::Responses
        | Endpoint::Rerank
        | Endpoint::Embeddings => {
            let caller = admit(&state, &req.headers, true).await?;
            let body = read_body(&req.headers, body, state.max_body_bytes, &state.http).await?;
            match endpoint {
                Endpoint::Rerank => plugins::rerank(&state, &caller, &body).await,
                Endpoint::Responses => responses::create(&state, &caller, &body).await,
                _ => dispatch::serve(&state, &caller, &body, endpoint).await,
            }
        }
        Endpoint::Response => {
            let caller = admit(&state, &req.headers, false).await?;
            let rest = &path["/v1/responses/".len()..];
            let query = req.uri.query();
            responses::stored(&state, &caller, &req.method, rest, query).await
        }
        Endpoint::Models => {
            let caller = admit(&state, &req.headers, false).await?;
            Ok(json_response(StatusCode::OK, &models(&state, &caller)))
        }
        Endpoint::Model => {
            let caller = admit(&state, &req.headers, false).await?;
            let id = &path["/v1/models/".len()..];
            if state.embedders.contains_key(id) {
                let e = state.embedder(&caller, id)?;
                let card = embeddings::model_card(&e, state.started);
                return Ok(json_response(StatusCode::OK, &card));
            }
            if state.upstreams.get(id).is_some() && caller.allows_model(id) {
                let card = upstream_card(id, state.started);
                return Ok(json_response(StatusCode::OK, &card));
            }
            let engine = state.engine(&caller, id)?;
            Ok(json_response(StatusCode::OK, &model_card(&state, &engine)))
        }
        // Search and Documents name what a collection request charges; the route is one.
        Endpoint::Collections | Endpoint::Search | Endpoint::Documents => {
            let caller = admit(&state, &req.headers, true).await?;
            let content_type = req
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let body = if matches!(req.method, Method::POST | Method::PUT) {
                read_body(&req.headers, body, state.max_body_bytes, &state.http).await?
            } else {
                Bytes::new()
            };
            let rest = &path["/v1/collections".len()..];
            let ct = content_type.as_deref();
            collections::route(&state, &caller, &req.method, rest, ct, body).await
        }
        Endpoint::Health => Ok(json_response(StatusCode::OK, &json!({"status": "ok"}))),
        Endpoint::Ready => ready(&state),
        Endpoint::Metrics => Ok(metrics(&state)),
        Endpoint::Admin => {
            audit::enabled(&state)?;
            if let Some(served) = console::serve(&state, secure, req, body).await {
                return served;
            }
            // A bearer token wins; without one, the console's session cookie may stand in.
            let session = match bearer(&req.headers) {
                None => console::session_actor(&state, &req.headers, &req.method),
                Some(_) => None,
            };
            let actor = match session {
                Some(s) => s?,
                None => audit::authorized(&state, &req.headers)?,
            };
            audit::permitted(&actor, &req.method)?;
            let query = req.uri.query().map(str::to_string);
            let body = if matches!(req.method, Method::PUT | Method::POST) {
                Some(read_body(&req.headers, body, state.max_upload_bytes, &state.http).await?)
            } else {
                None
            };
            admin::route(&state, &actor, &req.method, path, query.as_deref(), body).await
        }
    }
}

/// `/v1/models`: the tenant's chat and embedding models.
fn models(state: &AppState, caller: &crate::tenancy::Caller) -> serde_json::Value {
    let mut data: Vec<_> = state
        .engines
        .values()
        .filter(|e| caller.allows_model(&e.info.name))
        .map(|e| model_card(state, e))
        .collect();
    data.extend(
        state
            .embedders
            .values()
            .filter(|e| caller.allows_model(&e.name))
            .map(|e| embeddings::model_card(e, state.started)),
    );
    data.extend(
        state
            .upstreams
            .names()
            .filter(|m| caller.allows_model(m))
            .map(|m| upstream_card(m, state.started)),
    );
    json!({"object": "list", "data": data})
}

/// A model served upstream: what its replicas can do is theirs to say.
fn upstream_card(id: &str, created: u64) -> serde_json::Value {
    json!({"id": id, "object": "model", "created": created, "owned_by": "gateway", "upstream": true})
}

fn ready(state: &AppState) -> Result<Response, ApiError> {
    if state.shutdown.draining() {
        return Err(ApiError::overloaded(
            "Draining: the gateway is shutting down.",
        ));
    }
    let models: Vec<_> = state.engines.keys().collect();
    Ok(json_response(
        StatusCode::OK,
        &json!({"status": "ready", "models": models}),
    ))
}

/// `/metrics`, with the ledger writer's state read at scrape time.
fn metrics(state: &AppState) -> Response {
    if let Some(l) = &state.tenancy.ledger {
        let h = l.health();
        let (pending, spilled) = (h.pending_rows(), h.spilled_rows());
        let m = &state.metrics.ledger;
        m.observe(h.failing(), pending, spilled, h.write_failures());
    }
    text_response("text/plain; version=0.0.4", state.metrics.render())
}

fn model_card(state: &AppState, e: &Engine) -> serde_json::Value {
    json!({
        "id": e.info.name,
        "object": "model",
        "created": state.started,
        "owned_by": "gateway",
        "max_model_len": e.info.max_model_len,
    })
}

/// Answers one request; `secure`: it came over TLS (the console's cookie is then `Secure`).
pub(super) async fn handle(
    state: Arc<AppState>,
    (role, secure): (Role, bool),
    req: http::Request<Incoming>,
) -> Result<Response, Infallible> {
    let start = Instant::now();
    let label = routes::label(req.uri().path());
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let (parts, body) = req.into_parts();
    let http1 = parts.version < http::Version::HTTP_2;
    let mut body = Some(body);
    // A listener does not reveal the other listener's routes: they are unknown here.
    let routed = match routes::resolve(&method, &path) {
        Resolved::Found(e) if e.served_by(role) => {
            route(state.clone(), (e, secure), &parts, &mut body).await
        }
        Resolved::WrongMethod(e) if e.served_by(role) => {
            Err(ApiError::method_not_allowed(&method, &path))
        }
        _ => Err(ApiError::not_found(&path)),
    };
    let resp = match routed {
        Ok(r) => r,
        Err(e) => {
            if e.status.is_server_error() {
                tracing::warn!(status = %e.status, message = %e.message, "request failed");
            }
            let mut r = Response::from(&e);
            // An HTTP/1 connection whose request body was left half-read cannot carry another
            // request: hyper closes it, and a client that pooled it would fail its next request
            // on a dead socket. Refusals that never looked at the body drain it first; what
            // cannot be drained (or was cut off by the size limit) says `connection: close`.
            let reusable = match body.take() {
                Some(b) if hyper::body::Body::is_end_stream(&b) => true,
                Some(b) => discard(b, state.max_body_bytes).await,
                None => !matches!(
                    e.status,
                    StatusCode::PAYLOAD_TOO_LARGE | StatusCode::REQUEST_TIMEOUT
                ),
            };
            if http1 && !reusable {
                r.headers_mut().insert(
                    header::CONNECTION,
                    header::HeaderValue::from_static("close"),
                );
            }
            r
        }
    };
    let elapsed = start.elapsed();
    tracing::debug!(%method, route = label, status = resp.status().as_u16(), ms = elapsed.as_secs_f64() * 1e3, "response head");
    state
        .metrics
        .http_requests
        .with_label_values(&[label, resp.status().as_str()])
        .inc();
    state.metrics.http_latency.observe(elapsed.as_secs_f64());
    Ok(resp)
}

/// What a listener serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The API and, without a separate admin listener, `/admin/*`.
    All,
    /// The API only (`/admin/*` is served elsewhere).
    Api,
    /// `/admin/*` (plus `/health`, `/ready`, `/metrics`) only.
    Admin,
}

pub struct Listener {
    pub tcp: TcpListener,
    pub tls: Option<Arc<tls::Tls>>,
    pub role: Role,
}

/// How long cut responses get to send their final error before the process exits.
const CUT_GRACE: std::time::Duration = std::time::Duration::from_secs(3);

/// Accepts connections until ctrl-c / SIGTERM; then `/ready` turns 503, no new connections are
/// taken, and requests and streams in flight get up to `drain` to finish before they are cut.
pub async fn serve(
    listeners: Vec<Listener>,
    state: Arc<AppState>,
    drain: std::time::Duration,
) -> std::io::Result<()> {
    overview::start(&state);
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let (max, per_client) = (
        state.http.max_connections,
        state.http.max_connections_per_client,
    );
    // A gate per listener: a flood on the API port leaves the admin port usable.
    let gates: Vec<_> = listeners
        .iter()
        .map(|_| conn::Gate::new(max, per_client))
        .collect();
    let accepting: Vec<_> = listeners
        .into_iter()
        .zip(&gates)
        .map(|(l, gate)| {
            tokio::spawn(conn::accept_loop(
                l,
                state.clone(),
                gate.clone(),
                stop_rx.clone(),
            ))
        })
        .collect();
    shutdown_signal().await;
    state.shutdown.start_draining();
    let _ = stop_tx.send(true);
    for a in accepting {
        let _ = a.await;
    }
    tracing::info!(
        deadline_s = drain.as_secs(),
        "draining: waiting for requests in flight"
    );
    let drained = async {
        for g in &gates {
            g.drained().await;
        }
    };
    tokio::pin!(drained);
    tokio::select! {
        _ = &mut drained => {
            tracing::info!("drained");
            return Ok(());
        }
        _ = tokio::time::sleep(drain) => {}
    }
    tracing::warn!("requests still in flight at the drain deadline; cutting them");
    state.shutdown.cut_now();
    // The cut responses end with an error event, which the clients still have to be sent.
    if tokio::time::timeout(CUT_GRACE, drained).await.is_err() {
        tracing::warn!("connections still open after the cut; exiting");
    }
    Ok(())
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("signal handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}
