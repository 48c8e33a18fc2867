//! Tenants and what they may do: API keys (stored hashed), allow-lists, rate and token limits,
//! token budgets and the usage ledger, all from a policy file that is swapped atomically on
//! change. A request's admission reads one policy snapshot; reloading never disturbs requests
//! in flight, and what a tenant has used or reserved survives reloads.
//!
//! Must not depend on the HTTP server: it returns `Denied` values the server maps to errors.

pub mod cache_policy;
pub mod keys;
pub mod ledger;
pub mod limits;
pub mod policy;
mod rejection;
mod reservation;
pub mod shared;
pub mod watch;

pub use rejection::{Limit, Rejection};
pub use reservation::{Outcome, Reservation, Settled};

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use arc_swap::ArcSwap;

use crate::common::Endpoint;
use crate::config::RedisFailure;
use crate::metrics::Metrics;
use ledger::{Ledger, Record};
use limits::{Rates, Slot, Usage};
use policy::{Policies, PolicyError, TenantPolicy};
use shared::{Reserved, Shared};

/// The tenant of requests when no policy file is configured: no key needed, no limits.
pub const OPEN_TENANT: &str = "default";

/// One tenant under one policy version.
pub struct Tenant {
    pub name: Arc<str>,
    pub policy: TenantPolicy,
    /// The policy's `config` values, as plugins read them through `config-get`.
    pub values: Arc<std::collections::BTreeMap<String, crate::common::ConfigValue>>,
    /// Keys this tenant's prefix-cache entries apart from every other tenant's.
    pub cache_salt: u64,
    rates: Arc<Rates>,
    usage: Arc<Usage>,
}

impl Tenant {
    pub fn allows_model(&self, model: &str) -> bool {
        policy::allows(&self.policy.models, model)
    }

    pub fn allows_plugin(&self, plugin: &str) -> bool {
        policy::allows(&self.policy.plugins, plugin)
    }

    pub fn allows_collection(&self, collection: &str) -> bool {
        policy::allows(&self.policy.collections, collection)
    }
}

/// A key's tenant, id and expiry (Unix seconds).
type KeyOf = (Arc<Tenant>, Arc<str>, Option<i64>);

/// What is told of a policy the file brought in: (old text, new text).
type FileChange = Box<dyn Fn(&str, &str) + Send + Sync>;

struct PolicySet {
    by_key_hash: HashMap<[u8; 32], KeyOf>,
    tenants: BTreeMap<String, Arc<Tenant>>,
    text: String,
}

/// Why a request was turned away before it reached a handler.
#[derive(Debug)]
pub enum Denied {
    /// No key, or a key no tenant has (401).
    Unauthenticated(&'static str),
    /// A limit (429).
    Limited(Rejection),
    /// The usage ledger takes no writes and the policy is to refuse billable requests (503).
    LedgerUnavailable,
    /// Redis, which holds the limits every replica shares, does not answer, and the failure
    /// mode is `closed` (503).
    LimitsUnavailable,
}

/// An admitted request: its tenant, the key it used, and one of the tenant's in-flight slots.
/// The slot is shared with the request's `Reservation`, so a stream keeps it until it ends.
#[derive(Clone)]
pub struct Caller {
    pub tenant: Arc<Tenant>,
    pub key_id: Arc<str>,
    slot: Arc<Slot>,
    /// Time this request spent in plugins, in microseconds (for the ledger).
    pub plugin_us: Arc<AtomicU64>,
    /// Set when the request asked for its plugins' log lines (and the policy allows it).
    pub debug: Option<crate::common::LogSink>,
    /// The request sent `Cache-Control: no-cache` (or `no-store`): the response cache is
    /// neither read nor written.
    pub no_cache: bool,
    /// How the request's reservation settled.
    pub settled: Arc<Settled>,
}

impl Caller {
    fn new(tenant: Arc<Tenant>, key_id: Arc<str>, slot: Slot) -> Self {
        Self {
            tenant,
            key_id,
            slot: Arc::new(slot),
            plugin_us: Arc::default(),
            debug: None,
            no_cache: false,
            settled: Arc::default(),
        }
    }
}

impl std::ops::Deref for Caller {
    type Target = Arc<Tenant>;
    fn deref(&self) -> &Arc<Tenant> {
        &self.tenant
    }
}

pub struct Tenancy {
    policies: ArcSwap<PolicySet>,
    /// Per tenant name; outlives policy versions.
    usage: Mutex<HashMap<String, Arc<Usage>>>,
    /// The policy file, when there is one (else: open mode).
    pub path: Option<PathBuf>,
    pub ledger: Option<Ledger>,
    metrics: Arc<Metrics>,
    /// The kind of an installed plugin (tenant, name) → e.g. `"reranker"`, once the server has
    /// its plugin registry: policies binding a plugin of another kind are refused.
    plugin_kinds: std::sync::OnceLock<KindOf>,
    /// Limits shared with the other replicas (Redis), when configured.
    shared: std::sync::OnceLock<Arc<Shared>>,
    /// Told of each policy an edit of the file brought in (old text, new text).
    on_file_change: std::sync::OnceLock<FileChange>,
    /// Serialises replacements (admin API, cluster follower) and reloads of the file, so the
    /// file and the policy in force are always the same version.
    replacing: Mutex<()>,
}

/// Looks up the kind of the tenant's installed plugin, if it is installed.
pub type KindOf = Box<dyn Fn(&str, &str) -> Option<&'static str> + Send + Sync>;

impl Tenancy {
    /// Loads the policy file (if any) and opens the ledger (if any). A policy file that does
    /// not parse or validate is an error here: the gateway does not start on a bad policy.
    pub fn new(
        path: Option<PathBuf>,
        ledger: Option<Ledger>,
        metrics: Arc<Metrics>,
    ) -> Result<Self, PolicyError> {
        let text = match &path {
            Some(p) => std::fs::read_to_string(p)
                .map_err(|e| PolicyError(vec![format!("{}: {e}", p.display())]))?,
            None => String::new(),
        };
        let parsed = Policies::parse(&text)?;
        let t = Self {
            policies: ArcSwap::from_pointee(PolicySet {
                by_key_hash: HashMap::new(),
                tenants: BTreeMap::new(),
                text: String::new(),
            }),
            usage: Mutex::default(),
            path,
            ledger,
            metrics,
            plugin_kinds: std::sync::OnceLock::new(),
            shared: std::sync::OnceLock::new(),
            on_file_change: std::sync::OnceLock::new(),
            replacing: Mutex::default(),
        };
        t.install(parsed, text);
        Ok(t)
    }

    /// From now on, policies binding an installed plugin of the wrong kind are refused.
    /// Returns the problems of the policy in force (to warn about: it is already serving).
    pub fn check_plugin_kinds(&self, kind_of: KindOf) -> Vec<String> {
        let _ = self.plugin_kinds.set(kind_of);
        let set = self.policies.load();
        self.wrong_kinds(set.tenants.values().map(|t| &t.policy))
    }

    fn wrong_kinds<'a>(&self, tenants: impl Iterator<Item = &'a TenantPolicy>) -> Vec<String> {
        let Some(kind_of) = self.plugin_kinds.get() else {
            return Vec::new();
        };
        let mut problems = Vec::new();
        for t in tenants {
            for (field, want, name) in t.plugin_bindings() {
                let Some(name) = name else { continue };
                match kind_of(&t.name, name) {
                    Some(kind) if kind != want => problems.push(format!(
                        "tenant {:?}: {field} = {name:?} is installed as kind `{kind}`; {field} needs kind `{want}`",
                        t.name
                    )),
                    _ => {}
                }
            }
        }
        problems
    }

    /// Whether `replace(text)` would take `text`.
    pub fn check(&self, text: &str) -> Result<(), PolicyError> {
        self.parse(text).map(drop)
    }

    /// Parses and validates a policy text, bindings included.
    fn parse(&self, text: &str) -> Result<Policies, PolicyError> {
        let parsed = Policies::parse(text)?;
        let problems = self.wrong_kinds(parsed.tenants.iter());
        match problems.is_empty() {
            true => Ok(parsed),
            false => Err(PolicyError(problems)),
        }
    }

    pub fn open_mode(&self) -> bool {
        self.path.is_none()
    }

    /// The policy file's text now in force.
    pub fn text(&self) -> String {
        self.policies.load().text.clone()
    }

    /// Validates `text` and makes it the policy; with a policy file, writes it there first.
    /// On error nothing changes.
    pub fn replace(&self, text: &str) -> Result<(), PolicyError> {
        let _one = self.replacing.lock().unwrap_or_else(|e| e.into_inner());
        let parsed = self.parse(text)?;
        if let Some(path) = &self.path {
            crate::common::write_atomically(path, text.as_bytes())
                .map_err(|e| PolicyError(vec![format!("{}: {e}", path.display())]))?;
        }
        self.install(parsed, text.to_string());
        Ok(())
    }

    /// Re-reads the policy file; a bad file is logged and the policy in force stays.
    pub fn reload(&self) {
        let Some(path) = &self.path else { return };
        // Not beside a `replace`: one that has written the file but not yet installed it
        // would read as an edit of the file (a second, "file" version in the audit log), and
        // a text read before its write would be installed after it, undoing the change.
        let _one = self.replacing.lock().unwrap_or_else(|e| e.into_inner());
        let text = match std::fs::read_to_string(path) {
            Ok(t) => t,
            Err(e) => {
                return tracing::warn!(path = %path.display(), error = %e, "cannot read the policy file; keeping the policy in force")
            }
        };
        if text == self.policies.load().text {
            return;
        }
        // An editor that saves in place truncates the file first; a slow write can leave it
        // empty past the debounce. Installing that would drop every tenant and key until the
        // content lands, so an empty file waits for the next change (a policy with no tenants
        // is still written as, say, a comment).
        if text.trim().is_empty() && !self.policies.load().text.trim().is_empty() {
            return tracing::warn!(path = %path.display(), "the policy file is empty (a save in progress?); keeping the policy in force");
        }
        match self.parse(&text) {
            Ok(p) => {
                let old = self.text();
                self.install(p, text.clone());
                tracing::info!(path = %path.display(), "policies reloaded");
                if let Some(told) = self.on_file_change.get() {
                    told(&old, &text);
                }
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), problems = %e, "policy file rejected; keeping the policy in force")
            }
        }
    }

    fn install(&self, parsed: Policies, text: String) {
        let old = self.policies.load_full();
        let mut usage = self.usage.lock().unwrap_or_else(|e| e.into_inner());
        let mut set = PolicySet {
            by_key_hash: HashMap::new(),
            tenants: BTreeMap::new(),
            text,
        };
        let mut tenants = parsed.tenants;
        if self.open_mode() {
            tenants.push(open_tenant());
        }
        for p in tenants {
            let rates = match old.tenants.get(&p.name) {
                Some(t) if t.rates.same_quotas(&p) => t.rates.clone(),
                _ => Arc::new(Rates::new(&p)),
            };
            let tenant = Arc::new(Tenant {
                name: p.name.as_str().into(),
                values: Arc::new(p.config.clone()),
                cache_salt: salt(&p.name),
                usage: usage.entry(p.name.clone()).or_default().clone(),
                rates,
                policy: p,
            });
            for k in &tenant.policy.keys {
                if let Some(hash) = parse_hex32(&k.sha256) {
                    set.by_key_hash
                        .insert(hash, (tenant.clone(), k.id.as_str().into(), k.expires_at));
                }
            }
            set.tenants.insert(tenant.policy.name.clone(), tenant);
        }
        self.policies.store(Arc::new(set));
    }

    /// The tenants of the policy in force, by name.
    pub fn tenant_names(&self) -> Vec<String> {
        self.policies.load().tenants.keys().cloned().collect()
    }

    /// Whether the policy in force has tenant `name` (in open mode, only `default`).
    pub fn has_tenant(&self, name: &str) -> bool {
        self.policies.load().tenants.contains_key(name)
    }

    /// The tenant and key id of an API key (the request's bearer token).
    fn authenticate(&self, key: Option<&str>) -> Result<(Arc<Tenant>, Arc<str>), Denied> {
        let set = self.policies.load();
        if self.open_mode() {
            return Ok((set.tenants[OPEN_TENANT].clone(), Arc::from("none")));
        }
        let key = key.ok_or(Denied::Unauthenticated(
            "Missing API key: send `Authorization: Bearer <key>`.",
        ))?;
        let (t, id, expires) = set
            .by_key_hash
            .get(&keys::hash(key))
            .ok_or(Denied::Unauthenticated("Invalid API key."))?;
        if expires.is_some_and(|at| at <= unix_now()) {
            return Err(Denied::Unauthenticated("This API key has expired."));
        }
        Ok((t.clone(), id.clone()))
    }

    fn count_rejection(&self, tenant: &Tenant, r: &Rejection) {
        self.metrics
            .tenant_rejections
            .with_label_values(&[&tenant.name, r.limit.as_str()])
            .inc();
    }

    fn rejected(&self, tenant: &Tenant, r: Rejection) -> Denied {
        self.count_rejection(tenant, &r);
        Denied::Limited(r)
    }

    fn admit_locally(&self, tenant: Arc<Tenant>, key_id: Arc<str>) -> Result<Caller, Denied> {
        match tenant
            .usage
            .admit(&tenant.rates, tenant.policy.max_concurrent)
        {
            Ok(slot) => Ok(Caller::new(tenant, key_id, slot)),
            Err(r) => Err(self.rejected(&tenant, r)),
        }
    }

    /// Authenticates the API key and applies the tenant's request-rate and concurrency
    /// limits, against the limits every replica shares when `[cluster] redis` is set
    /// (`billable`: also refused while the ledger cannot record the request).
    pub async fn admit_request(&self, key: Option<&str>, billable: bool) -> Result<Caller, Denied> {
        if billable && self.ledger.as_ref().is_some_and(|l| !l.accepting()) {
            return Err(Denied::LedgerUnavailable);
        }
        let (tenant, key_id) = self.authenticate(key)?;
        let p = &tenant.policy;
        let limited = p.requests_per_second.is_some()
            || p.requests_per_minute.is_some()
            || p.max_concurrent.is_some();
        // No request limit to share: no round trip.
        let Some(shared) = self.shared.get().filter(|_| limited) else {
            return self.admit_locally(tenant, key_id);
        };
        match shared.admit(&tenant.policy).await {
            Ok(Ok(member)) => {
                let slot = Slot::shared(shared, &tenant.name, member);
                Ok(Caller::new(tenant, key_id, slot))
            }
            Ok(Err(r)) => Err(self.rejected(&tenant, r)),
            Err(_) => match shared.failure {
                RedisFailure::Open => {
                    self.metrics.shared.local_fallbacks.inc();
                    self.admit_locally(tenant, key_id)
                }
                RedisFailure::Closed => Err(Denied::LimitsUnavailable),
            },
        }
    }

    /// `f` is told of each policy an edit of the file brings in (the audit log records it;
    /// the admin API's replaces are recorded where they are made). Runs on the watcher's
    /// thread.
    pub fn on_file_change(&self, f: impl Fn(&str, &str) + Send + Sync + 'static) {
        let _ = self.on_file_change.set(Box::new(f));
    }

    /// From now on, limits and budgets are shared through Redis.
    pub fn share_limits(&self, shared: Arc<Shared>) {
        let _ = self.shared.set(shared);
    }

    /// Reserves `tokens` (prompt + the most the request may generate) for `caller`, in
    /// this process only: what `reserve_tokens` falls back to without shared limits.
    fn reserve_locally(
        self: &Arc<Self>,
        caller: &Caller,
        model: &str,
        endpoint: Endpoint,
        prompt_tokens: u64,
        tokens: u64,
    ) -> Result<Reservation, Rejection> {
        let now = unix_now();
        let tenant = &caller.tenant;
        let reserved = tenant
            .usage
            .reserve(&tenant.rates, tenant.policy.token_budget, tokens, now, |period| match &self.ledger {
                Some(l) => off_runtime(|| l.period_usage(&tenant.name, period, now)).unwrap_or_else(|e| {
                    tracing::error!(error = %e, "cannot read the usage ledger; counting this period from zero");
                    fallback_period(period, now)
                }),
                None => fallback_period(period, now),
            });
        if let Err(r) = reserved {
            self.count_rejection(tenant, &r);
            return Err(r);
        }
        Ok(self.reservation(caller, model, endpoint, prompt_tokens, tokens, None))
    }

    /// Reserves `tokens` (prompt + the most the request may generate) for `caller`, against
    /// the token rate and budget every replica shares when `[cluster] redis` is set.
    pub async fn reserve_tokens(
        self: &Arc<Self>,
        caller: &Caller,
        model: &str,
        endpoint: Endpoint,
        prompt_tokens: u64,
        tokens: u64,
    ) -> Result<Reservation, Denied> {
        let p = &caller.tenant.policy;
        let shared = match self.shared.get() {
            Some(s) if p.token_budget.is_some() || p.tokens_per_minute.is_some() => s,
            _ => {
                return self
                    .reserve_locally(caller, model, endpoint, prompt_tokens, tokens)
                    .map_err(Denied::Limited)
            }
        };
        let now = unix_now();
        let budget = p.token_budget.map(|b| {
            let (start, end) = b.period.bounds(now);
            (b, start, end)
        });
        let mut reserved = shared.reserve(p, tokens, budget, None).await;
        if let (Ok(Reserved::Unseeded), Some((b, ..))) = (&reserved, budget) {
            // Redis has no count for this period (its first request, or Redis lost its
            // data): it starts from what the ledger (shared, with PostgreSQL) recorded.
            let used = match &self.ledger {
                Some(l) => off_runtime(|| l.period_usage(&p.name, b.period, now))
                    .map(|(_, _, used)| used)
                    .unwrap_or_else(|e| {
                        tracing::error!(error = %e, "cannot read the usage ledger; counting this period's budget from zero");
                        0
                    }),
                None => 0,
            };
            reserved = shared.reserve(p, tokens, budget, Some(used)).await;
        }
        match reserved {
            Ok(Reserved::Held(r)) => {
                let held = Some((shared.clone(), r));
                Ok(self.reservation(caller, model, endpoint, prompt_tokens, tokens, held))
            }
            Ok(Reserved::Refused(r)) => Err(self.rejected(&caller.tenant, r)),
            Ok(Reserved::Unseeded) => Err(Denied::LimitsUnavailable),
            Err(_) => match shared.failure {
                RedisFailure::Open => {
                    self.metrics.shared.local_fallbacks.inc();
                    self.reserve_locally(caller, model, endpoint, prompt_tokens, tokens)
                        .map_err(Denied::Limited)
                }
                RedisFailure::Closed => Err(Denied::LimitsUnavailable),
            },
        }
    }

    fn reservation(
        self: &Arc<Self>,
        caller: &Caller,
        model: &str,
        endpoint: Endpoint,
        prompt_tokens: u64,
        tokens: u64,
        shared: Option<(Arc<Shared>, shared::SharedReservation)>,
    ) -> Reservation {
        Reservation {
            tenancy: self.clone(),
            tenant: caller.tenant.clone(),
            key_id: caller.key_id.clone(),
            model: model.to_string(),
            endpoint,
            reserved: tokens,
            prompt_tokens: AtomicU64::new(prompt_tokens),
            completion_tokens: AtomicU64::new(0),
            started: Instant::now(),
            ts: unix_now(),
            settled: std::sync::atomic::AtomicBool::new(false),
            _slot: caller.slot.clone(),
            plugin_us: caller.plugin_us.clone(),
            _alive: shared
                .as_ref()
                .and_then(|(s, r)| s.keep_alive(r.member().into_iter().collect())),
            shared,
            more_shared: Vec::new(),
            _more_alive: Vec::new(),
            report: caller.settled.clone(),
        }
    }

    /// Grows `r` by `tokens` against the same limits: the prompt, known exactly only after
    /// retrieval and the template, came out longer than the estimate reserved at admission.
    pub async fn reserve_more(
        self: &Arc<Self>,
        caller: &Caller,
        r: &mut Reservation,
        tokens: u64,
    ) -> Result<(), Denied> {
        if tokens == 0 {
            return Ok(());
        }
        let more = self
            .reserve_tokens(caller, &r.model, r.endpoint, 0, tokens)
            .await?;
        r.absorb(more);
        Ok(())
    }

    /// Records a request that generated nothing (rerank, or one refused after admission).
    pub fn record_plain(
        &self,
        caller: &Caller,
        model: &str,
        endpoint: Endpoint,
        started: Instant,
        outcome: Outcome,
    ) {
        let status = outcome.as_str();
        self.metrics
            .tenant_requests
            .with_label_values(&[&caller.tenant.name, status])
            .inc();
        if let Some(l) = &self.ledger {
            l.record(Record {
                ts: unix_now(),
                tenant: caller.tenant.name.to_string(),
                key_id: caller.key_id.to_string(),
                model: model.to_string(),
                endpoint: endpoint.as_str(),
                prompt_tokens: 0,
                completion_tokens: 0,
                latency_ms: started.elapsed().as_secs_f64() * 1e3,
                status,
                plugin_ms: caller.plugin_us.load(Ordering::Relaxed) as f64 / 1e3,
            });
        }
    }
}

fn open_tenant() -> TenantPolicy {
    Policies::parse(&format!("[[tenants]]\nname = \"{OPEN_TENANT}\"\n"))
        .expect("static policy")
        .tenants
        .remove(0)
}

/// Runs blocking `f` (a SQLite query, once per tenant and period) so that it does not stall
/// an async worker: on a multi-threaded runtime the worker hands its other tasks over first.
fn off_runtime<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

fn fallback_period(period: policy::Period, now: i64) -> (i64, i64, u64) {
    let (start, end) = period.bounds(now);
    (start, end, 0)
}

pub fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

fn salt(tenant: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    tenant.hash(&mut h);
    h.finish()
}

fn parse_hex32(s: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}
