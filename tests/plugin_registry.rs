//! The plugin registry through the library API, with real components built from `plugins/`
//! and `tests/plugins/`: swap semantics, rejection of bad versions, directory sync, and direct
//! calls of a cache-key plugin written in Rust and in Python.

mod support;

use std::collections::BTreeMap;
use std::sync::Arc;

use gateway::config::PluginsConfig;
use gateway::plugins::{
    CacheRequest, CallError, Candidate, Message, PluginKind, Registry, Runtime, TenantValues,
};
use support::wasm::{component, language_component};

/// Drives one plugin call (an async fn: its deadline is a timer) to completion.
fn block<T>(call: impl std::future::Future<Output = T>) -> T {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap()
        .block_on(call)
}

fn runtime() -> Arc<Runtime> {
    Runtime::new(&PluginsConfig::default()).unwrap()
}

fn runtime_with_deadline(timeout_ms: u64) -> Arc<Runtime> {
    let config = PluginsConfig {
        timeout_ms,
        ..PluginsConfig::default()
    };
    Runtime::new(&config).unwrap()
}

fn candidates() -> Vec<Candidate> {
    [
        "export invoices to pdf",
        "reset password",
        "export contacts",
    ]
    .iter()
    .enumerate()
    .map(|(i, t)| Candidate {
        id: i.to_string(),
        document_id: None,
        text: t.to_string(),
        metadata: vec![],
        score: 0.0,
    })
    .collect()
}

/// Candidate ids from best to worst.
fn order(rt: &Runtime, p: &gateway::plugins::Plugin, query: &str) -> Vec<String> {
    let mut s = block(p.rerank(rt, &TenantValues::default(), query, &candidates())).unwrap();
    s.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.id.cmp(&b.id)));
    s.into_iter().map(|s| s.id).collect()
}

#[test]
fn in_flight_calls_keep_their_version_and_bad_uploads_change_nothing() {
    let rt = runtime();
    let reg = Registry::new(rt.clone(), None);
    let real = std::fs::read(component("crm-field-reranker")).unwrap();
    let reversed = std::fs::read(component("faulty-reranker")).unwrap();

    let v1 = reg.install("acme", "ranker", &real, None).unwrap();
    assert_eq!(v1.kind(), PluginKind::Reranker);
    // Query terms: "export", "invoice" -> the first candidate matches both.
    assert_eq!(order(&rt, &v1, "export invoices"), ["0", "2", "1"]);

    // A request holds v1 while v2 replaces it: v1 keeps answering as v1.
    let held = reg.get("acme", "ranker").unwrap();
    let v2 = reg
        .install("acme", "ranker", &reversed, Some(PluginKind::Reranker))
        .unwrap();
    assert_ne!(v1.sha256, v2.sha256);
    assert_eq!(order(&rt, &held, "export invoices"), ["0", "2", "1"]);
    let now = reg.get("acme", "ranker").unwrap();
    assert_eq!(now.sha256, v2.sha256);
    assert_eq!(order(&rt, &now, "export invoices"), ["2", "1", "0"]);

    // Not a component, a component of another kind, a bad name: rejected, v2 stays.
    assert!(reg
        .install("acme", "ranker", b"\0asm garbage", None)
        .is_err());
    let template = std::fs::read(component("crm-persona-template")).unwrap();
    let err = reg
        .install("acme", "ranker", &template, Some(PluginKind::Reranker))
        .unwrap_err();
    assert!(err.to_string().contains("not a reranker"), "{err}");
    assert!(reg.install("acme", "../etc", &real, None).is_err());
    assert_eq!(reg.get("acme", "ranker").unwrap().sha256, v2.sha256);

    // Tenants are separate namespaces.
    assert!(reg.get("other", "ranker").is_none());
    assert!(reg.remove("acme", "ranker").unwrap());
    assert!(reg.get("acme", "ranker").is_none());
    assert_eq!(order(&rt, &held, "export invoices"), ["0", "2", "1"]);
}

#[test]
fn calls_during_swaps_all_succeed() {
    let rt = runtime();
    let reg = Arc::new(Registry::new(rt.clone(), None));
    let a = std::fs::read(component("crm-field-reranker")).unwrap();
    let b = std::fs::read(component("faulty-reranker")).unwrap();
    reg.install("acme", "ranker", &a, None).unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let callers: Vec<_> = (0..2)
        .map(|_| {
            let (reg, rt, stop) = (reg.clone(), rt.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut calls = 0;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let p = reg
                        .get("acme", "ranker")
                        .expect("a version is always installed");
                    let o = order(&rt, &p, "export invoices");
                    assert!(o == ["0", "2", "1"] || o == ["2", "1", "0"], "{o:?}");
                    calls += 1;
                }
                calls
            })
        })
        .collect();
    for i in 0..10 {
        reg.install("acme", "ranker", if i % 2 == 0 { &b } else { &a }, None)
            .unwrap();
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let calls: usize = callers.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(calls > 0);
}

#[test]
fn faults_are_contained_and_classified() {
    // Every fault but the deadline's under a roomy one: on a loaded machine a fresh instance
    // building a 4 MiB error can pass the default 50 ms, which would read as a timeout.
    let rt = runtime_with_deadline(5000);
    let reg = Registry::new(rt.clone(), None);
    let faulty = std::fs::read(component("faulty-reranker")).unwrap();
    let p = reg.install("acme", "faulty", &faulty, None).unwrap();
    let values = TenantValues::default();
    let call = |q: &str| block(p.rerank(&rt, &values, q, &candidates()));
    // The deadline itself, the default 50 ms, on a registry of its own.
    let tight_rt = runtime();
    let tight = Registry::new(tight_rt.clone(), None)
        .install("acme", "faulty", &faulty, None)
        .unwrap();
    let tight_call = |q: &str| block(tight.rerank(&tight_rt, &values, q, &candidates()));
    assert!(
        matches!(call("trap"), Err(CallError::Trap(_))),
        "{:?}",
        call("trap")
    );
    match call("panic") {
        Err(CallError::Panic(m)) => assert!(m.contains("asked to panic"), "{m}"),
        other => panic!("{other:?}"),
    }
    let started = std::time::Instant::now();
    assert!(matches!(
        tight_call("spin"),
        Err(CallError::Timeout { ms: 50 })
    ));
    println!(
        "an endless loop was cut after {:?} (deadline 50 ms)",
        started.elapsed()
    );
    assert!(
        started.elapsed() < std::time::Duration::from_secs(2),
        "{:?}",
        started.elapsed()
    );
    // Blocked in a host call past the deadline: abandoned on time, the instance dropped.
    let started = std::time::Instant::now();
    assert!(matches!(
        tight_call("sleep"),
        Err(CallError::Timeout { ms: 50 })
    ));
    let took = started.elapsed();
    println!("a 20 s sleep was cut after {took:?} (deadline 50 ms)");
    assert!(took < std::time::Duration::from_millis(500), "{took:?}");
    // A 4 MiB error message comes back cut to a bounded size, marked as cut.
    match call("huge-error") {
        Err(CallError::Rejected { message, .. }) => {
            assert!(message.len() < 4096, "{} bytes", message.len());
            assert!(message.contains("truncated"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        call("alloc"),
        Err(CallError::Memory { limit_mb: 64 })
    ));
    assert!(matches!(
        call("unknown-id"),
        Err(CallError::InvalidOutput(_))
    ));
    assert!(matches!(call("nan"), Err(CallError::InvalidOutput(_))));
    match call("refuse") {
        Err(CallError::Rejected { code, .. }) => assert_eq!(code, "refused"),
        other => panic!("{other:?}"),
    }
    // After all that, the same plugin still serves.
    assert_eq!(call("export").unwrap().len(), 3);

    let bad = reg
        .install(
            "acme",
            "bad",
            &std::fs::read(component("bad-parser")).unwrap(),
            None,
        )
        .unwrap();
    assert!(matches!(
        block(bad.parse(&rt, &values, "{}", None)),
        Err(CallError::InvalidOutput(_))
    ));
}

#[test]
fn directory_sync_loads_replaces_keeps_and_removes() {
    let dir = tempdir();
    let reg = Registry::new(runtime(), Some(dir.clone()));
    let acme = dir.join("acme");
    std::fs::create_dir_all(&acme).unwrap();
    std::fs::copy(component("crm-field-reranker"), acme.join("ranker.wasm")).unwrap();
    std::fs::copy(component("json-extract"), acme.join("json.wasm")).unwrap();
    std::fs::write(acme.join("json.toml"), "kind = \"output-parser\"\n").unwrap();
    let r = reg.sync_dir();
    assert_eq!(r.loaded, ["acme/json", "acme/ranker"]);
    let v1 = reg.get("acme", "ranker").unwrap().sha256.clone();

    // A broken replacement is rejected and the loaded version keeps serving; it is not retried
    // until the file changes again.
    std::fs::write(acme.join("ranker.wasm"), b"not wasm").unwrap();
    let r = reg.sync_dir();
    assert_eq!(r.rejected, ["acme/ranker"]);
    assert_eq!(reg.get("acme", "ranker").unwrap().sha256, v1);
    assert_eq!(reg.sync_dir(), Default::default());

    // A manifest naming the wrong kind is a rejection too.
    std::fs::copy(component("crm-persona-template"), acme.join("persona.wasm")).unwrap();
    std::fs::write(acme.join("persona.toml"), "kind = \"reranker\"\n").unwrap();
    assert_eq!(reg.sync_dir().rejected, ["acme/persona"]);
    std::fs::remove_file(acme.join("persona.toml")).unwrap();
    assert_eq!(reg.sync_dir().loaded, ["acme/persona"]);

    std::fs::remove_file(acme.join("ranker.wasm")).unwrap();
    assert_eq!(reg.sync_dir().removed, ["acme/ranker"]);
    assert!(reg.get("acme", "ranker").is_none());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn a_rejected_file_never_loses_the_plugin_across_restarts() {
    let dir = tempdir();
    let acme = dir.join("acme");
    std::fs::create_dir_all(&acme).unwrap();
    std::fs::copy(component("crm-field-reranker"), acme.join("ranker.wasm")).unwrap();
    let reg = Registry::new(runtime(), Some(dir.clone()));
    assert_eq!(reg.sync_dir().loaded, ["acme/ranker"]);
    let good = reg.get("acme", "ranker").unwrap().sha256.clone();

    // A broken file copied over the working one; then the gateway restarts.
    std::fs::write(acme.join("ranker.wasm"), b"\0asm but not really").unwrap();
    assert_eq!(reg.sync_dir().rejected, ["acme/ranker"]);
    drop(reg);
    let reg = Registry::new(runtime(), Some(dir.clone()));
    let r = reg.sync_dir();
    assert_eq!(r.rejected, ["acme/ranker"]);
    assert_eq!(
        r.loaded,
        ["acme/ranker"],
        "the last version that loaded serves"
    );
    let p = reg.get("acme", "ranker").expect("still installed");
    assert_eq!(p.sha256, good);
    assert_eq!(order(reg.runtime(), &p, "export invoices"), ["0", "2", "1"]);
    let rejections = reg.rejections();
    assert_eq!(rejections.len(), 1);
    assert_eq!(
        (rejections[0].tenant.as_str(), rejections[0].name.as_str()),
        ("acme", "ranker")
    );
    assert!(
        rejections[0].reason.contains("compile"),
        "{:?}",
        rejections[0]
    );

    // Deleting the file is deliberate: the plugin and its kept copy both go.
    std::fs::remove_file(acme.join("ranker.wasm")).unwrap();
    assert_eq!(reg.sync_dir().removed, ["acme/ranker"]);
    std::fs::copy(component("faulty-reranker"), acme.join("other.wasm")).unwrap();
    let reg = Registry::new(runtime(), Some(dir.clone()));
    assert_eq!(reg.sync_dir().loaded, ["acme/other"]);
    assert!(reg.get("acme", "ranker").is_none());
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn compiled_components_are_cached_by_hash() {
    let cache = tempdir();
    let cfg = PluginsConfig {
        cache_dir: Some(cache.clone()),
        ..PluginsConfig::default()
    };
    let wasm = std::fs::read(component("crm-persona-template")).unwrap();
    let reg = Registry::new(Runtime::new(&cfg).unwrap(), None);
    reg.install("acme", "persona", &wasm, None).unwrap();
    let files: Vec<_> = std::fs::read_dir(&cache)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    // A second runtime (a restart) loads the cached artefact and it works.
    let rt = Runtime::new(&cfg).unwrap();
    let reg = Registry::new(rt.clone(), None);
    let p = reg.install("acme", "persona", &wasm, None).unwrap();
    let values: TenantValues = Arc::new(BTreeMap::from([(
        "persona".to_string(),
        gateway::plugins::ConfigValue::Text("You are Ava.".to_string()),
    )]));
    let req = gateway::plugins::ChatRequest {
        model: "m".into(),
        messages: vec![gateway::plugins::Message {
            role: "user".into(),
            content: "hi".into(),
            name: None,
        }],
        context: vec![],
    };
    match block(p.render(&rt, &values, &req)).unwrap() {
        gateway::plugins::RenderedPrompt::Messages(m) => assert_eq!(m[0].content, "You are Ava."),
        other => panic!("{other:?}"),
    }
    // Removing the plugin removes its compiled code.
    assert!(reg.remove("acme", "persona").unwrap());
    assert_eq!(std::fs::read_dir(&cache).unwrap().count(), 0);
    let _ = std::fs::remove_dir_all(cache);
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!(
        "gateway-plugins-{}-{:x}",
        std::process::id(),
        rand_u64()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn rand_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos() as u64,
    );
    h.finish()
}

/// `gateway plugin check` and `run`: a component checked and called from the command line,
/// with no server and no model.
#[test]
fn the_cli_checks_and_runs_a_component_without_a_server() {
    let bin = env!("CARGO_BIN_EXE_gateway");
    let dir = tempdir();
    let cli = |args: &[&str]| {
        std::process::Command::new(bin)
            .args(args)
            .env("XDG_CACHE_HOME", &dir)
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap()
    };
    let reranker = component("crm-field-reranker");
    let out = cli(&["plugin", "check", reranker.to_str().unwrap()]);
    assert!(out.status.success(), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("a reranker plugin"));

    let input = dir.join("case.json");
    std::fs::write(
        &input,
        r#"{"query": "export invoices", "candidates": [
            {"id": "a", "text": "reset password", "metadata": {"tier": "free"}},
            {"id": "b", "text": "export invoices to pdf", "metadata": {"tier": "enterprise"}}]}"#,
    )
    .unwrap();
    let args = [
        "plugin",
        "run",
        reranker.to_str().unwrap(),
        "--input",
        input.to_str().unwrap(),
        "--config-value",
        "boosts=tier=enterprise:2",
    ];
    let out = cli(&args);
    assert!(out.status.success(), "{out:?}");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["kind"], "reranker");
    assert_eq!(v["result"]["results"][0]["id"], "b", "{v}");
    assert!(v["call_ms"].as_f64().unwrap() >= 0.0);

    let junk = dir.join("junk.wasm");
    std::fs::write(&junk, b"<html>").unwrap();
    let out = cli(&["plugin", "check", junk.to_str().unwrap()]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not a WebAssembly file"), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    let _ = std::fs::remove_dir_all(dir);
}

/// One user message with `content`, as a cache-key plugin sees a chat request.
fn cache_request(content: &str) -> CacheRequest {
    CacheRequest {
        model: "m".into(),
        endpoint: "chat".into(),
        messages: vec![Message {
            role: "user".into(),
            content: content.into(),
            name: None,
        }],
        parameters: r#"{"temperature":0}"#.into(),
    }
}

#[test]
fn cache_key_plugins_in_rust_and_python_key_alike_without_timestamps() {
    // A Python component's first call may take longer than the default deadline while other
    // tests compile on the same cores; what is checked here is what the plugins compute.
    let rt = Runtime::new(&PluginsConfig {
        timeout_ms: 10_000,
        ..Default::default()
    })
    .unwrap();
    let reg = Registry::new(rt.clone(), None);
    let mut keys = Vec::new();
    for (name, wasm) in [
        ("rs", component("strip-timestamp")),
        ("py", language_component("strip-timestamp-py")),
    ] {
        let p = reg
            .install("acme", name, &std::fs::read(wasm).unwrap(), None)
            .unwrap();
        assert_eq!(p.kind(), PluginKind::CacheKey, "{name}");
        let key = |content: &str| {
            block(p.cache_key(&rt, &TenantValues::default(), &cache_request(content))).unwrap()
        };
        let a = key("Orders as of 2026-12-05T04:24:11Z [ts=1733372651]?");
        let b = key("Orders as of 2026-12-06T09:00:00+01:00 [ts=later]?");
        assert_eq!(a, b, "{name}: only the timestamps differ");
        assert_eq!(
            a.as_deref(),
            Some("m\nuser: Orders as of  ?\n{\"temperature\":0}"),
            "{name}"
        );
        assert_ne!(key("Orders as of yesterday?"), a, "{name}");
        assert_eq!(key("Orders as of now, NOCACHE"), None, "{name}");
        keys.push(a);
    }
    assert_eq!(keys[0], keys[1], "the Rust and Python plugins key alike");

    // A key longer than `max_output_bytes` is the plugin's invalid output.
    let small = Runtime::new(&PluginsConfig {
        max_output_bytes: 8,
        ..Default::default()
    })
    .unwrap();
    let reg = Registry::new(small.clone(), None);
    let wasm = std::fs::read(component("strip-timestamp")).unwrap();
    let p = reg
        .install("acme", "rs", &wasm, Some(PluginKind::CacheKey))
        .unwrap();
    let err =
        block(p.cache_key(&small, &TenantValues::default(), &cache_request("hello"))).unwrap_err();
    assert!(
        matches!(&err, CallError::InvalidOutput(why) if why.contains("cache key")),
        "{err}"
    );
}
