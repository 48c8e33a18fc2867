//! Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 prompt rows across the lanes (`quant::lanes`).
//!
//! The batch kernels (`f32_kernels`) dequantize each block to f32 and meet unrounded
//! activations: on Zen 4 a 512-bit FMA does sixteen multiply-adds a cycle, a `vpdpwssd` on
//! 16-bit values thirty-two. Prompt rows here round each activation block of 32 to 16-bit
//! integers (`x ≈ s·x16`, error ≤ amax / 65534 per element, 256× finer than llama.cpp's
//! 8 bits). A weight block is `w = d·q + m` with small integers `q` (`m = 0`, or `−8d` /
//! `−16d` folded into `q` for Q4_0 / Q5_0), so per block
//! `w·x = d·s·Σ q·x16 + m·s·Σ x16`: both sums exact in i32, so the block meets its
//! activations rounded whole (the min's term on unrounded sums would meet the rounding error
//! with `d·q`, `q` in 0..15, instead of the centred weights).

use std::arch::x86_64::*;

use super::super::aligned::Aligned;
use super::super::rounding::{quantize_block, round_rows};
use super::super::{ActivationBits, Format, Segment};
use super::{
    across_groups, dot_acc, f16_at, reduce_halves, transpose, LaneFormat, LaneKernel, ACROSS_ROWS,
    LANES,
};
use crate::engine::team::Team;

/// Elements per block.
const BLOCK: usize = 32;

/// Activation rows rounded to 16 bits for the 32-element formats' prompt kernel.
pub(in crate::engine::quant) struct Acts32 {
    k: usize,
    /// `[m][k]`, in element order: each 32-element block scaled so its largest magnitude is
    /// 32767 (a block is one cache line).
    q: Aligned<i16, 32>,
    /// `[m][k / 32]`: each block's scale (`x ≈ q · scale`).
    scale: Vec<f32>,
    /// `[m][k / 32]`: each block's sum (of the rounded values, times the scale), for the
    /// formats with a min.
    sums: Vec<f32>,
}

impl Acts32 {
    /// Rounds the `m` rows of `x` (`[m][k]`, `k` a multiple of 32), rows split across the team.
    pub(in crate::engine::quant) fn new(team: &Team, x: &[f32], m: usize, k: usize) -> Self {
        let (q, scale, sums) = round_rows::<BLOCK, 1>(team, x, m, k, |xb, q, u| {
            let scale = quantize_block(xb, q, ActivationBits::Sixteen.max());
            u[0] = q.iter().map(|&v| i32::from(v)).sum::<i32>() as f32 * scale;
            scale
        });
        Self { k, q, scale, sums }
    }
}

/// The format parameter of `Q32` (a const generic, so each format gets its own loop).
const Q4_0: u8 = 0;
const Q4_1: u8 = 1;
const Q5_0: u8 = 2;
const Q5_1: u8 = 3;
const Q8_0: u8 = 4;

/// Whether the format has a min (`w = d·q + m`, a second float vector per block).
const fn affine(f: u8) -> bool {
    f == Q4_1 || f == Q5_1
}

/// A block's 32 weights as signed 16-bit integers in element order, its `d` and its min.
#[inline(always)]
unsafe fn prep<const F: u8>(b: *const u8) -> (__m512i, f32, f32) {
    let d = f16_at(b);
    if F == Q8_0 {
        return (
            _mm512_cvtepi8_epi16(_mm256_loadu_si256(b.add(2).cast())),
            d,
            0.0,
        );
    }
    let (min, qh, qs) = match F {
        Q4_0 => (0.0, b, b.add(2)),
        Q4_1 => (f16_at(b.add(2)), b, b.add(4)),
        Q5_0 => (0.0, b.add(2), b.add(6)),
        _ => (f16_at(b.add(2)), b.add(4), b.add(8)),
    };
    // Elements 0..16 are the low nibbles of the 16 bytes, 16..32 their high nibbles.
    let bytes = _mm_loadu_si128(qs.cast());
    let mask = _mm_set1_epi8(0x0F);
    let lo = _mm_and_si128(bytes, mask);
    let hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    let mut q = _mm512_cvtepu8_epi16(_mm256_set_m128i(hi, lo));
    if F == Q5_0 || F == Q5_1 {
        // Bit j of qh is the fifth bit of weight j.
        let h = qh.cast::<u32>().read_unaligned();
        q = _mm512_mask_add_epi16(q, h, q, _mm512_set1_epi16(16));
    }
    match F {
        Q4_0 => q = _mm512_sub_epi16(q, _mm512_set1_epi16(8)),
        Q5_0 => q = _mm512_sub_epi16(q, _mm512_set1_epi16(16)),
        _ => {}
    }
    (q, d, min)
}

/// The 32-element format `F` across the lanes.
struct Q32<const F: u8>;

impl<const F: u8> LaneFormat for Q32<F> {
    const ELEMS: usize = BLOCK;
    const PAIRS: usize = BLOCK / 2;
    /// `d`, then the min for the formats that have one.
    const FLOATS: usize = if affine(F) { 2 } else { 1 };
    const BLOCK_BYTES: usize = [18, 20, 22, 24, 34][F as usize];

    unsafe fn pack_block(rows: &[*const u8; LANES], w: &mut Vec<__m512i>, f: &mut Vec<__m512>) {
        let mut v = [_mm512_setzero_si512(); LANES];
        let (mut d, mut m) = ([0f32; LANES], [0f32; LANES]);
        for (l, &row) in rows.iter().enumerate() {
            (v[l], d[l], m[l]) = prep::<F>(row);
        }
        w.extend(transpose(v));
        f.push(_mm512_loadu_ps(d.as_ptr()));
        if affine(F) {
            f.push(_mm512_loadu_ps(m.as_ptr()));
        }
    }
}

/// Activation rows `i0..i0 + G` of `Acts32`, block by block.
struct Rows<const G: usize> {
    q: [*const i32; G],
    scale: [*const f32; G],
    sums: [*const f32; G],
}

impl<const F: u8, const G: usize> LaneKernel<G> for Q32<F> {
    type Acts = Rows<G>;

    /// Sixteen pairs per block: a lane's i32 sum takes 32 products of |x16| ≤ 32767 and
    /// |q| ≤ 128, far below 2³¹.
    #[inline(always)]
    unsafe fn block(
        w: *const __m512i,
        f: *const __m512,
        x: &Rows<G>,
        b: usize,
        sums: &mut [__m512; G],
    ) {
        let pairs: [*const i32; G] = std::array::from_fn(|j| x.q[j].add(b * BLOCK / 2));
        let mut ia = [_mm512_setzero_si512(); G];
        for t in 0..BLOCK / 2 {
            let wv = _mm512_load_si512(w.add(t).cast());
            for (j, ia) in ia.iter_mut().enumerate() {
                *ia = dot_acc(*ia, wv, _mm512_set1_epi32(*pairs[j].add(t)));
            }
        }
        for j in 0..G {
            let scale = _mm512_mul_ps(*f, _mm512_set1_ps(*x.scale[j].add(b)));
            sums[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[j]), scale, sums[j]);
            if affine(F) {
                sums[j] = _mm512_fmadd_ps(*f.add(1), _mm512_set1_ps(*x.sums[j].add(b)), sums[j]);
            }
        }
    }
}

/// Rows `r0..r0 + nr` of `s` times activation rows `i0..i0 + g` of `a`, into `dst[row * g +
/// j]`, within prefill span `span`.
pub(in crate::engine::quant) fn tile(
    s: &Segment,
    (r0, nr): (usize, usize),
    a: &Acts32,
    (i0, g): (usize, usize),
    dst: &mut [f32],
    span: u64,
) {
    assert!((1..=8).contains(&g), "a group of one to eight rows");
    let args = (s, r0, nr, a, i0, dst);
    match s.format {
        Format::Q4_0 => super::super::by_group!(span_lanes, Q4_0, g, span, args),
        Format::Q4_1 => super::super::by_group!(span_lanes, Q4_1, g, span, args),
        Format::Q5_0 => super::super::by_group!(span_lanes, Q5_0, g, span, args),
        Format::Q5_1 => super::super::by_group!(span_lanes, Q5_1, g, span, args),
        Format::Q8_0 => super::super::by_group!(span_lanes, Q8_0, g, span, args),
        other => unreachable!("{other:?} is a k-quant"),
    }
}

/// `tile` for format `F` and a group of G rows.
#[allow(clippy::type_complexity)]
fn span_lanes<const F: u8, const G: usize>(
    span: u64,
    (s, r0, nr, a, i0, dst): (&Segment, usize, usize, &Acts32, usize, &mut [f32]),
) {
    let (k, nb) = (a.k, a.k / BLOCK);
    assert!(
        s.cols == k && a.q.as_slice().len() >= (i0 + G) * k,
        "activations for the segment's columns"
    );
    let x = Rows::<G> {
        q: std::array::from_fn(|j| a.q.as_slice()[(i0 + j) * k..].as_ptr().cast()),
        scale: std::array::from_fn(|j| a.scale[(i0 + j) * nb..].as_ptr()),
        sums: std::array::from_fn(|j| a.sums[(i0 + j) * nb..].as_ptr()),
    };
    // SAFETY: asserted above: blocks < nb of rows < i0 + G, each row k wide.
    unsafe { super::span_lanes::<Q32<F>, G>(span, s, (r0, nr), &x, dst) }
}

/// Rows `r0..r0 + nr` of `s` times the `m` (≤ ACROSS_ROWS) rows of `a`, into `dst[row * m + j]`, with
/// the bits of `tile` (the lanes kernel) and no packing, for a prompt of a row or two (a fully
/// cached prompt's recomputed last token): each weight row's block meets the activation block
/// in one `vpdpwssd`, sixteen rows' lanes are added across (`reduce_halves`: exact integers,
/// so the lanes kernel's per-block sums), and the float steps are the lanes kernel's.
pub(in crate::engine::quant) fn across(
    s: &Segment,
    r0: usize,
    nr: usize,
    a: &Acts32,
    m: usize,
    dst: &mut [f32],
) {
    let (k, nb) = (a.k, a.k / BLOCK);
    assert!(
        (1..=ACROSS_ROWS).contains(&m)
            && s.cols == k
            && s.bytes().len() >= (r0 + nr) * s.row_bytes()
            && a.q.as_slice().len() >= m * k
            && dst.len() >= nr * m,
        "across rows: shapes"
    );
    // SAFETY: asserted above: every block of the sixteen rows and of the m activation rows
    // is in bounds.
    across_groups(s, (r0, nr), m, dst, |rows| unsafe {
        match s.format {
            Format::Q4_0 => across_group::<Q4_0>(rows, a, m, nb),
            Format::Q4_1 => across_group::<Q4_1>(rows, a, m, nb),
            Format::Q5_0 => across_group::<Q5_0>(rows, a, m, nb),
            Format::Q5_1 => across_group::<Q5_1>(rows, a, m, nb),
            Format::Q8_0 => across_group::<Q8_0>(rows, a, m, nb),
            other => unreachable!("{other:?} is a k-quant"),
        }
    });
}

/// Sixteen weight rows times activation rows `0..m`: lane `l` of row `j`'s sums is weight
/// row `l`'s result.
#[inline(always)]
unsafe fn across_group<const F: u8>(
    rows: &[*const u8; LANES],
    a: &Acts32,
    m: usize,
    nb: usize,
) -> [[f32; LANES]; ACROSS_ROWS] {
    let bb = <Q32<F> as LaneFormat>::BLOCK_BYTES;
    let mut sums = [_mm512_setzero_ps(); ACROSS_ROWS];
    for b in 0..nb {
        let mut w = [_mm512_setzero_si512(); LANES];
        let (mut d, mut mn) = ([0f32; LANES], [0f32; LANES]);
        for l in 0..LANES {
            let blk = rows[l].add(b * bb);
            // Sixteen rows' blocks ahead, 1 KiB on (every block of a row is in one line or two).
            _mm_prefetch::<_MM_HINT_T0>(blk.wrapping_add(1024).cast());
            (w[l], d[l], mn[l]) = prep::<F>(blk);
        }
        let (dv, mv) = (_mm512_loadu_ps(d.as_ptr()), _mm512_loadu_ps(mn.as_ptr()));
        for (j, sum) in sums.iter_mut().enumerate().take(m) {
            let x = _mm512_loadu_si512(a.q.as_slice()[j * a.k + b * BLOCK..].as_ptr().cast());
            let p = std::array::from_fn(|l| dot_acc(_mm512_setzero_si512(), w[l], x));
            let (lo, hi) = reduce_halves(&p);
            let scale = _mm512_mul_ps(dv, _mm512_set1_ps(a.scale[j * nb + b]));
            *sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), scale, *sum);
            if affine(F) {
                *sum = _mm512_fmadd_ps(mv, _mm512_set1_ps(a.sums[j * nb + b]), *sum);
            }
        }
    }
    let mut out = [[0f32; LANES]; ACROSS_ROWS];
    for (o, s) in out.iter_mut().zip(sums) {
        _mm512_storeu_ps(o.as_mut_ptr(), s);
    }
    out
}
