//! The semantic side: an HNSW graph (hnsw_rs) over unit-length chunk embeddings, scored by
//! cosine similarity (a dot product, since vectors are normalised). hnsw_rs cannot delete, so
//! removed chunks stay in the graph as tombstones that searches skip, and the graph is rebuilt
//! from the live vectors once tombstones outnumber them. The store holds every vector, so the
//! graph is derived data; a snapshot of it (`save`, at open and at shutdown) spares a large
//! collection the rebuild when it opens again: `load` takes the snapshot and brings it up to
//! the store (points it lacks are inserted, points no longer live become tombstones; a chunk
//! id never names two vectors, so no point can be stale).
//!
//! Filtered searches follow the query planning of dedicated vector databases: when the filter
//! leaves few chunks, an exact scan over them beats walking a graph whose neighbours are
//! mostly filtered out (and has perfect recall).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use hnsw_rs::api::AnnT;
use hnsw_rs::hnswio::HnswIo;
use hnsw_rs::prelude::{Distance, FilterT, Hnsw};
use parking_lot::RwLock;

/// Below this many allowed chunks a filtered search scans them exactly.
const EXACT_SCAN_MAX: usize = 20_000;
const M: usize = 16;
const EF_CONSTRUCTION: usize = 100;
/// The snapshot's file names' stem.
const SNAPSHOT: &str = "graph";

/// `1 - cosine` of unit vectors, in eight lanes so the compiler vectorises it.
#[derive(Clone, Copy, Default)]
pub struct Dot;

impl Distance<f32> for Dot {
    fn eval(&self, a: &[f32], b: &[f32]) -> f32 {
        (1.0 - dot(a, b)).max(0.0)
    }
}

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
    if a.len() == b.len() {
        // SAFETY: equal lengths; the cfg guarantees AVX-512.
        return unsafe { dot16(a, b) };
    }
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `dot` 16 lanes wide with four sums in flight (LLVM keeps the portable form 8 wide and
/// one chain): the graph walk's distances are most of a vector search.
#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
unsafe fn dot16(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let (n, pa, pb) = (a.len(), a.as_ptr(), b.as_ptr());
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut i = 0;
    while i + 64 <= n {
        for (j, acc) in acc.iter_mut().enumerate() {
            let at = i + 16 * j;
            *acc = _mm512_fmadd_ps(
                _mm512_loadu_ps(pa.add(at)),
                _mm512_loadu_ps(pb.add(at)),
                *acc,
            );
        }
        i += 64;
    }
    while i < n {
        let mask = match n - i {
            left if left >= 16 => 0xffff,
            left => ((1u32 << left) - 1) as __mmask16,
        };
        let (x, y) = (
            _mm512_maskz_loadu_ps(mask, pa.add(i)),
            _mm512_maskz_loadu_ps(mask, pb.add(i)),
        );
        acc[0] = _mm512_fmadd_ps(x, y, acc[0]);
        i += 16;
    }
    let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
    _mm512_reduce_add_ps(sum)
}

type Graph = Hnsw<'static, f32, Dot>;

pub struct Vectors {
    graph: RwLock<Arc<Graph>>,
    live: RwLock<HashMap<u64, Arc<[f32]>>>,
    /// Points in the graph that are no longer live.
    dead: RwLock<usize>,
}

fn new_graph(capacity: usize) -> Graph {
    // hnsw_rs's maximum; a collection created empty must still hold millions of points well.
    Hnsw::new(M, capacity.max(1024), 16, EF_CONSTRUCTION, Dot)
}

impl Vectors {
    /// A graph over `vectors` (id, unit vector), inserted in parallel.
    pub fn build(vectors: Vec<(u64, Vec<f32>)>) -> Self {
        let graph = new_graph(vectors.len());
        let live: HashMap<u64, Arc<[f32]>> =
            vectors.into_iter().map(|(id, v)| (id, v.into())).collect();
        insert_all(&graph, &live);
        Self {
            graph: RwLock::new(Arc::new(graph)),
            live: RwLock::new(live),
            dead: RwLock::new(0),
        }
    }

    /// The graph in the snapshot folder `dir` brought up to `vectors` (the store's live
    /// chunks); `None` when there is no usable snapshot, or it holds more dead points than
    /// live ones (a rebuild is then better).
    pub fn load(dir: &Path, vectors: &[(u64, Vec<f32>)]) -> Option<Self> {
        if !dir.join(format!("{SNAPSHOT}.hnsw.graph")).exists() {
            return None;
        }
        // The loaded graph borrows its loader for its whole life; one small loader per open.
        let io: &'static mut HnswIo = Box::leak(Box::new(HnswIo::new(dir, SNAPSHOT)));
        // hnsw_rs panics on some damaged files rather than returning an error.
        let graph: Graph = std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
            let io = io;
            io.load_hnsw::<f32, Dot>()
        }))
        .ok()?
        .ok()?;
        let have: HashSet<u64> = graph
            .get_point_indexation()
            .into_iter()
            .map(|p| p.get_origin_id() as u64)
            .collect();
        let live: HashMap<u64, Arc<[f32]>> = vectors
            .iter()
            .map(|(id, v)| (*id, Arc::from(&v[..])))
            .collect();
        let dead = have.iter().filter(|id| !live.contains_key(id)).count();
        if dead > 1024 && dead > live.len() {
            return None;
        }
        let missing: HashMap<u64, Arc<[f32]>> = live
            .iter()
            .filter(|(id, _)| !have.contains(id))
            .map(|(id, v)| (*id, v.clone()))
            .collect();
        insert_all(&graph, &missing);
        Some(Self {
            graph: RwLock::new(Arc::new(graph)),
            live: RwLock::new(live),
            dead: RwLock::new(dead),
        })
    }

    /// Writes a snapshot of the graph to the folder `dir`, replacing the last one only once
    /// it is complete.
    pub fn save(&self, dir: &Path) -> std::io::Result<()> {
        let tmp = dir.with_extension("tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)?;
        let graph = self.graph.read().clone();
        graph
            .file_dump(&tmp, SNAPSHOT)
            .map_err(std::io::Error::other)?;
        let old = dir.with_extension("old");
        let _ = std::fs::remove_dir_all(&old);
        if dir.exists() {
            std::fs::rename(dir, &old)?;
        }
        std::fs::rename(&tmp, dir)?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    }

    /// Removes `removed` and adds `added`. Callers serialise writes. Points become live
    /// before they enter the graph, so the graph never holds a point that is neither live
    /// nor counted dead (what lets `search` skip its check when nothing is dead).
    pub fn update(&self, removed: &[u64], added: Vec<(u64, Vec<f32>)>) {
        let added: Vec<(u64, Arc<[f32]>)> =
            added.into_iter().map(|(id, v)| (id, v.into())).collect();
        let rebuild = {
            let mut live = self.live.write();
            let mut dead = self.dead.write();
            for id in removed {
                if live.remove(id).is_some() {
                    *dead += 1;
                }
            }
            live.extend(added.iter().cloned());
            *dead > 1024 && *dead > live.len()
        };
        if rebuild {
            // Built beside the old graph, which keeps serving searches until the swap; writers
            // are serialised by the caller, so the snapshot cannot go stale meanwhile.
            let snapshot: HashMap<u64, Arc<[f32]>> = self.live.read().clone();
            let graph = new_graph(snapshot.len());
            insert_all(&graph, &snapshot);
            *self.graph.write() = Arc::new(graph);
            *self.dead.write() = 0;
            return;
        }
        let graph = self.graph.read().clone();
        let batch: Vec<(&[f32], usize)> =
            added.iter().map(|(id, v)| (&v[..], *id as usize)).collect();
        if batch.len() > 16 {
            graph.parallel_insert_slice(&batch);
        } else {
            for item in batch {
                graph.insert_slice(item);
            }
        }
    }

    /// The `k` nearest live chunks as (id, cosine similarity), optionally only among
    /// `allowed`.
    pub fn search(
        &self,
        query: &[f32],
        k: usize,
        allowed: Option<&Arc<HashSet<u64>>>,
    ) -> Vec<(u64, f32)> {
        if k == 0 {
            return Vec::new();
        }
        let live = self.live.read();
        if let Some(allowed) = allowed.filter(|a| a.len() <= EXACT_SCAN_MAX) {
            let mut hits: Vec<(u64, f32)> = allowed
                .iter()
                .filter_map(|id| live.get(id).map(|v| (*id, dot(query, v))))
                .collect();
            hits.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            hits.truncate(k);
            return hits;
        }
        let graph = self.graph.read().clone();
        let keep = |id: &usize| {
            let id = *id as u64;
            live.contains_key(&id) && allowed.is_none_or(|a| a.contains(&id))
        };
        let ef = (k * 2).max(64);
        // Without tombstones or a filter every point qualifies: no check per visited point.
        let found = match allowed.is_none() && *self.dead.read() == 0 {
            true => graph.search(query, k, ef),
            false => graph.search_filter(query, k, ef, Some(&keep as &dyn FilterT)),
        };
        let mut hits: Vec<(u64, f32)> = found
            .into_iter()
            .map(|n| (n.d_id as u64, 1.0 - n.distance))
            .collect();
        hits.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        hits
    }
}

fn insert_all(graph: &Graph, live: &HashMap<u64, Arc<[f32]>>) {
    let batch: Vec<(&[f32], usize)> = live.iter().map(|(id, v)| (&v[..], *id as usize)).collect();
    for part in batch.chunks(4096) {
        graph.parallel_insert_slice(&part.to_vec());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(seed: u64, dim: usize) -> Vec<f32> {
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1);
        let mut v: Vec<f32> = (0..dim)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) as f32 / (1u64 << 31) as f32) - 0.5
            })
            .collect();
        let n = dot(&v, &v).sqrt();
        v.iter_mut().for_each(|a| *a /= n);
        v
    }

    #[test]
    fn finds_neighbours_skips_tombstones_and_honours_filters() {
        let data: Vec<(u64, Vec<f32>)> = (0..2000).map(|i| (i, unit(i, 48))).collect();
        let v = Vectors::build(data.clone());
        // Every point finds itself first.
        let mut found = 0;
        for (id, x) in data.iter().step_by(40) {
            let hits = v.search(x, 5, None);
            found += usize::from(hits[0].0 == *id);
            assert!((hits[0].1 - 1.0).abs() < 1e-4 || hits[0].0 != *id);
        }
        assert!(found >= 48, "recall@1 {found}/50");
        // Deleted points never come back.
        v.update(&[0, 40, 80], vec![(5000, unit(0, 48))]);
        let hits = v.search(&data[0].1, 3, None);
        assert_eq!(hits[0].0, 5000);
        assert!(hits.iter().all(|h| h.0 != 0));
        // A filter restricts results, exactly.
        let allowed: Arc<HashSet<u64>> = Arc::new((100..110).collect());
        let hits = v.search(&data[0].1, 20, Some(&allowed));
        assert_eq!(hits.len(), 10);
        assert!(hits.iter().all(|h| allowed.contains(&h.0)));
        assert!(hits.windows(2).all(|w| w[0].1 >= w[1].1));
    }

    #[test]
    fn a_snapshot_reloads_and_catches_up_with_the_store() {
        let dir = std::env::temp_dir().join(format!("hnsw-snap-{}", rand::random::<u64>()));
        let data: Vec<(u64, Vec<f32>)> = (0..1500).map(|i| (i, unit(i, 32))).collect();
        Vectors::build(data.clone()).save(&dir).unwrap();
        // Since the snapshot: 0..100 deleted, 5000..5100 added.
        let now: Vec<(u64, Vec<f32>)> = data[100..]
            .iter()
            .cloned()
            .chain((5000..5100).map(|i| (i, unit(i, 32))))
            .collect();
        let v = Vectors::load(&dir, &now).expect("snapshot loads");
        assert_eq!(*v.dead.read(), 100);
        assert_eq!(v.search(&unit(5050, 32), 1, None)[0].0, 5050);
        assert_eq!(v.search(&unit(700, 32), 1, None)[0].0, 700);
        assert!(v.search(&unit(50, 32), 5, None).iter().all(|h| h.0 >= 100));
        // A damaged snapshot is no snapshot.
        std::fs::write(dir.join("graph.hnsw.graph"), b"garbage").unwrap();
        assert!(Vectors::load(&dir, &now).is_none());
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn rebuilds_once_tombstones_dominate() {
        let v = Vectors::build((0..3000).map(|i| (i, unit(i, 16))).collect());
        let gone: Vec<u64> = (0..2500).collect();
        v.update(&gone, Vec::new());
        assert_eq!(*v.dead.read(), 0, "rebuilt");
        assert_eq!(v.graph.read().get_nb_point(), 500);
        let hits = v.search(&unit(2600, 16), 1, None);
        assert_eq!(hits[0].0, 2600);
    }
}
