//! Chat and completion requests for an upstream model: the same pipeline as a local model
//! around the call (tenant checks, RAG and `documents` grounding, the prompt-template plugin
//! when it returns messages, the token reservation, the output parser, citations, ledger),
//! then the request goes to a replica picked by the pool, retried on another for failures
//! before the first response byte. `relay.rs` carries the answer back.

use std::sync::Arc;

use bytes::Bytes;
use serde_json::{json, Map, Value};

use super::completions::output_stage;
use super::dispatch::Api;
use super::error::ApiError;
use super::openai::{Document, ResponseFormat};
use super::{relay, AppState, Response};
use crate::engine::chat_template::ChatMessage;
use crate::pipeline::grounding;
use crate::pipeline::output::OutputStage;
use crate::pipeline::{PluginCalls, Retrieval};
use crate::plugins::{ContextChunk, RenderedPrompt};
use crate::tenancy::{Caller, Outcome, Reservation};
use crate::upstream::{Pool, SendError};

/// What came of sending a request to a pool.
pub(super) enum Forwarded {
    /// Answered: a response, or an error for the client.
    Done(Result<Response, ApiError>),
    /// Every replica tried failed before answering (or none was available); the request's
    /// reservation has been given back so that a fallback model can take it.
    Exhausted(ApiError),
}

/// A request made ready for the upstream.
pub(super) struct Prepared {
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
}

/// Prepares the request and sends it, trying up to `max_attempts` replicas. With
/// `may_fall_back`, running out of replicas gives `Exhausted`; otherwise it is the client's
/// 502/503/504.
pub(super) async fn forward(
    state: &Arc<AppState>,
    caller: &Caller,
    pool: &Arc<Pool>,
    body: &[u8],
    api: Api,
    may_fall_back: bool,
) -> Forwarded {
    let prepared = match prepare(state, caller, pool, body, api).await {
        Ok(p) => p,
        Err(e) => return Forwarded::Done(Err(e)),
    };
    let path = api.path();
    let mut tried = Vec::new();
    let mut last = None;
    while tried.len() < pool.cfg.max_attempts {
        let Some(lease) = pool.pick(&prepared.chain, &tried) else {
            break;
        };
        if !tried.is_empty() {
            state
                .metrics
                .upstream
                .retries
                .with_label_values(&[&pool.name])
                .inc();
        }
        tried.push(lease.id());
        match lease.send(path, prepared.body.clone()).await {
            Ok(resp) => return Forwarded::Done(relay::relay(pool, lease, resp, prepared).await),
            Err(SendError::Status(status, body)) if !SendError::retryable_status(status) => {
                prepared.reservation.end(Outcome::Failed);
                return Forwarded::Done(Ok(relay::upstream_error(status, body)));
            }
            Err(e) => last = Some(e),
        }
    }
    let e = exhausted(pool, tried.len(), last);
    if may_fall_back {
        prepared.reservation.release();
        return Forwarded::Exhausted(e);
    }
    prepared.reservation.end(Outcome::Failed);
    Forwarded::Done(Err(e))
}

fn exhausted(pool: &Pool, tried: usize, last: Option<SendError>) -> ApiError {
    let name = &pool.name;
    match last {
        None => ApiError::upstream(
            http::StatusCode::SERVICE_UNAVAILABLE,
            "upstream_unavailable",
            format!("No replica of model `{name}` is available; retry shortly."),
        ),
        Some(SendError::Timeout) => ApiError::upstream(
            http::StatusCode::GATEWAY_TIMEOUT,
            "upstream_timeout",
            format!(
                "Model `{name}`: no answer within {} ms from {tried} replica(s).",
                pool.cfg.first_token_timeout_ms
            ),
        ),
        Some(SendError::Connect(why)) => ApiError::upstream(
            http::StatusCode::BAD_GATEWAY,
            "upstream_unavailable",
            format!("Model `{name}`: {tried} replica(s) could not be reached (last: {why})."),
        ),
        Some(SendError::Status(s, _)) => ApiError::upstream(
            http::StatusCode::BAD_GATEWAY,
            "upstream_error",
            format!("Model `{name}`: {tried} replica(s) answered {s}."),
        ),
    }
}

async fn prepare(
    state: &Arc<AppState>,
    caller: &Caller,
    pool: &Arc<Pool>,
    body: &[u8],
    api: Api,
) -> Result<Prepared, ApiError> {
    check_tenant(caller, pool, api)?;
    let tenant = &caller.tenant;
    let mut req: Map<String, Value> = serde_json::from_slice(body)?;
    let stream = flag(&req, "stream")? && api != Api::Embeddings;
    let n = count(&req, "n", 1)?.max(1);
    let max_tokens = completion_budget(api, &req, pool)?;
    let output = match api {
        Api::Embeddings => None,
        _ => parser(state.plugin_calls(), caller, &req)?,
    };
    let (text, citations) = match api {
        Api::Chat => chat_prompt(&state.retrieval(), caller, pool, &mut req).await?,
        Api::Completion => (input_text(&req, "prompt")?, None),
        Api::Embeddings => (input_text(&req, "input")?, None),
    };
    let client_usage = req
        .get("stream_options")
        .and_then(|o| o.get("include_usage"))
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if stream {
        req.insert("stream_options".into(), json!({"include_usage": true}));
    }
    req.insert("model".into(), Value::String(pool.model.clone()));
    // A coarse estimate (a token is ~4 bytes of English), corrected at settlement from the
    // usage the upstream reports.
    let prompt_tokens = text.len().div_ceil(4) as u64;
    let endpoint = api.endpoint();
    let reservation = state
        .tenancy
        .reserve_tokens(
            caller,
            &pool.name,
            endpoint,
            prompt_tokens,
            prompt_tokens + n * max_tokens,
        )
        .await
        .map_err(ApiError::denied)?;
    Ok(Prepared {
        body: Bytes::from(serde_json::to_vec(&req).expect("JSON values serialize")),
        stream,
        client_usage,
        chain: crate::upstream::prefix_chain(&tenant.name, &text),
        output,
        citations,
        reservation,
        debug: caller.debug.clone(),
    })
}

/// The tenant may use the model, and has no logits processor bound for a generation (the
/// decode loop runs upstream).
fn check_tenant(caller: &Caller, pool: &Pool, api: Api) -> Result<(), ApiError> {
    let tenant = &caller.tenant;
    if !tenant.allows_model(&pool.name) {
        return Err(ApiError::forbidden(
            "model",
            format!(
                "Tenant `{}` may not use model `{}`.",
                tenant.name, pool.name
            ),
        ));
    }
    match &tenant.policy.logits_processor {
        Some(p) if api != Api::Embeddings => Err(ApiError::invalid(
            "model",
            format!(
                "Tenant `{}` binds the logits processor `{p}`, which runs in the decode loop; \
                 model `{}` decodes on an upstream server, where it cannot run.",
                tenant.name, pool.name
            ),
        )),
        _ => Ok(()),
    }
}

/// A completion's prompt or an embedding's input, as text (token arrays as their JSON).
fn input_text(req: &Map<String, Value>, field: &'static str) -> Result<String, ApiError> {
    match req.get(field) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(other) => Ok(other.to_string()),
        None => Err(ApiError::invalid(field, format!("`{field}` is required."))),
    }
}

/// The most tokens the request may generate, for the reservation: its own `max_tokens`
/// (`max_completion_tokens` for chat), else the pool's default; none for embeddings.
fn completion_budget(api: Api, req: &Map<String, Value>, pool: &Pool) -> Result<u64, ApiError> {
    let asked = match api {
        Api::Chat => count(req, "max_completion_tokens", 0)?.max(count(req, "max_tokens", 0)?),
        Api::Completion => count(req, "max_tokens", 16)?,
        Api::Embeddings => return Ok(0),
    };
    Ok(if asked == 0 {
        pool.cfg.default_max_tokens
    } else {
        asked
    })
}

/// The tenant's output parser when `response_format` (or the tenant's policy) asks for one,
/// unless tools are offered (calls are not the parser's JSON).
fn parser(
    calls: PluginCalls,
    caller: &Caller,
    req: &Map<String, Value>,
) -> Result<Option<OutputStage>, ApiError> {
    if req.get("tools").is_some_and(|t| !t.is_null()) {
        return Ok(None);
    }
    let format: Option<ResponseFormat> = match req.get("response_format") {
        Some(Value::Null) | None => None,
        Some(v) => Some(
            serde_json::from_value(v.clone())
                .map_err(|e| ApiError::invalid("response_format", e.to_string()))?,
        ),
    };
    output_stage(calls, caller, format.as_ref())
}

/// The chat prompt stage for an upstream model: `documents` and RAG chunks ground the
/// messages (or go to the tenant's prompt-template plugin, which must return messages).
/// Returns the messages as text (for the estimate and affinity) and the citations.
async fn chat_prompt(
    retrieval: &Retrieval,
    caller: &Caller,
    pool: &Pool,
    req: &mut Map<String, Value>,
) -> Result<(String, Option<Vec<Value>>), ApiError> {
    let messages = match req.get("messages") {
        Some(Value::Array(m)) if !m.is_empty() => m.clone(),
        _ => {
            return Err(ApiError::invalid(
                "messages",
                "`messages` must contain at least one message.",
            ))
        }
    };
    let documents: Vec<Document> = match req.remove("documents") {
        Some(Value::Null) | None => Vec::new(),
        Some(v) => {
            serde_json::from_value(v).map_err(|e| ApiError::invalid("documents", e.to_string()))?
        }
    };
    let rag_field = match req.remove("rag") {
        Some(Value::Null) | None => None,
        Some(v) => {
            Some(serde_json::from_value(v).map_err(|e| ApiError::invalid("rag", e.to_string()))?)
        }
    };
    let settings = grounding::settings(rag_field, caller)?;
    let template = caller.tenant.policy.prompt_template.clone();
    if documents.is_empty() && settings.is_none() && template.is_none() {
        return Ok((Value::Array(messages).to_string(), None));
    }
    let plain: Vec<ChatMessage> = messages.iter().map(plain_message).collect();
    let mut context: Vec<ContextChunk> = documents
        .into_iter()
        .enumerate()
        .map(|(i, d)| ContextChunk {
            id: d.id.unwrap_or_else(|| i.to_string()),
            text: d.text,
            title: d.title,
        })
        .collect();
    let mut citations = None;
    if let Some(s) = &settings {
        let first = context.len() + 1;
        let (chunks, cites) = retrieval.retrieve(caller, s, &plain, &[], first).await?;
        context.extend(chunks);
        citations = Some(cites);
    }
    let messages = match template {
        Some(name) => templated(&retrieval.plugins, caller, pool, &name, plain, context).await?,
        None => grounded(messages, &context),
    };
    let text = Value::Array(messages.clone()).to_string();
    req.insert("messages".into(), Value::Array(messages));
    Ok((text, citations))
}

/// The tenant's prompt-template plugin over the conversation; an upstream takes messages, so
/// a plugin that renders a finished prompt cannot serve it.
async fn templated(
    calls: &PluginCalls,
    caller: &Caller,
    pool: &Pool,
    name: &str,
    messages: Vec<ChatMessage>,
    context: Vec<ContextChunk>,
) -> Result<Vec<Value>, ApiError> {
    let rendered = calls
        .render(caller, name, &pool.name, messages, context)
        .await?;
    match rendered {
        RenderedPrompt::Messages(ms) => Ok(ms
            .into_iter()
            .map(|m| match m.name {
                Some(n) => json!({"role": m.role, "content": m.content, "name": n}),
                None => json!({"role": m.role, "content": m.content}),
            })
            .collect()),
        RenderedPrompt::Prompt(_) => Err(ApiError::invalid(
            "model",
            format!(
                "The prompt_template plugin `{name}` renders a finished prompt, but model `{}` \
                 is served upstream, which takes messages: have the plugin return messages.",
                pool.name
            ),
        )),
    }
}

/// A message's role and text, for retrieval's query and the template plugin.
fn plain_message(m: &Value) -> ChatMessage {
    let role = m["role"].as_str().unwrap_or("user");
    let content = match &m["content"] {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    };
    let mut msg = ChatMessage::new(role, content);
    msg.name = m["name"].as_str().map(String::from);
    msg
}

/// The messages with the sources in the system message (a new one when the first is not a
/// system message with text), as for a local model.
fn grounded(mut messages: Vec<Value>, context: &[ContextChunk]) -> Vec<Value> {
    let Some(sources) = grounding::sources(context) else {
        return messages;
    };
    match messages.first_mut() {
        Some(m) if m["role"] == "system" && m["content"].is_string() => {
            let text = m["content"].as_str().unwrap_or_default().trim_end();
            m["content"] = Value::String(format!("{text}\n\n{sources}"));
        }
        _ => messages.insert(0, json!({"role": "system", "content": sources})),
    }
    messages
}

/// A boolean field: absent or null is false.
fn flag(req: &Map<String, Value>, field: &'static str) -> Result<bool, ApiError> {
    match req.get(field) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::invalid(
            field,
            format!("`{field}` must be a boolean."),
        )),
    }
}

/// A count field: absent or null gives `default`.
fn count(req: &Map<String, Value>, field: &'static str, default: u64) -> Result<u64, ApiError> {
    match req.get(field) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_u64().filter(|&n| n <= 1 << 24).ok_or_else(|| {
            ApiError::invalid(field, format!("`{field}` must be a non-negative integer."))
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_join_the_system_message_or_open_one() {
        let ctx = [ContextChunk {
            id: "kb-1".into(),
            text: "Refunds take 5 days.".into(),
            title: None,
        }];
        let with_system = grounded(
            vec![
                json!({"role": "system", "content": "Be brief."}),
                json!({"role": "user", "content": "Refunds?"}),
            ],
            &ctx,
        );
        let text = with_system[0]["content"].as_str().unwrap();
        assert!(text.starts_with("Be brief.\n\nAnswer using the sources"));
        assert!(text.ends_with("[1] Refunds take 5 days."));
        let without = grounded(vec![json!({"role": "user", "content": "Refunds?"})], &ctx);
        assert_eq!(without.len(), 2);
        assert_eq!(without[0]["role"], "system");
        assert_eq!(grounded(vec![json!({"role": "user"})], &[]).len(), 1);
    }

    #[test]
    fn counts_and_flags_are_checked() {
        let req: Map<String, Value> =
            serde_json::from_value(json!({"stream": "yes", "n": -1, "max_tokens": 7})).unwrap();
        assert!(flag(&req, "stream").is_err());
        assert!(count(&req, "n", 1).is_err());
        assert_eq!(count(&req, "max_tokens", 0).unwrap(), 7);
        assert_eq!(count(&req, "absent", 3).unwrap(), 3);
    }
}
