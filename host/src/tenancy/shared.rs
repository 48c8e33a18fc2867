//! Limits shared by every replica, in Redis: request rates (fixed windows), requests in
//! flight and token reservations against the token rate and budget, each one server-side
//! script, one round trip per admission or reservation. In-flight slots and reservations are
//! sorted-set members scored by an expiry, pushed forward while their request runs, so a
//! replica that dies (`kill -9`) leaks them for at most `reservation_ttl_s`; a settlement removes its member, which makes it count once
//! even against an expiry that won the race.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::Script;

use super::policy::{Budget, TenantPolicy};
use super::rejection::{Limit, Rejection};
use crate::config::{ClusterConfig, RedisFailure};
use crate::metrics::Metrics;

const ADMIT: &str = r#"
local now, rps, rpm, maxf = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
if rps >= 0 and tonumber(redis.call('GET', KEYS[1]) or '0') >= rps then
  return {'requests_per_second', 1000 - now % 1000}
end
if rpm >= 0 and tonumber(redis.call('GET', KEYS[2]) or '0') >= rpm then
  return {'requests_per_minute', 60000 - now % 60000}
end
if maxf >= 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
  if redis.call('ZCARD', KEYS[3]) >= maxf then return {'max_concurrent', 1000} end
end
if rps >= 0 then redis.call('INCR', KEYS[1]); redis.call('PEXPIRE', KEYS[1], 2000) end
if rpm >= 0 then redis.call('INCR', KEYS[2]); redis.call('PEXPIRE', KEYS[2], 120000) end
if maxf >= 0 then
  redis.call('ZADD', KEYS[3], now + tonumber(ARGV[6]), ARGV[5])
  redis.call('PEXPIRE', KEYS[3], tonumber(ARGV[6]))
end
return {'ok', 0}
"#;

const RESERVE: &str = r#"
local now, tokens, budget, tpm = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[7])
if budget >= 0 and redis.call('EXISTS', KEYS[1]) == 0 then
  local seed = tonumber(ARGV[8])
  if seed < 0 then return {'unseeded', 0} end
  redis.call('SET', KEYS[1], seed, 'PX', tonumber(ARGV[6]))
end
if budget >= 0 then
  local expired = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now)
  for _, m in ipairs(expired) do
    redis.call('DECRBY', KEYS[3], tonumber(string.match(m, ':(%d+)$')) or 0)
  end
  if #expired > 0 then redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now) end
  local committed = tonumber(redis.call('GET', KEYS[1]) or '0') + tonumber(redis.call('GET', KEYS[3]) or '0')
  if committed + tokens > budget then return {'token_budget', committed} end
end
if tpm >= 0 then
  if tokens > tpm then return {'tokens_per_minute_never', 0} end
  if tonumber(redis.call('GET', KEYS[4]) or '0') + tokens > tpm then
    return {'tokens_per_minute', 60000 - now % 60000}
  end
  redis.call('INCRBY', KEYS[4], tokens)
  redis.call('PEXPIRE', KEYS[4], 120000)
end
if budget >= 0 then
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[4]), ARGV[5])
  redis.call('INCRBY', KEYS[3], tokens)
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], tonumber(ARGV[6])) end
end
return {'ok', 0}
"#;

const SETTLE: &str = r#"
-- A retried settlement (its answer was lost) counts nothing twice.
if not redis.call('SET', KEYS[4], '1', 'NX', 'PX', tonumber(ARGV[5])) then return 0 end
if redis.call('ZREM', KEYS[2], ARGV[1]) == 1 then
  redis.call('DECRBY', KEYS[3], tonumber(ARGV[2]))
end
-- A count Redis lost is not restarted from this one request: the next reservation seeds it
-- from the ledger, which has this request too.
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('INCRBY', KEYS[1], tonumber(ARGV[3]))
  redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[4]))
end
return 1
"#;

/// What a token reservation came to.
pub enum Reserved {
    Held(SharedReservation),
    Refused(Rejection),
    /// Redis holds no count for the budget's period: call again with the ledger's (`seed`).
    Unseeded,
}

/// Redis could not answer in time: the configured failure mode decides.
#[derive(Debug)]
pub struct Unavailable;

/// A reservation held in Redis, to settle once.
#[derive(Clone)]
pub struct SharedReservation {
    /// The budget period's key prefix, and this reservation's member.
    period_key: Option<String>,
    member: String,
    period_ttl_ms: u64,
}

pub struct Shared {
    con: ConnectionManager,
    pub failure: RedisFailure,
    timeout: Duration,
    ttl_ms: u64,
    admit: Script,
    reserve: Script,
    settle: Script,
    next: AtomicU64,
    /// Tells this process's members apart from other replicas'.
    instance: u64,
    metrics: Arc<Metrics>,
    last_warning: parking_lot::Mutex<Option<std::time::Instant>>,
}

fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// A policy limit as a script argument: -1 when unset.
fn limit(v: Option<impl Into<i64>>) -> i64 {
    v.map(Into::into).unwrap_or(-1)
}

impl Shared {
    /// Connects lazily: a Redis that is down at start is the failure mode's business, not a
    /// reason not to start.
    pub fn new(cfg: &ClusterConfig, url: &str, metrics: Arc<Metrics>) -> anyhow::Result<Self> {
        let timeout = Duration::from_millis(cfg.redis_timeout_ms);
        let con = cfg.redis_connection(url)?;
        Ok(Self {
            con,
            failure: cfg.redis_failure,
            timeout,
            ttl_ms: cfg.reservation_ttl_s * 1000,
            admit: Script::new(ADMIT),
            reserve: Script::new(RESERVE),
            settle: Script::new(SETTLE),
            next: AtomicU64::new(0),
            instance: rand::random(),
            metrics,
            last_warning: parking_lot::Mutex::new(None),
        })
    }

    fn member_id(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}-{n}", self.instance)
    }

    fn failed(&self, what: &str, e: &dyn std::fmt::Display) -> Unavailable {
        self.metrics
            .shared
            .redis_errors
            .with_label_values(&[what])
            .inc();
        let mut last = self.last_warning.lock();
        if last.is_none_or(|t| t.elapsed() > Duration::from_secs(10)) {
            *last = Some(std::time::Instant::now());
            tracing::warn!(error = %e, failure_mode = ?self.failure, "Redis did not answer; shared limits unavailable");
        }
        Unavailable
    }

    async fn run(
        &self,
        what: &str,
        inv: redis::ScriptInvocation<'_>,
    ) -> Result<(String, i64), Unavailable> {
        let mut con = self.con.clone();
        match tokio::time::timeout(self.timeout, inv.invoke_async(&mut con)).await {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(e)) => Err(self.failed(what, &e)),
            Err(_) => Err(self.failed(what, &"timed out")),
        }
    }

    /// Request rates and a slot among the tenant's requests in flight. Ok(slot member) when
    /// admitted (None when the tenant has no in-flight cap).
    pub async fn admit(
        &self,
        p: &TenantPolicy,
    ) -> Result<Result<Option<String>, Rejection>, Unavailable> {
        let now = now_ms();
        let t = &p.name;
        let member = p.max_concurrent.map(|_| self.member_id());
        let mut inv = self.admit.prepare_invoke();
        inv.key(format!("gw:{{{t}}}:rps:{}", now / 1000))
            .key(format!("gw:{{{t}}}:rpm:{}", now / 60_000))
            .key(format!("gw:{{{t}}}:inflight"))
            .arg(now)
            .arg(limit(p.requests_per_second))
            .arg(limit(p.requests_per_minute))
            .arg(limit(p.max_concurrent))
            .arg(member.clone().unwrap_or_default())
            .arg(self.ttl_ms);
        let (verdict, wait_ms) = self.run("admit", inv).await?;
        Ok(match verdict.as_str() {
            "ok" => Ok(member),
            verdict => Err(rejection(verdict, p, wait_ms, 0)),
        })
    }

    /// Gives a slot back (on its own task: it runs from `Drop`).
    pub fn release(self: &Arc<Self>, tenant: &str, member: String) {
        let (me, key) = (self.clone(), format!("gw:{{{tenant}}}:inflight"));
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                let mut con = me.con.clone();
                let mut cmd = redis::cmd("ZREM");
                cmd.arg(&key).arg(&member);
                match tokio::time::timeout(me.timeout, cmd.query_async::<i64>(&mut con)).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(e)) => {
                        me.failed("release", &e);
                    }
                    Err(_) => {
                        me.failed("release", &"timed out");
                    }
                }
            });
        }
    }

    /// Reserves `tokens` against the tenant's token rate and budget for the period starting
    /// at `period_start` (ending at `period_end`, Unix seconds).
    pub async fn reserve(
        &self,
        p: &TenantPolicy,
        tokens: u64,
        budget: Option<(Budget, i64, i64)>,
        seed: Option<u64>,
    ) -> Result<Reserved, Unavailable> {
        let now = now_ms();
        let t = &p.name;
        let member = format!("{}:{tokens}", self.member_id());
        let period_key = budget.map(|(_, start, _)| format!("gw:{{{t}}}:budget:{start}"));
        let period_ttl_ms = budget.map_or(0, |(_, _, end)| {
            ((end * 1000) as u64).saturating_sub(now) + 86_400_000
        });
        let prefix = period_key
            .clone()
            .unwrap_or_else(|| format!("gw:{{{t}}}:nobudget"));
        let mut inv = self.reserve.prepare_invoke();
        inv.key(format!("{prefix}:used"))
            .key(format!("{prefix}:resv"))
            .key(format!("{prefix}:reserved"))
            .key(format!("gw:{{{t}}}:tpm:{}", now / 60_000))
            .arg(now)
            .arg(tokens)
            .arg(budget.map_or(-1, |(b, _, _)| b.tokens as i64))
            .arg(self.ttl_ms)
            .arg(&member)
            .arg(period_ttl_ms)
            .arg(limit(p.tokens_per_minute))
            .arg(seed.map_or(-1, |s| s as i64));
        let (verdict, n) = self.run("reserve", inv).await?;
        Ok(match verdict.as_str() {
            "ok" => Reserved::Held(SharedReservation {
                period_key,
                member,
                period_ttl_ms,
            }),
            "unseeded" => Reserved::Unseeded,
            verdict => Reserved::Refused(rejection(verdict, p, n, tokens)),
        })
    }

    /// Replaces a reservation of `reserved` tokens by `used` (on its own task: settlement
    /// runs from `Drop` too).
    pub fn settle(self: &Arc<Self>, r: SharedReservation, reserved: u64, used: u64) {
        let Some(prefix) = r.period_key else { return };
        let me = self.clone();
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        rt.spawn(async move {
            // Redis may blink: a few tries over ~3 s before the tokens are given up on (the
            // reservation then frees itself at its expiry, but the usage is not counted).
            let mut wait = Duration::from_millis(100);
            for attempt in 1..=5 {
                let mut inv = me.settle.prepare_invoke();
                inv.key(format!("{prefix}:used"))
                    .key(format!("{prefix}:resv"))
                    .key(format!("{prefix}:reserved"))
                    .key(format!("{prefix}:settled:{}", r.member))
                    .arg(&r.member)
                    .arg(reserved)
                    .arg(used)
                    .arg(r.period_ttl_ms)
                    .arg(me.ttl_ms.max(60_000));
                let mut con = me.con.clone();
                let done = tokio::time::timeout(me.timeout, inv.invoke_async::<i64>(&mut con));
                let why = match done.await {
                    Ok(Ok(_)) => return,
                    Ok(Err(e)) => e.to_string(),
                    Err(_) => "timed out".to_string(),
                };
                if attempt == 5 {
                    me.failed("settle", &why);
                    return;
                }
                tokio::time::sleep(wait).await;
                wait *= 2;
            }
        });
    }
}

/// Keeps sorted-set members from expiring while their request runs (a stream may outlive
/// `reservation_ttl_s`); stops when dropped, after which expiry takes over again.
pub struct KeepAlive(tokio::task::AbortHandle);

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.0.abort();
    }
}

impl Shared {
    /// Pushes the expiry of each (key, member) forward every third of the TTL.
    pub fn keep_alive(self: &Arc<Self>, members: Vec<(String, String)>) -> Option<KeepAlive> {
        if members.is_empty() {
            return None;
        }
        let rt = tokio::runtime::Handle::try_current().ok()?;
        let me = self.clone();
        let every = Duration::from_millis((self.ttl_ms / 3).max(100));
        let task = rt.spawn(async move {
            let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                tick.tick().await;
                let mut pipe = redis::pipe();
                for (key, member) in &members {
                    // XX: only while it is still there (settled or released: gone).
                    pipe.cmd("ZADD")
                        .arg(key)
                        .arg("XX")
                        .arg(now_ms() + me.ttl_ms)
                        .arg(member)
                        .ignore();
                    // The set itself expires too; only ever lengthen that (a budget's sets
                    // live for their period).
                    pipe.cmd("PEXPIRE")
                        .arg(key)
                        .arg(me.ttl_ms)
                        .arg("GT")
                        .ignore();
                }
                let mut con = me.con.clone();
                if let Ok(Err(e)) =
                    tokio::time::timeout(me.timeout, pipe.query_async::<()>(&mut con)).await
                {
                    me.failed("keep_alive", &e);
                }
            }
        });
        Some(KeepAlive(task.abort_handle()))
    }

    /// The in-flight set's key and a slot's member in it.
    pub fn slot_member(tenant: &str, member: &str) -> (String, String) {
        (format!("gw:{{{tenant}}}:inflight"), member.to_string())
    }
}

impl SharedReservation {
    /// The budget's reservation set and this reservation's member in it, if it holds budget.
    pub fn member(&self) -> Option<(String, String)> {
        self.period_key
            .as_ref()
            .map(|p| (format!("{p}:resv"), self.member.clone()))
    }
}

/// The refusal a script's verdict names; `n` is the wait in milliseconds, or for the budget the
/// tokens already committed.
fn rejection(verdict: &str, p: &TenantPolicy, n: i64, tokens: u64) -> Rejection {
    let wait = Some(Duration::from_millis(n.max(1) as u64));
    match verdict {
        "requests_per_second" => Rejection {
            limit: Limit::RequestsPerSecond,
            message: format!("Rate limit reached: {} requests per second (all replicas).", p.requests_per_second.unwrap_or(0)),
            retry_after: wait,
        },
        "requests_per_minute" => Rejection {
            limit: Limit::RequestsPerMinute,
            message: format!("Rate limit reached: {} requests per minute (all replicas).", p.requests_per_minute.unwrap_or(0)),
            retry_after: wait,
        },
        "max_concurrent" => Rejection {
            limit: Limit::MaxConcurrent,
            message: format!("Too many requests in flight: the tenant's limit is {} (all replicas).", p.max_concurrent.unwrap_or(0)),
            retry_after: wait,
        },
        "token_budget" => Rejection {
            limit: Limit::TokenBudget,
            message: format!(
                "Token budget exhausted: {n} of {} tokens this period are used or reserved (all replicas), and this request reserves {tokens}.",
                p.token_budget.map_or(0, |b| b.tokens)
            ),
            retry_after: None,
        },
        "tokens_per_minute_never" => Rejection {
            limit: Limit::TokensPerMinute,
            message: format!("This request reserves {tokens} tokens (prompt + max_tokens), more than the tenant's {} tokens per minute; lower max_tokens.", p.tokens_per_minute.unwrap_or(0)),
            retry_after: None,
        },
        // `tokens_per_minute`, the last verdict RESERVE can give.
        _ => Rejection {
            limit: Limit::TokensPerMinute,
            message: format!("Token rate limit reached: {} tokens per minute (all replicas); this request reserves {tokens}.", p.tokens_per_minute.unwrap_or(0)),
            retry_after: wait,
        },
    }
}
