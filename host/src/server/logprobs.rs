//! Token log-probabilities in each endpoint's response shape: chat's `logprobs.content`
//! (token, bytes, top alternatives) and completions' parallel arrays with text offsets.

use serde_json::{json, Value};
use tokenizers::Tokenizer;

use crate::engine::tokenizer::token_bytes;
use crate::engine::TokenLogprobs;
use crate::pipeline::openai::{ChatTokenLogprob, CompletionLogprobs, TopLogprob};

fn token_str(tok: &Tokenizer, id: u32) -> String {
    tok.decode(&[id], false).unwrap_or_default()
}

/// Chat's `logprobs`: `{"content": [...]}`, or null for no tokens.
pub(super) fn chat(tok: &Tokenizer, tokens: &[(u32, TokenLogprobs)]) -> Value {
    if tokens.is_empty() {
        return Value::Null;
    }
    let top = |(id, lp): &(u32, f32)| TopLogprob {
        bytes: token_bytes(tok, *id),
        token: token_str(tok, *id),
        logprob: *lp,
    };
    let content: Vec<ChatTokenLogprob> = tokens
        .iter()
        .map(|(id, l)| ChatTokenLogprob {
            bytes: token_bytes(tok, *id),
            token: token_str(tok, *id),
            logprob: l.logprob,
            top_logprobs: l.top.iter().map(top).collect(),
        })
        .collect();
    json!({ "content": content })
}

/// Completions' `logprobs`; `text_start` is where these tokens' text ends in the choice's
/// text so far (their offsets count back from it). Null for no tokens.
pub(super) fn completion(
    tok: &Tokenizer,
    tokens: &[(u32, TokenLogprobs)],
    text_start: usize,
) -> Value {
    if tokens.is_empty() {
        return Value::Null;
    }
    let mut out = CompletionLogprobs::default();
    let len: usize = tokens.iter().map(|(id, _)| token_str(tok, *id).len()).sum();
    let mut offset = text_start.saturating_sub(len);
    for (id, l) in tokens {
        let t = token_str(tok, *id);
        out.text_offset.push(offset);
        offset += t.len();
        out.tokens.push(t);
        out.token_logprobs.push(l.logprob);
        out.top_logprobs.push(
            l.top
                .iter()
                .map(|(tid, lp)| (token_str(tok, *tid), json!(lp)))
                .collect(),
        );
    }
    serde_json::to_value(out).expect("plain struct")
}
