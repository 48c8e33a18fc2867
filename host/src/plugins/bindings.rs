//! Host-side bindings generated from `wit/plugins.wit` (the current contract; `legacy` binds
//! 0.1.0), and the `host` interface every plugin imports. The `types` and `host` interfaces
//! are generated once (with the prompt-template world) and shared by the other worlds, so one
//! linker serves every plugin kind.

use std::collections::BTreeMap;
use std::sync::Arc;

use wasmtime::component::ResourceTable;
use wasmtime::{ResourceLimiter, StoreLimits};
use wasmtime_wasi::{WasiCtx, WasiCtxView, WasiView};

// Exports are async so that a call is a future the host can abandon at its deadline, even
// while the guest is blocked in a WASI call (a sleep, a poll) where epoch interruption cannot
// reach it. The `host` imports stay synchronous: they never block.
pub mod prompt_template {
    wasmtime::component::bindgen!({
        world: "prompt-template",
        path: "../wit",
        exports: { default: async },
    });
}

pub mod reranker {
    wasmtime::component::bindgen!({
        world: "reranker",
        path: "../wit",
        exports: { default: async },
        with: { "gateway:plugins": super::prompt_template::gateway::plugins },
    });
}

pub mod output_parser {
    wasmtime::component::bindgen!({
        world: "output-parser",
        path: "../wit",
        exports: { default: async },
        with: { "gateway:plugins": super::prompt_template::gateway::plugins },
    });
}

pub mod cache_key {
    wasmtime::component::bindgen!({
        world: "cache-key",
        path: "../wit",
        exports: { default: async },
        with: { "gateway:plugins": super::prompt_template::gateway::plugins },
    });
}

// The logits processor imports `vocabulary` too, so it shares only `types` and `host`.
pub mod logits_processor {
    wasmtime::component::bindgen!({
        world: "logits-processor",
        path: "../wit",
        exports: { default: async },
        with: {
            "gateway:plugins/types": super::prompt_template::gateway::plugins::types,
            "gateway:plugins/host": super::prompt_template::gateway::plugins::host,
        },
    });
}

pub(super) use logits_processor::gateway::plugins::vocabulary;
pub(super) use prompt_template::gateway::plugins::{host, types};

use crate::common::ConfigValue;

/// A policy's value as the contract carries it.
pub fn value(v: &ConfigValue) -> types::Value {
    match v {
        ConfigValue::Text(t) => types::Value::Text(t.clone()),
        ConfigValue::Number(n) => types::Value::Number(*n),
        ConfigValue::Boolean(b) => types::Value::Boolean(*b),
        ConfigValue::TextList(l) => types::Value::TextList(l.clone()),
    }
}

/// The contract's value as the host keeps it.
pub fn config_value(v: &types::Value) -> ConfigValue {
    match v {
        types::Value::Text(t) => ConfigValue::Text(t.clone()),
        types::Value::Number(n) => ConfigValue::Number(*n),
        types::Value::Boolean(b) => ConfigValue::Boolean(*b),
        types::Value::TextList(l) => ConfigValue::TextList(l.clone()),
    }
}

/// At most this many log lines per call, each cut to `MAX_LOG_BYTES`: a plugin cannot flood
/// the gateway's log.
const MAX_LOGS_PER_CALL: u32 = 32;
const MAX_LOG_BYTES: usize = 1024;

thread_local! {
    /// Where the plugin calls running on this thread also send their log lines.
    static CAPTURE: std::cell::RefCell<Option<crate::common::LogSink>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` (which drives plugin calls to completion on this thread) with the calls' log lines
/// also appended to `sink`.
pub fn capturing_logs<R>(sink: Option<&crate::common::LogSink>, f: impl FnOnce() -> R) -> R {
    let Some(sink) = sink else { return f() };
    let before = CAPTURE.with(|c| c.replace(Some(sink.clone())));
    let out = f();
    CAPTURE.with(|c| *c.borrow_mut() = before);
    out
}

fn level_name(level: host::LogLevel) -> &'static str {
    match level {
        host::LogLevel::Trace => "trace",
        host::LogLevel::Debug => "debug",
        host::LogLevel::Info => "info",
        host::LogLevel::Warn => "warn",
        host::LogLevel::Error => "error",
    }
}

/// Everything one call's `Store` holds.
pub struct CallState {
    pub wasi: WasiCtx,
    pub table: ResourceTable,
    pub limiter: Limiter,
    pub tenant: Arc<str>,
    pub plugin: Arc<str>,
    pub config: Arc<BTreeMap<String, ConfigValue>>,
    pub logs: u32,
    /// The model's vocabulary, for a logits processor; other kinds see an empty one.
    pub vocab: Option<Arc<super::vocab::VocabIndex>>,
}

impl WasiView for CallState {
    fn ctx(&mut self) -> WasiCtxView<'_> {
        WasiCtxView {
            ctx: &mut self.wasi,
            table: &mut self.table,
        }
    }
}

impl types::Host for CallState {}

impl host::Host for CallState {
    fn log(&mut self, level: host::LogLevel, message: String) {
        if self.logs >= MAX_LOGS_PER_CALL {
            return;
        }
        self.logs += 1;
        let mut end = message.len().min(MAX_LOG_BYTES);
        while !message.is_char_boundary(end) {
            end -= 1;
        }
        let message = &message[..end];
        let (tenant, plugin) = (&*self.tenant, &*self.plugin);
        CAPTURE.with(|c| {
            if let Some(sink) = &*c.borrow() {
                let line = format!("{plugin} {}: {message}", level_name(level));
                sink.lock().unwrap_or_else(|e| e.into_inner()).push(line);
            }
        });
        match level {
            host::LogLevel::Trace => tracing::trace!(tenant, plugin, "{message}"),
            host::LogLevel::Debug => tracing::debug!(tenant, plugin, "{message}"),
            host::LogLevel::Info => tracing::info!(tenant, plugin, "{message}"),
            host::LogLevel::Warn => tracing::warn!(tenant, plugin, "{message}"),
            host::LogLevel::Error => tracing::error!(tenant, plugin, "{message}"),
        }
    }

    fn config_get(&mut self, key: String) -> Option<types::Value> {
        self.config.get(&key).map(value)
    }
}

impl vocabulary::Host for CallState {
    fn token_text(&mut self, id: u32) -> String {
        self.vocab.as_ref().map(|v| v.text(id)).unwrap_or_default()
    }

    fn tokens_with_prefix(&mut self, prefix: String, ignore_case: bool) -> Vec<u32> {
        let v = self.vocab.as_ref();
        v.map(|v| v.with_prefix(&prefix, ignore_case))
            .unwrap_or_default()
    }

    fn tokens_containing(&mut self, text: String, ignore_case: bool) -> Vec<u32> {
        let v = self.vocab.as_ref();
        v.map(|v| v.containing(&text, ignore_case))
            .unwrap_or_default()
    }
}

/// `StoreLimits` plus a record of whether a memory limit was hit, so a trap caused by the
/// cap is reported as "memory limit" rather than as an anonymous trap.
pub struct Limiter {
    pub limits: StoreLimits,
    pub memory_cap: usize,
    pub hit_memory_cap: bool,
}

impl ResourceLimiter for Limiter {
    fn memory_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        if desired > self.memory_cap {
            self.hit_memory_cap = true;
            wasmtime::bail!(
                "plugin memory would grow past its {}-byte cap",
                self.memory_cap
            );
        }
        self.limits.memory_growing(current, desired, maximum)
    }

    fn table_growing(
        &mut self,
        current: usize,
        desired: usize,
        maximum: Option<usize>,
    ) -> wasmtime::Result<bool> {
        self.limits.table_growing(current, desired, maximum)
    }

    fn instances(&self) -> usize {
        self.limits.instances()
    }

    fn tables(&self) -> usize {
        self.limits.tables()
    }

    fn memories(&self) -> usize {
        self.limits.memories()
    }
}
