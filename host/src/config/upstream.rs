//! `[[upstreams]]`: models served by other OpenAI-compatible servers.

use std::path::PathBuf;

use serde::Deserialize;

/// A model served elsewhere, by OpenAI-compatible replicas.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// Name clients put in `model`.
    pub name: String,
    /// The name sent upstream (default: `name`).
    pub model: Option<String>,
    /// Base URLs as an OpenAI client takes them, e.g. `http://10.0.0.7:8000/v1`; or
    /// `dns+http://engines:8080/v1` for every address a name resolves to (a Kubernetes
    /// headless Service), re-resolved each probe round.
    pub replicas: Vec<String>,
    /// Bearer key sent upstream. Prefer `api_key_env`: the key never appears in logs.
    pub api_key: Option<String>,
    /// Environment variable holding the bearer key.
    pub api_key_env: Option<String>,
    /// Extra PEM root certificate for `https` replicas with a private CA (the Mozilla roots
    /// are always trusted).
    pub ca: Option<PathBuf>,
    /// Path probed on each replica's origin every `probe_ms` (`/health` for vLLM and
    /// llama.cpp; `/ready` for gateways, so a draining one gets no new requests). Empty: no
    /// probes, ejection is passive only (hosted providers).
    pub health_path: String,
    /// Read each replica's `/metrics` (vLLM's gauges) every `probe_ms` to weigh its load.
    pub scrape_metrics: bool,
    pub probe_ms: u64,
    pub connect_timeout_ms: u64,
    /// A stream's first byte must come within this long; a non-streaming answer, whole.
    pub first_token_timeout_ms: u64,
    /// Most silence between two pieces of a stream.
    pub idle_timeout_ms: u64,
    /// How long a replica that failed (connect error, 5xx, timeout) is left out.
    pub eject_ms: u64,
    /// Replicas tried per request, for failures before the first response byte.
    pub max_attempts: usize,
    /// Tokens reserved for the completion when the request sets no `max_tokens`.
    pub default_max_tokens: u64,
    /// The replicas' context window, when known: a request whose `max_tokens` alone does not
    /// fit is refused before anything is charged. Unset, the replica checks the prompt.
    pub max_model_len: Option<usize>,
    /// Requests queued on every replica beyond which `fallback` takes new requests (0: never).
    pub saturated_waiting: usize,
    /// Models tried in order when this one is saturated or every replica failed.
    pub fallback: Vec<String>,
    /// Requests sharing a tenant and a prompt prefix go to the replica that served it last,
    /// unless its load exceeds the least loaded replica's by `balance_abs` and by the factor
    /// `balance_rel` (SGLang's cache-aware rule).
    pub prefix_affinity: bool,
    pub balance_abs: usize,
    pub balance_rel: f64,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        Self {
            name: String::new(),
            model: None,
            replicas: Vec::new(),
            api_key: None,
            api_key_env: None,
            ca: None,
            health_path: "/health".into(),
            scrape_metrics: true,
            probe_ms: 1_000,
            connect_timeout_ms: 2_000,
            first_token_timeout_ms: 120_000,
            idle_timeout_ms: 60_000,
            eject_ms: 5_000,
            max_attempts: 2,
            default_max_tokens: 1_024,
            max_model_len: None,
            saturated_waiting: 0,
            fallback: Vec::new(),
            prefix_affinity: true,
            balance_abs: 4,
            balance_rel: 1.5,
        }
    }
}

/// Names unique across local and upstream models, replicas that parse as http(s) URLs, and
/// fallbacks that name configured models. The key's variable (`api_key_env`) is read where
/// the pool is built, not here: the config reads no environment.
pub(super) fn validate(cfg: &super::Config) -> Result<(), String> {
    let mut names = std::collections::HashSet::new();
    for name in cfg.models.iter().map(|m| &m.name) {
        names.insert(name.as_str());
    }
    for u in &cfg.upstreams {
        let at = format!("upstreams.{}", u.name);
        if u.name.is_empty() {
            return Err("every [[upstreams]] entry needs a name".into());
        }
        if !names.insert(u.name.as_str()) {
            return Err(format!("model name {:?} is configured twice", u.name));
        }
        if u.replicas.is_empty() {
            return Err(format!("{at}: at least one replica URL is needed"));
        }
        for r in &u.replicas {
            let uri: http::Uri = r
                .parse()
                .map_err(|e| format!("{at}: replica {r:?} is not a URL: {e}"))?;
            let scheme = uri.scheme_str();
            if !matches!(scheme, Some("http" | "https" | "dns+http")) || uri.host().is_none() {
                return Err(format!(
                    "{at}: replica {r:?} must be an http://, https:// or dns+http:// URL"
                ));
            }
        }
        if u.max_attempts == 0 || u.probe_ms == 0 || u.connect_timeout_ms == 0 {
            return Err(format!(
                "{at}: max_attempts, probe_ms and connect_timeout_ms must be > 0"
            ));
        }
        if u.first_token_timeout_ms == 0 || u.idle_timeout_ms == 0 || u.balance_rel < 1.0 {
            return Err(format!(
                "{at}: timeouts must be > 0 and balance_rel at least 1"
            ));
        }
        if u.api_key.is_some() && u.api_key_env.is_some() {
            return Err(format!("{at}: set api_key or api_key_env, not both"));
        }
    }
    let chains = cfg
        .models
        .iter()
        .map(|m| (&m.name, &m.fallback))
        .chain(cfg.upstreams.iter().map(|u| (&u.name, &u.fallback)));
    for (name, fallback) in chains {
        for f in fallback {
            if f == name || !names.contains(f.as_str()) {
                return Err(format!(
                    "{name}: fallback {f:?} must name another configured model"
                ));
            }
        }
    }
    Ok(())
}
