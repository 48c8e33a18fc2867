//! Prompt rows of the 32-element formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) on AVX2 (no
//! AVX-512BW): eight activation rows across the lanes, weight values broadcast.
//!
//! The batch kernels (`q32_avx2`, `q32_bytes`) give every (weight row, activation row) pair
//! its own vector of partial sums, and each block of each pair pays a float conversion and a
//! multiply-add besides its products: on a Zen 3 the 16-bit kernel took about 3 cycles per
//! pair and block, most of SmolLM2's prefill. Here lane `j` of a vector holds an i16 pair of
//! activation row `j` of a group of eight, a weight row's pair is broadcast to every lane, and
//! one `vpmaddwd` makes that pair's products for all eight rows. A block's sixteen pairs add
//! up in i32 lanes, so the float work is per block and weight row for the whole group (about
//! 1.7 cycles per pair and block in an isolated loop).
//!
//! Activations are rounded to 16 bits per block of 32 (`x ≈ e·q`), as the AVX-512 prompt
//! kernel (`lanes::q32`) rounds them. Weights are their unsigned values `u` (0..15, 0..31
//! with the fifth bit; Q8_0's signed bytes as they are), so per block `b`:
//! `w·x = d_b·e_b·Σ u·q + c_b·e_b·Σ q`, `c_b` the min (Q4_1, Q5_1), the offset `−8·d_b`
//! (Q4_0), `−16·d_b` (Q5_0) or zero (Q8_0). A block's integer sum is exact in i32 (and in
//! float for 4-bit values: 32·15·32767 < 2²⁴; wider ones round in the conversion, the same
//! way in every kernel here).
//!
//! A weight tile's values are widened to i16 once per prefill span and kept per thread for
//! the span's next groups. One or two rows (a fully cached prompt's last token, a chunk's
//! tail) would leave most lanes idle: they take `few`, which puts eight weight rows across the
//! lanes instead, and gives the same bits, since a block's integer sum is the same however it
//! is added up and the float steps per block are the same. Every lane takes the same steps
//! whatever the others hold and blocks add up in column order, so a row's bits depend neither
//! on its group nor on its step.

use std::arch::x86_64::*;
use std::cell::RefCell;

use super::aligned::Aligned;
use super::blocks::f16_at;
use super::q32_avx2::unsigned_bytes;
use super::rounding::{quantize_block, round_rows, ROUND_PER_THREAD};
use super::{Format, Segment};
use crate::engine::team::{split, split_mut, Team};

/// Elements per block (and per activation scale).
const BLOCK: usize = 32;
/// Activation rows per group, and weight rows per `few` pass: a float vector's lanes.
const LANES: usize = 8;
/// Pairs per block.
const PAIRS: usize = BLOCK / 2;
/// i16 values per block of a group's activations.
const GROUP_BLOCK: usize = BLOCK * LANES;
/// Weight rows multiplied together: their i32 sums and float sums fill the registers beside
/// the pair's activation vector.
const QUAD: usize = 4;
/// How far ahead of the block being multiplied `few` prefetches each weight row (one or two
/// activation rows read the weights once, from memory).
const PREFETCH: usize = 1024;
/// Activation rows that take `few` rather than a group's lanes.
const FEW_ROWS: usize = 2;

/// Whether prompt rows of `format` take this kernel (every 32-element format).
pub(super) fn takes(format: Format) -> bool {
    !format.is_k()
}

/// Activation rows rounded to 16 bits per block of 32, eight rows across the lanes.
pub(super) struct Acts16 {
    k: usize,
    m: usize,
    /// `[group][block][pair][lane][2]` (empty when `rows` holds the values).
    q: Aligned<i16, 32>,
    /// `[m][k]`, in element order, when `m ≤ FEW_ROWS` (for `few`).
    rows: Option<Aligned<i16, 32>>,
    /// Each block's scale (`x ≈ e·q`): `[group][block][lane]`, zero past the last row, or
    /// `[m][block]` with `rows`.
    e: Vec<f32>,
    /// Each block's `e·Σq`, laid out as `e`.
    s: Vec<f32>,
}

impl Acts16 {
    /// The `m` rows of `x` (`[m][k]`, `k` a multiple of 32), groups split across the team.
    pub(super) fn new(team: &Team, x: &[f32], m: usize, k: usize) -> Self {
        assert!(
            k.is_multiple_of(BLOCK) && x.len() == m * k,
            "rows of whole blocks"
        );
        if m <= FEW_ROWS {
            // `few` reads the rows in element order: rounded so, not across the lanes.
            let (rows, e, s) = round_rows::<BLOCK, 1>(team, x, m, k, |xb, q, u| {
                let e = quantize_block(xb, q, 32767.0);
                u[0] = q.iter().map(|&v| i32::from(v)).sum::<i32>() as f32 * e;
                e
            });
            let q = Aligned::zeroed(0);
            let rows = Some(rows);
            return Self {
                k,
                m,
                q,
                rows,
                e,
                s,
            };
        }
        let (nb, groups) = (k / BLOCK, m.div_ceil(LANES));
        let mut q = Aligned::zeroed(groups * nb * GROUP_BLOCK);
        let (mut e, mut s) = (
            vec![0f32; groups * nb * LANES],
            vec![0f32; groups * nb * LANES],
        );
        let parts = team.threads().min(groups).min(1 + m * k / ROUND_PER_THREAD);
        let ranges: Vec<_> = (0..parts).map(|p| split(groups, 1, p, parts)).collect();
        let qs = split_mut(
            q.as_mut_slice(),
            ranges.iter().map(|r| r.len() * nb * GROUP_BLOCK),
        );
        let es = split_mut(&mut e, ranges.iter().map(|r| r.len() * nb * LANES));
        let ss = split_mut(&mut s, ranges.iter().map(|r| r.len() * nb * LANES));
        let job = |p: usize, _: usize| {
            let Some(range) = ranges.get(p) else { return };
            let mut q = qs[p].lock().unwrap_or_else(|e| e.into_inner());
            let mut e = es[p].lock().unwrap_or_else(|e| e.into_inner());
            let mut s = ss[p].lock().unwrap_or_else(|e| e.into_inner());
            for (gi, g) in range.clone().enumerate() {
                for j in 0..LANES.min(m - g * LANES) {
                    let row = &x[(g * LANES + j) * k..][..k];
                    for (b, xb) in row.chunks_exact(BLOCK).enumerate() {
                        let at = (gi * nb + b) * LANES + j;
                        let dst = &mut q[(gi * nb + b) * GROUP_BLOCK..][..GROUP_BLOCK];
                        (e[at], s[at]) = round_block(xb, j, dst);
                    }
                }
            }
        };
        // A group or two is rounded here rather than waking the team for it.
        if parts > 1 {
            team.run(&job);
        } else {
            job(0, 1);
        }
        Self {
            k,
            m,
            q,
            rows: None,
            e,
            s,
        }
    }
}

/// Rounds one block of a row to 16 bits into lane `j` of a group's block `dst`; returns its
/// scale and `e·Σq`.
fn round_block(x: &[f32], j: usize, dst: &mut [i16]) -> (f32, f32) {
    let mut q = [0i16; BLOCK];
    let e = quantize_block(x, &mut q, 32767.0);
    let sum: i32 = q.iter().map(|&v| i32::from(v)).sum();
    for (p, pair) in q.chunks_exact(2).enumerate() {
        let at = (p * LANES + j) * 2;
        dst[at..at + 2].copy_from_slice(pair);
    }
    (e, sum as f32 * e)
}

/// A tile's weight rows widened to i16, four rows to a quad, kept for a span's next groups.
struct Widened {
    /// (span, segment bytes, first row, rows) of what `q` and `f` hold.
    key: Option<(u64, usize, usize, usize)>,
    /// `[quad][block][row][32]`: each block's unsigned values (zero past the tile's rows).
    q: Aligned<i16, 32>,
    /// `[quad][block][d of 4 rows, c of 4 rows]`.
    f: Vec<f32>,
}

thread_local! {
    static WIDENED: RefCell<Widened> = RefCell::new(Widened {
        key: None,
        q: Aligned::zeroed(0),
        f: Vec::new(),
    });
}

/// Frees this thread's widened tile.
pub(super) fn release() {
    WIDENED.with_borrow_mut(|w| {
        (w.key, w.q, w.f) = (None, Aligned::zeroed(0), Vec::new());
    });
}

/// Rows `r0..r0 + nr` of `s` against activation rows `i0..i0 + g` (`i0` a multiple of 8,
/// g ≤ 8) of `a`, into `dst[row * g + j]`. `span`: the prefill span the call belongs to, whose
/// later calls on the same rows reuse the widened tile (`None`: widened for this call only).
pub(super) fn tile(
    s: &Segment,
    (r0, nr): (usize, usize),
    a: &Acts16,
    (i0, g): (usize, usize),
    dst: &mut [f32],
    span: Option<u64>,
) {
    let nb = s.cols / BLOCK;
    assert!(
        a.k == s.cols
            && s.bytes().len() >= (r0 + nr) * s.row_bytes()
            && i0.is_multiple_of(LANES)
            && (1..=LANES).contains(&g)
            && i0 + g <= a.m
            && dst.len() >= nr * g,
        "prompt tile: shapes"
    );
    if let Some(rows) = &a.rows {
        return few(s, (r0, nr), a, rows, (i0, g), dst);
    }
    let group = i0 / LANES;
    WIDENED.with_borrow_mut(|w| {
        let key = span.map(|n| (n, s.bytes().as_ptr() as usize, r0, nr));
        if key.is_none() || w.key != key {
            w.key = None;
            widen(s, r0, nr, w);
            w.key = key;
        }
        let x = &a.q.as_slice()[group * nb * GROUP_BLOCK..][..nb * GROUP_BLOCK];
        let e = &a.e[group * nb * LANES..][..nb * LANES];
        let sums = &a.s[group * nb * LANES..][..nb * LANES];
        for quad in 0..nr.div_ceil(QUAD) {
            let wq = &w.q.as_slice()[quad * nb * QUAD * BLOCK..][..nb * QUAD * BLOCK];
            let wf = &w.f[quad * nb * 2 * QUAD..][..nb * 2 * QUAD];
            // SAFETY: AVX2 and FMA are enabled for this module; every slice covers the `nb`
            // blocks the kernel reads.
            let acc = unsafe { quad_rows(wq, wf, x, e, sums) };
            for (i, acc) in acc.iter().enumerate().take(nr - quad * QUAD) {
                let mut lanes = [0f32; LANES];
                // SAFETY: `lanes` holds eight floats.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), *acc) };
                let row = quad * QUAD + i;
                dst[row * g..(row + 1) * g].copy_from_slice(&lanes[..g]);
            }
        }
    });
}

/// Four widened weight rows (`wq`, `wf`: one quad's blocks) times a group's eight activation
/// rows: the rows' sums, lane = activation row.
#[inline(always)]
unsafe fn quad_rows(wq: &[i16], wf: &[f32], x: &[i16], e: &[f32], s: &[f32]) -> [__m256; QUAD] {
    let nb = e.len() / LANES;
    debug_assert!(wq.len() == nb * QUAD * BLOCK && wf.len() == nb * 2 * QUAD);
    debug_assert!(x.len() == nb * GROUP_BLOCK && s.len() == nb * LANES);
    let mut acc = [_mm256_setzero_ps(); QUAD];
    for b in 0..nb {
        let (w, xb) = (
            wq.as_ptr().add(b * QUAD * BLOCK),
            x.as_ptr().add(b * GROUP_BLOCK),
        );
        let mut sums = [_mm256_setzero_si256(); QUAD];
        for p in 0..PAIRS {
            let xp = _mm256_load_si256(xb.add(p * 2 * LANES).cast());
            for (i, sum) in sums.iter_mut().enumerate() {
                let wp = _mm256_set1_epi32(w.add(i * BLOCK + p * 2).cast::<i32>().read_unaligned());
                *sum = _mm256_add_epi32(*sum, _mm256_madd_epi16(wp, xp));
            }
        }
        let (ev, sv) = (
            _mm256_loadu_ps(e.as_ptr().add(b * LANES)),
            _mm256_loadu_ps(s.as_ptr().add(b * LANES)),
        );
        let f = wf.as_ptr().add(b * 2 * QUAD);
        for (i, (acc, sum)) in acc.iter_mut().zip(sums).enumerate() {
            let de = _mm256_mul_ps(_mm256_broadcast_ss(&*f.add(i)), ev);
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), de, *acc);
            *acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&*f.add(QUAD + i)), sv, *acc);
        }
    }
    acc
}

/// `tile` for one or two activation rows (`rows`: them in element order): eight weight rows
/// across the lanes, with the steps and so the bits of `quad_rows`.
fn few(
    s: &Segment,
    (r0, nr): (usize, usize),
    a: &Acts16,
    rows: &Aligned<i16, 32>,
    (i0, g): (usize, usize),
    dst: &mut [f32],
) {
    let (k, nb, rb, bb) = (a.k, a.k / BLOCK, s.row_bytes(), s.format.block_bytes());
    assert!(rows.as_slice().len() >= (i0 + g) * k && i0 == 0);
    let data = s.bytes();
    for oct in 0..nr.div_ceil(LANES) {
        // The last octet repeats its last row in the lanes past the tile; they are not written.
        let row = |l: usize| &data[(r0 + (oct * LANES + l).min(nr - 1)) * rb..][..rb];
        let weights: [&[u8]; LANES] = std::array::from_fn(row);
        for j in 0..g {
            let x = &rows.as_slice()[(i0 + j) * k..][..k];
            let (e, sums) = (&a.e[(i0 + j) * nb..], &a.s[(i0 + j) * nb..]);
            let mut acc = unsafe { _mm256_setzero_ps() };
            for b in 0..nb {
                let mut int = [unsafe { _mm256_setzero_si256() }; LANES];
                let (mut d, mut c) = ([0f32; LANES], [0f32; LANES]);
                // SAFETY: AVX2 is enabled for this module; each row holds `nb` blocks and `x`
                // holds `nb` blocks of 32.
                unsafe {
                    let x0 = _mm256_load_si256(x.as_ptr().add(b * BLOCK).cast());
                    let x1 = _mm256_load_si256(x.as_ptr().add(b * BLOCK + 16).cast());
                    for l in 0..LANES {
                        let blk = &weights[l][b * bb..][..bb];
                        _mm_prefetch::<_MM_HINT_T0>(blk.as_ptr().wrapping_add(PREFETCH).cast());
                        let (w0, w1);
                        (w0, w1, d[l], c[l]) = unpack(s.format, blk);
                        int[l] =
                            _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
                    }
                    let sum = reduce8(&int);
                    let de = _mm256_mul_ps(_mm256_loadu_ps(d.as_ptr()), _mm256_set1_ps(e[b]));
                    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), de, acc);
                    acc =
                        _mm256_fmadd_ps(_mm256_loadu_ps(c.as_ptr()), _mm256_set1_ps(sums[b]), acc);
                }
            }
            let mut lanes = [0f32; LANES];
            // SAFETY: `lanes` holds eight floats.
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), acc) };
            for (l, &v) in lanes.iter().enumerate().take(nr - oct * LANES) {
                dst[(oct * LANES + l) * g + j] = v;
            }
        }
    }
}

/// Lane `l` of the result: the sum of the eight lanes of `v[l]`.
#[inline(always)]
unsafe fn reduce8(v: &[__m256i; LANES]) -> __m256i {
    let h = |a, b| _mm256_hadd_epi32(a, b);
    // Each 128-bit half: rows 0-3, then 4-7, summed over that half's lanes.
    let lo = h(h(v[0], v[1]), h(v[2], v[3]));
    let hi = h(h(v[4], v[5]), h(v[6], v[7]));
    _mm256_add_epi32(
        _mm256_permute2x128_si256::<0x20>(lo, hi),
        _mm256_permute2x128_si256::<0x31>(lo, hi),
    )
}

/// Widens rows `r0..r0 + nr` of `s` into `w.q` and `w.f`, four rows per quad (the last
/// quad's missing rows are zero).
fn widen(s: &Segment, r0: usize, nr: usize, w: &mut Widened) {
    let (nb, rb, bb) = (s.cols / BLOCK, s.row_bytes(), s.format.block_bytes());
    let quads = nr.div_ceil(QUAD);
    let data = &s.bytes()[r0 * rb..(r0 + nr) * rb];
    if w.q.as_slice().len() < quads * nb * QUAD * BLOCK {
        w.q = Aligned::zeroed(quads * nb * QUAD * BLOCK);
    }
    w.f.clear();
    w.f.resize(quads * nb * 2 * QUAD, 0.0);
    let q = w.q.as_mut_slice();
    for quad in 0..quads {
        for i in 0..QUAD {
            let t = quad * QUAD + i;
            for b in 0..nb {
                let out = &mut q[((quad * nb + b) * QUAD + i) * BLOCK..][..BLOCK];
                if t >= nr {
                    out.fill(0);
                    continue;
                }
                // SAFETY: AVX2 is enabled for this module; the block is whole and `out`
                // holds 32 values.
                unsafe {
                    let (w0, w1, d, c) = unpack(s.format, &data[t * rb + b * bb..][..bb]);
                    _mm256_storeu_si256(out.as_mut_ptr().cast(), w0);
                    _mm256_storeu_si256(out.as_mut_ptr().add(16).cast(), w1);
                    let f = (quad * nb + b) * 2 * QUAD + i;
                    (w.f[f], w.f[f + QUAD]) = (d, c);
                }
            }
        }
    }
}

/// One block's values as two vectors of i16 (elements 0..16, 16..32), with its `d` and `c`
/// (the min, or the offset times `d`; Q8_0's signed values have neither).
#[inline(always)]
unsafe fn unpack(format: Format, b: &[u8]) -> (__m256i, __m256i, f32, f32) {
    let d = f16_at(b, 0);
    if format == Format::Q8_0 {
        let q = b[2..34].as_ptr();
        let lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(q.cast()));
        let hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(q.add(16).cast()));
        return (lo, hi, d, 0.0);
    }
    let (qs, c) = match format {
        Format::Q4_0 => (2, -8.0 * d),
        Format::Q4_1 => (4, f16_at(b, 2)),
        Format::Q5_0 => (6, -16.0 * d),
        _ => (8, f16_at(b, 2)),
    };
    let (lo, hi) = unsigned_bytes(b, qs, matches!(format, Format::Q5_0 | Format::Q5_1));
    (_mm256_cvtepu8_epi16(lo), _mm256_cvtepu8_epi16(hi), d, c)
}

#[cfg(test)]
mod tests {
    use super::super::tests::{quantize, reference, tolerance, weights};
    use super::super::QuantMatrix;
    use super::{release, takes, tile, Acts16, WIDENED};
    use crate::engine::team::Team;
    use candle_core::quantized::GgmlDType;

    /// Within 16-bit rounding of the float reference, and a row's bits the same in a group of
    /// eight (its tile widened once for two groups, or for each call), alone and in a pair
    /// (`few`).
    #[test]
    fn matches_the_float_reference_and_gives_a_row_the_same_bits_whatever_its_group() {
        let team = Team::new(1);
        let (n, k, m) = (9, 576, 11);
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
        ] {
            let (q, deq) = quantize(&weights(n, k, 7), n, k, dtype);
            let qm = QuantMatrix::from_qtensor(&q).unwrap();
            let seg = &qm.segments[0];
            assert!(takes(seg.format), "{dtype:?}");
            let mut x: Vec<f32> = (0..m * k)
                .map(|i| match i % 97 {
                    0 => 6.5,
                    _ => ((i * 29 % 41) as f32 - 20.0) * 0.05,
                })
                .collect();
            // A block of zeros and a block of one tiny value: the scale's edge cases.
            x[k..k + 32].fill(0.0);
            x[2 * k + 32] = 1e-30;
            let want = reference(&x, &deq, m, n, k);
            let a = Acts16::new(&team, &x, m, k);
            for span in [Some(u64::MAX), None] {
                for i0 in (0..m).step_by(8) {
                    let g = (m - i0).min(8);
                    let mut group = vec![f32::NAN; n * g];
                    tile(seg, (0, n), &a, (i0, g), &mut group, span);
                    for i in i0..i0 + g {
                        let xi = &x[i * k..(i + 1) * k];
                        let mut alone = vec![f32::NAN; n];
                        tile(
                            seg,
                            (0, n),
                            &Acts16::new(&team, xi, 1, k),
                            (0, 1),
                            &mut alone,
                            None,
                        );
                        let pair = (i + 1).min(m - 1) - 1..(i + 1).min(m - 1) + 1;
                        let two = Acts16::new(&team, &x[pair.start * k..pair.end * k], 2, k);
                        let mut both = vec![f32::NAN; 2 * n];
                        tile(seg, (0, n), &two, (0, 2), &mut both, span);
                        for r in 0..n {
                            let got = group[r * g + i - i0];
                            let tol = tolerance(Some(32767.0), xi, &deq[r * k..(r + 1) * k]);
                            let w = want[i * n + r];
                            assert!(
                                (got as f64 - w).abs() <= tol,
                                "{dtype:?} ({i},{r}): {got} vs {w}"
                            );
                            assert_eq!(
                                got.to_bits(),
                                alone[r].to_bits(),
                                "{dtype:?} ({i},{r}) alone"
                            );
                            let in_pair = both[r * 2 + i - pair.start];
                            assert_eq!(
                                got.to_bits(),
                                in_pair.to_bits(),
                                "{dtype:?} ({i},{r}) pair"
                            );
                        }
                    }
                }
            }
        }
    }
    /// An idle engine's release frees the widened tile, and the span's next call widens it
    /// again to the same bits.
    #[test]
    fn release_frees_the_widened_tile() {
        let team = Team::new(1);
        let (n, k) = (32, 576);
        let (q, _) = quantize(&weights(n, k, 3), n, k, GgmlDType::Q4_1);
        let qm = QuantMatrix::from_qtensor(&q).unwrap();
        let x: Vec<f32> = (0..8 * k).map(|i| (i % 13) as f32 - 6.0).collect();
        let a = Acts16::new(&team, &x, 8, k);
        let run = || {
            let mut out = vec![f32::NAN; n * 8];
            tile(&qm.segments[0], (0, n), &a, (0, 8), &mut out, Some(7));
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let first = run();
        let held = || WIDENED.with_borrow(|w| w.q.as_slice().len() + w.f.capacity());
        assert!(held() > 0, "a span keeps its widened tile");
        release();
        assert_eq!(held(), 0);
        assert_eq!(run(), first);
    }
}
