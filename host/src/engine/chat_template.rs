//! The model's own chat template (Jinja, from GGUF `tokenizer.chat_template` or
//! `tokenizer_config.json`), rendered with minijinja.

use minijinja::{context, Environment, ErrorKind};
use serde::Serialize;

/// Who speaks a turn. OpenAI's `developer` is the newer name of `system`.
#[derive(Debug, Clone, Copy, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
    Tool,
}

impl Role {
    pub fn parse(name: &str) -> Option<Role> {
        match name {
            "system" | "developer" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            "tool" => Some(Role::Tool),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
            Role::Tool => "tool",
        }
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// An assistant turn's calls, as templates with a tools branch read them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool turn: the call it answers.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: Role, content: impl Into<String>) -> Self {
        Self {
            role,
            content: content.into(),
            name: None,
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// One past call in OpenAI's shape, arguments as an object (HF templates write them with
/// `tojson`).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: serde_json::Value,
}

impl ToolCall {
    pub fn new(id: String, name: String, arguments: serde_json::Value) -> Self {
        Self {
            id,
            kind: "function",
            function: FunctionCall { name, arguments },
        }
    }
}

#[derive(Clone)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos: String,
    eos: String,
    /// False for a model with no template (a base model): chat requests are refused.
    present: bool,
    /// The template reads `tools` (it has its own way of offering tools and writing calls).
    tools: bool,
}

/// Used when a model ships no template but its vocabulary has ChatML's tokens (most small
/// instruction-tuned models), or when configured as `chat_template = "chatml"`.
pub const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

impl ChatTemplate {
    /// `source` `None`: no template; `render` fails and `is_present` says false.
    pub fn new(source: Option<String>, bos: String, eos: String) -> Result<Self, minijinja::Error> {
        let mut env = Environment::new();
        // Templates written for Python Jinja call str methods like .strip() and .startswith().
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
            },
        );
        let present = source.is_some();
        let source = source.unwrap_or_default();
        let tools = source.contains("tools");
        env.add_template_owned("chat", source)?;
        Ok(Self {
            env,
            bos,
            eos,
            present,
            tools,
        })
    }

    /// The same template variables with another template source.
    pub fn with_source(&self, source: String) -> Result<Self, minijinja::Error> {
        Self::new(Some(source), self.bos.clone(), self.eos.clone())
    }

    pub fn is_present(&self) -> bool {
        self.present
    }

    pub fn handles_tools(&self) -> bool {
        self.tools
    }

    /// `tools`: the tool definitions (OpenAI's shape), for a template that handles them.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        tools: Option<&[serde_json::Value]>,
    ) -> Result<String, minijinja::Error> {
        if !self.present {
            return Err(minijinja::Error::new(
                ErrorKind::TemplateNotFound,
                "the model has no chat template",
            ));
        }
        self.env.get_template("chat")?.render(context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos,
            eos_token => self.eos,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage::new(Role::parse(role).unwrap(), content)
    }

    #[test]
    fn chatml_default_with_generation_prompt() {
        let none = ChatTemplate::new(None, "<s>".into(), "</s>".into()).unwrap();
        assert!(!none.is_present());
        assert!(none.render(&[msg("user", "Hi")], true, None).is_err());
        let t = none.with_source(CHATML.into()).unwrap();
        assert!(t.is_present());
        let out = t.render(&[msg("user", "Hi")], true, None).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t.render(&[msg("user", "Hi")], false, None).unwrap();
        assert_eq!(out, "<|im_start|>user\nHi<|im_end|>\n");
    }

    #[test]
    fn python_style_methods_bos_and_exceptions() {
        let src = "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system') }}{% endif %}[{{ m.content.strip() }}]{% endfor %}";
        let t = ChatTemplate::new(Some(src.into()), "<s>".into(), "</s>".into()).unwrap();
        assert_eq!(
            t.render(&[msg("user", "  x ")], true, None).unwrap(),
            "<s>[x]"
        );
        let err = t.render(&[msg("system", "x")], true, None).unwrap_err();
        assert!(err.to_string().contains("no system"));
    }
}
