//! The follower: one thread per replica that applies here the plugin and policy changes made
//! through any replica (this one's own come back too, and change nothing).

use std::sync::Arc;
use std::time::Duration;

use postgres::fallible_iterator::FallibleIterator;
use postgres::Client;

use super::{Replication, CHANNEL};
use crate::plugins::{PluginKind, Registry};
use crate::search::collection::Settings;
use crate::search::Collections;
use crate::tenancy::Tenancy;

/// The longest a change waits when its `NOTIFY` was lost (a reconnect, a busy database).
const POLL: Duration = Duration::from_secs(1);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// The longest start-up waits for the tables' first read (connect timeout and a margin).
const FIRST_SYNC: Duration = Duration::from_secs(15);

struct Follower {
    rep: Arc<Replication>,
    registry: Arc<Registry>,
    tenancy: Arc<Tenancy>,
    collections: Arc<Collections>,
    client: Option<Client>,
    /// The last change applied from each table.
    plugins_seq: i64,
    policy_seq: i64,
    collections_seq: i64,
}

/// Applies what the tables hold now (bounded by the connect timeout), then follows them on a
/// thread of its own.
pub(super) fn spawn(
    rep: Arc<Replication>,
    registry: Arc<Registry>,
    tenancy: Arc<Tenancy>,
    collections: Arc<Collections>,
) -> std::io::Result<()> {
    let mut f = Follower {
        rep,
        registry,
        tenancy,
        collections,
        client: None,
        plugins_seq: 0,
        policy_seq: 0,
        collections_seq: 0,
    };
    let (synced, first) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("cluster-follow".into())
        .spawn(move || {
            if let Err(e) = f.sync() {
                f.failed();
                tracing::error!(error = %e, "cannot read plugins and policies from PostgreSQL; serving the local ones until it answers");
            }
            let _ = synced.send(());
            f.run()
        })?;
    // The first read happens on the follower's thread (a blocking client may not run on the
    // async runtime's), and start-up waits for it, bounded by the connect timeout.
    let _ = first.recv_timeout(FIRST_SYNC);
    Ok(())
}

impl Follower {
    fn run(mut self) {
        let mut backoff = Duration::from_millis(200);
        loop {
            match self.wait().and_then(|()| self.sync()) {
                Ok(()) => backoff = Duration::from_millis(200),
                Err(e) => {
                    self.failed();
                    tracing::warn!(error = %e, retry_in = ?backoff, "following plugins and policies in PostgreSQL failed");
                    std::thread::sleep(backoff);
                    backoff = (backoff * 2).min(BACKOFF_MAX);
                }
            }
        }
    }

    fn failed(&mut self) {
        self.client = None;
        self.rep.error("follow");
    }

    fn client(&mut self) -> Result<&mut Client, postgres::Error> {
        if self.client.as_ref().is_none_or(|c| c.is_closed()) {
            let mut c = self.rep.connect()?;
            c.batch_execute(&format!("LISTEN {CHANNEL}"))?;
            self.client = Some(c);
        }
        Ok(self.client.as_mut().expect("connected above"))
    }

    /// Until a change is announced, or `POLL` passes.
    fn wait(&mut self) -> Result<(), postgres::Error> {
        let mut notes = self.client()?.notifications();
        if notes.timeout_iter(POLL).next()?.is_some() {
            // Several changes announced at once need one read.
            while notes.iter().next()?.is_some() {}
        }
        Ok(())
    }

    fn sync(&mut self) -> Result<(), postgres::Error> {
        let (plugins_seq, policy_seq) = (self.plugins_seq, self.policy_seq);
        let c = self.client()?;
        let plugins = c.query(
            "SELECT tenant, name, kind, sha256, wasm, deleted, seq FROM gateway_plugins WHERE seq > $1 ORDER BY seq",
            &[&plugins_seq],
        )?;
        let policy = c.query_opt(
            "SELECT text, seq FROM gateway_policy WHERE seq > $1",
            &[&policy_seq],
        )?;
        for row in plugins {
            let (tenant, name): (&str, &str) = (row.get(0), row.get(1));
            if row.get::<_, bool>(5) {
                self.remove_plugin(tenant, name);
            } else {
                self.put_plugin(tenant, name, row.get(2), row.get(3), row.get(4));
            }
            self.plugins_seq = row.get(6);
        }
        if let Some(row) = policy {
            self.put_policy(row.get(0));
            self.policy_seq = row.get(1);
        }
        self.sync_collections()
    }

    /// Collections created or deleted elsewhere, then documents written elsewhere.
    fn sync_collections(&mut self) -> Result<(), postgres::Error> {
        let after = self.collections_seq;
        let c = self.client()?;
        let changed = c.query(
            "SELECT tenant, name, incarnation, settings, deleted, seq FROM gateway_collections WHERE seq > $1 ORDER BY seq",
            &[&after],
        )?;
        let heads: std::collections::HashMap<String, i64> = c
            .query(
                "SELECT incarnation, doc_seq FROM gateway_collections WHERE NOT deleted",
                &[],
            )?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        for row in changed {
            let (tenant, name, incarnation): (&str, &str, &str) =
                (row.get(0), row.get(1), row.get(2));
            let settings = match row.get::<_, bool>(4) {
                true => None,
                false => match serde_json::from_str::<Settings>(row.get(3)) {
                    Ok(s) => Some(s),
                    Err(e) => {
                        tracing::warn!(tenant, collection = name, error = %e, "unreadable collection settings in PostgreSQL; skipped");
                        self.collections_seq = row.get(5);
                        continue;
                    }
                },
            };
            let created = settings.is_some();
            match self.collections.follow(tenant, name, incarnation, settings) {
                Ok(()) => self.applied(if created {
                    "collection"
                } else {
                    "collection_delete"
                }),
                Err(e) => {
                    tracing::warn!(tenant, collection = name, error = %e, "cannot follow a collection changed through another replica")
                }
            }
            self.collections_seq = row.get(5);
        }
        for col in self.collections.all() {
            let incarnation = col.incarnation();
            match heads.get(&incarnation) {
                Some(&head) if head > col.applied() => {
                    if let Err(e) = col.catch_up() {
                        tracing::warn!(collection = %col.name, error = %e, "cannot apply documents written through another replica");
                    }
                }
                Some(_) => {}
                None if after == 0 => {
                    tracing::warn!(collection = %col.name, %incarnation, "collection not in the shared store (made before [cluster] postgres was set?); it serves here only, and writes to it fail")
                }
                None => {}
            }
        }
        Ok(())
    }

    fn applied(&self, kind: &str) {
        let m = &self.rep.metrics.shared.changes_applied;
        m.with_label_values(&[kind]).inc();
    }

    fn put_plugin(&self, tenant: &str, name: &str, kind: &str, sha: &str, wasm: Option<&[u8]>) {
        if self
            .registry
            .get(tenant, name)
            .is_some_and(|p| p.sha256 == sha)
        {
            return;
        }
        let (Some(wasm), Some(kind)) = (wasm, PluginKind::parse(kind)) else {
            return tracing::warn!(
                tenant,
                plugin = name,
                "unreadable plugin row in PostgreSQL; skipped"
            );
        };
        match self.registry.install(tenant, name, wasm, Some(kind)) {
            Ok(_) => {
                self.applied("plugin");
                tracing::info!(tenant, plugin = name, sha256 = %&sha[..sha.len().min(12)], "plugin installed from another replica");
            }
            Err(e) => {
                tracing::warn!(tenant, plugin = name, error = %e, "a plugin stored by another replica does not load here; the previous version (if any) stays")
            }
        }
    }

    fn remove_plugin(&self, tenant: &str, name: &str) {
        match self.registry.remove(tenant, name) {
            Ok(true) => {
                self.applied("plugin_delete");
                tracing::info!(
                    tenant,
                    plugin = name,
                    "plugin deleted through another replica"
                );
            }
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(tenant, plugin = name, error = %e, "cannot remove a plugin deleted through another replica")
            }
        }
    }

    fn put_policy(&self, text: &str) {
        if self.tenancy.open_mode() {
            return tracing::warn!("another replica replaced the policy, but this one runs without a policy file; ignored");
        }
        if text == self.tenancy.text() {
            return;
        }
        match self.tenancy.replace(text) {
            Ok(()) => {
                self.applied("policy");
                tracing::info!("policies replaced through another replica");
            }
            Err(e) => {
                tracing::warn!(problems = %e, "a policy stored by another replica is rejected here; keeping the policy in force")
            }
        }
    }
}
