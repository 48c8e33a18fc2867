//! A front gateway routing to upstream replicas over loopback: two real gateways in engine
//! role (the default model, one compute thread each), and a listener that accepts and never
//! answers, as a hung server would.

mod support;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{key_sha256, model_path, patient_client, Server, MODEL};

const KEY: &str = "acme-key-1";

fn engine() -> Server {
    Server::start(&["--threads", "1"])
}

/// An engine on a given address (a replica restarted where it was).
fn engine_at(addr: &str) -> Server {
    Server::start(&["--threads", "1", "--listen", addr])
}

fn scratch(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "gateway-upstream-{what}-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A front gateway with no model of its own, `upstreams` (TOML) as its models, tenant `acme`.
fn front(upstreams: &str) -> Server {
    front_with("models = []\n", upstreams)
}

/// A front gateway: `head` (top-level keys) and `tables` (models and upstreams) as its config.
fn front_with(head: &str, tables: &str) -> Server {
    let dir = scratch("front");
    let policy = format!(
        "[[tenants]]\nname = \"acme\"\nkeys = [{{ id = \"k1\", sha256 = \"{}\" }}]\n",
        key_sha256(KEY)
    );
    std::fs::write(dir.join("policies.toml"), policy).unwrap();
    let config = format!(
        "{head}embeddings = []\npolicies = \"{d}/policies.toml\"\nledger = \"{d}/usage.sqlite\"\n\
         collections_dir = \"{d}/collections\"\n{tables}",
        d = dir.display()
    );
    std::fs::write(dir.join("front.toml"), config).unwrap();
    let path = dir.join("front.toml");
    Server::start(&["--config", path.to_str().unwrap()]).remove_on_drop(&dir)
}

/// A pool of gateway replicas, probed on `/ready` so that a draining one takes no requests.
fn pool(name: &str, replicas: &[&Server], extra: &str) -> String {
    let urls: Vec<String> = replicas
        .iter()
        .map(|s| format!("\"{}/v1\"", s.base))
        .collect();
    pool_of(name, &urls.join(", "), "/ready", extra)
}

fn pool_of(name: &str, urls: &str, health: &str, extra: &str) -> String {
    format!(
        "[[upstreams]]\nname = \"{name}\"\nmodel = \"{MODEL}\"\nreplicas = [{urls}]\n\
         health_path = \"{health}\"\nprobe_ms = 200\neject_ms = 1000\n{extra}\n"
    )
}

/// POSTs a chat request as tenant acme; status, `x-gateway-replica`, `x-gateway-model`, body.
fn chat(front: &Server, body: &Value) -> (u16, String, String, Value) {
    let r = patient_client()
        .post(format!("{}/v1/chat/completions", front.base))
        .bearer_auth(KEY)
        .json(body)
        .send()
        .unwrap();
    let header = |h: &str| {
        r.headers()
            .get(h)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default()
    };
    let (replica, model) = (header("x-gateway-replica"), header("x-gateway-model"));
    (r.status().as_u16(), replica, model, r.json().unwrap())
}

fn ask(model: &str, text: &str, max_tokens: u32) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": text}],
           "max_tokens": max_tokens, "temperature": 0})
}

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

/// Starts a streamed chat as acme; the replica that took it and the response to read.
fn open_stream(front: &Server, body: &Value) -> (String, reqwest::blocking::Response) {
    let r = patient_client()
        .post(format!("{}/v1/chat/completions", front.base))
        .bearer_auth(KEY)
        .json(body)
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    let replica = r
        .headers()
        .get("x-gateway-replica")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (replica, r)
}

/// The JSON events of an SSE stream, and whether it ended with `[DONE]`.
fn events(r: reqwest::blocking::Response) -> (Vec<Value>, bool) {
    let mut out = Vec::new();
    for line in BufReader::new(r).lines() {
        let Ok(line) = line else { break };
        match line.strip_prefix("data: ") {
            Some("[DONE]") => return (out, true),
            Some(data) => out.push(serde_json::from_str(data).unwrap()),
            None => {}
        }
    }
    (out, false)
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

/// llama.cpp's `llama-server` (built by host/scripts/test.sh from the llama-cpp-python sdist)
/// as an upstream: a server we did not write.
#[test]
fn llama_cpp_server_serves_as_an_upstream() {
    let Some(bin) = std::env::var_os("GATEWAY_LLAMA_SERVER") else {
        println!(
            "SKIPPED: GATEWAY_LLAMA_SERVER is not set (host/scripts/test.sh builds llama-server)"
        );
        return;
    };
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let child = std::process::Command::new(bin)
        .args([
            "-m",
            &model_path(),
            "--host",
            "127.0.0.1",
            "--port",
            &port.to_string(),
        ])
        .args(["-t", "1", "-c", "2048", "--metrics"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("llama-server starts");
    struct Kill(std::process::Child);
    impl Drop for Kill {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _llama = Kill(child);
    let url = format!("\"http://127.0.0.1:{port}/v1\"");
    let front = front(&pool_of("llama", &url, "/health", ""));
    front.wait_until(
        "gateway_upstream_up{model=\"llama\",replica=\"0\"}",
        |v| v == 1.0,
        "= 1",
    );
    let (st, _, model, body) = chat(&front, &ask("llama", "What is the capital of France?", 12));
    assert_eq!(st, 200, "{body}");
    assert_eq!(
        (model.as_str(), body["model"].as_str()),
        ("llama", Some("llama"))
    );
    assert!(!body["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
    let usage = &body["usage"];
    assert!(usage["prompt_tokens"].as_u64().unwrap() > 5, "{body}");
    let charged = front.metric("gateway_tenant_tokens_total{kind=\"completion\",tenant=\"acme\"}");
    assert_eq!(charged, usage["completion_tokens"].as_f64().unwrap());

    let mut body = ask("llama", "Count to five.", 8);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let (_, r) = open_stream(&front, &body);
    let (evs, done) = events(r);
    assert!(done);
    let text: String = evs
        .iter()
        .filter_map(|e| e["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert!(!text.is_empty());
    assert_eq!(evs.last().unwrap()["usage"]["completion_tokens"], 8);
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
    let mut long = ask("local", "Tell a very long story.", 300);
    long["stream"] = json!(true);
    long["ignore_eos"] = json!(true);
    let streams: Vec<_> = (0..3).map(|_| open_stream(&front, &long).1).collect();
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
fn a_dns_entry_stands_for_every_address_of_its_name() {
    let a = engine();
    let port = a.base.rsplit(':').next().unwrap().to_string();
    // `localhost` may resolve to ::1 too, where nothing listens: that replica stays unhealthy.
    let url = format!("\"dns+http://localhost:{port}/v1\"");
    let front = front(&pool_of("smol", &url, "/ready", ""));
    let (st, replica, _, body) = chat(&front, &ask("smol", "Hello.", 2));
    assert_eq!(st, 200, "{body}");
    assert_eq!(replica, format!("127.0.0.1:{port}"));
}

#[test]
fn a_refused_connection_is_retried_on_another_replica() {
    let a = engine();
    let dead = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    // No probes: only the failed request itself can find the dead replica out.
    let urls = format!("\"http://{dead}/v1\", \"{}/v1\"", a.base);
    let front = front(&pool_of("flaky", &urls, "", ""));
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

#[test]
fn the_upstream_key_is_sent_and_refusals_pass_through() {
    // An engine that demands a key of its own.
    let dir = scratch("keyed");
    let policy = format!(
        "[[tenants]]\nname = \"front\"\nkeys = [{{ id = \"f\", sha256 = \"{}\" }}]\n",
        key_sha256("upstream-secret")
    );
    std::fs::write(dir.join("policies.toml"), policy).unwrap();
    let policies = dir.join("policies.toml");
    let keyed = Server::start(&["--threads", "1", "--policies", policies.to_str().unwrap()])
        .remove_on_drop(&dir);
    let urls = format!("\"{}/v1\"", keyed.base);
    let config = [
        pool_of(
            "with-key",
            &urls,
            "/ready",
            "api_key_env = \"GATEWAY_TEST_UPSTREAM_KEY\"",
        ),
        pool_of("without-key", &urls, "/ready", ""),
    ]
    .concat();
    let front = {
        let dir = scratch("front-keyed");
        let policy = format!(
            "[[tenants]]\nname = \"acme\"\nkeys = [{{ id = \"k1\", sha256 = \"{}\" }}]\n",
            key_sha256(KEY)
        );
        std::fs::write(dir.join("policies.toml"), policy).unwrap();
        let cfg = format!(
            "models = []\nembeddings = []\npolicies = \"{d}/policies.toml\"\nledger = \"{d}/u.sqlite\"\n\
             collections_dir = \"{d}/c\"\n{config}",
            d = dir.display()
        );
        std::fs::write(dir.join("front.toml"), cfg).unwrap();
        let path = dir.join("front.toml");
        Server::start_with(&["--config", path.to_str().unwrap()], |cmd| {
            cmd.env("GATEWAY_TEST_UPSTREAM_KEY", "upstream-secret");
        })
        .remove_on_drop(&dir)
    };
    let (st, _, _, body) = chat(&front, &ask("with-key", "Hello.", 2));
    assert_eq!(st, 200, "{body}");
    // The engine's own 401 reaches the client as it was, not retried as a failure.
    let (st, _, _, body) = chat(&front, &ask("without-key", "Hello.", 2));
    assert_eq!(st, 401, "{body}");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    let tried = "gateway_upstream_requests_total{code=\"401\",model=\"without-key\",replica=\"0\"}";
    assert_eq!(front.metric(tried), 1.0);
    let (_, metrics) = front.get("/metrics");
    assert!(!metrics.contains("gateway_upstream_retries_total{model=\"without-key\"}"));
    // The key never shows in the front's log.
    assert!(front
        .log_lines()
        .iter()
        .all(|l| !l.contains("upstream-secret")));
}
