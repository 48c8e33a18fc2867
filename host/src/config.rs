//! One typed configuration: TOML file, then CLI flags on top. Every field has a default that runs
//! out of the box on the embedded model.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// Where the embedded default model lives after `scripts/fetch-models.sh` (or the README's run command).
pub const DEFAULT_MODEL_PATH: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
pub const DEFAULT_MODEL_NAME: &str = "smollm2-135m-instruct";

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Address the OpenAI-compatible API listens on.
    pub listen: SocketAddr,
    /// Largest request body accepted, in bytes (larger bodies get 413).
    pub max_body_bytes: usize,
    /// Models to serve; each has its own engine thread and KV pool.
    pub models: Vec<ModelConfig>,
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
    pub engine: EngineConfig,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EngineConfig {
    /// Bytes of KV cache to allocate (all layers, K and V). Pages are touched lazily, so an idle
    /// gateway does not pay for the whole budget in RSS.
    pub kv_cache_bytes: usize,
    /// Tokens per KV block.
    pub block_size: usize,
    /// Most sequences decoded together in one step.
    pub max_num_seqs: usize,
    /// Most tokens (prefill chunks + decodes) in one forward pass; long prompts are chunked.
    pub max_num_batched_tokens: usize,
    /// Fraction of blocks kept free when admitting new sequences, so running ones can grow.
    pub watermark: f32,
    /// Requests waiting for admission beyond this are refused with 503.
    pub max_waiting: usize,
    /// Reuse KV blocks of identical prompt prefixes across requests.
    pub prefix_caching: bool,
    /// Compute threads of this model's engine (0 = one per core).
    pub threads: usize,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:8080".parse().expect("static address"),
            max_body_bytes: 4 << 20,
            models: vec![ModelConfig::default()],
        }
    }
}

impl Default for ModelConfig {
    fn default() -> Self {
        Self {
            name: DEFAULT_MODEL_NAME.into(),
            path: DEFAULT_MODEL_PATH.into(),
            max_model_len: 0,
            engine: EngineConfig::default(),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            kv_cache_bytes: 512 << 20,
            block_size: 16,
            max_num_seqs: 32,
            max_num_batched_tokens: 512,
            watermark: 0.01,
            max_waiting: 256,
            prefix_caching: true,
            threads: 0,
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
        if self.models.is_empty() {
            return bad("at least one [[models]] entry is needed".into());
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
        }
        Ok(())
    }
}
