//! Models served by other OpenAI-compatible servers: a pool of replicas per model, the choice
//! of a replica for each request (load, prefix affinity, health), and the HTTP client that
//! sends it. What the gateway does around the call (tenancy, RAG, plugins, ledger) is the
//! server's request pipeline, as for a local model.

mod pick;
mod probe;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use parking_lot::Mutex;

use crate::config::UpstreamConfig;
use crate::metrics::Metrics;
pub use pick::prefix_chain;

/// Every upstream model, by the name clients use.
#[derive(Default)]
pub struct Upstreams {
    pools: BTreeMap<String, Arc<Pool>>,
}

impl Upstreams {
    pub fn new(cfgs: &[UpstreamConfig], metrics: &Arc<Metrics>) -> anyhow::Result<Self> {
        let mut pools = BTreeMap::new();
        for cfg in cfgs {
            let pool = Pool::new(cfg.clone(), metrics.clone())
                .with_context(|| format!("upstreams.{}", cfg.name))?;
            pools.insert(cfg.name.clone(), Arc::new(pool));
        }
        Ok(Self { pools })
    }

    /// Probes every replica once (so that the first requests find the healthy ones), then
    /// starts each pool's probe loop (health and load) on the current runtime. The loops end
    /// when their pool is dropped.
    pub async fn start_probes(&self) {
        futures_util::future::join_all(self.pools.values().map(|p| probe::all(p))).await;
        for pool in self.pools.values() {
            probe::spawn(pool);
        }
    }

    pub fn get(&self, name: &str) -> Option<&Arc<Pool>> {
        self.pools.get(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &String> {
        self.pools.keys()
    }
}

/// One replica's state as the pool sees it.
struct Replica {
    /// Base URL as an OpenAI client takes it (`…/v1`), without a trailing slash.
    url: String,
    /// `scheme://host:port`, for the probes.
    origin: String,
    /// Label in metrics and response headers: its position in the config.
    label: String,
    /// Requests this gateway has in flight there.
    outstanding: AtomicUsize,
    /// From its `/metrics`: waiting and running requests, KV usage in thousandths.
    waiting: AtomicUsize,
    running: AtomicUsize,
    kv_milli: AtomicUsize,
    /// The last health probe answered 2xx (always true without probes).
    healthy: AtomicBool,
    /// Failures in a row; each doubles the ejection, up to 16×.
    failures: AtomicU32,
    ejected_until: Mutex<Option<Instant>>,
}

impl Replica {
    fn available(&self, now: Instant) -> bool {
        self.healthy.load(Ordering::Relaxed) && self.ejected_until.lock().is_none_or(|t| now >= t)
    }

    /// What the picker weighs: the busier of our own count and the replica's report (which
    /// includes other clients, but is up to a probe interval old), plus its queue again (a
    /// queued request is worse than a running one), plus a step when its KV cache is full.
    fn load(&self, full_step: usize) -> usize {
        let waiting = self.waiting.load(Ordering::Relaxed);
        let reported = self.running.load(Ordering::Relaxed) + waiting;
        let kv_full = self.kv_milli.load(Ordering::Relaxed) >= 950;
        self.outstanding.load(Ordering::Relaxed).max(reported)
            + waiting
            + if kv_full { full_step } else { 0 }
    }
}

pub struct Pool {
    pub name: String,
    /// The model name sent upstream.
    pub model: String,
    pub cfg: UpstreamConfig,
    replicas: Vec<Replica>,
    client: reqwest::Client,
    key: Option<String>,
    affinity: Mutex<pick::Affinity>,
    /// Rotates ties among equally loaded replicas.
    turn: AtomicUsize,
    metrics: Arc<Metrics>,
}

/// Why a replica gave no usable answer.
#[derive(Debug)]
pub enum SendError {
    /// Connection refused or reset, or closed before the response head: nothing started.
    Connect(String),
    /// No response head within `first_token_timeout_ms`.
    Timeout,
    /// An answer with this error status and body.
    Status(http::StatusCode, Bytes),
}

impl SendError {
    /// Worth trying another replica: the request never started there, or the replica is
    /// overloaded or failing. A 4xx other than 429 is the request's own fault.
    pub fn retryable(&self) -> bool {
        match self {
            Self::Connect(_) | Self::Timeout => true,
            Self::Status(s, _) => Self::retryable_status(*s),
        }
    }

    pub fn retryable_status(s: http::StatusCode) -> bool {
        s.is_server_error() || s == http::StatusCode::TOO_MANY_REQUESTS
    }
}

impl Pool {
    fn new(cfg: UpstreamConfig, metrics: Arc<Metrics>) -> anyhow::Result<Self> {
        let mut client = reqwest::Client::builder()
            .connect_timeout(Duration::from_millis(cfg.connect_timeout_ms))
            .pool_idle_timeout(Duration::from_secs(60))
            .tcp_nodelay(true)
            .redirect(reqwest::redirect::Policy::none());
        if let Some(ca) = &cfg.ca {
            let pem = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
            client = client.add_root_certificate(reqwest::Certificate::from_pem(&pem)?);
        }
        let replicas = cfg
            .replicas
            .iter()
            .enumerate()
            .map(|(i, url)| {
                let uri: http::Uri = url.parse().context("replica URL")?;
                let origin = format!(
                    "{}://{}",
                    uri.scheme_str().unwrap_or("http"),
                    uri.authority().context("replica URL has no host")?
                );
                Ok(Replica {
                    url: url.trim_end_matches('/').to_string(),
                    origin,
                    label: i.to_string(),
                    outstanding: AtomicUsize::new(0),
                    waiting: AtomicUsize::new(0),
                    running: AtomicUsize::new(0),
                    kv_milli: AtomicUsize::new(0),
                    // With probes, a replica takes requests once one has answered.
                    healthy: AtomicBool::new(cfg.health_path.is_empty()),
                    failures: AtomicU32::new(0),
                    ejected_until: Mutex::new(None),
                })
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        for r in &replicas {
            let labels = [cfg.name.as_str(), r.label.as_str()];
            let up = r.healthy.load(Ordering::Relaxed);
            metrics
                .upstream
                .up
                .with_label_values(&labels)
                .set(up as i64);
            metrics
                .upstream
                .outstanding
                .with_label_values(&labels)
                .set(0);
        }
        Ok(Self {
            name: cfg.name.clone(),
            model: cfg.model.clone().unwrap_or_else(|| cfg.name.clone()),
            key: cfg.key().map_err(anyhow::Error::msg)?,
            client: client.build()?,
            replicas,
            affinity: Mutex::new(pick::Affinity::new(100_000)),
            turn: AtomicUsize::new(0),
            cfg,
            metrics,
        })
    }

    /// Every available replica has more than `saturated_waiting` requests queued (or none is
    /// available): the time to send new requests down the fallback chain.
    pub fn saturated(&self) -> bool {
        let now = Instant::now();
        let limit = self.cfg.saturated_waiting;
        let mut open = self.replicas.iter().filter(|r| r.available(now)).peekable();
        open.peek().is_none()
            || (limit > 0 && open.all(|r| r.waiting.load(Ordering::Relaxed) > limit))
    }

    /// A replica for a request whose prompt has the prefix `chain`, skipping those in `tried`.
    /// None when no replica is available.
    pub fn pick(self: &Arc<Self>, chain: &[u64], tried: &[usize]) -> Option<Lease> {
        let now = Instant::now();
        let loads: Vec<Option<usize>> = self
            .replicas
            .iter()
            .enumerate()
            .map(|(i, r)| {
                (r.available(now) && !tried.contains(&i)).then(|| r.load(self.cfg.balance_abs))
            })
            .collect();
        let affine = match self.cfg.prefix_affinity && !chain.is_empty() {
            true => self.affinity.lock().lookup(chain),
            false => None,
        };
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let rule = pick::Balance {
            abs: self.cfg.balance_abs,
            rel: self.cfg.balance_rel,
        };
        let (index, by_prefix) = rule.choose(&loads, affine, turn)?;
        if self.cfg.prefix_affinity && !chain.is_empty() {
            self.affinity.lock().insert(chain, index);
        }
        let kind = if by_prefix { "prefix" } else { "load" };
        let replica = &self.replicas[index];
        self.metrics
            .upstream
            .picks
            .with_label_values(&[&self.name, &replica.label, kind])
            .inc();
        replica.outstanding.fetch_add(1, Ordering::Relaxed);
        self.outstanding_gauge(index);
        Some(Lease {
            pool: self.clone(),
            index,
        })
    }

    fn outstanding_gauge(&self, index: usize) {
        let r = &self.replicas[index];
        self.metrics
            .upstream
            .outstanding
            .with_label_values(&[&self.name, &r.label])
            .set(r.outstanding.load(Ordering::Relaxed) as i64);
    }

    fn eject(&self, index: usize, why: &str) {
        let r = &self.replicas[index];
        let failures = r.failures.fetch_add(1, Ordering::Relaxed).min(4);
        let cool = Duration::from_millis(self.cfg.eject_ms) * (1 << failures);
        *r.ejected_until.lock() = Some(Instant::now() + cool);
        self.metrics
            .upstream
            .ejections
            .with_label_values(&[&self.name, &r.label])
            .inc();
        tracing::warn!(model = %self.name, replica = %r.url, why, cool_ms = cool.as_millis() as u64, "upstream replica ejected");
    }
}

/// A request's hold on one replica: counted in its outstanding requests until dropped.
pub struct Lease {
    pool: Arc<Pool>,
    index: usize,
}

impl Lease {
    pub fn index(&self) -> usize {
        self.index
    }

    pub fn label(&self) -> &str {
        &self.pool.replicas[self.index].label
    }

    /// POSTs `body` (JSON) to `path` under the replica's base URL and waits for the response
    /// head, within the first-token timeout. An error status is read whole (bounded), so
    /// the caller can pass it on or retry elsewhere.
    pub async fn send(&self, path: &str, body: Bytes) -> Result<reqwest::Response, SendError> {
        let pool = &self.pool;
        let replica = &pool.replicas[self.index];
        let mut req = pool
            .client
            .post(format!("{}{path}", replica.url))
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(k) = &pool.key {
            req = req.bearer_auth(k);
        }
        let limit = Duration::from_millis(pool.cfg.first_token_timeout_ms);
        let result = match tokio::time::timeout(limit, req.send()).await {
            Err(_) => Err(SendError::Timeout),
            Ok(Err(e)) => Err(SendError::Connect(error_chain(&e))),
            Ok(Ok(r)) if r.status().is_success() => Ok(r),
            Ok(Ok(r)) => {
                let status = r.status();
                let body = read_capped(r, 64 << 10).await;
                Err(SendError::Status(status, body))
            }
        };
        let code = match &result {
            Ok(r) => r.status().as_str().to_string(),
            Err(SendError::Status(s, _)) => s.as_str().to_string(),
            Err(SendError::Timeout) => "timeout".into(),
            Err(SendError::Connect(_)) => "connect".into(),
        };
        pool.metrics
            .upstream
            .requests
            .with_label_values(&[&pool.name, &replica.label, &code])
            .inc();
        match &result {
            Ok(_) => replica.failures.store(0, Ordering::Relaxed),
            Err(SendError::Status(s, _)) if *s == http::StatusCode::TOO_MANY_REQUESTS => {}
            Err(e) if e.retryable() => pool.eject(self.index, &code),
            Err(_) => {}
        }
        result
    }

    /// The stream broke or stalled after it started: the replica is suspect.
    pub fn failed_midway(&self, why: &str) {
        self.pool.eject(self.index, why);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.pool.replicas[self.index]
            .outstanding
            .fetch_sub(1, Ordering::Relaxed);
        self.pool.outstanding_gauge(self.index);
    }
}

/// An error and its causes on one line: reqwest's own message alone says little
/// ("error sending request").
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// The first `cap` bytes of a response body (an error's body, or a probe's), or what
/// arrived before it broke.
async fn read_capped(mut r: reqwest::Response, cap: usize) -> Bytes {
    let mut out = Vec::new();
    while let Ok(Some(chunk)) = r.chunk().await {
        let room = cap.saturating_sub(out.len());
        out.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if out.len() >= cap {
            break;
        }
    }
    out.into()
}
