//! Connections at the edge: accepting them (with a cap, per client address and overall, and a
//! backoff when the process runs out of file descriptors), the TLS handshake deadline, and
//! serving each under its watchdog (`deadlines`), which never closes a connection with a
//! request in flight: a generation that takes minutes before its first byte, or a stream that
//! writes slowly, is not cut.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use http_body_util::BodyExt;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::deadlines::{watchdog, Activity, Tracked, Watched};
use super::{handle, AppState, Listener, Response};

/// How long a connection asked to close (idle, header deadline, shutdown) may take to do so
/// while no request is in flight on it.
const CLOSE_GRACE: Duration = Duration::from_secs(1);
/// Accept errors back off from this delay, doubling up to `MAX_BACKOFF`.
const MIN_BACKOFF: Duration = Duration::from_millis(5);
const MAX_BACKOFF: Duration = Duration::from_secs(1);

/// The open connections of one listener: at most `max` in all and `per_client` from one
/// address. Each connection holds a `Slot` for its whole life, TLS handshake included.
pub struct Gate {
    open: Arc<Semaphore>,
    max: u32,
    per_client: usize,
    clients: Mutex<HashMap<IpAddr, usize>>,
}

pub struct Slot {
    gate: Arc<Gate>,
    ip: IpAddr,
    _permit: OwnedSemaphorePermit,
}

#[derive(Debug, Clone, Copy)]
enum Refusal {
    Full,
    Client,
}

impl Gate {
    pub fn new(max: usize, per_client: usize) -> Arc<Self> {
        let max = max.clamp(1, Semaphore::MAX_PERMITS.min(u32::MAX as usize)) as u32;
        Arc::new(Self {
            open: Arc::new(Semaphore::new(max as usize)),
            max,
            per_client,
            clients: Mutex::default(),
        })
    }

    fn admit(self: &Arc<Self>, ip: IpAddr) -> Result<Slot, Refusal> {
        let permit = self
            .open
            .clone()
            .try_acquire_owned()
            .map_err(|_| Refusal::Full)?;
        if self.per_client > 0 {
            let mut clients = self.clients.lock().unwrap_or_else(|e| e.into_inner());
            let n = clients.entry(ip).or_default();
            if *n >= self.per_client {
                return Err(Refusal::Client);
            }
            *n += 1;
        }
        Ok(Slot {
            gate: self.clone(),
            ip,
            _permit: permit,
        })
    }

    /// Resolves once every connection of this listener has closed.
    pub async fn drained(&self) {
        let _ = self.open.acquire_many(self.max).await;
    }

    #[cfg(test)]
    fn open_now(&self) -> usize {
        self.max as usize - self.open.available_permits()
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if self.gate.per_client == 0 {
            return;
        }
        let mut clients = self.gate.clients.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = clients.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                clients.remove(&self.ip);
            }
        }
    }
}

/// A log line at most once per second, counting what it held back.
#[derive(Default)]
pub struct Throttled {
    last: Mutex<Option<Instant>>,
    held: AtomicU64,
}

impl Throttled {
    /// Calls `log` with the number of lines held back since the last one, or holds this one.
    pub fn log(&self, log: impl FnOnce(u64)) {
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(1)) {
            self.held.fetch_add(1, Ordering::Relaxed);
            return;
        }
        *last = Some(Instant::now());
        log(self.held.swap(0, Ordering::Relaxed));
    }
}

/// Whether an accept error means the process (or system) is out of a resource, which
/// accepting again at once cannot fix.
fn exhausted(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

/// Accepts connections on `l` until `stop` turns true.
pub async fn accept_loop(
    l: Listener,
    state: Arc<AppState>,
    gate: Arc<Gate>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let throttled = Throttled::default();
    let mut backoff = MIN_BACKOFF;
    loop {
        let accepted = tokio::select! {
            a = l.tcp.accept() => a,
            _ = stop.changed() => return,
        };
        let (stream, peer) = match accepted {
            Ok(x) => {
                backoff = MIN_BACKOFF;
                x
            }
            Err(e) => {
                state.metrics.edge.accept_errors.inc();
                throttled.log(|held| tracing::warn!(error = %e, held_back = held, "accept failed"));
                // Out of descriptors, the listener stays readable: accepting again at once
                // would spin. Waiting gives connections in flight the time to close.
                if exhausted(&e) {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(MAX_BACKOFF);
                }
                continue;
            }
        };
        let slot = match gate.admit(peer.ip()) {
            Ok(s) => s,
            Err(why) => {
                refuse(stream, why, l.tls.is_some(), &state, &throttled, peer);
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let acceptor = l.tls.as_ref().map(|t| t.acceptor());
        let (state, stop, role) = (state.clone(), stop.clone(), l.role);
        state.metrics.edge.open_connections.inc();
        tokio::spawn(async move {
            let (limits, activity, metrics) =
                (state.http.clone(), Activity::new(), state.metrics.clone());
            match acceptor {
                Some(acceptor) => {
                    let handshake = Duration::from_millis(limits.tls_handshake_timeout_ms);
                    match tokio::time::timeout(handshake, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            serve_connection(tls, activity, state, (role, true), stop).await
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => {
                            metrics.edge.closed("tls_handshake_timeout");
                            tracing::debug!(%peer, "TLS handshake timed out");
                        }
                    }
                }
                None => serve_connection(stream, activity, state, (role, false), stop).await,
            }
            drop(slot);
            metrics.edge.open_connections.dec();
        });
    }
}

/// Turns a connection over the cap away: plain HTTP gets a 503 (or 429 for one client's
/// excess) it can read; TLS would need a handshake first, so it is just closed.
fn refuse(
    stream: TcpStream,
    why: Refusal,
    tls: bool,
    state: &AppState,
    throttled: &Throttled,
    peer: SocketAddr,
) {
    let (reason, status, message) = match why {
        Refusal::Full => (
            "max_connections",
            "503 Service Unavailable",
            "The gateway has reached its connection limit; retry shortly.",
        ),
        Refusal::Client => (
            "max_connections_per_client",
            "429 Too Many Requests",
            "Too many open connections from this address; reuse or close some.",
        ),
    };
    state
        .metrics
        .edge
        .refused
        .with_label_values(&[reason])
        .inc();
    throttled.log(|held| tracing::warn!(%peer, reason, held_back = held, "connection refused"));
    if !tls {
        let body = serde_json::json!({"error": {"message": message, "type": "server_error",
            "param": null, "code": reason}})
        .to_string();
        let head = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nretry-after: 1\r\nconnection: close\r\n\r\n",
            body.len()
        );
        // The socket's send buffer is empty: this does not block, and a client that does
        // not read it loses nothing but the explanation.
        let _ = stream.try_write(format!("{head}{body}").as_bytes());
    }
}

/// Serves one connection's requests until it closes, is closed by its watchdog, or the
/// gateway shuts down (which lets requests in flight finish).
async fn serve_connection<S>(
    io: S,
    activity: Arc<Activity>,
    state: Arc<AppState>,
    role: (super::Role, bool),
    mut stop: tokio::sync::watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let limits = state.http.clone();
    let io = TokioIo::new(Watched::new(io, activity.clone()));
    let svc_state = state.clone();
    let svc_activity = activity.clone();
    let svc = hyper::service::service_fn(move |req: http::Request<hyper::body::Incoming>| {
        let request = svc_activity.begin(req.version() == http::Version::HTTP_2);
        let handled = handle(svc_state.clone(), role, req);
        async move {
            let resp = handled.await?;
            Ok::<Response, Infallible>(
                resp.map(|inner| Tracked::new(inner, request).boxed_unsync()),
            )
        }
    });
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http2()
        .max_concurrent_streams(limits.h2_max_concurrent_streams);
    let conn = builder.serve_connection_with_upgrades(io, svc);
    tokio::pin!(conn);
    let closing = tokio::select! {
        r = conn.as_mut() => return ended(r),
        why = watchdog(&activity, &limits) => {
            state.metrics.edge.closed(why.label());
            true
        }
        _ = stop.wait_for(|s| *s) => false,
    };
    conn.as_mut().graceful_shutdown();
    loop {
        tokio::select! {
            r = conn.as_mut() => return ended(r),
            _ = tokio::time::sleep(CLOSE_GRACE) => {
                // A closed-for-idleness connection whose client still says nothing, or a
                // shutting-down one with nothing in flight, is dropped.
                if !activity.busy() && (closing || *stop.borrow()) {
                    return;
                }
            }
        }
    }
}

fn ended(r: Result<(), Box<dyn std::error::Error + Send + Sync>>) {
    if let Err(e) = r {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

/// Raises the soft limit on open files to the hard limit (as Go's runtime and most servers
/// do), and returns the soft limit now in force: connections are capped below it so that a
/// flood of clients cannot starve the gateway of descriptors for its own files.
pub fn raise_fd_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct passed by pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) != 0 {
            return None;
        }
        if lim.rlim_cur < lim.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: lim.rlim_max,
                rlim_max: lim.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                lim.rlim_cur = lim.rlim_max;
            }
        }
    }
    Some(lim.rlim_cur)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_caps_per_client_and_overall() {
        let gate = Gate::new(3, 2);
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let a1 = gate.admit(a).unwrap();
        let _a2 = gate.admit(a).unwrap();
        assert!(matches!(gate.admit(a), Err(Refusal::Client)));
        let _b1 = gate.admit(b).unwrap();
        assert!(matches!(gate.admit(b), Err(Refusal::Full)));
        assert_eq!(gate.open_now(), 3);
        drop(a1);
        assert_eq!(gate.open_now(), 2);
        let _a3 = gate.admit(a).unwrap();
    }
}
