//! The BERT-family encoder's forward pass over *packed* sequences: the tokens of every
//! sequence in a batch are rows of one matrix, so each linear layer is one GEMM over all of
//! them (the `gemm` crate's AVX-512 kernels, on the cores' threads) and no work is spent on
//! padding; only attention looks at sequence boundaries, one sequence per task. Buffers live in
//! a `Scratch` the caller keeps, sized by the batch's tokens, so memory is bounded by the
//! batcher's token budget however many requests arrive.

mod attention;
pub mod batcher;
mod few;
mod math;

use rayon::prelude::*;

use crate::config::EmbeddingPrecision;
use crate::engine::quant::amx;

/// The kernels a model's matrix products run on, chosen once at load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kernel {
    /// BF16 tiles (`amx`) for every row count.
    Amx,
    /// f32 GEMM for texts over `few::MAX_ROWS` tokens and BF16 weights streamed through
    /// AVX-512 for shorter ones (a query's cost is reading the weights).
    Mixed,
    /// f32 GEMM for everything: the float-faithful setting.
    F32,
}

impl Kernel {
    /// As the model card shows it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Amx => "amx-bf16",
            Self::Mixed => "f32+bf16-queries",
            Self::F32 => "f32",
        }
    }

    /// What `precision` means on this machine for a model of these widths; an error when
    /// `bf16` is asked of a CPU or OS without AMX, or of widths the tiles do not cover.
    pub fn choose(precision: EmbeddingPrecision, widths: &[usize]) -> Result<Self, String> {
        let fits = widths.iter().all(|w| w.is_multiple_of(32));
        match (precision, amx::available() && fits) {
            (EmbeddingPrecision::F32, _) => Ok(Self::F32),
            (EmbeddingPrecision::Auto | EmbeddingPrecision::Bf16, true) => Ok(Self::Amx),
            (EmbeddingPrecision::Auto, false) => Ok(Self::Mixed),
            (EmbeddingPrecision::Bf16, false) if !fits => Err(format!(
                "precision bf16 needs widths that are multiples of 32; this model has {widths:?}"
            )),
            (EmbeddingPrecision::Bf16, false) => Err(
                "precision bf16 needs AMX-BF16, which this CPU or OS does not offer (use auto or f32)"
                    .into(),
            ),
        }
    }
}

/// A dense layer's weight in the layout its kernel reads.
enum Weights {
    /// Transposed (`[inputs, outputs]`, row-major) so the GEMM streams it along its rows,
    /// with a BF16 copy for the few-token path under `Kernel::Mixed`.
    F32 {
        w_t: Vec<f32>,
        few: Option<Vec<u16>>,
    },
    Amx(amx::PackedBf16),
}

/// A dense layer.
pub struct Linear {
    w: Weights,
    b: Vec<f32>,
    inputs: usize,
    outputs: usize,
}

impl Linear {
    /// From the checkpoint's `[outputs, inputs]` weight and its bias, in f32 until `prepare`.
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
            w: Weights::F32 { w_t, few: None },
            b,
            inputs,
            outputs,
        }
    }

    fn f32_weights(&self) -> &[f32] {
        match &self.w {
            Weights::F32 { w_t, .. } => w_t,
            Weights::Amx(_) => panic!("fuse before prepare"),
        }
    }

    /// Several layers of the same input as one (Q, K and V), outputs side by side.
    pub fn fuse(parts: &[Linear]) -> Self {
        let inputs = parts[0].inputs;
        let outputs = parts.iter().map(|p| p.outputs).sum();
        let mut w_t = Vec::with_capacity(inputs * outputs);
        for i in 0..inputs {
            for p in parts {
                w_t.extend_from_slice(&p.f32_weights()[i * p.outputs..(i + 1) * p.outputs]);
            }
        }
        let b = parts.iter().flat_map(|p| p.b.iter().copied()).collect();
        Self::with(w_t, b, inputs, outputs)
    }

    /// The weight laid out for `kernel` (the f32 copy dropped when no longer read); an error
    /// when its shape is not one the config's widths promised.
    pub fn prepare(self, kernel: Kernel) -> Result<Self, String> {
        let Weights::F32 { w_t, .. } = self.w else {
            return Ok(self);
        };
        let (k, n) = (self.inputs, self.outputs);
        let w = match kernel {
            Kernel::Amx => Weights::Amx(amx::PackedBf16::pack(&w_t, k, n).ok_or_else(|| {
                format!("a {k}×{n} weight does not fit the tiles the config's widths chose")
            })?),
            Kernel::Mixed => Weights::F32 {
                few: Some(w_t.iter().map(|&v| amx::bf16(v)).collect()),
                w_t,
            },
            Kernel::F32 => Weights::F32 { w_t, few: None },
        };
        Ok(Self { w, ..self })
    }

    /// `out[t, outputs] = then(x[t, inputs] · W + b)`, `then` elementwise (an activation).
    fn forward(
        &self,
        (x, t): (&[f32], usize),
        out: &mut [f32],
        threads: usize,
        acts: &mut amx::Acts,
        then: impl Fn(&mut [f32]) + Sync + Send,
    ) {
        let (k, n) = (self.inputs, self.outputs);
        debug_assert_eq!(x.len(), t * k);
        if let Weights::Amx(p) = &self.w {
            return amx::matmul(x, t, p, &self.b, out, threads, acts, then);
        }
        for row in out.chunks_exact_mut(n) {
            row.copy_from_slice(&self.b);
        }
        self.f32_product(x, t, out, threads);
        match threads > 1 && t >= 64 {
            true => out.par_chunks_mut(n * 16).for_each(then),
            false => then(out),
        }
    }

    /// `out += x · W` on the f32 weights (or their BF16 copy for a few rows).
    fn f32_product(&self, x: &[f32], t: usize, out: &mut [f32], threads: usize) {
        let (k, n) = (self.inputs, self.outputs);
        let w_t = match &self.w {
            Weights::F32 { few: Some(w16), .. } if few::matmul(x, t, w16, n, out) => return,
            Weights::F32 { w_t, .. } => w_t,
            Weights::Amx(_) => unreachable!("forward takes the tiles"),
        };
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
                w_t.as_ptr(),
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
    /// What the layers' weights were prepared for.
    pub kernel: Kernel,
}

/// A forward's buffers, grown to the largest batch seen and reused.
#[derive(Default)]
pub struct Scratch {
    x: Vec<f32>,
    tmp: Vec<f32>,
    qkv: Vec<f32>,
    ctx: Vec<f32>,
    h: Vec<f32>,
    acts: amx::Acts,
}

fn sized(v: &mut Vec<f32>, n: usize) -> &mut [f32] {
    v.resize(n, 0.0);
    &mut v[..n]
}

impl Encoder {
    /// Unit-length mean-pooled embeddings of `seqs` (token ids with the special tokens, each
    /// within the position table), in order. Under `Kernel::Mixed` a sequence of at most
    /// `few::MAX_ROWS` tokens always takes the few-token path (packed with other short ones up
    /// to that many rows), a longer one always the GEMM path: which path a text takes, and so
    /// its vector, does not depend on what else is in the batch. The other kernels are
    /// batch-invariant whatever the rows, so one pass serves all.
    pub fn forward(&self, seqs: &[&[u32]], s: &mut Scratch) -> Vec<Vec<f32>> {
        if self.kernel != Kernel::Mixed {
            return self.packed(seqs, s);
        }
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
            let none = |_: &mut [f32]| {};
            l.qkv.forward((&x, t), qkv, self.threads, &mut s.acts, none);
            let ctx = sized(&mut s.ctx, t * d);
            self.attend(seqs, qkv, ctx);
            l.out
                .forward((ctx, t), &mut tmp, self.threads, &mut s.acts, none);
            self.add_norm(&mut tmp, &x, &l.attn_norm);
            std::mem::swap(&mut x, &mut tmp);
            let h = sized(&mut s.h, t * inter);
            l.up.forward((&x, t), h, self.threads, &mut s.acts, math::gelu);
            l.down
                .forward((h, t), &mut tmp, self.threads, &mut s.acts, none);
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
                attention::attention(qkv, len, self.heads, out)
            }
        };
        match self.threads > 1 && seqs.len() > 1 {
            true => parts.into_par_iter().for_each(one),
            false => parts.into_iter().for_each(one),
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
