//! A gateway assembled in the test's own process from a `Config` (`app::Gateway::build`), as
//! an embedding application or a test can start one, serving real HTTP on loopback: the
//! default model answers a chat and the same question as a Responses request, stored in the
//! ledger's file.

mod support;

use gateway::app::Gateway;
use gateway::config::{Config, ModelConfig};
use serde_json::{json, Value};
use support::{model_path, MODEL};

#[test]
fn a_gateway_built_from_a_config_serves_in_process() {
    let dir = std::env::temp_dir().join(format!("gateway-in-process-{}", rand::random::<u32>()));
    let cfg = Config {
        listen: "127.0.0.1:0".parse().unwrap(),
        models: vec![ModelConfig::from_arg(&format!("{MODEL}={}", model_path()))],
        embeddings: Vec::new(),
        ledger: Some(dir.join("usage.sqlite")),
        collections_dir: dir.join("collections"),
        ..Config::default()
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let gateway = rt.block_on(Gateway::build(&cfg)).unwrap();
    let (_, addr) = gateway.addresses().unwrap()[0];
    rt.spawn(gateway.serve());
    let base = format!("http://{addr}");
    let http = reqwest::blocking::Client::new();
    let post = |path: &str, body: Value| -> Value {
        let r = http
            .post(format!("{base}{path}"))
            .json(&body)
            .send()
            .unwrap();
        assert_eq!(r.status().as_u16(), 200);
        r.json().unwrap()
    };
    let chat = post(
        "/v1/chat/completions",
        json!({"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}],
               "max_tokens": 12, "temperature": 0}),
    );
    let text = chat["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(text.contains("Paris"), "{text}");
    let r = post(
        "/v1/responses",
        json!({"model": MODEL, "input": "What is the capital of France?", "max_output_tokens": 12,
               "temperature": 0}),
    );
    assert_eq!(
        r["output"][0]["content"][0]["text"], text,
        "the same pipeline"
    );
    let got: Value = http
        .get(format!("{base}/v1/responses/{}", r["id"].as_str().unwrap()))
        .send()
        .unwrap()
        .json()
        .unwrap();
    assert_eq!(got, r, "stored in the ledger's file");
    drop(rt);
    let _ = std::fs::remove_dir_all(dir);
}
