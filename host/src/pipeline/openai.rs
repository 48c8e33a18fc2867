//! OpenAI API request and response shapes (the subset the gateway serves), plus the extension
//! fields vLLM also accepts (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`,
//! `stop_token_ids`, structured outputs). Unknown fields are ignored, as the OpenAI API does.

use serde::{Deserialize, Serialize};

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany<T> {
    One(T),
    Many(Vec<T>),
}

impl<T> OneOrMany<T> {
    pub fn into_vec(self) -> Vec<T> {
        match self {
            OneOrMany::One(x) => vec![x],
            OneOrMany::Many(v) => v,
        }
    }
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling fields shared by both endpoints.
#[derive(Debug, Default, Deserialize)]
pub struct SamplingFields {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub seed: Option<i64>,
    pub n: Option<usize>,
    pub stop: Option<OneOrMany<String>>,
    pub stop_token_ids: Option<Vec<u32>>,
    /// Token id (as a string, as OpenAI sends it) to a bias in [-100, 100].
    pub logit_bias: Option<std::collections::HashMap<String, f32>>,
    #[serde(default)]
    pub ignore_eos: bool,
    /// Extension: `false` turns speculative decoding off for this request.
    pub speculative: Option<bool>,
    #[serde(default)]
    pub stream: bool,
    pub stream_options: Option<StreamOptions>,
}

#[derive(Debug, Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<ChatMessageIn>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    #[serde(default)]
    pub logprobs: bool,
    pub top_logprobs: Option<usize>,
    pub response_format: Option<ResponseFormat>,
    /// Passages to ground the answer in (vLLM's extension): context chunks for the tenant's
    /// prompt-template plugin, or numbered sources in the system message.
    pub documents: Option<Vec<Document>>,
    /// Retrieval from a collection (`{"collection": ..., "top_k": ...}`), or `false` to skip
    /// the tenant's default.
    pub rag: Option<RagField>,
    pub tools: Option<Vec<ToolIn>>,
    /// `"none" | "auto" | "required"` or `{"type": "function", "function": {"name": ...}}`.
    pub tool_choice: Option<serde_json::Value>,
    pub parallel_tool_calls: Option<bool>,
    #[serde(flatten)]
    pub guided: GuidedFields,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

/// vLLM's structured-output fields, so vLLM clients work unchanged: `structured_outputs`, and
/// the older `guided_*` ones. At most one constraint per request.
#[derive(Debug, Default, Deserialize)]
pub struct GuidedFields {
    /// A schema, as an object or as JSON text.
    pub guided_json: Option<serde_json::Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    pub structured_outputs: Option<StructuredOutputs>,
}

#[derive(Debug, Default, Deserialize)]
pub struct StructuredOutputs {
    pub json: Option<serde_json::Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct ToolIn {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: Option<FunctionIn>,
}

#[derive(Debug, Deserialize)]
pub struct FunctionIn {
    pub name: Option<String>,
    pub description: Option<String>,
    pub parameters: Option<serde_json::Value>,
    pub strict: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct ToolCallIn {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: Option<String>,
    pub function: FunctionCallIn,
}

#[derive(Debug, Deserialize)]
pub struct FunctionCallIn {
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
}

#[derive(Debug, Deserialize)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub schema: Option<serde_json::Value>,
    pub strict: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct Document {
    pub id: Option<String>,
    pub title: Option<String>,
    pub text: String,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    pub content: Option<MessageContent>,
    pub name: Option<String>,
    pub tool_calls: Option<Vec<ToolCallIn>>,
    pub tool_call_id: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum MessageContent {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: String,
    pub prompt: Prompt,
    pub max_tokens: Option<usize>,
    pub logprobs: Option<usize>,
    #[serde(default)]
    pub echo: bool,
    pub suffix: Option<String>,
    pub best_of: Option<usize>,
    /// vLLM accepts `response_format` on completions too.
    pub response_format: Option<ResponseFormat>,
    #[serde(flatten)]
    pub guided: GuidedFields,
    #[serde(flatten)]
    pub sampling: SamplingFields,
}

#[derive(Debug, Serialize, Clone, Copy)]
pub struct UsageOut {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub total_tokens: usize,
    pub prompt_tokens_details: CachedTokens,
}

#[derive(Debug, Serialize, Clone, Copy)]
pub struct CachedTokens {
    pub cached_tokens: usize,
}

#[derive(Debug, Serialize, Clone)]
pub struct TopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

#[derive(Debug, Serialize, Clone)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Serialize, Clone, Default)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Debug, Serialize, Clone, Default)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    pub top_logprobs: Vec<serde_json::Map<String, serde_json::Value>>,
    pub text_offset: Vec<usize>,
}

/// The chat request's `rag` field: settings, or `false` to skip the tenant's default.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum RagField {
    Enabled(bool),
    Settings(crate::search::request::RagSettings),
}
