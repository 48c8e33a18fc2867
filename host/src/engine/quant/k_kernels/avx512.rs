//! AVX-512BW kernels.
//! - Batches (`rows`, `span_rows`): a super-block becomes eight 32-lane i16 weight vectors with
//!   the sub-block scales folded in, each met by 32 activations in one `vpdpwssd` (VNNI;
//!   `vpmaddwd` + add without it), unpacked once for the group's rows.
//! - One row (`one_row`, decode): the packed values stay bytes and meet the activation's high
//!   and low bytes (or, rounded to 8 bits, its only byte) in `vpmaddubsw`; the 16-bit pair
//!   sums take the scales in `vpdpwssd`.
//!
//! Both give each i32 lane the same integers (see the parent module), then one float
//! conversion per super-block and activation row.

use std::arch::x86_64::*;

use super::super::lanes::{dot_acc, f16_at};
use super::super::Segment;
use super::{KActs, CHUNK, Q5K, Q6K, QK, SUMS};

/// How far ahead of the block being multiplied weights are prefetched (4–32 KiB measured
/// alike; 8 KiB was best).
pub(super) const PREFETCH: usize = 8192;

/// Activation bytes of a group that fit L1 beside the weights streaming past (half of
/// Zen 4/5's 48 KiB).
const L1_ACTS: usize = 24 * 1024;

/// The six-bit scales and mins of a Q4_K/Q5_K block as two u64s of eight bytes each
/// (the byte shuffle of `blocks::k4_scales_mins`, done on 32-bit words).
#[inline(always)]
pub(super) unsafe fn scales_mins(p: *const u8) -> (u64, u64) {
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

/// Sub-block of each i16 position of run `r`'s scale vector, `[Q6_K][r][m]`: position `m`
/// covers elements `64r + 2m` and `64r + 2m + 1` (a `maddubs` pair, or the `m`-th of the even
/// or odd elements in `prep`), which share a sub-block of 32 (16 for Q6_K).
static RUN_SCALE_IDX: [[[i16; 32]; 4]; 2] = {
    let mut t = [[[0i16; 32]; 4]; 2];
    let mut f = 0;
    while f < 2 {
        let sub = if f == 1 { 16 } else { 32 };
        let mut r = 0;
        while r < 4 {
            let mut m = 0;
            while m < 32 {
                t[f][r][m] = ((64 * r + 2 * m) / sub) as i16;
                m += 1;
            }
            r += 1;
        }
        f += 1;
    }
    t
};

/// A super-block's values as four 64-byte runs in element order (Q6_K's without the offset of
/// 32). 16-bit shifts are safe where the masks keep each byte's own bits.
#[inline(always)]
pub(super) unsafe fn runs<const F: u8>(b: *const u8) -> [__m512i; 4] {
    let m4 = _mm512_set1_epi8(0x0F);
    let mut out = [_mm512_setzero_si512(); 4];
    if F == Q6K {
        // Run 2n: low nibbles of ql[64n..64n + 64], high bits 0-1 then 2-3 of qh[32n..32n + 32];
        // run 2n + 1: high nibbles, bits 4-5 then 6-7.
        let m30 = _mm512_set1_epi8(0x30);
        let by2 = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
        for n in 0..2 {
            let ql = _mm512_loadu_si512(b.add(64 * n).cast());
            let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(128 + 32 * n).cast()));
            let qh = _mm512_srlv_epi16(qh, by2);
            out[2 * n] = _mm512_or_si512(
                _mm512_and_si512(ql, m4),
                _mm512_and_si512(_mm512_slli_epi16::<4>(qh), m30),
            );
            out[2 * n + 1] = _mm512_or_si512(
                _mm512_and_si512(_mm512_srli_epi16::<4>(ql), m4),
                _mm512_and_si512(qh, m30),
            );
        }
        return out;
    }
    // Run r: the low nibbles of qs[32r..32r + 32], then their high nibbles; Q5_K adds bit 2r,
    // then bit 2r + 1, of qh[0..32] as the fifth bit.
    let qs = if F == Q5K { b.add(48) } else { b.add(16) };
    let by4 = _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(4));
    let qh = _mm512_broadcast_i64x4(_mm256_loadu_si256(b.add(16).cast()));
    for (r, out) in out.iter_mut().enumerate() {
        let q = _mm512_broadcast_i64x4(_mm256_loadu_si256(qs.add(32 * r).cast()));
        *out = _mm512_and_si512(_mm512_srlv_epi16(q, by4), m4);
        if F == Q5K {
            let bits = _mm512_inserti64x4::<1>(
                _mm512_set1_epi8(1 << (2 * r)),
                _mm256_set1_epi8(1 << (2 * r + 1)),
            );
            let set = _mm512_test_epi8_mask(qh, bits);
            *out = _mm512_mask_add_epi8(*out, set, *out, _mm512_set1_epi8(16));
        }
    }
    out
}

/// The i16 scale vectors of a super-block's four runs (`RUN_SCALE_IDX`), `d`, and `dmin·m_j`
/// in lanes 0..8 (zero for Q6_K).
#[inline(always)]
unsafe fn run_scales<const F: u8>(b: *const u8) -> ([__m512i; 4], f32, __m512) {
    let (sc, d, mins) = if F == Q6K {
        let sc = _mm_loadu_si128(b.add(192).cast());
        let sc = _mm512_cvtepi8_epi16(_mm256_castsi128_si256(sc));
        (sc, f16_at(b.add(208)), _mm512_setzero_ps())
    } else {
        let (d, dmin) = (f16_at(b), f16_at(b.add(2)));
        let (sc, mn) = scales_mins(b.add(4));
        let mins = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_cvtsi64_si128(mn as i64))),
            _mm512_set1_ps(dmin),
        );
        let sc = _mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_cvtsi64_si128(sc as i64)));
        (sc, d, mins)
    };
    let idx = &RUN_SCALE_IDX[usize::from(F == Q6K)];
    let s = std::array::from_fn(|r| {
        _mm512_permutexvar_epi16(_mm512_loadu_si512(idx[r].as_ptr().cast()), sc)
    });
    (s, d, mins)
}

/// One super-block for the batch kernels: eight weight vectors (run r's even elements, then
/// its odd ones, as the activations are stored; scales folded in), `d`, and `dmin·m_j`.
#[inline(always)]
pub(super) unsafe fn prep<const F: u8>(b: *const u8) -> ([__m512i; 8], f32, __m512) {
    let n = runs::<F>(b);
    let (s, d, mins) = run_scales::<F>(b);
    let (low, off) = (_mm512_set1_epi16(0xFF), _mm512_set1_epi16(32));
    let mut w = [_mm512_setzero_si512(); 8];
    for r in 0..4 {
        let mut even = _mm512_and_si512(n[r], low);
        let mut odd = _mm512_srli_epi16::<8>(n[r]);
        if F == Q6K {
            even = _mm512_sub_epi16(even, off);
            odd = _mm512_sub_epi16(odd, off);
        }
        w[2 * r] = _mm512_mullo_epi16(even, s[r]);
        w[2 * r + 1] = _mm512_mullo_epi16(odd, s[r]);
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
    let (k, rb, data) = (s.cols, s.row_bytes(), s.bytes());
    let nb = k / QK;
    let x = Acts::new(s, r0..r0 + nr, a, i0, dst.len());
    let w = Weights {
        data,
        r0,
        rb,
        bb: s.format.block_bytes(),
        // Whole groups of R rows ahead, about PREFETCH bytes.
        pf: PREFETCH.div_ceil(R * rb) * R * rb,
    };
    for (c, g) in order(G * k * 2, k, nr.div_ceil(R)) {
        let (t, c0) = (g * R, c * CHUNK);
        let rr = (nr - t).min(R);
        // SAFETY: `Acts::new` asserted the bounds of every pointer: super-blocks < nb of rows
        // < r0 + nr, activation blocks < nb of rows < i0 + G.
        let acc = unsafe { chunk::<F, R, G, P>(&w, &x, t..t + rr, c0..nb.min(c0 + CHUNK)) };
        for (q, acc) in acc.iter().enumerate().take(rr) {
            add_chunk(acc, &mut dst[(t + q) * G..(t + q + 1) * G], c0 == 0);
        }
    }
}

/// Pointers to a group's prepared activations.
pub(super) struct Acts<const G: usize> {
    pub(super) q: [*const i16; G],
    pub(super) scale: [*const f32; G],
    pub(super) sums: [*const f32; G],
}

impl<const G: usize> Acts<G> {
    /// Rows `i0..i0 + G` of `a`, for weight rows `rows` of `s` and `dst_len` results: asserts
    /// that every super-block the kernels read, of weights and activations, and every result
    /// they write is in bounds.
    pub(super) fn new(
        s: &Segment,
        rows: std::ops::Range<usize>,
        a: &KActs,
        i0: usize,
        dst_len: usize,
    ) -> Self {
        let (k, nb) = (a.k, a.k / QK);
        assert!(
            s.bytes().len() >= rows.end * s.row_bytes()
                && s.cols == k
                && a.q().len() >= (i0 + G) * k
                && a.scale.len() >= (i0 + G) * nb
                && a.sums.len() >= (i0 + G) * nb * SUMS
                && dst_len >= rows.len() * G
        );
        Self {
            q: std::array::from_fn(|j| a.q()[(i0 + j) * k..].as_ptr()),
            scale: std::array::from_fn(|j| a.scale[(i0 + j) * nb..].as_ptr()),
            sums: std::array::from_fn(|j| a.sums[(i0 + j) * nb * SUMS..].as_ptr()),
        }
    }
}

/// The (chunk, group of weight rows) pairs of a tile of `groups` groups, `k` wide, in the
/// order the kernels walk them. When the group's activation rows (`group_bytes`) do not fit L1
/// (eight 16-bit rows of an 8960-wide matrix are 143 KiB), one chunk of them stays there while every row of the
/// tile passes it, instead of coming from L2 once per weight row. Otherwise row after row, so
/// each weight row streams in order (decode reads DRAM).
pub(super) fn order(
    group_bytes: usize,
    k: usize,
    groups: usize,
) -> impl Iterator<Item = (usize, usize)> {
    let chunks = (k / QK).div_ceil(CHUNK);
    let chunk_outer = group_bytes > L1_ACTS;
    (0..chunks * groups).map(move |i| match chunk_outer {
        true => (i / groups, i % groups),
        false => (i % chunks, i / chunks),
    })
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
            // rows further ahead. Measured on DRAM-resident Q4_K: 5.8 GB/s without, 24 GB/s
            // with, single thread.
            if P {
                prefetch(blk, w);
            }
            let (wv, d, mins) = prep::<F>(blk);
            block::<F, G>(&wv, d, mins, x, b, &mut acc[q]);
        }
    }
    acc
}

/// Fetches the super-block `w.pf` bytes past `blk` into L1 (a prefetch never faults, so
/// running past the matrix is harmless).
#[inline(always)]
unsafe fn prefetch(blk: *const u8, w: &Weights) {
    prefetch_at(blk.wrapping_add(w.pf), w.bb);
}

/// Fetches the `bb`-byte super-block at `ahead` into L1.
#[inline(always)]
pub(super) unsafe fn prefetch_at(ahead: *const u8, bb: usize) {
    // Three or four lines: super-blocks are 144 to 210 bytes.
    _mm_prefetch::<_MM_HINT_T0>(ahead.cast());
    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(64).cast());
    _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(128).cast());
    if bb > 192 {
        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(192).cast());
    }
}

/// One super-block `b` of a weight row (`wv`, `d`, `mins` from `prep`) times the group's
/// activations, added to the 16-lane partial sums `acc`.
#[inline(always)]
unsafe fn block<const F: u8, const G: usize>(
    wv: &[__m512i; 8],
    d: f32,
    mins: __m512,
    x: &Acts<G>,
    b: usize,
    acc: &mut [__m512; G],
) {
    // Written out for each row: as a loop, LLVM kept six to eight rows rolled, their sums on
    // the stack and stored and reloaded every super-block (Qwen2.5-shaped step, six rows:
    // 43.5-44.5 ms where five took 33.4-34.3). The guards are constants.
    macro_rules! each_row {
        ($($j:literal)*) => {$(
            if $j < G {
                let xq = x.q[$j].add(b * QK).cast::<__m512i>();
                // Two chains a row, added at the end: the lane sums are exact integers, so
                // the order does not change them.
                let mut ia = [_mm512_setzero_si512(); 2];
                for (v, &wv) in wv.iter().enumerate() {
                    ia[v % 2] = dpwssd(ia[v % 2], wv, _mm512_loadu_si512(xq.add(v)));
                }
                let sum = _mm512_add_epi32(ia[0], ia[1]);
                acc[$j] = fold::<F, G>(acc[$j], sum, d, mins, x, $j, b);
            }
        )*};
    }
    each_row!(0 1 2 3 4 5 6 7);
}

/// `acc` plus the pair products of `w` and `x` in one `vpdpwssd`. LLVM lowers the intrinsic
/// to `vpmaddwd` + `vpaddd` when tuning for Intel cores, which shortens a chain of them (the
/// add's latency, not the multiply's, is carried) but issues two instructions per 32
/// multiply-adds; `block` has 2·G independent chains, enough to hide the fused latency.
/// Qwen2.5-shaped layers, six alternating rounds: four generated rows 73–76 against 80–87 ms
/// a step, eight 115–124 against 125–138.
#[inline(always)]
unsafe fn dpwssd(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
    #[cfg(target_feature = "avx512vnni")]
    {
        let mut acc = acc;
        // SAFETY: VNNI is enabled for this build; registers only.
        std::arch::asm!(
            "vpdpwssd {acc}, {w}, {x}",
            acc = inout(zmm_reg) acc,
            w = in(zmm_reg) w,
            x = in(zmm_reg) x,
            options(pure, nomem, nostack),
        );
        acc
    }
    #[cfg(not(target_feature = "avx512vnni"))]
    dot_acc(acc, w, x)
}

/// `acc` plus super-block `b`'s i32 lane sums `ia` against activation row `j`, scaled, less the
/// mins: the float steps every kernel takes in this one order, so a row's bits do not depend
/// on which kernel it went through.
#[inline(always)]
pub(super) unsafe fn fold<const F: u8, const G: usize>(
    acc: __m512,
    ia: __m512i,
    d: f32,
    mins: __m512,
    x: &Acts<G>,
    j: usize,
    b: usize,
) -> __m512 {
    let scale = _mm512_set1_ps(d * *x.scale[j].add(b));
    let acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia), scale, acc);
    if F == Q6K {
        return acc;
    }
    _mm512_fnmadd_ps(mins, _mm512_loadu_ps(x.sums[j].add(b * SUMS)), acc)
}

/// Adds one chunk's partial sums of a weight row to its results `dst[j]` (the first chunk,
/// `first`, sets them).
#[inline(always)]
pub(super) fn add_chunk<const G: usize>(acc: &[__m512; G], dst: &mut [f32], first: bool) {
    for (&acc, d) in acc.iter().zip(dst) {
        // SAFETY: plain AVX-512F, which this module is compiled for.
        let v = unsafe { _mm512_reduce_add_ps(acc) };
        *d = if first { v } else { *d + v };
    }
}

/// A tile's weight rows unpacked by `prep` (eight weight vectors, then `dmin·m_j`, per row
/// and super-block; `d` apart), kept for the next group of the same prefill span.
///
/// Prefill meets each tile with SPAN groups in a row, so a Q6_K tile (bit merges, a lane
/// permute and a multiply per weight vector) is unpacked once per span instead of once per
/// group: Q6_K 1536 × 8960 against 256 activation rows, one thread, best of 12, three rounds,
/// went from 41–45 to 52–55 GMAC/s. Q4_K, whose unpacking is cheap, was no faster reading its
/// vectors back and keeps `rows`. Results are bit for bit those of `rows`: the same vectors
/// meet the same activations in the same order.
struct Unpacked {
    /// (span, segment bytes, first row, rows) of what `w` and `d` hold.
    key: Option<(u64, usize, usize, usize)>,
    w: Vec<__m512i>,
    d: Vec<f32>,
}

/// Vectors per unpacked row and super-block.
const UNPACKED: usize = 9;

thread_local! {
    static TILE: std::cell::RefCell<Unpacked> = const {
        std::cell::RefCell::new(Unpacked { key: None, w: Vec::new(), d: Vec::new() })
    };
}

/// Frees this thread's unpacked tile.
pub(super) fn release() {
    TILE.with_borrow_mut(|u| (u.key, u.w, u.d) = (None, Vec::new(), Vec::new()));
}

/// `rows` for prefill span `span`: rows `r0..r0 + nr` are unpacked on this thread's first call
/// of the span and reused by its later calls.
#[allow(clippy::type_complexity)]
pub(super) fn span_rows<const F: u8, const G: usize>(
    span: u64,
    (s, r0, nr, a, i0, dst): (&Segment, usize, usize, &KActs, usize, &mut [f32]),
) {
    let (k, rb, data) = (s.cols, s.row_bytes(), s.bytes());
    let nb = k / QK;
    let x = Acts::<G>::new(s, r0..r0 + nr, a, i0, dst.len());
    TILE.with_borrow_mut(|u| {
        let key = (span, data.as_ptr() as usize, r0, nr);
        if u.key != Some(key) {
            u.key = None;
            u.w.clear();
            u.d.clear();
            let bb = s.format.block_bytes();
            for t in 0..nr {
                for b in 0..nb {
                    // SAFETY: super-block b < nb of row r0 + t < r0 + nr, within the bounds
                    // `Acts::new` asserted.
                    let (wv, d, mins) =
                        unsafe { prep::<F>(data[(r0 + t) * rb + b * bb..].as_ptr()) };
                    u.w.extend(wv);
                    // SAFETY: a plain AVX-512F cast.
                    u.w.push(unsafe { _mm512_castps_si512(mins) });
                    u.d.push(d);
                }
            }
            u.key = Some(key);
        }
        for (c, t) in order(G * k * 2, k, nr) {
            let c0 = c * CHUNK;
            // SAFETY: plain AVX-512F.
            let mut acc = [unsafe { _mm512_setzero_ps() }; G];
            for b in c0..nb.min(c0 + CHUNK) {
                let at = t * nb + b;
                let v = &u.w[at * UNPACKED..(at + 1) * UNPACKED];
                let wv: [__m512i; 8] = std::array::from_fn(|q| v[q]);
                // SAFETY: activation blocks < nb of rows < i0 + G (`Acts::new`); AVX-512F.
                unsafe { block::<F, G>(&wv, u.d[at], _mm512_castsi512_ps(v[8]), &x, b, &mut acc) };
            }
            add_chunk(&acc, &mut dst[t * G..(t + 1) * G], c0 == 0);
        }
    });
}

/// How far ahead of the block being multiplied the one-row kernel prefetches (1–6 KiB
/// measured alike, two threads on DRAM-resident matrices).
pub(super) const PREFETCH_ONE: usize = 4096;

/// Weight rows `r0..r0 + nr` times activation row `i0` given as bytes (`KActs::bytes`), into
/// `dst[row]`: decode's kernel, one weight row after another.
///
/// A weight is read once from memory here, so unpacking decides the speed: Q4_K 1536 × 256,
/// L2-resident, one thread, went from 9–12 GB/s (`rows`) to 14 GB/s. Rows stream one at a
/// time in address order, which the hardware prefetcher follows: twelve DRAM-resident
/// 8960 × 1536 matrices, two threads, read Q4_K at 20–25.7 GB/s (`rows`: 14–19) and Q6_K at
/// 18–23 (16–19); walking four rows together, as `rows` does, fell to 13–20.
#[allow(clippy::type_complexity)]
pub(super) fn one_row<const F: u8>(
    (s, r0, nr, a, i0, dst): (&Segment, usize, usize, &KActs, usize, &mut [f32]),
) {
    let (k, rb, data) = (s.cols, s.row_bytes(), s.bytes());
    let nb = k / QK;
    let x = Acts::<1>::new(s, r0..r0 + nr, a, i0, dst.len());
    let bytes = a.bytes.as_ref().expect("one_row needs the row as bytes");
    assert!(i0 == 0 && bytes.hi.as_slice().len() == k && bytes.hs.as_slice().len() == k / 2);
    assert!(bytes.lo.as_ref().is_none_or(|lo| lo.as_slice().len() == k));
    let w = Weights {
        data,
        r0,
        rb,
        bb: s.format.block_bytes(),
        pf: PREFETCH_ONE,
    };
    let (hi, hs) = (bytes.hi.as_slice().as_ptr(), bytes.hs.as_slice().as_ptr());
    // Rounded to 8 bits, a row has no low bytes; `byte_block::<F, false>` never reads `lo`.
    let lo = bytes
        .lo
        .as_ref()
        .map_or(std::ptr::null(), |lo| lo.as_slice().as_ptr());
    let wide = bytes.lo.is_some();
    for t in 0..nr {
        let row = data[(r0 + t) * rb..].as_ptr();
        for c0 in (0..nb).step_by(CHUNK) {
            // SAFETY: plain AVX-512F.
            let mut acc = unsafe { _mm512_setzero_ps() };
            for b in c0..nb.min(c0 + CHUNK) {
                // SAFETY: super-block b < nb of row r0 + t < r0 + nr, and activation block
                // b < nb, within the bounds `Acts::new` and the assert above checked.
                unsafe {
                    let blk = row.add(b * w.bb);
                    prefetch(blk, &w);
                    let at = b * QK;
                    let (hi, lo, hs) = (hi.add(at), lo.wrapping_add(at), hs.add(at / 2));
                    let (ia, d, mins) = match wide {
                        true => byte_block::<F, true>(blk, hi, lo, hs),
                        false => byte_block::<F, false>(blk, hi, lo, hs),
                    };
                    acc = fold::<F, 1>(acc, ia, d, mins, &x, 0, b);
                }
            }
            add_chunk(&[acc], &mut dst[t..t + 1], c0 == 0);
        }
    }
}

/// One super-block against one activation row as bytes (`WIDE`: 16-bit activations as high and
/// low bytes; otherwise 8-bit ones in `hi` and `lo` unused): the i32 lane sums, `d` and the
/// mins.
///
/// Per run, `vpmaddubsw` sums neighbouring pairs of value × activation byte into i16 without
/// saturating (|pair| ≤ 2·63·255 < 2¹⁵), and `vpdpwssd` multiplies the pairs by their
/// sub-block scale. Q6_K's values carry an offset of 32: the low bytes meet `q − 32` (signed),
/// the high bytes meet `q` and lose `32·(hi + hi')` per pair (`RowBytes::hs`; |pair| ≤
/// 2·63·128 + 32·256 < 2¹⁵). Summing high and low halves apart and combining them as
/// `256·high + low` gives the lane the same integer as `prep`'s vectors (i32 wraps, so only
/// the final sum has to fit, and it does). Rounded to 8 bits, the high half is the sum.
#[inline(always)]
unsafe fn byte_block<const F: u8, const WIDE: bool>(
    b: *const u8,
    hi: *const i8,
    lo: *const u8,
    hs: *const i16,
) -> (__m512i, f32, __m512) {
    let n = runs::<F>(b);
    let (s, d, mins) = run_scales::<F>(b);
    let (mut high, mut low) = (_mm512_setzero_si512(), _mm512_setzero_si512());
    for r in 0..4 {
        let h = _mm512_load_si512(hi.add(64 * r).cast());
        let mut hp = _mm512_maddubs_epi16(n[r], h);
        if F == Q6K {
            hp = _mm512_sub_epi16(hp, _mm512_load_si512(hs.add(32 * r).cast()));
        }
        high = dot_acc(high, hp, s[r]);
        if WIDE {
            let l = _mm512_load_si512(lo.add(64 * r).cast());
            let lp = match F == Q6K {
                true => _mm512_maddubs_epi16(l, _mm512_sub_epi8(n[r], _mm512_set1_epi8(32))),
                false => _mm512_maddubs_epi16(l, n[r]),
            };
            low = dot_acc(low, lp, s[r]);
        }
    }
    match WIDE {
        true => (_mm512_add_epi32(_mm512_slli_epi32::<8>(high), low), d, mins),
        false => (high, d, mins),
    }
}
