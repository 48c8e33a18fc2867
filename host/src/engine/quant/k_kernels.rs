//! Q4_K, Q5_K and Q6_K (256-weight super-blocks) times activations rounded to 16-bit integers.
//!
//! Per super-block `b` of a weight row and activation row `x ≈ s_b · x16`:
//! - Q4_K / Q5_K: `w = d·sc_j·q − dmin·m_j` for sub-block `j` (32 weights), so
//!   `w·x = d·s_b·Σ_j Σ (sc_j·q)·x16 − dmin·Σ_j m_j·Σ_{i∈j} x_i`. The first sum is exact integer
//!   arithmetic (`sc_j·q` fits in i16, the products of a super-block in i32); the second uses
//!   the float sums of the unrounded activations, computed once per activation row.
//! - Q6_K: `w = d·sc_j·(q − 32)` for 16-weight sub-blocks: `w·x = d·s_b·Σ (sc_j·(q − 32))·x16`.
//!
//! Bounds (why i32 never overflows): |x16| ≤ 32767 and each i32 lane takes 16 products of a
//! super-block: Q4_K |sc·q| ≤ 63·15, Q5_K ≤ 63·31, Q6_K ≤ 128·32 = 4096, so the largest lane
//! sum is 16 · 4096 · 32767 < 2³¹.

use super::aligned::Aligned;
use crate::engine::team::{split, split_mut, Team};

/// Elements per super-block.
pub(super) const QK: usize = 256;
/// Float sums stored per super-block: 8 sub-block sums, then 8 zeros (one 16-lane load).
const SUMS: usize = 16;

/// Activation rows prepared for the k-quant kernels.
pub(super) struct KActs {
    k: usize,
    /// `[m][k]`: each 256-element block scaled so its largest magnitude is 32767.
    q: Aligned<i16, 32>,
    /// `[m][k / 256]`: the scale of each block (`x ≈ q · scale`).
    scale: Vec<f32>,
    /// `[m][k / 256][16]`: each 32-element sub-block's float sum, zero padded.
    sums: Vec<f32>,
}

impl KActs {
    /// Quantizes the `m` rows of `x` (`[m][k]`, `k` a multiple of 256), rows split across the
    /// team.
    pub(super) fn new(team: &Team, x: &[f32], m: usize, k: usize) -> Self {
        assert!(k.is_multiple_of(QK), "k-quant rows are whole super-blocks");
        let nb = k / QK;
        let mut q = Aligned::zeroed(m * k);
        let mut scale = vec![0f32; m * nb];
        let mut sums = vec![0f32; m * nb * SUMS];
        let parts = team.threads().min(m);
        let ranges: Vec<_> = (0..parts).map(|p| split(m, 1, p, parts)).collect();
        let qs = split_mut(q.as_mut_slice(), ranges.iter().map(|r| r.len() * k));
        let ss = split_mut(&mut scale, ranges.iter().map(|r| r.len() * nb));
        let us = split_mut(&mut sums, ranges.iter().map(|r| r.len() * nb * SUMS));
        let job = |p: usize, _: usize| {
            if p >= parts {
                return;
            }
            let mut q = qs[p].lock().unwrap_or_else(|e| e.into_inner());
            let mut s = ss[p].lock().unwrap_or_else(|e| e.into_inner());
            let mut u = us[p].lock().unwrap_or_else(|e| e.into_inner());
            let x = &x[ranges[p].start * k..ranges[p].end * k];
            for (i, xb) in x.chunks_exact(QK).enumerate() {
                s[i] = quantize_block(xb, &mut q[i * QK..(i + 1) * QK]);
                for (j, sub) in xb.chunks_exact(32).enumerate() {
                    u[i * SUMS + j] = sub.iter().sum();
                }
            }
        };
        if parts > 1 {
            team.run(&job);
        } else {
            job(0, 1);
        }
        Self { k, q, scale, sums }
    }

    fn q(&self) -> &[i16] {
        self.q.as_slice()
    }
}

/// Rounds one block to i16 (ties to even, so it vectorises); returns its scale.
fn quantize_block(x: &[f32], q: &mut [i16]) -> f32 {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    if !(amax > 0.0 && amax.is_finite()) {
        q.fill(0);
        return 0.0;
    }
    let inv = 32767.0 / amax;
    for (q, &v) in q.iter_mut().zip(x) {
        *q = (v * inv).round_ties_even() as i16;
    }
    amax / 32767.0
}

/// What the SIMD kernels (AVX-512 and AVX2) share.
#[cfg(all(
    target_arch = "x86_64",
    any(
        target_feature = "avx512bw",
        all(target_feature = "avx2", target_feature = "fma")
    )
))]
mod simd {
    /// The format parameter (a const generic, so each format gets its own loop).
    pub const Q4K: u8 = 0;
    pub const Q5K: u8 = 1;
    pub const Q6K: u8 = 2;

    /// Super-blocks summed before a partial result is added to the output (24 KiB of
    /// activations for a group of eight): every result is summed per such chunk in column
    /// order, whatever the loop order, so a row's bits do not depend on its batch.
    pub const CHUNK: usize = 6;
}
#[cfg(all(
    target_arch = "x86_64",
    any(
        target_feature = "avx512bw",
        all(target_feature = "avx2", target_feature = "fma")
    )
))]
use simd::{CHUNK, Q4K, Q5K, Q6K};

/// Rows `r0..r0 + nr` of `s` against activation rows `i0..i0 + g` of `a`, into `dst[row][g]`.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
#[allow(clippy::too_many_arguments)] // the f32 kernels' signature plus the prepared activations
pub(super) fn tile(
    s: &super::Segment,
    r0: usize,
    nr: usize,
    a: &KActs,
    i0: usize,
    g: usize,
    dst: &mut [f32],
    prefetch: bool,
) {
    use avx512::rows;
    let args = (s, r0, nr, a, i0, dst);
    // Batches over four walk one weight row at a time: its eight weight vectors stay in
    // registers beside the float accumulators.
    macro_rules! by_batch {
        ($f:expr) => {
            super::by_batch!(rows, $f, 1, g, prefetch, args)
        };
    }
    match s.format {
        super::Format::Q4K => by_batch!(Q4K),
        super::Format::Q5K => by_batch!(Q5K),
        super::Format::Q6K => by_batch!(Q6K),
        other => unreachable!("{other:?} is not a k-quant"),
    }
}

/// AVX2 + FMA without AVX-512BW: the 256-bit kernel (also built for tests everywhere it
/// compiles, so this machine checks it against the scalar sums).
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    any(test, not(target_feature = "avx512bw"))
))]
pub(super) mod avx2;

#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx2",
    target_feature = "fma",
    not(target_feature = "avx512bw")
))]
pub(super) use avx2::tile;

/// Portable path: the same integer sums, one weight row and activation row at a time.
#[cfg(not(all(
    target_arch = "x86_64",
    any(
        target_feature = "avx512bw",
        all(target_feature = "avx2", target_feature = "fma")
    )
)))]
#[allow(clippy::too_many_arguments)]
pub(super) fn tile(
    s: &super::Segment,
    r0: usize,
    nr: usize,
    a: &KActs,
    i0: usize,
    g: usize,
    dst: &mut [f32],
    _prefetch: bool,
) {
    let rb = s.row_bytes();
    for t in 0..nr {
        let row = &s.bytes()[(r0 + t) * rb..(r0 + t + 1) * rb];
        for j in 0..g {
            dst[t * g + j] = dot_row(s.format, row, a, i0 + j);
        }
    }
}

/// One weight row (k-quant bytes) times activation row `i`, in scalar code.
#[cfg(any(
    test,
    not(all(
        target_arch = "x86_64",
        any(
            target_feature = "avx512bw",
            all(target_feature = "avx2", target_feature = "fma")
        )
    ))
))]
pub(super) fn dot_row(format: super::Format, row: &[u8], a: &KActs, i: usize) -> f32 {
    use super::blocks::{f16_at, k45_values, k4_scales_mins, q6k_values};
    use super::Format;
    let (k, bb) = (a.k, format.block_bytes());
    let nb = k / QK;
    let mut total = 0f32;
    for (b, blk) in row.chunks_exact(bb).enumerate() {
        let x = &a.q()[i * k + b * QK..i * k + (b + 1) * QK];
        let xs = a.scale[i * nb + b];
        // i64: 16-bit activations times 6-bit weights times 8-bit scales, summed over a
        // super-block, pass i32's range (debug builds panicked, release wrapped).
        let dot = |q: &[i32], x: &[i16]| -> i64 {
            q.iter()
                .zip(x)
                .map(|(&q, &x)| i64::from(q * x as i32))
                .sum()
        };
        match format {
            Format::Q4K | Format::Q5K => {
                let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                let (sc, mn) = k4_scales_mins(&blk[4..16]);
                let q = k45_values(format, blk).map(i32::from);
                let sums = &a.sums[(i * nb + b) * SUMS..];
                let mut isum = 0i64;
                let mut msum = 0f32;
                for j in 0..8 {
                    isum += sc[j] as i64 * dot(&q[32 * j..32 * j + 32], &x[32 * j..32 * j + 32]);
                    msum += mn[j] as f32 * sums[j];
                }
                total += d * xs * isum as f32 - dmin * msum;
            }
            Format::Q6K => {
                let d = f16_at(blk, 208);
                let q = q6k_values(blk).map(i32::from);
                let isum: i64 = (0..16)
                    .map(|j| {
                        (blk[192 + j] as i8) as i64
                            * dot(&q[16 * j..16 * j + 16], &x[16 * j..16 * j + 16])
                    })
                    .sum();
                total += d * xs * isum as f32;
            }
            other => unreachable!("{other:?} is not a k-quant"),
        }
    }
    total
}

/// A Q6_K block's 6-bit values for elements `128n..128n + 128`, as four runs of 32 bytes in
/// element order: low nibbles from `ql`, the two high bits from `qh` (bits 0-1, 2-3, 4-5, 6-7
/// for the four runs). 16-bit shifts are safe because the masks keep each byte's own bits.
#[cfg(all(target_arch = "x86_64", target_feature = "avx2"))]
#[inline(always)]
unsafe fn q6k_runs(b: *const u8, n: usize) -> [std::arch::x86_64::__m256i; 4] {
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

/// AVX-512BW kernel: a super-block becomes eight 32-lane i16 weight vectors with the sub-block
/// scales folded in, each met by 32 activations in one `vpdpwssd` (VNNI; `vpmaddwd` + add
/// without it); one float conversion per super-block and activation row.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
mod avx512 {
    use std::arch::x86_64::*;

    use super::super::Segment;
    use super::{KActs, CHUNK, Q5K, Q6K, QK, SUMS};

    /// How far ahead of the block being multiplied weights are prefetched (4–32 KiB measured
    /// alike; 8 KiB was best).
    const PREFETCH: usize = 8192;

    /// Activation bytes of a group that fit L1 beside the weights streaming past (half of
    /// Zen 4/5's 48 KiB).
    const L1_ACTS: usize = 24 * 1024;

    /// Lane → scale index for Q6_K weight vector `v` (16-weight sub-blocks: two per vector).
    static Q6K_SCALE_IDX: [[i16; 32]; 8] = {
        let mut t = [[0i16; 32]; 8];
        let mut v = 0;
        while v < 8 {
            let mut l = 0;
            while l < 32 {
                t[v][l] = (2 * v + l / 16) as i16;
                l += 1;
            }
            v += 1;
        }
        t
    };

    #[inline(always)]
    unsafe fn f16_at(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            p.cast::<u16>().read_unaligned() as i32,
        )))
    }

    #[inline(always)]
    unsafe fn dot_acc(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
        #[cfg(target_feature = "avx512vnni")]
        {
            _mm512_dpwssd_epi32(acc, w, x)
        }
        #[cfg(not(target_feature = "avx512vnni"))]
        {
            _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
        }
    }

    /// The six-bit scales and mins of a Q4_K/Q5_K block as two u64s of eight bytes each
    /// (the byte shuffle of `blocks::k4_scales_mins`, done on 32-bit words).
    #[inline(always)]
    unsafe fn scales_mins(p: *const u8) -> (u64, u64) {
        const K1: u32 = 0x3f3f_3f3f;
        const K2: u32 = 0x0f0f_0f0f;
        const K3: u32 = 0x0303_0303;
        let u0 = p.cast::<u32>().read_unaligned();
        let u1 = p.add(4).cast::<u32>().read_unaligned();
        let u2 = p.add(8).cast::<u32>().read_unaligned();
        let sc = (u0 & K1) as u64 | (((u2 & K2) | (((u0 >> 6) & K3) << 4)) as u64) << 32;
        let mn = (u1 & K1) as u64 | ((((u2 >> 4) & K2) | (((u1 >> 6) & K3) << 4)) as u64) << 32;
        (sc, mn)
    }

    /// One super-block: eight weight vectors (element order, scales folded in), `d`, and
    /// `dmin·m_j` in lanes 0..8 (zero for Q6_K).
    #[inline(always)]
    unsafe fn prep<const F: u8>(b: *const u8) -> ([__m512i; 8], f32, __m512) {
        let mut w = [_mm512_setzero_si512(); 8];
        if F == Q6K {
            let sc =
                _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192).cast())));
            let off = _mm512_set1_epi16(32);
            for n in 0..2 {
                let q = super::q6k_runs(b, n);
                for (i, q) in q.into_iter().enumerate() {
                    let v = 4 * n + i;
                    let idx = _mm512_loadu_si512(Q6K_SCALE_IDX[v].as_ptr().cast());
                    let s = _mm512_permutexvar_epi16(idx, sc);
                    w[v] = _mm512_mullo_epi16(_mm512_sub_epi16(_mm512_cvtepu8_epi16(q), off), s);
                }
            }
            return (w, f16_at(b.add(208)), _mm512_setzero_ps());
        }
        let (d, dmin) = (f16_at(b), f16_at(b.add(2)));
        let (sc, mn) = scales_mins(b.add(4));
        let mins = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128(mn as i64))),
            _mm512_set1_ps(dmin),
        );
        let qs = if F == Q5K { b.add(48) } else { b.add(16) };
        let qh = _mm256_loadu_si256(b.add(16).cast());
        let m4 = _mm256_set1_epi8(0x0F);
        let sixteen = _mm512_set1_epi16(16);
        for c in 0..4 {
            let q = _mm256_loadu_si256(qs.add(32 * c).cast());
            let nib = [
                _mm256_and_si256(q, m4),
                _mm256_and_si256(_mm256_srli_epi16(q, 4), m4),
            ];
            for (h, nib) in nib.into_iter().enumerate() {
                let j = 2 * c + h;
                let mut v = _mm512_cvtepu8_epi16(nib);
                if F == Q5K {
                    let bit = _mm256_test_epi8_mask(qh, _mm256_set1_epi8((1u8 << j) as i8));
                    v = _mm512_mask_add_epi16(v, bit, v, sixteen);
                }
                let s = ((sc >> (8 * j)) & 0xFF) as i16;
                w[j] = _mm512_mullo_epi16(v, _mm512_set1_epi16(s));
            }
        }
        (w, d, mins)
    }

    /// Weight rows `r0..r0 + nr` times activation rows `i0..i0 + G`, into `dst[row * G + j]`,
    /// walking R weight rows at a time (independent streams keep loads in flight).
    ///
    /// Each result is summed chunk by chunk, CHUNK super-blocks at a time, in column order,
    /// whatever the loop order: a row's bits do not depend on the batch it is in.
    #[allow(clippy::type_complexity)]
    pub(super) fn rows<const F: u8, const R: usize, const G: usize, const P: bool>(
        (s, r0, nr, a, i0, dst): (&Segment, usize, usize, &KActs, usize, &mut [f32]),
    ) {
        let k = s.cols;
        let nb = k / QK;
        let rb = s.row_bytes();
        let data = s.bytes();
        assert!(
            data.len() >= (r0 + nr) * rb
                && a.k == k
                && a.q().len() >= (i0 + G) * k
                && a.scale.len() >= (i0 + G) * nb
                && a.sums.len() >= (i0 + G) * nb * SUMS
                && dst.len() >= nr * G
        );
        let x = Acts {
            q: std::array::from_fn(|j| a.q()[(i0 + j) * k..].as_ptr()),
            scale: std::array::from_fn(|j| a.scale[(i0 + j) * nb..].as_ptr()),
            sums: std::array::from_fn(|j| a.sums[(i0 + j) * nb * SUMS..].as_ptr()),
        };
        let w = Weights {
            data,
            r0,
            rb,
            bb: s.format.block_bytes(),
            // Whole groups of R rows ahead, about PREFETCH bytes.
            pf: PREFETCH.div_ceil(R * rb) * R * rb,
        };
        let (chunks, groups) = (nb.div_ceil(CHUNK), nr.div_ceil(R));
        // When the group's activations do not fit L1 (eight rows of an 8960-wide matrix are
        // 143 KiB), one chunk of them stays there while every row of the tile passes it,
        // instead of coming from L2 once per weight row. Otherwise row after row, so each
        // weight row streams in order (decode reads DRAM).
        let chunk_outer = G * k * 2 > L1_ACTS;
        for i in 0..chunks * groups {
            let (c, g) = match chunk_outer {
                true => (i / groups, i % groups),
                false => (i % chunks, i / chunks),
            };
            let (t, c0) = (g * R, c * CHUNK);
            let rr = (nr - t).min(R);
            // SAFETY: the assert above bounds every pointer: super-blocks < nb of rows
            // < r0 + nr, activation blocks < nb of rows < i0 + G.
            let acc = unsafe { chunk::<F, R, G, P>(&w, &x, t..t + rr, c0..nb.min(c0 + CHUNK)) };
            for (q, acc) in acc.iter().enumerate().take(rr) {
                for (j, &acc) in acc.iter().enumerate() {
                    // SAFETY: plain AVX-512F, which this module is compiled for.
                    let v = unsafe { _mm512_reduce_add_ps(acc) };
                    let d = &mut dst[(t + q) * G + j];
                    *d = if c0 == 0 { v } else { *d + v };
                }
            }
        }
    }

    /// Pointers to a group's prepared activations.
    struct Acts<const G: usize> {
        q: [*const i16; G],
        scale: [*const f32; G],
        sums: [*const f32; G],
    }

    /// Where a segment's weight rows are.
    struct Weights<'a> {
        data: &'a [u8],
        r0: usize,
        rb: usize,
        bb: usize,
        pf: usize,
    }

    /// Weight rows `rows` (at most R; past the last, it is repeated and the extra results
    /// dropped) times the group's activations over super-blocks `blocks`: 16-lane partial sums.
    #[inline(always)]
    unsafe fn chunk<const F: u8, const R: usize, const G: usize, const P: bool>(
        w: &Weights,
        x: &Acts<G>,
        rows: std::ops::Range<usize>,
        blocks: std::ops::Range<usize>,
    ) -> [[__m512; G]; R] {
        let rp: [*const u8; R] = std::array::from_fn(|q| {
            let r = w.r0 + rows.start + q.min(rows.len() - 1);
            w.data[r * w.rb..].as_ptr()
        });
        let mut acc = [[_mm512_setzero_ps(); G]; R];
        for b in blocks {
            for q in 0..R {
                let blk = rp[q].add(b * w.bb);
                // The hardware prefetcher loses R interleaved streams: fetch the same block of
                // rows further ahead (a prefetch never faults, so running past the matrix is
                // harmless). Measured on DRAM-resident Q4_K: 5.8 GB/s without, 24 GB/s with,
                // single thread.
                if P {
                    let ahead = blk.wrapping_add(w.pf);
                    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast());
                    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(128).cast());
                    if w.bb > 192 {
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(192).cast());
                    }
                }
                let (wv, d, mins) = prep::<F>(blk);
                for (j, acc) in acc[q].iter_mut().enumerate() {
                    let xq = x.q[j].add(b * QK).cast::<__m512i>();
                    let mut ia = _mm512_setzero_si512();
                    for (v, &wv) in wv.iter().enumerate() {
                        ia = dot_acc(ia, wv, _mm512_loadu_si512(xq.add(v)));
                    }
                    let scale = _mm512_set1_ps(d * *x.scale[j].add(b));
                    *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), scale, *acc);
                    if F != Q6K {
                        let sums = _mm512_loadu_ps(x.sums[j].add(b * SUMS));
                        *acc = _mm512_fnmadd_ps(mins, sums, *acc);
                    }
                }
            }
        }
        acc
    }
}
