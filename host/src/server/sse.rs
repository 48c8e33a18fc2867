//! Server-sent events of a streamed response: `data: <json>` frames, an OpenAI-shaped error
//! event when a stream fails midway, then `data: [DONE]`.

use bytes::Bytes;
use serde_json::Value;
use tokio::sync::mpsc;

use super::error::ApiError;

const DONE: &[u8] = b"data: [DONE]\n\n";

/// The SSE side of a streamed response: `data: <json>` events, then `data: [DONE]`.
pub(super) struct Sse(pub(super) mpsc::Sender<Bytes>);

impl Sse {
    /// False when the client has gone away.
    pub(super) async fn send(&self, v: &Value) -> bool {
        let frame = Bytes::from(format!("data: {v}\n\n"));
        self.0.send(frame).await.is_ok()
    }

    pub(super) async fn done(&self) {
        let _ = self.0.send(Bytes::from_static(DONE)).await;
    }

    /// An error event in the OpenAI error shape, then the end of the stream.
    pub(super) async fn fail(&self, e: &ApiError) {
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
        let sse = Sse(tx);
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
