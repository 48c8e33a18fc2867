//! A block of a 32-element format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) as BF16, for the tiles.
//!
//! The quants are unpacked in element order as signed bytes (the unsigned formats' offset
//! taken off as an integer, so `(q - 8)·d` is exact before its one rounding), widened to f32,
//! scaled by `d` (plus `m` for the `_1` formats) and put in `chunk_order`, the order the
//! k-quant unpacker gives and the activations' tiles take: the tiles then need no second
//! layout.

use std::arch::x86_64::*;

use super::super::Format;

/// The block of `format` at `b` as 32 BF16 values, value `q` being element `chunk_order(q)`.
///
/// # Safety
/// `b` must address a whole block of `format` (`format.block_bytes()` bytes); AVX-512 BW, VL
/// and BF16 must be present.
#[inline(always)]
pub(super) unsafe fn block(format: Format, b: *const u8) -> __m512i {
    let f16 = |at: usize| half::f16::from_bits(u16::from_le_bytes([*b.add(at), *b.add(at + 1)]));
    let d = f16(0).to_f32();
    let (q, m) = match format {
        Format::Q4_0 => (_mm256_sub_epi8(nibbles(b.add(2)), _mm256_set1_epi8(8)), 0.0),
        Format::Q4_1 => (nibbles(b.add(4)), f16(2).to_f32()),
        Format::Q5_0 => {
            let q = _mm256_or_si256(nibbles(b.add(6)), fifth_bits(b.add(2)));
            (_mm256_sub_epi8(q, _mm256_set1_epi8(16)), 0.0)
        }
        Format::Q5_1 => (
            _mm256_or_si256(nibbles(b.add(8)), fifth_bits(b.add(4))),
            f16(2).to_f32(),
        ),
        Format::Q8_0 => (_mm256_loadu_si256(b.add(2).cast()), 0.0),
        other => unreachable!("{other:?} is a k-quant"),
    };
    let (d, m) = (_mm512_set1_ps(d), _mm512_set1_ps(m));
    let lo = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
        d,
        m,
    );
    let hi = _mm512_fmadd_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256::<1>(q))),
        d,
        m,
    );
    super::chunk_bf16(lo, hi)
}

/// Sixteen bytes of nibbles as 32 values in element order: the low nibbles are elements
/// 0..16, the high ones 16..32.
#[inline(always)]
unsafe fn nibbles(p: *const u8) -> __m256i {
    let v = _mm_loadu_si128(p.cast());
    let mask = _mm_set1_epi8(0x0F);
    let (lo, hi) = (
        _mm_and_si128(v, mask),
        _mm_and_si128(_mm_srli_epi16::<4>(v), mask),
    );
    _mm256_set_m128i(hi, lo)
}

/// The fifth bits of Q5_0 / Q5_1 (bit `e` of the little-endian u32 at `p` is element `e`'s)
/// as 16 in the elements that have one.
#[inline(always)]
unsafe fn fifth_bits(p: *const u8) -> __m256i {
    let qh = u32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]);
    _mm256_maskz_set1_epi8(qh, 0x10)
}
