//! Per-tenant limits at admission: request and token rates (`governor`), requests in flight,
//! and the token budget, which is reserved before generation and settled to the real count
//! after it, so no stream can overrun a budget after the fact.

use std::num::NonZeroU32;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use super::policy::{Budget, Period, TenantPolicy};
use super::rejection::{Limit, Rejection};

/// Rate limiters of one policy version; rebuilt only when the tenant's quotas change.
pub struct Rates {
    quotas: (Option<u32>, Option<u32>, Option<u32>),
    per_second: Option<DefaultDirectRateLimiter>,
    per_minute: Option<DefaultDirectRateLimiter>,
    tokens: Option<DefaultDirectRateLimiter>,
}

impl Rates {
    pub fn new(p: &TenantPolicy) -> Self {
        let nz = |n: u32| NonZeroU32::new(n).expect("validated non-zero");
        Self {
            quotas: Self::quotas_of(p),
            per_second: p
                .requests_per_second
                .map(|n| RateLimiter::direct(Quota::per_second(nz(n)))),
            per_minute: p
                .requests_per_minute
                .map(|n| RateLimiter::direct(Quota::per_minute(nz(n)))),
            tokens: p
                .tokens_per_minute
                .map(|n| RateLimiter::direct(Quota::per_minute(nz(n)))),
        }
    }

    pub fn quotas_of(p: &TenantPolicy) -> (Option<u32>, Option<u32>, Option<u32>) {
        (
            p.requests_per_second,
            p.requests_per_minute,
            p.tokens_per_minute,
        )
    }

    pub fn same_quotas(&self, p: &TenantPolicy) -> bool {
        self.quotas == Self::quotas_of(p)
    }

    fn check_request(&self) -> Result<(), Rejection> {
        for (limiter, limit, n, per) in [
            (
                &self.per_second,
                Limit::RequestsPerSecond,
                self.quotas.0,
                "second",
            ),
            (
                &self.per_minute,
                Limit::RequestsPerMinute,
                self.quotas.1,
                "minute",
            ),
        ] {
            if let Some(l) = limiter {
                if let Err(not_until) = l.check() {
                    let wait = not_until.wait_time_from(DefaultClock::default().now());
                    return Err(Rejection {
                        limit,
                        message: format!(
                            "Rate limit reached: {} requests per {per}.",
                            n.unwrap_or(0)
                        ),
                        retry_after: Some(wait),
                    });
                }
            }
        }
        Ok(())
    }

    fn check_tokens(&self, tokens: u64) -> Result<(), Rejection> {
        let (Some(l), Some(per_minute)) = (&self.tokens, self.quotas.2) else {
            return Ok(());
        };
        let n = NonZeroU32::new(tokens.clamp(1, u32::MAX as u64) as u32)
            .expect("clamped to at least 1");
        match l.check_n(n) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(not_until)) => Err(Rejection {
                limit: Limit::TokensPerMinute,
                message: format!("Token rate limit reached: {per_minute} tokens per minute; this request reserves {tokens}."),
                retry_after: Some(not_until.wait_time_from(DefaultClock::default().now())),
            }),
            Err(_) => Err(Rejection {
                limit: Limit::TokensPerMinute,
                message: format!("This request reserves {tokens} tokens (prompt + max_tokens), more than the tenant's {per_minute} tokens per minute; lower max_tokens."),
                retry_after: None,
            }),
        }
    }
}

/// What a tenant has in flight and has spent; lives across policy reloads.
#[derive(Default)]
pub struct Usage {
    in_flight: AtomicU32,
    budget: Mutex<BudgetState>,
}

#[derive(Default)]
pub struct BudgetState {
    /// The period the counters belong to, as Unix seconds [start, end).
    pub period: Option<(Period, i64, i64)>,
    /// Tokens settled in this period (from the ledger at start-up, then counted).
    pub used: u64,
    /// Tokens reserved by requests still running.
    pub reserved: u64,
}

/// Holds one of the tenant's concurrent-request slots until dropped: in this process, or in
/// Redis (a member of the tenant's in-flight set; None when it has no cap).
pub enum Slot {
    Local(Arc<Usage>),
    Shared {
        shared: Arc<super::shared::Shared>,
        tenant: String,
        member: Option<String>,
        /// Keeps the slot from expiring while its request runs.
        _alive: Option<super::shared::KeepAlive>,
    },
}

impl Slot {
    pub fn shared(
        shared: &Arc<super::shared::Shared>,
        tenant: &str,
        member: Option<String>,
    ) -> Self {
        let alive = member
            .as_ref()
            .and_then(|m| shared.keep_alive(vec![super::shared::Shared::slot_member(tenant, m)]));
        Self::Shared {
            shared: shared.clone(),
            tenant: tenant.to_string(),
            member,
            _alive: alive,
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        match self {
            Self::Local(usage) => {
                usage.in_flight.fetch_sub(1, Ordering::Relaxed);
            }
            Self::Shared {
                shared,
                tenant,
                member,
                ..
            } => {
                if let Some(m) = member.take() {
                    shared.release(tenant, m);
                }
            }
        }
    }
}

impl Usage {
    /// Rate and concurrency checks for a new request.
    pub fn admit(
        self: &Arc<Self>,
        rates: &Rates,
        max_concurrent: Option<u32>,
    ) -> Result<Slot, Rejection> {
        rates.check_request()?;
        let now = self.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        let slot = Slot::Local(self.clone());
        if let Some(max) = max_concurrent {
            if now > max {
                return Err(Rejection {
                    limit: Limit::MaxConcurrent,
                    message: format!("Too many requests in flight: the tenant's limit is {max}."),
                    retry_after: Some(Duration::from_secs(1)),
                });
            }
        }
        Ok(slot)
    }

    pub fn in_flight(&self) -> u32 {
        self.in_flight.load(Ordering::Relaxed)
    }

    /// Reserves `tokens` against the token rate and the budget. `period` gives the current
    /// period's bounds and, on a period change, the tokens already settled in the new one.
    pub fn reserve(
        &self,
        rates: &Rates,
        budget: Option<Budget>,
        tokens: u64,
        now: i64,
        period: impl FnOnce(Period) -> (i64, i64, u64),
    ) -> Result<(), Rejection> {
        let mut b = self.budget.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(budget) = budget {
            let stale = match b.period {
                Some((p, _, end)) => p != budget.period || now >= end,
                None => true,
            };
            if stale {
                let (start, end, used) = period(budget.period);
                b.period = Some((budget.period, start, end));
                b.used = used;
            }
            let committed = b.used + b.reserved;
            if committed + tokens > budget.tokens {
                let end = b.period.map_or(now, |(_, _, end)| end);
                return Err(Rejection {
                    limit: Limit::TokenBudget,
                    message: format!(
                        "Token budget exhausted: {} of {} tokens this {} are used or reserved, and this request reserves {tokens}.",
                        committed,
                        budget.tokens,
                        match budget.period { Period::Day => "day", Period::Month => "month" },
                    ),
                    retry_after: Some(Duration::from_secs((end - now).max(1) as u64)),
                });
            }
        }
        rates.check_tokens(tokens)?;
        b.reserved += tokens;
        Ok(())
    }

    /// Replaces a reservation by what was really used.
    pub fn settle(&self, reserved: u64, used: u64) {
        let mut b = self.budget.lock().unwrap_or_else(|e| e.into_inner());
        b.reserved = b.reserved.saturating_sub(reserved);
        b.used += used;
    }

    pub fn budget_used(&self) -> (u64, u64) {
        let b = self.budget.lock().unwrap_or_else(|e| e.into_inner());
        (b.used, b.reserved)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(extra: &str) -> TenantPolicy {
        super::super::policy::Policies::parse(&format!("[[tenants]]\nname = \"t\"\n{extra}"))
            .unwrap()
            .tenants
            .remove(0)
    }

    #[test]
    fn budget_is_reserved_then_settled() {
        let p = policy("token_budget = { tokens = 100, period = \"day\" }");
        let (rates, usage) = (Rates::new(&p), Usage::default());
        let period = |_| (0, 86_400, 10);
        usage
            .reserve(&rates, p.token_budget, 60, 5, period)
            .unwrap();
        // 10 used + 60 reserved: 40 more would overrun.
        let r = usage
            .reserve(&rates, p.token_budget, 40, 5, period)
            .unwrap_err();
        assert_eq!(r.limit, Limit::TokenBudget);
        assert_eq!(r.retry_after, Some(Duration::from_secs(86_395)));
        usage.settle(60, 25);
        assert_eq!(usage.budget_used(), (35, 0));
        usage
            .reserve(&rates, p.token_budget, 65, 5, period)
            .unwrap();
        // A new period starts from what the ledger says it has used.
        usage.settle(65, 65);
        usage
            .reserve(&rates, p.token_budget, 90, 86_400, |_| (86_400, 172_800, 0))
            .unwrap();
        assert_eq!(usage.budget_used(), (0, 90));
    }

    #[test]
    fn concurrency_and_rates() {
        let p = policy("max_concurrent = 1\nrequests_per_second = 2\ntokens_per_minute = 100");
        let (rates, usage) = (Rates::new(&p), Arc::new(Usage::default()));
        let slot = usage.admit(&rates, p.max_concurrent).unwrap();
        assert_eq!(
            usage.admit(&rates, p.max_concurrent).err().unwrap().limit,
            Limit::MaxConcurrent
        );
        drop(slot);
        assert_eq!(usage.in_flight(), 0);
        assert_eq!(
            usage.admit(&rates, p.max_concurrent).err().unwrap().limit,
            Limit::RequestsPerSecond
        );
        let over = usage
            .reserve(&rates, None, 101, 0, |_| unreachable!())
            .unwrap_err();
        assert_eq!(
            (over.limit, over.retry_after),
            (Limit::TokensPerMinute, None)
        );
        usage
            .reserve(&rates, None, 100, 0, |_| unreachable!())
            .unwrap();
        assert!(usage
            .reserve(&rates, None, 1, 0, |_| unreachable!())
            .unwrap_err()
            .retry_after
            .is_some());
    }
}
