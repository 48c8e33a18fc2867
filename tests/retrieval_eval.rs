//! Retrieval quality on a real support FAQ: `tests/debian_faq.py` derives 144 question →
//! answer-section pairs from Debian's `debian-faq` package (downloaded at test time, never
//! committed), and `gateway eval-retrieval` scores each mode on them. The floors below sit a
//! few points under the scores measured when they were set, so a regression in chunking,
//! analysis, embeddings or fusion fails here.

use std::process::Command;

use serde_json::Value;

#[test]
fn debian_faq_retrieval_quality() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("debian-faq");
    let derive = Command::new("python3")
        .args([
            concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/debian_faq.py"),
            dir.to_str().unwrap(),
        ])
        .status()
        .expect("python3 runs");
    assert!(derive.success(), "deriving the Debian FAQ set failed");
    let r = eval(&dir, "auto");
    println!("{}", serde_json::to_string_pretty(&r).unwrap());
    assert_eq!(r["documents"], 144);
    let m = &r["modes"];
    let get = |mode: &str, metric: &str| m[mode][metric].as_f64().unwrap();
    for (mode, ndcg, mrr) in [
        ("bm25", FLOORS[0].0, FLOORS[0].1),
        ("vector", FLOORS[1].0, FLOORS[1].1),
        ("hybrid-rrf", FLOORS[2].0, FLOORS[2].1),
        ("hybrid-weighted", FLOORS[3].0, FLOORS[3].1),
    ] {
        assert_eq!(m[mode]["queries"], 144);
        assert!(get(mode, "ndcg@10") >= ndcg, "{mode} nDCG@10 below {ndcg}");
        assert!(get(mode, "mrr@10") >= mrr, "{mode} MRR@10 below {mrr}");
        assert!(
            get(mode, "recall@100") >= 0.9,
            "{mode} Recall@100 below 0.9"
        );
    }
    // Fusion must not be worse than the better of its two inputs by more than noise.
    let best_single = get("bm25", "ndcg@10").max(get("vector", "ndcg@10"));
    assert!(get("hybrid-rrf", "ndcg@10") >= best_single - 0.03);

    // The default precision (BF16 tiles where the CPU has AMX) ranks as f32 does, to within a
    // swap or two of neighbours (measured: vector nDCG@10 0.7035 against 0.7061).
    let exact = eval(&dir, "f32");
    for mode in ["vector", "hybrid-rrf"] {
        let (a, b) = (
            get(mode, "ndcg@10"),
            exact["modes"][mode]["ndcg@10"].as_f64().unwrap(),
        );
        println!("{mode} nDCG@10: default {a:.4}, f32 {b:.4}");
        assert!((a - b).abs() <= 0.01, "{mode}: default {a} against f32 {b}");
    }
}

/// `gateway eval-retrieval --json` on the derived set, with the encoder at `precision`.
fn eval(dir: &std::path::Path, precision: &str) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_gateway"))
        .args([
            "eval-retrieval",
            "--json",
            "--precision",
            precision,
            "--embedding-model",
        ])
        .arg(concat!(
            "all-minilm-l6-v2=",
            env!("CARGO_MANIFEST_DIR"),
            "/../models/all-MiniLM-L6-v2"
        ))
        .arg("--corpus")
        .arg(dir.join("corpus.jsonl"))
        .arg("--queries")
        .arg(dir.join("queries.jsonl"))
        .arg("--qrels")
        .arg(dir.join("qrels.tsv"))
        .output()
        .expect("gateway runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

/// (nDCG@10, MRR@10) floors for bm25, vector, hybrid-rrf, hybrid-weighted.
const FLOORS: [(f64, f64); 4] = [(0.52, 0.45), (0.67, 0.61), (0.66, 0.60), (0.65, 0.58)];
