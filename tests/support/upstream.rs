//! Fronts and engines for the upstream tests: real gateways over loopback, the front with
//! no model of its own routing to engine-role gateways.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;

use serde_json::{json, Value};

use super::{key_sha256, patient_client, Server, MODEL};

pub const KEY: &str = "acme-key-1";

pub fn engine() -> Server {
    Server::start(&["--threads", "1"])
}

/// An engine on a given address (a replica restarted where it was).
pub fn engine_at(addr: &str) -> Server {
    Server::start(&["--threads", "1", "--listen", addr])
}

pub fn scratch(what: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "gateway-upstream-{what}-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A front gateway with no model of its own, `upstreams` (TOML) as its models, tenant `acme`.
pub fn front(upstreams: &str) -> Server {
    front_with("models = []\n", upstreams)
}

/// A front gateway: `head` (top-level keys) and `tables` (models and upstreams) as its config.
pub fn front_with(head: &str, tables: &str) -> Server {
    front_prepared(head, tables, |_| {})
}

/// `front_with`, with `prepare` adjusting the command (its environment) first.
pub fn front_prepared(
    head: &str,
    tables: &str,
    prepare: impl FnOnce(&mut std::process::Command),
) -> Server {
    let dir = scratch("front");
    let policy = format!(
        "[[tenants]]\nname = \"acme\"\nplugin_debug = true\nkeys = [{{ id = \"k1\", sha256 = \"{}\" }}]\n",
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
    Server::start_with(&["--config", path.to_str().unwrap()], prepare).remove_on_drop(&dir)
}

/// A pool of gateway replicas, probed on `/ready` so that a draining one takes no requests.
pub fn pool(name: &str, replicas: &[&Server], extra: &str) -> String {
    let urls: Vec<String> = replicas
        .iter()
        .map(|s| format!("\"{}/v1\"", s.base))
        .collect();
    pool_of(name, &urls.join(", "), "/ready", extra)
}

pub fn pool_of(name: &str, urls: &str, health: &str, extra: &str) -> String {
    pool_ejecting(name, urls, health, 1000, extra)
}

/// Like `pool_of`, with a replica's first cool-down after a failure of `eject_ms`.
pub fn pool_ejecting(name: &str, urls: &str, health: &str, eject_ms: u64, extra: &str) -> String {
    format!(
        "[[upstreams]]\nname = \"{name}\"\nmodel = \"{MODEL}\"\nreplicas = [{urls}]\n\
         health_path = \"{health}\"\nprobe_ms = 200\neject_ms = {eject_ms}\n{extra}\n"
    )
}

/// POSTs a chat request as tenant acme; status, `x-gateway-replica`, `x-gateway-model`, body.
pub fn chat(front: &Server, body: &Value) -> (u16, String, String, Value) {
    let r = post_chat(front, body);
    let header = |h: &str| {
        r.headers()
            .get(h)
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default()
    };
    let (replica, model) = (header("x-gateway-replica"), header("x-gateway-model"));
    (r.status().as_u16(), replica, model, r.json().unwrap())
}

pub fn ask(model: &str, text: &str, max_tokens: u32) -> Value {
    json!({"model": model, "messages": [{"role": "user", "content": text}],
           "max_tokens": max_tokens, "temperature": 0})
}

/// Starts a streamed chat as acme; the replica that took it and the response to read.
pub fn open_stream(front: &Server, body: &Value) -> (String, reqwest::blocking::Response) {
    let r = post_chat(front, body);
    assert_eq!(r.status().as_u16(), 200);
    let replica = r
        .headers()
        .get("x-gateway-replica")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    (replica, r)
}

/// The JSON events of an SSE stream, and whether it ended with `[DONE]`.
pub fn events(r: reqwest::blocking::Response) -> (Vec<Value>, bool) {
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

/// POSTs a chat request to the front as tenant acme.
fn post_chat(front: &Server, body: &Value) -> reqwest::blocking::Response {
    patient_client()
        .post(format!("{}/v1/chat/completions", front.base))
        .bearer_auth(KEY)
        .json(body)
        .send()
        .unwrap()
}
