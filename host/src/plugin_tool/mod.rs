//! `gateway plugin check` and `gateway plugin run`: a plugin author's loop without a server or
//! a model. `check` runs the loader's full validation (component, world, imports) and says
//! what the file is; `run` makes one call in the same sandbox as the server (same deadline and
//! memory cap, from the same `[plugins]` settings) and prints the result and its timing.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context};
use serde_json::{json, Value};

use crate::config::PluginsConfig;
use crate::plugins::{
    Candidate, ChatRequest, ContextChunk, Message, Plugin, PluginKind, Registry, RenderedPrompt,
    Runtime,
};

fn load(path: &Path, cfg: &PluginsConfig) -> anyhow::Result<(Arc<Plugin>, Arc<Runtime>, f64)> {
    let wasm = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let rt = Runtime::new(cfg).map_err(|e| anyhow!("starting the plugin runtime: {e}"))?;
    let registry = Registry::new(rt.clone(), None);
    let started = Instant::now();
    let plugin = registry
        .install("local", "plugin", &wasm, None)
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    Ok((plugin, rt, started.elapsed().as_secs_f64() * 1e3))
}

/// What `check` prints for a component that loads; an error says why it does not.
pub fn check(path: &Path, cfg: &PluginsConfig) -> anyhow::Result<String> {
    let (p, _, ms) = load(path, cfg)?;
    Ok(format!(
        "{}: a {} plugin (world `{}` of gateway:plugins@0.1.0), {} bytes, sha256 {}, compiled and linked in {ms:.0} ms",
        path.display(),
        p.kind(),
        p.kind(),
        p.size,
        p.sha256
    ))
}

fn text(v: &Value, key: &str) -> anyhow::Result<String> {
    v[key]
        .as_str()
        .map(String::from)
        .ok_or_else(|| anyhow!("the input needs a string `{key}`"))
}

fn opt_text(v: &Value, key: &str) -> Option<String> {
    v[key].as_str().map(String::from)
}

fn list<'a>(v: &'a Value, key: &str) -> &'a [Value] {
    v[key].as_array().map_or(&[], Vec::as_slice)
}

/// One call with `input` (the world's arguments as JSON: see the README), with the tenant
/// configuration `config`. Returns the result as JSON, with the call's time in ms.
pub async fn run(
    path: &Path,
    input: &Value,
    config: BTreeMap<String, String>,
    cfg: &PluginsConfig,
) -> anyhow::Result<Value> {
    let (p, rt, compile_ms) = load(path, cfg)?;
    let values = Arc::new(config);
    let started = Instant::now();
    let fail = |e: crate::plugins::CallError| anyhow!("the plugin {e}");
    let result = match p.kind() {
        PluginKind::PromptTemplate => {
            let request = ChatRequest {
                model: opt_text(input, "model").unwrap_or_else(|| "local".into()),
                messages: list(input, "messages")
                    .iter()
                    .map(|m| {
                        Ok(Message {
                            role: text(m, "role")?,
                            content: text(m, "content")?,
                            name: opt_text(m, "name"),
                        })
                    })
                    .collect::<anyhow::Result<_>>()?,
                context: list(input, "context")
                    .iter()
                    .map(|c| {
                        Ok(ContextChunk {
                            id: text(c, "id")?,
                            text: text(c, "text")?,
                            title: opt_text(c, "title"),
                        })
                    })
                    .collect::<anyhow::Result<_>>()?,
            };
            match p.render(&rt, &values, &request).await.map_err(fail)? {
                RenderedPrompt::Prompt(t) => json!({"prompt": t}),
                RenderedPrompt::Messages(ms) => json!({"messages": ms
                    .iter()
                    .map(|m| json!({"role": m.role, "content": m.content, "name": m.name}))
                    .collect::<Vec<_>>()}),
            }
        }
        PluginKind::Reranker => {
            let candidates: Vec<Candidate> = list(input, "candidates")
                .iter()
                .map(|c| {
                    let metadata = c["metadata"]
                        .as_object()
                        .map(|m| {
                            m.iter()
                                .map(|(k, v)| {
                                    (k.clone(), v.as_str().map_or(v.to_string(), String::from))
                                })
                                .collect()
                        })
                        .unwrap_or_default();
                    Ok(Candidate {
                        id: text(c, "id")?,
                        text: text(c, "text")?,
                        metadata,
                        score: c["score"].as_f64().unwrap_or(0.0) as f32,
                    })
                })
                .collect::<anyhow::Result<_>>()?;
            let query = text(input, "query")?;
            let mut scored = p
                .rerank(&rt, &values, &query, &candidates)
                .await
                .map_err(fail)?;
            scored.sort_by(|a, b| b.score.total_cmp(&a.score));
            json!({"results": scored.iter().map(|s| json!({"id": s.id, "score": s.score})).collect::<Vec<_>>()})
        }
        PluginKind::OutputParser => {
            let schema = match &input["schema"] {
                Value::Null => None,
                Value::String(s) => Some(s.clone()),
                v => Some(v.to_string()),
            };
            let parsed = p
                .parse(&rt, &values, &text(input, "text")?, schema.as_deref())
                .await
                .map_err(fail)?;
            json!({"json": serde_json::from_str::<Value>(&parsed.json)?, "repairs": parsed.repairs})
        }
        PluginKind::LogitsProcessor => bail!(
            "`run` takes prompt templates, rerankers and output parsers; a logits processor needs \
             a model's vocabulary: test it with guest_sdk::testing, or bind it on a gateway"
        ),
    };
    let call_ms = started.elapsed().as_secs_f64() * 1e3;
    Ok(json!({"kind": p.kind().as_str(), "result": result,
              "compile_ms": compile_ms, "call_ms": call_ms}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_name_what_is_missing() {
        let v = json!({"query": 3});
        assert!(text(&v, "query")
            .unwrap_err()
            .to_string()
            .contains("`query`"));
        assert_eq!(list(&v, "candidates").len(), 0);
        assert_eq!(
            opt_text(&json!({"name": "a"}), "name").as_deref(),
            Some("a")
        );
    }

    #[test]
    fn a_file_that_is_not_a_component_is_one_clear_line() {
        let dir = std::env::temp_dir().join(format!("plugin-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x.wasm");
        std::fs::write(&f, b"\0asm\x01\0\0\0").unwrap();
        let err = check(&f, &PluginsConfig::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("core WebAssembly module"), "{err}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
