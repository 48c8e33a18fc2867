//! Server-sent events of a streamed response: `data: <json>` frames, an OpenAI-shaped error
//! event when a stream fails midway, then `data: [DONE]`. A Responses API stream takes the
//! same chat chunks and frames the Responses events they make instead (`event: <type>`).

use bytes::Bytes;
use serde_json::Value;
use tokio::sync::mpsc;

use super::error::ApiError;
use crate::pipeline::responses::{EventStream, Finisher};

const DONE: &[u8] = b"data: [DONE]\n\n";

/// The SSE side of a streamed response: `data: <json>` events, then `data: [DONE]`.
pub(super) struct Sse {
    tx: mpsc::Sender<Bytes>,
    responses: Option<Responses>,
}

/// A Responses stream: the events made so far, and what finishes (and stores) the response.
struct Responses {
    events: std::sync::Mutex<EventStream>,
    finisher: std::sync::Arc<Finisher>,
}

impl Sse {
    /// Chat chunks framed as they are (chat and completions), or as the Responses events they
    /// make when `finisher` is given.
    pub(super) fn shaped(
        tx: mpsc::Sender<Bytes>,
        finisher: Option<std::sync::Arc<Finisher>>,
    ) -> Self {
        let responses = finisher.map(|f| Responses {
            events: std::sync::Mutex::new(f.shape.events()),
            finisher: f,
        });
        Self { tx, responses }
    }

    /// Runs `f` over the Responses events of this stream.
    fn events<T>(r: &Responses, f: impl FnOnce(&mut EventStream) -> T) -> T {
        f(&mut r.events.lock().unwrap_or_else(|e| e.into_inner()))
    }

    async fn frames(&self, events: Vec<Value>) -> bool {
        for e in events {
            let kind = e["type"].as_str().unwrap_or("message");
            let frame = Bytes::from(format!("event: {kind}\ndata: {e}\n\n"));
            if self.tx.send(frame).await.is_err() {
                return false;
            }
        }
        true
    }

    /// False when the client has gone away.
    pub(super) async fn send(&self, v: &Value) -> bool {
        if let Some(r) = &self.responses {
            let events = Self::events(r, |s| s.push(v));
            return self.frames(events).await;
        }
        let frame = Bytes::from(format!("data: {v}\n\n"));
        self.tx.send(frame).await.is_ok()
    }

    /// The chat chunks are reframed as Responses events.
    pub(super) fn shapes_responses(&self) -> bool {
        self.responses.is_some()
    }

    /// The end of the stream: `[DONE]`, or a Responses stream's closing events, its response
    /// stored first (when asked) so that a completed response is never one that was lost.
    pub(super) async fn done(&self) {
        let Some(r) = &self.responses else {
            let _ = self.tx.send(Bytes::from_static(DONE)).await;
            return;
        };
        let events = Self::events(r, |s| s.finish());
        let response = Self::events(r, |s| s.response());
        match r.finisher.keep(&response).await {
            Ok(()) => {
                self.frames(events).await;
            }
            Err(e) => {
                let failed = Self::events(r, |s| s.fail(&ApiError::from(e).body()));
                self.frames(failed).await;
            }
        }
    }

    /// An error event in the OpenAI error shape (`response.failed` for a Responses stream),
    /// then the end of the stream.
    pub(super) async fn fail(&self, e: &ApiError) {
        if let Some(r) = &self.responses {
            let events = Self::events(r, |s| s.fail(&e.body()));
            self.frames(events).await;
            return;
        }
        self.send(&e.body()).await;
        self.done().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[tokio::test]
    async fn sse_frames_events_errors_and_done() {
        let (tx, mut rx) = mpsc::channel(8);
        let sse = Sse::shaped(tx, None);
        assert!(sse.send(&json!({"a": 1})).await);
        sse.fail(&ApiError::shutting_down()).await;
        assert_eq!(
            rx.recv().await.unwrap(),
            Bytes::from_static(b"data: {\"a\":1}\n\n")
        );
        let err = rx.recv().await.unwrap();
        let text = std::str::from_utf8(&err).unwrap();
        let body: Value = serde_json::from_str(
            text.strip_prefix("data: ")
                .unwrap()
                .strip_suffix("\n\n")
                .unwrap(),
        )
        .unwrap();
        assert_eq!(body["error"]["code"], "server_shutting_down");
        assert_eq!(rx.recv().await.unwrap(), Bytes::from_static(DONE));
        drop(sse);
        assert!(rx.recv().await.is_none());
    }
}
