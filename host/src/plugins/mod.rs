//! Tenant plugins: WebAssembly components (WIT worlds in `wit/`) run by wasmtime in the
//! request path. This module owns the engine and sandbox (`runtime`), the generated bindings
//! and the `host` interface (`bindings`), the per-tenant registry with atomic hot swap
//! (`registry`) and the directory watcher (`watch`).
//!
//! Must not depend on the HTTP server or the inference engine: callers pass plain values in
//! and get plain values (or a `CallError`) back.

mod bindings;
mod legacy;
mod processor;
mod registry;
mod runtime;
pub mod stats;
pub mod vocab;
mod warm;
pub mod watch;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

pub use crate::common::{hex, valid_name, write_atomically, ConfigValue};
pub use bindings::cache_key::CacheRequest;
pub use bindings::capturing_logs;
pub use bindings::logits_processor::{Decision, SequenceStart};
pub use bindings::output_parser::Parsed;
pub use bindings::prompt_template::gateway::plugins::types::{ContextChunk, Message, Value};
pub use bindings::prompt_template::{ChatRequest, RenderedPrompt};
pub use bindings::reranker::{Candidate, Scored};
pub use processor::Processor;
pub use registry::{Registry, Rejection};
pub use runtime::Runtime;

use bindings::prompt_template::gateway::plugins::types;
use runtime::Prepared;
use warm::Bound;

/// The versions of the `gateway:plugins` contract this gateway serves, oldest first: the
/// current one (`wit/plugins.wit`) and 0.1.0 (`wit/0.1.0/`, adapted in `legacy`).
pub const WIT_VERSIONS: &[&str] = &[LEGACY_WIT_VERSION, WIT_VERSION];
/// The version `wit/plugins.wit` is, which new plugins are built against.
pub const WIT_VERSION: &str = "0.2.0";
/// The previous version, still served through `legacy`.
pub const LEGACY_WIT_VERSION: &str = "0.1.0";

/// The roles a prompt-template plugin's messages may take (OpenAI's, `developer` included).
pub const MESSAGE_ROLES: &[&str] = &["system", "developer", "user", "assistant", "tool"];

/// The world a plugin implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PluginKind {
    PromptTemplate,
    Reranker,
    OutputParser,
    LogitsProcessor,
    CacheKey,
}

impl PluginKind {
    pub const ALL: [PluginKind; 5] = [
        PluginKind::PromptTemplate,
        PluginKind::Reranker,
        PluginKind::OutputParser,
        PluginKind::LogitsProcessor,
        PluginKind::CacheKey,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PluginKind::PromptTemplate => "prompt-template",
            PluginKind::Reranker => "reranker",
            PluginKind::OutputParser => "output-parser",
            PluginKind::LogitsProcessor => "logits-processor",
            PluginKind::CacheKey => "cache-key",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.as_str() == s)
    }
}

impl fmt::Display for PluginKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a component could not be installed. The previous version, if any, stays.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("invalid {what} {name:?}: use 1 to 64 characters from a-z, 0-9, '-' and '_', starting with a letter or digit")]
    BadName { what: &'static str, name: String },
    #[error("the component does not compile: {0}")]
    Compile(String),
    #[error("the component imports something the gateway does not provide: {0}")]
    Link(String),
    #[error("the component implements no plugin world: {0}")]
    NoWorld(String),
    #[error("the component was built against gateway:plugins@{0}; this gateway speaks gateway:plugins {versions}: rebuild it with this gateway's WIT (`gateway plugin build`, or the guest-sdk of this release)", versions = WIT_VERSIONS.join(", "))]
    Version(String),
    #[error("the manifest is invalid: {0}")]
    Manifest(String),
    #[error("could not store the plugin: {0}")]
    Io(#[from] std::io::Error),
}

impl LoadError {
    /// The `code` of the admin API's error for this refusal.
    pub fn code(&self) -> &'static str {
        match self {
            LoadError::BadName { .. } => "invalid_name",
            LoadError::Compile(_) => "plugin_invalid",
            LoadError::Link(_) => "plugin_unknown_imports",
            LoadError::NoWorld(_) => "plugin_no_world",
            LoadError::Version(_) => "plugin_wit_version",
            LoadError::Manifest(_) => "invalid_manifest",
            LoadError::Io(_) => "storage_failed",
        }
    }
}

/// Why one call failed. The plugin and the gateway carry on; only this request fails.
#[derive(Debug, Clone, thiserror::Error)]
pub enum CallError {
    #[error("returned an error ({code}): {message}")]
    Rejected { code: String, message: String },
    #[error("trapped: {0}")]
    Trap(String),
    #[error("panicked: {0}")]
    Panic(String),
    #[error("ran past its {ms} ms deadline")]
    Timeout { ms: u64 },
    #[error("exceeded its {limit_mb} MiB memory limit")]
    Memory { limit_mb: usize },
    #[error("returned invalid output: {0}")]
    InvalidOutput(String),
    #[error("has no free instance slot: {0}")]
    Busy(String),
}

impl CallError {
    /// The `cause` label of `plugin_failures_total`.
    pub fn cause(&self) -> &'static str {
        match self {
            CallError::Rejected { .. } => "rejected",
            CallError::Trap(_) => "trap",
            CallError::Panic(_) => "panic",
            CallError::Timeout { .. } => "timeout",
            CallError::Memory { .. } => "memory",
            CallError::InvalidOutput(_) => "invalid_output",
            CallError::Busy(_) => "busy",
        }
    }
}

/// JSON metadata as every reranker sees it (the `metadata` of `candidate` in the WIT), one
/// rendering for search and `/v1/rerank`: in name order; strings, numbers, booleans and arrays
/// of strings as themselves; arrays of numbers or booleans as a text list of their JSON;
/// objects and other arrays as text holding their JSON; nulls left out.
pub fn metadata<'a>(
    fields: impl Iterator<Item = (&'a String, &'a serde_json::Value)>,
) -> Vec<(String, Value)> {
    use serde_json::Value as J;
    let mut out: Vec<(String, Value)> = fields
        .filter_map(|(k, v)| {
            let value = match v {
                J::Null => return None,
                J::String(s) => Value::Text(s.clone()),
                J::Bool(b) => Value::Boolean(*b),
                J::Number(n) => n
                    .as_f64()
                    .map_or_else(|| Value::Text(n.to_string()), Value::Number),
                J::Array(items) => {
                    let scalars: Option<Vec<String>> = items
                        .iter()
                        .map(|i| match i {
                            J::String(s) => Some(s.clone()),
                            J::Number(_) | J::Bool(_) => Some(i.to_string()),
                            _ => None,
                        })
                        .collect();
                    scalars.map_or_else(|| Value::Text(v.to_string()), Value::TextList)
                }
                J::Object(_) => Value::Text(v.to_string()),
            };
            Some((k.clone(), value))
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// Per-tenant values a plugin reads through `config-get`.
pub type TenantValues = Arc<BTreeMap<String, crate::common::ConfigValue>>;

/// One installed version of a tenant's plugin. Immutable: a new version is a new `Plugin`,
/// and a request that holds this `Arc` finishes on it whatever the registry does meanwhile.
pub struct Plugin {
    pub tenant: Arc<str>,
    pub name: Arc<str>,
    pub sha256: String,
    pub size: usize,
    pub loaded_at: SystemTime,
    /// How long compiling and checking the component took.
    pub load_time: std::time::Duration,
    /// This version's calls, failures and call times.
    pub stats: stats::Stats,
    prepared: Prepared,
    pool: warm::Pool,
}

impl fmt::Debug for Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Plugin")
            .field("tenant", &self.tenant)
            .field("name", &self.name)
            .field("kind", &self.kind())
            .field("sha256", &self.sha256)
            .finish()
    }
}

impl Plugin {
    pub fn kind(&self) -> PluginKind {
        self.prepared.kind()
    }

    /// The version of `gateway:plugins` the plugin was built against.
    pub fn wit_version(&self) -> &'static str {
        self.prepared.version()
    }

    /// Runs the `prompt-template` world's `render`. Returned messages may only take the roles a chat template
    /// knows, so that a plugin's typo is its own invalid output, not a broken prompt.
    pub async fn render(
        &self,
        rt: &Runtime,
        values: &TenantValues,
        request: &ChatRequest,
    ) -> Result<RenderedPrompt, CallError> {
        let rendered = match self.call(rt, values, Request::Render(request)).await? {
            Reply::Render(r) => r,
            _ => unreachable!("a render call returns a rendered prompt"),
        };
        let size = match &rendered {
            RenderedPrompt::Prompt(p) => p.len(),
            RenderedPrompt::Messages(ms) => ms
                .iter()
                .map(|m| m.role.len() + m.content.len() + m.name.as_ref().map_or(0, |n| n.len()))
                .sum(),
        };
        if size > rt.max_output_bytes {
            return Err(self.invalid(format!(
                "rendered a {size}-byte prompt, over the {}-byte limit (plugins.max_output_bytes)",
                rt.max_output_bytes
            )));
        }
        if let RenderedPrompt::Messages(ms) = &rendered {
            if let Some(m) = ms
                .iter()
                .find(|m| !MESSAGE_ROLES.contains(&m.role.as_str()))
            {
                return Err(self.invalid(format!(
                    "returned a message with role {:?}; roles are {}",
                    bounded(m.role.clone(), 64),
                    MESSAGE_ROLES.join(", ")
                )));
            }
        }
        Ok(rendered)
    }

    /// Runs the `reranker` world's `rerank` and checks the result names only known candidates,
    /// each once, with finite scores.
    pub async fn rerank(
        &self,
        rt: &Runtime,
        values: &TenantValues,
        query: &str,
        candidates: &[Candidate],
    ) -> Result<Vec<Scored>, CallError> {
        let scored = match self
            .call(rt, values, Request::Rerank(query, candidates))
            .await?
        {
            Reply::Rerank(s) => s,
            _ => unreachable!("a rerank call returns scores"),
        };
        let mut seen = std::collections::HashSet::new();
        for s in &scored {
            if !candidates.iter().any(|c| c.id == s.id) {
                return Err(self.invalid(format!("scored unknown candidate id {:?}", s.id)));
            }
            if !seen.insert(s.id.as_str()) {
                return Err(self.invalid(format!("scored candidate {:?} twice", s.id)));
            }
            if !s.score.is_finite() {
                return Err(self.invalid(format!("score {} for {:?} is not finite", s.score, s.id)));
            }
        }
        Ok(scored)
    }

    /// Runs the `output-parser` world's `parse` and checks that what it returns is JSON.
    pub async fn parse(
        &self,
        rt: &Runtime,
        values: &TenantValues,
        text: &str,
        schema: Option<&str>,
    ) -> Result<Parsed, CallError> {
        let parsed = match self.call(rt, values, Request::Parse(text, schema)).await? {
            Reply::Parse(p) => p,
            _ => unreachable!("a parse call returns parsed output"),
        };
        let size = parsed.json.len() + parsed.repairs.iter().map(String::len).sum::<usize>();
        if size > rt.max_output_bytes {
            return Err(self.invalid(format!(
                "returned {size} bytes, over the {}-byte limit (plugins.max_output_bytes)",
                rt.max_output_bytes
            )));
        }
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&parsed.json) {
            return Err(self.invalid(format!("`json` is not JSON: {e}")));
        }
        Ok(parsed)
    }

    /// Runs the `cache-key` world's `key`: the text the tenant's response cache keys `request`
    /// on, or `None` when the request is not to be cached. The text is bounded by
    /// `plugins.max_output_bytes` like any plugin output.
    pub async fn cache_key(
        &self,
        rt: &Runtime,
        values: &TenantValues,
        request: &CacheRequest,
    ) -> Result<Option<String>, CallError> {
        let key = match self.call(rt, values, Request::CacheKey(request)).await? {
            Reply::CacheKey(k) => k,
            _ => unreachable!("a key call returns a key"),
        };
        if let Some(size) = key.as_ref().map(String::len) {
            if size > rt.max_output_bytes {
                return Err(self.invalid(format!(
                    "returned a {size}-byte cache key, over the {}-byte limit (plugins.max_output_bytes)",
                    rt.max_output_bytes
                )));
            }
        }
        Ok(key)
    }

    fn invalid(&self, why: String) -> CallError {
        // The reason may quote guest output (a candidate id): keep it short.
        let why = bounded(why, 1024);
        tracing::warn!(tenant = %self.tenant, plugin = %self.name, cause = "invalid_output", "{why}");
        CallError::InvalidOutput(why)
    }

    /// One call under the tenant's concurrency quota and the call deadline, which covers
    /// instantiation too and holds whatever the guest does: computing (epoch interruption
    /// traps it) or blocked in a host call (the call's future is dropped). An instance whose
    /// call failed or ran out of time is dropped, never reused.
    async fn call(
        &self,
        rt: &Runtime,
        values: &TenantValues,
        request: Request<'_>,
    ) -> Result<Reply, CallError> {
        let out = match rt.admit(&self.tenant) {
            Err(e) => Err(e),
            Ok(_slot) => {
                let timed_out = CallError::Timeout {
                    ms: rt.timeout.as_millis() as u64,
                };
                tokio::time::timeout(rt.timeout, self.call_now(rt, values, request))
                    .await
                    .unwrap_or(Err(timed_out))
            }
        };
        if let Err(e) = &out {
            tracing::warn!(tenant = %self.tenant, plugin = %self.name, cause = e.cause(), error = %e, "plugin call failed");
        }
        out
    }

    async fn call_now(
        &self,
        rt: &Runtime,
        values: &TenantValues,
        request: Request<'_>,
    ) -> Result<Reply, CallError> {
        let mut w = self
            .pool
            .take(rt, &self.prepared, &self.tenant, &self.name, values)
            .await?;
        match invoke(&mut w.store, &w.bound, request).await {
            Ok(result) => {
                self.pool.give_back(rt, w);
                result.map_err(|e| CallError::Rejected {
                    code: bounded(e.code, 64),
                    message: bounded(e.message, rt.max_error_bytes),
                })
            }
            Err(e) => Err(warm::Pool::failed(rt, w, e)),
        }
    }
}

/// The arguments of one call, by world.
enum Request<'r> {
    Render(&'r ChatRequest),
    Rerank(&'r str, &'r [Candidate]),
    Parse(&'r str, Option<&'r str>),
    CacheKey(&'r CacheRequest),
}

enum Reply {
    Render(RenderedPrompt),
    Rerank(Vec<Scored>),
    Parse(Parsed),
    CacheKey(Option<String>),
}

async fn invoke(
    store: &mut wasmtime::Store<bindings::CallState>,
    bound: &Bound,
    request: Request<'_>,
) -> wasmtime::Result<Result<Reply, types::PluginError>> {
    Ok(match (bound, request) {
        (Bound::PromptTemplate(p), Request::Render(r)) => {
            p.call_render(store, r).await?.map(Reply::Render)
        }
        (Bound::Reranker(p), Request::Rerank(q, c)) => {
            p.call_rerank(store, q, c).await?.map(Reply::Rerank)
        }
        (Bound::OutputParser(p), Request::Parse(t, s)) => {
            p.call_parse(store, t, s).await?.map(Reply::Parse)
        }
        (Bound::CacheKey(p), Request::CacheKey(r)) => {
            p.call_key(store, r).await?.map(Reply::CacheKey)
        }
        (Bound::Legacy(b), request) => return legacy::invoke(store, b, request).await,
        _ => unreachable!("the plugin's kind is checked before it is called"),
    })
}

/// `value` as canonical JSON text: compact, every object's keys sorted (at every depth), so two
/// requests that mean the same give the same text whatever order their fields came in. The
/// `parameters` of a `CacheRequest`.
pub fn canonical_json(value: &serde_json::Value) -> String {
    use serde_json::Value as J;
    fn sorted(v: &J) -> J {
        match v {
            J::Object(m) => {
                let mut entries: Vec<(&String, &J)> = m.iter().collect();
                entries.sort_by(|a, b| a.0.cmp(b.0));
                J::Object(
                    entries
                        .into_iter()
                        .map(|(k, v)| (k.clone(), sorted(v)))
                        .collect(),
                )
            }
            J::Array(items) => J::Array(items.iter().map(sorted).collect()),
            other => other.clone(),
        }
    }
    sorted(value).to_string()
}

/// `text` cut to at most `max` bytes (on a character boundary) plus a marker saying so: what
/// a plugin says reaches logs and response bodies, and must not be able to flood them.
pub fn bounded(text: String, max: usize) -> String {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}… [truncated, {} bytes in all]", &text[..end], text.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn canonical_json_sorts_keys_at_every_depth() {
        let a: serde_json::Value =
            serde_json::from_str(r#"{"top_p": 1, "tools": [{"b": 2, "a": {"y": 0, "x": 1}}]}"#)
                .unwrap();
        let b: serde_json::Value =
            serde_json::from_str(r#"{"tools": [{"a": {"x": 1, "y": 0}, "b": 2}], "top_p": 1}"#)
                .unwrap();
        assert_eq!(canonical_json(&a), canonical_json(&b));
        assert_eq!(
            canonical_json(&a),
            r#"{"tools":[{"a":{"x":1,"y":0},"b":2}],"top_p":1}"#
        );
    }
}
