//! Our quantized kernels against a float reference on the real models: the same GGUF loaded
//! twice, once with the float-faithful kernels (k-quants × 16-bit activations, prompt rows
//! too: `prompt_precision = "int16"`; the 32-element formats × 16-bit activations on AVX-512,
//! Q5_1's generated rows × f32 ones) and once with every projection dequantized to dense f32 and
//! multiplied by candle's f32 matmul. (The default prompt kernels, BF16 tiles where the CPU
//! has AMX, are held to llama.cpp's KL divergence instead: `tests/kl_divergence.rs`.)
//! Greedy continuations must be equal, except where the float reference itself has two
//! candidates within 0.05 logits (a near-tie any rounding may flip); those are reported.

use gateway::engine::model::{BatchSeq, Model};
use gateway::engine::paged_attention::KvCache;
use gateway::engine::quant::PromptPrecision;
use gateway::engine::weights;

/// Greedy `n` tokens with an incremental KV cache; returns each step's logits too.
fn greedy(model: &Model, prompt: &[u32], n: usize) -> Vec<(u32, Vec<f32>)> {
    let s = &model.shape;
    let blocks = (prompt.len() + n).div_ceil(16);
    let mut cache = KvCache::new(s.num_layers, blocks, 16, s.num_kv_heads, s.head_dim);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut ids = prompt.to_vec();
    let mut out = Vec::new();
    let mut start = 0;
    for _ in 0..n {
        let seq = BatchSeq {
            block_table: &table,
            start,
            tokens: &ids[start..],
            want_logits: true,
            draft_rows: 0,
            prompt_len: prompt.len(),
        };
        let logits = model.forward(&[seq], &mut cache).unwrap().remove(0);
        let best = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap() as u32;
        start = ids.len();
        ids.push(best);
        out.push((best, logits));
    }
    out
}

/// The gap between the best and second-best logit.
fn margin(logits: &[f32]) -> f32 {
    let mut top = [f32::NEG_INFINITY; 2];
    for &l in logits {
        if l > top[0] {
            top = [l, top[0]];
        } else if l > top[1] {
            top[1] = l;
        }
    }
    top[0] - top[1]
}

fn check(file: &str, prompts: &[&str], n: usize) {
    let path = format!("{}/../models/{file}", env!("CARGO_MANIFEST_DIR"));
    assert!(
        std::path::Path::new(&path).exists(),
        "{path} is missing: run host/scripts/fetch-real-models.sh"
    );
    let mut served = weights::load(path.as_ref()).unwrap();
    served.model.set_prompt_precision(PromptPrecision::Int16);
    let float = weights::load(path.as_ref())
        .unwrap()
        .model
        .into_dense_f32()
        .unwrap();
    for prompt in prompts {
        let mut ids = served
            .tokenizer
            .encode(*prompt, false)
            .unwrap()
            .get_ids()
            .to_vec();
        if served.add_bos {
            ids.insert(0, served.bos.unwrap());
        }
        let a = greedy(&served.model, &ids, n);
        let b = greedy(&float, &ids, n);
        match a.iter().zip(&b).position(|(x, y)| x.0 != y.0) {
            None => {
                eprintln!("{file} {prompt:?}: {n}/{n} greedy tokens equal to the float reference")
            }
            Some(i) => {
                let m = margin(&b[i].1);
                eprintln!("{file} {prompt:?}: equal for {i} tokens, then a near-tie (float margin {m:.4})");
                assert!(m < 0.05, "{file} {prompt:?}: differs at token {i} where the float reference leads by {m}");
            }
        }
    }
}

#[test]
fn gemma3_greedy_matches_the_float_reference() {
    check(
        "gemma-3-270m.Q4_K_M.gguf",
        &[
            "The capital of France is",
            "def fibonacci(n):",
            "Water boils at",
            "Once upon a time, in a small village",
            LONG,
        ],
        32,
    );
}

/// A prompt of over a hundred tokens: its rows go through the prompt kernels (`quant::lanes`
/// on AVX-512), which short prompts alone in a step do not reach.
const LONG: &str = "Customer record: Maria Lopez, account 48213, signed up in March 2021 on \
    the premium plan. She contacted support three times this quarter about invoices that listed \
    the wrong billing address, and each time the agent corrected the address but the next \
    invoice reverted to the old one. Her renewal is due next month. Summarise the issue and \
    suggest the next step:";

#[test]
fn smollm2_greedy_matches_the_float_reference() {
    check(
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        &["The capital of France is", "def fibonacci(n):", LONG],
        32,
    );
}

#[test]
fn qwen2_5_greedy_matches_the_float_reference() {
    check(
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        &[
            "The capital of France is",
            "def fibonacci(n):",
            "List the primary colors:",
            "Water boils at",
        ],
        32,
    );
}
