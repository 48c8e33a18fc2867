//! Per-connection deadlines: the watchdog that closes a connection whose next request's
//! headers are too slow or that sits idle with no request in flight, and the deadlines of a
//! request body (a longest pause, a minimum average rate).

use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::sync::Notify;

use crate::config::HttpConfig;

const NO_BYTE: u64 = u64::MAX;

/// What the watchdog of one connection knows: requests in flight, when the last one ended,
/// and when the first byte after that arrived (the start of the next request's headers).
pub(super) struct Activity {
    born: Instant,
    in_flight: AtomicUsize,
    /// Milliseconds since `born` when the connection last had no request in flight.
    idle_since: AtomicU64,
    /// Milliseconds since `born` of the first byte read while idle, or `NO_BYTE`.
    first_byte: AtomicU64,
    /// HTTP/2: frames arrive between requests (pings, window updates), so only the idle rule
    /// applies once the connection has shown it speaks h2.
    h2: AtomicBool,
    wake: Notify,
}

impl Activity {
    pub(super) fn new() -> Arc<Self> {
        Arc::new(Self {
            born: Instant::now(),
            in_flight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(0),
            first_byte: AtomicU64::new(NO_BYTE),
            h2: AtomicBool::new(false),
            wake: Notify::new(),
        })
    }

    fn now(&self) -> u64 {
        self.born.elapsed().as_millis() as u64
    }

    fn saw_bytes(&self) {
        if self.in_flight.load(Ordering::Relaxed) == 0
            && self.first_byte.load(Ordering::Relaxed) == NO_BYTE
        {
            self.first_byte.store(self.now(), Ordering::Relaxed);
            self.wake.notify_one();
        }
    }

    pub(super) fn begin(self: &Arc<Self>, h2: bool) -> InFlight {
        if h2 {
            self.h2.store(true, Ordering::Relaxed);
        }
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        InFlight(self.clone())
    }

    /// Whether a request is in flight (its response not yet fully sent).
    pub(super) fn busy(&self) -> bool {
        self.in_flight.load(Ordering::Relaxed) > 0
    }

    /// Why the connection should close now, or how long until it might.
    fn check(&self, limits: &HttpConfig) -> Result<Duration, Closed> {
        let now = self.now();
        let idle = limits.idle_timeout_ms;
        if self.in_flight.load(Ordering::Relaxed) > 0 {
            return Ok(Duration::from_millis(idle));
        }
        let first = self.first_byte.load(Ordering::Relaxed);
        let (deadline, why) = if first != NO_BYTE && !self.h2.load(Ordering::Relaxed) {
            (first + limits.header_timeout_ms, Closed::HeaderTimeout)
        } else {
            (
                self.idle_since.load(Ordering::Relaxed) + idle,
                Closed::IdleTimeout,
            )
        };
        if now >= deadline {
            Err(why)
        } else {
            Ok(Duration::from_millis(deadline - now))
        }
    }
}

/// One request in flight; dropped when its response has been sent (or abandoned).
pub(super) struct InFlight(Arc<Activity>);

impl Drop for InFlight {
    fn drop(&mut self) {
        let a = &self.0;
        if a.in_flight.fetch_sub(1, Ordering::Relaxed) == 1 {
            a.idle_since.store(a.now(), Ordering::Relaxed);
            a.first_byte.store(NO_BYTE, Ordering::Relaxed);
            a.wake.notify_one();
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) enum Closed {
    HeaderTimeout,
    IdleTimeout,
}

impl Closed {
    pub(super) fn label(self) -> &'static str {
        match self {
            Closed::HeaderTimeout => "header_timeout",
            Closed::IdleTimeout => "idle_timeout",
        }
    }
}

/// A response body that keeps its request counted as in flight until it is fully sent.
pub(super) struct Tracked<B> {
    inner: B,
    _request: InFlight,
}

impl<B> Tracked<B> {
    pub(super) fn new(inner: B, request: InFlight) -> Self {
        Self {
            inner,
            _request: request,
        }
    }
}

impl<B: Body + Unpin> Body for Tracked<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

/// The connection's byte stream, reporting reads to its watchdog.
pub(super) struct Watched<S> {
    inner: S,
    activity: Arc<Activity>,
}

impl<S> Watched<S> {
    pub(super) fn new(inner: S, activity: Arc<Activity>) -> Self {
        Self { inner, activity }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Watched<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.saw_bytes();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Watched<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Resolves when the connection should close: headers too slow, or idle too long.
pub(super) async fn watchdog(activity: &Activity, limits: &HttpConfig) -> Closed {
    loop {
        match activity.check(limits) {
            Err(why) => return why,
            Ok(wait) => {
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    _ = activity.wake.notified() => {}
                }
            }
        }
    }
}

/// Reads a request body whole, up to `limit` bytes, within the body deadlines: each piece
/// within `body_timeout_ms` of the previous one, and the whole at `min_body_rate` bytes/s on
/// average after a first `body_timeout_ms` of grace.
pub(super) async fn collect_body(
    mut body: hyper::body::Incoming,
    limit: usize,
    limits: &HttpConfig,
) -> Result<Bytes, BodyError> {
    let start = tokio::time::Instant::now();
    let gap = Duration::from_millis(limits.body_timeout_ms);
    let mut buf = bytes::BytesMut::new();
    loop {
        let allowed = limits.min_body_rate.max(1) as f64;
        let by_rate = start + gap + Duration::from_secs_f64(buf.len() as f64 / allowed);
        let deadline = by_rate.min(tokio::time::Instant::now() + gap);
        let frame = match tokio::time::timeout_at(deadline, body.frame()).await {
            Err(_) => return Err(BodyError::TooSlow),
            Ok(None) => return Ok(buf.freeze()),
            Ok(Some(Err(e))) => return Err(BodyError::Broken(e.to_string())),
            Ok(Some(Ok(f))) => f,
        };
        if let Ok(data) = frame.into_data() {
            if buf.len() + data.len() > limit {
                return Err(BodyError::TooLarge);
            }
            buf.extend_from_slice(&data);
        }
    }
}

#[derive(Debug)]
pub(super) enum BodyError {
    TooLarge,
    TooSlow,
    Broken(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idle_and_header_deadlines() {
        let limits = HttpConfig {
            header_timeout_ms: 50,
            idle_timeout_ms: 1_000,
            ..HttpConfig::default()
        };
        let a = Activity::new();
        assert!(a.check(&limits).unwrap() > Duration::from_millis(900));
        a.saw_bytes();
        std::thread::sleep(Duration::from_millis(60));
        assert!(matches!(a.check(&limits), Err(Closed::HeaderTimeout)));
        let req = a.begin(false);
        assert!(
            a.check(&limits).is_ok(),
            "a request in flight is never idle"
        );
        drop(req);
        assert!(a.check(&limits).unwrap() > Duration::from_millis(900));
        // An h2 connection's frames between requests do not start the header clock.
        let r2 = a.begin(true);
        drop(r2);
        a.saw_bytes();
        std::thread::sleep(Duration::from_millis(60));
        assert!(a.check(&limits).is_ok());
    }
}
