//! Which model serves a chat, completion or embedding request: the one it names, or, when that
//! one is saturated (or, upstream, no replica could take it), the first model of its fallback
//! chain that can. Chat runs the one pipeline (`pipeline::chat`) on each target; completions
//! and embeddings run locally (`completions.rs`, `embeddings.rs`) or pass through to an
//! upstream (`pipeline::upstream`). The model that served is in the `x-gateway-model` header
//! and in the ledger.

use std::sync::Arc;

use serde_json::Value;

use super::error::ApiError;
use super::reply::Reply;
use super::routes::Endpoint;
use super::{cache, embeddings, relay, AppState, Response};
use crate::pipeline::cache::Keyed;
use crate::pipeline::chat::{ChatRequest, LocalRun, Served};
use crate::pipeline::upstream::{self, Passthrough, Sent};
use crate::tenancy::Caller;
use crate::upstream::Pool;

/// What came of trying one model of the chain.
enum Attempt {
    /// Answered: a response, or an error for the client.
    Done(Result<Response, ApiError>),
    /// Every replica failed before answering; the next model may take the request.
    Exhausted(ApiError),
}

pub(super) async fn serve(
    state: &Arc<AppState>,
    caller: &Caller,
    body: &[u8],
    endpoint: Endpoint,
) -> Result<Response, ApiError> {
    if endpoint == Endpoint::Chat {
        return chat(state, caller, body).await;
    }
    let value: Value = serde_json::from_slice(body)?;
    let Some(first) = value.get("model").and_then(Value::as_str) else {
        return Err(ApiError::invalid("model", "`model` is required."));
    };
    let kind = match endpoint {
        Endpoint::Embeddings => Passthrough::Embeddings,
        _ => Passthrough::Completion,
    };
    let run = || async {
        let mut chain = Chain::new(state, first);
        while let Some((name, may_fall_back)) = chain.next(state, caller) {
            let attempt = match state.upstreams.get(&name) {
                Some(pool) => forward(state, caller, pool, kind, &value, may_fall_back).await,
                None => Attempt::Done(match kind {
                    Passthrough::Embeddings => match state.embedder(&caller.tenant, &name) {
                        Ok(e) => embeddings::embeddings(state, caller, &e, &value).await,
                        Err(e) => Err(e),
                    },
                    Passthrough::Completion => local_completion(state, caller, &name, &value).await,
                }),
            };
            if let Some(done) = chain.settle(state, &name, attempt) {
                return done;
            }
        }
        Err(chain.failed())
    };
    match (kind, value.as_object()) {
        (Passthrough::Completion, Some(body)) => {
            let keyed = Keyed::completion(first, body);
            cache::through(state, caller, keyed, run).await
        }
        _ => run().await,
    }
}

/// A chat request: parsed and checked once (body and tenant), then served by the first model
/// of its chain that can.
async fn chat(state: &Arc<AppState>, caller: &Caller, body: &[u8]) -> Result<Response, ApiError> {
    serve_chat(state, caller, ChatRequest::parse(body)?).await
}

/// Serves a parsed chat request (a chat's, or a Responses request's) with the first model of
/// its chain that can.
pub(super) async fn serve_chat(
    state: &Arc<AppState>,
    caller: &Caller,
    req: ChatRequest,
) -> Result<Response, ApiError> {
    let stages = state.stages();
    let plan = req.plan(&stages, caller)?;
    let keyed = req.keyed(&plan);
    let run = || async {
        let mut chain = Chain::new(state, &req.model);
        while let Some((name, may_fall_back)) = chain.next(state, caller) {
            let attempt = match state.target(&caller.tenant, &name) {
                Err(e) => Attempt::Done(Err(e)),
                Ok(target) => match req
                    .serve(&stages, caller, &plan, &target, may_fall_back)
                    .await
                {
                    Err(e) => Attempt::Done(Err(e.into())),
                    Ok(Served::Local(run)) => {
                        Attempt::Done(local_chat(state, caller, &name, *run).await)
                    }
                    Ok(Served::Upstream { pool, sent }) => answer(&pool, sent, may_fall_back).await,
                },
            };
            if let Some(done) = chain.settle(state, &name, attempt) {
                return done;
            }
        }
        Err(chain.failed())
    };
    cache::through(state, caller, keyed, run).await
}

async fn local_chat(
    state: &AppState,
    caller: &Caller,
    model: &str,
    run: LocalRun,
) -> Result<Response, ApiError> {
    let mut reply = Reply::new(
        Endpoint::Chat,
        "chatcmpl",
        model.into(),
        run.engine,
        &run.gen,
        None,
    );
    reply.output = run.output;
    reply.tools = run.tools;
    reply.debug = caller.debug.clone();
    reply.reservation = Some(run.reservation);
    reply.citations = run.citations;
    reply.responses = run.responses;
    reply
        .run(run.streams, run.gen.stream, state.shutdown.cut())
        .await
}

async fn local_completion(
    state: &AppState,
    caller: &Caller,
    model: &str,
    body: &Value,
) -> Result<Response, ApiError> {
    let engine = state.engine(&caller.tenant, model)?;
    let run = crate::pipeline::completion::run(&state.stages(), caller, &engine, body).await?;
    let (gen, echo) = (run.gen, run.echo);
    let mut reply = Reply::new(
        Endpoint::Completions,
        "cmpl",
        model.into(),
        run.engine,
        &gen,
        echo,
    );
    reply.debug = caller.debug.clone();
    reply.reservation = Some(run.reservation);
    reply
        .run(run.streams, gen.stream, state.shutdown.cut())
        .await
}

/// A completion or embedding request for an upstream model, as the client wrote it.
async fn forward(
    state: &AppState,
    caller: &Caller,
    pool: &Arc<Pool>,
    kind: Passthrough,
    body: &Value,
    may_fall_back: bool,
) -> Attempt {
    if let Err(e) = state.target(&caller.tenant, &pool.name) {
        return Attempt::Done(Err(e));
    }
    let prepared = match upstream::passthrough(&state.tenancy, caller, pool, kind, body).await {
        Ok(p) => p,
        Err(e) => return Attempt::Done(Err(e.into())),
    };
    let sent = upstream::send(&state.metrics, pool, prepared, kind.path(), may_fall_back).await;
    answer(pool, sent, may_fall_back).await
}

/// An upstream's answer relayed, its refusal passed on, or its failure handed to the chain.
async fn answer(pool: &Arc<Pool>, sent: Sent, may_fall_back: bool) -> Attempt {
    match sent {
        Sent::Answered(a) => {
            Attempt::Done(relay::relay(pool, a.lease, a.response, a.prepared).await)
        }
        Sent::Refused { status, body } => Attempt::Done(Ok(relay::upstream_error(status, body))),
        Sent::Exhausted(e) if may_fall_back => Attempt::Exhausted(e.into()),
        Sent::Exhausted(e) => Attempt::Done(Err(e.into())),
    }
}

/// `model` and then its fallbacks, tried in order: a model past its `saturated_waiting` is
/// skipped unless it is the last, as is a fallback the tenant may not use.
struct Chain {
    model: String,
    names: Vec<String>,
    next: usize,
    /// Why the last model tried could not take the request.
    exhausted: Option<ApiError>,
}

impl Chain {
    fn new(state: &AppState, model: &str) -> Self {
        Self {
            model: model.to_string(),
            names: state.fallback_chain(model),
            next: 0,
            exhausted: None,
        }
    }

    /// The next model to try, and whether a fallback may follow it.
    fn next(&mut self, state: &AppState, caller: &Caller) -> Option<(String, bool)> {
        let last = self.names.len() - 1;
        while self.next <= last {
            let i = self.next;
            self.next += 1;
            let name = &self.names[i];
            if i > 0 && !caller.tenant.allows_model(name) {
                continue;
            }
            if i < last && saturated(state, name) {
                continue;
            }
            return Some((name.clone(), i < last));
        }
        None
    }

    /// The answer, if `attempt` is one: the model that served named in `x-gateway-model`, a
    /// fallback counted.
    fn settle(
        &mut self,
        state: &AppState,
        name: &str,
        attempt: Attempt,
    ) -> Option<Result<Response, ApiError>> {
        let served = match attempt {
            Attempt::Done(r) => r,
            Attempt::Exhausted(e) => {
                self.exhausted = Some(e);
                return None;
            }
        };
        if name != self.model {
            state
                .metrics
                .upstream
                .fallbacks
                .with_label_values(&[&self.model, name])
                .inc();
        }
        Some(served.map(|mut response| {
            if let Ok(v) = http::HeaderValue::from_str(name) {
                response.headers_mut().insert("x-gateway-model", v);
            }
            response
        }))
    }

    /// Why no model of the chain served.
    fn failed(self) -> ApiError {
        self.exhausted.unwrap_or_else(|| {
            ApiError::overloaded(format!(
                "Model `{}` and its fallbacks are saturated; retry shortly.",
                self.model
            ))
        })
    }
}

/// The model takes no new requests for now: a local engine's queue or every replica's is past
/// its `saturated_waiting`, or no replica is available.
fn saturated(state: &AppState, name: &str) -> bool {
    if let Some(pool) = state.upstreams.get(name) {
        return pool.saturated();
    }
    match (state.engines.get(name), state.fallbacks.get(name)) {
        (Some(engine), Some(f)) if f.saturated_waiting > 0 => {
            engine.waiting() > f.saturated_waiting
        }
        _ => false,
    }
}
