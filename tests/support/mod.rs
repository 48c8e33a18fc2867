//! A real gateway process on a free loopback port, serving the real default model.
// Shared by several test binaries; each uses a subset.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

pub mod collections;
mod model;
pub mod plugin_gateway;
pub mod postgres;
pub mod redis;
pub mod upstream;
pub mod wasm;
pub use model::model_path;

/// The `sha256` a policy file lists for the API key `key`.
pub fn key_sha256(key: &str) -> String {
    gateway::plugins::hex(&gateway::tenancy::keys::hash(key))
}

pub const MODEL: &str = "smollm2-135m-instruct";

/// The gateway's built-in grounding instruction, before the numbered sources.
pub const GROUNDING: &str = "Answer using the sources below. Cite the sources you use by number, like [1]. If they do not contain the answer, say that you do not know.\n\nSources:";

/// Two chat responses came from the same prompt: equal prompt token counts and (greedy)
/// equal messages.
pub fn assert_same_prompt(a: &Value, b: &Value) {
    assert_eq!(a["usage"]["prompt_tokens"], b["usage"]["prompt_tokens"]);
    assert_eq!(a["choices"][0]["message"], b["choices"][0]["message"]);
}

/// The document indexes of a `/v1/rerank` response, best first.
pub fn rerank_order(body: &Value) -> Vec<u64> {
    body["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["index"].as_u64().unwrap())
        .collect()
}

/// An HTTP client that waits as long as the test server's own (300 s): generations share two
/// cores with the other tests of a binary, and reqwest's default 30 s has run out in CI.
pub fn patient_client() -> reqwest::blocking::Client {
    reqwest::blocking::Client::builder()
        .timeout(Duration::from_secs(300))
        .build()
        .unwrap()
}

pub struct Server {
    child: Child,
    pub base: String,
    http: reqwest::blocking::Client,
    /// The server's later log lines.
    log: std::sync::Mutex<std::sync::mpsc::Receiver<String>>,
    /// Folders removed when the server is dropped (after the process has exited).
    scratch: Vec<std::path::PathBuf>,
}

impl Server {
    pub fn start(extra: &[&str]) -> Self {
        Self::start_with(extra, |_| {})
    }

    /// Like `start`, with `prepare` adjusting the command (environment, limits) first.
    pub fn start_with(extra: &[&str], prepare: impl FnOnce(&mut Command)) -> Self {
        let model = model_path();
        assert!(
            std::path::Path::new(&model).exists(),
            "{model} is missing: run host/scripts/fetch-models.sh"
        );
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_gateway"));
        cmd.arg("serve");
        if !extra.contains(&"--listen") {
            cmd.args(["--listen", "127.0.0.1:0"]);
        }
        // Tests of the engine, plugins and limits repeat greedy requests on purpose: they
        // must run the model each time. The response cache's own tests turn it on.
        if !extra.contains(&"--response-cache") {
            cmd.args(["--response-cache", "false"]);
        }
        // A config file names its own models and ledger; otherwise serve the default model
        // with a ledger and collections of this server's own, removed when it is dropped.
        let mut scratch = Vec::new();
        if !extra.contains(&"--config") {
            let dir = std::env::temp_dir().join(format!(
                "gateway-test-{}-{}",
                std::process::id(),
                rand::random::<u64>()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            cmd.args(["--model", &format!("{MODEL}={model}")]);
            cmd.args(["--ledger", dir.join("usage.sqlite").to_str().unwrap()]);
            if !extra.contains(&"--collections-dir") {
                cmd.args([
                    "--collections-dir",
                    dir.join("collections").to_str().unwrap(),
                ]);
            }
            scratch.push(dir);
        }
        prepare(&mut cmd);
        let mut child = cmd
            .args(extra)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("gateway binary starts");
        let mut lines = BufReader::new(child.stderr.take().unwrap()).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("gateway exited before listening")
                .unwrap();
            if let Some(i) = line.find("serving the OpenAI API addr=") {
                break line[i + "serving the OpenAI API addr=".len()..]
                    .trim()
                    .to_string();
            }
        };
        // Keep draining stderr so the server never blocks on a full pipe.
        let (tx, log) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in lines.map_while(Result::ok) {
                let _ = tx.send(line);
            }
        });
        let http = patient_client();
        Self {
            child,
            base: format!("http://{addr}"),
            http,
            log: std::sync::Mutex::new(log),
            scratch,
        }
    }

    /// Removes `dir` when this server is dropped: for tests whose folder outlives no server.
    pub fn remove_on_drop(mut self, dir: &std::path::Path) -> Self {
        self.scratch.push(dir.to_path_buf());
        self
    }

    /// The address in the first later log line containing `marker` (e.g. "serving the admin
    /// API addr="), waiting up to 20 s for it.
    pub fn logged_addr(&self, marker: &str) -> String {
        let log = self.log.lock().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            let line = log
                .recv_timeout(left)
                .unwrap_or_else(|_| panic!("no log line with {marker:?}"));
            if let Some(i) = line.find(marker) {
                return line[i + marker.len()..].trim().to_string();
            }
        }
    }

    /// Sends SIGTERM and waits for the process to exit; returns its exit code.
    /// SIGKILL: no drain, no flush, as a crash or an OOM kill would end it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn terminate(&mut self) -> Option<i32> {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        self.child.wait().ok()?.code()
    }

    /// Runs `tests/<script>` (an OpenAI Python SDK client) against this server's `/v1` with
    /// `model`; panics with its output unless it exits 0; returns its stdout.
    pub fn sdk_script(&self, script: &str, model: &str) -> String {
        self.client(Command::new("python3"), script, &[model])
    }

    /// Runs `program tests/<script> <base>/v1 <args>...` (an SDK client); panics with its
    /// output unless it exits 0; returns its stdout.
    pub fn client(&self, mut program: Command, script: &str, args: &[&str]) -> String {
        let script = format!("{}/../tests/{script}", env!("CARGO_MANIFEST_DIR"));
        let out = program
            .arg(&script)
            .arg(format!("{}/v1", self.base))
            .args(args)
            .output()
            .expect("the client program runs");
        assert!(
            out.status.success(),
            "SDK client {script} failed (host/scripts/test.sh installs the SDKs):\n{}\n{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The log lines the server has written since the last call (or since it started).
    pub fn log_lines(&self) -> Vec<String> {
        self.log.lock().unwrap().try_iter().collect()
    }

    pub fn addr(&self) -> &str {
        &self.base["http://".len()..]
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        self.post_raw(path, body.to_string())
    }

    pub fn post_raw(&self, path: &str, body: String) -> (u16, Value) {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json().unwrap_or(Value::Null))
    }

    /// Any method, raw body, optional bearer token; the response body as JSON (or Null).
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Vec<u8>,
        token: Option<&str>,
    ) -> (u16, Value) {
        let mut r = self
            .http
            .request(method.parse().unwrap(), format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body);
        if let Some(t) = token {
            r = r.bearer_auth(t);
        }
        let r = r.send().unwrap();
        let status = r.status().as_u16();
        (status, r.json().unwrap_or(Value::Null))
    }

    /// A JSON POST as the tenant that owns `key`.
    pub fn post_as(&self, key: &str, path: &str, body: &Value) -> (u16, Value) {
        self.request("POST", path, body.to_string().into_bytes(), Some(key))
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        let r = self
            .http
            .get(format!("{}{path}", self.base))
            .send()
            .unwrap();
        (r.status().as_u16(), r.text().unwrap())
    }

    /// The `data:` payloads of an SSE response, up to and including `[DONE]`.
    pub fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .json(body)
            .send()
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        assert_eq!(r.headers()["content-type"], "text/event-stream");
        BufReader::new(r)
            .lines()
            .map(Result::unwrap)
            .filter_map(|l| l.strip_prefix("data: ").map(String::from))
            .collect()
    }

    /// Like `stream`, as the tenant that owns `key`.
    pub fn stream_as(&self, key: &str, path: &str, body: &Value) -> Vec<String> {
        let r = self
            .http
            .post(format!("{}{path}", self.base))
            .bearer_auth(key)
            .json(body)
            .send()
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        BufReader::new(r)
            .lines()
            .map(Result::unwrap)
            .filter_map(|l| l.strip_prefix("data: ").map(String::from))
            .collect()
    }

    /// One metric's value from `/metrics`, by full series name (with labels).
    pub fn metric(&self, series: &str) -> f64 {
        let (_, text) = self.get("/metrics");
        text.lines()
            .find_map(|l| {
                l.strip_prefix(series)
                    .and_then(|v| v.strip_prefix(' '))
                    .map(|v| v.trim().parse().unwrap())
            })
            .unwrap_or_else(|| panic!("metric {series} missing"))
    }

    /// Waits (up to 20 s) for a gauge to reach `want`: gauges are published once per engine
    /// step, so they trail the responses a client has already received.
    pub fn wait_metric(&self, series: &str, want: f64) {
        self.wait_until(series, |v| v == want, &format!("= {want}"));
    }

    /// Like `wait_metric`, for any condition on the value.
    pub fn wait_until(&self, series: &str, ok: impl Fn(f64) -> bool, what: &str) {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        loop {
            let got = self.metric(series);
            if ok(got) {
                return;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{series} is {got}, expected {what}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Sends a raw HTTP/1.1 streaming request on a fresh socket, reads until the first SSE
    /// event has arrived (so the request is running), and returns the socket to hang up on.
    pub fn raw_request(&self, path: &str, body: &str) -> std::net::TcpStream {
        self.raw_request_with(path, body, "")
    }

    /// `raw_request` as the tenant that owns `key`.
    pub fn raw_request_as(&self, key: &str, path: &str, body: &str) -> std::net::TcpStream {
        self.raw_request_with(path, body, &format!("Authorization: Bearer {key}\r\n"))
    }

    fn raw_request_with(&self, path: &str, body: &str, headers: &str) -> std::net::TcpStream {
        let mut s = std::net::TcpStream::connect(self.addr()).unwrap();
        write!(s, "POST {path} HTTP/1.1\r\nHost: x\r\n{headers}Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        while !seen.windows(6).any(|w| w == b"data: ") {
            let n = s.read(&mut buf).unwrap();
            assert!(
                n > 0,
                "connection closed early: {}",
                String::from_utf8_lossy(&seen)
            );
            seen.extend_from_slice(&buf[..n]);
        }
        assert!(
            seen.starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&seen)
        );
        s
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        for dir in &self.scratch {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Polls `ok` every 20 ms until it holds, failing the test after `limit`; returns how long it
/// took.
pub fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !ok() {
        assert!(start.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    start.elapsed()
}
