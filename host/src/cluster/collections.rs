//! Search collections stored in PostgreSQL: `gateway_collections` holds each name's live
//! incarnation (created and deleted under the ordered write lock, like plugins), and
//! `gateway_collection_docs` each document's latest state (a delete is a tombstone) with a
//! per-collection change number. A write takes the collection's row lock, numbers its
//! changes after the last, and bumps the collection's `doc_seq`, so changes commit in number
//! order and a replica applying "after my last" never skips one.

use std::sync::Arc;

use serde_json::{Map, Value};

use super::{Replication, StoreError};
use crate::search::collection::Settings;
use crate::search::{DocChange, NewChunk, NewDoc, Replica, SearchError};

pub(super) struct Shared(pub(super) Arc<Replication>);

fn unavailable(e: StoreError) -> SearchError {
    SearchError::Unavailable(format!(
        "The shared collection store did not answer; nothing was changed ({e})."
    ))
}

impl Replica for Shared {
    fn create(
        &self,
        tenant: &str,
        name: &str,
        incarnation: &str,
        settings: &Settings,
    ) -> Result<(), SearchError> {
        let settings =
            serde_json::to_string(settings).map_err(|e| SearchError::Internal(e.to_string()))?;
        let made = self
            .0
            .write("create_collection", |tx| {
                tx.execute(
                    "INSERT INTO gateway_collections (tenant, name, incarnation, settings, deleted, seq, doc_seq) \
                     VALUES ($1, $2, $3, $4, false, nextval('gateway_change_seq'), 0) \
                     ON CONFLICT (tenant, name) DO UPDATE SET incarnation = excluded.incarnation, \
                     settings = excluded.settings, deleted = false, seq = excluded.seq, doc_seq = 0 \
                     WHERE gateway_collections.deleted",
                    &[&tenant, &name, &incarnation, &settings],
                )
            })
            .map_err(unavailable)?;
        match made {
            0 => Err(SearchError::Conflict(format!(
                "A collection named `{name}` already exists."
            ))),
            _ => Ok(()),
        }
    }

    fn delete(&self, tenant: &str, name: &str) -> Result<(), SearchError> {
        let gone = self
            .0
            .write("delete_collection", |tx| {
                let row = tx.query_opt(
                    "UPDATE gateway_collections SET deleted = true, seq = nextval('gateway_change_seq') \
                     WHERE tenant = $1 AND name = $2 AND NOT deleted RETURNING incarnation",
                    &[&tenant, &name],
                )?;
                if let Some(r) = &row {
                    let incarnation: &str = r.get(0);
                    tx.execute(
                        "DELETE FROM gateway_collection_docs WHERE incarnation = $1",
                        &[&incarnation],
                    )?;
                }
                Ok(row.is_some())
            })
            .map_err(unavailable)?;
        match gone {
            true => Ok(()),
            false => Err(SearchError::NotFound(format!(
                "No collection named `{name}`."
            ))),
        }
    }

    fn write(
        &self,
        incarnation: &str,
        docs: &[NewDoc],
        deletes: &[String],
    ) -> Result<(), SearchError> {
        let rows: Vec<_> = docs.iter().map(encode).collect::<Result<_, _>>()?;
        let live = self
            .0
            .transaction("write_documents", false, |tx| {
                let Some(row) = tx.query_opt(
                    "SELECT doc_seq FROM gateway_collections WHERE incarnation = $1 AND NOT deleted FOR UPDATE",
                    &[&incarnation],
                )?
                else {
                    return Ok(false);
                };
                let mut seq: i64 = row.get(0);
                let put = tx.prepare(
                    "INSERT INTO gateway_collection_docs (incarnation, doc, seq, deleted, metadata, chunks, vectors) \
                     VALUES ($1, $2, $3, $4, $5, $6, $7) ON CONFLICT (incarnation, doc) DO UPDATE SET \
                     seq = excluded.seq, deleted = excluded.deleted, metadata = excluded.metadata, \
                     chunks = excluded.chunks, vectors = excluded.vectors",
                )?;
                for id in deletes {
                    seq += 1;
                    let none: Option<&str> = None;
                    let no_bytes: Option<&[u8]> = None;
                    tx.execute(&put, &[&incarnation, id, &seq, &true, &none, &none, &no_bytes])?;
                }
                for (d, (metadata, chunks, vectors)) in docs.iter().zip(&rows) {
                    seq += 1;
                    tx.execute(
                        &put,
                        &[&incarnation, &d.id, &seq, &false, metadata, chunks, vectors],
                    )?;
                }
                tx.execute(
                    "UPDATE gateway_collections SET doc_seq = $2 WHERE incarnation = $1",
                    &[&incarnation, &seq],
                )?;
                Ok(true)
            })
            .map_err(unavailable)?;
        match live {
            true => Ok(()),
            false => Err(SearchError::NotFound(
                "The collection was deleted (through another replica).".into(),
            )),
        }
    }

    fn changes(
        &self,
        incarnation: &str,
        after: i64,
        limit: usize,
    ) -> Result<Vec<DocChange>, SearchError> {
        let rows = self
            .0
            .on(&self.0.reader, "read_documents", |c| {
                c.query(
                    "SELECT doc, seq, deleted, metadata, chunks, vectors FROM gateway_collection_docs \
                     WHERE incarnation = $1 AND seq > $2 ORDER BY seq LIMIT $3",
                    &[&incarnation, &after, &(limit as i64)],
                )
            })
            .map_err(unavailable)?;
        rows.iter()
            .map(|r| {
                let body = match r.get::<_, bool>(2) {
                    true => None,
                    false => Some(decode(r.get(3), r.get(4), r.get(5))?),
                };
                Ok(DocChange {
                    doc: r.get(0),
                    seq: r.get(1),
                    body,
                })
            })
            .collect()
    }
}

/// A document as stored: metadata (JSON), chunks as `[[start, end, text], …]` (JSON) and
/// their unit vectors, little-endian f32, one after the other.
fn encode(d: &NewDoc) -> Result<(String, String, Vec<u8>), SearchError> {
    let bad = |e: serde_json::Error| SearchError::Internal(e.to_string());
    let metadata = serde_json::to_string(&d.metadata).map_err(bad)?;
    let spans: Vec<(usize, usize, &str)> = d
        .chunks
        .iter()
        .map(|c| (c.start, c.end, c.text.as_str()))
        .collect();
    let chunks = serde_json::to_string(&spans).map_err(bad)?;
    let vectors = d
        .chunks
        .iter()
        .flat_map(|c| c.vector.iter().flat_map(|x| x.to_le_bytes()))
        .collect();
    Ok((metadata, chunks, vectors))
}

fn decode(
    metadata: &str,
    chunks: &str,
    vectors: &[u8],
) -> Result<(Map<String, Value>, Vec<NewChunk>), SearchError> {
    let bad = |what: &str| SearchError::Internal(format!("unreadable stored document: {what}"));
    let metadata: Map<String, Value> =
        serde_json::from_str(metadata).map_err(|_| bad("metadata"))?;
    let spans: Vec<(usize, usize, String)> =
        serde_json::from_str(chunks).map_err(|_| bad("chunks"))?;
    if spans.is_empty() || !vectors.len().is_multiple_of(4 * spans.len()) {
        return Err(bad("vectors"));
    }
    let dim = vectors.len() / 4 / spans.len();
    let chunks = spans
        .into_iter()
        .zip(vectors.chunks_exact(4 * dim))
        .map(|((start, end, text), v)| NewChunk {
            start,
            end,
            text,
            vector: v
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
        })
        .collect();
    Ok((metadata, chunks))
}
