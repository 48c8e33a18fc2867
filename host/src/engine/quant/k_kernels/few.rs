//! A few k-quant prompt rows (at most `FEW_ROWS`) across the lanes the other way round: the
//! activation rows, not the weight rows, share a vector, sixteen to it, and each weight row's
//! `prep` vectors meet them pair by pair as broadcasts.
//!
//! `lanes` packs every weight row of a matrix once per prompt span, which is worth it for
//! hundreds of prompt rows but costs as much as the multiplies of about sixteen of them: a
//! short prompt, or the tail of a long one after a prefix-cache hit, paid it in full. Here
//! the activation rows are transposed instead (8 KiB per sixteen rows and super-block), and a
//! weight row is unpacked once for all of them, as the batch kernels do.
//!
//! Results are bit for bit those of `lanes`, so a prompt row's bits still do not depend on
//! how many prompt rows its step has: each (weight row, activation row) pair sums the same
//! products in i32 per segment (`segment_pairs`; integer sums are exact, so splitting a
//! segment over several accumulators changes nothing), and takes the same float steps in the
//! same order: the segment's sum times `d · scale` (that product rounded once, either way
//! round), then the mins.

use std::arch::x86_64::*;

use super::super::lanes::{dot_acc, transpose, LANES};
use super::super::{Format, QuantMatrix, Segment, TILE};
use super::avx512::prep;
use super::lanes::segment_pairs;
use super::{KActs, Q4K, Q5K, Q6K, QK, SUMS};
use crate::engine::team::{Scatter, Shares, Team};

/// Most prompt rows taken here: four vectors of sixteen. At 64 rows the multiplies run at
/// about 80% of peak, as the lanes kernel's do; passes of 64 rows over longer prompts were
/// level with it (Qwen2.5, 128 and 512 rows), so those keep the lanes.
pub(in super::super) const FEW_ROWS: usize = 4 * LANES;
/// i16 pairs per super-block.
const PAIRS: usize = QK / 2;
/// How far ahead of the super-block being multiplied the weights are prefetched, as the
/// one-row kernel does (weights come from DRAM; measured level to 2% faster than without).
const PREFETCH: usize = 1024;

/// Up to `FEW_ROWS` activation rows, transposed: lane `j` of each vector of group `g` belongs
/// to row `16g + j` (lanes past the last row hold zeros).
pub(in super::super) struct Few {
    /// Activation rows.
    m: usize,
    nb: usize,
    /// Vectors of sixteen rows.
    groups: usize,
    /// `[nb][groups][PAIRS]`: pair `t` of super-block `b` (elements `2t`, `2t + 1` as
    /// stored) as i32.
    pairs: Vec<__m512i>,
    /// `[nb][groups]`: the super-block's scale.
    scale: Vec<__m512>,
    /// `[nb][groups][8]`: the float sums of its eight 32-element sub-blocks.
    sums: Vec<__m512>,
}

impl Few {
    /// The `m` (≤ `FEW_ROWS`) rows of `a`.
    pub(in super::super) fn new(a: &KActs, m: usize) -> Self {
        let (k, nb, groups) = (a.k, a.k / QK, m.div_ceil(LANES));
        let q = a.q();
        assert!(
            m <= FEW_ROWS
                && q.len() >= m * k
                && a.scale.len() >= m * nb
                && a.sums.len() >= m * nb * SUMS
        );
        let lanes = |g: usize, f: &dyn Fn(usize) -> f32| {
            let v: [f32; LANES] = std::array::from_fn(|l| match g * LANES + l {
                j if j < m => f(j),
                _ => 0.0,
            });
            // SAFETY: plain AVX-512F; `v` holds sixteen floats.
            unsafe { _mm512_loadu_ps(v.as_ptr()) }
        };
        let mut pairs = Vec::with_capacity(nb * groups * PAIRS);
        let (mut scale, mut sums) = (Vec::new(), Vec::new());
        for b in 0..nb {
            for g in 0..groups {
                for c in (0..PAIRS).step_by(LANES) {
                    // Sixteen pairs of each row, one row per vector, then turned across.
                    let v: [__m512i; LANES] = std::array::from_fn(|l| match g * LANES + l {
                        // SAFETY: elements 2c..2c + 32 of super-block b of row j < m are
                        // within `q` (asserted above).
                        j if j < m => unsafe {
                            _mm512_loadu_si512(q[j * k + b * QK + 2 * c..].as_ptr().cast())
                        },
                        // SAFETY: plain AVX-512F.
                        _ => unsafe { _mm512_setzero_si512() },
                    });
                    // SAFETY: plain AVX-512F.
                    pairs.extend(unsafe { transpose(v) });
                }
                scale.push(lanes(g, &|j| a.scale[j * nb + b]));
                sums.extend((0..8).map(|u| lanes(g, &|j| a.sums[(j * nb + b) * SUMS + u])));
            }
        }
        Self {
            m,
            nb,
            groups,
            pairs,
            scale,
            sums,
        }
    }
}

/// The rows of `x` (prompt rows) times every weight row of `qm` (all k-quants), into `out`
/// (`[x.m][rows]`).
pub(in super::super) fn pass(qm: &QuantMatrix, team: &Team, x: &Few, out: &mut [f32]) {
    pass_with(qm, team, x.m, out, &|s, r0, nr, dst| match s.format {
        Format::Q4K => rows::<Q4K>(s, r0, nr, x, dst),
        Format::Q5K => rows::<Q5K>(s, r0, nr, x, dst),
        Format::Q6K => rows::<Q6K>(s, r0, nr, x, dst),
        other => unreachable!("{other:?} is not a k-quant"),
    });
}

/// Writes rows `r0..r0 + nr` of a segment times the pass's activation rows into
/// `dst[row * m + j]`.
pub(in super::super) type PieceKernel<'a> = dyn Fn(&Segment, usize, usize, &mut [f32]) + Sync + 'a;

/// `m` activation rows times every weight row of `qm`, into `out` (`[m][rows]`), where
/// `kernel(segment, r0, nr, dst)` writes a piece of a tile into `dst[row * m + j]`: one pass
/// over the weights, each thread streaming its share of the tiles as `QuantMatrix::pass`
/// does, each writing its tiles' results straight into `out`.
pub(in super::super) fn pass_with(
    qm: &QuantMatrix,
    team: &Team,
    m: usize,
    out: &mut [f32],
    kernel: &PieceKernel<'_>,
) {
    let n = qm.rows;
    assert_eq!(out.len(), m * n, "output shape");
    let tiles = n.div_ceil(TILE);
    let shares = Shares::new(tiles, team.threads());
    let out = Scatter::new(out);
    team.run(&|p, _| {
        let mut d = vec![0f32; TILE * m];
        while let Some(t) = shares.next(p) {
            let (start, end) = (t * TILE, n.min((t + 1) * TILE));
            for (s, r0, nr, at) in qm.pieces(start..end) {
                kernel(s, r0, nr, &mut d[at * m..(at + nr) * m]);
            }
            // Activation row by activation row, so the writes run along `out`'s rows.
            for i in 0..m {
                for (r, col) in (start..end).zip(d.chunks_exact(m)) {
                    // SAFETY: i < m and r < n index `out` (`m · n` long, asserted), and only
                    // the thread that took tile t writes its rows' elements.
                    unsafe { *out.at(i * n + r) = col[i] };
                }
            }
        }
    });
}

/// Weight rows `r0..r0 + nr` of `s` (format `F`) times the rows of `x`, into
/// `dst[row * x.m + j]`.
fn rows<const F: u8>(s: &Segment, r0: usize, nr: usize, x: &Few, dst: &mut [f32]) {
    let rb = s.row_bytes();
    assert!(
        s.cols == x.nb * QK && s.bytes().len() >= (r0 + nr) * rb && dst.len() >= nr * x.m,
        "few rows: shapes"
    );
    // Four weight rows walk together, so each activation vector loaded serves four
    // `vpdpwssd`, and A accumulators per (row, group) keep at least eight chains in flight
    // (each takes four to five cycles and one issues per cycle). With three or four groups
    // the partial sums no longer fit in registers, but they are touched once per segment;
    // two weight rows at a time were no faster there (48 and 64 rows, Qwen2.5).
    macro_rules! walk {
        ($four:expr, $one:expr) => {{
            let whole = nr / 4 * 4;
            for t in (0..whole).step_by(4) {
                // SAFETY: rows r0 + t .. r0 + t + 4 ≤ r0 + nr, in bounds by the assert.
                unsafe { $four(s, r0 + t, x, &mut dst[t * x.m..]) };
            }
            for t in whole..nr {
                // SAFETY: as above, one row.
                unsafe { $one(s, r0 + t, x, &mut dst[t * x.m..]) };
            }
        }};
    }
    match x.groups {
        1 if x.m <= LANES / 2 => walk!(walk_half::<F, 4>, walk_half::<F, 1>),
        1 => walk!(walk::<F, 4, 1, 2>, walk::<F, 1, 1, 4>),
        2 => walk!(walk::<F, 4, 2, 1>, walk::<F, 1, 2, 4>),
        3 => walk!(walk::<F, 4, 3, 1>, walk::<F, 1, 3, 4>),
        4 => walk!(walk::<F, 4, 4, 1>, walk::<F, 1, 4, 4>),
        g => unreachable!("{g} groups of few rows"),
    }
}

/// The super-block `b` of each of weight rows `r..r + R` of `s`, with the blocks
/// `PREFETCH` bytes ahead of them prefetched (weights come from DRAM).
///
/// # Safety
/// Rows `r..r + R` must be within `s` and `b` one of their super-blocks.
#[inline(always)]
unsafe fn blocks<const R: usize>(s: &Segment, r: usize, b: usize) -> [*const u8; R] {
    let (rb, bb) = (s.row_bytes(), s.format.block_bytes());
    let blks: [*const u8; R] =
        std::array::from_fn(|i| s.bytes().as_ptr().add((r + i) * rb + b * bb));
    for blk in blks {
        for line in (0..bb).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(PREFETCH + line).cast());
        }
    }
    blks
}

/// Weight rows' super-blocks at `blks` unpacked by `prep`: their vectors, `d` and the mins of
/// their sub-blocks as floats (`dmin·m_j`, zero for Q6_K).
#[inline(always)]
unsafe fn unpack<const F: u8, const R: usize>(
    blks: [*const u8; R],
) -> ([[__m512i; 8]; R], [f32; R], [[f32; 8]; R]) {
    // Filled in place: `array::map` over `prep` moved the vectors through memcpy calls.
    let mut w = [[_mm512_setzero_si512(); 8]; R];
    let mut d = [0f32; R];
    let mut mins = [[0f32; 8]; R];
    for i in 0..R {
        let m;
        (w[i], d[i], m) = prep::<F>(blks[i]);
        let mut lanes = [0f32; LANES];
        _mm512_storeu_ps(lanes.as_mut_ptr(), m);
        mins[i].copy_from_slice(&lanes[..8]);
    }
    (w, d, mins)
}

/// Weight rows `r..r + R` of `s` against every super-block of `x` (G groups), into
/// `dst[row * x.m + j]`.
///
/// # Safety
/// Rows `r..r + R` must be within `s`, `s` as wide as `x`, and `x.groups == G`.
#[inline(always)]
unsafe fn walk<const F: u8, const R: usize, const G: usize, const A: usize>(
    s: &Segment,
    r: usize,
    x: &Few,
    dst: &mut [f32],
) {
    let mut sum = [[_mm512_setzero_ps(); G]; R];
    for b in 0..x.nb {
        block::<F, R, G, A>(blocks::<R>(s, r, b), x, b, &mut sum);
    }
    for (i, sum) in sum.iter().enumerate() {
        for (g, sum) in sum.iter().enumerate() {
            let mut lanes = [0f32; LANES];
            _mm512_storeu_ps(lanes.as_mut_ptr(), *sum);
            let (j0, j1) = (g * LANES, x.m.min((g + 1) * LANES));
            dst[i * x.m + j0..i * x.m + j1].copy_from_slice(&lanes[..j1 - j0]);
        }
    }
}

/// `sum[i][g]` plus super-block `b` of weight row `i` (at `blks[i]`) against super-block `b`
/// of group `g` of `x`.
#[inline(always)]
#[allow(clippy::needless_range_loop)] // (row, group) index the accumulators, sums and inputs
unsafe fn block<const F: u8, const R: usize, const G: usize, const A: usize>(
    blks: [*const u8; R],
    x: &Few,
    b: usize,
    sum: &mut [[__m512; G]; R],
) {
    let (w, d, mins) = unpack::<F, R>(blks);
    let p = x.pairs.as_ptr().add(b * G * PAIRS);
    let seg = segment_pairs(F);
    for s0 in (0..PAIRS).step_by(seg) {
        let mut ia = [[[_mm512_setzero_si512(); A]; G]; R];
        for t in s0..s0 + seg {
            // Pair t of weight row i is i32 element t of its eight vectors, as `lanes` packs
            // them.
            let wt: [__m512i; R] =
                std::array::from_fn(|i| _mm512_set1_epi32(*w[i].as_ptr().cast::<i32>().add(t)));
            for g in 0..G {
                let xv = *p.add(g * PAIRS + t);
                for i in 0..R {
                    let a = &mut ia[i][g][t % A];
                    *a = dot_acc(*a, xv, wt[i]);
                }
            }
        }
        for i in 0..R {
            for g in 0..G {
                let v = ia[i][g]
                    .iter()
                    .fold(_mm512_setzero_si512(), |a, &v| _mm512_add_epi32(a, v));
                // `d · scale` rounds as the lanes kernel's product of the same two floats.
                let scale = _mm512_mul_ps(_mm512_set1_ps(d[i]), x.scale[b * G + g]);
                sum[i][g] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(v), scale, sum[i][g]);
            }
        }
    }
    if F != Q6K {
        for (i, mins) in mins.iter().enumerate() {
            for (u, &m) in mins.iter().enumerate() {
                for g in 0..G {
                    let at = (b * G + g) * 8 + u;
                    sum[i][g] = _mm512_fnmadd_ps(_mm512_set1_ps(m), x.sums[at], sum[i][g]);
                }
            }
        }
    }
}

/// `walk` for at most eight rows in one group, on 256-bit vectors: `vpdpwssd` issues two of
/// those per cycle where it issues one on 512 bits (7.1 against 3.6 G/s measured here), so
/// the lanes past the eighth row cost nothing. Same sums in the same order, so the same bits.
///
/// # Safety
/// As `walk`, with `x.groups == 1` and `x.m <= 8`.
#[inline(always)]
unsafe fn walk_half<const F: u8, const R: usize>(s: &Segment, r: usize, x: &Few, dst: &mut [f32]) {
    let mut sum = [_mm256_setzero_ps(); R];
    for b in 0..x.nb {
        block_half::<F, R>(blocks::<R>(s, r, b), x, b, &mut sum);
    }
    for (i, sum) in sum.iter().enumerate() {
        let mut lanes = [0f32; LANES / 2];
        _mm256_storeu_ps(lanes.as_mut_ptr(), *sum);
        dst[i * x.m..(i + 1) * x.m].copy_from_slice(&lanes[..x.m]);
    }
}

/// `block` for one group of at most eight rows, on the low halves of its vectors.
#[inline(always)]
unsafe fn block_half<const F: u8, const R: usize>(
    blks: [*const u8; R],
    x: &Few,
    b: usize,
    sum: &mut [__m256; R],
) {
    /// Accumulators per weight row: sixteen chains for two issues per cycle.
    const A: usize = 4;
    let (w, d, mins) = unpack::<F, R>(blks);
    let p = x.pairs.as_ptr().add(b * PAIRS);
    let xs = _mm512_castps512_ps256(x.scale[b]);
    let seg = segment_pairs(F);
    for s0 in (0..PAIRS).step_by(seg) {
        let mut ia = [[_mm256_setzero_si256(); A]; R];
        for t in s0..s0 + seg {
            let xv = _mm512_castsi512_si256(*p.add(t));
            for (i, ia) in ia.iter_mut().enumerate() {
                let pair = *w[i].as_ptr().cast::<i32>().add(t);
                ia[t % A] = dot_acc_half(ia[t % A], xv, _mm256_set1_epi32(pair));
            }
        }
        for (i, ia) in ia.iter().enumerate() {
            let v = ia
                .iter()
                .fold(_mm256_setzero_si256(), |a, &v| _mm256_add_epi32(a, v));
            let scale = _mm256_mul_ps(_mm256_set1_ps(d[i]), xs);
            sum[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), scale, sum[i]);
        }
    }
    if F != Q6K {
        for (i, mins) in mins.iter().enumerate() {
            for (u, &m) in mins.iter().enumerate() {
                let at = _mm512_castps512_ps256(x.sums[b * 8 + u]);
                sum[i] = _mm256_fnmadd_ps(_mm256_set1_ps(m), at, sum[i]);
            }
        }
    }
}

/// `dot_acc` on 256 bits.
#[inline(always)]
unsafe fn dot_acc_half(acc: __m256i, w: __m256i, x: __m256i) -> __m256i {
    #[cfg(target_feature = "avx512vnni")]
    {
        _mm256_dpwssd_epi32(acc, w, x)
    }
    #[cfg(not(target_feature = "avx512vnni"))]
    {
        _mm256_add_epi32(acc, _mm256_madd_epi16(w, x))
    }
}
