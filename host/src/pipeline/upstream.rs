//! The upstream target: a request made ready for a pool of replicas (`Prepared`), then sent to
//! a replica the pool picks, retried on another for failures before the first response byte.
//! The edge relays the answer back (`server/relay.rs`).

use std::sync::Arc;

use bytes::Bytes;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::error::UpstreamFailure;
use super::output::OutputStage;
use super::Error;
use crate::common::Endpoint;
use crate::metrics::Metrics;
use crate::tenancy::{Outcome, Reservation};
use crate::upstream::{Lease, Pool, SendError};

/// A request made ready for the upstream.
pub struct Prepared {
    pub body: Bytes,
    pub stream: bool,
    /// The client asked for the usage chunk (`stream_options.include_usage`); the gateway
    /// always asks for it upstream, to settle the reservation.
    pub client_usage: bool,
    /// The prompt's prefix blocks, for affinity.
    pub chain: Vec<u64>,
    /// The tenant's output parser, run on each choice's final text.
    pub output: Option<OutputStage>,
    pub citations: Option<Vec<Value>>,
    pub reservation: Reservation,
    /// The caller asked for plugin debugging: the raw text and the plugins' log lines.
    pub debug: Option<crate::common::LogSink>,
    /// A Responses request: what shapes (and stores) the answer.
    pub responses: Option<Arc<super::responses::Finisher>>,
}

/// A replica's answer, to be relayed.
pub struct Answer {
    pub lease: Lease,
    pub response: reqwest::Response,
    pub prepared: Prepared,
}

/// What came of sending a request to a pool.
pub enum Sent {
    /// A replica answered (boxed: the answer is large, and the other outcomes small).
    Answered(Box<Answer>),
    /// A replica refused the request (a 4xx other than 429): passed on as it came. The
    /// reservation is settled as failed.
    Refused {
        status: http::StatusCode,
        body: Bytes,
    },
    /// Every replica tried failed before answering (or none was available). With
    /// `may_fall_back` the reservation has been given back so that a fallback model can
    /// take the request; otherwise it is settled as failed.
    Exhausted(Error),
}

/// The body sent upstream: the client's own (fields the gateway does not read pass through),
/// with the replicas' model name, the usage chunk always asked for when streaming, and
/// `replace`'s fields set (`None` removes one).
pub fn body(
    mut body: Map<String, Value>,
    pool: &Pool,
    stream: bool,
    replace: impl IntoIterator<Item = (&'static str, Option<Value>)>,
) -> Bytes {
    if stream {
        body.insert("stream_options".into(), json!({"include_usage": true}));
    }
    body.insert("model".into(), Value::String(pool.model.clone()));
    for (k, v) in replace {
        match v {
            Some(v) => body.insert(k.into(), v),
            None => body.remove(k),
        };
    }
    Bytes::from(serde_json::to_vec(&body).expect("JSON values serialize"))
}

/// A coarse token estimate of text sent upstream (a token is ~4 bytes of English), corrected
/// at settlement from the usage the upstream reports.
pub fn estimate(text: &str) -> u64 {
    text.len().div_ceil(4) as u64
}

/// Sends `prepared` to `path` under the pool's base URL, trying up to `max_attempts` replicas.
pub async fn send(
    metrics: &Metrics,
    pool: &Arc<Pool>,
    prepared: Prepared,
    path: &str,
    may_fall_back: bool,
) -> Sent {
    let mut tried = Vec::new();
    let mut last = None;
    while tried.len() < pool.cfg.max_attempts {
        let Some(lease) = pool.pick(&prepared.chain, &tried) else {
            break;
        };
        if !tried.is_empty() {
            metrics
                .upstream
                .retries
                .with_label_values(&[&pool.name])
                .inc();
        }
        tried.push(lease.id());
        match lease.send(path, prepared.body.clone()).await {
            Ok(response) => {
                return Sent::Answered(Box::new(Answer {
                    lease,
                    response,
                    prepared,
                }))
            }
            Err(SendError::Status(status, body)) if !SendError::retryable_status(status) => {
                prepared.reservation.end(Outcome::Failed);
                return Sent::Refused { status, body };
            }
            Err(e) => last = Some(e),
        }
    }
    let e = exhausted(pool, tried.len(), last);
    match may_fall_back {
        true => prepared.reservation.release(),
        false => prepared.reservation.end(Outcome::Failed),
    }
    Sent::Exhausted(e)
}

fn exhausted(pool: &Pool, tried: usize, last: Option<SendError>) -> Error {
    let name = &pool.name;
    let (failure, message) = match last {
        None => (
            UpstreamFailure::Unavailable,
            format!("No replica of model `{name}` is available; retry shortly."),
        ),
        Some(SendError::Timeout) => (
            UpstreamFailure::Timeout,
            format!(
                "Model `{name}`: no answer within {} ms from {tried} replica(s).",
                pool.cfg.first_token_timeout_ms
            ),
        ),
        Some(SendError::Connect(why)) => (
            UpstreamFailure::Unreachable,
            format!("Model `{name}`: {tried} replica(s) could not be reached (last: {why})."),
        ),
        Some(SendError::Status(s, _)) => (
            UpstreamFailure::Failed,
            format!("Model `{name}`: {tried} replica(s) answered {s}."),
        ),
    };
    Error::Upstream { failure, message }
}

/// A tenant's logits processor cannot run on an upstream model.
pub fn remote_decode(tenant: &str, processor: &str, model: &str) -> Error {
    Error::invalid(
        "model",
        format!(
            "Tenant `{tenant}` binds the logits processor `{processor}`, which runs in the \
             decode loop; model `{model}` decodes on an upstream server, where it cannot run."
        ),
    )
}

/// What an upstream completion or embedding request is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Passthrough {
    Completion,
    Embeddings,
}

impl Passthrough {
    /// The path under the replicas' OpenAI base URL.
    pub fn path(self) -> &'static str {
        match self {
            Passthrough::Completion => "/completions",
            Passthrough::Embeddings => "/embeddings",
        }
    }

    fn endpoint(self) -> Endpoint {
        match self {
            Passthrough::Completion => Endpoint::Completions,
            Passthrough::Embeddings => Endpoint::Embeddings,
        }
    }

    /// The field holding the text sent.
    fn input(self) -> &'static str {
        match self {
            Passthrough::Completion => "prompt",
            Passthrough::Embeddings => "input",
        }
    }
}

/// A completion or embedding request for an upstream model, checked with the same rules as
/// for a local model (sampling fields, `n`, `max_tokens`, `stream`), reserved, and made ready
/// to send as the client wrote it.
pub async fn passthrough(
    tenancy: &Arc<crate::tenancy::Tenancy>,
    caller: &crate::tenancy::Caller,
    pool: &Pool,
    kind: Passthrough,
    value: &Value,
) -> Result<Prepared, Error> {
    if let (Passthrough::Completion, Some(p)) = (kind, &caller.tenant.policy.logits_processor) {
        return Err(remote_decode(&caller.tenant.name, p, &pool.name));
    }
    let (stream, include_usage, completion) = match kind {
        Passthrough::Completion => {
            let req = super::openai::CompletionRequest::deserialize(value)?;
            let max_tokens = req
                .max_tokens
                .map_or(pool.cfg.default_max_tokens, |m| m as u64);
            let gen = super::generation::generation(req.sampling, Some(max_tokens as usize), None)?;
            let n = gen.n as u64;
            (gen.stream, gen.include_usage, n * max_tokens)
        }
        Passthrough::Embeddings => (false, false, 0),
    };
    let field = kind.input();
    let text = match &value[field] {
        Value::Null => return Err(Error::invalid(field, format!("`{field}` is required."))),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let map = super::into_object(value.clone())?;
    let prompt = estimate(&text);
    let endpoint = kind.endpoint();
    let reservation = tenancy
        .reserve_tokens(caller, &pool.name, endpoint, prompt, prompt + completion)
        .await
        .map_err(Error::Denied)?;
    Ok(Prepared {
        body: self::body(map, pool, stream, []),
        stream,
        client_usage: include_usage,
        chain: crate::upstream::prefix_chain(&caller.tenant.name, &text),
        output: None,
        citations: None,
        reservation,
        debug: caller.debug.clone(),
        responses: None,
    })
}
