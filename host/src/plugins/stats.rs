//! Each plugin version's own call counts, failures by cause and call-time quantiles, for the
//! admin API and console (the Prometheus series are per tenant and plugin, or per kind: a
//! version's p99 is not among them).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Buckets per doubling of the call time, and doublings from 1 µs (to ~16 s): a quantile is
/// known within a factor of 2^(1/4) (±9%).
const PER_OCTAVE: usize = 4;
const BUCKETS: usize = 24 * PER_OCTAVE;

pub struct Stats {
    calls: AtomicU64,
    times: [AtomicU64; BUCKETS],
    failures: parking_lot::Mutex<BTreeMap<&'static str, u64>>,
}

impl Default for Stats {
    fn default() -> Self {
        Self {
            calls: AtomicU64::new(0),
            times: std::array::from_fn(|_| AtomicU64::new(0)),
            failures: Default::default(),
        }
    }
}

impl Stats {
    /// One call that took `took`, failed with `cause` if it failed.
    pub fn record(&self, took: Duration, cause: Option<&'static str>) {
        self.calls.fetch_add(1, Ordering::Relaxed);
        self.times[bucket(took)].fetch_add(1, Ordering::Relaxed);
        if let Some(c) = cause {
            *self.failures.lock().entry(c).or_default() += 1;
        }
    }

    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    pub fn failures(&self) -> BTreeMap<&'static str, u64> {
        self.failures.lock().clone()
    }

    /// The call time below which a share `q` of the calls took, in milliseconds (the middle
    /// of its bucket); none before the first call.
    pub fn quantile_ms(&self, q: f64) -> Option<f64> {
        let counts: Vec<u64> = self
            .times
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((q * total as f64).ceil() as u64).clamp(1, total);
        let mut seen = 0;
        let at = counts
            .iter()
            .position(|c| {
                seen += c;
                seen >= rank
            })
            .unwrap_or(BUCKETS - 1);
        let mid = (at as f64 + 0.5) / PER_OCTAVE as f64;
        Some(mid.exp2() / 1000.0)
    }
}

fn bucket(took: Duration) -> usize {
    let us = took.as_secs_f64() * 1e6;
    if us <= 1.0 {
        return 0;
    }
    ((us.log2() * PER_OCTAVE as f64) as usize).min(BUCKETS - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_come_within_a_bucket() {
        let s = Stats::default();
        assert_eq!(s.quantile_ms(0.5), None);
        for i in 0..100u64 {
            let took = Duration::from_micros(if i < 98 { 100 } else { 20_000 });
            s.record(took, (i == 99).then_some("trap"));
        }
        let p50 = s.quantile_ms(0.5).unwrap();
        let p99 = s.quantile_ms(0.99).unwrap();
        assert!((0.09..0.12).contains(&p50), "{p50}");
        assert!((18.0..23.0).contains(&p99), "{p99}");
        assert_eq!(s.calls(), 100);
        assert_eq!(s.failures()["trap"], 1);
    }
}
