//! One to `ACROSS_ROWS` k-quant prompt rows with the lanes kernel's bits and neither its
//! packing nor `few`'s broadcasts: the usual case is a fully cached prompt whose last token is
//! recomputed for its logits, one row, which cost three decode steps through `few` (a
//! broadcast `vpdpwssd` per i16 pair, sixteen lanes of which one was used).
//!
//! Each weight row is unpacked by `prep` (as decode's batch kernels do) and meets the
//! activation row in one `vpdpwssd` per 32 elements. A segment's lanes (`segment_pairs`) are
//! then added across for sixteen weight rows at once (`lanes::reduce_halves`), which leaves
//! lane `l` holding weight row `l`'s exact segment sum: the integer the lanes kernel's lane `l`
//! holds, since integer sums are exact in any order. The float steps that follow are the lanes
//! kernel's own, on the same vectors: the segment sum times `d · scale` (that product rounded
//! once), segment after segment, then the mins. So the bits are the lanes kernel's.

use std::arch::x86_64::*;

use super::super::lanes::{across_groups, dot_acc, reduce_halves, ACROSS_ROWS, LANES};
use super::super::{Format, Segment};
use super::avx512::prep;
use super::lanes::segment_pairs;
use super::{KActs, Q4K, Q5K, Q6K, QK, SUMS};

/// How far ahead of the super-block being multiplied each row's weights are prefetched.
const PREFETCH: usize = 1024;

/// Weight rows `r0..r0 + nr` of `s` times the `m` (≤ ACROSS_ROWS) rows of `a`, into
/// `dst[row * m + j]`.
pub(in super::super) fn rows(
    s: &Segment,
    r0: usize,
    nr: usize,
    a: &KActs,
    m: usize,
    dst: &mut [f32],
) {
    let (k, nb) = (a.k, a.k / QK);
    assert!(
        (1..=ACROSS_ROWS).contains(&m)
            && s.cols == k
            && s.bytes().len() >= (r0 + nr) * s.row_bytes()
            && a.q().len() >= m * k
            && a.scale.len() >= m * nb
            && a.sums.len() >= m * nb * SUMS
            && dst.len() >= nr * m,
        "across rows: shapes"
    );
    let bb = s.format.block_bytes();
    // SAFETY: asserted above: every super-block of the sixteen rows and of the m activation
    // rows is in bounds.
    across_groups(s, (r0, nr), m, dst, |rows| unsafe {
        match s.format {
            Format::Q4K => group::<Q4K>(rows, bb, a, m, nb),
            Format::Q5K => group::<Q5K>(rows, bb, a, m, nb),
            Format::Q6K => group::<Q6K>(rows, bb, a, m, nb),
            other => unreachable!("{other:?} is not a k-quant"),
        }
    });
}

/// Sixteen weight rows (`rows[l]`: row `l`'s bytes, super-blocks of `bb` bytes) times
/// activation rows `0..m` of `a`: lane `l` of row `j`'s sums is weight row `l`'s result.
#[inline(always)]
unsafe fn group<const F: u8>(
    rows: &[*const u8; LANES],
    bb: usize,
    a: &KActs,
    m: usize,
    nb: usize,
) -> [[f32; LANES]; ACROSS_ROWS] {
    let seg = segment_pairs(F);
    let mut sums = [_mm512_setzero_ps(); ACROSS_ROWS];
    for b in 0..nb {
        let mut w = [[_mm512_setzero_si512(); 8]; LANES];
        let mut d = [0f32; LANES];
        let mut mins = [[0f32; LANES]; 8];
        for l in 0..LANES {
            let blk = rows[l].add(b * bb);
            for line in (0..bb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH + line).cast());
            }
            let (wv, dl, mn) = prep::<F>(blk);
            (w[l], d[l]) = (wv, dl);
            let mut lanes = [0f32; LANES];
            _mm512_storeu_ps(lanes.as_mut_ptr(), mn);
            for (u, col) in mins.iter_mut().enumerate() {
                col[l] = lanes[u];
            }
        }
        let dv = _mm512_loadu_ps(d.as_ptr());
        for (j, sum) in sums.iter_mut().enumerate().take(m) {
            let xq = a.q()[j * a.k + b * QK..].as_ptr().cast::<__m512i>();
            let x: [__m512i; 8] = std::array::from_fn(|v| _mm512_loadu_si512(xq.add(v)));
            let scale = _mm512_mul_ps(dv, _mm512_set1_ps(a.scale[j * nb + b]));
            // Per weight row, each of the eight vectors' pair sums: lane `t` of vector `v` is
            // pair `16v + t` of the super-block.
            let p = |v: usize| -> [__m512i; LANES] {
                std::array::from_fn(|l| dot_acc(_mm512_setzero_si512(), w[l][v], x[v]))
            };
            let mut fold = |ia: __m512i| {
                *sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), scale, *sum);
            };
            match seg {
                // Segments of 32 pairs: two vectors each.
                32 => {
                    for s in 0..4 {
                        let (e, o) = (p(2 * s), p(2 * s + 1));
                        let both = std::array::from_fn(|l| _mm512_add_epi32(e[l], o[l]));
                        let (lo, hi) = reduce_halves(&both);
                        fold(_mm512_add_epi32(lo, hi));
                    }
                }
                // Of 16 pairs: one vector each.
                16 => {
                    for v in 0..8 {
                        let (lo, hi) = reduce_halves(&p(v));
                        fold(_mm512_add_epi32(lo, hi));
                    }
                }
                // Of 8 pairs: each vector's low lanes, then its high ones.
                _ => {
                    for v in 0..8 {
                        let (lo, hi) = reduce_halves(&p(v));
                        fold(lo);
                        fold(hi);
                    }
                }
            }
            if F != Q6K {
                let at = j * nb * SUMS + b * SUMS;
                for (u, col) in mins.iter().enumerate() {
                    let mv = _mm512_loadu_ps(col.as_ptr());
                    *sum = _mm512_fnmadd_ps(mv, _mm512_set1_ps(a.sums[at + u]), *sum);
                }
            }
        }
    }
    let mut out = [[0f32; LANES]; ACROSS_ROWS];
    for (o, s) in out.iter_mut().zip(sums) {
        _mm512_storeu_ps(o.as_mut_ptr(), s);
    }
    out
}
