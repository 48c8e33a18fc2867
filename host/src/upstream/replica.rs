//! Replicas and where they come from: a URL each, or a DNS name (`dns+http://name:port/v1`,
//! e.g. a Kubernetes headless Service) that stands for every address it resolves to,
//! re-resolved each probe round so that pods joining or leaving join or leave the pool.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use parking_lot::Mutex;

/// One replica's state as the pool sees it.
pub(super) struct Replica {
    /// Unique in its pool for the pool's lifetime (affinity and retries refer to it).
    pub id: usize,
    /// The configured entry it came from, and for a DNS entry the address.
    pub source: (usize, Option<SocketAddr>),
    /// Base URL as an OpenAI client takes it (`…/v1`), without a trailing slash.
    pub url: String,
    /// `scheme://host:port`, for the probes.
    pub origin: String,
    /// Label in metrics and response headers: its position in `replicas`, or for a DNS
    /// entry's replica the address.
    pub label: String,
    /// Requests this gateway has in flight there.
    pub outstanding: AtomicUsize,
    /// From its `/metrics`: waiting and running requests, KV usage in thousandths.
    pub waiting: AtomicUsize,
    pub running: AtomicUsize,
    pub kv_milli: AtomicUsize,
    /// The last health probe answered 2xx (always true without probes).
    pub healthy: AtomicBool,
    /// Failures in a row; each doubles the ejection, up to 16×.
    pub failures: AtomicU32,
    pub ejected_until: Mutex<Option<Instant>>,
}

impl Replica {
    fn new(
        id: usize,
        source: (usize, Option<SocketAddr>),
        url: &str,
        label: String,
        healthy: bool,
    ) -> anyhow::Result<Self> {
        let uri: http::Uri = url.parse().context("replica URL")?;
        let origin = format!(
            "{}://{}",
            uri.scheme_str().unwrap_or("http"),
            uri.authority().context("replica URL has no host")?
        );
        Ok(Self {
            id,
            source,
            url: url.trim_end_matches('/').to_string(),
            origin,
            label,
            outstanding: AtomicUsize::new(0),
            waiting: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            kv_milli: AtomicUsize::new(0),
            healthy: AtomicBool::new(healthy),
            failures: AtomicU32::new(0),
            ejected_until: Mutex::new(None),
        })
    }

    pub fn available(&self, now: Instant) -> bool {
        self.healthy.load(Ordering::Relaxed) && self.ejected_until.lock().is_none_or(|t| now >= t)
    }

    /// What the picker weighs: the busier of our own count and the replica's report (which
    /// includes other clients, but is up to a probe interval old), plus its queue again (a
    /// queued request is worse than a running one), plus a step when its KV cache is full.
    pub fn load(&self, full_step: usize) -> usize {
        let waiting = self.waiting.load(Ordering::Relaxed);
        let reported = self.running.load(Ordering::Relaxed) + waiting;
        let kv_full = self.kv_milli.load(Ordering::Relaxed) >= 950;
        self.outstanding.load(Ordering::Relaxed).max(reported)
            + waiting
            + if kv_full { full_step } else { 0 }
    }
}

/// A `replicas` entry.
enum Source {
    Url(String),
    /// `dns+http://host:port/path`: one replica per address of `host`.
    Dns {
        host: String,
        port: u16,
        path: String,
    },
}

impl Source {
    fn parse(entry: &str) -> anyhow::Result<Self> {
        let Some(rest) = entry.strip_prefix("dns+http://") else {
            return Ok(Self::Url(entry.to_string()));
        };
        let uri: http::Uri = format!("http://{rest}").parse().context("replica URL")?;
        Ok(Self::Dns {
            host: uri.host().context("replica URL has no host")?.to_string(),
            port: uri.port_u16().unwrap_or(80),
            path: uri.path().trim_end_matches('/').to_string(),
        })
    }
}

/// The pool's replicas: one per URL entry, and one per address each DNS entry resolves to.
/// Replicas whose entry still yields them are kept (with their state); new ones start
/// unhealthy when probes will vouch for them. A name that fails to resolve keeps its replicas
/// until it resolves again: a DNS hiccup must not empty the pool.
pub(super) struct Roster {
    sources: Vec<Source>,
    next_id: usize,
    probed: bool,
}

impl Roster {
    pub fn new(entries: &[String], probed: bool) -> anyhow::Result<Self> {
        Ok(Self {
            sources: entries
                .iter()
                .map(|e| Source::parse(e))
                .collect::<anyhow::Result<_>>()?,
            next_id: 0,
            probed,
        })
    }

    /// The DNS entries to resolve: entry index, host, port.
    pub fn lookups(&self) -> Vec<(usize, String, u16)> {
        self.sources
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Source::Dns { host, port, .. } => Some((i, host.clone(), *port)),
                Source::Url(_) => None,
            })
            .collect()
    }

    /// The URL entries' replicas.
    pub fn initial(&mut self) -> anyhow::Result<Vec<Arc<Replica>>> {
        let mut out = Vec::new();
        for (i, s) in self.sources.iter().enumerate() {
            if let Source::Url(url) = s {
                let r = Replica::new(self.next_id, (i, None), url, i.to_string(), !self.probed)?;
                self.next_id += 1;
                out.push(Arc::new(r));
            }
        }
        Ok(out)
    }

    /// `current` updated with `resolved` (each DNS entry's addresses, None when its lookup
    /// failed); returns the new list and the replicas that left.
    pub fn merge(
        &mut self,
        current: &[Arc<Replica>],
        resolved: &[(usize, Option<Vec<SocketAddr>>)],
    ) -> (Vec<Arc<Replica>>, Vec<Arc<Replica>>) {
        let mut keep: Vec<Arc<Replica>> = Vec::new();
        let mut gone = Vec::new();
        for r in current {
            let stays = match r.source {
                (_, None) => true,
                (i, Some(addr)) => match resolved.iter().find(|(j, _)| *j == i) {
                    Some((_, Some(addrs))) => addrs.contains(&addr),
                    _ => true,
                },
            };
            if stays {
                keep.push(r.clone());
            } else {
                gone.push(r.clone());
            }
        }
        for (i, addrs) in resolved {
            let (Some(addrs), Source::Dns { path, .. }) = (addrs, &self.sources[*i]) else {
                continue;
            };
            for addr in addrs {
                if keep.iter().any(|r| r.source == (*i, Some(*addr))) {
                    continue;
                }
                let url = format!("http://{addr}{path}");
                if let Ok(r) = Replica::new(
                    self.next_id,
                    (*i, Some(*addr)),
                    &url,
                    addr.to_string(),
                    !self.probed,
                ) {
                    self.next_id += 1;
                    keep.push(Arc::new(r));
                }
            }
        }
        (keep, gone)
    }
}

/// Each lookup's addresses now (None where it failed).
pub(super) async fn resolve(
    lookups: &[(usize, String, u16)],
) -> Vec<(usize, Option<Vec<SocketAddr>>)> {
    let mut out = Vec::new();
    for (i, host, port) in lookups {
        let addrs = tokio::net::lookup_host((host.as_str(), *port))
            .await
            .ok()
            .map(|a| {
                let mut v: Vec<SocketAddr> = a.collect();
                v.sort();
                v.dedup();
                v
            })
            .filter(|v| !v.is_empty());
        out.push((*i, addrs));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dns_entries_follow_their_addresses_and_survive_failed_lookups() {
        let entries = [
            "http://a:1/v1".to_string(),
            "dns+http://engines:8080/v1".to_string(),
        ];
        let mut roster = Roster::new(&entries, true).unwrap();
        let first = roster.initial().unwrap();
        assert_eq!(first.len(), 1);
        assert_eq!(first[0].label, "0");
        let (a, b, c): (SocketAddr, SocketAddr, SocketAddr) = (
            "10.0.0.1:8080".parse().unwrap(),
            "10.0.0.2:8080".parse().unwrap(),
            "10.0.0.3:8080".parse().unwrap(),
        );
        let (two, gone) = roster.merge(&first, &[(1, Some(vec![a, b]))]);
        assert_eq!((two.len(), gone.len()), (3, 0));
        assert_eq!(two[1].url, "http://10.0.0.1:8080/v1");
        assert!(!two[1].healthy.load(Ordering::Relaxed));
        // A lookup that fails changes nothing; a pod leaving and one joining do.
        let (same, gone) = roster.merge(&two, &[(1, None)]);
        assert_eq!((same.len(), gone.len()), (3, 0));
        let (next, gone) = roster.merge(&same, &[(1, Some(vec![b, c]))]);
        assert_eq!(gone.len(), 1);
        assert_eq!(gone[0].label, "10.0.0.1:8080");
        let labels: Vec<&str> = next.iter().map(|r| r.label.as_str()).collect();
        assert_eq!(labels, ["0", "10.0.0.2:8080", "10.0.0.3:8080"]);
        // The replica that stayed is the same one, state and id included.
        assert_eq!(next[1].id, two[2].id);
    }
}
