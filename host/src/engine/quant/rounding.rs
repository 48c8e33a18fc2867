//! Activation rows rounded to integers block by block, each block with its own scale: what the
//! k-quant kernels (`k_kernels.rs`) and the 32-element formats' prompt kernels (`lanes/q32.rs`)
//! multiply, and how finely they are rounded (`ActivationBits`, `Rounding`).

use super::aligned::Aligned;
use super::PromptPrecision;
use crate::engine::team::{split, split_mut, Team};

/// Elements a thread of the team rounds at least: waking the team costs more than rounding a
/// few thousand elements (a batch of eight 576-wide rows) on one thread.
pub(super) const ROUND_PER_THREAD: usize = 16 * 1024;

/// The `m` rows of `x` (`[m][k]`) rounded to i16 block by block, rows split across the team:
/// `block(x, q, sums)` rounds one block of `B` elements (a row's last may be shorter) into
/// `q`, writes its `S` float sums and returns its scale. Returns the rounded rows, the scales
/// (`[m][blocks]`, `k / B` rounded up) and the sums (`[m][blocks][S]`).
pub(super) fn round_rows<const B: usize, const S: usize>(
    team: &Team,
    x: &[f32],
    m: usize,
    k: usize,
    block: impl Fn(&[f32], &mut [i16], &mut [f32]) -> f32 + Sync,
) -> (Aligned<i16, 32>, Vec<f32>, Vec<f32>) {
    assert!(x.len() == m * k);
    let nb = k.div_ceil(B);
    let mut q = Aligned::zeroed(m * k);
    let mut scale = vec![0f32; m * nb];
    let mut sums = vec![0f32; m * nb * S];
    let parts = team.threads().min(m).min(1 + m * k / ROUND_PER_THREAD);
    let ranges: Vec<_> = (0..parts).map(|p| split(m, 1, p, parts)).collect();
    let qs = split_mut(q.as_mut_slice(), ranges.iter().map(|r| r.len() * k));
    let ss = split_mut(&mut scale, ranges.iter().map(|r| r.len() * nb));
    let us = split_mut(&mut sums, ranges.iter().map(|r| r.len() * nb * S));
    let job = |p: usize, _: usize| {
        let Some(range) = ranges.get(p) else { return };
        let mut q = qs[p].lock().unwrap_or_else(|e| e.into_inner());
        let mut s = ss[p].lock().unwrap_or_else(|e| e.into_inner());
        let mut u = us[p].lock().unwrap_or_else(|e| e.into_inner());
        // (`max(1)`: rows of no elements have no blocks to round.)
        let rows = x[range.start * k..range.end * k].chunks_exact(k.max(1));
        let outs = q
            .chunks_exact_mut(k.max(1))
            .zip(u.chunks_exact_mut((nb * S).max(1)));
        for ((xr, (qr, ur)), sr) in rows.zip(outs).zip(s.chunks_exact_mut(nb.max(1))) {
            let outs = qr.chunks_mut(B).zip(ur.chunks_exact_mut(S));
            for ((xb, (qb, ub)), sb) in xr.chunks(B).zip(outs).zip(sr.iter_mut()) {
                *sb = block(xb, qb, ub);
            }
        }
    };
    // A single row (decode) is rounded here rather than waking the team for it.
    if parts > 1 {
        team.run(&job);
    } else {
        job(0, 1);
    }
    (q, scale, sums)
}

/// The largest magnitude in `x`, or `None` when a value is not finite. Magnitudes compare as
/// their bit patterns (a NaN's or infinity's are above every finite one's), and an integer
/// maximum may be taken in any order, so the loop vectorises and gives what a sequential float
/// fold gives (that fold was a chain of dependent compares).
fn finite_amax(x: &[f32]) -> Option<f32> {
    let top = x
        .iter()
        .fold(0u32, |a, &v| a.max(v.to_bits() & 0x7FFF_FFFF));
    (top < f32::INFINITY.to_bits()).then(|| f32::from_bits(top))
}

/// 1.5·2²³: a float of magnitude under 2²² plus this is rounded to an integer, ties to even (the
/// default rounding), which sits in the sum's low mantissa bits. Unlike `round_ties_even`
/// and a saturating cast, it vectorises.
const ROUND: f32 = 12_582_912.0;

/// Rounds one block to integers of magnitude up to `max` (ties to even); returns its scale.
pub(super) fn quantize_block(x: &[f32], q: &mut [i16], max: f32) -> f32 {
    let Some(amax) = finite_amax(x) else {
        // A NaN or infinity rounds to nothing in i16: the scale carries it, so the block's
        // products are NaN as unrounded arithmetic's would be.
        q.fill(0);
        return f32::NAN;
    };
    if amax <= 0.0 {
        q.fill(0);
        return 0.0;
    }
    let inv = max / amax;
    if !inv.is_finite() {
        // A block below about 10⁻³⁴: the saturating cast keeps the largest values at ±max.
        for (q, &v) in q.iter_mut().zip(x) {
            *q = (v * inv).round_ties_even() as i16;
        }
        return amax / max;
    }
    // |v · inv| ≤ max·(1 + 2⁻²³) < 2²², so the sum rounds as `round_ties_even` would.
    for (q, &v) in q.iter_mut().zip(x) {
        *q = ((v * inv + ROUND).to_bits() as i32 - ROUND.to_bits() as i32) as i16;
    }
    amax / max
}

/// How finely the batch kernels (decode, drafts, small batches) round activations before they
/// meet k-quant weights (Q4_K, Q5_K, Q6_K), and on AVX2 the 32-element formats too: 16 bits
/// per 256 elements there (`q32_avx2`), or 8 bits per 32 (`q32_bytes`, llama.cpp's `Q8_0`
/// rounding for these formats). Prompt rows take `PromptPrecision`; Q4_0, Q5_0, Q8_0 and Q4_1
/// batch rows on AVX-512 take 16 bits whatever this says, and Q5_1 there floats.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ActivationBits {
    /// 16-bit integers per 256-element block: greedy output equals the dense-f32 reference's
    /// on every real-model prompt of `tests/float_reference.rs`.
    #[default]
    Sixteen,
    /// 8 bits for every format: `8-all`. On AVX2 Q8_0 rows take bytes too, and a Q8_0 output
    /// layer (SmolLM2's and Gemma 3's tied embeddings) then costs the most precision for the
    /// least speed: Q8_0's own rounding is finer than the activations' there, and its 16-bit
    /// kernel already reads at 80% of the memory rate. SmolLM2 answers "What is the capital of
    /// France?" with a list of French words instead of Paris (as llama.cpp does), and its mean
    /// KL divergence from f32 rises from 1.9e-3 to 2.7e-3 (llama.cpp 2.76e-3), Gemma 3's from
    /// 3.3e-3 to 3.95e-3 (llama.cpp 3.64e-3).
    Eight,
    /// 8 bits for every format but Q8_0: `8`, and `auto` on AVX2. The k-quants are rounded as
    /// llama.cpp's Q8_K per 256 elements, and on AVX2 Q4_0, Q4_1, Q5_0 and Q5_1 as its Q8_0
    /// per 32 (`q32_bytes`: each weight byte multiplied once instead of widened and multiplied
    /// twice; SmolLM2's decode 1.35x faster on a Zen 3). Their KL divergence from f32 is below
    /// llama.cpp's on the same file (SmolLM2 1.9e-3 against 2.76e-3, Gemma 3 3.3e-3 against
    /// 3.64e-3; README, "Precision"). Q8_0 rows keep 16 bits (`Eight` says why).
    EightButQ8_0,
    /// 8 bits for the k-quants, 16 for the 32-element formats: prompt rows at `prompt_precision`
    /// `auto` and `int8` where there are no AVX-512 prompt kernels (`prompt_bytes`; on AVX2
    /// the 32-element formats take their own prompt kernel, `q32_prompt`, at 16 bits per 32).
    /// A prompt step is bound by arithmetic, and the finer rounding stays in the KV cache for
    /// every token after: with its prompt rows in bytes too, SmolLM2 no longer answered "What
    /// is the capital of France?" with Paris, and prefilled no faster with the batch kernels.
    EightKQuants,
}

/// Whether this build's batch kernels are AVX2's byte kernels (AVX2 without AVX-512BW): the
/// k-quants' (`k_kernels::avx2`), where 16-bit rows cost twice the byte products of 8-bit ones
/// (`ActivationBits::auto`), and the 32-element formats' `q32_bytes`.
pub(super) const AVX2_BYTES: bool = cfg!(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    not(target_feature = "avx512bw")
));

impl ActivationBits {
    /// How many bits a block is rounded to.
    pub fn bits(self) -> u8 {
        match self {
            ActivationBits::Sixteen => 16,
            ActivationBits::Eight | ActivationBits::EightButQ8_0 | ActivationBits::EightKQuants => {
                8
            }
        }
    }

    /// How a model's batch kernels are set, for a bench's header.
    pub fn describe(self) -> &'static str {
        match self {
            ActivationBits::Sixteen => "16-bit decode activations",
            ActivationBits::Eight if AVX2_BYTES => "8-bit decode activations for every format",
            ActivationBits::EightButQ8_0 if AVX2_BYTES => "8-bit decode activations (16 for Q8_0)",
            ActivationBits::Eight | ActivationBits::EightButQ8_0 | ActivationBits::EightKQuants => {
                "8-bit decode activations for k-quants (16 for Q4_0-Q8_0)"
            }
        }
    }

    /// Whether rows of the 32-element `format` meet bytes at these bits (`q32_bytes`, built on
    /// AVX2 without AVX-512BW); else 16-bit or float activations.
    #[cfg(not(all(target_arch = "x86_64", target_feature = "avx512bw")))]
    pub(super) fn q32_bytes(self, format: super::Format) -> bool {
        AVX2_BYTES
            && !format.is_k()
            && match self {
                ActivationBits::Eight => true,
                ActivationBits::EightButQ8_0 => format != super::Format::Q8_0,
                ActivationBits::Sixteen | ActivationBits::EightKQuants => false,
            }
    }

    /// The largest magnitude a block is rounded to.
    pub(super) fn max(self) -> f32 {
        match self {
            ActivationBits::Sixteen => 32767.0,
            ActivationBits::Eight | ActivationBits::EightButQ8_0 | ActivationBits::EightKQuants => {
                127.0
            }
        }
    }
}

/// How a model's kernels round: the batch kernels' activations and the prompt rows'.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rounding {
    pub decode: ActivationBits,
    pub prompt: PromptPrecision,
}

/// Batch kernels at `bits`, prompt rows in 16-bit integers.
impl From<ActivationBits> for Rounding {
    fn from(decode: ActivationBits) -> Self {
        Rounding {
            decode,
            prompt: PromptPrecision::Int16,
        }
    }
}
