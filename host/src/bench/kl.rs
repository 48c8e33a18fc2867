//! `gateway eval-kl`: how far a kernel setting's token distributions are from full precision,
//! measured as the field measures quantized inference (llama.cpp's `llama-perplexity
//! --kl-divergence`): perplexity, the KL divergence from the full-precision distribution (mean,
//! median, 99th percentile), and how often the most likely token is the same.
//!
//! The text is cut into chunks of `ctx` tokens, each run from an empty cache, and only the
//! second half of each chunk is scored, so every scored token has at least `ctx / 2` tokens
//! of context (llama.cpp's chunking, with the chunk's first token replaced by BOS where the
//! model adds one). The reference is the same GGUF with every projection dequantized to
//! dense f32 and multiplied in f32. Given a `--kl-divergence-base` file written by
//! `llama-perplexity` (from the same GGUF written out as F32 by `llama-quantize`), the tokens
//! and chunks come from that file and llama.cpp's own f32 log-probabilities become a second
//! reference: our f32 path is first checked against it, then every setting is measured against
//! both.

use std::io::Read;
use std::path::PathBuf;

use crate::engine::model::{BatchSeq, Model};
use crate::engine::paged_attention::KvCache;
use crate::engine::quant::{ActivationBits, PromptPrecision, Rounding};
use crate::engine::weights;
use anyhow::{bail, Context};

#[derive(Debug, Clone, clap::Args)]
pub struct KlOptions {
    /// The GGUF to measure.
    #[arg(short = 'm', long)]
    pub model: PathBuf,
    /// Plain text to score (tokenized by the model's own tokenizer).
    #[arg(long, required_unless_present = "llama_base")]
    pub text: Option<PathBuf>,
    /// A `llama-perplexity --kl-divergence-base` file: its tokens and chunk length are used,
    /// and its log-probabilities are a second full-precision reference.
    #[arg(long)]
    pub llama_base: Option<PathBuf>,
    /// Tokens per chunk (ignored with `--llama-base`, which records its own).
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// Score at most this many chunks.
    #[arg(long)]
    pub chunks: Option<usize>,
    /// Kernel settings to measure: `prompt` (the default prompt kernels, which prefill uses:
    /// BF16 AMX tiles where the CPU has them), `prompt16` and `prompt8` (the 16- and 8-bit
    /// integer prompt kernels, `--prompt-precision int16` / `int8`), `decode16`, `decode8` and
    /// `decode8-all` (the kernels of generated tokens at `--decode-activation-bits 16`, `8`, which
    /// rounds the activations of every format but Q8_0 to 8 bits, and `8-all`, an opt-in whose
    /// KL divergence is above llama.cpp's on Gemma 3, so not measured unless named).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "prompt,prompt16,prompt8,decode16,decode8"
    )]
    pub kernels: Vec<Setting>,
    /// Compute threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Print the results as one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Which kernels score the text.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Setting {
    Prompt,
    Prompt16,
    Prompt8,
    Decode16,
    Decode8,
    #[value(name = "decode8-all")]
    #[serde(rename = "decode8-all")]
    Decode8All,
}

impl Setting {
    /// Every row a prompt row (`prompt`, `prompt16`, `prompt8`) or a generated one, and the
    /// rounding.
    fn kernels(self) -> (bool, Rounding) {
        let rounding = |decode, prompt| Rounding { decode, prompt };
        match self {
            Setting::Prompt => (true, Rounding::default()),
            Setting::Prompt16 => (
                true,
                rounding(ActivationBits::Sixteen, PromptPrecision::Int16),
            ),
            Setting::Prompt8 => (
                true,
                rounding(ActivationBits::Sixteen, PromptPrecision::Int8),
            ),
            Setting::Decode16 => (false, ActivationBits::Sixteen.into()),
            Setting::Decode8 => (false, ActivationBits::EightButQ8_0.into()),
            Setting::Decode8All => (false, ActivationBits::Eight.into()),
        }
    }
}

/// Running sums for one distribution against one reference.
#[derive(Default)]
struct Tally {
    nll: f64,
    nll_ref: f64,
    kl: Vec<f32>,
    same_top: usize,
}

/// A tally's summary.
#[derive(Debug, serde::Serialize)]
pub struct Figures {
    pub tokens: usize,
    pub ppl: f64,
    pub ppl_reference: f64,
    pub kl_mean: f64,
    pub kl_median: f64,
    pub kl_p99: f64,
    pub kl_max: f64,
    pub top1_agreement: f64,
}

/// The results: each setting against our f32 path, and (with a llama.cpp base) our f32 path
/// and each setting against llama.cpp's.
#[derive(Debug, serde::Serialize)]
pub struct Report {
    pub model: String,
    pub ctx: usize,
    pub chunks: usize,
    pub f32_vs_llama_f32: Option<Figures>,
    pub settings: Vec<SettingReport>,
}

#[derive(Debug, serde::Serialize)]
pub struct SettingReport {
    pub setting: Setting,
    pub vs_f32: Figures,
    pub vs_llama_f32: Option<Figures>,
}

/// A reference distribution as natural-log probabilities over the vocabulary.
enum Reference<'a> {
    /// Logits and their log-sum-exp (`ln p_i = l_i − lse`), computed once per row for every
    /// setting measured against it.
    Logits { logits: &'a [f32], lse: f32 },
    /// llama.cpp's compression: `ln p_i = scale · q_i + min`, terms under −16 left out.
    Llama { scale: f32, min: f32, q: &'a [u16] },
}

impl Reference<'_> {
    fn log_prob(&self, i: usize) -> f32 {
        match self {
            Reference::Logits { logits, lse } => logits[i] - lse,
            Reference::Llama { scale, min, q } => scale * f32::from(q[i]) + min,
        }
    }
}

/// `max + ln Σ exp(l − max)` and the index of the max.
fn log_sum_exp(logits: &[f32]) -> (f32, usize) {
    let (best, max) =
        logits
            .iter()
            .copied()
            .enumerate()
            .fold(
                (0, f32::NEG_INFINITY),
                |a, (i, v)| if v > a.1 { (i, v) } else { a },
            );
    let sum: f64 = logits.iter().map(|&v| f64::from((v - max).exp())).sum();
    (max + sum.ln() as f32, best)
}

impl Tally {
    /// Scores one row: `logits` (the measured distribution) against `reference`, `next` the
    /// token that follows.
    fn add(&mut self, logits: &[f32], reference: &Reference, next: usize) {
        let (lse, top) = log_sum_exp(logits);
        let (mut kl, mut ref_top, mut ref_best) = (0f64, 0, f32::NEG_INFINITY);
        for (i, &l) in logits.iter().enumerate() {
            let lp_ref = reference.log_prob(i);
            if lp_ref > ref_best {
                (ref_best, ref_top) = (lp_ref, i);
            }
            if lp_ref > -16.0 {
                kl += f64::from(lp_ref.exp()) * f64::from(lp_ref - (l - lse));
            }
        }
        self.nll += f64::from(lse - logits[next]);
        self.nll_ref -= f64::from(reference.log_prob(next));
        self.kl.push(kl as f32);
        self.same_top += usize::from(top == ref_top);
    }

    fn figures(&self) -> Figures {
        let n = self.kl.len().max(1);
        let mut kl = self.kl.clone();
        kl.sort_by(f32::total_cmp);
        let at = |f: f64| kl.get(((kl.len().max(1) - 1) as f64 * f) as usize).copied();
        Figures {
            tokens: self.kl.len(),
            ppl: (self.nll / n as f64).exp(),
            ppl_reference: (self.nll_ref / n as f64).exp(),
            kl_mean: kl.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64,
            kl_median: at(0.5).unwrap_or(0.0).into(),
            kl_p99: at(0.99).unwrap_or(0.0).into(),
            kl_max: kl.last().copied().unwrap_or(0.0).into(),
            top1_agreement: self.same_top as f64 / n as f64,
        }
    }
}

/// A `--kl-divergence-base` file: header, tokens, then per chunk `ctx − 1 − ctx/2` rows of
/// `nv` u16 (two f32, scale and min, then the vocabulary).
struct LlamaBase {
    ctx: usize,
    vocab: usize,
    tokens: Vec<u32>,
    file: std::io::BufReader<std::fs::File>,
}

impl LlamaBase {
    fn open(path: &std::path::Path) -> anyhow::Result<Self> {
        let mut file = std::io::BufReader::new(
            std::fs::File::open(path).with_context(|| format!("opening {}", path.display()))?,
        );
        let mut head = [0u8; 20];
        file.read_exact(&mut head)?;
        if &head[..8] != b"_logits_" {
            bail!("{} is not a llama-perplexity logits file", path.display());
        }
        let word = |i: usize| u32::from_le_bytes(head[8 + 4 * i..12 + 4 * i].try_into().unwrap());
        let (ctx, vocab, chunks) = (word(0) as usize, word(1) as usize, word(2) as usize);
        // llama-perplexity does not check its writes: a disk that fills while it writes leaves
        // a short file and exit status 0, which must not pass for a shorter reference. Checked
        // before anything is allocated by the header's word.
        let rows = ctx.saturating_sub(1 + ctx / 2) as u128 * Self::row_len(vocab) as u128;
        let want = 20 + (ctx * chunks) as u128 * 4 + chunks as u128 * rows * 2;
        let have = file.get_ref().metadata()?.len() as u128;
        if ctx < 2 || have != want {
            bail!(
                "{} holds {have} bytes where its header ({chunks} chunks of {ctx} tokens over a \
                 vocabulary of {vocab}) needs {want}: truncated (was the disk full when it was \
                 written?)",
                path.display()
            );
        }
        let mut raw = vec![0u8; ctx * chunks * 4];
        file.read_exact(&mut raw)?;
        let tokens = raw
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        Ok(Self {
            ctx,
            vocab,
            tokens,
            file,
        })
    }

    /// u16 per row: 4 for the two floats, the vocabulary rounded up to even.
    fn row_len(vocab: usize) -> usize {
        2 * vocab.div_ceil(2) + 4
    }

    fn next_chunk(&mut self) -> anyhow::Result<Vec<u16>> {
        let n = (self.ctx - 1 - self.ctx / 2) * Self::row_len(self.vocab);
        let mut raw = vec![0u8; 2 * n];
        self.file.read_exact(&mut raw)?;
        Ok(raw
            .chunks_exact(2)
            .map(|b| u16::from_le_bytes([b[0], b[1]]))
            .collect())
    }
}

/// The logits of rows `ctx/2 ..= ctx − 2` of one chunk (each predicting the next token), run
/// from an empty cache; `prompt` sends every row through the prompt kernels.
fn chunk_logits(model: &Model, tokens: &[u32], prompt: bool) -> anyhow::Result<Vec<Vec<f32>>> {
    let (s, ctx) = (&model.shape, tokens.len());
    let blocks = ctx.div_ceil(16);
    let mut cache = KvCache::new(s.num_layers, blocks, 16, s.num_kv_heads, s.head_dim);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let first = ctx / 2;
    let seq = BatchSeq {
        block_table: &table,
        start: 0,
        tokens,
        want_logits: true,
        draft_rows: ctx - 1 - first,
        prompt_len: if prompt { ctx } else { 0 },
    };
    let mut rows = model.forward(&[seq], &mut cache)?;
    rows.pop(); // the last row predicts past the chunk
    Ok(rows)
}

/// Scores the text (or the llama.cpp base's tokens) with every setting.
pub fn run(o: &KlOptions) -> anyhow::Result<Report> {
    let loaded = weights::load(&o.model)?;
    let mut base = o.llama_base.as_deref().map(LlamaBase::open).transpose()?;
    let (ctx, mut tokens) = match (&base, &o.text) {
        (Some(b), _) => (b.ctx, b.tokens.clone()),
        (None, Some(path)) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let ids = loaded
                .tokenizer
                .encode(text, false)
                .map_err(|e| anyhow::anyhow!("tokenizing: {e}"))?
                .get_ids()
                .to_vec();
            (o.ctx, ids)
        }
        (None, None) => bail!("give --text or --llama-base"),
    };
    if ctx < 4 || tokens.len() < 2 * ctx {
        bail!(
            "need at least two chunks of {ctx} tokens, have {}",
            tokens.len()
        );
    }
    let chunks = (tokens.len() / ctx).min(o.chunks.unwrap_or(usize::MAX));
    tokens.truncate(chunks * ctx);
    if let Some(b) = &base {
        let vocab = loaded.model.shape.vocab_size;
        if b.vocab != vocab {
            bail!(
                "the llama.cpp base has {} tokens, the model {vocab}",
                b.vocab
            );
        }
    }
    let mut quant = loaded.model;
    quant.set_threads(o.threads);
    let mut reference = weights::load(&o.model)?.model.into_dense_f32()?;
    reference.set_threads(o.threads);
    let bos = loaded.add_bos.then_some(loaded.bos).flatten();

    let mut f32_vs_llama = Tally::default();
    let mut vs_f32: Vec<Tally> = o.kernels.iter().map(|_| Tally::default()).collect();
    let mut vs_llama: Vec<Tally> = o.kernels.iter().map(|_| Tally::default()).collect();
    for (c, chunk) in tokens.chunks_exact(ctx).enumerate() {
        let mut chunk = chunk.to_vec();
        if let Some(bos) = bos {
            chunk[0] = bos;
        }
        let next = &tokens[c * ctx + ctx / 2 + 1..(c + 1) * ctx];
        let llama = base.as_mut().map(LlamaBase::next_chunk).transpose()?;
        let row_len = base.as_ref().map_or(0, |b| LlamaBase::row_len(b.vocab));
        let llama_row = |r: usize| {
            llama.as_ref().map(|q| {
                let row = &q[r * row_len..(r + 1) * row_len];
                let word =
                    |i: usize| f32::from_bits(u32::from(row[i]) | u32::from(row[i + 1]) << 16);
                Reference::Llama {
                    scale: word(0),
                    min: word(2),
                    q: &row[4..],
                }
            })
        };
        let float = chunk_logits(&reference, &chunk, false)?;
        let float_lse: Vec<f32> = float.iter().map(|l| log_sum_exp(l).0).collect();
        for (r, logits) in float.iter().enumerate() {
            if let Some(l) = llama_row(r) {
                f32_vs_llama.add(logits, &l, next[r] as usize);
            }
        }
        for (i, setting) in o.kernels.iter().enumerate() {
            let (prompt, rounding) = setting.kernels();
            quant.set_activation_bits(rounding.decode);
            quant.set_prompt_precision(rounding.prompt);
            let rows = chunk_logits(&quant, &chunk, prompt)?;
            for (r, logits) in rows.iter().enumerate() {
                let f32_row = Reference::Logits {
                    logits: &float[r],
                    lse: float_lse[r],
                };
                vs_f32[i].add(logits, &f32_row, next[r] as usize);
                if let Some(l) = llama_row(r) {
                    vs_llama[i].add(logits, &l, next[r] as usize);
                }
            }
        }
        tracing::info!(chunk = c + 1, of = chunks, "scored");
    }
    let with_base = base.is_some();
    Ok(Report {
        model: o.model.display().to_string(),
        ctx,
        chunks,
        f32_vs_llama_f32: with_base.then(|| f32_vs_llama.figures()),
        settings: o
            .kernels
            .iter()
            .zip(vs_f32.iter().zip(&vs_llama))
            .map(|(&setting, (f, l))| SettingReport {
                setting,
                vs_f32: f.figures(),
                vs_llama_f32: with_base.then(|| l.figures()),
            })
            .collect(),
    })
}

/// The report as a markdown table.
pub fn print(r: &Report) {
    println!(
        "model {}: {} chunks of {} tokens, {} scored",
        r.model,
        r.chunks,
        r.ctx,
        r.chunks * (r.ctx - 1 - r.ctx / 2)
    );
    println!("| kernels | reference | PPL | PPL(ref) | mean KLD | median KLD | 99% KLD | max KLD | same top |");
    println!("|---|---|---|---|---|---|---|---|---|");
    let row = |name: &str, reference: &str, f: &Figures| {
        println!(
            "| {name} | {reference} | {:.4} | {:.4} | {:.3e} | {:.3e} | {:.3e} | {:.3e} | {:.3}% |",
            f.ppl,
            f.ppl_reference,
            f.kl_mean,
            f.kl_median,
            f.kl_p99,
            f.kl_max,
            100.0 * f.top1_agreement
        )
    };
    if let Some(f) = &r.f32_vs_llama_f32 {
        row("our f32", "llama.cpp f32", f);
    }
    for s in &r.settings {
        let name = clap::ValueEnum::to_possible_value(&s.setting)
            .map_or_else(String::new, |v| v.get_name().to_owned());
        row(&name, "our f32", &s.vs_f32);
        if let Some(f) = &s.vs_llama_f32 {
            row(&name, "llama.cpp f32", f);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::LlamaBase;

    /// A reference cut short (as a full disk leaves it) or lying in its header is refused before
    /// any chunk is read; a whole one opens.
    #[test]
    fn a_short_or_lying_reference_is_refused() {
        let path = std::env::temp_dir().join(format!("kl-base-{}", std::process::id()));
        let (ctx, vocab, chunks) = (8u32, 3u32, 2u32);
        let mut bytes = b"_logits_".to_vec();
        for w in [ctx, vocab, chunks] {
            bytes.extend(w.to_le_bytes());
        }
        bytes.extend(vec![0u8; (ctx * chunks * 4) as usize]);
        // rows 4..=6 of each chunk, 2·⌈3/2⌉ + 4 = 8 u16 each
        bytes.extend(vec![0u8; (chunks * 3 * 8 * 2) as usize]);
        std::fs::write(&path, &bytes).unwrap();
        let base = LlamaBase::open(&path).unwrap();
        assert_eq!(base.tokens.len(), 16);

        std::fs::write(&path, &bytes[..bytes.len() - 2]).unwrap();
        let err = LlamaBase::open(&path).err().unwrap().to_string();
        assert!(err.contains("truncated"), "{err}");

        bytes[16..20].copy_from_slice(&u32::MAX.to_le_bytes()); // chunks
        std::fs::write(&path, &bytes).unwrap();
        assert!(LlamaBase::open(&path).is_err());
        std::fs::remove_file(&path).unwrap();
    }
}
