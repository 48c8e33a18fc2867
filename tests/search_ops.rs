//! Running collections: acknowledged writes survive `kill -9` and a lost BM25 index is rebuilt,
//! the `gateway index` CLI loads files and JSONL, and embedding a query is charged to the
//! tenant's token budget.

mod support;

use std::time::Duration;

use serde_json::json;
use support::collections::{ids, kb, search, start, temp};
use support::wait_for;

#[test]
fn query_embeddings_are_charged_to_the_tenant() {
    let (dir, cols) = (temp("metered"), temp("metered-cols"));
    let s = start(&dir, &cols);
    assert_eq!(
        s.post_as("k-metered", "/v1/collections", &json!({"name": "kb"}))
            .0,
        201
    );
    let (st, up) = s.post_as("k-metered", "/v1/collections/kb/documents", &kb());
    assert_eq!(st, 200, "{up}");
    let mut used = up["usage"]["prompt_tokens"].as_u64().unwrap();
    let query = "How long does it take before a refund for a returned item reaches the original \
                 payment method, and can invoices be exported as CSV files by administrators?";
    let (st, r) = search(
        &s,
        "k-metered",
        "kb",
        json!({"query": query, "mode": "bm25"}),
    );
    assert_eq!((st, r["usage"]["prompt_tokens"].as_u64()), (200, Some(0)));
    // Each vector or hybrid search charges the query's tokens until the budget is spent.
    let mut per_query = None;
    for mode in ["vector", "hybrid"].into_iter().cycle() {
        let (st, r) = search(&s, "k-metered", "kb", json!({"query": query, "mode": mode}));
        if st == 429 {
            assert_eq!(r["error"]["code"], "token_budget", "{r}");
            break;
        }
        assert_eq!(st, 200, "{r}");
        assert_eq!(ids(&r)[0], "refund-policy");
        let n = r["usage"]["prompt_tokens"].as_u64().unwrap();
        assert!(n > 20 && *per_query.get_or_insert(n) == n, "{r}");
        used += n;
        assert!(used <= 1000, "charged past the budget: {used}");
    }
    assert!(
        used + per_query.unwrap() > 1000,
        "refused with room left: {used}"
    );
    // Keyword search embeds nothing, so it still answers.
    let (st, r) = search(
        &s,
        "k-metered",
        "kb",
        json!({"query": query, "mode": "bm25"}),
    );
    assert_eq!(st, 200, "{r}");
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(cols);
}

#[test]
fn acknowledged_writes_survive_kill_9() {
    let (dir, cols) = (temp("durable"), temp("durable-cols"));
    let mut s = start(&dir, &cols);
    assert_eq!(
        s.post_as("k-acme", "/v1/collections", &json!({"name": "kb"}))
            .0,
        201
    );
    s.post_as("k-acme", "/v1/collections/kb/documents", &kb());
    // A writer upserts one document per request; every acknowledged id is remembered. The
    // server is killed once a few writes are in (not after a fixed time: on a loaded machine one
    // embedded upsert can take seconds), so the kill lands while writes are still in flight.
    let base = s.base.clone();
    let acked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = acked.clone();
    // Returns why it stopped: the refused write's status and body, or the transport error.
    let writer = std::thread::spawn(move || {
        let client = reqwest::blocking::Client::new();
        for i in 0.. {
            let doc = json!({"documents": [{"id": format!("w{i}"), "text": format!("Ticket number zq{i}x was resolved by restarting the sync agent.")}]});
            match client
                .post(format!("{base}/v1/collections/kb/documents"))
                .bearer_auth("k-acme")
                .json(&doc)
                .send()
            {
                Ok(r) if r.status().is_success() => log.lock().unwrap().push(i),
                Ok(r) => return format!("{}: {}", r.status(), r.text().unwrap_or_default()),
                Err(e) => return e.to_string(),
            }
        }
        unreachable!("the writer runs until a write fails")
    });
    wait_for("five acknowledged writes", Duration::from_secs(180), || {
        acked.lock().unwrap().len() >= 5 || writer.is_finished()
    });
    s.kill();
    let stopped_by = writer.join().unwrap();
    let acked = std::mem::take(&mut *acked.lock().unwrap());
    assert!(
        acked.len() >= 5,
        "the writer got {} writes in; it stopped on: {stopped_by}",
        acked.len()
    );
    let s = start(&dir, &cols);
    for i in acked {
        let (st, v) = search(
            &s,
            "k-acme",
            "kb",
            json!({"query": format!("zq{i}x"), "mode": "bm25", "top_k": 1}),
        );
        assert_eq!(st, 200);
        assert_eq!(
            ids(&v),
            [format!("w{i}")],
            "acknowledged write {i} lost (BM25)"
        );
        let (_, v) = search(
            &s,
            "k-acme",
            "kb",
            json!({"query": format!("Ticket number zq{i}x was resolved by restarting the sync agent."), "mode": "vector", "top_k": 5, "filter": {}}),
        );
        assert!(
            ids(&v).contains(&format!("w{i}")),
            "acknowledged write {i} lost (vectors): {v}"
        );
    }
    // The derived BM25 index can be lost entirely: it is rebuilt from the store.
    drop(s);
    for d in std::fs::read_dir(cols.join("acme")).unwrap().flatten() {
        let _ = std::fs::remove_dir_all(d.path().join("bm25"));
    }
    let s = start(&dir, &cols);
    assert_eq!(
        ids(&search(
            &s,
            "k-acme",
            "kb",
            json!({"query": "SAML", "mode": "bm25", "top_k": 1})
        )
        .1),
        ["sso-setup"]
    );
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(cols);
}

#[test]
fn index_cli_loads_files_and_jsonl_with_the_tenants_key() {
    let (dir, cols) = (temp("index-cli"), temp("index-cli-cols"));
    let s = start(&dir, &cols);
    let docs = dir.join("docs");
    std::fs::create_dir_all(docs.join("guides")).unwrap();
    std::fs::write(
        docs.join("guides/exports.md"),
        "# Exporting reports\n\nOpen Reports, pick a saved view and press Export to download a spreadsheet.\n",
    )
    .unwrap();
    std::fs::write(
        docs.join("notes.txt"),
        "Quota resets on the first day of each month.",
    )
    .unwrap();
    std::fs::write(docs.join("ignored.bin"), [0u8, 159, 146, 150]).unwrap();
    let jsonl = dir.join("tickets.jsonl");
    std::fs::write(
        &jsonl,
        "{\"id\": \"t-1\", \"title\": \"Sync stuck\", \"text\": \"Restart the sync agent from the tray icon.\", \"metadata\": {\"priority\": \"high\"}}\n\
         {\"id\": \"t-2\", \"text\": \"Calendar invites are sent from noreply addresses.\"}\n",
    )
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gateway"))
        .args([
            "index",
            "support",
            "--url",
            &s.base,
            "--api-key",
            "k-globex",
        ])
        .arg(&docs)
        .arg(&jsonl)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains("indexed 4 documents"), "{err}");
    let (_, card) = s.request("GET", "/v1/collections/support", vec![], Some("k-globex"));
    assert_eq!(card["documents"], 4, "{card}");
    let (_, v) = search(
        &s,
        "k-globex",
        "support",
        json!({"query": "download a spreadsheet of reports", "top_k": 1}),
    );
    let hit = &v["data"][0];
    assert!(
        hit["id"].as_str().unwrap().ends_with("guides/exports.md"),
        "{v}"
    );
    assert_eq!(hit["metadata"]["title"], "Exporting reports");
    let (_, v) = search(
        &s,
        "k-globex",
        "support",
        json!({"query": "sync agent", "filter": {"priority": "high"}}),
    );
    assert_eq!(ids(&v), ["t-1"]);
    // A wrong key fails with the gateway's message, not a stack trace.
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gateway"))
        .args(["index", "support", "--url", &s.base, "--api-key", "nope"])
        .arg(&jsonl)
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("401"));
    let _ = std::fs::remove_dir_all(dir);
    let _ = std::fs::remove_dir_all(cols);
}
