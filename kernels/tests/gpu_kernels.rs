//! The CUDA kernels against the CPU reference on random inputs, across dtypes, head sizes, GQA
//! ratios, block sizes and context lengths (1, around block boundaries, and past one
//! partition so the split-K path and its reduction run). A plain `main` (harness = false) so
//! that a skip — no `cuda` feature, no driver, no GPU — is always printed, never a silent pass.
//!
//! Tolerances (max |gpu − reference| relative to the output's max |value|, inputs rounded to
//! the dtype before the reference sees them): f32 1e-4, f16 4e-3, bf16 3e-2 — the products are
//! accumulated in f32 on both sides; what differs is summation order, `__expf`, and the final
//! rounding of the output to the dtype.

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("gpu kernel tests: SKIPPED — built without the `cuda` feature");
}

#[cfg(feature = "cuda")]
fn main() {
    if let Err(why) = gpu::run() {
        println!("gpu kernel tests: SKIPPED — {why}");
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use cudarc::driver::CudaContext;
    use gateway_kernels::cuda::{Element, Kernels};
    use gateway_kernels::layers::{Heads, Layers};
    use gateway_kernels::{reference, Shape};
    use half::{bf16, f16};

    pub struct Rng(pub u64);
    impl Rng {
        pub fn next(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            (self.0 % 20001) as f32 / 10000.0 - 1.0
        }
        pub fn vec(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.next()).collect()
        }
    }

    fn fail(m: &str) -> ! {
        println!("gpu kernel tests: FAILED — {m}");
        std::process::exit(1)
    }

    trait Cast: Element {
        fn of(x: f32) -> Self;
        fn get(self) -> f32;
        const TOL: f32;
    }
    impl Cast for f32 {
        fn of(x: f32) -> Self {
            x
        }
        fn get(self) -> f32 {
            self
        }
        const TOL: f32 = 1e-4;
    }
    impl Cast for f16 {
        fn of(x: f32) -> Self {
            f16::from_f32(x)
        }
        fn get(self) -> f32 {
            self.to_f32()
        }
        const TOL: f32 = 4e-3;
    }
    impl Cast for bf16 {
        fn of(x: f32) -> Self {
            bf16::from_f32(x)
        }
        fn get(self) -> f32 {
            self.to_f32()
        }
        const TOL: f32 = 3e-2;
    }

    pub fn run() -> Result<(), String> {
        // The driver library is opened lazily; without one, say so instead of panicking.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err("no CUDA driver library (libcuda.so) on this machine".into());
        }
        let ctx = CudaContext::new(0).map_err(|e| format!("no usable CUDA device: {e:?}"))?;
        // From here on a device exists: every error is a failure, not a skip.
        let k = Kernels::new(ctx.default_stream()).unwrap_or_else(|e| fail(&e.to_string()));
        let mut cases = 0;
        let mut worst = [0f32; 3];
        for (head, ratio, block, ctxs) in [
            (64, 1, 16, vec![1, 16, 17, 100]),
            (80, 2, 8, vec![1, 7, 9, 513]),
            (96, 4, 32, vec![31, 32, 33, 700]),
            (128, 4, 16, vec![1, 15, 16, 2048 + 7]),
            (128, 8, 16, vec![5, 1030]),
            // A group that leaves part of its tile idle, and one larger than the largest tile.
            (96, 3, 16, vec![2, 129]),
            (64, 12, 8, vec![3, 600]),
        ] {
            let errs = [
                case::<f32>(&k, head, ratio, block, &ctxs, &mut cases),
                case::<f16>(&k, head, ratio, block, &ctxs, &mut cases),
                case::<bf16>(&k, head, ratio, block, &ctxs, &mut cases),
            ];
            for (w, e) in worst.iter_mut().zip(errs) {
                *w = w.max(e.unwrap_or_else(|m| fail(&m)));
            }
        }
        cache_ops(&k).unwrap_or_else(|m| fail(&m));
        let layers = Layers::new(ctx.default_stream()).unwrap_or_else(|e| fail(&e.to_string()));
        for neox in [false, true] {
            layer_ops(&layers, neox).unwrap_or_else(|m| fail(&m));
        }
        println!(
            "gpu kernel tests: {cases} attention cases passed (worst relative error f32 {:.2e}, f16 {:.2e}, bf16 {:.2e}); reshape_and_cache and copy_blocks exact; layer kernels (embed, rms_norm, rope_split both styles, silu_mul, gather_rows) within 1e-5",
            worst[0], worst[1], worst[2]
        );
        Ok(())
    }

    /// Decode rows (one per sequence, the given context lengths) and prefill rows (every
    /// position of the first sequence, causal) in one call; returns the relative error.
    fn case<T: Cast>(
        k: &Kernels,
        head: usize,
        ratio: usize,
        block: usize,
        ctxs: &[usize],
        cases: &mut usize,
    ) -> Result<f32, String> {
        let mut rng = Rng(0x9e3779b97f4a7c15 ^ (head * 31 + ratio * 7 + block) as u64);
        let num_kv_heads = 2;
        let max_ctx = *ctxs.iter().max().unwrap_or(&1);
        let max_blocks = max_ctx.div_ceil(block);
        let seqs = ctxs.len();
        let num_blocks = seqs * max_blocks + 3;
        let te = num_kv_heads * head;
        let round = |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| T::of(x).get()).collect() };
        let kc = round(rng.vec(num_blocks * block * te));
        let vc = round(rng.vec(num_blocks * block * te));
        // Each sequence gets scattered physical blocks (reversed order, offset by 3).
        let tables: Vec<u32> = (0..seqs)
            .flat_map(|s| {
                (0..max_blocks).map(move |b| (3 + s * max_blocks + (max_blocks - 1 - b)) as u32)
            })
            .collect();
        let prefill = ctxs[0].min(64);
        let mut row_seq: Vec<u32> = (0..seqs as u32).collect();
        let mut row_ctx: Vec<u32> = ctxs.iter().map(|&c| c as u32).collect();
        row_seq.extend(std::iter::repeat_n(0, prefill));
        row_ctx.extend((1..=prefill).map(|c| c as u32));
        let num_heads = num_kv_heads * ratio;
        let s = Shape {
            rows: row_seq.len(),
            num_heads,
            num_kv_heads,
            head_size: head,
            block_size: block,
            max_blocks,
            scale: 1.0 / (head as f32).sqrt(),
        };
        let q = round(rng.vec(s.rows * num_heads * head));
        let want = reference::paged_attention(&q, &kc, &vc, &tables, &row_seq, &row_ctx, &s);
        let st = k.stream();
        let up = |v: &[f32]| st.clone_htod(&v.iter().map(|&x| T::of(x)).collect::<Vec<T>>());
        let e = |e: cudarc::driver::DriverError| format!("{e:?}");
        let mut out = st.alloc_zeros::<T>(want.len()).map_err(e)?;
        k.paged_attention(
            &mut out,
            &up(&q).map_err(e)?,
            &up(&kc).map_err(e)?,
            &up(&vc).map_err(e)?,
            &st.clone_htod(&tables).map_err(e)?,
            &st.clone_htod(&row_seq).map_err(e)?,
            &st.clone_htod(&row_ctx).map_err(e)?,
            &k.plan_rows(&row_ctx).map_err(|x| x.to_string())?,
            &s,
        )
        .map_err(|x| x.to_string())?;
        let got: Vec<T> = st.clone_dtoh(&out).map_err(e)?;
        let scale = want.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        let err = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g.get() - w).abs())
            .fold(0f32, f32::max)
            / scale;
        *cases += 1;
        // NaN must fail too.
        if err.is_nan() || err > T::TOL {
            return Err(format!(
                "{} head {head} GQA {ratio}:1 block {block} contexts {ctxs:?}: relative error {err:.3e} > {:.0e}",
                T::NAME,
                T::TOL
            ));
        }
        Ok(err)
    }

    fn cache_ops(k: &Kernels) -> Result<(), String> {
        let e = |e: cudarc::driver::DriverError| format!("{e:?}");
        let st = k.stream();
        let (te, block, blocks) = (2 * 64, 16, 8);
        let mut rng = Rng(42);
        let key: Vec<f32> = rng.vec(5 * te);
        let value: Vec<f32> = rng.vec(5 * te);
        let slots: Vec<i64> = vec![17, 3, -1, 127, 64];
        let (mut kc, mut vc) = (
            vec![0f32; blocks * block * te],
            vec![0f32; blocks * block * te],
        );
        reference::reshape_and_cache(&key, &value, &mut kc, &mut vc, &slots, te);
        reference::copy_blocks(&mut kc, &mut vc, &[(1, 6), (4, 2)], block * te);
        let mut dk = st.alloc_zeros::<f32>(kc.len()).map_err(e)?;
        let mut dv = st.alloc_zeros::<f32>(vc.len()).map_err(e)?;
        k.reshape_and_cache(
            &st.clone_htod(&key).map_err(e)?,
            &st.clone_htod(&value).map_err(e)?,
            &mut dk,
            &mut dv,
            &st.clone_htod(&slots).map_err(e)?,
            te,
        )
        .map_err(|x| x.to_string())?;
        k.copy_blocks(
            &mut dk,
            &mut dv,
            &st.clone_htod(&[1i64, 6, 4, 2]).map_err(e)?,
            block * te * 4,
        )
        .map_err(|x| x.to_string())?;
        let (gk, gv) = (
            st.clone_dtoh(&dk).map_err(e)?,
            st.clone_dtoh(&dv).map_err(e)?,
        );
        if gk != kc || gv != vc {
            return Err("reshape_and_cache / copy_blocks differ from the reference".into());
        }
        Ok(())
    }

    /// The per-row layer kernels in f32 against plain loops (the host's CPU formulas).
    fn layer_ops(l: &Layers, neox: bool) -> Result<(), String> {
        let e = |e: cudarc::driver::DriverError| format!("{e:?}");
        let k = |e: gateway_kernels::cuda::Error| e.to_string();
        let st = l.stream();
        let (rows, hidden, vocab, inter) = (5, 96, 11, 40);
        let (nh, nkv, hd) = (4, 2, 16);
        let (qd, kvd, half) = (nh * hd, nkv * hd, hd / 2);
        let mut rng = Rng(7);
        let check = |what: &str, got: &[f32], want: &[f32]| -> Result<(), String> {
            let err = got
                .iter()
                .zip(want)
                .map(|(g, w)| (g - w).abs())
                .fold(0f32, f32::max);
            match got.len() == want.len() && err <= 1e-5 {
                true => Ok(()),
                false => Err(format!("{what} (neox {neox}): max error {err:.3e}")),
            }
        };
        let table = rng.vec(vocab * hidden);
        let ids: Vec<u32> = vec![3, 0, 10, 3, 7];
        let mut x = st.alloc_zeros::<f32>(rows * hidden).map_err(e)?;
        l.embed(
            &mut x,
            &st.clone_htod(&table).map_err(e)?,
            &st.clone_htod(&ids).map_err(e)?,
            hidden,
        )
        .map_err(k)?;
        let xs: Vec<f32> = ids
            .iter()
            .flat_map(|&i| table[i as usize * hidden..][..hidden].to_vec())
            .collect();
        check("embed", &st.clone_dtoh(&x).map_err(e)?, &xs)?;

        let w = rng.vec(hidden);
        let mut h = st.alloc_zeros::<f32>(rows * hidden).map_err(e)?;
        l.rms_norm(&mut h, &x, &st.clone_htod(&w).map_err(e)?, 1e-5, rows)
            .map_err(k)?;
        let normed: Vec<f32> = xs
            .chunks(hidden)
            .flat_map(|r| {
                let inv =
                    1.0 / (r.iter().map(|v| v * v).sum::<f32>() / hidden as f32 + 1e-5).sqrt();
                r.iter().zip(&w).map(move |(v, g)| v * inv * g)
            })
            .collect();
        check("rms_norm", &st.clone_dtoh(&h).map_err(e)?, &normed)?;

        let qkv = rng.vec(rows * (qd + 2 * kvd));
        let bias = rng.vec(qd + 2 * kvd);
        let pos: Vec<u32> = vec![0, 1, 7, 30, 2];
        let (cos, sin): (Vec<f32>, Vec<f32>) = (0..32 * half)
            .map(|i| {
                let a = (i / half) as f32 * 10000f32.powf(-((2 * (i % half)) as f32) / hd as f32);
                (a.cos(), a.sin())
            })
            .unzip();
        let mut want = vec![Vec::new(); 3];
        for (r, row) in qkv.chunks(qd + 2 * kvd).enumerate() {
            let mut row: Vec<f32> = row.iter().zip(&bias).map(|(a, b)| a + b).collect();
            let p = pos[r] as usize * half;
            for head in row[..qd + kvd].chunks_mut(hd) {
                for i in 0..half {
                    let (a, b) = if neox {
                        (i, i + half)
                    } else {
                        (2 * i, 2 * i + 1)
                    };
                    let (x, y) = (head[a], head[b]);
                    head[a] = x * cos[p + i] - y * sin[p + i];
                    head[b] = x * sin[p + i] + y * cos[p + i];
                }
            }
            want[0].extend_from_slice(&row[..qd]);
            want[1].extend_from_slice(&row[qd..qd + kvd]);
            want[2].extend_from_slice(&row[qd + kvd..]);
        }
        let mut q = st.alloc_zeros::<f32>(rows * qd).map_err(e)?;
        let mut kk = st.alloc_zeros::<f32>(rows * kvd).map_err(e)?;
        let mut v = st.alloc_zeros::<f32>(rows * kvd).map_err(e)?;
        let heads = Heads {
            num_heads: nh,
            num_kv_heads: nkv,
            head_size: hd,
            neox,
        };
        let (dc, ds) = (
            st.clone_htod(&cos).map_err(e)?,
            st.clone_htod(&sin).map_err(e)?,
        );
        l.rope_split(
            (&mut q, &mut kk, &mut v),
            &st.clone_htod(&qkv).map_err(e)?,
            &st.clone_htod(&bias).map_err(e)?,
            &st.clone_htod(&pos).map_err(e)?,
            (&dc, &ds),
            heads,
        )
        .map_err(k)?;
        for (name, (d, w)) in ["rope q", "rope k", "split v"]
            .iter()
            .zip([&q, &kk, &v].into_iter().zip(&want))
        {
            check(name, &st.clone_dtoh(d).map_err(e)?, w)?;
        }

        let gu = rng.vec(rows * 2 * inter);
        let mut act = st.alloc_zeros::<f32>(rows * inter).map_err(e)?;
        l.silu_mul(&mut act, &st.clone_htod(&gu).map_err(e)?, inter, rows)
            .map_err(k)?;
        let swiglu: Vec<f32> = gu
            .chunks(2 * inter)
            .flat_map(|r| (0..inter).map(move |i| r[i] / (1.0 + (-r[i]).exp()) * r[inter + i]))
            .collect();
        check("silu_mul", &st.clone_dtoh(&act).map_err(e)?, &swiglu)?;

        let idx: Vec<u32> = vec![4, 1];
        let mut picked = st.alloc_zeros::<f32>(2 * hidden).map_err(e)?;
        l.gather_rows(&mut picked, &h, &st.clone_htod(&idx).map_err(e)?, hidden)
            .map_err(k)?;
        let rows_want: Vec<f32> = idx
            .iter()
            .flat_map(|&i| normed[i as usize * hidden..][..hidden].to_vec())
            .collect();
        check(
            "gather_rows",
            &st.clone_dtoh(&picked).map_err(e)?,
            &rows_want,
        )
    }
}
