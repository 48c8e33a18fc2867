//! Search and retrieval: the native embedding model, and per-tenant collections with BM25
//! (tantivy) and vector (hnsw_rs) indexes, filters and fusion.
//!
//! Must not depend on the HTTP server or the generation engine.

pub mod bm25;
pub mod chunk;
pub mod collection;
pub mod embedder;
pub mod eval;
pub mod filter;
pub mod fusion;
pub mod request;
mod store;
pub mod vectors;

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::RwLock;

use collection::{Collection, Settings};
use embedder::{EmbedError, Embedder};

#[derive(Debug, thiserror::Error)]
pub enum SearchError {
    #[error("{0}")]
    Invalid(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Internal(String),
}

impl SearchError {
    fn embed(e: EmbedError) -> Self {
        match e {
            EmbedError::Model(_) | EmbedError::Load { .. } => Self::Internal(e.to_string()),
            _ => Self::Invalid(e.to_string()),
        }
    }
}

/// What a create request may choose; the rest comes from the server's defaults.
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateOptions {
    pub chunk_tokens: Option<usize>,
    pub chunk_overlap: Option<usize>,
    pub language: Option<String>,
    pub stemming: Option<bool>,
    pub stop_words: Option<bool>,
    pub embedding_model: Option<String>,
}

/// Every tenant's collections, under `root/<tenant>/<collection>/`.
pub struct Collections {
    root: PathBuf,
    embedders: BTreeMap<String, Arc<Embedder>>,
    default_embedder: Option<String>,
    open: RwLock<HashMap<(String, String), Arc<Collection>>>,
}

pub fn valid_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_' || b == b'.')
        && !name.starts_with('.');
    if ok {
        Ok(())
    } else {
        Err(format!(
            "collection name {name:?} must be 1-64 characters of letters, digits, '-', '_' or '.', not starting with '.'"
        ))
    }
}

impl Collections {
    /// Opens every collection found under `root`. One that cannot be opened (its embedding
    /// model is not loaded, its store is unreadable) is skipped with an error in the log, and
    /// its files are left alone.
    pub fn open(root: PathBuf, embedders: BTreeMap<String, Arc<Embedder>>) -> Self {
        let default_embedder = embedders.keys().next().cloned();
        let this = Self {
            root,
            embedders,
            default_embedder,
            open: RwLock::new(HashMap::new()),
        };
        let tenants = std::fs::read_dir(&this.root)
            .into_iter()
            .flatten()
            .flatten();
        for t in tenants {
            let tenant = t.file_name().to_string_lossy().to_string();
            for c in std::fs::read_dir(t.path()).into_iter().flatten().flatten() {
                let name = c.file_name().to_string_lossy().to_string();
                if !c.path().join("store.sqlite").exists() {
                    continue;
                }
                let started = std::time::Instant::now();
                match this.load(&tenant, &name) {
                    Ok(col) => {
                        tracing::info!(
                            tenant,
                            collection = name,
                            documents = col.documents(),
                            chunks = col.chunks(),
                            seconds = started.elapsed().as_secs_f32(),
                            "collection opened"
                        );
                        this.open
                            .write()
                            .insert((tenant.clone(), name), Arc::new(col));
                    }
                    Err(e) => {
                        tracing::error!(tenant, collection = name, error = %e, "collection not opened")
                    }
                }
            }
        }
        this
    }

    fn load(&self, tenant: &str, name: &str) -> Result<Collection, SearchError> {
        let dir = self.root.join(tenant).join(name);
        let settings = rusqlite::Connection::open(dir.join("store.sqlite"))
            .and_then(|db| {
                db.query_row("SELECT value FROM meta WHERE key = 'settings'", [], |r| {
                    r.get::<_, String>(0)
                })
            })
            .map_err(|e| SearchError::Internal(e.to_string()))?;
        let settings: Settings =
            serde_json::from_str(&settings).map_err(|e| SearchError::Internal(e.to_string()))?;
        let embedder = self
            .embedders
            .get(&settings.embedding_model)
            .ok_or_else(|| {
                SearchError::Internal(format!(
                    "embedding model `{}` is not loaded",
                    settings.embedding_model
                ))
            })?;
        Collection::open(name, &dir, embedder.clone(), None)
    }

    pub fn get(&self, tenant: &str, name: &str) -> Result<Arc<Collection>, SearchError> {
        self.open
            .read()
            .get(&(tenant.to_string(), name.to_string()))
            .cloned()
            .ok_or_else(|| SearchError::NotFound(format!("No collection named `{name}`.")))
    }

    /// The tenant's collections, by name.
    pub fn list(&self, tenant: &str) -> Vec<Arc<Collection>> {
        let mut v: Vec<_> = self
            .open
            .read()
            .iter()
            .filter(|((t, _), _)| t == tenant)
            .map(|(_, c)| c.clone())
            .collect();
        v.sort_by(|a, b| a.name.cmp(&b.name));
        v
    }

    pub fn create(
        &self,
        tenant: &str,
        name: &str,
        opts: CreateOptions,
    ) -> Result<Arc<Collection>, SearchError> {
        valid_name(name).map_err(SearchError::Invalid)?;
        let model = opts
            .embedding_model
            .or_else(|| self.default_embedder.clone())
            .ok_or_else(|| {
                SearchError::Invalid(
                    "No embedding model is loaded; start the gateway with --embedding-model."
                        .into(),
                )
            })?;
        let embedder = self.embedders.get(&model).ok_or_else(|| {
            SearchError::Invalid(format!("No embedding model named `{model}` is loaded."))
        })?;
        let max_chunk = embedder.max_tokens - 2;
        let chunk_tokens = opts.chunk_tokens.unwrap_or(200.min(max_chunk));
        if chunk_tokens == 0 || chunk_tokens > max_chunk {
            return Err(SearchError::Invalid(format!(
                "`chunk_tokens` must be 1 to {max_chunk} for embedding model `{model}`"
            )));
        }
        let chunk_overlap = opts.chunk_overlap.unwrap_or(chunk_tokens / 5);
        if chunk_overlap * 2 > chunk_tokens {
            return Err(SearchError::Invalid(
                "`chunk_overlap` must be at most half of `chunk_tokens`".into(),
            ));
        }
        let mut analysis = bm25::Analysis::default();
        analysis.language = opts.language.unwrap_or(analysis.language);
        analysis.stemming = opts.stemming.unwrap_or(analysis.stemming);
        analysis.stop_words = opts.stop_words.unwrap_or(analysis.stop_words);
        analysis.validate().map_err(SearchError::Invalid)?;
        let settings = Settings {
            chunk_tokens,
            chunk_overlap,
            analysis,
            embedding_model: model,
            dimensions: embedder.dim,
            created: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        let mut open = self.open.write();
        let key = (tenant.to_string(), name.to_string());
        let dir = self.root.join(tenant).join(name);
        if open.contains_key(&key) || dir.exists() {
            return Err(SearchError::Conflict(format!(
                "A collection named `{name}` already exists."
            )));
        }
        let col =
            Collection::open(name, &dir, embedder.clone(), Some(&settings)).inspect_err(|_| {
                let _ = std::fs::remove_dir_all(&dir);
            })?;
        let col = Arc::new(col);
        open.insert(key, col.clone());
        Ok(col)
    }

    /// Removes a collection and its files. Searches already running finish on their handle.
    pub fn delete(&self, tenant: &str, name: &str) -> Result<(), SearchError> {
        let key = (tenant.to_string(), name.to_string());
        if self.open.write().remove(&key).is_none() {
            return Err(SearchError::NotFound(format!(
                "No collection named `{name}`."
            )));
        }
        std::fs::remove_dir_all(self.root.join(tenant).join(name))
            .map_err(|e| SearchError::Internal(format!("removing the collection's files: {e}")))
    }
}
