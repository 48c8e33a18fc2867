//! A BERT-family sentence encoder (all-MiniLM-L6-v2 by default) from an HF folder
//! (`config.json` + `*.safetensors` + `tokenizer.json`): f32 forward over candle tensors, mean
//! pooling over real tokens, L2 normalisation — what sentence-transformers computes for this
//! model. Inputs of one call are batched, padded to the longest.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor, D};
use serde::Deserialize;

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
}

fn eps() -> f64 {
    1e-12
}

struct Linear {
    /// Transposed once at load: [in, out].
    w_t: Tensor,
    b: Tensor,
}

impl Linear {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        x.broadcast_matmul(&self.w_t)?.broadcast_add(&self.b)
    }
}

struct LayerNorm {
    w: Tensor,
    b: Tensor,
    eps: f64,
}

impl LayerNorm {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let centered = x.broadcast_sub(&mean)?;
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let normed = centered.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        normed.broadcast_mul(&self.w)?.broadcast_add(&self.b)
    }
}

struct Layer {
    q: Linear,
    k: Linear,
    v: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    up: Linear,
    down: Linear,
    out_norm: LayerNorm,
}

pub struct Embedder {
    pub name: String,
    tokenizer: tokenizers::Tokenizer,
    word: Tensor,
    position: Tensor,
    token_type: Tensor,
    embed_norm: LayerNorm,
    layers: Vec<Layer>,
    heads: usize,
    pub dim: usize,
    pub max_tokens: usize,
    vocab: usize,
}

impl Embedder {
    pub fn load(name: &str, dir: &Path) -> Result<Self, EmbedError> {
        let cfg = read_config(dir)?;
        let tokenizer = read_tokenizer(dir)?;
        let w = Weights {
            tensors: read_tensors(dir)?,
            dir,
            eps: cfg.layer_norm_eps,
        };
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let p = format!("encoder.layer.{i}");
                Ok(Layer {
                    q: w.linear(&format!("{p}.attention.self.query"))?,
                    k: w.linear(&format!("{p}.attention.self.key"))?,
                    v: w.linear(&format!("{p}.attention.self.value"))?,
                    attn_out: w.linear(&format!("{p}.attention.output.dense"))?,
                    attn_norm: w.norm(&format!("{p}.attention.output.LayerNorm"))?,
                    up: w.linear(&format!("{p}.intermediate.dense"))?,
                    down: w.linear(&format!("{p}.output.dense"))?,
                    out_norm: w.norm(&format!("{p}.output.LayerNorm"))?,
                })
            })
            .collect::<Result<Vec<_>, EmbedError>>()?;
        Ok(Self {
            name: name.to_string(),
            tokenizer,
            word: w.get("embeddings.word_embeddings.weight")?,
            position: w.get("embeddings.position_embeddings.weight")?,
            token_type: w.get("embeddings.token_type_embeddings.weight")?,
            embed_norm: w.norm("embeddings.LayerNorm")?,
            layers,
            heads: cfg.num_attention_heads,
            dim: cfg.hidden_size,
            max_tokens: cfg.max_position_embeddings,
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
        // Similar lengths together: less padding computed.
        let mut order: Vec<usize> = (0..inputs.len()).collect();
        order.sort_by_key(|&i| inputs[i].len());
        let mut results = vec![Vec::new(); inputs.len()];
        for chunk in order.chunks(32) {
            let batch: Vec<&Vec<u32>> = chunk.iter().map(|&i| &inputs[i]).collect();
            for (&i, v) in chunk.iter().zip(self.forward(&batch)?) {
                results[i] = v;
            }
        }
        Ok(results)
    }

    fn forward(&self, batch: &[&Vec<u32>]) -> Result<Vec<Vec<f32>>, EmbedError> {
        let (b, len) = (
            batch.len(),
            batch.iter().map(|ids| ids.len()).max().unwrap_or(0).max(1),
        );
        let mut ids = vec![0u32; b * len];
        let mut mask = vec![0f32; b * len];
        for (r, seq) in batch.iter().enumerate() {
            ids[r * len..r * len + seq.len()].copy_from_slice(seq);
            mask[r * len..r * len + seq.len()].fill(1.0);
        }
        let dev = Device::Cpu;
        let ids = Tensor::from_vec(ids, (b * len,), &dev)?;
        let mask = Tensor::from_vec(mask, (b, len), &dev)?;
        let x = self
            .word
            .index_select(&ids, 0)?
            .reshape((b, len, self.dim))?;
        let x = x
            .broadcast_add(&self.position.narrow(0, 0, len)?)?
            .broadcast_add(&self.token_type.narrow(0, 0, 1)?)?;
        let mut x = self.embed_norm.forward(&x)?;
        // Padding gets a large negative score before the softmax.
        let bias = ((mask.clone() - 1.0)? * 1e9)?.reshape((b, 1, 1, len))?;
        let head_dim = self.dim / self.heads;
        let scale = 1.0 / (head_dim as f64).sqrt();
        for l in &self.layers {
            let split = |t: Tensor| {
                t.reshape((b, len, self.heads, head_dim))?
                    .transpose(1, 2)?
                    .contiguous()
            };
            let q = split(l.q.forward(&x)?)?;
            let k = split(l.k.forward(&x)?)?;
            let v = split(l.v.forward(&x)?)?;
            let scores = (q.matmul(&k.t()?.contiguous()?)? * scale)?.broadcast_add(&bias)?;
            let scores = scores
                .broadcast_sub(&scores.max_keepdim(D::Minus1)?)?
                .exp()?;
            let probs = scores.broadcast_div(&scores.sum_keepdim(D::Minus1)?)?;
            let ctx = probs
                .matmul(&v)?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((b, len, self.dim))?;
            x = l.attn_norm.forward(&(l.attn_out.forward(&ctx)? + &x)?)?;
            let h = l.up.forward(&x)?.gelu_erf()?;
            x = l.out_norm.forward(&(l.down.forward(&h)? + &x)?)?;
        }
        // Mean over real tokens, then unit length.
        let m = mask.unsqueeze(2)?;
        let summed = x.broadcast_mul(&m)?.sum(1)?;
        let pooled = summed.broadcast_div(&m.sum(1)?)?;
        let norm = pooled
            .sqr()?
            .sum_keepdim(1)?
            .sqrt()?
            .clamp(1e-12, f64::MAX)?;
        Ok(pooled.broadcast_div(&norm)?.to_vec2::<f32>()?)
    }
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
    eps: f64,
}

impl Weights<'_> {
    fn get(&self, name: &str) -> Result<Tensor, EmbedError> {
        let t = self
            .tensors
            .get(name)
            .ok_or_else(|| load_error(self.dir, format!("tensor {name} is missing")))?;
        Ok(t.to_dtype(DType::F32)?)
    }

    /// Old checkpoints name LayerNorm parameters gamma/beta.
    fn norm(&self, prefix: &str) -> Result<LayerNorm, EmbedError> {
        let w = self
            .get(&format!("{prefix}.weight"))
            .or_else(|_| self.get(&format!("{prefix}.gamma")))?;
        let b = self
            .get(&format!("{prefix}.bias"))
            .or_else(|_| self.get(&format!("{prefix}.beta")))?;
        Ok(LayerNorm {
            w,
            b,
            eps: self.eps,
        })
    }

    fn linear(&self, prefix: &str) -> Result<Linear, EmbedError> {
        Ok(Linear {
            w_t: self.get(&format!("{prefix}.weight"))?.t()?.contiguous()?,
            b: self.get(&format!("{prefix}.bias"))?,
        })
    }
}
