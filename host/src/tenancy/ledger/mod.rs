//! The usage ledger: one row per request, in SQLite (one machine) or PostgreSQL (replicas
//! sharing one ledger), written by a thread of its own in batched transactions, read for
//! budgets and for `/admin/usage`.
//!
//! A billable row is never dropped. A batch that cannot be committed (disk full, I/O error,
//! the database unreachable) is appended to a local spill file instead, and replayed into the
//! store once it accepts writes again;
//! while neither works, the rows wait in memory and `accepting()` turns false, so the gateway
//! refuses new billable requests (503) rather than serve them unbilled. Every row carries a
//! random id, inserted with `OR IGNORE`, so a replay interrupted by a crash counts nothing
//! twice.

mod postgres;
mod spill;
mod sqlite;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::policy::Period;

#[derive(Debug, Clone)]
pub struct Record {
    /// Unix seconds when the request arrived.
    pub ts: i64,
    pub tenant: String,
    pub key_id: String,
    pub model: String,
    pub endpoint: &'static str,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub latency_ms: f64,
    /// `ok`, `cancelled`, `error`, `shutdown`, `cached` (`Outcome::as_str`).
    pub status: &'static str,
    pub plugin_ms: f64,
}

/// A row as stored (and spilled): owned, with its id.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Row {
    rid: String,
    ts: i64,
    tenant: String,
    key_id: String,
    model: String,
    endpoint: String,
    prompt_tokens: u64,
    completion_tokens: u64,
    latency_ms: f64,
    status: String,
    plugin_ms: f64,
}

impl From<Record> for Row {
    fn from(r: Record) -> Self {
        Row {
            rid: format!("{:032x}", rand::random::<u128>()),
            ts: r.ts,
            tenant: r.tenant,
            key_id: r.key_id,
            model: r.model,
            endpoint: r.endpoint.into(),
            prompt_tokens: r.prompt_tokens,
            completion_tokens: r.completion_tokens,
            latency_ms: r.latency_ms,
            status: r.status.into(),
            plugin_ms: r.plugin_ms,
        }
    }
}

enum Msg {
    Write(Record),
    Flush(mpsc::Sender<()>),
}

/// How the writer is doing, for admission and `/metrics`.
#[derive(Default)]
pub struct Health {
    /// Neither the store nor the spill file takes writes: rows wait in memory.
    failing: AtomicBool,
    /// Rows held in memory, not yet on disk.
    pending: AtomicUsize,
    /// Rows in the spill file, waiting to be replayed into the store.
    spilled: AtomicUsize,
    /// Batches that the store refused.
    write_failures: AtomicU64,
}

impl Health {
    pub fn pending_rows(&self) -> usize {
        self.pending.load(Ordering::Relaxed)
    }

    pub fn spilled_rows(&self) -> usize {
        self.spilled.load(Ordering::Relaxed)
    }

    pub fn write_failures(&self) -> u64 {
        self.write_failures.load(Ordering::Relaxed)
    }

    pub fn failing(&self) -> bool {
        self.failing.load(Ordering::Relaxed)
    }
}

/// Where failed batches go and what to do when nothing can be written.
#[derive(Debug, Clone)]
pub struct Durability {
    /// The spill file (JSON lines). Best on another filesystem than the ledger.
    pub spill: PathBuf,
    /// Refuse billable requests while no row can be written (else serve them, holding up to
    /// `MAX_PENDING` rows in memory).
    pub refuse_when_failing: bool,
    /// The spill file takes no more than this: a store away for long must not fill the disk.
    pub spill_max_bytes: u64,
}

impl Durability {
    /// Beside the ledger, refusing when failing.
    pub fn beside(ledger: &Path) -> Self {
        Self {
            spill: ledger.with_extension("spill.jsonl"),
            refuse_when_failing: true,
            spill_max_bytes: 1 << 30,
        }
    }
}

pub struct Ledger {
    tx: Mutex<Option<mpsc::Sender<Msg>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    reader: Mutex<Box<dyn Query>>,
    health: Arc<Health>,
    refuse_when_failing: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    #[error("usage ledger (SQLite): {0}")]
    Sqlite(#[from] rusqlite::Error),
    #[error("usage ledger (PostgreSQL): {0}")]
    Postgres(#[from] ::postgres::Error),
    #[error("usage ledger: {0}")]
    Io(#[from] std::io::Error),
}

/// Where committed rows live.
trait Store: Send {
    /// Commits all of `rows` or none; rows already there (same `rid`) are skipped.
    fn commit(&mut self, rows: &[Row]) -> Result<(), LedgerError>;
}

/// Reads for budgets and `/admin/usage`.
trait Query: Send {
    /// The period containing `now` as [start, end) Unix seconds (UTC), and the tokens the
    /// tenant used in it so far.
    fn period_usage(
        &mut self,
        tenant: &str,
        period: Period,
        now: i64,
    ) -> Result<(i64, i64, u64), LedgerError>;

    fn usage(
        &mut self,
        tenant: Option<&str>,
        from: i64,
        to: i64,
        by_model: bool,
    ) -> Result<Vec<serde_json::Value>, LedgerError>;
}

/// One `/admin/usage` row; `counts` are requests, prompt, completion, failed requests and
/// requests answered from the response cache.
fn usage_row(
    by_model: bool,
    tenant: String,
    group: String,
    counts: [i64; 5],
    mean_latency_ms: f64,
    plugin_ms: f64,
) -> serde_json::Value {
    let [requests, prompt, completion, failed, cached] = counts;
    serde_json::json!({
        "tenant": tenant,
        if by_model { "model" } else { "day" }: group,
        "requests": requests,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "failed_requests": failed,
        "cached_requests": cached,
        "mean_latency_ms": mean_latency_ms,
        "plugin_ms": plugin_ms,
    })
}

impl Ledger {
    /// Opens (or creates) the SQLite ledger at `path`; `:memory:`-like use is not supported,
    /// the ledger is meant to survive restarts.
    pub fn open(path: &Path, durability: Durability) -> Result<Self, LedgerError> {
        let (store, reader) = sqlite::open(path)?;
        Self::start(Box::new(store), Box::new(reader), durability)
    }

    /// The ledger in the PostgreSQL database at `url` (`postgres://…`), shared with the other
    /// replicas. Starts even while the database is unreachable: rows spill until it answers.
    pub fn open_postgres(url: &str, durability: Durability) -> Result<Self, LedgerError> {
        Self::start(
            Box::new(postgres::Postgres::new(url)),
            Box::new(postgres::Postgres::new(url)),
            durability,
        )
    }

    fn start(
        store: Box<dyn Store>,
        reader: Box<dyn Query>,
        durability: Durability,
    ) -> Result<Self, LedgerError> {
        let (tx, rx) = mpsc::channel::<Msg>();
        let health = Arc::new(Health::default());
        let mut writer = Writer {
            store,
            spill: durability.spill,
            spill_max_bytes: durability.spill_max_bytes,
            health: health.clone(),
            pending: Vec::new(),
            retry_at: None,
            backoff: RETRY_MIN,
        };
        writer
            .health
            .spilled
            .store(spill::count(&writer.spill), Ordering::Relaxed);
        // Rows a previous run spilled go in before anything is served. On a thread of its own:
        // a store's blocking client may not run on a thread of the async runtime.
        std::thread::scope(|s| {
            let _ = s.spawn(|| writer.replay()).join();
        });
        let writer = std::thread::Builder::new()
            .name("usage-ledger".into())
            .spawn(move || writer.run(rx))?;
        Ok(Self {
            tx: Mutex::new(Some(tx)),
            writer: Mutex::new(Some(writer)),
            reader: Mutex::new(reader),
            health,
            refuse_when_failing: durability.refuse_when_failing,
        })
    }

    pub fn health(&self) -> &Health {
        &self.health
    }

    /// False while no row can be written and the policy is to refuse: billable requests
    /// must then be turned away.
    pub fn accepting(&self) -> bool {
        !(self.refuse_when_failing && self.health.failing())
    }

    pub fn record(&self, r: Record) {
        if let Some(tx) = &*self.tx.lock().unwrap_or_else(|e| e.into_inner()) {
            let _ = tx.send(Msg::Write(r));
        }
    }

    /// Returns once everything recorded so far is committed.
    pub fn flush(&self) {
        let (done, wait) = mpsc::channel();
        if let Some(tx) = &*self.tx.lock().unwrap_or_else(|e| e.into_inner()) {
            if tx.send(Msg::Flush(done)).is_ok() {
                let _ = wait.recv();
            }
        }
    }

    /// Flushes and stops the writer (at shutdown).
    pub fn close(&self) {
        self.tx.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(h) = self.writer.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = h.join();
        }
    }

    /// The current period containing `now` as [start, end) Unix seconds, and the tokens the
    /// tenant used in it so far.
    pub fn period_usage(
        &self,
        tenant: &str,
        period: Period,
        now: i64,
    ) -> Result<(i64, i64, u64), LedgerError> {
        let mut reader = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        reader.period_usage(tenant, period, now)
    }

    /// Usage rows between `from` and `to` (Unix seconds, `to` exclusive), optionally for one
    /// tenant, grouped by tenant and day or model.
    pub fn usage(
        &self,
        tenant: Option<&str>,
        from: i64,
        to: i64,
        by_model: bool,
    ) -> Result<Vec<serde_json::Value>, LedgerError> {
        let mut reader = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        reader.usage(tenant, from, to, by_model)
    }
}

/// How long records wait to be committed. The writer polls instead of blocking on the
/// channel, so recording a request never wakes a thread (a futex wake and a context switch per
/// request were most of the admission overhead at 1,000 requests/s on two cores).
const BATCH_INTERVAL: Duration = Duration::from_millis(20);
/// After a failed write, retry after this long, doubling up to `RETRY_MAX`.
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);
/// Rows held in memory when serving while failing; beyond, the oldest are dropped (logged).
const MAX_PENDING: usize = 1_000_000;

struct Writer {
    store: Box<dyn Store>,
    spill: PathBuf,
    spill_max_bytes: u64,
    health: Arc<Health>,
    /// Rows neither the store nor the spill file took.
    pending: Vec<Row>,
    retry_at: Option<Instant>,
    backoff: Duration,
}

impl Writer {
    fn run(mut self, rx: mpsc::Receiver<Msg>) {
        loop {
            std::thread::sleep(BATCH_INTERVAL);
            let mut flushed = Vec::new();
            let open = loop {
                match rx.try_recv() {
                    Ok(Msg::Write(r)) => self.pending.push(r.into()),
                    Ok(Msg::Flush(done)) => flushed.push(done),
                    Err(mpsc::TryRecvError::Empty) => break true,
                    Err(mpsc::TryRecvError::Disconnected) => break false,
                }
            };
            if !open {
                self.retry_at = None;
            }
            self.write();
            for done in flushed {
                let _ = done.send(());
            }
            if !open {
                if !self.pending.is_empty() {
                    tracing::error!(rows = self.pending.len(), spill = %self.spill.display(), "usage ledger: rows could not be written at shutdown, neither to the ledger nor to the spill file");
                }
                return;
            }
        }
    }

    /// Writes what is pending: into the store when it takes writes (replaying the spill file
    /// first), else into the spill file at once. Only the store's retries back off: rows never wait
    /// in memory for a retry while the spill file works.
    fn write(&mut self) {
        let due = self.retry_at.is_none_or(|t| Instant::now() >= t);
        // While spilled rows cannot be replayed, the store is still refusing: new rows follow
        // them to the spill file without another try.
        let replayed = due && self.replay();
        let rows = std::mem::take(&mut self.pending);
        if !rows.is_empty() {
            let committed = replayed
                && self
                    .store
                    .commit(&rows)
                    .map_err(|e| {
                        self.health.write_failures.fetch_add(1, Ordering::Relaxed);
                        tracing::error!(error = %e, rows = rows.len(), "usage ledger write failed; spilling the rows");
                    })
                    .is_ok();
            if !committed {
                self.spill_or_keep(rows);
            }
        }
        let failing = !self.pending.is_empty();
        if due {
            if failing || self.health.spilled_rows() > 0 {
                self.retry_at = Some(Instant::now() + self.backoff);
                self.backoff = (self.backoff * 2).min(RETRY_MAX);
            } else {
                self.retry_at = None;
                self.backoff = RETRY_MIN;
            }
        }
        if self.health.failing.swap(failing, Ordering::Relaxed) != failing {
            if failing {
                tracing::error!(rows = self.pending.len(), spill = %self.spill.display(), "usage ledger: neither the ledger nor the spill file takes writes; holding rows in memory and refusing billable requests");
            } else {
                tracing::warn!("usage ledger writable again");
            }
        }
        self.health
            .pending
            .store(self.pending.len(), Ordering::Relaxed);
    }

    fn spill_or_keep(&mut self, rows: Vec<Row>) {
        match spill::append(&self.spill, &rows, self.spill_max_bytes) {
            Ok(()) => {
                self.health.spilled.fetch_add(rows.len(), Ordering::Relaxed);
            }
            Err(e) => {
                // Said once per failing spell (by `write`), not once per 20 ms retry.
                if !self.health.failing() {
                    tracing::error!(error = %e, spill = %self.spill.display(), "usage ledger spill failed too");
                }
                self.pending = rows;
                if self.pending.len() > MAX_PENDING {
                    let drop = self.pending.len() - MAX_PENDING;
                    tracing::error!(
                        rows = drop,
                        "usage ledger: dropping the oldest rows held in memory"
                    );
                    self.pending.drain(..drop);
                }
            }
        }
    }

    /// Moves the spill file's rows into the store; true when nothing is left to replay.
    fn replay(&mut self) -> bool {
        if self.health.spilled_rows() == 0 {
            return true;
        }
        let rows = match spill::read(&self.spill) {
            Ok(rows) => rows,
            Err(e) => {
                tracing::error!(error = %e, spill = %self.spill.display(), "cannot read the usage ledger spill file");
                return false;
            }
        };
        if let Err(e) = self.store.commit(&rows) {
            tracing::debug!(error = %e, "usage ledger still refuses writes");
            return false;
        }
        if let Err(e) = std::fs::remove_file(&self.spill) {
            tracing::error!(error = %e, "cannot remove the replayed spill file (its rows will be ignored when replayed again)");
        }
        tracing::info!(rows = rows.len(), "usage ledger: spilled rows replayed");
        self.health.spilled.store(0, Ordering::Relaxed);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_survive_reopening_and_aggregate() {
        let dir = std::env::temp_dir().join(format!(
            "ledger-test-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        let path = dir.join("usage.sqlite");
        let rec = |ts, tenant: &str, model: &str, p, c| Record {
            ts,
            tenant: tenant.into(),
            key_id: "k".into(),
            model: model.into(),
            endpoint: "chat",
            prompt_tokens: p,
            completion_tokens: c,
            latency_ms: 10.0,
            status: "ok",
            plugin_ms: 0.0,
        };
        let l = Ledger::open(&path, Durability::beside(&path)).unwrap();
        // 2024-03-10 and 2024-03-11 (UTC).
        l.record(rec(1_710_072_000, "a", "m1", 10, 5));
        l.record(rec(1_710_158_400, "a", "m2", 1, 2));
        l.record(rec(1_710_158_400, "b", "m1", 100, 100));
        l.close();
        let l = Ledger::open(&path, Durability::beside(&path)).unwrap();
        let (start, end, used) = l.period_usage("a", Period::Day, 1_710_160_000).unwrap();
        assert_eq!((start, end, used), (1_710_115_200, 1_710_201_600, 3));
        assert_eq!(
            l.period_usage("a", Period::Month, 1_710_160_000).unwrap().2,
            18
        );
        let days = l.usage(Some("a"), 0, i64::MAX, false).unwrap();
        assert_eq!(days.len(), 2);
        assert_eq!(days[0]["day"], "2024-03-10");
        assert_eq!(days[0]["total_tokens"], 15);
        let models = l.usage(None, 0, i64::MAX, true).unwrap();
        assert_eq!(models.len(), 3);
        l.close();
        let _ = std::fs::remove_dir_all(dir);
    }
}
