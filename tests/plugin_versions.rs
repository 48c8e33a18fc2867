//! Plugins built against `gateway:plugins@0.1.0` and `@0.2.0`, served side by side by one
//! gateway: the same typed metadata and configuration reach each as its contract says (typed
//! values for 0.2.0, text for 0.1.0), rendered the same way from `/v1/rerank` and from search,
//! and the admin API says which contract each plugin speaks.

mod support;

use serde_json::json;
use support::collections::temp;
use support::{key_sha256, rerank_order, wasm::component, Server};

const ADMIN: &str = "admin-token-for-versions-0123";

/// Tenant acme with `new` (echo-reranker, 0.2.0) as its reranker and `old` (legacy-reranker,
/// 0.1.0) installed beside it; both log every value they are given.
fn start() -> Server {
    let dir = temp("plugin-versions");
    std::fs::create_dir_all(dir.join("plugins/acme")).unwrap();
    for (name, krate) in [("new", "echo-reranker"), ("old", "legacy-reranker")] {
        std::fs::copy(
            component(krate),
            dir.join(format!("plugins/acme/{name}.wasm")),
        )
        .unwrap();
    }
    let policies = format!(
        "[[tenants]]\nname = \"acme\"\nkeys = [{{ id = \"t\", sha256 = \"{}\" }}]\nreranker = \"new\"\n\
         [tenants.config]\nfactor = 2\ntags = [\"x\", \"y\"]\n",
        key_sha256("k-acme")
    );
    std::fs::write(dir.join("policies.toml"), policies).unwrap();
    support::collections::serve(&dir, &dir.join("collections"), &["--admin-token", ADMIN])
        .remove_on_drop(&dir)
}

/// Waits until `plugin` has logged `n` lines, and returns them.
fn lines_of(s: &Server, seen: &mut Vec<String>, plugin: &str, n: usize) -> Vec<String> {
    let want = format!("plugin=\"{plugin}\"");
    support::wait_for(
        "the plugin's log lines",
        std::time::Duration::from_secs(20),
        || {
            seen.extend(s.log_lines());
            seen.iter().filter(|l| l.contains(&want)).count() >= n
        },
    );
    seen.iter()
        .filter(|l| l.contains(&want))
        .filter_map(|l| {
            let at = l.find("gateway::plugins::bindings: ")? + "gateway::plugins::bindings: ".len();
            Some(l[at..].split(" tenant=").next()?.to_string())
        })
        .collect()
}

#[test]
fn both_contract_versions_serve_side_by_side() {
    let s = start();
    let docs = json!([
        {"text": "low", "priority": 1, "tier": "gold", "tags": ["vip", "emea"], "open": true,
         "extra": {"a": 1}, "scores": [1, 2.5], "gone": null},
        "no metadata",
        {"text": "high", "priority": 3},
    ]);
    // Both rank by priority × factor: the numbers reached the 0.2.0 plugin as numbers and the
    // 0.1.0 one as text it could parse.
    for model in ["new", "old"] {
        let (st, body) = s.post_as(
            "k-acme",
            "/v1/rerank",
            &json!({"model": model, "query": "q", "documents": docs}),
        );
        assert_eq!(st, 200, "{model}: {body}");
        assert_eq!(rerank_order(&body), [2, 0, 1], "{model}: {body}");
        assert_eq!(body["results"][0]["relevance_score"], 6.0, "{body}");
    }
    // A `/v1/rerank` document's other fields, in name order: objects as their JSON, a list of
    // numbers as a list of their text, nulls left out; no key the client did not send.
    let mut seen = Vec::new();
    let new = lines_of(&s, &mut seen, "new", 4);
    assert_eq!(new[0], "config factor=2 tags=list:x|y");
    assert_eq!(
        new[1],
        r#"0 doc=-: extra=text:{"a":1} open=boolean:true priority=number:1 scores=list:1|2.5 tags=list:vip|emea tier=text:gold"#
    );
    assert_eq!(new[2..], ["1 doc=-: ", "2 doc=-: priority=number:3"]);
    let old = lines_of(&s, &mut seen, "old", 4);
    assert_eq!(old[0], "config factor=2 tags=x,y");
    assert_eq!(
        old[1],
        r#"0: extra={"a":1} open=true priority=1 scores=1,2.5 tags=vip,emea tier=gold"#
    );

    let (st, list) = s.request("GET", "/admin/plugins", vec![], Some(ADMIN));
    assert_eq!(st, 200, "{list}");
    let version = |name: &str| {
        list["data"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["name"] == name)
            .map(|p| p["wit_version"].clone())
    };
    assert_eq!(version("new"), Some(json!("0.2.0")), "{list}");
    assert_eq!(version("old"), Some(json!("0.1.0")), "{list}");
}

#[test]
fn rerank_and_search_render_metadata_alike_for_each_version() {
    let s = start();
    let text = "Export invoices as CSV from the billing page.";
    let meta = json!({"priority": 3, "tier": "gold", "tags": ["vip", "emea"], "open": true});
    let mut doc = meta.clone();
    doc["text"] = json!(text);
    assert_eq!(
        s.post_as("k-acme", "/v1/collections", &json!({"name": "kb"}))
            .0,
        201
    );
    let (st, body) = s.post_as(
        "k-acme",
        "/v1/collections/kb/documents",
        &json!({"documents": [{"id": "inv-1", "text": text, "metadata": meta}]}),
    );
    assert!(st == 200 || st == 201, "{st} {body}");
    for model in ["new", "old"] {
        let (st, body) = s.post_as(
            "k-acme",
            "/v1/rerank",
            &json!({"model": model, "query": "export invoices", "documents": [doc]}),
        );
        assert_eq!(st, 200, "{body}");
        let (st, body) = s.post_as(
            "k-acme",
            "/v1/collections/kb/search",
            &json!({"query": "export invoices", "rerank": model}),
        );
        assert_eq!(st, 200, "{body}");
        assert_eq!(body["data"][0]["scores"]["rerank"], 6.0, "{body}");
    }
    let mut seen = Vec::new();
    // 0.2.0: the same typed values from both; search names the document in its own field and
    // adds no metadata key.
    let fields = "open=boolean:true priority=number:3 tags=list:vip|emea tier=text:gold";
    let config = "config factor=2 tags=list:x|y";
    assert_eq!(
        lines_of(&s, &mut seen, "new", 4),
        [
            config,
            &format!("0 doc=-: {fields}"),
            config,
            &format!("0 doc=inv-1: {fields}")
        ],
    );
    // 0.1.0: the same values as text, lists joined with commas, from both.
    let fields = "0: open=true priority=3 tags=vip,emea tier=gold";
    let config = "config factor=2 tags=x,y";
    assert_eq!(
        lines_of(&s, &mut seen, "old", 4),
        [config, fields, config, fields]
    );
}
