//! Output parser that finds the JSON in a model's answer, repairs the faults small models make,
//! and validates it against the request's JSON Schema.
//!
//! Finding: the first fenced code block that holds JSON, else the first `{` or `[` in the text;
//! the value ends where its brackets balance (strings and escapes respected).
//! Repairs (each one reported): single-quoted strings, unquoted keys, Python literals
//! (`True`/`False`/`None`), trailing commas, and brackets left open when generation stopped.
//! Validation: full JSON Schema (drafts 4 to 2020-12) through the `jsonschema` crate, which
//! builds for `wasm32-wasip2` without its network features; remote `$ref`s are not fetched.

mod repair;

use guest_sdk::output_parser::{error, Guest, Parsed, PluginError};

struct Plugin;

impl Guest for Plugin {
    fn parse(text: String, schema: Option<String>) -> Result<Parsed, PluginError> {
        parse(&text, schema.as_deref())
    }
}

guest_sdk::export_output_parser!(Plugin);

/// The parser's logic; it needs no host imports, so it runs natively as is.
pub fn parse(text: &str, schema: Option<&str>) -> Result<Parsed, PluginError> {
    let candidate = repair::locate(text)
        .ok_or_else(|| error("no-json", "the output contains no JSON object or array"))?;
    let (json, repairs) = repair::repair(candidate);
    let value: serde_json::Value = serde_json::from_str(&json).map_err(|e| {
        error(
            "invalid-json",
            format!("the output is not valid JSON even after repair: {e}"),
        )
    })?;
    if let Some(schema) = schema {
        let schema: serde_json::Value = serde_json::from_str(schema).map_err(|e| {
            error(
                "invalid-schema",
                format!("the JSON Schema does not parse: {e}"),
            )
        })?;
        let validator = jsonschema::validator_for(&schema)
            .map_err(|e| error("invalid-schema", format!("the JSON Schema is invalid: {e}")))?;
        let problems: Vec<String> = validator
            .iter_errors(&value)
            .take(5)
            .map(|e| format!("at '{}': {}", e.instance_path, e))
            .collect();
        if !problems.is_empty() {
            return Err(error("schema-mismatch", problems.join("; ")));
        }
    }
    Ok(Parsed { json, repairs })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prose_fence_and_faults() {
        let text = "Sure! Here it is:\n```json\n{name: 'Ada', 'tags': ['vip',], active: True,}\n```\nAnything else?";
        let parsed = parse(text, None).unwrap();
        let value: serde_json::Value = serde_json::from_str(&parsed.json).unwrap();
        assert_eq!(
            value,
            serde_json::json!({"name": "Ada", "tags": ["vip"], "active": true})
        );
        assert_eq!(
            parsed.repairs,
            [
                "quoted 2 keys",
                "converted 3 single-quoted strings",
                "replaced 1 Python literals",
                "removed 2 trailing commas"
            ]
        );
    }

    #[test]
    fn truncated_output_is_closed() {
        let parsed = parse(r#"{"a": [1, 2, {"b": "unterminated"#, None).unwrap();
        assert_eq!(parsed.json, r#"{"a": [1, 2, {"b": "unterminated"}]}"#);
        assert_eq!(
            parsed.repairs,
            ["closed an unterminated string", "closed 3 open brackets"]
        );
    }

    #[test]
    fn half_written_members_are_finished_or_dropped() {
        let parsed = parse("{\n  \"name\": \"Ada\",\n  \"city\"", None).unwrap();
        assert_eq!(parsed.json, "{\n  \"name\": \"Ada\"}");
        assert_eq!(
            parsed.repairs,
            ["dropped a key without a value", "closed 1 open brackets"]
        );
        let parsed = parse(r#"{"a": {"b": 1, "c":"#, None).unwrap();
        assert_eq!(parsed.json, r#"{"a": {"b": 1, "c":null}}"#);
        let parsed = parse(r#"{"only"#, None).unwrap();
        assert_eq!(parsed.json, "{}");
        // In an array a lone string is a value, not a key.
        assert_eq!(parse(r#"["a", "b"#, None).unwrap().json, r#"["a", "b"]"#);
    }

    #[test]
    fn schema_is_enforced() {
        let schema = r#"{"type":"object","required":["email"],"properties":{"email":{"type":"string"},"age":{"type":"integer"}}}"#;
        assert!(parse(r#"{"email": "a@b.c", "age": 3}"#, Some(schema)).is_ok());
        let err = parse(r#"{"age": "three"}"#, Some(schema)).unwrap_err();
        assert_eq!(err.code, "schema-mismatch");
        assert!(
            err.message.contains("email") && err.message.contains("/age"),
            "{}",
            err.message
        );
    }

    #[test]
    fn no_json_is_reported() {
        assert_eq!(
            parse("I cannot help with that.", None).unwrap_err().code,
            "no-json"
        );
    }

    #[test]
    fn strings_keep_brackets_and_quotes() {
        let parsed = parse(
            r#"x {"q": "it's {not} [a] bracket", "n": 1} trailing {"#,
            None,
        )
        .unwrap();
        assert_eq!(parsed.json, r#"{"q": "it's {not} [a] bracket", "n": 1}"#);
        assert!(parsed.repairs.is_empty());
    }
}
