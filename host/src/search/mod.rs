//! Search and retrieval: the native embedding model, and per-tenant collections with BM25
//! (tantivy) and vector (hnsw_rs) indexes, filters and fusion.
//!
//! Must not depend on the HTTP server or the generation engine.

pub mod bm25;
pub mod chunk;
pub mod collection;
pub mod embedder;
mod encoder;
pub mod eval;
pub mod filter;
pub mod fusion;
mod query;
pub mod request;
mod store;
pub mod vectors;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use collection::{Collection, Settings};
pub use collection::{DocChange, Replica};
use embedder::{EmbedError, Embedder};
pub use store::{NewChunk, NewDoc};

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
    /// The store shared with other replicas did not answer.
    #[error("{0}")]
    Unavailable(String),
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
/// Turns a failure of `what` (a store, an index) into an `Internal` error.
fn internal(what: &str) -> impl Fn(&dyn std::fmt::Display) -> SearchError + '_ {
    move |e| SearchError::Internal(format!("{what}: {e}"))
}

#[derive(Debug, Default)]
pub struct CreateOptions {
    pub chunk_tokens: Option<usize>,
    pub chunk_overlap: Option<usize>,
    pub language: Option<String>,
    pub stemming: Option<bool>,
    pub stop_words: Option<bool>,
    pub embedding_model: Option<String>,
}

/// Every tenant's collections. Each incarnation of a collection has its own folder,
/// `root/<tenant>/<name>@<id>/`, so a request still finishing on a deleted collection can never
/// touch the files of a new one created under the same name.
pub struct Collections {
    root: PathBuf,
    embedders: BTreeMap<String, Arc<Embedder>>,
    default_embedder: Option<String>,
    open: RwLock<HashMap<(String, String), Arc<Collection>>>,
    /// Names being created (their files are written outside the `open` lock).
    creating: Mutex<HashSet<(String, String)>>,
    /// The durable store shared with other replicas, when there is one.
    shared: std::sync::OnceLock<Arc<dyn Replica>>,
}

/// Written into a collection's folder before its files are removed: a folder left half-deleted
/// by a crash is finished off at the next start instead of coming back.
const DELETED: &str = "DELETED";

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
            creating: Mutex::new(HashSet::new()),
            shared: Default::default(),
        };
        let tenants = std::fs::read_dir(&this.root)
            .into_iter()
            .flatten()
            .flatten();
        for t in tenants {
            let tenant = t.file_name().to_string_lossy().to_string();
            for c in std::fs::read_dir(t.path()).into_iter().flatten().flatten() {
                let dir = c.path();
                let folder = c.file_name().to_string_lossy().to_string();
                let name = folder.rsplit_once('@').map_or(folder.as_str(), |(n, _)| n);
                if dir.join(DELETED).exists() {
                    let _ = std::fs::remove_dir_all(&dir);
                    continue;
                }
                if valid_name(name).is_err() || !dir.join("store.sqlite").exists() {
                    continue;
                }
                let started = std::time::Instant::now();
                match this.load(name, &dir) {
                    Ok(col) => {
                        tracing::info!(
                            tenant,
                            collection = name,
                            documents = col.documents(),
                            chunks = col.chunks(),
                            seconds = started.elapsed().as_secs_f32(),
                            "collection opened"
                        );
                        let key = (tenant.clone(), name.to_string());
                        let mut open = this.open.write();
                        let newer = open
                            .get(&key)
                            .is_none_or(|o| o.settings.created <= col.settings.created);
                        if newer {
                            open.insert(key, Arc::new(col));
                        }
                    }
                    Err(e) => {
                        tracing::error!(tenant, collection = name, error = %e, "collection not opened")
                    }
                }
            }
        }
        this
    }

    fn load(&self, name: &str, dir: &Path) -> Result<Collection, SearchError> {
        let embedder = |s: &Settings| {
            self.embedders
                .get(&s.embedding_model)
                .cloned()
                .ok_or_else(|| {
                    SearchError::Internal(format!(
                        "embedding model `{}` is not loaded",
                        s.embedding_model
                    ))
                })
        };
        Collection::open(name, dir, embedder, None)
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
        if chunk_overlap > chunk_tokens / 2 {
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
        let key = (tenant.to_string(), name.to_string());
        {
            let open = self.open.read();
            let mut creating = self.creating.lock();
            if open.contains_key(&key) || !creating.insert(key.clone()) {
                return Err(SearchError::Conflict(format!(
                    "A collection named `{name}` already exists."
                )));
            }
        }
        let dir = self
            .root
            .join(tenant)
            .join(format!("{name}@{:016x}", rand::random::<u64>()));
        if let Some(shared) = self.shared.get() {
            let incarnation = dir.file_name().expect("named").to_string_lossy();
            if let Err(e) = shared.create(tenant, name, &incarnation, &settings) {
                self.creating.lock().remove(&key);
                return Err(e);
            }
        }
        let made = Collection::open(name, &dir, |_| Ok(embedder.clone()), Some(&settings))
            .inspect_err(|_| {
                let _ = std::fs::remove_dir_all(&dir);
            });
        let result = made.map(|c| {
            let c = self.attach(c);
            self.open.write().insert(key.clone(), c.clone());
            c
        });
        self.creating.lock().remove(&key);
        result
    }

    /// Removes a collection and its files. Searches already running finish on their handle;
    /// writes still running finish first, and later writes through an old handle are refused.
    pub fn delete(&self, tenant: &str, name: &str) -> Result<(), SearchError> {
        let key = (tenant.to_string(), name.to_string());
        if let Some(shared) = self.shared.get() {
            shared.delete(tenant, name)?;
            // The follower may have removed it here already.
            return match self.open.write().remove(&key) {
                Some(col) => Self::remove_files(&col),
                None => Ok(()),
            };
        }
        let Some(col) = self.open.write().remove(&key) else {
            return Err(SearchError::NotFound(format!(
                "No collection named `{name}`."
            )));
        };
        Self::remove_files(&col)
    }

    fn remove_files(col: &Collection) -> Result<(), SearchError> {
        col.close();
        let dir = col.dir.clone();
        std::fs::write(dir.join(DELETED), b"")
            .and_then(|()| std::fs::remove_dir_all(&dir))
            .map_err(|e| SearchError::Internal(format!("removing the collection's files: {e}")))
    }

    /// From now on collections are created, deleted and written through `shared`, and the
    /// ones open here follow it.
    pub fn share(&self, shared: Arc<dyn Replica>) {
        for c in self.open.read().values() {
            let _ = c.shared.set(shared.clone());
        }
        let _ = self.shared.set(shared);
    }

    fn attach(&self, c: Collection) -> Arc<Collection> {
        if let Some(s) = self.shared.get() {
            let _ = c.shared.set(s.clone());
        }
        Arc::new(c)
    }

    /// Snapshots every collection's vector graph (at shutdown), so the next start loads the
    /// graphs instead of rebuilding them.
    pub fn save_graphs(&self) {
        for c in self.all() {
            let started = std::time::Instant::now();
            match c.save_graph() {
                Ok(()) => {
                    tracing::info!(collection = %c.name, chunks = c.chunks(), seconds = started.elapsed().as_secs_f32(), "vector graph saved")
                }
                Err(e) => {
                    tracing::warn!(collection = %c.name, error = %e, "cannot save the vector graph; it is rebuilt at the next start")
                }
            }
        }
    }

    /// Every open collection, of every tenant.
    pub fn all(&self) -> Vec<Arc<Collection>> {
        self.open.read().values().cloned().collect()
    }

    /// Brings this replica in line with the shared store's view of one collection name:
    /// `settings` for its live incarnation (opened here, its files made if new), `None` when
    /// it has none (an incarnation open here is removed).
    pub fn follow(
        &self,
        tenant: &str,
        name: &str,
        incarnation: &str,
        settings: Option<Settings>,
    ) -> Result<(), SearchError> {
        let key = (tenant.to_string(), name.to_string());
        if self.creating.lock().contains(&key) {
            // Being created here: `create` opens it.
            return Ok(());
        }
        let current = self.open.read().get(&key).cloned();
        let same = current
            .as_ref()
            .is_some_and(|c| c.incarnation() == incarnation);
        let Some(settings) = settings else {
            if let (true, Some(c)) = (same, current) {
                self.open.write().remove(&key);
                return Self::remove_files(&c);
            }
            return Ok(());
        };
        if same {
            return Ok(());
        }
        valid_name(name).map_err(SearchError::Invalid)?;
        let embedder = self
            .embedders
            .get(&settings.embedding_model)
            .cloned()
            .ok_or_else(|| {
                SearchError::Internal(format!(
                    "embedding model `{}` is not loaded",
                    settings.embedding_model
                ))
            })?;
        let dir = self.root.join(tenant).join(incarnation);
        let create = (!dir.join("store.sqlite").exists()).then_some(&settings);
        let col = self.attach(Collection::open(name, &dir, |_| Ok(embedder), create)?);
        let old = self.open.write().insert(key, col);
        match old {
            Some(old) => Self::remove_files(&old),
            None => Ok(()),
        }
    }
}
