//! AVX2 + FMA kernel for the many x86 machines without AVX-512BW (Zen 2/3, client Intel).
//!
//! The packed 4-, 5- and 6-bit values stay bytes, and each run of 32 (a Q4_K/Q5_K sub-block,
//! two of Q6_K's) meets the activation rows' bytes (`RowBytes`: a group's rows run by run) in
//! `vpmaddubsw` (32 products into 16-bit pair sums) and one `vpmaddwd` that applies the
//! sub-block scale as it adds the pairs: llama.cpp's Q8_K arithmetic. Rounded to 16 bits, a row
//! is its high bytes (signed) and low bytes (unsigned), the low ones meeting the values as the
//! signed operand, and the lane sums combine as `256·high + low`, the same integers as 16-bit
//! multiplies: two `vpmaddubsw` and two `vpmaddwd` per 32 products. This replaced a kernel that
//! widened every value to i16 with its scale folded in (a `vpmullo` per 16 values, then a
//! `vpmaddwd` and an add per 16 products per row): Qwen2.5-1.5B decode ran at half
//! llama.cpp's speed on AVX2.
//!
//! Q6_K's values carry an offset of 32. At 16 bits the high bytes meet `q` and lose
//! `32·(hi + hi')` per pair (`RowBytes::hs`), the low ones meet `q − 32`; at 8 bits the
//! offset comes off once per super-block (`chunk8`).
//!
//! Bounds: a pair sum is at most 2·63·128 + 32·256 (high, Q6_K at 16 bits) or 2·255·32 (low), inside
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
    // The group's bytes: G rows of k from `base`, kept run by run (`RowBytes`).
    let base = x.group(i0, G, k);
    let holds = |len: usize, per: usize| len >= (base + G * k) / per;
    assert!(
        data.len() >= (r0 + nr) * rb
            && a.k == k
            && holds(x.hi.as_slice().len(), 1)
            && holds(x.hs.as_slice().len(), 2)
            && holds(x.bs.as_slice().len(), 16)
            && x.lo.as_ref().map(|lo| holds(lo.as_slice().len(), 1)) == WIDE.then_some(true)
            && a.scale.len() >= (i0 + G) * nb
            && a.sums.len() >= (i0 + G) * nb * SUMS
            && dst.len() >= nr * G
    );
    // SAFETY (pointer offsets): inside the slices by the assert above.
    let group = unsafe {
        Group {
            hi: x.hi.as_slice().as_ptr().add(base),
            lo: x
                .lo
                .as_ref()
                .map_or(std::ptr::null(), |lo| lo.as_slice().as_ptr().add(base)),
            hs: x.hs.as_slice().as_ptr().add(base / 2),
            bs: x.bs.as_slice().as_ptr().add(base / 16),
            scale: a.scale.as_ptr().add(i0 * nb),
            sums: a.sums.as_ptr().add(i0 * nb * SUMS),
            nb,
            stream,
        }
    };
    for t in 0..nr {
        let row = &data[(r0 + t) * rb..(r0 + t + 1) * rb];
        let out = &mut dst[t * G..(t + 1) * G];
        out.fill(0.0);
        for c0 in (0..nb).step_by(CHUNK) {
            // SAFETY: AVX2 and FMA are enabled for this module; the assert above bounds every
            // activation row and block read (G rows of the group, blocks < nb).
            let blocks = c0..nb.min(c0 + CHUNK);
            let acc = unsafe {
                match WIDE {
                    true => chunk::<F, G>(row, bb, &group, blocks),
                    false => chunk8::<F, G>(row, bb, &group, blocks),
                }
            };
            for (o, acc) in out.iter_mut().zip(acc) {
                *o += unsafe { hsum(acc) };
            }
        }
    }
}

/// A group's activation bytes (`RowBytes`: run `v` of super-block `b`, row `j` at
/// `(8b + v)·32·G + 32j` from `hi` and `lo`, half that from `hs`; the row's 16 sums of block
/// `b` at `16·(G·b + j)` from `bs`) and the prepared rows' scales and sub-block sums (row `j`'s
/// of block `b` at `j·nb + b` from `scale`, `SUMS` times that from `sums`): pointers checked
/// once per call, where indexing the slices cost a multiply and a bounds check per row and
/// super-block.
struct Group {
    hi: *const i8,
    lo: *const u8,
    hs: *const i16,
    bs: *const i16,
    scale: *const f32,
    sums: *const f32,
    nb: usize,
    /// Whether the weights stream from memory (prefetched ahead).
    stream: bool,
}

/// One weight row's super-blocks `blocks` against the G rows rounded to 16 bits (high and
/// low bytes): 8-lane partials.
#[inline(always)]
unsafe fn chunk<const F: u8, const G: usize>(
    row: &[u8],
    bb: usize,
    x: &Group,
    blocks: std::ops::Range<usize>,
) -> [__m256; G] {
    let mut acc = [_mm256_setzero_ps(); G];
    let (mut w, mut sc) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
    for b in blocks {
        if x.stream {
            prefetch(row, b, bb);
        }
        let (d, mins) = prep::<F>(&row[b * bb..(b + 1) * bb], &mut w, &mut sc);
        // As floats, broadcast where used: G vectors held across the runs spilled the sums.
        let scale: [f32; G] = std::array::from_fn(|j| d * *x.scale.add(j * x.nb + b));
        // Each half super-block goes to float (exact, and inside i32).
        for part in 0..2 {
            // Run by run, every row: the run's values and scales stay in registers and each
            // row's sum in one.
            let mut ia = [_mm256_setzero_si256(); G];
            for v in part * 4..part * 4 + 4 {
                let (wv, sv) = (w[v], sc[v]);
                let signed = match F == Q6K {
                    true => _mm256_sub_epi8(wv, _mm256_set1_epi8(32)),
                    false => wv,
                };
                for (j, ia) in ia.iter_mut().enumerate() {
                    let at = (8 * b + v) * 32 * G + 32 * j;
                    let mut hp = _mm256_maddubs_epi16(wv, _mm256_loadu_si256(x.hi.add(at).cast()));
                    if F == Q6K {
                        hp = _mm256_sub_epi16(hp, _mm256_loadu_si256(x.hs.add(at / 2).cast()));
                    }
                    let l = _mm256_loadu_si256(x.lo.add(at).cast());
                    let lp = _mm256_maddubs_epi16(l, signed);
                    let high = _mm256_slli_epi32::<8>(_mm256_madd_epi16(hp, sv));
                    let sum = _mm256_add_epi32(high, _mm256_madd_epi16(lp, sv));
                    *ia = _mm256_add_epi32(*ia, sum);
                }
            }
            for ((acc, ia), &scale) in acc.iter_mut().zip(ia).zip(&scale) {
                *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), _mm256_set1_ps(scale), *acc);
            }
        }
        if F != Q6K {
            minus_mins(&mut acc, mins, x, b);
        }
    }
    acc
}

/// `chunk` for rows rounded to 8 bits, whose whole super-block goes to float once: Q4_K/Q5_K's
/// lanes stay exact (32 · 31 · 63 · 127 < 2²⁴), Q6_K's round past 2²⁴ the same way in any
/// group. Q6_K's values meet the rows unsigned (`q`, not `q − 32`), and the offset comes off
/// once per super-block: `32·Σ_j sc_j·Σ_{i∈j} x_i`, one `vpmaddwd` of the scales with the
/// row's sums of 16 (`RowBytes::bs`) where subtracting `hs` took a load and a subtract per
/// run and row (with the grouped rows, a Qwen2.5-shaped Q6_K prompt layer 1.3x faster).
#[inline(always)]
unsafe fn chunk8<const F: u8, const G: usize>(
    row: &[u8],
    bb: usize,
    x: &Group,
    blocks: std::ops::Range<usize>,
) -> [__m256; G] {
    let mut acc = [_mm256_setzero_ps(); G];
    let (mut w, mut sc) = ([_mm256_setzero_si256(); 8], [_mm256_setzero_si256(); 8]);
    for b in blocks {
        if x.stream {
            prefetch(row, b, bb);
        }
        let blk = &row[b * bb..(b + 1) * bb];
        let (d, mins) = prep::<F>(blk, &mut w, &mut sc);
        let mut ia = [_mm256_setzero_si256(); G];
        // A loop over the runs, not unrolled: indexed by the run, the values and scales stay
        // in memory and the G sums in registers. Unrolled, LLVM held all eight runs and
        // spilled the sums (Q4_K prefill 0.9x); an opaque trip count keeps the loop.
        for v in 0..std::hint::black_box(8) {
            let (wv, sv, xv) = (w[v], sc[v], x.hi.add((8 * b + v) * 32 * G));
            for (j, ia) in ia.iter_mut().enumerate() {
                let hp = _mm256_maddubs_epi16(wv, _mm256_loadu_si256(xv.add(32 * j).cast()));
                *ia = _mm256_add_epi32(*ia, _mm256_madd_epi16(hp, sv));
            }
        }
        if F == Q6K {
            // Each sub-block of 16's scale times 32, against the rows' sums of 16: at most
            // 2 · 128 · 32 · 16 · 127 a lane, beside the runs' 8 · 2 · 2 · 63 · 127 · 128.
            let sc = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.as_ptr().add(192).cast()));
            let sc = _mm256_slli_epi16::<5>(sc);
            let sums = x.bs.add(16 * G * b);
            for (j, ia) in ia.iter_mut().enumerate() {
                let bsum = _mm256_loadu_si256(sums.add(16 * j).cast());
                *ia = _mm256_sub_epi32(*ia, _mm256_madd_epi16(bsum, sc));
            }
        }
        for (j, (acc, ia)) in acc.iter_mut().zip(ia).enumerate() {
            let scale = _mm256_set1_ps(d * *x.scale.add(j * x.nb + b));
            *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ia), scale, *acc);
        }
        if F != Q6K {
            minus_mins(&mut acc, mins, x, b);
        }
    }
    acc
}

/// Three or four lines (super-blocks are 144 to 210 bytes), 4 KiB ahead of super-block `b` as
/// the AVX-512 one-row kernel fetches; a prefetch past the matrix never faults.
#[inline(always)]
unsafe fn prefetch(row: &[u8], b: usize, bb: usize) {
    let ahead = row.as_ptr().wrapping_add(b * bb + PREFETCH);
    for line in (0..bb).step_by(64) {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(line).cast());
    }
}

/// The mins' term, `dmin·m_j` times each row's sub-block sums, off the G rows' partials.
#[inline(always)]
unsafe fn minus_mins<const G: usize>(acc: &mut [__m256; G], mins: __m256, x: &Group, b: usize) {
    for (j, acc) in acc.iter_mut().enumerate() {
        let sums = _mm256_loadu_ps(x.sums.add((j * x.nb + b) * SUMS));
        *acc = _mm256_fnmadd_ps(mins, sums, *acc);
    }
}

/// A Q4_K / Q5_K super-block's `d` and `dmin·m_j` per sub-block, from its mins `mn`.
#[inline(always)]
unsafe fn k4_mins(blk: &[u8], mn: [u8; 8]) -> (f32, __m256) {
    let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
    let mins = _mm256_mul_ps(
        _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(mn.as_ptr().cast()))),
        _mm256_set1_ps(dmin),
    );
    (d, mins)
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
        for v in 0..8 {
            w[v] = q6k_run(p, v);
            sc[v] = _mm256_set_m128i(s(2 * v + 1), s(2 * v));
        }
        return (f16_at(blk, 208), _mm256_setzero_ps());
    }
    let (scales, mn) = k4_scales_mins(&blk[4..16]);
    let qh = _mm256_loadu_si256(p.add(16).cast());
    for (v, &s) in scales.iter().enumerate() {
        w[v] = k45_run::<F>(p, qh, v);
        sc[v] = _mm256_set1_epi16(i16::from(s));
    }
    k4_mins(blk, mn)
}

/// Run `j` of a Q4_K / Q5_K super-block at `p` (elements `32j..32j + 32`, sub-block `j`) as
/// bytes in element order, Q5_K's fifth bits (`qh`, its 32 bytes at `p + 16`) merged.
#[inline(always)]
unsafe fn k45_run<const F: u8>(p: *const u8, qh: __m256i, j: usize) -> __m256i {
    let qs = if F == Q5K { p.add(48) } else { p.add(16) };
    let m4 = _mm256_set1_epi8(0x0F);
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
}

#[inline(always)]
unsafe fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
}

/// Run `v` of a Q6_K block at `b` (elements `32v..32v + 32`) as 6-bit values in element order.
/// Elements `128n..128n + 128` are four runs: low nibbles of `ql`'s 64 bytes at `64n` (runs 0
/// and 1), then their high nibbles (runs 2 and 3); the two high bits from `qh`'s 32 bytes at
/// `128 + 32n`, bits 0-1, 2-3, 4-5, 6-7 for the four runs. 16-bit shifts are safe because the
/// masks keep each byte's own bits.
#[inline(always)]
unsafe fn q6k_run(b: *const u8, v: usize) -> __m256i {
    let (n, i) = (v / 4, v % 4);
    let (m4, m30) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x30));
    let l = _mm256_loadu_si256(b.add(64 * n + 32 * (i % 2)).cast());
    let l = if i >= 2 { _mm256_srli_epi16::<4>(l) } else { l };
    let h = _mm256_loadu_si256(b.add(128 + 32 * n).cast());
    // High bits of run i are bits 2i, 2i + 1 of h, moved to bits 4 and 5.
    let h = match i {
        0 => _mm256_slli_epi16::<4>(h),
        1 => _mm256_slli_epi16::<2>(h),
        2 => h,
        _ => _mm256_srli_epi16::<2>(h),
    };
    _mm256_or_si256(_mm256_and_si256(l, m4), _mm256_and_si256(h, m30))
}
