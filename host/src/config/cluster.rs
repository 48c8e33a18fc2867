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

impl ClusterConfig {
    /// A connection to the Redis at `url`, made lazily (a Redis down at start is the failure
    /// mode's business, not a reason not to start), each call bounded by `redis_timeout_ms`.
    pub fn redis_connection(&self, url: &str) -> redis::RedisResult<redis::aio::ConnectionManager> {
        let client = redis::Client::open(url)?;
        let timeout = std::time::Duration::from_millis(self.redis_timeout_ms);
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1)
            .set_max_delay(std::time::Duration::from_secs(1));
        redis::aio::ConnectionManager::new_lazy_with_config(client, config)
    }
}
