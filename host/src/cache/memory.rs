//! Answers held in this process's memory: bounded in bytes overall and per tenant, least
//! recently used first out, each expiring at its tenant's TTL. One mutex: a lookup is a hash
//! probe and two ordered-map updates, far below the cost of anything it saves.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use parking_lot::Mutex;

use super::{Entry, Key, Limits, Usage};

pub struct Memory {
    inner: Mutex<Inner>,
    /// All tenants' answers together.
    cap: u64,
}

#[derive(Default)]
struct Inner {
    tenants: HashMap<Arc<str>, Tenant>,
    /// Every answer by last use, oldest first: (tick → tenant, key).
    order: BTreeMap<u64, (Arc<str>, Key)>,
    tick: u64,
    bytes: u64,
}

#[derive(Default)]
struct Tenant {
    entries: HashMap<Key, Slot>,
    /// This tenant's answers by last use (tick → key).
    order: BTreeMap<u64, Key>,
    bytes: u64,
}

struct Slot {
    entry: Arc<Entry>,
    tick: u64,
    expires: Instant,
}

/// What a change did: answers dropped to make room, and the tenant's bytes after it.
pub struct Changed {
    pub evicted: u64,
    pub bytes: u64,
}

impl Memory {
    pub fn new(cap: u64) -> Self {
        Self {
            inner: Mutex::default(),
            cap,
        }
    }

    /// The tenant's answer under `key`, if one is stored and fresh; it becomes the most
    /// recently used.
    pub fn get(&self, tenant: &str, key: &Key) -> Option<Arc<Entry>> {
        let mut g = self.inner.lock();
        let inner = &mut *g;
        let t = inner.tenants.get_mut(tenant)?;
        let slot = t.entries.get(key)?;
        if slot.expires <= Instant::now() {
            let name = inner.tenants.get_key_value(tenant)?.0.clone();
            inner.remove(&name, key);
            return None;
        }
        inner.tick += 1;
        let tick = inner.tick;
        let t = inner.tenants.get_mut(tenant)?;
        let slot = t.entries.get_mut(key)?;
        let old = std::mem::replace(&mut slot.tick, tick);
        let entry = slot.entry.clone();
        t.order.remove(&old);
        t.order.insert(tick, *key);
        if let Some(v) = inner.order.remove(&old) {
            inner.order.insert(tick, v);
        }
        Some(entry)
    }

    /// Stores `entry`, replacing any under `key`, then drops the least recently used answers
    /// of the tenant (past `limits.max_bytes`) and of everyone (past the process's cap).
    pub fn put(&self, tenant: &str, key: Key, entry: Entry, limits: &Limits) -> Changed {
        let size = entry.size();
        let mut inner = self.inner.lock();
        let name: Arc<str> = match inner.tenants.get_key_value(tenant) {
            Some((n, _)) => n.clone(),
            None => Arc::from(tenant),
        };
        inner.remove(&name, &key);
        if size > limits.max_bytes.min(self.cap) {
            let bytes = inner.tenants.get(tenant).map_or(0, |t| t.bytes);
            return Changed { evicted: 0, bytes };
        }
        inner.tick += 1;
        let tick = inner.tick;
        inner.order.insert(tick, (name.clone(), key));
        inner.bytes += size;
        let t = inner.tenants.entry(name.clone()).or_default();
        t.bytes += size;
        t.order.insert(tick, key);
        t.entries.insert(
            key,
            Slot {
                entry: Arc::new(entry),
                tick,
                expires: Instant::now() + limits.ttl,
            },
        );
        let mut evicted = 0;
        while let Some(oldest) = inner
            .tenants
            .get(tenant)
            .filter(|t| t.bytes > limits.max_bytes)
            .and_then(|t| t.order.first_key_value().map(|(_, k)| *k))
        {
            inner.remove(&name, &oldest);
            evicted += 1;
        }
        while inner.bytes > self.cap {
            let Some((_, (who, k))) = inner.order.first_key_value().map(|(t, v)| (*t, v.clone()))
            else {
                break;
            };
            inner.remove(&who, &k);
            evicted += 1;
        }
        let bytes = inner.tenants.get(tenant).map_or(0, |t| t.bytes);
        Changed { evicted, bytes }
    }

    /// Drops the tenant's answers (of `model` only, when given); returns how many and their
    /// bytes.
    pub fn clear(&self, tenant: &str, model: Option<&str>) -> Usage {
        let mut inner = self.inner.lock();
        let Some((name, t)) = inner.tenants.get_key_value(tenant) else {
            return Usage::default();
        };
        let name = name.clone();
        let keys: Vec<Key> = t
            .entries
            .iter()
            .filter(|(_, s)| model.is_none_or(|m| s.entry.model == m))
            .map(|(k, _)| *k)
            .collect();
        let mut gone = Usage::default();
        for k in keys {
            gone.entries += 1;
            gone.bytes += inner.remove(&name, &k);
        }
        gone
    }

    /// Each tenant's answers and bytes held.
    pub fn usage(&self) -> Vec<(String, Usage)> {
        let inner = self.inner.lock();
        let mut all: Vec<(String, Usage)> = inner
            .tenants
            .iter()
            .map(|(n, t)| {
                let u = Usage {
                    entries: t.entries.len() as u64,
                    bytes: t.bytes,
                };
                (n.to_string(), u)
            })
            .collect();
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }
}

impl Inner {
    /// Removes one answer; returns its size (0 when there was none).
    fn remove(&mut self, tenant: &Arc<str>, key: &Key) -> u64 {
        let Some(t) = self.tenants.get_mut(tenant) else {
            return 0;
        };
        let Some(slot) = t.entries.remove(key) else {
            return 0;
        };
        let size = slot.entry.size();
        t.order.remove(&slot.tick);
        t.bytes -= size;
        if t.entries.is_empty() {
            self.tenants.remove(tenant);
        }
        self.order.remove(&slot.tick);
        self.bytes -= size;
        size
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn entry(n: usize, model: &str) -> Entry {
        Entry {
            model: model.into(),
            sse: false,
            prompt_tokens: 1,
            completion_tokens: 1,
            body: bytes::Bytes::from(vec![b'x'; n]),
        }
    }

    fn key(i: u8) -> Key {
        [i; 32]
    }

    fn limits(max_bytes: u64) -> Limits {
        Limits {
            ttl: Duration::from_secs(60),
            max_bytes,
        }
    }

    #[test]
    fn tenants_are_apart_and_least_recently_used_goes_first() {
        let m = Memory::new(1 << 20);
        let size = entry(100, "m").size();
        m.put("a", key(1), entry(100, "m"), &limits(3 * size));
        m.put("a", key(2), entry(100, "m"), &limits(3 * size));
        m.put("a", key(3), entry(100, "m"), &limits(3 * size));
        assert!(m.get("b", &key(1)).is_none(), "another tenant's answer");
        assert!(m.get("a", &key(1)).is_some());
        let c = m.put("a", key(4), entry(100, "m"), &limits(3 * size));
        assert_eq!(c.evicted, 1);
        assert!(
            m.get("a", &key(2)).is_none(),
            "the least recently used went"
        );
        assert!(m.get("a", &key(1)).is_some() && m.get("a", &key(4)).is_some());
        assert_eq!(
            m.usage(),
            vec![(
                "a".into(),
                Usage {
                    entries: 3,
                    bytes: 3 * size
                }
            )]
        );
    }

    #[test]
    fn the_process_cap_evicts_across_tenants() {
        let size = entry(100, "m").size();
        let m = Memory::new(2 * size);
        m.put("a", key(1), entry(100, "m"), &limits(1 << 20));
        m.put("b", key(1), entry(100, "m"), &limits(1 << 20));
        m.put("c", key(1), entry(100, "m"), &limits(1 << 20));
        assert!(m.get("a", &key(1)).is_none());
        assert!(m.get("c", &key(1)).is_some());
        let too_big = m.put("d", key(1), entry(10_000, "m"), &limits(1 << 20));
        assert_eq!(too_big.bytes, 0);
        assert!(m.get("d", &key(1)).is_none());
    }

    #[test]
    fn expired_answers_are_not_served_and_clear_takes_a_model() {
        let m = Memory::new(1 << 20);
        let short = Limits {
            ttl: Duration::from_millis(1),
            max_bytes: 1 << 20,
        };
        m.put("a", key(1), entry(10, "m"), &short);
        std::thread::sleep(Duration::from_millis(5));
        assert!(m.get("a", &key(1)).is_none());
        assert!(m.usage().is_empty());
        m.put("a", key(2), entry(10, "m"), &limits(1 << 20));
        m.put("a", key(3), entry(10, "n"), &limits(1 << 20));
        assert_eq!(m.clear("a", Some("n")).entries, 1);
        assert!(m.get("a", &key(2)).is_some());
        assert_eq!(m.clear("a", None).entries, 1);
    }
}
