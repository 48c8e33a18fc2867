//! The CPU reference: straightforward f32 loops over the same layouts the kernels use. It is
//! itself checked against dense attention over contiguous K/V in the tests below.

use crate::Shape;

/// Attention of every row (query token) over its context through its sequence's block table.
/// `q` is `[rows][num_heads][head_size]`; `block_tables` is `[seqs][max_blocks]`; row `r`
/// attends positions `0..row_ctx[r]` of sequence `row_seq[r]`. Returns `[rows][num_heads][head_size]`.
pub fn paged_attention(
    q: &[f32],
    k_cache: &[f32],
    v_cache: &[f32],
    block_tables: &[u32],
    row_seq: &[u32],
    row_ctx: &[u32],
    s: &Shape,
) -> Vec<f32> {
    let hs = s.head_size;
    let group = s.num_heads / s.num_kv_heads;
    let token_stride = s.num_kv_heads * hs;
    let mut out = vec![0f32; s.rows * s.num_heads * hs];
    for r in 0..s.rows {
        let table = &block_tables[row_seq[r] as usize * s.max_blocks..][..s.max_blocks];
        let ctx = row_ctx[r] as usize;
        let slot = |t: usize| table[t / s.block_size] as usize * s.block_size + t % s.block_size;
        for h in 0..s.num_heads {
            let kvh = h / group;
            let qv = &q[(r * s.num_heads + h) * hs..][..hs];
            let logits: Vec<f32> = (0..ctx)
                .map(|t| {
                    let k = &k_cache[slot(t) * token_stride + kvh * hs..][..hs];
                    qv.iter().zip(k).map(|(a, b)| a * b).sum::<f32>() * s.scale
                })
                .collect();
            let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let e: Vec<f32> = logits.iter().map(|l| (l - m).exp()).collect();
            let sum: f32 = e.iter().sum();
            let o = &mut out[(r * s.num_heads + h) * hs..][..hs];
            for (t, w) in e.iter().enumerate() {
                let v = &v_cache[slot(t) * token_stride + kvh * hs..][..hs];
                for (od, vd) in o.iter_mut().zip(v) {
                    *od += w / sum * vd;
                }
            }
        }
    }
    out
}

/// Writes each token's K and V (`[tokens][token_elems]`) into its slot; negative slots skip.
pub fn reshape_and_cache(
    key: &[f32],
    value: &[f32],
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    slots: &[i64],
    token_elems: usize,
) {
    for (t, &slot) in slots.iter().enumerate() {
        if slot < 0 {
            continue;
        }
        let (src, dst) = (t * token_elems, slot as usize * token_elems);
        k_cache[dst..dst + token_elems].copy_from_slice(&key[src..src + token_elems]);
        v_cache[dst..dst + token_elems].copy_from_slice(&value[src..src + token_elems]);
    }
}

/// Copies whole blocks (`block_elems` each) of K and V from `src` to `dst`.
pub fn copy_blocks(
    k_cache: &mut [f32],
    v_cache: &mut [f32],
    pairs: &[(usize, usize)],
    block_elems: usize,
) {
    for &(src, dst) in pairs {
        k_cache.copy_within(
            src * block_elems..(src + 1) * block_elems,
            dst * block_elems,
        );
        v_cache.copy_within(
            src * block_elems..(src + 1) * block_elems,
            dst * block_elems,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noise(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x % 2000) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// Scattered through a shuffled block table, paged attention equals dense causal attention
    /// over the same K/V laid out contiguously.
    #[test]
    fn paged_equals_dense_causal_attention() {
        let s = Shape {
            rows: 5,
            num_heads: 4,
            num_kv_heads: 2,
            head_size: 8,
            block_size: 4,
            max_blocks: 3,
            scale: 0.35,
        };
        let len = 9; // not a multiple of the block size
        let te = s.num_kv_heads * s.head_size;
        let (k, v) = (noise(len * te, 1), noise(len * te, 2));
        let q = noise(s.rows * s.num_heads * s.head_size, 3);
        // Physical blocks 5, 1, 3 of a 6-block pool.
        let table = [5u32, 1, 3];
        let mut kc = vec![0f32; 6 * s.block_size * te];
        let mut vc = kc.clone();
        let slots: Vec<i64> = (0..len)
            .map(|t| (table[t / 4] as usize * 4 + t % 4) as i64)
            .collect();
        reshape_and_cache(&k, &v, &mut kc, &mut vc, &slots, te);
        // Prefill rows: the last 5 positions, each attending causally.
        let row_ctx: Vec<u32> = (len - 5 + 1..=len).map(|c| c as u32).collect();
        let got = paged_attention(&q, &kc, &vc, &table, &[0; 5], &row_ctx, &s);
        for r in 0..s.rows {
            for h in 0..s.num_heads {
                let kvh = h / 2;
                let qv = &q[(r * 4 + h) * 8..][..8];
                let ctx = row_ctx[r] as usize;
                let l: Vec<f32> = (0..ctx)
                    .map(|t| (0..8).map(|d| qv[d] * k[t * te + kvh * 8 + d]).sum::<f32>() * s.scale)
                    .collect();
                let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let z: f32 = l.iter().map(|x| (x - m).exp()).sum();
                for d in 0..8 {
                    let want: f32 = (0..ctx)
                        .map(|t| (l[t] - m).exp() / z * v[t * te + kvh * 8 + d])
                        .sum();
                    let g = got[(r * 4 + h) * 8 + d];
                    assert!(
                        (g - want).abs() < 1e-5,
                        "row {r} head {h} dim {d}: {g} vs {want}"
                    );
                }
            }
        }
        // Copy-on-write duplicates a block exactly.
        copy_blocks(&mut kc, &mut vc, &[(5, 0)], s.block_size * te);
        assert_eq!(kc[..16 * 4], kc[5 * 64..5 * 64 + 64]);
    }
}
