//! A gateway with collections (the real all-MiniLM-L6-v2 encoder), its tenants and a small
//! knowledge base, shared by the search test binaries.

use std::path::{Path, PathBuf};

use serde_json::{json, Value};

use super::{key_sha256, wasm::component, Server};

pub const EMBED: &str = "all-minilm-l6-v2";

pub fn embed_arg() -> String {
    format!(
        "{EMBED}={}",
        concat!(env!("CARGO_MANIFEST_DIR"), "/../models/all-MiniLM-L6-v2")
    )
}

pub fn temp(what: &str) -> PathBuf {
    std::env::temp_dir().join(format!(
        "gateway-e2e-{what}-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ))
}

/// A gateway with tenants acme (reranker plugin `ranker`), globex, narrow (may only use
/// collection `allowed`), helpdesk (retrieves from its `kb` by default) and metered (1,000
/// tokens a day), keeping collections in `collections`.
pub fn start(dir: &Path, collections: &Path) -> Server {
    std::fs::create_dir_all(dir.join("plugins/acme")).unwrap();
    std::fs::copy(
        component("crm-field-reranker"),
        dir.join("plugins/acme/ranker.wasm"),
    )
    .unwrap();
    let policies = format!(
        r#"
[[tenants]]
name = "acme"
keys = [{{ id = "t", sha256 = "{}" }}]
reranker = "ranker"
[[tenants]]
name = "globex"
keys = [{{ id = "t", sha256 = "{}" }}]
[[tenants]]
name = "narrow"
keys = [{{ id = "t", sha256 = "{}" }}]
collections = ["allowed"]
[[tenants]]
name = "helpdesk"
keys = [{{ id = "t", sha256 = "{}" }}]
rag = {{ collection = "kb", top_k = 1 }}
[[tenants]]
name = "metered"
keys = [{{ id = "t", sha256 = "{}" }}]
token_budget = {{ tokens = 1000, period = "day" }}
"#,
        key_sha256("k-acme"),
        key_sha256("k-globex"),
        key_sha256("k-narrow"),
        key_sha256("k-helpdesk"),
        key_sha256("k-metered")
    );
    std::fs::write(dir.join("policies.toml"), policies).unwrap();
    serve(dir, collections, &[])
}

/// A gateway with the real encoder, the policies in `dir/policies.toml`, the plugins in
/// `dir/plugins` and collections kept in `collections`, plus `extra` arguments.
pub fn serve(dir: &Path, collections: &Path, extra: &[&str]) -> Server {
    let embed = embed_arg();
    let policies = dir.join("policies.toml");
    let plugins = dir.join("plugins");
    let mut args = vec![
        "--embedding-model",
        &embed,
        "--policies",
        policies.to_str().unwrap(),
        "--plugins-dir",
        plugins.to_str().unwrap(),
        "--collections-dir",
        collections.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    Server::start(&args)
}

pub fn kb() -> Value {
    json!({"documents": [
        {"id": "refund-policy", "text": "Refunds are issued to the original payment method within five business days after the returned item is received.", "metadata": {"team": "billing", "year": 2024, "tags": ["refund", "payments"]}},
        {"id": "invoice-export", "text": "Administrators can export all invoices as CSV from the Billing settings page, filtered by date range.", "metadata": {"team": "billing", "year": 2022, "tags": ["invoices", "export"]}},
        {"id": "password-reset", "text": "To reset a forgotten password, click 'Forgot password' on the sign-in screen and follow the emailed link.", "metadata": {"team": "support", "year": 2023, "tags": ["login"]}},
        {"id": "sso-setup", "text": "Single sign-on with SAML is configured by an owner under Security, using the identity provider's metadata URL.", "metadata": {"team": "support", "year": 2024, "tags": ["login", "security"]}},
        {"id": "pipeline-stages", "text": "Sales pipelines have customizable stages; drag a deal card between columns to move an opportunity forward.", "metadata": {"team": "sales", "year": 2021, "tags": ["deals"]}},
    ]})
}

pub fn search(s: &Server, k: &str, col: &str, body: Value) -> (u16, Value) {
    s.post_as(k, &format!("/v1/collections/{col}/search"), &body)
}

pub fn ids(v: &Value) -> Vec<String> {
    v["data"]
        .as_array()
        .unwrap_or(&Vec::new())
        .iter()
        .map(|h| h["id"].as_str().unwrap().to_string())
        .collect()
}
