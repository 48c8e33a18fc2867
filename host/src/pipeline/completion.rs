//! `/v1/completions` on a local model: the body's checks, tokenization of each prompt (the
//! exact window check), the reservation, the logits processors, one engine request per choice.
//! An upstream model takes the request as written (`upstream::passthrough`).

use std::sync::Arc;

use serde::Deserialize;
use serde_json::Value;

use super::generation::{self, encode, Generation};
use super::openai::{CompletionRequest, Prompt};
use super::{constraint, Error, Stages};
use crate::common::Endpoint;
use crate::engine::{Engine, EventStream, GenerationRequest};
use crate::tenancy::{Caller, Outcome, Reservation};

/// Completion's own cap on `logprobs` (OpenAI's).
const MAX_LOGPROBS: usize = 5;

/// A local completion under way: what the edge needs to answer from its streams.
pub struct CompletionRun {
    pub engine: Arc<Engine>,
    pub streams: Vec<EventStream>,
    pub gen: Generation,
    /// `echo`: each prompt's text, put in front of its choices' text.
    pub echo: Option<Vec<String>>,
    pub reservation: Reservation,
}

pub async fn run(
    stages: &Stages,
    caller: &Caller,
    engine: &Arc<Engine>,
    body: &Value,
) -> Result<CompletionRun, Error> {
    let req = CompletionRequest::deserialize(body)?;
    check(&req)?;
    let mut gen = generation::generation(
        req.sampling,
        Some(req.max_tokens.unwrap_or(16)),
        req.logprobs,
    )?;
    gen.cache_salt = caller.tenant.cache_salt;
    gen.weight = caller.tenant.policy.weight;
    let format = constraint::format(req.response_format.as_ref(), req.guided)?;
    gen.constraint = constraint::constraint(engine, format, None).await?;
    // Echo gives back the prompt as sent: the text itself, or the decoded token ids.
    let (prompts, texts): (Vec<Vec<u32>>, Option<Vec<String>>) = match req.prompt {
        Prompt::Text(t) => (
            encode(engine, vec![t.clone()], true, "prompt").await?,
            Some(vec![t]),
        ),
        Prompt::Texts(ts) => (encode(engine, ts.clone(), true, "prompt").await?, Some(ts)),
        Prompt::Tokens(ids) => (vec![ids], None),
        Prompt::TokenLists(l) => (l, None),
    };
    if prompts.is_empty() {
        return Err(Error::invalid("prompt", "`prompt` must not be empty."));
    }
    let echo = req.echo.then(|| {
        texts.unwrap_or_else(|| {
            prompts
                .iter()
                .map(|p| engine.tokenizer.decode(p, false).unwrap_or_default())
                .collect()
        })
    });
    let mut reqs = prompts
        .into_iter()
        .map(|p| gen.requests(engine, p, "prompt"))
        .collect::<Result<Vec<_>, _>>()?;
    let reservation = reserve(stages, caller, &engine.info.name, &reqs).await?;
    let submitted = async {
        for choices in reqs.iter_mut() {
            stages
                .processors
                .attach(caller, &engine.info.name, engine, choices)
                .await?;
        }
        submit(engine, reqs)
    };
    match submitted.await {
        Ok(streams) => Ok(CompletionRun {
            engine: engine.clone(),
            streams,
            gen,
            echo,
            reservation,
        }),
        Err(e) => {
            reservation.end(Outcome::Failed);
            Err(e)
        }
    }
}

/// The fields this server does not serve, or not in this combination.
fn check(req: &CompletionRequest) -> Result<(), Error> {
    if req.suffix.is_some() {
        return Err(Error::invalid(
            "suffix",
            "`suffix` is not supported by this model.",
        ));
    }
    if req
        .best_of
        .is_some_and(|b| b != req.sampling.n.unwrap_or(1))
    {
        return Err(Error::invalid(
            "best_of",
            "`best_of` different from `n` is not supported.",
        ));
    }
    if let Some(k) = req.logprobs.filter(|&k| k > MAX_LOGPROBS) {
        return Err(Error::invalid(
            "logprobs",
            format!("`logprobs` must be at most {MAX_LOGPROBS}, got {k}."),
        ));
    }
    if req.echo && req.logprobs.is_some() {
        return Err(Error::invalid(
            "echo",
            "`echo` together with `logprobs` is not supported.",
        ));
    }
    Ok(())
}

/// Reserves the tokens these requests may use: each prompt once (its choices share it) and
/// every choice's `max_tokens`.
async fn reserve(
    stages: &Stages,
    caller: &Caller,
    model: &str,
    per_prompt: &[Vec<GenerationRequest>],
) -> Result<Reservation, Error> {
    let prompt: u64 = per_prompt
        .iter()
        .filter_map(|c| c.first())
        .map(|r| r.prompt.len() as u64)
        .sum();
    let completion: u64 = per_prompt
        .iter()
        .flatten()
        .map(|r| r.max_tokens as u64)
        .sum();
    stages
        .tenancy
        .reserve_tokens(
            caller,
            model,
            Endpoint::Completions,
            prompt,
            prompt + completion,
        )
        .await
        .map_err(Error::Denied)
}

/// Submits every choice of every prompt, in choice-index order. Nothing is left running if one
/// submission fails: the streams already made are dropped, which cancels them.
fn submit(
    engine: &Engine,
    per_prompt: Vec<Vec<GenerationRequest>>,
) -> Result<Vec<EventStream>, Error> {
    per_prompt
        .into_iter()
        .flatten()
        .map(|r| engine.submit(r).map_err(Error::from))
        .collect()
}
