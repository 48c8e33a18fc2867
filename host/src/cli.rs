//! Command-line tools around search: `gateway index` loads files into a running gateway's
//! collection over its HTTP API (so it works against any deployment, with the tenant's key),
//! and `gateway eval-retrieval` measures retrieval quality on a labelled set in-process.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::{json, Value};

use crate::search::collection::{Collection, DocInput};
use crate::search::embedder::Embedder;
use crate::search::eval;

/// A request body stays under this (the server's default body limit is 4 MiB).
const BATCH_BYTES: usize = 512 << 10;
const BATCH_DOCS: usize = 128;

fn bar(total: u64, unit: &str) -> ProgressBar {
    let b = ProgressBar::new(total);
    b.set_style(
        ProgressStyle::with_template(&format!(
            "{{elapsed_precise}} [{{bar:40}}] {{pos}}/{{len}} {unit} {{msg}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    b
}

/// Documents from files and folders: JSONL files hold one document per line (`id` or `_id`,
/// `text`, optional `title` and `metadata`); any other file is one document whose id is its
/// path, with `source` and `title` metadata.
pub fn read_documents(paths: &[PathBuf]) -> anyhow::Result<Vec<DocInput>> {
    let mut files = Vec::new();
    for p in paths {
        collect_files(p, &mut files)?;
    }
    let mut docs = Vec::new();
    for f in files {
        let text =
            std::fs::read_to_string(&f).with_context(|| format!("reading {}", f.display()))?;
        let ext = f.extension().and_then(|e| e.to_str()).unwrap_or("");
        if matches!(ext, "jsonl" | "ndjson") {
            for (n, line) in text
                .lines()
                .enumerate()
                .filter(|(_, l)| !l.trim().is_empty())
            {
                let at = || format!("{}:{}", f.display(), n + 1);
                let mut v: Value = serde_json::from_str(line).with_context(at)?;
                let Some(obj) = v.as_object_mut() else {
                    bail!("{}: expected a JSON object", at());
                };
                let id = match obj.remove("id").or_else(|| obj.remove("_id")) {
                    Some(Value::String(s)) => s,
                    Some(other @ Value::Number(_)) => other.to_string(),
                    _ => bail!("{}: no string `id`", at()),
                };
                let body = obj
                    .remove("text")
                    .and_then(|t| t.as_str().map(String::from));
                let Some(body) = body else {
                    bail!("{}: no string `text`", at());
                };
                let mut metadata = match obj.remove("metadata") {
                    Some(Value::Object(m)) => m,
                    None | Some(Value::Null) => Default::default(),
                    Some(_) => bail!("{}: `metadata` must be an object", at()),
                };
                let text = match obj.remove("title") {
                    Some(Value::String(t)) if !t.is_empty() => {
                        metadata.entry("title").or_insert(Value::String(t.clone()));
                        format!("{t}\n{body}")
                    }
                    _ => body,
                };
                docs.push(DocInput { id, text, metadata });
            }
        } else {
            let title = text
                .lines()
                .find_map(|l| l.strip_prefix("# "))
                .map(str::trim)
                .map(String::from)
                .or_else(|| f.file_stem().map(|s| s.to_string_lossy().into_owned()))
                .unwrap_or_default();
            let source = f.display().to_string();
            docs.push(DocInput {
                id: source.clone(),
                text,
                metadata: json!({"source": source, "title": title})
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
            });
        }
    }
    Ok(docs)
}

fn collect_files(p: &Path, out: &mut Vec<PathBuf>) -> anyhow::Result<()> {
    if p.is_dir() {
        let mut entries: Vec<_> = std::fs::read_dir(p)
            .with_context(|| format!("reading {}", p.display()))?
            .flatten()
            .map(|e| e.path())
            .collect();
        entries.sort();
        for e in entries {
            let hidden = e
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with('.'));
            let text_like = e.is_dir()
                || e.extension().and_then(|x| x.to_str()).is_some_and(|x| {
                    matches!(x, "txt" | "md" | "markdown" | "rst" | "jsonl" | "ndjson")
                });
            if !hidden && text_like {
                collect_files(&e, out)?;
            }
        }
    } else if p.exists() {
        out.push(p.to_path_buf());
    } else {
        bail!("{}: no such file", p.display());
    }
    Ok(())
}

pub struct IndexOptions {
    pub url: String,
    pub api_key: Option<String>,
    pub ca_cert: Option<PathBuf>,
}

/// Uploads `docs` to `collection` (created with the server's defaults if missing), in batches,
/// retrying when the gateway asks to (429/503 with Retry-After).
pub fn index(collection: &str, paths: &[PathBuf], o: &IndexOptions) -> anyhow::Result<()> {
    let docs = read_documents(paths)?;
    if docs.is_empty() {
        bail!("no documents found in the given paths");
    }
    let up = Uploader::new(collection, o)?;
    up.ensure_collection()?;
    let total: u64 = docs.iter().map(|d| d.text.len() as u64).sum();
    let progress = bar(total, "bytes");
    let started = Instant::now();
    let (mut sent_docs, mut chunks, mut tokens) = (0usize, 0u64, 0u64);
    let (mut batch, mut batch_docs, mut batch_bytes) = (String::new(), 0usize, 0u64);
    let mut flush = |batch: &mut String, n: &mut usize, bytes: &mut u64| -> anyhow::Result<()> {
        if *n == 0 {
            return Ok(());
        }
        let (c, t) = up.send(batch, |wait| {
            progress.set_message(format!("(gateway busy, retrying in {wait}s)"))
        })?;
        (chunks, tokens, sent_docs) = (chunks + c, tokens + t, sent_docs + *n);
        progress.inc(*bytes);
        progress.set_message(format!("{sent_docs} documents, {chunks} chunks"));
        batch.clear();
        (*n, *bytes) = (0, 0);
        Ok(())
    };
    for d in docs {
        let line = json!({"id": d.id, "text": d.text, "metadata": d.metadata}).to_string();
        if batch_docs > 0 && (batch.len() + line.len() > BATCH_BYTES || batch_docs == BATCH_DOCS) {
            flush(&mut batch, &mut batch_docs, &mut batch_bytes)?;
        }
        batch_bytes += d.text.len() as u64;
        batch.push_str(&line);
        batch.push('\n');
        batch_docs += 1;
    }
    flush(&mut batch, &mut batch_docs, &mut batch_bytes)?;
    progress.finish();
    let secs = started.elapsed().as_secs_f64();
    eprintln!(
        "indexed {sent_docs} documents ({chunks} chunks, {tokens} tokens) into `{collection}` in {secs:.1} s ({:.0} tokens/s)",
        tokens as f64 / secs.max(1e-9)
    );
    Ok(())
}

/// The gateway's collection API, as `index` uses it.
struct Uploader<'a> {
    client: reqwest::blocking::Client,
    base: String,
    collection: &'a str,
    api_key: Option<&'a str>,
}

impl<'a> Uploader<'a> {
    fn new(collection: &'a str, o: &'a IndexOptions) -> anyhow::Result<Self> {
        let mut client = reqwest::blocking::Client::builder().timeout(Duration::from_secs(600));
        if let Some(ca) = &o.ca_cert {
            let pem = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
            client = client.add_root_certificate(reqwest::Certificate::from_pem(&pem)?);
        }
        Ok(Self {
            client: client.build()?,
            base: format!("{}/v1/collections", o.url.trim_end_matches('/')),
            collection,
            api_key: o.api_key.as_deref(),
        })
    }

    fn auth(&self, r: reqwest::blocking::RequestBuilder) -> reqwest::blocking::RequestBuilder {
        match self.api_key {
            Some(k) => r.bearer_auth(k),
            None => r,
        }
    }

    /// Creates the collection unless it exists.
    fn ensure_collection(&self) -> anyhow::Result<()> {
        let (base, collection) = (&self.base, self.collection);
        let r = self
            .auth(self.client.get(format!("{base}/{collection}")))
            .send()?;
        match r.status().as_u16() {
            200 => Ok(()),
            404 => {
                let create = self.client.post(base).json(&json!({"name": collection}));
                let r = self.auth(create).send()?;
                if !r.status().is_success() {
                    bail!("creating collection `{collection}`: {}", error_text(r));
                }
                eprintln!("created collection `{collection}`");
                Ok(())
            }
            _ => bail!("collection `{collection}`: {}", error_text(r)),
        }
    }

    /// Uploads one NDJSON batch, waiting out 429/503 as the gateway's `retry-after` says
    /// (`waiting` is told each wait); returns the chunks and tokens it was charged.
    fn send(&self, batch: &str, waiting: impl Fn(u64)) -> anyhow::Result<(u64, u64)> {
        let url = format!("{}/{}/documents", self.base, self.collection);
        loop {
            let post = self
                .client
                .post(&url)
                .header("content-type", "application/x-ndjson");
            let r = self.auth(post.body(batch.to_string())).send()?;
            let status = r.status().as_u16();
            if status == 429 || status == 503 {
                let wait = r
                    .headers()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                    .unwrap_or(1);
                waiting(wait);
                std::thread::sleep(Duration::from_secs(wait));
                continue;
            }
            if !r.status().is_success() {
                bail!("uploading documents: {}", error_text(r));
            }
            let v: Value = r.json()?;
            let chunks = v["chunks"].as_u64().unwrap_or(0);
            return Ok((chunks, v["usage"]["prompt_tokens"].as_u64().unwrap_or(0)));
        }
    }
}

fn error_text(r: reqwest::blocking::Response) -> String {
    let status = r.status();
    let body: Value = r.json().unwrap_or(Value::Null);
    match body["error"]["message"].as_str() {
        Some(m) => format!("{status}: {m}"),
        None => status.to_string(),
    }
}

pub struct EvalOptions {
    pub corpus: PathBuf,
    pub queries: PathBuf,
    pub qrels: PathBuf,
    pub embedder: Arc<Embedder>,
    pub chunk_tokens: Option<usize>,
    pub json: bool,
}

/// Indexes the corpus into a scratch collection and prints nDCG@10, Recall@100 and MRR@10 per
/// retrieval mode (or JSON with `json`).
pub fn eval_retrieval(o: EvalOptions) -> anyhow::Result<()> {
    let corpus = eval::load_corpus(&o.corpus)?;
    let queries = eval::load_queries(&o.queries)?;
    let qrels = eval::load_qrels(&o.qrels)?;
    let dir = std::env::temp_dir().join(format!("gateway-eval-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let root = crate::search::Collections::open(
        dir.clone(),
        [(o.embedder.name.clone(), o.embedder.clone())].into(),
    );
    let result = (|| -> anyhow::Result<()> {
        let col = root.create(
            "eval",
            "eval",
            crate::search::CreateOptions {
                chunk_tokens: o.chunk_tokens,
                ..Default::default()
            },
        )?;
        let n = corpus.len();
        let started = Instant::now();
        let tokens = ingest(&col, corpus)?;
        let secs = started.elapsed().as_secs_f64();
        let results = eval::evaluate(&col, &queries, &qrels)?;
        if o.json {
            let modes: Value = results
                .iter()
                .map(|r| {
                    (
                        r.name.to_string(),
                        json!({"ndcg@10": r.scores.ndcg10, "recall@100": r.scores.recall100, "mrr@10": r.scores.mrr10, "queries": r.queries, "p50_ms": r.p50_ms}),
                    )
                })
                .collect::<serde_json::Map<_, _>>()
                .into();
            println!(
                "{}",
                json!({"documents": n, "chunks": col.chunks(), "index_seconds": secs, "tokens": tokens, "modes": modes})
            );
        } else {
            println!(
                "{n} documents, {} chunks, indexed in {secs:.1} s ({:.0} tokens/s); {} judged queries\n",
                col.chunks(),
                tokens as f64 / secs.max(1e-9),
                results.first().map_or(0, |r| r.queries)
            );
            println!(
                "{:<16} {:>8} {:>11} {:>7} {:>10}",
                "mode", "nDCG@10", "Recall@100", "MRR@10", "p50 ms"
            );
            for r in &results {
                println!(
                    "{:<16} {:>8.4} {:>11.4} {:>7.4} {:>10.1}",
                    r.name, r.scores.ndcg10, r.scores.recall100, r.scores.mrr10, r.p50_ms
                );
            }
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&dir);
    result
}

/// Upserts in batches with a progress bar; returns the tokens embedded.
fn ingest(col: &Collection, docs: Vec<DocInput>) -> anyhow::Result<usize> {
    let progress = bar(docs.len() as u64, "documents");
    let mut tokens = 0;
    let mut docs = docs.into_iter().peekable();
    while docs.peek().is_some() {
        let batch: Vec<DocInput> = docs.by_ref().take(64).collect();
        let n = batch.len() as u64;
        tokens += col.upsert(batch)?.tokens;
        progress.inc(n);
    }
    progress.finish_and_clear();
    Ok(tokens)
}
