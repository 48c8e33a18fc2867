//! A reranker that logs every value it is given, with its type (`id doc=... field=type:value`),
//! and scores each candidate by its numeric `priority` field times the tenant's `factor`: how
//! typed metadata and configuration reach a 0.2.0 plugin, beside `legacy-reranker` (0.1.0).

use guest_sdk::reranker::{config, log, Candidate, Guest, LogLevel, PluginError, Scored, Value};

struct Plugin;

fn typed(v: &Value) -> String {
    match v {
        Value::Text(t) => format!("text:{t}"),
        Value::Number(n) => format!("number:{n}"),
        Value::Boolean(b) => format!("boolean:{b}"),
        Value::TextList(l) => format!("list:{}", l.join("|")),
    }
}

impl Guest for Plugin {
    fn rerank(_query: String, candidates: Vec<Candidate>) -> Result<Vec<Scored>, PluginError> {
        let factor = config("factor").and_then(|f| f.as_number()).unwrap_or(1.0);
        let tags = config("tags").map(|t| typed(&t)).unwrap_or_default();
        log(
            LogLevel::Info,
            &format!("config factor={factor} tags={tags}"),
        );
        Ok(candidates
            .into_iter()
            .map(|c| {
                let fields: Vec<String> = c
                    .metadata
                    .iter()
                    .map(|(k, v)| format!("{k}={}", typed(v)))
                    .collect();
                let doc = c.document_id.as_deref().unwrap_or("-");
                log(
                    LogLevel::Info,
                    &format!("{} doc={doc}: {}", c.id, fields.join(" ")),
                );
                let priority = c
                    .field("priority")
                    .and_then(|p| p.as_number())
                    .unwrap_or(0.0);
                Scored {
                    score: (priority * factor) as f32,
                    id: c.id,
                }
            })
            .collect())
    }
}

guest_sdk::export_reranker!(Plugin);
