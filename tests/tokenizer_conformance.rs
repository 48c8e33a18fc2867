//! llama.cpp's tokenizer conformance vectors: vocab-only GGUFs with `.inp` (texts separated by
//! `__ggml_vocab_test__` lines) and `.out` (the token ids llama.cpp's `test-tokenizer-0`
//! produces, no BOS, special tokens not parsed). `host/scripts/fetch-real-models.sh` unpacks
//! them into `models/vocab/` from the llama-cpp-python sdist. Every vocabulary the README lists
//! as supported must match token for token; the others must be refused at load.

use std::path::PathBuf;

use gateway::engine::tokenizer;

fn vocab_dir() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../models/vocab"))
}

fn cases(name: &str) -> Vec<(String, Vec<u32>)> {
    let base = vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
    let read = |ext: &str| {
        let p = base.with_extension(format!("gguf.{ext}"));
        std::fs::read_to_string(&p).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (run host/scripts/fetch-real-models.sh)",
                p.display()
            )
        })
    };
    let raw = read("inp");
    let sep = "\n__ggml_vocab_test__\n";
    // As llama.cpp reads it: a separator at the very end opens no further case.
    let inputs: Vec<String> = raw
        .strip_suffix(sep)
        .unwrap_or(&raw)
        .split(sep)
        .map(String::from)
        .collect();
    let outputs: Vec<Vec<u32>> = read("out")
        .lines()
        .map(|l| l.split_whitespace().map(|t| t.parse().unwrap()).collect())
        .collect();
    assert_eq!(
        inputs.len(),
        outputs.len(),
        "{name}: .inp and .out disagree"
    );
    inputs.into_iter().zip(outputs).collect()
}

fn check(name: &str) {
    let path = vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
    let tok = tokenizer::from_gguf_file(&path).unwrap();
    let mut failures = Vec::new();
    let cases = cases(name);
    for (text, want) in &cases {
        let got = tok.encode(text.as_str(), false).unwrap().get_ids().to_vec();
        if &got != want {
            failures.push(format!("{text:?}\n  got  {got:?}\n  want {want:?}"));
        }
    }
    assert!(
        failures.is_empty(),
        "{name}: {} of {} cases differ:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

#[test]
fn llama_spm() {
    check("llama-spm");
}

#[test]
fn phi_3() {
    check("phi-3");
}

#[test]
fn gpt_2() {
    check("gpt-2");
}

#[test]
fn llama_bpe() {
    check("llama-bpe");
}

#[test]
fn qwen2() {
    check("qwen2");
}

#[test]
fn unsupported_vocabularies_are_refused_with_a_reason() {
    for (name, words) in [
        ("bert-bge", "\"bert\""),
        ("gemma-4", "\"gemma4\""),
        ("falcon", "\"falcon\""),
        ("starcoder", "\"starcoder\""),
    ] {
        let path = vocab_dir().join(format!("ggml-vocab-{name}.gguf"));
        let err = tokenizer::from_gguf_file(&path).unwrap_err().to_string();
        assert!(err.contains(words), "{name}: {err}");
    }
}
