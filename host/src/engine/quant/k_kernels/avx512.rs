//! AVX-512BW kernel: a super-block becomes eight 32-lane i16 weight vectors with the sub-block
//! scales folded in, each met by 32 activations in one `vpdpwssd` (VNNI; `vpmaddwd` + add
//! without it); one float conversion per super-block and activation row.

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
        let sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(b.add(192).cast())));
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
    for (c, g) in order::<G>(k, nr.div_ceil(R)) {
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
struct Acts<const G: usize> {
    q: [*const i16; G],
    scale: [*const f32; G],
    sums: [*const f32; G],
}

impl<const G: usize> Acts<G> {
    /// Rows `i0..i0 + G` of `a`, for weight rows `rows` of `s` and `dst_len` results: asserts
    /// that every super-block the kernels read, of weights and activations, and every result
    /// they write is in bounds.
    fn new(
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
/// order the kernels walk them. When a group of G activation rows does not fit L1 (eight rows
/// of an 8960-wide matrix are 143 KiB), one chunk of them stays there while every row of the
/// tile passes it, instead of coming from L2 once per weight row. Otherwise row after row, so
/// each weight row streams in order (decode reads DRAM).
fn order<const G: usize>(k: usize, groups: usize) -> impl Iterator<Item = (usize, usize)> {
    let chunks = (k / QK).div_ceil(CHUNK);
    let chunk_outer = G * k * 2 > L1_ACTS;
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
            block::<F, G>(&wv, d, mins, x, b, &mut acc[q]);
        }
    }
    acc
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
    for (j, acc) in acc.iter_mut().enumerate() {
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

/// Adds one chunk's partial sums of a weight row to its results `dst[j]` (the first chunk,
/// `first`, sets them).
#[inline(always)]
fn add_chunk<const G: usize>(acc: &[__m512; G], dst: &mut [f32], first: bool) {
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
        for (c, t) in order::<G>(k, nr) {
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
