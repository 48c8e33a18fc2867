//! K-quant prompt rows across the lanes on 8-bit activations (`prompt_precision = "int8"`,
//! llama.cpp's Q8_K rounding), for CPUs without AMX tiles.
//!
//! The 16-bit lanes kernel (`lanes.rs`) meets i16 weights, scales folded in, with one
//! `vpdpwssd` per two values of sixteen rows: 32 multiply-adds an instruction, its ceiling on
//! such a CPU. Here the packed values stay bytes (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63 before its
//! offset) and one `vpdpbusd` meets four values of each of sixteen weight rows with four
//! activation bytes broadcast: 64 multiply-adds. The sub-block scales cannot ride in the bytes
//! (a 4-bit value times a 6-bit scale passes 255), so each sub-block's lane sums go to float
//! and take their scale there, one conversion and one FMA per 32 values (16 for Q6_K). Those
//! sums are integers below 2²⁴ (Q6_K: 16 · 63 · 127 plus the offset term), so the conversion
//! is exact; the scaled sums then add up in a fixed order.
//!
//! Every k-quant prompt row takes this kernel at this setting, however many a step has (no
//! `few`, no `across`: their bits are the 16-bit kernel's), and a row's result does not depend
//! on the other rows of its group or span, so a row's bits do not depend on its batch.

use std::arch::x86_64::*;

use super::super::aligned::Aligned;
use super::super::lanes::{self, f16_at, transpose, LaneFormat, LaneKernel, LANES};
use super::super::Segment;
use super::avx512::{runs, scales_mins};
use super::{KActs, Q6K, QK, SUMS};
use crate::engine::team::{split, split_mut, Team};

/// Activation rows rounded to 8 bits (`KActs` at `ActivationBits::Eight`), as bytes.
pub(in super::super) struct Bytes8 {
    /// `[m][k]`: the values in element order, 4 per i32 word.
    q: Aligned<i8, 64>,
    /// `[m][k / 16]`: 32 times the sum of each 16 values: Q6_K's weights are `q − 32`, and the
    /// kernel multiplies `q`.
    off: Vec<i32>,
}

impl Bytes8 {
    /// From `m` rows of `KActs`' stored values (each run of 64: its even elements, then its
    /// odd ones), rows split across the team.
    pub(super) fn new(team: &Team, stored: &[i16], m: usize, k: usize) -> Self {
        assert!(stored.len() == m * k && k.is_multiple_of(QK));
        let mut q = Aligned::<i8, 64>::zeroed(m * k);
        let mut off = vec![0i32; m * k / 16];
        let parts = team.threads().min(m).max(1);
        let ranges: Vec<_> = (0..parts).map(|p| split(m, 1, p, parts)).collect();
        let qs = split_mut(q.as_mut_slice(), ranges.iter().map(|r| r.len() * k));
        let os = split_mut(&mut off, ranges.iter().map(|r| r.len() * k / 16));
        team.run(&|p, _| {
            let Some(range) = ranges.get(p) else { return };
            let mut q = qs[p].lock().unwrap_or_else(|e| e.into_inner());
            let mut o = os[p].lock().unwrap_or_else(|e| e.into_inner());
            let runs = stored[range.start * k..range.end * k].chunks_exact(64);
            for (run, out) in runs.zip(q.chunks_exact_mut(64)) {
                let (even, odd) = run.split_at(32);
                for (i, (&e, &o)) in even.iter().zip(odd).enumerate() {
                    debug_assert!(e.abs() <= 127 && o.abs() <= 127, "8-bit activations");
                    (out[2 * i], out[2 * i + 1]) = (e as i8, o as i8);
                }
            }
            for (o, xs) in o.iter_mut().zip(q.chunks_exact(16)) {
                *o = 32 * xs.iter().map(|&v| i32::from(v)).sum::<i32>();
            }
        });
        Self { q, off }
    }
}

/// Pointers to a group's activations.
pub(super) struct Acts8<const G: usize> {
    /// Each row's bytes as words of four.
    q: [*const i32; G],
    off: [*const i32; G],
    scale: [*const f32; G],
    sums: [*const f32; G],
}

impl<const G: usize> Acts8<G> {
    /// Rows `i0..i0 + G` of `a`, for weight rows `rows` of `s` and `dst_len` results: asserts
    /// that every block the kernel reads and every result it writes is in bounds.
    fn new(
        s: &Segment,
        rows: std::ops::Range<usize>,
        (a, b8): (&KActs, &Bytes8),
        i0: usize,
        dst_len: usize,
    ) -> Self {
        let (k, nb) = (a.k, a.k / QK);
        assert!(
            s.bytes().len() >= rows.end * s.row_bytes()
                && s.cols == k
                && b8.q.as_slice().len() >= (i0 + G) * k
                && b8.off.len() >= (i0 + G) * k / 16
                && a.scale.len() >= (i0 + G) * nb
                && a.sums.len() >= (i0 + G) * nb * SUMS
                && dst_len >= rows.len() * G
        );
        Self {
            q: std::array::from_fn(|j| b8.q.as_slice()[(i0 + j) * k..].as_ptr().cast()),
            off: std::array::from_fn(|j| b8.off[(i0 + j) * k / 16..].as_ptr()),
            scale: std::array::from_fn(|j| a.scale[(i0 + j) * nb..].as_ptr()),
            sums: std::array::from_fn(|j| a.sums[(i0 + j) * nb * SUMS..].as_ptr()),
        }
    }
}

/// Rows `r0..r0 + nr` of `s` times activation rows `i0..i0 + G` of `a` (which carries
/// `Bytes8`), into `dst[row * G + j]`, within prefill span `span`.
#[allow(clippy::type_complexity)]
pub(super) fn span_lanes<const F: u8, const G: usize>(
    span: u64,
    (s, r0, nr, a, i0, dst): (&Segment, usize, usize, &KActs, usize, &mut [f32]),
) {
    let b8 = a.bytes8.as_ref().expect("8-bit activation bytes");
    let x = Acts8::<G>::new(s, r0..r0 + nr, (a, b8), i0, dst.len());
    // SAFETY: `Acts8::new` checked every super-block of the G rows against `s`.
    unsafe { lanes::span_lanes::<K8Lanes<F>, G>(span, s, (r0, nr), &x, dst) };
}

/// `acc + Σ` of the products of `w`'s unsigned and `x`'s signed bytes, four per i32 lane
/// (`vpdpbusd`; `vpmaddubsw` and `vpmaddwd` without VNNI: a pair's sum is at most
/// 2 · 63 · 127, inside i16).
#[inline(always)]
unsafe fn dot8(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
    #[cfg(target_feature = "avx512vnni")]
    {
        _mm512_dpbusd_epi32(acc, w, x)
    }
    #[cfg(not(target_feature = "avx512vnni"))]
    {
        let pairs = _mm512_maddubs_epi16(w, x);
        _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)))
    }
}

/// The k-quant `F` across the lanes, as bytes.
struct K8Lanes<const F: u8>;

impl<const F: u8> K8Lanes<F> {
    /// Weight vectors per sub-block (four values of each row a vector).
    const PER_SUB: usize = if F == Q6K { 4 } else { 8 };
    /// Where the sub-block scales start among a block's float vectors.
    const SCALES: usize = if F == Q6K { 1 } else { 9 };
}

impl<const F: u8> LaneFormat for K8Lanes<F> {
    const ELEMS: usize = QK;
    /// Weight vectors per block: four bytes of each row a vector.
    const PAIRS: usize = QK / 4;
    /// `d`, then (Q4_K, Q5_K) `dmin·m_j` and the scales of the eight sub-blocks, or (Q6_K) the
    /// scales of its sixteen.
    const FLOATS: usize = 17;
    const BLOCK_BYTES: usize = [144, 176, 210][F as usize];

    unsafe fn pack_block(rows: &[*const u8; LANES], w: &mut Vec<__m512i>, f: &mut Vec<__m512>) {
        // Built whole rather than zeroed and overwritten: the zeroing was a 4 KiB memset a
        // block, a tenth of the packing.
        let v: [[__m512i; 4]; LANES] = std::array::from_fn(|l| runs::<F>(rows[l]));
        let mut d = [0f32; LANES];
        // Per sub-block, lane by lane: Q4_K/Q5_K's mins (first 8) and scales, or Q6_K's scales.
        let mut cols = [[0f32; LANES]; 16];
        for (l, &row) in rows.iter().enumerate() {
            if F == Q6K {
                d[l] = f16_at(row.add(208));
                for (j, col) in cols.iter_mut().enumerate() {
                    col[l] = f32::from(row.add(192 + j).cast::<i8>().read());
                }
            } else {
                let dmin = f16_at(row.add(2));
                d[l] = f16_at(row);
                let (sc, mn) = scales_mins(row.add(4));
                for j in 0..8 {
                    cols[j][l] = ((mn >> (8 * j)) & 0xFF) as f32 * dmin;
                    cols[8 + j][l] = ((sc >> (8 * j)) & 0xFF) as f32;
                }
            }
        }
        // Vector 16r + t: word t (values 64r + 4t..64r + 4t + 4) of run r of every row.
        w.extend((0..4).flat_map(|r| transpose(std::array::from_fn(|l| v[l][r]))));
        f.push(_mm512_loadu_ps(d.as_ptr()));
        f.extend(cols.iter().map(|c| _mm512_loadu_ps(c.as_ptr())));
    }
}

impl<const F: u8, const G: usize> LaneKernel<G> for K8Lanes<F> {
    type Acts = Acts8<G>;

    #[inline(always)]
    unsafe fn block(
        w: *const __m512i,
        f: *const __m512,
        x: &Acts8<G>,
        b: usize,
        sums: &mut [__m512; G],
    ) {
        let per = Self::PER_SUB;
        let words: [*const i32; G] = std::array::from_fn(|j| x.q[j].add(b * QK / 4));
        let mut fs = [_mm512_setzero_ps(); G];
        for sb in 0..QK / 4 / per {
            let mut ia = [_mm512_setzero_si512(); G];
            for t in sb * per..(sb + 1) * per {
                let wv = _mm512_load_si512(w.add(t).cast());
                for (j, ia) in ia.iter_mut().enumerate() {
                    *ia = dot8(*ia, wv, _mm512_set1_epi32(words[j].add(t).read_unaligned()));
                }
            }
            if F == Q6K {
                for (j, ia) in ia.iter_mut().enumerate() {
                    let off = *x.off[j].add(b * QK / 16 + sb);
                    *ia = _mm512_sub_epi32(*ia, _mm512_set1_epi32(off));
                }
            }
            let sc = *f.add(Self::SCALES + sb);
            for (fs, ia) in fs.iter_mut().zip(ia) {
                *fs = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), sc, *fs);
            }
        }
        for (j, sum) in sums.iter_mut().enumerate() {
            let scale = _mm512_mul_ps(*f, _mm512_set1_ps(*x.scale[j].add(b)));
            *sum = _mm512_fmadd_ps(fs[j], scale, *sum);
            if F != Q6K {
                let at = x.sums[j].add(b * SUMS);
                for m in 0..8 {
                    *sum = _mm512_fnmadd_ps(*f.add(1 + m), _mm512_set1_ps(*at.add(m)), *sum);
                }
            }
        }
    }
}
