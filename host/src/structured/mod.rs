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

/// `schema` as strict decoding reads it (OpenAI's `strict`, xgrammar's strict mode, vLLM's
/// default): every object schema that lists its `properties` and says nothing of
/// `additionalProperties` gets `additionalProperties: false`, so a small model cannot wander
/// through properties it invents until it runs out of tokens. An object schema without
/// `properties` still takes any object; `allOf` branches are left alone (one branch's
/// properties are allowed by another).
pub fn strict_schema(mut schema: Value) -> Value {
    tighten(&mut schema);
    schema
}

fn tighten(v: &mut Value) {
    let Some(o) = v.as_object_mut() else {
        if let Some(items) = v.as_array_mut() {
            items.iter_mut().for_each(tighten);
        }
        return;
    };
    if o.get("properties").is_some_and(Value::is_object)
        && !o.contains_key("additionalProperties")
        && !o.contains_key("unevaluatedProperties")
    {
        o.insert("additionalProperties".into(), Value::Bool(false));
    }
    for (k, child) in o.iter_mut() {
        match k.as_str() {
            "properties" | "patternProperties" | "$defs" | "definitions" => {
                if let Some(map) = child.as_object_mut() {
                    map.values_mut().for_each(tighten);
                }
            }
            "items"
            | "prefixItems"
            | "additionalProperties"
            | "anyOf"
            | "oneOf"
            | "not"
            | "if"
            | "then"
            | "else"
            | "contains" => tighten(child),
            _ => {}
        }
    }
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
    fn strict_schemas_close_listed_objects_only() {
        let s = strict_schema(json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "stops": {"type": "array", "items": {"type": "object", "properties": {"at": {"type": "string"}}}},
                "extra": {"type": "object"},
                "open": {"type": "object", "properties": {}, "additionalProperties": true},
            },
            "$defs": {"p": {"properties": {"x": {}}}},
            "anyOf": [{"properties": {"y": {}}}],
            "allOf": [{"properties": {"z": {}}}],
        }));
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(
            s["properties"]["stops"]["items"]["additionalProperties"],
            false
        );
        assert!(
            s["properties"]["extra"]
                .get("additionalProperties")
                .is_none(),
            "any object"
        );
        assert_eq!(
            s["properties"]["open"]["additionalProperties"], true,
            "its own say"
        );
        assert_eq!(s["$defs"]["p"]["additionalProperties"], false);
        assert_eq!(s["anyOf"][0]["additionalProperties"], false);
        assert!(s["allOf"][0].get("additionalProperties").is_none());
    }

    #[test]
    fn choices_become_one_escaped_alternation() {
        assert_eq!(regex_escape("a.b*(c)"), r"a\.b\*\(c\)");
        let g = Format::Choice(vec!["yes".into(), "no (maybe)".into()]).grammar();
        let text = serde_json::to_string(&g).unwrap();
        assert!(text.contains(r"(yes|no \\(maybe\\))"), "{text}");
    }
}
