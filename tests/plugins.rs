//! Tenant plugins end to end: a real gateway process with real components (built from
//! `plugins/` and `tests/plugins/`) in its plugin folder, driven over HTTP.

mod support;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use support::wasm::component;
use support::{key_sha256, model_path, Server, MODEL};

const ADMIN: &str = "admin-token-for-tests-0123";
const PERSONA: &str = "You are Ava, the support assistant of Acme CRM.";
const CITE: &str = "Cite sources as [n].";

/// A gateway whose plugin folder holds tenant `acme`'s real plugins and tenant `badco`'s
/// faulty ones. Returns the server and the plugin folder.
fn start() -> (Server, PathBuf) {
    start_with("")
}

/// Like `start`, with more `[plugins]` settings (TOML lines).
fn start_with(plugin_settings: &str) -> (Server, PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "gateway-e2e-plugins-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    for (tenant, name, krate) in [
        ("acme", "persona", "crm-persona-template"),
        ("acme", "json", "json-extract"),
        ("acme", "ranker", "crm-field-reranker"),
        ("badco", "faulty", "faulty-reranker"),
        ("badco", "bad", "bad-parser"),
    ] {
        std::fs::create_dir_all(dir.join(tenant)).unwrap();
        std::fs::copy(
            component(krate),
            dir.join(tenant).join(format!("{name}.wasm")),
        )
        .unwrap();
    }
    let policies = format!(
        r#"
[[tenants]]
name = "acme"
keys = [{{ id = "acme-test", sha256 = "{acme}" }}]
prompt_template = "persona"
output_parser = "json"
reranker = "ranker"
[tenants.config]
persona = "{PERSONA}"
citation_instruction = "{CITE}"
boosts = "tier=enterprise:2"
[[tenants]]
name = "badco"
keys = [{{ id = "bad-test", sha256 = "{bad}" }}]
output_parser = "bad"
parse_output = true
reranker = "faulty"
[[tenants]]
name = "plain"
keys = [{{ id = "plain-test", sha256 = "{plain}" }}]
"#,
        acme = key_sha256("sk-acme"),
        bad = key_sha256("sk-bad"),
        plain = key_sha256("sk-plain"),
    );
    std::fs::write(dir.join("policies.toml"), policies).unwrap();
    let config = format!(
        r#"
admin_token = "{ADMIN}"
policies = "{dir}/policies.toml"
ledger = "{dir}/usage.sqlite"
[plugins]
dir = "{dir}"
{plugin_settings}
[[models]]
name = "{MODEL}"
path = "{model}"
"#,
        dir = dir.display(),
        model = model_path(),
    );
    let path = dir.join("gateway.toml");
    std::fs::write(&path, config).unwrap();
    (Server::start(&["--config", path.to_str().unwrap()]), dir)
}

fn chat(messages: Value) -> Value {
    json!({"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12})
}

fn failures(s: &Server, tenant: &str, plugin: &str, cause: &str) -> f64 {
    let (_, text) = s.get("/metrics");
    let labels = [
        format!("tenant=\"{tenant}\""),
        format!("plugin=\"{plugin}\""),
        format!("cause=\"{cause}\""),
    ];
    text.lines()
        .find(|l| {
            l.starts_with("plugin_failures_total{") && labels.iter().all(|x| l.contains(x.as_str()))
        })
        .map_or(0.0, |l| l.rsplit(' ').next().unwrap().parse().unwrap())
}

#[test]
fn the_template_plugin_writes_the_prompt() {
    let (s, dir) = start();
    let question = json!({"role": "user", "content": "How do I reset my password?"});
    // The plugin puts the tenant's persona in front: the same as another tenant sending
    // that system message itself, token for token.
    let (st, via_plugin) = s.post_as("sk-acme", "/v1/chat/completions", &chat(json!([question])));
    assert_eq!(st, 200, "{via_plugin}");
    let (_, by_hand) = s.post_as(
        "sk-plain",
        "/v1/chat/completions",
        &chat(json!([{"role": "system", "content": PERSONA}, question])),
    );
    assert_eq!(
        via_plugin["usage"]["prompt_tokens"],
        by_hand["usage"]["prompt_tokens"]
    );
    // Tenants never share prefix-cache entries: the other tenant's identical prompt missed.
    assert_eq!(
        by_hand["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    assert_eq!(
        via_plugin["choices"][0]["message"],
        by_hand["choices"][0]["message"]
    );

    // Documents become numbered sources after the citation instruction.
    let mut req = chat(json!([question]));
    req["documents"] = json!([{"id": "kb-7", "title": "Passwords", "text": "Use the Forgot link."}, {"text": "Admins can reset any user."}]);
    let (st, grounded) = s.post_as("sk-acme", "/v1/chat/completions", &req);
    assert_eq!(st, 200, "{grounded}");
    let system = format!("{PERSONA}\n\n{CITE}\n\n[1] Passwords: Use the Forgot link.\n\n[2] Admins can reset any user.");
    let (_, by_hand) = s.post_as(
        "sk-plain",
        "/v1/chat/completions",
        &chat(json!([{"role": "system", "content": system}, question])),
    );
    support::assert_same_prompt(&grounded, &by_hand);

    // Without a template plugin, documents become numbered sources in the system message.
    let (st, grounded) = s.post_as("sk-plain", "/v1/chat/completions", &req);
    assert_eq!(st, 200, "{grounded}");
    let system = format!(
        "{}\n\n[1] Passwords\nUse the Forgot link.\n\n[2] Admins can reset any user.",
        support::GROUNDING
    );
    let (_, by_hand) = s.post_as(
        "sk-plain",
        "/v1/chat/completions",
        &chat(json!([{"role": "system", "content": system}, question])),
    );
    support::assert_same_prompt(&grounded, &by_hand);
    // The plugin refusing its input is the request's error (422), naming the plugin.
    let (st, err) = s.post_as(
        "sk-acme",
        "/v1/chat/completions",
        &chat(json!([{"role": "system", "content": "x"}])),
    );
    assert_eq!(st, 422, "{err}");
    assert_eq!(err["error"]["code"], "plugin_rejected");
    assert!(
        err["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`persona`"),
        "{err}"
    );
    // Time spent in plugins is part of each request's ledger row.
    let (st, usage) = s.request("GET", "/admin/usage?tenant=acme", vec![], Some(ADMIN));
    assert_eq!(st, 200, "{usage}");
    assert!(
        usage["data"][0]["plugin_ms"].as_f64().unwrap() > 0.0,
        "{usage}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn the_output_parser_returns_validated_json() {
    let (s, dir) = start();
    // Greedy decoding with batch-invariant kernels: the model answers with the same JSON every
    // time ({"name": "Ada", "city": "Paris"} on the default model).
    let ask = |extra: Value| {
        let mut r = json!({
            "model": MODEL,
            "messages": [{"role": "user", "content": "Give a JSON object with keys name and city for a customer called Ada from Paris. Answer with JSON only."}],
            "temperature": 0,
            "max_tokens": 40,
            "response_format": {"type": "json_object"},
        });
        r.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        r
    };
    let (st, body) = s.post_as("sk-acme", "/v1/chat/completions", &ask(json!({})));
    assert_eq!(st, 200, "{body}");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    let v: Value = serde_json::from_str(content).unwrap_or_else(|e| panic!("{content}: {e}"));
    assert_eq!(v["name"], "Ada", "{v}");
    assert!(body["choices"][0]["repairs"].is_array(), "{body}");
    // Cut off mid-object, the answer still comes back as JSON, with what was fixed.
    let (st, body) = s.post_as(
        "sk-acme",
        "/v1/chat/completions",
        &ask(json!({"max_tokens": 12})),
    );
    assert_eq!(st, 200, "{body}");
    let content = body["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Value>(content).unwrap().is_object(),
        "{content}"
    );
    assert_eq!(body["choices"][0]["finish_reason"], "length");
    assert!(
        body["choices"][0]["repairs"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r.as_str().unwrap().starts_with("closed")),
        "{body}"
    );

    // Streaming: raw deltas, then the parsed value in the final chunk.
    let events = s.stream_as(
        "sk-acme",
        "/v1/chat/completions",
        &ask(json!({"stream": true})),
    );
    assert_eq!(events.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["parsed"], v, "{last}");
    let streamed: String = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str::<Value>(e).unwrap())
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert_eq!(
        serde_json::from_str::<Value>(&streamed).unwrap(),
        v,
        "deltas carry the raw text"
    );

    // An output that does not meet the schema is reported with the schema's complaint. The
    // schema itself is enforced while decoding, so only a cut (max_tokens) leaves it unmet.
    let schema = json!({"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object", "required": ["invoice_total_cents"]}}});
    let (st, body) = s.post_as(
        "sk-acme",
        "/v1/chat/completions",
        &ask(json!({"response_format": schema, "max_tokens": 1})),
    );
    assert_eq!(st, 422, "{body}");
    assert_eq!(body["error"]["code"], "plugin_rejected");

    // A parser that claims success with non-JSON is caught by the host.
    let (st, body) = s.post_as(
        "sk-bad",
        "/v1/chat/completions",
        &chat(json!([{"role": "user", "content": "hi"}])),
    );
    assert_eq!(st, 500, "{body}");
    assert_eq!(body["error"]["code"], "plugin_invalid_output");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("`bad` of tenant `badco`"),
        "{body}"
    );
    assert_eq!(failures(&s, "badco", "bad", "invalid_output"), 1.0);
    let _ = std::fs::remove_dir_all(dir);
}

fn rerank_docs() -> Value {
    json!([
        {"text": "Export invoices as PDF from the billing tab", "tier": "free"},
        "Reset a password",
        {"text": "Export contacts", "tier": "enterprise"},
    ])
}

#[test]
fn a_policy_binding_a_plugin_of_the_wrong_kind_is_refused() {
    let (s, dir) = start();
    let policy = std::fs::read_to_string(dir.join("policies.toml")).unwrap();
    let wrong = policy.replace("output_parser = \"json\"", "output_parser = \"ranker\"");
    assert_ne!(wrong, policy);
    let (st, body) = s.request("PUT", "/admin/policies", wrong.into_bytes(), Some(ADMIN));
    assert_eq!(st, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("output_parser = \"ranker\" is installed as kind `reranker`"),
        "{message}"
    );
    // The policy in force is unchanged, and a binding of the right kind is accepted.
    let (st, _) = s.request("PUT", "/admin/policies", policy.into_bytes(), Some(ADMIN));
    assert_eq!(st, 200);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn rerank_is_served_by_the_tenant_plugin() {
    let (s, dir) = start();
    let (st, body) = s.post_as(
        "sk-acme",
        "/v1/rerank",
        &json!({"query": "export invoices", "documents": rerank_docs(), "top_n": 2}),
    );
    assert_eq!(st, 200, "{body}");
    let results = body["results"].as_array().unwrap();
    assert_eq!(results.len(), 2);
    // Both terms match document 0 (1.0); one term and the enterprise boost give document 2 1.0
    // too (0.5 × 2), and ties keep input order.
    assert_eq!(results[0]["index"], 0);
    assert_eq!(results[0]["relevance_score"], 1.0);
    assert_eq!(results[1]["index"], 2);
    assert_eq!(results[1]["document"]["tier"], "enterprise");
    assert_eq!(body["model"], "ranker");

    let bad = |b: Value| s.post_as("sk-acme", "/v1/rerank", &b);
    assert_eq!(bad(json!({"query": " ", "documents": ["a"]})).0, 400);
    assert_eq!(bad(json!({"query": "q", "documents": []})).0, 400);
    assert_eq!(
        bad(json!({"query": "q", "documents": [{"title": "no text"}]})).0,
        400
    );
    assert_eq!(
        bad(json!({"query": "q", "documents": ["a"], "model": "nope"})).0,
        404
    );
    // Another tenant's plugin is not visible, and a tenant without a reranker must name one.
    assert_eq!(
        bad(json!({"query": "q", "documents": ["a"], "model": "faulty"})).0,
        404
    );
    let (st, body) = s.post_as(
        "sk-plain",
        "/v1/rerank",
        &json!({"query": "q", "documents": ["a"]}),
    );
    assert_eq!(st, 400, "{body}");
    assert_eq!(body["error"]["param"], "model");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_faulty_plugin_fails_only_its_own_request() {
    let (s, dir) = start();
    let s = Arc::new(s);
    // An endless loop runs while other requests, of both tenants, are served.
    let spinner = {
        let s = s.clone();
        std::thread::spawn(move || {
            s.post_as(
                "sk-bad",
                "/v1/rerank",
                &json!({"query": "spin", "documents": ["a", "b"]}),
            )
        })
    };
    for _ in 0..5 {
        assert_eq!(
            s.post_as(
                "sk-acme",
                "/v1/rerank",
                &json!({"query": "export", "documents": rerank_docs()})
            )
            .0,
            200
        );
    }
    assert_eq!(
        s.post_as(
            "sk-acme",
            "/v1/chat/completions",
            &chat(json!([{"role": "user", "content": "Hi"}]))
        )
        .0,
        200
    );
    let (st, body) = spinner.join().unwrap();
    assert_eq!(
        (st, body["error"]["code"].as_str()),
        (500, Some("plugin_timeout")),
        "{body}"
    );
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("50 ms deadline"),
        "{body}"
    );

    for (query, status, code, cause, says) in [
        ("trap", 500, "plugin_trap", "trap", "unreachable"),
        ("panic", 500, "plugin_panic", "panic", "asked to panic"),
        ("alloc", 500, "plugin_memory_limit", "memory", "64 MiB"),
        (
            "unknown-id",
            500,
            "plugin_invalid_output",
            "invalid_output",
            "unknown candidate",
        ),
        (
            "nan",
            500,
            "plugin_invalid_output",
            "invalid_output",
            "not finite",
        ),
        (
            "refuse",
            422,
            "plugin_rejected",
            "rejected",
            "refuses the query",
        ),
    ] {
        let before = failures(&s, "badco", "faulty", cause);
        let (st, body) = s.post_as(
            "sk-bad",
            "/v1/rerank",
            &json!({"query": query, "documents": ["a", "b"]}),
        );
        assert_eq!(st, status, "{query}: {body}");
        assert_eq!(body["error"]["code"], code, "{query}: {body}");
        assert_eq!(body["error"]["type"], "plugin_error");
        let msg = body["error"]["message"].as_str().unwrap();
        assert!(
            msg.contains("`faulty` of tenant `badco`") && msg.contains(says),
            "{query}: {msg}"
        );
        assert_eq!(
            failures(&s, "badco", "faulty", cause),
            before + 1.0,
            "{query}"
        );
    }
    assert_eq!(failures(&s, "badco", "faulty", "timeout"), 1.0);
    // And the faulty plugin itself still serves a good request.
    assert_eq!(
        s.post_as(
            "sk-bad",
            "/v1/rerank",
            &json!({"query": "ok", "documents": ["a", "b"]})
        )
        .0,
        200
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn sleeping_plugins_are_cut_on_time_and_cannot_starve_another_tenant() {
    let (s, dir) = start_with("max_calls_per_tenant = 2");
    let s = Arc::new(s);
    // Eight clients of badco keep its plugin asleep in a WASI clock wait (epoch interruption
    // cannot reach a guest blocked in the host); each call is cut at the 50 ms deadline, and
    // beyond badco's quota of two calls at once, calls are refused at once.
    let sleepers: Vec<_> = (0..8)
        .map(|_| {
            let s = s.clone();
            std::thread::spawn(move || {
                (0..5)
                    .map(|_| {
                        let t = Instant::now();
                        let (st, body) = s.post_as(
                            "sk-bad",
                            "/v1/rerank",
                            &json!({"query": "sleep", "documents": ["a", "b"]}),
                        );
                        (
                            st,
                            body["error"]["code"].as_str().map(String::from),
                            t.elapsed(),
                        )
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    for _ in 0..10 {
        let (st, body) = s.post_as(
            "sk-acme",
            "/v1/rerank",
            &json!({"query": "export", "documents": rerank_docs()}),
        );
        assert_eq!(st, 200, "{body}");
    }
    let answers: Vec<_> = sleepers
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    let timeouts = answers
        .iter()
        .filter(|a| a.1.as_deref() == Some("plugin_timeout"))
        .count();
    assert!(timeouts > 0, "{answers:?}");
    for (st, code, took) in &answers {
        match code.as_deref() {
            Some("plugin_timeout") => assert_eq!(*st, 500),
            Some("plugin_busy") => assert_eq!(*st, 503),
            other => panic!("{st} {other:?}"),
        }
        // Before, a sleeping plugin ran 5 to 20 s against its 50 ms deadline.
        assert!(*took < Duration::from_secs(2), "{took:?}");
    }
    // A 4 MiB error message reaches the client (and the log) cut short.
    let (st, body) = s.post_as(
        "sk-bad",
        "/v1/rerank",
        &json!({"query": "huge-error", "documents": ["a", "b"]}),
    );
    assert_eq!(
        (st, body["error"]["code"].as_str()),
        (422, Some("plugin_rejected"))
    );
    let msg = body["error"]["message"].as_str().unwrap();
    assert!(
        msg.len() < 4096 && msg.contains("truncated"),
        "{} bytes",
        msg.len()
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Index order of a rerank of three documents as tenant acme (with `model`, if given).
fn acme_order(s: &Server, model: Option<&str>) -> Result<Vec<u64>, (u16, Value)> {
    let mut req = json!({"query": "export invoices", "documents": ["export invoices", "reset", "export contacts"]});
    if let Some(m) = model {
        req["model"] = json!(m);
    }
    let (st, body) = s.post_as("sk-acme", "/v1/rerank", &req);
    if st != 200 {
        return Err((st, body));
    }
    Ok(body["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["index"].as_u64().unwrap())
        .collect())
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "timed out waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    start.elapsed()
}

#[test]
fn hot_reload_by_file_and_by_admin_upload_drops_nothing() {
    let (s, dir) = start();
    let s = Arc::new(s);
    assert_eq!(acme_order(&s, None).unwrap(), [0, 2, 1]);
    // Load from two clients through the whole test: every request must succeed.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicUsize::new(0));
    let load: Vec<_> = (0..2)
        .map(|_| {
            let (s, stop, done) = (s.clone(), stop.clone(), done.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let order = acme_order(&s, None)
                        .unwrap_or_else(|e| panic!("request failed during reload: {e:?}"));
                    assert!(order == [0, 2, 1] || order == [2, 1, 0], "{order:?}");
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();

    // Replace the file in place, as `cp` would: the reversing reranker takes over.
    let ranker = dir.join("acme/ranker.wasm");
    std::fs::copy(component("faulty-reranker"), &ranker).unwrap();
    let took = wait_for("the new version", || {
        acme_order(&s, None).unwrap() == [2, 1, 0]
    });
    println!("file replacement served after {took:?}");
    // A broken file leaves the running version in place.
    std::fs::write(&ranker, b"\0asm\x0d\0\x01\0 truncated").unwrap();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(acme_order(&s, None).unwrap(), [2, 1, 0]);

    // Admin API: upload, list, replace-with-garbage (rejected), delete.
    let real = std::fs::read(component("crm-field-reranker")).unwrap();
    let admin =
        |m: &str, path: &str, body: Vec<u8>, token: &str| s.request(m, path, body, Some(token));
    assert_eq!(
        admin(
            "PUT",
            "/admin/plugins/acme/ranker2",
            real.clone(),
            "wrong-token"
        )
        .0,
        401
    );
    let (st, body) = admin(
        "PUT",
        "/admin/plugins/acme/ranker2?kind=reranker",
        real.clone(),
        ADMIN,
    );
    assert_eq!(st, 201, "{body}");
    assert_eq!(body["kind"], "reranker");
    assert!(
        Path::new(&dir.join("acme/ranker2.wasm")).exists(),
        "uploads persist in the plugin folder"
    );
    assert_eq!(acme_order(&s, Some("ranker2")).unwrap(), [0, 2, 1]);
    let (st, body) = admin(
        "PUT",
        "/admin/plugins/acme/ranker2",
        b"garbage".to_vec(),
        ADMIN,
    );
    assert_eq!(st, 400, "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("previous version"), "{body}");
    assert!(
        message.contains("not a WebAssembly file (7 bytes"),
        "{body}"
    );
    assert_eq!(body["error"]["code"], "plugin_invalid");
    let (st, body) = admin(
        "PUT",
        "/admin/plugins/acme/ranker2?kind=output-parser",
        real.clone(),
        ADMIN,
    );
    assert_eq!(st, 400, "{body}");
    assert_eq!(acme_order(&s, Some("ranker2")).unwrap(), [0, 2, 1]);
    assert_eq!(
        admin("PUT", "/admin/plugins/acme/..%2Fx", real.clone(), ADMIN).0,
        400
    );
    // A tenant the policy does not know gets nothing installed (and no folder).
    let (st, body) = admin("PUT", "/admin/plugins/ghost/ranker", real.clone(), ADMIN);
    assert_eq!(
        (st, body["error"]["code"].as_str()),
        (404, Some("tenant_not_found"))
    );
    assert!(!dir.join("ghost").exists());
    let (st, list) = admin("GET", "/admin/plugins", vec![], ADMIN);
    assert_eq!(st, 200);
    assert!(
        list["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "ranker2" && p["tenant"] == "acme"),
        "{list}"
    );
    // The broken file in the folder is listed with its reason (the old version serves).
    assert!(
        list["rejected"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| r["tenant"] == "acme"
                && r["name"] == "ranker"
                && r["reason"].as_str().unwrap().contains("does not compile")),
        "{list}"
    );
    assert_eq!(
        admin("DELETE", "/admin/plugins/acme/ranker2", vec![], ADMIN).0,
        200
    );
    assert_eq!(acme_order(&s, Some("ranker2")).unwrap_err().0, 404);
    assert!(!dir.join("acme/ranker2.wasm").exists());

    // Back to the original by upload over the folder's broken file.
    assert_eq!(
        admin("PUT", "/admin/plugins/acme/ranker", real, ADMIN).0,
        200
    );
    assert_eq!(acme_order(&s, None).unwrap(), [0, 2, 1]);
    stop.store(true, Ordering::Relaxed);
    for t in load {
        t.join().unwrap();
    }
    println!(
        "{} requests during reloads, none failed",
        done.load(Ordering::Relaxed)
    );
    assert!(done.load(Ordering::Relaxed) > 0);
    let _ = std::fs::remove_dir_all(dir);
}
