//! A k-quant super-block as BF16, for the AMX prompt kernel (`quant::tiles`).
//!
//! `prep` already unpacks a super-block for the batch kernels: run `r`'s even elements, then
//! its odd ones, as i16 with the sub-block scales folded in, with `d` and each sub-block's
//! `dmin·m_j`. A weight is then `d · v − dmin·m_j`, computed in f32 and rounded to BF16
//! once. Each 32-element chunk keeps `prep`'s order, its 16 even elements then its 16 odd
//! ones (`chunk_order`): the activations are put in the same order, which costs one permute
//! per 32 activations where reordering the weights would cost one per 32 weights.

use std::arch::x86_64::*;

use super::super::Format;
use super::avx512::prep;
use super::{Q4K, Q5K, Q6K};

/// `super_block` for a k-quant `format`.
///
/// # Safety
/// As `super_block`'s.
#[inline(always)]
pub(in super::super) unsafe fn block(format: Format, b: *const u8) -> [__m512i; 8] {
    match format {
        Format::Q4K => super_block::<Q4K>(b),
        Format::Q5K => super_block::<Q5K>(b),
        Format::Q6K => super_block::<Q6K>(b),
        other => unreachable!("{other:?} is not a k-quant"),
    }
}

/// Where value `q` of a chunk as `super_block` orders it comes from in element order.
pub(in super::super) const fn chunk_order(q: usize) -> usize {
    if q < 16 {
        2 * q
    } else {
        2 * (q - 16) + 1
    }
}

/// The super-block of format `F` at `b`: vector `c` holds elements `32c .. 32c + 32` as BF16,
/// value `q` being element `32c + chunk_order(q)`.
///
/// # Safety
/// `b` must address a whole super-block of format `F`; AVX-512 BF16 must be present.
#[inline(always)]
unsafe fn super_block<const F: u8>(b: *const u8) -> [__m512i; 8] {
    let (w, d, mins) = prep::<F>(b);
    let d = _mm512_set1_ps(d);
    let mut m = [0f32; 16];
    _mm512_storeu_ps(m.as_mut_ptr(), mins);
    // Chunk c is half c % 2 of run c / 2, and sub-block c of the 32-element sub-blocks whose
    // `dmin·m_j` `prep` returns (Q6_K's 16-element scales are folded into `w`; its mins are 0).
    let wide = |v: __m512i, hi: bool| {
        let h = match hi {
            false => _mm512_castsi512_si256(v),
            true => _mm512_extracti64x4_epi64::<1>(v),
        };
        _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(h))
    };
    std::array::from_fn(|c| {
        let (r, hi, min) = (c / 2, c % 2 == 1, _mm512_set1_ps(m[c]));
        let even = _mm512_fmsub_ps(wide(w[2 * r], hi), d, min);
        let odd = _mm512_fmsub_ps(wide(w[2 * r + 1], hi), d, min);
        std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(odd, even))
    })
}
