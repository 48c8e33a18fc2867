//! Two gateway replicas sharing their limits through a real Redis (Debian's `redis-server`,
//! started here on a loopback port in a temporary folder): rates, in-flight caps and token
//! budgets hold across both; a dead replica's reservations expire; Redis down gives the
//! configured failure mode, and recovery when it returns.

mod support;

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::redis::{redis, Redis};
use support::{key_sha256, model_path, Server, MODEL};

const KEY: &str = "acme-cluster-key";

/// A replica of the default model whose tenant `acme` has `limits`, sharing them through
/// `redis` with `cluster` settings.
fn replica(redis: &str, limits: &str, cluster: &str) -> Server {
    let dir = std::env::temp_dir().join(format!(
        "gateway-cluster-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = format!(
        "[[tenants]]\nname = \"acme\"\nkeys = [{{ id = \"k\", sha256 = \"{}\" }}]\n{limits}\n",
        key_sha256(KEY)
    );
    std::fs::write(dir.join("policies.toml"), policy).unwrap();
    let config = format!(
        "embeddings = []\npolicies = \"{d}/policies.toml\"\nledger = \"{d}/usage.sqlite\"\n\
         collections_dir = \"{d}/collections\"\n\
         [[models]]\nname = \"{MODEL}\"\npath = \"{}\"\n[models.engine]\nthreads = 1\n\
         [cluster]\nredis = \"{redis}\"\nredis_timeout_ms = 1000\n{cluster}\n",
        model_path(),
        d = dir.display()
    );
    std::fs::write(dir.join("gateway.toml"), config).unwrap();
    let path = dir.join("gateway.toml");
    Server::start(&["--config", path.to_str().unwrap()]).remove_on_drop(&dir)
}

fn models(s: &Server) -> (u16, Value) {
    s.request("GET", "/v1/models", vec![], Some(KEY))
}

fn complete(s: &Server, max_tokens: u32) -> (u16, Value) {
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": true});
    s.post_as(KEY, "/v1/completions", &body)
}

/// Waits until at least `margin` seconds are left in the current minute, so that a test of a
/// per-minute window does not straddle two.
fn clear_of_minute_boundary(margin: u64) {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    if 60 - secs % 60 < margin {
        std::thread::sleep(Duration::from_secs(60 - secs % 60 + 1));
    }
}

#[test]
fn a_request_rate_holds_across_replicas() {
    let Some(redis) = redis() else { return };
    let limits = "requests_per_minute = 6";
    let (a, b) = (
        replica(&redis.url(), limits, ""),
        replica(&redis.url(), limits, ""),
    );
    clear_of_minute_boundary(20);
    // Six requests a minute in all, however they are spread over A and B.
    let statuses: Vec<u16> = (0..10)
        .map(|i| models(if i % 2 == 0 { &a } else { &b }).0)
        .collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 200).count(),
        6,
        "{statuses:?}"
    );
    let (_, body) = models(&a);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("per minute"),
        "{body}"
    );
}

#[test]
fn an_in_flight_cap_holds_across_replicas() {
    let Some(redis) = redis() else { return };
    let limits = "max_concurrent = 1";
    // Slots expire after 2 s unless their request is still running.
    let cluster = "reservation_ttl_s = 2";
    let (a, b) = (
        replica(&redis.url(), limits, cluster),
        replica(&redis.url(), limits, cluster),
    );
    // One request in flight on A holds the tenant's only slot on B too, past the expiry.
    let long = json!({"model": MODEL, "prompt": "Tell a story", "max_tokens": 4000,
                      "ignore_eos": true, "stream": true});
    let stream = a.raw_request_as(KEY, "/v1/completions", &long.to_string());
    let (st, body) = models(&b);
    assert_eq!(st, 429, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("in flight"), "{body}");
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(models(&b).0, 429, "the running request's slot expired");
    // Hanging up gives the slot back, for every replica.
    drop(stream);
    let deadline = Instant::now() + Duration::from_secs(10);
    while models(&b).0 != 200 {
        assert!(Instant::now() < deadline, "the slot was never given back");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_token_budget_holds_across_replicas_under_concurrency() {
    let Some(redis) = redis() else { return };
    let limits = "token_budget = { tokens = 300, period = \"day\" }";
    let (a, b) = (
        replica(&redis.url(), limits, ""),
        replica(&redis.url(), limits, ""),
    );
    let results: Vec<(u16, Value)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..24)
            .map(|i| {
                let server = if i % 2 == 0 { &a } else { &b };
                s.spawn(move || complete(server, 20))
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let spent: u64 = results
        .iter()
        .filter(|(st, _)| *st == 200)
        .map(|(_, b)| b["usage"]["total_tokens"].as_u64().unwrap())
        .sum();
    let refused = results
        .iter()
        .filter(|(st, b)| *st == 429 && b["error"]["message"].as_str().unwrap().contains("budget"))
        .count();
    // Each request reserves its prompt + 20 (~25 tokens): 300 hold about 11 of them, where
    // each replica alone would have let 11 through, 22 in all.
    assert!(
        spent <= 300,
        "settled {spent} tokens against a budget of 300"
    );
    assert!(
        spent >= 300 - 2 * 25,
        "refused too early: {spent} tokens settled"
    );
    assert_eq!(
        refused + results.iter().filter(|(st, _)| *st == 200).count(),
        24
    );
}

#[test]
fn a_dead_replicas_reservations_expire() {
    let Some(redis) = redis() else { return };
    let limits = "token_budget = { tokens = 500, period = \"day\" }";
    let cluster = "reservation_ttl_s = 3";
    let mut a = replica(&redis.url(), limits, cluster);
    let b = replica(&redis.url(), limits, cluster);
    // A reserves 450 for a long generation and dies holding them.
    let body = json!({"model": MODEL, "prompt": "Tell a story", "max_tokens": 440,
                      "ignore_eos": true, "stream": true});
    let stream = a.raw_request_as(KEY, "/v1/completions", &body.to_string());
    a.kill();
    drop(stream);
    let (st, body) = complete(&b, 100);
    assert_eq!(st, 429, "{body}");
    // Not forever: after the reservation's expiry the budget is B's again.
    std::thread::sleep(Duration::from_secs(4));
    let (st, body) = complete(&b, 100);
    assert_eq!(st, 200, "{body}");
}

#[test]
fn redis_down_fails_closed_or_open_and_recovery_follows() {
    let Some(redis) = redis() else { return };
    let port = redis.port;
    let limits = "requests_per_minute = 1000";
    let closed = replica(&redis.url(), limits, "redis_failure = \"closed\"");
    let open = replica(&redis.url(), limits, "redis_failure = \"open\"");
    assert_eq!(models(&closed).0, 200);
    drop(redis);
    let started = Instant::now();
    let (st, body) = models(&closed);
    assert_eq!(st, 503, "{body}");
    assert_eq!(body["error"]["code"], "limits_unavailable");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(models(&open).0, 200);
    assert!(open.metric("gateway_shared_limits_local_total") >= 1.0);
    // Redis back on the same port: shared limits again, within the reconnect backoff.
    let _redis = Redis::start_on(port).expect("redis-server restarts");
    let deadline = Instant::now() + Duration::from_secs(10);
    while models(&closed).0 != 200 {
        assert!(Instant::now() < deadline, "never recovered");
        std::thread::sleep(Duration::from_millis(100));
    }
}
