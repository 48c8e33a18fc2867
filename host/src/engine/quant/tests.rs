use super::k_kernels::KActs;
use super::*;
use candle_core::{Device, Tensor};
use ActivationBits::{Eight, EightButQ8_0, EightKQuants, Sixteen};

const ALL: [GgmlDType; 8] = [
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// Weights with varied magnitudes per row and per sub-block, so scales and mins all differ.
pub(super) fn weights(n: usize, k: usize, seed: usize) -> Vec<f32> {
    (0..n * k)
        .map(|i| {
            let (r, c) = (i / k, i % k);
            let wave = ((i * 7919 + seed * 104_729) % 1013) as f32 / 1013.0 - 0.45;
            wave * (0.05 + 0.02 * (r % 5) as f32) * (1.0 + (c / 32 % 3) as f32)
        })
        .collect()
}

pub(super) fn quantize(w: &[f32], n: usize, k: usize, dtype: GgmlDType) -> (QTensor, Vec<f32>) {
    let dev = Device::Cpu;
    let t = Tensor::from_vec(w.to_vec(), (n, k), &dev).unwrap();
    let q = QTensor::quantize(&t, dtype).unwrap();
    let deq = q.dequantize(&dev).unwrap().flatten_all().unwrap();
    (q, deq.to_vec1().unwrap())
}

/// `x · wᵀ` in f64 over the dequantized weights: the float reference.
pub(super) fn reference(x: &[f32], deq: &[f32], m: usize, n: usize, k: usize) -> Vec<f64> {
    let mut out = vec![0f64; m * n];
    for i in 0..m {
        for r in 0..n {
            out[i * n + r] = (0..k)
                .map(|c| x[i * k + c] as f64 * deq[r * k + c] as f64)
                .sum();
        }
    }
    out
}

/// Tolerance for one output: f32 kernels are exact to rounding; the k-quant kernels, and the
/// prompt kernels of every format, round activations per block to integers up to `rounded`
/// (error ≤ amax / (2·rounded) per element).
pub(super) fn tolerance(rounded: Option<f64>, x: &[f32], deq_row: &[f32]) -> f64 {
    let mass: f64 = x
        .iter()
        .zip(deq_row)
        .map(|(&a, &b)| (a as f64 * b as f64).abs())
        .sum();
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
    let l1: f64 = deq_row.iter().map(|v| v.abs() as f64).sum();
    match rounded {
        Some(max) => 1e-5 * mass + amax / (2.0 * max) * l1 + 1e-4,
        None => 1e-5 * mass + 1e-4,
    }
}

/// candle's quantizer writes the GGML block layouts; its dequantizer is the reference.
#[test]
fn dequantize_rows_match_candle_bit_for_bit() {
    let (n, k) = (7, 512);
    for dtype in ALL {
        let (q, deq) = quantize(&weights(n, k, 1), n, k, dtype);
        let qm = QuantMatrix::from_qtensor(&q).unwrap();
        let mut row = vec![0f32; k];
        for r in 0..n {
            qm.dequantize_row(r, &mut row);
            assert_eq!(row, deq[r * k..(r + 1) * k], "{dtype:?} row {r}");
        }
    }
}

#[test]
fn matmul_matches_the_dequantized_float_reference_for_every_format_and_batch() {
    let team = Team::new(2);
    for dtype in ALL {
        // 1664 columns is not a whole number of 256-element super-blocks (as Gemma 3's 640
        // are not), and is two of the prompt kernel's column chunks.
        let is_k = format_of(dtype).unwrap().is_k();
        let (n, k) = (37, if is_k { 512 } else { 1664 });
        let (q, deq) = quantize(&weights(n, k, 2), n, k, dtype);
        let qm = QuantMatrix::from_qtensor(&q).unwrap();
        for m in [1, 2, 3, 4, 5, 8, 9, 21, 40] {
            // Activations with outliers, as real hidden states have.
            let x: Vec<f32> = (0..m * k)
                .map(|i| match i % 97 {
                    0 => 6.5,
                    _ => ((i * 31 % 13) as f32 - 6.0) * 0.1,
                })
                .collect();
            let want = reference(&x, &deq, m, n, k);
            // Generated rows at both roundings, then prompt rows (their own kernels) at 16 and
            // 8 bits.
            let p8 = Rounding {
                decode: Sixteen,
                prompt: PromptPrecision::Int8,
            };
            for (prompt, rounding) in [
                (false, Sixteen.into()),
                (false, Eight.into()),
                (false, EightButQ8_0.into()),
                (false, EightKQuants.into()),
                (true, Sixteen.into()),
                (true, p8),
            ] {
                // NaN to start (here and below): the engine hands the kernels reused buffers
                // (`engine::buffers`), so every kernel must write every output.
                let mut out = vec![f32::NAN; m * n];
                qm.matmul_rows(&team, &x, &vec![prompt; m], rounding, &mut out);
                let bits = rounding.decode;
                // k-quant prompt rows round to 8 bits at `int8` on every build (the prompt
                // kernels on AVX-512, the batch kernels on 8-bit rows elsewhere), to 16 at
                // `int16`; the AVX-512 prompt kernels round the other formats to 16 bits too.
                // The batch kernels round k-quants to `bits`; Q4_0, Q5_0, Q8_0 and Q4_1 to 16
                // bits on AVX-512 (`q32_batch`, `q4_1_batch`); on AVX2 the 32-element formats to
                // 8 bits at `Eight` and, but Q8_0, at `EightButQ8_0` (`q32_bytes`), to 16
                // otherwise (`q32_avx2`); their prompt rows at `int8` to 16 bits per 32
                // (`q32_prompt`); the others get floats.
                let avx512 = cfg!(all(target_arch = "x86_64", target_feature = "avx512bw"));
                let avx2 = cfg!(all(
                    target_arch = "x86_64",
                    target_feature = "avx2",
                    target_feature = "fma",
                    not(target_feature = "avx512bw")
                ));
                let q16 = avx2
                    || matches!(
                        dtype,
                        GgmlDType::Q4_0 | GgmlDType::Q5_0 | GgmlDType::Q8_0 | GgmlDType::Q4_1
                    ) && cfg!(all(
                        target_arch = "x86_64",
                        target_feature = "avx512bw",
                        target_feature = "avx512vl"
                    ));
                let bytes = avx2
                    && !prompt
                    && match bits {
                        Eight => true,
                        EightButQ8_0 => dtype != GgmlDType::Q8_0,
                        Sixteen | EightKQuants => false,
                    };
                let rounded = match (prompt, is_k, bits) {
                    (true, true, _) if rounding == p8 => Some(127.0),
                    (true, true, _) | (false, true, Sixteen) => Some(32767.0),
                    (false, true, Eight | EightButQ8_0 | EightKQuants) => Some(127.0),
                    (true, false, _) if avx512 => Some(32767.0),
                    (_, false, _) if bytes => Some(127.0),
                    (_, false, _) if q16 => Some(32767.0),
                    (_, false, _) => None,
                };
                for i in 0..m {
                    for r in 0..n {
                        let deq_row = &deq[r * k..(r + 1) * k];
                        let tol = tolerance(rounded, &x[i * k..(i + 1) * k], deq_row);
                        let got = out[i * n + r] as f64;
                        let want = want[i * n + r];
                        assert!(
                            (got - want).abs() <= tol,
                            "{dtype:?} m={m} prompt={prompt} {rounding:?} ({i},{r}): {got} vs {want} (tol {tol})"
                        );
                    }
                }
            }
        }
    }
}

/// The SIMD k-quant kernel and the portable one do the same integer sums.
#[test]
fn k_kernels_agree_with_the_scalar_dot() {
    let team = Team::new(1);
    let (n, k) = (9, 768);
    for dtype in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
        let (q, _) = quantize(&weights(n, k, 3), n, k, dtype);
        let qm = QuantMatrix::from_qtensor(&q).unwrap();
        let x: Vec<f32> = (0..3 * k)
            .map(|i| ((i * 17 % 29) as f32 - 14.0) * 0.03)
            .collect();
        for bits in [Sixteen, Eight] {
            let acts = KActs::new(&team, &x, 3, k, bits);
            let mut out = vec![0f32; 3 * n];
            qm.batch(&team, &x, 3, bits, &mut out);
            let seg = &qm.segments[0];
            for r in 0..n {
                let row = &seg.bytes()[r * seg.row_bytes()..(r + 1) * seg.row_bytes()];
                for i in 0..3 {
                    let want = k_kernels::dot_row(seg.format, row, &acts, i);
                    let got = out[i * n + r];
                    assert!(
                        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "{dtype:?} {bits:?} ({i},{r}): {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// The AVX2 kernel (what machines without AVX-512BW run), at 16 and 8 bits, does the scalar
/// sums too, and gives a row the same bits alone as in its group: a whole group of eight and
/// the short last one (rows are kept in groups, `RowBytes`).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[test]
fn avx2_k_kernel_agrees_with_the_scalar_dot_whatever_the_group() {
    let team = Team::new(1);
    // 2048 columns: two chunks (6 + 2 super-blocks) per row; 11 rows: groups of 8 and 3.
    let (n, k, m) = (9, 2048, 11);
    for dtype in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
        let (q, _) = quantize(&weights(n, k, 5), n, k, dtype);
        let qm = QuantMatrix::from_qtensor(&q).unwrap();
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 23 % 37) as f32 - 18.0) * 0.04)
            .collect();
        for bits in [Sixteen, Eight] {
            let acts = KActs::new(&team, &x, m, k, bits).with_row_bytes(bits);
            let seg = &qm.segments[0];
            let mut grouped = vec![0f32; n * m];
            for (i0, g) in [(0, 8), (8, 3)] {
                let mut out = vec![0f32; n * g];
                k_kernels::avx2::tile(seg, 0, n, &acts, i0, g, &mut out, Walk::Stream);
                for (r, o) in out.chunks_exact(g).enumerate() {
                    grouped[r * m + i0..r * m + i0 + g].copy_from_slice(o);
                }
            }
            for i in 0..m {
                let one = KActs::new(&team, &x[i * k..(i + 1) * k], 1, k, bits);
                let one = one.with_row_bytes(bits);
                let mut alone = vec![0f32; n];
                k_kernels::avx2::tile(seg, 0, n, &one, 0, 1, &mut alone, Walk::Stream);
                for r in 0..n {
                    let row = &seg.bytes()[r * seg.row_bytes()..(r + 1) * seg.row_bytes()];
                    let want = k_kernels::dot_row(seg.format, row, &acts, i);
                    let got = grouped[r * m + i];
                    assert!(
                        (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                        "{dtype:?} {bits:?} ({i},{r}): {got} vs {want}"
                    );
                    let alone = alone[r].to_bits();
                    assert_eq!(got.to_bits(), alone, "{dtype:?} {bits:?} ({i},{r})");
                }
            }
        }
    }
}

/// The AVX2 kernel of the 32-element formats (what machines without AVX-512BW run for every
/// row) is within 16-bit rounding of the float reference, and gives a row the same bits alone
/// as in a group.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
#[test]
fn avx2_q32_kernels_match_the_float_reference_whatever_the_group() {
    let team = Team::new(1);
    let (n, k, m) = (9, 576, 8);
    for dtype in &ALL[..5] {
        let (q, deq) = quantize(&weights(n, k, 7), n, k, *dtype);
        let qm = QuantMatrix::from_qtensor(&q).unwrap();
        let mut x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 29 % 41) as f32 - 20.0) * 0.05)
            .collect();
        // A block of zeros and a block of one tiny value: the scale's edge cases.
        x[k..k + 32].fill(0.0);
        x[2 * k + 32] = 1e-30;
        let want = reference(&x, &deq, m, n, k);
        let seg = &qm.segments[0];
        // The 16-bit kernel, then the 8-bit one (576 columns: a short last group of both).
        let a16 = q32_avx2::Acts32::new(&team, &x, m, k);
        let a8 = q32_bytes::Acts8::new(&team, &x, m, k);
        type Kernel<'a> = Box<dyn Fn((usize, usize), &mut [f32], bool) + 'a>;
        let kernels: [(f64, Kernel); 2] = [
            (
                32767.0,
                Box::new(|rows, d, stream| q32_avx2::tile(seg, (0, n), &a16, rows, d, stream)),
            ),
            (
                127.0,
                Box::new(|rows, d, stream| q32_bytes::tile(seg, (0, n), &a8, rows, d, stream)),
            ),
        ];
        for (max, tile) in &kernels {
            for g in [8, 3] {
                let mut group = vec![0f32; n * g];
                for i0 in (0..m).step_by(g) {
                    let g = g.min(m - i0);
                    tile((i0, g), &mut group[..n * g], i0 % 2 == 0);
                    for i in i0..i0 + g {
                        let mut alone = vec![0f32; n];
                        tile((i, 1), &mut alone, false);
                        for r in 0..n {
                            let got = group[r * g + i - i0];
                            let row = &deq[r * k..(r + 1) * k];
                            let tol = tolerance(Some(*max), &x[i * k..(i + 1) * k], row);
                            let w = want[i * n + r];
                            assert!(
                                (got as f64 - w).abs() <= tol,
                                "{dtype:?} at {max} ({i},{r}): {got} vs {w}"
                            );
                            assert_eq!(got.to_bits(), alone[r].to_bits(), "{dtype:?} ({i},{r})");
                        }
                    }
                }
            }
        }
    }
}

/// A batch row gets the same bits whatever else is in its group (the engine's invariant:
/// greedy output does not depend on the batch).
#[test]
fn a_row_result_does_not_depend_on_the_batch() {
    let team = Team::new(2);
    // 2048 columns: a k-quant group of eight takes the column-chunked loop, smaller ones the
    // row-by-row loop, and both must sum alike.
    let (n, k) = (40, 2048);
    for dtype in ALL {
        let (q, _) = quantize(&weights(n, k, 4), n, k, dtype);
        let qm = QuantMatrix::from_qtensor(&q).unwrap();
        let x: Vec<f32> = (0..40 * k)
            .map(|i| ((i * 13 % 31) as f32 - 15.0) * 0.05)
            .collect();
        for bits in [Sixteen, Eight] {
            let run = |rows: std::ops::Range<usize>| {
                let mut out = vec![f32::NAN; rows.len() * n];
                let x = &x[rows.start * k..rows.end * k];
                qm.batch(&team, x, rows.len(), bits, &mut out);
                out
            };
            let (first, later) = (run(0..1), run(33..34));
            // Up to a group (one pass), several groups, several prefill spans.
            for m in [2, 5, 8, 13, 40] {
                let out = run(0..m);
                assert_eq!(out[..n], first[..], "{dtype:?} {bits:?} batch {m}");
                if m > 33 {
                    assert_eq!(
                        out[33 * n..34 * n],
                        later[..],
                        "{dtype:?} {bits:?} batch {m}, row 33"
                    );
                }
            }
        }
    }
}

/// Prompt rows (their own kernels) are independent of their batch too, and generated rows
/// mixed in with them keep the bits they have alone.
#[test]
fn prompt_rows_do_not_depend_on_the_batch_nor_change_generated_rows() {
    let team = Team::new(2);
    // 40 rows of a 2048-wide matrix: tiles of two lane groups (the last one partial), two
    // column chunks, several groups per span. 72 prompt rows go through the lanes kernel;
    // up to 64 through `few` (k-quants) and one or two through `across` (every format), which
    // must give the same bits. At `int8` every k-quant prompt row takes `lanes8`.
    let (n, k) = (40, 2048);
    for (dtype, prompt) in ALL
        .into_iter()
        .flat_map(|d| [PromptPrecision::Int16, PromptPrecision::Int8].map(|p| (d, p)))
    {
        let (q, _) = quantize(&weights(n, k, 6), n, k, dtype);
        let qm = QuantMatrix::from_qtensor(&q).unwrap();
        let x: Vec<f32> = (0..72 * k)
            .map(|i| ((i * 11 % 29) as f32 - 14.0) * 0.05)
            .collect();
        let rounding = Rounding {
            decode: Sixteen,
            prompt,
        };
        let run = |rows: std::ops::Range<usize>, kinds: &[bool]| {
            let mut out = vec![f32::NAN; rows.len() * n];
            let x = &x[rows.start * k..rows.end * k];
            qm.matmul_rows(&team, x, kinds, rounding, &mut out);
            out
        };
        let all = run(0..72, &[true; 72]);
        // Row 33 second in a batch of eight, and row 0 in batches of 8 to 65.
        let tail = run(32..40, &[true; 8]);
        assert_eq!(
            tail[n..2 * n],
            all[33 * n..34 * n],
            "{dtype:?} {prompt:?} row 33"
        );
        // Alone, and a few beside generated rows (a prompt's last chunk joining decodes).
        assert_eq!(
            run(33..34, &[true]),
            all[33 * n..34 * n],
            "{dtype:?} {prompt:?} row 33 alone"
        );
        let few = run(32..36, &[false, true, true, false]);
        assert_eq!(
            few[n..2 * n],
            all[33 * n..34 * n],
            "{dtype:?} {prompt:?} row 33 of few"
        );
        for m in [1, 2, 3, 8, 13, 16, 17, 33, 48, 64, 65] {
            assert_eq!(
                run(0..m, &vec![true; m])[..n],
                all[..n],
                "{dtype:?} {prompt:?} batch {m}"
            );
        }
        // Prompt rows scattered among generated ones, and in one run between them (read in
        // place): every row as it is alone.
        let scattered: Vec<bool> = (0..40).map(|i| i % 3 != 0).collect();
        let run_of: Vec<bool> = (0..40).map(|i| (3..37).contains(&i)).collect();
        for mixed in [scattered, run_of] {
            let out = run(0..40, &mixed);
            for (i, &is_prompt) in mixed.iter().enumerate() {
                let want = match is_prompt {
                    true => all[i * n..(i + 1) * n].to_vec(),
                    false => run(i..i + 1, &[false]),
                };
                assert_eq!(
                    out[i * n..(i + 1) * n],
                    want[..],
                    "{dtype:?} {prompt:?} row {i}"
                );
            }
        }
    }
}

/// A NaN in an activation row spoils that row's outputs in every kernel, as unrounded f32
/// arithmetic would, rather than rounding to zero in the 16-bit ones; other rows stay finite.
#[test]
fn a_nan_activation_spoils_its_row_in_every_kernel() {
    let team = Team::new(2);
    let (n, k) = (20, 512);
    for dtype in ALL {
        let (q, _) = quantize(&weights(n, k, 7), n, k, dtype);
        let qm = QuantMatrix::from_qtensor(&q).unwrap();
        let p8 = Rounding {
            decode: Sixteen,
            prompt: PromptPrecision::Int8,
        };
        let cases = [
            (1, false, Sixteen.into()),
            (1, false, Eight.into()),
            (3, false, Sixteen.into()),
            (9, false, Eight.into()),
            (9, true, Sixteen.into()),
            (9, true, p8),
        ];
        for (m, prompt, bits) in cases {
            let mut x: Vec<f32> = (0..m * k).map(|i| (i % 7) as f32 * 0.1 - 0.3).collect();
            x[(m - 1) * k + 100] = f32::NAN;
            let mut out = vec![0f32; m * n];
            qm.matmul_rows(&team, &x, &vec![prompt; m], bits, &mut out);
            let (rest, last) = out.split_at((m - 1) * n);
            assert!(rest.iter().all(|v| v.is_finite()), "{dtype:?} m={m}");
            assert!(
                last.iter().all(|v| v.is_nan()),
                "{dtype:?} m={m} prompt={prompt}"
            );
        }
    }
}

#[test]
fn stacks_of_mixed_formats_multiply_as_one_matrix() {
    let team = Team::new(2);
    let k = 256;
    let parts = [
        (GgmlDType::Q4K, 19),
        (GgmlDType::Q6K, 7),
        (GgmlDType::Q8_0, 33),
    ];
    let mut deq_all = Vec::new();
    let mut mats = Vec::new();
    for (i, &(dtype, n)) in parts.iter().enumerate() {
        let (q, deq) = quantize(&weights(n, k, 10 + i), n, k, dtype);
        deq_all.extend(deq);
        mats.push(QuantMatrix::from_qtensor(&q).unwrap());
    }
    let s = QuantMatrix::stack(mats).unwrap();
    let n = s.rows();
    assert_eq!((n, s.cols()), (59, k));
    assert_eq!(s.formats(), vec![Format::Q4K, Format::Q6K, Format::Q8_0]);
    // Tiles straddle the segments (rows 0..32 are Q4_K and Q6_K, 32..64 Q6_K and Q8_0); nine
    // prompt rows go through the prompt kernels of all three formats, one or two through
    // `across`, the same pass handing each piece to its format's kernel. At `int8` the k-quant
    // pieces take `lanes8` and the Q8_0 piece its 16-bit kernel, in the same pass.
    let p8 = Rounding {
        decode: Sixteen,
        prompt: PromptPrecision::Int8,
    };
    let cases = [
        (1, false, Sixteen.into()),
        (3, false, Sixteen.into()),
        (9, true, Sixteen.into()),
        (1, true, Sixteen.into()),
        (2, true, Sixteen.into()),
        (9, true, p8),
        (2, true, p8),
    ];
    for (m, prompt, rounding) in cases {
        let x: Vec<f32> = (0..m * k)
            .map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.2)
            .collect();
        let mut out = vec![f32::NAN; m * n];
        s.matmul_rows(&team, &x, &vec![prompt; m], rounding, &mut out);
        let want = reference(&x, &deq_all, m, n, k);
        for (i, (&g, &w)) in out.iter().zip(&want).enumerate() {
            let (row, col) = (i / n, i % n);
            let tol = match rounding == p8 && col < 26 {
                // The k-quant rows, on activations rounded to 8 bits.
                true => tolerance(
                    Some(127.0),
                    &x[row * k..(row + 1) * k],
                    &deq_all[col * k..(col + 1) * k],
                ),
                false => 1e-3 * w.abs().max(1.0),
            };
            assert!((g as f64 - w).abs() < tol, "m={m} #{i}: {g} vs {w}");
        }
    }
    let mut row = vec![0f32; k];
    s.dequantize_row(30, &mut row);
    assert_eq!(row, deq_all[30 * k..31 * k]);
    let narrow = QuantMatrix::new(Format::Q8_0, 1, 32, Bytes::Owned(vec![0; 34])).unwrap();
    let wide = QuantMatrix::new(Format::Q8_0, 1, 64, Bytes::Owned(vec![0; 68])).unwrap();
    assert!(
        QuantMatrix::stack(vec![narrow, wide]).is_none(),
        "widths must agree"
    );
}

#[test]
fn shapes_that_are_not_whole_blocks_are_refused() {
    assert!(QuantMatrix::new(Format::Q4K, 1, 128, Bytes::Owned(vec![0; 72])).is_none());
    assert!(QuantMatrix::new(Format::Q8_0, 2, 32, Bytes::Owned(vec![0; 34])).is_none());
    assert!(QuantMatrix::new(Format::Q6K, 1, 256, Bytes::Owned(vec![0; 210])).is_some());
}

/// The vectorised rounding of activation blocks gives what the plain loops give, bit for bit:
/// the largest magnitude, the rounded values (ties to even), the scale and the sub-block sums,
/// on ordinary, tied, tiny, huge, zero and non-finite blocks.
#[test]
fn activation_blocks_round_as_the_plain_loops_do() {
    let plain = |x: &[f32], max: f32| -> (Vec<i16>, f32) {
        if !x.iter().all(|v| v.is_finite()) {
            return (vec![0; x.len()], f32::NAN);
        }
        let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        if amax <= 0.0 {
            return (vec![0; x.len()], 0.0);
        }
        let inv = max / amax;
        let q = x
            .iter()
            .map(|&v| (v * inv).round_ties_even() as i16)
            .collect();
        (q, amax / max)
    };
    let wave = |scale: f32| -> Vec<f32> {
        (0..256)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.45) * scale)
            .collect()
    };
    let mut blocks = vec![
        wave(1.0),
        wave(3.0e-3),
        wave(2.0e30),
        wave(1.0e-36),
        vec![0.0; 256],
        vec![-0.0; 256],
    ];
    // Ties: with a largest magnitude of 32767 against a max of 32767, `inv` is 1 and the
    // halves stay halves.
    blocks.push(
        (0..256)
            .map(|i| {
                if i == 0 {
                    32767.0
                } else {
                    i as f32 * 3.0 - 300.5
                }
            })
            .collect(),
    );
    let mut poisoned = wave(1.0);
    poisoned[77] = f32::NAN;
    blocks.push(poisoned);
    let mut infinite = wave(1.0);
    infinite[200] = f32::NEG_INFINITY;
    blocks.push(infinite);
    for (n, x) in blocks.iter().enumerate() {
        for max in [32767.0, 127.0] {
            let (want_q, want_scale) = plain(x, max);
            let mut q = vec![0i16; 256];
            let scale = rounding::quantize_block(x, &mut q, max);
            assert_eq!(q, want_q, "block {n}, max {max}");
            assert_eq!(
                scale.to_bits(),
                want_scale.to_bits(),
                "block {n}, max {max}"
            );
        }
        let (want_q, want_scale) = plain(x, 127.0);
        let mut u = [0f32; 16];
        k_kernels::sub_block_sums(&want_q, want_scale, &mut u);
        for j in 0..8 {
            let sum: i32 = want_q[32 * j..32 * j + 32]
                .iter()
                .map(|&v| i32::from(v))
                .sum();
            let want = sum as f32 * want_scale;
            assert_eq!(u[j].to_bits(), want.to_bits(), "block {n}, sub-block {j}");
        }
    }
}

/// The k-quant kernels multiply the weights by the activations rounded per 256-element block,
/// mins included: their results are the float products of the rounded rows, to float
/// rounding, at 8 bits as at 16 (outliers make the rounding coarse, so a half-rounded product
/// would stand out).
#[test]
fn k_quants_meet_the_rounded_activations_whole() {
    let team = Team::new(2);
    let (n, k) = (64, 1536);
    for dtype in [GgmlDType::Q4K, GgmlDType::Q5K, GgmlDType::Q6K] {
        let (q, deq) = quantize(&weights(n, k, 3), n, k, dtype);
        let qm = QuantMatrix::from_qtensor(&q).unwrap();
        for (m, bits, max) in [
            (1, Eight, 127.0),
            (3, Eight, 127.0),
            (12, Eight, 127.0),
            (1, Sixteen, 32767.0),
        ] {
            let x: Vec<f32> = (0..m * k)
                .map(|i| match i % 97 {
                    5 => 20.0,
                    _ => ((i * 13 % 31) as f32 - 15.0) * 0.07,
                })
                .collect();
            let mut rounded = x.clone();
            for b in rounded.chunks_mut(256) {
                let amax = b.iter().fold(0f32, |a, v| a.max(v.abs()));
                for v in b.iter_mut() {
                    *v = (*v * (max / amax)).round_ties_even() * (amax / max);
                }
            }
            let want = reference(&rounded, &deq, m, n, k);
            let mut out = vec![0f32; m * n];
            qm.matmul_rows(&team, &x, &vec![false; m], bits, &mut out);
            for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
                let tol = tolerance(
                    None,
                    &rounded[i / n * k..(i / n + 1) * k],
                    &deq[i % n * k..(i % n + 1) * k],
                );
                assert!(
                    (got as f64 - want).abs() <= tol,
                    "{dtype:?} m={m} {bits:?} #{i}: {got} vs {want}"
                );
            }
        }
    }
}
