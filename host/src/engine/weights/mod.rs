//! Loading a llama-family model from a GGUF file (`gguf.rs`: weights stay quantized and
//! memory-mapped) or from an HF folder (`hf.rs`: config.json + *.safetensors + tokenizer.json),
//! together with its tokenizer, chat template and stop tokens.

mod gguf;
mod hf;

use std::path::Path;

use tokenizers::Tokenizer;

use super::chat_template::ChatTemplate;
use super::model::Model;
use super::ModelError;

/// Everything the engine and the prompt stage need from one model directory or file.
pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub template: ChatTemplate,
    /// Tokens that end generation (the model's eos plus its end-of-turn tokens).
    pub stop_ids: Vec<u32>,
    pub bos: Option<u32>,
    pub add_bos: bool,
}

/// End-of-turn tokens of common chat formats; any present in the vocabulary stop generation.
const END_OF_TURN: &[&str] = &[
    "<|im_end|>",
    "<|endoftext|>",
    "<|eot_id|>",
    "<|end|>",
    "</s>",
    "<end_of_turn>",
];

pub fn load(path: &Path) -> Result<LoadedModel, ModelError> {
    if path.is_dir() {
        hf::load(path)
    } else if path.extension().is_some_and(|e| e == "gguf") {
        gguf::load(path)
    } else if path.exists() {
        Err(ModelError::Format(format!(
            "{}: expected a .gguf file or a folder with config.json, *.safetensors and tokenizer.json",
            path.display()
        )))
    } else {
        Err(ModelError::NotFound(path.into()))
    }
}

fn stop_ids(tok: &Tokenizer, eos: &[u32]) -> Vec<u32> {
    let mut ids = eos.to_vec();
    ids.extend(END_OF_TURN.iter().filter_map(|t| tok.token_to_id(t)));
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// The model's template; without one, ChatML when the vocabulary has its tokens, else none.
fn chat_template(
    source: Option<String>,
    tok: &Tokenizer,
    bos: String,
    eos: String,
) -> Result<ChatTemplate, ModelError> {
    let chatml =
        tok.token_to_id("<|im_start|>").is_some() && tok.token_to_id("<|im_end|>").is_some();
    let source = source.or_else(|| chatml.then(|| super::chat_template::CHATML.to_string()));
    Ok(ChatTemplate::new(source, bos, eos)?)
}
