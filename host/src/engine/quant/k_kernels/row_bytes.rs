//! Activation rows as bytes: rounded to 16 bits, `q = 256·hi + lo`; to 8, the values are `hi`
//! and there is no `lo`.
//!
//! A row's weights are read once from memory, so the one-row kernel's cost is the unpacking:
//! it multiplies the packed 4-6-bit values as bytes (`maddubs`, no widening and no per-vector
//! 16-bit scale multiply), high and low activation bytes apart, and applies the sub-block
//! scales to the 16-bit pair sums.
//!
//! Rows are kept in the batch kernels' groups (`GROUP` rows counted from the first, the last
//! group the rest), each group run by run: `[super-block][run of 32][row][32 bytes]`. A kernel
//! for a group of G rows then finds every byte it reads for a run at a fixed offset from one
//! pointer, instead of one pointer per row (the AVX2 kernel spent a quarter of its
//! instructions stepping between rows). One row alone is in element order.

use super::super::aligned::Aligned;
use super::super::{ActivationBits, GROUP};
use super::QK;
use std::sync::{Mutex, MutexGuard};

use crate::engine::team::{split, split_mut, Team};

pub(in super::super) struct RowBytes {
    pub(super) hi: Aligned<i8, 64>,
    pub(super) lo: Option<Aligned<u8, 64>>,
    /// Beside `hi` (half its offsets): `32·(hi[2i] + hi[2i + 1])`, Q6_K's offset of 32 on the
    /// high bytes of a pair.
    pub(super) hs: Aligned<i16, 32>,
    // Read by the AVX2 kernel only (AVX-512 builds take one row, for their one-row kernel).
    #[cfg_attr(all(target_feature = "avx512bw", not(test)), allow(dead_code))]
    /// Per group `[super-block][row][16]`: the sum of `hi` over each 16 elements, Q6_K's
    /// offset at 8 bits, taken with the sub-block scales once per super-block.
    pub(super) bs: Aligned<i16, 32>,
    // Read by the AVX2 kernel only (AVX-512 builds take one row, for their one-row kernel).
    #[cfg_attr(all(target_feature = "avx512bw", not(test)), allow(dead_code))]
    /// Rows.
    pub(super) m: usize,
}

impl RowBytes {
    /// From `m` rows of `k` stored activations (`deinterleave` order) rounded to `bits`,
    /// groups split across the team (AVX2 converts every prompt row of a prefill chunk).
    pub(super) fn new(team: &Team, q: &[i16], k: usize, bits: ActivationBits) -> Self {
        assert!(
            k.is_multiple_of(QK) && q.len().is_multiple_of(k),
            "whole rows of blocks"
        );
        let m = q.len() / k;
        let wide = bits == ActivationBits::Sixteen;
        // Rounded to 16 bits the high byte is `q >> 8`; to 8 bits it is `q`.
        let shift = if wide { 8 } else { 0 };
        let (mut hi, mut hs, mut bs) = (
            Aligned::<i8, 64>::zeroed(m * k),
            Aligned::<i16, 32>::zeroed(m * k / 2),
            Aligned::<i16, 32>::zeroed(m * k / 16),
        );
        let mut lo = wide.then(|| Aligned::<u8, 64>::zeroed(m * k));
        let groups = m.div_ceil(GROUP);
        // A few rows (decode, a small batch) are converted here rather than waking the team.
        let parts = match q.len() < 1 << 16 {
            true => 1,
            false => team.threads().min(groups),
        };
        let rows: Vec<_> = (0..parts)
            .map(|p| split(groups, 1, p, parts))
            .map(|g| GROUP * g.start..m.min(GROUP * g.end))
            .collect();
        let parts_of = |per: usize| rows.iter().map(move |r| r.len() * per);
        let his = split_mut(hi.as_mut_slice(), parts_of(k));
        let hss = split_mut(hs.as_mut_slice(), parts_of(k / 2));
        let bss = split_mut(bs.as_mut_slice(), parts_of(k / 16));
        let los = lo
            .as_mut()
            .map(|lo| split_mut(lo.as_mut_slice(), parts_of(k)));
        let job = |p: usize, _: usize| {
            let Some(range) = rows.get(p) else { return };
            let (mut hi, mut hs, mut bs) = (lock(&his[p]), lock(&hss[p]), lock(&bss[p]));
            let mut lo = los.as_ref().map(|l| lock(&l[p]));
            for r in range.clone() {
                let i0 = r - r % GROUP;
                let (g, j, base) = (GROUP.min(m - i0), r - i0, (i0 - range.start) * k);
                // Element e of row r: its run's place in the group, then the row's 32 bytes;
                // its sum of 16 the same way.
                let at = |e: usize| base + (e / 32) * 32 * g + j * 32 + e % 32;
                let sum_at = |e: usize| base / 16 + (e / QK) * 16 * g + j * 16 + e % QK / 16;
                // A stored run of 64 is its 32 even elements, then its 32 odd ones: each half
                // of 32 elements in order (a run of the group) is 16 of each, interleaved,
                // written through slices so that the loops vectorize (element by element, this
                // took 4% of a Qwen2.5 prefill).
                for (run, stored) in q[r * k..(r + 1) * k].chunks_exact(64).enumerate() {
                    for half in 0..2 {
                        let e0 = 64 * run + 32 * half;
                        let even = &stored[16 * half..16 * half + 16];
                        let odd = &stored[32 + 16 * half..32 + 16 * half + 16];
                        let (h, pairs) = (at(e0), at(e0) / 2);
                        let high: [[i8; 2]; 16] = std::array::from_fn(|i| {
                            [(even[i] >> shift) as i8, (odd[i] >> shift) as i8]
                        });
                        for (d, p) in hi[h..h + 32].chunks_exact_mut(2).zip(&high) {
                            d.copy_from_slice(p);
                        }
                        let sums: [i16; 16] =
                            std::array::from_fn(|i| i16::from(high[i][0]) + i16::from(high[i][1]));
                        for (d, s) in hs[pairs..pairs + 16].iter_mut().zip(&sums) {
                            *d = 32 * s;
                        }
                        let s = sum_at(e0);
                        bs[s] = sums[..8].iter().sum();
                        bs[s + 1] = sums[8..].iter().sum();
                        if let Some(lo) = lo.as_mut() {
                            for (i, d) in lo[h..h + 32].chunks_exact_mut(2).enumerate() {
                                d.copy_from_slice(&[even[i] as u8, odd[i] as u8]);
                            }
                        }
                    }
                }
            }
        };
        if parts > 1 {
            team.run(&job);
        } else {
            job(0, 1);
        }
        drop((his, hss, bss, los));
        Self { hi, lo, hs, bs, m }
    }

    /// Where group `i0..i0 + g` starts in `hi` and `lo` (`hs` at half, `bs` at a sixteenth),
    /// checking that it is one of the groups the rows are kept in.
    #[cfg_attr(all(target_feature = "avx512bw", not(test)), allow(dead_code))]
    pub(super) fn group(&self, i0: usize, g: usize, k: usize) -> usize {
        assert!(
            i0 < self.m && i0.is_multiple_of(GROUP) && g == GROUP.min(self.m - i0),
            "rows {i0}..{} are not a group of {} rows",
            i0 + g,
            self.m
        );
        i0 * k
    }
}

/// A part's slice (a poisoned lock still holds whole bytes: the writer only stores).
fn lock<'a, 'b, T>(s: &'a Mutex<&'b mut [T]>) -> MutexGuard<'a, &'b mut [T]> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}
