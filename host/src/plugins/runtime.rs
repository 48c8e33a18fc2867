//! The wasmtime side: one `Engine` with a pooling allocator and an epoch ticker, compilation
//! with an on-disk cache keyed by the component's hash, and one call = one fresh `Store`.

use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::common::{hex, write_atomically};
use wasmtime::component::{Component, InstancePre, Linker, ResourceTable};
use wasmtime::{
    Config, Engine, InstanceAllocationStrategy, PoolingAllocationConfig, Store, StoreLimitsBuilder,
    Trap,
};
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;
use wasmtime_wasi::WasiCtxBuilder;

use super::bindings::{
    cache_key::CacheKeyPre, logits_processor::LogitsProcessorPre, output_parser::OutputParserPre,
    prompt_template::PromptTemplatePre, reranker::RerankerPre, CallState, Limiter,
};
use super::{CallError, LoadError, PluginKind};
use crate::config::PluginsConfig;

/// How often the epoch advances; deadlines are rounded up to whole ticks.
const EPOCH_TICK: Duration = Duration::from_millis(2);
/// Guest stderr kept per call: enough for a panic message.
const STDERR_BYTES: usize = 4096;

pub struct Runtime {
    engine: Engine,
    linker: Linker<CallState>,
    cache_dir: Option<PathBuf>,
    deadline_ticks: u64,
    pub timeout: Duration,
    /// Keep instances warm between calls (see `warm`); off = a fresh instance per call.
    pub reuse_instances: bool,
    /// Idle instances now, over all plugins, and the most allowed.
    pub idle: Arc<std::sync::atomic::AtomicUsize>,
    pub max_idle: usize,
    pub memory_cap: usize,
    inherit_stdio: bool,
    /// Calls running now, per tenant, and the most one tenant may have: a tenant whose
    /// plugins all sleep to their deadline cannot take every instance slot.
    tenant_calls: std::sync::Mutex<std::collections::HashMap<Arc<str>, usize>>,
    max_calls_per_tenant: usize,
    pub max_error_bytes: usize,
    pub max_output_bytes: usize,
}

/// One running call counted against its tenant's quota.
pub struct TenantSlot<'a> {
    rt: &'a Runtime,
    tenant: Arc<str>,
}

impl Drop for TenantSlot<'_> {
    fn drop(&mut self) {
        let mut calls = self
            .rt
            .tenant_calls
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(n) = calls.get_mut(&self.tenant) {
            *n -= 1;
            if *n == 0 {
                calls.remove(&self.tenant);
            }
        }
    }
}

/// A compiled, linked and world-checked plugin, ready to instantiate.
pub enum Prepared {
    PromptTemplate(PromptTemplatePre<CallState>),
    Reranker(RerankerPre<CallState>),
    OutputParser(OutputParserPre<CallState>),
    LogitsProcessor(LogitsProcessorPre<CallState>),
    CacheKey(CacheKeyPre<CallState>),
    /// Built against `gateway:plugins@0.1.0`, called through adapters.
    Legacy(super::legacy::Prepared),
}

impl Prepared {
    pub fn kind(&self) -> PluginKind {
        match self {
            Prepared::PromptTemplate(_) => PluginKind::PromptTemplate,
            Prepared::Reranker(_) => PluginKind::Reranker,
            Prepared::OutputParser(_) => PluginKind::OutputParser,
            Prepared::LogitsProcessor(_) => PluginKind::LogitsProcessor,
            Prepared::CacheKey(_) => PluginKind::CacheKey,
            Prepared::Legacy(p) => p.kind(),
        }
    }

    /// The version of the contract the plugin is served as.
    pub fn version(&self) -> &'static str {
        match self {
            Prepared::Legacy(_) => super::LEGACY_WIT_VERSION,
            _ => super::WIT_VERSION,
        }
    }

    /// `pre` as the current world of `kind`.
    fn new(kind: PluginKind, pre: InstancePre<CallState>) -> wasmtime::Result<Self> {
        Ok(match kind {
            PluginKind::PromptTemplate => Prepared::PromptTemplate(PromptTemplatePre::new(pre)?),
            PluginKind::Reranker => Prepared::Reranker(RerankerPre::new(pre)?),
            PluginKind::OutputParser => Prepared::OutputParser(OutputParserPre::new(pre)?),
            PluginKind::LogitsProcessor => Prepared::LogitsProcessor(LogitsProcessorPre::new(pre)?),
            PluginKind::CacheKey => Prepared::CacheKey(CacheKeyPre::new(pre)?),
        })
    }
}

/// One clear line for the files wasmtime would refuse with a dump: not WebAssembly at all,
/// or a core module where a component is needed.
fn check_header(wasm: &[u8]) -> Result<(), LoadError> {
    match wasm.get(..8) {
        Some([0, b'a', b's', b'm', 1, 0, 0, 0]) => Err(LoadError::Compile(
            "this is a core WebAssembly module, not a component; build the plugin with \
             `cargo build --target wasm32-wasip2` (or componentize it)"
                .into(),
        )),
        Some([0, b'a', b's', b'm', ..]) => Ok(()),
        _ => Err(LoadError::Compile(format!(
            "not a WebAssembly file ({} bytes without the `\\0asm` header)",
            wasm.len()
        ))),
    }
}

/// A component built against another version of the contract would only fail to link with
/// "implementation is missing"; say which version it wants and which this gateway serves.
/// Returns the version its imports name, if they name one (a plugin that calls nothing of
/// the host's imports nothing of the contract).
fn check_version(
    engine: &Engine,
    component: &Component,
) -> Result<Option<&'static str>, LoadError> {
    let mut found = None;
    for (name, _) in component.component_type().imports(engine) {
        let Some(rest) = name.strip_prefix("gateway:plugins/") else {
            continue;
        };
        let version = rest.split_once('@').map_or("", |(_, v)| v);
        let Some(known) = super::WIT_VERSIONS.iter().find(|v| **v == version) else {
            let version = if version.is_empty() {
                "(no version)"
            } else {
                version
            };
            return Err(LoadError::Version(version.to_string()));
        };
        if let Some(other) = found.filter(|f| f != known) {
            return Err(LoadError::Link(format!(
                "the component imports both gateway:plugins@{other} and @{known}; build it against one"
            )));
        }
        found = Some(*known);
    }
    Ok(found)
}

impl Runtime {
    pub fn new(cfg: &PluginsConfig) -> Result<Arc<Self>, StartError> {
        let fail = |e: &dyn std::fmt::Display| StartError(e.to_string());
        let memory_cap = cfg.memory_mb * (1 << 20);
        let mut pool = PoolingAllocationConfig::default();
        // A Rust wasip2 component is one main module plus the small shim modules
        // wit-component adds for its imports; these bounds leave room for that.
        pool.total_component_instances(cfg.max_instances)
            .total_core_instances(cfg.max_instances * 4)
            .total_memories(cfg.max_instances * 2)
            .total_tables(cfg.max_instances * 4)
            .max_memory_size(memory_cap)
            .max_memories_per_component(2)
            // Every call runs on a fiber: one stack per live instance.
            .total_stacks(cfg.max_instances);
        let mut config = Config::new();
        config
            .allocation_strategy(InstanceAllocationStrategy::Pooling(pool))
            .epoch_interruption(true)
            // Linear memories never outgrow the cap, so reserve only that much address space
            // per pool slot instead of the default 4 GiB.
            .memory_reservation(memory_cap as u64)
            .memory_guard_size(1 << 16)
            .memory_reservation_for_growth(0);
        let engine = Engine::new(&config).map_err(|e| fail(&e))?;
        let mut linker = Linker::new(&engine);
        wasmtime_wasi::p2::add_to_linker_async(&mut linker).map_err(|e| fail(&e))?;
        super::bindings::prompt_template::gateway::plugins::host::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |s| s)
        .map_err(|e| fail(&e))?;
        super::bindings::prompt_template::gateway::plugins::types::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |s| s)
        .map_err(|e| fail(&e))?;
        super::bindings::logits_processor::gateway::plugins::vocabulary::add_to_linker::<
            _,
            wasmtime::component::HasSelf<_>,
        >(&mut linker, |s| s)
        .map_err(|e| fail(&e))?;
        super::legacy::add_to_linker(&mut linker).map_err(|e| fail(&e))?;

        // The ticker holds only a weak handle: it ends when the runtime is dropped.
        let weak = engine.weak();
        std::thread::Builder::new()
            .name("plugin-epoch".into())
            .spawn(move || {
                while let Some(engine) = weak.upgrade() {
                    engine.increment_epoch();
                    drop(engine);
                    std::thread::sleep(EPOCH_TICK);
                }
            })
            .map_err(|e| fail(&e))?;
        let timeout = Duration::from_millis(cfg.timeout_ms);
        let ticks = timeout.as_micros().div_ceil(EPOCH_TICK.as_micros()) as u64;
        Ok(Arc::new(Self {
            engine,
            linker,
            cache_dir: cfg.cache_dir.clone(),
            // +1: the current tick may be about to end.
            deadline_ticks: ticks + 1,
            timeout,
            reuse_instances: cfg.reuse_instances,
            idle: Arc::default(),
            max_idle: cfg.max_instances as usize / 2,
            memory_cap,
            inherit_stdio: cfg.debug_stdio,
            tenant_calls: Default::default(),
            max_calls_per_tenant: match cfg.max_calls_per_tenant {
                0 => (cfg.max_instances as usize / 4).max(1),
                n => n,
            },
            max_error_bytes: cfg.max_error_bytes,
            max_output_bytes: cfg.max_output_bytes,
        }))
    }

    /// Compiles (or loads from the cache), links and checks `wasm` against the plugin worlds.
    /// With `expected`, the component must implement that world.
    pub fn prepare(
        &self,
        wasm: &[u8],
        expected: Option<PluginKind>,
    ) -> Result<Prepared, LoadError> {
        check_header(wasm)?;
        let component = self.compile(wasm)?;
        let version = check_version(&self.engine, &component)?;
        let pre = self
            .linker
            .instantiate_pre(&component)
            .map_err(|e| LoadError::Link(format!("{e:#}")))?;
        // Without imports of the contract, only the exports tell the versions apart (a 0.1.0
        // reranker's candidates differ); the current version is tried first.
        let versions: &[&str] = match version {
            Some(v) => &[v],
            None => &[super::WIT_VERSION, super::LEGACY_WIT_VERSION],
        };
        let mut problems = Vec::new();
        for &version in versions {
            for kind in PluginKind::ALL
                .into_iter()
                .filter(|k| expected.is_none_or(|e| e == *k))
            {
                let prepared = match version == super::WIT_VERSION {
                    true => Prepared::new(kind, pre.clone()),
                    false => super::legacy::Prepared::new(kind, pre.clone()).map(Prepared::Legacy),
                };
                // The reasons reported are the first version's: the one the plugin most
                // likely meant.
                match prepared {
                    Ok(p) => return Ok(p),
                    Err(e) if version == versions[0] => {
                        problems.push(format!("not a {kind}: {e:#}"))
                    }
                    Err(_) => {}
                }
            }
        }
        Err(LoadError::NoWorld(problems.join("; ")))
    }

    fn compile(&self, wasm: &[u8]) -> Result<Component, LoadError> {
        let Some(dir) = &self.cache_dir else {
            return Component::new(&self.engine, wasm)
                .map_err(|e| LoadError::Compile(format!("{e:#}")));
        };
        let mut h = std::collections::hash_map::DefaultHasher::new();
        self.engine.precompile_compatibility_hash().hash(&mut h);
        let path = dir.join(format!(
            "{}-{:016x}.cwasm",
            hex(&Sha256::digest(wasm)),
            h.finish()
        ));
        if path.exists() {
            // SAFETY: files in the cache directory are only ever written by `precompile_component`
            // below, for this engine configuration (its compatibility hash is in the name).
            match unsafe { Component::deserialize_file(&self.engine, &path) } {
                Ok(c) => return Ok(c),
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "discarding unreadable compiled plugin")
                }
            }
        }
        let start = Instant::now();
        let bytes = self
            .engine
            .precompile_component(wasm)
            .map_err(|e| LoadError::Compile(format!("{e:#}")))?;
        tracing::info!(
            ms = start.elapsed().as_millis() as u64,
            bytes = wasm.len(),
            "compiled plugin"
        );
        if let Err(e) = write_atomically(&path, &bytes) {
            tracing::warn!(path = %path.display(), error = %e, "could not cache the compiled plugin");
        }
        // SAFETY: `bytes` was produced by `precompile_component` on this very engine.
        unsafe { Component::deserialize(&self.engine, &bytes) }
            .map_err(|e| LoadError::Compile(format!("{e:#}")))
    }

    /// Deletes compiled components in the cache that belong to none of `installed` (SHA-256s):
    /// a removed or replaced plugin's machine code does not stay on disk forever.
    pub fn prune_cache(&self, installed: &std::collections::HashSet<&str>) {
        let Some(dir) = &self.cache_dir else { return };
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(sha) = name
                .to_str()
                .filter(|n| n.ends_with(".cwasm"))
                .and_then(|n| n.split('-').next())
            else {
                continue;
            };
            if !installed.contains(sha) {
                match std::fs::remove_file(entry.path()) {
                    Ok(()) => tracing::debug!(file = ?name, "removed an unused compiled plugin"),
                    Err(e) => {
                        tracing::warn!(file = ?name, error = %e, "could not remove an unused compiled plugin")
                    }
                }
            }
        }
    }

    /// A fresh store for one call: no filesystem, network, environment or arguments; stderr
    /// captured (for panic messages) unless stdio debugging is on.
    pub fn store(
        &self,
        tenant: &Arc<str>,
        plugin: &Arc<str>,
        config: &super::TenantValues,
    ) -> (Store<CallState>, Option<MemoryOutputPipe>) {
        let mut wasi = WasiCtxBuilder::new();
        let stderr = if self.inherit_stdio {
            wasi.inherit_stdout().inherit_stderr();
            None
        } else {
            let pipe = MemoryOutputPipe::new(STDERR_BYTES);
            wasi.stderr(pipe.clone());
            Some(pipe)
        };
        let state = CallState {
            wasi: wasi.build(),
            table: ResourceTable::new(),
            limiter: Limiter {
                limits: StoreLimitsBuilder::new()
                    .memory_size(self.memory_cap)
                    .build(),
                memory_cap: self.memory_cap,
                hit_memory_cap: false,
            },
            tenant: tenant.clone(),
            plugin: plugin.clone(),
            config: config.clone(),
            logs: 0,
            vocab: None,
        };
        let mut store = Store::new(&self.engine, state);
        store.limiter(|s| &mut s.limiter);
        store.epoch_deadline_trap();
        (store, stderr)
    }

    /// Counts a call against `tenant`'s quota, or refuses it (`Busy`) when the tenant already
    /// has its most calls running.
    pub fn admit(&self, tenant: &Arc<str>) -> Result<TenantSlot<'_>, CallError> {
        let mut calls = self.tenant_calls.lock().unwrap_or_else(|e| e.into_inner());
        let n = calls.entry(tenant.clone()).or_default();
        if *n >= self.max_calls_per_tenant {
            return Err(CallError::Busy(format!(
                "tenant `{tenant}` already has {n} plugin calls running (plugins.max_calls_per_tenant)"
            )));
        }
        *n += 1;
        Ok(TenantSlot {
            rt: self,
            tenant: tenant.clone(),
        })
    }

    /// Starts a call's deadline.
    pub fn arm(&self, store: &mut Store<CallState>) {
        store.set_epoch_deadline(self.deadline_ticks);
    }

    /// Turns a failed call into its cause.
    pub fn classify(
        &self,
        store: &Store<CallState>,
        stderr: Option<&MemoryOutputPipe>,
        err: wasmtime::Error,
    ) -> CallError {
        if store.data().limiter.hit_memory_cap {
            return CallError::Memory {
                limit_mb: self.memory_cap >> 20,
            };
        }
        if err.downcast_ref::<Trap>() == Some(&Trap::Interrupt) {
            return CallError::Timeout {
                ms: self.timeout.as_millis() as u64,
            };
        }
        let text = stderr
            .map(|p| String::from_utf8_lossy(&p.contents()).into_owned())
            .unwrap_or_default();
        if let Some(at) = text.find("panicked at") {
            let msg: String = text[at..].lines().take(2).collect::<Vec<_>>().join(": ");
            return CallError::Panic(super::bounded(msg, self.max_error_bytes));
        }
        if err
            .downcast_ref::<wasmtime::PoolConcurrencyLimitError>()
            .is_some()
        {
            return CallError::Busy(format!("{err:#}"));
        }
        let trap = err
            .downcast_ref::<Trap>()
            .map_or_else(|| format!("{err:#}"), |t| t.to_string());
        CallError::Trap(super::bounded(trap, self.max_error_bytes))
    }
}

/// The plugin runtime could not start (an engine setting the platform cannot honour).
#[derive(Debug, thiserror::Error)]
#[error("cannot start the plugin runtime: {0}")]
pub struct StartError(String);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_say_what_the_file_is() {
        let core = check_header(b"\0asm\x01\0\0\0rest")
            .unwrap_err()
            .to_string();
        assert!(core.contains("core WebAssembly module") && core.contains("wasm32-wasip2"));
        let text = check_header(b"<html>oops</html>").unwrap_err().to_string();
        assert!(text.contains("not a WebAssembly file (17 bytes"), "{text}");
        assert!(!text.contains('\n'));
        assert!(check_header(b"\0asm\x0d\0\x01\0").is_ok());
    }
}
