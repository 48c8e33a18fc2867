//! The store behind `previous_response_id`: 100,000 stored responses (a few KB each, spread
//! over 100 tenants) in the ledger's SQLite file, then random lookups of one, as a request
//! continuing a conversation makes. Prints p50 / p99 / p99.9 in µs, and the put rate.
//!
//! `cargo bench --bench conversations [-- RESPONSES]`

use std::time::Instant;

use gateway::config::ResponsesConfig;
use gateway::conversations::{Conversations, Stored};
use serde_json::json;

fn main() {
    let n: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(100_000);
    let dir = std::env::temp_dir().join(format!("gateway-conv-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = ResponsesConfig {
        retention_days: 30,
        max_mb_per_tenant: 1 << 20,
    };
    let store = Conversations::open(&dir.join("usage.sqlite"), &cfg).unwrap();
    let turn = |i: usize| Stored {
        response: json!({"id": format!("resp_{i}"), "object": "response", "output": [
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "A reply of a few sentences. ".repeat(20)}]}]}),
        input: vec![
            json!({"id": format!("msg_{i}"), "type": "message", "role": "user",
                           "content": [{"type": "input_text", "text": "A question. ".repeat(20)}]}),
        ],
        context: vec![json!({"role": "user", "content": "Earlier turns. ".repeat(60)})],
    };
    let t0 = Instant::now();
    for i in 0..n {
        store
            .put(&format!("t{}", i % 100), &format!("resp_{i}"), &turn(i))
            .unwrap();
    }
    let put_rate = n as f64 / t0.elapsed().as_secs_f64();
    let mut samples = Vec::with_capacity(20_000);
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let i = (x % n as u64) as usize;
        let t = Instant::now();
        let got = store
            .get(&format!("t{}", i % 100), &format!("resp_{i}"))
            .unwrap();
        samples.push(t.elapsed());
        assert!(got.is_some());
    }
    samples.sort();
    let at = |q: f64| samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)];
    let us = |d: std::time::Duration| d.as_secs_f64() * 1e6;
    println!("\nprevious_response_id lookup among {n} stored responses (SQLite, WAL), µs");
    println!("| p50 | p99 | p99.9 | puts/s while filling |");
    println!("|---:|---:|---:|---:|");
    println!(
        "| {:.1} | {:.1} | {:.1} | {put_rate:.0} |",
        us(at(0.5)),
        us(at(0.99)),
        us(at(0.999))
    );
    let _ = std::fs::remove_dir_all(dir);
}
