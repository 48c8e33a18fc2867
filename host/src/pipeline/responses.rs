//! The Responses API (`POST /v1/responses`) as a front door onto the chat pipeline: the request
//! is translated into the chat request it means (instructions → a system message, input items →
//! messages and tool turns, function tools, `text.format` → `response_format`,
//! `max_output_tokens`), which then runs the same pipeline as any chat, local or upstream; the
//! chat answer is shaped back into a Response object (`output.rs` of this folder's sibling
//! `responses/`) or, streamed, into Responses events.
//!
//! Fields the gateway does not serve are refused with a 400 naming them, except those the
//! official SDKs send on their own with neutral values (empty `include`, `truncation:
//! "disabled"`, `prompt_cache_key`, `service_tier: "auto"`, ...), which are accepted.

use std::sync::Arc;

use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::Error;
use crate::conversations::{Conversations, Stored};

mod file_search;
mod shape;
pub use shape::{EventStream, Shape};

/// Runs `f` on the response store, on the blocking pool (SQLite or PostgreSQL I/O).
pub async fn on_store<T: Send + 'static>(
    store: Arc<Conversations>,
    f: impl FnOnce(&Conversations) -> Result<T, crate::conversations::StoreError> + Send + 'static,
) -> Result<T, Error> {
    super::blocking("response store", move || f(&store))
        .await?
        .map_err(Error::Store)
}

/// The items a stored response's conversation continues from: its context (earlier turns and
/// its own input), then its output.
pub fn continued(s: Stored) -> Vec<Value> {
    let mut items = s.context;
    items.extend(s.response["output"].as_array().cloned().unwrap_or_default());
    items
}

/// What shapes one response's answer, and stores it when asked.
pub struct Finisher {
    pub shape: Shape,
    keep: Option<Keep>,
}

/// Where and what to store of a finished response.
struct Keep {
    store: Arc<Conversations>,
    tenant: String,
    input: Vec<Value>,
    context: Vec<Value>,
}

impl Finisher {
    /// Shapes answers as `t` asks, storing them in `store` under `tenant` when `t.store`.
    pub fn new(t: &Translated, store: Option<Arc<Conversations>>, tenant: &str) -> Self {
        let keep = store.filter(|_| t.store).map(|store| Keep {
            store,
            tenant: tenant.to_string(),
            input: t.input.clone(),
            context: t.context.clone(),
        });
        Self {
            shape: t.shape.clone(),
            keep,
        }
    }

    /// The Response object for a whole chat completion, stored first when asked.
    pub async fn body(&self, chat: &Value) -> Result<Value, Error> {
        let response = self.shape.response(chat);
        self.keep(&response).await?;
        Ok(response)
    }

    /// Stores the finished `response` (durable when this returns), when asked.
    pub async fn keep(&self, response: &Value) -> Result<(), Error> {
        let Some(k) = &self.keep else {
            return Ok(());
        };
        let stored = Stored {
            response: response.clone(),
            input: k.input.clone(),
            context: k.context.clone(),
        };
        let (tenant, id) = (k.tenant.clone(), self.shape.id.clone());
        on_store(k.store.clone(), move |s| s.put(&tenant, &id, &stored)).await
    }
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Input {
    Text(String),
    Items(Vec<Value>),
}

#[derive(Debug, Deserialize)]
struct TextConfig {
    format: Option<Value>,
}

/// The request as the Responses API defines it; `rest` holds every other field, checked
/// against what may be sent with a neutral value.
#[derive(Debug, Deserialize)]
struct ResponsesRequest {
    model: String,
    input: Option<Input>,
    instructions: Option<String>,
    max_output_tokens: Option<u64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    seed: Option<i64>,
    metadata: Option<Map<String, Value>>,
    user: Option<String>,
    tools: Option<Vec<Value>>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<bool>,
    text: Option<TextConfig>,
    #[serde(default)]
    stream: bool,
    store: Option<bool>,
    previous_response_id: Option<String>,
    #[serde(flatten)]
    rest: Map<String, Value>,
}

/// A Responses request made ready for the chat pipeline.
pub struct Translated {
    /// The chat request body the Responses request means.
    pub chat: Value,
    pub shape: Shape,
    /// This turn's input items (each with an id), as stored and listed by `input_items`.
    pub input: Vec<Value>,
    /// The conversation's items up to this turn's output: what it continued, then `input`.
    pub context: Vec<Value>,
    pub store: bool,
}

/// Most metadata pairs, and their sizes, as OpenAI allows.
const MAX_METADATA: usize = 16;

/// Parses a Responses request; `previous` holds the items of the stored conversation it
/// continues (the caller looks it up by `previous_response_id`, which `wanted_previous` reads
/// first, and `continued` gives its items).
pub fn translate(body: &Value, previous: Vec<Value>) -> Result<Translated, Error> {
    let req = ResponsesRequest::deserialize(body)?;
    neutral_only(&req.rest)?;
    if let Some(m) = &req.metadata {
        check_metadata(m)?;
    }
    let mut input: Vec<Value> = match req.input {
        None => return Err(Error::invalid("input", "`input` is required.")),
        Some(Input::Text(t)) => vec![json!({"type": "message", "role": "user", "content": t})],
        Some(Input::Items(items)) => items,
    };
    if input.is_empty() {
        return Err(Error::invalid(
            "input",
            "`input` must hold at least one item.",
        ));
    }
    input.iter_mut().for_each(normalize);
    let mut items = previous;
    items.extend(input.iter().cloned());
    let mut messages = Vec::new();
    if let Some(i) = &req.instructions {
        messages.push(json!({"role": "system", "content": i}));
    }
    messages.extend(chat_messages(&items)?);
    let tools = req.tools.unwrap_or_default();
    let (mut chat_tools, mut rag) = (Vec::new(), None);
    for (i, t) in tools.iter().enumerate() {
        match t["type"].as_str() {
            Some("file_search") if rag.is_some() => {
                return Err(Error::invalid_at(
                    format!("tools[{i}]"),
                    "At most one file_search tool per request.",
                ))
            }
            Some("file_search") => rag = Some(file_search::rag(i, t)?),
            _ => chat_tools.push(chat_tool(i, t)?),
        }
    }
    // The search's query, as retrieval takes it: the last user message.
    let query = rag.as_ref().and_then(|_| last_user_text(&messages));
    let mut chat = json!({"model": req.model, "messages": messages, "stream": req.stream});
    if let Some(r) = rag {
        chat["rag"] = r;
    }
    if req.stream {
        chat["stream_options"] = json!({"include_usage": true});
    }
    let c = chat.as_object_mut().expect("an object");
    let mut set = |k: &str, v: Option<Value>| {
        if let Some(v) = v {
            c.insert(k.into(), v);
        }
    };
    set(
        "max_completion_tokens",
        req.max_output_tokens.map(Value::from),
    );
    set("temperature", req.temperature.map(Value::from));
    set("top_p", req.top_p.map(Value::from));
    set("seed", req.seed.map(Value::from));
    set("user", req.user.clone().map(Value::from));
    set(
        "parallel_tool_calls",
        req.parallel_tool_calls.map(Value::from),
    );
    if !chat_tools.is_empty() {
        set("tools", Some(Value::Array(chat_tools)));
    }
    set(
        "tool_choice",
        req.tool_choice.as_ref().map(chat_tool_choice).transpose()?,
    );
    let format = req.text.and_then(|t| t.format);
    set(
        "response_format",
        format.as_ref().map(response_format).transpose()?,
    );
    let shape = Shape::new(shape::Echo {
        model: req.model,
        instructions: req.instructions,
        max_output_tokens: req.max_output_tokens,
        temperature: req.temperature,
        top_p: req.top_p,
        metadata: req.metadata.unwrap_or_default(),
        user: req.user,
        tools,
        tool_choice: req.tool_choice.unwrap_or_else(|| json!("auto")),
        parallel_tool_calls: req.parallel_tool_calls.unwrap_or(true),
        format: format.unwrap_or_else(|| json!({"type": "text"})),
        previous_response_id: req.previous_response_id.clone(),
        store: req.store.unwrap_or(true),
        file_search: query,
    });
    Ok(Translated {
        chat,
        shape,
        input,
        context: items,
        store: req.store.unwrap_or(true),
    })
}

/// The `previous_response_id` a request names, read before the whole request is translated
/// (its stored conversation is the context).
pub fn wanted_previous(body: &Value) -> Result<Option<String>, Error> {
    match body.get("previous_response_id") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(id)) => Ok(Some(id.clone())),
        Some(_) => Err(Error::invalid(
            "previous_response_id",
            "`previous_response_id` must be a string.",
        )),
    }
}

/// An input item as `input_items` lists it: with an id, and a message's text as content parts
/// (`input_text`, or `output_text` for an assistant's).
fn normalize(item: &mut Value) {
    let Some(o) = item.as_object_mut() else {
        return;
    };
    let message = o.get("type").is_none_or(|t| t == "message");
    if message {
        o.insert("type".into(), json!("message"));
        if let Some(Value::String(text)) = o.get("content") {
            let kind = match o.get("role").and_then(Value::as_str) {
                Some("assistant") => "output_text",
                _ => "input_text",
            };
            let parts = json!([{"type": kind, "text": text}]);
            o.insert("content".into(), parts);
        }
    }
    if !o.contains_key("id") {
        let prefix = if message { "msg" } else { "item" };
        o.insert(
            "id".into(),
            json!(format!("{prefix}_{:032x}", rand::random::<u128>())),
        );
    }
}

/// Fields the official SDKs and agent frameworks send with these values on their own: accepted
/// and ignored. Any other value, or any other field, is a 400 naming it.
fn neutral_only(rest: &Map<String, Value>) -> Result<(), Error> {
    for (k, v) in rest {
        let neutral = match k.as_str() {
            "include" => v.is_null() || v.as_array().is_some_and(Vec::is_empty),
            "truncation" => v.is_null() || v == "disabled",
            "service_tier" => v.is_null() || v == "auto" || v == "default",
            "background" => v.is_null() || v == false,
            "reasoning" => {
                v.is_null()
                    || v.as_object()
                        .is_some_and(|o| o.values().all(Value::is_null))
            }
            "prompt_cache_key" | "safety_identifier" => v.is_null() || v.is_string(),
            "stream_options" | "top_logprobs" | "max_tool_calls" | "conversation" | "prompt" => {
                v.is_null()
            }
            _ => false,
        };
        if !neutral {
            let field = static_field(k);
            return Err(Error::invalid(
                field,
                format!("`{k}` is not supported by this gateway's Responses API (value {v})."),
            ));
        }
    }
    Ok(())
}

/// The error's `param` for a field name the client chose (kept to the names the API defines,
/// so a hostile body cannot put arbitrary text there).
fn static_field(k: &str) -> &'static str {
    const KNOWN: &[&str] = &[
        "include",
        "truncation",
        "service_tier",
        "background",
        "reasoning",
        "prompt_cache_key",
        "safety_identifier",
        "stream_options",
        "top_logprobs",
        "max_tool_calls",
        "conversation",
        "prompt",
    ];
    KNOWN.iter().find(|f| **f == k).copied().unwrap_or("body")
}

fn check_metadata(m: &Map<String, Value>) -> Result<(), Error> {
    let ok = m.len() <= MAX_METADATA
        && m.iter()
            .all(|(k, v)| k.len() <= 64 && v.as_str().is_some_and(|s| s.len() <= 512));
    if ok {
        return Ok(());
    }
    Err(Error::invalid(
        "metadata",
        format!("`metadata` holds at most {MAX_METADATA} pairs of a key of up to 64 characters and a string of up to 512."),
    ))
}

/// Input items as chat messages: messages by role, a run of `function_call` items as one
/// assistant turn with those calls, each `function_call_output` as a tool turn.
fn chat_messages(items: &[Value]) -> Result<Vec<Value>, Error> {
    let mut out: Vec<Value> = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let at = |field: &str| format!("input[{i}]{field}");
        let kind = item["type"].as_str().unwrap_or("message");
        match kind {
            "message" => {
                let role = item["role"].as_str().unwrap_or_default();
                if !matches!(role, "user" | "system" | "developer" | "assistant") {
                    return Err(Error::invalid_at(
                        at(".role"),
                        format!("Role {role:?} is not one of user, system, developer, assistant."),
                    ));
                }
                out.push(json!({"role": role, "content": message_text(&item["content"], &at)?}));
            }
            "function_call" => {
                let (Some(call_id), Some(name)) = (item["call_id"].as_str(), item["name"].as_str())
                else {
                    return Err(Error::invalid_at(
                        at(""),
                        "A function_call item needs `call_id` and `name`.",
                    ));
                };
                let arguments = item["arguments"].as_str().unwrap_or("{}");
                let call = json!({"id": call_id, "type": "function",
                                  "function": {"name": name, "arguments": arguments}});
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" && last["tool_calls"].is_array() => {
                        last["tool_calls"].as_array_mut().expect("an array").push(call);
                    }
                    _ => out.push(json!({"role": "assistant", "content": "", "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let Some(call_id) = item["call_id"].as_str() else {
                    return Err(Error::invalid_at(
                        at(".call_id"),
                        "A function_call_output item needs `call_id`.",
                    ));
                };
                let output = match &item["output"] {
                    Value::String(s) => s.clone(),
                    other => message_text(other, &at)?,
                };
                out.push(json!({"role": "tool", "tool_call_id": call_id, "content": output}));
            }
            other => {
                return Err(Error::invalid_at(
                    at(".type"),
                    format!("Input items of type {other:?} are not supported; send message, function_call or function_call_output items."),
                ))
            }
        }
    }
    Ok(out)
}

/// A message's content as text: a string, or `input_text` / `output_text` parts joined.
fn message_text(content: &Value, at: &dyn Fn(&str) -> String) -> Result<String, Error> {
    match content {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p["type"].as_str(), p["text"].as_str()) {
                    (Some("input_text" | "output_text" | "text"), Some(t)) => text.push_str(t),
                    (kind, _) => {
                        return Err(Error::invalid_at(
                            at(&format!(".content[{j}]")),
                            format!(
                            "Content parts of type {kind:?} are not supported; send input_text."
                        ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(Error::invalid_at(
            at(".content"),
            "`content` must be a string or a list of input_text parts.",
        )),
    }
}

/// A Responses tool as a chat tool: only `function` tools (flat in Responses, nested in chat).
fn chat_tool(i: usize, t: &Value) -> Result<Value, Error> {
    match t["type"].as_str() {
        Some("function") => {
            let mut function = json!({"name": t["name"], "parameters": t["parameters"]});
            for k in ["description", "strict"] {
                if let Some(v) = t.get(k).filter(|v| !v.is_null()) {
                    function[k] = v.clone();
                }
            }
            Ok(json!({"type": "function", "function": function}))
        }
        other => Err(Error::invalid_at(
            format!("tools[{i}].type"),
            format!(
                "Tools of type {} are not supported by this gateway; use function tools.",
                other.map_or("(none)".to_string(), |o| format!("{o:?}"))
            ),
        )),
    }
}

/// The last user message's text among chat messages.
fn last_user_text(messages: &[Value]) -> Option<String> {
    messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
        .and_then(|m| m["content"].as_str())
        .map(str::to_string)
}

fn chat_tool_choice(c: &Value) -> Result<Value, Error> {
    match c {
        // The search runs on every request that offers it; the choice is the functions'.
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("file_search") => {
            Ok(json!("auto"))
        }
        Value::String(_) => Ok(c.clone()),
        Value::Object(o) if o.get("type").and_then(Value::as_str) == Some("function") => {
            match o.get("name").and_then(Value::as_str) {
                Some(name) => Ok(json!({"type": "function", "function": {"name": name}})),
                None => Err(Error::invalid(
                    "tool_choice",
                    "A function tool choice needs `name`.",
                )),
            }
        }
        _ => Err(Error::invalid(
            "tool_choice",
            "`tool_choice` must be none, auto, required or {\"type\": \"function\", \"name\": ...}.",
        )),
    }
}

/// `text.format` as chat's `response_format`.
fn response_format(f: &Value) -> Result<Value, Error> {
    match f["type"].as_str() {
        Some("text") => Ok(json!({"type": "text"})),
        Some("json_object") => Ok(json!({"type": "json_object"})),
        Some("json_schema") => {
            let mut schema = json!({"name": f["name"], "schema": f["schema"]});
            if let Some(s) = f.get("strict").filter(|v| !v.is_null()) {
                schema["strict"] = s.clone();
            }
            Ok(json!({"type": "json_schema", "json_schema": schema}))
        }
        _ => Err(Error::invalid(
            "text",
            "`text.format.type` must be text, json_object or json_schema.",
        )),
    }
}

#[cfg(test)]
mod tests;
