//! The prompt stage: the conversation (and its context chunks) into the prompt text, by the
//! tenant's prompt-template plugin when one is bound, else by the model's own chat template.

use super::{grounding, Error, PluginCalls};
use crate::engine::chat_template::{ChatMessage, Role};
use crate::engine::Engine;
use crate::plugins::{ContextChunk, RenderedPrompt};
use crate::structured::tools::{self, ToolSet};
use crate::tenancy::Caller;

/// What the prompt stage needs besides the conversation.
pub struct PromptStage<'a> {
    pub engine: &'a Engine,
    pub model: &'a str,
    pub tools: Option<&'a ToolSet>,
    pub plugins: &'a PluginCalls,
}

impl PromptStage<'_> {
    /// The prompt text. A plugin may return the final text or rewritten messages, which then
    /// go through the model's template. Context chunks go to the plugin, or without one into
    /// the system message as numbered sources. Tools go through the model's template when it
    /// handles them, else into the messages in the generic format.
    pub async fn run(
        &self,
        caller: &Caller,
        messages: Vec<ChatMessage>,
        context: Vec<ContextChunk>,
    ) -> Result<String, Error> {
        let tenant = &caller.tenant;
        let native =
            tenant.policy.prompt_template.is_none() && self.engine.template.handles_tools();
        let (messages, definitions) = match native {
            true => (messages, self.tools.map(ToolSet::definitions)),
            false => (tools::generic_messages(messages, self.tools), None),
        };
        let messages = match &tenant.policy.prompt_template {
            Some(name) => {
                let rendered = self
                    .plugins
                    .render(caller, name, self.model, messages, context)
                    .await?;
                match rendered {
                    RenderedPrompt::Prompt(text) => return Ok(text),
                    RenderedPrompt::Messages(ms) => ms
                        .into_iter()
                        .map(|m| ChatMessage {
                            name: m.name,
                            // `render` refused any role outside MESSAGE_ROLES.
                            ..ChatMessage::new(
                                Role::parse(&m.role).unwrap_or(Role::User),
                                m.content,
                            )
                        })
                        .collect(),
                }
            }
            None => grounding::ground(messages, &context),
        };
        let template = &self.engine.template;
        if !template.is_present() {
            return Err(Error::invalid(
                "messages",
                "This model has no chat template (a base model): use /v1/completions, bind a \
                 prompt_template plugin, or configure chat_template for the model",
            ));
        }
        template
            .render(&messages, true, definitions.as_deref())
            .map_err(|e| {
                Error::invalid(
                    "messages",
                    format!("The model's chat template rejected the messages: {e}"),
                )
            })
    }
}
