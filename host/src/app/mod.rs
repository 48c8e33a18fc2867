//! `gateway serve` as a library call: everything a `Config` names loaded and wired into the
//! server's `AppState`, the listeners bound, then served until a signal. A test can start a
//! gateway in-process this way (`listen` on port 0, then `addresses`).
//!
//! The one module above the server: it may use every other, and none uses it.

mod edge;
mod listeners;
mod load;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common::Watch;
use crate::config::Config;
use crate::metrics::Metrics;
use crate::plugins::Registry;
use crate::search::Collections;
use crate::server::{self, AppState, Fallback, Listener, Role};
use crate::tenancy::Tenancy;
use crate::upstream::Upstreams;

/// A gateway loaded, wired and bound, ready to serve.
pub struct Gateway {
    state: Arc<AppState>,
    listeners: Vec<Listener>,
    drain: Duration,
    /// Watchers of the TLS files; stopped once serving has ended, before the ledger's flush.
    tls_watches: Vec<Watch>,
    /// Watchers of the policy file and the plugin folder, kept as long as the gateway serves.
    watches: (Option<Watch>, Option<Watch>),
}

impl Gateway {
    /// Loads the models, embedders, collections, tenancy and plugins `cfg` names, joins the
    /// cluster and binds the listeners. Loading runs in `block_in_place`, which needs a
    /// multi-threaded Tokio runtime.
    pub async fn build(cfg: &Config) -> anyhow::Result<Self> {
        let metrics = Arc::new(Metrics::new());
        let engines = load::engines(cfg, &metrics)?;
        let upstreams = Upstreams::new(&cfg.upstreams, &metrics)?;
        let (plugins, plugin_watch) = load::plugins(cfg)?;
        let embedders = load::embedders(cfg)?;
        let collections = Arc::new(tokio::task::block_in_place(|| {
            Collections::open(cfg.collections_dir.clone(), embedders.clone())
        }));
        let (tenancy, policy_watch) = load::tenancy(cfg, &metrics)?;
        check_plugin_kinds(&tenancy, &plugins);
        let cluster =
            crate::cluster::join(&cfg.cluster, &tenancy, &plugins, &collections, &metrics)?;
        let cache = load::cache(cfg, &embedders, &metrics)?;
        let (listeners, tls_watches) = listeners::bind(cfg).await?;
        let started = SystemTime::now().duration_since(UNIX_EPOCH)?.as_secs();
        let state = Arc::new(AppState {
            engines,
            embedders,
            collections,
            metrics,
            max_body_bytes: cfg.max_body_bytes,
            started,
            plugins,
            tenancy,
            admin_token: cfg.admin_token.clone(),
            max_upload_bytes: cfg.plugins.max_upload_bytes,
            shutdown: Default::default(),
            http: edge::limits(cfg),
            vocabularies: Default::default(),
            upstreams,
            cluster,
            fallbacks: fallbacks(cfg),
            conversations: load::conversations(cfg)?,
            cache,
            admin_accounts: cfg.admin.accounts.clone(),
            audit: load::audit(cfg)?,
            sessions: Default::default(),
            overview: Default::default(),
        });
        audit_file_edits(&state);
        state.upstreams.start_probes().await;
        Ok(Self {
            state,
            listeners,
            drain: Duration::from_secs(cfg.drain_seconds),
            tls_watches,
            watches: (policy_watch, plugin_watch),
        })
    }

    /// Where each listener is bound (the port the system chose, for port 0) and what it serves.
    pub fn addresses(&self) -> std::io::Result<Vec<(Role, SocketAddr)>> {
        self.listeners
            .iter()
            .map(|l| Ok((l.role, l.tcp.local_addr()?)))
            .collect()
    }

    /// Serves until ctrl-c or SIGTERM and the drain that follows, then saves the collections'
    /// vector graphs and flushes the usage ledger.
    pub async fn serve(self) -> anyhow::Result<()> {
        let Self {
            state,
            listeners,
            drain,
            tls_watches,
            watches: _watches,
        } = self;
        let (collections, tenancy) = (state.collections.clone(), state.tenancy.clone());
        server::serve(listeners, state, drain).await?;
        tokio::task::block_in_place(|| collections.save_graphs());
        drop(tls_watches);
        if let Some(l) = &tenancy.ledger {
            l.close();
            tracing::info!("usage ledger flushed");
        }
        Ok(())
    }
}

/// Tells the tenancy the plugins' kinds (policy reloads check them too) and warns of policies
/// binding a plugin of the wrong kind: only their tenants' requests fail, so it is said now.
fn check_plugin_kinds(tenancy: &Tenancy, plugins: &Arc<Registry>) {
    let registry = plugins.clone();
    let wrong = tenancy.check_plugin_kinds(Box::new(move |tenant, name| {
        registry.get(tenant, name).map(|p| p.kind().as_str())
    }));
    for problem in wrong {
        tracing::warn!(%problem, "policy binds a plugin of the wrong kind; its requests will fail");
    }
}

/// Each local model's fallback chain.
fn fallbacks(cfg: &Config) -> BTreeMap<String, Fallback> {
    cfg.models
        .iter()
        .map(|m| {
            let f = Fallback {
                chain: m.fallback.clone(),
                saturated_waiting: m.saturated_waiting,
            };
            (m.name.clone(), f)
        })
        .collect()
}

/// Policies an edit of the file brings in are kept as versions and audited, as the admin API's
/// are, with `file` as who made them.
fn audit_file_edits(state: &AppState) {
    let Some(audit) = state.audit.clone() else {
        return;
    };
    state.tenancy.on_file_change(move |old, new| {
        let ts = crate::tenancy::unix_now();
        let version = audit
            .keep_policy(ts, "file", new)
            .map_err(|e| tracing::error!(error = %e, "could not keep the policy version"))
            .ok();
        let mut detail = crate::audit::line_changes(old, new);
        detail["version"] = serde_json::json!(version);
        let change = crate::audit::Change {
            ts,
            actor: "file".into(),
            action: "policy.replace".into(),
            target: "policies".into(),
            detail,
        };
        if let Err(e) = audit.record(&change) {
            tracing::error!(error = %e, "could not write the audit log");
        }
    });
}
