//! Plugins, policies and search collections shared by replicas through PostgreSQL
//! (`[cluster] postgres`); collections are in `collections.rs`.
//!
//! An upload, delete or policy replacement through any replica's admin API is checked there
//! first (compiled, validated), then committed to PostgreSQL, then served there; every other
//! replica follows the tables (`follow`): woken by `NOTIFY`, polling once a second as the
//! safety net, it compiles what changed and swaps it in under the same rules as a local
//! change. Writers take one advisory lock, so change numbers (`seq`) are committed in order
//! and a follower reading `seq > last` never skips one. The tables hold each plugin's latest
//! state (a delete is a tombstone), not a log: a replica that was away catches up in one read.

mod collections;
mod follow;

use std::sync::{Arc, Mutex};

use postgres::Client;

use anyhow::Context;

use crate::config::ClusterConfig;
use crate::metrics::Metrics;
use crate::plugins::{PluginKind, Registry};
use crate::search::Collections;
use crate::tenancy::Tenancy;

const SCHEMA: &str = "
BEGIN;
SELECT pg_advisory_xact_lock(7302);
CREATE SEQUENCE IF NOT EXISTS gateway_change_seq;
CREATE TABLE IF NOT EXISTS gateway_plugins (
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    wasm BYTEA,
    deleted BOOLEAN NOT NULL DEFAULT false,
    seq BIGINT NOT NULL,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE IF NOT EXISTS gateway_policy (
    id INT PRIMARY KEY CHECK (id = 1),
    text TEXT NOT NULL,
    seq BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS gateway_collections (
    tenant TEXT NOT NULL,
    name TEXT NOT NULL,
    incarnation TEXT NOT NULL UNIQUE,
    settings TEXT NOT NULL,
    deleted BOOLEAN NOT NULL DEFAULT false,
    seq BIGINT NOT NULL,
    doc_seq BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (tenant, name)
);
CREATE TABLE IF NOT EXISTS gateway_collection_docs (
    incarnation TEXT NOT NULL,
    doc TEXT NOT NULL,
    seq BIGINT NOT NULL,
    deleted BOOLEAN NOT NULL,
    metadata TEXT,
    chunks TEXT,
    vectors BYTEA,
    PRIMARY KEY (incarnation, doc)
);
CREATE INDEX IF NOT EXISTS gateway_collection_docs_seq ON gateway_collection_docs (incarnation, seq);
COMMIT;
";

/// The advisory lock every writer holds for its transaction: commits in `seq` order.
const WRITE_LOCK: i64 = 7303;
/// The channel followers listen on.
const CHANNEL: &str = "gateway_changes";

/// Shares this replica's limits (Redis) and its plugins, policies and collections
/// (PostgreSQL) with the others, as `[cluster]` says. The ledger's own PostgreSQL link is made
/// with the ledger.
pub fn join(
    cfg: &ClusterConfig,
    tenancy: &Arc<Tenancy>,
    registry: &Arc<Registry>,
    collections: &Arc<Collections>,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<Option<Arc<Replication>>> {
    if let Some(url) = &cfg.redis {
        let shared = crate::tenancy::shared::Shared::new(cfg, url, metrics.clone())
            .context("[cluster] redis")?;
        tenancy.share_limits(Arc::new(shared));
        tracing::info!(failure_mode = ?cfg.redis_failure, "limits and budgets shared through Redis");
    }
    let Some(url) = &cfg.postgres else {
        return Ok(None);
    };
    let rep = Replication::start(
        url,
        registry.clone(),
        tenancy.clone(),
        collections.clone(),
        metrics.clone(),
    )
    .context("[cluster] postgres")?;
    tracing::info!("usage ledger, plugins, policies and collections shared through PostgreSQL");
    Ok(Some(rep))
}

#[derive(Debug, thiserror::Error)]
#[error("PostgreSQL: {}", .0.as_db_error().map_or_else(|| .0.to_string(), |d| d.message().to_string()))]
pub struct StoreError(#[from] postgres::Error);

/// The connection, not the statement, failed: the server restarted (it ends every session
/// with `admin_shutdown`) or the socket broke. Worth one more try on a new connection; a
/// statement that failed on its own (a timeout included) is not.
fn connection_lost(e: &postgres::Error) -> bool {
    e.is_closed()
        || e.as_db_error().is_none_or(|d| {
            let code = d.code().code();
            matches!(code, "57P01" | "57P02" | "57P03") || code.starts_with("08")
        })
}

/// This replica's link to the shared plugin, policy and collection tables.
pub struct Replication {
    url: String,
    /// Writes, one at a time; (re)connected on demand.
    writer: Mutex<Option<Client>>,
    /// Reads of collection changes for request paths.
    reader: Mutex<Option<Client>>,
    metrics: Arc<Metrics>,
}

impl Replication {
    /// Connects, creates the tables, applies what they hold (so the replica serves the
    /// cluster's plugins and policy before it listens), and starts following them. A database
    /// that is away is not fatal: the follower keeps trying and applies everything once it
    /// answers.
    pub fn start(
        url: &str,
        registry: Arc<Registry>,
        tenancy: Arc<Tenancy>,
        collections: Arc<Collections>,
        metrics: Arc<Metrics>,
    ) -> std::io::Result<Arc<Self>> {
        let me = Arc::new(Self {
            url: url.to_string(),
            writer: Mutex::default(),
            reader: Mutex::default(),
            metrics,
        });
        collections.share(Arc::new(collections::Shared(me.clone())));
        follow::spawn(me.clone(), registry, tenancy, collections)?;
        Ok(me)
    }

    fn connect(&self) -> Result<Client, postgres::Error> {
        let mut c = crate::common::postgres_connect(&self.url)?;
        c.batch_execute(SCHEMA)?;
        Ok(c)
    }

    /// One write transaction under the write lock, with a `NOTIFY` for the followers.
    fn write<T>(
        &self,
        op: &str,
        f: impl FnMut(&mut postgres::Transaction<'_>) -> Result<T, postgres::Error>,
    ) -> Result<T, StoreError> {
        self.transaction(op, true, f)
    }

    /// One transaction on the writer's connection, under the write lock when `ordered` (its
    /// change numbers then commit in order), with a `NOTIFY` for the followers.
    fn transaction<T>(
        &self,
        op: &str,
        ordered: bool,
        mut f: impl FnMut(&mut postgres::Transaction<'_>) -> Result<T, postgres::Error>,
    ) -> Result<T, StoreError> {
        self.on(&self.writer, op, |client| {
            let mut tx = client.transaction()?;
            if ordered {
                tx.execute("SELECT pg_advisory_xact_lock($1)", &[&WRITE_LOCK])?;
            }
            let out = f(&mut tx)?;
            tx.batch_execute(&format!("NOTIFY {CHANNEL}"))?;
            tx.commit()?;
            Ok(out)
        })
    }

    /// Runs `f` on the connection in `slot`, (re)connecting first; a failure drops it.
    fn on<T>(
        &self,
        slot: &Mutex<Option<Client>>,
        op: &str,
        mut f: impl FnMut(&mut Client) -> Result<T, postgres::Error>,
    ) -> Result<T, StoreError> {
        let mut slot = slot.lock().unwrap_or_else(|e| e.into_inner());
        let reused = slot.as_ref().is_some_and(|c| !c.is_closed());
        let mut attempt = |slot: &mut Option<Client>| {
            let client = match slot {
                Some(c) if !c.is_closed() => c,
                _ => slot.insert(self.connect()?),
            };
            f(client)
        };
        let result = match attempt(&mut slot) {
            // A statement that failed on its own is not retried (it would fail again).
            Err(e) if reused && connection_lost(&e) => {
                *slot = None;
                attempt(&mut slot)
            }
            other => other,
        };
        result.map_err(|e| {
            *slot = None;
            self.error(op);
            e.into()
        })
    }

    fn error(&self, op: &str) {
        self.metrics
            .shared
            .postgres_errors
            .with_label_values(&[op])
            .inc();
    }

    /// Stores a checked plugin upload for every replica.
    pub fn put_plugin(
        &self,
        tenant: &str,
        name: &str,
        kind: PluginKind,
        sha256: &str,
        wasm: &[u8],
    ) -> Result<(), StoreError> {
        self.write("put_plugin", |tx| {
            tx.execute(
                "INSERT INTO gateway_plugins (tenant, name, kind, sha256, wasm, deleted, seq) \
                 VALUES ($1, $2, $3, $4, $5, false, nextval('gateway_change_seq')) \
                 ON CONFLICT (tenant, name) DO UPDATE SET kind = excluded.kind, sha256 = excluded.sha256, \
                 wasm = excluded.wasm, deleted = false, seq = excluded.seq",
                &[&tenant, &name, &kind.as_str(), &sha256, &wasm],
            )
            .map(drop)
        })
    }

    /// Deletes the tenant's plugin on every replica.
    pub fn delete_plugin(&self, tenant: &str, name: &str) -> Result<(), StoreError> {
        self.write("delete_plugin", |tx| {
            tx.execute(
                "INSERT INTO gateway_plugins (tenant, name, kind, sha256, wasm, deleted, seq) \
                 VALUES ($1, $2, '', '', NULL, true, nextval('gateway_change_seq')) \
                 ON CONFLICT (tenant, name) DO UPDATE SET wasm = NULL, sha256 = '', deleted = true, seq = excluded.seq",
                &[&tenant, &name],
            )
            .map(drop)
        })
    }

    /// Stores a validated policy text for every replica.
    pub fn put_policy(&self, text: &str) -> Result<(), StoreError> {
        self.write("put_policy", |tx| {
            tx.execute(
                "INSERT INTO gateway_policy (id, text, seq) VALUES (1, $1, nextval('gateway_change_seq')) \
                 ON CONFLICT (id) DO UPDATE SET text = excluded.text, seq = excluded.seq",
                &[&text],
            )
            .map(drop)
        })
    }
}
