//! Prompt rows on AMX tiles (`engine.prompt_precision = "auto"` on CPUs with AMX-BF16): each
//! 32-row weight unit is dequantized to BF16 once per call and meets every prompt row of the
//! call in `tdpbf16ps` (8,192 multiply-adds an instruction, where the 16-bit integer kernels'
//! `vpdpwssd` does 32). Every format takes them: the k-quants unpack through the batch
//! kernels' `prep` (`k_kernels::bf16_block`), the 32-element formats through `q32`, both into
//! the same order within each 32-value chunk.
//!
//! The weights are the tile unit's left operand, sixteen weight rows to a tile, so a tile row
//! is 32 of one weight row's values as dequantized: no weight is transposed. The activations
//! are the right operand, transposed once per call (tile row `r` holds pair `r` of sixteen
//! activation rows), and the 16 × 16 sums come out transposed and are turned back on the way
//! to the output. With one row (a fully cached prompt's last token, recomputed) the unit does
//! sixteen times the multiplies it needs, which cost less than dequantizing the weights.
//!
//! Precision: activations and weights are rounded to BF16 (8 significant bits each, relative
//! to each value, not to a block's largest); products and sums are f32. On the real models
//! this is measured by KL divergence from the f32 reference (`gateway eval-kl`, setting
//! `prompt`), as llama.cpp's 8-bit activations are.
//!
//! A row's result depends only on that row: the tile unit sums each output over the inputs in
//! the same order whatever the other rows are, so prompt rows stay batch-invariant however
//! many a step has.

use std::arch::asm;
use std::arch::x86_64::*;
use std::sync::atomic::Ordering;

use super::aligned::Aligned;
use super::amx::{self, K_TILE, N_TILE, TILE_VALUES};
use super::k_kernels::{bf16_block, chunk_order};
use super::lanes::transpose;
use super::{Beside, QuantMatrix, Walk, GROUP, SPANS};
use crate::engine::team::{split, split_mut, Scatter, Shares, Team};

mod q32;

/// Weight rows per work unit: two tiles of sixteen.
const ROWS: usize = 2 * N_TILE;

thread_local! {
    /// This thread's dequantized unit: `[ROWS][k]` BF16.
    static UNIT: std::cell::RefCell<Option<Aligned<u16, 32>>> = const { std::cell::RefCell::new(None) };
}

/// Frees this thread's dequantized unit.
pub(super) fn release() {
    UNIT.take();
}

impl QuantMatrix {
    /// Whether `tiles` can take this matrix: AMX-BF16 granted (every format unpacks to BF16,
    /// and every row is whole 32-value chunks).
    pub(super) fn tiles_fit(&self) -> bool {
        self.cols.is_multiple_of(K_TILE) && amx::available()
    }

    /// `out[r, ..] = x[r, ..] · selfᵀ` on AMX tiles for the rows `r` of `rows` (`tiles_fit`
    /// must hold; `x` and `out` have as many rows as each other, read and written in place);
    /// with `beside`, also its generated rows through the batch kernels into its output, unit
    /// by unit while the weights are in cache (their bits are the batch kernels' anyway).
    pub(super) fn tiles(
        &self,
        team: &Team,
        (x, rows): (&[f32], &[usize]),
        out: &mut [f32],
        beside: Option<(&Beside, &mut [f32])>,
    ) {
        let (n, k, m) = (self.rows, self.cols, rows.len());
        let total = x.len() / k;
        assert!(
            self.tiles_fit()
                && x.len() == total * k
                && out.len() == total * n
                && m > 0
                && rows.iter().all(|&r| r < total),
            "tiles: shapes"
        );
        let acts = act_tiles(team, x, rows, k);
        let units = n.div_ceil(ROWS);
        let shares = Shares::new(units, team.threads());
        // Each weight unit's outputs (columns of `out`) are written only by the thread that
        // took the unit.
        let dst = Scatter::new(out);
        let beside = beside.map(|(rows, out)| {
            assert_eq!(out.len(), rows.m * n, "output shape");
            (rows, Scatter::new(out))
        });
        let span = Walk::Span(SPANS.fetch_add(1, Ordering::Relaxed));
        team.run(&|p, _| {
            let dst = &dst;
            UNIT.with_borrow_mut(|unit| {
                if unit.as_ref().is_none_or(|u| u.as_slice().len() < ROWS * k) {
                    *unit = Some(Aligned::zeroed(ROWS * k));
                }
                let unit = &mut unit.as_mut().expect("sized above").as_mut_slice()[..ROWS * k];
                // SAFETY: `tiles_fit` checked `amx::available()`.
                unsafe {
                    amx::with_tiles(|| {
                        while let Some(u) = shares.next(p) {
                            let (r0, nr) = (u * ROWS, (n - u * ROWS).min(ROWS));
                            self.dequantize_unit(r0, nr, unit);
                            // SAFETY: `acts` holds m rows' tiles, `unit` ROWS rows of k;
                            // columns r0..r0 + nr of `out` are this unit's.
                            unit_times_acts(unit, k, &acts, rows, (dst.at(0), n), (r0, nr));
                            if let Some((rows, out)) = &beside {
                                self.beside_unit(rows, out, (r0, nr), span);
                            }
                        }
                    })
                }
            })
        });
    }

    /// The generated rows `rows` times weight rows `r0..r0 + nr` (≤ ROWS), through the batch
    /// kernels, into columns `r0..r0 + nr` of `out` (`[rows.m][n]`, this unit's).
    fn beside_unit(&self, rows: &Beside, out: &Scatter, (r0, nr): (usize, usize), span: Walk) {
        let (n, k) = (self.rows, self.cols);
        let mut d = [0f32; ROWS * GROUP];
        for i0 in (0..rows.m).step_by(GROUP) {
            let g = (rows.m - i0).min(GROUP);
            let (x, d) = (&rows.x[i0 * k..(i0 + g) * k], &mut d[..nr * g]);
            self.tile(x, &rows.acts, (i0, g), r0..r0 + nr, d, span);
            for (q, sums) in d.chunks_exact(g).enumerate() {
                for (j, &v) in sums.iter().enumerate() {
                    // SAFETY: row i0 + j < m and column r0 + q < n of `out`, whose columns
                    // r0..r0 + nr only this unit's thread writes.
                    unsafe { *out.at((i0 + j) * n + r0 + q) = v };
                }
            }
        }
    }

    /// Weight rows `r0..r0 + nr` (≤ ROWS) into `unit` (`[ROWS][k]` BF16, chunks in
    /// `chunk_order`); rows past `nr` zero.
    fn dequantize_unit(&self, r0: usize, nr: usize, unit: &mut [u16]) {
        let k = self.cols;
        unit[nr * k..].fill(0);
        for l in 0..nr {
            let s = self.segment(r0 + l);
            let (bb, row) = (
                s.format.block_bytes(),
                &s.bytes()[(r0 + l - s.row0) * s.row_bytes()..],
            );
            let dst = &mut unit[l * k..(l + 1) * k];
            let be = s.format.block_elems();
            assert!(row.len() >= k / be * bb, "a whole row");
            for (b, dst) in dst.chunks_exact_mut(be).enumerate() {
                // SAFETY: block b < k / be lies in `row` (asserted); AVX-512 BW and BF16 are
                // this module's cfg; `dst` is one block's values, 32 per vector stored.
                unsafe {
                    let at = row.as_ptr().add(b * bb);
                    if s.format.is_k() {
                        let v = bf16_block(s.format, at);
                        for (c, v) in v.iter().enumerate() {
                            _mm512_storeu_si512(dst.as_mut_ptr().add(32 * c).cast(), *v);
                        }
                    } else {
                        _mm512_storeu_si512(dst.as_mut_ptr().cast(), q32::block(s.format, at));
                    }
                }
            }
        }
    }
}

/// The activation rows `rows` of `x` as the tiles' right operand: `[m / 16][k / 32]` tiles,
/// tile row `r` holding for each of sixteen rows the BF16 pair `2r`, `2r + 1` of the chunk in
/// `chunk_order` (rows past `m` zero). Groups of sixteen rows split over the team.
fn act_tiles(team: &Team, x: &[f32], rows: &[usize], k: usize) -> Aligned<u16, 32> {
    let (groups, per) = (rows.len().div_ceil(N_TILE), k / K_TILE * TILE_VALUES);
    let mut t = Aligned::<u16, 32>::zeroed(groups * per);
    let parts = team.threads().min(groups);
    let ranges: Vec<_> = (0..parts).map(|p| split(groups, 1, p, parts)).collect();
    let dst = split_mut(t.as_mut_slice(), ranges.iter().map(|r| r.len() * per));
    team.run(&|p, _| {
        if let (Some(range), Some(dst)) = (ranges.get(p), dst.get(p)) {
            let mut dst = dst.lock().unwrap_or_else(|e| e.into_inner());
            for (g, dst) in range.clone().zip(dst.chunks_exact_mut(per)) {
                group_tiles(x, rows, k, g, dst);
            }
        }
    });
    t
}

/// Activation group `g`'s tiles (`act_tiles`) into `dst`.
fn group_tiles(x: &[f32], rows: &[usize], k: usize, g: usize, dst: &mut [u16]) {
    assert_eq!(dst.len(), k / K_TILE * TILE_VALUES);
    for (i, tile) in dst.chunks_exact_mut(TILE_VALUES).enumerate() {
        // SAFETY: plain AVX-512F/BF16 (this module's cfg); each row read is 32 values of a row
        // of `x` (`tiles` asserted `rows` within it) at chunk i < k / 32; the tile written is
        // `tile`, TILE_VALUES long.
        unsafe {
            let group: [__m512i; N_TILE] = std::array::from_fn(|j| {
                let Some(&r) = rows.get(g * N_TILE + j) else {
                    return _mm512_setzero_si512();
                };
                let p = x.as_ptr().add(r * k + i * K_TILE);
                chunk_bf16(_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)))
            });
            for (r, v) in transpose(group).iter().enumerate() {
                _mm512_storeu_si512(tile.as_mut_ptr().add(32 * r).cast(), *v);
            }
        }
    }
}

/// A 32-value chunk in element order (`lo` 0..16, `hi` 16..32) as BF16 in `chunk_order`: the
/// activations' tiles and the 32-element formats' weights alike.
///
/// # Safety
/// AVX-512 BF16 must be present (this module's cfg).
#[inline(always)]
unsafe fn chunk_bf16(lo: __m512, hi: __m512) -> __m512i {
    let order: [i32; 32] = std::array::from_fn(|q| chunk_order(q) as i32);
    let (even, odd) = (
        _mm512_permutex2var_ps(lo, _mm512_loadu_si512(order[..16].as_ptr().cast()), hi),
        _mm512_permutex2var_ps(lo, _mm512_loadu_si512(order[16..].as_ptr().cast()), hi),
    );
    std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(odd, even))
}

/// The unit's rows times every activation row, two tiles of sixteen activation rows at a
/// time, into columns `c0..c0 + nc` of `out` (rows of `n`): activation row `i` into row
/// `at[i]`.
///
/// # Safety
/// The tiles must be configured (`amx::with_tiles`); `unit` must be `[ROWS][k]` and `acts`
/// `act_tiles` of `at.len()` rows; `out` must have every row `at` names.
unsafe fn unit_times_acts(
    unit: &[u16],
    k: usize,
    acts: &Aligned<u16, 32>,
    at: &[usize],
    (out, n): (*mut f32, usize),
    (c0, nc): (usize, usize),
) {
    let m = at.len();
    let groups = m.div_ceil(N_TILE);
    let mut g = 0;
    while g < groups {
        let two = g + 1 < groups;
        let mut c = [[0f32; TILE_VALUES / 2]; 4];
        block(unit.as_ptr(), k, acts.as_slice().as_ptr(), g, two, &mut c);
        // c[h + 2s]: weight rows 16h.. against activation rows of group g + s.
        for s in 0..1 + usize::from(two) {
            let rows = (m - (g + s) * N_TILE).min(N_TILE);
            for h in 0..2 {
                let cols = nc.saturating_sub(h * N_TILE).min(N_TILE);
                if cols == 0 {
                    continue;
                }
                let sums: [__m512i; N_TILE] = std::array::from_fn(|r| {
                    _mm512_loadu_si512(c[h + 2 * s][16 * r..].as_ptr().cast())
                });
                let t = transpose(sums);
                for (j, v) in t.iter().enumerate().take(rows) {
                    let dst = out.add(at[(g + s) * N_TILE + j] * n + c0 + h * N_TILE);
                    if cols == N_TILE {
                        _mm512_storeu_si512(dst.cast(), *v);
                    } else {
                        let mut lane = [0f32; N_TILE];
                        _mm512_storeu_si512(lane.as_mut_ptr().cast(), *v);
                        std::ptr::copy_nonoverlapping(lane.as_ptr(), dst, cols);
                    }
                }
            }
        }
        g += 1 + usize::from(two);
    }
}

/// `c[h + 2s] = unit rows 16h..16h + 16 · activation group g + s` (s = 1 only with `two`),
/// over all of k, each `[weight row][activation row]`.
#[inline(always)]
unsafe fn block(
    unit: *const u16,
    k: usize,
    acts: *const u16,
    g: usize,
    two: bool,
    c: &mut [[f32; TILE_VALUES / 2]; 4],
) {
    let chunks = k / K_TILE;
    let (sw, w1) = (k * 2, unit.add(N_TILE * k));
    asm!(
        "tilezero tmm0",
        "tilezero tmm1",
        "tilezero tmm2",
        "tilezero tmm3",
        options(nostack, nomem)
    );
    for i in 0..chunks {
        let x0 = acts.add((g * chunks + i) * TILE_VALUES);
        asm!(
            "tileloadd tmm4, [{w0} + {sw}]",
            "tileloadd tmm5, [{w1} + {sw}]",
            "tileloadd tmm6, [{x0} + {sx}]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm5, tmm6",
            w0 = in(reg) unit.add(i * K_TILE), w1 = in(reg) w1.add(i * K_TILE),
            x0 = in(reg) x0, sw = in(reg) sw, sx = in(reg) 64usize,
            options(nostack, readonly)
        );
        if two {
            asm!(
                "tileloadd tmm7, [{x1} + {sx}]",
                "tdpbf16ps tmm2, tmm4, tmm7",
                "tdpbf16ps tmm3, tmm5, tmm7",
                x1 = in(reg) x0.add(chunks * TILE_VALUES), sx = in(reg) 64usize,
                options(nostack, readonly)
            );
        }
    }
    asm!(
        "tilestored [{c0} + {s}], tmm0",
        "tilestored [{c1} + {s}], tmm1",
        c0 = in(reg) c[0].as_mut_ptr(), c1 = in(reg) c[1].as_mut_ptr(), s = in(reg) 64usize,
        options(nostack)
    );
    if two {
        asm!(
            "tilestored [{c2} + {s}], tmm2",
            "tilestored [{c3} + {s}], tmm3",
            c2 = in(reg) c[2].as_mut_ptr(), c3 = in(reg) c[3].as_mut_ptr(), s = in(reg) 64usize,
            options(nostack)
        );
    }
}

#[cfg(test)]
mod tests;
