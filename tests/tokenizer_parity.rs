//! The GGUF-built tokenizer must produce the same ids as the model's reference tokenizer.
//!
//! Where the expected ids come from: the SmolLM2 GGUF's own `tokenizer.ggml.*` metadata fed to
//! Hugging Face's Python `tokenizers` (BPE, `Digits(individual_digits)` + `ByteLevel`
//! pre-tokenizer, as llama.cpp's `smollm` pre-tokenizer type specifies), cross-checked
//! against `transformers`' own GGUF tokenizer conversion (identical on the first six strings;
//! transformers lacks the digit split, the later cases check exactly that) and against an
//! independent pure-Python byte-level BPE. Special tokens in the text are matched whole.

use gateway::engine::tokenizer;

#[path = "support/model.rs"]
mod model;

const CASES: &[(&str, &[u32])] = &[
    (
        "What is the capital of France?",
        &[1780, 314, 260, 3575, 282, 4649, 47],
    ),
    (
        "Hello, world! 12345 tokens.",
        &[19556, 28, 905, 17, 216, 33, 34, 35, 36, 37, 17837, 30],
    ),
    (
        "<|im_start|>user\nHi there<|im_end|>\n",
        &[1, 4093, 198, 26843, 665, 2, 198],
    ),
    (
        "  leading spaces and\ttabs\nnewlines",
        &[216, 2899, 5600, 284, 197, 100, 7366, 198, 2241, 5110],
    ),
    (
        "naïve café — emoji 🚀 done",
        &[3546, 46494, 37366, 1841, 649, 33777, 15107, 244, 218, 2294],
    ),
    (
        "def add(a, b):\n    return a + b\n",
        &[
            1604, 803, 24, 81, 28, 278, 727, 472, 1003, 253, 1232, 278, 198,
        ],
    ),
    ("a  1", &[81, 256, 33]),
    (
        "Total:   2024 items",
        &[17647, 42, 333, 34, 32, 34, 36, 3723],
    ),
    ("x\n 1\n\n  22", &[104, 3805, 33, 39892, 34, 34]),
    (
        "x² + y³ = z¹ ½",
        &[104, 19133, 1232, 329, 39050, 446, 1892, 43183, 216, 16738],
    ),
    (
        "version 3.14159, 1,000,000 and 0x1F",
        &[
            5903, 216, 35, 30, 33, 36, 33, 37, 41, 28, 216, 33, 28, 32, 32, 32, 28, 32, 32, 32,
            284, 216, 32, 104, 33, 54,
        ],
    ),
    (" ", &[216]),
    ("Hello ", &[19556, 216]),
    ("\n\n\n", &[16506]),
    (
        "don't I'LL we've they'RE",
        &[12420, 982, 339, 23, 16421, 392, 3543, 502, 23, 3256],
    ),
    (
        "日本語のテキスト",
        &[
            23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226,
        ],
    ),
    ("<|endoftext|>", &[0]),
    ("<|im_start|>assistant\n", &[1, 520, 9531, 198]),
];

#[test]
fn gguf_tokenizer_matches_reference_ids() {
    let path = model::model_path();
    let tok = tokenizer::from_gguf_file(std::path::Path::new(&path))
        .unwrap_or_else(|e| panic!("cannot load {path}: {e} (run host/scripts/fetch-models.sh)"));
    for (text, want) in CASES {
        let got = tok.encode(*text, false).unwrap();
        assert_eq!(got.get_ids(), *want, "ids of {text:?}");
        assert_eq!(
            tok.decode(got.get_ids(), false).unwrap(),
            *text,
            "round trip of {text:?}"
        );
    }
    assert_eq!(tok.token_to_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
}
