//! A chat answer shaped as the Responses API's: a whole chat completion as a Response object
//! (`Shape::response`), or the chunks of a streamed one as Responses events, in OpenAI's order
//! (`EventStream`): `response.created`, `response.in_progress`, then per output item
//! `response.output_item.added`, its content or arguments deltas and their `.done`,
//! `response.output_item.done`, and last `response.completed` (or `response.incomplete`, or
//! `response.failed`), each with its `sequence_number`.

use std::sync::Arc;

use serde_json::{json, Map, Value};

use super::file_search;

/// What the Response object repeats of its request.
#[derive(Debug)]
pub struct Echo {
    pub model: String,
    pub instructions: Option<String>,
    pub max_output_tokens: Option<u64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub metadata: Map<String, Value>,
    pub user: Option<String>,
    pub tools: Vec<Value>,
    pub tool_choice: Value,
    pub parallel_tool_calls: bool,
    pub format: Value,
    pub previous_response_id: Option<String>,
    pub store: bool,
    /// The request offered `file_search`: the search's query.
    pub file_search: Option<String>,
}

/// One response's identity and echo, shared by its body or its events.
#[derive(Debug, Clone)]
pub struct Shape {
    pub id: String,
    created_at: u64,
    echo: Arc<Echo>,
}

fn new_id(prefix: &str) -> String {
    format!("{prefix}_{:032x}", rand::random::<u128>())
}

impl Shape {
    pub fn new(echo: Echo) -> Self {
        let created_at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Self {
            id: new_id("resp"),
            created_at,
            echo: Arc::new(echo),
        }
    }

    /// The Response object in `status`, with `output` and `usage` as given.
    fn object(&self, model: Option<&str>, status: &str, output: Vec<Value>, usage: Value) -> Value {
        let e = &self.echo;
        let incomplete = (status == "incomplete").then(|| json!({"reason": "max_output_tokens"}));
        json!({
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": false,
            "error": null,
            "incomplete_details": incomplete,
            "instructions": e.instructions,
            "max_output_tokens": e.max_output_tokens,
            "metadata": e.metadata,
            "model": model.unwrap_or(&e.model),
            "output": output,
            "parallel_tool_calls": e.parallel_tool_calls,
            "previous_response_id": e.previous_response_id,
            "reasoning": {"effort": null, "summary": null},
            "store": e.store,
            "temperature": e.temperature,
            "text": {"format": e.format},
            "tool_choice": e.tool_choice,
            "tools": e.tools,
            "top_p": e.top_p,
            "truncation": "disabled",
            "usage": usage,
            "user": e.user,
        })
    }

    /// A whole chat completion as the Response object.
    pub fn response(&self, chat: &Value) -> Value {
        let choice = &chat["choices"][0];
        let message = &choice["message"];
        let mut output: Vec<Value> = self
            .echo
            .file_search
            .iter()
            .map(|q| file_search::call_item(q))
            .collect();
        if let Some(text) = message["content"].as_str().filter(|t| !t.is_empty()) {
            let notes = file_search::annotations(text, &chat["citations"]);
            output.push(message_item(&new_id("msg"), text, &notes, "completed"));
        }
        for call in message["tool_calls"].as_array().into_iter().flatten() {
            output.push(call_item(
                &new_id("fc"),
                &call["id"],
                &call["function"]["name"],
                call["function"]["arguments"].as_str().unwrap_or_default(),
                "completed",
            ));
        }
        let status = status(choice["finish_reason"].as_str());
        self.object(
            chat["model"].as_str(),
            status,
            output,
            usage(&chat["usage"]),
        )
    }

    pub fn events(&self) -> EventStream {
        EventStream {
            shape: self.clone(),
            seq: 0,
            started: false,
            model: None,
            items: Vec::new(),
            message: None,
            calls: Vec::new(),
            usage: Value::Null,
            finish: None,
            citations: Value::Null,
        }
    }
}

/// A chat finish reason as a Response status.
fn status(finish: Option<&str>) -> &'static str {
    match finish {
        Some("length") => "incomplete",
        _ => "completed",
    }
}

/// Chat usage as Responses usage.
fn usage(u: &Value) -> Value {
    if !u.is_object() {
        return Value::Null;
    }
    let (input, output) = (&u["prompt_tokens"], &u["completion_tokens"]);
    json!({
        "input_tokens": input,
        "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap_or(0)},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input.as_u64().unwrap_or(0) + output.as_u64().unwrap_or(0),
    })
}

fn text_part(text: &str, annotations: &[Value]) -> Value {
    json!({"type": "output_text", "text": text, "annotations": annotations, "logprobs": []})
}

fn message_item(id: &str, text: &str, annotations: &[Value], status: &str) -> Value {
    let content = match status {
        "in_progress" => json!([]),
        _ => json!([text_part(text, annotations)]),
    };
    json!({"id": id, "type": "message", "status": status, "role": "assistant", "content": content})
}

fn call_item(id: &str, call_id: &Value, name: &Value, arguments: &str, status: &str) -> Value {
    json!({"id": id, "type": "function_call", "status": status, "call_id": call_id,
           "name": name, "arguments": arguments})
}

/// The message item being streamed: its place in `output`, id and text so far.
struct OpenMessage {
    index: usize,
    id: String,
    text: String,
}

/// A function call being streamed: the chat call's index, its place in `output`, its item.
struct OpenCall {
    chat_index: u64,
    index: usize,
    id: String,
    call_id: Value,
    name: Value,
    arguments: String,
}

/// Chat chunks in, Responses events out.
pub struct EventStream {
    shape: Shape,
    seq: u64,
    started: bool,
    model: Option<String>,
    /// Output items, by output index (`None` while the item is still streaming).
    items: Vec<Option<Value>>,
    message: Option<OpenMessage>,
    calls: Vec<OpenCall>,
    usage: Value,
    finish: Option<String>,
    /// The sources retrieval found (the finishing chunk carries them).
    citations: Value,
}

impl EventStream {
    fn event(&mut self, kind: &str, mut body: Value) -> Value {
        body["type"] = json!(kind);
        body["sequence_number"] = json!(self.seq);
        self.seq += 1;
        body
    }

    fn snapshot(&self, status: &str) -> Value {
        let output = self.items.iter().flatten().cloned().collect();
        let usage = match status {
            "in_progress" => Value::Null,
            _ => self.usage.clone(),
        };
        self.shape
            .object(self.model.as_deref(), status, output, usage)
    }

    /// The events one chat chunk makes.
    pub fn push(&mut self, chunk: &Value) -> Vec<Value> {
        let mut out = Vec::new();
        if let Some(m) = chunk["model"].as_str() {
            self.model = Some(m.to_string());
        }
        if !self.started {
            self.started = true;
            let r = self.snapshot("in_progress");
            out.push(self.event("response.created", json!({"response": r})));
            out.push(self.event("response.in_progress", json!({"response": r})));
            if let Some(q) = self.shape.echo.file_search.clone() {
                self.searched(&q, &mut out);
            }
        }
        if chunk["citations"].is_array() {
            self.citations = chunk["citations"].clone();
        }
        if chunk["usage"].is_object() {
            self.usage = usage(&chunk["usage"]);
        }
        for choice in chunk["choices"].as_array().into_iter().flatten() {
            let delta = &choice["delta"];
            if let Some(text) = delta["content"].as_str().filter(|t| !t.is_empty()) {
                self.text(text, &mut out);
            }
            for call in delta["tool_calls"].as_array().into_iter().flatten() {
                self.call(call, &mut out);
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                self.finish = Some(f.to_string());
                self.close_all(&mut out);
            }
        }
        out
    }

    /// The search ran before the first token: its item, added and done, comes first.
    fn searched(&mut self, query: &str, out: &mut Vec<Value>) {
        let index = self.items.len();
        let item = file_search::call_item(query);
        let id = item["id"].clone();
        let mut added = item.clone();
        added["status"] = json!("in_progress");
        out.push(self.event(
            "response.output_item.added",
            json!({"output_index": index, "item": added}),
        ));
        for kind in ["in_progress", "searching", "completed"] {
            let body = json!({"item_id": id, "output_index": index});
            out.push(self.event(&format!("response.file_search_call.{kind}"), body));
        }
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ));
        self.items.push(Some(item));
    }

    fn text(&mut self, text: &str, out: &mut Vec<Value>) {
        if self.message.is_none() {
            let (index, id) = (self.items.len(), new_id("msg"));
            self.items.push(None);
            let item = message_item(&id, "", &[], "in_progress");
            out.push(self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            ));
            let part = json!({"type": "output_text", "text": "", "annotations": []});
            out.push(self.event(
                "response.content_part.added",
                json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
            ));
            self.message = Some(OpenMessage {
                index,
                id,
                text: String::new(),
            });
        }
        let m = self.message.as_mut().expect("opened above");
        m.text.push_str(text);
        let body = json!({"item_id": m.id, "output_index": m.index, "content_index": 0, "delta": text, "logprobs": []});
        out.push(self.event("response.output_text.delta", body));
    }

    fn call(&mut self, call: &Value, out: &mut Vec<Value>) {
        let chat_index = call["index"].as_u64().unwrap_or(0);
        if !self.calls.iter().any(|c| c.chat_index == chat_index) {
            self.close_message(out);
            let (index, id) = (self.items.len(), new_id("fc"));
            self.items.push(None);
            let (call_id, name) = (call["id"].clone(), call["function"]["name"].clone());
            let item = call_item(&id, &call_id, &name, "", "in_progress");
            out.push(self.event(
                "response.output_item.added",
                json!({"output_index": index, "item": item}),
            ));
            self.calls.push(OpenCall {
                chat_index,
                index,
                id,
                call_id,
                name,
                arguments: String::new(),
            });
        }
        let Some(piece) = call["function"]["arguments"]
            .as_str()
            .filter(|a| !a.is_empty())
        else {
            return;
        };
        let c = self
            .calls
            .iter_mut()
            .find(|c| c.chat_index == chat_index)
            .expect("opened above");
        c.arguments.push_str(piece);
        let body = json!({"item_id": c.id, "output_index": c.index, "delta": piece});
        out.push(self.event("response.function_call_arguments.delta", body));
    }

    fn close_message(&mut self, out: &mut Vec<Value>) {
        let Some(m) = self.message.take() else {
            return;
        };
        let (index, id) = (m.index, &m.id);
        let notes = file_search::annotations(&m.text, &self.citations);
        let done = json!({"item_id": id, "output_index": index, "content_index": 0, "text": m.text, "logprobs": []});
        out.push(self.event("response.output_text.done", done));
        let part = json!({"item_id": id, "output_index": index, "content_index": 0, "part": text_part(&m.text, &notes)});
        out.push(self.event("response.content_part.done", part));
        let item = message_item(id, &m.text, &notes, "completed");
        self.items[index] = Some(item.clone());
        out.push(self.event(
            "response.output_item.done",
            json!({"output_index": index, "item": item}),
        ));
    }

    fn close_all(&mut self, out: &mut Vec<Value>) {
        self.close_message(out);
        for c in std::mem::take(&mut self.calls) {
            let done = json!({"item_id": c.id, "output_index": c.index, "arguments": c.arguments});
            out.push(self.event("response.function_call_arguments.done", done));
            let item = call_item(&c.id, &c.call_id, &c.name, &c.arguments, "completed");
            self.items[c.index] = Some(item.clone());
            out.push(self.event(
                "response.output_item.done",
                json!({"output_index": c.index, "item": item}),
            ));
        }
    }

    /// The closing events once the chat stream ended: open items closed, then
    /// `response.completed` (or `response.incomplete` when cut by `max_output_tokens`).
    pub fn finish(&mut self) -> Vec<Value> {
        let mut out = Vec::new();
        self.close_all(&mut out);
        let status = status(self.finish.as_deref());
        let kind = match status {
            "incomplete" => "response.incomplete",
            _ => "response.completed",
        };
        let r = self.snapshot(status);
        out.push(self.event(kind, json!({"response": r})));
        out
    }

    /// `response.failed`, with the error an OpenAI error body carries.
    pub fn fail(&mut self, error: &Value) -> Vec<Value> {
        let mut r = self.snapshot("failed");
        r["error"] = json!({
            "code": error["error"]["code"].as_str().unwrap_or("server_error"),
            "message": error["error"]["message"],
        });
        vec![self.event("response.failed", json!({"response": r}))]
    }

    /// The response as it stands: after `finish`, the completed object to store.
    pub fn response(&self) -> Value {
        self.snapshot(status(self.finish.as_deref()))
    }
}
