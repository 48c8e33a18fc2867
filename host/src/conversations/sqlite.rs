//! Stored responses in SQLite (the ledger's file, WAL): one row per response, and each
//! tenant's total bytes kept beside them so the cap costs one lookup, not a scan.

use std::path::Path;
use std::sync::Mutex;

use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};

use super::{Encoded, StoreError, Stored};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    response TEXT NOT NULL,
    input TEXT NOT NULL,
    context TEXT NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX IF NOT EXISTS responses_created ON responses (created_at);
CREATE INDEX IF NOT EXISTS responses_tenant_created ON responses (tenant, created_at);
CREATE TABLE IF NOT EXISTS response_bytes (
    tenant TEXT PRIMARY KEY,
    bytes INTEGER NOT NULL
);
";

/// Rows deleted at a time when a tenant is over its cap.
const EVICT_BATCH: i64 = 64;

pub(super) struct Db(Mutex<Connection>);

impl Db {
    pub(super) fn open(path: &Path) -> Result<Self, StoreError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            let _ = std::fs::create_dir_all(dir);
        }
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        // A committed response survives a process crash (kill -9) in WAL + NORMAL; an OS
        // crash may lose the last commits.
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(SCHEMA)?;
        Ok(Self(Mutex::new(conn)))
    }

    /// Write transactions take the write lock up front (IMMEDIATE): the ledger writes to the
    /// same file, and a read transaction that later wants to write fails at once if the ledger
    /// wrote in between, where an immediate one waits its turn (`busy_timeout`).
    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn put(
        &self,
        tenant: &str,
        id: &str,
        now: i64,
        s: &Stored,
    ) -> Result<(), StoreError> {
        let Encoded {
            response,
            input,
            context,
            bytes,
        } = s.encode()?;
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let old: Option<i64> = tx
            .query_row(
                "SELECT bytes FROM responses WHERE tenant = ?1 AND id = ?2",
                params![tenant, id],
                |r| r.get(0),
            )
            .optional()?;
        tx.execute(
            "INSERT OR REPLACE INTO responses (tenant, id, created_at, bytes, response, input, context) \
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)",
            params![tenant, id, now, bytes, response, input, context],
        )?;
        add_bytes(&tx, tenant, bytes - old.unwrap_or(0))?;
        tx.commit()?;
        Ok(())
    }

    pub(super) fn get(
        &self,
        tenant: &str,
        id: &str,
        not_before: i64,
    ) -> Result<Option<Stored>, StoreError> {
        let row: Option<(String, String, String)> = self
            .conn()
            .query_row(
                "SELECT response, input, context FROM responses \
                 WHERE tenant = ?1 AND id = ?2 AND created_at >= ?3",
                params![tenant, id, not_before],
                |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)),
            )
            .optional()?;
        let Some((response, input, context)) = row else {
            return Ok(None);
        };
        Ok(Some(Stored::decode(&response, &input, &context)?))
    }

    pub(super) fn delete(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let gone: Option<i64> = tx
            .query_row(
                "DELETE FROM responses WHERE tenant = ?1 AND id = ?2 RETURNING bytes",
                params![tenant, id],
                |r| r.get(0),
            )
            .optional()?;
        if let Some(b) = gone {
            add_bytes(&tx, tenant, -b)?;
        }
        tx.commit()?;
        Ok(gone.is_some())
    }

    /// Deletes every response created before `before`.
    pub(super) fn expire(&self, before: i64) -> Result<(), StoreError> {
        let mut conn = self.conn();
        let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
        let gone: Vec<(String, i64)> = tx
            .prepare("DELETE FROM responses WHERE created_at < ?1 RETURNING tenant, bytes")?
            .query_map(params![before], |r| Ok((r.get(0)?, r.get(1)?)))?
            .collect::<Result<_, _>>()?;
        for (tenant, bytes) in gone {
            add_bytes(&tx, &tenant, -bytes)?;
        }
        tx.commit()?;
        Ok(())
    }

    /// Deletes the tenant's oldest responses while it holds more than `max_bytes`.
    pub(super) fn cap(&self, tenant: &str, max_bytes: u64) -> Result<(), StoreError> {
        let mut conn = self.conn();
        loop {
            let tx = conn.transaction_with_behavior(TransactionBehavior::Immediate)?;
            let held: i64 = tx
                .query_row(
                    "SELECT bytes FROM response_bytes WHERE tenant = ?1",
                    params![tenant],
                    |r| r.get(0),
                )
                .optional()?
                .unwrap_or(0);
            if held as u64 <= max_bytes {
                return Ok(());
            }
            let freed: i64 = tx
                .prepare(
                    "DELETE FROM responses WHERE rowid IN (SELECT rowid FROM responses \
                     WHERE tenant = ?1 ORDER BY created_at, rowid LIMIT ?2) RETURNING bytes",
                )?
                .query_map(params![tenant, EVICT_BATCH], |r| r.get::<_, i64>(0))?
                .sum::<Result<i64, _>>()?;
            add_bytes(&tx, tenant, -freed)?;
            tx.commit()?;
            if freed == 0 {
                return Ok(());
            }
        }
    }
}

fn add_bytes(tx: &rusqlite::Transaction, tenant: &str, delta: i64) -> Result<(), StoreError> {
    tx.execute(
        "INSERT INTO response_bytes (tenant, bytes) VALUES (?1, ?2) \
         ON CONFLICT (tenant) DO UPDATE SET bytes = bytes + excluded.bytes",
        params![tenant, delta],
    )?;
    Ok(())
}
