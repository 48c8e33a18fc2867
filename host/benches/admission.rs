//! Admission overhead per request: API-key check (SHA-256 + lookup), request-rate and
//! in-flight limits, token reservation against rate and budget, settlement and the ledger
//! write hand-off — everything a generation request pays before and after the engine.
//! Paced at 1,000 requests/s like a busy gateway, not a tight loop. Prints p50/p99 in µs.
//!
//! With `redis-server` installed, also the same through Redis-shared limits: two tenancies
//! (two replicas) on one Redis on loopback, taking turns.
//!
//! `cargo bench --bench admission`

use std::sync::Arc;
use std::time::{Duration, Instant};

use gateway::common::Endpoint;
use gateway::metrics::Metrics;
use gateway::tenancy::{keys, ledger::Ledger, Tenancy};

#[path = "support/redis.rs"]
mod support;

const RATE: u32 = 1000;
const SECONDS: u32 = 5;

fn main() {
    let dir = std::env::temp_dir().join(format!("gateway-admission-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut policy = String::new();
    // 200 tenants with two keys each: the lookup is not against a toy table.
    for t in 0..200 {
        policy += &format!(
            "[[tenants]]\nname = \"t{t}\"\nrequests_per_second = 100000\ntokens_per_minute = 1000000000\nmax_concurrent = 1000\n\
             token_budget = {{ tokens = 1000000000000, period = \"month\" }}\n\
             keys = [{{ id = \"a\", sha256 = \"{}\" }}, {{ id = \"b\", sha256 = \"{}\" }}]\n",
            gateway::plugins::hex(&keys::hash(&format!("key-{t}-a"))),
            gateway::plugins::hex(&keys::hash(&format!("key-{t}-b"))),
        );
    }
    let path = dir.join("policies.toml");
    std::fs::write(&path, policy).unwrap();
    let ledger_path = dir.join("usage.sqlite");
    let durability = gateway::tenancy::ledger::Durability::beside(&ledger_path);
    let ledger = Ledger::open(&ledger_path, durability).unwrap();
    let tenancy =
        Arc::new(Tenancy::new(Some(path), Some(ledger), Arc::new(Metrics::new())).unwrap());
    let open = Arc::new(Tenancy::new(None, None, Arc::new(Metrics::new())).unwrap());

    // What the server calls, on a runtime as it does (with no Redis configured, neither entry
    // point awaits anything).
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let mut rows = Vec::new();
    for (name, t) in [
        ("policies + ledger", &tenancy),
        ("open mode (no policies, no ledger)", &open),
    ] {
        let mut samples = Vec::with_capacity((RATE * SECONDS) as usize);
        let start = Instant::now();
        for i in 0..RATE * SECONDS {
            let due = start + Duration::from_secs_f64(i as f64 / RATE as f64);
            while Instant::now() < due {
                std::hint::spin_loop();
            }
            let key = format!("key-{}-a", i % 200);
            let t0 = Instant::now();
            let caller = rt.block_on(t.admit_request(Some(&key), true)).unwrap();
            let reserved = t.reserve_tokens(&caller, "model", Endpoint::Chat, 40, 140);
            let r = rt.block_on(reserved).unwrap();
            r.settle(40, 60, gateway::tenancy::Outcome::Ok);
            drop(r);
            drop(caller);
            samples.push(t0.elapsed());
        }
        samples.sort();
        let at = |q: f64| {
            samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)].as_secs_f64()
                * 1e6
        };
        rows.push((name, at(0.5), at(0.99), at(0.999)));
    }
    if let Some(row) = shared_row(&dir) {
        rows.push(row);
    }
    if let Some(l) = &tenancy.ledger {
        l.close();
    }
    println!("\nadmission overhead per request at {RATE} requests/s for {SECONDS} s (µs)");
    println!("| path | p50 | p99 | p99.9 |");
    println!("|---|---:|---:|---:|");
    for (name, p50, p99, p999) in rows {
        println!("| {name} | {p50:.1} | {p99:.1} | {p999:.1} |");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// The Redis-shared path: admission and reservation are one script round trip each.
fn shared_row(dir: &std::path::Path) -> Option<(&'static str, f64, f64, f64)> {
    let redis = support::Redis::start()?;
    let policy =
        "[[tenants]]\nname = \"t\"\nrequests_per_second = 100000\ntokens_per_minute = 1000000000\n\
        max_concurrent = 1000\ntoken_budget = { tokens = 1000000000000, period = \"month\" }\n\
        keys = [{ id = \"a\", sha256 = \"KEY\" }]\n"
            .replace("KEY", &gateway::plugins::hex(&keys::hash("shared-key")));
    let path = dir.join("shared-policies.toml");
    std::fs::write(&path, policy).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let replicas = redis.replicas(2, &path, &rt);
    let samples = rt.block_on(async {
        let mut samples = Vec::with_capacity((RATE * SECONDS) as usize);
        let start = Instant::now();
        for i in 0..RATE * SECONDS {
            let due = start + Duration::from_secs_f64(i as f64 / RATE as f64);
            tokio::time::sleep_until(due.into()).await;
            let t = &replicas[i as usize % 2];
            let t0 = Instant::now();
            let caller = t.admit_request(Some("shared-key"), true).await.unwrap();
            let r = t
                .reserve_tokens(&caller, "model", Endpoint::Chat, 40, 140)
                .await
                .unwrap();
            r.settle(40, 60, gateway::tenancy::Outcome::Ok);
            samples.push(t0.elapsed());
        }
        samples
    });
    drop(redis);
    let mut samples = samples;
    samples.sort();
    let at = |q: f64| {
        samples[((samples.len() as f64 * q) as usize).min(samples.len() - 1)].as_secs_f64() * 1e6
    };
    Some((
        "Redis-shared, two replicas (admit + reserve: two round trips)",
        at(0.5),
        at(0.99),
        at(0.999),
    ))
}
