//! Bodies at the edge: request bodies read whole within their size and time limits (and
//! drained when a refusal left them unread), JSON, text and SSE responses, and the OpenAI error
//! body of an `ApiError`.

use bytes::Bytes;
use http::{header, StatusCode};
use http_body_util::{BodyExt, Full, Limited, StreamBody};
use hyper::body::{Frame, Incoming};
use tokio::sync::mpsc;

use super::deadlines;
use super::error::ApiError;
use super::Response;

pub fn json_response(status: StatusCode, v: &serde_json::Value) -> Response {
    http::Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(v.to_string())).boxed_unsync())
        .expect("static headers are valid")
}

pub(super) fn text_response(content_type: &'static str, text: String) -> Response {
    http::Response::builder()
        .header(header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(text)).boxed_unsync())
        .expect("static headers are valid")
}

/// Server-sent events from a channel of already framed `data: ...\n\n` chunks.
pub fn sse_response(rx: mpsc::Receiver<Bytes>) -> Response {
    let frames = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok(Frame::data(b)), rx))
    });
    http::Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(BodyExt::boxed_unsync(StreamBody::new(frames)))
        .expect("static headers are valid")
}

/// A query string's `key=value` pairs, in order (a bare key has an empty value).
pub(super) fn query_pairs(query: Option<&str>) -> impl Iterator<Item = (&str, &str)> {
    query
        .unwrap_or_default()
        .split('&')
        .filter(|s| !s.is_empty())
        .map(|kv| kv.split_once('=').unwrap_or((kv, "")))
}

impl From<&ApiError> for Response {
    fn from(e: &ApiError) -> Self {
        let mut r = json_response(e.status, &e.body());
        if let Some(s) = e.retry_after {
            r.headers_mut().insert(header::RETRY_AFTER, s.into());
        }
        r
    }
}

/// Takes the request body (once) and reads it whole, up to `limit` bytes.
pub(super) async fn read_body(
    headers: &http::HeaderMap,
    body: &mut Option<Incoming>,
    limit: usize,
    http: &crate::config::HttpConfig,
) -> Result<Bytes, ApiError> {
    let body = body.take().expect("a request body is read at most once");
    if let Some(len) = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<usize>().ok())
    {
        if len > limit {
            return Err(ApiError::too_large(limit));
        }
    }
    deadlines::collect_body(body, limit, http)
        .await
        .map_err(|e| match e {
            deadlines::BodyError::TooLarge => ApiError::too_large(limit),
            deadlines::BodyError::TooSlow => {
                ApiError::body_timeout(http.body_timeout_ms, http.min_body_rate)
            }
            deadlines::BodyError::Broken(e) => {
                ApiError::invalid(None, format!("Could not read the request body: {e}"))
            }
        })
}

/// Reads and discards an unread body so the answer to a refused request reaches the client
/// and the connection stays usable (a "lingering close", bounded in bytes and time). False if
/// the body was too large, too slow or broken: the connection must then close.
pub(super) async fn discard(body: Incoming, limit: usize) -> bool {
    let drain = Limited::new(body, limit).collect();
    matches!(
        tokio::time::timeout(std::time::Duration::from_secs(2), drain).await,
        Ok(Ok(_))
    )
}
