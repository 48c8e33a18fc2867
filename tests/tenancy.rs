//! Tenants end to end: a real gateway with a policy file, driven over HTTP. Authentication,
//! allow-lists, each limit's error, hot reload of keys under load, budget exactness against
//! the ledger, and a SIGTERM drain.

mod support;

use std::io::{BufReader, Read};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::{key_sha256, model_path, Server, MODEL};

const ADMIN: &str = "admin-token-for-tests-0123";

fn tenant(name: &str, keys: &[&str], extra: &str) -> String {
    let keys: Vec<String> = keys
        .iter()
        .map(|k| format!("{{ id = \"{k}\", sha256 = \"{}\" }}", key_sha256(k)))
        .collect();
    format!(
        "[[tenants]]\nname = \"{name}\"\nkeys = [{}]\n{extra}\n",
        keys.join(", ")
    )
}

/// A gateway with `policies` as its policy file; returns it and its folder.
fn start(policies: &str) -> (Server, PathBuf) {
    start_with(policies, "")
}

/// `start`, with `model_extra` appended to the model's config table.
fn start_with(policies: &str, model_extra: &str) -> (Server, PathBuf) {
    // Long enough that a drain never reaches its deadline on a loaded machine.
    start_draining(policies, 600, model_extra)
}

fn start_draining(policies: &str, drain_seconds: u64, model_extra: &str) -> (Server, PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "gateway-e2e-tenancy-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("policies.toml"), policies).unwrap();
    let config = format!(
        "admin_token = \"{ADMIN}\"\npolicies = \"{d}/policies.toml\"\nledger = \"{d}/usage.sqlite\"\ndrain_seconds = {drain_seconds}\n[[models]]\nname = \"{MODEL}\"\npath = \"{m}\"\n",
        d = dir.display(),
        m = model_path(),
    ) + model_extra;
    std::fs::write(dir.join("gateway.toml"), config).unwrap();
    (
        Server::start(&["--config", dir.join("gateway.toml").to_str().unwrap()]),
        dir,
    )
}

fn chat(max_tokens: usize) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": "Tell me about the sea."}], "temperature": 0, "max_tokens": max_tokens})
}

#[test]
fn keys_and_allow_lists() {
    let (s, dir) = start(
        &(tenant("acme", &["k-acme"], "")
            + &tenant(
                "narrow",
                &["k-narrow"],
                "models = [\"some-other-model\"]\nplugins = [\"only-this\"]",
            )),
    );
    let (st, body) = s.post("/v1/chat/completions", &chat(2));
    assert_eq!(
        (st, body["error"]["code"].as_str()),
        (401, Some("invalid_api_key")),
        "{body}"
    );
    assert_eq!(s.post_as("wrong", "/v1/chat/completions", &chat(2)).0, 401);
    assert_eq!(s.post_as("k-acme", "/v1/chat/completions", &chat(2)).0, 200);
    // A model or plugin outside the tenant's allow-list is 403, naming it.
    let (st, body) = s.post_as("k-narrow", "/v1/chat/completions", &chat(2));
    assert_eq!(
        (st, body["error"]["param"].as_str()),
        (403, Some("model")),
        "{body}"
    );
    let (st, body) = s.post_as(
        "k-narrow",
        "/v1/rerank",
        &json!({"model": "other", "query": "q", "documents": ["a"]}),
    );
    assert_eq!(st, 403, "{body}");
    let (st, list) = s.request("GET", "/v1/models", vec![], Some("k-narrow"));
    assert_eq!(
        (st, list["data"].as_array().map(Vec::len)),
        (200, Some(0)),
        "{list}"
    );
    let (_, list) = s.request("GET", "/v1/models", vec![], Some("k-acme"));
    assert_eq!(list["data"][0]["id"], MODEL);
    assert_eq!(s.request("GET", "/v1/models", vec![], None).0, 401);
    // A request refused before its body was read must not leave a half-read connection in the
    // client's pool: the gateway drains the body, and the same client goes on working.
    let client = reqwest::blocking::Client::new();
    let url = format!("http://{}/v1/chat/completions", s.addr());
    for _ in 0..20 {
        let r = client
            .post(&url)
            .bearer_auth("wrong")
            .body(vec![b' '; 1 << 20])
            .send()
            .unwrap();
        assert_eq!(r.status().as_u16(), 401);
        assert!(r.headers().get("connection").is_none());
        let r = client.get(format!("http://{}/health", s.addr())).send();
        assert_eq!(r.unwrap().status().as_u16(), 200);
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// Status, error code and Retry-After of a chat request as `key`.
fn limited(s: &Server, key: &str, body: &Value) -> (u16, Option<String>, Option<u64>) {
    let r = support::patient_client()
        .post(format!("{}/v1/chat/completions", s.base))
        .bearer_auth(key)
        .json(body)
        .send()
        .unwrap();
    let status = r.status().as_u16();
    let retry = r
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    let body: Value = r.json().unwrap();
    (
        status,
        body["error"]["code"].as_str().map(String::from),
        retry,
    )
}

#[test]
fn each_limit_answers_429_with_its_name_and_retry_after() {
    let policies = tenant("rps", &["k-rps"], "requests_per_second = 2")
        + &tenant("rpm", &["k-rpm"], "requests_per_minute = 2")
        + &tenant("conc", &["k-conc"], "max_concurrent = 1")
        + &tenant("tpm", &["k-tpm"], "tokens_per_minute = 100")
        + &tenant(
            "budget",
            &["k-budget"],
            "token_budget = { tokens = 200, period = \"day\" }",
        );
    let (s, dir) = start(&policies);
    // Per minute: the third request in a minute is refused, however slow the machine is.
    let statuses: Vec<_> = (0..3).map(|_| limited(&s, "k-rpm", &chat(1))).collect();
    assert_eq!(statuses[2].0, 429, "{statuses:?}");
    assert_eq!(statuses[2].1.as_deref(), Some("requests_per_minute"));
    assert!((1..=60).contains(&statuses[2].2.unwrap()), "{statuses:?}");
    // Per second: a quick burst of cheap requests runs into it.
    let burst: Vec<u16> = (0..20)
        .map(|_| s.request("GET", "/v1/models", vec![], Some("k-rps")).0)
        .collect();
    assert!(burst.contains(&429) && burst[0] == 200, "{burst:?}");

    // One stream in flight holds the only slot.
    let stream = s.raw_request_as("k-conc", "/v1/chat/completions", &json!({"model": MODEL, "messages": [{"role": "user", "content": "Count to fifty."}], "max_tokens": 200, "stream": true, "ignore_eos": true}).to_string());
    let (st, code, retry) = limited(&s, "k-conc", &chat(1));
    assert_eq!(
        (st, code.as_deref(), retry),
        (429, Some("max_concurrent"), Some(1))
    );
    drop(stream);

    // Prompt (~30 tokens) + 80 fits 100 tokens a minute once, not twice; asking for more than
    // the whole minute's worth can never succeed, so it says so without a Retry-After.
    assert_eq!(limited(&s, "k-tpm", &chat(60)).0, 200);
    let (st, code, retry) = limited(&s, "k-tpm", &chat(60));
    assert_eq!((st, code.as_deref()), (429, Some("tokens_per_minute")));
    assert!(retry.unwrap() >= 1);
    let (st, code, retry) = limited(&s, "k-tpm", &chat(500));
    assert_eq!(
        (st, code.as_deref(), retry),
        (429, Some("tokens_per_minute"), None)
    );

    // The budget is reserved up front (prompt + max_tokens) and settled to the real use.
    let (st, first) = s.post_as("k-budget", "/v1/chat/completions", &chat(60));
    assert_eq!(st, 200, "{first}");
    let used = first["usage"]["total_tokens"].as_u64().unwrap();
    let prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    let room = 200 - used;
    let (st, code, retry) = limited(&s, "k-budget", &chat((room - prompt + 1) as usize));
    assert_eq!((st, code.as_deref()), (429, Some("token_budget")));
    assert!(retry.unwrap() <= 86_400);
    assert_eq!(
        limited(&s, "k-budget", &chat((room - prompt) as usize)).0,
        200
    );
    let (_, text) = s.get("/metrics");
    assert!(
        text.contains(
            "gateway_tenant_rejections_total{reason=\"token_budget\",tenant=\"budget\"} 1"
        ),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn keys_rotate_by_editing_the_file_under_load() {
    let stay = tenant("acme", &["k-stay", "k-old"], "");
    let (s, dir) = start(&stay);
    let s = Arc::new(s);
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicUsize::new(0));
    let load: Vec<_> = (0..2)
        .map(|_| {
            let (s, stop, ok) = (s.clone(), stop.clone(), ok.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let (st, body) = s.request("GET", "/v1/models", vec![], Some("k-stay"));
                    assert_eq!(st, 200, "a valid key failed during the reload: {body}");
                    ok.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    assert_eq!(s.request("GET", "/v1/models", vec![], Some("k-new")).0, 401);
    let started = Instant::now();
    // Written in place, like an editor without atomic saves.
    std::fs::write(
        dir.join("policies.toml"),
        tenant("acme", &["k-stay", "k-new"], ""),
    )
    .unwrap();
    while s.request("GET", "/v1/models", vec![], Some("k-new")).0 != 200 {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the new key never worked"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    println!(
        "new key accepted {:?} after the file was written",
        started.elapsed()
    );
    assert_eq!(s.request("GET", "/v1/models", vec![], Some("k-old")).0, 401);

    // A broken file is ignored; the admin API says why and keeps the policy.
    std::fs::write(dir.join("policies.toml"), "[[tenants]]\nname = 7\n").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(s.request("GET", "/v1/models", vec![], Some("k-new")).0, 200);
    let bad = "[[tenants]]\nname = \"acme\"\nmax_concurrent = 0\n"
        .as_bytes()
        .to_vec();
    let (st, body) = s.request("PUT", "/admin/policies", bad, Some(ADMIN));
    assert_eq!(st, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_concurrent"),
        "{body}"
    );
    let (st, _) = s.request(
        "PUT",
        "/admin/policies",
        tenant("acme", &["k-stay", "k-admin"], "").into_bytes(),
        Some(ADMIN),
    );
    assert_eq!(st, 200);
    assert_eq!(
        s.request("GET", "/v1/models", vec![], Some("k-admin")).0,
        200
    );
    assert_eq!(s.request("GET", "/v1/models", vec![], Some("k-new")).0, 401);
    assert_eq!(
        s.request("PUT", "/admin/policies", vec![], Some("not-the-admin"))
            .0,
        401
    );
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.join().unwrap();
    }
    println!(
        "{} requests with the kept key during reloads, none failed",
        ok.load(Ordering::Relaxed)
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn ledger_totals_equal_what_clients_were_told() {
    let (s, dir) = start(&tenant(
        "acme",
        &["k-acme"],
        "token_budget = { tokens = 1000000, period = \"month\" }",
    ));
    let s = Arc::new(s);
    // Six streams at once; every other one hangs up after its first few tokens.
    let runs: Vec<_> = (0..6)
        .map(|i| {
            let s = s.clone();
            std::thread::spawn(move || {
                let body = json!({"model": MODEL, "messages": [{"role": "user", "content": format!("Write a story number {i}.")}],
                    "max_tokens": 40, "stream": true, "stream_options": {"include_usage": true}, "temperature": 0.8, "seed": i});
                if i % 2 == 1 {
                    let mut sock = s.raw_request_as("k-acme", "/v1/chat/completions", &body.to_string());
                    let mut buf = [0u8; 256];
                    let _ = sock.read(&mut buf);
                    return None;
                }
                let events = s.stream_as("k-acme", "/v1/chat/completions", &body);
                let usage: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
                Some(usage["usage"]["total_tokens"].as_u64().unwrap())
            })
        })
        .collect();
    let reported: u64 = runs.into_iter().filter_map(|h| h.join().unwrap()).sum();
    // Cancelled streams settle when the server notices the hang-up.
    let deadline = Instant::now() + Duration::from_secs(20);
    let rows = loop {
        let (st, usage) = s.request(
            "GET",
            "/admin/usage?tenant=acme&group_by=model",
            vec![],
            Some(ADMIN),
        );
        assert_eq!(st, 200, "{usage}");
        if usage["data"][0]["requests"] == 6 || Instant::now() > deadline {
            break usage;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(rows["data"][0]["requests"], 6, "{rows}");
    let conn = rusqlite::Connection::open(dir.join("usage.sqlite")).unwrap();
    let ok: i64 = conn
        .query_row(
            "SELECT SUM(prompt_tokens + completion_tokens) FROM requests WHERE status = 'ok'",
            [],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(ok as u64, reported, "ledger vs usage reported to clients");
    let cancelled: Vec<(i64, i64)> = conn
        .prepare("SELECT prompt_tokens, completion_tokens FROM requests WHERE status = 'cancelled'")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(cancelled.len(), 3);
    assert!(
        cancelled.iter().all(|(p, c)| *p > 0 && *c < 40),
        "{cancelled:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn sigterm_drains_streams_then_exits_cleanly() {
    let (mut s, dir) = start(&tenant("acme", &["k-acme"], ""));
    let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "Count to a hundred."}], "max_tokens": 64, "ignore_eos": true, "stream": true});
    let mut sock = s.raw_request_as("k-acme", "/v1/chat/completions", &body.to_string());
    let code = {
        let addr = s.addr().to_string();
        let waiter = std::thread::spawn(move || {
            sock.set_read_timeout(Some(Duration::from_secs(600)))
                .unwrap();
            let mut all = String::new();
            let _ = BufReader::new(&mut sock).read_to_string(&mut all);
            all
        });
        std::thread::sleep(Duration::from_millis(100));
        let code = s.terminate();
        let streamed = waiter.join().unwrap();
        assert!(
            streamed.contains("data: [DONE]"),
            "the stream was cut: {streamed}"
        );
        assert!(
            std::net::TcpStream::connect(addr).is_err(),
            "still accepting after exit"
        );
        code
    };
    assert_eq!(code, Some(0));
    // The drained request was flushed to the ledger before exit.
    let conn = rusqlite::Connection::open(dir.join("usage.sqlite")).unwrap();
    let n: i64 = conn
        .query_row("SELECT completion_tokens FROM requests", [], |r| r.get(0))
        .unwrap();
    assert_eq!(n, 64);
    let _ = std::fs::remove_dir_all(dir);
}

/// A request over its own connection, read to the end: the status and the JSON body.
fn request_to_close(addr: &str, key: &str, body: &Value) -> (u16, Value) {
    use std::io::Write;
    let mut sock = std::net::TcpStream::connect(addr).unwrap();
    let body = body.to_string();
    write!(sock, "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {key}\r\nContent-Type: application/json\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(600)))
        .unwrap();
    let mut all = String::new();
    sock.read_to_string(&mut all).unwrap();
    let status = all[9..12].parse().unwrap();
    let (_, json) = all.split_once("\r\n\r\n").unwrap();
    (status, serde_json::from_str(json).unwrap_or(Value::Null))
}

#[test]
fn the_drain_deadline_cuts_generations_with_an_error_and_charges_them() {
    let (mut s, dir) = start_draining(&tenant("acme", &["k-acme"], ""), 1, "");
    let long = |stream| json!({"model": MODEL, "messages": [{"role": "user", "content": "Count to a thousand."}], "max_tokens": 1500, "ignore_eos": true, "stream": stream});
    let whole = {
        let (addr, body) = (s.addr().to_string(), long(false));
        std::thread::spawn(move || request_to_close(&addr, "k-acme", &body))
    };
    std::thread::sleep(Duration::from_millis(300));
    let sock = s.raw_request_as("k-acme", "/v1/chat/completions", &long(true).to_string());
    sock.set_read_timeout(Some(Duration::from_secs(600)))
        .unwrap();
    // Cut only once tokens are flowing, so there is something to charge.
    let mut reader = BufReader::new(sock);
    let mut streamed = String::new();
    while streamed.matches("\"content\":\"").count() < 4 {
        assert!(std::io::BufRead::read_line(&mut reader, &mut streamed).unwrap() > 0);
    }
    let rest = std::thread::spawn(move || {
        let mut rest = String::new();
        let _ = reader.read_to_string(&mut rest);
        rest
    });
    let code = s.terminate();
    streamed += &rest.join().unwrap();
    let (status, body) = whole.join().unwrap();
    assert_eq!(code, Some(0));

    // The stream ends with the error and [DONE], not in the middle of nowhere.
    let events: Vec<Value> = streamed
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let last = events.last().unwrap();
    assert_eq!(last["error"]["code"], "server_shutting_down", "{streamed}");
    let mut data = streamed.lines().filter(|l| l.starts_with("data: "));
    assert_eq!(data.next_back(), Some("data: [DONE]"), "{streamed}");
    let deltas = events
        .iter()
        .filter(|e| e["choices"][0]["delta"]["content"].is_string())
        .count();
    assert_eq!(status, 503, "{body}");
    assert_eq!(body["error"]["code"], "server_shutting_down", "{body}");

    // Both are in the ledger as cut at shutdown (not as cancelled by their client), charged
    // what they generated before the cut.
    let conn = rusqlite::Connection::open(dir.join("usage.sqlite")).unwrap();
    let rows: Vec<(String, i64, i64)> = conn
        .prepare("SELECT status, prompt_tokens, completion_tokens FROM requests")
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert!(
        rows.iter()
            .all(|(st, p, c)| st == "shutdown" && *p > 0 && *c < 1500),
        "{rows:?}"
    );
    assert!(
        rows.iter()
            .any(|(_, _, c)| *c as usize >= deltas && deltas >= 3),
        "{deltas} deltas streamed: {rows:?}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn weights_share_a_saturated_engine() {
    let policies = tenant("heavy", &["k-heavy"], "weight = 3")
        + &tenant("light", &["k-light"], "")
        + &tenant("warm", &["k-warm"], "");
    // One sequence at a time: the admission order is the completion order.
    let (s, dir) = start_with(&policies, "[models.engine]\nmax_num_seqs = 1\n");
    let s = Arc::new(s);
    // A long request holds the engine while both tenants queue their bursts behind it.
    let body = |n: usize| json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": n, "ignore_eos": true});
    let warm = {
        let s = s.clone();
        std::thread::spawn(move || s.post_as("k-warm", "/v1/chat/completions", &body(256)).0)
    };
    std::thread::sleep(Duration::from_millis(200));
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let clients: Vec<_> = [("k-heavy", 30), ("k-light", 12)]
        .into_iter()
        .flat_map(|(key, n)| std::iter::repeat_n(key, n))
        .map(|key| {
            let (s, order) = (s.clone(), order.clone());
            std::thread::spawn(move || {
                let (st, b) = s.post_as(key, "/v1/chat/completions", &body(4));
                assert_eq!(st, 200, "{b}");
                order.lock().unwrap().push(key);
            })
        })
        .collect();
    for c in clients {
        c.join().unwrap();
    }
    assert_eq!(warm.join().unwrap(), 200);
    // While both have requests waiting (heavy runs out after ~40 admissions), 3:1.
    let order = order.lock().unwrap();
    let heavy = order[..24].iter().filter(|k| **k == "k-heavy").count() as f64;
    let ratio = heavy / (24.0 - heavy);
    println!(
        "first 24 completions: {heavy} heavy, {} light (ratio {ratio:.2})",
        24.0 - heavy
    );
    assert!((2.4..=3.6).contains(&ratio), "ratio {ratio:.2}: {order:?}");
    let _ = std::fs::remove_dir_all(dir);
}
