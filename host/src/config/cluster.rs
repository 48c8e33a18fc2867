//! `[cluster]`: the engines replicas share state in (Redis for counters, PostgreSQL for
//! records).

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ClusterConfig {
    /// `redis://host:port/db`: request rates, requests in flight, the token rate and budgets
    /// are counted there, once for all replicas. Unset: each process counts its own.
    pub redis: Option<String>,
    /// When Redis does not answer within `redis_timeout_ms`: `open` admits on this process's
    /// own limits (with a warning and `gateway_shared_limits_local_total`), `closed` refuses
    /// with 503 `limits_unavailable`.
    pub redis_failure: RedisFailure,
    pub redis_timeout_ms: u64,
    /// A slot or reservation a replica never gave back (it died) expires after this long.
    pub reservation_ttl_s: u64,
    /// `postgres://user:password@host:port/db`: the usage ledger, admin-API plugin uploads and
    /// policy replacements are stored there and reach every replica. Unset: SQLite and files.
    pub postgres: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RedisFailure {
    Open,
    Closed,
}

impl Default for ClusterConfig {
    fn default() -> Self {
        Self {
            redis: None,
            redis_failure: RedisFailure::Open,
            redis_timeout_ms: 250,
            reservation_ttl_s: 900,
            postgres: None,
        }
    }
}
