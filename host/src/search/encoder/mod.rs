//! The BERT-family encoder's forward pass over *packed* sequences: the tokens of every
//! sequence in a batch are rows of one matrix, so each linear layer is one GEMM over all of
//! them (the `gemm` crate's AVX-512 kernels, on the cores' threads) and no work is spent on
//! padding; only attention looks at sequence boundaries, one sequence per task. Buffers live in
//! a `Scratch` the caller keeps, sized by the batch's tokens, so memory is bounded by the
//! batcher's token budget however many requests arrive.

pub mod batcher;
mod few;
mod math;

use rayon::prelude::*;

/// A dense layer, its weight stored transposed (`[inputs, outputs]`, row-major) so the GEMM
/// streams it along its rows; and the same in BF16 for the few-token path (`few`).
pub struct Linear {
    w_t: Vec<f32>,
    w_bf16: Vec<u16>,
    b: Vec<f32>,
    inputs: usize,
    outputs: usize,
}

impl Linear {
    /// From the checkpoint's `[outputs, inputs]` weight and its bias.
    pub fn new(w: &[f32], b: Vec<f32>, inputs: usize) -> Self {
        let outputs = b.len();
        assert_eq!(w.len(), inputs * outputs, "weight shape");
        let mut w_t = vec![0f32; w.len()];
        for (o, row) in w.chunks_exact(inputs).enumerate() {
            for (i, v) in row.iter().enumerate() {
                w_t[i * outputs + o] = *v;
            }
        }
        Self::with(w_t, b, inputs, outputs)
    }

    fn with(w_t: Vec<f32>, b: Vec<f32>, inputs: usize, outputs: usize) -> Self {
        Self {
            w_bf16: w_t.iter().map(|&v| few::bf16(v)).collect(),
            w_t,
            b,
            inputs,
            outputs,
        }
    }

    /// Several layers of the same input as one (Q, K and V), outputs side by side.
    pub fn fuse(parts: &[Linear]) -> Self {
        let inputs = parts[0].inputs;
        let outputs = parts.iter().map(|p| p.outputs).sum();
        let mut w_t = Vec::with_capacity(inputs * outputs);
        for i in 0..inputs {
            for p in parts {
                w_t.extend_from_slice(&p.w_t[i * p.outputs..(i + 1) * p.outputs]);
            }
        }
        let b = parts.iter().flat_map(|p| p.b.iter().copied()).collect();
        Self::with(w_t, b, inputs, outputs)
    }

    /// `out[t, outputs] = x[t, inputs] · W + b`.
    fn forward(&self, x: &[f32], t: usize, out: &mut [f32], threads: usize) {
        let (k, n) = (self.inputs, self.outputs);
        debug_assert_eq!(x.len(), t * k);
        for row in out.chunks_exact_mut(n) {
            row.copy_from_slice(&self.b);
        }
        if few::matmul(x, t, &self.w_bf16, n, out) {
            return;
        }
        // Small batches (a query) gain nothing from threads but their start-up.
        let parallelism = match t * k * n >= 1 << 22 && threads > 1 {
            true => gemm::Parallelism::Rayon(threads),
            false => gemm::Parallelism::None,
        };
        // SAFETY: every pointer covers its matrix at the strides given: `out` is t×n, `x` is
        // t×k and `w_t` is k×n, all row-major (column stride 1, row stride the width).
        unsafe {
            gemm::gemm(
                t,
                n,
                k,
                out.as_mut_ptr(),
                1,
                n as isize,
                true,
                x.as_ptr(),
                1,
                k as isize,
                self.w_t.as_ptr(),
                1,
                n as isize,
                1.0,
                1.0,
                false,
                false,
                false,
                parallelism,
            );
        }
    }
}

/// LayerNorm parameters.
pub struct Norm {
    pub w: Vec<f32>,
    pub b: Vec<f32>,
}

pub struct Layer {
    pub qkv: Linear,
    pub out: Linear,
    pub attn_norm: Norm,
    pub up: Linear,
    pub down: Linear,
    pub out_norm: Norm,
}

pub struct Encoder {
    /// `[vocab, dim]`, `[positions, dim]`, and the first token type's row (single-segment
    /// inputs).
    pub word: Vec<f32>,
    pub position: Vec<f32>,
    pub token_type: Vec<f32>,
    pub embed_norm: Norm,
    pub layers: Vec<Layer>,
    pub heads: usize,
    pub dim: usize,
    pub eps: f32,
    /// Threads of one forward (the cores).
    pub threads: usize,
}

/// A forward's buffers, grown to the largest batch seen and reused.
#[derive(Default)]
pub struct Scratch {
    x: Vec<f32>,
    tmp: Vec<f32>,
    qkv: Vec<f32>,
    ctx: Vec<f32>,
    h: Vec<f32>,
}

fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}

impl Encoder {
    /// Unit-length mean-pooled embeddings of `seqs` (token ids with the special tokens, each
    /// within the position table), in order. A sequence of at most `few::MAX_ROWS` tokens
    /// always takes the few-token path (packed with other short ones up to that many rows),
    /// a longer one always the GEMM path: which path a text takes, and so its vector, does not
    /// depend on what else is in the batch.
    pub fn forward(&self, seqs: &[&[u32]], s: &mut Scratch) -> Vec<Vec<f32>> {
        let mut out = vec![Vec::new(); seqs.len()];
        let (short, long): (Vec<usize>, Vec<usize>) =
            (0..seqs.len()).partition(|&i| seqs[i].len() <= few::MAX_ROWS);
        let mut run = |group: &[usize], s: &mut Scratch| {
            let part: Vec<&[u32]> = group.iter().map(|&i| seqs[i]).collect();
            for (&i, v) in group.iter().zip(self.packed(&part, s)) {
                out[i] = v;
            }
        };
        if !long.is_empty() {
            run(&long, s);
        }
        let (mut pack, mut rows) = (Vec::new(), 0);
        for i in short {
            if rows + seqs[i].len() > few::MAX_ROWS {
                run(&pack, s);
                (pack, rows) = (Vec::new(), 0);
            }
            pack.push(i);
            rows += seqs[i].len();
        }
        if !pack.is_empty() {
            run(&pack, s);
        }
        out
    }

    /// `forward` of sequences packed into one matrix.
    fn packed(&self, seqs: &[&[u32]], s: &mut Scratch) -> Vec<Vec<f32>> {
        let d = self.dim;
        let t: usize = seqs.iter().map(|q| q.len()).sum();
        if t == 0 {
            return seqs.iter().map(|_| vec![0.0; d]).collect();
        }
        let inter = self.layers.first().map_or(0, |l| l.up.outputs);
        let (mut x, mut tmp) = (std::mem::take(&mut s.x), std::mem::take(&mut s.tmp));
        sized(&mut x, t * d);
        sized(&mut tmp, t * d);
        self.embed(seqs, &mut x);
        for l in &self.layers {
            let qkv = sized(&mut s.qkv, t * 3 * d);
            l.qkv.forward(&x, t, qkv, self.threads);
            let ctx = sized(&mut s.ctx, t * d);
            self.attend(seqs, qkv, ctx);
            l.out.forward(ctx, t, &mut tmp, self.threads);
            self.add_norm(&mut tmp, &x, &l.attn_norm);
            std::mem::swap(&mut x, &mut tmp);
            let h = sized(&mut s.h, t * inter);
            l.up.forward(&x, t, h, self.threads);
            self.rows(h, inter, math::gelu);
            l.down.forward(h, t, &mut tmp, self.threads);
            self.add_norm(&mut tmp, &x, &l.out_norm);
            std::mem::swap(&mut x, &mut tmp);
        }
        let pooled = self.pool(seqs, &x);
        (s.x, s.tmp) = (x, tmp);
        pooled
    }

    fn embed(&self, seqs: &[&[u32]], x: &mut [f32]) {
        let d = self.dim;
        let mut rows = x.chunks_exact_mut(d);
        for q in seqs {
            for (p, &id) in q.iter().enumerate() {
                let row = rows.next().expect("a row per token");
                let (w, pos) = (id as usize * d, p * d);
                for (i, r) in row.iter_mut().enumerate() {
                    *r = self.word[w + i] + self.position[pos + i] + self.token_type[i];
                }
                let n = &self.embed_norm;
                math::add_norm(row, &[], &n.w, &n.b, self.eps);
            }
        }
    }

    /// Each sequence's attention, sequences spread over the threads.
    fn attend(&self, seqs: &[&[u32]], qkv: &[f32], ctx: &mut [f32]) {
        let d = self.dim;
        let mut parts = Vec::with_capacity(seqs.len());
        let (mut rest, mut at) = (ctx, 0);
        for q in seqs {
            let (mine, tail) = rest.split_at_mut(q.len() * d);
            parts.push((&qkv[at * 3 * d..(at + q.len()) * 3 * d], q.len(), mine));
            (rest, at) = (tail, at + q.len());
        }
        let one = |(qkv, len, out): (&[f32], usize, &mut [f32])| {
            if len > 0 {
                math::attention(qkv, len, self.heads, out)
            }
        };
        match self.threads > 1 && seqs.len() > 1 {
            true => parts.into_par_iter().for_each(one),
            false => parts.into_iter().for_each(one),
        }
    }

    /// `f` on every `width`-wide row of `m`, in parallel when there are many.
    fn rows(&self, m: &mut [f32], width: usize, f: impl Fn(&mut [f32]) + Sync) {
        let rows = m.len() / width;
        match self.threads > 1 && rows >= 64 {
            true => m.par_chunks_mut(width * 16).for_each(&f),
            false => f(m),
        }
    }

    /// `out = norm(out + residual)`, row by row.
    fn add_norm(&self, out: &mut [f32], residual: &[f32], n: &Norm) {
        let d = self.dim;
        let one = |(o, r): (&mut [f32], &[f32])| math::add_norm(o, r, &n.w, &n.b, self.eps);
        match self.threads > 1 && out.len() / d >= 64 {
            true => out
                .par_chunks_exact_mut(d)
                .zip(residual.par_chunks_exact(d))
                .for_each(one),
            false => out
                .chunks_exact_mut(d)
                .zip(residual.chunks_exact(d))
                .for_each(one),
        }
    }

    /// Mean over each sequence's tokens, then unit length.
    fn pool(&self, seqs: &[&[u32]], x: &[f32]) -> Vec<Vec<f32>> {
        let d = self.dim;
        let mut at = 0;
        seqs.iter()
            .map(|q| {
                let mut v = vec![0f32; d];
                for row in x[at * d..(at + q.len()) * d].chunks_exact(d) {
                    for (a, b) in v.iter_mut().zip(row) {
                        *a += b;
                    }
                }
                at += q.len();
                let norm = v.iter().map(|a| a * a).sum::<f32>().sqrt().max(1e-12);
                let scale = 1.0 / norm;
                v.iter_mut().for_each(|a| *a *= scale);
                v
            })
            .collect()
    }
}
