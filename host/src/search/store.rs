//! A collection's source of truth: one SQLite database (WAL, `synchronous=FULL`) holding
//! documents' metadata and every live chunk with its text and embedding. An upsert is
//! acknowledged only after its transaction commits here; the BM25 and vector indexes are
//! derived from these rows. Documents written here but maybe not yet committed to tantivy are
//! listed in `pending` in the same transaction and replayed into tantivy on open.

use std::collections::HashMap;
use std::path::Path;

use rusqlite::{params, Connection, OptionalExtension};
use serde_json::{Map, Value};

/// One chunk to store: character offsets into its document, text, unit embedding.
pub struct NewChunk {
    pub start: usize,
    pub end: usize,
    pub text: String,
    pub vector: Vec<f32>,
}

pub struct NewDoc {
    pub id: String,
    pub metadata: Map<String, Value>,
    pub chunks: Vec<NewChunk>,
}

/// A live chunk as loaded at open.
pub struct StoredChunk {
    pub id: u64,
    pub doc: String,
    pub start: usize,
    pub end: usize,
    pub vector: Vec<f32>,
}

/// What a write changed, per document: the chunk ids it removed and the ones it added.
pub struct Written {
    pub doc: String,
    pub removed: Vec<u64>,
    pub added: Vec<u64>,
}

pub struct Store {
    db: Connection,
}

impl Store {
    pub fn open(path: &Path) -> rusqlite::Result<Self> {
        let db = Connection::open(path)?;
        db.pragma_update(None, "journal_mode", "WAL")?;
        // FULL: a commit is on disk before the upsert is acknowledged, power loss included.
        db.pragma_update(None, "synchronous", "FULL")?;
        db.execute_batch(
            "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS docs (id TEXT PRIMARY KEY, metadata TEXT NOT NULL);
             CREATE TABLE IF NOT EXISTS chunks (
                 id INTEGER PRIMARY KEY AUTOINCREMENT,
                 doc TEXT NOT NULL, start INTEGER NOT NULL, end INTEGER NOT NULL,
                 text TEXT NOT NULL, vector BLOB NOT NULL);
             CREATE INDEX IF NOT EXISTS chunks_doc ON chunks(doc);
             CREATE TABLE IF NOT EXISTS pending (doc TEXT PRIMARY KEY);",
        )?;
        Ok(Self { db })
    }

    pub fn meta(&self, key: &str) -> rusqlite::Result<Option<String>> {
        self.db
            .query_row("SELECT value FROM meta WHERE key = ?1", [key], |r| r.get(0))
            .optional()
    }

    pub fn set_meta(&self, key: &str, value: &str) -> rusqlite::Result<()> {
        self.db
            .execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES (?1, ?2)",
                [key, value],
            )
            .map(drop)
    }

    /// Every document's metadata and every live chunk (with its vector), in id order.
    #[allow(clippy::type_complexity)]
    pub fn load(
        &self,
    ) -> rusqlite::Result<(HashMap<String, Map<String, Value>>, Vec<StoredChunk>)> {
        let mut docs = HashMap::new();
        let mut q = self.db.prepare("SELECT id, metadata FROM docs")?;
        let rows = q.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?)))?;
        for row in rows {
            let (id, meta) = row?;
            let meta = serde_json::from_str(&meta).unwrap_or_default();
            docs.insert(id, meta);
        }
        let mut q = self
            .db
            .prepare("SELECT id, doc, start, end, vector FROM chunks ORDER BY id")?;
        let chunks = q
            .query_map([], |r| {
                Ok(StoredChunk {
                    id: r.get::<_, i64>(0)? as u64,
                    doc: r.get(1)?,
                    start: r.get::<_, i64>(2)? as usize,
                    end: r.get::<_, i64>(3)? as usize,
                    vector: from_blob(&r.get::<_, Vec<u8>>(4)?),
                })
            })?
            .collect::<rusqlite::Result<_>>()?;
        Ok((docs, chunks))
    }

    /// Replaces `docs` (all their old chunks go) and deletes `deletes`, in one durable
    /// transaction that also marks every touched document pending for the BM25 index.
    pub fn write(&mut self, docs: &[NewDoc], deletes: &[String]) -> rusqlite::Result<Vec<Written>> {
        let tx = self.db.transaction()?;
        let mut out = Vec::with_capacity(docs.len() + deletes.len());
        {
            let mut old = tx.prepare("SELECT id FROM chunks WHERE doc = ?1")?;
            let mut del_chunks = tx.prepare("DELETE FROM chunks WHERE doc = ?1")?;
            let mut del_doc = tx.prepare("DELETE FROM docs WHERE id = ?1")?;
            let mut put_doc =
                tx.prepare("INSERT OR REPLACE INTO docs (id, metadata) VALUES (?1, ?2)")?;
            let mut put_chunk = tx.prepare(
                "INSERT INTO chunks (doc, start, end, text, vector) VALUES (?1, ?2, ?3, ?4, ?5)",
            )?;
            let mut pend = tx.prepare("INSERT OR IGNORE INTO pending (doc) VALUES (?1)")?;
            let mut clear = |doc: &str| -> rusqlite::Result<Vec<u64>> {
                let removed = old
                    .query_map([doc], |r| r.get::<_, i64>(0).map(|i| i as u64))?
                    .collect::<rusqlite::Result<Vec<_>>>()?;
                del_chunks.execute([doc])?;
                pend.execute([doc])?;
                Ok(removed)
            };
            for id in deletes {
                let removed = clear(id)?;
                del_doc.execute([id])?;
                out.push(Written {
                    doc: id.clone(),
                    removed,
                    added: Vec::new(),
                });
            }
            for d in docs {
                let removed = clear(&d.id)?;
                put_doc.execute(params![d.id, Value::Object(d.metadata.clone()).to_string()])?;
                let mut added = Vec::with_capacity(d.chunks.len());
                for c in &d.chunks {
                    put_chunk.execute(params![
                        d.id,
                        c.start as i64,
                        c.end as i64,
                        c.text,
                        to_blob(&c.vector)
                    ])?;
                    added.push(tx.last_insert_rowid() as u64);
                }
                out.push(Written {
                    doc: d.id.clone(),
                    removed,
                    added,
                });
            }
        }
        tx.commit()?;
        Ok(out)
    }

    /// Documents whose BM25 entries may lag behind this store.
    pub fn pending(&self) -> rusqlite::Result<Vec<String>> {
        let mut q = self.db.prepare("SELECT doc FROM pending")?;
        let rows = q.query_map([], |r| r.get(0))?;
        rows.collect()
    }

    /// Called once tantivy has committed these documents' current state.
    pub fn clear_pending(&mut self, docs: &[String]) -> rusqlite::Result<()> {
        let tx = self.db.transaction()?;
        {
            let mut q = tx.prepare("DELETE FROM pending WHERE doc = ?1")?;
            for d in docs {
                q.execute([d])?;
            }
        }
        tx.commit()
    }

    /// A document's live chunks as (id, text), for rebuilding its BM25 entries.
    pub fn doc_chunks(&self, doc: &str) -> rusqlite::Result<Vec<(u64, String)>> {
        let mut q = self
            .db
            .prepare_cached("SELECT id, text FROM chunks WHERE doc = ?1 ORDER BY id")?;
        let rows = q.query_map([doc], |r| Ok((r.get::<_, i64>(0)? as u64, r.get(1)?)))?;
        rows.collect()
    }

    /// Every live chunk as (id, doc, text), for rebuilding the whole BM25 index.
    pub fn all_texts(&self) -> rusqlite::Result<Vec<(u64, String, String)>> {
        let mut q = self
            .db
            .prepare("SELECT id, doc, text FROM chunks ORDER BY id")?;
        let rows = q.query_map([], |r| {
            Ok((r.get::<_, i64>(0)? as u64, r.get(1)?, r.get(2)?))
        })?;
        rows.collect()
    }
}

/// A read-only connection for searches: in WAL mode readers never wait for the writer's
/// fsync, and several readers run side by side.
pub struct Reader {
    db: Connection,
}

impl Reader {
    pub fn open(path: &Path) -> rusqlite::Result<Self> {
        let db = Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )?;
        Ok(Self { db })
    }

    /// The texts of the given chunks that still exist, in one query.
    pub fn chunk_texts(&self, ids: &[u64]) -> rusqlite::Result<HashMap<u64, String>> {
        if ids.is_empty() {
            return Ok(HashMap::new());
        }
        let marks = vec!["?"; ids.len()].join(",");
        let mut q = self.db.prepare(&format!(
            "SELECT id, text FROM chunks WHERE id IN ({marks})"
        ))?;
        let rows = q.query_map(
            rusqlite::params_from_iter(ids.iter().map(|&i| i as i64)),
            |r| Ok((r.get::<_, i64>(0)? as u64, r.get(1)?)),
        )?;
        rows.collect()
    }
}

fn to_blob(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn from_blob(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}
