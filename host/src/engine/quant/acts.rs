//! Activation rows prepared once per matmul for the batch kernels: each kernel family's own
//! rounding, made only where the matrix has rows of its formats.

#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
use super::lanes;
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx512bw",
    target_feature = "avx512vl"
))]
use super::q32_batch;
use super::{k_kernels::KActs, ActivationBits, QuantMatrix};
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    not(target_feature = "avx512bw")
))]
use super::{q32_avx2, q32_bytes, q32_prompt};
use crate::engine::team::Team;

impl QuantMatrix {
    /// Generated rows `x` (`m` of them) as the batch kernels take them.
    pub(super) fn batch_acts(
        &self,
        team: &Team,
        x: &[f32],
        m: usize,
        bits: ActivationBits,
    ) -> Acts {
        assert_eq!(x.len(), m * self.cols, "activation shape");
        Acts {
            k: self
                .segments
                .iter()
                .any(|s| s.format.is_k())
                .then(|| KActs::new(team, x, m, self.cols, bits)),
            #[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
            q32: None,
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx512bw",
                target_feature = "avx512vl"
            ))]
            q16: self.batch_acts16(team, x, m),
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx2",
                target_feature = "fma",
                not(target_feature = "avx512bw")
            ))]
            r32: self
                .segments
                .iter()
                .any(|s| !s.format.is_k() && !bits.q32_bytes(s.format))
                .then(|| q32_avx2::Acts32::new(team, x, m, self.cols)),
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx2",
                target_feature = "fma",
                not(target_feature = "avx512bw")
            ))]
            b32: self
                .segments
                .iter()
                .any(|s| bits.q32_bytes(s.format))
                .then(|| q32_bytes::Acts8::new(team, x, m, self.cols)),
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx2",
                target_feature = "fma",
                not(target_feature = "avx512bw")
            ))]
            p32: None,
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx2",
                target_feature = "fma",
                not(target_feature = "avx512bw")
            ))]
            bits,
        }
    }

    /// Prompt rows `x` (`m` of them) as AVX2's kernels take them: k-quant rows at
    /// `EightKQuants`, the 32-element formats' rows at 16 bits per 32 for their prompt kernel
    /// (`q32_prompt`).
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        not(target_feature = "avx512bw")
    ))]
    pub(super) fn prompt_acts(&self, team: &Team, x: &[f32], m: usize) -> Acts {
        assert_eq!(x.len(), m * self.cols, "activation shape");
        let bits = ActivationBits::EightKQuants;
        let any = |f: &dyn Fn(super::Format) -> bool| self.segments.iter().any(|s| f(s.format));
        Acts {
            k: any(&|f| f.is_k()).then(|| KActs::new(team, x, m, self.cols, bits)),
            r32: None,
            b32: None,
            p32: any(&q32_prompt::takes).then(|| q32_prompt::Acts16::new(team, x, m, self.cols)),
            bits,
        }
    }
}

/// Generated rows and their activations as the batch kernels take them.
pub(super) struct Beside<'a> {
    pub(super) x: &'a [f32],
    pub(super) m: usize,
    pub(super) acts: Acts,
}

/// Activations as the kernels take them, prepared once per matmul.
pub(super) struct Acts {
    /// Rounded for the k-quant kernels, when the matrix has k-quant rows.
    pub(super) k: Option<KActs>,
    /// Rounded for the 32-element formats' prompt kernel, in a prompt pass over such rows.
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
    pub(super) q32: Option<lanes::q32::Acts32>,
    /// Rounded for the batch kernels of Q4_0 / Q5_0 / Q8_0 rows (`q32_batch`) and Q4_1 rows
    /// (`q4_1_batch`), in a pass of generated rows over such rows (never in a prompt pass).
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx512bw",
        target_feature = "avx512vl"
    ))]
    pub(super) q16: Option<q32_batch::Acts16>,
    /// Rounded for the 32-element formats' AVX2 kernels, every row: to 16 bits per 256
    /// elements (`q32_avx2`) for the rows that do not take bytes, and to bytes per 32
    /// (`q32_bytes`) for those that do (`ActivationBits::q32_bytes`).
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        not(target_feature = "avx512bw")
    ))]
    pub(super) r32: Option<q32_avx2::Acts32>,
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        not(target_feature = "avx512bw")
    ))]
    pub(super) b32: Option<q32_bytes::Acts8>,
    /// Prompt rows rounded for the 32-element formats' prompt kernel (`q32_prompt`), in a
    /// pass of prompt rows (never beside generated ones).
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        not(target_feature = "avx512bw")
    ))]
    pub(super) p32: Option<q32_prompt::Acts16>,
    /// The bits asked for: which rows take `b32` (`ActivationBits::q32_bytes`).
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma",
        not(target_feature = "avx512bw")
    ))]
    pub(super) bits: ActivationBits,
}
