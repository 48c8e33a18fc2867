//! Models served by other OpenAI-compatible servers: a pool of replicas per model, the choice
//! of a replica for each request (load, prefix affinity, health), and the HTTP client that
//! sends it. What the gateway does around the call (tenancy, RAG, plugins, ledger) is the
//! server's request pipeline, as for a local model.

mod pick;
mod probe;
mod replica;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use parking_lot::{Mutex, RwLock};

use crate::config::UpstreamConfig;
use crate::metrics::Metrics;
pub use pick::prefix_chain;
use replica::{Replica, Roster};

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

pub struct Pool {
    pub name: String,
    /// The model name sent upstream.
    pub model: String,
    pub cfg: UpstreamConfig,
    /// The replicas now (DNS entries change it), and how it is kept.
    replicas: RwLock<Vec<Arc<Replica>>>,
    roster: Mutex<Roster>,
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
        let mut roster = Roster::new(&cfg.replicas, !cfg.health_path.is_empty())?;
        let replicas = roster.initial()?;
        for r in &replicas {
            gauges(&metrics, &cfg.name, r);
        }
        Ok(Self {
            name: cfg.name.clone(),
            model: cfg.model.clone().unwrap_or_else(|| cfg.name.clone()),
            key: bearer_key(&cfg)?,
            client: client.build()?,
            replicas: RwLock::new(replicas),
            roster: Mutex::new(roster),
            affinity: Mutex::new(pick::Affinity::new(100_000)),
            turn: AtomicUsize::new(0),
            cfg,
            metrics,
        })
    }

    /// Each replica as an admin sees it: address, health and load.
    pub fn replicas_view(&self) -> Vec<serde_json::Value> {
        let now = Instant::now();
        self.replicas
            .read()
            .iter()
            .map(|r| {
                let n = |a: &AtomicUsize| a.load(Ordering::Relaxed);
                serde_json::json!({
                    "url": r.label,
                    "healthy": r.healthy.load(Ordering::Relaxed),
                    "available": r.available(now),
                    "in_flight": n(&r.outstanding),
                    "running": n(&r.running),
                    "waiting": n(&r.waiting),
                    "kv_usage": n(&r.kv_milli) as f64 / 1000.0,
                    "failures": r.failures.load(Ordering::Relaxed),
                })
            })
            .collect()
    }

    /// Every available replica has more than `saturated_waiting` requests queued (or none is
    /// available): the time to send new requests down the fallback chain.
    pub fn saturated(&self) -> bool {
        let now = Instant::now();
        let limit = self.cfg.saturated_waiting;
        let replicas = self.replicas.read();
        let mut open = replicas.iter().filter(|r| r.available(now)).peekable();
        open.peek().is_none()
            || (limit > 0 && open.all(|r| r.waiting.load(Ordering::Relaxed) > limit))
    }

    /// A replica for a request whose prompt has the prefix `chain`, skipping those in `tried`
    /// (replica ids). None when no replica is available.
    pub fn pick(self: &Arc<Self>, chain: &[u64], tried: &[usize]) -> Option<Lease> {
        let now = Instant::now();
        let replicas = self.replicas.read().clone();
        let loads: Vec<Option<usize>> = replicas
            .iter()
            .map(|r| {
                (r.available(now) && !tried.contains(&r.id)).then(|| r.load(self.cfg.balance_abs))
            })
            .collect();
        let affine = match self.cfg.prefix_affinity && !chain.is_empty() {
            true => self.affinity.lock().lookup(chain),
            false => None,
        };
        // The affinity table holds replica ids; the rule takes positions.
        let affine = affine
            .and_then(|(id, len)| replicas.iter().position(|r| r.id == id).map(|at| (at, len)));
        let turn = self.turn.fetch_add(1, Ordering::Relaxed);
        let rule = pick::Balance {
            abs: self.cfg.balance_abs,
            rel: self.cfg.balance_rel,
        };
        let (at, by_prefix) = rule.choose(&loads, affine, turn)?;
        let replica = replicas[at].clone();
        if self.cfg.prefix_affinity && !chain.is_empty() {
            self.affinity.lock().insert(chain, replica.id);
        }
        let kind = if by_prefix { "prefix" } else { "load" };
        self.metrics
            .upstream
            .picks
            .with_label_values(&[&self.name, &replica.label, kind])
            .inc();
        replica.outstanding.fetch_add(1, Ordering::Relaxed);
        self.outstanding_gauge(&replica);
        Some(Lease {
            pool: self.clone(),
            replica,
        })
    }

    fn outstanding_gauge(&self, r: &Replica) {
        self.metrics
            .upstream
            .outstanding
            .with_label_values(&[&self.name, &r.label])
            .set(r.outstanding.load(Ordering::Relaxed) as i64);
    }

    /// Re-resolves the DNS entries and updates the replicas; series of replicas that left
    /// are dropped from `/metrics`.
    async fn discover(&self) {
        let lookups = self.roster.lock().lookups();
        if lookups.is_empty() {
            return;
        }
        let resolved = replica::resolve(&lookups).await;
        let mut roster = self.roster.lock();
        let mut replicas = self.replicas.write();
        let (now, gone) = roster.merge(&replicas, &resolved);
        for r in now
            .iter()
            .filter(|r| !replicas.iter().any(|o| o.id == r.id))
        {
            tracing::info!(model = %self.name, replica = %r.url, "upstream replica discovered");
            gauges(&self.metrics, &self.name, r);
        }
        for r in &gone {
            tracing::info!(model = %self.name, replica = %r.url, "upstream replica left");
            let m = &self.metrics.upstream;
            let labels = [self.name.as_str(), r.label.as_str()];
            let _ = m.up.remove_label_values(&labels);
            let _ = m.outstanding.remove_label_values(&labels);
        }
        *replicas = now;
    }

    fn eject(&self, r: &Replica, why: &str) {
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
    replica: Arc<Replica>,
}

impl Lease {
    /// The replica's id in its pool.
    pub fn id(&self) -> usize {
        self.replica.id
    }

    pub fn label(&self) -> &str {
        &self.replica.label
    }

    /// POSTs `body` (JSON) to `path` under the replica's base URL and waits for the response
    /// head, within the first-token timeout. An error status is read whole (bounded), so
    /// the caller can pass it on or retry elsewhere.
    pub async fn send(&self, path: &str, body: Bytes) -> Result<reqwest::Response, SendError> {
        let pool = &self.pool;
        let replica = &self.replica;
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
            Err(e) if e.retryable() => pool.eject(replica, &code),
            Err(_) => {}
        }
        result
    }

    /// The stream broke or stalled after it started: the replica is suspect.
    pub fn failed_midway(&self, why: &str) {
        self.pool.eject(&self.replica, why);
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.replica.outstanding.fetch_sub(1, Ordering::Relaxed);
        self.pool.outstanding_gauge(&self.replica);
    }
}

/// A new replica's series, so that `/metrics` lists it before its first request.
fn gauges(metrics: &Metrics, model: &str, r: &Replica) {
    let labels = [model, r.label.as_str()];
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

/// The bearer key sent upstream: `api_key`, else the variable `api_key_env` names (read once,
/// when the pool is built).
fn bearer_key(cfg: &UpstreamConfig) -> anyhow::Result<Option<String>> {
    match (&cfg.api_key, &cfg.api_key_env) {
        (Some(k), _) => Ok(Some(k.clone())),
        (None, Some(var)) => std::env::var(var).map(Some).map_err(|_| {
            anyhow::anyhow!(
                "upstreams.{}: api_key_env names {var}, which is not set",
                cfg.name
            )
        }),
        (None, None) => Ok(None),
    }
}
