//! Tenant plugins: WebAssembly components (WIT worlds in `wit/`) run by wasmtime in the
//! request path. This module owns the engine and sandbox (`runtime`), the generated bindings
//! and the `host` interface (`bindings`), the per-tenant registry with atomic hot swap
//! (`registry`) and the directory watcher (`watch`).
//!
//! Must not depend on the HTTP server or the inference engine: callers pass plain values in
//! and get plain values (or a `CallError`) back.

mod bindings;
mod registry;
mod runtime;
mod warm;
pub mod watch;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

pub use bindings::output_parser::Parsed;
pub use bindings::prompt_template::gateway::plugins::types::{ContextChunk, Message};
pub use bindings::prompt_template::{ChatRequest, RenderedPrompt};
pub use bindings::reranker::{Candidate, Scored};
pub use registry::Registry;
pub use runtime::{hex, write_atomically, Runtime};

use bindings::prompt_template::gateway::plugins::types;
use runtime::Prepared;
use warm::Bound;

/// The world a plugin implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PluginKind {
    PromptTemplate,
    Reranker,
    OutputParser,
}

impl PluginKind {
    pub fn as_str(self) -> &'static str {
        match self {
            PluginKind::PromptTemplate => "prompt-template",
            PluginKind::Reranker => "reranker",
            PluginKind::OutputParser => "output-parser",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Self::PromptTemplate, Self::Reranker, Self::OutputParser]
            .into_iter()
            .find(|k| k.as_str() == s)
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
    #[error("the manifest is invalid: {0}")]
    Manifest(String),
    #[error("could not store the plugin: {0}")]
    Io(#[from] std::io::Error),
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

/// Per-tenant values a plugin reads through `config-get`.
pub type TenantValues = Arc<BTreeMap<String, String>>;

/// One installed version of a tenant's plugin. Immutable: a new version is a new `Plugin`,
/// and a request that holds this `Arc` finishes on it whatever the registry does meanwhile.
pub struct Plugin {
    pub tenant: Arc<str>,
    pub name: Arc<str>,
    pub sha256: String,
    pub size: usize,
    pub loaded_at: SystemTime,
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

    /// Runs the `prompt-template` world's `render`.
    pub fn render(
        &self,
        rt: &Runtime,
        values: &TenantValues,
        request: &ChatRequest,
    ) -> Result<RenderedPrompt, CallError> {
        self.call(rt, values, |store, bound| match bound {
            Bound::PromptTemplate(p) => p.call_render(store, request),
            _ => unreachable!("kind checked by the caller"),
        })
    }

    /// Runs the `reranker` world's `rerank` and checks the result names only known candidates,
    /// each once, with finite scores.
    pub fn rerank(
        &self,
        rt: &Runtime,
        values: &TenantValues,
        query: &str,
        candidates: &[Candidate],
    ) -> Result<Vec<Scored>, CallError> {
        let scored = self.call(rt, values, |store, bound| match bound {
            Bound::Reranker(p) => p.call_rerank(store, query, candidates),
            _ => unreachable!("kind checked by the caller"),
        })?;
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
    pub fn parse(
        &self,
        rt: &Runtime,
        values: &TenantValues,
        text: &str,
        schema: Option<&str>,
    ) -> Result<Parsed, CallError> {
        let parsed = self.call(rt, values, |store, bound| match bound {
            Bound::OutputParser(p) => p.call_parse(store, text, schema),
            _ => unreachable!("kind checked by the caller"),
        })?;
        if let Err(e) = serde_json::from_str::<serde::de::IgnoredAny>(&parsed.json) {
            return Err(self.invalid(format!("`json` is not JSON: {e}")));
        }
        Ok(parsed)
    }

    fn invalid(&self, why: String) -> CallError {
        tracing::warn!(tenant = %self.tenant, plugin = %self.name, cause = "invalid_output", "{why}");
        CallError::InvalidOutput(why)
    }

    fn call<T>(
        &self,
        rt: &Runtime,
        values: &TenantValues,
        f: impl FnOnce(
            &mut wasmtime::Store<bindings::CallState>,
            &Bound,
        ) -> wasmtime::Result<Result<T, types::PluginError>>,
    ) -> Result<T, CallError> {
        let out = self
            .pool
            .take(rt, &self.prepared, &self.tenant, &self.name, values)
            .and_then(|mut w| match f(&mut w.store, &w.bound) {
                Ok(result) => {
                    self.pool.give_back(rt, w);
                    result.map_err(|e| CallError::Rejected {
                        code: e.code,
                        message: e.message,
                    })
                }
                Err(e) => Err(warm::Pool::failed(rt, w, e)),
            });
        if let Err(e) = &out {
            tracing::warn!(tenant = %self.tenant, plugin = %self.name, cause = e.cause(), error = %e, "plugin call failed");
        }
        out
    }
}

/// Tenant and plugin names end up in file paths: keep them to a safe alphabet.
pub fn valid_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && s.as_bytes()[0].is_ascii_alphanumeric()
}
