//! Loading a llama-family model from a GGUF file. The file is memory-mapped: quantized weights
//! in a format our kernels multiply (`quant::format_of`) are used in place, so the resident
//! size after loading is about the file's size and pages of rarely used rows (most of a large
//! vocabulary's embedding table) are never read. Other types go through candle.

use std::borrow::Cow;
use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::Device;

use super::{chat_template, stop_ids, LoadedModel};
use crate::engine::model::{
    Embedding, GemmaNorms, GemmaShape, Layer, Linear, Model, ModelShape, RopeStyle,
};
use crate::engine::quant::{format_of, Bytes, QuantMatrix};
use crate::engine::{tokenizer, ModelError};

/// An open GGUF file: its header and the mapped tensor data.
struct Gguf {
    content: gguf_file::Content,
    map: Arc<memmap2::Mmap>,
}

impl Gguf {
    fn open(path: &Path) -> Result<Self, ModelError> {
        let io = |e| ModelError::Io(path.into(), e);
        let mut file = File::open(path).map_err(io)?;
        let content = gguf_file::Content::read(&mut file)
            .map_err(|e| ModelError::Format(format!("{}: {e}", path.display())))?;
        // SAFETY: mapped read-only; like any model file it must not change while serving.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        // Decode streams every weight once per token: in 2 MiB pages (where the page cache
        // holds large folios) that is one TLB miss per 2 MiB instead of per 4 KiB. Advisory
        // only, so a kernel without THP just keeps 4 KiB pages.
        #[cfg(target_os = "linux")]
        let _ = map.advise(memmap2::Advice::HugePage);
        Ok(Self {
            content,
            map: Arc::new(map),
        })
    }

    fn has(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// A tensor's type, shape (candle order: rows first) and byte window in the map.
    fn locate(&self, name: &str) -> Result<(GgmlDType, Vec<usize>, usize, usize), ModelError> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| ModelError::Format(format!("GGUF has no tensor {name}")))?;
        let dims = info.shape.dims().to_vec();
        let elems: usize = dims.iter().product();
        let (bs, ts) = (info.ggml_dtype.block_size(), info.ggml_dtype.type_size());
        let len = elems / bs * ts;
        let start =
            usize::try_from(self.content.tensor_data_offset + info.offset).unwrap_or(usize::MAX);
        if !elems.is_multiple_of(bs) || start.checked_add(len).is_none_or(|e| e > self.map.len()) {
            return Err(ModelError::Format(format!(
                "tensor {name} ({:?}, {dims:?}) lies outside the file or is not whole blocks",
                info.ggml_dtype
            )));
        }
        Ok((info.ggml_dtype, dims, start, len))
    }

    /// The tensor as a matrix our kernels multiply in place, if its format allows.
    fn native(&self, name: &str) -> Result<Option<QuantMatrix>, ModelError> {
        let (dtype, dims, start, len) = self.locate(name)?;
        let (Some(format), &[rows, cols]) = (format_of(dtype), dims.as_slice()) else {
            return Ok(None);
        };
        let bytes = Bytes::Mapped {
            map: self.map.clone(),
            start,
            len,
        };
        Ok(QuantMatrix::new(format, rows, cols, bytes))
    }

    /// A copy of the tensor as candle's `QTensor`.
    fn qtensor(&self, name: &str) -> Result<QTensor, ModelError> {
        let (dtype, dims, start, len) = self.locate(name)?;
        let data = Cow::Borrowed(&self.map[start..start + len]);
        Ok(QTensor::new(
            QStorage::from_data(data, &Device::Cpu, dtype)?,
            dims,
        )?)
    }

    fn vec_f32(&self, name: &str) -> Result<Vec<f32>, ModelError> {
        Ok(self
            .qtensor(name)?
            .dequantize(&Device::Cpu)?
            .flatten_all()?
            .to_vec1()?)
    }

    fn linear(&self, name: &str) -> Result<Linear, ModelError> {
        Ok(match self.native(name)? {
            Some(m) => Linear::Native(Arc::new(m)),
            None => Linear::Quantized(QMatMul::from_qtensor(self.qtensor(name)?)?),
        })
    }

    /// Stacks projections that share an input into one matrix, so a step runs one matmul
    /// instead of several. Natively multiplied parts stack whatever their formats; otherwise
    /// same-type parts are concatenated for candle, and mixed ones dequantized.
    fn fused(&self, names: &[String]) -> Result<Linear, ModelError> {
        let native: Option<Vec<QuantMatrix>> = names
            .iter()
            .map(|n| self.native(n))
            .collect::<Result<_, _>>()?;
        if let Some(m) = native.and_then(QuantMatrix::stack) {
            return Ok(Linear::Native(Arc::new(m)));
        }
        let parts: Vec<QTensor> = names
            .iter()
            .map(|n| self.qtensor(n))
            .collect::<Result<_, _>>()?;
        let dtype = parts[0].dtype();
        let cols = parts[0].shape().dims()[1];
        if parts.iter().all(|p| p.dtype() == dtype) {
            let rows: usize = parts.iter().map(|p| p.shape().dims()[0]).sum();
            let mut bytes = Vec::new();
            for p in &parts {
                bytes.extend_from_slice(&p.data()?);
            }
            let storage = QStorage::from_data(Cow::Owned(bytes), &Device::Cpu, dtype)?;
            let t = QTensor::new(storage, (rows, cols))?;
            return Ok(Linear::Quantized(QMatMul::from_qtensor(t)?));
        }
        let dense = parts
            .iter()
            .map(|p| p.dequantize(&Device::Cpu))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Linear::Dense(candle_core::Tensor::cat(&dense, 0)?))
    }

    fn layer(&self, i: usize) -> Result<Layer, ModelError> {
        let n = |t: &str| format!("blk.{i}.{t}");
        let qkv_bias = match self.has(&n("attn_q.bias")) {
            true => Some(
                ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
                    .iter()
                    .map(|t| self.vec_f32(&n(t)))
                    .collect::<Result<Vec<_>, _>>()?
                    .concat(),
            ),
            false => None,
        };
        let gemma = match self.has(&n("attn_q_norm.weight")) {
            true => Some(GemmaNorms {
                q_norm: self.vec_f32(&n("attn_q_norm.weight"))?,
                k_norm: self.vec_f32(&n("attn_k_norm.weight"))?,
                post_attn: self.vec_f32(&n("post_attention_norm.weight"))?,
                post_ffn: self.vec_f32(&n("post_ffw_norm.weight"))?,
            }),
            false => None,
        };
        Ok(Layer {
            attn_norm: self.vec_f32(&n("attn_norm.weight"))?,
            qkv: self.fused(&[n("attn_q.weight"), n("attn_k.weight"), n("attn_v.weight")])?,
            qkv_bias,
            o: self.linear(&n("attn_output.weight"))?,
            ffn_norm: self.vec_f32(&n("ffn_norm.weight"))?,
            gate_up: self.fused(&[n("ffn_gate.weight"), n("ffn_up.weight")])?,
            down: self.linear(&n("ffn_down.weight"))?,
            gemma,
        })
    }

    /// The token embedding table and the output projection (the same matrix when tied).
    fn embedding_and_head(&self) -> Result<(Embedding, Linear), ModelError> {
        let table = self.native("token_embd.weight")?.map(Arc::new);
        let embed = match &table {
            Some(m) => Embedding::Native(m.clone()),
            None => Embedding::Quantized(self.qtensor("token_embd.weight")?),
        };
        let head = match (self.has("output.weight"), table) {
            (true, _) => self.linear("output.weight")?,
            (false, Some(m)) => Linear::Native(m),
            (false, None) => {
                Linear::Quantized(QMatMul::from_qtensor(self.qtensor("token_embd.weight")?)?)
            }
        };
        Ok((embed, head))
    }

    fn shape(&self, arch: &str, rope_style: RopeStyle) -> Result<ModelShape, ModelError> {
        let md = |k: &str| self.content.metadata.get(&format!("{arch}.{k}"));
        let u = |k: &str| -> Result<usize, ModelError> {
            Ok(md(k)
                .ok_or_else(|| ModelError::Format(format!("GGUF metadata has no {arch}.{k}")))?
                .to_u32()? as usize)
        };
        let f = |k: &str, default: f32| md(k).and_then(|v| v.to_f32().ok()).unwrap_or(default);
        let num_heads = u("attention.head_count")?;
        let hidden = u("embedding_length")?;
        let gemma = (arch == "gemma3").then(|| GemmaShape {
            // Without a window every layer is global (llama.cpp's rule too).
            sliding_window: u("attention.sliding_window").unwrap_or(usize::MAX),
            global_every: u("attention.sliding_window_pattern").unwrap_or(6).max(1),
            local_rope_theta: f("rope.freq_base_swa", 10_000.0),
            global_rope_scale: f("rope.scaling.factor", 1.0).max(1e-6),
            final_softcap: md("final_logit_softcapping")
                .and_then(|v| v.to_f32().ok())
                .filter(|&c| c > 0.0),
        });
        Ok(ModelShape {
            vocab_size: self.locate("token_embd.weight")?.1[0],
            hidden,
            intermediate: u("feed_forward_length")?,
            num_layers: u("block_count")?,
            num_heads,
            num_kv_heads: u("attention.head_count_kv").unwrap_or(num_heads),
            head_dim: u("attention.key_length").unwrap_or(hidden / num_heads),
            rms_eps: f("attention.layer_norm_rms_epsilon", 1e-5),
            rope_theta: f("rope.freq_base", 10_000.0),
            rope_style,
            context_length: u("context_length")?,
            gemma,
        })
    }
}

pub(super) fn load(path: &Path) -> Result<LoadedModel, ModelError> {
    let g = Gguf::open(path)?;
    let md = |k: &str| g.content.metadata.get(k);
    let arch = md("general.architecture")
        .and_then(|v| v.to_string().ok())
        .cloned()
        .unwrap_or_default();
    let rope_style = match arch.as_str() {
        "llama" | "mistral" => RopeStyle::Interleaved,
        "qwen2" | "gemma3" => RopeStyle::Neox,
        other => {
            return Err(ModelError::Format(format!(
            "GGUF architecture {other:?} is not supported (llama, mistral, qwen2 and gemma3 are)"
        )))
        }
    };
    let shape = g.shape(&arch, rope_style)?;
    let tok = tokenizer::from_gguf(&g.content)?;
    let layers = (0..shape.num_layers)
        .map(|i| g.layer(i))
        .collect::<Result<Vec<_>, _>>()?;
    let (embed, lm_head) = g.embedding_and_head()?;
    let norm = g.vec_f32("output_norm.weight")?;
    let template_src = md("tokenizer.chat_template")
        .and_then(|v| v.to_string().ok())
        .cloned();
    let id = |k: &str| md(k).and_then(|v| v.to_u32().ok());
    let (bos, eos) = (
        id("tokenizer.ggml.bos_token_id"),
        id("tokenizer.ggml.eos_token_id"),
    );
    let template = chat_template(
        template_src,
        &tok,
        token_text(&tok, bos),
        token_text(&tok, eos),
    )?;
    Ok(LoadedModel {
        model: Model::new(shape, embed, layers, norm, lm_head, Device::Cpu),
        stop_ids: stop_ids(&tok, &eos.into_iter().collect::<Vec<_>>()),
        tokenizer: tok,
        template,
        bos,
        add_bos: md("tokenizer.ggml.add_bos_token")
            .and_then(|v| v.to_bool().ok())
            .unwrap_or(false),
    })
}

/// The text of a special token, empty when the model has none.
fn token_text(tok: &tokenizers::Tokenizer, id: Option<u32>) -> String {
    id.and_then(|i| tok.id_to_token(i)).unwrap_or_default()
}
