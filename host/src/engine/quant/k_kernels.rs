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
    walk: super::Walk,
) {
    use avx512::{rows, span_rows};
    let args = (s, r0, nr, a, i0, dst);
    // Batches over four walk one weight row at a time: its eight weight vectors stay in
    // registers beside the float accumulators.
    macro_rules! by_batch {
        ($f:expr) => {
            match walk {
                super::Walk::Stream => super::by_batch!(rows, $f, 1, g, true, args),
                // Only Q6_K's unpacking (bit merges and a lane permute per vector) costs
                // more than reading back its 576 bytes per super-block; Q4_K came out slower.
                super::Walk::Span(_) if $f != Q6K => super::by_batch!(rows, $f, 1, g, false, args),
                super::Walk::Span(n) => match g {
                    8 => span_rows::<{ $f }, 8>(n, args),
                    7 => span_rows::<{ $f }, 7>(n, args),
                    6 => span_rows::<{ $f }, 6>(n, args),
                    5 => span_rows::<{ $f }, 5>(n, args),
                    4 => span_rows::<{ $f }, 4>(n, args),
                    3 => span_rows::<{ $f }, 3>(n, args),
                    2 => span_rows::<{ $f }, 2>(n, args),
                    _ => span_rows::<{ $f }, 1>(n, args),
                },
            }
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
    _walk: super::Walk,
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

/// The AVX-512BW kernel (`vpdpwssd` on i16 weights with the sub-block scales folded in).
#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
mod avx512;
