//! {{name}}: a prompt template. Puts the tenant's persona (config `persona`) first and the
//! retrieved passages after it as numbered sources.

use guest_sdk::prompt_template::{
    config_text, error, ChatRequest, Guest, Message, PluginError, RenderedPrompt,
};

struct Plugin;

impl Guest for Plugin {
    fn render(request: ChatRequest) -> Result<RenderedPrompt, PluginError> {
        if !request.messages.iter().any(|m| m.role == "user") {
            return Err(error("invalid-input", "the conversation has no user message"));
        }
        let mut system =
            config_text("persona").unwrap_or_else(|| "You are a helpful CRM assistant.".into());
        for (i, c) in request.context.iter().enumerate() {
            system.push_str(&format!("\n\n[{}] {}", i + 1, c.text));
        }
        let mut messages = vec![Message { role: "system".into(), content: system, name: None }];
        messages.extend(request.messages.into_iter().filter(|m| m.role != "system"));
        // The gateway applies the model's own chat template to these messages.
        Ok(RenderedPrompt::Messages(messages))
    }
}

guest_sdk::export_prompt_template!(Plugin);

#[cfg(test)]
mod tests {
    use super::*;
    use guest_sdk::testing;

    #[test]
    fn the_persona_comes_first() {
        testing::reset();
        testing::set_config("persona", "You are Ada.");
        let request = ChatRequest {
            model: "m".into(),
            messages: vec![Message { role: "user".into(), content: "Hi".into(), name: None }],
            context: vec![],
        };
        let RenderedPrompt::Messages(m) = Plugin::render(request).unwrap() else {
            panic!("expected messages");
        };
        assert_eq!(m[0].content, "You are Ada.");
        assert_eq!(m[1].content, "Hi");
    }
}
