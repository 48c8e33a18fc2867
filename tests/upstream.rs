//! A front gateway routing to upstream replicas over loopback: two real gateways in engine
//! role (the default model, one compute thread each), and listeners that refuse, or accept and
//! never answer, as dead and hung servers do.

mod support;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::upstream::*;
use support::{model_path, patient_client, Server, MODEL};

#[test]
fn load_spreads_prefixes_stick_and_usage_is_the_upstreams() {
    let (a, b) = (engine(), engine());
    let front = front(&pool("smol", &[&a, &b], ""));
    // Concurrent requests spread over both replicas by their load.
    let replicas: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                let front = &front;
                s.spawn(move || {
                    let (st, replica, model, body) =
                        chat(front, &ask("smol", &format!("Say the number {i}."), 8));
                    assert_eq!(st, 200, "{body}");
                    assert_eq!(model, "smol");
                    assert_eq!(body["model"], "smol");
                    replica
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(
        replicas.contains(&"0".to_string()) && replicas.contains(&"1".to_string()),
        "{replicas:?}"
    );

    // A shared system prompt: one replica takes them all and serves the prefix from its cache.
    let system = "You are the assistant of the Acme CRM. Answer in one short sentence. ".repeat(20);
    let mut seen = Vec::new();
    let mut completion = 0;
    for q in [
        "Who owns the Initech deal?",
        "What is my quota?",
        "List open tickets.",
        "Any renewals?",
    ] {
        let body = json!({"model": "smol", "temperature": 0, "max_tokens": 6, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": q}]});
        let (st, replica, _, body) = chat(&front, &body);
        assert_eq!(st, 200, "{body}");
        completion += body["usage"]["completion_tokens"].as_u64().unwrap();
        seen.push(replica);
    }
    assert!(
        seen.iter().all(|r| *r == seen[0]),
        "prefix went to several replicas: {seen:?}"
    );
    let sticky = if seen[0] == "0" { &a } else { &b };
    let hits = sticky.metric(&format!(
        "gateway_prefix_cache_hit_tokens_total{{model=\"{MODEL}\"}}"
    ));
    assert!(
        hits >= 3.0 * 16.0,
        "prefix cache hits on the chosen replica: {hits}"
    );
    let by_prefix = front.metric(&format!(
        "gateway_upstream_picks_total{{by=\"prefix\",model=\"smol\",replica=\"{}\"}}",
        seen[0]
    ));
    assert!(by_prefix >= 3.0, "picks by prefix: {by_prefix}");

    // The tenant is charged what the upstream reported.
    let before = front.metric("gateway_tenant_tokens_total{kind=\"completion\",tenant=\"acme\"}");
    assert!(before >= completion as f64);
    let (st, _, _, body) = chat(&front, &ask("smol", "Name a colour.", 5));
    assert_eq!(st, 200);
    let after = front.metric("gateway_tenant_tokens_total{kind=\"completion\",tenant=\"acme\"}");
    assert_eq!(
        after - before,
        body["usage"]["completion_tokens"].as_f64().unwrap()
    );
}

#[test]
fn streams_relay_deltas_and_the_usage_chunk_only_when_asked() {
    let a = engine();
    let front = front(&pool("smol", &[&a], ""));
    let mut body = ask("smol", "Write a haiku about invoices.", 12);
    body["stream"] = json!(true);
    let (_, r) = open_stream(&front, &body);
    let (evs, done) = events(r);
    assert!(done);
    assert!(
        evs.iter()
            .all(|e| e["model"] == "smol" && e.get("usage").is_none()),
        "{evs:?}"
    );
    let text: String = evs
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    let (st, _, _, whole) = chat(&front, &ask("smol", "Write a haiku about invoices.", 12));
    assert_eq!(st, 200);
    assert_eq!(
        text,
        whole["choices"][0]["message"]["content"].as_str().unwrap()
    );
    body["stream_options"] = json!({"include_usage": true});
    let (_, r) = open_stream(&front, &body);
    let (evs, done) = events(r);
    assert!(done);
    let last = evs.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"], whole["usage"]);

    // Plugin debugging reports the raw text on the upstream path too.
    let debugged: Value = patient_client()
        .post(format!("{}/v1/chat/completions", front.base))
        .bearer_auth(KEY)
        .header("x-gateway-debug", "plugins")
        .json(&ask("smol", "Write a haiku about invoices.", 12))
        .send()
        .unwrap()
        .json()
        .unwrap();
    let raw = &debugged["gateway_debug"]["raw_text"][0];
    assert_eq!(
        raw, &debugged["choices"][0]["message"]["content"],
        "{debugged}"
    );

    // `documents` ground the prompt here, as for a local model: the upstream sees the sources.
    let mut grounded = ask("smol", "Write a haiku about invoices.", 12);
    grounded["documents"] = json!([{"text": "Invoices are due within 30 days of issue."}]);
    let (st, _, _, with_docs) = chat(&front, &grounded);
    assert_eq!(st, 200, "{with_docs}");
    let tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        tokens(&with_docs) > tokens(&whole) + 20,
        "{with_docs} vs {whole}"
    );
}

#[test]
fn a_killed_replica_is_retried_around_ejected_and_readmitted() {
    let (a, mut b) = (engine(), engine());
    let front = front(&pool("smol", &[&a, &b], ""));
    let b_addr = b.base.trim_start_matches("http://").to_string();
    let stop = std::sync::atomic::AtomicBool::new(false);
    // Steady load throughout: two clients, one request after another, across the kill and
    // the restart. None may fail: requests caught on the killed replica before their first
    // byte are retried on the other.
    let served: Vec<(u16, String, Value)> = std::thread::scope(|s| {
        let load: Vec<_> = (0..2)
            .map(|w| {
                let (front, stop) = (&front, &stop);
                s.spawn(move || {
                    let mut out = Vec::new();
                    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                        let q = format!("Client {w}, request {}: pick a number.", out.len());
                        let (st, replica, _, body) = chat(front, &ask("smol", &q, 24));
                        out.push((st, replica, body));
                    }
                    out
                })
            })
            .collect();
        let b_new = kill_midstream_and_restart(&front, &mut b, &b_addr);
        // Back in the pool: the load reaches it again.
        let deadline = Instant::now() + Duration::from_secs(20);
        let by_b = "gateway_upstream_requests_total{code=\"200\",model=\"smol\",replica=\"1\"}";
        let before = front.metric(by_b);
        front.wait_until(by_b, |v| v > before, "> before");
        assert!(Instant::now() < deadline);
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let all = load.into_iter().flat_map(|h| h.join().unwrap()).collect();
        drop(b_new);
        all
    });
    let failed: Vec<_> = served.iter().filter(|(st, _, _)| *st != 200).collect();
    assert!(failed.is_empty(), "failed under the kill: {failed:?}");
    assert!(served.len() >= 6, "{} requests", served.len());
    assert!(front.metric("gateway_upstream_ejections_total{model=\"smol\",replica=\"1\"}") >= 1.0);
}

/// Kills replica 1 while a stream runs on it (the stream must end with an error event), waits
/// for the front to see it down, restarts it at `addr` and waits until it is probed up.
fn kill_midstream_and_restart(front: &Server, b: &mut Server, addr: &str) -> Server {
    let mut long = ask("smol", "Tell a very long story about a sales team.", 400);
    long["stream"] = json!(true);
    long["ignore_eos"] = json!(true);
    let r = loop {
        let (replica, r) = open_stream(front, &long);
        if replica == "1" {
            break r;
        }
        drop(r);
    };
    let mut lines = BufReader::new(r).lines();
    for _ in 0..6 {
        lines.next().unwrap().unwrap();
    }
    b.kill();
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    let error = rest
        .iter()
        .filter_map(|l| l.strip_prefix("data: "))
        .find_map(|d| {
            serde_json::from_str::<Value>(d)
                .ok()
                .filter(|v| v.get("error").is_some())
        })
        .expect("the cut stream ends with an error event");
    assert_eq!(error["error"]["code"], "upstream_error");
    let last = rest.iter().rev().find(|l| !l.is_empty());
    assert_eq!(last.map(String::as_str), Some("data: [DONE]"));
    let up = "gateway_upstream_up{model=\"smol\",replica=\"1\"}";
    front.wait_until(up, |v| v == 0.0, "= 0");
    std::thread::sleep(Duration::from_secs(1));
    let b = engine_at(addr);
    front.wait_until(up, |v| v == 1.0, "= 1");
    b
}

#[test]
fn a_hung_upstream_times_out_and_the_fallback_chain_serves() {
    let a = engine();
    let hung = TcpListener::bind("127.0.0.1:0").unwrap();
    let hung_url = format!("http://{}/v1", hung.local_addr().unwrap());
    // Accept and hold every connection, reading nothing back.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in hung.incoming().map_while(Result::ok) {
            held.push(s);
        }
    });
    let slow = |name: &str, fallback: &str| {
        format!(
            "[[upstreams]]\nname = \"{name}\"\nmodel = \"{MODEL}\"\nreplicas = [\"{hung_url}\"]\n\
             health_path = \"\"\nscrape_metrics = false\nfirst_token_timeout_ms = 1000\n\
             max_attempts = 1\n{fallback}\n"
        )
    };
    let config = [
        slow("stuck", ""),
        slow("stuck-with-fallback", "fallback = [\"smol\"]"),
        pool("smol", &[&a], ""),
    ]
    .concat();
    let front = front(&config);
    let started = Instant::now();
    let (st, _, _, body) = chat(&front, &ask("stuck", "Hello?", 4));
    assert_eq!(st, 504, "{body}");
    assert_eq!(body["error"]["code"], "upstream_timeout");
    assert!(started.elapsed() < Duration::from_secs(5));

    let (st, replica, model, body) = chat(&front, &ask("stuck-with-fallback", "Hello?", 4));
    assert_eq!(st, 200, "{body}");
    assert_eq!((model.as_str(), replica.as_str()), ("smol", "0"));
    assert_eq!(body["model"], "smol");
    let fell = "gateway_upstream_fallbacks_total{model=\"stuck-with-fallback\",served_by=\"smol\"}";
    assert_eq!(front.metric(fell), 1.0);
    // One settled request (ledger row) for the fallback, and the timed-out one's error.
    let (_, usage) = front.get("/metrics");
    assert!(
        usage.contains("gateway_tenant_requests_total{status=\"ok\",tenant=\"acme\"} 1"),
        "{usage}"
    );
}

#[test]
fn a_draining_replica_gets_no_new_requests() {
    let (a, b) = (engine(), engine());
    let front = front(&pool("smol", &[&a, &b], ""));
    // A stream in flight keeps b draining after SIGTERM.
    let mut long = ask(MODEL, "Tell a very long story.", 300);
    long["stream"] = json!(true);
    long["ignore_eos"] = json!(true);
    let in_flight = patient_client()
        .post(format!("{}/v1/chat/completions", b.base))
        .json(&long)
        .send()
        .unwrap();
    std::process::Command::new("kill")
        .args(["-TERM", &b.pid().to_string()])
        .status()
        .unwrap();
    front.wait_until(
        "gateway_upstream_up{model=\"smol\",replica=\"1\"}",
        |v| v == 0.0,
        "= 0",
    );
    for i in 0..4 {
        let (st, replica, _, body) = chat(&front, &ask("smol", &format!("Hi {i}."), 2));
        assert_eq!(st, 200, "{body}");
        assert_eq!(replica, "0");
    }
    drop(in_flight);
}

#[test]
fn a_saturated_local_model_sends_new_requests_down_its_fallback_chain() {
    let remote = engine();
    let local = format!(
        "[[models]]\nname = \"local\"\npath = \"{}\"\nfallback = [\"remote\"]\n\
         saturated_waiting = 1\n[models.engine]\nmax_num_seqs = 1\nthreads = 1\n",
        model_path()
    );
    let front = front_with("", &(local + &pool("remote", &[&remote], "")));
    let (st, _, model, body) = chat(&front, &ask("local", "Hello.", 2));
    assert_eq!((st, model.as_str()), (200, "local"), "{body}");
    // One sequence runs at a time: three long streams leave two waiting, past the threshold.
    // The first must be running before the others come: while it still waits, the third
    // would find two waiting already and rightly go to the fallback (seen on a loaded machine).
    let mut long = ask("local", "Tell a very long story.", 300);
    long["stream"] = json!(true);
    long["ignore_eos"] = json!(true);
    let mut streams = vec![open_stream(&front, &long).1];
    front.wait_until(
        "vllm:num_requests_running{model_name=\"local\"}",
        |v| v >= 1.0,
        ">= 1",
    );
    streams.extend((0..2).map(|_| open_stream(&front, &long).1));
    front.wait_until(
        "vllm:num_requests_waiting{model_name=\"local\"}",
        |v| v >= 2.0,
        ">= 2",
    );
    let (st, replica, model, body) = chat(&front, &ask("local", "Hello.", 2));
    assert_eq!(
        (st, model.as_str(), replica.as_str()),
        (200, "remote", "0"),
        "{body}"
    );
    assert_eq!(body["model"], "remote");
    let fell = "gateway_upstream_fallbacks_total{model=\"local\",served_by=\"remote\"}";
    assert_eq!(front.metric(fell), 1.0);
    drop(streams);
    front.wait_until(
        "vllm:num_requests_waiting{model_name=\"local\"}",
        |v| v == 0.0,
        "= 0",
    );
    let (st, _, model, _) = chat(&front, &ask("local", "Hello.", 2));
    assert_eq!((st, model.as_str()), (200, "local"));
}

#[test]
fn a_refused_connection_is_retried_on_another_replica() {
    let a = engine();
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    // No probes: only the failed request itself can find the dead replica out. Its cool-down
    // must outlast the test: a loaded CI machine can take more than the usual 1 s per request,
    // and the second request would then retry the dead replica once more.
    let urls = format!("\"http://{dead}/v1\", \"{}/v1\"", a.base);
    let front = front(&pool_ejecting("flaky", &urls, "", 600_000, ""));
    for i in 0..2 {
        let (st, replica, _, body) = chat(&front, &ask("flaky", &format!("Hi {i}."), 2));
        assert_eq!((st, replica.as_str()), (200, "1"), "{body}");
    }
    assert_eq!(
        front.metric("gateway_upstream_retries_total{model=\"flaky\"}"),
        1.0
    );
    let refused = "gateway_upstream_requests_total{code=\"connect\",model=\"flaky\",replica=\"0\"}";
    assert_eq!(front.metric(refused), 1.0);
}

#[test]
fn a_client_hanging_up_cancels_the_upstream_generation() {
    let a = engine();
    let front = front(&pool("smol", &[&a], ""));
    let mut long = ask("smol", "Tell a very long story.", 2000);
    long["stream"] = json!(true);
    long["ignore_eos"] = json!(true);
    let (_, r) = open_stream(&front, &long);
    let mut lines = BufReader::new(r).lines();
    for _ in 0..4 {
        lines.next().unwrap().unwrap();
    }
    let running = format!("vllm:num_requests_running{{model_name=\"{MODEL}\"}}");
    a.wait_until(&running, |v| v == 1.0, "= 1 while the stream runs");
    drop(lines);
    a.wait_until(&running, |v| v == 0.0, "= 0 once the client is gone");
    let generated = a.metric(&format!(
        "gateway_generation_tokens_total{{model=\"{MODEL}\"}}"
    ));
    assert!(
        generated < 1000.0,
        "{generated} tokens: the generation ran on"
    );
}
