//! Turning OpenAI request fields into engine requests, with a precise 400 for each bad field.
//! Handlers never look at raw fields again after this.

use std::sync::Arc;

use crate::engine::{Engine, GenerationRequest, SamplingParams};

use super::openai::SamplingFields;
use super::Error;

pub const MAX_N: usize = 16;
pub const MAX_STOP: usize = 16;
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Everything but the prompt and `max_tokens`, shared by the n choices of each prompt.
#[derive(Clone)]
pub struct Generation {
    pub sampling: SamplingParams,
    pub n: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    pub speculative: bool,
    pub stream: bool,
    pub include_usage: bool,
    pub max_tokens: Option<usize>,
    /// Prefix-cache namespace: the tenant's, so no tenant ever reuses (or times) another's KV.
    pub cache_salt: u64,
    /// The tenant's fair-queuing weight.
    pub weight: u32,
    /// The grammar every choice must follow (`response_format`, guided decoding, tool calls).
    pub constraint: Option<crate::engine::constraint::Constraint>,
}

fn range(
    param: &'static str,
    v: Option<f32>,
    lo: f32,
    hi: f32,
    default: f32,
) -> Result<f32, Error> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && x >= lo && x <= hi => Ok(x),
        Some(x) => Err(Error::invalid(
            param,
            format!("`{param}` must be between {lo} and {hi}, got {x}."),
        )),
    }
}

/// `logit_bias` as (token id, bias) pairs: keys are token ids, values within [-100, 100].
fn logit_bias(
    bias: Option<&std::collections::HashMap<String, f32>>,
) -> Result<Vec<(u32, f32)>, Error> {
    let mut logit_bias = Vec::new();
    for (k, &v) in bias.into_iter().flatten() {
        let id = k.parse::<u32>().map_err(|_| {
            Error::invalid(
                "logit_bias",
                format!("`logit_bias` keys are token ids; {k:?} is not one."),
            )
        })?;
        if !(-100.0..=100.0).contains(&v) {
            return Err(Error::invalid(
                "logit_bias",
                format!(
                    "`logit_bias` values must be between -100 and 100, got {v} for token {id}."
                ),
            ));
        }
        logit_bias.push((id, v));
    }
    Ok(logit_bias)
}

pub fn generation(
    f: SamplingFields,
    max_tokens: Option<usize>,
    logprobs: Option<usize>,
) -> Result<Generation, Error> {
    let top_p = range("top_p", f.top_p, 0.0, 1.0, 1.0)?;
    if top_p == 0.0 {
        return Err(Error::invalid("top_p", "`top_p` must be greater than 0."));
    }
    let top_k = match f.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(Error::invalid(
                "top_k",
                format!("`top_k` must be -1 (off) or positive, got {k}."),
            ))
        }
    };
    let repetition_penalty = range("repetition_penalty", f.repetition_penalty, 0.01, 10.0, 1.0)?;
    let n = f.n.unwrap_or(1);
    if !(1..=MAX_N).contains(&n) {
        return Err(Error::invalid(
            "n",
            format!("`n` must be between 1 and {MAX_N}, got {n}."),
        ));
    }
    let stop = f.stop.map(|s| s.into_vec()).unwrap_or_default();
    if stop.len() > MAX_STOP {
        return Err(Error::invalid(
            "stop",
            format!(
                "At most {MAX_STOP} stop sequences are allowed, got {}.",
                stop.len()
            ),
        ));
    }
    if max_tokens == Some(0) {
        return Err(Error::invalid(
            "max_tokens",
            "`max_tokens` must be at least 1.",
        ));
    }
    let logit_bias = logit_bias(f.logit_bias.as_ref())?;
    if f.stream_options.is_some() && !f.stream {
        return Err(Error::invalid(
            "stream_options",
            "`stream_options` is only allowed when `stream` is true.",
        ));
    }
    Ok(Generation {
        sampling: SamplingParams {
            temperature: range("temperature", f.temperature, 0.0, 2.0, 1.0)?,
            top_p,
            top_k,
            min_p: range("min_p", f.min_p, 0.0, 1.0, 0.0)?,
            presence_penalty: range("presence_penalty", f.presence_penalty, -2.0, 2.0, 0.0)?,
            frequency_penalty: range("frequency_penalty", f.frequency_penalty, -2.0, 2.0, 0.0)?,
            repetition_penalty,
            seed: f.seed.map(|s| s as u64),
            logprobs,
            logit_bias,
        },
        n,
        stop,
        stop_token_ids: f.stop_token_ids.unwrap_or_default(),
        ignore_eos: f.ignore_eos,
        speculative: f.speculative.unwrap_or(true),
        stream: f.stream,
        include_usage: f.stream_options.is_some_and(|o| o.include_usage),
        max_tokens,
        cache_salt: 0,
        weight: 1,
        constraint: None,
    })
}

impl Generation {
    /// The engine requests for one prompt: one per choice, seeds offset so choices differ but
    /// stay reproducible. Fails when the prompt and completion cannot fit the context window.
    pub fn requests(
        &self,
        engine: &Engine,
        prompt: Vec<u32>,
        param: &'static str,
    ) -> Result<Vec<GenerationRequest>, Error> {
        let limit = engine.info.max_model_len;
        // Ids index the embedding and the logits, so the model's vocabulary is the bound.
        let vocab = engine.info.vocab_size as u32;
        if prompt.is_empty() {
            return Err(Error::invalid(param, "The prompt is empty."));
        }
        if let Some(bad) = prompt
            .iter()
            .chain(&self.stop_token_ids)
            .find(|&&t| t >= vocab)
        {
            return Err(Error::invalid(
                param,
                format!("Token id {bad} is outside the vocabulary (size {vocab})."),
            ));
        }
        if let Some((bad, _)) = self.sampling.logit_bias.iter().find(|(t, _)| *t >= vocab) {
            return Err(Error::invalid(
                "logit_bias",
                format!("`logit_bias` names token {bad}, outside the vocabulary (size {vocab})."),
            ));
        }
        let max_tokens = match self.max_tokens {
            Some(m) if m > limit.saturating_sub(prompt.len()) => {
                return Err(Error::invalid(
                    param,
                    format!(
                        "This model's maximum context length is {limit} tokens. However, you requested {} tokens \
                         ({} in the prompt, {m} for the completion). Please reduce the prompt or `max_tokens`.",
                        prompt.len().saturating_add(m),
                        prompt.len()
                    ),
                ))
            }
            Some(m) => m,
            None if prompt.len() >= limit => {
                return Err(Error::invalid(
                    param,
                    format!("This model's maximum context length is {limit} tokens, and the prompt has {}. Please shorten it.", prompt.len()),
                ))
            }
            None => limit - prompt.len(),
        };
        Ok((0..self.n)
            .map(|i| {
                let mut sampling = self.sampling.clone();
                sampling.seed = sampling.seed.map(|s| s.wrapping_add(i as u64));
                GenerationRequest {
                    prompt: prompt.clone(),
                    sampling,
                    max_tokens,
                    stop: self.stop.clone(),
                    stop_token_ids: self.stop_token_ids.clone(),
                    ignore_eos: self.ignore_eos,
                    cache_salt: self.cache_salt,
                    weight: self.weight,
                    speculative: self.speculative,
                    constraint: self.constraint.clone(),
                    processor: None,
                }
            })
            .collect())
    }
}

/// Tokenizes on the blocking pool: a multi-megabyte prompt takes long enough to stall the
/// runtime's I/O threads. A text the tokenizer refuses is `param`'s 400.
pub async fn encode(
    engine: &Arc<Engine>,
    texts: Vec<String>,
    add_bos: bool,
    param: &'static str,
) -> Result<Vec<Vec<u32>>, Error> {
    let engine = engine.clone();
    super::blocking("tokenizer", move || {
        texts
            .iter()
            .map(|t| engine.encode(t, add_bos))
            .collect::<Result<Vec<_>, _>>()
    })
    .await?
    .map_err(|e| Error::invalid(param, e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(v: serde_json::Value) -> SamplingFields {
        serde_json::from_value(v).unwrap()
    }

    fn refused(v: serde_json::Value, max_tokens: Option<usize>) -> Error {
        match generation(fields(v), max_tokens, None) {
            Err(e) => e,
            Ok(_) => panic!("accepted"),
        }
    }

    #[test]
    fn defaults_are_openai_defaults() {
        let g = generation(fields(serde_json::json!({})), None, None).unwrap();
        assert_eq!(g.sampling.temperature, 1.0);
        assert_eq!(g.sampling.top_p, 1.0);
        assert_eq!(
            (g.n, g.stream, g.include_usage, g.speculative),
            (1, false, false, true)
        );
    }

    #[test]
    fn each_bad_field_is_named() {
        use serde_json::json;
        let cases = [
            (json!({"top_p": 0.0}), None, "top_p"),
            (json!({"temperature": 2.5}), None, "temperature"),
            (json!({"top_k": -2}), None, "top_k"),
            (json!({"n": 17}), None, "n"),
            (json!({"stop": vec!["x"; 17]}), None, "stop"),
            (json!({"logit_bias": {"abc": 1.0}}), None, "logit_bias"),
            (json!({"logit_bias": {"5": 101.0}}), None, "logit_bias"),
            (
                json!({"stream_options": {"include_usage": true}}),
                None,
                "stream_options",
            ),
            (json!({}), Some(0), "max_tokens"),
            (json!({"presence_penalty": -3.0}), None, "presence_penalty"),
        ];
        for (v, max_tokens, param) in cases {
            match refused(v.clone(), max_tokens) {
                Error::Invalid { param: p, message } => assert_eq!(p, param, "{v}: {message}"),
                other => panic!("{v}: {other}"),
            }
        }
    }
}
