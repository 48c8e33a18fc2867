//! Decode's one-row kernels per weight format, beside this machine's streaming read rate in the
//! same run: how fast each kernel multiplies when its weights sit in L2 (its compute ceiling,
//! one thread), and how fast it reads them from DRAM on every thread, as decode does.
//!
//! Single-stream decode reads every weight once per token, so a format's DRAM figure against
//! the streaming read rate says how much of the memory bandwidth decode gets, and the L2 figure
//! says whether the arithmetic or the memory holds it back.
//!
//! `cargo bench --bench kernels [-- ROUNDS] [PART...]` (default 9 rounds, medians; every part
//! unless some are named: a format (`Q4_K`, `Q6_K`, …), `calls`, `prompt`, `step`, which also
//! times SmolLM2's step for batches of generated rows, or `batch`, SmolLM2's batches without
//! the rest of `step`, `qwen-batch` Qwen2.5's). Weights are random blocks with small, finite
//! scales: the kernels' speed does not depend on the values.

use std::time::Instant;

use gateway::config::DecodeBits;
use gateway::engine::quant::{
    ActivationBits, Bytes, Format, PromptPrecision, QuantMatrix, Rounding,
};
use gateway::engine::team::{split, Team};

/// Columns of every matrix (Qwen2.5-1.5B's hidden size).
const COLS: usize = 1536;
/// Bytes of weights that stay in L2 (2 MiB on Zen 4 and most server cores since).
const L2_BYTES: usize = 768 << 10;
/// Bytes of weights streamed from DRAM per round: well past any L3.
const DRAM_BYTES: usize = 384 << 20;

#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

/// 64 random bits, the state's high bits folded into its weak low ones.
fn next(rng: &mut Rng) -> u64 {
    let s = rng.step();
    s ^ (s >> 29)
}

fn fill(rng: &mut Rng, out: &mut [u8]) {
    for chunk in out.chunks_mut(8) {
        chunk.copy_from_slice(&next(rng).to_le_bytes()[..chunk.len()]);
    }
}

/// Byte offsets of a block's f16 scales (`d`, and `dmin` or `m` where the format has one).
fn f16_offsets(format: Format) -> &'static [usize] {
    match format {
        Format::Q4_0 | Format::Q5_0 | Format::Q8_0 => &[0],
        Format::Q4_1 | Format::Q5_1 | Format::Q4K | Format::Q5K => &[0, 2],
        Format::Q6K => &[208],
    }
}

/// Random blocks of `format`, `bytes` of them at most, in a `[rows, COLS]` matrix.
fn matrix(format: Format, bytes: usize, rng: &mut Rng) -> QuantMatrix {
    let row_bytes = COLS / format.block_elems() * format.block_bytes();
    shaped(format, (bytes / row_bytes).max(1), COLS, rng)
}

/// Random blocks of `format` in a `[rows, cols]` matrix.
fn shaped(format: Format, rows: usize, cols: usize, rng: &mut Rng) -> QuantMatrix {
    let row_bytes = cols / format.block_elems() * format.block_bytes();
    let mut data = vec![0u8; rows * row_bytes];
    fill(rng, &mut data);
    // About 2⁻¹⁰: finite scales, so no NaN or infinity takes a slow path.
    let small = half::f16::from_f32(1.0 / 1024.0).to_le_bytes();
    for block in data.chunks_exact_mut(format.block_bytes()) {
        for &at in f16_offsets(format) {
            block[at..at + 2].copy_from_slice(&small);
        }
    }
    QuantMatrix::new(format, rows, cols, Bytes::Owned(data)).expect("whole blocks")
}

fn bytes_of(m: &QuantMatrix) -> usize {
    let f = m.formats()[0];
    m.rows() * m.cols() / f.block_elems() * f.block_bytes()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// GB/s of one activation row through `mats`, each `reps` times, median of `rounds`, at the
/// activation bits decode takes by default here.
fn rate(team: &Team, mats: &[QuantMatrix], reps: usize, rounds: usize) -> f64 {
    let bits = ActivationBits::configured(DecodeBits::Auto);
    rate_as(team, mats, reps, rounds, Row::Decode(bits))
}

/// The kernels one row takes.
#[derive(Clone, Copy)]
enum Row {
    /// A generated token's, at these activation bits.
    Decode(ActivationBits),
    /// A prompt token's (a fully cached prompt's last row, recomputed for its logits).
    Prompt(PromptPrecision),
}

/// `rate` for one row of kind `row`.
fn rate_as(team: &Team, mats: &[QuantMatrix], reps: usize, rounds: usize, row: Row) -> f64 {
    let widest = mats.iter().map(QuantMatrix::cols).max().unwrap_or(0);
    let x: Vec<f32> = (0..widest)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let most = mats.iter().map(QuantMatrix::rows).max().unwrap_or(0);
    let mut out = vec![0f32; most];
    let bytes: usize = mats.iter().map(bytes_of).sum::<usize>() * reps;
    let runs = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..reps {
                for m in mats {
                    let (x, out) = (&x[..m.cols()], &mut out[..m.rows()]);
                    match row {
                        Row::Decode(bits) => m.matmul_rows(team, x, &[false], bits, out),
                        Row::Prompt(prompt) => {
                            let decode = ActivationBits::Sixteen;
                            m.matmul_rows(team, x, &[true], Rounding { decode, prompt }, out)
                        }
                    }
                }
            }
            bytes as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    median(runs)
}

/// GB/s of plain 64-bit reads over `buf`, split across the team, median of `rounds`.
fn stream_read(team: &Team, buf: &[u64], rounds: usize) -> f64 {
    let runs = (0..rounds)
        .map(|_| {
            let t = Instant::now();
            team.run(&|p, parts| {
                let part = &buf[split(buf.len(), 4096, p, parts)];
                // Wrapping adds reassociate, so this vectorises and keeps up with the loads.
                std::hint::black_box(part.iter().fold(0u64, |a, &v| a.wrapping_add(v)));
            });
            std::mem::size_of_val(buf) as f64 / t.elapsed().as_secs_f64() / 1e9
        })
        .collect();
    median(runs)
}

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let rounds: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(9);
    let named: Vec<&str> = args
        .iter()
        .map(String::as_str)
        .filter(|a| a.parse::<usize>().is_err())
        .collect();
    let wanted = |name: &str| named.is_empty() || named.contains(&name);
    let (one, all) = (Team::new(1), Team::new(0));
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
    let buf: Vec<u64> = (0..DRAM_BYTES / 8).map(|_| next(&mut rng)).collect();
    let roof = stream_read(&all, &buf, rounds);
    drop(buf);
    println!(
        "one activation row (decode; {}, the default here) through {COLS}-column matrices, \
         medians of {rounds} rounds",
        ActivationBits::configured(DecodeBits::Auto).describe()
    );
    println!(
        "streaming read, {} threads: {roof:.1} GB/s\n",
        all.threads()
    );
    println!(
        "| format | L2-resident, 1 thread (GB/s) | DRAM, {} threads (GB/s) | DRAM / streaming read |",
        all.threads()
    );
    println!("|---|---:|---:|---:|");
    let formats = [
        ("Q4_K", Format::Q4K),
        ("Q5_K", Format::Q5K),
        ("Q6_K", Format::Q6K),
        ("Q8_0", Format::Q8_0),
        ("Q5_0", Format::Q5_0),
        ("Q4_0", Format::Q4_0),
        ("Q4_1", Format::Q4_1),
        ("Q5_1", Format::Q5_1),
    ];
    for (name, format) in formats.into_iter().filter(|(name, _)| wanted(name)) {
        let small = [matrix(format, L2_BYTES, &mut rng)];
        let cached = rate(&one, &small, 64, rounds);
        // Eight matrices of 48 MiB: each is read once per round, as decode reads a model.
        let big: Vec<_> = (0..8)
            .map(|_| matrix(format, DRAM_BYTES / 8, &mut rng))
            .collect();
        let dram = rate(&all, &big, 1, rounds);
        println!(
            "| {name} | {cached:.1} | {dram:.1} | {:.0}% |",
            100.0 * dram / roof
        );
    }
    if wanted("calls") {
        calls(&one, &mut rng, rounds);
    }
    if wanted("prompt") {
        prompt_rows(&all, &mut rng, rounds.min(5));
    }
    if wanted("batch") && !wanted("step") {
        batch_rows("SmolLM2-135M", &all, &smollm2_step(&mut rng), rounds);
        return;
    }
    if !wanted("step") && !wanted("qwen-batch") {
        return;
    }
    // A decode step's matrices in Qwen2.5-1.5B's shapes (Q4_K; its output matrix Q6_K): the
    // calls are smaller than above, so what each one costs beyond its weights shows here.
    let mut step = Vec::new();
    for _ in 0..28 {
        for (rows, cols) in [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)] {
            step.push(shaped(Format::Q4K, rows, cols, &mut rng));
        }
    }
    step.push(shaped(Format::Q6K, 151_936, 1536, &mut rng));
    if wanted("qwen-batch") {
        batch_rows("Qwen2.5-1.5B", &all, &step[..step.len() - 1], rounds);
        return;
    }
    step_rows("Qwen2.5-1.5B", &all, &step, rounds);
    batch_rows("Qwen2.5-1.5B", &all, &step[..step.len() - 1], rounds);
    let step = smollm2_step(&mut rng);
    step_rows("SmolLM2-135M", &all, &step, rounds);
    batch_rows("SmolLM2-135M", &all, &step, rounds);
    // The layers only: the vocabulary product takes just the rows that want logits.
    mixed_rows("SmolLM2-135M", &all, &step[..step.len() - 1], rounds);
}

/// SmolLM2-135M's step matrices (Q4_1; its output matrix is the Q8_0 embedding table).
fn smollm2_step(rng: &mut Rng) -> Vec<QuantMatrix> {
    let mut step = Vec::new();
    for _ in 0..30 {
        for (rows, cols) in [(960, 576), (576, 576), (3072, 576), (576, 1536)] {
            step.push(shaped(Format::Q4_1, rows, cols, rng));
        }
    }
    step.push(shaped(Format::Q8_0, 49_152, 576, rng));
    step
}

/// A model-shaped step's layer matrices for a prompt chunk beside generated rows (a prefill
/// joining running decodes, or a prompt's last rows, which take the batch kernels): the mixed
/// step against the two kinds' steps run one after the other.
fn mixed_rows(name: &str, team: &Team, step: &[QuantMatrix], rounds: usize) {
    println!("\n{name}-shaped step, prompt rows (default kernels) beside generated rows:");
    println!("| prompt + generated rows | mixed step (ms) | the two apart (ms) | apart / mixed |");
    println!("|---|---:|---:|---:|");
    let widest = step.iter().map(QuantMatrix::cols).max().unwrap_or(0);
    let most = step.iter().map(QuantMatrix::rows).max().unwrap_or(0);
    for (p, g) in [(1, 1), (64, 1), (64, 8), (256, 4)] {
        let m = p + g;
        let x: Vec<f32> = (0..m * widest)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let mut out = vec![0f32; m * most];
        let mut time = |rows: std::ops::Range<usize>, prompt: &[bool]| {
            let t = Instant::now();
            for w in step {
                let x = &x[rows.start * w.cols()..rows.end * w.cols()];
                let out = &mut out[..rows.len() * w.rows()];
                let rounding = Rounding {
                    decode: ActivationBits::configured(DecodeBits::Auto),
                    prompt: PromptPrecision::Auto,
                };
                w.matmul_rows(team, x, prompt, rounding, out);
            }
            t.elapsed().as_secs_f64() * 1e3
        };
        let kinds: Vec<bool> = (0..m).map(|i| i < p).collect();
        let (mut mixed, mut apart) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            mixed.push(time(0..m, &kinds));
            apart.push(time(0..p, &kinds[..p]) + time(p..m, &kinds[p..]));
        }
        let (mixed, apart) = (median(mixed), median(apart));
        println!(
            "| {p} + {g} | {mixed:.2} | {apart:.2} | {:.2}x |",
            apart / mixed
        );
    }
}

/// A model-shaped step's matrices for 1–8 generated rows at once (continuous batching's decode
/// step): what one weight pass for the whole batch costs against one row's.
fn batch_rows(name: &str, team: &Team, step: &[QuantMatrix], rounds: usize) {
    let auto = ActivationBits::configured(DecodeBits::Auto);
    for bits in [ActivationBits::Sixteen, ActivationBits::EightButQ8_0] {
        let default = if bits == auto {
            ", the default here"
        } else {
            ""
        };
        println!(
            "\n{name}-shaped step, generated rows ({}{default}), batch of m:",
            bits.describe()
        );
        batch_rows_at(team, step, rounds, bits);
    }
}

/// `batch_rows` at one rounding.
fn batch_rows_at(team: &Team, step: &[QuantMatrix], rounds: usize, bits: ActivationBits) {
    println!("| m | ms per step | ms per row | rows/s against m = 1 |");
    println!("|---:|---:|---:|---:|");
    let mut one = 0.0;
    for m in [1, 2, 3, 4, 5, 6, 8] {
        let widest = step.iter().map(QuantMatrix::cols).max().unwrap_or(0);
        let x: Vec<f32> = (0..m * widest)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        let most = step.iter().map(QuantMatrix::rows).max().unwrap_or(0);
        let mut out = vec![0f32; m * most];
        let prompt = vec![false; m];
        let runs = (0..rounds)
            .map(|_| {
                let t = Instant::now();
                for w in step {
                    let (x, out) = (&x[..m * w.cols()], &mut out[..m * w.rows()]);
                    w.matmul_rows(team, x, &prompt, bits, out);
                }
                t.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        let ms = median(runs);
        if m == 1 {
            one = ms;
        }
        println!(
            "| {m} | {ms:.2} | {:.2} | {:.2}x |",
            ms / m as f64,
            one * m as f64 / ms
        );
    }
}

/// A model-shaped step's matrices for one generated row (16 bits, the default, `8-all`) and for
/// one prompt row (what recomputing a fully cached prompt's last token costs).
fn step_rows(name: &str, team: &Team, step: &[QuantMatrix], rounds: usize) {
    let gb = step.iter().map(bytes_of).sum::<usize>() as f64 / 1e9;
    println!(
        "\n{name}-shaped step ({} matrices, {gb:.3} GB), one row:",
        step.len()
    );
    for (label, row) in [
        ("generated, 16-bit", Row::Decode(ActivationBits::Sixteen)),
        (
            "generated, default (`auto` here)",
            Row::Decode(ActivationBits::configured(DecodeBits::Auto)),
        ),
        (
            "generated, 8-bit (`8-all`)",
            Row::Decode(ActivationBits::Eight),
        ),
        (
            "prompt (cached prompt's last row), 16-bit integer",
            Row::Prompt(PromptPrecision::Int16),
        ),
        (
            "prompt (cached prompt's last row), default (BF16 tiles with AMX, else 8-bit)",
            Row::Prompt(PromptPrecision::Auto),
        ),
    ] {
        let rate = rate_as(team, step, 1, rounds, row);
        println!("| {label} | {rate:.1} GB/s | {:.2} ms |", gb / rate * 1e3);
    }
}

/// What a call costs beyond its multiplies: a 64-row Q4_K matrix in L1/L2, one thread, so the
/// activation row's rounding and the call's set-up weigh against little arithmetic.
fn calls(one: &Team, rng: &mut Rng, rounds: usize) {
    println!("\n| 64 × k Q4_K, one thread | µs per call | weights / call time |");
    println!("|---|---:|---:|");
    for cols in [1536, 8960] {
        let m = [shaped(Format::Q4K, 64, cols, rng)];
        let gbs = rate(one, &m, 2000, rounds);
        let us = bytes_of(&m[0]) as f64 / gbs / 1e3;
        println!("| k = {cols} | {us:.1} | {gbs:.1} GB/s |");
    }
}

/// Prompt rows through a Qwen2.5-1.5B-shaped layer (all Q4_K, then all Q6_K), in the 16- and
/// 8-bit integer prompt kernels and on BF16 AMX tiles where this CPU has them: a prefill's
/// rows (512), a short prompt's or a prefix-cache hit's tail (64, 8) and a fully cached
/// prompt's last row (1).
fn prompt_rows(team: &Team, rng: &mut Rng, rounds: usize) {
    const QWEN: [(usize, usize); 4] = [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)];
    const SMOLLM2: [(usize, usize); 4] = [(960, 576), (576, 576), (3072, 576), (576, 1536)];
    for (format, model, shapes) in [
        (Format::Q4K, "Qwen2.5-1.5B", QWEN),
        (Format::Q6K, "Qwen2.5-1.5B", QWEN),
        (Format::Q4_1, "SmolLM2-135M", SMOLLM2),
        (Format::Q5_0, "SmolLM2-135M", SMOLLM2),
    ] {
        let layer: Vec<_> = shapes
            .into_iter()
            .map(|(rows, cols)| shaped(format, rows, cols, rng))
            .collect();
        println!("\nprompt rows through a {model}-shaped layer ({format:?}), ms per layer:");
        println!("| rows | 16-bit integer | 8-bit integer | BF16 tiles | 8-bit speed-up |");
        println!("|---:|---:|---:|---:|---:|");
        for m in [512, 64, 8, 1] {
            let time = |prompt: PromptPrecision| {
                let rounding = Rounding {
                    decode: ActivationBits::Sixteen,
                    prompt,
                };
                let mut bufs: Vec<_> = layer
                    .iter()
                    .map(|w| {
                        let x = (0..m * w.cols()).map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0);
                        (x.collect::<Vec<f32>>(), vec![0f32; m * w.rows()])
                    })
                    .collect();
                let prompt = vec![true; m];
                let runs = (0..rounds)
                    .map(|_| {
                        let t = Instant::now();
                        for (w, (x, out)) in layer.iter().zip(&mut bufs) {
                            w.matmul_rows(team, x, &prompt, rounding, out);
                        }
                        t.elapsed().as_secs_f64() * 1e3
                    })
                    .collect();
                median(runs)
            };
            let [int16, int8, tiles] = [
                PromptPrecision::Int16,
                PromptPrecision::Int8,
                PromptPrecision::Auto,
            ]
            .map(time);
            println!(
                "| {m} | {int16:.2} | {int8:.2} | {tiles:.2} | {:.2}x |",
                int16 / int8
            );
        }
    }
}
