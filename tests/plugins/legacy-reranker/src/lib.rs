//! A reranker built against `gateway:plugins@0.1.0`, where metadata and configuration are
//! text: it scores each candidate by its `priority` field times the tenant's `factor`, and
//! logs every value it was given, so a test can see how typed values reach an old plugin.

wit_bindgen::generate!({
    world: "reranker",
    path: "../../../wit/0.1.0",
});

use gateway::plugins::host::{config_get, log, LogLevel};

struct Plugin;

impl Guest for Plugin {
    fn rerank(_query: String, candidates: Vec<Candidate>) -> Result<Vec<Scored>, PluginError> {
        let factor = match config_get("factor") {
            Some(f) => f.parse::<f32>().map_err(|_| PluginError {
                code: "invalid-config".into(),
                message: format!("factor {f:?} is not a number"),
            })?,
            None => 1.0,
        };
        let tags = config_get("tags").unwrap_or_default();
        log(
            LogLevel::Info,
            &format!("config factor={factor} tags={tags}"),
        );
        Ok(candidates
            .into_iter()
            .map(|c| {
                let fields: Vec<String> =
                    c.metadata.iter().map(|(k, v)| format!("{k}={v}")).collect();
                log(LogLevel::Info, &format!("{}: {}", c.id, fields.join(" ")));
                let priority = c
                    .metadata
                    .iter()
                    .find(|(k, _)| k == "priority")
                    .and_then(|(_, v)| v.parse::<f32>().ok())
                    .unwrap_or(0.0);
                Scored {
                    id: c.id,
                    score: priority * factor,
                }
            })
            .collect())
    }
}

export!(Plugin);
