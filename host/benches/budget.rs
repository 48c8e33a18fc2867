//! Budget exactness across replicas: 10,000 concurrent requests split over two tenancies (two
//! replicas) sharing one Redis, against a token budget that runs out midway. Each reserves
//! 140 tokens (40 prompt + 100 max) and settles 100. Prints what was admitted and settled
//! against the budget, and how full the budget was at the first refusal.
//!
//! `cargo bench --bench budget` (needs `redis-server`).

use std::sync::Arc;
use std::time::Duration;

use gateway::tenancy::{keys, Denied, Tenancy};

#[path = "support/redis.rs"]
mod support;

const REQUESTS: usize = 10_000;
const BUDGET: u64 = 700_000;
const RESERVE: u64 = 140;
const SETTLE: (u64, u64) = (40, 60);

fn main() {
    let Some(server) = support::Redis::start() else {
        println!("SKIPPED: redis-server is not installed");
        return;
    };
    let dir = std::env::temp_dir().join(format!("gateway-budget-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = format!(
        "[[tenants]]\nname = \"t\"\ntoken_budget = {{ tokens = {BUDGET}, period = \"day\" }}\n\
         keys = [{{ id = \"a\", sha256 = \"{}\" }}]\n",
        gateway::plugins::hex(&keys::hash("budget-key"))
    );
    let path = dir.join("policies.toml");
    std::fs::write(&path, policy).unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let replicas = server.replicas(2, &path, &rt);
    let outcomes = rt.block_on(run(&replicas));
    let admitted = outcomes.iter().filter(|o| o.is_ok()).count() as u64;
    let settled = admitted * (SETTLE.0 + SETTLE.1);
    // The first refusal's message says how much was used or reserved then.
    let at_first_refusal = outcomes
        .iter()
        .find_map(|o| o.as_ref().err())
        .and_then(|m| {
            m.split("exhausted: ")
                .nth(1)?
                .split(' ')
                .next()?
                .parse::<u64>()
                .ok()
        });
    let mut con = redis::Client::open(server.url().as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("gw:{t}:budget:*:used")
        .query(&mut con)
        .unwrap();
    let used_in_redis: u64 = redis::cmd("GET").arg(&keys[0]).query(&mut con).unwrap();
    println!("\nbudget exactness: {REQUESTS} concurrent requests over two replicas, budget {BUDGET} tokens, {RESERVE} reserved and {} settled each", SETTLE.0 + SETTLE.1);
    println!("| admitted | refused | settled tokens | in Redis | budget | used + reserved at the first refusal |");
    println!("|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {admitted} | {} | {settled} | {used_in_redis} | {BUDGET} | {} |",
        REQUESTS as u64 - admitted,
        at_first_refusal.map_or("none".into(), |n| n.to_string())
    );
    drop(server);
    let _ = std::fs::remove_dir_all(dir);
}

/// Every request at once, alternating replicas: reserve, a short generation, settle.
async fn run(replicas: &[Arc<Tenancy>]) -> Vec<Result<(), String>> {
    let tasks: Vec<_> = (0..REQUESTS)
        .map(|i| {
            let t = replicas[i % 2].clone();
            tokio::spawn(async move {
                let caller = t.admit_request(Some("budget-key"), true).await.unwrap();
                match t
                    .reserve_tokens(
                        &caller,
                        "m",
                        gateway::common::Endpoint::Chat,
                        SETTLE.0,
                        RESERVE,
                    )
                    .await
                {
                    Ok(r) => {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                        r.settle(SETTLE.0, SETTLE.1, gateway::tenancy::Outcome::Ok);
                        Ok(())
                    }
                    Err(Denied::Limited(r)) => Err(r.message),
                    Err(other) => panic!("{other:?}"),
                }
            })
        })
        .collect();
    let mut out = Vec::new();
    for t in tasks {
        out.push(t.await.unwrap());
    }
    // Settlements run on their own tasks: let them land.
    tokio::time::sleep(Duration::from_millis(500)).await;
    out
}
