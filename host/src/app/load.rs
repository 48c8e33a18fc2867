//! What `Gateway::build` loads before it can serve: engines, embedding models, the plugin
//! registry, policies and the usage ledger, each with the watcher that keeps it current.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use anyhow::Context;

use crate::common::Watch;
use crate::config::{Config, EmbeddingModelConfig, LedgerUnwritable};
use crate::engine::Engine;
use crate::metrics::Metrics;
use crate::plugins::{Registry, Runtime};
use crate::search::embedder::Embedder;
use crate::tenancy::ledger::{Durability, Ledger};
use crate::tenancy::Tenancy;

/// One engine (thread, KV pool) per configured model.
pub(super) fn engines(
    cfg: &Config,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<BTreeMap<String, Arc<Engine>>> {
    let mut engines = BTreeMap::new();
    for m in &cfg.models {
        tracing::info!(model = %m.name, path = %m.path.display(), "loading model");
        let started = std::time::Instant::now();
        let engine = tokio::task::block_in_place(|| Engine::start(m, metrics.clone()))
            .with_context(|| format!("loading model {}", m.name))?;
        tracing::info!(model = %m.name, seconds = started.elapsed().as_secs_f32(), "model ready");
        engines.insert(m.name.clone(), Arc::new(engine));
    }
    Ok(engines)
}

/// The embedding models; the default one is skipped (with a warning) when not fetched.
pub(super) fn embedders(cfg: &Config) -> anyhow::Result<BTreeMap<String, Arc<Embedder>>> {
    let mut embedders = BTreeMap::new();
    for e in &cfg.embeddings {
        if *e == EmbeddingModelConfig::default() && !e.path.exists() {
            tracing::warn!(path = %e.path.display(), "default embedding model not found (host/scripts/fetch-models.sh fetches it); /v1/embeddings has no model");
            continue;
        }
        let loaded = tokio::task::block_in_place(|| Embedder::load(&e.name, &e.path, e.precision))
            .with_context(|| format!("loading embedding model {}", e.name))?;
        tracing::info!(model = %e.name, dim = loaded.dim, kernel = ?loaded.kernel, "embedding model ready");
        embedders.insert(e.name.clone(), Arc::new(loaded));
    }
    Ok(embedders)
}

/// Policies (watched for changes when from a file) and the usage ledger.
pub(super) fn tenancy(
    cfg: &Config,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<(Arc<Tenancy>, Option<Watch>)> {
    let ledger = match (&cfg.ledger, &cfg.cluster.postgres) {
        (Some(p), Some(url)) => Some(
            Ledger::open_postgres(url, ledger_durability(cfg, p))
                .context("opening the usage ledger in PostgreSQL")?,
        ),
        (Some(p), None) => Some(
            Ledger::open(p, ledger_durability(cfg, p))
                .with_context(|| format!("opening the usage ledger {}", p.display()))?,
        ),
        (None, _) => None,
    };
    let tenancy = Arc::new(
        Tenancy::new(cfg.policies.clone(), ledger, metrics.clone())
            .map_err(|e| anyhow::anyhow!("invalid policy file:\n{e}"))?,
    );
    let Some(p) = &cfg.policies else {
        tracing::warn!(
            "no policy file: requests are not authenticated and all belong to tenant `default`"
        );
        return Ok((tenancy, None));
    };
    tracing::info!(path = %p.display(), "policies loaded");
    let watch = crate::tenancy::watch::watch(tenancy.clone())
        .with_context(|| format!("watching {}", p.display()))?;
    Ok((tenancy, Some(watch)))
}

fn ledger_durability(cfg: &Config, ledger: &Path) -> Durability {
    let mut d = Durability::beside(ledger);
    if let Some(spill) = &cfg.ledger_spill {
        d.spill = spill.clone();
    }
    d.refuse_when_failing = cfg.ledger_unwritable == LedgerUnwritable::Refuse;
    d.spill_max_bytes = cfg.ledger_spill_max_mb.saturating_mul(1 << 20);
    d
}

/// The plugin runtime and registry, filled from the plugin folder (watched for changes) when
/// one is configured. The watcher lives as long as the returned handle.
pub(super) fn plugins(cfg: &Config) -> anyhow::Result<(Arc<Registry>, Option<Watch>)> {
    let mut pc = cfg.plugins.clone();
    if pc.cache_dir.is_none() {
        pc.cache_dir = pc.dir.as_ref().map(|d| d.join(".compiled"));
    }
    let runtime = Runtime::new(&pc).context("starting the plugin runtime")?;
    let registry = Arc::new(Registry::new(runtime, pc.dir.clone()));
    let Some(dir) = &pc.dir else {
        return Ok((registry, None));
    };
    if !dir.exists() {
        // Said out loud: a typo in the path would otherwise look like "no plugins".
        tracing::warn!(dir = %dir.display(), "the plugin folder does not exist; creating it");
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let started = std::time::Instant::now();
    let report = tokio::task::block_in_place(|| registry.sync_dir());
    tracing::info!(
        dir = %dir.display(),
        loaded = report.loaded.len(),
        rejected = report.rejected.len(),
        seconds = started.elapsed().as_secs_f32(),
        "plugins loaded"
    );
    let watcher = crate::plugins::watch::watch(registry.clone())
        .with_context(|| format!("watching {}", dir.display()))?;
    Ok((registry, Some(watcher)))
}

/// The store of the Responses API's responses: PostgreSQL with `[cluster] postgres` (every
/// replica sees every response), else the ledger's SQLite file; none without a ledger.
pub(super) fn conversations(
    cfg: &Config,
) -> anyhow::Result<Option<Arc<crate::conversations::Conversations>>> {
    use crate::conversations::Conversations;
    let store = match (&cfg.cluster.postgres, &cfg.ledger) {
        (Some(url), _) => Conversations::open_postgres(url, &cfg.responses),
        (None, Some(path)) => Conversations::open(path, &cfg.responses)
            .with_context(|| format!("opening the response store in {}", path.display()))?,
        (None, None) => return Ok(None),
    };
    Ok(Some(Arc::new(store)))
}

/// The audit log of admin changes: PostgreSQL with `[cluster] postgres` (one log for every
/// replica), else the ledger's SQLite file; none without a ledger.
pub(super) fn audit(cfg: &Config) -> anyhow::Result<Option<Arc<crate::audit::Audit>>> {
    use crate::audit::Audit;
    let log = match (&cfg.cluster.postgres, &cfg.ledger) {
        (Some(url), _) => Audit::open_postgres(url),
        (None, Some(path)) => Audit::open(path)
            .with_context(|| format!("opening the audit log in {}", path.display()))?,
        (None, None) => return Ok(None),
    };
    Ok(Some(Arc::new(log)))
}

/// The response cache (in Redis with `[cluster] redis`), and the embedding model of its
/// semantic lookups: `[cache] embedding_model`, else the first embedding model.
pub(super) fn cache(
    cfg: &Config,
    embedders: &BTreeMap<String, Arc<Embedder>>,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<crate::pipeline::cache::CacheStage> {
    let cache = crate::cache::ResponseCache::new(&cfg.cache, &cfg.cluster, metrics.clone())
        .context("[cache]")?;
    let embedder = match &cfg.cache.embedding_model {
        Some(name) => Some(embedders.get(name).cloned().with_context(|| {
            format!("[cache] embedding_model: no embedding model named `{name}`")
        })?),
        None => cfg
            .embeddings
            .first()
            .and_then(|e| embedders.get(&e.name).cloned()),
    };
    Ok(crate::pipeline::cache::CacheStage {
        cache: Arc::new(cache),
        embedder,
    })
}
