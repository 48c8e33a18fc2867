//! Q4_K, Q5_K and Q6_K (256-weight super-blocks) times activations rounded to integers: 16 bits
//! by default, 8 for the batch kernels where a model asks (`ActivationBits`).
//!
//! Per super-block `b` of a weight row and activation row `x ≈ s_b · x16`:
//! - Q4_K / Q5_K: `w = d·sc_j·q − dmin·m_j` for sub-block `j` (32 weights), so
//!   `w·x = d·s_b·Σ_j Σ (sc_j·q)·x16 − dmin·Σ_j m_j·s_b·Σ_{i∈j} x16_i`. The first sum is exact
//!   integer arithmetic (`sc_j·q` fits in i16, the products of a super-block in i32); the
//!   second uses each sub-block's sum of the same rounded activations, computed once per
//!   activation row (`sub_block_sums`).
//! - Q6_K: `w = d·sc_j·(q − 32)` for 16-weight sub-blocks: `w·x = d·s_b·Σ (sc_j·(q − 32))·x16`.
//!
//! Bounds (why i32 never overflows): |x16| ≤ 32767 and each i32 lane takes 16 products of a
//! super-block: Q4_K |sc·q| ≤ 63·15, Q5_K ≤ 63·31, Q6_K ≤ 128·32 = 4096, so the largest lane
//! sum is 16 · 4096 · 32767 < 2³¹.
//!
//! Which products share a lane is fixed: lane `l` of super-block run `r` (64 elements) takes
//! elements `64r + 4l .. 64r + 4l + 4`, over the four runs. The 16-bit activations are stored
//! so that `vpdpwssd` meets them that way (`deinterleave`), and the one-row kernel's byte multiplies
//! (`maddubs`, four neighbours per lane) do too: a lane's integer sum, and so every result's
//! bits, are the same whichever kernel a row goes through.

use super::aligned::Aligned;
use super::rounding::{quantize_block, round_rows, AVX2_BYTES};
use super::ActivationBits;
use crate::engine::team::Team;

/// Elements per super-block.
pub(super) const QK: usize = 256;
/// Float sums stored per super-block: 8 sub-block sums, then 8 zeros (one 16-lane load).
const SUMS: usize = 16;

/// Activation rows prepared for the k-quant kernels.
pub(super) struct KActs {
    k: usize,
    /// `[m][k]`: each 256-element block scaled so its largest magnitude is 32767 (or 127).
    // AVX2 builds read the rows only as bytes (`RowBytes`, made from these in `new`).
    #[cfg_attr(
        all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma",
            not(any(test, target_feature = "avx512bw"))
        ),
        allow(dead_code)
    )]
    q: Aligned<i16, 32>,
    /// `[m][k / 256]`: the scale of each block (`x ≈ q · scale`).
    scale: Vec<f32>,
    /// `[m][k / 256][16]`: each 32-element sub-block's sum of the rounded activations (times
    /// the scale), zero padded.
    sums: Vec<f32>,
    /// The rows also as bytes: on AVX-512 a single row (decode), for the one-row kernel; on
    /// AVX2 every row, which its kernel multiplies.
    #[cfg(all(
        target_arch = "x86_64",
        any(
            target_feature = "avx512bw",
            all(target_feature = "avx2", target_feature = "fma")
        )
    ))]
    bytes: Option<RowBytes>,
    /// Prompt rows at `prompt_precision = "int8"` also as bytes, for `lanes8`.
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
    bytes8: Option<lanes8::Bytes8>,
    /// Generated rows rounded to 8 bits, in the order `quads` multiplies them.
    #[cfg(all(
        target_arch = "x86_64",
        target_feature = "avx512bw",
        target_feature = "avx512vnni"
    ))]
    quads: Option<quads::Quads>,
}

#[cfg(all(
    target_arch = "x86_64",
    any(
        target_feature = "avx512bw",
        all(target_feature = "avx2", target_feature = "fma")
    )
))]
mod row_bytes;
#[cfg(all(
    target_arch = "x86_64",
    any(
        target_feature = "avx512bw",
        all(target_feature = "avx2", target_feature = "fma")
    )
))]
use row_bytes::RowBytes;

/// Reorders a block quantized in element order into the stored order: each run of 64 holds
/// its even elements, then its odd ones, so a `vpdpwssd` lane (two neighbouring 16-bit values
/// of each of two vectors) takes elements `4l .. 4l + 4` of the run (`dot_row`'s `slot` reads
/// them back).
fn deinterleave(q: &mut [i16]) {
    for run in q.chunks_exact_mut(64) {
        let natural: [i16; 64] = std::array::from_fn(|e| run[e]);
        let (even, odd) = run.split_at_mut(32);
        for (m, pair) in natural.chunks_exact(2).enumerate() {
            (even[m], odd[m]) = (pair[0], pair[1]);
        }
    }
}

/// Where `deinterleave` stored element `e` of a super-block: what the scalar dot and the
/// quad-order copy read rows back by.
#[cfg(any(
    test,
    target_feature = "avx512vnni",
    not(all(
        target_arch = "x86_64",
        any(
            target_feature = "avx512bw",
            all(target_feature = "avx2", target_feature = "fma")
        )
    ))
))]
const fn stored_slot(e: usize) -> usize {
    e / 64 * 64 + e % 2 * 32 + e % 64 / 2
}

impl KActs {
    /// Quantizes the `m` rows of `x` (`[m][k]`, `k` a multiple of 256) to `bits`, rows split
    /// across the team. Generated rows at 8 bits (`Eight`, `EightButQ8_0`) are also kept for
    /// `quads` where it is built; prompt rows at 8 bits come as `EightKQuants`.
    pub(super) fn new(team: &Team, x: &[f32], m: usize, k: usize, bits: ActivationBits) -> Self {
        assert!(k.is_multiple_of(QK), "k-quant rows are whole super-blocks");
        let (q, scale, sums) = round_rows::<QK, SUMS>(team, x, m, k, |xb, q, u| {
            let scale = quantize_block(xb, q, bits.max());
            sub_block_sums(q, scale, u);
            deinterleave(q);
            scale
        });
        // Generated rows at 8 bits go through `quads` where it is built, which needs no bytes.
        let quad_order = cfg!(all(
            target_arch = "x86_64",
            target_feature = "avx512bw",
            target_feature = "avx512vnni"
        )) && matches!(bits, ActivationBits::Eight | ActivationBits::EightButQ8_0);
        Self {
            k,
            #[cfg(all(
                target_arch = "x86_64",
                any(
                    target_feature = "avx512bw",
                    all(target_feature = "avx2", target_feature = "fma")
                )
            ))]
            bytes: ((m == 1 && !quad_order) || cfg!(not(target_feature = "avx512bw")))
                .then(|| RowBytes::new(team, q.as_slice(), k, bits)),
            #[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
            bytes8: None,
            #[cfg(all(
                target_arch = "x86_64",
                target_feature = "avx512bw",
                target_feature = "avx512vnni"
            ))]
            quads: quad_order.then(|| quads::Quads::new(q.as_slice(), m, k)),
            q,
            scale,
            sums,
        }
    }

    // AVX2 builds read the rows only as bytes (`RowBytes`, made from these in `new`).
    #[cfg_attr(
        all(
            target_arch = "x86_64",
            target_feature = "avx2",
            target_feature = "fma",
            not(any(test, target_feature = "avx512bw"))
        ),
        allow(dead_code)
    )]
    fn q(&self) -> &[i16] {
        self.q.as_slice()
    }

    /// Every row also as bytes, as AVX2 builds keep them: what the AVX2 kernel's test needs on
    /// an AVX-512 build.
    #[cfg(all(
        test,
        target_arch = "x86_64",
        target_feature = "avx2",
        target_feature = "fma"
    ))]
    pub(super) fn with_row_bytes(mut self, bits: ActivationBits) -> Self {
        self.bytes = Some(RowBytes::new(&Team::new(1), self.q(), self.k, bits));
        self
    }

    /// These rows (rounded to 8 bits) for the 8-bit prompt kernel: every prefill span over them
    /// takes `lanes8` instead of the 16-bit lanes kernel.
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
    pub(super) fn with_bytes8(mut self, team: &Team) -> Self {
        let m = self.q().len() / self.k;
        self.bytes8 = Some(lanes8::Bytes8::new(team, self.q(), m, self.k));
        self
    }
}

/// The sum of each 32-element sub-block of a rounded 256-element block (`q`, element order,
/// times `scale`), `u[j]` for `q[32j..]`: the integers added exactly, then scaled once.
///
/// The mins' term `dmin·m_j·Σx` takes the rounded activations, as the rest of the product
/// does, so a row meets its activations rounded whole (llama.cpp's `bsums`). With the
/// unrounded sums instead, the rounding error met the weights without their mins, `d·sc_j·q`
/// with `q` in 0..15, whose magnitude is about twice the centred weights': Qwen2.5's 8-bit
/// decode had a mean KL divergence from f32 of 4.5e-3 against llama.cpp's 1.4e-3 (`gateway
/// eval-kl`).
pub(super) fn sub_block_sums(q: &[i16], scale: f32, u: &mut [f32]) {
    let mut acc = [0i32; 8];
    for i in 0..32 {
        for (j, acc) in acc.iter_mut().enumerate() {
            *acc += i32::from(q[32 * j + i]);
        }
    }
    for (u, acc) in u.iter_mut().zip(acc) {
        *u = acc as f32 * scale;
    }
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

/// Weight rows `rows` walks together for `g` activation rows. Memory-bound passes (decode,
/// small batches: `stream`) walk one weight row at a time, which the hardware prefetcher
/// follows: DRAM-resident Q4_K, four activation rows, two threads, read 11.8–14.3 GB/s that
/// way against 8.7–11.5 for four weight rows together (two rows of Q4_K and four of Q6_K:
/// level or better). Prefill batches over four do the same, so their eight weight vectors
/// stay in registers beside the float accumulators. A row's sum is the same whatever R.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
const fn rows_walked(g: usize, stream: bool) -> usize {
    if stream || g > 4 {
        1
    } else {
        4
    }
}

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
    use avx512::{one_row, rows, span_rows};
    use lanes::span_lanes;
    use lanes8::span_lanes as span_lanes8;
    let args = (s, r0, nr, a, i0, dst);
    #[cfg(target_feature = "avx512vnni")]
    use quads::rows as quad_rows;
    macro_rules! by_batch {
        ($f:expr) => {
            match walk {
                #[cfg(target_feature = "avx512vnni")]
                super::Walk::Stream | super::Walk::Span(_) if a.quads.is_some() => {
                    super::by_group!(quad_rows, $f, g, walk == super::Walk::Stream, args)
                }
                super::Walk::Stream if g == 1 && a.bytes.is_some() => one_row::<{ $f }>(args),
                super::Walk::Stream => super::by_batch!(rows, $f, rows_walked, g, true, args),
                // Only Q6_K's unpacking (bit merges and a lane permute per vector) costs
                // more than reading back its 576 bytes per super-block; Q4_K came out slower.
                super::Walk::Span(_) if $f != Q6K => {
                    super::by_batch!(rows, $f, rows_walked, g, false, args)
                }
                super::Walk::Span(n) => super::by_group!(span_rows, $f, g, n, args),
                super::Walk::Prompt(n) if a.bytes8.is_some() => {
                    super::by_group!(span_lanes8, $f, g, n, args)
                }
                super::Walk::Prompt(n) => super::by_group!(span_lanes, $f, g, n, args),
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

// `auto` lives here, beside the condition that picks the kernel, so that `rounding.rs` (which
// the kernels use) does not use the kernels back.
impl ActivationBits {
    /// `decode_activation_bits = "auto"`: 8 bits where a step's k-quant products cost less in
    /// bytes, which is everywhere but AVX-512BW without VNNI. On AVX2 (`k_kernels/avx2.rs`) a
    /// 16-bit row is its high and low bytes, two `vpmaddubsw` and two `vpmaddwd` per 32 products
    /// where a byte row takes one of each: on a Zen 3, Qwen2.5-1.5B's weight products took 146
    /// against 251 ms a step for ~7 rows (`gateway bench`, concurrency 4) and 48 against 77 for
    /// one or two. With VNNI, `quads` multiplies 64 byte products in one `vpdpbusd`: on a Zen 5,
    /// Qwen2.5-shaped steps of 1 / 2 / 5 / 8 generated rows took 16.1-17.2 / 18.1-18.8 /
    /// 28.4-31.4 / 38.0-39.6 ms against 16.4-18.7 / 23.6-23.8 / 35.6 / 53.4-56.0 at 16 bits
    /// (kernels bench, `qwen-batch`, the same runs). Without VNNI, 16-bit rows take `vpdpwssd`'s
    /// emulation as cheaply as bytes would, so 16 bits stay there. The KL divergence of 8 bits
    /// from f32 is llama.cpp's (README, "Precision"). The 32-element formats take bytes on
    /// AVX2 too, but Q8_0 (`EightButQ8_0`); on AVX-512 they keep 16 bits.
    fn auto() -> Self {
        match AVX2_BYTES
            || cfg!(all(
                target_feature = "avx512bw",
                target_feature = "avx512vnni"
            )) {
            true => ActivationBits::EightButQ8_0,
            false => ActivationBits::Sixteen,
        }
    }

    /// The configured `decode_activation_bits`, `auto` resolved for this build's kernels.
    pub fn configured(bits: crate::config::DecodeBits) -> Self {
        use crate::config::DecodeBits;
        match bits {
            DecodeBits::Eight => ActivationBits::EightButQ8_0,
            DecodeBits::EightAll => ActivationBits::Eight,
            DecodeBits::Sixteen => ActivationBits::Sixteen,
            DecodeBits::Auto => ActivationBits::auto(),
        }
    }
}

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
        let stored = &a.q()[i * k + b * QK..i * k + (b + 1) * QK];
        let x: [i16; QK] = std::array::from_fn(|e| stored[stored_slot(e)]);
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

/// The AVX-512BW kernel (`vpdpwssd` on i16 weights with the sub-block scales folded in).
#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
mod avx512;

/// Frees this thread's unpacked k-quant tile (AVX-512 prompt spans; nothing elsewhere).
pub(super) fn release() {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
    avx512::release();
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
mod lanes;

/// 8-bit generated rows with `vpdpbusd`.
#[cfg(all(
    target_arch = "x86_64",
    target_feature = "avx512bw",
    target_feature = "avx512vnni"
))]
mod quads;

#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
mod lanes8;

#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
mod few;

#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
pub(super) use few::{pass as few_pass, pass_with, Few, FEW_ROWS};

#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
mod across;

#[cfg(all(target_arch = "x86_64", target_feature = "avx512bf16"))]
mod bf16;
#[cfg(all(target_arch = "x86_64", target_feature = "avx512bf16"))]
pub(super) use bf16::{block as bf16_block, chunk_order};

#[cfg(all(target_arch = "x86_64", target_feature = "avx512bw"))]
pub(super) use across::rows as across_rows;
