//! Answers kept in Redis, so every replica serves what any one stored. Per tenant: each answer
//! under its own key (expiring at the tenant's TTL), and beside them a sorted set of the
//! answers by last use and a hash of their sizes and models, so that a tenant's `max_mb` holds
//! across replicas: storing evicts the tenant's least recently used answers first, in the
//! same server-side script, and drops the bookkeeping of answers past their expiry (an expiry
//! set, on Redis's clock). Every call is one round trip, bounded by `redis_timeout_ms`; a
//! Redis that does not answer is a miss, never an error for the client.

use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::Script;

use super::{Entry, Key, Limits, Usage};
use crate::config::ClusterConfig;
use crate::metrics::Metrics;

/// Milliseconds on Redis's clock: one clock for every replica.
const NOW: &str = "local t = redis.call('TIME')\nlocal now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n";

/// KEYS: the answer, the tenant's last-use set, its size hash, its byte total, its expiry set.
/// ARGV: the answer's bytes, TTL (ms), the tenant's cap (bytes), the member, the tenant's key
/// prefix, the model.
const PUT: &str = r#"
local ttl, cap = tonumber(ARGV[2]), tonumber(ARGV[3])
local size = string.len(ARGV[1])
local function drop(m)
  local info = redis.call('HGET', KEYS[3], m)
  if info then redis.call('DECRBY', KEYS[4], tonumber(string.match(info, '^(%d+)'))) end
  redis.call('HDEL', KEYS[3], m)
  redis.call('ZREM', KEYS[2], m)
  redis.call('ZREM', KEYS[5], m)
  redis.call('DEL', ARGV[5] .. m)
end
-- Answers past their expiry: their keys are gone, their bookkeeping goes now.
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[5], '-inf', now)) do drop(m) end
drop(ARGV[4])
if size > cap then return -1 end
local evicted = 0
while tonumber(redis.call('GET', KEYS[4]) or '0') + size > cap do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  drop(oldest[1])
  evicted = evicted + 1
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[2], now, ARGV[4])
redis.call('ZADD', KEYS[5], now + ttl, ARGV[4])
redis.call('HSET', KEYS[3], ARGV[4], size .. ' ' .. ARGV[6])
redis.call('INCRBY', KEYS[4], size)
-- The bookkeeping outlives the longest-lived answer it counts.
for i = 2, 5 do
  if redis.call('PTTL', KEYS[i]) < ttl + 60000 then redis.call('PEXPIRE', KEYS[i], ttl + 60000) end
end
return evicted
"#;

/// KEYS: the answer, the tenant's last-use set. ARGV: the member.
const GET: &str = r#"
local v = redis.call('GET', KEYS[1])
if v then redis.call('ZADD', KEYS[2], 'XX', now, ARGV[1]) end
return v
"#;

/// KEYS: the tenant's last-use set, size hash, byte total, expiry set. ARGV: the tenant's key
/// prefix, the model ('' for all). Returns {answers, bytes} dropped.
const CLEAR: &str = r#"
local n, bytes = 0, 0
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  local m, info = all[i], all[i + 1]
  local size, model = string.match(info, '^(%d+) (.*)$')
  if ARGV[2] == '' or model == ARGV[2] then
    redis.call('HDEL', KEYS[2], m)
    redis.call('ZREM', KEYS[1], m)
    redis.call('ZREM', KEYS[4], m)
    redis.call('DEL', ARGV[1] .. m)
    redis.call('DECRBY', KEYS[3], tonumber(size))
    n, bytes = n + 1, bytes + tonumber(size)
  end
end
return {n, bytes}
"#;

pub struct RedisStore {
    con: ConnectionManager,
    timeout: Duration,
    put: Script,
    get: Script,
    clear: Script,
    metrics: std::sync::Arc<Metrics>,
}

/// The tenant's keys: the prefix of its answers, its last-use set, size hash and byte total.
struct TenantKeys {
    prefix: String,
    order: String,
    sizes: String,
    total: String,
    expiry: String,
}

fn keys(tenant: &str) -> TenantKeys {
    let base = format!("gw:cache:{{{tenant}}}");
    TenantKeys {
        prefix: format!("{base}:a:"),
        order: format!("{base}:order"),
        sizes: format!("{base}:sizes"),
        total: format!("{base}:bytes"),
        expiry: format!("{base}:expiry"),
    }
}

fn hex(key: &Key) -> String {
    key.iter().map(|b| format!("{b:02x}")).collect()
}

impl RedisStore {
    /// Connects lazily, as the shared limits do: a Redis down at start is a miss, not a
    /// reason not to start.
    pub fn new(
        cfg: &ClusterConfig,
        url: &str,
        metrics: std::sync::Arc<Metrics>,
    ) -> anyhow::Result<Self> {
        Ok(Self {
            con: cfg.redis_connection(url)?,
            timeout: Duration::from_millis(cfg.redis_timeout_ms),
            put: Script::new(&format!("{NOW}{PUT}")),
            get: Script::new(&format!("{NOW}{GET}")),
            clear: Script::new(CLEAR),
            metrics,
        })
    }

    async fn run<T: redis::FromRedisValue>(
        &self,
        what: &'static str,
        inv: redis::ScriptInvocation<'_>,
    ) -> Option<T> {
        let mut con = self.con.clone();
        match tokio::time::timeout(self.timeout, inv.invoke_async(&mut con)).await {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => {
                self.failed(what, &e);
                None
            }
            Err(_) => {
                self.failed(what, &"timed out");
                None
            }
        }
    }

    fn failed(&self, what: &'static str, e: &dyn std::fmt::Display) {
        self.metrics
            .shared
            .redis_errors
            .with_label_values(&[what])
            .inc();
        tracing::debug!(error = %e, op = what, "response cache: Redis did not answer");
    }

    pub async fn get(&self, tenant: &str, key: &Key) -> Option<Entry> {
        let k = keys(tenant);
        let member = hex(key);
        let mut inv = self.get.prepare_invoke();
        inv.key(format!("{}{member}", k.prefix))
            .key(&k.order)
            .arg(&member);
        let raw: Option<Vec<u8>> = self.run("cache_get", inv).await?;
        Entry::decode(&raw?)
    }

    /// Stores `entry`; returns how many of the tenant's answers made room for it.
    pub async fn put(&self, tenant: &str, key: &Key, entry: &Entry, limits: &Limits) -> u64 {
        let k = keys(tenant);
        let member = hex(key);
        let mut inv = self.put.prepare_invoke();
        inv.key(format!("{}{member}", k.prefix))
            .key(&k.order)
            .key(&k.sizes)
            .key(&k.total)
            .key(&k.expiry)
            .arg(entry.encode())
            .arg(limits.ttl.as_millis() as u64)
            .arg(limits.max_bytes)
            .arg(&member)
            .arg(&k.prefix)
            .arg(&entry.model);
        let evicted: Option<i64> = self.run("cache_put", inv).await;
        evicted.unwrap_or(0).max(0) as u64
    }

    pub async fn clear(&self, tenant: &str, model: Option<&str>) -> Usage {
        let k = keys(tenant);
        let mut inv = self.clear.prepare_invoke();
        inv.key(&k.order)
            .key(&k.sizes)
            .key(&k.total)
            .key(&k.expiry)
            .arg(&k.prefix)
            .arg(model.unwrap_or(""));
        let (entries, bytes): (u64, u64) = self.run("cache_clear", inv).await.unwrap_or((0, 0));
        Usage { entries, bytes }
    }

    /// The tenant's answers and bytes held in Redis.
    pub async fn usage(&self, tenant: &str) -> Usage {
        let k = keys(tenant);
        let mut con = self.con.clone();
        let mut pipe = redis::pipe();
        pipe.hlen(&k.sizes).get(&k.total);
        let call = pipe.query_async::<(u64, Option<u64>)>(&mut con);
        match tokio::time::timeout(self.timeout, call).await {
            Ok(Ok((entries, bytes))) => Usage {
                entries,
                bytes: bytes.unwrap_or(0),
            },
            Ok(Err(e)) => {
                self.failed("cache_usage", &e);
                Usage::default()
            }
            Err(_) => {
                self.failed("cache_usage", &"timed out");
                Usage::default()
            }
        }
    }
}
