//! Stored responses in PostgreSQL (`[cluster] postgres`), so a conversation started on one
//! replica continues on another. The same rows as in SQLite; the JSON kept as text, as sent.
//! One lazy connection (`LazyPostgres`), dropped on any error, so a database that comes back
//! is used again.

use postgres::Client;

use super::{Encoded, StoreError, Stored};
use crate::common::LazyPostgres;

const SCHEMA: &str = "
BEGIN;
SELECT pg_advisory_xact_lock(7302);
CREATE TABLE IF NOT EXISTS gateway_responses (
    tenant TEXT NOT NULL,
    id TEXT NOT NULL,
    created_at BIGINT NOT NULL,
    bytes BIGINT NOT NULL,
    response TEXT NOT NULL,
    input TEXT NOT NULL,
    context TEXT NOT NULL,
    PRIMARY KEY (tenant, id)
);
CREATE INDEX IF NOT EXISTS gateway_responses_created ON gateway_responses (created_at);
CREATE INDEX IF NOT EXISTS gateway_responses_tenant_created ON gateway_responses (tenant, created_at);
CREATE TABLE IF NOT EXISTS gateway_response_bytes (
    tenant TEXT PRIMARY KEY,
    bytes BIGINT NOT NULL
);
COMMIT;
";

/// Rows deleted at a time when a tenant is over its cap.
const EVICT_BATCH: i64 = 64;

const ADD_BYTES: &str = "INSERT INTO gateway_response_bytes (tenant, bytes) VALUES ($1, $2) \
     ON CONFLICT (tenant) DO UPDATE SET bytes = gateway_response_bytes.bytes + EXCLUDED.bytes";

pub(super) struct Db(LazyPostgres);

impl Db {
    /// Connects on first use, as the ledger does: a database that is away at start (or whose
    /// certificate is not trusted) costs the Responses API its stored responses (503
    /// `store_unavailable`), not the gateway its start.
    pub(super) fn open(url: &str) -> Self {
        Self(LazyPostgres::new(url, SCHEMA))
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&mut Client) -> Result<T, postgres::Error>,
    ) -> Result<T, StoreError> {
        self.0.with(f)
    }
}

impl Db {
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
        self.with(|c| {
            let mut tx = c.transaction()?;
            let old: Option<i64> = tx
                .query_opt(
                    "SELECT bytes FROM gateway_responses WHERE tenant = $1 AND id = $2 FOR UPDATE",
                    &[&tenant, &id],
                )?
                .map(|r| r.get(0));
            tx.execute(
                "INSERT INTO gateway_responses (tenant, id, created_at, bytes, response, input, context) \
                 VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (tenant, id) DO UPDATE SET \
                 created_at = EXCLUDED.created_at, bytes = EXCLUDED.bytes, response = EXCLUDED.response, \
                 input = EXCLUDED.input, context = EXCLUDED.context",
                &[&tenant, &id, &now, &bytes, &response, &input, &context],
            )?;
            tx.execute(ADD_BYTES, &[&tenant, &(bytes - old.unwrap_or(0))])?;
            tx.commit()
        })
    }

    pub(super) fn get(
        &self,
        tenant: &str,
        id: &str,
        not_before: i64,
    ) -> Result<Option<Stored>, StoreError> {
        let row = self.with(|c| {
            c.query_opt(
                "SELECT response, input, context FROM gateway_responses \
                 WHERE tenant = $1 AND id = $2 AND created_at >= $3",
                &[&tenant, &id, &not_before],
            )
        })?;
        let Some(row) = row else {
            return Ok(None);
        };
        let (response, input, context): (String, String, String) =
            (row.get(0), row.get(1), row.get(2));
        Ok(Some(Stored::decode(&response, &input, &context)?))
    }

    pub(super) fn delete(&self, tenant: &str, id: &str) -> Result<bool, StoreError> {
        self.with(|c| {
            let mut tx = c.transaction()?;
            let gone = tx.query_opt(
                "DELETE FROM gateway_responses WHERE tenant = $1 AND id = $2 RETURNING bytes",
                &[&tenant, &id],
            )?;
            if let Some(r) = &gone {
                tx.execute(ADD_BYTES, &[&tenant, &-r.get::<_, i64>(0)])?;
            }
            tx.commit()?;
            Ok(gone.is_some())
        })
    }

    /// Deletes every response created before `before`.
    pub(super) fn expire(&self, before: i64) -> Result<(), StoreError> {
        self.with(|c| {
            let mut tx = c.transaction()?;
            let gone = tx.query(
                "DELETE FROM gateway_responses WHERE created_at < $1 RETURNING tenant, bytes",
                &[&before],
            )?;
            for r in gone {
                let (tenant, bytes): (String, i64) = (r.get(0), r.get(1));
                tx.execute(ADD_BYTES, &[&tenant, &-bytes])?;
            }
            tx.commit()
        })
    }

    /// Deletes the tenant's oldest responses while it holds more than `max_bytes`.
    pub(super) fn cap(&self, tenant: &str, max_bytes: u64) -> Result<(), StoreError> {
        let max = max_bytes.min(i64::MAX as u64) as i64;
        self.with(|c| loop {
            let mut tx = c.transaction()?;
            let held: i64 = tx
                .query_opt(
                    "SELECT bytes FROM gateway_response_bytes WHERE tenant = $1 FOR UPDATE",
                    &[&tenant],
                )?
                .map_or(0, |r| r.get(0));
            if held <= max {
                return tx.commit();
            }
            let freed: i64 = tx
                .query(
                    "DELETE FROM gateway_responses WHERE (tenant, id) IN (SELECT tenant, id \
                     FROM gateway_responses WHERE tenant = $1 ORDER BY created_at, id LIMIT $2) \
                     RETURNING bytes",
                    &[&tenant, &EVICT_BATCH],
                )?
                .iter()
                .map(|r| r.get::<_, i64>(0))
                .sum();
            tx.execute(ADD_BYTES, &[&tenant, &-freed])?;
            tx.commit()?;
            if freed == 0 {
                return Ok(());
            }
        })
    }
}
