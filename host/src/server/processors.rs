//! The tenant's logits-processor plugin in the decode loop: one instance started per choice
//! (on the async runtime, before submission) and handed to the engine behind its
//! `LogitsProcessor` trait, with the model's vocabulary index for its lookups.

use std::sync::Arc;

use super::error::ApiError;
use super::AppState;
use crate::engine::steering::{LogitsProcessor, ProcessorError, ProcessorSlot, Steer};
use crate::engine::tokenizer::token_bytes;
use crate::engine::{Engine, EngineError, GenerationRequest};
use crate::plugins::vocab::VocabIndex;
use crate::plugins::{CallError, Decision, PluginKind, Processor, SequenceStart};
use crate::tenancy::Caller;

struct PluginProcessor {
    processor: Processor,
    /// `plugin_failures_total`, labelled for this tenant and plugin.
    failures: Arc<crate::metrics::Metrics>,
    labels: [String; 2],
}

/// A processor's failure as it crosses the engine: the plugin's own error, with whose it is,
/// so the response can name them with the plugin error's code.
#[derive(Debug, thiserror::Error)]
#[error("the logits processor `{plugin}` of tenant `{tenant}` {error}")]
pub(super) struct ProcessorFailure {
    pub(super) tenant: String,
    pub(super) plugin: String,
    pub(super) error: CallError,
}

impl LogitsProcessor for PluginProcessor {
    fn step(&mut self, tokens: &[u32], text: &str) -> Result<Steer, ProcessorError> {
        self.processor
            .step(tokens, text)
            .map(steer)
            .map_err(|error| {
                let [tenant, plugin] = self.labels.clone();
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

/// The client's error for a generation that failed midway: a processor's fault as the
/// plugin error it is, a grammar that ran into the parser's limits as the request's 400,
/// anything else as the server's.
pub(super) fn engine_error(e: EngineError) -> ApiError {
    match &e {
        EngineError::Processor(p) => {
            if let Some(f) = p.downcast_ref::<ProcessorFailure>() {
                return ApiError::plugin(&f.tenant, &f.plugin, &f.error);
            }
        }
        EngineError::Grammar(why) => {
            return ApiError::invalid(
                None,
                format!("The output constraint failed partway through the answer: {why}. Simplify the schema, regex or grammar."),
            )
        }
        _ => {}
    }
    ApiError::internal(e.to_string())
}

fn steer(d: Decision) -> Steer {
    Steer {
        banned: d.banned,
        biases: d.biases,
        stop: d.stop,
    }
}

/// The model's vocabulary as the `vocabulary` interface answers it, built on first use.
fn vocabulary(state: &AppState, model: &str, engine: &Engine) -> Arc<VocabIndex> {
    let mut all = state.vocabularies.lock();
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

/// Starts the tenant's logits processor for each request (choice), if it has one bound.
pub(super) async fn attach(
    state: &Arc<AppState>,
    caller: &Caller,
    model: &str,
    engine: &Arc<Engine>,
    reqs: &mut [GenerationRequest],
) -> Result<(), ApiError> {
    let tenant = &caller.tenant;
    let Some(name) = &tenant.policy.logits_processor else {
        return Ok(());
    };
    let calls = state.plugin_calls();
    let plugin = calls.bound(tenant, name, PluginKind::LogitsProcessor)?;
    let vocab = {
        let (state, model, engine) = (state.clone(), model.to_string(), engine.clone());
        super::blocking("vocabulary", move || vocabulary(&state, &model, &engine)).await?
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
            failures: state.metrics.clone(),
            labels: [tenant.name.to_string(), plugin.name.to_string()],
        };
        r.processor = Some(ProcessorSlot::new(Box::new(code), steer(first)));
        // Forced tokens and drafts skip sampling; the processor must see every choice.
        r.speculative = false;
    }
    Ok(())
}
