//! Our quantized matmul kernels on real weights: every format the Qwen2.5 and Gemma 3 Q4_K_M
//! files use (Q4_K, Q6_K, Q5_0, Q8_0), whole matrices through the engine's kernels, checked row
//! by row against an f64 dot product over candle's dequantization of the same rows.

use candle_core::quantized::gguf_file;
use candle_core::Device;
use gateway::engine::quant::{format_of, Format, QuantMatrix};
use gateway::engine::team::Team;

fn check(file: &str, tensors: &[&str]) {
    let path = format!("{}/../models/{file}", env!("CARGO_MANIFEST_DIR"));
    let mut f = std::fs::File::open(&path)
        .unwrap_or_else(|e| panic!("{path}: {e} (run host/scripts/fetch-real-models.sh)"));
    let c = gguf_file::Content::read(&mut f).unwrap();
    let team = Team::new(2);
    for name in tensors {
        let t = c.tensor(&mut f, name, &Device::Cpu).unwrap();
        let format = format_of(t.dtype()).unwrap();
        let qm = QuantMatrix::from_qtensor(&t).unwrap();
        let deq: Vec<f32> = t
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let (n, k) = (qm.rows(), qm.cols());
        for m in [1, 3, 8] {
            // Hidden-state-like activations: mostly small, a few large outliers.
            let x: Vec<f32> = (0..m * k)
                .map(|i| match i % 211 {
                    0 => 9.0,
                    _ => (((i * 7919) % 1009) as f32 / 1009.0 - 0.5) * 0.8,
                })
                .collect();
            let mut out = vec![0f32; m * n];
            qm.matmul(&team, &x, m, &mut out);
            for r in (0..n).step_by((n / 97).max(1)) {
                let w = &deq[r * k..(r + 1) * k];
                for i in 0..m {
                    let xr = &x[i * k..(i + 1) * k];
                    let want: f64 = xr.iter().zip(w).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let mass: f64 = xr
                        .iter()
                        .zip(w)
                        .map(|(&a, &b)| (a as f64 * b as f64).abs())
                        .sum();
                    // k-quants round activations to 16 bits per 256 (≤ amax/65534 each), and
                    // so do Q4_0, Q5_0, Q8_0 and Q4_1 on AVX-512 (`quant::q32_batch`,
                    // `q4_1_batch`); on AVX2 every format rounds to 16 bits per 256
                    // (`quant::q32_avx2`), within the same bound.
                    let l1: f64 = w.iter().map(|v| v.abs() as f64).sum();
                    let avx2 = cfg!(all(
                        target_arch = "x86_64",
                        target_feature = "avx2",
                        target_feature = "fma",
                        not(target_feature = "avx512bw")
                    ));
                    let q16 = avx2
                        || matches!(
                            format,
                            Format::Q4_0 | Format::Q5_0 | Format::Q8_0 | Format::Q4_1
                        ) && cfg!(all(
                            target_arch = "x86_64",
                            target_feature = "avx512bw",
                            target_feature = "avx512vl"
                        ));
                    let tol = 1e-5 * mass
                        + if format.is_k() || q16 {
                            9.0 / 65534.0 * l1
                        } else {
                            0.0
                        }
                        + 1e-5;
                    let got = out[i * n + r] as f64;
                    assert!(
                        (got - want).abs() <= tol,
                        "{file} {name} ({format:?}) m={m} row {r}: {got} vs {want} (tol {tol})"
                    );
                }
            }
        }
    }
}

#[test]
fn qwen2_5_q4_k_m_tensors() {
    check(
        "Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
        &[
            "blk.0.attn_q.weight",
            "blk.0.attn_v.weight",
            "blk.0.ffn_down.weight",
            "output.weight",
        ],
    );
}

#[test]
fn gemma3_q4_k_m_tensors() {
    check(
        "gemma-3-270m.Q4_K_M.gguf",
        &[
            "blk.0.attn_q.weight",
            "blk.0.attn_v.weight",
            "blk.0.ffn_down.weight",
            "blk.5.attn_output.weight",
            "token_embd.weight",
        ],
    );
}
