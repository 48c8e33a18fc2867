//! The response cache: answers stored per tenant under an exact key (`pipeline::cache` builds
//! it) and served again without running the request. In this process's memory (bounded,
//! least recently used out), or in Redis with `[cluster] redis`, so that every replica serves
//! what any one stored; plus, for tenants that opt in, a semantic index of last user messages
//! (`semantic`). Tenants are kept apart by construction: every store is addressed by tenant
//! first, and a key is only ever looked up under the tenant that made it.

mod memory;
mod redis_store;
pub mod semantic;

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::config::{CacheConfig, ClusterConfig};
use crate::metrics::Metrics;

/// A SHA-256 over everything that makes two requests the same.
pub type Key = [u8; 32];

/// One stored answer: the response body exactly as served (a JSON body, or every SSE frame of
/// a stream), what served it and what it cost.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    /// The model that answered (a fallback's, when one served).
    pub model: String,
    /// `body` is a stream's frames, replayed as `text/event-stream`.
    pub sse: bool,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    #[serde(skip)]
    pub body: Bytes,
}

impl Entry {
    /// Bytes it takes, bookkeeping included.
    pub fn size(&self) -> u64 {
        (self.body.len() + self.model.len() + 64) as u64
    }

    /// One header line of JSON, then the body.
    fn encode(&self) -> Vec<u8> {
        let mut out = serde_json::to_vec(self).expect("an entry serialises");
        out.push(b'\n');
        out.extend_from_slice(&self.body);
        out
    }

    fn decode(raw: &[u8]) -> Option<Self> {
        let nl = raw.iter().position(|&b| b == b'\n')?;
        let mut e: Entry = serde_json::from_slice(&raw[..nl]).ok()?;
        e.body = Bytes::copy_from_slice(&raw[nl + 1..]);
        Some(e)
    }
}

/// A tenant's limits for one answer stored.
pub struct Limits {
    pub ttl: Duration,
    /// The tenant's answers together.
    pub max_bytes: u64,
}

/// Answers and their bytes.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Usage {
    pub entries: u64,
    pub bytes: u64,
}

pub struct ResponseCache {
    pub enabled: bool,
    /// A larger answer is not stored.
    pub max_entry_bytes: u64,
    memory: memory::Memory,
    redis: Option<redis_store::RedisStore>,
    pub semantic: semantic::Semantic,
    metrics: Arc<Metrics>,
}

impl ResponseCache {
    pub fn new(
        cfg: &CacheConfig,
        cluster: &ClusterConfig,
        metrics: Arc<Metrics>,
    ) -> anyhow::Result<Self> {
        let redis = match &cluster.redis {
            Some(url) if cfg.enabled => {
                Some(redis_store::RedisStore::new(cluster, url, metrics.clone())?)
            }
            _ => None,
        };
        Ok(Self {
            enabled: cfg.enabled,
            max_entry_bytes: cfg.max_entry_kb * 1024,
            memory: memory::Memory::new(cfg.memory_mb * 1024 * 1024),
            redis,
            semantic: semantic::Semantic::default(),
            metrics,
        })
    }

    /// Where answers are kept: `memory` or `redis`.
    pub fn backend(&self) -> &'static str {
        if self.redis.is_some() {
            "redis"
        } else {
            "memory"
        }
    }

    /// The tenant's answer under `key`, if one is stored and fresh.
    pub async fn get(&self, tenant: &str, key: &Key) -> Option<Arc<Entry>> {
        match &self.redis {
            Some(r) => r.get(tenant, key).await.map(Arc::new),
            None => self.memory.get(tenant, key),
        }
    }

    /// Stores the tenant's answer under `key` in this process's memory, unless answers go to
    /// Redis: then the entry comes back, for `put_shared`.
    pub fn put_local(
        &self,
        tenant: &str,
        key: Key,
        entry: Entry,
        limits: &Limits,
    ) -> Option<Entry> {
        if self.redis.is_some() {
            return Some(entry);
        }
        if entry.size() <= self.max_entry_bytes {
            let changed = self.memory.put(tenant, key, entry, limits);
            self.stored(tenant, changed.evicted);
            let bytes = changed.bytes as i64;
            self.metrics
                .cache
                .bytes
                .with_label_values(&[tenant])
                .set(bytes);
        }
        None
    }

    /// Stores in Redis an answer `put_local` handed back.
    pub async fn put_shared(&self, tenant: &str, key: Key, entry: Entry, limits: &Limits) {
        let Some(r) = &self.redis else { return };
        if entry.size() <= self.max_entry_bytes {
            let evicted = r.put(tenant, &key, &entry, limits).await;
            self.stored(tenant, evicted);
        }
    }

    fn stored(&self, tenant: &str, evicted: u64) {
        self.metrics.cache.stores.with_label_values(&[tenant]).inc();
        if evicted > 0 {
            self.metrics
                .cache
                .evictions
                .with_label_values(&[tenant])
                .inc_by(evicted);
        }
    }

    /// Drops the tenant's answers (of `model` only, when given), semantic points included.
    pub async fn clear(&self, tenant: &str, model: Option<&str>) -> Usage {
        self.semantic.clear(tenant, model);
        match &self.redis {
            Some(r) => r.clear(tenant, model).await,
            None => {
                let gone = self.memory.clear(tenant, model);
                let left = self
                    .memory
                    .usage()
                    .into_iter()
                    .find(|(t, _)| t == tenant)
                    .map_or(0, |(_, u)| u.bytes);
                self.metrics
                    .cache
                    .bytes
                    .with_label_values(&[tenant])
                    .set(left as i64);
                gone
            }
        }
    }

    /// What each of `tenants` holds.
    pub async fn usage(&self, tenants: &[String]) -> Vec<(String, Usage)> {
        match &self.redis {
            Some(r) => {
                let mut all = Vec::with_capacity(tenants.len());
                for t in tenants {
                    all.push((t.clone(), r.usage(t).await));
                }
                all
            }
            None => {
                let held = self.memory.usage();
                tenants
                    .iter()
                    .map(|t| {
                        let u = held.iter().find(|(n, _)| n == t).map(|(_, u)| *u);
                        (t.clone(), u.unwrap_or_default())
                    })
                    .collect()
            }
        }
    }

    /// Counts one lookup of `kind` (`exact`, `semantic`) with its `result`.
    pub fn count(&self, tenant: &str, kind: &str, result: &str) {
        self.metrics
            .cache
            .lookups
            .with_label_values(&[tenant, kind, result])
            .inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_entry_survives_its_encoding() {
        let e = Entry {
            model: "m".into(),
            sse: true,
            prompt_tokens: 3,
            completion_tokens: 4,
            body: Bytes::from_static(b"data: {\"a\":1}\n\ndata: [DONE]\n\n"),
        };
        let d = Entry::decode(&e.encode()).unwrap();
        assert_eq!((d.model.as_str(), d.sse, d.prompt_tokens), ("m", true, 3));
        assert_eq!(d.body, e.body);
        assert!(Entry::decode(b"not json\nx").is_none());
    }
}
