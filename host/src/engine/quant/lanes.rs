//! Prompt rows on AVX-512: a tile's weight rows across the lanes, for every format.
//!
//! The batch kernels give each (weight row, activation row) pair its own accumulator, so every
//! block of every pair pays its own float fold, and every multiply loads a 64-byte activation
//! operand. Here lane `l` of a vector is weight row `l` of a group of sixteen: a weight vector
//! holds one i16 pair of each row, and it meets a pair of 16-bit activations broadcast from
//! memory. One `vpdpwssd` then serves sixteen rows, the float fold is shared by them, and the
//! weight vector, loaded once, serves the whole group of activation rows.
//!
//! A format supplies how a block of sixteen rows is packed (`LaneFormat`) and how a packed
//! block meets its activations (`LaneKernel`): the k-quants in `k_kernels::lanes`, the
//! 32-element formats in `lanes::q32`. This module walks the tile and keeps the packed rows.
//!
//! The price is rounding: activations are 16-bit integers here, and each row's integers are
//! exact per block (or segment) and summed as floats one after another, an order the batch
//! kernels do not share. So prompt rows, which take this kernel, and generated rows, which take
//! the others, differ in the last bits. A row's result here does not depend on the other rows
//! of its group or span.

use std::arch::x86_64::*;

use super::Segment;

pub(super) mod q32;

/// Weight rows per lane group (one i32 lane each).
pub(super) const LANES: usize = 16;
/// Activation elements of the group walked over every lane group of the tile while they sit
/// in L1 (eight rows of 16-bit values: 8 · 1536 · 2 B = 24 KiB).
const CHUNK: usize = 1536;

/// How a weight format's blocks go across the lanes.
pub(super) trait LaneFormat {
    /// Elements per block: the unit packed with its float vectors.
    const ELEMS: usize;
    /// Weight vectors per block and lane group (the block's i16 pairs).
    const PAIRS: usize;
    /// Float vectors per block and lane group.
    const FLOATS: usize;
    /// Bytes per block: each format's differ, so a segment is checked against the packer.
    const BLOCK_BYTES: usize;

    /// Appends a block of sixteen rows (`rows[l]`: the block's bytes in row `l`): PAIRS weight
    /// vectors to `w`, vector `t` holding pair `t` of every row, and FLOATS vectors to `f`.
    ///
    /// # Safety
    /// Each pointer must address a whole block of the format; AVX-512BW must be present.
    unsafe fn pack_block(rows: &[*const u8; LANES], w: &mut Vec<__m512i>, f: &mut Vec<__m512>);
}

/// How a packed block meets G activation rows.
pub(super) trait LaneKernel<const G: usize>: LaneFormat {
    /// The group's activations, as `block` reads them.
    type Acts;

    /// Packed block `b` of a lane group (`w`: its PAIRS weight vectors, `f`: its FLOATS) times
    /// the group's activations, added to the float sums (lane = weight row).
    ///
    /// # Safety
    /// `w` and `f` must hold a packed block; `x` must cover block `b` of its G rows.
    unsafe fn block(
        w: *const __m512i,
        f: *const __m512,
        x: &Self::Acts,
        b: usize,
        sums: &mut [__m512; G],
    );
}

/// `acc + Σ` of `w`'s and `x`'s 16-bit pair products, per i32 lane (`vpdpwssd`).
#[inline(always)]
pub(super) unsafe fn dot_acc(acc: __m512i, w: __m512i, x: __m512i) -> __m512i {
    #[cfg(target_feature = "avx512vnni")]
    {
        _mm512_dpwssd_epi32(acc, w, x)
    }
    #[cfg(not(target_feature = "avx512vnni"))]
    {
        _mm512_add_epi32(acc, _mm512_madd_epi16(w, x))
    }
}

/// Most prompt rows the `across` kernels (`k_kernels::across`, `q32::across`) take. Each row
/// costs a `vpdpwssd` per 32 weights and the segment reductions; past two rows `few`, whose
/// broadcasts serve sixteen rows, costs less.
pub(super) const ACROSS_ROWS: usize = 2;

/// Rows `r0..r0 + nr` of `s` sixteen at a time for an `across` kernel: `group(rows)` gets the
/// sixteen rows' bytes (the last group repeating its last row, as the lanes kernel packs it;
/// those lanes are never written out) and returns `[j][l]`, activation row `j` against weight
/// row `l`, which lands in `dst[row * m + j]`.
pub(super) fn across_groups(
    s: &Segment,
    (r0, nr): (usize, usize),
    m: usize,
    dst: &mut [f32],
    group: impl Fn(&[*const u8; LANES]) -> [[f32; LANES]; ACROSS_ROWS],
) {
    assert!(m <= ACROSS_ROWS && dst.len() >= nr * m);
    for g0 in (r0..r0 + nr).step_by(LANES) {
        let n = (r0 + nr - g0).min(LANES);
        let rows: [*const u8; LANES] =
            std::array::from_fn(|l| s.bytes()[(g0 + l.min(n - 1)) * s.row_bytes()..].as_ptr());
        let sums = group(&rows);
        for l in 0..n {
            for j in 0..m {
                dst[(g0 - r0 + l) * m + j] = sums[j][l];
            }
        }
    }
}

/// Each of sixteen vectors' lanes added across, halves apart: lane `l` of the first result is
/// the sum of lanes 0..8 of `v[l]`, of the second the sum of its lanes 8..16. Integer sums are
/// exact in any order, so these are the sums a lane of `span_lanes` accumulates pair by pair.
#[inline(always)]
pub(super) unsafe fn reduce_halves(v: &[__m512i; LANES]) -> (__m512i, __m512i) {
    // Within 128-bit chunks: lanes 0+2 and 1+3 of two vectors, side by side.
    let a: [__m512i; 8] = std::array::from_fn(|p| {
        let (x, y) = (v[2 * p], v[2 * p + 1]);
        _mm512_add_epi32(_mm512_unpacklo_epi32(x, y), _mm512_unpackhi_epi32(x, y))
    });
    // Each chunk of b[q] holds its chunk's sum for vectors 4q..4q + 4.
    let b: [__m512i; 4] = std::array::from_fn(|q| {
        let (x, y) = (a[2 * q], a[2 * q + 1]);
        _mm512_add_epi32(_mm512_unpacklo_epi64(x, y), _mm512_unpackhi_epi64(x, y))
    });
    // c[r]: vectors 8r..8r + 4, chunks 0+1 then 2+3; vectors 8r + 4..8r + 8, the same.
    let c: [__m512i; 2] = std::array::from_fn(|r| {
        let (x, y) = (b[2 * r], b[2 * r + 1]);
        _mm512_add_epi32(
            _mm512_shuffle_i32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_i32x4::<0b11_01_11_01>(x, y),
        )
    });
    (
        _mm512_shuffle_i32x4::<0b10_00_10_00>(c[0], c[1]),
        _mm512_shuffle_i32x4::<0b11_01_11_01>(c[0], c[1]),
    )
}

/// The f16 at `p` (a block's scale) as f32.
#[inline(always)]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
        p.cast::<u16>().read_unaligned() as i32,
    )))
}

/// A tile's rows, packed across lanes, kept for the span's next groups.
struct Packed {
    /// (span, segment bytes, first row, rows) of what `w` and `f` hold.
    key: Option<(u64, usize, usize, usize)>,
    /// `[lane group][block][PAIRS]`.
    w: Vec<__m512i>,
    /// `[lane group][block][FLOATS]`.
    f: Vec<__m512>,
    /// `[lane group][G]`: the float sums carried from one column chunk to the next.
    acc: Vec<__m512>,
}

thread_local! {
    static PACKED: std::cell::RefCell<Packed> = const {
        std::cell::RefCell::new(Packed { key: None, w: Vec::new(), f: Vec::new(), acc: Vec::new() })
    };
}

/// Frees this thread's packed tile.
pub(super) fn release() {
    PACKED.with_borrow_mut(|p| {
        (p.key, p.w, p.f, p.acc) = (None, Vec::new(), Vec::new(), Vec::new());
    });
}

/// Rows `r0..r0 + nr` of `s` times the G activation rows `x`, into `dst[row * G + j]`; the
/// rows are packed on this thread's first call of prefill span `span` and reused by its later
/// calls.
///
/// # Safety
/// `x` must cover the `s.cols / L::ELEMS` blocks of its G rows that `L::block` reads.
pub(super) unsafe fn span_lanes<L: LaneKernel<G>, const G: usize>(
    span: u64,
    s: &Segment,
    (r0, nr): (usize, usize),
    x: &L::Acts,
    dst: &mut [f32],
) {
    let nb = s.cols / L::ELEMS;
    let groups = nr.div_ceil(LANES);
    assert!(dst.len() >= nr * G);
    PACKED.with_borrow_mut(|p| {
        let key = (span, s.bytes().as_ptr() as usize, r0, nr);
        if p.key != Some(key) {
            p.key = None;
            pack::<L>(s, r0, nr, p);
            p.key = Some(key);
        }
        // Cleared, not only resized: with no columns nothing below writes the sums.
        p.acc.clear();
        // SAFETY: plain AVX-512F.
        p.acc.resize(groups * G, unsafe { _mm512_setzero_ps() });
        let cols = (CHUNK / L::ELEMS).max(1);
        for c0 in (0..nb).step_by(cols) {
            for (gi, acc) in p.acc.chunks_exact_mut(G).enumerate() {
                // SAFETY: plain AVX-512F.
                let mut sums: [__m512; G] = std::array::from_fn(|j| match c0 {
                    0 => unsafe { _mm512_setzero_ps() },
                    _ => acc[j],
                });
                for b in c0..nb.min(c0 + cols) {
                    let at = gi * nb + b;
                    // SAFETY: `pack` wrote `groups · nb` blocks of PAIRS and FLOATS vectors;
                    // the activations cover blocks b < nb (this function's contract).
                    unsafe {
                        L::block(
                            p.w[at * L::PAIRS..].as_ptr(),
                            p.f[at * L::FLOATS..].as_ptr(),
                            x,
                            b,
                            &mut sums,
                        )
                    };
                }
                acc.copy_from_slice(&sums);
            }
        }
        for (gi, acc) in p.acc.chunks_exact(G).enumerate() {
            let rows = (nr - gi * LANES).min(LANES);
            for (j, &v) in acc.iter().enumerate() {
                let mut lanes = [0f32; LANES];
                // SAFETY: plain AVX-512F; `lanes` holds 16 floats.
                unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), v) };
                for (l, &v) in lanes.iter().enumerate().take(rows) {
                    dst[(gi * LANES + l) * G + j] = v;
                }
            }
        }
    });
}

/// Packs rows `r0..r0 + nr` of `s` into `p.w` and `p.f`, sixteen rows per lane group (the
/// last group repeats its last row; those lanes are never written out).
fn pack<L: LaneFormat>(s: &Segment, r0: usize, nr: usize, p: &mut Packed) {
    let (nb, rb, bb, data) = (
        s.cols / L::ELEMS,
        s.row_bytes(),
        s.format.block_bytes(),
        s.bytes(),
    );
    let groups = nr.div_ceil(LANES);
    assert!(
        s.format.block_elems() == L::ELEMS
            && s.format.block_bytes() == L::BLOCK_BYTES
            && nr > 0
            && data.len() >= (r0 + nr) * rb,
        "a lanes kernel for the segment's format, over its rows"
    );
    p.w.clear();
    p.f.clear();
    p.w.reserve(groups * nb * L::PAIRS);
    p.f.reserve(groups * nb * L::FLOATS);
    for gi in 0..groups {
        // Block b of sixteen rows is sixteen strided reads, which the hardware prefetcher does
        // not follow: ask for the group's bytes (contiguous) up front.
        let bytes = &data[(r0 + gi * LANES) * rb..(r0 + nr.min((gi + 1) * LANES)) * rb];
        for line in bytes.chunks(64) {
            // SAFETY: a prefetch of memory inside `data`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
        }
        for b in 0..nb {
            let rows: [*const u8; LANES] = std::array::from_fn(|l| {
                let r = r0 + (gi * LANES + l).min(nr - 1);
                data[r * rb + b * bb..].as_ptr()
            });
            // SAFETY: block b < nb of rows < r0 + nr, inside `data` (asserted above), of the
            // format L packs (asserted above); this module is built for AVX-512BW.
            unsafe { L::pack_block(&rows, &mut p.w, &mut p.f) };
        }
    }
}

/// Indices of `transpose`'s stage `i`: the first of a row pair `(a, a + h)` keeps its columns
/// with bit `i` clear and takes the second's from `h` lower; the second the converse.
const fn stage_idx(i: usize) -> [[i32; 16]; 2] {
    let h = 1 << i;
    let mut t = [[0i32; 16]; 2];
    let mut c = 0;
    while c < 16 {
        (t[0][c], t[1][c]) = if c & h == 0 {
            (c as i32, (c + h) as i32)
        } else {
            ((16 + c - h) as i32, (16 + c) as i32)
        };
        c += 1;
    }
    t
}

static STAGES: [[[i32; 16]; 2]; 4] = [stage_idx(0), stage_idx(1), stage_idx(2), stage_idx(3)];

/// A 16 × 16 transpose of 32-bit elements: each stage swaps bit `i` of the row and column
/// indices.
#[inline(always)]
pub(super) unsafe fn transpose(mut r: [__m512i; 16]) -> [__m512i; 16] {
    for (i, idx) in STAGES.iter().enumerate() {
        let h = 1 << i;
        let (lo, hi) = (
            _mm512_loadu_si512(idx[0].as_ptr().cast()),
            _mm512_loadu_si512(idx[1].as_ptr().cast()),
        );
        for a in (0..16).filter(|a| a & h == 0) {
            let (x, y) = (r[a], r[a + h]);
            r[a] = _mm512_permutex2var_epi32(x, lo, y);
            r[a + h] = _mm512_permutex2var_epi32(x, hi, y);
        }
    }
    r
}
