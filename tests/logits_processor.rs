//! Logits-processor plugins in the decode loop, end to end: the CRM guardrail example
//! (plugins/crm-guardrail) keeps deny-listed phrases out of sampled answers that a plain
//! tenant's answers to the same provoking prompt contain; a faulty processor fails only its
//! own request, whatever the fault.

mod support;

use std::path::PathBuf;

use serde_json::{json, Value};
use support::wasm::component;
use support::{key_sha256, model_path, Server, MODEL};

const MODES: [&str; 4] = ["panic", "spin", "wild-id", "reject"];

fn start() -> (Server, PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "gateway-e2e-logits-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let mut policies = format!(
        r#"
[[tenants]]
name = "guard"
keys = [{{ id = "g", sha256 = "{}" }}]
logits_processor = "guardrail"
[tenants.config]
deny = "Salesforce, HubSpot"
[[tenants]]
name = "open"
keys = [{{ id = "o", sha256 = "{}" }}]
"#,
        key_sha256("sk-guard"),
        key_sha256("sk-open")
    );
    std::fs::create_dir_all(dir.join("guard")).unwrap();
    std::fs::copy(component("crm-guardrail"), dir.join("guard/guardrail.wasm")).unwrap();
    for mode in MODES {
        let tenant = format!("bad-{mode}");
        std::fs::create_dir_all(dir.join(&tenant)).unwrap();
        std::fs::copy(component("bad-processor"), dir.join(&tenant).join("p.wasm")).unwrap();
        policies += &format!(
            "[[tenants]]\nname = \"{tenant}\"\nkeys = [{{ id = \"k\", sha256 = \"{}\" }}]\nlogits_processor = \"p\"\n[tenants.config]\nmode = \"{mode}\"\n",
            key_sha256(&format!("sk-{mode}"))
        );
    }
    std::fs::write(dir.join("policies.toml"), policies).unwrap();
    let config = format!(
        "policies = \"{d}/policies.toml\"\nledger = \"{d}/usage.sqlite\"\n[plugins]\ndir = \"{d}\"\n[[models]]\nname = \"{MODEL}\"\npath = \"{m}\"\n",
        d = dir.display(),
        m = model_path()
    );
    std::fs::write(dir.join("gateway.toml"), config).unwrap();
    let path = dir.join("gateway.toml");
    (Server::start(&["--config", path.to_str().unwrap()]), dir)
}

/// A prompt that makes the model name the competitor.
fn provoke(seed: u64) -> Value {
    json!({"model": MODEL, "temperature": 1.0, "n": 10, "seed": seed, "max_tokens": 30,
           "messages": [{"role": "user", "content": "Which CRM is the market leader? Answer with one word: Salesforce or HubSpot. Say Salesforce."}]})
}

fn denied(text: &str) -> bool {
    let t = text.to_lowercase();
    t.contains("salesforce") || t.contains("hubspot")
}

#[test]
fn the_guardrail_keeps_denied_phrases_out_of_sampled_answers() {
    let (s, dir) = start();
    let mut counts = Vec::new();
    for key in ["sk-open", "sk-guard"] {
        let mut hits = 0;
        for seed in [1, 2] {
            let (status, v) = s.post_as(key, "/v1/chat/completions", &provoke(seed));
            assert_eq!(status, 200, "{v}");
            let choices = v["choices"].as_array().unwrap();
            assert_eq!(choices.len(), 10);
            for c in choices {
                let text = c["message"]["content"].as_str().unwrap();
                hits += denied(text) as usize;
                assert!(key == "sk-open" || !denied(text), "{text}");
            }
        }
        counts.push(hits);
    }
    assert!(
        counts[0] >= 3,
        "the prompt should provoke the phrase without the guardrail: {counts:?}"
    );
    assert_eq!(counts[1], 0);
    // Streamed, and on /v1/completions too.
    let events = s.stream_as("sk-guard", "/v1/chat/completions", &{
        let mut b = provoke(3);
        b["n"] = json!(1);
        b["stream"] = json!(true);
        b
    });
    assert_eq!(events.last().unwrap(), "[DONE]");
    let text: String = events[..events.len() - 1]
        .iter()
        .filter_map(|e| {
            let v: Value = serde_json::from_str(e).unwrap();
            v["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert!(!denied(&text), "{text}");
    let (status, v) = s.post_as(
        "sk-guard",
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "The best CRM is Sales", "max_tokens": 8, "n": 5,
                "temperature": 1.0, "seed": 5}),
    );
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        let text = format!("Sales{}", c["text"].as_str().unwrap());
        assert!(!text.to_lowercase().starts_with("salesforce"), "{text}");
    }
    let steps = s.metric(&format!(
        "gateway_logits_processor_step_seconds_count{{model=\"{MODEL}\"}}"
    ));
    assert!(steps >= 200.0, "{steps} processor steps");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_faulty_processor_fails_only_its_own_request() {
    let (s, dir) = start();
    let ask = json!({"model": MODEL, "max_tokens": 12, "temperature": 0,
                     "messages": [{"role": "user", "content": "Say hello."}]});
    for (mode, status_code, code, says) in [
        ("panic", 500, "plugin_panic", "panicked"),
        ("spin", 500, "plugin_timeout", "deadline"),
        ("wild-id", 500, "plugin_invalid_output", "outside the"),
        ("reject", 422, "plugin_rejected", "this sequence is refused"),
    ] {
        let (status, v) = s.post_as(&format!("sk-{mode}"), "/v1/chat/completions", &ask);
        assert_eq!(status, status_code, "{mode}: {v}");
        assert_eq!(v["error"]["type"], "plugin_error", "{mode}: {v}");
        assert_eq!(v["error"]["code"], code, "{mode}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("Plugin `p` of tenant `bad-{mode}`"))
                && message.contains(says),
            "{mode}: {message}"
        );
        // Everyone else carries on, and so does this tenant's next request, until it fails.
        let (status, v) = s.post_as("sk-open", "/v1/chat/completions", &ask);
        assert_eq!(status, 200, "after {mode}: {v}");
        let streamed = s.stream_as(&format!("sk-{mode}"), "/v1/chat/completions", &{
            let mut b = ask.clone();
            b["stream"] = json!(true);
            b
        });
        let last: Value = serde_json::from_str(&streamed[streamed.len() - 2]).unwrap();
        assert_eq!(last["error"]["code"], code, "{mode}: {last}");
    }
    let (_, metrics) = s.get("/metrics");
    for cause in ["panic", "timeout", "invalid_output", "rejected"] {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with("plugin_failures_total{")
                    && l.contains(&format!("cause=\"{cause}\""))
                    && l.contains("plugin=\"p\"")),
            "no {cause} failure counted"
        );
    }
    let _ = std::fs::remove_dir_all(dir);
}
