//! A tenant's `[tenants.cache]`: whether its answers are cached, for how long, how much, what a
//! hit costs, and its semantic cache.

use serde::Deserialize;

/// What a tenant's response cache does. Every field has a default, so `cache = {}` or no table
/// at all gives the exact cache of deterministic requests, an hour, 64 MiB, hits free.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CachePolicy {
    /// Answers of this tenant are cached and served again.
    pub enabled: bool,
    /// How long an answer is served again after it was stored.
    pub ttl_s: u64,
    /// The most this tenant's stored answers may take (MiB, fractions allowed); beyond it the
    /// least recently used go.
    pub max_mb: f64,
    /// Also cache requests that may answer differently each time (`temperature` above 0
    /// without a `seed`): a hit then repeats one sample.
    pub nondeterministic: bool,
    /// What a hit costs against the tenant's token rate and budget.
    pub charge: Charge,
    /// Paraphrases of an earlier last user message hit too (the gateway's embedding model).
    pub semantic: bool,
    /// The cosine similarity a semantic hit needs.
    pub threshold: f32,
    /// Semantic lookups only for conversations of at most this many messages.
    pub semantic_max_messages: usize,
    /// ... and whose last user message has at most this many characters.
    pub semantic_max_chars: usize,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Charge {
    /// A hit costs nothing (the ledger still records it, as `cached`, with no tokens).
    None,
    /// A hit costs the tokens of the answer it repeats.
    Full,
}

impl Default for CachePolicy {
    fn default() -> Self {
        Self {
            enabled: true,
            ttl_s: 3600,
            max_mb: 64.0,
            nondeterministic: false,
            charge: Charge::None,
            semantic: false,
            threshold: 0.95,
            semantic_max_messages: 4,
            semantic_max_chars: 2000,
        }
    }
}

impl CachePolicy {
    /// Every problem of the table, each naming its field under `at`.
    pub fn problems(&self, at: &str) -> Vec<String> {
        let mut problems = Vec::new();
        if self.ttl_s == 0 {
            problems.push(format!(
                "{at}.cache.ttl_s: must be at least 1 (set `enabled = false` to cache nothing)"
            ));
        }
        if !(self.max_mb > 0.0 && self.max_mb.is_finite()) {
            problems.push(format!("{at}.cache.max_mb: must be above 0"));
        }
        if !(self.threshold > 0.0 && self.threshold <= 1.0) {
            problems.push(format!(
                "{at}.cache.threshold: must be above 0 and at most 1 (cosine similarity)"
            ));
        }
        if self.semantic_max_messages == 0 || self.semantic_max_chars == 0 {
            problems.push(format!(
                "{at}.cache: semantic_max_messages and semantic_max_chars must be at least 1"
            ));
        }
        problems
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_cache_deterministic_answers_for_free() {
        let p: CachePolicy = toml::from_str("").unwrap();
        assert!(p.enabled && !p.nondeterministic && !p.semantic);
        assert_eq!(p.charge, Charge::None);
        assert!(p.problems("t").is_empty());
        let bad: CachePolicy = toml::from_str("ttl_s = 0\nthreshold = 1.5").unwrap();
        assert_eq!(bad.problems("t").len(), 2);
        assert!(toml::from_str::<CachePolicy>("charge = \"half\"").is_err());
    }
}
