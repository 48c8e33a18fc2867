//! `/v1/embeddings` on a local encoder: the body's checks (input forms, `encoding_format`,
//! `dimensions`), tokenization, the reservation of the prompt tokens, the encoder on the
//! blocking pool. An upstream model takes the request as written (`upstream::passthrough`).

use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;

use super::openai::Prompt;
use super::Error;
use crate::common::Endpoint;
use crate::search::embedder::Embedder;
use crate::tenancy::{Caller, Outcome, Tenancy};

/// OpenAI's own cap on inputs per request.
const MAX_INPUTS: usize = 2048;

#[derive(Deserialize)]
struct EmbeddingRequest {
    input: Prompt,
    encoding_format: Option<String>,
    dimensions: Option<usize>,
}

pub struct Embedded {
    pub vectors: Vec<Vec<f32>>,
    pub prompt_tokens: u64,
    /// `encoding_format: base64`: each vector as its little-endian f32 bytes in base64.
    pub base64: bool,
}

pub async fn run(
    tenancy: &Arc<Tenancy>,
    caller: &Caller,
    embedder: &Arc<Embedder>,
    body: &Value,
) -> Result<Embedded, Error> {
    let req = EmbeddingRequest::deserialize(body)?;
    let base64 = match req.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(other) => {
            return Err(Error::invalid(
                "encoding_format",
                format!("`encoding_format` must be `float` or `base64`, got {other:?}."),
            ))
        }
    };
    if let Some(d) = req.dimensions.filter(|&d| d != embedder.dim) {
        return Err(Error::invalid(
            "dimensions",
            format!("Model `{}` produces {}-dimensional embeddings and cannot shorten them to {d}; leave out `dimensions`.", embedder.name, embedder.dim),
        ));
    }
    let ids = match inputs(req.input)? {
        Inputs::Texts(ts) => {
            let e = embedder.clone();
            super::blocking("tokenizer", move || e.tokenize(&ts))
                .await?
                .map_err(|e| Error::invalid("input", e.to_string()))?
        }
        Inputs::Tokens(ids) => ids,
    };
    let prompt_tokens: u64 = ids.iter().map(|i| i.len() as u64).sum();
    let reservation = tenancy
        .reserve_tokens(
            caller,
            &embedder.name,
            Endpoint::Embeddings,
            prompt_tokens,
            prompt_tokens,
        )
        .await
        .map_err(Error::Denied)?;
    let e = embedder.clone();
    let vectors = super::blocking("embedding", move || e.embed(&ids)).await?;
    let vectors = vectors.inspect_err(|_| reservation.end(Outcome::Failed))?;
    reservation.settle(prompt_tokens, 0, Outcome::Ok);
    Ok(Embedded {
        vectors,
        prompt_tokens,
        base64,
    })
}

/// Texts to tokenize, or token lists as given.
enum Inputs {
    Texts(Vec<String>),
    Tokens(Vec<Vec<u32>>),
}

/// The texts or token lists of `input`, each non-empty, 1 to `MAX_INPUTS` of them.
fn inputs(input: Prompt) -> Result<Inputs, Error> {
    let inputs = match input {
        Prompt::Text(t) => Inputs::Texts(vec![t]),
        Prompt::Texts(ts) => Inputs::Texts(ts),
        Prompt::Tokens(ids) => Inputs::Tokens(vec![ids]),
        Prompt::TokenLists(l) => Inputs::Tokens(l),
    };
    let (n, empty) = match &inputs {
        Inputs::Texts(ts) => (ts.len(), ts.iter().any(|t| t.is_empty())),
        Inputs::Tokens(l) => (l.len(), l.iter().any(Vec::is_empty)),
    };
    if n == 0 || n > MAX_INPUTS {
        return Err(Error::invalid(
            "input",
            format!("`input` must hold 1 to {MAX_INPUTS} items."),
        ));
    }
    if empty {
        return Err(Error::invalid(
            "input",
            "`input` must not contain empty strings or empty token arrays.",
        ));
    }
    Ok(inputs)
}
