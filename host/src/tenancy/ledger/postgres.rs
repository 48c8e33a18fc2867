//! The shared store: PostgreSQL, for replicas that report one usage. Connections are made
//! lazily and dropped on any error, so a database that comes back is used again; while it is
//! away the writer spills rows to its local file and replays them later (`rid` is unique,
//! so a replay counts nothing twice).

use postgres::Client;

use super::{usage_row, LedgerError, Query, Row, Store};
use crate::tenancy::policy::Period;

const SCHEMA: &str = "
BEGIN;
SELECT pg_advisory_xact_lock(7301);
CREATE TABLE IF NOT EXISTS gateway_requests (
    id BIGSERIAL PRIMARY KEY,
    rid TEXT NOT NULL UNIQUE,
    ts BIGINT NOT NULL,
    tenant TEXT NOT NULL,
    key_id TEXT NOT NULL,
    model TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    prompt_tokens BIGINT NOT NULL,
    completion_tokens BIGINT NOT NULL,
    latency_ms DOUBLE PRECISION NOT NULL,
    status TEXT NOT NULL,
    plugin_ms DOUBLE PRECISION NOT NULL
);
CREATE INDEX IF NOT EXISTS gateway_requests_tenant_ts ON gateway_requests (tenant, ts);
COMMIT;
";

/// One connection to the ledger's database, (re)made when needed.
pub(super) struct Postgres {
    url: String,
    client: Option<Client>,
}

impl Postgres {
    pub(super) fn new(url: &str) -> Self {
        Self {
            url: url.to_string(),
            client: None,
        }
    }

    /// Runs `f` on the connection, connecting (and creating the table) first if needed; a
    /// failed call drops the connection.
    fn with<T>(
        &mut self,
        f: impl FnOnce(&mut Client) -> Result<T, postgres::Error>,
    ) -> Result<T, LedgerError> {
        let client = match &mut self.client {
            Some(c) if !c.is_closed() => c,
            _ => {
                let mut c = crate::common::postgres_connect(&self.url)?;
                c.batch_execute(SCHEMA)?;
                self.client.insert(c)
            }
        };
        f(client).map_err(|e| {
            self.client = None;
            e.into()
        })
    }
}

impl Store for Postgres {
    fn commit(&mut self, rows: &[Row]) -> Result<(), LedgerError> {
        let col = |f: fn(&Row) -> &str| rows.iter().map(f).collect::<Vec<_>>();
        let (rid, tenant, key_id) = (col(|r| &r.rid), col(|r| &r.tenant), col(|r| &r.key_id));
        let (model, endpoint, status) =
            (col(|r| &r.model), col(|r| &r.endpoint), col(|r| &r.status));
        let ts: Vec<i64> = rows.iter().map(|r| r.ts).collect();
        let prompt: Vec<i64> = rows.iter().map(|r| r.prompt_tokens as i64).collect();
        let completion: Vec<i64> = rows.iter().map(|r| r.completion_tokens as i64).collect();
        let latency: Vec<f64> = rows.iter().map(|r| r.latency_ms).collect();
        let plugin: Vec<f64> = rows.iter().map(|r| r.plugin_ms).collect();
        // One statement per batch, whatever its size: the rows travel as column arrays.
        self.with(|c| {
            c.execute(
                "INSERT INTO gateway_requests (rid, ts, tenant, key_id, model, endpoint, prompt_tokens, completion_tokens, latency_ms, status, plugin_ms) \
                 SELECT * FROM unnest($1::text[], $2::int8[], $3::text[], $4::text[], $5::text[], $6::text[], $7::int8[], $8::int8[], $9::float8[], $10::text[], $11::float8[]) \
                 ON CONFLICT (rid) DO NOTHING",
                &[&rid, &ts, &tenant, &key_id, &model, &endpoint, &prompt, &completion, &latency, &status, &plugin],
            )
        })?;
        Ok(())
    }
}

impl Query for Postgres {
    fn period_usage(
        &mut self,
        tenant: &str,
        period: Period,
        now: i64,
    ) -> Result<(i64, i64, u64), LedgerError> {
        let unit = match period {
            Period::Day => "day",
            Period::Month => "month",
        };
        self.with(|c| {
            let row = c.query_one(
                "WITH p AS (SELECT date_trunc($2::text, to_timestamp($1::float8) AT TIME ZONE 'UTC') AS start) \
                 SELECT extract(epoch FROM p.start)::int8, extract(epoch FROM p.start + ('1 ' || $2::text)::interval)::int8 FROM p",
                &[&(now as f64), &unit],
            )?;
            let (start, end): (i64, i64) = (row.get(0), row.get(1));
            let used: i64 = c
                .query_one(
                    "SELECT COALESCE(SUM(prompt_tokens + completion_tokens), 0)::int8 FROM gateway_requests \
                     WHERE tenant = $1 AND ts >= $2 AND ts < $3",
                    &[&tenant, &start, &end],
                )?
                .get(0);
            Ok((start, end, used as u64))
        })
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
            "to_char(to_timestamp(ts) AT TIME ZONE 'UTC', 'YYYY-MM-DD')"
        };
        let rows = self.with(|c| {
            c.query(
                &format!(
                    "SELECT tenant, {group} AS g, COUNT(*)::int8, SUM(prompt_tokens)::int8, SUM(completion_tokens)::int8, \
                     (COUNT(*) FILTER (WHERE status NOT IN ('ok', 'cached')))::int8, (COUNT(*) FILTER (WHERE status = 'cached'))::int8, AVG(latency_ms)::float8, SUM(plugin_ms)::float8 \
                     FROM gateway_requests WHERE ts >= $1 AND ts < $2 AND ($3::text IS NULL OR tenant = $3) \
                     GROUP BY tenant, g ORDER BY tenant, g"
                ),
                &[&from, &to, &tenant],
            )
        })?;
        Ok(rows
            .iter()
            .map(|r| {
                usage_row(
                    by_model,
                    r.get(0),
                    r.get(1),
                    [r.get(2), r.get(3), r.get(4), r.get(5), r.get(6)],
                    r.get(7),
                    r.get(8),
                )
            })
            .collect())
    }
}
