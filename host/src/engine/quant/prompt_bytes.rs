//! Prompt rows where the AVX-512 prompt kernels are not built: at `prompt_precision` `auto` or
//! `int8` they take the batch kernels on activations rounded to 8 bits for the k-quants (on
//! AVX2 the byte kernel, `k_kernels::avx2::eight`) and, on AVX2, their own kernel for the
//! 32-element formats (`q32_prompt`); the generated rows of the step take the decode rounding.
//! Each kind goes through the kernels on its own rows, so a row's bits do not depend on what
//! shares its step.

use super::{step_rows, ActivationBits, PromptPrecision, QuantMatrix, Rounding};
use crate::engine::team::Team;

impl QuantMatrix {
    /// Whether `matmul_rows` splits this step's rows by kind: some are prompt rows, and some
    /// rows' kernel rounds them otherwise than the generated rows (k-quant rows at other bits;
    /// on AVX2 the 32-element formats' rows where only one kind takes bytes; their kernels
    /// elsewhere take the rows unrounded). At `int16` prompt rows take the generated rows'
    /// bits.
    pub(super) fn splits_prompt_rows(&self, prompt: &[bool], rounding: Rounding) -> bool {
        let decode = rounding.decode;
        let differs = |p: ActivationBits| {
            self.segments.iter().any(|s| match s.format.is_k() {
                true => p.bits() != decode.bits(),
                false => {
                    prompt_kernel(s.format) || p.q32_bytes(s.format) != decode.q32_bytes(s.format)
                }
            })
        };
        prompt.contains(&true) && prompt_bits(rounding.prompt).is_some_and(differs)
    }

    /// `matmul_rows` for such a step: prompt rows at `prompt_precision`'s bits, generated rows
    /// at `decode`, each kind on its own rows (`step_rows::on_rows`).
    pub(super) fn prompt_rows_bytes(
        &self,
        team: &Team,
        x: &[f32],
        prompt: &[bool],
        (prompt_precision, decode): (PromptPrecision, ActivationBits),
        out: &mut [f32],
    ) {
        let (m, n, k) = (prompt.len(), self.rows, self.cols);
        assert_eq!(x.len(), m * k, "activation shape");
        assert_eq!(out.len(), m * n, "output shape");
        let bits = prompt_bits(prompt_precision).expect("int16 prompt rows are not split");
        for (kind, bits) in [(true, bits), (false, decode)] {
            let rows: Vec<usize> = (0..m).filter(|&i| prompt[i] == kind).collect();
            if rows.is_empty() {
                continue;
            }
            step_rows::on_rows((x, k), (&mut *out, n), &rows, |xr, mr, or| {
                #[cfg(all(
                    target_arch = "x86_64",
                    target_feature = "avx2",
                    target_feature = "fma"
                ))]
                if kind && self.segments.iter().any(|s| prompt_kernel(s.format)) {
                    return self.prompt_batch(team, xr, mr, or);
                }
                self.batch(team, xr, mr, bits, or)
            });
        }
    }
}

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma"
))]
impl QuantMatrix {
    /// Prompt rows of a matrix with rows that have a prompt kernel (`q32_prompt`), in prefill
    /// spans of `PROMPT_SPAN` groups, over which that kernel keeps a tile's widened weights.
    fn prompt_batch(&self, team: &Team, x: &[f32], m: usize, out: &mut [f32]) {
        let acts = self.prompt_acts(team, x, m);
        if m <= super::GROUP {
            return self.batch_with(team, &super::Beside { x, m, acts }, out);
        }
        self.prefill(team, x, &acts, m, out, true);
    }
}

/// Whether prompt rows of the 32-element `format` take their own kernel (`q32_prompt`).
fn prompt_kernel(format: super::Format) -> bool {
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    return super::q32_prompt::takes(format);
    #[cfg(not(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    )))]
    {
        let _ = format;
        false
    }
}

/// The bits prompt rows take: `auto` and `int8` bytes for the k-quants and 16 bits for the
/// 32-element formats (`ActivationBits::EightKQuants` says why), `int16` none of their own.
fn prompt_bits(precision: PromptPrecision) -> Option<ActivationBits> {
    match precision {
        PromptPrecision::Int16 => None,
        PromptPrecision::Auto | PromptPrecision::Int8 => Some(ActivationBits::EightKQuants),
    }
}
