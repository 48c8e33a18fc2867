//! An HF folder: config.json for the shape, the *.safetensors weights (converted to f32),
//! tokenizer.json and tokenizer_config.json for the template and special tokens.

use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use serde::Deserialize;
use tokenizers::Tokenizer;

use super::{chat_template, stop_ids, LoadedModel};
use crate::engine::model::{Embedding, Layer, Linear, Model, ModelShape, RopeStyle};
use crate::engine::ModelError;

#[derive(Deserialize)]
struct HfConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rms_norm_eps: Option<f32>,
    rope_theta: Option<f32>,
    max_position_embeddings: Option<usize>,
    #[serde(default)]
    tie_word_embeddings: bool,
    bos_token_id: Option<u32>,
    eos_token_id: Option<serde_json::Value>,
}

#[derive(Deserialize, Default)]
struct HfTokenizerConfig {
    chat_template: Option<serde_json::Value>,
    bos_token: Option<serde_json::Value>,
    eos_token: Option<serde_json::Value>,
    #[serde(default)]
    add_bos_token: bool,
}

fn token_string(v: &Option<serde_json::Value>) -> String {
    match v {
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(serde_json::Value::Object(o)) => o
            .get("content")
            .and_then(|c| c.as_str())
            .unwrap_or_default()
            .into(),
        _ => String::new(),
    }
}

fn read_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T, ModelError> {
    let text = std::fs::read_to_string(path).map_err(|e| ModelError::Io(path.into(), e))?;
    serde_json::from_str(&text).map_err(|e| ModelError::Format(format!("{}: {e}", path.display())))
}

pub(super) fn load(dir: &Path) -> Result<LoadedModel, ModelError> {
    let cfg: HfConfig = read_json(&dir.join("config.json"))?;
    let shape = hf_shape(&cfg)?;
    let tok_path = dir.join("tokenizer.json");
    let tok = Tokenizer::from_file(&tok_path)
        .map_err(|e| ModelError::Tokenizer(format!("{}: {e}", tok_path.display())))?;
    let tcfg: HfTokenizerConfig = match dir.join("tokenizer_config.json") {
        p if p.exists() => read_json(&p)?,
        _ => HfTokenizerConfig::default(),
    };
    let w = HfWeights::open(dir)?;
    let layers = (0..shape.num_layers)
        .map(|i| w.layer(i))
        .collect::<Result<Vec<_>, _>>()?;
    let embed = w.get("model.embed_tokens.weight")?;
    let lm_head = if !cfg.tie_word_embeddings && w.has("lm_head.weight") {
        w.get("lm_head.weight")?
    } else {
        embed.clone()
    };
    let eos: Vec<u32> = match &cfg.eos_token_id {
        Some(serde_json::Value::Number(n)) => {
            n.as_u64().map(|n| vec![n as u32]).unwrap_or_default()
        }
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|n| n as u32))
            .collect(),
        _ => tok
            .token_to_id(&token_string(&tcfg.eos_token))
            .into_iter()
            .collect(),
    };
    let template = chat_template(
        hf_template_source(&tcfg),
        &tok,
        token_string(&tcfg.bos_token),
        token_string(&tcfg.eos_token),
    )?;
    let norm = w.vec_f32("model.norm.weight")?;
    Ok(LoadedModel {
        model: Model::new(
            shape,
            Embedding::Dense(embed),
            layers,
            norm,
            Linear::Dense(lm_head),
            Device::Cpu,
        ),
        stop_ids: stop_ids(&tok, &eos),
        tokenizer: tok,
        template,
        bos: cfg.bos_token_id,
        add_bos: tcfg.add_bos_token,
    })
}

/// The decoder's dimensions from a Hugging Face `config.json` (llama family only).
fn hf_shape(cfg: &HfConfig) -> Result<ModelShape, ModelError> {
    let rope_style = match cfg.model_type.as_deref() {
        Some("llama" | "mistral" | "qwen2") | None => RopeStyle::Neox,
        Some(other) => {
            return Err(ModelError::Format(format!(
                "model_type {other:?} is not a supported llama-family decoder"
            )))
        }
    };
    let num_heads = cfg.num_attention_heads;
    Ok(ModelShape {
        vocab_size: cfg.vocab_size,
        hidden: cfg.hidden_size,
        intermediate: cfg.intermediate_size,
        num_layers: cfg.num_hidden_layers,
        num_heads,
        num_kv_heads: cfg.num_key_value_heads.unwrap_or(num_heads),
        head_dim: cfg.head_dim.unwrap_or(cfg.hidden_size / num_heads),
        rms_eps: cfg.rms_norm_eps.unwrap_or(1e-5),
        rope_theta: cfg.rope_theta.unwrap_or(10_000.0),
        rope_style,
        context_length: cfg.max_position_embeddings.unwrap_or(4096),
        gemma: None,
    })
}

/// `chat_template` as a string, or the default of a list of named templates.
fn hf_template_source(tcfg: &HfTokenizerConfig) -> Option<String> {
    match &tcfg.chat_template {
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
            .and_then(|t| t.get("template").and_then(|s| s.as_str()).map(String::from)),
        _ => None,
    }
}

/// A checkpoint's safetensors files, mapped, read as f32 tensors.
struct HfWeights(MmapedSafetensors);

impl HfWeights {
    fn open(dir: &Path) -> Result<Self, ModelError> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| ModelError::Io(dir.into(), e))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors"))
            .collect();
        files.sort();
        if files.is_empty() {
            return Err(ModelError::Format(format!(
                "{}: no *.safetensors files",
                dir.display()
            )));
        }
        // SAFETY: the weights are mapped read-only; the files must not change while serving.
        Ok(Self(unsafe { MmapedSafetensors::multi(&files)? }))
    }

    fn get(&self, name: &str) -> Result<Tensor, ModelError> {
        Ok(self.0.load(name, &Device::Cpu)?.to_dtype(DType::F32)?)
    }

    fn has(&self, name: &str) -> bool {
        self.0.get(name).is_ok()
    }

    fn vec_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        Ok(self.get(name)?.to_vec1()?)
    }

    /// Decoder layer `i`, with q/k/v and gate/up fused as the CPU model runs them.
    fn layer(&self, i: usize) -> Result<Layer, ModelError> {
        let p = format!("model.layers.{i}");
        let w = |n: &str| self.get(&format!("{p}.{n}.weight"));
        let qkv = Tensor::cat(
            &[
                w("self_attn.q_proj")?,
                w("self_attn.k_proj")?,
                w("self_attn.v_proj")?,
            ],
            0,
        )?;
        let qkv_bias = match self.has(&format!("{p}.self_attn.q_proj.bias")) {
            true => Some(
                ["q", "k", "v"]
                    .iter()
                    .map(|x| self.vec_f32(&format!("{p}.self_attn.{x}_proj.bias")))
                    .collect::<Result<Vec<_>, _>>()?
                    .concat(),
            ),
            false => None,
        };
        Ok(Layer {
            attn_norm: self.vec_f32(&format!("{p}.input_layernorm.weight"))?,
            qkv: Linear::Dense(qkv),
            qkv_bias,
            o: Linear::Dense(w("self_attn.o_proj")?),
            ffn_norm: self.vec_f32(&format!("{p}.post_attention_layernorm.weight"))?,
            gate_up: Linear::Dense(Tensor::cat(&[w("mlp.gate_proj")?, w("mlp.up_proj")?], 0)?),
            down: Linear::Dense(w("mlp.down_proj")?),
            gemma: None,
        })
    }
}
