//! An upstream's answer on its way back to the client: a JSON body read whole (bounded), or an
//! SSE stream relayed event by event as it arrives. On the way the model takes the name the
//! client used, the reservation is settled from the usage the upstream reports (or from the
//! tokens counted), and the output parser and citations apply as for a local model.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::error::ApiError;
use super::sse::Sse;
use super::{json_response, sse_response, Response};
use crate::pipeline::upstream::Prepared;
use crate::tenancy::Outcome;
use crate::upstream::{Lease, Pool};

/// Largest non-streaming answer, or single stream event, taken from an upstream.
const MAX_BODY: usize = 32 << 20;

pub(super) async fn relay(
    pool: &Arc<Pool>,
    lease: Lease,
    resp: reqwest::Response,
    p: Prepared,
) -> Result<Response, ApiError> {
    let label = http::HeaderValue::from_str(lease.label()).expect("a number");
    let mut response = match p.stream {
        true => stream(pool, lease, resp, p),
        false => whole(pool, &lease, resp, p).await?,
    };
    response.headers_mut().insert("x-gateway-replica", label);
    Ok(response)
}

/// An upstream's refusal (a 4xx other than 429), passed on as it came when it is an OpenAI
/// error body, else wrapped in one.
pub(super) fn upstream_error(status: StatusCode, body: Bytes) -> Response {
    let parsed: Option<Value> = serde_json::from_slice(&body).ok();
    let body = match parsed {
        Some(v) if v.get("error").is_some() => v,
        _ => ApiError::upstream(
            status,
            "upstream_error",
            format!(
                "The upstream answered {status}: {}",
                String::from_utf8_lossy(&body[..body.len().min(512)])
            ),
        )
        .body(),
    };
    json_response(status, &body)
}

fn broken(pool: &Pool, why: impl std::fmt::Display) -> ApiError {
    ApiError::upstream(
        StatusCode::BAD_GATEWAY,
        "upstream_error",
        format!(
            "Model `{}`: the upstream's answer broke off: {why}",
            pool.name
        ),
    )
}

async fn whole(
    pool: &Pool,
    lease: &Lease,
    mut resp: reqwest::Response,
    p: Prepared,
) -> Result<Response, ApiError> {
    let idle = Duration::from_millis(pool.cfg.idle_timeout_ms);
    let mut bytes = Vec::new();
    let read = loop {
        match tokio::time::timeout(idle, resp.chunk()).await {
            Err(_) => break Err(format!("no data for {} ms", idle.as_millis())),
            Ok(Err(e)) => break Err(e.to_string()),
            Ok(Ok(None)) => break Ok(()),
            Ok(Ok(Some(c))) if bytes.len() + c.len() > MAX_BODY => {
                break Err(format!("larger than {MAX_BODY} bytes"))
            }
            Ok(Ok(Some(c))) => bytes.extend_from_slice(&c),
        }
    };
    let parsed = read.and_then(|()| {
        serde_json::from_slice::<Value>(&bytes)
            .ok()
            .filter(Value::is_object)
            .ok_or_else(|| "not a JSON object".to_string())
    });
    let mut body = match parsed {
        Ok(b) => b,
        Err(why) => {
            lease.failed_midway("broken answer");
            p.reservation.end(Outcome::Failed);
            return Err(broken(pool, why));
        }
    };
    body["model"] = json!(pool.name);
    let (prompt, completion) = match usage(&body) {
        Some(u) => u,
        None => {
            let text: usize = texts(&body).map(|(_, t)| t.len()).sum();
            p.reservation.count_tokens(text.div_ceil(4) as u64);
            p.reservation.counted()
        }
    };
    let raw: Option<Vec<Value>> = p
        .debug
        .as_ref()
        .map(|_| texts(&body).map(|(_, t)| json!(t)).collect());
    let report = |raw: Option<Vec<Value>>| {
        p.debug
            .as_ref()
            .map(|sink| crate::pipeline::plugin_calls::debug_report(sink, raw))
    };
    if let Some(out) = &p.output {
        if let Err(mut e) = parse_choices(out, &mut body).await {
            p.reservation.settle(prompt, completion, Outcome::Failed);
            e.debug = report(raw).map(Box::new);
            return Err(e);
        }
    }
    if let Some(c) = &p.citations {
        body["citations"] = json!(c);
    }
    if let Some(d) = report(raw) {
        body["gateway_debug"] = d;
    }
    p.reservation.settle(prompt, completion, Outcome::Ok);
    let body = match &p.responses {
        Some(f) => f.body(&body).await?,
        None => body,
    };
    Ok(json_response(StatusCode::OK, &body))
}

/// `usage.prompt_tokens` and `usage.completion_tokens`, when reported.
fn usage(body: &Value) -> Option<(u64, u64)> {
    let u = body.get("usage").filter(|u| u.is_object())?;
    Some((
        u["prompt_tokens"].as_u64().unwrap_or(0),
        u["completion_tokens"].as_u64().unwrap_or(0),
    ))
}

/// Each choice's index and text (a chat message's content, or a completion's text).
fn texts(body: &Value) -> impl Iterator<Item = (usize, &str)> {
    body["choices"].as_array().into_iter().flatten().map(|c| {
        let index = c["index"].as_u64().unwrap_or(0) as usize;
        let text = c["message"]["content"]
            .as_str()
            .or_else(|| c["text"].as_str())
            .unwrap_or_default();
        (index, text)
    })
}

/// The output parser over each choice's final text, in place, with the fixes it made.
async fn parse_choices(
    out: &crate::pipeline::output::OutputStage,
    body: &mut Value,
) -> Result<(), ApiError> {
    let Some(choices) = body["choices"].as_array_mut() else {
        return Ok(());
    };
    for c in choices {
        let chat = c["message"].is_object();
        let text = match chat {
            true => c["message"]["content"].as_str(),
            false => c["text"].as_str(),
        };
        let parsed = out.parse(text.unwrap_or_default().to_string()).await?;
        match chat {
            true => c["message"]["content"] = json!(parsed.json),
            false => c["text"] = json!(parsed.json),
        }
        c["repairs"] = json!(parsed.repairs);
    }
    Ok(())
}

fn stream(pool: &Arc<Pool>, lease: Lease, resp: reqwest::Response, p: Prepared) -> Response {
    let (tx, rx) = mpsc::channel(16);
    let relay = StreamRelay {
        pool: pool.clone(),
        lease,
        p,
        usage: None,
        texts: Vec::new(),
        cited: false,
        failed: false,
    };
    let sse = Sse::shaped(tx, relay.p.responses.clone());
    tokio::spawn(relay.pump(resp, sse));
    sse_response(rx)
}

struct StreamRelay {
    pool: Arc<Pool>,
    lease: Lease,
    p: Prepared,
    usage: Option<(u64, u64)>,
    /// Each choice's text so far, for the output parser.
    texts: Vec<String>,
    cited: bool,
    /// The upstream sent an error event.
    failed: bool,
}

/// What to do after an event.
enum Flow {
    Next,
    /// `[DONE]` was relayed.
    Finished,
    /// The client went away.
    Gone,
}

impl StreamRelay {
    async fn pump(mut self, mut resp: reqwest::Response, sse: Sse) {
        let idle = Duration::from_millis(self.pool.cfg.idle_timeout_ms);
        let mut buf: Vec<u8> = Vec::new();
        loop {
            let chunk = match tokio::time::timeout(idle, resp.chunk()).await {
                Err(_) => {
                    let why = format!("no data for {} ms", idle.as_millis());
                    return self.fail(&sse, why).await;
                }
                Ok(Err(e)) => return self.fail(&sse, e.to_string()).await,
                Ok(Ok(None)) => break,
                Ok(Ok(Some(c))) => c,
            };
            // JSON escapes control characters, so dropping every CR turns CRLF framing into LF.
            buf.extend(chunk.iter().filter(|&&b| b != b'\r'));
            while let Some(end) = buf.windows(2).position(|w| w == b"\n\n") {
                let event: Vec<u8> = buf.drain(..end + 2).collect();
                match self.event(&event, &sse).await {
                    Flow::Next => {}
                    Flow::Finished | Flow::Gone => return,
                }
            }
            if buf.len() > MAX_BODY {
                return self.fail(&sse, "an event too large".into()).await;
            }
        }
        self.fail(&sse, "the stream ended before [DONE]".into())
            .await
    }

    async fn fail(self, sse: &Sse, why: String) {
        self.lease.failed_midway("stream broke");
        self.p.reservation.end(Outcome::Failed);
        sse.fail(&broken(&self.pool, why)).await;
    }

    async fn event(&mut self, event: &[u8], sse: &Sse) -> Flow {
        let text = String::from_utf8_lossy(event);
        let data: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data:"))
            .map(|d| d.strip_prefix(' ').unwrap_or(d))
            .collect();
        if data.is_empty() {
            return Flow::Next;
        }
        let data = data.join("\n");
        if data.trim() == "[DONE]" {
            if let Some(sink) = &self.p.debug {
                let report = crate::pipeline::plugin_calls::debug_report(sink, None);
                let chunk =
                    json!({"model": self.pool.name, "choices": [], "gateway_debug": report});
                if !sse.send(&chunk).await {
                    return Flow::Gone;
                }
            }
            let outcome = if self.failed {
                Outcome::Failed
            } else {
                Outcome::Ok
            };
            match self.usage {
                Some((p, c)) => self.p.reservation.settle(p, c, outcome),
                None => self.p.reservation.end(outcome),
            }
            // The error event went to a chat client as it came; a Responses stream drops chunks
            // without choices, so it must end failed, not completed.
            if self.failed && sse.shapes_responses() {
                let e = ApiError::upstream(
                    StatusCode::BAD_GATEWAY,
                    "upstream_error",
                    format!("Upstream `{}` failed during the stream.", self.pool.name),
                );
                sse.fail(&e).await;
            } else {
                sse.done().await;
            }
            return Flow::Finished;
        }
        let Ok(mut v) = serde_json::from_str::<Value>(&data) else {
            return Flow::Next;
        };
        if v.get("error").is_some() {
            self.failed = true;
        }
        if !self.p.client_usage && v.get("usage").is_some_and(Value::is_null) {
            v.as_object_mut().map(|o| o.remove("usage"));
        }
        if let Some(u) = usage(&v) {
            self.usage = Some(u);
            let usage_only = v["choices"].as_array().is_none_or(|c| c.is_empty());
            if !self.p.client_usage {
                if usage_only {
                    return Flow::Next;
                }
                v.as_object_mut().map(|o| o.remove("usage"));
            }
        }
        if v.get("model").is_some() {
            v["model"] = json!(self.pool.name);
        }
        if let Err(e) = self.choices(&mut v).await {
            self.p.reservation.end(Outcome::Failed);
            sse.fail(&e).await;
            return Flow::Finished;
        }
        match sse.send(&v).await {
            true => Flow::Next,
            false => Flow::Gone,
        }
    }

    /// Counts generated pieces, keeps the text for the parser, and on a choice's finish adds
    /// the parser's result and (once) the citations.
    async fn choices(&mut self, v: &mut Value) -> Result<(), ApiError> {
        let Some(choices) = v["choices"].as_array_mut() else {
            return Ok(());
        };
        for c in choices {
            let i = c["index"].as_u64().unwrap_or(0) as usize;
            let piece = c["delta"]["content"]
                .as_str()
                .or_else(|| c["text"].as_str())
                .unwrap_or_default();
            if !piece.is_empty() || c["delta"]["tool_calls"].is_array() {
                self.p.reservation.count_token();
            }
            if self.p.output.is_some() {
                if self.texts.len() <= i {
                    self.texts.resize(i + 1, String::new());
                }
                self.texts[i].push_str(piece);
            }
            if c["finish_reason"].is_null() {
                continue;
            }
            if let Some(out) = &self.p.output {
                let parsed = out.parse(std::mem::take(&mut self.texts[i])).await?;
                c["parsed"] = serde_json::from_str(&parsed.json).unwrap_or(Value::Null);
                c["repairs"] = json!(parsed.repairs);
            }
        }
        let finished = v["choices"]
            .as_array()
            .is_some_and(|cs| cs.iter().any(|c| !c["finish_reason"].is_null()));
        if let (true, false, Some(c)) = (finished, self.cited, &self.p.citations) {
            v["citations"] = json!(c);
            self.cited = true;
        }
        Ok(())
    }
}
