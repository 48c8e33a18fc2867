//! Calls out of the model's text: the streaming parser that splits each choice's deltas into
//! content and `<tool_call>` blocks as they arrive (names first, arguments as they grow), and
//! the whole-answer parse built on it.

use serde_json::Value;

use super::{ToolChoice, ToolSet, CLOSE, OPEN};

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
