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
use crate::common::Endpoint;
use crate::pipeline::cache::{charge_hit, Hit, Keyed, Lookup, Pending};
use crate::pipeline::responses::on_store;
use crate::tenancy::{Caller, Settled};

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
    // A hit is served only to a tenant that may use the model now (the policy may have changed
    // since the answer was stored).
    state.target(&caller.tenant, &keyed.model)?;
    let stages = state.stages();
    match stages.cache.lookup(&stages, caller, keyed).await? {
        Lookup::Off => serve().await,
        Lookup::Bypass => serve().await.map(|r| marked(r, "bypass")),
        Lookup::Hit(hit)
            if endpoint == Endpoint::Responses && !still_stored(state, caller, &hit).await =>
        {
            // The stored Response it names was deleted (or expired): run the request anew.
            serve().await.map(|r| marked(r, "miss"))
        }
        Lookup::Hit(hit) => {
            charge_hit(&stages, caller, endpoint, &hit.entry, started).await?;
            Ok(replay(hit))
        }
        Lookup::Miss(pending) => {
            let settled = caller.settled.clone();
            serve().await.map(|r| capture(r, pending, settled))
        }
    }
}

/// A cached Response that was stored (`store` true) still is: a hit must not hand out an id
/// that `GET /v1/responses/{id}` and `previous_response_id` refuse.
async fn still_stored(state: &AppState, caller: &Caller, hit: &Hit) -> bool {
    let e = &hit.entry;
    let response = match e.sse {
        false => serde_json::from_slice::<Value>(&e.body).ok(),
        true => std::str::from_utf8(&e.body)
            .ok()
            .and_then(|t| t.lines().find_map(|l| l.strip_prefix("data: ")))
            .and_then(|d| serde_json::from_str::<Value>(d).ok())
            .map(|v| v["response"].clone()),
    };
    let Some(r) = response else { return false };
    if r["store"] == Value::Bool(false) {
        return true;
    }
    let (Some(id), Some(store)) = (r["id"].as_str(), state.conversations.clone()) else {
        return false;
    };
    let (tenant, id) = (caller.tenant.name.to_string(), id.to_string());
    matches!(
        on_store(store, move |s| s.get(&tenant, &id)).await,
        Ok(Some(_))
    )
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
fn capture(r: Response, pending: Pending, settled: Arc<Settled>) -> Response {
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
            settled,
        }),
    };
    http::Response::from_parts(parts, tee.boxed_unsync())
}

struct Done {
    pending: Pending,
    sse: bool,
    model: String,
    /// How the request settled: only an answer that ended `Ok` is stored, with its tokens.
    settled: Arc<Settled>,
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
    let whole = match done.sse {
        true => whole_stream(&body),
        false => whole_body(&body),
    };
    let Some((prompt_tokens, completion_tokens)) = done.settled.ok().filter(|_| whole) else {
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

/// Whether a JSON answer is a whole one: not an error, not a Response that failed.
fn whole_body(body: &[u8]) -> bool {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return false;
    };
    let failed = v.get("error").is_some_and(|e| !e.is_null());
    let response = v.get("object").and_then(Value::as_str) == Some("response");
    // A Response cut at `max_output_tokens` is `incomplete`, and as repeatable as a complete one.
    let status = v.get("status").and_then(Value::as_str);
    let unfinished = response && !matches!(status, Some("completed" | "incomplete"));
    !failed && !unfinished
}

/// Whether a stream is a whole answer: it ended (`[DONE]`, or a Responses stream's
/// `response.completed` or `response.incomplete`) with no error event.
fn whole_stream(body: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(body) else {
        return false;
    };
    let complete = text.ends_with("data: [DONE]\n\n")
        || text.contains("event: response.completed\n")
        || text.contains("event: response.incomplete\n");
    let failed = text.contains("event: error\n")
        || text.contains("event: response.failed\n")
        || text.contains("\ndata: {\"error\"")
        || text.starts_with("data: {\"error\"");
    complete && !failed
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_stream_that_ended_well_is_whole() {
        let s = "data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\ndata: [DONE]\n\n";
        assert!(whole_stream(s.as_bytes()));
        assert!(!whole_stream(b"data: {\"choices\":[]}\n\n"), "cut short");
        let failed =
            "data: {\"choices\":[]}\n\ndata: {\"error\":{\"message\":\"x\"}}\n\ndata: [DONE]\n\n";
        assert!(!whole_stream(failed.as_bytes()));
        let responses =
            "event: response.created\ndata: {}\n\nevent: response.incomplete\ndata: {}\n\n";
        assert!(whole_stream(responses.as_bytes()));
        let gone = "event: response.created\ndata: {}\n\nevent: response.failed\ndata: {}\n\n";
        assert!(!whole_stream(gone.as_bytes()));
    }

    #[test]
    fn only_a_body_that_answers_is_whole() {
        assert!(whole_body(br#"{"choices":[],"usage":{"prompt_tokens":7}}"#));
        assert!(whole_body(
            br#"{"object":"response","status":"incomplete"}"#
        ));
        assert!(!whole_body(br#"{"object":"response","status":"failed"}"#));
        assert!(!whole_body(br#"{"error":{"message":"x"}}"#));
        assert!(!whole_body(b"not json"));
    }
}
