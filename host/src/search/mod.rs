//! Search and retrieval. So far: the native embedding model behind `/v1/embeddings`.
//!
//! Must not depend on the HTTP server or the generation engine.

pub mod embedder;
