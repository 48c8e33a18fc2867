//! The response cache's numbers.

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};

pub struct CacheMetrics {
    /// Lookups by tenant, kind (`exact`, `semantic`) and result (`hit`, `miss`, `bypass`).
    pub lookups: IntCounterVec,
    /// Bytes of answers held in this process's memory, by tenant.
    pub bytes: IntGaugeVec,
    /// Answers dropped to make room (tenant's `max_mb` or `[cache] memory_mb`), by tenant.
    pub evictions: IntCounterVec,
    /// Answers stored, by tenant.
    pub stores: IntCounterVec,
}

impl CacheMetrics {
    pub(super) fn new(r: &Registry) -> Self {
        let counter = |n: &str, h: &str, labels: &[&str]| {
            super::reg(
                r,
                IntCounterVec::new(Opts::new(n, h), labels).expect("valid"),
            )
        };
        Self {
            lookups: counter(
                "gateway_cache_lookups_total",
                "Response cache lookups by tenant, kind (exact, semantic) and result (hit, miss, bypass)",
                &["tenant", "kind", "result"],
            ),
            bytes: super::reg(
                r,
                IntGaugeVec::new(
                    Opts::new(
                        "gateway_cache_bytes",
                        "Bytes of cached answers held in this process's memory",
                    ),
                    &["tenant"],
                )
                .expect("valid"),
            ),
            evictions: counter(
                "gateway_cache_evictions_total",
                "Cached answers dropped to make room",
                &["tenant"],
            ),
            stores: counter(
                "gateway_cache_stores_total",
                "Answers stored in the response cache",
                &["tenant"],
            ),
        }
    }
}
