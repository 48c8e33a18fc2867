//! Upstreams we did not write and the ways replicas are named and reached: llama.cpp's
//! `llama-server`, a DNS name standing for its addresses, a bearer key of the front's own.

mod support;

use std::net::TcpListener;
use std::time::Duration;

use serde_json::json;
use support::upstream::*;
use support::{key_sha256, model_path, wait_for, Server};

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
    let (mut llama, port) = LlamaServer::start(bin.as_ref());
    let url = format!("\"http://127.0.0.1:{port}/v1\"");
    let front = front(&pool_of("llama", &url, "/health", ""));
    wait_for(
        "the front's probe of llama-server",
        Duration::from_secs(60),
        || {
            llama.assert_running();
            front.metric("gateway_upstream_up{model=\"llama\",replica=\"0\"}") == 1.0
        },
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
    let front = front_prepared("models = []\n", &config, |cmd| {
        cmd.env("GATEWAY_TEST_UPSTREAM_KEY", "upstream-secret");
    });
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

#[test]
fn embeddings_route_upstream_too() {
    let engine = Server::start(&[
        "--threads",
        "1",
        "--embedding-model",
        &support::collections::embed_arg(),
    ]);
    let config = format!(
        "[[upstreams]]\nname = \"embed\"\nmodel = \"{}\"\nreplicas = [\"{}/v1\"]\nhealth_path = \"/ready\"\n",
        support::collections::EMBED,
        engine.base
    );
    let front = front(&config);
    let input = json!(["Refunds take five days.", "Invoices are due in 30 days."]);
    let (st, routed) = front.post_as(
        KEY,
        "/v1/embeddings",
        &json!({"model": "embed", "input": input}),
    );
    assert_eq!(st, 200, "{routed}");
    assert_eq!(routed["model"], "embed");
    let body = json!({"model": support::collections::EMBED, "input": input});
    let (_, direct) = engine.post("/v1/embeddings", &body);
    assert_eq!(routed["data"], direct["data"]);
    let prompt = routed["usage"]["prompt_tokens"].as_f64().unwrap();
    assert!(prompt > 0.0);
    let charged = front.metric("gateway_tenant_tokens_total{kind=\"prompt\",tenant=\"acme\"}");
    assert_eq!(charged, prompt);
}

/// A `llama-server` child, killed when dropped, with its log in a file a failure can show.
struct LlamaServer {
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl LlamaServer {
    /// Starts `bin` on the default model and waits until its own `/health` answers 200. The
    /// port is picked by binding port 0 and released for the child, so another process can
    /// take it in between: a child that exits is started again on a fresh port.
    fn start(bin: &std::ffi::OsStr) -> (Self, u16) {
        for _ in 0..3 {
            let port = TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port();
            let log = scratch("llama").join("llama-server.log");
            let out = std::fs::File::create(&log).unwrap();
            let child = std::process::Command::new(bin)
                .args(["-m", &model_path(), "--host", "127.0.0.1"])
                .args(["--port", &port.to_string()])
                .args(["-t", "1", "-c", "2048", "--metrics"])
                // Weight repacking puts the weights in ggml's AMX buffers on CPUs that have
                // AMX, and that path segfaults on the first batch in this VM; this test is
                // about the protocol, not llama.cpp's speed.
                .arg("--no-repack")
                .stdout(out.try_clone().unwrap())
                .stderr(out)
                .spawn()
                .expect("llama-server starts");
            let mut server = Self { child, log };
            // Loading and the warm-up run share two cores with the other tests: allow minutes.
            let health = format!("http://127.0.0.1:{port}/health");
            let http = reqwest::blocking::Client::builder()
                .timeout(Duration::from_secs(5))
                .build()
                .unwrap();
            let deadline = std::time::Instant::now() + Duration::from_secs(180);
            while std::time::Instant::now() < deadline {
                if server.child.try_wait().unwrap().is_some() {
                    break;
                }
                let ok = http.get(&health).send().map(|r| r.status().as_u16());
                if ok.is_ok_and(|s| s == 200) {
                    return (server, port);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            eprintln!(
                "llama-server on port {port} did not come up:\n{}",
                server.tail()
            );
        }
        panic!("llama-server did not become healthy in three starts");
    }

    /// Fails with the child's log if it has exited.
    fn assert_running(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("llama-server exited ({status}):\n{}", self.tail());
        }
    }

    fn tail(&self) -> String {
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = self.log.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}
