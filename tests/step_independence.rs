//! A sequence's logits do not depend on the other sequences of its step. The scheduler packs
//! whatever is running into one forward pass, so anything else would let the same request
//! (same seed) answer differently under different traffic. Long steps also go through the
//! feed-forward block in slices of rows (`Model::ffn_block`), and a neighbour in the step
//! shifts where a sequence's rows fall in them: the bits must not move. Nor may they when a
//! prompt's last block is recomputed over the rest of it, cached, as a full prefix-cache hit
//! does.

use std::path::Path;

use gateway::engine::model::{BatchSeq, Model};
use gateway::engine::paged_attention::KvCache;
use gateway::engine::quant::PromptPrecision;
use gateway::engine::weights;

const BLOCK: usize = 16;
const TEXT: &str = "The quarterly report shows that customer satisfaction improved across all \
    regions, driven by faster support response times and a simpler onboarding flow. ";

/// The logits of every sequence of one step, each given its own KV blocks in a fresh cache.
fn step(model: &Model, seqs: &[&[u32]]) -> Vec<Vec<f32>> {
    let s = &model.shape;
    let blocks: Vec<usize> = seqs.iter().map(|t| t.len().div_ceil(BLOCK)).collect();
    let mut cache = KvCache::new(
        s.num_layers,
        blocks.iter().sum(),
        BLOCK,
        s.num_kv_heads,
        s.head_dim,
    );
    let mut next = 0u32;
    let tables: Vec<Vec<u32>> = blocks
        .iter()
        .map(|&n| {
            next += n as u32;
            (next - n as u32..next).collect()
        })
        .collect();
    let batch: Vec<BatchSeq> = seqs
        .iter()
        .zip(&tables)
        .map(|(tokens, table)| BatchSeq {
            block_table: table,
            start: 0,
            tokens,
            want_logits: true,
            draft_rows: 0,
            prompt_len: tokens.len(),
        })
        .collect();
    model.forward(&batch, &mut cache).unwrap()
}

/// The model in `models/`, its prompt rows at `precision`.
fn load(file: &str, precision: PromptPrecision) -> weights::LoadedModel {
    let path = format!("{}/../models/{file}", env!("CARGO_MANIFEST_DIR"));
    let mut loaded = weights::load(Path::new(&path)).unwrap();
    loaded.model.set_prompt_precision(precision);
    loaded
}

fn check(file: &str, precision: PromptPrecision) {
    let loaded = load(file, precision);
    let encode = |text: &str| -> Vec<u32> {
        let ids = loaded.tokenizer.encode(text, false).unwrap();
        ids.get_ids().to_vec()
    };
    // 300 rows: two feed-forward slices of 256 alone, split at another row beside a
    // 60-token neighbour.
    let long = encode(&format!("Summarise: {}", TEXT.repeat(16)));
    let long = &long[..300.min(long.len())];
    let short = encode(&format!("Request B. {}", TEXT.repeat(4)));
    let short = &short[..60.min(short.len())];
    assert!(
        long.len() == 300 && short.len() == 60,
        "prompts long enough"
    );

    let alone = step(&loaded.model, &[long]).remove(0);
    let behind = step(&loaded.model, &[short, long]).remove(1);
    let first = step(&loaded.model, &[long, short]).remove(0);
    for (other, name) in [
        (&behind, "behind a neighbour"),
        (&first, "before a neighbour"),
    ] {
        let same = alone
            .iter()
            .zip(other)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "{file}: logits {name} differ from the sequence alone");
    }
}

/// A prompt whose last KV block holds two tokens (rows that take the batch kernels, see
/// `BatchSeq::prompt_len`), and one whose last block is full: recomputing the last block over
/// the cached rest gives the whole pass's logits bit for bit.
fn check_recompute(file: &str, precision: PromptPrecision) {
    let loaded = load(file, precision);
    let (s, model) = (&loaded.model.shape, &loaded.model);
    let ids = loaded
        .tokenizer
        .encode(format!("Summarise: {}", TEXT.repeat(8)), false)
        .unwrap();
    for len in [8 * BLOCK + 2, 8 * BLOCK] {
        let tokens = &ids.get_ids()[..len];
        let blocks = len.div_ceil(BLOCK);
        let mut cache = KvCache::new(s.num_layers, blocks, BLOCK, s.num_kv_heads, s.head_dim);
        let table: Vec<u32> = (0..blocks as u32).collect();
        let seq = |start: usize| BatchSeq {
            block_table: &table,
            start,
            tokens: &tokens[start..],
            want_logits: true,
            draft_rows: 0,
            prompt_len: len,
        };
        let whole = model.forward(&[seq(0)], &mut cache).unwrap();
        let last_block = (len - 1) / BLOCK * BLOCK;
        let again = model.forward(&[seq(last_block)], &mut cache).unwrap();
        let same = whole[0]
            .iter()
            .zip(&again[0])
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(
            same,
            "{file}: {len} tokens, the recomputed last block's logits differ"
        );
    }
}

#[test]
fn a_cached_prompt_recomputes_its_last_block_to_the_same_bits() {
    check_recompute("SmolLM2-135M-Instruct.Q4_1.gguf", PromptPrecision::Auto);
    check_recompute("gemma-3-270m.Q4_K_M.gguf", PromptPrecision::Auto);
    // What a CPU without AMX tiles runs: the k-quants' prompt rows on 8-bit activations.
    check_recompute("gemma-3-270m.Q4_K_M.gguf", PromptPrecision::Int8);
}

#[test]
fn smollm2_logits_do_not_depend_on_the_step() {
    check("SmolLM2-135M-Instruct.Q4_1.gguf", PromptPrecision::Auto);
}

#[test]
fn qwen2_5_logits_do_not_depend_on_the_step() {
    check(
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        PromptPrecision::Auto,
    );
}

#[test]
fn gemma3_logits_do_not_depend_on_the_step() {
    check("gemma-3-270m.Q4_K_M.gguf", PromptPrecision::Auto);
    check("gemma-3-270m.Q4_K_M.gguf", PromptPrecision::Int8);
}
