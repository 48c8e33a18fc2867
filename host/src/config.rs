//! One typed configuration: TOML file, then CLI flags on top. Every field has a default that runs
//! out of the box on the embedded model.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

mod admin;
mod cache;
mod cluster;
mod engine;
mod responses;
mod upstream;
pub use admin::{AdminAccount, AdminConfig, AdminRole};
pub use cache::CacheConfig;
pub use cluster::{ClusterConfig, RedisFailure};
pub use engine::{ComputeDevice, DecodeBits, EngineConfig, GpuDtype, PromptPrecision};
pub use responses::ResponsesConfig;
pub use upstream::UpstreamConfig;

/// Where the embedded default model lives after `scripts/fetch-models.sh` (or the README's run command).
pub const DEFAULT_MODEL_PATH: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_NAME: &str = "smollm2-135m-instruct";
pub const DEFAULT_EMBEDDING_PATH: &str = "models/all-MiniLM-L6-v2";
pub const DEFAULT_EMBEDDING_NAME: &str = "all-minilm-l6-v2";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address the OpenAI-compatible API listens on.
    pub listen: SocketAddr,
    /// Largest request body accepted, in bytes (larger bodies get 413).
    pub max_body_bytes: usize,
    /// Models to serve; each has its own engine thread and KV pool.
    pub models: Vec<ModelConfig>,
    /// Embedding models (BERT-family HF folders) for `/v1/embeddings`. The default one is
    /// skipped with a warning when its folder is missing; a configured one must load.
    pub embeddings: Vec<EmbeddingModelConfig>,
    /// Bearer token for `/admin/*`; without it the admin API is off.
    pub admin_token: Option<String>,
    pub plugins: PluginsConfig,
    /// The policy file (tenants, keys, limits, plugin bindings), watched for changes. Unset:
    /// no authentication, every request is tenant `default` with no limits.
    pub policies: Option<PathBuf>,
    /// SQLite usage ledger (one row per request; budgets are counted from it after a restart).
    /// With `[cluster] postgres` the rows go there instead, and this path only places the
    /// spill file.
    pub ledger: Option<PathBuf>,
    /// Where ledger rows go when SQLite refuses writes (disk full), replayed into it later.
    /// Default: beside the ledger (`<ledger>.spill.jsonl`); another filesystem is safer.
    pub ledger_spill: Option<PathBuf>,
    /// While neither the ledger nor the spill file takes writes: `refuse` billable requests
    /// with 503 (default), or `serve` them and hold their rows in memory.
    pub ledger_unwritable: LedgerUnwritable,
    /// The most the spill file may hold (MiB); beyond, rows wait in memory as when it fails.
    pub ledger_spill_max_mb: u64,
    /// Where tenants' search collections live (`<dir>/<tenant>/<collection>/`).
    pub collections_dir: PathBuf,
    /// On SIGTERM, how long in-flight requests and streams may take to finish.
    pub drain_seconds: u64,
    /// Serve HTTPS (both listeners) with these PEM files.
    pub tls: Option<TlsConfig>,
    pub admin: AdminConfig,
    pub http: HttpConfig,
    /// Models served by other OpenAI-compatible servers (gateways in engine role, vLLM,
    /// llama.cpp, hosted providers), each over one or more replicas.
    pub upstreams: Vec<UpstreamConfig>,
    /// State shared by replicas: limits and budgets in Redis; ledger, plugins and policies in
    /// PostgreSQL.
    pub cluster: ClusterConfig,
    /// Stored responses of the Responses API (kept in the ledger's database).
    pub responses: ResponsesConfig,
    /// The response cache.
    pub cache: CacheConfig,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LedgerUnwritable {
    Refuse,
    Serve,
}

/// Deadlines and caps at the HTTP edge, against silent, trickling and hoarding clients.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct HttpConfig {
    /// A request's headers must arrive within this long of its first byte (HTTP/1.1, and the
    /// HTTP/2 preface); a silent new connection gets `idle_timeout_ms`.
    pub header_timeout_ms: u64,
    /// A request body may pause this long between pieces, and gets this long before it
    /// must keep up `min_body_rate`. Too slow: 408.
    pub body_timeout_ms: u64,
    /// Bytes per second a body must average, after the first `body_timeout_ms`.
    pub min_body_rate: u64,
    /// A connection with no request in flight is closed after this long. Requests in flight,
    /// generation streams included, are never cut by it.
    pub idle_timeout_ms: u64,
    /// A TLS client must finish its handshake within this long.
    pub tls_handshake_timeout_ms: u64,
    /// Open connections per listener; over it, new ones get 503 and are closed. 0 (default):
    /// 10,000, or fewer to stay below the process's open-file limit. A value set here is
    /// kept even above that limit (with a warning); accepts then back off when descriptors
    /// run out.
    pub max_connections: usize,
    /// Open connections from one client address per listener (0 = no cap); over it, 429.
    pub max_connections_per_client: usize,
    /// Concurrent streams one HTTP/2 connection may open.
    pub h2_max_concurrent_streams: u32,
}

impl Default for HttpConfig {
    fn default() -> Self {
        Self {
            header_timeout_ms: 10_000,
            body_timeout_ms: 10_000,
            min_body_rate: 1024,
            idle_timeout_ms: 60_000,
            tls_handshake_timeout_ms: 10_000,
            max_connections: 0,
            max_connections_per_client: 1_000,
            h2_max_concurrent_streams: 128,
        }
    }
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct EmbeddingModelConfig {
    /// Name clients put in `model`.
    pub name: String,
    /// HF folder: config.json + *.safetensors + tokenizer.json.
    pub path: PathBuf,
    /// Arithmetic of the encoder's matrix products.
    #[serde(default)]
    pub precision: EmbeddingPrecision,
}

/// How the encoder multiplies: `auto` takes BF16 AMX tiles where the CPU and OS offer them
/// (cosine to the f32 vectors ≥ 0.9999, several times the f32 speed) and f32 elsewhere;
/// `f32` keeps every product in f32; `bf16` insists on AMX and fails to load without it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum EmbeddingPrecision {
    #[default]
    Auto,
    F32,
    Bf16,
}

impl Default for EmbeddingModelConfig {
    fn default() -> Self {
        Self {
            name: DEFAULT_EMBEDDING_NAME.into(),
            path: DEFAULT_EMBEDDING_PATH.into(),
            precision: EmbeddingPrecision::default(),
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsConfig {
    /// Certificate chain (PEM), leaf first. Reloaded on change or SIGHUP.
    pub cert: PathBuf,
    /// Private key (PEM: PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PluginsConfig {
    /// Plugin folder: `<dir>/<tenant>/<name>.wasm` (+ optional `<name>.toml` with `kind`),
    /// watched for changes. Unset: plugins come only through the admin API and live in memory.
    pub dir: Option<PathBuf>,
    /// Compiled components, keyed by the wasm's SHA-256. Default: `<dir>/.compiled`.
    pub cache_dir: Option<PathBuf>,
    /// Wall-clock deadline of one plugin call, in milliseconds.
    pub timeout_ms: u64,
    /// Linear-memory cap of one plugin call, in MiB.
    pub memory_mb: usize,
    /// Plugin instances alive at once (the pooling allocator's slots); calls beyond fail fast.
    pub max_instances: u32,
    /// Plugin calls one tenant may have running at once (0: a quarter of `max_instances`);
    /// calls beyond fail fast with 503 `plugin_busy`, so one tenant cannot take every slot.
    pub max_calls_per_tenant: usize,
    /// A plugin error's message is cut to this many bytes (its code to 64), with a marker.
    pub max_error_bytes: usize,
    /// The most a plugin may return: a rendered prompt, parsed JSON plus repair notes. More
    /// is an `invalid_output` failure.
    pub max_output_bytes: usize,
    /// Largest component accepted by the admin upload, in bytes.
    pub max_upload_bytes: usize,
    /// Let plugins write to the gateway's stdout/stderr (for debugging plugins only).
    pub debug_stdio: bool,
    /// Reuse a plugin's instances across calls (never across plugins or tenants); off gives
    /// every call a fresh instance, at several times the cost per call.
    pub reuse_instances: bool,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// Name clients put in `model`.
    pub name: String,
    /// A `.gguf` file or an HF-style folder (config.json + *.safetensors + tokenizer.json).
    pub path: PathBuf,
    /// Longest prompt + completion, in tokens. 0 = the model's own context length.
    pub max_model_len: usize,
    /// A Jinja chat template file that replaces the model's own, or `"chatml"`. A model
    /// without either (a base model) answers `/v1/chat/completions` with 400.
    pub chat_template: Option<String>,
    pub engine: EngineConfig,
    /// Models tried in order when this one is saturated (more than `saturated_waiting`
    /// requests queued). The list is the whole chain: a fallback's own fallbacks are not
    /// followed.
    pub fallback: Vec<String>,
    /// Requests waiting for a batch slot beyond which `fallback` takes new requests (0: never).
    pub saturated_waiting: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".parse().expect("static address"),
            max_body_bytes: 4 << 20,
            models: vec![ModelConfig::default()],
            embeddings: vec![EmbeddingModelConfig::default()],
            admin_token: None,
            plugins: PluginsConfig::default(),
            policies: None,
            ledger: Some("data/usage.sqlite".into()),
            ledger_spill: None,
            ledger_unwritable: LedgerUnwritable::Refuse,
            ledger_spill_max_mb: 1024,
            collections_dir: "data/collections".into(),
            drain_seconds: 30,
            tls: None,
            admin: AdminConfig::default(),
            http: HttpConfig::default(),
            upstreams: Vec::new(),
            cluster: ClusterConfig::default(),
            responses: ResponsesConfig::default(),
            cache: CacheConfig::default(),
        }
    }
}

impl Default for PluginsConfig {
    fn default() -> Self {
        Self {
            dir: None,
            cache_dir: None,
            timeout_ms: 50,
            memory_mb: 64,
            max_instances: 256,
            max_calls_per_tenant: 0,
            max_error_bytes: 2048,
            max_output_bytes: 1 << 20,
            max_upload_bytes: 32 << 20,
            debug_stdio: false,
            reuse_instances: true,
        }
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            name: DEFAULT_MODEL_NAME.into(),
            path: DEFAULT_MODEL_PATH.into(),
            max_model_len: 0,
            chat_template: None,
            engine: EngineConfig::default(),
            fallback: Vec::new(),
            saturated_waiting: 0,
        }
    }
}

impl ModelConfig {
    /// A `--model` value: `NAME=PATH`, the embedded default's name, or a bare path named by its
    /// file stem, lowercased.
    pub fn from_arg(arg: &str) -> Self {
        let (name, path) = match arg {
            DEFAULT_MODEL_NAME => (arg.to_string(), PathBuf::from(DEFAULT_MODEL_PATH)),
            _ => named_path(arg, |p| {
                p.file_stem()
                    .map_or_else(|| arg.to_string(), |s| s.to_string_lossy().to_lowercase())
            }),
        };
        Self {
            name,
            path,
            ..Self::default()
        }
    }
}

impl EmbeddingModelConfig {
    /// An `--embedding-model` value: `NAME=PATH`, or a bare folder named by its name,
    /// lowercased.
    pub fn from_arg(arg: &str) -> Self {
        let (name, path) = named_path(arg, |p| {
            p.file_name()
                .map_or_else(|| arg.to_string(), |s| s.to_string_lossy().to_lowercase())
        });
        Self {
            name,
            path,
            precision: EmbeddingPrecision::default(),
        }
    }
}

/// A command-line `NAME=PATH`, split at the first `=`; a bare `PATH` gets the name `unnamed`
/// makes of it.
pub fn named_path(arg: &str, unnamed: impl FnOnce(&Path) -> String) -> (String, PathBuf) {
    match arg.split_once('=') {
        Some((name, path)) => (name.to_string(), PathBuf::from(path)),
        None => {
            let path = PathBuf::from(arg);
            (unnamed(&path), path)
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("cannot read config file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("invalid config file {path}: {source}")]
    Parse {
        path: PathBuf,
        source: toml::de::Error,
    },
    #[error("invalid config: {0}")]
    Invalid(String),
}

impl Config {
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        toml::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.into(),
            source,
        })
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.models.is_empty() && self.upstreams.is_empty() {
            return bad("at least one [[models]] or [[upstreams]] entry is needed".into());
        }
        upstream::validate(self).map_err(ConfigError::Invalid)?;
        let problems = self.admin.problems();
        if !problems.is_empty() {
            return bad(problems.join("; "));
        }
        let mut names = std::collections::HashSet::new();
        for m in &self.models {
            if !names.insert(&m.name) {
                return bad(format!("model name {:?} is configured twice", m.name));
            }
            let e = &m.engine;
            if e.block_size == 0 || !e.block_size.is_power_of_two() {
                return bad(format!(
                    "models.{}: block_size must be a power of two",
                    m.name
                ));
            }
            if e.max_num_seqs == 0 || e.max_num_batched_tokens == 0 {
                return bad(format!(
                    "models.{}: max_num_seqs and max_num_batched_tokens must be > 0",
                    m.name
                ));
            }
            if !(0.0..0.5).contains(&e.watermark) {
                return bad(format!("models.{}: watermark must be in [0, 0.5)", m.name));
            }
            if !(e.gpu_memory_utilization > 0.0 && e.gpu_memory_utilization <= 1.0) {
                return bad(format!(
                    "models.{}: gpu_memory_utilization must be in (0, 1]",
                    m.name
                ));
            }
            if e.device != ComputeDevice::Cpu && !cfg!(feature = "cuda") {
                return bad(format!(
                    "models.{}: device {} needs a gateway built with CUDA support \
                     (cargo build --release --features cuda; see README, GPU)",
                    m.name, e.device
                ));
            }
        }
        let p = &self.plugins;
        if p.timeout_ms == 0 || p.memory_mb == 0 || p.max_instances == 0 {
            return bad("plugins: timeout_ms, memory_mb and max_instances must be > 0".into());
        }
        let h = &self.http;
        if [
            h.header_timeout_ms,
            h.body_timeout_ms,
            h.idle_timeout_ms,
            h.tls_handshake_timeout_ms,
        ]
        .contains(&0)
            || h.h2_max_concurrent_streams == 0
        {
            return bad("http: timeouts and h2_max_concurrent_streams must be > 0".into());
        }
        if self.collections_dir.is_file() {
            return bad(format!(
                "collections_dir {} is a file, not a folder",
                self.collections_dir.display()
            ));
        }
        if self.admin.client_ca.is_some() && (self.tls.is_none() || self.admin.listen.is_none()) {
            return bad("admin.client_ca needs [tls] and admin.listen".into());
        }
        if self.admin_token.as_ref().is_some_and(|t| t.len() < 16) {
            return bad("admin_token must be at least 16 characters".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_paths_split_at_the_first_equals_sign() {
        let unnamed = |_: &Path| "unnamed".to_string();
        assert_eq!(
            named_path("q=models/a=b.gguf", unnamed),
            ("q".to_string(), PathBuf::from("models/a=b.gguf"))
        );
        assert_eq!(
            named_path("models/x", unnamed),
            ("unnamed".to_string(), PathBuf::from("models/x"))
        );
        let m = ModelConfig::from_arg("models/Qwen2.5-1.5B.Q4_K_M.gguf");
        assert_eq!(m.name, "qwen2.5-1.5b.q4_k_m");
        let m = ModelConfig::from_arg(DEFAULT_MODEL_NAME);
        assert_eq!(m.path, PathBuf::from(DEFAULT_MODEL_PATH));
        let e = EmbeddingModelConfig::from_arg("models/all-MiniLM-L6-v2");
        assert_eq!(e.name, "all-minilm-l6-v2");
        assert_eq!(EmbeddingModelConfig::from_arg("e=dir").name, "e");
    }

    #[test]
    fn decode_activation_bits_take_8_16_8_all_or_auto_only() {
        let bits = |text: &str| {
            let text =
                format!("[[models]]\nname = \"m\"\npath = \"m.gguf\"\n[models.engine]\n{text}\n");
            toml::from_str::<Config>(&text).map(|c| c.models[0].engine.decode_activation_bits)
        };
        assert_eq!(bits("").unwrap(), DecodeBits::Auto);
        assert_eq!(
            bits("decode_activation_bits = 8").unwrap(),
            DecodeBits::Eight
        );
        assert_eq!(
            bits("decode_activation_bits = \"16\"").unwrap(),
            DecodeBits::Sixteen
        );
        assert_eq!(
            bits("decode_activation_bits = \"auto\"").unwrap(),
            DecodeBits::Auto
        );
        assert_eq!(
            bits("decode_activation_bits = \"8-all\"").unwrap(),
            DecodeBits::EightAll
        );
        for wrong in ["0", "4", "12", "32", "-8", "\"eight\"", "8.0"] {
            let err = bits(&format!("decode_activation_bits = {wrong}")).unwrap_err();
            assert!(
                err.to_string()
                    .contains("decode_activation_bits must be 8, 16 or"),
                "{wrong}: {err}"
            );
        }
    }
}
