//! Prompt rows where the prompt kernels are not built (no AVX-512BW): they take the batch
//! kernels on activations rounded to 8 bits (`prompt_precision` `auto` or `int8`; on AVX2 the
//! byte kernels, `k_kernels::avx2::eight` and `q32_bytes`), the generated rows of the step
//! the decode rounding.
//! Each kind goes through the kernels on its own rows, so a row's bits do not depend on what
//! shares its step.

use super::{step_rows, ActivationBits, PromptPrecision, QuantMatrix, Rounding};
use crate::engine::team::Team;

impl QuantMatrix {
    /// Whether `matmul_rows` splits this step's rows by kind: some are prompt rows, they take
    /// 8 bits where the generated rows do not, and some rows' kernel reads the bits (k-quant
    /// rows everywhere, every row on AVX2; the other formats' kernels elsewhere take the rows
    /// unrounded).
    pub(super) fn splits_prompt_rows(&self, prompt: &[bool], rounding: Rounding) -> bool {
        let avx2 = cfg!(all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma"
        ));
        rounding.prompt != PromptPrecision::Int16
            && rounding.decode != ActivationBits::Eight
            && prompt.contains(&true)
            && (avx2 || self.segments.iter().any(|s| s.format.is_k()))
    }

    /// `matmul_rows` for such a step: prompt rows at 8 bits, generated rows at `decode`, each
    /// kind on its own rows (`step_rows::on_rows`).
    pub(super) fn prompt_rows_bytes(
        &self,
        team: &Team,
        x: &[f32],
        prompt: &[bool],
        decode: ActivationBits,
        out: &mut [f32],
    ) {
        let (m, n, k) = (prompt.len(), self.rows, self.cols);
        assert_eq!(x.len(), m * k, "activation shape");
        assert_eq!(out.len(), m * n, "output shape");
        for (kind, bits) in [(true, ActivationBits::Eight), (false, decode)] {
            let rows: Vec<usize> = (0..m).filter(|&i| prompt[i] == kind).collect();
            if !rows.is_empty() {
                step_rows::on_rows((x, k), (&mut *out, n), &rows, |xr, mr, or| {
                    self.batch(team, xr, mr, bits, or)
                });
            }
        }
    }
}
