//! Prompt rows on AVX-512: a tile's weight rows across the lanes.
//!
//! The batch kernels (`rows`, `span_rows`) give each (weight row, activation row) pair its own
//! accumulator, so every super-block of every pair pays a float fold (convert, scale, mins)
//! beside its eight `vpdpwssd`, and every `vpdpwssd` loads a 64-byte activation operand. Here
//! lane `l` of a vector is weight row `l` of a group of sixteen: a weight vector holds one
//! i16 pair of each row (scales folded in, as `prep` makes them), and it meets a pair of
//! activations broadcast from memory. One `vpdpwssd` then serves sixteen rows, the float
//! fold is shared by them, and the weight vector, loaded once, serves the whole group of
//! activation rows.
//!
//! The price is the order of the float sums, which differs from the batch kernels' (those sum
//! sixteen lanes of four-element pieces; here each row's integers are exact per segment and
//! summed as floats segment after segment). So prompt rows, which take this kernel, and
//! generated rows, which take the others, differ in the last bits. A row's result here does
//! not depend on the other rows of its group or span.

use std::arch::x86_64::*;

use super::super::Segment;
use super::avx512::{dot_acc, prep, Acts};
use super::{KActs, Q4K, Q5K, Q6K, QK, SUMS};

/// Weight rows per lane group (one i32 lane each).
const LANES: usize = 16;
/// i16 pairs of a super-block: its weight vectors per lane group.
const PAIRS: usize = QK / 2;
/// Float vectors per lane group and super-block: `d`, then `dmin·m_j` of the eight sub-blocks.
const FLOATS: usize = 9;
/// Super-blocks of the group's activations walked over every lane group of the tile while
/// they sit in L1 (eight rows: 6 · 512 B · 8 = 24 KiB).
const COLS: usize = 6;

/// Pairs summed in i32 before the lanes go to float. A lane's sum of products must stay below
/// 2³¹ whatever the values: |x16| ≤ 32767 against |w| ≤ 945 (Q4_K: 64 products), 1953 (Q5_K:
/// 32) or 4096 (Q6_K: 16, and 16 · 4096 · 32767 = 2147418112).
const fn segment_pairs(f: u8) -> usize {
    if f == Q4K {
        32
    } else if f == Q5K {
        16
    } else {
        8
    }
}

/// A tile's rows, packed across lanes, kept for the span's next groups.
struct Packed {
    /// (span, segment bytes, first row, rows) of what `w` and `f` hold.
    key: Option<(u64, usize, usize, usize)>,
    /// `[lane group][super-block][PAIRS]`: vector `t` holds pair `t` of sixteen rows, the pair
    /// that meets the activations' stored i16 values `2t` and `2t + 1` of the super-block.
    w: Vec<__m512i>,
    /// `[lane group][super-block][FLOATS]`.
    f: Vec<__m512>,
    /// `[lane group][G]`: the float sums carried from one column chunk to the next.
    acc: Vec<__m512>,
}

thread_local! {
    static PACKED: std::cell::RefCell<Packed> = const {
        std::cell::RefCell::new(Packed { key: None, w: Vec::new(), f: Vec::new(), acc: Vec::new() })
    };
}

/// Rows `r0..r0 + nr` of `s` times activation rows `i0..i0 + G` of `a`, into `dst[row * G +
/// j]`; the rows are packed on this thread's first call of prefill span `span` and reused by
/// its later calls.
#[allow(clippy::type_complexity)]
pub(super) fn span_lanes<const F: u8, const G: usize>(
    span: u64,
    (s, r0, nr, a, i0, dst): (&Segment, usize, usize, &KActs, usize, &mut [f32]),
) {
    let nb = s.cols / QK;
    let x = Acts::<G>::new(s, r0..r0 + nr, a, i0, dst.len());
    let groups = nr.div_ceil(LANES);
    PACKED.with_borrow_mut(|p| {
        let key = (span, s.bytes().as_ptr() as usize, r0, nr);
        if p.key != Some(key) {
            p.key = None;
            pack::<F>(s, r0, nr, p);
            p.key = Some(key);
        }
        // SAFETY: plain AVX-512F.
        p.acc.resize(groups * G, unsafe { _mm512_setzero_ps() });
        for c0 in (0..nb).step_by(COLS) {
            for (gi, acc) in p.acc.chunks_exact_mut(G).enumerate() {
                // SAFETY: plain AVX-512F.
                let mut sums: [__m512; G] = std::array::from_fn(|j| match c0 {
                    0 => unsafe { _mm512_setzero_ps() },
                    _ => acc[j],
                });
                for b in c0..nb.min(c0 + COLS) {
                    let at = gi * nb + b;
                    // SAFETY: `pack` wrote `groups · nb` super-blocks of PAIRS and FLOATS
                    // vectors; activation block b < nb of rows < i0 + G (`Acts::new`).
                    unsafe {
                        block::<F, G>(
                            p.w[at * PAIRS..].as_ptr(),
                            p.f[at * FLOATS..].as_ptr(),
                            &x,
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

/// Super-block `b` of a lane group (`w`: its PAIRS weight vectors, `f`: its FLOATS) times the
/// group's activations, added to the float sums (lane = weight row).
#[inline(always)]
unsafe fn block<const F: u8, const G: usize>(
    w: *const __m512i,
    f: *const __m512,
    x: &Acts<G>,
    b: usize,
    sums: &mut [__m512; G],
) {
    let seg = segment_pairs(F);
    let scale: [__m512; G] =
        std::array::from_fn(|j| _mm512_mul_ps(*f, _mm512_set1_ps(*x.scale[j].add(b))));
    let pairs: [*const i32; G] = std::array::from_fn(|j| x.q[j].add(b * QK).cast::<i32>());
    for s0 in (0..PAIRS).step_by(seg) {
        let mut ia = [_mm512_setzero_si512(); G];
        for t in s0..s0 + seg {
            let wv = _mm512_load_si512(w.add(t).cast());
            for (j, ia) in ia.iter_mut().enumerate() {
                *ia = dot_acc(*ia, wv, _mm512_set1_epi32(pairs[j].add(t).read_unaligned()));
            }
        }
        for j in 0..G {
            sums[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[j]), scale[j], sums[j]);
        }
    }
    if F != Q6K {
        for (j, sum) in sums.iter_mut().enumerate() {
            let at = x.sums[j].add(b * SUMS);
            for m in 0..8 {
                *sum = _mm512_fnmadd_ps(*f.add(1 + m), _mm512_set1_ps(*at.add(m)), *sum);
            }
        }
    }
}

/// Packs rows `r0..r0 + nr` of `s` into `p.w` and `p.f`, sixteen rows per lane group (the
/// last group repeats its last row; those lanes are never written out).
fn pack<const F: u8>(s: &Segment, r0: usize, nr: usize, p: &mut Packed) {
    let (nb, rb, bb, data) = (
        s.cols / QK,
        s.row_bytes(),
        s.format.block_bytes(),
        s.bytes(),
    );
    let groups = nr.div_ceil(LANES);
    assert!(nr > 0 && data.len() >= (r0 + nr) * rb);
    p.w.clear();
    p.f.clear();
    p.w.reserve(groups * nb * PAIRS);
    p.f.reserve(groups * nb * FLOATS);
    for gi in 0..groups {
        // Super-block b of sixteen rows is sixteen strided reads, which the hardware
        // prefetcher does not follow: ask for the group's bytes (contiguous) up front.
        let bytes = &data[(r0 + gi * LANES) * rb..(r0 + nr.min((gi + 1) * LANES)) * rb];
        for line in bytes.chunks(64) {
            // SAFETY: a prefetch of memory inside `data`.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(line.as_ptr().cast()) };
        }
        for b in 0..nb {
            // SAFETY: super-block b < nb of row r < r0 + nr, within `data` (asserted above);
            // the rest is plain AVX-512F on local arrays.
            unsafe {
                let mut w = [[_mm512_setzero_si512(); 8]; LANES];
                let mut d = [0f32; LANES];
                let mut mins = [[0f32; 16]; LANES];
                for l in 0..LANES {
                    let r = r0 + (gi * LANES + l).min(nr - 1);
                    let (wv, dl, mn) = prep::<F>(data[r * rb + b * bb..].as_ptr());
                    (w[l], d[l]) = (wv, dl);
                    _mm512_storeu_ps(mins[l].as_mut_ptr(), mn);
                }
                p.w.extend((0..8).flat_map(|v| transpose(std::array::from_fn(|l| w[l][v]))));
                p.f.push(_mm512_loadu_ps(d.as_ptr()));
                p.f.extend((0..8).map(|m| {
                    let col: [f32; LANES] = std::array::from_fn(|l| mins[l][m]);
                    _mm512_loadu_ps(col.as_ptr())
                }));
            }
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
unsafe fn transpose(mut r: [__m512i; 16]) -> [__m512i; 16] {
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
