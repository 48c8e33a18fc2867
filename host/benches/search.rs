//! Vector index figures at a realistic scale, side by side with exact search in the same run:
//! build rate, query latency p50/p99, recall@10 against the exact answer, and filtered queries
//! on both plans (exact scan for selective filters, filtered HNSW otherwise).
//!
//! `cargo bench --bench search [-- N]` (N vectors, default 50,000, 384 dimensions). Vectors are
//! clustered (256 centroids plus noise), closer to sentence embeddings than uniform noise.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use gateway::search::vectors::{dot, Vectors};

const DIM: usize = 384;

#[path = "support/rng.rs"]
mod rng;
use rng::Rng;

/// Uniform in [-0.5, 0.5), from the state's top 24 bits.
fn uniform(rng: &mut Rng) -> f32 {
    ((rng.step() >> 40) as f32 / (1u64 << 24) as f32) - 0.5
}

fn unit(mut v: Vec<f32>) -> Vec<f32> {
    let n = dot(&v, &v).sqrt();
    v.iter_mut().for_each(|x| *x /= n);
    v
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn exact(
    data: &[(u64, Vec<f32>)],
    q: &[f32],
    k: usize,
    allowed: Option<&HashSet<u64>>,
) -> Vec<u64> {
    let mut s: Vec<(u64, f32)> = data
        .iter()
        .filter(|(id, _)| allowed.is_none_or(|a| a.contains(id)))
        .map(|(id, v)| (*id, dot(q, v)))
        .collect();
    s.sort_by(|a, b| b.1.total_cmp(&a.1));
    s.into_iter().take(k).map(|x| x.0).collect()
}

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(50_000);
    let mut rng = Rng(7);
    let centroids: Vec<Vec<f32>> = (0..256)
        .map(|_| unit((0..DIM).map(|_| uniform(&mut rng)).collect()))
        .collect();
    let point = |rng: &mut Rng| {
        let c = &centroids[((uniform(rng) + 0.5) * 255.0) as usize];
        // Noise of about 1.7 times the centroid's norm: clusters overlap, as topics do.
        unit(c.iter().map(|x| x + 0.3 * uniform(rng)).collect())
    };
    let data: Vec<(u64, Vec<f32>)> = (0..n as u64).map(|i| (i, point(&mut rng))).collect();
    let queries: Vec<Vec<f32>> = (0..200).map(|_| point(&mut rng)).collect();

    let t = Instant::now();
    let index = Vectors::build(data.clone());
    let build = t.elapsed().as_secs_f64();
    println!(
        "{n} vectors of {DIM} dims; HNSW build {build:.1} s ({:.0} vectors/s, 2 cores)",
        n as f64 / build
    );
    // Reopening: the snapshot saved at shutdown, brought up to a store that changed by 1%.
    let dir = std::env::temp_dir().join(format!("bench-hnsw-{}", std::process::id()));
    let t = Instant::now();
    index.save(&dir).expect("snapshot saved");
    let save = t.elapsed().as_secs_f64();
    let changed: Vec<(u64, Vec<f32>)> = data[n / 100..]
        .iter()
        .cloned()
        .chain((0..n / 100).map(|i| (10_000_000 + i as u64, point(&mut rng))))
        .collect();
    let t = Instant::now();
    let reopened = Vectors::load(&dir, &changed).expect("snapshot loads");
    let load = t.elapsed().as_secs_f64();
    drop(reopened);
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "reopen: snapshot saved in {save:.1} s; loaded and caught up with a 1% change in {load:.1} s, against {build:.1} s to rebuild ({:.1}x)\n",
        build / load
    );
    println!(
        "{:<34} {:>9} {:>9} {:>10}",
        "query (k = 10)", "p50 ms", "p99 ms", "recall@10"
    );

    let run = |name: &str, allowed: Option<Arc<HashSet<u64>>>, use_index: bool| {
        let mut times = Vec::new();
        let mut hit = 0usize;
        let mut total = 0usize;
        for q in &queries {
            let truth = exact(&data, q, 10, allowed.as_deref());
            let t = Instant::now();
            let got: Vec<u64> = if use_index {
                index
                    .search(q, 10, allowed.as_ref())
                    .into_iter()
                    .map(|h| h.0)
                    .collect()
            } else {
                exact(&data, q, 10, allowed.as_deref())
            };
            times.push(t.elapsed().as_secs_f64() * 1e3);
            total += truth.len();
            hit += got.iter().filter(|id| truth.contains(id)).count();
        }
        println!(
            "{name:<34} {:>9.3} {:>9.3} {:>10.3}",
            percentile(&mut times, 0.5),
            percentile(&mut times, 0.99),
            hit as f64 / total.max(1) as f64
        );
        percentile(&mut times, 0.5)
    };
    let hnsw = run("HNSW, no filter", None, true);
    let scan = run("exact scan, no filter", None, false);
    let one_pct: Arc<HashSet<u64>> = Arc::new((0..n as u64).filter(|i| i % 100 == 0).collect());
    run("filter 1% (exact-scan plan)", Some(one_pct), true);
    let half: Arc<HashSet<u64>> = Arc::new((0..n as u64).filter(|i| i % 2 == 0).collect());
    run("filter 50% (filtered-HNSW plan)", Some(half), true);
    println!(
        "\nHNSW is {:.0}x faster than the exact scan at this size.",
        scan / hnsw
    );
}
