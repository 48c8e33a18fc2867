//! The models people actually download, end to end over HTTP: Qwen2.5-Coder-1.5B-Instruct
//! Q4_K_M (k-quants, qwen2 BPE, ChatML) and Gemma 3 270M Q4_K_M (gemma3, SentencePiece, a
//! base model). `host/scripts/fetch-real-models.sh` fetches both (pinned, sha256-checked).
//!
//! The expected greedy texts are llama.cpp's: `llama-server` (llama-cpp-python 0.3.36's
//! vendored llama.cpp, built by `host/scripts/build-llama-peer.sh`, `-t 2`) answering
//! `/v1/completions` with `temperature: 0` on the same GGUF. Prompts where the two engines'
//! greedy paths split at a near-tie (top-2 logits within 0.03–0.07 nats in both engines)
//! are left out; the README's model table records them.

mod support;

use serde_json::{json, Value};
use support::Server;

const QWEN: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"
);
const GEMMA: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../models/gemma-3-270m.Q4_K_M.gguf"
);

fn start(name: &str, path: &str) -> Server {
    assert!(
        std::path::Path::new(path).exists(),
        "{path} is missing: run host/scripts/fetch-real-models.sh"
    );
    Server::start(&["--model", &format!("{name}={path}")])
}

fn complete(s: &Server, model: &str, prompt: &str, max_tokens: u32) -> String {
    let body =
        json!({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0});
    let (status, v): (u16, Value) = s.post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn qwen2_5_greedy_completions_equal_llama_cpp_and_chat_works_through_the_sdk() {
    let s = start("qwen", QWEN);
    // Token 21 of the first case is a near-tie in the float reference itself (' cultural' over
    // ' capital' by 0.0013 logits, `tests/float_reference.rs`): llama.cpp's 8-bit rounding
    // picks ' cultural', and which one ours picks depends on the order of float sums. Up to
    // there the texts must be equal; the others must be equal throughout.
    let tie = " Paris. Paris is the largest city in France and the second-largest city in Europe. Paris is the";
    let cases = [
        (
            "The capital of France is",
            " Paris. Paris is the largest city in France and the second-largest city in Europe. Paris is the cultural and historical center of France and is home to many of",
        ),
        (
            "def fibonacci(n):",
            "\n    if n <= 0:\n        return \"Invalid input\"\n    elif n == 1:\n        return 0\n    elif n == 2",
        ),
        (
            "List the primary colors:",
            " red, blue, and green. These colors are essential for creating a wide range of visual effects and are widely used in various fields such as art, design,",
        ),
    ];
    for (prompt, want) in cases {
        let got = complete(&s, "qwen", prompt, 32);
        if want.starts_with(tie) {
            let next = got.strip_prefix(tie);
            assert!(
                next.is_some_and(|n| n.starts_with(" cultural") || n.starts_with(" capital")),
                "{prompt}: {got:?}"
            );
        } else {
            assert_eq!(got, want, "{prompt}");
        }
    }
    let answer = s.sdk_script("openai_sdk.py", "qwen");
    assert!(answer.contains("Paris"), "{answer}");
}

/// `--decode-activation-bits 8` (llama.cpp's Q8_K rounding in decode) serves the model end to
/// end. Its text is pinned only up to the first near-tie: 8-bit rounding moves logits by up to
/// ~0.13 nats, enough to flip the closer calls these prompts make (ARCHITECTURE.md).
#[test]
fn qwen2_5_serves_with_8_bit_decode_activations() {
    let s = Server::start(&[
        "--model",
        &format!("qwen={QWEN}"),
        "--decode-activation-bits",
        "8",
    ]);
    let got = complete(&s, "qwen", "The capital of France is", 24);
    assert!(
        got.starts_with(" Paris. Paris is the largest city in France and the second-largest"),
        "{got:?}"
    );
}

#[test]
fn gemma3_greedy_completions_equal_llama_cpp_and_chat_is_refused_through_the_sdk() {
    let s = start("gemma", GEMMA);
    let cases = [
        (
            "def fibonacci(n):",
            "\n    if n == 0:\n        return 0\n    elif n == 1:\n        return 1\n    elif n == 2:\n        return 2\n",
        ),
        (
            "Water boils at",
            " 100 degrees Celsius.\n\nWater boils at 100 degrees Celsius.\n\nWater boils at 100 degrees Celsius.\n\nWater boils at 100 degrees Celsius.",
        ),
    ];
    for (prompt, want) in cases {
        assert_eq!(complete(&s, "gemma", prompt, 40), want, "{prompt}");
    }
    s.sdk_script("openai_sdk_base_model.py", "gemma");
}
