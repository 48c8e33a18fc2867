//! A deliberately faulty reranker for the gateway's fault-containment tests: the query picks
//! the fault. Any other query scores candidates in reverse input order, which also makes this
//! component tell-apart from the real reranker in hot-reload tests.

use guest_sdk::reranker::{error, Candidate, Guest, LogLevel, PluginError, Scored};

struct Plugin;

impl Guest for Plugin {
    fn rerank(query: String, candidates: Vec<Candidate>) -> Result<Vec<Scored>, PluginError> {
        match query.as_str() {
            "trap" => trap(),
            "panic" => panic!("faulty-reranker was asked to panic"),
            "spin" => {
                let mut n = 0u64;
                loop {
                    n = std::hint::black_box(n.wrapping_add(1));
                }
            }
            // Blocks in the host (a WASI monotonic-clock pollable), where epoch interruption
            // cannot reach: only abandoning the call holds the deadline.
            "sleep" => {
                std::thread::sleep(std::time::Duration::from_secs(20));
                Ok(vec![])
            }
            "huge-error" => Err(error("refused", "x".repeat(4 << 20))),
            "alloc" => {
                // Capacity without writes: grows linear memory fast, so the memory cap (not the
                // deadline) is what stops it even on a loaded machine.
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(Vec::with_capacity(8 << 20));
                    std::hint::black_box(&hoard);
                }
            }
            "unknown-id" => Ok(vec![Scored {
                id: "no-such-candidate".into(),
                score: 1.0,
            }]),
            "nan" => Ok(candidates
                .into_iter()
                .map(|c| Scored {
                    id: c.id,
                    score: f32::NAN,
                })
                .collect()),
            "refuse" => Err(error("refused", "this reranker refuses the query")),
            _ => {
                guest_sdk::reranker::log(LogLevel::Info, "scoring in reverse order");
                let n = candidates.len() as f32;
                Ok(candidates
                    .into_iter()
                    .enumerate()
                    .map(|(i, c)| Scored {
                        id: c.id,
                        score: (i as f32 + 1.0) / n,
                    })
                    .collect())
            }
        }
    }
}

#[cfg(target_arch = "wasm32")]
fn trap() -> ! {
    core::arch::wasm32::unreachable()
}

#[cfg(not(target_arch = "wasm32"))]
fn trap() -> ! {
    std::process::abort()
}

guest_sdk::export_reranker!(Plugin);
