//! `/v1/chat/completions` and `/v1/completions`: parsing, the prompt stage (template plugin or
//! chat template), tokenization, the tenant's token reservation and submission of one engine
//! request per choice. The response is built by `reply.rs`.

use std::sync::Arc;

use super::error::ApiError;
use super::openai::*;
use super::reply::{Kind, Reply};
use super::structured;
use super::validation::{self, MAX_TOP_LOGPROBS};
use super::{AppState, Response};
use crate::engine::chat_template::ChatMessage;
use crate::engine::{Engine, EventStream, SubmitError};
use crate::pipeline::grounding::{self, strip_specials};
use crate::pipeline::output::OutputStage;
use crate::pipeline::prompt::PromptStage;
use crate::pipeline::PluginCalls;
use crate::plugins::{ContextChunk, PluginKind};
use crate::structured::tools;
use crate::tenancy::{Caller, Reservation};

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
    let tools = structured::toolset(req.tools, req.tool_choice, req.parallel_tool_calls)?;
    structured::check_history(&req.messages, tools.as_ref())?;
    let format = structured::format(req.response_format.as_ref(), req.guided)?;
    let messages = req
        .messages
        .into_iter()
        .map(message)
        .collect::<Result<Vec<_>, _>>()?;
    let logprobs = chat_logprobs(req.logprobs, req.top_logprobs)?;
    let mut gen = validation::generation(
        req.sampling,
        req.max_completion_tokens.or(req.max_tokens),
        logprobs,
    )?;
    gen.cache_salt = tenant.cache_salt;
    gen.weight = tenant.policy.weight;
    gen.constraint = structured::constraint(&engine, format, tools.as_ref()).await?;
    let output = output_stage(state.plugin_calls(), caller, req.response_format.as_ref())?;
    let rag = grounding::settings(req.rag, caller)?;
    // Every added token, special or not: each is matched as one control token when the prompt
    // is encoded (`<|im_end|>`, but also e.g. `<tool_call>` or `</think>` in other models).
    let specials: Vec<String> = engine
        .tokenizer
        .get_added_tokens_decoder()
        .into_values()
        .map(|t| t.content)
        .collect();
    let mut context = documents(req.documents.unwrap_or_default(), &specials);
    let mut citations = None;
    if let Some(r) = &rag {
        let first = context.len() + 1;
        let retrieval = state.retrieval();
        let (chunks, cites) = retrieval
            .retrieve(caller, r, &messages, &specials, first)
            .await?;
        context.extend(chunks);
        citations = Some(cites);
    }
    let stage = PromptStage {
        engine: &engine,
        model: &req.model,
        tools: tools.as_ref(),
        plugins: &state.plugin_calls(),
    };
    let text = stage.run(caller, messages, context).await?;
    // The template already wrote any BOS it wants.
    let prompt = encode(&engine, vec![text], false, "messages")
        .await?
        .remove(0);
    let mut reqs = gen.requests(&engine, prompt, "messages")?;
    state
        .processor_stage()
        .attach(caller, &req.model, &engine, &mut reqs)
        .await?;
    let reservation = reserve(
        state,
        caller,
        &req.model,
        "chat",
        std::slice::from_ref(&reqs),
    )
    .await?;
    // Refused by the engine (queue full, too long): a failure, not a cancellation.
    let streams = submit(&engine, vec![reqs])
        .inspect_err(|_| reservation.end(crate::tenancy::Outcome::Failed))?;
    let mut reply = Reply::new(Kind::Chat, "chatcmpl", req.model, engine, &gen, None);
    reply.output = output;
    reply.tools = tools.map(Arc::new);
    reply.debug = caller.debug.clone();
    reply.reservation = Some(reservation);
    reply.citations = citations;
    reply.run(streams, gen.stream, state.shutdown.cut()).await
}

/// Chat's `logprobs` + `top_logprobs` as the engine takes them: None, or the count of
/// alternatives per token.
fn chat_logprobs(logprobs: bool, top: Option<usize>) -> Result<Option<usize>, ApiError> {
    match (logprobs, top) {
        (false, Some(_)) => Err(ApiError::invalid(
            "top_logprobs",
            "`top_logprobs` requires `logprobs` to be true.",
        )),
        (true, Some(k)) if k > MAX_TOP_LOGPROBS => Err(ApiError::invalid(
            "top_logprobs",
            format!("`top_logprobs` must be at most {MAX_TOP_LOGPROBS}."),
        )),
        (true, k) => Ok(Some(k.unwrap_or(0))),
        (false, None) => Ok(None),
    }
}

/// Passages the client sent (vLLM's `documents`), as context chunks: data just like retrieved
/// ones, so the model's special tokens are stripped from them.
fn documents(docs: Vec<Document>, specials: &[String]) -> Vec<ContextChunk> {
    docs.into_iter()
        .enumerate()
        .map(|(i, d)| ContextChunk {
            id: strip_specials(&d.id.unwrap_or_else(|| i.to_string()), specials),
            text: strip_specials(&d.text, specials),
            title: d.title.map(|t| strip_specials(&t, specials)),
        })
        .collect()
}

/// The output parser to run, if the request asks for JSON (or the tenant always parses) and
/// the tenant has a parser bound. Without a parser, `response_format` passes through.
pub(super) fn output_stage(
    calls: PluginCalls,
    caller: &Caller,
    format: Option<&ResponseFormat>,
) -> Result<Option<OutputStage>, ApiError> {
    let tenant = &caller.tenant;
    let schema = match format {
        Some(ResponseFormat::JsonObject) => None,
        Some(ResponseFormat::JsonSchema { json_schema }) => match &json_schema.schema {
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
        plugin: calls.bound(tenant, name, PluginKind::OutputParser)?,
        calls,
        caller: caller.clone(),
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
    let format = structured::format(req.response_format.as_ref(), req.guided)?;
    gen.constraint = structured::constraint(&engine, format, None).await?;
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
    let mut reqs = prompts
        .into_iter()
        .map(|p| gen.requests(&engine, p, "prompt"))
        .collect::<Result<Vec<_>, _>>()?;
    for choices in reqs.iter_mut() {
        state
            .processor_stage()
            .attach(caller, &req.model, &engine, choices)
            .await?;
    }
    let reservation = reserve(state, caller, &req.model, "completions", &reqs).await?;
    let streams =
        submit(&engine, reqs).inspect_err(|_| reservation.end(crate::tenancy::Outcome::Failed))?;
    let mut reply = Reply::new(Kind::Completion, "cmpl", req.model, engine, &gen, echo);
    reply.debug = caller.debug.clone();
    reply.reservation = Some(reservation);
    reply.run(streams, gen.stream, state.shutdown.cut()).await
}

/// Reserves the tokens these requests may use: each prompt once (its choices share it) and
/// every choice's `max_tokens`.
async fn reserve(
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
        .reserve_tokens(caller, model, endpoint, prompt, prompt + completion)
        .await
        .map_err(ApiError::denied)
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
    crate::pipeline::blocking("tokenizer", move || {
        texts
            .iter()
            .map(|t| engine.encode(t, add_bos))
            .collect::<Result<Vec<_>, _>>()
    })
    .await?
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
    let tool_calls = m
        .tool_calls
        .unwrap_or_default()
        .into_iter()
        .map(|c| tools::history_call(c.id, c.function.name, &c.function.arguments))
        .collect();
    Ok(ChatMessage {
        role,
        content,
        name: m.name,
        tool_calls,
        tool_call_id: m.tool_call_id,
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
