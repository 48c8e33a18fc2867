//! K-quant prompt rows across the lanes (`quant::lanes`).
//!
//! A super-block of sixteen rows packs into 128 weight vectors, the batch kernels' i16 pairs
//! (`prep`, sub-block scales folded in) transposed so that vector `t` holds pair `t` of every
//! row, the pair that meets the activations' stored i16 values `2t` and `2t + 1`. The float
//! sums go segment by segment; within a segment a row's integers are exact.

use std::arch::x86_64::*;

use super::super::lanes::{self, dot_acc, transpose, LaneFormat, LaneKernel, LANES};
use super::super::Segment;
use super::avx512::{prep, Acts};
use super::{KActs, Q4K, Q5K, Q6K, QK, SUMS};

/// Pairs summed in i32 before the lanes go to float. A lane's sum of products must stay below
/// 2³¹ whatever the values: |x16| ≤ 32767 against |w| ≤ 945 (Q4_K: 64 products), 1953 (Q5_K:
/// 32) or 4096 (Q6_K: 16, and 16 · 4096 · 32767 = 2147418112).
pub(super) const fn segment_pairs(f: u8) -> usize {
    if f == Q4K {
        32
    } else if f == Q5K {
        16
    } else {
        8
    }
}

/// Rows `r0..r0 + nr` of `s` times activation rows `i0..i0 + G` of `a`, into `dst[row * G +
/// j]`, across the lanes (`lanes::span_lanes`) within prefill span `span`.
#[allow(clippy::type_complexity)]
pub(super) fn span_lanes<const F: u8, const G: usize>(
    span: u64,
    (s, r0, nr, a, i0, dst): (&Segment, usize, usize, &KActs, usize, &mut [f32]),
) {
    let x = Acts::<G>::new(s, r0..r0 + nr, a, i0, dst.len());
    // SAFETY: `Acts::new` checked every super-block of the G rows against `s`.
    unsafe { lanes::span_lanes::<KLanes<F>, G>(span, s, (r0, nr), &x, dst) };
}

/// The k-quant `F` across the lanes.
struct KLanes<const F: u8>;

impl<const F: u8> LaneFormat for KLanes<F> {
    const ELEMS: usize = QK;
    const PAIRS: usize = QK / 2;
    /// `d`, then `dmin·m_j` of the eight sub-blocks.
    const FLOATS: usize = 9;
    const BLOCK_BYTES: usize = [144, 176, 210][F as usize];

    unsafe fn pack_block(rows: &[*const u8; LANES], w: &mut Vec<__m512i>, f: &mut Vec<__m512>) {
        let mut v = [[_mm512_setzero_si512(); 8]; LANES];
        let mut d = [0f32; LANES];
        let mut mins = [[0f32; 16]; LANES];
        for (l, &row) in rows.iter().enumerate() {
            let (wv, dl, mn) = prep::<F>(row);
            (v[l], d[l]) = (wv, dl);
            _mm512_storeu_ps(mins[l].as_mut_ptr(), mn);
        }
        w.extend((0..8).flat_map(|i| transpose(std::array::from_fn(|l| v[l][i]))));
        f.push(_mm512_loadu_ps(d.as_ptr()));
        f.extend((0..8).map(|m| {
            let col: [f32; LANES] = std::array::from_fn(|l| mins[l][m]);
            _mm512_loadu_ps(col.as_ptr())
        }));
    }
}

impl<const F: u8, const G: usize> LaneKernel<G> for KLanes<F> {
    type Acts = Acts<G>;

    #[inline(always)]
    unsafe fn block(
        w: *const __m512i,
        f: *const __m512,
        x: &Acts<G>,
        b: usize,
        sums: &mut [__m512; G],
    ) {
        let seg = segment_pairs(F);
        let scale: [__m512; G] =
            std::array::from_fn(|j| _mm512_mul_ps(*f, _mm512_set1_ps(*x.scale[j].add(b))));
        let pairs: [*const i32; G] = std::array::from_fn(|j| x.q[j].add(b * QK).cast::<i32>());
        for s0 in (0..QK / 2).step_by(seg) {
            let mut ia = [_mm512_setzero_si512(); G];
            for t in s0..s0 + seg {
                let wv = _mm512_load_si512(w.add(t).cast());
                for (j, ia) in ia.iter_mut().enumerate() {
                    *ia = dot_acc(*ia, wv, _mm512_set1_epi32(pairs[j].add(t).read_unaligned()));
                }
            }
            for j in 0..G {
                sums[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[j]), scale[j], sums[j]);
            }
        }
        if F != Q6K {
            for (j, sum) in sums.iter_mut().enumerate() {
                let at = x.sums[j].add(b * SUMS);
                for m in 0..8 {
                    *sum = _mm512_fnmadd_ps(*f.add(1 + m), _mm512_set1_ps(*at.add(m)), *sum);
                }
            }
        }
    }
}
