//! One response of the completion endpoints: collecting each choice's events into a JSON body,
//! or framing them as SSE chunks; the output-parser stage and the settlement of the tenant's
//! token reservation happen here, at the end of each choice.

use std::future::Future;
use std::sync::Arc;

use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::error::ApiError;
use super::logprobs;
use super::tool_calls;
use super::{json_response, sse_response, Response};
use crate::common::Endpoint;
use crate::engine::{Engine, Event, EventStream, FinishReason, TokenLogprobs, Usage};
use crate::pipeline::generation::Generation;
use crate::pipeline::openai::*;
use crate::pipeline::output::OutputStage;
use crate::pipeline::plugin_calls::debug_report;
use crate::pipeline::responses::Finisher;
use crate::structured::tools::ToolSet;
use crate::tenancy::{Outcome, Reservation};

mod streamed;

/// What every chunk and body of one response shares.
pub(super) struct Reply {
    kind: Endpoint,
    id: String,
    created: u64,
    model: String,
    engine: Arc<Engine>,
    n: usize,
    include_usage: bool,
    /// Completion `echo`: each prompt's text, put in front of its choices' text.
    echo: Option<Vec<String>>,
    /// Chat with structured output: the tenant's output parser runs on each choice's text.
    pub(super) output: Option<OutputStage>,
    /// The tenant's token reservation, settled with the usage reported (or, if the response
    /// never completes, with the tokens counted so far when this is dropped).
    pub(super) reservation: Option<Reservation>,
    /// Chunks retrieved for the prompt (RAG), reported with the answer.
    pub(super) citations: Option<Vec<Value>>,
    /// The request offered tools: calls are parsed out of each choice's text.
    pub(super) tools: Option<Arc<ToolSet>>,
    /// The caller asked for plugin debugging: the raw text and its plugins' log lines.
    pub(super) debug: Option<crate::common::LogSink>,
    /// A Responses request: the chat answer shaped (and stored) as a Response.
    pub(super) responses: Option<Arc<Finisher>>,
}

#[derive(Default)]
struct Choice {
    text: String,
    tokens: Vec<(u32, TokenLogprobs)>,
    finish: Option<FinishReason>,
    usage: Usage,
    /// Fixes the output parser applied, when one ran.
    repairs: Option<Vec<String>>,
    /// The model's text before the output parser, kept for a debugging caller.
    raw: Option<String>,
}

impl Reply {
    pub(super) fn new(
        kind: Endpoint,
        prefix: &str,
        model: String,
        engine: Arc<Engine>,
        gen: &Generation,
        echo: Option<Vec<String>>,
    ) -> Self {
        let created = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        Self {
            kind,
            id: format!("{prefix}-{:032x}", rand::random::<u128>()),
            created,
            model,
            engine,
            n: gen.n,
            include_usage: gen.include_usage,
            echo,
            output: None,
            reservation: None,
            citations: None,
            tools: None,
            debug: None,
            responses: None,
        }
    }

    /// Answers with the generations in `streams`, as one body or as SSE chunks. Once `cut`
    /// resolves (the drain deadline of a shutdown) the generations are dropped, which cancels
    /// them, and the response ends with a `server_shutting_down` error.
    pub(super) async fn run(
        self,
        streams: Vec<EventStream>,
        stream: bool,
        cut: impl Future<Output = ()> + Send + 'static,
    ) -> Result<Response, ApiError> {
        if stream {
            let (tx, rx) = mpsc::channel(64);
            tokio::spawn(self.stream(streams, tx, cut));
            return Ok(sse_response(rx));
        }
        let (body, outcome) = tokio::select! {
            body = self.collect(streams) => (body, Outcome::Failed),
            () = cut => (Err(ApiError::shutting_down()), Outcome::Shutdown),
        };
        if body.is_err() {
            self.end(outcome);
        }
        body
    }

    /// Settles the reservation of a request that ended early, with the tokens counted so far.
    fn end(&self, outcome: Outcome) {
        if let Some(r) = &self.reservation {
            r.end(outcome);
        }
    }

    async fn collect(&self, streams: Vec<EventStream>) -> Result<Response, ApiError> {
        let mut choices = Vec::with_capacity(streams.len());
        for mut s in streams {
            let mut c = Choice::default();
            while let Some(ev) = s.recv().await {
                match ev {
                    Event::Token { id, text, logprobs } => {
                        self.count_token();
                        c.text.push_str(&text);
                        c.tokens.extend(logprobs.map(|l| (id, l)));
                    }
                    Event::Done(u, f) => {
                        c.usage = u;
                        c.finish = Some(f);
                    }
                    Event::Failed(e) => return Err(e.into()),
                }
            }
            if c.finish.is_none() {
                return Err(ApiError::internal(
                    "The engine stopped before the generation finished.",
                ));
            }
            if let Some(out) = self.parser() {
                c.raw = self.debug.is_some().then(|| c.text.clone());
                let parsed = out
                    .parse(std::mem::take(&mut c.text))
                    .await
                    .map_err(|e| self.with_debug(e, c.raw.as_deref()))?;
                c.text = parsed.json;
                c.repairs = Some(parsed.repairs);
            }
            choices.push(c);
        }
        // Settled with the very usage the client is told, typed, not read back from the body.
        let usage = self.usage(choices.iter().map(|c| &c.usage).enumerate());
        if let Some(r) = &self.reservation {
            let (p, c) = (usage.prompt_tokens, usage.completion_tokens);
            r.settle(p as u64, c as u64, Outcome::Ok);
        }
        let body = self.body(choices, usage);
        let body = match &self.responses {
            Some(f) => f.body(&body).await?,
            None => body,
        };
        Ok(json_response(http::StatusCode::OK, &body))
    }

    /// The output parser, unless tools are on (calls are not the parser's JSON).
    fn parser(&self) -> Option<&OutputStage> {
        self.output.as_ref().filter(|_| self.tools.is_none())
    }

    fn body(&self, choices: Vec<Choice>, usage: UsageOut) -> Value {
        let raw: Option<Vec<Value>> = self.debug.as_ref().map(|_| {
            choices
                .iter()
                .map(|c| json!(c.raw.as_deref().unwrap_or(&c.text)))
                .collect()
        });
        let choices: Vec<Value> = choices
            .into_iter()
            .enumerate()
            .map(|(i, c)| {
                let logprobs = self.logprobs(&c.tokens, c.text.len());
                let finish = c.finish.map(FinishReason::as_str);
                match self.kind {
                    Endpoint::Chat => {
                        let (message, finish) = match (&self.tools, c.finish) {
                            (Some(t), Some(f)) => {
                                let (m, called) = tool_calls::message(&c.text, t);
                                (m, Some(tool_calls::finish_reason(f, called)))
                            }
                            _ => (json!({"role": "assistant", "content": c.text}), finish),
                        };
                        let mut choice = json!({
                            "index": i,
                            "message": message,
                            "logprobs": logprobs,
                            "finish_reason": finish,
                        });
                        if let Some(repairs) = c.repairs {
                            choice["repairs"] = json!(repairs);
                        }
                        choice
                    }
                    _ => {
                        let text = match &self.echo {
                            Some(p) => format!("{}{}", p[i / self.n], c.text),
                            None => c.text,
                        };
                        json!({"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish})
                    }
                }
            })
            .collect();
        let mut body = self.envelope(false);
        body["choices"] = Value::Array(choices);
        body["usage"] = serde_json::to_value(usage).expect("plain struct");
        if let Some(c) = &self.citations {
            body["citations"] = json!(c);
        }
        if let Some(d) = self.debug_report(raw) {
            body["gateway_debug"] = d;
        }
        body
    }

    /// What a debugging caller gets: each choice's text before the output parser (streams
    /// carry it in their deltas) and the log lines of the request's plugins so far.
    fn debug_report(&self, raw: Option<Vec<Value>>) -> Option<Value> {
        Some(debug_report(self.debug.as_ref()?, raw))
    }

    /// A plugin failure, with the debugging report when the caller asked for one: a parser
    /// refusing the text is when its raw text matters most.
    fn with_debug(&self, e: impl Into<ApiError>, raw: Option<&str>) -> ApiError {
        let mut e = e.into();
        e.debug = self.debug_report(raw.map(|r| vec![json!(r)])).map(Box::new);
        e
    }

    fn envelope(&self, chunk: bool) -> Value {
        let object = match (self.kind, chunk) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            _ => "text_completion",
        };
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": super::SYSTEM_FINGERPRINT,
        })
    }

    fn usage<'a>(&self, usages: impl Iterator<Item = (usize, &'a Usage)>) -> UsageOut {
        total_usage(self.n, usages)
    }

    fn count_token(&self) {
        if let Some(r) = &self.reservation {
            r.count_token();
        }
    }

    /// Logprobs in the endpoint's own shape; `text_start` is where these tokens' text begins.
    fn logprobs(&self, tokens: &[(u32, TokenLogprobs)], text_start: usize) -> Value {
        let tok = &self.engine.tokenizer;
        match self.kind {
            Endpoint::Chat => logprobs::chat(tok, tokens),
            _ => logprobs::completion(tok, tokens, text_start),
        }
    }
}

/// Usage over all choices (`n` per prompt, in order): each prompt and its cached part count once
/// however many choices it has; every choice's completion counts.
fn total_usage<'a>(n: usize, usages: impl Iterator<Item = (usize, &'a Usage)>) -> UsageOut {
    let (mut prompt, mut completion, mut cached) = (0, 0, 0);
    for (i, u) in usages {
        if i % n == 0 {
            prompt += u.prompt_tokens;
            cached += u.cached_tokens;
        }
        completion += u.completion_tokens;
    }
    UsageOut {
        prompt_tokens: prompt,
        completion_tokens: completion,
        total_tokens: prompt + completion,
        prompt_tokens_details: CachedTokens {
            cached_tokens: cached,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_counts_each_prompt_once_and_every_choice() {
        let u = |p, c, cached| Usage {
            prompt_tokens: p,
            completion_tokens: c,
            cached_tokens: cached,
        };
        // Two prompts, two choices each (completions with a list prompt and n = 2).
        let usages = [u(10, 3, 4), u(10, 5, 4), u(7, 1, 0), u(7, 2, 0)];
        let total = total_usage(2, usages.iter().enumerate());
        assert_eq!(
            serde_json::to_value(total).unwrap(),
            json!({"prompt_tokens": 17, "completion_tokens": 11, "total_tokens": 28,
                   "prompt_tokens_details": {"cached_tokens": 4}})
        );
        // A stream reports choices as they finish, in any order.
        let late = [
            (3, &usages[3]),
            (0, &usages[0]),
            (2, &usages[2]),
            (1, &usages[1]),
        ];
        assert_eq!(total_usage(2, late.into_iter()).total_tokens, 28);
    }
}
