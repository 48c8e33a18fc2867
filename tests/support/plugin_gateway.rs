//! A gateway with real tenant plugin components (built from `plugins/` and `tests/plugins/`)
//! in its plugin folder, and the helpers the plugin tests share.

use std::path::PathBuf;

use serde_json::{json, Value};

use super::wasm::component;
use super::{key_sha256, model_path, rerank_order, Server, MODEL};

pub const ADMIN: &str = "admin-token-for-tests-0123";
pub const PERSONA: &str = "You are Ava, the support assistant of Acme CRM.";
pub const CITE: &str = "Cite sources as [n].";

/// A gateway whose plugin folder holds tenant `acme`'s real plugins and tenant `badco`'s
/// faulty ones. Returns the server and the plugin folder.
pub fn start() -> (Server, PathBuf) {
    start_with("")
}

/// Like `start`, with more `[plugins]` settings (TOML lines).
pub fn start_with(plugin_settings: &str) -> (Server, PathBuf) {
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
        ("oddrole", "narrator", "bad-template"),
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
[[tenants]]
name = "oddrole"
keys = [{{ id = "odd-test", sha256 = "{odd}" }}]
prompt_template = "narrator"
"#,
        acme = key_sha256("sk-acme"),
        bad = key_sha256("sk-bad"),
        plain = key_sha256("sk-plain"),
        odd = key_sha256("sk-odd"),
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

pub fn chat(messages: Value) -> Value {
    json!({"model": MODEL, "messages": messages, "temperature": 0, "max_tokens": 12})
}

pub fn failures(s: &Server, tenant: &str, plugin: &str, cause: &str) -> f64 {
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

pub fn rerank_docs() -> Value {
    json!([
        {"text": "Export invoices as PDF from the billing tab", "tier": "free"},
        "Reset a password",
        {"text": "Export contacts", "tier": "enterprise"},
    ])
}

/// Index order of a rerank of three documents as tenant acme (with `model`, if given).
pub fn acme_order(s: &Server, model: Option<&str>) -> Result<Vec<u64>, (u16, Value)> {
    let mut req = json!({"query": "export invoices", "documents": ["export invoices", "reset", "export contacts"]});
    if let Some(m) = model {
        req["model"] = json!(m);
    }
    let (st, body) = s.post_as("sk-acme", "/v1/rerank", &req);
    if st != 200 {
        return Err((st, body));
    }
    Ok(rerank_order(&body))
}
