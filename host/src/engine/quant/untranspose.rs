//! Kernel outputs (`[weight rows][g]`, each thread's tiles contiguous) written into the
//! row-major output (`[m][n]`).
//!
//! Element by element this was a scalar strided store per value: 5% of a Qwen2.5 prefill on
//! the integer prompt kernels, and a decode batch's every output passes through it too. Eight
//! weight rows of a group of eight (or four of four) are transposed in registers instead and
//! stored as runs of the output rows.

thread_local! {
    static SPARE: std::cell::Cell<Vec<f32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Frees the calling thread's buffer for `with_transposed` (kept from call to call), for an
/// engine that has been idle a while.
pub(super) fn release_transposed() {
    SPARE.take();
}

/// Runs `f` on a buffer of `len` floats for kernel outputs before they are untransposed,
/// reused from the last call on this thread. Its contents are stale: the kernels write every
/// element of it before `untranspose` reads one. (Zeroed afresh, a 512-row Qwen2.5 prefill
/// cleared 1.3 GB of these on one thread while the other waited.) A nested call gets a buffer
/// of its own.
pub(super) fn with_transposed<R>(len: usize, f: impl FnOnce(&mut [f32]) -> R) -> R {
    let mut buf = SPARE.take();
    if buf.len() < len {
        buf.resize(len, 0.0);
    }
    let r = f(&mut buf[..len]);
    SPARE.set(buf);
    r
}

/// Writes `block` (`[rows][g]`, weight rows from `r0`, activation rows `i0..i0 + g`) into
/// `out` (`[m][n]`).
pub(super) fn untranspose(
    block: &[f32],
    (i0, g): (usize, usize),
    r0: usize,
    n: usize,
    out: &mut [f32],
) {
    let rows = block.len() / g.max(1);
    assert!(
        block.len() == rows * g
            && (g == 0 || rows == 0 || (i0 + g - 1) * n + r0 + rows <= out.len()),
        "untranspose: shapes"
    );
    let done = squares(block, (i0, g), r0, n, out);
    for r in done..rows {
        for (i, &v) in block[r * g..(r + 1) * g].iter().enumerate() {
            out[(i0 + i) * n + r0 + r] = v;
        }
    }
}

/// Writes the whole squares of `block` (groups of 8 or 4, `g` weight rows at a time) where the
/// build has AVX; returns how many weight rows it wrote. `untranspose` checked the shapes.
#[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
fn squares(block: &[f32], (i0, g): (usize, usize), r0: usize, n: usize, out: &mut [f32]) -> usize {
    if g != 8 && g != 4 {
        return 0;
    }
    let rows = block.len() / g;
    let done = rows - rows % g;
    for r in (0..done).step_by(g) {
        let at = i0 * n + r0 + r;
        // SAFETY: `g` rows of `block` from `r` (r + g ≤ rows), and `g` runs of `g` outputs at
        // `at + i·n`, the last ending at (i0 + g − 1)·n + r0 + r + g ≤ out.len() (asserted by
        // `untranspose`); AVX is present.
        unsafe {
            let (src, dst) = (block[r * g..].as_ptr(), out[at..].as_mut_ptr());
            if g == 8 {
                square8(src, dst, n);
            } else {
                square4(src, dst, n);
            }
        }
    }
    done
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "avx")))]
fn squares(_: &[f32], _: (usize, usize), _: usize, _: usize, _: &mut [f32]) -> usize {
    0
}

/// An 8 × 8 block (row `j` at `src + 8j`) transposed into eight runs at `dst + i·stride`.
#[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
#[inline(always)]
unsafe fn square8(src: *const f32, dst: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    let r: [__m256; 8] = std::array::from_fn(|j| _mm256_loadu_ps(src.add(8 * j)));
    // Pairs of rows interleaved, then pairs of pairs, then the 128-bit halves.
    let t: [__m256; 8] = std::array::from_fn(|j| {
        let (a, b) = (r[j / 2 * 2], r[j / 2 * 2 + 1]);
        if j % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // u[4h + c]: column c of rows 4h..4h + 4 (column c + 4 in the high half).
    let u: [__m256; 8] = std::array::from_fn(|j| {
        let (q, c) = (j / 4 * 4, j % 4);
        let (a, b) = (t[q + c / 2], t[q + 2 + c / 2]);
        if c % 2 == 0 {
            _mm256_shuffle_ps::<0x44>(a, b)
        } else {
            _mm256_shuffle_ps::<0xEE>(a, b)
        }
    });
    for i in 0..8 {
        let (a, b) = (u[i % 4], u[4 + i % 4]);
        let v = if i < 4 {
            _mm256_permute2f128_ps::<0x20>(a, b)
        } else {
            _mm256_permute2f128_ps::<0x31>(a, b)
        };
        _mm256_storeu_ps(dst.add(i * stride), v);
    }
}

/// A 4 × 4 block (row `j` at `src + 4j`) transposed into four runs at `dst + i·stride`.
#[cfg(all(target_arch = "x86_64", target_feature = "avx"))]
#[inline(always)]
unsafe fn square4(src: *const f32, dst: *mut f32, stride: usize) {
    use std::arch::x86_64::*;
    let r: [__m128; 4] = std::array::from_fn(|j| _mm_loadu_ps(src.add(4 * j)));
    let (t0, t1) = (_mm_unpacklo_ps(r[0], r[1]), _mm_unpackhi_ps(r[0], r[1]));
    let (t2, t3) = (_mm_unpacklo_ps(r[2], r[3]), _mm_unpackhi_ps(r[2], r[3]));
    let v = [
        _mm_movelh_ps(t0, t2),
        _mm_movehl_ps(t2, t0),
        _mm_movelh_ps(t1, t3),
        _mm_movehl_ps(t3, t1),
    ];
    for (i, v) in v.into_iter().enumerate() {
        _mm_storeu_ps(dst.add(i * stride), v);
    }
}

#[cfg(test)]
mod tests {
    use super::untranspose;

    /// Every group size, whole and partial squares, at an offset in both directions: each
    /// value lands where the element-by-element loop puts it, and nothing else is written.
    #[test]
    fn blocks_land_where_the_plain_loop_puts_them() {
        let (n, m) = (45, 11);
        for g in 1..=8 {
            for rows in [0, 1, 3, 4, 7, 8, 9, 16, 31, 32] {
                for (i0, r0) in [(0, 0), (m - g, n - rows), (1, 5.min(n - rows))] {
                    let block: Vec<f32> = (0..rows * g).map(|v| v as f32 + 0.5).collect();
                    let mut want = vec![-1f32; m * n];
                    for r in 0..rows {
                        for i in 0..g {
                            want[(i0 + i) * n + r0 + r] = block[r * g + i];
                        }
                    }
                    let mut got = vec![-1f32; m * n];
                    untranspose(&block, (i0, g), r0, n, &mut got);
                    assert_eq!(got, want, "g={g} rows={rows} i0={i0} r0={r0}");
                }
            }
        }
    }
}
