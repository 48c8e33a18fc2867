//! `/v1/chat/completions` and `/v1/completions`: prompt stage, submission of one engine request
//! per choice, then either one JSON body or an SSE stream of chunks.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::error::ApiError;
use super::openai::*;
use super::plugins::{bound, call};
use super::validation::{self, Generation, MAX_TOP_LOGPROBS};
use super::{json_response, sse_response, AppState, Response};
use crate::engine::chat_template::ChatMessage;
use crate::engine::tokenizer::token_bytes;
use crate::engine::{Engine, Event, EventStream, FinishReason, SubmitError, TokenLogprobs, Usage};
use crate::plugins::{ContextChunk, Message, Plugin, PluginKind, RenderedPrompt};
use crate::tenancy::{Caller, Reservation};

const DONE: &[u8] = b"data: [DONE]\n\n";

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Chat,
    Completion,
}

/// What every chunk and body of one response shares.
struct Reply {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    engine: Arc<Engine>,
    n: usize,
    include_usage: bool,
    /// Completion `echo`: each prompt's text, put in front of its choices' text.
    echo: Option<Vec<String>>,
    /// Chat with structured output: the tenant's output parser runs on each choice's text.
    output: Option<OutputStage>,
    /// The tenant's token reservation, settled with the usage reported (or, if the response
    /// never completes, with the tokens counted so far when this is dropped).
    reservation: Option<Reservation>,
}

struct OutputStage {
    state: Arc<AppState>,
    caller: Caller,
    plugin: Arc<Plugin>,
    schema: Option<String>,
}

impl OutputStage {
    async fn parse(&self, text: String) -> Result<crate::plugins::Parsed, ApiError> {
        let schema = self.schema.clone();
        call(
            &self.state,
            &self.caller,
            self.plugin.clone(),
            move |p, rt, v| p.parse(rt, v, &text, schema.as_deref()),
        )
        .await
    }
}

pub async fn chat(
    state: &Arc<AppState>,
    caller: &Caller,
    body: &[u8],
) -> Result<Response, ApiError> {
    let tenant = &caller.tenant;
    let req: ChatCompletionRequest = serde_json::from_slice(body)?;
    let engine = state.engine(tenant, &req.model)?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "`messages` must contain at least one message.",
        ));
    }
    let messages = req
        .messages
        .into_iter()
        .map(message)
        .collect::<Result<Vec<_>, _>>()?;
    let logprobs = match (req.logprobs, req.top_logprobs) {
        (false, Some(_)) => {
            return Err(ApiError::invalid(
                "top_logprobs",
                "`top_logprobs` requires `logprobs` to be true.",
            ))
        }
        (true, Some(k)) if k > MAX_TOP_LOGPROBS => {
            return Err(ApiError::invalid(
                "top_logprobs",
                format!("`top_logprobs` must be at most {MAX_TOP_LOGPROBS}."),
            ))
        }
        (true, k) => Some(k.unwrap_or(0)),
        (false, None) => None,
    };
    let mut gen = validation::generation(
        req.sampling,
        req.max_completion_tokens.or(req.max_tokens),
        logprobs,
    )?;
    gen.cache_salt = tenant.cache_salt;
    gen.weight = tenant.policy.weight;
    let output = output_stage(state, caller, req.response_format)?;
    let text = prompt_stage(state, caller, &engine, &req.model, messages, req.documents).await?;
    // The template already wrote any BOS it wants.
    let prompt = encode(&engine, vec![text], false, "messages")
        .await?
        .remove(0);
    let reqs = gen.requests(&engine, prompt, "messages")?;
    let reservation = reserve(
        state,
        caller,
        &req.model,
        "chat",
        std::slice::from_ref(&reqs),
    )?;
    let streams = submit(&engine, vec![reqs])?;
    let mut reply = Reply::new(Kind::Chat, "chatcmpl", req.model, engine, &gen, None);
    reply.output = output;
    reply.reservation = Some(reservation);
    reply.run(streams, gen.stream).await
}

/// The prompt text: the tenant's prompt-template plugin when one is bound, else the model's
/// own chat template. A plugin may return the final text or rewritten messages, which then go
/// through the model's template.
async fn prompt_stage(
    state: &Arc<AppState>,
    caller: &Caller,
    engine: &Engine,
    model: &str,
    messages: Vec<ChatMessage>,
    documents: Option<Vec<Document>>,
) -> Result<String, ApiError> {
    let tenant = &caller.tenant;
    let messages = match &tenant.policy.prompt_template {
        Some(name) => {
            let plugin = bound(&state.plugins, tenant, name, PluginKind::PromptTemplate)?;
            let request = crate::plugins::ChatRequest {
                model: model.to_string(),
                messages: messages
                    .into_iter()
                    .map(|m| Message {
                        role: m.role,
                        content: m.content,
                        name: m.name,
                    })
                    .collect(),
                context: documents
                    .unwrap_or_default()
                    .into_iter()
                    .enumerate()
                    .map(|(i, d)| ContextChunk {
                        id: d.id.unwrap_or_else(|| i.to_string()),
                        text: d.text,
                        title: d.title,
                    })
                    .collect(),
            };
            match call(state, caller, plugin, move |p, rt, v| {
                p.render(rt, v, &request)
            })
            .await?
            {
                RenderedPrompt::Prompt(text) => return Ok(text),
                RenderedPrompt::Messages(ms) => ms
                    .into_iter()
                    .map(|m| ChatMessage {
                        role: m.role,
                        content: m.content,
                        name: m.name,
                    })
                    .collect(),
            }
        }
        None if documents.is_some() => {
            return Err(ApiError::invalid(
                "documents",
                format!(
                "`documents` need a prompt-template plugin, and tenant `{}` has none configured.",
                tenant.name
            ),
            ))
        }
        None => messages,
    };
    engine.template.render(&messages, true).map_err(|e| {
        ApiError::invalid(
            "messages",
            format!("The model's chat template rejected the messages: {e}"),
        )
    })
}

/// The output parser to run, if the request asks for JSON (or the tenant always parses) and
/// the tenant has a parser bound. Without a parser, `response_format` passes through.
fn output_stage(
    state: &Arc<AppState>,
    caller: &Caller,
    format: Option<ResponseFormat>,
) -> Result<Option<OutputStage>, ApiError> {
    let tenant = &caller.tenant;
    let schema = match format {
        Some(ResponseFormat::JsonObject) => None,
        Some(ResponseFormat::JsonSchema { json_schema }) => match json_schema.schema {
            Some(schema) => Some(schema.to_string()),
            None => {
                return Err(ApiError::invalid(
                    "response_format",
                    "`response_format.json_schema.schema` is required for type json_schema.",
                ))
            }
        },
        Some(ResponseFormat::Text) | None if tenant.policy.parse_output => None,
        Some(ResponseFormat::Text) | None => return Ok(None),
    };
    let Some(name) = &tenant.policy.output_parser else {
        return Ok(None);
    };
    Ok(Some(OutputStage {
        state: state.clone(),
        caller: caller.clone(),
        plugin: bound(&state.plugins, tenant, name, PluginKind::OutputParser)?,
        schema,
    }))
}

pub async fn completion(
    state: &Arc<AppState>,
    caller: &Caller,
    body: &[u8],
) -> Result<Response, ApiError> {
    let tenant = &caller.tenant;
    let req: CompletionRequest = serde_json::from_slice(body)?;
    let engine = state.engine(tenant, &req.model)?;
    if req.suffix.is_some() {
        return Err(ApiError::invalid(
            "suffix",
            "`suffix` is not supported by this model.",
        ));
    }
    if req
        .best_of
        .is_some_and(|b| b != req.sampling.n.unwrap_or(1))
    {
        return Err(ApiError::invalid(
            "best_of",
            "`best_of` different from `n` is not supported.",
        ));
    }
    if let Some(k) = req.logprobs.filter(|&k| k > 5) {
        return Err(ApiError::invalid(
            "logprobs",
            format!("`logprobs` must be at most 5, got {k}."),
        ));
    }
    if req.echo && req.logprobs.is_some() {
        return Err(ApiError::invalid(
            "echo",
            "`echo` together with `logprobs` is not supported.",
        ));
    }
    let mut gen = validation::generation(
        req.sampling,
        Some(req.max_tokens.unwrap_or(16)),
        req.logprobs,
    )?;
    gen.cache_salt = tenant.cache_salt;
    gen.weight = tenant.policy.weight;
    // Echo gives back the prompt as sent: the text itself, or the decoded token ids.
    let (prompts, texts): (Vec<Vec<u32>>, Option<Vec<String>>) = match req.prompt {
        Prompt::Text(t) => (
            encode(&engine, vec![t.clone()], true, "prompt").await?,
            Some(vec![t]),
        ),
        Prompt::Texts(ts) => (encode(&engine, ts.clone(), true, "prompt").await?, Some(ts)),
        Prompt::Tokens(ids) => (vec![ids], None),
        Prompt::TokenLists(l) => (l, None),
    };
    if prompts.is_empty() {
        return Err(ApiError::invalid("prompt", "`prompt` must not be empty."));
    }
    let echo = req.echo.then(|| {
        texts.unwrap_or_else(|| {
            prompts
                .iter()
                .map(|p| engine.tokenizer.decode(p, false).unwrap_or_default())
                .collect()
        })
    });
    let reqs = prompts
        .into_iter()
        .map(|p| gen.requests(&engine, p, "prompt"))
        .collect::<Result<Vec<_>, _>>()?;
    let reservation = reserve(state, caller, &req.model, "completions", &reqs)?;
    let streams = submit(&engine, reqs)?;
    let mut reply = Reply::new(Kind::Completion, "cmpl", req.model, engine, &gen, echo);
    reply.reservation = Some(reservation);
    reply.run(streams, gen.stream).await
}

/// Reserves the tokens these requests may use: each prompt once (its choices share it) and
/// every choice's `max_tokens`.
fn reserve(
    state: &Arc<AppState>,
    caller: &Caller,
    model: &str,
    endpoint: &'static str,
    per_prompt: &[Vec<crate::engine::GenerationRequest>],
) -> Result<Reservation, ApiError> {
    let prompt: u64 = per_prompt
        .iter()
        .filter_map(|c| c.first())
        .map(|r| r.prompt.len() as u64)
        .sum();
    let completion: u64 = per_prompt
        .iter()
        .flatten()
        .map(|r| r.max_tokens as u64)
        .sum();
    state
        .tenancy
        .reserve(caller, model, endpoint, prompt, prompt + completion)
        .map_err(ApiError::limited)
}

/// Tokenizes on the blocking pool: a multi-megabyte prompt takes long enough to stall the
/// runtime's I/O threads.
async fn encode(
    engine: &Arc<Engine>,
    texts: Vec<String>,
    add_bos: bool,
    param: &'static str,
) -> Result<Vec<Vec<u32>>, ApiError> {
    let engine = engine.clone();
    tokio::task::spawn_blocking(move || {
        texts
            .iter()
            .map(|t| engine.encode(t, add_bos))
            .collect::<Result<Vec<_>, _>>()
    })
    .await
    .map_err(|e| ApiError::internal(format!("tokenizer task failed: {e}")))?
    .map_err(|e| ApiError::invalid(param, e.to_string()))
}

fn message(m: ChatMessageIn) -> Result<ChatMessage, ApiError> {
    let role = match m.role.as_str() {
        "system" | "user" | "assistant" | "tool" => m.role,
        "developer" => "system".into(),
        other => {
            return Err(ApiError::invalid(
                "messages",
                format!(
                "Unknown message role {other:?}; use system, developer, user, assistant or tool."
            ),
            ))
        }
    };
    let content = match m.content {
        None => String::new(),
        Some(MessageContent::Text(t)) => t,
        Some(MessageContent::Parts(parts)) => {
            let mut s = String::new();
            for p in parts {
                match (p.kind.as_str(), p.text) {
                    ("text", Some(t)) => s.push_str(&t),
                    (kind, _) => {
                        return Err(ApiError::invalid(
                            "messages",
                            format!("Content parts of type {kind:?} are not supported; send text."),
                        ))
                    }
                }
            }
            s
        }
    };
    Ok(ChatMessage {
        role,
        content,
        name: m.name,
    })
}

/// Submits every choice of every prompt, in choice-index order. Nothing is left running if one
/// submission fails: the streams already made are dropped, which cancels them.
fn submit(
    engine: &Engine,
    per_prompt: Vec<Vec<crate::engine::GenerationRequest>>,
) -> Result<Vec<EventStream>, ApiError> {
    per_prompt
        .into_iter()
        .flatten()
        .map(|r| {
            engine.submit(r).map_err(|e| match e {
                SubmitError::QueueFull(_) => {
                    ApiError::overloaded(format!("The server is overloaded: {e}"))
                }
                SubmitError::Stopped => ApiError::internal(e.to_string()),
            })
        })
        .collect()
}

#[derive(Default)]
struct Choice {
    text: String,
    tokens: Vec<(u32, TokenLogprobs)>,
    finish: Option<FinishReason>,
    usage: Usage,
    /// Fixes the output parser applied, when one ran.
    repairs: Option<Vec<String>>,
}

impl Reply {
    fn new(
        kind: Kind,
        prefix: &str,
        model: String,
        engine: Arc<Engine>,
        gen: &Generation,
        echo: Option<Vec<String>>,
    ) -> Self {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Self {
            kind,
            id: format!("{prefix}-{:032x}", rand::random::<u128>()),
            created,
            model,
            engine,
            n: gen.n,
            include_usage: gen.include_usage,
            echo,
            output: None,
            reservation: None,
        }
    }

    async fn run(self, streams: Vec<EventStream>, stream: bool) -> Result<Response, ApiError> {
        if stream {
            let (tx, rx) = mpsc::channel(64);
            tokio::spawn(self.stream(streams, tx));
            return Ok(sse_response(rx));
        }
        let mut choices = Vec::with_capacity(streams.len());
        for mut s in streams {
            let mut c = Choice::default();
            while let Some(ev) = s.recv().await {
                match ev {
                    Event::Token { id, text, logprobs } => {
                        self.count_token();
                        c.text.push_str(&text);
                        c.tokens.extend(logprobs.map(|l| (id, l)));
                    }
                    Event::Done(u, f) => {
                        c.usage = u;
                        c.finish = Some(f);
                    }
                    Event::Failed(m) => return Err(ApiError::internal(m)),
                }
            }
            if c.finish.is_none() {
                return Err(ApiError::internal(
                    "The engine stopped before the generation finished.",
                ));
            }
            if let Some(out) = &self.output {
                let parsed = out.parse(std::mem::take(&mut c.text)).await?;
                c.text = parsed.json;
                c.repairs = Some(parsed.repairs);
            }
            choices.push(c);
        }
        let body = self.body(choices);
        if let Some(r) = &self.reservation {
            let u = &body["usage"];
            let n = |k: &str| u[k].as_u64().unwrap_or(0);
            r.settle(n("prompt_tokens"), n("completion_tokens"), "ok");
        }
        Ok(json_response(http::StatusCode::OK, &body))
    }

    fn body(&self, choices: Vec<Choice>) -> Value {
        let usage = self.usage(choices.iter().map(|c| &c.usage).enumerate());
        let choices: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let logprobs = self.logprobs(&c.tokens, c.text.len());
                let finish = c.finish.map(FinishReason::as_str);
                match self.kind {
                    Kind::Chat => {
                        let mut choice = json!({
                            "index": i,
                            "message": {"role": "assistant", "content": c.text},
                            "logprobs": logprobs,
                            "finish_reason": finish,
                        });
                        if let Some(repairs) = c.repairs {
                            choice["repairs"] = json!(repairs);
                        }
                        choice
                    }
                    Kind::Completion => {
                        let text = match &self.echo {
                            Some(p) => format!("{}{}", p[i / self.n], c.text),
                            None => c.text,
                        };
                        json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish})
                    }
                }
            })
            .collect();
        let mut body = self.envelope(false);
        body["choices"] = Value::Array(choices);
        body["usage"] = serde_json::to_value(usage).expect("plain struct");
        body
    }

    fn envelope(&self, chunk: bool) -> Value {
        let object = match (self.kind, chunk) {
            (Kind::Chat, false) => "chat.completion",
            (Kind::Chat, true) => "chat.completion.chunk",
            (Kind::Completion, _) => "text_completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": super::SYSTEM_FINGERPRINT,
        })
    }

    /// Usage over all choices: each prompt counts once however many choices it has.
    fn usage<'a>(&self, usages: impl Iterator<Item = (usize, &'a Usage)>) -> UsageOut {
        let (mut prompt, mut completion, mut cached) = (0, 0, 0);
        for (i, u) in usages {
            if i % self.n == 0 {
                prompt += u.prompt_tokens;
                cached += u.cached_tokens;
            }
            completion += u.completion_tokens;
        }
        UsageOut {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt + completion,
            prompt_tokens_details: CachedTokens {
                cached_tokens: cached,
            },
        }
    }

    fn count_token(&self) {
        if let Some(r) = &self.reservation {
            r.count_token();
        }
    }

    fn token_str(&self, id: u32) -> String {
        self.engine
            .tokenizer
            .decode(&[id], false)
            .unwrap_or_default()
    }

    /// Logprobs in the endpoint's own shape; `text_start` is where these tokens' text begins.
    fn logprobs(&self, tokens: &[(u32, TokenLogprobs)], text_start: usize) -> Value {
        if tokens.is_empty() {
            return Value::Null;
        }
        match self.kind {
            Kind::Chat => {
                let top = |(id, lp): &(u32, f32)| TopLogprob {
                    bytes: token_bytes(&self.engine.tokenizer, *id),
                    token: self.token_str(*id),
                    logprob: *lp,
                };
                let content: Vec<ChatTokenLogprob> = tokens
                    .iter()
                    .map(|(id, l)| ChatTokenLogprob {
                        bytes: token_bytes(&self.engine.tokenizer, *id),
                        token: self.token_str(*id),
                        logprob: l.logprob,
                        top_logprobs: l.top.iter().map(top).collect(),
                    })
                    .collect();
                json!({ "content": content })
            }
            Kind::Completion => {
                let mut out = CompletionLogprobs::default();
                let mut offset = text_start
                    .saturating_sub(tokens.iter().map(|(id, _)| self.token_str(*id).len()).sum());
                for (id, l) in tokens {
                    let t = self.token_str(*id);
                    out.text_offset.push(offset);
                    offset += t.len();
                    out.tokens.push(t);
                    out.token_logprobs.push(l.logprob);
                    out.top_logprobs.push(
                        l.top
                            .iter()
                            .map(|(tid, lp)| (self.token_str(*tid), json!(lp)))
                            .collect(),
                    );
                }
                serde_json::to_value(out).expect("plain struct")
            }
        }
    }

    /// The prompt text for choice `i`'s first streamed text, once.
    fn take_echo(&self, pending: &mut bool, i: usize) -> String {
        match (&self.echo, std::mem::take(pending)) {
            (Some(p), true) => p[i / self.n].clone(),
            _ => String::new(),
        }
    }

    fn chunk(&self, choice: Value) -> Value {
        let mut c = self.envelope(true);
        c["choices"] = json!([choice]);
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    /// Feeds SSE events into `tx` until every choice is done. When the client goes away the
    /// send fails, this returns, and dropping the streams cancels their sequences.
    async fn stream(self, streams: Vec<EventStream>, tx: mpsc::Sender<Bytes>) {
        let send = |v: &Value| {
            let tx = tx.clone();
            let frame = Bytes::from(format!("data: {v}\n\n"));
            async move { tx.send(frame).await.is_ok() }
        };
        let total = streams.len();
        let mut merged = stream::select_all(streams.into_iter().enumerate().map(|(i, s)| {
            stream::unfold(s, |mut s| async move { s.recv().await.map(|e| (e, s)) })
                .map(move |e| (i, e))
                .boxed()
        }));
        if self.kind == Kind::Chat {
            for i in 0..total {
                if !send(&self.chunk(json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))).await {
                    return;
                }
            }
        }
        let mut usages = BTreeMap::new();
        let mut failed = false;
        let mut text_len = vec![0usize; total];
        // The whole text of each choice, kept only when the output parser needs it at the end.
        let mut texts = vec![String::new(); if self.output.is_some() { total } else { 0 }];
        let mut echo_pending = vec![self.echo.is_some(); total];
        while let Some((i, ev)) = merged.next().await {
            let choice = match ev {
                Event::Token { id, text, logprobs } => {
                    self.count_token();
                    if text.is_empty() && logprobs.is_none() {
                        continue;
                    }
                    text_len[i] += text.len();
                    if let Some(t) = texts.get_mut(i) {
                        t.push_str(&text);
                    }
                    let lp =
                        logprobs.map_or(Value::Null, |l| self.logprobs(&[(id, l)], text_len[i]));
                    let text = self.take_echo(&mut echo_pending[i], i) + &text;
                    match self.kind {
                        Kind::Chat => {
                            json!({"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": null})
                        }
                        Kind::Completion => {
                            json!({"index": i, "text": text, "logprobs": lp, "finish_reason": null})
                        }
                    }
                }
                Event::Done(u, f) => {
                    usages.insert(i, u);
                    match self.kind {
                        Kind::Chat => {
                            let mut choice = json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": f.as_str()});
                            if let Some(out) = &self.output {
                                match out.parse(std::mem::take(&mut texts[i])).await {
                                    Ok(p) => {
                                        choice["parsed"] =
                                            serde_json::from_str(&p.json).unwrap_or(Value::Null);
                                        choice["repairs"] = json!(p.repairs);
                                    }
                                    Err(e) => {
                                        send(&e.body()).await;
                                        let _ = tx.send(Bytes::from_static(DONE)).await;
                                        return;
                                    }
                                }
                            }
                            choice
                        }
                        Kind::Completion => {
                            // A choice that produced no text still echoes its prompt.
                            let text = self.take_echo(&mut echo_pending[i], i);
                            json!({"index": i, "text": text, "logprobs": null, "finish_reason": f.as_str()})
                        }
                    }
                }
                Event::Failed(m) => {
                    send(&ApiError::internal(m).body()).await;
                    failed = true;
                    break;
                }
            };
            if !send(&self.chunk(choice)).await {
                return;
            }
        }
        if usages.len() < total {
            // A choice ended without its finish: say so rather than end as if it were complete.
            if !failed {
                send(
                    &ApiError::internal("The engine stopped before the generation finished.")
                        .body(),
                )
                .await;
            }
            let _ = tx.send(Bytes::from_static(DONE)).await;
            return;
        }
        let usage = self.usage(usages.iter().map(|(i, u)| (*i, u)));
        if let Some(r) = &self.reservation {
            r.settle(
                usage.prompt_tokens as u64,
                usage.completion_tokens as u64,
                "ok",
            );
        }
        if self.include_usage {
            let mut c = self.envelope(true);
            c["choices"] = json!([]);
            c["usage"] = serde_json::to_value(usage).expect("plain struct");
            if !send(&c).await {
                return;
            }
        }
        let _ = tx.send(Bytes::from_static(DONE)).await;
    }
}
