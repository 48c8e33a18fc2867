//! The HF-folder loader and the GGUF loader must run the same network: the GGUF is converted
//! here into an HF folder (dequantized f32 safetensors with HF names, Q/K rows permuted back
//! from llama.cpp's interleaved-RoPE order to HF's half-split order, config.json,
//! tokenizer.json written from the GGUF-built tokenizer), then both are loaded by the gateway
//! and must give the same logits and the same greedy continuation.

use std::collections::HashMap;
use std::path::Path;

use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use gateway::engine::model::{BatchSeq, Model};
use gateway::engine::paged_attention::KvCache;
use gateway::engine::{tokenizer, weights};

#[path = "support/model.rs"]
mod model;

const HEADS: usize = 9;
const KV_HEADS: usize = 3;

/// Inverse of llama.cpp's `permute` for Q/K: rows (head, pair, 2) back to (head, 2, pair).
fn unpermute(t: Tensor, heads: usize) -> Tensor {
    let (out, inp) = t.dims2().unwrap();
    t.reshape((heads, out / heads / 2, 2, inp))
        .unwrap()
        .transpose(1, 2)
        .unwrap()
        .reshape((out, inp))
        .unwrap()
}

fn convert(gguf: &Path, dir: &Path) {
    let mut f = std::fs::File::open(gguf).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    let dev = Device::Cpu;
    let mut tensors = HashMap::new();
    for name in c.tensor_infos.keys() {
        let t = c
            .tensor(&mut f, name, &dev)
            .unwrap()
            .dequantize(&dev)
            .unwrap();
        let hf = if name == "token_embd.weight" {
            "model.embed_tokens.weight".to_string()
        } else if name == "output_norm.weight" {
            "model.norm.weight".to_string()
        } else {
            let rest = name.strip_prefix("blk.").unwrap();
            let (layer, part) = rest.split_once('.').unwrap();
            let hf_part = match part {
                "attn_norm.weight" => "input_layernorm.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "attn_q.weight" => "self_attn.q_proj.weight",
                "attn_k.weight" => "self_attn.k_proj.weight",
                "attn_v.weight" => "self_attn.v_proj.weight",
                "attn_output.weight" => "self_attn.o_proj.weight",
                "ffn_gate.weight" => "mlp.gate_proj.weight",
                "ffn_up.weight" => "mlp.up_proj.weight",
                "ffn_down.weight" => "mlp.down_proj.weight",
                other => panic!("unexpected tensor {other}"),
            };
            format!("model.layers.{layer}.{hf_part}")
        };
        let t = match name.rsplit('.').nth(1) {
            Some("attn_q") => unpermute(t, HEADS),
            Some("attn_k") => unpermute(t, KV_HEADS),
            _ => t,
        };
        tensors.insert(hf, t);
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
    let config = serde_json::json!({
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let template = c.metadata["tokenizer.chat_template"]
        .to_string()
        .unwrap()
        .clone();
    let tcfg = serde_json::json!({"chat_template": template, "bos_token": "<|im_start|>", "eos_token": "<|im_end|>"});
    std::fs::write(dir.join("tokenizer_config.json"), tcfg.to_string()).unwrap();
    tokenizer::from_gguf_file(gguf)
        .unwrap()
        .save(dir.join("tokenizer.json"), false)
        .unwrap();
}

fn logits(model: &Model, tokens: &[u32]) -> Vec<f32> {
    let s = &model.shape;
    let mut cache = KvCache::new(s.num_layers, 8, 16, s.num_kv_heads, s.head_dim);
    let table: Vec<u32> = (0..8).collect();
    let seq = BatchSeq {
        block_table: &table,
        start: 0,
        tokens,
        want_logits: true,
        draft_rows: 0,
        prompt_len: tokens.len(),
    };
    model.forward(&[seq], &mut cache).unwrap().remove(0)
}

fn greedy(model: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut ids = prompt.to_vec();
    for _ in 0..n {
        let l = logits(model, &ids);
        let best = (0..l.len()).max_by(|&a, &b| l[a].total_cmp(&l[b])).unwrap() as u32;
        ids.push(best);
    }
    ids[prompt.len()..].to_vec()
}

#[test]
fn hf_folder_and_gguf_run_the_same_model() {
    let gguf = model::model_path();
    let dir = std::env::temp_dir().join(format!("gateway-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    convert(Path::new(&gguf), &dir);
    let a = weights::load(Path::new(&gguf)).unwrap();
    let b = weights::load(&dir).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();

    assert_eq!(a.stop_ids, b.stop_ids);
    let prompt = a
        .tokenizer
        .encode("The capital of France is", false)
        .unwrap()
        .get_ids()
        .to_vec();
    assert_eq!(
        prompt,
        b.tokenizer
            .encode("The capital of France is", false)
            .unwrap()
            .get_ids()
    );
    let (la, lb) = (logits(&a.model, &prompt), logits(&b.model, &prompt));
    let diff = la
        .iter()
        .zip(&lb)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    assert!(diff < 2e-2, "max logit difference {diff}");
    assert_eq!(greedy(&a.model, &prompt, 8), greedy(&b.model, &prompt, 8));
}
