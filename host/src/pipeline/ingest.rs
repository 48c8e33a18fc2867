//! Documents into a tenant's collection: chunked and counted (the encoder's tokens) on the
//! blocking pool, the tokens reserved, then embedded and committed, one bulk embedding at a
//! time, and the reservation settled with what was embedded.

use std::sync::Arc;

use super::retrieval::index;
use super::{Error, Stages};
use crate::common::Endpoint;
use crate::search::collection::{Collection, DocInput, Upserted};
use crate::tenancy::{Caller, Outcome};

/// One bulk embedding at a time: each already uses every core, and two at once would only slow
/// both and starve generation longer.
static EMBEDDING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

pub async fn upsert(
    stages: &Stages,
    caller: &Caller,
    c: Arc<Collection>,
    docs: Vec<DocInput>,
) -> Result<Upserted, Error> {
    if docs.is_empty() {
        return Err(Error::invalid(
            "documents",
            "`documents` must hold at least one document.",
        ));
    }
    let col = c.clone();
    let prepared = index(move || col.prepare(docs)).await?;
    let tokens = prepared.tokens as u64;
    let model = &c.settings.embedding_model;
    let reservation = stages
        .tenancy
        .reserve_tokens(caller, model, Endpoint::Documents, tokens, tokens)
        .await
        .map_err(Error::Denied)?;
    let turn = EMBEDDING.acquire().await;
    let done = match turn {
        Ok(_turn) => index(move || c.commit(prepared)).await,
        Err(e) => Err(Error::Task {
            what: "embedding turn",
            cause: e.to_string(),
        }),
    };
    reservation.settle(tokens, 0, Outcome::of(&done));
    let done = done?;
    stages
        .metrics
        .indexed_chunks
        .with_label_values(&[&caller.tenant.name])
        .inc_by(done.chunks as u64);
    Ok(done)
}
