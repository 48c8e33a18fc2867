//! A BERT-family sentence encoder (all-MiniLM-L6-v2 by default) from an HF folder
//! (`config.json` + `*.safetensors` + `tokenizer.json`): tokenizing, checking and loading here;
//! the f32 forward (mean pooling over the tokens, L2 normalisation: what sentence-transformers
//! computes for this model) on packed sequences in `super::encoder`, batched across callers.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use serde::Deserialize;

use super::encoder::batcher::{Batcher, Ticket};
use super::encoder::{Encoder, Kernel, Layer, Linear, Norm};
use crate::config::EmbeddingPrecision;

/// Tokens of one forward: a few MiB of buffers (the MLP's is the largest, 1536 floats a
/// token), big enough that each GEMM runs near the cores' peak.
const BATCH_TOKENS: usize = 2048;

#[derive(Debug, thiserror::Error)]
pub enum EmbedError {
    #[error("{path}: {message}")]
    Load { path: String, message: String },
    #[error("input {index} has {tokens} tokens; this model takes at most {max}")]
    TooLong {
        index: usize,
        tokens: usize,
        max: usize,
    },
    #[error("input {index}: token id {id} is outside the vocabulary (0..{vocab})")]
    BadToken { index: usize, id: u32, vocab: usize },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("model: {0}")]
    Model(#[from] candle_core::Error),
    #[error("encoder: {0}")]
    Encoder(String),
}

#[derive(Deserialize)]
struct Config {
    hidden_size: usize,
    num_attention_heads: usize,
    num_hidden_layers: usize,
    max_position_embeddings: usize,
    vocab_size: usize,
    #[serde(default = "eps")]
    layer_norm_eps: f64,
    #[serde(default)]
    hidden_act: Option<String>,
    #[serde(default)]
    intermediate_size: Option<usize>,
}

fn eps() -> f64 {
    1e-12
}

pub struct Embedder {
    pub name: String,
    tokenizer: tokenizers::Tokenizer,
    /// The one encoder thread every caller's sequences are batched on.
    batcher: Batcher,
    pub dim: usize,
    pub max_tokens: usize,
    /// The kernels its products run on.
    pub kernel: Kernel,
    vocab: usize,
}

impl Embedder {
    pub fn load(name: &str, dir: &Path, precision: EmbeddingPrecision) -> Result<Self, EmbedError> {
        let cfg = read_config(dir)?;
        let inter = cfg.intermediate_size.unwrap_or(4 * cfg.hidden_size);
        let kernel =
            Kernel::choose(precision, &[cfg.hidden_size, inter]).map_err(|m| load_error(dir, m))?;
        let tokenizer = read_tokenizer(dir)?;
        let w = Weights {
            tensors: read_tensors(dir)?,
            dir,
        };
        let d = cfg.hidden_size;
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = format!("encoder.layer.{i}");
                let attn = |part: &str| w.linear(&format!("{p}.attention.{part}"));
                Ok(Layer {
                    qkv: Linear::fuse(&[
                        attn("self.query")?,
                        attn("self.key")?,
                        attn("self.value")?,
                    ])
                    .prepare(kernel)
                    .map_err(|m| load_error(dir, m))?,
                    out: attn("output.dense")?
                        .prepare(kernel)
                        .map_err(|m| load_error(dir, m))?,
                    attn_norm: w.norm(&format!("{p}.attention.output.LayerNorm"))?,
                    up: w
                        .linear(&format!("{p}.intermediate.dense"))?
                        .prepare(kernel)
                        .map_err(|m| load_error(dir, m))?,
                    down: w
                        .linear(&format!("{p}.output.dense"))?
                        .prepare(kernel)
                        .map_err(|m| load_error(dir, m))?,
                    out_norm: w.norm(&format!("{p}.output.LayerNorm"))?,
                })
            })
            .collect::<Result<Vec<_>, EmbedError>>()?;
        let mut token_type = w.get("embeddings.token_type_embeddings.weight")?;
        token_type.truncate(d);
        let encoder = Encoder {
            word: w.get("embeddings.word_embeddings.weight")?,
            position: w.get("embeddings.position_embeddings.weight")?,
            token_type,
            embed_norm: w.norm("embeddings.LayerNorm")?,
            layers,
            heads: cfg.num_attention_heads,
            dim: d,
            eps: cfg.layer_norm_eps as f32,
            threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernel,
        };
        check_shapes(&encoder, &cfg).map_err(|m| load_error(dir, m))?;
        Ok(Self {
            name: name.to_string(),
            tokenizer,
            batcher: Batcher::new(Arc::new(encoder), BATCH_TOKENS),
            dim: d,
            max_tokens: cfg.max_position_embeddings,
            kernel,
            vocab: cfg.vocab_size,
        })
    }

    /// Token ids with the model's special tokens ([CLS] ... [SEP]).
    pub fn tokenize(&self, texts: &[String]) -> Result<Vec<Vec<u32>>, EmbedError> {
        texts
            .iter()
            .map(|t| {
                self.tokenizer
                    .encode(t.as_str(), true)
                    .map(|e| e.get_ids().to_vec())
                    .map_err(|e| EmbedError::Tokenizer(e.to_string()))
            })
            .collect()
    }

    /// Byte offsets of the tokens of `text` without special tokens: what chunking counts.
    pub fn offsets(&self, text: &str) -> Result<Vec<(usize, usize)>, EmbedError> {
        self.tokenizer
            .encode(text, false)
            .map(|e| e.get_offsets().to_vec())
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))
    }

    /// Token ids with special tokens, cut to the model's length (keeping the final [SEP]):
    /// for queries and chunks, where a slightly shorter input beats a refusal.
    pub fn tokenize_truncated(&self, text: &str) -> Result<Vec<u32>, EmbedError> {
        let mut ids = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| EmbedError::Tokenizer(e.to_string()))?
            .get_ids()
            .to_vec();
        if ids.len() > self.max_tokens {
            let last = ids[ids.len() - 1];
            ids.truncate(self.max_tokens - 1);
            ids.push(last);
        }
        Ok(ids)
    }

    /// Unit-length embeddings of already tokenized inputs, in order.
    pub fn embed(&self, inputs: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, EmbedError> {
        self.start(inputs)?.wait()
    }

    /// `embed`, started: the inputs are checked and queued, and the caller collects the
    /// vectors with `Started::wait` after doing other work.
    pub fn start(&self, inputs: &[Vec<u32>]) -> Result<Started, EmbedError> {
        for (index, ids) in inputs.iter().enumerate() {
            if ids.len() > self.max_tokens {
                return Err(EmbedError::TooLong {
                    index,
                    tokens: ids.len(),
                    max: self.max_tokens,
                });
            }
            if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab) {
                return Err(EmbedError::BadToken {
                    index,
                    id,
                    vocab: self.vocab,
                });
            }
        }
        self.batcher
            .submit(inputs.to_vec())
            .map(Started)
            .map_err(EmbedError::Encoder)
    }
}

/// Embeddings on their way (`Embedder::start`).
pub struct Started(Ticket);

impl Started {
    pub fn wait(self) -> Result<Vec<Vec<f32>>, EmbedError> {
        self.0.wait().map_err(EmbedError::Encoder)
    }
}

/// Every table is as large as the config says, so no token or position indexes past one.
fn check_shapes(e: &Encoder, cfg: &Config) -> Result<(), String> {
    let d = cfg.hidden_size;
    let want = [
        ("word embeddings", e.word.len(), cfg.vocab_size * d),
        (
            "position embeddings",
            e.position.len(),
            cfg.max_position_embeddings * d,
        ),
        ("token type embeddings", e.token_type.len(), d),
    ];
    for (what, got, need) in want {
        if got != need {
            return Err(format!("{what}: {got} values, the config implies {need}"));
        }
    }
    if !d.is_multiple_of(cfg.num_attention_heads) {
        return Err(format!("hidden_size {d} is not a multiple of the heads"));
    }
    Ok(())
}

fn load_error(p: &Path, message: String) -> EmbedError {
    EmbedError::Load {
        path: p.display().to_string(),
        message,
    }
}

fn read_config(dir: &Path) -> Result<Config, EmbedError> {
    let path = dir.join("config.json");
    let cfg: Config = std::fs::read_to_string(&path)
        .map_err(|e| load_error(&path, e.to_string()))
        .and_then(|t| serde_json::from_str(&t).map_err(|e| load_error(&path, e.to_string())))?;
    if cfg.hidden_act.as_deref().is_some_and(|a| a != "gelu") {
        let act = &cfg.hidden_act;
        return Err(load_error(
            &path,
            format!("hidden_act {act:?} is not supported (gelu only)"),
        ));
    }
    Ok(cfg)
}

fn read_tokenizer(dir: &Path) -> Result<tokenizers::Tokenizer, EmbedError> {
    let path = dir.join("tokenizer.json");
    let fail = |e: tokenizers::Error| load_error(&path, e.to_string());
    let mut tokenizer = tokenizers::Tokenizer::from_file(&path).map_err(fail)?;
    // Length is checked (and refused) per input instead of silently truncated.
    tokenizer.with_truncation(None).map_err(fail)?;
    tokenizer.with_padding(None);
    Ok(tokenizer)
}

/// Every tensor of the folder's `*.safetensors` files, by name.
fn read_tensors(dir: &Path) -> Result<HashMap<String, Tensor>, EmbedError> {
    let files: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| load_error(dir, e.to_string()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    if files.is_empty() {
        return Err(load_error(dir, "no *.safetensors file".into()));
    }
    let mut tensors = HashMap::new();
    for f in files {
        let t = candle_core::safetensors::load(&f, &Device::Cpu)
            .map_err(|e| load_error(&f, e.to_string()))?;
        // Checkpoints saved from BertForX prefix every name with `bert.`.
        tensors.extend(
            t.into_iter()
                .map(|(k, v)| (k.strip_prefix("bert.").map(String::from).unwrap_or(k), v)),
        );
    }
    Ok(tensors)
}

/// A checkpoint's tensors, read as the encoder's parts.
struct Weights<'a> {
    tensors: HashMap<String, Tensor>,
    dir: &'a Path,
}

impl Weights<'_> {
    fn tensor(&self, name: &str) -> Result<&Tensor, EmbedError> {
        self.tensors
            .get(name)
            .ok_or_else(|| load_error(self.dir, format!("tensor {name} is missing")))
    }

    fn get(&self, name: &str) -> Result<Vec<f32>, EmbedError> {
        let t = self.tensor(name)?.to_dtype(DType::F32)?;
        Ok(t.flatten_all()?.to_vec1::<f32>()?)
    }

    /// Old checkpoints name LayerNorm parameters gamma/beta.
    fn norm(&self, prefix: &str) -> Result<Norm, EmbedError> {
        let w = self
            .get(&format!("{prefix}.weight"))
            .or_else(|_| self.get(&format!("{prefix}.gamma")))?;
        let b = self
            .get(&format!("{prefix}.bias"))
            .or_else(|_| self.get(&format!("{prefix}.beta")))?;
        Ok(Norm { w, b })
    }

    fn linear(&self, prefix: &str) -> Result<Linear, EmbedError> {
        let name = format!("{prefix}.weight");
        let (outputs, inputs) = self.tensor(&name)?.dims2()?;
        let b = self.get(&format!("{prefix}.bias"))?;
        if b.len() != outputs {
            return Err(load_error(
                self.dir,
                format!("{prefix}.bias: {} values for {outputs} outputs", b.len()),
            ));
        }
        Ok(Linear::new(&self.get(&name)?, b, inputs))
    }
}
