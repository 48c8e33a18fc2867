//! Generated rows rounded to 8 bits (llama.cpp's Q8_K) against the k-quants, with `vpdpbusd`
//! (AVX-512 VNNI): 64 products of a weight byte and an activation byte per instruction.
//!
//! The 16-bit batch kernel (`avx512::rows`) unpacks each super-block to eight i16 vectors with
//! the sub-block scales multiplied in, and each activation row meets them in eight `vpdpwssd`;
//! the bytes' one-row kernel pays two multiplies per 64 products (`vpmaddubsw`, then the scales
//! in `vpdpwssd`). A verification step of two to five rows was bound by those multiplies
//! (Qwen2.5 1.5B: 22-34 ms a step against 16 for one row, on two Zen 5 threads).
//!
//! Here both sides are stored so that every i32 lane of every vector belongs to one 16-weight
//! sub-block, the same one in all four vectors of a super-block: lane `L` of vector `v` takes
//! elements `16L + 4v .. 16L + 4v + 4` ("quad order"). Four `vpdpbusd` then leave each lane the
//! exact integer sum of a whole 16-element sub-block, and one `vpmulld` applies its scale (a
//! Q4_K/Q5_K sub-block of 32 is lanes `2j` and `2j + 1`): five multiplies a row per super-block
//! instead of eight, the activations in half the bytes, and the weights' unpacking (a dword
//! permute, a shift and a mask per vector, no 16-bit multiply) shared by the group's rows.
//!
//! One row and a batch take this same code, so a row's bits do not depend on its batch; the
//! float steps after each super-block are the other kernels' (`avx512::fold`, `add_chunk`).
//! The integer sum of a super-block is the one every kernel computes; which products share a
//! lane, and so the last bits of the float sum, differ from the 16-bit kernels', which never
//! see 8-bit generated rows.

use std::arch::x86_64::*;

use super::super::aligned::Aligned;
use super::super::lanes::f16_at;
use super::super::Segment;
// The 16-bit kernels' prefetch distances: a lone row streams at 4 KiB, a group at about 8.
use super::avx512::{
    add_chunk, fold, order, prefetch_at, scales_mins, Acts, PREFETCH, PREFETCH_ONE,
};
use super::{stored_slot, KActs, CHUNK, Q5K, Q6K, QK};

/// Where element `e` of a super-block is kept in quad order.
const fn quad_slot(e: usize) -> usize {
    64 * (e % 16 / 4) + 4 * (e / 16) + e % 4
}

/// For each quad-order position, the stored position of its element.
static FROM_STORED: [u8; QK] = {
    let mut t = [0u8; QK];
    let mut e = 0;
    while e < QK {
        t[quad_slot(e)] = stored_slot(e) as u8;
        e += 1;
    }
    t
};

/// Activation rows rounded to 8 bits, in quad order.
pub(in super::super) struct Quads {
    /// `[m][k]` bytes.
    x: Aligned<i8, 64>,
    /// `[m][k / 256][16]`: `32·Σ` of each 16-element sub-block, Q6_K's offset of 32 times the
    /// activations.
    off: Aligned<i32, 16>,
}

impl Quads {
    /// From `m` rows of `k` activations as `KActs` stores them (rounded to 8 bits).
    pub(super) fn new(q: &[i16], m: usize, k: usize) -> Self {
        let nb = k / QK;
        let (mut x, mut off) = (Aligned::zeroed(m * k), Aligned::zeroed(m * nb * 16));
        let blocks = q.chunks_exact(QK).take(m * nb);
        let dst = x.as_mut_slice().chunks_exact_mut(QK);
        for ((src, dst), off) in blocks.zip(dst).zip(off.as_mut_slice().chunks_exact_mut(16)) {
            for (d, &s) in dst.iter_mut().zip(&FROM_STORED) {
                *d = src[usize::from(s)] as i8;
            }
            // Quad order keeps a sub-block's 16 elements in lane L of the four vectors.
            for (l, off) in off.iter_mut().enumerate() {
                let lane = (0..4).flat_map(|v| &dst[64 * v + 4 * l..64 * v + 4 * l + 4]);
                *off = 32 * lane.map(|&b| i32::from(b)).sum::<i32>();
            }
        }
        Self { x, off }
    }
}

/// A table `[v][L]` of `$f(L, v)` (a macro: a const initializer cannot call a closure).
macro_rules! lanes {
    (|$l:ident, $v:ident| $f:expr) => {{
        let mut t = [[0i32; 16]; 4];
        let mut $v = 0;
        while $v < 4 {
            let mut $l = 0;
            while $l < 16 {
                t[$v][$l] = $f as i32;
                $l += 1;
            }
            $v += 1;
        }
        t
    }};
}

/// Dword index vectors of the weights' unpacking, one per quad vector `v`, for lanes L:
/// - `QS45`: the Q4_K/Q5_K `qs` dword (of 32) holding elements `16L + 4v ..` (sub-block
///   `j = L/2` is the low (j even) or high nibbles of `qs[32(j/2)..]`);
/// - `QH5`: the Q5_K `qh` dword (of 8) with their fifth bits (bit j of `qh[e % 32]`);
/// - `QL6` / `QH6`: the Q6_K `ql` dword (of 32) and `qh` dword (of 16).
static QS45: [[i32; 16]; 4] = lanes!(|l, v| 8 * (l / 4) + 4 * (l % 2) + v);
static QH5: [[i32; 16]; 4] = lanes!(|l, v| 4 * (l % 2) + v);
static QL6: [[i32; 16]; 4] = lanes!(|l, v| 16 * (l / 8) + 8 * (l / 2 % 2) + 4 * (l % 2) + v);
static QH6: [[i32; 16]; 4] = lanes!(|l, v| 8 * (l / 8) + 4 * (l % 2) + v);
/// Per lane: the nibble's shift (Q4_K/Q5_K, Q6_K), and the left rotation that brings Q5_K's
/// bit `j` (Q6_K's bits `2t, 2t + 1`, t the quarter of its 128) to bit 4 of each byte.
static SHIFT45: [i32; 16] = lanes!(|l, _v| 4 * (l / 2 % 2))[0];
static SHIFT6: [i32; 16] = lanes!(|l, _v| 4 * (l / 4 % 2))[0];
static ROT5: [i32; 16] = lanes!(|l, _v| (36 - l / 2) % 32)[0];
static ROT6: [i32; 16] = lanes!(|l, _v| (36 - 2 * (l % 8 / 2)) % 32)[0];

#[inline(always)]
unsafe fn table(t: &[i32; 16]) -> __m512i {
    _mm512_loadu_si512(t.as_ptr().cast())
}

/// A super-block's values as four vectors of bytes in quad order, the i32 scale of each lane's
/// sub-block, `d`, and `dmin·m_j` in lanes 0..8 (zero for Q6_K).
#[inline(always)]
unsafe fn weights<const F: u8>(b: *const u8) -> ([__m512i; 4], __m512i, f32, __m512) {
    let mut w = [_mm512_setzero_si512(); 4];
    if F == Q6K {
        let (lo, hi) = (
            _mm512_loadu_si512(b.cast()),
            _mm512_loadu_si512(b.add(64).cast()),
        );
        let qh = _mm512_loadu_si512(b.add(128).cast());
        let (m4, m30) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(0x30));
        for (v, w) in w.iter_mut().enumerate() {
            let low = _mm512_permutex2var_epi32(lo, table(&QL6[v]), hi);
            let low = _mm512_srlv_epi32(low, table(&SHIFT6));
            let high = _mm512_permutexvar_epi32(table(&QH6[v]), qh);
            let high = _mm512_and_si512(_mm512_rolv_epi32(high, table(&ROT6)), m30);
            // (low & 0x0F) | high
            *w = _mm512_ternarylogic_epi32::<0xEC>(low, high, m4);
        }
        let sc = _mm512_cvtepi8_epi32(_mm_loadu_si128(b.add(192).cast()));
        return (w, sc, f16_at(b.add(208)), _mm512_setzero_ps());
    }
    let qs = b.add(if F == Q5K { 48 } else { 16 });
    let (lo, hi) = (
        _mm512_loadu_si512(qs.cast()),
        _mm512_loadu_si512(qs.add(64).cast()),
    );
    let m4 = _mm512_set1_epi8(0x0F);
    for (v, w) in w.iter_mut().enumerate() {
        let q = _mm512_permutex2var_epi32(lo, table(&QS45[v]), hi);
        *w = _mm512_and_si512(_mm512_srlv_epi32(q, table(&SHIFT45)), m4);
    }
    if F == Q5K {
        // Only dwords 0..8 are indexed: the upper half of the cast is never read.
        let qh = _mm512_castsi256_si512(_mm256_loadu_si256(b.add(16).cast()));
        let m10 = _mm512_set1_epi8(0x10);
        for (v, w) in w.iter_mut().enumerate() {
            let h = _mm512_rolv_epi32(_mm512_permutexvar_epi32(table(&QH5[v]), qh), table(&ROT5));
            // w | (h & 0x10)
            *w = _mm512_ternarylogic_epi32::<0xF8>(*w, h, m10);
        }
    }
    let (d, dmin) = (f16_at(b), f16_at(b.add(2)));
    let (sc, mn) = scales_mins(b.add(4));
    let sc = _mm_cvtsi64_si128(sc as i64);
    let sc = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(sc, sc));
    let mins = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128(mn as i64))),
        _mm512_set1_ps(dmin),
    );
    (w, sc, d, mins)
}

/// `acc` plus the 64 products of the unsigned bytes `w` and the signed bytes `x`, four to a
/// lane. The intrinsic, not `asm!` as `avx512::dpwssd`: LLVM has no two-instruction form of
/// `vpdpbusd` to lower it to, and it folds the activation loads into the multiplies (a
/// Qwen2.5-shaped step of five rows, 15 instructions a row and super-block with them apart).
#[inline(always)]
unsafe fn dpbusd(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
    _mm512_dpbusd_epi32(acc, w, x)
}

/// One activation row's super-block (`x`, 256 bytes; `off`, its Q6_K offsets) against the
/// weights: each lane's sub-block sum times its scale. A lane's sum is at most
/// 16 · 63 · 127 (Q6_K's six-bit values) before the scale, so i32 holds it exactly.
#[inline(always)]
unsafe fn row_sum<const F: u8>(
    w: &[__m512i; 4],
    sc: __m512i,
    x: *const __m512i,
    off: *const __m512i,
) -> __m512i {
    let mut a = dpbusd(_mm512_setzero_si512(), w[0], _mm512_load_si512(x));
    a = dpbusd(a, w[1], _mm512_load_si512(x.add(1)));
    a = dpbusd(a, w[2], _mm512_load_si512(x.add(2)));
    a = dpbusd(a, w[3], _mm512_load_si512(x.add(3)));
    if F == Q6K {
        a = _mm512_sub_epi32(a, _mm512_load_si512(off));
    }
    _mm512_mullo_epi32(a, sc)
}

/// Weight rows `r0..r0 + nr` times activation rows `i0..i0 + G` in quad order, into
/// `dst[row * G + j]`, one weight row after another (prefetched ahead when `stream`: decode
/// and small batches read the weights from memory).
#[allow(clippy::type_complexity)]
pub(super) fn rows<const F: u8, const G: usize>(
    stream: bool,
    args: (&Segment, usize, usize, &KActs, usize, &mut [f32]),
) {
    // A constant in the loop: tested there per super-block, eight Qwen2.5-shaped rows took
    // 35.7-39.3 ms against 34.9-37.8.
    match stream {
        true => walk::<F, G, true>(args),
        false => walk::<F, G, false>(args),
    }
}

/// `rows`, prefetching when `P`.
#[allow(clippy::type_complexity)]
fn walk<const F: u8, const G: usize, const P: bool>(
    (s, r0, nr, a, i0, dst): (&Segment, usize, usize, &KActs, usize, &mut [f32]),
) {
    let (k, rb, data, bb) = (s.cols, s.row_bytes(), s.bytes(), s.format.block_bytes());
    let nb = k / QK;
    let x = Acts::<G>::new(s, r0..r0 + nr, a, i0, dst.len());
    let quads = a
        .quads
        .as_ref()
        .expect("rows rounded to 8 bits in quad order");
    assert!(quads.x.as_slice().len() >= (i0 + G) * k);
    assert!(quads.off.as_slice().len() >= (i0 + G) * nb * 16);
    let xq: [*const __m512i; G] =
        std::array::from_fn(|j| quads.x.as_slice()[(i0 + j) * k..].as_ptr().cast());
    let off: [*const __m512i; G] =
        std::array::from_fn(|j| quads.off.as_slice()[(i0 + j) * nb * 16..].as_ptr().cast());
    // A group prefetches whole rows ahead, as `avx512::rows` does: the same super-block of a
    // later row is what a walk chunk by chunk reads next (six and eight Qwen2.5-shaped rows,
    // 8 KiB ahead in the same row: 33.0-34.3 / 37.8-39.6 ms; two rows ahead: 30.6-32.2 /
    // 34.8-37.5), and about PREFETCH bytes ahead in address order otherwise.
    let pf = match G {
        1 => PREFETCH_ONE,
        _ => PREFETCH.div_ceil(rb) * rb,
    };
    // Rows walk the weights in address order up to 48 KiB of activations (Zen 5's L1):
    // Qwen2.5-shaped steps, three to five rows (8960-wide rows 27-45 KiB), 24.3-24.7 /
    // 27.5-28.2 / 33.4-34.0 ms chunk by chunk against 20.5-21.2 / 25.2-25.6 / 31.5-32.5 row
    // by row; always row by row, six and eight rows fell from 37 / 42 to 39-43 / 50-52.
    for (c, t) in order(G * k / 2, k, nr) {
        let c0 = c * CHUNK;
        // SAFETY: plain AVX-512F.
        let mut acc = [unsafe { _mm512_setzero_ps() }; G];
        let row = data[(r0 + t) * rb..].as_ptr();
        for b in c0..nb.min(c0 + CHUNK) {
            // SAFETY: super-block b < nb of weight row r0 + t < r0 + nr, and activation block
            // b < nb of rows < i0 + G, within the bounds asserted above and by `Acts::new`;
            // each block's 256 bytes and 16 offsets are whole lines of the aligned buffers.
            unsafe {
                let blk = row.add(b * bb);
                if P {
                    prefetch_at(blk.wrapping_add(pf), bb);
                }
                let (w, sc, d, mins) = weights::<F>(blk);
                // Written out per row, as `avx512::block` is (a loop stayed rolled).
                macro_rules! each_row {
                    ($($j:literal)*) => {$(
                        if $j < G {
                            let ia = row_sum::<F>(&w, sc, xq[$j].add(4 * b), off[$j].add(b));
                            acc[$j] = fold::<F, G>(acc[$j], ia, d, mins, &x, $j, b);
                        }
                    )*};
                }
                each_row!(0 1 2 3 4 5 6 7);
            }
        }
        add_chunk(&acc, &mut dst[t * G..(t + 1) * G], c0 == 0);
    }
}

#[cfg(test)]
mod tests {
    use super::super::super::{ActivationBits, Bytes, Format, QuantMatrix};
    use super::super::{dot_row, KActs};
    use crate::engine::team::Team;

    /// Random super-blocks (every nibble, high bit and scale pattern) with finite `d` and
    /// `dmin` near 2⁻¹⁰.
    fn random(format: Format, n: usize, k: usize) -> QuantMatrix {
        let mut state = 0x9E37_79B9_7F4A_7C15u64 ^ format.block_bytes() as u64;
        let mut data: Vec<u8> = (0..n * k / 256 * format.block_bytes())
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            })
            .collect();
        let small = half::f16::from_f32(1.0 / 1024.0).to_le_bytes();
        let scales: &[usize] = if format == Format::Q6K {
            &[208]
        } else {
            &[0, 2]
        };
        for block in data.chunks_exact_mut(format.block_bytes()) {
            for &at in scales {
                block[at..at + 2].copy_from_slice(&small);
            }
        }
        QuantMatrix::new(format, n, k, Bytes::Owned(data)).unwrap()
    }

    /// 6400-wide rows (25 super-blocks: four whole chunks and a short one): eight rows of them
    /// are 50 KiB, so a group of eight walks chunk by chunk and smaller groups row by row. Every
    /// row has the scalar dot's value and, in every group size, the bits it has alone.
    #[test]
    fn a_row_has_the_scalar_value_and_its_bits_alone_in_every_group() {
        let team = Team::new(2);
        let (n, k, m) = (19, 6400, 8);
        let bits = ActivationBits::EightButQ8_0;
        for format in [Format::Q4K, Format::Q5K, Format::Q6K] {
            let qm = random(format, n, k);
            let seg = &qm.segments[0];
            let x: Vec<f32> = (0..m * k)
                .map(|i| ((i * 29 % 41) as f32 - 20.0) * 0.03)
                .collect();
            let acts = KActs::new(&team, &x, m, k, bits);
            let alone: Vec<Vec<f32>> = (0..m)
                .map(|i| {
                    let mut out = vec![f32::NAN; n];
                    qm.batch(&team, &x[i * k..(i + 1) * k], 1, bits, &mut out);
                    out
                })
                .collect();
            for g in [2, 5, 8] {
                let mut out = vec![f32::NAN; g * n];
                qm.batch(&team, &x[..g * k], g, bits, &mut out);
                for i in 0..g {
                    for r in 0..n {
                        let row = &seg.bytes()[r * seg.row_bytes()..(r + 1) * seg.row_bytes()];
                        let want = dot_row(seg.format, row, &acts, i);
                        let got = out[i * n + r];
                        assert!(
                            (got - want).abs() <= 1e-4 * want.abs().max(1.0),
                            "{format:?} g={g} ({i},{r}): {got} vs {want}"
                        );
                        assert_eq!(got.to_bits(), alone[i][r].to_bits(), "{format:?} g={g}");
                    }
                }
            }
        }
    }
}
