//! The streamed form of a response: one SSE chunk per text delta (tool calls, logprobs and
//! echo included), the output parser and citations on each choice's last chunk, then the usage
//! chunk when asked for and `data: [DONE]`.

use std::collections::BTreeMap;
use std::future::Future;

use bytes::Bytes;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::super::error::ApiError;
use super::super::sse::Sse;
use super::super::tool_calls::{self, StreamCalls};
use super::Reply;
use crate::common::Endpoint;
use crate::engine::{Event, EventStream, FinishReason, TokenLogprobs, Usage};
use crate::tenancy::Outcome;

impl Reply {
    /// The prompt text for choice `i`'s first streamed text, once.
    fn take_echo(&self, pending: &mut bool, i: usize) -> String {
        match (&self.echo, std::mem::take(pending)) {
            (Some(p), true) => p[i / self.n].clone(),
            _ => String::new(),
        }
    }

    fn chunk(&self, choice: Value) -> Value {
        let mut c = self.envelope(true);
        c["choices"] = json!([choice]);
        if self.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    /// Feeds SSE events into `tx` until every choice is done. When the client goes away the
    /// send fails, this returns, and dropping the streams cancels their sequences.
    pub(super) async fn stream(
        self,
        streams: Vec<EventStream>,
        tx: mpsc::Sender<Bytes>,
        cut: impl Future<Output = ()> + Send,
    ) {
        let sse = Sse::shaped(tx, self.responses.clone());
        let total = streams.len();
        let mut merged = stream::select_all(streams.into_iter().enumerate().map(|(i, s)| {
            stream::unfold(s, |mut s| async move { s.recv().await.map(|e| (e, s)) })
                .map(move |e| (i, e))
                .boxed()
        }));
        if self.kind == Endpoint::Chat {
            for i in 0..total {
                if !sse.send(&self.chunk(json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}))).await {
                    return;
                }
            }
        }
        let mut p = Progress::new(total, self.parser().is_some(), self.echo.is_some());
        if let Some(t) = &self.tools {
            p.calls = (0..total).map(|_| StreamCalls::new(t)).collect();
        }
        tokio::pin!(cut);
        loop {
            let (i, ev) = tokio::select! {
                next = merged.next() => match next {
                    Some(next) => next,
                    None => break,
                },
                () = &mut cut => {
                    self.end(Outcome::Shutdown);
                    return sse.fail(&ApiError::shutting_down()).await;
                }
            };
            let finished = matches!(ev, Event::Done(..));
            let choices = match ev {
                Event::Token { id, text, logprobs } => {
                    self.token_choice(&mut p, i, id, text, logprobs)
                }
                Event::Done(u, f) => match self.done_choice(&mut p, i, u, f).await {
                    Ok(c) => c,
                    Err(e) => {
                        self.end(Outcome::Failed);
                        return sse.fail(&e).await;
                    }
                },
                Event::Failed(m) => {
                    self.end(Outcome::Failed);
                    return sse.fail(&ApiError::from(m)).await;
                }
            };
            let last = choices.len().saturating_sub(1);
            for (k, choice) in choices.into_iter().enumerate() {
                let mut chunk = self.chunk(choice);
                if let (true, true, Some(c)) = (finished, k == last, &self.citations) {
                    chunk["citations"] = json!(c);
                }
                if !sse.send(&chunk).await {
                    return;
                }
            }
        }
        self.close_stream(&sse, p).await
    }

    /// The chunks for one generated token of choice `i`: none while text is held back (for a
    /// stop string, an incomplete character, or a possible tool-call tag).
    fn token_choice(
        &self,
        p: &mut Progress,
        i: usize,
        id: u32,
        text: String,
        logprobs: Option<TokenLogprobs>,
    ) -> Vec<Value> {
        self.count_token();
        if text.is_empty() && logprobs.is_none() {
            return Vec::new();
        }
        p.text_len[i] += text.len();
        if let Some(t) = p.texts.get_mut(i) {
            t.push_str(&text);
        }
        let lp = logprobs.map_or(Value::Null, |l| self.logprobs(&[(id, l)], p.text_len[i]));
        if let Some(calls) = p.calls.get_mut(i) {
            // Logprobs ride on the first delta the token released, if any.
            let mut lp = Some(lp);
            return calls
                .push(&text)
                .into_iter()
                .map(|delta| {
                    let lp = lp.take().unwrap_or(Value::Null);
                    json!({"index": i, "delta": delta, "logprobs": lp, "finish_reason": null})
                })
                .collect();
        }
        let text = self.take_echo(&mut p.echo_pending[i], i) + &text;
        vec![match self.kind {
            Endpoint::Chat => {
                json!({"index": i, "delta": {"content": text}, "logprobs": lp, "finish_reason": null})
            }
            _ => {
                json!({"index": i, "text": text, "logprobs": lp, "finish_reason": null})
            }
        }]
    }

    /// The finishing chunks of choice `i`: text a tool-call parser held back, then the finish;
    /// with an output parser, its verdict on the whole text.
    async fn done_choice(
        &self,
        p: &mut Progress,
        i: usize,
        usage: Usage,
        finish: FinishReason,
    ) -> Result<Vec<Value>, ApiError> {
        p.usages.insert(i, usage);
        let mut reason = finish.as_str();
        let mut out = Vec::new();
        if let Some(calls) = p.calls.get_mut(i) {
            for delta in calls.finish() {
                out.push(
                    json!({"index": i, "delta": delta, "logprobs": null, "finish_reason": null}),
                );
            }
            reason = tool_calls::finish_reason(finish, calls.called());
        }
        out.push(match self.kind {
            Endpoint::Chat => {
                let mut choice =
                    json!({"index": i, "delta": {}, "logprobs": null, "finish_reason": reason});
                if let Some(out) = self.parser() {
                    let parsed = out
                        .parse(std::mem::take(&mut p.texts[i]))
                        .await
                        .map_err(|e| self.with_debug(e, None))?;
                    choice["parsed"] = serde_json::from_str(&parsed.json).unwrap_or(Value::Null);
                    choice["repairs"] = json!(parsed.repairs);
                }
                choice
            }
            _ => {
                // A choice that produced no text still echoes its prompt.
                let text = self.take_echo(&mut p.echo_pending[i], i);
                json!({"index": i, "text": text, "logprobs": null, "finish_reason": reason})
            }
        });
        Ok(out)
    }

    /// After the last event: settles the reservation and sends the usage chunk and `[DONE]`,
    /// or, when a choice ended without its finish, says so rather than end as if complete.
    async fn close_stream(&self, sse: &Sse, p: Progress) {
        if p.usages.len() < p.text_len.len() {
            self.end(Outcome::Failed);
            let stopped = ApiError::internal("The engine stopped before the generation finished.");
            return sse.fail(&stopped).await;
        }
        let usage = self.usage(p.usages.iter().map(|(i, u)| (*i, u)));
        if let Some(r) = &self.reservation {
            r.settle(
                usage.prompt_tokens as u64,
                usage.completion_tokens as u64,
                Outcome::Ok,
            );
        }
        if let Some(d) = self.debug_report(None) {
            let mut c = self.envelope(true);
            c["choices"] = json!([]);
            c["gateway_debug"] = d;
            if !sse.send(&c).await {
                return;
            }
        }
        if self.include_usage {
            let mut c = self.envelope(true);
            c["choices"] = json!([]);
            c["usage"] = serde_json::to_value(usage).expect("plain struct");
            if !sse.send(&c).await {
                return;
            }
        }
        sse.done().await;
    }
}

/// Per-choice progress of a streamed response.
struct Progress {
    usages: BTreeMap<usize, Usage>,
    text_len: Vec<usize>,
    /// The whole text of each choice, kept only when the output parser needs it at the end.
    texts: Vec<String>,
    echo_pending: Vec<bool>,
    /// Tool-call parsing per choice, when the request offered tools.
    calls: Vec<StreamCalls>,
}

impl Progress {
    fn new(choices: usize, keep_text: bool, echo: bool) -> Self {
        Self {
            usages: BTreeMap::new(),
            text_len: vec![0; choices],
            texts: vec![String::new(); if keep_text { choices } else { 0 }],
            echo_pending: vec![echo; choices],
            calls: Vec::new(),
        }
    }
}
