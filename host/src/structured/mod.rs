//! Structured output: what a request asks its text to look like (OpenAI `response_format`,
//! vLLM's `structured_outputs` and older `guided_*` fields, tool calls), as an llguidance
//! grammar for the engine's constrained decoding.
//!
//! Must not depend on: HTTP. The server parses the request fields into a [`Format`] and maps
//! compile errors to 400s naming the field.

pub mod tools;

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

/// One constraint on a choice's whole text.
#[derive(Debug, Clone, PartialEq)]
pub enum Format {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// A JSON value matching this schema.
    JsonSchema(Value),
    /// A string matching this regular expression (Rust `regex` syntax, anchored).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A context-free grammar in llguidance's Lark dialect.
    Grammar(String),
}

/// JSON is written compactly, one space after `:` and `,` as OpenAI's models write it: a
/// free-whitespace grammar lets a small model spend its whole budget on newlines.
fn with_layout(mut schema: Value) -> Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance").or_insert_with(
            || json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

impl Format {
    pub fn grammar(&self) -> TopLevelGrammar {
        match self {
            Format::JsonObject => {
                TopLevelGrammar::from_json_schema(with_layout(json!({"type": "object"})))
            }
            // A boolean schema (`true`) has nowhere to put the layout; it is any JSON value.
            Format::JsonSchema(s) => TopLevelGrammar::from_json_schema(with_layout(s.clone())),
            Format::Regex(r) => TopLevelGrammar::from_regex(r),
            // A regex alternation is one lexeme (a DFA), so thousands of choices stay cheap;
            // as grammar alternatives they would blow the parser's row limit.
            Format::Choice(options) => {
                let alternatives: Vec<String> = options.iter().map(|o| regex_escape(o)).collect();
                TopLevelGrammar::from_regex(&format!("({})", alternatives.join("|")))
            }
            Format::Grammar(g) => TopLevelGrammar::from_lark(g.clone()),
        }
    }
}

/// `s` matched literally in a regex (`regex-syntax` meta characters escaped).
fn regex_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// A Lark string literal for `s`: JSON string escaping is a subset Lark reads the same way.
pub(crate) fn lark_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_gets_compact_layout_unless_the_schema_sets_one() {
        let s = with_layout(json!({"type": "object"}));
        assert_eq!(s["x-guidance"]["whitespace_flexible"], false);
        let own = json!({"type": "object", "x-guidance": {"whitespace_flexible": true}});
        assert_eq!(with_layout(own.clone()), own);
        assert_eq!(with_layout(json!(true)), json!(true));
    }

    #[test]
    fn choices_become_one_escaped_alternation() {
        assert_eq!(regex_escape("a.b*(c)"), r"a\.b\*\(c\)");
        let g = Format::Choice(vec!["yes".into(), "no (maybe)".into()]).grammar();
        let text = serde_json::to_string(&g).unwrap();
        assert!(text.contains(r"(yes|no \\(maybe\\))"), "{text}");
    }
}
