//! Warm instances: a plugin version keeps a few instantiated stores between calls, so a call
//! costs a function call rather than store setup + instantiation + the guest re-running its
//! lazy initialisers (a JSON Schema crate compiling its meta-schemas, say) every time.
//!
//! Isolation stays per plugin version, and so per tenant: an instance only ever serves calls
//! to the plugin it was made from. An instance that trapped, hit a limit or ran past its
//! deadline is dropped, never reused; one that has served `MAX_CALLS` calls or written a lot
//! to stderr is retired, which bounds leaks in guest code.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use wasmtime::Store;
use wasmtime_wasi::p2::pipe::MemoryOutputPipe;

use super::bindings::{
    cache_key::CacheKey, logits_processor::LogitsProcessor, output_parser::OutputParser,
    prompt_template::PromptTemplate, reranker::Reranker, CallState,
};
use super::runtime::{Prepared, Runtime};
use super::{CallError, TenantValues};

/// Idle instances kept per plugin version: enough for the calls that overlap on a small host.
const MAX_IDLE_PER_PLUGIN: usize = 4;
const MAX_CALLS: u32 = 10_000;
const MAX_STDERR_BYTES: usize = 8 << 10;

pub enum Bound {
    PromptTemplate(PromptTemplate),
    Reranker(Reranker),
    OutputParser(OutputParser),
    LogitsProcessor(LogitsProcessor),
    CacheKey(CacheKey),
    Legacy(super::legacy::Bound),
}

pub struct Warm {
    pub store: Store<CallState>,
    pub bound: Bound,
    stderr: Option<MemoryOutputPipe>,
    calls: u32,
}

pub struct Pool {
    idle: Mutex<Vec<Warm>>,
    /// The runtime's count of idle instances over all plugins.
    all_idle: Arc<AtomicUsize>,
}

impl Warm {
    pub fn stderr(&self) -> Option<&MemoryOutputPipe> {
        self.stderr.as_ref()
    }
}

impl Pool {
    pub fn new(rt: &Runtime) -> Self {
        Self {
            idle: Mutex::default(),
            all_idle: rt.idle.clone(),
        }
    }

    /// An idle instance, or a new one.
    pub async fn take(
        &self,
        rt: &Runtime,
        prepared: &Prepared,
        tenant: &Arc<str>,
        name: &Arc<str>,
        values: &TenantValues,
    ) -> Result<Warm, CallError> {
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner()).pop();
        if let Some(mut w) = idle {
            self.all_idle.fetch_sub(1, Ordering::Relaxed);
            let data = w.store.data_mut();
            data.config = values.clone();
            data.logs = 0;
            rt.arm(&mut w.store);
            return Ok(w);
        }
        let (mut store, stderr) = rt.store(tenant, name, values);
        // Instantiation runs guest code too (start functions), under the same deadline.
        rt.arm(&mut store);
        let bound = match prepared {
            Prepared::PromptTemplate(pre) => pre
                .instantiate_async(&mut store)
                .await
                .map(Bound::PromptTemplate),
            Prepared::Reranker(pre) => pre.instantiate_async(&mut store).await.map(Bound::Reranker),
            Prepared::OutputParser(pre) => pre
                .instantiate_async(&mut store)
                .await
                .map(Bound::OutputParser),
            Prepared::LogitsProcessor(pre) => pre
                .instantiate_async(&mut store)
                .await
                .map(Bound::LogitsProcessor),
            Prepared::CacheKey(pre) => pre.instantiate_async(&mut store).await.map(Bound::CacheKey),
            Prepared::Legacy(pre) => pre.instantiate(&mut store).await.map(Bound::Legacy),
        }
        .map_err(|e| rt.classify(&store, stderr.as_ref(), e))?;
        Ok(Warm {
            store,
            bound,
            stderr,
            calls: 0,
        })
    }

    /// Returns an instance after a call that completed (with a value or a plugin error).
    pub fn give_back(&self, rt: &Runtime, mut w: Warm) {
        w.calls += 1;
        let chatty = w
            .stderr
            .as_ref()
            .is_some_and(|p| p.contents().len() > MAX_STDERR_BYTES);
        if !rt.reuse_instances || w.calls >= MAX_CALLS || chatty {
            return;
        }
        // Idle instances hold pool slots: keep at most half the pool idle across all plugins.
        if self.all_idle.fetch_add(1, Ordering::Relaxed) >= rt.max_idle {
            self.all_idle.fetch_sub(1, Ordering::Relaxed);
            return;
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.len() < MAX_IDLE_PER_PLUGIN {
            idle.push(w);
        } else {
            self.all_idle.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Classifies a failed call; the instance is dropped with it.
    pub fn failed(rt: &Runtime, w: Warm, err: wasmtime::Error) -> CallError {
        rt.classify(&w.store, w.stderr.as_ref(), err)
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let n = self.idle.get_mut().map_or(0, |v| v.len());
        self.all_idle.fetch_sub(n, Ordering::Relaxed);
    }
}
