//! The processor stage: the tenant's logits-processor plugin in the decode loop, one instance
//! started per choice (on the async runtime, before submission) and handed to the engine
//! behind its `LogitsProcessor` trait, with the model's vocabulary index for its lookups.

use std::collections::HashMap;
use std::sync::Arc;

use super::{Error, PluginCalls};
use crate::engine::steering::{LogitsProcessor, ProcessorError, ProcessorSlot, Steer};
use crate::engine::tokenizer::token_bytes;
use crate::engine::{Engine, GenerationRequest};
use crate::plugins::vocab::VocabIndex;
use crate::plugins::{CallError, Decision, PluginKind, Processor, SequenceStart};
use crate::tenancy::Caller;

/// What the processor stage needs: the plugin calls, and each model's vocabulary index.
pub struct ProcessorStage {
    pub calls: PluginCalls,
    pub vocabularies: Arc<Vocabularies>,
}

/// Each model's vocabulary index for logits processors, built on first use.
#[derive(Default)]
pub struct Vocabularies(parking_lot::Mutex<HashMap<String, Arc<VocabIndex>>>);

struct PluginProcessor {
    processor: Processor,
    /// `plugin_failures_total`, labelled with the plugin's tenant and name.
    failures: Arc<crate::metrics::Metrics>,
    /// Whose step times and failures each step adds to.
    plugin: Arc<crate::plugins::Plugin>,
}

/// A processor's failure as it crosses the engine: the plugin's own error, with whose it is,
/// so the response can name them with the plugin error's code.
#[derive(Debug, thiserror::Error)]
#[error("the logits processor `{plugin}` of tenant `{tenant}` {error}")]
pub struct ProcessorFailure {
    pub tenant: String,
    pub plugin: String,
    pub error: CallError,
}

impl LogitsProcessor for PluginProcessor {
    fn step(&mut self, tokens: &[u32], text: &str) -> Result<Steer, ProcessorError> {
        let start = std::time::Instant::now();
        let stepped = self.processor.step(tokens, text);
        let cause = stepped.as_ref().err().map(CallError::cause);
        self.plugin.stats.record(start.elapsed(), cause);
        stepped.map(steer).map_err(|error| {
            let (tenant, plugin) = (self.plugin.tenant.to_string(), self.plugin.name.to_string());
            self.failures
                .plugin_failures
                .with_label_values(&[&tenant, &plugin, error.cause()])
                .inc();
            Arc::new(ProcessorFailure {
                tenant,
                plugin,
                error,
            }) as ProcessorError
        })
    }
}

fn steer(d: Decision) -> Steer {
    Steer {
        banned: d.banned,
        biases: d.biases,
        stop: d.stop,
    }
}

impl Vocabularies {
    /// The model's vocabulary as the `vocabulary` interface answers it, built on first use.
    fn get(&self, model: &str, engine: &Engine) -> Arc<VocabIndex> {
        let mut all = self.0.lock();
        all.entry(model.to_string())
            .or_insert_with(|| {
                let tok = &engine.tokenizer;
                let texts = (0..engine.info.vocab_size as u32)
                    .map(|id| match tok.id_to_token(id) {
                        Some(_) => String::from_utf8_lossy(&token_bytes(tok, id)).into_owned(),
                        None => String::new(),
                    })
                    .collect();
                Arc::new(VocabIndex::new(texts))
            })
            .clone()
    }
}

impl ProcessorStage {
    /// Starts the tenant's logits processor for each request (choice), if it has one bound.
    pub async fn attach(
        &self,
        caller: &Caller,
        model: &str,
        engine: &Arc<Engine>,
        reqs: &mut [GenerationRequest],
    ) -> Result<(), Error> {
        let tenant = &caller.tenant;
        let Some(name) = &tenant.policy.logits_processor else {
            return Ok(());
        };
        let calls = &self.calls;
        let plugin = calls.bound(tenant, name, PluginKind::LogitsProcessor)?;
        let vocab = {
            let (all, model, engine) =
                (self.vocabularies.clone(), model.to_string(), engine.clone());
            super::blocking("vocabulary", move || all.get(&model, &engine)).await?
        };
        for r in reqs.iter_mut() {
            // The prompt as the model sees it, role markers included.
            let prompt = engine
                .tokenizer
                .decode(&r.prompt, false)
                .unwrap_or_default();
            let start = SequenceStart {
                model: model.to_string(),
                prompt,
                max_tokens: r.max_tokens.min(u32::MAX as usize) as u32,
            };
            // Counted, timed and mapped to the client's error like every other plugin call.
            let vocab = vocab.clone();
            let (p, first) = calls
                .call(caller, plugin.clone(), move |p, rt, v| async move {
                    p.start_processor(&rt, &v, vocab, start).await
                })
                .await?;
            let code = PluginProcessor {
                processor: p,
                failures: calls.metrics.clone(),
                plugin: plugin.clone(),
            };
            r.processor = Some(ProcessorSlot::new(Box::new(code), steer(first)));
            // Forced tokens and drafts skip sampling; the processor must see every choice.
            r.speculative = false;
        }
        Ok(())
    }
}
