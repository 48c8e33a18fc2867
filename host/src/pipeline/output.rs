//! The output stage: the tenant's output parser over each choice's final text (local or
//! upstream), with the schema the request asked for.

use std::sync::Arc;

use super::{Error, PluginCalls};
use crate::plugins::{Parsed, Plugin};
use crate::tenancy::Caller;

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
