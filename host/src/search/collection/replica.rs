//! Collections shared by replicas. The durable store is elsewhere (PostgreSQL, through the
//! `Replica` the cluster module provides): an acknowledged write is a committed transaction
//! there. This replica's store, keyword index and vector graph are derived from it: every
//! document change carries a per-collection sequence number, and a collection applies the
//! changes after the last it applied, in order (`catch_up`), both right after its own writes
//! (read-your-writes) and when the follower sees another replica's. Applying is idempotent
//! (an upsert replaces, a delete of nothing does nothing), so the applied number is saved
//! after the write it covers and a crash in between only repeats work.

use serde_json::{Map, Value};

use super::{Collection, Settings};
use crate::search::store::{NewChunk, NewDoc};
use crate::search::SearchError;

/// How many changes one catch-up step reads.
const BATCH: usize = 512;
/// The local store's key for the last change applied.
pub(super) const APPLIED: &str = "shared_seq";

/// The shared store of collections (implemented over PostgreSQL by `cluster`).
pub trait Replica: Send + Sync {
    /// Stores a new incarnation of a collection; `Conflict` while a live one has the name.
    fn create(
        &self,
        tenant: &str,
        name: &str,
        incarnation: &str,
        settings: &Settings,
    ) -> Result<(), SearchError>;
    /// Ends the live incarnation of the collection; `NotFound` when there is none.
    fn delete(&self, tenant: &str, name: &str) -> Result<(), SearchError>;
    /// Commits document upserts (embedded) and deletes; `NotFound` once the incarnation ended.
    fn write(
        &self,
        incarnation: &str,
        docs: &[NewDoc],
        deletes: &[String],
    ) -> Result<(), SearchError>;
    /// The incarnation's document changes after `after`, in order, at most `limit`.
    fn changes(
        &self,
        incarnation: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<DocChange>, SearchError>;
}

/// One document's latest state in the shared store.
pub struct DocChange {
    pub seq: i64,
    pub doc: String,
    /// The document's metadata and chunks (text and vector); `None`: deleted.
    pub body: Option<(Map<String, Value>, Vec<NewChunk>)>,
}

impl Collection {
    /// The name of this incarnation (its folder's name), unique across replicas.
    pub fn incarnation(&self) -> String {
        self.dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default()
    }

    /// The last shared change applied here.
    pub fn applied(&self) -> i64 {
        *self.applied.lock()
    }

    /// Applies the shared store's changes not applied here yet, in order; returns how many.
    pub fn catch_up(&self) -> Result<usize, SearchError> {
        let Some(shared) = self.shared.get() else {
            return Ok(0);
        };
        let incarnation = self.incarnation();
        let mut applied = self.applied.lock();
        let mut n = 0;
        loop {
            let changes = shared.changes(&incarnation, *applied, BATCH)?;
            let Some(last) = changes.last().map(|c| c.seq) else {
                return Ok(n);
            };
            n += changes.len();
            let (mut docs, mut deletes) = (Vec::new(), Vec::new());
            for c in changes {
                match c.body {
                    Some((metadata, chunks)) => docs.push(NewDoc {
                        id: c.doc,
                        metadata,
                        chunks,
                    }),
                    None => deletes.push(c.doc),
                }
            }
            self.apply(docs, deletes)?;
            *applied = last;
            self.save_applied(last)?;
        }
    }

    /// Writes through the shared store, then applies what it holds (this write included).
    pub(super) fn write_shared(
        &self,
        shared: &dyn Replica,
        docs: Vec<NewDoc>,
        deletes: Vec<String>,
    ) -> Result<(), SearchError> {
        if self.is_closed() {
            return Err(SearchError::NotFound(format!(
                "Collection `{}` was deleted.",
                self.name
            )));
        }
        shared.write(&self.incarnation(), &docs, &deletes)?;
        self.catch_up().map(drop)
    }
}
