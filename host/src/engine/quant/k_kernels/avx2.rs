//! AVX2 + FMA kernel for the many x86 machines without AVX-512BW (Zen 2/3, client Intel).
//!
//! The packed 4-, 5- and 6-bit values stay bytes, and each run of 32 (a Q4_K/Q5_K sub-block,
//! two of Q6_K's) meets the activation row's bytes (`RowBytes`, element order) in
//! `vpmaddubsw` (32 products into 16-bit pair sums) and one `vpmaddwd` that applies the
//! sub-block scale as it adds the pairs: llama.cpp's Q8_K arithmetic. Rounded to 16 bits, a row
//! is its high bytes (signed) and low bytes (unsigned), the low ones meeting the values as the
//! signed operand, and the lane sums combine as `256·high + low`, the same integers as 16-bit
//! multiplies: two `vpmaddubsw` and two `vpmaddwd` per 32 products. This replaced a kernel that
//! widened every value to i16 with its scale folded in (a `vpmullo` per 16 values, then a
//! `vpmaddwd` and an add per 16 products per row): Qwen2.5-1.5B decode ran at half
//! llama.cpp's speed on AVX2.
//!
//! Q6_K's values carry an offset of 32: the high bytes meet `q` and lose `32·(hi + hi')` per
//! pair (`RowBytes::hs`), the low ones meet `q − 32`.
//!
//! Bounds: a pair sum is at most 2·63·128 + 32·256 (high, Q6_K) or 2·255·32 (low), inside
//! i16; at 16 bits a lane adds 16 products per half super-block, at most 16 · 4096 · 32767 <
//! 2³¹ (`k_kernels`' header), and each half goes to float once; at 8 bits the whole
//! super-block's 32 products a lane do (below 2²⁴ but for Q6_K's largest sums). Each result is
//! summed per chunk of CHUNK super-blocks in column order, one weight row at a time with the
//! same steps whatever the group, so a row's bits do not depend on the batch it is in.

use std::arch::x86_64::*;

use super::super::blocks::{f16_at, k4_scales_mins};
use super::super::{Format, Segment};
use super::{KActs, RowBytes, CHUNK, Q4K, Q5K, Q6K, QK, SUMS};

/// How far ahead of the block being multiplied a stream of weights is prefetched.
const PREFETCH: usize = 4096;

/// Rows `r0..r0 + nr` of `s` against activation rows `i0..i0 + g` (g ≤ 8), into
/// `dst[row * g + j]`. The same signature as the other paths' `tile`. Passes that read each
/// weight once from memory (`Walk::Stream`: decode, small batches) prefetch ahead: without it
/// Qwen2.5-1.5B's decode stalled on the weights' loads (8.5 tok/s, 8-bit rows).
#[allow(clippy::too_many_arguments)]
pub(in super::super) fn tile(
    s: &Segment,
    r0: usize,
    nr: usize,
    a: &KActs,
    i0: usize,
    g: usize,
    dst: &mut [f32],
    walk: super::super::Walk,
) {
    let x = a.bytes.as_ref().expect("AVX2 takes the rows as bytes");
    let args = (s, r0, nr, a, x, i0, dst, walk == super::super::Walk::Stream);
    macro_rules! by_rows {
        ($f:expr, $wide:expr) => {
            match g {
                1 => rows::<{ $f }, 1, $wide>(args),
                2 => rows::<{ $f }, 2, $wide>(args),
                3 => rows::<{ $f }, 3, $wide>(args),
                4 => rows::<{ $f }, 4, $wide>(args),
                5 => rows::<{ $f }, 5, $wide>(args),
                6 => rows::<{ $f }, 6, $wide>(args),
                7 => rows::<{ $f }, 7, $wide>(args),
                8 => rows::<{ $f }, 8, $wide>(args),
                _ => unreachable!("groups hold at most eight rows"),
            }
        };
    }
    macro_rules! by_format {
        ($wide:expr) => {
            match s.format {
                Format::Q4K => by_rows!(Q4K, $wide),
                Format::Q5K => by_rows!(Q5K, $wide),
                Format::Q6K => by_rows!(Q6K, $wide),
                other => unreachable!("{other:?} is not a k-quant"),
            }
        };
    }
    match x.lo.is_some() {
        true => by_format!(true),
        false => by_format!(false),
    }
}

/// `tile` for G rows, rounded to 16 bits (`WIDE`: high and low bytes) or to 8.
#[allow(clippy::type_complexity)]
fn rows<const F: u8, const G: usize, const WIDE: bool>(
    (s, r0, nr, a, x, i0, dst, stream): (
        &Segment,
        usize,
        usize,
        &KActs,
        &RowBytes,
        usize,
        &mut [f32],
        bool,
    ),
) {
    let (k, rb, bb) = (s.cols, s.row_bytes(), s.format.block_bytes());
    let nb = k / QK;
    let data = s.bytes();
    let rows_of = |len: usize, per: usize| len >= (i0 + G) * per;
    assert!(
        data.len() >= (r0 + nr) * rb
            && a.k == k
            && rows_of(x.hi.as_slice().len(), k)
            && rows_of(x.hs.as_slice().len(), k / 2)
            && x.lo.as_ref().map(|lo| rows_of(lo.as_slice().len(), k)) == WIDE.then_some(true)
            && rows_of(a.scale.len(), nb)
            && rows_of(a.sums.len(), nb * SUMS)
            && dst.len() >= nr * G
    );
    for t in 0..nr {
        let row = &data[(r0 + t) * rb..(r0 + t + 1) * rb];
        let out = &mut dst[t * G..(t + 1) * G];
        out.fill(0.0);
        for c0 in (0..nb).step_by(CHUNK) {
            // SAFETY: AVX2 and FMA are enabled for this module; the assert above bounds every
            // activation row and block read (rows < i0 + G, blocks < nb).
            let blocks = c0..nb.min(c0 + CHUNK);
            let acc = unsafe { chunk::<F, G, WIDE>(row, bb, (a, x), (i0, stream), blocks) };
            for (o, acc) in out.iter_mut().zip(acc) {
                *o += unsafe { hsum(acc) };
            }
        }
    }
}

/// One weight row's super-blocks `blocks` against the G rows: 8-lane partials.
#[inline(always)]
unsafe fn chunk<const F: u8, const G: usize, const WIDE: bool>(
    row: &[u8],
    bb: usize,
    (a, x): (&KActs, &RowBytes),
    (i0, stream): (usize, bool),
    blocks: std::ops::Range<usize>,
) -> [__m256; G] {
    let (k, nb) = (a.k, a.k / QK);
    let (hi, hs) = (x.hi.as_slice().as_ptr(), x.hs.as_slice().as_ptr());
    let lo =
        x.lo.as_ref()
            .map_or(std::ptr::null(), |lo| lo.as_slice().as_ptr());
    let mut acc = [_mm256_setzero_ps(); G];
    let (mut w, mut sc) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
    for b in blocks {
        if stream {
            // Three or four lines (super-blocks are 144 to 210 bytes), 4 KiB ahead as the
            // AVX-512 one-row kernel fetches; a prefetch past the matrix never faults.
            let ahead = row.as_ptr().wrapping_add(b * bb + PREFETCH);
            for line in (0..bb).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
            }
        }
        let (d, mins) = prep::<F>(&row[b * bb..(b + 1) * bb], &mut w, &mut sc);
        // As floats, broadcast where used: G vectors held across the runs spilled the sums.
        let scale: [f32; G] = std::array::from_fn(|j| d * a.scale[(i0 + j) * nb + b]);
        // 16-bit rows go to float per half super-block (exact, and inside i32), 8-bit ones
        // once per super-block: Q4_K/Q5_K's lanes stay exact (32 · 31 · 63 · 127 < 2²⁴), Q6_K's
        // round past 2²⁴ the same way in any group; the conversion and its FMA were a tenth
        // of prefill's instructions.
        let parts = if WIDE { 2 } else { 1 };
        for part in 0..parts {
            // Run by run, every row: the run's values and scales stay in registers and each
            // row's sum in one.
            let mut ia = [_mm256_setzero_si256(); G];
            for v in part * 8 / parts..(part + 1) * 8 / parts {
                let (wv, sv) = (w[v], sc[v]);
                let signed = match F == Q6K {
                    true => _mm256_sub_epi8(wv, _mm256_set1_epi8(32)),
                    false => wv,
                };
                for (j, ia) in ia.iter_mut().enumerate() {
                    let at = (i0 + j) * k + b * QK + 32 * v;
                    let mut hp = _mm256_maddubs_epi16(wv, _mm256_loadu_si256(hi.add(at).cast()));
                    if F == Q6K {
                        hp = _mm256_sub_epi16(hp, _mm256_loadu_si256(hs.add(at / 2).cast()));
                    }
                    if WIDE {
                        let l = _mm256_loadu_si256(lo.add(at).cast());
                        let lp = _mm256_maddubs_epi16(l, signed);
                        let high = _mm256_slli_epi32::<8>(_mm256_madd_epi16(hp, sv));
                        let sum = _mm256_add_epi32(high, _mm256_madd_epi16(lp, sv));
                        *ia = _mm256_add_epi32(*ia, sum);
                    } else {
                        *ia = _mm256_add_epi32(*ia, _mm256_madd_epi16(hp, sv));
                    }
                }
            }
            for ((acc, ia), &scale) in acc.iter_mut().zip(ia).zip(&scale) {
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(scale), *acc);
            }
        }
        if F != Q6K {
            for (j, acc) in acc.iter_mut().enumerate() {
                let sums = _mm256_loadu_ps(a.sums[((i0 + j) * nb + b) * SUMS..].as_ptr());
                *acc = _mm256_fnmadd_ps(mins, sums, *acc);
            }
        }
    }
    acc
}

/// One super-block's runs of 32 values as bytes in element order (`w[v]`: elements
/// `32v..32v + 32`) and each run's scales as 16-bit words (`sc[v]`: a Q4_K/Q5_K sub-block's
/// scale in every word; Q6_K's two sub-blocks' in the low and high halves, as `vpmaddubsw`
/// keeps a half's pairs in its half). Returns `d` and `dmin·m_j` per sub-block (zero for
/// Q6_K).
#[inline(always)]
unsafe fn prep<const F: u8>(
    blk: &[u8],
    w: &mut [__m256i; 8],
    sc: &mut [__m256i; 8],
) -> (f32, __m256) {
    let p = blk.as_ptr();
    if F == Q6K {
        let s = |j: usize| _mm_set1_epi16(i16::from(blk[192 + j] as i8));
        for n in 0..2 {
            for (i, q) in q6k_runs(p, n).into_iter().enumerate() {
                let v = 4 * n + i;
                w[v] = q;
                sc[v] = _mm256_set_m128i(s(2 * v + 1), s(2 * v));
            }
        }
        return (f16_at(blk, 208), _mm256_setzero_ps());
    }
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    let (scales, mn) = k4_scales_mins(&blk[4..16]);
    let mins = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(mn.as_ptr().cast()))),
        _mm256_set1_ps(dmin),
    );
    for (j, v) in k45_runs::<F>(p).into_iter().enumerate() {
        w[j] = v;
        sc[j] = _mm256_set1_epi16(i16::from(scales[j]));
    }
    (d, mins)
}

/// A Q4_K / Q5_K super-block's values as bytes, run `j` (elements `32j..32j + 32`, sub-block
/// `j`) in element order, Q5_K's fifth bits merged.
#[inline(always)]
unsafe fn k45_runs<const F: u8>(p: *const u8) -> [__m256i; 8] {
    let qs = if F == Q5K { p.add(48) } else { p.add(16) };
    let qh = _mm256_loadu_si256(p.add(16).cast());
    let m4 = _mm256_set1_epi8(0x0F);
    std::array::from_fn(|j| {
        let q = _mm256_loadu_si256(qs.add(32 * (j / 2)).cast());
        // Sub-block 2c is the low nibbles of bytes 32c.., 2c + 1 their high ones.
        let q = if j % 2 == 1 {
            _mm256_srli_epi16::<4>(q)
        } else {
            q
        };
        let v = _mm256_and_si256(q, m4);
        if F != Q5K {
            return v;
        }
        // Bit j of each `qh` byte is the fifth bit of that weight in sub-block j.
        let bit = _mm256_set1_epi8((1u8 << j) as i8);
        let set = _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit);
        _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(16)))
    })
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// A Q6_K block's 6-bit values for elements `128n..128n + 128`, as four runs of 32 bytes in
/// element order: low nibbles from `ql`, the two high bits from `qh` (bits 0-1, 2-3, 4-5, 6-7
/// for the four runs). 16-bit shifts are safe because the masks keep each byte's own bits.
#[inline(always)]
unsafe fn q6k_runs(b: *const u8, n: usize) -> [__m256i; 4] {
    use std::arch::x86_64::*;
    let (m4, m30) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let lo = _mm256_loadu_si256(b.add(64 * n).cast());
    let hi = _mm256_loadu_si256(b.add(64 * n + 32).cast());
    let h = _mm256_loadu_si256(b.add(128 + 32 * n).cast());
    [
        _mm256_or_si256(
            _mm256_and_si256(lo, m4),
            _mm256_and_si256(_mm256_slli_epi16(h, 4), m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(hi, m4),
            _mm256_and_si256(_mm256_slli_epi16(h, 2), m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(lo, 4), m4),
            _mm256_and_si256(h, m30),
        ),
        _mm256_or_si256(
            _mm256_and_si256(_mm256_srli_epi16(hi, 4), m4),
            _mm256_and_si256(_mm256_srli_epi16(h, 2), m30),
        ),
    ]
}
