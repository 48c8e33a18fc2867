//! Retrieval evaluation over labelled sets: BEIR layout (corpus.jsonl, queries.jsonl, qrels
//! TSV with a header) or TREC layout (`id<TAB>text` files, qrels as `qid 0 docid rel`).
//! Metrics are computed per document (a document's best chunk stands for it), as BEIR and
//! trec_eval do: nDCG@10 with linear gain, Recall@100, MRR@10.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use serde_json::Value;

use super::collection::{Collection, DocInput, Fusion, Mode, Query};
use super::SearchError;

pub type Qrels = HashMap<String, HashMap<String, f32>>;

/// A corpus as documents: BEIR JSONL (`_id`, `title`, `text`) or TSV (`id<TAB>text`).
pub fn load_corpus(path: &Path) -> anyhow::Result<Vec<DocInput>> {
    let text = std::fs::read_to_string(path)?;
    let mut docs = Vec::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let at = || format!("{}:{}", path.display(), n + 1);
        if line.trim_start().starts_with('{') {
            let v: Value =
                serde_json::from_str(line).map_err(|e| anyhow::anyhow!("{}: {e}", at()))?;
            let id = id_of(&v).ok_or_else(|| anyhow::anyhow!("{}: no `_id` or `id`", at()))?;
            let title = v["title"].as_str().unwrap_or("");
            let body = v["text"].as_str().unwrap_or("");
            let text = if title.is_empty() {
                body.to_string()
            } else {
                format!("{title}\n{body}")
            };
            if text.trim().is_empty() {
                eprintln!("{}: document {id} has no text; skipped", at());
                continue;
            }
            docs.push(DocInput {
                id,
                text,
                metadata: Default::default(),
            });
        } else {
            let (id, text) = line
                .split_once('\t')
                .ok_or_else(|| anyhow::anyhow!("{}: expected `id<TAB>text`", at()))?;
            docs.push(DocInput {
                id: id.trim().to_string(),
                text: text.to_string(),
                metadata: Default::default(),
            });
        }
    }
    Ok(docs)
}

/// Queries as (id, text), from BEIR JSONL or TSV.
pub fn load_queries(path: &Path) -> anyhow::Result<Vec<(String, String)>> {
    Ok(load_corpus(path)?
        .into_iter()
        .map(|d| (d.id, d.text))
        .collect())
}

/// Relevance judgements: BEIR TSV (`query-id corpus-id score`, header optional) or TREC
/// (`qid iteration docid relevance`).
pub fn load_qrels(path: &Path) -> anyhow::Result<Qrels> {
    let text = std::fs::read_to_string(path)?;
    let mut qrels: Qrels = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (q, d, rel) = match f.as_slice() {
            [q, d, r] => (q, d, r),
            [q, _, d, r] => (q, d, r),
            [] => continue,
            _ => anyhow::bail!("{}:{}: expected 3 or 4 columns", path.display(), n + 1),
        };
        let Ok(rel) = rel.parse::<f32>() else {
            if n == 0 {
                continue; // a header line
            }
            anyhow::bail!(
                "{}:{}: relevance {rel:?} is not a number",
                path.display(),
                n + 1
            );
        };
        qrels
            .entry(q.to_string())
            .or_default()
            .insert(d.to_string(), rel);
    }
    Ok(qrels)
}

fn id_of(v: &Value) -> Option<String> {
    let id = v.get("_id").or_else(|| v.get("id"))?;
    Some(match id {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    })
}

#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Scores {
    pub ndcg10: f64,
    pub recall100: f64,
    pub mrr10: f64,
}

/// Metrics of one ranked list of document ids against its judgements.
pub fn score(ranked: &[String], rels: &HashMap<String, f32>) -> Scores {
    let gain = |d: &String| rels.get(d).copied().unwrap_or(0.0).max(0.0) as f64;
    let dcg: f64 = ranked
        .iter()
        .take(10)
        .enumerate()
        .map(|(i, d)| gain(d) / (i as f64 + 2.0).log2())
        .sum();
    let mut ideal: Vec<f64> = rels.values().map(|&r| r.max(0.0) as f64).collect();
    ideal.sort_by(|a, b| b.total_cmp(a));
    let idcg: f64 = ideal
        .iter()
        .take(10)
        .enumerate()
        .map(|(i, g)| g / (i as f64 + 2.0).log2())
        .sum();
    let relevant = rels.values().filter(|&&r| r > 0.0).count();
    let found = ranked.iter().take(100).filter(|d| gain(d) > 0.0).count();
    let mrr = ranked
        .iter()
        .take(10)
        .position(|d| gain(d) > 0.0)
        .map_or(0.0, |p| 1.0 / (p as f64 + 1.0));
    Scores {
        ndcg10: if idcg > 0.0 { dcg / idcg } else { 0.0 },
        recall100: if relevant > 0 {
            found as f64 / relevant as f64
        } else {
            0.0
        },
        mrr10: mrr,
    }
}

pub struct ModeResult {
    pub name: &'static str,
    pub scores: Scores,
    pub queries: usize,
    /// Median search latency in milliseconds.
    pub p50_ms: f64,
}

/// The four configurations reported: each first stage alone and both fusions.
pub fn modes() -> [(&'static str, Mode, Fusion); 4] {
    [
        ("bm25", Mode::Bm25, Fusion::Rrf { k: 60.0 }),
        ("vector", Mode::Vector, Fusion::Rrf { k: 60.0 }),
        ("hybrid-rrf", Mode::Hybrid, Fusion::Rrf { k: 60.0 }),
        (
            "hybrid-weighted",
            Mode::Hybrid,
            Fusion::Weighted { alpha: 0.5 },
        ),
    ]
}

/// Runs every judged query in every mode; documents ranked by their best chunk.
pub fn evaluate(
    col: &Collection,
    queries: &[(String, String)],
    qrels: &Qrels,
) -> Result<Vec<ModeResult>, SearchError> {
    let judged: Vec<_> = queries
        .iter()
        .filter(|(id, _)| qrels.get(id).is_some_and(|r| r.values().any(|&v| v > 0.0)))
        .collect();
    let mut out = Vec::new();
    for (name, mode, fusion) in modes() {
        let mut total = Scores::default();
        let mut times = Vec::with_capacity(judged.len());
        for (qid, text) in &judged {
            let started = std::time::Instant::now();
            // Deep enough that 100 distinct documents remain after folding chunks into them.
            let hits = col.search(&Query {
                text,
                top_k: 1000,
                mode,
                fusion,
                filter: None,
                candidates: 1000,
                tokens: None,
            })?;
            times.push(started.elapsed().as_secs_f64() * 1e3);
            let mut seen = HashSet::new();
            let ranked: Vec<String> = hits
                .into_iter()
                .filter(|h| seen.insert(h.id.clone()))
                .map(|h| h.id)
                .take(100)
                .collect();
            let s = score(&ranked, &qrels[qid.as_str()]);
            total.ndcg10 += s.ndcg10;
            total.recall100 += s.recall100;
            total.mrr10 += s.mrr10;
        }
        let n = judged.len().max(1) as f64;
        times.sort_by(f64::total_cmp);
        out.push(ModeResult {
            name,
            scores: Scores {
                ndcg10: total.ndcg10 / n,
                recall100: total.recall100 / n,
                mrr10: total.mrr10 / n,
            },
            queries: judged.len(),
            p50_ms: times.get(times.len() / 2).copied().unwrap_or(0.0),
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_match_hand_computation() {
        let rels: HashMap<String, f32> = [("a".into(), 1.0), ("b".into(), 2.0)].into();
        let ranked: Vec<String> = ["x", "b", "a"].iter().map(|s| s.to_string()).collect();
        let s = score(&ranked, &rels);
        let dcg = 2.0 / 3f64.log2() + 1.0 / 4f64.log2();
        let idcg = 2.0 + 1.0 / 3f64.log2();
        assert!((s.ndcg10 - dcg / idcg).abs() < 1e-12);
        assert_eq!(s.mrr10, 0.5);
        assert_eq!(s.recall100, 1.0);
        let none = score(&["x".to_string()], &rels);
        assert_eq!(none, Scores::default());
    }
}
