//! Attention of a block of consecutive rows of one sequence for one KV head, with the query
//! vectors (the block's rows times the heads of the group) side by side in the lanes.
//!
//! Scoring a query against a cached row one dot product at a time ends each product in a
//! horizontal sum, and every query row widened every cached K and V row to f32 again. Here a
//! cached row is widened once per block, a score takes one multiply-add per element for all
//! the block's queries at once, and the only horizontal step is gone. Every result keeps the
//! steps and the order of the one-query formulation (eight partial sums by element index
//! modulo 8, added in order, then scaled; softmax in position order; each output element a
//! chain of multiply-adds in position order), so a row's bits do not depend on its block.

use std::ops::Range;

use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::engine::cpu_ops::exp;

/// Query vectors attended together, one lane each.
pub(super) const LANES: usize = 16;
/// Cached rows widened to f32 at a time.
const CHUNK: usize = 32;
/// Output elements accumulated in registers at a time.
const DIMS: usize = 64;

/// Buffers reused across blocks.
#[derive(Default)]
pub(super) struct Scratch {
    /// `[head_dim][LANES]`: the block's queries, transposed.
    qt: Vec<f32>,
    /// `[positions][LANES]`: scores, then probabilities.
    s: Vec<f32>,
    /// `[CHUNK][head_dim]`: cached rows widened to f32.
    rows: Vec<f32>,
    /// A lone row's scores (`KvCache::attend_group`).
    alone: Vec<f32>,
    /// A lone row's cached rows: where each position's starts.
    offsets: Vec<usize>,
}

impl Scratch {
    /// A lone row's scores, the buffer its value rows are widened into, and its positions'
    /// offsets.
    pub(super) fn alone(&mut self) -> (&mut Vec<f32>, &mut Vec<f32>, &mut Vec<usize>) {
        (&mut self.alone, &mut self.rows, &mut self.offsets)
    }
}

/// A lone row's (decode's) weighted values: `out[g] += Σ_p scores[g][p] · v_p` over the cached
/// rows at `offsets` (`scores`: `[group][positions]`), as `weighted_values` does for a block:
/// value rows widened a chunk at a time, each output element a chain of multiply-adds in
/// position order, kept in registers across the chunk (one multiply-add per position and
/// head, where adding each position's row to the outputs in memory loaded and stored every
/// output each time).
pub(super) fn values_alone(
    vc: &[f16],
    offsets: &[usize],
    d: usize,
    scores: &[f32],
    out: &mut [f32],
    rows: &mut Vec<f32>,
) {
    let ctx = scores.len() / (out.len() / d).max(1);
    rows.resize(CHUNK * d, 0.0);
    for (c, chunk) in offsets.chunks(CHUNK).enumerate() {
        for (&at, row) in chunk.iter().zip(rows.chunks_exact_mut(d)) {
            vc[at..at + d].convert_to_f32_slice(row);
        }
        let c0 = c * CHUNK;
        group_passes(out, &rows[..chunk.len() * d], d, |p, k| {
            scores[k * ctx + c0 + p]
        });
    }
}

/// Where one block's inputs are and its outputs go.
pub(super) struct Block<'a> {
    /// The K and V cache of the layer.
    pub kc: &'a [f16],
    pub vc: &'a [f16],
    /// Offset in `kc`/`vc` of the cached row at a position (for this KV head).
    pub offset: &'a dyn Fn(usize) -> usize,
    pub head_dim: usize,
    /// Query heads per row (the KV head's group).
    pub heads: usize,
    pub scale: f32,
    /// Per row of the block: the positions it attends to (ascending, ends increasing).
    pub spans: &'a [Range<usize>],
}

impl Block<'_> {
    /// `q[r]` holds row `r`'s `group` query heads; writes each head's output to `out[r]`.
    pub(super) fn attend(&self, q: &[&[f32]], out: &mut [&mut [f32]], sc: &mut Scratch) {
        let (d, group) = (self.head_dim, self.heads);
        let nq = q.len() * group;
        assert!(nq <= LANES && d.is_multiple_of(8) && self.spans.len() == q.len());
        let union = self.spans[0].start..self.spans[q.len() - 1].end;
        sc.qt.clear();
        sc.qt.resize(d * LANES, 0.0);
        for l in 0..nq {
            let qv = &q[l / group][(l % group) * d..][..d];
            for (i, &v) in qv.iter().enumerate() {
                sc.qt[i * LANES + l] = v;
            }
        }
        // Every lane of every position is written by `scores` before it is read, so the
        // buffer is only grown, not cleared: a decode row would otherwise zero sixteen lanes
        // per position of its context, for each KV head and layer.
        if sc.s.len() < union.len() * LANES {
            sc.s.resize(union.len() * LANES, 0.0);
        }
        sc.rows.resize(CHUNK * d, 0.0);
        self.scores(union.clone(), sc);
        // Lane l's positions, relative to the union.
        let span = |l: usize| {
            let s = &self.spans[(l / group).min(self.spans.len() - 1)];
            s.start - union.start..s.end - union.start
        };
        let spans: [Range<usize>; LANES] = std::array::from_fn(|l| match l < nq {
            true => span(l),
            false => 0..0,
        });
        softmax_lanes(&mut sc.s[..union.len() * LANES], &spans);
        for o in out.iter_mut() {
            o[..group * d].fill(0.0);
        }
        self.weighted_values(union, &spans[..nq], out, sc);
    }

    /// `s[p][l] = q_l · k_p · scale` for every position of `union`.
    fn scores(&self, union: Range<usize>, sc: &mut Scratch) {
        let d = self.head_dim;
        let (rows, qt, s) = (&mut sc.rows, &sc.qt, &mut sc.s);
        for c0 in union.clone().step_by(CHUNK) {
            let c1 = union.end.min(c0 + CHUNK);
            for p in c0..c1 {
                let at = (self.offset)(p);
                self.kc[at..at + d].convert_to_f32_slice(&mut rows[(p - c0) * d..][..d]);
            }
            // The positions scored in pairs, then the rest one at a time.
            #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
            let paired = {
                let k = |p: usize| &rows[(p - c0) * d..][..d];
                let mut p = c0;
                while p + 2 <= c1 {
                    let out = &mut s[(p - union.start) * LANES..][..2 * LANES];
                    // SAFETY: this build has AVX-512F.
                    unsafe { score_pair(qt, [k(p), k(p + 1)], self.scale, out) };
                    p += 2;
                }
                p
            };
            #[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
            let paired = c0;
            for p in paired..c1 {
                let k = &rows[(p - c0) * d..][..d];
                // Fixed-size views, so the loops unroll and the sums stay in registers.
                let mut acc = [[0f32; LANES]; 8];
                for (k8, q8) in k.chunks_exact(8).zip(qt.chunks_exact(8 * LANES)) {
                    let k8: &[f32; 8] = k8.try_into().expect("eight elements");
                    for c in 0..8 {
                        let qrow: &[f32; LANES] =
                            q8[c * LANES..][..LANES].try_into().expect("a lane row");
                        for l in 0..LANES {
                            acc[c][l] = qrow[l].mul_add(k8[c], acc[c][l]);
                        }
                    }
                }
                let zero = empty_sum();
                let mut sum = [zero; LANES];
                for part in &acc {
                    for l in 0..LANES {
                        sum[l] += part[l];
                    }
                }
                let s = &mut s[(p - union.start) * LANES..][..LANES];
                for l in 0..LANES {
                    s[l] = (sum[l] + zero) * self.scale;
                }
            }
        }
    }

    /// `out[r][g] = Σ_p s[p][l] · v_p` over lane `l`'s positions, in position order.
    fn weighted_values(
        &self,
        union: Range<usize>,
        spans: &[Range<usize>],
        out: &mut [&mut [f32]],
        sc: &mut Scratch,
    ) {
        let (d, group) = (self.head_dim, self.heads);
        for c0 in union.clone().step_by(CHUNK) {
            let c1 = union.end.min(c0 + CHUNK);
            for p in c0..c1 {
                let at = (self.offset)(p);
                self.vc[at..at + d].convert_to_f32_slice(&mut sc.rows[(p - c0) * d..][..d]);
            }
            for (r, o) in out.iter_mut().enumerate() {
                let span = &spans[r * group];
                // This chunk's positions of the row, relative to the union.
                let (lo, hi) = (
                    span.start.max(c0 - union.start),
                    span.end.min(c1 - union.start),
                );
                if lo >= hi {
                    continue;
                }
                let rows = &sc.rows[(lo + union.start - c0) * d..(hi + union.start - c0) * d];
                let w = |p: usize, k: usize| sc.s[(lo + p) * LANES + r * group + k];
                group_passes(&mut o[..group * d], rows, d, w);
            }
        }
    }
}

/// `cpu_ops::dot`'s ending: the eight partial sums are added in order from the empty sum (a
/// float sum starts at -0.0), plus the sum of the (empty) tail, then scaled.
fn empty_sum() -> f32 {
    std::iter::empty::<f32>().sum()
}

/// The scores of two positions at once into `out` (`[2][LANES]`), in 512-bit vectors, each lane
/// with `cpu_ops::dot`'s steps (as `Block::scores` computes one position's): each
/// query row loaded serves both positions (one position at a time, every multiply-add took
/// two loads, and LLVM kept the lanes in 256-bit halves). The same operations per lane, so
/// the same bits.
///
/// # Safety
/// AVX-512F must be present.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
#[inline(always)]
unsafe fn score_pair(qt: &[f32], k: [&[f32]; 2], scale: f32, out: &mut [f32]) {
    use std::arch::x86_64::*;
    let d = k[0].len();
    assert!(k[1].len() == d && qt.len() >= d * LANES && out.len() >= 2 * LANES);
    let mut acc = [[_mm512_setzero_ps(); 8]; 2];
    for j in 0..d / 8 {
        for c in 0..8 {
            let i = 8 * j + c;
            // SAFETY: i < d, so the lane row i · LANES.. is inside `qt` (asserted).
            let q = unsafe { _mm512_loadu_ps(qt.as_ptr().add(i * LANES)) };
            for (acc, k) in acc.iter_mut().zip(k) {
                acc[c] = _mm512_fmadd_ps(q, _mm512_set1_ps(k[i]), acc[c]);
            }
        }
    }
    let zero = _mm512_set1_ps(empty_sum());
    for (t, acc) in acc.iter().enumerate() {
        let sum = acc.iter().fold(zero, |s, &part| _mm512_add_ps(s, part));
        let v = _mm512_mul_ps(_mm512_add_ps(sum, zero), _mm512_set1_ps(scale));
        // SAFETY: out holds 2 · LANES floats (asserted).
        unsafe { _mm512_storeu_ps(out.as_mut_ptr().add(t * LANES), v) };
    }
}

/// `heads_pass` over every head of `out` (`[heads][d]`, weight `w(p, head)`): a row's heads
/// share its positions, so they go together, up to four, and each widened value row is
/// loaded once for them while their sums make independent chains.
#[inline(always)]
fn group_passes(out: &mut [f32], rows: &[f32], d: usize, w: impl Fn(usize, usize) -> f32 + Copy) {
    let group = out.len() / d;
    let mut g = 0;
    while g < group {
        let h = match group - g {
            1 => 1,
            2 | 3 => 2,
            _ => 4,
        };
        let heads = &mut out[g * d..(g + h) * d];
        let w = move |p: usize, k: usize| w(p, g + k);
        match h {
            1 => heads_pass::<1>(heads, rows, d, w),
            2 => heads_pass::<2>(heads, rows, d, w),
            _ => heads_pass::<4>(heads, rows, d, w),
        }
        g += h;
    }
}

/// `heads[k][i] = v_p[i] · w(p, k) + heads[k][i]` for the rows `v_p` of `rows` (`[p][d]`), in
/// position order, for `H` heads of `d` outputs each.
#[inline(always)]
fn heads_pass<const H: usize>(
    heads: &mut [f32],
    rows: &[f32],
    d: usize,
    w: impl Fn(usize, usize) -> f32 + Copy,
) {
    let mut i0 = 0;
    while i0 + DIMS <= d {
        #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
        // SAFETY: this build has AVX-512F.
        unsafe {
            accumulate512::<H>(heads, rows, d, i0, w)
        };
        #[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
        accumulate::<DIMS, H>(heads, rows, d, i0, w);
        i0 += DIMS;
    }
    while i0 < d {
        accumulate::<8, H>(heads, rows, d, i0, w);
        i0 += 8;
    }
}

/// Outputs `i0..i0 + N` of `H` heads, `N · H` sums in registers.
#[inline(always)]
fn accumulate<const N: usize, const H: usize>(
    heads: &mut [f32],
    rows: &[f32],
    d: usize,
    i0: usize,
    w: impl Fn(usize, usize) -> f32,
) {
    let mut acc: [[f32; N]; H] =
        std::array::from_fn(|k| heads[k * d + i0..][..N].try_into().expect("N outputs"));
    for (p, v) in rows.chunks_exact(d).enumerate() {
        let v: &[f32; N] = v[i0..i0 + N].try_into().expect("N values");
        for (k, acc) in acc.iter_mut().enumerate() {
            let w = w(p, k);
            for i in 0..N {
                acc[i] = v[i].mul_add(w, acc[i]);
            }
        }
    }
    for (k, acc) in acc.iter().enumerate() {
        heads[k * d + i0..][..N].copy_from_slice(acc);
    }
}

/// `accumulate::<DIMS, H>` in 512-bit vectors (LLVM kept its sums in 256-bit halves, two
/// multiply-adds and loads where one does); the same operations per output, so the same bits.
///
/// # Safety
/// AVX-512F must be present.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
#[inline(always)]
unsafe fn accumulate512<const H: usize>(
    heads: &mut [f32],
    rows: &[f32],
    d: usize,
    i0: usize,
    w: impl Fn(usize, usize) -> f32,
) {
    use std::arch::x86_64::*;
    const V: usize = DIMS / 16;
    assert!(i0 + DIMS <= d && heads.len() >= H * d && rows.len().is_multiple_of(d));
    let at = |k: usize, t: usize| k * d + i0 + 16 * t;
    // SAFETY (loads and stores of `heads`): at(k, t) + 16 ≤ (H − 1)·d + i0 + DIMS ≤ H·d.
    let mut acc: [[__m512; V]; H] = std::array::from_fn(|k| {
        std::array::from_fn(|t| unsafe { _mm512_loadu_ps(heads.as_ptr().add(at(k, t))) })
    });
    for (p, v) in rows.chunks_exact(d).enumerate() {
        // SAFETY: i0 + 16t + 16 ≤ i0 + DIMS ≤ d, inside the row.
        let v: [__m512; V] =
            std::array::from_fn(|t| unsafe { _mm512_loadu_ps(v.as_ptr().add(i0 + 16 * t)) });
        for (k, acc) in acc.iter_mut().enumerate() {
            let w = _mm512_set1_ps(w(p, k));
            for t in 0..V {
                acc[t] = _mm512_fmadd_ps(v[t], w, acc[t]);
            }
        }
    }
    for (k, acc) in acc.iter().enumerate() {
        for (t, &a) in acc.iter().enumerate() {
            unsafe { _mm512_storeu_ps(heads.as_mut_ptr().add(at(k, t)), a) };
        }
    }
}

/// `cpu_ops::softmax` of each lane over its own positions (`s`: `[positions][LANES]`), lanes
/// side by side: the same steps in the same order per lane. Positions outside a lane's span
/// are selected away rather than branched around, so the loops vectorise (branching, this was
/// a quarter of a prefill's attention): a lane's sum adds 0.0 for them, which leaves it as it
/// was (the sum starts at +0.0 and adds only non-negative values), and its values keep theirs.
fn softmax_lanes(s: &mut [f32], spans: &[Range<usize>; LANES]) {
    let positions = s.len() / LANES;
    let lanes = |f: fn(&Range<usize>) -> usize| -> [u32; LANES] {
        std::array::from_fn(|l| f(&spans[l]).min(positions) as u32)
    };
    let (starts, ends) = (lanes(|r| r.start), lanes(|r| r.end));
    let mut max = [f32::NEG_INFINITY; LANES];
    for (p, row) in s.chunks_exact(LANES).enumerate() {
        let p = p as u32;
        for l in 0..LANES {
            let live = starts[l] <= p && p < ends[l];
            max[l] = if live { max[l].max(row[l]) } else { max[l] };
        }
    }
    let mut sum = [0f32; LANES];
    for (p, row) in s.chunks_exact_mut(LANES).enumerate() {
        let p = p as u32;
        for l in 0..LANES {
            let x = exp(row[l] - max[l]);
            let live = starts[l] <= p && p < ends[l];
            row[l] = if live { x } else { row[l] };
            sum[l] += if live { x } else { 0.0 };
        }
    }
    let inv: [f32; LANES] = std::array::from_fn(|l| 1.0 / sum[l]);
    for row in s[..positions * LANES].chunks_exact_mut(LANES) {
        for l in 0..LANES {
            row[l] *= inv[l];
        }
    }
}
