use super::super::tests::{quantize, reference, weights};
use super::super::{amx, ActivationBits, PromptPrecision, QuantMatrix, Rounding};
use crate::engine::team::Team;
use candle_core::quantized::GgmlDType;

/// All three k-quants in a stack whose units straddle the segments (81 rows: two whole units
/// and a partial one).
#[test]
fn tiles_are_bf16_products_and_batch_invariant() {
    check(
        512,
        &[
            (GgmlDType::Q4K, 40),
            (GgmlDType::Q6K, 17),
            (GgmlDType::Q5K, 24),
        ],
    );
}

/// Every 32-element format over rows of 7 blocks (not a multiple of 256, as the 0.5B Qwen's
/// 896-wide matrices): 99 rows, units straddling five segments; then two of them stacked with
/// a k-quant (a Q4_K_M file's mix where widths allow k-quants).
#[test]
fn tiles_take_the_32_element_formats() {
    check(
        224,
        &[
            (GgmlDType::Q4_0, 19),
            (GgmlDType::Q4_1, 21),
            (GgmlDType::Q5_0, 13),
            (GgmlDType::Q5_1, 30),
            (GgmlDType::Q8_0, 16),
        ],
    );
    check(
        512,
        &[
            (GgmlDType::Q5_0, 40),
            (GgmlDType::Q4K, 17),
            (GgmlDType::Q8_0, 24),
        ],
    );
}

/// The stack of `parts` (format, rows) over `k` columns on the tiles, against an f64 product
/// of the dequantized weights within what rounding both operands to BF16 allows; and a row's
/// bits the same in a step of any size, alone, and beside generated rows.
fn check(k: usize, parts_of: &[(GgmlDType, usize)]) {
    if !amx::available() {
        eprintln!("SKIPPED: this CPU or OS gives no AMX-BF16 tiles");
        return;
    }
    let team = Team::new(2);
    let mut deq = Vec::new();
    let mut parts = Vec::new();
    for (i, &(dtype, n)) in parts_of.iter().enumerate() {
        let (q, d) = quantize(&weights(n, k, 20 + i), n, k, dtype);
        deq.extend(d);
        parts.push(QuantMatrix::from_qtensor(&q).unwrap());
    }
    let s = QuantMatrix::stack(parts).unwrap();
    let (n, m) = (s.rows(), 37);
    assert!(s.tiles_fit());
    // Magnitudes over four decades, as activations with outliers have.
    let x: Vec<f32> = (0..m * k)
        .map(|i| ((i * 13 % 31) as f32 - 15.0) * 10f32.powi((i % 5) as i32 - 2))
        .collect();
    let tiles = Rounding {
        decode: ActivationBits::Sixteen,
        prompt: PromptPrecision::Auto,
    };
    let run = |rows: std::ops::Range<usize>, prompt: &[bool]| {
        let mut out = vec![0f32; rows.len() * n];
        s.matmul_rows(
            &team,
            &x[rows.start * k..rows.end * k],
            prompt,
            tiles,
            &mut out,
        );
        out
    };
    let all = run(0..m, &[true; 37]);
    let want = reference(&x, &deq, m, n, k);
    let (mut err2, mut mass2) = (0f64, 0f64);
    for (i, (&g, &w)) in all.iter().zip(&want).enumerate() {
        let (row, col) = (i / n, i % n);
        let mass: f64 = (0..k)
            .map(|c| (x[row * k + c] as f64 * deq[col * k + c] as f64).abs())
            .sum();
        // Each product of two BF16 roundings is within 2⁻⁸ of itself.
        assert!(
            (g as f64 - w).abs() <= mass / 128.0 + 1e-6,
            "#{i}: {g} vs {w}"
        );
        (err2, mass2) = (err2 + (g as f64 - w).powi(2), mass2 + mass * mass);
    }
    // Rounding errors of opposite signs mostly cancel: far inside the bound on the whole.
    let typical = (err2 / mass2).sqrt();
    assert!(typical < 1e-3, "rms error / rms mass {typical}");
    for rows in [1, 2, 15, 16, 17, 32, 33] {
        assert_eq!(
            run(0..rows, &vec![true; rows]),
            all[..rows * n],
            "{rows} rows"
        );
    }
    assert_eq!(run(20..21, &[true]), all[20 * n..21 * n], "row 20 alone");
    let mixed = run(19..23, &[false, true, false, true]);
    assert_eq!(
        mixed[n..2 * n],
        all[20 * n..21 * n],
        "row 20 beside generated rows"
    );
    assert_eq!(
        mixed[3 * n..],
        all[22 * n..23 * n],
        "row 22 beside generated rows"
    );
    // The generated rows (the batch kernels, on each weight unit as the tiles take it): as
    // they are alone, also when there are more than a group of them.
    for (j, i) in [(0, 19), (2, 21)] {
        let alone = run(i..i + 1, &[false]);
        assert_eq!(
            mixed[j * n..(j + 1) * n],
            alone,
            "generated row {i} beside prompt rows"
        );
    }
    let many: Vec<bool> = (0..13).map(|i| i % 6 == 5).collect();
    let out = run(0..13, &many);
    for (i, &prompt) in many.iter().enumerate() {
        let want = match prompt {
            true => all[i * n..(i + 1) * n].to_vec(),
            false => run(i..i + 1, &[false]),
        };
        assert_eq!(
            out[i * n..(i + 1) * n],
            want,
            "row {i} of eleven generated, two prompt"
        );
    }
    // A NaN spoils its own row only.
    let mut bad = x[..3 * k].to_vec();
    bad[k + 7] = f32::NAN;
    let mut out = vec![0f32; 3 * n];
    s.matmul_rows(&team, &bad, &[true; 3], tiles, &mut out);
    assert!(out[n..2 * n].iter().all(|v| v.is_nan()));
    assert_eq!(out[..n], all[..n]);
    assert_eq!(out[2 * n..], all[2 * n..3 * n]);
}
