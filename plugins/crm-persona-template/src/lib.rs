//! Prompt template for CRM assistants: puts the tenant's persona first and lays retrieved
//! passages out as numbered sources the model cites as `[1]`, `[2]`, ...
//!
//! Tenant configuration:
//! - `persona`: the system prompt (default: a generic support-assistant persona);
//! - `citation_instruction`: the sentence placed before the sources.

use guest_sdk::prompt_template::{
    error, ChatRequest, ContextChunk, Guest, Message, PluginError, RenderedPrompt,
};

const DEFAULT_PERSONA: &str = "You are a helpful customer-support assistant for our CRM. \
Be concise and accurate.";
const DEFAULT_CITATION: &str =
    "Answer from the sources below and cite each one you use by its number, like [1].";

struct Plugin;

impl Guest for Plugin {
    fn render(request: ChatRequest) -> Result<RenderedPrompt, PluginError> {
        render(request, &guest_sdk::prompt_template::config_text)
    }
}

guest_sdk::export_prompt_template!(Plugin);

/// The template's logic, with configuration passed in so it also runs natively.
pub fn render(
    request: ChatRequest,
    config: &dyn Fn(&str) -> Option<String>,
) -> Result<RenderedPrompt, PluginError> {
    if !request.messages.iter().any(|m| m.role == "user") {
        return Err(error(
            "invalid-input",
            "the conversation has no user message",
        ));
    }
    let mut system = config("persona").unwrap_or_else(|| DEFAULT_PERSONA.to_string());
    // The client's own system messages refine the persona; they never replace it.
    for m in request.messages.iter().filter(|m| m.role == "system") {
        system.push_str("\n\n");
        system.push_str(&m.content);
    }
    if !request.context.is_empty() {
        system.push_str("\n\n");
        system.push_str(
            &config("citation_instruction").unwrap_or_else(|| DEFAULT_CITATION.to_string()),
        );
        system.push_str(&sources(&request.context));
    }
    let mut messages = Vec::with_capacity(request.messages.len() + 1);
    messages.push(Message {
        role: "system".into(),
        content: system,
        name: None,
    });
    messages.extend(request.messages.into_iter().filter(|m| m.role != "system"));
    Ok(RenderedPrompt::Messages(messages))
}

fn sources(context: &[ContextChunk]) -> String {
    let mut out = String::new();
    for (i, chunk) in context.iter().enumerate() {
        out.push_str(&format!("\n\n[{}] ", i + 1));
        if let Some(title) = &chunk.title {
            out.push_str(title);
            out.push_str(": ");
        }
        out.push_str(chunk.text.trim());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> Message {
        Message {
            role: role.into(),
            content: content.into(),
            name: None,
        }
    }

    #[test]
    fn persona_leads_and_sources_are_numbered() {
        let request = ChatRequest {
            model: "m".into(),
            messages: vec![
                msg("system", "Reply in French."),
                msg("user", "How do I reset?"),
            ],
            context: vec![
                ContextChunk {
                    id: "kb-1".into(),
                    text: "Hold the button.".into(),
                    title: Some("Reset".into()),
                },
                ContextChunk {
                    id: "kb-2".into(),
                    text: " Unplug it. ".into(),
                    title: None,
                },
            ],
        };
        let config = |k: &str| (k == "persona").then(|| "You are Ava.".to_string());
        let RenderedPrompt::Messages(out) = render(request, &config).unwrap() else {
            panic!("expected messages")
        };
        assert_eq!(out.len(), 2);
        assert_eq!(
            out[0].content,
            format!("You are Ava.\n\nReply in French.\n\n{DEFAULT_CITATION}\n\n[1] Reset: Hold the button.\n\n[2] Unplug it.")
        );
        assert_eq!(out[1].content, "How do I reset?");
    }

    #[test]
    fn refuses_a_conversation_without_user_turn() {
        let request = ChatRequest {
            model: "m".into(),
            messages: vec![msg("system", "x")],
            context: vec![],
        };
        assert_eq!(
            render(request, &|_| None).unwrap_err().code,
            "invalid-input"
        );
    }
}
