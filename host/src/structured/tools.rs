//! OpenAI tool calling over a text model. Calls are written in the Hermes format that Qwen2.5
//! (and most tool-tuned open models) use: one JSON object per call inside `<tool_call>` tags.
//! A model whose chat template has a `tools` branch gets the tools and the structured history
//! through it; any other gets the documented generic format: the tool list appended to the
//! system message, past calls written in the same tags, tool results as user turns inside
//! `<tool_response>` tags.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

use crate::engine::chat_template::{ChatMessage, Role, ToolCall};

mod parse;
pub use parse::{parse, Call, CallParser, Delta};

pub const OPEN: &str = "<tool_call>";
pub const CLOSE: &str = "</tool_call>";

#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of the arguments object.
    pub parameters: Value,
    /// Decode the arguments with no properties beyond those listed (the default; a request
    /// opts out with `strict: false`).
    pub strict: bool,
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
    let arguments = match tool.strict {
        true => super::strict_schema(tool.parameters.clone()),
        false => tool.parameters.clone(),
    };
    json!({
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": arguments},
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
        match messages.first_mut().filter(|m| m.role == Role::System) {
            Some(first) => first.content = format!("{}\n\n{prompt}", first.content),
            None => messages.insert(0, ChatMessage::new(Role::System, prompt)),
        }
    }
    generic_history(messages)
}

fn generic_history(messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
    let mut out: Vec<ChatMessage> = Vec::with_capacity(messages.len());
    for m in messages {
        match m.role {
            Role::Assistant if !m.tool_calls.is_empty() => {
                let mut parts: Vec<String> = Vec::new();
                if !m.content.is_empty() {
                    parts.push(m.content.clone());
                }
                parts.extend(
                    m.tool_calls
                        .iter()
                        .map(|c| call_text(&c.function.name, &c.function.arguments)),
                );
                out.push(ChatMessage::new(Role::Assistant, parts.join("\n")));
            }
            Role::Tool => {
                let response = format!("<tool_response>\n{}\n</tool_response>", m.content);
                // Results of one turn's calls go together in one user turn.
                match out.last_mut() {
                    Some(last)
                        if last.role == Role::User
                            && last.content.ends_with("</tool_response>") =>
                    {
                        last.content = format!("{}\n{response}", last.content);
                    }
                    _ => out.push(ChatMessage::new(Role::User, response)),
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
                strict: true,
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
        let mut call = ChatMessage::new(Role::Assistant, "");
        call.tool_calls = vec![history_call(
            "call_1".into(),
            "lookup".into(),
            r#"{"q":"Acme"}"#,
        )];
        let mut result = ChatMessage::new(Role::Tool, "{\"id\": 7}");
        result.tool_call_id = Some("call_1".into());
        let out = generic_messages(
            vec![ChatMessage::new(Role::User, "Find Acme"), call, result],
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
        let out = generic_messages(
            vec![ChatMessage::new(Role::System, "Be brief.")],
            Some(&tools),
        );
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
            strict: true,
        });
        let g = serde_json::to_string(&tools.grammar()).unwrap();
        assert!(g.contains("lookup") && !g.contains("other"), "{g}");
        assert!(!g.contains("call)*"));
        tools.choice = ToolChoice::Required;
        let g = serde_json::to_string(&tools.grammar()).unwrap();
        assert!(g.contains("other") && g.contains("call)*"), "{g}");
    }
}
