//! A logits processor's instance for one generated sequence: started once (async, on the
//! runtime), then stepped after every token from the engine's thread, each step under the
//! plugin deadline. The instance is never reused: it holds the sequence's state.

use std::sync::Arc;

use super::bindings::logits_processor::{Decision, SequenceStart};
use super::legacy::{self, Bound as Legacy};
use super::vocab::VocabIndex;
use super::warm::{Bound, Warm};
use super::{bounded, CallError, Plugin, PluginKind, Runtime, TenantValues};

pub struct Processor {
    plugin: Arc<Plugin>,
    rt: Arc<Runtime>,
    warm: Warm,
    vocab_len: usize,
    /// The runtime the plugin's async calls (WASI clocks, deadlines) run on, entered with
    /// `block_on` from the engine's threads, which are not part of it.
    handle: tokio::runtime::Handle,
}

impl Plugin {
    /// A fresh instance of this logits processor for one sequence, and its decision for the
    /// first token. Call on the async runtime.
    pub async fn start_processor(
        self: &Arc<Self>,
        rt: &Arc<Runtime>,
        values: &TenantValues,
        vocab: Arc<VocabIndex>,
        start: SequenceStart,
    ) -> Result<(Processor, Decision), CallError> {
        if self.kind() != PluginKind::LogitsProcessor {
            return Err(CallError::InvalidOutput(format!(
                "`{}` is a {}, not a logits-processor",
                self.name,
                self.kind()
            )));
        }
        let _slot = rt.admit(&self.tenant)?;
        let started = tokio::time::timeout(rt.timeout, async {
            let mut warm = self
                .pool
                .take(rt, &self.prepared, &self.tenant, &self.name, values)
                .await?;
            warm.store.data_mut().vocab = Some(vocab.clone());
            let out = match &warm.bound {
                Bound::LogitsProcessor(p) => p.call_start(&mut warm.store, &start).await,
                Bound::Legacy(Legacy::LogitsProcessor(p)) => {
                    legacy::start(p, &mut warm.store, &start).await
                }
                _ => unreachable!("the kind was checked"),
            };
            Ok::<_, CallError>((out, warm))
        })
        .await
        .unwrap_or(Err(CallError::Timeout {
            ms: rt.timeout.as_millis() as u64,
        }));
        let (out, warm) = started.map_err(|e| self.failed(e))?;
        let mut processor = Processor {
            plugin: self.clone(),
            rt: rt.clone(),
            warm,
            vocab_len: vocab.len(),
            handle: tokio::runtime::Handle::current(),
        };
        let first = processor.settle(out)?;
        Ok((processor, first))
    }

    fn failed(&self, e: CallError) -> CallError {
        tracing::warn!(tenant = %self.tenant, plugin = %self.name, cause = e.cause(), error = %e, "logits processor failed");
        e
    }
}

impl Processor {
    /// The decision for the next token, after `tokens` (and the `text` they released) were
    /// generated. Blocks the calling thread for at most the plugin deadline; call it from a
    /// thread outside the async runtime.
    pub fn step(&mut self, tokens: &[u32], text: &str) -> Result<Decision, CallError> {
        self.rt.arm(&mut self.warm.store);
        let store = &mut self.warm.store;
        let call = async {
            match &self.warm.bound {
                Bound::LogitsProcessor(p) => p.call_step(store, tokens, text).await,
                Bound::Legacy(Legacy::LogitsProcessor(p)) => {
                    legacy::step(p, store, tokens, text).await
                }
                _ => unreachable!("a processor holds a logits-processor instance"),
            }
        };
        let out = self
            .handle
            .block_on(async { tokio::time::timeout(self.rt.timeout, call).await });
        let out = out.unwrap_or_else(|_| Err(wasmtime::Error::new(wasmtime::Trap::Interrupt)));
        self.settle(out)
    }

    /// A call's result, checked: ids within the vocabulary, finite biases.
    fn settle(
        &mut self,
        out: wasmtime::Result<Result<Decision, super::types::PluginError>>,
    ) -> Result<Decision, CallError> {
        let rt = &self.rt;
        let d = match out {
            Ok(Ok(d)) => d,
            Ok(Err(e)) => {
                return Err(self.plugin.failed(CallError::Rejected {
                    code: bounded(e.code, 64),
                    message: bounded(e.message, rt.max_error_bytes),
                }))
            }
            Err(e) => {
                let e = rt.classify(&self.warm.store, self.warm.stderr(), e);
                return Err(self.plugin.failed(e));
            }
        };
        let n = self.vocab_len as u32;
        let bad_id = d
            .banned
            .iter()
            .chain(d.biases.iter().map(|(t, _)| t))
            .find(|&&t| t >= n);
        if let Some(t) = bad_id {
            return Err(self.plugin.failed(CallError::InvalidOutput(format!(
                "token id {t} is outside the {n}-token vocabulary"
            ))));
        }
        if let Some((t, b)) = d.biases.iter().find(|(_, b)| !b.is_finite()) {
            return Err(self.plugin.failed(CallError::InvalidOutput(format!(
                "bias {b} for token {t} is not finite"
            ))));
        }
        Ok(d)
    }
}
