//! An output parser that claims success but returns text that is not JSON, for the gateway's
//! test that the host validates what plugins return.

use guest_sdk::output_parser::{Guest, Parsed, PluginError};

struct Plugin;

impl Guest for Plugin {
    fn parse(text: String, _schema: Option<String>) -> Result<Parsed, PluginError> {
        Ok(Parsed {
            json: format!("{{not json: {}", text.len()),
            repairs: Vec::new(),
        })
    }
}

guest_sdk::export_output_parser!(Plugin);
