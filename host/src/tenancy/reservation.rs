//! A token reservation and how a request ended: what the ledger and the tenant metrics
//! record when the reservation is settled, exactly once.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use super::ledger::Record;
use super::limits::Slot;
use super::shared::{Shared, SharedReservation};
use super::{Tenancy, Tenant};

/// How a request ended, as the ledger and `gateway_tenant_requests_total` record it. Typed so
/// that a failure is never written down as a cancellation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Answered in full.
    Ok,
    /// The client went away before the answer was complete.
    Cancelled,
    /// The gateway failed it (engine, plugin, index): an error went to the client.
    Failed,
    /// Cut at the drain deadline of a shutdown.
    Shutdown,
    /// Answered from the response cache.
    Cached,
}

impl Outcome {
    /// `Ok` for a request that succeeded, `Failed` for one that did not.
    pub fn of<T, E>(result: &Result<T, E>) -> Self {
        if result.is_ok() {
            Outcome::Ok
        } else {
            Outcome::Failed
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Cancelled => "cancelled",
            Outcome::Failed => "error",
            Outcome::Shutdown => "shutdown",
            Outcome::Cached => "cached",
        }
    }
}

/// How a request's reservation settled, for what answered it (the response cache stores an
/// answer only once it settled `Ok`, with those tokens).
#[derive(Debug, Default)]
pub struct Settled {
    ok: std::sync::atomic::AtomicBool,
    prompt: AtomicU64,
    completion: AtomicU64,
}

impl Settled {
    /// The (prompt, completion) tokens of a request that ended `Ok`; None otherwise.
    pub fn ok(&self) -> Option<(u64, u64)> {
        self.ok.load(Ordering::Acquire).then(|| {
            (
                self.prompt.load(Ordering::Relaxed),
                self.completion.load(Ordering::Relaxed),
            )
        })
    }
}

/// Tokens reserved for one generation request. Settled exactly once: explicitly with the usage
/// reported to the client, or on drop (cancellation) with the tokens counted so far.
pub struct Reservation {
    pub(super) tenancy: Arc<Tenancy>,
    pub(super) tenant: Arc<Tenant>,
    pub(super) key_id: Arc<str>,
    pub(super) model: String,
    pub(super) endpoint: crate::common::Endpoint,
    pub(super) reserved: u64,
    pub(super) prompt_tokens: AtomicU64,
    pub(super) completion_tokens: AtomicU64,
    pub(super) started: Instant,
    pub(super) ts: i64,
    pub(super) settled: std::sync::atomic::AtomicBool,
    pub(super) _slot: Arc<Slot>,
    pub(super) plugin_us: Arc<AtomicU64>,
    /// The same tokens reserved in Redis, when limits are shared.
    pub(super) shared: Option<(Arc<Shared>, SharedReservation)>,
    /// Keeps the Redis reservation from expiring while the request runs.
    pub(super) _alive: Option<super::shared::KeepAlive>,
    /// Tokens added after admission (`Tenancy::reserve_more`): their Redis reservations, each
    /// with its size, and what keeps those alive.
    pub(super) more_shared: Vec<(Arc<Shared>, SharedReservation, u64)>,
    pub(super) _more_alive: Vec<super::shared::KeepAlive>,
    /// Told how this settles (the caller's `settled`).
    pub(super) report: Arc<Settled>,
}

impl Reservation {
    /// Counts one generated token as it reaches the client.
    pub fn count_token(&self) {
        self.completion_tokens.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts `n` generated tokens at once (an upstream's answer that reported no usage).
    pub fn count_tokens(&self, n: u64) {
        self.completion_tokens.fetch_add(n, Ordering::Relaxed);
    }

    /// The prompt tokens (as estimated at reservation) and the completion tokens counted.
    pub fn counted(&self) -> (u64, u64) {
        (
            self.prompt_tokens.load(Ordering::Relaxed),
            self.completion_tokens.load(Ordering::Relaxed),
        )
    }

    /// The exact prompt length, once the prompt is built (the reservation was taken on an
    /// estimate).
    pub fn set_prompt_tokens(&self, n: u64) {
        self.prompt_tokens.store(n, Ordering::Relaxed);
    }

    /// Tokens reserved in all.
    pub fn reserved(&self) -> u64 {
        self.reserved
    }

    /// Takes `more`'s tokens into this reservation, to be settled with it as one request.
    pub(super) fn absorb(&mut self, mut more: Reservation) {
        more.settled.store(true, Ordering::Release);
        self.reserved += more.reserved;
        if let Some((shared, r)) = more.shared.take() {
            self.more_shared.push((shared, r, more.reserved));
        }
        self._more_alive.extend(more._alive.take());
    }

    /// The tokens of the reservation taken at admission, without those added since.
    fn first_reserved(&self) -> u64 {
        self.reserved - self.more_shared.iter().map(|m| m.2).sum::<u64>()
    }

    fn settle_more_shared(&self) {
        for (shared, r, reserved) in &self.more_shared {
            shared.settle(r.clone(), *reserved, 0);
        }
    }

    /// Gives the tokens back with no ledger row: the request moved on to a fallback model,
    /// whose own reservation records it.
    pub fn release(self) {
        self.settled.store(true, Ordering::Release);
        self.tenant.usage.settle(self.reserved, 0);
        if let Some((shared, r)) = &self.shared {
            shared.settle(r.clone(), self.first_reserved(), 0);
        }
        self.settle_more_shared();
    }

    /// Settles a request that ended early (`Failed`, `Shutdown`) with the tokens counted so far.
    pub fn end(&self, outcome: Outcome) {
        let (p, c) = self.counted();
        self.settle(p, c, outcome);
    }

    /// Settles with the exact usage reported to the client.
    pub fn settle(&self, prompt_tokens: u64, completion_tokens: u64, outcome: Outcome) {
        if self.settled.swap(true, Ordering::AcqRel) {
            return;
        }
        if outcome == Outcome::Ok {
            self.report.prompt.store(prompt_tokens, Ordering::Relaxed);
            self.report
                .completion
                .store(completion_tokens, Ordering::Relaxed);
            self.report.ok.store(true, Ordering::Release);
        }
        let status = outcome.as_str();
        let t = &self.tenant;
        t.usage
            .settle(self.reserved, prompt_tokens + completion_tokens);
        if let Some((shared, r)) = &self.shared {
            let used = prompt_tokens + completion_tokens;
            shared.settle(r.clone(), self.first_reserved(), used);
        }
        self.settle_more_shared();
        let m = &self.tenancy.metrics;
        m.tenant_requests
            .with_label_values(&[&t.name, status])
            .inc();
        m.tenant_tokens
            .with_label_values(&[&t.name, "prompt"])
            .inc_by(prompt_tokens);
        m.tenant_tokens
            .with_label_values(&[&t.name, "completion"])
            .inc_by(completion_tokens);
        if let Some(l) = &self.tenancy.ledger {
            l.record(Record {
                ts: self.ts,
                tenant: t.name.to_string(),
                key_id: self.key_id.to_string(),
                model: self.model.clone(),
                endpoint: self.endpoint.as_str(),
                prompt_tokens,
                completion_tokens,
                latency_ms: self.started.elapsed().as_secs_f64() * 1e3,
                status,
                plugin_ms: self.plugin_us.load(Ordering::Relaxed) as f64 / 1e3,
            });
        }
    }
}

impl Drop for Reservation {
    /// Not settled by then: the client went away (every failure path settles first).
    fn drop(&mut self) {
        self.end(Outcome::Cancelled);
    }
}
