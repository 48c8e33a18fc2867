//! The Responses API end to end over HTTP with the real default model: the official Python and
//! Node SDKs unchanged (tests/openai_sdk_responses.py, tests/openai_sdk_responses_node.cjs),
//! stored responses that survive a `kill -9`, ids no other tenant can see, the ledger's row,
//! and a client that hangs up mid-stream.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::json;
use support::{key_sha256, model_path, wait_for, Server, MODEL};

/// A gateway config with tenants acme and globex and a ledger in `dir`.
fn config(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir).unwrap();
    let policies = format!(
        "[[tenants]]\nname = \"acme\"\nkeys = [{{ id = \"a\", sha256 = \"{}\" }}]\n\
         [[tenants]]\nname = \"globex\"\nkeys = [{{ id = \"g\", sha256 = \"{}\" }}]\n",
        key_sha256("k-acme"),
        key_sha256("k-globex")
    );
    std::fs::write(dir.join("policies.toml"), policies).unwrap();
    let cfg = format!(
        "listen = \"127.0.0.1:0\"\npolicies = \"{d}/policies.toml\"\nledger = \"{d}/usage.sqlite\"\n\
         collections_dir = \"{d}/collections\"\nembeddings = []\n\
         [[models]]\nname = \"{MODEL}\"\npath = \"{}\"\n",
        model_path(),
        d = dir.display()
    );
    let path = dir.join("gateway.toml");
    std::fs::write(&path, cfg).unwrap();
    path
}

fn node_modules() -> String {
    std::env::var("GATEWAY_NODE_MODULES").unwrap_or_else(|_| {
        let home = std::env::var("HOME").unwrap_or_else(|_| "/root".into());
        format!("{home}/.cache/gateway-test-npm/node_modules")
    })
}

#[test]
fn the_official_sdks_drive_responses_and_stored_ones_outlive_a_crash() {
    let dir = std::env::temp_dir().join(format!("gateway-responses-{}", rand::random::<u32>()));
    let cfg = config(&dir);
    let cfg = cfg.to_str().unwrap();
    let mut s = Server::start(&["--config", cfg]);
    let python = Command::new("python3");
    let out = s.client(python, "openai_sdk_responses.py", &[MODEL, "k-acme"]);
    let id = out.lines().last().unwrap().trim().to_string();
    assert!(id.starts_with("resp_"), "{out}");

    let modules = node_modules();
    assert!(
        Path::new(&modules).join("openai").exists(),
        "the OpenAI Node SDK is missing from {modules}: run host/scripts/test.sh"
    );
    let mut node = Command::new("node");
    node.env("NODE_PATH", &modules);
    let out = s.client(node, "openai_sdk_responses_node.cjs", &[MODEL, "k-acme"]);
    assert!(out.contains("node responses ok"), "{out}");

    // Another tenant's id is a 404, as a missing one is.
    let path = format!("/v1/responses/{id}");
    let (st, mine) = s.request("GET", &path, Vec::new(), Some("k-acme"));
    assert_eq!(st, 200, "{mine}");
    let (st, theirs) = s.request("GET", &path, Vec::new(), Some("k-globex"));
    let (st2, missing) = s.request("GET", "/v1/responses/resp_0", Vec::new(), Some("k-globex"));
    assert_eq!((st, st2), (404, 404));
    assert_eq!(
        theirs["error"]["message"]
            .as_str()
            .unwrap()
            .replace(&id, "ID"),
        missing["error"]["message"]
            .as_str()
            .unwrap()
            .replace("resp_0", "ID")
    );
    let (st, e) = s.request("DELETE", &path, Vec::new(), Some("k-globex"));
    assert_eq!(st, 404, "{e}");
    let (st, e) = s.post_as(
        "k-globex",
        "/v1/responses",
        &json!({"model": MODEL, "input": "x", "previous_response_id": id, "max_output_tokens": 2}),
    );
    assert_eq!(st, 404, "{e}");

    // A response acknowledged before a crash is there after the restart.
    s.kill();
    let s = Server::start(&["--config", cfg]);
    let (st, again) = s.request("GET", &path, Vec::new(), Some("k-acme"));
    assert_eq!((st, &again), (200, &mine));
    let (st, cont) = s.post_as(
        "k-acme",
        "/v1/responses",
        &json!({"model": MODEL, "input": "And again?", "previous_response_id": id,
                "max_output_tokens": 4, "temperature": 0}),
    );
    assert_eq!(st, 200, "{cont}");
    assert_eq!(cont["previous_response_id"], json!(id));

    // The ledger records Responses requests as such.
    let (_, metrics) = s.get("/metrics");
    assert!(metrics.contains("route=\"responses\""), "route label");
    drop(s);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_agent_of_the_agents_sdk_completes_a_tool_round_trip() {
    let qwen = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf"
    );
    assert!(
        Path::new(qwen).exists(),
        "{qwen} is missing: run host/scripts/fetch-real-models.sh"
    );
    let s = Server::start(&["--model", &format!("qwen={qwen}")]);
    let python = Command::new("python3");
    let out = s.client(python, "openai_agents_sdk.py", &["qwen", "anything"]);
    assert!(out.contains("agents sdk ok"), "{out}");
    // Two Responses requests: the forced call, then the answer after the tool's output.
    let (_, metrics) = s.get("/metrics");
    assert!(metrics.contains("route=\"responses\""), "{metrics}");
}

#[test]
fn a_client_hanging_up_mid_stream_cancels_and_settles() {
    let dir = std::env::temp_dir().join(format!("gateway-responses-{}", rand::random::<u32>()));
    let cfg = config(&dir);
    let s = Server::start(&["--config", cfg.to_str().unwrap()]);
    let body = json!({"model": MODEL, "input": "Write a very long story about a lighthouse.",
                      "max_output_tokens": 2000, "stream": true});
    // Answered 200 and streaming (the helper checks both), then the client is gone.
    let conn = s.raw_request_as("k-acme", "/v1/responses", &body.to_string());
    drop(conn);
    wait_for(
        "the cancelled request settled",
        Duration::from_secs(20),
        || {
            let (_, text) = s.get("/metrics");
            text.lines().any(|l| {
                l.starts_with("gateway_tenant_requests_total{")
                    && l.contains("status=\"cancelled\"")
                    && l.contains("tenant=\"acme\"")
                    && !l.ends_with(" 0")
            })
        },
    );
    s.wait_metric(
        "gateway_running_sequences{model=\"smollm2-135m-instruct\"}",
        0.0,
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn file_search_grounds_the_answer_in_the_tenants_collection() {
    use support::collections::{kb, start, temp};
    let (dir, cols) = (temp("responses-fs"), temp("responses-fs-cols"));
    let s = start(&dir, &cols);
    let (st, c) = s.post_as("k-acme", "/v1/collections", &json!({"name": "kb"}));
    assert_eq!(st, 201, "{c}");
    let (st, up) = s.post_as("k-acme", "/v1/collections/kb/documents", &kb());
    assert_eq!(st, 200, "{up}");
    let ask = |key: &str, tools: serde_json::Value, stream: bool| {
        let body = json!({"model": MODEL, "input": "How long do refunds take?", "tools": tools,
                          "temperature": 0, "max_output_tokens": 32, "stream": stream});
        s.post_as(key, "/v1/responses", &body)
    };
    let tool = json!([{"type": "file_search", "vector_store_ids": ["kb"], "max_num_results": 2,
                       "filters": {"type": "eq", "key": "team", "value": "billing"}}]);
    let (st, r) = ask("k-acme", tool.clone(), false);
    assert_eq!(st, 200, "{r}");
    assert_eq!(r["output"][0]["type"], "file_search_call", "{r}");
    assert_eq!(r["output"][0]["queries"][0], "How long do refunds take?");
    assert_eq!(r["output"][1]["type"], "message", "{r}");
    assert_eq!(r["tools"], tool, "the tools as sent");
    let (st, plain) = ask("k-acme", json!([]), false);
    assert_eq!(st, 200, "{plain}");
    let grounded = r["usage"]["input_tokens"].as_u64().unwrap();
    let bare = plain["usage"]["input_tokens"].as_u64().unwrap();
    assert!(
        grounded > bare + 20,
        "the sources are in the prompt: {grounded} vs {bare}"
    );
    // A collection the tenant may not read is refused as RAG refuses it.
    let (st, e) = ask("k-narrow", tool.clone(), false);
    assert_eq!(
        (st, e["error"]["param"].as_str()),
        (403, Some("collection")),
        "{e}"
    );
    let (st, e) = ask(
        "k-acme",
        json!([{"type": "file_search", "vector_store_ids": ["nope"]}]),
        false,
    );
    assert_eq!(st, 404, "{e}");
    // Streamed, the search's item comes first.
    let events = s.stream_as(
        "k-acme",
        "/v1/responses",
        &json!({"model": MODEL, "input": "How long do refunds take?", "tools": tool,
                "max_output_tokens": 8, "stream": true}),
    );
    let kinds: Vec<String> = events
        .iter()
        .filter_map(|e| serde_json::from_str::<serde_json::Value>(e).ok())
        .map(|e| e["type"].as_str().unwrap_or_default().to_string())
        .collect();
    let searched = kinds
        .iter()
        .position(|k| k == "response.file_search_call.completed");
    let text = kinds.iter().position(|k| k == "response.output_text.delta");
    assert!(searched.is_some() && searched < text, "{kinds:?}");
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(cols);
}
