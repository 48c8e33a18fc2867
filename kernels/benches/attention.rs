//! Decode paged-attention throughput on the GPU: time per call (CUDA events, median of 50 runs
//! after 5 warm-ups), achieved bandwidth over the K/V bytes a call must read, and that as a
//! share of the device's peak (`PEAK_GBPS`, default 4800 for an H200). Prints a skip line on a
//! machine without a GPU or without the `cuda` feature.

#[cfg(not(feature = "cuda"))]
fn main() {
    println!("attention bench: SKIPPED — built without the `cuda` feature");
}

#[cfg(feature = "cuda")]
fn main() {
    use cudarc::driver::{sys::CUevent_flags, CudaContext};
    use gateway_kernels::cuda::{Element, Kernels};
    use gateway_kernels::Shape;

    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        println!("attention bench: SKIPPED — no CUDA driver library on this machine");
        return;
    }
    let ctx = match CudaContext::new(0) {
        Ok(c) => c,
        Err(e) => {
            println!("attention bench: SKIPPED — no usable CUDA device: {e:?}");
            return;
        }
    };
    let peak: f64 = std::env::var("PEAK_GBPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4800.0);
    let k = Kernels::new(ctx.default_stream()).expect("kernels load");
    println!(
        "{:<8} {:<44} {:>10} {:>10} {:>8}",
        "dtype", "shape (decode)", "median us", "GB/s", "% peak"
    );
    fn run<T: Element>(
        k: &Kernels,
        batch: usize,
        ctx_len: usize,
        heads: usize,
        kv_heads: usize,
        head: usize,
        peak: f64,
    ) {
        let st = k.stream().clone();
        let block = 16;
        let max_blocks = ctx_len.div_ceil(block);
        let num_blocks = batch * max_blocks;
        let te = kv_heads * head;
        let zeros = |n| st.alloc_zeros::<T>(n).expect("alloc");
        let (kc, vc) = (
            zeros(num_blocks * block * te),
            zeros(num_blocks * block * te),
        );
        let q = zeros(batch * heads * head);
        let mut out = zeros(batch * heads * head);
        // Blocks interleaved across sequences, as a busy pool leaves them.
        let tables: Vec<u32> = (0..batch)
            .flat_map(|s| (0..max_blocks).map(move |b| (b * batch + s) as u32))
            .collect();
        let tables = st.clone_htod(&tables).expect("copy");
        let row_seq = st
            .clone_htod(&(0..batch as u32).collect::<Vec<_>>())
            .expect("copy");
        let ctxs = vec![ctx_len as u32; batch];
        let plan = k.plan_rows(&ctxs).expect("plan");
        let row_ctx = st.clone_htod(&ctxs).expect("copy");
        let s = Shape {
            rows: batch,
            num_heads: heads,
            num_kv_heads: kv_heads,
            head_size: head,
            block_size: block,
            max_blocks,
            scale: 1.0 / (head as f32).sqrt(),
        };
        let mut call = || {
            k.paged_attention(
                &mut out, &q, &kc, &vc, &tables, &row_seq, &row_ctx, &plan, &s,
            )
            .expect("launch")
        };
        for _ in 0..5 {
            call();
        }
        let mut times = Vec::new();
        for _ in 0..50 {
            let a = st
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .expect("event");
            call();
            let b = st
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .expect("event");
            times.push(a.elapsed_ms(&b).expect("elapsed") as f64 * 1e3);
        }
        times.sort_by(f64::total_cmp);
        let us = times[times.len() / 2];
        let bytes = (2 * batch * ctx_len * te * std::mem::size_of::<T>()) as f64;
        let gbps = bytes / (us * 1e-6) / 1e9;
        println!(
            "{:<8} {:<44} {:>10.1} {:>10.0} {:>7.1}%",
            T::NAME,
            format!("batch {batch}, ctx {ctx_len}, heads {heads}/{kv_heads}, head {head}"),
            us,
            gbps,
            100.0 * gbps / peak
        );
    }
    run::<half::bf16>(&k, 64, 2048, 32, 8, 128, peak);
    run::<half::f16>(&k, 64, 2048, 32, 8, 128, peak);
    run::<half::bf16>(&k, 64, 8192, 32, 8, 128, peak);
    run::<half::bf16>(&k, 256, 1024, 32, 8, 128, peak);
    run::<half::bf16>(&k, 64, 2048, 9, 3, 64, peak);
    run::<f32>(&k, 64, 2048, 32, 8, 128, peak);
}
