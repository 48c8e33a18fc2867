//! The usage ledger: one row per request in SQLite (WAL mode), written by a thread of its own
//! in batched transactions, read for budgets at start-up and for `/admin/usage`.
//!
//! A billable row is never dropped. A batch that cannot be committed (disk full, I/O error)
//! is appended to a spill file instead, and replayed into SQLite once it accepts writes again;
//! while neither works, the rows wait in memory and `accepting()` turns false, so the gateway
//! refuses new billable requests (503) rather than serve them unbilled. Every row carries a
//! random id, inserted with `OR IGNORE`, so a replay interrupted by a crash counts nothing
//! twice.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use rusqlite::{params, Connection};

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
    /// `ok`, `cancelled`, `error`, `shutdown` (`Outcome::as_str`).
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
    /// Neither SQLite nor the spill file takes writes: rows wait in memory.
    failing: AtomicBool,
    /// Rows held in memory, not yet on disk.
    pending: AtomicUsize,
    /// Rows in the spill file, waiting to be replayed into SQLite.
    spilled: AtomicUsize,
    /// Batches that SQLite refused.
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
}

impl Durability {
    /// Beside the ledger, refusing when failing.
    pub fn beside(ledger: &Path) -> Self {
        Self {
            spill: ledger.with_extension("spill.jsonl"),
            refuse_when_failing: true,
        }
    }
}

pub struct Ledger {
    tx: Mutex<Option<mpsc::Sender<Msg>>>,
    writer: Mutex<Option<JoinHandle<()>>>,
    reader: Mutex<Connection>,
    health: Arc<Health>,
    refuse_when_failing: bool,
}

#[derive(Debug, thiserror::Error)]
#[error("usage ledger: {0}")]
pub struct LedgerError(#[from] rusqlite::Error);

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS requests (
    id INTEGER PRIMARY KEY,
    ts INTEGER NOT NULL,
    tenant TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    latency_ms REAL NOT NULL,
    status TEXT NOT NULL,
    plugin_ms REAL NOT NULL,
    rid TEXT
);
CREATE INDEX IF NOT EXISTS requests_tenant_ts ON requests (tenant, ts);
";

/// Ledgers created before rows had ids gain the column; old rows keep NULL (never replayed).
const RID_INDEX: &str = "CREATE UNIQUE INDEX IF NOT EXISTS requests_rid ON requests (rid)";

impl Ledger {
    /// Opens (or creates) the ledger at `path`; `:memory:`-like use is not supported, the
    /// ledger is meant to survive restarts.
    pub fn open(path: &Path, durability: Durability) -> Result<Self, LedgerError> {
        if let Some(dir) = path.parent() {
            if !dir.as_os_str().is_empty() && !dir.exists() {
                tracing::warn!(dir = %dir.display(), "creating the usage ledger's folder");
                let _ = std::fs::create_dir_all(dir);
            }
        }
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // WAL + NORMAL: a committed batch survives a process crash; an OS crash may lose the
        // last batch. Records are committed in batches every 20 ms (and on shutdown).
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.execute_batch(SCHEMA)?;
        let has_rid = conn
            .prepare("SELECT 1 FROM pragma_table_info('requests') WHERE name = 'rid'")?
            .exists([])?;
        if !has_rid {
            conn.execute_batch("ALTER TABLE requests ADD COLUMN rid TEXT")?;
        }
        conn.execute_batch(RID_INDEX)?;
        let reader = Connection::open(path)?;
        let (tx, rx) = mpsc::channel::<Msg>();
        let health = Arc::new(Health::default());
        let mut writer = Writer {
            conn,
            spill: durability.spill,
            health: health.clone(),
            pending: Vec::new(),
            retry_at: None,
            backoff: RETRY_MIN,
        };
        // Rows a previous run spilled go in first.
        writer.count_spilled();
        writer.replay();
        let writer = std::thread::Builder::new()
            .name("usage-ledger".into())
            .spawn(move || writer.run(rx))
            .map_err(|e| LedgerError(rusqlite::Error::ToSqlConversionFailure(Box::new(e))))?;
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
        let unit = match period {
            Period::Day => "'start of day', '+1 day'",
            Period::Month => "'start of month', '+1 month'",
        };
        let start_of = unit.split(", ").next().expect("two parts");
        let conn = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        let (start, end): (i64, i64) = conn.query_row(
            &format!("SELECT CAST(strftime('%s', ?1, 'unixepoch', {start_of}) AS INTEGER), CAST(strftime('%s', ?1, 'unixepoch', {unit}) AS INTEGER)"),
            params![now],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        let used: i64 = conn.query_row(
            "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM requests WHERE tenant = ?1 AND ts >= ?2 AND ts < ?3",
            params![tenant, start, end],
            |r| r.get(0),
        )?;
        Ok((start, end, used as u64))
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
        let group = if by_model {
            "model"
        } else {
            "date(ts, 'unixepoch')"
        };
        let conn = self.reader.lock().unwrap_or_else(|e| e.into_inner());
        let mut stmt = conn.prepare(&format!(
            "SELECT tenant, {group}, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), \
             SUM(status != 'ok'), AVG(latency_ms), SUM(plugin_ms) FROM requests \
             WHERE ts >= ?1 AND ts < ?2 AND (?3 IS NULL OR tenant = ?3) \
             GROUP BY tenant, {group} ORDER BY tenant, {group}"
        ))?;
        let rows = stmt.query_map(params![from, to, tenant], |r| {
            Ok(serde_json::json!({
                "tenant": r.get::<_, String>(0)?,
                if by_model { "model" } else { "day" }: r.get::<_, String>(1)?,
                "requests": r.get::<_, i64>(2)?,
                "prompt_tokens": r.get::<_, i64>(3)?,
                "completion_tokens": r.get::<_, i64>(4)?,
                "total_tokens": r.get::<_, i64>(3)? + r.get::<_, i64>(4)?,
                "failed_requests": r.get::<_, i64>(5)?,
                "mean_latency_ms": r.get::<_, f64>(6)?,
                "plugin_ms": r.get::<_, f64>(7)?,
            }))
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
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
    conn: Connection,
    spill: PathBuf,
    health: Arc<Health>,
    /// Rows neither SQLite nor the spill file took.
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

    /// Writes what is pending: into SQLite when it takes writes (replaying the spill file
    /// first), else into the spill file at once. Only SQLite retries back off: rows never wait
    /// in memory for a retry while the spill file works.
    fn write(&mut self) {
        let due = self.retry_at.is_none_or(|t| Instant::now() >= t);
        // While spilled rows cannot be replayed, SQLite is still refusing: new rows follow
        // them to the spill file without another try.
        let replayed = due && self.replay();
        let rows = std::mem::take(&mut self.pending);
        if !rows.is_empty() {
            let committed = replayed
                && commit(&mut self.conn, &rows)
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
        match append(&self.spill, &rows) {
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

    fn count_spilled(&self) {
        let n = std::fs::File::open(&self.spill)
            .map(|f| std::io::BufReader::new(f).lines().count())
            .unwrap_or(0);
        self.health.spilled.store(n, Ordering::Relaxed);
    }

    /// Moves the spill file's rows into SQLite; true when nothing is left to replay.
    fn replay(&mut self) -> bool {
        if self.health.spilled_rows() == 0 {
            return true;
        }
        let rows = match read_spill(&self.spill) {
            Ok(rows) => rows,
            Err(e) => {
                tracing::error!(error = %e, spill = %self.spill.display(), "cannot read the usage ledger spill file");
                return false;
            }
        };
        if let Err(e) = commit(&mut self.conn, &rows) {
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

/// Appends `rows` to the spill file and syncs it; on failure the file is cut back to where it
/// was, so a half-written line never follows.
fn append(path: &Path, rows: &[Row]) -> std::io::Result<()> {
    let mut text = Vec::new();
    for r in rows {
        serde_json::to_writer(&mut text, r).map_err(std::io::Error::other)?;
        text.push(b'\n');
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let before = f.metadata()?.len();
    let written = f.write_all(&text).and_then(|()| f.sync_data());
    if written.is_err() {
        let _ = f.set_len(before);
    }
    written
}

fn read_spill(path: &Path) -> std::io::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for line in std::io::BufReader::new(std::fs::File::open(path)?).lines() {
        let line = line?;
        match serde_json::from_str(&line) {
            Ok(r) => rows.push(r),
            Err(e) => tracing::error!(error = %e, "skipping an unreadable usage ledger spill line"),
        }
    }
    Ok(rows)
}

fn commit(conn: &mut Connection, rows: &[Row]) -> rusqlite::Result<()> {
    let tx = conn.transaction()?;
    {
        let mut stmt = tx.prepare_cached(
            "INSERT OR IGNORE INTO requests (ts, tenant, key_id, model, endpoint, prompt_tokens, completion_tokens, latency_ms, status, plugin_ms, rid) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
        )?;
        for r in rows {
            stmt.execute(params![
                r.ts,
                r.tenant,
                r.key_id,
                r.model,
                r.endpoint,
                r.prompt_tokens as i64,
                r.completion_tokens as i64,
                r.latency_ms,
                r.status,
                r.plugin_ms,
                r.rid
            ])?;
        }
    }
    tx.commit()
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
