//! {{name}}: an output parser. Takes the first JSON object in the model's text (code fences
//! and prose around it are dropped) and checks the schema's top-level `required` keys.

use guest_sdk::output_parser::{error, Guest, Parsed, PluginError};
use guest_sdk::serde_json::{self, Value};

struct Plugin;

impl Guest for Plugin {
    fn parse(text: String, schema: Option<String>) -> Result<Parsed, PluginError> {
        let start = text
            .find('{')
            .ok_or_else(|| error("no-json", "the text holds no JSON object"))?;
        let mut values = serde_json::Deserializer::from_str(&text[start..]).into_iter::<Value>();
        let value = match values.next() {
            Some(Ok(v)) => v,
            _ => return Err(error("no-json", "the JSON object in the text does not parse")),
        };
        let mut repairs = Vec::new();
        if start > 0 || values.byte_offset() + start < text.trim_end().len() {
            repairs.push("dropped text around the JSON object".to_string());
        }
        if let Some(schema) = schema {
            let schema: Value = serde_json::from_str(&schema)
                .map_err(|e| error("invalid-input", format!("the schema is not JSON: {e}")))?;
            for key in schema["required"].as_array().into_iter().flatten() {
                let key = key.as_str().unwrap_or_default();
                if value.get(key).is_none() {
                    return Err(error("schema-mismatch", format!("missing required key {key:?}")));
                }
            }
        }
        Ok(Parsed { json: value.to_string(), repairs })
    }
}

guest_sdk::export_output_parser!(Plugin);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_object_is_taken_from_prose() {
        let out = Plugin::parse("Sure! {\"intent\": \"refund\"} Hope that helps.".into(), None)
            .unwrap();
        assert_eq!(out.json, r#"{"intent":"refund"}"#);
        assert_eq!(out.repairs.len(), 1);
        let err = Plugin::parse("{}".into(), Some(r#"{"required": ["intent"]}"#.into()));
        assert_eq!(err.unwrap_err().code, "schema-mismatch");
    }
}
