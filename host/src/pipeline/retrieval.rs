//! The retrieval stage: a tenant's search over one of its collections (BM25, vector or hybrid,
//! filtered), the charge for embedding the query, and the optional rerank by the tenant's
//! reranker plugin. `/v1/collections/{name}/search` and RAG both run it.

use std::sync::Arc;
use std::time::Instant;

use super::{Error, PluginCalls};
use crate::common::Endpoint;
use crate::metrics::Metrics;
use crate::plugins::{Candidate, Plugin, PluginKind};
use crate::search::collection::{Collection, Fusion, Hit, Mode, Query};
use crate::search::filter::Filter;
use crate::search::request::{FusionKind, RerankChoice, SearchRequest};
use crate::search::Collections;
use crate::tenancy::{Caller, Outcome, Tenancy};

pub const MAX_TOP_K: usize = 1000;

/// What retrieval needs: the collections, the tenancy that charges the query's embedding, and
/// the reranker plugins.
pub struct Retrieval {
    pub collections: Arc<Collections>,
    pub tenancy: Arc<Tenancy>,
    pub metrics: Arc<Metrics>,
    pub plugins: PluginCalls,
}

pub struct Searched {
    pub hits: Vec<Hit>,
    /// Embedder tokens the query took (0 in BM25 mode), charged to the tenant.
    pub query_tokens: u64,
}

/// Index work on the blocking pool, its failure typed.
pub async fn index<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, crate::search::SearchError> + Send + 'static,
) -> Result<T, Error> {
    Ok(super::blocking("index", f).await??)
}

impl Retrieval {
    /// The caller's collection `name`, if its policy allows it.
    pub fn open(&self, caller: &Caller, name: &str) -> Result<Arc<Collection>, Error> {
        if !caller.tenant.allows_collection(name) {
            return Err(Error::Forbidden {
                param: "collection",
                message: format!(
                    "Tenant `{}` may not use collection `{name}`.",
                    caller.tenant.name
                ),
            });
        }
        Ok(self.collections.get(&caller.tenant.name, name)?)
    }

    /// Hits for `req` in `c`, reranked when asked.
    pub async fn search(
        &self,
        caller: &Caller,
        c: Arc<Collection>,
        req: &SearchRequest,
    ) -> Result<Searched, Error> {
        let filter = checked_filter(req)?;
        let plugin = self.reranker(caller, req)?;
        let candidates = req.candidates.unwrap_or(50).clamp(req.top_k, MAX_TOP_K);
        // A reranker sees a deeper pool than it returns, or it could only reorder.
        let first_k = if plugin.is_some() {
            (req.top_k * 3).clamp(req.top_k, candidates.max(req.top_k))
        } else {
            req.top_k
        };
        let (text, mode) = (req.query.clone(), req.mode);
        let fusion = match req.fusion {
            FusionKind::Rrf => Fusion::Rrf { k: req.rrf_k },
            FusionKind::Weighted => Fusion::Weighted { alpha: req.alpha },
        };
        // Embedding the query is charged like any embedding, and checked against the limits
        // first.
        let tokens = match mode {
            Mode::Bm25 => Vec::new(),
            _ => {
                let (c, text) = (c.clone(), text.clone());
                index(move || c.query_tokens(&text)).await?
            }
        };
        let charged = tokens.len() as u64;
        let model = &c.settings.embedding_model;
        let reservation = self
            .tenancy
            .reserve_tokens(caller, model, Endpoint::Search, charged, charged)
            .await
            .map_err(Error::Denied)?;
        let started = Instant::now();
        let searched = index(move || {
            c.search(&Query {
                text: &text,
                top_k: first_k,
                mode,
                fusion,
                filter: filter.as_ref(),
                candidates,
                tokens: Some(&tokens),
            })
        })
        .await;
        let label = match mode {
            Mode::Bm25 => "bm25",
            Mode::Vector => "vector",
            Mode::Hybrid => "hybrid",
        };
        self.metrics
            .search_seconds
            .with_label_values(&[label])
            .observe(started.elapsed().as_secs_f64());
        let hits = match (searched, plugin) {
            (Ok(hits), Some(plugin)) => self.rerank(caller, plugin, req, hits).await,
            (searched, _) => searched,
        };
        reservation.settle(charged, 0, Outcome::of(&hits));
        Ok(Searched {
            hits: hits?,
            query_tokens: charged,
        })
    }

    /// The reranker plugin the search asks for: none, the tenant's default, or one by name.
    fn reranker(&self, caller: &Caller, req: &SearchRequest) -> Result<Option<Arc<Plugin>>, Error> {
        let name = match &req.rerank {
            None | Some(RerankChoice::On(false)) => return Ok(None),
            Some(RerankChoice::Plugin(name)) => name,
            Some(RerankChoice::On(true)) => {
                caller.tenant.policy.reranker.as_ref().ok_or_else(|| {
                    Error::invalid(
                        "rerank",
                        format!(
                        "Tenant `{}` has no default reranker; give the plugin's name in `rerank`.",
                        caller.tenant.name
                    ),
                    )
                })?
            }
        };
        let plugin = self
            .plugins
            .bound(&caller.tenant, name, PluginKind::Reranker)?;
        Ok(Some(plugin))
    }

    /// The `top_k` of `hits` in the order of the tenant's reranker `plugin`.
    async fn rerank(
        &self,
        caller: &Caller,
        plugin: Arc<Plugin>,
        req: &SearchRequest,
        mut hits: Vec<Hit>,
    ) -> Result<Vec<Hit>, Error> {
        if hits.is_empty() {
            return Ok(hits);
        }
        let cands: Vec<Candidate> = hits
            .iter()
            .enumerate()
            .map(|(i, h)| Candidate {
                id: i.to_string(),
                document_id: Some(h.id.clone()),
                text: h.text.clone(),
                metadata: crate::plugins::metadata(h.metadata.iter()),
                score: h.score,
            })
            .collect();
        let order = self
            .plugins
            .rerank(caller, plugin, req.query.clone(), cands, req.top_k)
            .await?;
        let mut slots: Vec<Option<Hit>> = hits.drain(..).map(Some).collect();
        Ok(order
            .into_iter()
            .filter_map(|(i, s)| {
                let mut h = slots.get_mut(i)?.take()?;
                h.scores.rerank = Some(s);
                h.score = s;
                Some(h)
            })
            .collect())
    }
}

/// The search's numbers checked, and its filter parsed.
fn checked_filter(req: &SearchRequest) -> Result<Option<Filter>, Error> {
    if req.query.trim().is_empty() {
        return Err(Error::invalid("query", "`query` must not be empty."));
    }
    if req.top_k == 0 || req.top_k > MAX_TOP_K {
        return Err(Error::invalid(
            "top_k",
            format!("`top_k` must be 1 to {MAX_TOP_K}."),
        ));
    }
    if !(req.rrf_k > 0.0 && req.rrf_k.is_finite()) {
        return Err(Error::invalid("rrf_k", "`rrf_k` must be positive."));
    }
    if !(0.0..=1.0).contains(&req.alpha) {
        return Err(Error::invalid("alpha", "`alpha` must be between 0 and 1."));
    }
    req.filter
        .as_ref()
        .map(Filter::parse)
        .transpose()
        .map_err(|m| Error::invalid("filter", m))
}
