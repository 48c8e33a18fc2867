//! The response cache at the edge: a hit answered from the stored bytes (a JSON body, or a
//! stream's frames replayed), byte for byte what the miss was sent; a miss's answer captured
//! as it goes to the client and stored once it ended well. `x-gateway-cache` says which (`hit`, `miss`, `bypass`);
//! `x-gateway-cache-similarity` gives a semantic hit's cosine similarity.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use http::{header, HeaderValue, StatusCode};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, SizeHint};
use serde_json::Value;

use super::error::ApiError;
use super::{AppState, Response};
use crate::cache::Entry;
use crate::pipeline::cache::{charge_hit, Hit, Keyed, Lookup, Pending};
use crate::tenancy::Caller;

const HEADER: &str = "x-gateway-cache";

/// Answers `keyed` from the cache, or with `serve`, storing what it answers.
pub(super) async fn through<Fut>(
    state: &Arc<AppState>,
    caller: &Caller,
    keyed: Keyed,
    serve: impl FnOnce() -> Fut,
) -> Result<Response, ApiError>
where
    Fut: Future<Output = Result<Response, ApiError>>,
{
    let started = Instant::now();
    let endpoint = keyed.endpoint;
    let stages = state.stages();
    match stages.cache.lookup(&stages, caller, keyed).await? {
        Lookup::Off => serve().await,
        Lookup::Bypass => serve().await.map(|r| marked(r, "bypass")),
        Lookup::Hit(hit) => {
            charge_hit(&stages, caller, endpoint, &hit.entry, started).await?;
            Ok(replay(hit))
        }
        Lookup::Miss(pending) => serve().await.map(|r| capture(r, pending)),
    }
}

fn marked(mut r: Response, what: &'static str) -> Response {
    r.headers_mut()
        .insert(HEADER, HeaderValue::from_static(what));
    r
}

/// The stored answer, as it was served.
fn replay(hit: Hit) -> Response {
    let e = &hit.entry;
    let content_type = if e.sse {
        "text/event-stream"
    } else {
        "application/json"
    };
    let mut b = http::Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .header(HEADER, "hit");
    if e.sse {
        b = b.header(header::CACHE_CONTROL, "no-cache");
    }
    if let Ok(model) = HeaderValue::from_str(&e.model) {
        b = b.header("x-gateway-model", model);
    }
    if let Some(s) = hit.similarity {
        b = b.header("x-gateway-cache-similarity", format!("{s:.4}"));
    }
    b.body(Full::new(e.body.clone()).boxed_unsync())
        .expect("valid headers")
}

/// A miss's answer on its way to the client, copied (up to the most an entry may take) and
/// stored once it ended complete.
fn capture(r: Response, pending: Pending) -> Response {
    let r = marked(r, "miss");
    if r.status() != StatusCode::OK {
        return r;
    }
    let sse = r
        .headers()
        .get(header::CONTENT_TYPE)
        .is_some_and(|v| v.as_bytes().starts_with(b"text/event-stream"));
    let model = r
        .headers()
        .get("x-gateway-model")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let (parts, body) = r.into_parts();
    let limit = pending.max_bytes() as usize;
    let tee = Tee {
        inner: body,
        copy: Some(BytesMut::new()),
        limit,
        done: Some(Done {
            pending,
            sse,
            model,
        }),
    };
    http::Response::from_parts(parts, tee.boxed_unsync())
}

struct Done {
    pending: Pending,
    sse: bool,
    model: String,
}

struct Tee {
    inner: UnsyncBoxBody<Bytes, Infallible>,
    /// What went to the client so far; dropped once past `limit`.
    copy: Option<BytesMut>,
    limit: usize,
    done: Option<Done>,
}

impl Body for Tee {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        let mut last = false;
        if let Poll::Ready(Some(Ok(frame))) = &polled {
            if let (Some(copy), Some(data)) = (this.copy.as_mut(), frame.data_ref()) {
                if copy.len() + data.len() > this.limit {
                    this.copy = None;
                } else {
                    copy.extend_from_slice(data);
                    // A stream's last event: the client may ask again before the body's end
                    // is polled, and must find the answer stored.
                    last = this.done.as_ref().is_some_and(|d| d.sse) && final_event(data);
                }
            }
        }
        // hyper stops polling a body that says it has ended, so the end is either.
        let ended = matches!(polled, Poll::Ready(None)) || this.inner.is_end_stream();
        if last || ended {
            if let (Some(copy), Some(done)) = (this.copy.take(), this.done.take()) {
                store(copy.freeze(), done);
            }
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The frame that ends a complete stream: chat and completions' `[DONE]`, a Responses
/// stream's `response.completed` (or `response.incomplete`, cut at `max_output_tokens`).
fn final_event(data: &[u8]) -> bool {
    data.ends_with(b"data: [DONE]\n\n")
        || data.starts_with(b"event: response.completed\n")
        || data.starts_with(b"event: response.incomplete\n")
}

/// Stores a miss's answer, if it is a complete one (in memory at once; to Redis on a task).
fn store(body: Bytes, done: Done) {
    let kept = match done.sse {
        true => stored_stream(body),
        false => stored_body(body),
    };
    let Some((body, prompt_tokens, completion_tokens)) = kept else {
        return;
    };
    let entry = Entry {
        model: done.model,
        sse: done.sse,
        prompt_tokens,
        completion_tokens,
        body,
    };
    if let Some(shared) = done.pending.store(entry) {
        tokio::spawn(shared);
    }
}

/// A JSON answer as stored, exactly as served, with its (prompt, completion) tokens. None
/// for a body that is not a complete answer.
fn stored_body(body: Bytes) -> Option<(Bytes, u64, u64)> {
    let v: Value = serde_json::from_slice(&body).ok()?;
    let failed = v.get("error").is_some_and(|e| !e.is_null());
    let response = v.get("object").and_then(Value::as_str) == Some("response");
    // A Response cut at `max_output_tokens` is `incomplete`, and as repeatable as a complete one.
    let status = v.get("status").and_then(Value::as_str);
    let unfinished = response && !matches!(status, Some("completed" | "incomplete"));
    if failed || unfinished {
        return None;
    }
    let (p, c) = tokens(&v).unwrap_or((0, 0));
    Some((body, p, c))
}

/// A stream as stored, every frame as served: only one that ended as a complete answer
/// (`[DONE]`, or a Responses stream's `response.completed`) with no error event. Its tokens
/// come from its usage frame, when the client asked for one.
fn stored_stream(body: Bytes) -> Option<(Bytes, u64, u64)> {
    let text = std::str::from_utf8(&body).ok()?;
    let complete = text.ends_with("data: [DONE]\n\n")
        || text.contains("event: response.completed\n")
        || text.contains("event: response.incomplete\n");
    let failed = text.contains("event: error\n")
        || text.contains("event: response.failed\n")
        || text.contains("\ndata: {\"error\"")
        || text.starts_with("data: {\"error\"");
    if !complete || failed {
        return None;
    }
    let used = text
        .split("\n\n")
        .filter_map(|frame| frame.lines().find_map(|l| l.strip_prefix("data: ")))
        .filter(|data| data.contains("\"usage\""))
        .filter_map(|data| tokens(&serde_json::from_str(data).ok()?))
        .last()
        .unwrap_or((0, 0));
    Some((body, used.0, used.1))
}

/// The answer's (prompt, completion) tokens: chat and completions' `usage`, a Response's
/// (or a Responses event's `response`) `usage`; None when it has none.
fn tokens(v: &Value) -> Option<(u64, u64)> {
    let usage = match v.get("response") {
        Some(r) if r.get("usage").is_some_and(Value::is_object) => &r["usage"],
        _ => v.get("usage")?,
    };
    let (prompt, completion) = match usage.get("input_tokens") {
        Some(_) => ("input_tokens", "output_tokens"),
        None => ("prompt_tokens", "completion_tokens"),
    };
    let p = usage.get(prompt)?.as_u64()?;
    Some((
        p,
        usage.get(completion).and_then(Value::as_u64).unwrap_or(0),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_complete_stream_is_kept_as_served_with_its_usage() {
        let s = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n\
                 data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2}}\n\n\
                 data: [DONE]\n\n";
        let (body, p, c) = stored_stream(Bytes::from(s)).unwrap();
        assert_eq!((p, c), (5, 2));
        assert_eq!(body, s.as_bytes());
        let cut = Bytes::from_static(b"data: {\"choices\":[]}\n\n");
        assert!(stored_stream(cut).is_none(), "cut short");
        let failed =
            "data: {\"choices\":[]}\n\ndata: {\"error\":{\"message\":\"x\"}}\n\ndata: [DONE]\n\n";
        assert!(stored_stream(Bytes::from(failed)).is_none());
        let responses = "event: response.created\ndata: {\"response\":{\"usage\":null}}\n\n\
                         event: response.completed\ndata: {\"response\":{\"usage\":{\"input_tokens\":3,\"output_tokens\":4}}}\n\n";
        let (_, p, c) = stored_stream(Bytes::from(responses)).unwrap();
        assert_eq!((p, c), (3, 4));
    }

    #[test]
    fn a_body_is_kept_as_served_unless_it_is_an_error() {
        let b = Bytes::from_static(
            br#"{"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":1}}"#,
        );
        let (body, p, c) = stored_body(b.clone()).unwrap();
        assert_eq!((body, p, c), (b, 7, 1));
        let r = br#"{"object":"response","status":"completed","usage":{"input_tokens":3,"output_tokens":2}}"#;
        let (_, p, c) = stored_body(Bytes::from_static(r)).unwrap();
        assert_eq!((p, c), (3, 2));
        let failed = br#"{"object":"response","status":"failed","usage":null}"#;
        assert!(stored_body(Bytes::from_static(failed)).is_none());
        assert!(stored_body(Bytes::from_static(br#"{"error":{"message":"x"}}"#)).is_none());
        assert!(stored_body(Bytes::from_static(b"not json")).is_none());
    }
}
