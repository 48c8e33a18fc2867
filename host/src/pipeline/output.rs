//! The output stage: the tenant's output parser over each choice's final text (local or
//! upstream), with the schema the request asked for.

use std::sync::Arc;

use super::openai::ResponseFormat;
use super::{Error, PluginCalls};
use crate::plugins::{Parsed, Plugin, PluginKind};
use crate::tenancy::Caller;

#[derive(Clone)]
pub struct OutputStage {
    pub calls: PluginCalls,
    pub caller: Caller,
    pub plugin: Arc<Plugin>,
    /// The JSON schema of `response_format`, if it gave one.
    pub schema: Option<String>,
}

impl OutputStage {
    pub async fn parse(&self, text: String) -> Result<Parsed, Error> {
        let schema = self.schema.clone();
        self.calls
            .call(
                &self.caller,
                self.plugin.clone(),
                move |p, rt, v| async move { p.parse(&rt, &v, &text, schema.as_deref()).await },
            )
            .await
    }
}

/// The output parser to run, if the request asks for JSON (or the tenant always parses) and
/// the tenant has a parser bound. Without a parser, `response_format` passes through.
pub fn stage(
    calls: &PluginCalls,
    caller: &Caller,
    format: Option<&ResponseFormat>,
) -> Result<Option<OutputStage>, Error> {
    let tenant = &caller.tenant;
    let schema = match format {
        Some(ResponseFormat::JsonObject) => None,
        Some(ResponseFormat::JsonSchema { json_schema }) => match &json_schema.schema {
            Some(schema) => Some(schema.to_string()),
            None => return Err(super::constraint::schema_required()),
        },
        Some(ResponseFormat::Text) | None if tenant.policy.parse_output => None,
        Some(ResponseFormat::Text) | None => return Ok(None),
    };
    let Some(name) = &tenant.policy.output_parser else {
        return Ok(None);
    };
    Ok(Some(OutputStage {
        plugin: calls.bound(tenant, name, PluginKind::OutputParser)?,
        calls: calls.clone(),
        caller: caller.clone(),
        schema,
    }))
}
