//! `gateway bench`: engine throughput on one model, without HTTP, printed as a table.
//! Prefix caching is off so every prompt is really prefilled.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{ComputeDevice, ModelConfig};
use crate::engine::profile::{Phase, Snapshot};
use crate::engine::quant::ActivationBits;
use crate::engine::{Engine, Event, GenerationRequest, SamplingParams};
use crate::metrics::Metrics;

pub mod kl;
mod structured;

#[derive(Debug, Clone, clap::Args)]
pub struct BenchOptions {
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 256)]
    pub prompt_tokens: usize,
    /// Tokens generated per request in the decode measurements.
    #[arg(long, default_value_t = 128)]
    pub gen_tokens: usize,
    /// Concurrency levels for the aggregate-throughput rows.
    #[arg(long, value_delimiter = ',', default_value = "1,4,8")]
    pub concurrency: Vec<usize>,
    /// Repetitions of each measurement; the median is reported.
    #[arg(long, default_value_t = 3)]
    pub repeat: usize,
    /// Sequences in the KV-utilisation run (prompts spread over 64..1024 tokens).
    #[arg(long, default_value_t = 16)]
    pub kv_seqs: usize,
    /// Print only the prefill and single-stream decode rows (for rounds alternated with
    /// another engine, so both see the machine in the same state).
    #[arg(long)]
    pub single_stream_only: bool,
}

const TEXT: &str = "The quarterly report shows that customer satisfaction improved across all regions, \
    driven by faster support response times and a simpler onboarding flow. Sales teams closed more \
    renewals than forecast, while churn in the small-business segment fell for the third quarter in a row. ";

fn prompt(engine: &Engine, tokens: usize, salt: usize) -> Vec<u32> {
    let text = format!("Request {salt}. {}", TEXT.repeat(tokens / 40 + 2));
    let mut ids = engine.encode(&text, true).expect("bench prompt encodes");
    ids.truncate(tokens);
    ids
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerationRequest {
    GenerationRequest {
        prompt,
        sampling: SamplingParams {
            temperature: 0.0,
            ..Default::default()
        },
        max_tokens,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: true,
        cache_salt: 0,
        weight: 1,
        // The throughput rows measure plain decoding; `speculation_rows` compares both.
        speculative: false,
        constraint: None,
        processor: None,
    }
}

struct Run {
    first: Duration,
    last: Duration,
    tokens: usize,
}

async fn run_one(engine: &Engine, req: GenerationRequest, t0: Instant) -> Run {
    run_ids(engine, req, t0).await.1
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

pub async fn run(cfg: &ModelConfig, o: &BenchOptions) -> anyhow::Result<()> {
    let mut cfg = cfg.clone();
    cfg.engine.prefix_caching = false;
    cfg.engine.max_num_seqs = cfg
        .engine
        .max_num_seqs
        .max(o.concurrency.iter().copied().max().unwrap_or(1));
    let metrics = Arc::new(Metrics::new());
    let engine = Arc::new(Engine::start(&cfg, metrics.clone())?);
    let device = match cfg.engine.device {
        ComputeDevice::Cpu => format!(
            "cpu, {} threads, {}",
            std::thread::available_parallelism().map_or(1, |n| n.get()),
            ActivationBits::configured(cfg.engine.decode_activation_bits).describe()
        ),
        d => format!("{d}, {:?}", cfg.engine.dtype).to_lowercase(),
    };
    println!("model {} ({}), {device}", cfg.name, cfg.path.display());
    let idle_rss = rss_mib();
    // Warm-up: first-touch of weights and KV pages.
    run_one(&engine, request(prompt(&engine, 32, 0), 8), Instant::now()).await;

    let mut salt = 1;
    let decode1 = single_stream_rows(&engine, o, &mut salt).await;
    if o.single_stream_only {
        return Ok(());
    }
    if let Some(mib) = idle_rss {
        println!("| process RSS after loading, idle | {mib:.0} MiB |");
    }
    for &c in &o.concurrency {
        let mut agg = Vec::new();
        let before = engine.profile();
        for _ in 0..o.repeat {
            let reqs = (0..c)
                .map(|i| request(prompt(&engine, 16 + 9 * i, salt + i), o.gen_tokens))
                .collect();
            salt += c;
            let r = run_batch(&engine, &metrics, &cfg.name, reqs).await?;
            agg.push(r.tokens as f64 / r.wall);
        }
        let a = median(agg);
        println!(
            "| aggregate output, concurrency {c} | {a:.1} tok/s ({:.2}x single stream) |",
            a / decode1
        );
        breakdown_row(
            &format!("concurrency {c}"),
            &engine.profile().since(&before),
        );
    }
    speculation_rows(&engine, &metrics, &cfg.name, o, &mut salt).await;
    structured::rows(&engine, &metrics, &cfg.name, o).await?;
    kv_row(&engine, &metrics, &cfg.name, o.kv_seqs, salt).await
}

/// Where the steps of a concurrency row spent their time, per step (prefill steps included:
/// each request's prompt is short beside its output).
fn breakdown_row(what: &str, p: &Snapshot) {
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "| step breakdown, {what}: {:.2} rows/step | {:.2} ms/step: schedule {:.3}, weight products {:.2}, attention {:.2}, vocabulary product {:.2}, rest of forward {:.2}, sample+emit {:.3} |",
        p.rows as f64 / p.steps.max(1) as f64,
        ms(p.per_step(Phase::Schedule) + p.per_step(Phase::Forward) + p.per_step(Phase::Sample)),
        ms(p.per_step(Phase::Schedule)),
        ms(p.per_step(Phase::Projections)),
        ms(p.per_step(Phase::Attention)),
        ms(p.per_step(Phase::LmHead)),
        ms(p.other_forward()),
        ms(p.per_step(Phase::Sample)),
    );
}

/// Prefill and single-stream decode rates (medians of `repeat` runs), printed as the table's
/// first rows; returns the decode rate, which the concurrency rows compare against.
async fn single_stream_rows(engine: &Engine, o: &BenchOptions, salt: &mut usize) -> f64 {
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut prefill_steps = Snapshot::default();
    for _ in 0..o.repeat {
        let t0 = Instant::now();
        let before = engine.profile();
        let r = run_one(
            engine,
            request(prompt(engine, o.prompt_tokens, *salt), 1),
            t0,
        )
        .await;
        prefill_steps = engine.profile().since(&before);
        *salt += 1;
        prefill.push(o.prompt_tokens as f64 / r.first.as_secs_f64());
        let t0 = Instant::now();
        let r = run_one(engine, request(prompt(engine, 16, *salt), o.gen_tokens), t0).await;
        *salt += 1;
        decode.push((r.tokens - 1) as f64 / (r.last - r.first).as_secs_f64());
    }
    let decode1 = median(decode);
    println!();
    println!("| measurement | value |");
    println!("|---|---|");
    println!(
        "| prefill, {} prompt tokens | {:.1} tok/s |",
        o.prompt_tokens,
        median(prefill)
    );
    breakdown_row("prefill (last run)", &prefill_steps);
    println!("| decode, single stream | {decode1:.1} tok/s |");
    decode1
}

/// KV waste is the unfilled tail of each sequence's last block, so it is measured on `seqs`
/// prompts of realistic, mixed lengths (`--kv-seqs 0`: not measured, no row).
async fn kv_row(
    engine: &Arc<Engine>,
    metrics: &Arc<Metrics>,
    model: &str,
    seqs: usize,
    salt: usize,
) -> anyhow::Result<()> {
    if seqs == 0 {
        return Ok(());
    }
    let lens: Vec<usize> = (0..seqs).map(|i| 64 + i * 960 / seqs.max(1)).collect();
    let reqs = lens
        .iter()
        .enumerate()
        .map(|(i, &l)| request(prompt(engine, l, salt + i), 32))
        .collect();
    let r = run_batch(engine, metrics, model, reqs).await?;
    let mean = r.utilisation.iter().sum::<f64>() / r.utilisation.len().max(1) as f64;
    println!(
        "| KV utilisation, {} sequences, prompts {}-{} tokens + 32 generated (mean of {} samples) | {:.1}% (waste {:.1}%) |",
        seqs,
        lens.first().copied().unwrap_or(0),
        lens.last().copied().unwrap_or(0),
        r.utilisation.len(),
        100.0 * mean,
        100.0 * (1.0 - mean)
    );
    Ok(())
}

/// A CRM export an extraction request copies from.
fn contacts() -> String {
    let names = [
        "Ada Park",
        "Bo Chen",
        "Cruz Ortiz",
        "Dee Novak",
        "Eli Haddad",
        "Fay Moreau",
    ];
    let mut text = String::from("Account notes, week 48.\n");
    for (i, n) in names.iter().cycle().take(18).enumerate() {
        let user = n.to_lowercase().replace(' ', ".");
        text += &format!(
            "- {n} (ticket #{}) wrote from {user}{i}@example-{}.com about renewal terms.\n",
            4100 + i * 7,
            ["corp", "retail", "labs"][i % 3]
        );
    }
    text + "\nEvery email address in the notes above, one per line:\n"
}

/// Greedy generation with prompt-lookup speculation off, then on: tokens/s of each, whether
/// the outputs are identical, and the share of drafts accepted.
async fn speculation_rows(
    engine: &Arc<Engine>,
    metrics: &Arc<Metrics>,
    name: &str,
    o: &BenchOptions,
    salt: &mut usize,
) {
    let extraction = engine
        .encode(&contacts(), true)
        .expect("bench prompt encodes");
    let workloads = [
        ("extraction (answer copies the prompt)", extraction),
        ("free text (little to copy)", prompt(engine, 16, *salt)),
    ];
    *salt += 1;
    let counter = |c: &prometheus::IntCounterVec| c.with_label_values(&[name]).get();
    for (label, p) in workloads {
        let mut rates = [Vec::new(), Vec::new()];
        let mut outputs = [Vec::new(), Vec::new()];
        let (d0, a0) = (
            counter(&metrics.spec_draft_tokens),
            counter(&metrics.spec_accepted_tokens),
        );
        for _ in 0..o.repeat {
            for (k, spec) in [false, true].into_iter().enumerate() {
                let mut req = request(p.clone(), o.gen_tokens);
                req.speculative = spec;
                let t0 = Instant::now();
                let (ids, r) = run_ids(engine, req, t0).await;
                rates[k].push((r.tokens - 1) as f64 / (r.last - r.first).as_secs_f64());
                outputs[k] = ids;
            }
        }
        let drafted = counter(&metrics.spec_draft_tokens) - d0;
        let accepted = counter(&metrics.spec_accepted_tokens) - a0;
        let [off, on] = rates.map(median);
        println!(
            "| speculation, {label}: off / on | {off:.1} / {on:.1} tok/s ({:.2}x), {accepted} of {drafted} drafts accepted, outputs {} |",
            on / off,
            if outputs[0] == outputs[1] { "identical" } else { "DIFFER" }
        );
    }
}

/// One request to its end: the generated token ids, and when the first and last arrived.
async fn run_ids(engine: &Engine, req: GenerationRequest, t0: Instant) -> (Vec<u32>, Run) {
    let mut s = engine.submit(req).expect("bench queue has room");
    let (mut ids, mut first, mut last) = (Vec::new(), None, Duration::ZERO);
    while let Some(ev) = s.recv().await {
        match ev {
            Event::Token { id, .. } => {
                ids.push(id);
                last = t0.elapsed();
                first.get_or_insert(last);
            }
            Event::Done(..) => break,
            Event::Failed(m) => panic!("bench request failed: {m}"),
        }
    }
    let tokens = ids.len();
    let first = first.unwrap_or_default();
    (
        ids,
        Run {
            first,
            last,
            tokens,
        },
    )
}

/// Resident memory of this process (Linux), in MiB.
fn rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kb / 1024.0)
}

struct Batch {
    tokens: usize,
    wall: f64,
    /// KV utilisation sampled every 10 ms while sequences ran.
    utilisation: Vec<f64>,
}

/// Runs all requests at once.
async fn run_batch(
    engine: &Arc<Engine>,
    metrics: &Arc<Metrics>,
    name: &str,
    reqs: Vec<GenerationRequest>,
) -> anyhow::Result<Batch> {
    let t0 = Instant::now();
    let handles: Vec<_> = reqs
        .into_iter()
        .map(|r| {
            let engine = engine.clone();
            tokio::spawn(async move { run_one(&engine, r, t0).await })
        })
        .collect();
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (m, name, done) = (metrics.clone(), name.to_string(), done.clone());
        tokio::spawn(async move {
            let mut v = Vec::new();
            while !done.load(Ordering::Relaxed) {
                if m.running_seqs.with_label_values(&[&name]).get() > 0 {
                    v.push(m.kv_utilisation.with_label_values(&[&name]).get());
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            v
        })
    };
    let mut tokens = 0;
    for h in handles {
        tokens += h.await?.tokens;
    }
    let wall = t0.elapsed().as_secs_f64();
    done.store(true, Ordering::Relaxed);
    Ok(Batch {
        tokens,
        wall,
        utilisation: sampler.await?,
    })
}
