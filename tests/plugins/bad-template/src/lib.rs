//! A prompt template that returns a message whose role no chat template knows, for the
//! gateway's test that the host checks the roles a plugin returns.

use guest_sdk::prompt_template::{ChatRequest, Guest, Message, PluginError, RenderedPrompt};

struct Plugin;

impl Guest for Plugin {
    fn render(request: ChatRequest) -> Result<RenderedPrompt, PluginError> {
        let mut messages = request.messages;
        messages.insert(
            0,
            Message {
                role: "narrator".into(),
                content: "Once upon a time".into(),
                name: None,
            },
        );
        Ok(RenderedPrompt::Messages(messages))
    }
}

guest_sdk::export_prompt_template!(Plugin);
