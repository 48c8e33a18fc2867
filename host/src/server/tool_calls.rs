//! Tool calls in the response: `message.tool_calls` of a whole answer, and the
//! `delta.tool_calls` chunks of a stream, shaped as the OpenAI SDKs' stream helpers expect
//! (the first chunk of a call has its id, type, name and empty arguments; the next ones carry
//! argument text).

use serde_json::{json, Value};

use crate::engine::FinishReason;
use crate::structured::tools::{self, CallParser, Delta, ToolSet};

/// `finish_reason` of a choice: `tool_calls` when it ended normally having called.
pub(super) fn finish_reason(finish: FinishReason, called: bool) -> &'static str {
    match (finish, called) {
        (FinishReason::Stop, true) => "tool_calls",
        (f, _) => f.as_str(),
    }
}

/// The assistant message of a whole answer, and whether it called a tool. Without
/// `parallel_tool_calls`, only the first call counts.
pub(super) fn message(text: &str, tools: &ToolSet) -> (Value, bool) {
    let (content, mut calls) = tools::parse(text, tools);
    if !tools.parallel {
        calls.truncate(1);
    }
    let mut m = json!({"role": "assistant", "content": content});
    if calls.is_empty() {
        return (m, false);
    }
    let calls: Vec<Value> = calls
        .into_iter()
        .map(|c| {
            json!({"id": c.id, "type": "function",
                   "function": {"name": c.name, "arguments": c.arguments}})
        })
        .collect();
    m["tool_calls"] = Value::Array(calls);
    (m, true)
}

/// One choice's tool-call progress in a stream.
pub(super) struct StreamCalls {
    parser: CallParser,
    next_index: usize,
    parallel: bool,
    /// Inside a call that is dropped (a second one without `parallel_tool_calls`).
    skipping: bool,
}

impl StreamCalls {
    pub(super) fn new(tools: &ToolSet) -> Self {
        Self {
            parser: CallParser::new(tools),
            next_index: 0,
            parallel: tools.parallel,
            skipping: false,
        }
    }

    pub(super) fn called(&self) -> bool {
        self.next_index > 0
    }

    /// The `delta`s for a piece of generated text (none while a tag is being read).
    pub(super) fn push(&mut self, text: &str) -> Vec<Value> {
        let deltas = self.parser.push(text);
        self.deltas(deltas)
    }

    /// The `delta`s for text held back when the choice ends.
    pub(super) fn finish(&mut self) -> Vec<Value> {
        let deltas = self.parser.finish();
        self.deltas(deltas)
    }

    fn deltas(&mut self, deltas: Vec<Delta>) -> Vec<Value> {
        let mut out = Vec::new();
        for d in deltas {
            match d {
                Delta::Content(t) => out.push(json!({"content": t})),
                // Without `parallel_tool_calls`, calls after the first are dropped.
                Delta::CallStart { .. } if self.next_index > 0 && !self.parallel => {
                    self.skipping = true;
                }
                Delta::CallStart { id, name } => {
                    self.skipping = false;
                    out.push(json!({"tool_calls": [{"index": self.next_index, "id": id,
                        "type": "function", "function": {"name": name, "arguments": ""}}]}));
                    self.next_index += 1;
                }
                Delta::Args(_) if self.skipping || self.next_index == 0 => {}
                Delta::Args(a) => out.push(json!({"tool_calls": [{"index": self.next_index - 1,
                    "function": {"arguments": a}}]})),
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::structured::tools::{Tool, ToolChoice};

    #[test]
    fn stream_deltas_reassemble_to_the_whole_message() {
        let tools = ToolSet {
            tools: vec![Tool {
                name: "create_ticket".into(),
                description: None,
                parameters: json!({"type": "object"}),
                strict: true,
            }],
            choice: ToolChoice::Required,
            parallel: true,
        };
        let text = "<tool_call>\n{\"name\": \"create_ticket\", \"arguments\": {\"title\": \"Printer\"}}\n</tool_call>";
        let (whole, called) = message(text, &tools);
        assert!(called);
        assert_eq!(whole["content"], Value::Null);
        let mut s = StreamCalls::new(&tools);
        let mut deltas = Vec::new();
        for piece in text.split_inclusive(' ') {
            deltas.extend(s.push(piece));
        }
        deltas.extend(s.finish());
        assert!(deltas.len() >= 2, "{deltas:?}");
        assert_eq!(deltas[0]["tool_calls"][0]["function"]["arguments"], "");
        let args: String = deltas[1..]
            .iter()
            .map(|d| {
                d["tool_calls"][0]["function"]["arguments"]
                    .as_str()
                    .unwrap()
            })
            .collect();
        assert_eq!(args, whole["tool_calls"][0]["function"]["arguments"]);
        assert_eq!(
            deltas[0]["tool_calls"][0]["function"]["name"],
            "create_ticket"
        );
        assert_eq!(finish_reason(FinishReason::Stop, s.called()), "tool_calls");
        assert_eq!(finish_reason(FinishReason::Length, true), "length");
    }
}
