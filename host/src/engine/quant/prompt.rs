//! Prompt rows (`QuantMatrix::matmul_rows` for a step that has some): the prompt kernels, whose
//! results differ from the batch kernels' in the last bits, so every prompt row takes them
//! however many a step has.

use super::k_kernels::{self, KActs};
use super::{
    lanes, step_rows, ActivationBits, Acts, Beside, PromptPrecision, QuantMatrix, Rounding,
};
use crate::engine::team::Team;

impl QuantMatrix {
    /// `matmul_rows` for a step with prompt rows.
    pub(super) fn prompt_rows(
        &self,
        team: &Team,
        x: &[f32],
        prompt: &[bool],
        rounding: Rounding,
        out: &mut [f32],
    ) {
        let (m, n, k) = (prompt.len(), self.rows, self.cols);
        assert_eq!(x.len(), m * k, "activation shape");
        assert_eq!(out.len(), m * n, "output shape");
        let precision = rounding.prompt;
        let tiles = self.takes_tiles(precision);
        if prompt.iter().all(|&p| p) {
            return self.prompt_pass(team, x, m, precision, out);
        }
        let kind = |prompt_row: bool| (0..m).filter(move |&i| prompt[i] == prompt_row);
        let (rp, rg): (Vec<usize>, Vec<usize>) = (kind(true).collect(), kind(false).collect());
        // The generated rows (few: decodes, or a prompt's last block) gathered into
        // contiguous rows and scattered back.
        let xg = step_rows::gather(x, k, &rg);
        let mut og = vec![0f32; rg.len() * n];
        let beside = Beside {
            x: &xg,
            m: rg.len(),
            acts: self.batch_acts(team, &xg, rg.len(), rounding.decode),
        };
        #[cfg(all(target_feature = "avx512bf16", target_os = "linux"))]
        if tiles {
            // The prompt rows are read and written in place (copied in and out of fresh
            // buffers, a 256-row chunk beside 4 generated rows took 1.6x the two kinds'
            // passes), and the generated rows meet each weight unit while the tiles have it
            // in cache rather than in a pass of their own that reads every weight again.
            self.tiles(team, (x, &rp), out, Some((&beside, &mut og)));
        }
        if !tiles {
            step_rows::on_rows((x, k), (&mut *out, n), &rp, |xr, mr, or| {
                self.prompt_pass(team, xr, mr, precision, or)
            });
            self.batch_with(team, &beside, &mut og);
        }
        for (&i, o) in rg.iter().zip(og.chunks_exact(n)) {
            out[i * n..(i + 1) * n].copy_from_slice(o);
        }
    }

    /// Whether prompt rows take BF16 AMX tiles here (`tiles`): at `auto`, where they fit.
    fn takes_tiles(&self, precision: PromptPrecision) -> bool {
        #[cfg(all(target_feature = "avx512bf16", target_os = "linux"))]
        return precision == PromptPrecision::Auto && self.tiles_fit();
        #[cfg(not(all(target_feature = "avx512bf16", target_os = "linux")))]
        {
            let _ = precision;
            false
        }
    }

    /// `m` prompt rows through the prompt kernels: AMX tiles (every row, however many, so a
    /// row's bits never depend on its step), 8-bit integer kernels (`int8`, or `auto` without
    /// tiles) or 16-bit ones (`int16`).
    fn prompt_pass(
        &self,
        team: &Team,
        x: &[f32],
        m: usize,
        precision: PromptPrecision,
        out: &mut [f32],
    ) {
        #[cfg(all(target_feature = "avx512bf16", target_os = "linux"))]
        if self.takes_tiles(precision) {
            let rows: Vec<usize> = (0..m).collect();
            return self.tiles(team, (x, &rows), out, None);
        }
        // Without the tiles `auto` takes the 8-bit kernels too: 1.5-1.7x the 16-bit ones' speed,
        // and further from f32 than them but not as far as llama.cpp's kernels (README,
        // "Precision"). Every k-quant row at 8 bits takes `k_kernels::lanes8` however many a
        // step has: `few` and `across` give the 16-bit kernel's bits. The 32-element formats
        // keep their 16-bit prompt kernels either way.
        let eight = precision != PromptPrecision::Int16;
        if !eight && m <= lanes::ACROSS_ROWS {
            return self.across_pass(team, x, m, out);
        }
        let k = self.cols;
        let formats = self.formats();
        // A short prompt, or a long one's tail after a prefix-cache hit, is not worth packing
        // every weight row for: `few` gives the same bits without it (the 32-element formats'
        // rows still pack).
        if !eight && m <= k_kernels::FEW_ROWS && formats.iter().all(|f| f.is_k()) {
            let a = KActs::new(team, x, m, k, ActivationBits::Sixteen);
            return k_kernels::few_pass(self, team, &k_kernels::Few::new(&a, m), out);
        }
        let k_acts = || match eight {
            true => KActs::new(team, x, m, k, ActivationBits::EightKQuants).with_bytes8(team),
            false => KActs::new(team, x, m, k, ActivationBits::Sixteen),
        };
        let acts = Acts {
            k: formats.iter().any(|f| f.is_k()).then(k_acts),
            q32: formats
                .iter()
                .any(|f| !f.is_k())
                .then(|| lanes::q32::Acts32::new(team, x, m, k)),
            #[cfg(target_feature = "avx512vl")]
            q16: None,
        };
        self.prefill(team, x, &acts, m, out, true);
    }

    /// One or two prompt rows (most often a fully cached prompt's last token, recomputed for
    /// its logits) with the prompt kernels' bits and none of their set-up: no tile is packed
    /// and no activation lane is idle (`k_kernels::across`, `lanes::q32::across`).
    fn across_pass(&self, team: &Team, x: &[f32], m: usize, out: &mut [f32]) {
        let (k, formats) = (self.cols, self.formats());
        let ka = formats
            .iter()
            .any(|f| f.is_k())
            .then(|| KActs::new(team, x, m, k, ActivationBits::Sixteen));
        let qa = formats
            .iter()
            .any(|f| !f.is_k())
            .then(|| lanes::q32::Acts32::new(team, x, m, k));
        k_kernels::pass_with(
            self,
            team,
            m,
            out,
            &|s, r0, nr, dst| match (s.format.is_k(), &ka, &qa) {
                (true, Some(a), _) => k_kernels::across_rows(s, r0, nr, a, m, dst),
                (false, _, Some(a)) => lanes::q32::across(s, r0, nr, a, m, dst),
                _ => unreachable!("activations were prepared for every format"),
            },
        );
    }
}
