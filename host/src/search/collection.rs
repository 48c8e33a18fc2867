//! One tenant's collection: documents chunked and embedded, stored durably, indexed for BM25
//! and vectors, searched by either or both with metadata filters.
//!
//! Write path (serialised per collection): chunk + embed (no lock held) → store transaction
//! commits (the durability point; touched documents marked pending) → tantivy commit → pending
//! cleared → vector graph and in-memory catalog updated. A crash after the store commit loses
//! nothing: on open the catalog and graph are rebuilt from the store, pending documents are
//! re-indexed into tantivy, and a tantivy index that does not match the store is rebuilt. Search results are materialised from the catalog, so a chunk that
//! an index still holds after its document changed is never returned.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use super::bm25::{Analysis, Bm25};
use super::chunk;
use super::embedder::Embedder;
use super::filter::{check_metadata, Filter};
use super::fusion;
pub use super::query::{Fusion, Hit, Mode, Query, StageScores};
use super::store::{NewChunk, NewDoc, Reader, Store};
use super::vectors::Vectors;
use super::{internal, SearchError};

mod replica;
mod searching;

pub use replica::{DocChange, Replica};

/// The vector graph's snapshot folder.
const GRAPH: &str = "hnsw";

/// Longest document id, in bytes.
const MAX_ID_BYTES: usize = 512;

/// Fixed at creation; stored in the collection's database.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Settings {
    pub chunk_tokens: usize,
    pub chunk_overlap: usize,
    #[serde(flatten)]
    pub analysis: Analysis,
    pub embedding_model: String,
    pub dimensions: usize,
    pub created: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DocInput {
    pub id: String,
    pub text: String,
    #[serde(default)]
    pub metadata: Map<String, Value>,
}

struct ChunkEntry {
    doc: Arc<str>,
    start: usize,
    end: usize,
    metadata: Arc<Map<String, Value>>,
}

#[derive(Default)]
struct Catalog {
    docs: HashMap<Arc<str>, Vec<u64>>,
    chunks: HashMap<u64, ChunkEntry>,
    /// Bumped by every write under the catalog's lock: what a cached filter result is valid
    /// for (`searching::FilterCache`).
    generation: u64,
}

/// Documents chunked and tokenized, not yet embedded or stored.
pub struct Prepared {
    docs: Vec<NewDoc>,
    texts: Vec<String>,
    ids: Vec<Vec<u32>>,
    /// Tokens the embedding will process.
    pub tokens: usize,
}

pub struct Upserted {
    pub documents: usize,
    pub chunks: usize,
    pub tokens: usize,
}

pub struct Collection {
    pub name: String,
    pub settings: Settings,
    /// This incarnation's folder.
    pub dir: std::path::PathBuf,
    /// Set when the collection is deleted: writes through a handle still held are refused.
    closed: std::sync::atomic::AtomicBool,
    embedder: Arc<Embedder>,
    store: Mutex<Store>,
    /// Read-only connections for searches, so they neither queue behind writes nor each other.
    readers: Vec<Mutex<Reader>>,
    bm25: Bm25,
    vectors: Vectors,
    catalog: RwLock<Catalog>,
    /// The chunks recent filters admitted.
    filters: Mutex<searching::FilterCache>,
    writes: Mutex<()>,
    /// The store shared with other replicas, when there is one (`replica.rs`).
    pub(super) shared: std::sync::OnceLock<std::sync::Arc<dyn Replica>>,
    /// The last shared change applied here; held while applying.
    applied: Mutex<i64>,
    /// Writes applied since this open, and a random id of the open: a local collection's
    /// version (`version`).
    changes: std::sync::atomic::AtomicU64,
    opened: u64,
}

impl Settings {
    /// `create`'s settings, written to a new collection's store, or those an existing one
    /// holds.
    fn stored(
        store: &mut Store,
        create: Option<&Settings>,
        dir: &Path,
    ) -> Result<Self, SearchError> {
        let db = internal("collection store");
        match create {
            Some(s) => {
                let text = serde_json::to_string(s).map_err(|e| db(&e))?;
                store.set_meta("settings", &text).map_err(|e| db(&e))?;
                Ok(s.clone())
            }
            None => {
                let text = store.meta("settings").map_err(|e| db(&e))?.ok_or_else(|| {
                    SearchError::Internal(format!("{}: no settings", dir.display()))
                })?;
                serde_json::from_str(&text).map_err(|e| db(&e))
            }
        }
    }
}

impl Catalog {
    /// The catalog of the store's documents and live chunks, and the chunks' vectors.
    fn build(
        docs: HashMap<String, Map<String, Value>>,
        chunks: Vec<super::store::StoredChunk>,
    ) -> (Self, Vec<(u64, Vec<f32>)>) {
        let docs: HashMap<Arc<str>, Arc<Map<String, Value>>> = docs
            .into_iter()
            .map(|(id, m)| (Arc::from(id), Arc::new(m)))
            .collect();
        let mut catalog = Catalog::default();
        let mut vectors = Vec::with_capacity(chunks.len());
        for c in chunks {
            let Some((doc, meta)) = docs.get_key_value(c.doc.as_str()) else {
                continue;
            };
            catalog.docs.entry(doc.clone()).or_default().push(c.id);
            catalog.chunks.insert(
                c.id,
                ChunkEntry {
                    doc: doc.clone(),
                    start: c.start,
                    end: c.end,
                    metadata: meta.clone(),
                },
            );
            vectors.push((c.id, c.vector));
        }
        for d in docs.keys() {
            catalog.docs.entry(d.clone()).or_default();
        }
        (catalog, vectors)
    }
}

impl Collection {
    /// Opens (or, with `create`, creates) the collection stored in `dir`, with the embedding
    /// model `embedder` picks for its settings.
    pub fn open(
        name: &str,
        dir: &Path,
        embedder: impl FnOnce(&Settings) -> Result<Arc<Embedder>, SearchError>,
        create: Option<&Settings>,
    ) -> Result<Self, SearchError> {
        std::fs::create_dir_all(dir).map_err(|e| internal("creating the folder")(&e))?;
        let db = internal("collection store");
        let mut store = Store::open(&dir.join("store.sqlite")).map_err(|e| db(&e))?;
        let settings = Settings::stored(&mut store, create, dir)?;
        let embedder = embedder(&settings)?;
        if settings.dimensions != embedder.dim {
            return Err(SearchError::Internal(format!(
                "collection `{name}` holds {}-dimensional vectors but embedding model `{}` makes {}",
                settings.dimensions, embedder.name, embedder.dim
            )));
        }
        let (docs, chunks) = store.load().map_err(|e| db(&e))?;
        let applied = store
            .meta(replica::APPLIED)
            .map_err(|e| db(&e))?
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let readers = (0..4)
            .map(|_| Reader::open(&dir.join("store.sqlite")).map(Mutex::new))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| db(&e))?;
        let bm25 = Bm25::recover(
            &dir.join("bm25"),
            name,
            &settings.analysis,
            &mut store,
            chunks.len(),
        )?;
        let (catalog, vectors) = Catalog::build(docs, chunks);
        Ok(Self {
            name: name.into(),
            settings,
            dir: dir.to_path_buf(),
            closed: Default::default(),
            embedder,
            store: Mutex::new(store),
            readers,
            bm25,
            vectors: Vectors::load(&dir.join(GRAPH), &vectors)
                .unwrap_or_else(|| Vectors::build(vectors)),
            catalog: RwLock::new(catalog),
            filters: Default::default(),
            writes: Mutex::new(()),
            shared: Default::default(),
            applied: Mutex::new(applied),
            changes: Default::default(),
            opened: rand::random(),
        })
    }

    /// Changes with every write: the response cache keys RAG answers on it, so any write to
    /// the collection makes them miss. Shared collections use the shared change sequence, the
    /// same on every replica that applied it; while one is being applied, the version is one
    /// no answer was stored under (the lookup does not wait for the apply).
    pub fn version(&self) -> String {
        match self.shared.get() {
            // The folder names the incarnation: a collection deleted and made again restarts
            // its sequence.
            Some(_) => match self.applied.try_lock() {
                Some(seq) => format!("{}.s{}", self.incarnation(), *seq),
                None => format!("applying.{:x}", rand::random::<u64>()),
            },
            None => format!(
                "{:x}.{}",
                self.opened,
                self.changes.load(std::sync::atomic::Ordering::SeqCst)
            ),
        }
    }

    /// Saves a snapshot of the vector graph, so the next open need not rebuild it.
    pub fn save_graph(&self) -> std::io::Result<()> {
        let _serial = self.writes.lock();
        self.vectors.save(&self.dir.join(GRAPH))
    }

    /// Refuses further writes and waits for one in progress to finish.
    pub fn close(&self) {
        let _serial = self.writes.lock();
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    pub fn documents(&self) -> usize {
        self.catalog.read().docs.len()
    }

    pub fn chunks(&self) -> usize {
        self.catalog.read().chunks.len()
    }

    /// Inserts or replaces documents by id; returns once they are durable and searchable.
    pub fn upsert(&self, docs: Vec<DocInput>) -> Result<Upserted, SearchError> {
        self.commit(self.prepare(docs)?)
    }

    /// Validates, chunks and tokenizes documents: everything but the embedding and the write,
    /// so a caller can account for the tokens before paying for them.
    pub fn prepare(&self, docs: Vec<DocInput>) -> Result<Prepared, SearchError> {
        // Within one batch the last version of an id wins, as if sent one by one.
        let mut seen = HashSet::new();
        let mut docs: Vec<DocInput> = docs
            .into_iter()
            .rev()
            .filter(|d| seen.insert(d.id.clone()))
            .collect();
        docs.reverse();
        let mut new_docs = Vec::with_capacity(docs.len());
        let mut texts = Vec::new();
        for (i, d) in docs.into_iter().enumerate() {
            check_id(&d.id).map_err(|m| SearchError::Invalid(format!("documents[{i}]: {m}")))?;
            check_metadata(&d.metadata)
                .map_err(|m| SearchError::Invalid(format!("documents[{i}] ({}): {m}", d.id)))?;
            if d.text.trim().is_empty() {
                return Err(SearchError::Invalid(format!(
                    "documents[{i}] ({}): `text` is empty",
                    d.id
                )));
            }
            let offsets = self.embedder.offsets(&d.text).map_err(SearchError::embed)?;
            let spans = chunk::split(
                &d.text,
                &offsets,
                self.settings.chunk_tokens,
                self.settings.chunk_overlap,
            );
            if spans.is_empty() {
                return Err(SearchError::Invalid(format!(
                    "documents[{i}] ({}): `text` has no searchable content",
                    d.id
                )));
            }
            let chunks = spans
                .into_iter()
                .map(|s| {
                    texts.push(d.text[s.start..s.end].to_string());
                    NewChunk {
                        start: chunk::char_offset(&d.text, s.start),
                        end: chunk::char_offset(&d.text, s.end),
                        text: String::new(),
                        vector: Vec::new(),
                    }
                })
                .collect();
            new_docs.push(NewDoc {
                id: d.id,
                metadata: d.metadata,
                chunks,
            });
        }
        let ids = texts
            .iter()
            .map(|t| self.embedder.tokenize_truncated(t))
            .collect::<Result<Vec<_>, _>>()
            .map_err(SearchError::embed)?;
        Ok(Prepared {
            tokens: ids.iter().map(Vec::len).sum(),
            docs: new_docs,
            texts,
            ids,
        })
    }

    /// Embeds prepared documents and writes them; returns once durable and searchable.
    pub fn commit(&self, p: Prepared) -> Result<Upserted, SearchError> {
        let Prepared {
            mut docs,
            texts,
            ids,
            tokens,
        } = p;
        let new_docs = &mut docs;
        let mut vectors = self
            .embedder
            .embed(&ids)
            .map_err(SearchError::embed)?
            .into_iter();
        let mut texts = texts.into_iter();
        for c in new_docs.iter_mut().flat_map(|d| d.chunks.iter_mut()) {
            c.text = texts.next().unwrap_or_default();
            c.vector = vectors.next().unwrap_or_default();
        }
        let chunks = docs.iter().map(|d| d.chunks.len()).sum();
        let documents = docs.len();
        self.write(docs, Vec::new())?;
        Ok(Upserted {
            documents,
            chunks,
            tokens,
        })
    }

    /// Deletes documents by id; unknown ids are ignored. Returns how many existed.
    pub fn delete(&self, ids: Vec<String>) -> Result<usize, SearchError> {
        let existing: Vec<String> = {
            let cat = self.catalog.read();
            ids.into_iter()
                .filter(|id| cat.docs.contains_key(id.as_str()))
                .collect()
        };
        let n = existing.len();
        if n > 0 {
            self.write(Vec::new(), existing)?;
        }
        Ok(n)
    }

    /// Deletes every document whose metadata passes `filter`. Returns how many.
    pub fn delete_where(&self, filter: &Filter) -> Result<usize, SearchError> {
        let ids: Vec<String> = {
            let cat = self.catalog.read();
            let mut ids: Vec<String> = cat
                .chunks
                .values()
                .filter(|c| filter.matches(&c.metadata))
                .map(|c| c.doc.to_string())
                .collect();
            ids.sort();
            ids.dedup();
            ids
        };
        self.delete(ids)
    }

    fn write(&self, docs: Vec<NewDoc>, deletes: Vec<String>) -> Result<(), SearchError> {
        match self.shared.get() {
            Some(shared) => self.write_shared(&**shared, docs, deletes),
            None => self.apply(docs, deletes),
        }
    }

    fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::SeqCst)
    }

    fn save_applied(&self, seq: i64) -> Result<(), SearchError> {
        let store = self.store.lock();
        store
            .set_meta(replica::APPLIED, &seq.to_string())
            .map_err(|e| internal("collection store")(&e))
    }

    /// Writes to this replica's store and indexes.
    fn apply(&self, docs: Vec<NewDoc>, deletes: Vec<String>) -> Result<(), SearchError> {
        let _serial = self.writes.lock();
        if self.is_closed() {
            return Err(SearchError::NotFound(format!(
                "Collection `{}` was deleted.",
                self.name
            )));
        }
        let written = self
            .store
            .lock()
            .write(&docs, &deletes)
            .map_err(|e| internal("collection store")(&e))?;
        let touched: Vec<String> = written.iter().map(|w| w.doc.clone()).collect();
        let mut rows = Vec::new();
        for (d, w) in docs.iter().zip(written.iter().skip(deletes.len())) {
            for (c, id) in d.chunks.iter().zip(&w.added) {
                rows.push((*id, d.id.as_str(), c.text.as_str()));
            }
        }
        // The store has committed: the write is acknowledged whatever happens to the derived
        // indexes. A BM25 failure leaves the documents pending, replayed at the next open.
        match self.bm25.apply(&touched, &rows) {
            Ok(()) => {
                if let Err(e) = self.store.lock().clear_pending(&touched) {
                    tracing::warn!(collection = %self.name, error = %e, "could not clear pending BM25 marks");
                }
            }
            Err(e) => {
                tracing::error!(collection = %self.name, error = %e, "BM25 index update failed; the documents are stored and re-indexed at the next start")
            }
        }
        let removed: Vec<u64> = written
            .iter()
            .flat_map(|w| w.removed.iter().copied())
            .collect();
        let mut added = Vec::new();
        let mut cat = self.catalog.write();
        for w in &written {
            if let Some(old) = cat.docs.remove(w.doc.as_str()) {
                for id in old {
                    cat.chunks.remove(&id);
                }
            }
        }
        for (d, w) in docs.into_iter().zip(written.iter().skip(deletes.len())) {
            let doc: Arc<str> = Arc::from(d.id.as_str());
            let meta = Arc::new(d.metadata);
            for (c, &id) in d.chunks.into_iter().zip(&w.added) {
                cat.chunks.insert(
                    id,
                    ChunkEntry {
                        doc: doc.clone(),
                        start: c.start,
                        end: c.end,
                        metadata: meta.clone(),
                    },
                );
                added.push((id, c.vector));
            }
            cat.docs.insert(doc, w.added.clone());
        }
        cat.generation += 1;
        drop(cat);
        self.vectors.update(&removed, added);
        self.changes
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Ok(())
    }
}

impl Collection {
    /// A free read connection, or (all busy) one picked by thread so waiters spread out.
    fn reader(&self) -> parking_lot::MutexGuard<'_, Reader> {
        for r in &self.readers {
            if let Some(g) = r.try_lock() {
                return g;
            }
        }
        let mut h = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(&std::thread::current().id(), &mut h);
        let i = std::hash::Hasher::finish(&h) as usize % self.readers.len();
        self.readers[i].lock()
    }
}

fn check_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_ID_BYTES {
        return Err(format!(
            "`id` must be 1 to {MAX_ID_BYTES} bytes, got {}",
            id.len()
        ));
    }
    if id.chars().any(char::is_control) {
        return Err("`id` must not contain control characters".into());
    }
    Ok(())
}
