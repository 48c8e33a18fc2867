//! `/v1/embeddings` end to end against the real all-MiniLM-L6-v2 weights.
//!
//! Reference vectors come from `tests/reference_embeddings.py`: an independent float64 numpy
//! implementation of the BERT forward + mean pooling + L2 normalisation that
//! sentence-transformers runs for this model, reading the same files (HF `tokenizers` for
//! token ids, `safetensors` for weights). It runs at test time; nothing is committed.

mod support;

use std::io::Write;
use std::process::{Command, Stdio};

use base64::Engine as _;
use serde_json::{json, Value};
use support::Server;

const EMBED: &str = "all-minilm-l6-v2";

fn model_dir() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../models/all-MiniLM-L6-v2").into()
}

fn reference(sentences: &[&str]) -> (Vec<Vec<f64>>, Vec<u64>) {
    let mut child = Command::new("python3")
        .args([
            concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../tests/reference_embeddings.py"
            ),
            &model_dir(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3 runs");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(json!(sentences).to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "reference script failed (needs numpy, safetensors, tokenizers)"
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let vecs = v["vectors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| {
            x.as_array()
                .unwrap()
                .iter()
                .map(|f| f.as_f64().unwrap())
                .collect()
        })
        .collect();
    let toks = v["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap())
        .collect();
    (vecs, toks)
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_f64().unwrap())
        .collect()
}

fn cosine(a: &[f64], b: &[f64]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let n = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

#[test]
fn embeddings_match_the_reference_model() {
    let s = Server::start(&["--embedding-model", &format!("{EMBED}={}", model_dir())]);
    // Different lengths in one request: padding must not leak into the pooled vectors.
    let sentences = [
        "The cat sits on the mat.",
        "How do I reset my password if I no longer have access to my recovery email?",
        "Invoices can be exported as PDF from the billing tab.",
        "ok",
    ];
    let (want, tokens) = reference(&sentences);
    let (st, body) = s.post(
        "/v1/embeddings",
        &json!({"model": EMBED, "input": sentences}),
    );
    assert_eq!(st, 200, "{body}");
    assert_eq!(body["usage"]["prompt_tokens"], tokens.iter().sum::<u64>());
    for (i, w) in want.iter().enumerate() {
        let got = floats(&body["data"][i]["embedding"]);
        assert_eq!(got.len(), 384);
        let c = cosine(&got, w);
        println!("sentence {i}: cosine to the reference {c:.7}");
        assert!(c >= 0.999, "sentence {i}: cosine {c}");
        assert!((got.iter().map(|x| x * x).sum::<f64>().sqrt() - 1.0).abs() < 1e-4);
    }
    // One at a time gives the same vector as in a batch.
    let (_, one) = s.post(
        "/v1/embeddings",
        &json!({"model": EMBED, "input": sentences[1]}),
    );
    assert!(cosine(&floats(&one["data"][0]["embedding"]), &want[1]) >= 0.999);
    // Related sentences are closer than unrelated ones.
    assert!(cosine(&want[1], &want[2]) < cosine(&floats(&body["data"][2]["embedding"]), &want[2]));

    // base64: little-endian f32, the same numbers.
    let (_, b64) = s.post(
        "/v1/embeddings",
        &json!({"model": EMBED, "input": sentences[0], "encoding_format": "base64"}),
    );
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b64["data"][0]["embedding"].as_str().unwrap())
        .unwrap();
    let decoded: Vec<f64> = bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
        .collect();
    let float = floats(&body["data"][0]["embedding"]);
    assert_eq!(decoded.len(), float.len());
    // JSON carries each f32 as its shortest decimal: equal to f32 precision.
    assert!(
        decoded
            .iter()
            .zip(&float)
            .all(|(a, b)| (a - b).abs() <= 1e-7 * b.abs().max(1e-30)),
        "base64 and float disagree"
    );

    // Token arrays are embedded as given.
    let (st, ids) = s.post(
        "/v1/embeddings",
        &json!({"model": EMBED, "input": [[101, 7592, 102], [101, 102]]}),
    );
    assert_eq!(st, 200, "{ids}");
    assert_eq!(ids["usage"]["prompt_tokens"], 5);

    for (bad, param) in [
        (
            json!({"model": EMBED, "input": "x", "dimensions": 128}),
            "dimensions",
        ),
        (
            json!({"model": EMBED, "input": "x", "encoding_format": "int8"}),
            "encoding_format",
        ),
        (json!({"model": EMBED, "input": []}), "input"),
        (json!({"model": EMBED, "input": ["a", ""]}), "input"),
        (
            json!({"model": EMBED, "input": "word ".repeat(600)}),
            "input",
        ),
        (json!({"model": EMBED, "input": [[999999]]}), "input"),
    ] {
        let (st, e) = s.post("/v1/embeddings", &bad);
        assert_eq!(
            (st, e["error"]["param"].as_str()),
            (400, Some(param)),
            "{bad}: {e}"
        );
    }
    assert_eq!(
        s.post(
            "/v1/embeddings",
            &json!({"model": EMBED, "input": "x", "dimensions": 384})
        )
        .0,
        200
    );
    assert_eq!(
        s.post("/v1/embeddings", &json!({"model": "nope", "input": "x"}))
            .0,
        404
    );
    let (_, models) = s.get("/v1/models");
    assert!(models.contains(EMBED), "{models}");

    // The official SDK asks for base64 by default and decodes it.
    let script = format!(
        "from openai import OpenAI\nc = OpenAI(base_url='{}/v1', api_key='x')\nr = c.embeddings.create(model='{EMBED}', input=['The cat sits on the mat.'])\nprint(len(r.data[0].embedding), r.data[0].embedding[0], r.usage.prompt_tokens)",
        s.base
    );
    let out = Command::new("python3")
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let parts: Vec<&str> = text.split_whitespace().collect();
    assert_eq!(parts[0], "384");
    assert!(
        (parts[1].parse::<f64>().unwrap() - floats(&body["data"][0]["embedding"])[0]).abs() < 1e-6
    );
    assert_eq!(parts[2], tokens[0].to_string());
}

/// Each `--embedding-precision` against the float64 reference, and batch invariance: a text's
/// vector is the same bits alone, in a batch, and beside other clients' texts.
#[test]
fn every_precision_matches_the_reference_and_is_batch_invariant() {
    let sentences = [
        "The cat sits on the mat.",
        "How do I reset my password if I no longer have access to my recovery email?",
        "Invoices can be exported as PDF from the billing tab, or sent to the customer directly by email every month.",
        "ok",
        "Customer support escalations",
    ];
    let (want, _) = reference(&sentences);
    // The model card says which kernel `auto` chose: AMX where the CPU and the OS allow it.
    let mut amx = false;
    // Floors sit under the measured worst cosines (f32 1.0000000; BF16 0.99993, on the three-token "ok").
    for (precision, floor) in [("auto", 0.9999), ("f32", 0.999_999), ("bf16", 0.9999)] {
        if precision == "bf16" && !amx {
            println!("bf16: no AMX-BF16 here (auto chose f32 kernels); auto and f32 were checked");
            continue;
        }
        let model = format!("{EMBED}={}", model_dir());
        let s = Server::start(&[
            "--embedding-model",
            &model,
            "--embedding-precision",
            precision,
        ]);
        if precision == "auto" {
            let (_, models) = s.get("/v1/models");
            amx = models.contains(r#""kernel":"amx-bf16""#);
        }
        let (st, body) = s.post(
            "/v1/embeddings",
            &json!({"model": EMBED, "input": sentences}),
        );
        assert_eq!(st, 200, "{body}");
        let batched: Vec<Vec<f64>> = (0..sentences.len())
            .map(|i| floats(&body["data"][i]["embedding"]))
            .collect();
        for (i, (got, w)) in batched.iter().zip(&want).enumerate() {
            let c = cosine(got, w);
            println!("{precision}: sentence {i}: cosine to the reference {c:.7}");
            assert!(c >= floor, "{precision}: sentence {i}: cosine {c}");
        }
        let reversed: Vec<&str> = sentences.iter().rev().copied().collect();
        let (_, rev) = s.post(
            "/v1/embeddings",
            &json!({"model": EMBED, "input": reversed}),
        );
        for (i, text) in sentences.iter().enumerate() {
            let (_, one) = s.post("/v1/embeddings", &json!({"model": EMBED, "input": text}));
            assert_eq!(
                floats(&one["data"][0]["embedding"]),
                batched[i],
                "{precision}: {i} alone"
            );
            let r = sentences.len() - 1 - i;
            assert_eq!(
                floats(&rev["data"][r]["embedding"]),
                batched[i],
                "{precision}: {i} reordered"
            );
        }
    }
}
