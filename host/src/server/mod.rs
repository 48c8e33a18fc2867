//! The HTTP edge: hyper 1 over tokio, routing, body limits, OpenAI errors, SSE framing.
//! Handlers parse and validate requests into engine types; all model work happens on the
//! engine threads, so no handler blocks the runtime on compute.

mod admin;
mod collections;
mod completions;
mod conn;
pub use conn::raise_fd_limit;
mod embeddings;
pub mod error;
pub mod openai;
mod plugins;
mod rag;
mod reply;
pub mod tls;
mod validation;

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{header, Method, StatusCode};
use http_body_util::{combinators::UnsyncBoxBody, BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use serde_json::json;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::engine::Engine;
use crate::metrics::Metrics;
use error::ApiError;

pub type Response = http::Response<UnsyncBoxBody<Bytes, Infallible>>;

pub const SYSTEM_FINGERPRINT: &str = concat!("fp_gateway_", env!("CARGO_PKG_VERSION"));

pub struct AppState {
    pub engines: BTreeMap<String, Arc<Engine>>,
    pub embedders: BTreeMap<String, Arc<crate::search::embedder::Embedder>>,
    pub collections: Arc<crate::search::Collections>,
    pub metrics: Arc<Metrics>,
    pub max_body_bytes: usize,
    pub started: u64,
    pub plugins: Arc<crate::plugins::Registry>,
    pub tenancy: Arc<crate::tenancy::Tenancy>,
    pub admin_token: Option<String>,
    pub max_upload_bytes: usize,
    pub shutdown: Shutdown,
    /// Connection and body deadlines and caps.
    pub http: crate::config::HttpConfig,
}

/// What a SIGTERM sets in motion. First `draining`: `/ready` turns 503 and no connection is
/// taken while requests in flight finish. Then, at the drain deadline, `cut`: generations still
/// running end with a `server_shutting_down` error (and their tenant is charged what was
/// generated) instead of vanishing with the process.
pub struct Shutdown {
    draining: std::sync::atomic::AtomicBool,
    cut: tokio::sync::watch::Sender<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self {
            draining: Default::default(),
            cut: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl Shutdown {
    pub fn draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Resolves once the drain deadline has passed; never, until then.
    pub fn cut(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.cut.subscribe();
        async move {
            if rx.wait_for(|cut| *cut).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

impl AppState {
    /// The embedding model `model`, if the tenant may use it.
    pub fn embedder(
        &self,
        tenant: &crate::tenancy::Tenant,
        model: &str,
    ) -> Result<Arc<crate::search::embedder::Embedder>, ApiError> {
        allowed_model(&self.embedders, tenant, model)
    }

    /// The engine serving `model`, if the tenant may use it.
    pub fn engine(
        &self,
        tenant: &crate::tenancy::Tenant,
        model: &str,
    ) -> Result<Arc<Engine>, ApiError> {
        allowed_model(&self.engines, tenant, model)
    }
}

/// `model` from `models`: 404 (listing the tenant's models) when it does not exist, 403 when
/// the tenant's policy does not allow it.
fn allowed_model<T>(
    models: &BTreeMap<String, Arc<T>>,
    tenant: &crate::tenancy::Tenant,
    model: &str,
) -> Result<Arc<T>, ApiError> {
    let found = models.get(model).cloned().ok_or_else(|| {
        let allowed: Vec<String> = models
            .keys()
            .filter(|m| tenant.allows_model(m))
            .cloned()
            .collect();
        ApiError::model_not_found(model, &allowed)
    })?;
    if !tenant.allows_model(model) {
        return Err(ApiError::forbidden(
            "model",
            format!("Tenant `{}` may not use model `{model}`.", tenant.name),
        ));
    }
    Ok(found)
}

pub fn json_response(status: StatusCode, v: &serde_json::Value) -> Response {
    http::Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed_unsync())
        .expect("static headers are valid")
}

fn text_response(content_type: &'static str, text: String) -> Response {
    http::Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(text)).boxed_unsync())
        .expect("static headers are valid")
}

/// Server-sent events from a channel of already framed `data: ...\n\n` chunks.
pub fn sse_response(rx: mpsc::Receiver<Bytes>) -> Response {
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok(Frame::data(b)), rx))
    });
    http::Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(BodyExt::boxed_unsync(StreamBody::new(frames)))
        .expect("static headers are valid")
}

impl From<&ApiError> for Response {
    fn from(e: &ApiError) -> Self {
        let mut r = json_response(e.status, &e.body());
        if let Some(s) = e.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, s.into());
        }
        r
    }
}

/// Takes the request body (once) and reads it whole, up to `limit` bytes.
async fn read_body(
    headers: &http::HeaderMap,
    body: &mut Option<Incoming>,
    limit: usize,
    http: &crate::config::HttpConfig,
) -> Result<Bytes, ApiError> {
    let body = body.take().expect("a request body is read at most once");
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
    {
        if len > limit {
            return Err(ApiError::too_large(limit));
        }
    }
    conn::collect_body(body, limit, http)
        .await
        .map_err(|e| match e {
            conn::BodyError::TooLarge => ApiError::too_large(limit),
            conn::BodyError::TooSlow => {
                ApiError::body_timeout(http.body_timeout_ms, http.min_body_rate)
            }
            conn::BodyError::Broken(e) => {
                ApiError::invalid(None, format!("Could not read the request body: {e}"))
            }
        })
}

/// Reads and discards an unread body so the answer to a refused request reaches the client
/// and the connection stays usable (a "lingering close", bounded in bytes and time). False if
/// the body was too large, too slow or broken: the connection must then close.
async fn discard(body: Incoming, limit: usize) -> bool {
    let drain = Limited::new(body, limit).collect();
    matches!(
        tokio::time::timeout(std::time::Duration::from_secs(2), drain).await,
        Ok(Ok(_))
    )
}

async fn route(
    state: Arc<AppState>,
    req: &http::request::Parts,
    body: &mut Option<Incoming>,
) -> Result<Response, ApiError> {
    let path = req.uri.path().to_string();
    let method = req.method.clone();
    let post = |m: &Method| m == Method::POST;
    match path.as_str() {
        "/v1/chat/completions" | "/v1/completions" | "/v1/rerank" | "/v1/embeddings"
            if post(&method) =>
        {
            let caller = state
                .tenancy
                .admit_billable(&req.headers)
                .map_err(ApiError::denied)?;
            let body = read_body(&req.headers, body, state.max_body_bytes, &state.http).await?;
            match path.as_str() {
                "/v1/chat/completions" => completions::chat(&state, &caller, &body).await,
                "/v1/completions" => completions::completion(&state, &caller, &body).await,
                "/v1/embeddings" => embeddings::embeddings(&state, &caller, &body).await,
                _ => plugins::rerank(&state, &caller, &body).await,
            }
        }
        "/v1/models" if method == Method::GET => {
            let caller = state
                .tenancy
                .admit(&req.headers)
                .map_err(ApiError::denied)?;
            let mut data: Vec<_> = state
                .engines
                .values()
                .filter(|e| caller.allows_model(&e.info.name))
                .map(|e| model_card(&state, e))
                .collect();
            data.extend(
                state
                    .embedders
                    .values()
                    .filter(|e| caller.allows_model(&e.name))
                    .map(|e| embeddings::model_card(e, state.started)),
            );
            Ok(json_response(
                StatusCode::OK,
                &json!({"object": "list", "data": data}),
            ))
        }
        p if p.starts_with("/v1/models/") && method == Method::GET => {
            let caller = state
                .tenancy
                .admit(&req.headers)
                .map_err(ApiError::denied)?;
            let id = &p["/v1/models/".len()..];
            if state.embedders.contains_key(id) {
                let e = state.embedder(&caller, id)?;
                let card = embeddings::model_card(&e, state.started);
                return Ok(json_response(StatusCode::OK, &card));
            }
            let engine = state.engine(&caller, id)?;
            Ok(json_response(StatusCode::OK, &model_card(&state, &engine)))
        }
        p if p == "/v1/collections" || p.starts_with("/v1/collections/") => {
            let caller = state
                .tenancy
                .admit_billable(&req.headers)
                .map_err(ApiError::denied)?;
            let content_type = req
                .headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let body = if matches!(method, Method::POST | Method::PUT) {
                read_body(&req.headers, body, state.max_body_bytes, &state.http).await?
            } else {
                Bytes::new()
            };
            let rest = &p["/v1/collections".len()..];
            collections::route(
                &state,
                &caller,
                &method,
                rest,
                content_type.as_deref(),
                body,
            )
            .await
        }
        "/health" if method == Method::GET => {
            Ok(json_response(StatusCode::OK, &json!({"status": "ok"})))
        }
        "/ready" if method == Method::GET => {
            if state.shutdown.draining() {
                Err(ApiError::overloaded(
                    "Draining: the gateway is shutting down.",
                ))
            } else {
                let models: Vec<_> = state.engines.keys().collect();
                Ok(json_response(
                    StatusCode::OK,
                    &json!({"status": "ready", "models": models}),
                ))
            }
        }
        "/metrics" if method == Method::GET => {
            if let Some(l) = &state.tenancy.ledger {
                let h = l.health();
                let (pending, spilled) = (h.pending_rows(), h.spilled_rows());
                let m = &state.metrics.ledger;
                m.observe(h.failing(), pending, spilled, h.write_failures());
            }
            Ok(text_response(
                "text/plain; version=0.0.4",
                state.metrics.render(),
            ))
        }
        p if p.starts_with("/admin/") => {
            admin::authorized(&state, &req.headers)?;
            let query = req.uri.query().map(str::to_string);
            let body = if method == Method::PUT {
                Some(read_body(&req.headers, body, state.max_upload_bytes, &state.http).await?)
            } else {
                None
            };
            admin::route(&state, &method, &path, query.as_deref(), body).await
        }
        "/v1/chat/completions"
        | "/v1/completions"
        | "/v1/rerank"
        | "/v1/embeddings"
        | "/v1/models"
        | "/health"
        | "/ready"
        | "/metrics" => Err(ApiError::method_not_allowed(&method, &path)),
        _ => Err(ApiError::not_found(&path)),
    }
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

/// The route label for metrics: known routes by name, everything else lumped together so a
/// scanner cannot blow up the label set.
fn route_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat_completions",
        "/v1/completions" => "completions",
        "/health" => "health",
        "/ready" => "ready",
        "/metrics" => "metrics",
        "/v1/rerank" => "rerank",
        "/v1/embeddings" => "embeddings",
        p if p.starts_with("/v1/collections") => "collections",
        p if p.starts_with("/v1/models") => "models",
        p if p.starts_with("/admin/") => "admin",
        _ => "other",
    }
}

pub(super) async fn handle(
    state: Arc<AppState>,
    role: Role,
    req: http::Request<Incoming>,
) -> Result<Response, Infallible> {
    let start = Instant::now();
    let label = route_label(req.uri().path());
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let admin = path.starts_with("/admin/");
    let shared = matches!(path.as_str(), "/health" | "/ready" | "/metrics");
    let allowed = match role {
        Role::All => true,
        Role::Api => !admin,
        Role::Admin => admin || shared,
    };
    let (parts, body) = req.into_parts();
    let http1 = parts.version < http::Version::HTTP_2;
    let mut body = Some(body);
    let routed = if allowed {
        route(state.clone(), &parts, &mut body).await
    } else {
        Err(ApiError::not_found(&path))
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
    state
        .shutdown
        .draining
        .store(true, std::sync::atomic::Ordering::Relaxed);
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
    state.shutdown.cut.send_replace(true);
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
