//! The audit log in SQLite (the ledger's file, WAL).

use std::path::Path;
use std::sync::Mutex;

use rusqlite::{params, Connection};

use super::{AuditError, Change, Query, Row, Version};

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS audit (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts INTEGER NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS policy_versions (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    ts INTEGER NOT NULL,
    actor TEXT NOT NULL,
    text TEXT NOT NULL
);
";

pub struct Db(Mutex<Connection>);

impl Db {
    pub(super) fn open(path: &Path) -> Result<Self, AuditError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            let _ = std::fs::create_dir_all(dir);
        }
        let conn = Connection::open(path)?;
        conn.pragma_update(None, "journal_mode", "WAL")?;
        conn.pragma_update(None, "synchronous", "NORMAL")?;
        // The ledger writes to the same file: wait for its batch rather than fail.
        conn.busy_timeout(std::time::Duration::from_secs(5))?;
        conn.execute_batch(SCHEMA)?;
        Ok(Self(Mutex::new(conn)))
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn record(&self, c: &Change, detail: &str) -> Result<(), AuditError> {
        self.conn().execute(
            "INSERT INTO audit (ts, actor, action, target, detail) VALUES (?1, ?2, ?3, ?4, ?5)",
            params![c.ts, c.actor, c.action, c.target, detail],
        )?;
        Ok(())
    }

    pub(super) fn list(&self, q: &Query) -> Result<Vec<Row>, AuditError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT id, ts, actor, action, target, detail FROM audit \
             WHERE (?1 IS NULL OR id < ?1) AND (?2 IS NULL OR actor = ?2) \
             AND (?3 IS NULL OR action = ?3) ORDER BY id DESC LIMIT ?4",
        )?;
        let rows = stmt.query_map(params![q.before, q.actor, q.action, q.limit as i64], |r| {
            Ok((
                r.get(0)?,
                r.get(1)?,
                r.get(2)?,
                r.get(3)?,
                r.get(4)?,
                r.get(5)?,
            ))
        })?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    pub(super) fn keep_policy(&self, ts: i64, actor: &str, text: &str) -> Result<i64, AuditError> {
        let conn = self.conn();
        conn.execute(
            "INSERT INTO policy_versions (ts, actor, text) VALUES (?1, ?2, ?3)",
            params![ts, actor, text],
        )?;
        Ok(conn.last_insert_rowid())
    }

    pub(super) fn policies(&self) -> Result<Vec<Version>, AuditError> {
        let conn = self.conn();
        let mut stmt = conn.prepare(
            "SELECT id, ts, actor, length(CAST(text AS BLOB)) FROM policy_versions ORDER BY id DESC",
        )?;
        let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?)))?;
        Ok(rows.collect::<Result<_, _>>()?)
    }

    pub(super) fn policy(&self, id: i64) -> Result<Option<String>, AuditError> {
        use rusqlite::OptionalExtension;
        Ok(self
            .conn()
            .query_row(
                "SELECT text FROM policy_versions WHERE id = ?1",
                params![id],
                |r| r.get(0),
            )
            .optional()?)
    }
}
