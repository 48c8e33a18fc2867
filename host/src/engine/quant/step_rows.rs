//! A step's rows of one kind (prompt or generated), which the prompt passes multiply apart from
//! the others (`prompt.rs`, `prompt_bytes.rs`).

/// Rows `rows` of `x` (`[m][k]`) copied into contiguous rows.
pub(super) fn gather(x: &[f32], k: usize, rows: &[usize]) -> Vec<f32> {
    rows.iter()
        .flat_map(|&i| &x[i * k..(i + 1) * k])
        .copied()
        .collect()
}

/// `pass(x_rows, count, out_rows)` over rows `rows` (ascending, at least one) of `x` (`[m][k]`)
/// into the same rows of `out` (`[m][n]`). One run of rows (a step's one prefill chunk, the
/// usual case) is read and written in place: copying it cost a 256-row chunk beside 4
/// generated rows half again the two kinds' passes. Other rows are gathered and scattered back.
pub(super) fn on_rows(
    (x, k): (&[f32], usize),
    (out, n): (&mut [f32], usize),
    rows: &[usize],
    pass: impl FnOnce(&[f32], usize, &mut [f32]),
) {
    let (a, b) = (rows[0], rows[rows.len() - 1] + 1);
    if b - a == rows.len() {
        return pass(&x[a * k..b * k], b - a, &mut out[a * n..b * n]);
    }
    let mut o = vec![0f32; rows.len() * n];
    pass(&gather(x, k, rows), rows.len(), &mut o);
    for (&i, o) in rows.iter().zip(o.chunks_exact(n)) {
        out[i * n..(i + 1) * n].copy_from_slice(o);
    }
}
