//! The embedded store: SQLite in WAL mode, one writer connection (the ledger's thread) and one
//! reader.

use std::path::Path;

use rusqlite::{params, Connection};

use super::{usage_row, LedgerError, Query, Row, Store};
use crate::tenancy::policy::Period;

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

pub(super) struct Sqlite(Connection);

/// Opens (or creates) the ledger at `path`: the writer's store and the reader.
pub(super) fn open(path: &Path) -> Result<(Sqlite, Sqlite), LedgerError> {
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
    Ok((Sqlite(conn), Sqlite(Connection::open(path)?)))
}

impl Store for Sqlite {
    fn commit(&mut self, rows: &[Row]) -> Result<(), LedgerError> {
        let tx = self.0.transaction()?;
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
        Ok(tx.commit()?)
    }
}

impl Query for Sqlite {
    fn period_usage(
        &mut self,
        tenant: &str,
        period: Period,
        now: i64,
    ) -> Result<(i64, i64, u64), LedgerError> {
        let (start_of, next) = match period {
            Period::Day => ("'start of day'", "'+1 day'"),
            Period::Month => ("'start of month'", "'+1 month'"),
        };
        let (start, end): (i64, i64) = self.0.query_row(
            &format!("SELECT CAST(strftime('%s', ?1, 'unixepoch', {start_of}) AS INTEGER), CAST(strftime('%s', ?1, 'unixepoch', {start_of}, {next}) AS INTEGER)"),
            params![now],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )?;
        let used: i64 = self.0.query_row(
            "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM requests WHERE tenant = ?1 AND ts >= ?2 AND ts < ?3",
            params![tenant, start, end],
            |r| r.get(0),
        )?;
        Ok((start, end, used as u64))
    }

    fn usage(
        &mut self,
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
        let mut stmt = self.0.prepare(&format!(
            "SELECT tenant, {group}, COUNT(*), SUM(prompt_tokens), SUM(completion_tokens), \
             SUM(status NOT IN ('ok', 'cached')), SUM(status = 'cached'), AVG(latency_ms), SUM(plugin_ms) FROM requests \
             WHERE ts >= ?1 AND ts < ?2 AND (?3 IS NULL OR tenant = ?3) \
             GROUP BY tenant, {group} ORDER BY tenant, {group}"
        ))?;
        let rows = stmt.query_map(params![from, to, tenant], |r| {
            Ok(usage_row(
                by_model,
                r.get(0)?,
                r.get(1)?,
                [r.get(2)?, r.get(3)?, r.get(4)?, r.get(5)?, r.get(6)?],
                r.get(7)?,
                r.get(8)?,
            ))
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }
}
