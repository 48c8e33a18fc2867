//! The request pipeline between the HTTP edge and the domains. A generation request goes
//! admission (`tenancy`) → grounding (client passages, RAG retrieval: `grounding`,
//! `retrieval`) → prompt stage (template plugin or the model's chat template: `prompt`) →
//! logits processors (`processors`) → engine (local) or upstream → output stage (the tenant's parser: `output`) → settlement of
//! the reservation. Search and `/v1/rerank` use the same retrieval and plugin stages.
//!
//! Each stage takes the admitted `Caller` and the handles it needs (`PluginCalls`,
//! `Retrieval`), never the server's state, and fails with a typed `Error` that the edge maps to
//! a status and an OpenAI error body once (`server/error.rs`). Nothing here knows HTTP.

pub mod cache;
pub mod chat;
pub mod completion;
pub mod constraint;
pub mod embeddings;
mod error;
pub mod generation;
pub mod grounding;
pub mod ingest;
pub mod openai;
pub mod output;
pub mod plugin_calls;
pub mod processors;
pub mod prompt;
pub mod responses;
pub mod retrieval;
pub mod upstream;

pub use error::{Error, PluginFailure, UpstreamFailure};
pub use plugin_calls::PluginCalls;
pub use retrieval::Retrieval;

/// The handles the pipeline's stages take.
pub struct Stages {
    pub plugins: PluginCalls,
    pub retrieval: Retrieval,
    pub processors: processors::ProcessorStage,
    pub tenancy: std::sync::Arc<crate::tenancy::Tenancy>,
    pub metrics: std::sync::Arc<crate::metrics::Metrics>,
    pub cache: cache::CacheStage,
}

/// A request body as the object every endpoint's body is.
pub fn into_object(
    v: serde_json::Value,
) -> Result<serde_json::Map<String, serde_json::Value>, Error> {
    match v {
        serde_json::Value::Object(m) => Ok(m),
        _ => Err(Error::Json(serde::de::Error::custom(
            "the request body must be a JSON object",
        ))),
    }
}

/// Runs `f` on the blocking pool (tokenizers, encoders, indexes, plugins, compilation: work
/// that must not stall the runtime's I/O threads); a panic there fails the request, naming
/// `what`.
pub async fn blocking<T: Send + 'static>(
    what: &'static str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Error> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::Task {
            what,
            cause: e.to_string(),
        })
}
