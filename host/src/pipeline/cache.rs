//! The response-cache stage: right after admission and the checks the body and the tenant's
//! policy decide, before anything that costs (retrieval, plugins, reservation, generation). A
//! hit answers with the stored response and skips every later stage; a miss runs them and
//! stores what they answered (`Pending::store`).
//!
//! The exact key is a SHA-256 over the tenant, the endpoint, the model asked for, the versions
//! of what shapes the answer (the policy fields that bind plugins, their `config`, retrieval
//! settings, each bound plugin's sha256, and with RAG the collection's change sequence), and
//! the canonical request: the body with object keys sorted at every depth, without the fields that do not
//! shape the answer (`user`, ...), `stream` kept (a stream's frames are stored as a stream).
//! A tenant's `cache-key` plugin may replace the canonical request with its own text, or
//! refuse caching. Only deterministic requests are cached unless the policy says otherwise.
//!
//! The semantic lookup (opt-in) embeds the last user message and looks for a close one among
//! stored requests whose everything else hashes the same (`cache::semantic`).

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use super::{Error, Stages};
use crate::cache::{Entry, Key, Limits, ResponseCache};
use crate::common::Endpoint;
use crate::plugins::canonical_json;
use crate::search::embedder::Embedder;
use crate::tenancy::cache_policy::Charge;
use crate::tenancy::{Caller, Outcome};

/// Body fields that do not change the answer: the end user's id and hints to OpenAI's own
/// caches and tiers.
const IGNORED: [&str; 5] = [
    "user",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "service_tier",
];

/// The handles the stage takes.
#[derive(Clone)]
pub struct CacheStage {
    pub cache: Arc<ResponseCache>,
    /// The embedding model of semantic lookups.
    pub embedder: Option<Arc<Embedder>>,
}

/// A request as the cache sees it.
pub struct Keyed {
    pub endpoint: Endpoint,
    pub model: String,
    /// The body (and, for a Responses request, its chat translation), canonical.
    pub canonical: Map<String, Value>,
    /// The conversation as (role, text): what a `cache-key` plugin and the semantic lookup
    /// read.
    pub messages: Vec<(String, String)>,
    /// The collection the request retrieves from, if any.
    pub collection: Option<String>,
    /// Everything else about the tenant's retrieval that shapes the prompt.
    pub retrieval: String,
    /// Plugins the request names itself (a RAG reranker), beside the policy's bindings.
    pub plugins: Vec<String>,
}

impl Keyed {
    pub fn new(endpoint: Endpoint, model: &str, body: &Map<String, Value>) -> Self {
        Self {
            endpoint,
            model: model.to_string(),
            canonical: canonical(body),
            messages: Vec::new(),
            collection: None,
            retrieval: String::new(),
            plugins: Vec::new(),
        }
    }

    /// A completions request: its prompt is the one user message.
    pub fn completion(model: &str, body: &Map<String, Value>) -> Self {
        let mut k = Self::new(Endpoint::Completions, model, body);
        let prompt = match body.get("prompt") {
            Some(Value::String(s)) => s.clone(),
            Some(other) => other.to_string(),
            None => String::new(),
        };
        k.messages = vec![("user".into(), prompt)];
        k
    }

    /// `temperature` 0, or a `seed`: the same request gets the same answer.
    fn deterministic(&self) -> bool {
        let b = &self.canonical;
        b.get("temperature").and_then(Value::as_f64) == Some(0.0)
            || b.get("seed").is_some_and(Value::is_number)
    }
}

/// `body` without the fields that do not shape the answer (keyed as `canonical_json`, keys
/// sorted at every depth).
fn canonical(body: &Map<String, Value>) -> Map<String, Value> {
    let mut c = body.clone();
    for f in IGNORED {
        c.remove(f);
    }
    c
}

pub enum Lookup {
    /// The cache is off for this tenant (or process): no header says anything.
    Off,
    /// Neither looked up nor stored, for a reason the request shows (`Cache-Control:
    /// no-cache`, not deterministic, the `cache-key` plugin's choice).
    Bypass,
    Hit(Hit),
    Miss(Pending),
}

pub struct Hit {
    pub entry: Arc<Entry>,
    /// A semantic hit's cosine similarity.
    pub similarity: Option<f32>,
}

/// A miss, to be stored once answered.
pub struct Pending {
    cache: Arc<ResponseCache>,
    tenant: Arc<str>,
    model: String,
    key: Key,
    limits: Limits,
    /// The semantic bucket and the last user message's embedding, to index the answer by.
    semantic: Option<(Key, Vec<f32>)>,
}

impl Pending {
    /// Stores the answer: at once in this process's memory (so the client's next request
    /// finds it), or as the returned future to spawn when it goes to Redis.
    pub fn store(self, entry: Entry) -> Option<impl std::future::Future<Output = ()> + Send> {
        // A fallback's answer (the model asked for was saturated) is not the model's: it is not
        // repeated once the model is free again.
        if entry.model != self.model || entry.size() > self.max_bytes() {
            return None;
        }
        if let Some((bucket, vector)) = &self.semantic {
            let (tenant, model, ttl) = (&self.tenant, &self.model, self.limits.ttl);
            self.cache
                .semantic
                .insert(tenant, model, *bucket, vector.clone(), self.key, ttl);
        }
        let entry = self
            .cache
            .put_local(&self.tenant, self.key, entry, &self.limits)?;
        Some(async move {
            self.cache
                .put_shared(&self.tenant, self.key, entry, &self.limits)
                .await
        })
    }

    /// The most bytes an answer may take to be stored.
    pub fn max_bytes(&self) -> u64 {
        self.cache.max_entry_bytes.min(self.limits.max_bytes)
    }
}

impl CacheStage {
    pub async fn lookup(
        &self,
        stages: &Stages,
        caller: &Caller,
        keyed: Keyed,
    ) -> Result<Lookup, Error> {
        let policy = &caller.tenant.policy.cache;
        if !self.cache.enabled || !policy.enabled {
            return Ok(Lookup::Off);
        }
        let tenant = caller.tenant.name.clone();
        let bypass = || {
            self.cache.count(&tenant, "exact", "bypass");
            Ok(Lookup::Bypass)
        };
        // A debugging caller wants this run's plugin logs, not a stored answer.
        if caller.no_cache || caller.debug.is_some() {
            return bypass();
        }
        if !keyed.deterministic() && !policy.nondeterministic {
            return bypass();
        }
        let prefix = versions(stages, caller, &keyed)?;
        let text = match &caller.tenant.policy.cache_key {
            // What decides the answer's shape stays keyed whatever the plugin returns.
            Some(name) => match plugin_key(stages, caller, name, &keyed).await {
                Some(text) => format!("{}\0{text}", shape(&keyed.canonical)),
                None => return bypass(),
            },
            None => canonical_json(&Value::Object(keyed.canonical.clone())),
        };
        let key = digest(&[b"exact", prefix.as_bytes(), text.as_bytes()]);
        if let Some(entry) = self.cache.get(&tenant, &key).await {
            self.cache.count(&tenant, "exact", "hit");
            let similarity = None;
            return Ok(Lookup::Hit(Hit { entry, similarity }));
        }
        self.cache.count(&tenant, "exact", "miss");
        let mut semantic = None;
        if caller.tenant.policy.cache_key.is_none() {
            if let Some((bucket, vector)) = self.embedded(caller, &keyed, &prefix, &text).await {
                if let Some(hit) = self.semantic_hit(caller, &keyed, &bucket, &vector).await {
                    return Ok(Lookup::Hit(hit));
                }
                semantic = Some((bucket, vector));
            }
        }
        Ok(Lookup::Miss(Pending {
            cache: self.cache.clone(),
            tenant,
            model: keyed.model,
            key,
            limits: Limits {
                ttl: Duration::from_secs(policy.ttl_s),
                max_bytes: (policy.max_mb * 1024.0 * 1024.0) as u64,
            },
            semantic,
        }))
    }

    /// The semantic bucket (everything but the last user message) and that message's
    /// embedding, when the tenant has the semantic cache and the request is within its limits.
    async fn embedded(
        &self,
        caller: &Caller,
        keyed: &Keyed,
        prefix: &str,
        text: &str,
    ) -> Option<(Key, Vec<f32>)> {
        let policy = &caller.tenant.policy.cache;
        let embedder = self.embedder.clone().filter(|_| policy.semantic)?;
        let (role, last) = keyed.messages.last()?;
        if role != "user"
            || keyed.messages.len() > policy.semantic_max_messages
            || last.chars().count() > policy.semantic_max_chars
            || last.trim().is_empty()
        {
            return None;
        }
        // The message's JSON string wherever it occurs (the body, a Responses request's chat
        // translation), emptied: what is left must match exactly.
        let quoted = Value::String(last.clone()).to_string();
        let rest = text.replace(&quoted, "\"\"");
        let bucket = digest(&[b"semantic", prefix.as_bytes(), rest.as_bytes()]);
        let message = last.clone();
        let embedded = super::blocking("the cache's query embedding", move || {
            let ids = embedder.tokenize_truncated(&message).ok()?;
            embedder.embed(&[ids]).ok()?.pop()
        })
        .await;
        Some((bucket, embedded.ok()??))
    }

    async fn semantic_hit(
        &self,
        caller: &Caller,
        keyed: &Keyed,
        bucket: &Key,
        vector: &[f32],
    ) -> Option<Hit> {
        let tenant = &caller.tenant.name;
        let threshold = caller.tenant.policy.cache.threshold;
        let found = self
            .cache
            .semantic
            .find(tenant, &keyed.model, bucket, vector, threshold);
        let hit = match found {
            Some(m) => self.cache.get(tenant, &m.answer).await.map(|entry| Hit {
                entry,
                similarity: Some(m.similarity),
            }),
            None => None,
        };
        let result = if hit.is_some() { "hit" } else { "miss" };
        self.cache.count(tenant, "semantic", result);
        hit
    }
}

/// Everything but the request itself that the answer depends on: tenant, endpoint, model,
/// the policy fields that shape the prompt and output, the bound plugins' versions, the
/// collection's change sequence.
fn versions(stages: &Stages, caller: &Caller, keyed: &Keyed) -> Result<String, Error> {
    let t = &caller.tenant;
    let p = &t.policy;
    let mut out = format!(
        "{}\0{}\0{}\0{:?}\0{:?}\0{:?}\0{:?}\0{}",
        t.name,
        keyed.endpoint.as_str(),
        keyed.model,
        p.plugin_bindings(),
        p.parse_output,
        p.config,
        p.rag,
        keyed.retrieval,
    );
    let bound = p.plugin_bindings().into_iter().filter_map(|(_, _, n)| n);
    for name in bound.chain(&keyed.plugins) {
        if let Some(plugin) = stages.plugins.registry.get(&t.name, name) {
            out.push('\0');
            out.push_str(&plugin.sha256);
        }
    }
    if let Some(c) = &keyed.collection {
        let collection = stages.retrieval.open(caller, c)?;
        out.push('\0');
        out.push_str(&collection.version());
    }
    Ok(out)
}

/// The tenant's `cache-key` plugin's text for the request; none when it says not to cache or
/// fails (a cache plugin's failure costs the request its cache, not its answer).
async fn plugin_key(stages: &Stages, caller: &Caller, name: &str, keyed: &Keyed) -> Option<String> {
    let messages = keyed
        .messages
        .iter()
        .map(|(role, content)| crate::plugins::Message {
            role: role.clone(),
            content: content.clone(),
            name: None,
        })
        .collect();
    let mut parameters = keyed.canonical.clone();
    for f in ["messages", "prompt", "input", "chat", "model"] {
        parameters.remove(f);
    }
    let request = crate::plugins::CacheRequest {
        model: keyed.model.clone(),
        endpoint: keyed.endpoint.as_str().to_string(),
        messages,
        parameters: canonical_json(&Value::Object(parameters)),
    };
    match stages.plugins.cache_key(caller, name, request).await {
        Ok(text) => text,
        Err(e) => {
            tracing::warn!(tenant = %caller.tenant.name, plugin = name, error = %e, "cache-key plugin failed; the request is served uncached");
            None
        }
    }
}

/// The body fields that decide the form of the answer (a stream or a body, how many choices,
/// log probabilities, echo), and the messages without their text (roles, names, tool calls).
fn shape(body: &Map<String, Value>) -> String {
    let mut shape: Map<String, Value> = [
        "stream",
        "stream_options",
        "n",
        "logprobs",
        "top_logprobs",
        "echo",
        "best_of",
    ]
    .into_iter()
    .filter_map(|f| Some((f.to_string(), body.get(f)?.clone())))
    .collect();
    if let Some(Value::Array(ms)) = body.get("messages") {
        let forms = ms
            .iter()
            .map(|m| match m {
                Value::Object(o) => {
                    let mut o = o.clone();
                    o.remove("content");
                    Value::Object(o)
                }
                other => other.clone(),
            })
            .collect();
        shape.insert("messages".into(), Value::Array(forms));
    }
    canonical_json(&Value::Object(shape))
}

fn digest(parts: &[&[u8]]) -> Key {
    let mut h = Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_le_bytes());
        h.update(p);
    }
    h.finalize().into()
}

/// Records a hit in the ledger (outcome `cached`) and charges it as the tenant's policy says:
/// nothing, or the tokens of the answer it repeats (refused like any request past a limit).
pub async fn charge_hit(
    stages: &Stages,
    caller: &Caller,
    endpoint: Endpoint,
    entry: &Entry,
    started: std::time::Instant,
) -> Result<(), Error> {
    match caller.tenant.policy.cache.charge {
        Charge::None => {
            let model = &entry.model;
            stages
                .tenancy
                .record_plain(caller, model, endpoint, started, Outcome::Cached);
        }
        Charge::Full => {
            let (prompt, completion) = (entry.prompt_tokens, entry.completion_tokens);
            let r = stages
                .tenancy
                .reserve_tokens(caller, &entry.model, endpoint, prompt, prompt + completion)
                .await
                .map_err(Error::Denied)?;
            r.settle(prompt, completion, Outcome::Cached);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keyed(body: Value) -> Keyed {
        Keyed::new(Endpoint::Chat, "m", body.as_object().unwrap())
    }

    #[test]
    fn only_temperature_zero_or_a_seed_is_deterministic() {
        let msgs = serde_json::json!([{"role": "user", "content": "x"}]);
        assert!(keyed(serde_json::json!({"messages": msgs, "temperature": 0})).deterministic());
        assert!(
            keyed(serde_json::json!({"messages": msgs, "temperature": 0.7, "seed": 3}))
                .deterministic()
        );
        assert!(!keyed(serde_json::json!({"messages": msgs})).deterministic());
        assert!(!keyed(serde_json::json!({"messages": msgs, "temperature": 0.2})).deterministic());
    }

    #[test]
    fn fields_that_do_not_shape_the_answer_are_not_keyed() {
        let a = keyed(serde_json::json!({"messages": [], "user": "u1", "temperature": 0}));
        let b = keyed(serde_json::json!({"temperature": 0, "user": "u2", "messages": []}));
        assert_eq!(
            canonical_json(&Value::Object(a.canonical)),
            canonical_json(&Value::Object(b.canonical))
        );
        assert_ne!(digest(&[b"ab", b"c"]), digest(&[b"a", b"bc"]));
    }
}
