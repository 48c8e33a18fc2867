//! OpenAI tool calling over a text model. Calls are written in the Hermes format that Qwen2.5
//! (and most tool-tuned open models) use: one JSON object per call inside `<tool_call>` tags.
//! A model whose chat template has a `tools` branch gets the tools and the structured history
//! through it; any other gets the documented generic format: the tool list appended to the
//! system message, past calls written in the same tags, tool results as user turns inside
//! `<tool_response>` tags.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

use crate::engine::chat_template::{ChatMessage, ToolCall};

pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";

#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments object.
    pub parameters: Value,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolSet {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// More than one call per answer (`parallel_tool_calls`, default true).
    pub parallel: bool,
}

/// The schema of one call of `tool`: its name, then its arguments.
fn call_schema(tool: &Tool) -> Value {
    json!({
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}

/// A grammar of calls to `tools`: one, or with `parallel` one or more, newline-separated.
fn calls_grammar(tools: &[&Tool], parallel: bool) -> TopLevelGrammar {
    let alternatives: Vec<Value> = tools.iter().map(|t| call_schema(t)).collect();
    let schema = json!({
        "anyOf": alternatives,
        "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "},
    });
    let repeat = if parallel { " (\"\\n\" call)*" } else { "" };
    TopLevelGrammar::from_lark(format!(
        "start: call{repeat}\ncall: {} \"\\n\" args \"\\n\" {}\nargs: %json {schema}",
        super::lark_string(OPEN),
        super::lark_string(CLOSE),
    ))
}

impl ToolSet {
    /// `required` and a named function constrain the answer to calls; `auto` lets the model
    /// choose, and its calls are parsed out of the text.
    pub fn constrains(&self) -> bool {
        matches!(self.choice, ToolChoice::Required | ToolChoice::Named(_))
    }

    /// The calls this request allows (all tools for `auto` and `required`).
    pub fn grammar(&self) -> TopLevelGrammar {
        let allowed: Vec<&Tool> = match &self.choice {
            ToolChoice::Named(n) => self.tools.iter().filter(|t| &t.name == n).collect(),
            _ => self.tools.iter().collect(),
        };
        let parallel = self.parallel && !matches!(self.choice, ToolChoice::Named(_));
        calls_grammar(&allowed, parallel)
    }

    /// One call of one tool: compiled alone to find which tool's schema is at fault.
    pub fn tool_grammar(tool: &Tool) -> TopLevelGrammar {
        calls_grammar(&[tool], false)
    }

    /// The tools as chat templates take them (OpenAI's request shape).
    pub fn definitions(&self) -> Vec<Value> {
        self.tools
            .iter()
            .map(|t| {
                let mut f = json!({"name": t.name, "parameters": t.parameters});
                if let Some(d) = &t.description {
                    f["description"] = json!(d);
                }
                json!({"type": "function", "function": f})
            })
            .collect()
    }

    /// The generic format's instructions, appended to the system message.
    pub fn system_prompt(&self) -> String {
        let list: Vec<String> = self.definitions().iter().map(Value::to_string).collect();
        format!(
            "# Tools\n\nYou can call functions to help answer the user. Their signatures, one \
             per line:\n<tools>\n{}\n</tools>\n\nTo call a function, reply with a JSON object \
             holding its name and arguments inside {OPEN}{CLOSE} tags, one pair of tags per \
             call:\n{OPEN}\n{{\"name\": <function-name>, \"arguments\": <arguments-object>}}\n{CLOSE}",
            list.join("\n")
        )
    }
}

/// A call as the model writes it.
pub fn call_text(name: &str, arguments: &Value) -> String {
    format!(
        "{OPEN}\n{}\n{CLOSE}",
        json!({"name": name, "arguments": arguments})
    )
}

/// The conversation in the generic format, for a template (or prompt plugin) that knows
/// nothing of tools: instructions in the system message, calls and results as text.
pub fn generic_messages(
    mut messages: Vec<ChatMessage>,
    tools: Option<&ToolSet>,
) -> Vec<ChatMessage> {
    if let Some(t) = tools.filter(|t| t.choice != ToolChoice::None) {
        let prompt = t.system_prompt();
        match messages.first_mut().filter(|m| m.role == "system") {
            Some(first) => first.content = format!("{}\n\n{prompt}", first.content),
            None => messages.insert(0, ChatMessage::new("system", prompt)),
        }
    }
    generic_history(messages)
}

fn generic_history(messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    for m in messages {
        match m.role.as_str() {
            "assistant" if !m.tool_calls.is_empty() => {
                let mut parts: Vec<String> = Vec::new();
                if !m.content.is_empty() {
                    parts.push(m.content.clone());
                }
                parts.extend(
                    m.tool_calls
                        .iter()
                        .map(|c| call_text(&c.function.name, &c.function.arguments)),
                );
                out.push(ChatMessage::new("assistant", parts.join("\n")));
            }
            "tool" => {
                let response = format!("<tool_response>\n{}\n</tool_response>", m.content);
                // Results of one turn's calls go together in one user turn.
                match out.last_mut() {
                    Some(last)
                        if last.role == "user" && last.content.ends_with("</tool_response>") =>
                    {
                        last.content = format!("{}\n{response}", last.content);
                    }
                    _ => out.push(ChatMessage::new("user", response)),
                }
            }
            _ => out.push(ChatMessage {
                tool_calls: Vec::new(),
                tool_call_id: None,
                ..m
            }),
        }
    }
    out
}

/// A parsed call, ready for `message.tool_calls`.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub id: String,
    pub name: String,
    /// The arguments object as JSON text (OpenAI sends it as a string).
    pub arguments: String,
}

impl Call {
    /// A whole call as stream deltas.
    fn deltas(self) -> Vec<Delta> {
        vec![
            Delta::CallStart {
                id: self.id,
                name: self.name,
            },
            Delta::Args(self.arguments),
        ]
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Delta {
    Content(String),
    /// A call begins: its id and function name.
    CallStart {
        id: String,
        name: String,
    },
    /// More of the current call's arguments (JSON text, in pieces).
    Args(String),
}

/// How a constrained call starts, byte for byte: the call grammar writes the name first, with
/// the compact layout.
const HEAD: &str = "\n{\"name\": \"";
const AFTER_NAME: &str = "\", \"arguments\": ";

/// A call whose arguments are being streamed: where the arguments object stands.
#[derive(Default)]
struct Streaming {
    depth: usize,
    in_string: bool,
    escaped: bool,
    /// The arguments object has closed; what is left is the call's `}` and closing tag.
    closed: bool,
}

impl Streaming {
    /// How much of `text` (the next arguments text) belongs to the arguments.
    fn scan(&mut self, text: &str) -> usize {
        for (i, c) in text.char_indices() {
            if self.closed {
                return i;
            }
            match (self.in_string, self.escaped, c) {
                (true, true, _) => self.escaped = false,
                (true, false, '\\') => self.escaped = true,
                (true, false, '"') => self.in_string = false,
                (true, false, _) => {}
                (false, _, '"') => self.in_string = true,
                (false, _, '{' | '[') => self.depth += 1,
                (false, _, '}' | ']') => {
                    self.depth = self.depth.saturating_sub(1);
                    self.closed = self.depth == 0;
                }
                _ => {}
            }
        }
        text.len()
    }
}

/// Splits generated text into content and calls as it streams: text that may be the start of
/// a `<tool_call>` tag is held back until it is known; a call is released whole when its
/// closing tag arrives. A block that does not parse, or names an unknown function, is content.
///
/// With `tool_choice: auto`, an answer that starts with `{` or a code fence is held to the end:
/// models often write a call as a bare (or fenced) JSON object instead of in tags, and the
/// whole answer being one such object counts as that call.
pub struct CallParser {
    known: Vec<String>,
    buf: String,
    inside: bool,
    calls: usize,
    /// `None` until the answer's first visible character says whether it may be a bare call.
    bare: Option<bool>,
    /// Calls are constrained to the grammar's layout: their arguments stream as generated.
    progressive: bool,
    /// The call in the current block, once its head was read (progressive mode).
    streaming: Option<Streaming>,
    /// The current block does not start as the grammar writes calls: read it whole.
    whole: bool,
}

impl CallParser {
    pub fn new(tools: &ToolSet) -> Self {
        Self {
            known: tools.tools.iter().map(|t| t.name.clone()).collect(),
            buf: String::new(),
            inside: false,
            calls: 0,
            bare: match tools.choice {
                ToolChoice::Auto => None,
                _ => Some(false),
            },
            progressive: tools.constrains(),
            streaming: None,
            whole: false,
        }
    }

    /// Calls found so far.
    pub fn calls(&self) -> usize {
        self.calls
    }

    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        if self.bare.is_none() {
            match self.buf.trim_start().chars().next() {
                None => return out,
                Some(c) => self.bare = Some(c == '{' || c == '`'),
            }
        }
        if self.bare == Some(true) {
            return out;
        }
        loop {
            if !self.inside {
                if let Some(i) = self.buf.find(OPEN) {
                    self.content(&mut out, i);
                    self.buf.drain(..OPEN.len());
                    self.inside = true;
                    continue;
                }
                let keep = (1..OPEN.len())
                    .rev()
                    .find(|&k| self.buf.ends_with(&OPEN[..k]))
                    .unwrap_or(0);
                self.content(&mut out, self.buf.len() - keep);
                return out;
            }
            if self.progressive && !self.whole {
                self.stream_call(&mut out);
            }
            let Some(i) = self.buf.find(CLOSE) else {
                return out;
            };
            let body: String = self.buf.drain(..i + CLOSE.len()).collect();
            let body = &body[..i];
            if self.streaming.take().is_none() {
                match self.call(body) {
                    Some(c) => out.extend(c.deltas()),
                    None => out.push(Delta::Content(format!("{OPEN}{body}{CLOSE}"))),
                }
            }
            self.inside = false;
            self.whole = false;
        }
    }

    /// Progressive mode, inside a block: releases the call's start once its head is read, then
    /// its arguments as they arrive.
    fn stream_call(&mut self, out: &mut Vec<Delta>) {
        if self.streaming.is_none() {
            let b = self.buf.as_str();
            if b.len() < HEAD.len() {
                self.whole = !HEAD.starts_with(b);
                return;
            }
            let Some(rest) = b.strip_prefix(HEAD) else {
                self.whole = true;
                return;
            };
            let Some(end) = rest.find('"') else { return };
            let name = &rest[..end];
            let after = &rest[end..];
            if after.len() < AFTER_NAME.len() {
                self.whole = !AFTER_NAME.starts_with(after);
                return;
            }
            if !after.starts_with(AFTER_NAME) || !self.known.iter().any(|k| k == name) {
                self.whole = true;
                return;
            }
            out.push(Delta::CallStart {
                id: call_id(),
                name: name.to_string(),
            });
            self.calls += 1;
            let head = HEAD.len() + end + AFTER_NAME.len();
            self.buf.drain(..head);
            self.streaming = Some(Streaming::default());
        }
        let Some(s) = self.streaming.as_mut() else {
            return;
        };
        if s.closed {
            return;
        }
        let n = s.scan(&self.buf);
        let args: String = self.buf.drain(..n).collect();
        if !args.is_empty() {
            out.push(Delta::Args(args));
        }
    }

    /// The end of the text: held-back text is content; an unclosed block whose JSON is
    /// complete (a model that stopped right after it) is still a call.
    pub fn finish(&mut self) -> Vec<Delta> {
        if self.bare == Some(true) {
            return self.finish_bare();
        }
        let rest = std::mem::take(&mut self.buf);
        if !self.inside {
            let mut out = Vec::new();
            self.buf = rest;
            self.content(&mut out, self.buf.len());
            return out;
        }
        self.inside = false;
        if self.streaming.take().is_some() {
            // A call cut short (max_tokens): its arguments went out as they came.
            return Vec::new();
        }
        match self.call(&rest) {
            Some(c) => c.deltas(),
            None => vec![Delta::Content(format!("{OPEN}{rest}"))],
        }
    }

    /// A held answer: tagged calls if it has any, else the whole answer as one bare call, else
    /// content.
    fn finish_bare(&mut self) -> Vec<Delta> {
        let text = std::mem::take(&mut self.buf);
        self.bare = Some(false);
        let mut out = self.push(&text);
        out.extend(self.finish());
        if self.calls > 0 {
            return out;
        }
        let body = text.trim();
        let body = match body.strip_prefix("```") {
            Some(fenced) => fenced
                .trim_start_matches(|c: char| c.is_ascii_alphanumeric())
                .trim_end()
                .trim_end_matches("```"),
            None => body,
        };
        match self.call(body) {
            Some(c) => c.deltas(),
            None => out,
        }
    }

    /// Releases `buf[..end]` as content; after a call, whitespace between calls is dropped.
    fn content(&mut self, out: &mut Vec<Delta>, end: usize) {
        let text: String = self.buf.drain(..end).collect();
        let between_calls = self.calls > 0 && text.trim().is_empty();
        if !text.is_empty() && !between_calls {
            out.push(Delta::Content(text));
        }
    }

    fn call(&mut self, body: &str) -> Option<Call> {
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        let name = v.get("name")?.as_str()?;
        if !self.known.iter().any(|k| k == name) {
            return None;
        }
        let arguments = match v.get("arguments").or_else(|| v.get("parameters")) {
            None => "{}".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(a) => a.to_string(),
        };
        self.calls += 1;
        Some(Call {
            id: call_id(),
            name: name.to_string(),
            arguments,
        })
    }
}

/// `call_` and 24 random letters and digits, as OpenAI's ids look.
fn call_id() -> String {
    use rand::distr::{Alphanumeric, SampleString};
    format!("call_{}", Alphanumeric.sample_string(&mut rand::rng(), 24))
}

/// Content and calls of a whole answer: content `None` when it is only whitespace.
pub fn parse(text: &str, tools: &ToolSet) -> (Option<String>, Vec<Call>) {
    let mut p = CallParser::new(tools);
    let mut deltas = p.push(text);
    deltas.extend(p.finish());
    let mut content = String::new();
    let mut calls = Vec::new();
    for d in deltas {
        match d {
            Delta::Content(t) => content.push_str(&t),
            Delta::CallStart { id, name } => calls.push(Call {
                id,
                name,
                arguments: String::new(),
            }),
            Delta::Args(a) => {
                if let Some(c) = calls.last_mut() {
                    c.arguments.push_str(&a);
                }
            }
        }
    }
    let content = match content.trim() {
        "" if !calls.is_empty() => None,
        _ if !calls.is_empty() => Some(content.trim().to_string()),
        _ => Some(content),
    };
    (content, calls)
}

/// A past call as the chat template gets it: arguments as an object when they are JSON.
pub fn history_call(id: String, name: String, arguments: &str) -> ToolCall {
    let arguments =
        serde_json::from_str(arguments).unwrap_or_else(|_| Value::String(arguments.to_string()));
    ToolCall::new(id, name, arguments)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(choice: ToolChoice) -> ToolSet {
        ToolSet {
            tools: vec![Tool {
                name: "lookup".into(),
                description: Some("Find an account".into()),
                parameters: json!({"type": "object", "properties": {"q": {"type": "string"}}}),
            }],
            choice,
            parallel: true,
        }
    }

    #[test]
    fn streamed_calls_equal_the_whole_parse() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"q\": \"Acme\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"q\": \"Initech\"}}\n</tool_call>";
        let tools = set(ToolChoice::Auto);
        let mut p = CallParser::new(&tools);
        let mut deltas = Vec::new();
        // One character at a time: tags split anywhere.
        for c in text.chars() {
            deltas.extend(p.push(&c.to_string()));
        }
        deltas.extend(p.finish());
        let content: String = deltas
            .iter()
            .filter_map(|d| match d {
                Delta::Content(t) => Some(t.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(content, "Let me check.\n");
        let args: Vec<&str> = deltas
            .iter()
            .filter_map(|d| match d {
                Delta::Args(a) => Some(a.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(args, [r#"{"q":"Acme"}"#, r#"{"q":"Initech"}"#]);
        let (content, calls) = parse(text, &tools);
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(calls.len(), 2);
        assert!(calls[0].id.starts_with("call_") && calls[0].id.len() == 29);
    }

    #[test]
    fn constrained_calls_stream_their_arguments_as_generated() {
        let text = "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {\"q\": \"a } \\\" ]\", \"n\": [1, {\"x\": 2}]}}\n</tool_call>\n<tool_call>\n{\"name\": \"lookup\", \"arguments\": {}}\n</tool_call>";
        let tools = set(ToolChoice::Required);
        let mut p = CallParser::new(&tools);
        let mut deltas = Vec::new();
        for c in text.chars() {
            deltas.extend(p.push(&c.to_string()));
        }
        deltas.extend(p.finish());
        let starts = deltas
            .iter()
            .filter(|d| matches!(d, Delta::CallStart { .. }))
            .count();
        let pieces = deltas
            .iter()
            .filter(|d| matches!(d, Delta::Args(_)))
            .count();
        assert_eq!(starts, 2);
        assert!(pieces > 10, "arguments arrive piece by piece: {deltas:?}");
        assert!(
            !deltas.iter().any(|d| matches!(d, Delta::Content(_))),
            "{deltas:?}"
        );
        let (content, calls) = parse(text, &tools);
        assert_eq!(content, None);
        assert_eq!(
            calls[0].arguments,
            r#"{"q": "a } \" ]", "n": [1, {"x": 2}]}"#
        );
        assert_eq!(calls[1].arguments, "{}");
        // Cut by max_tokens: what was generated of the arguments, the same both ways.
        let cut = &text[..52];
        let (_, calls) = parse(cut, &tools);
        assert_eq!(calls[0].arguments, r#"{"q": "a"#);
    }

    #[test]
    fn unknown_functions_broken_json_and_near_tags_stay_content() {
        let tools = set(ToolChoice::Auto);
        let text = "<tool_call>{\"name\": \"drop_tables\"}</tool_call> a <tool x <tool_call>{oops";
        let (content, calls) = parse(text, &tools);
        assert!(calls.is_empty());
        assert_eq!(content.as_deref(), Some(text));
        // An unclosed but complete call at the end still counts.
        let (_, calls) = parse(
            "<tool_call>\n{\"name\": \"lookup\", \"arguments\": {}}",
            &tools,
        );
        assert_eq!(calls[0].arguments, "{}");
    }

    #[test]
    fn auto_takes_a_bare_or_fenced_json_call() {
        let tools = set(ToolChoice::Auto);
        for text in [
            "{\"name\": \"lookup\", \"arguments\": {\"q\": \"Acme\"}}",
            "```json\n{\n  \"name\": \"lookup\",\n  \"arguments\": {\"q\": \"Acme\"}\n}\n```",
        ] {
            let (content, calls) = parse(text, &tools);
            assert_eq!(content, None, "{text}");
            assert_eq!(calls[0].arguments, r#"{"q":"Acme"}"#);
        }
        // Other JSON, or the same under `required` (which writes tags), is content.
        let (content, calls) = parse("{\"total\": 3}", &tools);
        assert!(calls.is_empty());
        assert_eq!(content.as_deref(), Some("{\"total\": 3}"));
        let (_, calls) = parse(
            "{\"name\": \"lookup\", \"arguments\": {}}",
            &set(ToolChoice::Required),
        );
        assert!(calls.is_empty());
    }

    #[test]
    fn generic_format_folds_tools_into_plain_turns() {
        let tools = set(ToolChoice::Auto);
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = vec![history_call(
            "call_1".into(),
            "lookup".into(),
            r#"{"q":"Acme"}"#,
        )];
        let mut result = ChatMessage::new("tool", "{\"id\": 7}");
        result.tool_call_id = Some("call_1".into());
        let out = generic_messages(
            vec![ChatMessage::new("user", "Find Acme"), call, result],
            Some(&tools),
        );
        let roles: Vec<&str> = out.iter().map(|m| m.role.as_str()).collect();
        assert_eq!(roles, ["system", "user", "assistant", "user"]);
        assert!(out[0].content.contains("\"name\":\"lookup\""));
        assert_eq!(
            out[2].content,
            "<tool_call>\n{\"name\":\"lookup\",\"arguments\":{\"q\":\"Acme\"}}\n</tool_call>"
        );
        assert_eq!(
            out[3].content,
            "<tool_response>\n{\"id\": 7}\n</tool_response>"
        );
        // An existing system message gets the instructions appended.
        let out = generic_messages(vec![ChatMessage::new("system", "Be brief.")], Some(&tools));
        assert_eq!(out.len(), 1);
        assert!(out[0].content.starts_with("Be brief.\n\n# Tools"));
    }

    #[test]
    fn named_choice_allows_only_that_function_once() {
        let mut tools = set(ToolChoice::Named("lookup".into()));
        tools.tools.push(Tool {
            name: "other".into(),
            description: None,
            parameters: json!({"type": "object"}),
        });
        let g = serde_json::to_string(&tools.grammar()).unwrap();
        assert!(g.contains("lookup") && !g.contains("other"), "{g}");
        assert!(!g.contains("call)*"));
        tools.choice = ToolChoice::Required;
        let g = serde_json::to_string(&tools.grammar()).unwrap();
        assert!(g.contains("other") && g.contains("call)*"), "{g}");
    }
}
