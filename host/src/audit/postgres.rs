//! The audit log in PostgreSQL (`[cluster] postgres`): one log for every replica, on one lazy
//! connection (`LazyPostgres`).

use postgres::Client;

use super::{AuditError, Change, Query, Row, Version};
use crate::common::LazyPostgres;

const SCHEMA: &str = "
BEGIN;
SELECT pg_advisory_xact_lock(7304);
CREATE TABLE IF NOT EXISTS gateway_audit (
    id BIGSERIAL PRIMARY KEY,
    ts BIGINT NOT NULL,
    actor TEXT NOT NULL,
    action TEXT NOT NULL,
    target TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS gateway_policy_versions (
    id BIGSERIAL PRIMARY KEY,
    ts BIGINT NOT NULL,
    actor TEXT NOT NULL,
    text TEXT NOT NULL
);
COMMIT;
";

pub struct Db(LazyPostgres);

impl Db {
    pub(super) fn open(url: &str) -> Self {
        Self(LazyPostgres::new(url, SCHEMA))
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut Client) -> Result<T, postgres::Error>,
    ) -> Result<T, AuditError> {
        self.0.with(f)
    }

    pub(super) fn record(&self, c: &Change, detail: &str) -> Result<(), AuditError> {
        self.with(|db| {
            db.execute(
                "INSERT INTO gateway_audit (ts, actor, action, target, detail) \
                 VALUES ($1, $2, $3, $4, $5)",
                &[&c.ts, &c.actor, &c.action, &c.target, &detail],
            )
            .map(drop)
        })
    }

    pub(super) fn list(&self, q: &Query) -> Result<Vec<Row>, AuditError> {
        let limit = q.limit as i64;
        self.with(|db| {
            let rows = db.query(
                "SELECT id, ts, actor, action, target, detail FROM gateway_audit \
                 WHERE ($1::int8 IS NULL OR id < $1) AND ($2::text IS NULL OR actor = $2) \
                 AND ($3::text IS NULL OR action = $3) ORDER BY id DESC LIMIT $4",
                &[&q.before, &q.actor, &q.action, &limit],
            )?;
            Ok(rows
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4), r.get(5)))
                .collect())
        })
    }
}

impl Db {
    pub(super) fn keep_policy(&self, ts: i64, actor: &str, text: &str) -> Result<i64, AuditError> {
        self.with(|db| {
            let row = db.query_one(
                "INSERT INTO gateway_policy_versions (ts, actor, text) VALUES ($1, $2, $3) \
                 RETURNING id",
                &[&ts, &actor, &text],
            )?;
            Ok(row.get(0))
        })
    }

    pub(super) fn policies(&self) -> Result<Vec<Version>, AuditError> {
        self.with(|db| {
            let rows = db.query(
                "SELECT id, ts, actor, octet_length(text)::int8 FROM gateway_policy_versions \
                 ORDER BY id DESC",
                &[],
            )?;
            Ok(rows
                .iter()
                .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
                .collect())
        })
    }

    pub(super) fn policy(&self, id: i64) -> Result<Option<String>, AuditError> {
        self.with(|db| {
            let row = db.query_opt(
                "SELECT text FROM gateway_policy_versions WHERE id = $1",
                &[&id],
            )?;
            Ok(row.map(|r| r.get(0)))
        })
    }
}
