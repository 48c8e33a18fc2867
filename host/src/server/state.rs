//! What every handler shares: the models, collections, plugins, tenancy and metrics of this
//! process (`AppState`), the handles each pipeline stage takes from it, and the shutdown
//! sequence.

use std::collections::BTreeMap;
use std::sync::Arc;

use super::error::ApiError;
use crate::engine::Engine;
use crate::metrics::Metrics;

pub struct AppState {
    pub engines: BTreeMap<String, Arc<Engine>>,
    pub embedders: BTreeMap<String, Arc<crate::search::embedder::Embedder>>,
    pub collections: Arc<crate::search::Collections>,
    pub metrics: Arc<Metrics>,
    pub max_body_bytes: usize,
    pub started: u64,
    pub plugins: Arc<crate::plugins::Registry>,
    pub tenancy: Arc<crate::tenancy::Tenancy>,
    pub admin_token: Option<String>,
    pub max_upload_bytes: usize,
    pub shutdown: Shutdown,
    /// Connection and body deadlines and caps.
    pub http: crate::config::HttpConfig,
    /// Each model's vocabulary index for logits processors, built on first use.
    pub vocabularies: Arc<crate::pipeline::processors::Vocabularies>,
    /// Models served by upstream replicas.
    pub upstreams: crate::upstream::Upstreams,
    /// Local models' fallback chains.
    pub fallbacks: BTreeMap<String, Fallback>,
    /// Where admin-API changes to plugins and policies are stored for the other replicas.
    pub cluster: Option<Arc<crate::cluster::Replication>>,
    /// Stored responses of the Responses API (none without a ledger).
    pub conversations: Option<Arc<crate::conversations::Conversations>>,
    /// The response cache, and the embedding model of its semantic lookups.
    pub cache: crate::pipeline::cache::CacheStage,
    /// Named admin accounts beside `admin_token`.
    pub admin_accounts: Vec<crate::config::AdminAccount>,
    /// Every admin change (none without a ledger).
    pub audit: Option<Arc<crate::audit::Audit>>,
    /// The admin console's signed-in sessions.
    pub sessions: super::console::Sessions,
    /// The last minutes of rates and load `GET /admin/overview` charts.
    pub overview: super::overview::History,
}

/// Where a local model's requests go when its queue is long.
pub struct Fallback {
    pub chain: Vec<String>,
    pub saturated_waiting: usize,
}

/// What a SIGTERM sets in motion. First `draining`: `/ready` turns 503 and no connection is
/// taken while requests in flight finish. Then, at the drain deadline, `cut`: generations still
/// running end with a `server_shutting_down` error (and their tenant is charged what was
/// generated) instead of vanishing with the process.
pub struct Shutdown {
    draining: std::sync::atomic::AtomicBool,
    cut: tokio::sync::watch::Sender<bool>,
}

impl Default for Shutdown {
    fn default() -> Self {
        Self {
            draining: Default::default(),
            cut: tokio::sync::watch::Sender::new(false),
        }
    }
}

impl Shutdown {
    pub fn draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The first step: stop taking connections, let requests in flight finish.
    pub(super) fn start_draining(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// The drain deadline passed: generations still running end now.
    pub(super) fn cut_now(&self) {
        self.cut.send_replace(true);
    }

    /// Resolves once the drain deadline has passed; never, until then.
    pub fn cut(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.cut.subscribe();
        async move {
            if rx.wait_for(|cut| *cut).await.is_err() {
                std::future::pending::<()>().await;
            }
        }
    }
}

impl AppState {
    /// The handles the plugin stages take.
    pub fn plugin_calls(&self) -> crate::pipeline::PluginCalls {
        crate::pipeline::PluginCalls {
            registry: self.plugins.clone(),
            metrics: self.metrics.clone(),
        }
    }

    /// The handles the processor stage takes.
    pub fn processor_stage(&self) -> crate::pipeline::processors::ProcessorStage {
        crate::pipeline::processors::ProcessorStage {
            calls: self.plugin_calls(),
            vocabularies: self.vocabularies.clone(),
        }
    }

    /// The handles the retrieval stage takes.
    pub fn retrieval(&self) -> crate::pipeline::Retrieval {
        crate::pipeline::Retrieval {
            collections: self.collections.clone(),
            tenancy: self.tenancy.clone(),
            metrics: self.metrics.clone(),
            plugins: self.plugin_calls(),
        }
    }

    /// The handles the chat pipeline takes.
    pub fn stages(&self) -> crate::pipeline::Stages {
        crate::pipeline::Stages {
            plugins: self.plugin_calls(),
            retrieval: self.retrieval(),
            processors: self.processor_stage(),
            tenancy: self.tenancy.clone(),
            metrics: self.metrics.clone(),
            cache: self.cache.clone(),
        }
    }

    /// Where `model` is generated, if the tenant may use it: an upstream pool or a local
    /// engine.
    pub fn target(
        &self,
        tenant: &crate::tenancy::Tenant,
        model: &str,
    ) -> Result<crate::pipeline::chat::Target, ApiError> {
        use crate::pipeline::chat::Target;
        match self.upstreams.get(model) {
            Some(_) if !tenant.allows_model(model) => Err(forbidden_model(tenant, model)),
            Some(pool) => Ok(Target::Upstream(pool.clone())),
            None => Ok(Target::Local(self.engine(tenant, model)?)),
        }
    }

    /// `model` and then its fallbacks, in order.
    pub fn fallback_chain(&self, model: &str) -> Vec<String> {
        let rest = match self.upstreams.get(model) {
            Some(pool) => pool.cfg.fallback.clone(),
            None => self
                .fallbacks
                .get(model)
                .map(|f| f.chain.clone())
                .unwrap_or_default(),
        };
        std::iter::once(model.to_string()).chain(rest).collect()
    }

    /// The embedding model `model`, if the tenant may use it.
    pub fn embedder(
        &self,
        tenant: &crate::tenancy::Tenant,
        model: &str,
    ) -> Result<Arc<crate::search::embedder::Embedder>, ApiError> {
        allowed_model(&self.embedders, std::iter::empty(), tenant, model)
    }

    /// The engine serving `model`, if the tenant may use it.
    pub fn engine(
        &self,
        tenant: &crate::tenancy::Tenant,
        model: &str,
    ) -> Result<Arc<Engine>, ApiError> {
        allowed_model(&self.engines, self.upstreams.names(), tenant, model)
    }
}

/// `model` from `models`: 404 (listing the tenant's models, and `others` of the same kind
/// served elsewhere) when it does not exist, 403 when the tenant's policy does not allow it.
fn allowed_model<'a, T>(
    models: &'a BTreeMap<String, Arc<T>>,
    others: impl Iterator<Item = &'a String>,
    tenant: &crate::tenancy::Tenant,
    model: &str,
) -> Result<Arc<T>, ApiError> {
    let found = models.get(model).cloned().ok_or_else(|| {
        let allowed: Vec<String> = models
            .keys()
            .chain(others)
            .filter(|m| tenant.allows_model(m))
            .cloned()
            .collect();
        ApiError::model_not_found(model, &allowed)
    })?;
    if !tenant.allows_model(model) {
        return Err(forbidden_model(tenant, model));
    }
    Ok(found)
}

fn forbidden_model(tenant: &crate::tenancy::Tenant, model: &str) -> ApiError {
    ApiError::forbidden(
        "model",
        format!("Tenant `{}` may not use model `{model}`.", tenant.name),
    )
}
