//! `[cache]`: the response cache of this process (each tenant's share of it is its policy's
//! `[tenants.cache]`).

use serde::Deserialize;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CacheConfig {
    /// Off: no request is looked up or stored, whatever the tenants' policies say.
    pub enabled: bool,
    /// The most all tenants' answers may take in this process's memory (MiB); beyond it the
    /// least recently used go. With `[cluster] redis` answers are kept in Redis instead, shared
    /// by the replicas, each tenant within its own `max_mb`.
    pub memory_mb: u64,
    /// A larger answer is not stored (KiB).
    pub max_entry_kb: u64,
    /// The embedding model of semantic lookups; the first `[[embeddings]]` model when unset.
    pub embedding_model: Option<String>,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            memory_mb: 256,
            max_entry_kb: 1024,
            embedding_model: None,
        }
    }
}
