//! Plugins built against `gateway:plugins@0.1.0` (`wit/0.1.0/`), served beside 0.2.0 ones.
//! The host adapts each call at the boundary, so the rest of the gateway speaks only the
//! current contract: typed values reach a 0.1.0 plugin as text (`ConfigValue::as_text`), and a
//! candidate's document id, which 0.1.0 has no field for, is left out.
//!
//! The `types` interface did not change between the versions, so its 0.1.0 types are the
//! current ones (`with`); `host` and `vocabulary` are bound again under their 0.1.0 names.

use wasmtime::component::{HasSelf, Linker};
use wasmtime::Store;

use super::bindings::{self, CallState};
use super::{Reply, Request};

pub mod prompt_template {
    wasmtime::component::bindgen!({
        world: "prompt-template",
        path: "../wit/0.1.0",
        exports: { default: async },
        with: { "gateway:plugins/types@0.1.0": crate::plugins::bindings::prompt_template::gateway::plugins::types },
    });
}

pub mod reranker {
    wasmtime::component::bindgen!({
        world: "reranker",
        path: "../wit/0.1.0",
        exports: { default: async },
        with: {
            "gateway:plugins/types@0.1.0": crate::plugins::bindings::prompt_template::gateway::plugins::types,
            "gateway:plugins/host@0.1.0": super::prompt_template::gateway::plugins::host,
        },
    });
}

pub mod output_parser {
    wasmtime::component::bindgen!({
        world: "output-parser",
        path: "../wit/0.1.0",
        exports: { default: async },
        with: {
            "gateway:plugins/types@0.1.0": crate::plugins::bindings::prompt_template::gateway::plugins::types,
            "gateway:plugins/host@0.1.0": super::prompt_template::gateway::plugins::host,
        },
    });
}

pub mod logits_processor {
    wasmtime::component::bindgen!({
        world: "logits-processor",
        path: "../wit/0.1.0",
        exports: { default: async },
        with: {
            "gateway:plugins/types@0.1.0": crate::plugins::bindings::prompt_template::gateway::plugins::types,
            "gateway:plugins/host@0.1.0": super::prompt_template::gateway::plugins::host,
        },
    });
}

use logits_processor::gateway::plugins::vocabulary as old_vocabulary;
use prompt_template::gateway::plugins::host as old_host;

/// A compiled 0.1.0 plugin, ready to instantiate.
pub enum Prepared {
    PromptTemplate(prompt_template::PromptTemplatePre<CallState>),
    Reranker(reranker::RerankerPre<CallState>),
    OutputParser(output_parser::OutputParserPre<CallState>),
    LogitsProcessor(logits_processor::LogitsProcessorPre<CallState>),
}

/// An instantiated 0.1.0 plugin.
pub enum Bound {
    PromptTemplate(prompt_template::PromptTemplate),
    Reranker(reranker::Reranker),
    OutputParser(output_parser::OutputParser),
    LogitsProcessor(logits_processor::LogitsProcessor),
}

impl Prepared {
    /// `pre` as the 0.1.0 world of `kind`, if it implements that.
    pub fn new(
        kind: super::PluginKind,
        pre: wasmtime::component::InstancePre<CallState>,
    ) -> wasmtime::Result<Self> {
        use super::PluginKind as K;
        Ok(match kind {
            K::PromptTemplate => {
                Prepared::PromptTemplate(prompt_template::PromptTemplatePre::new(pre)?)
            }
            K::Reranker => Prepared::Reranker(reranker::RerankerPre::new(pre)?),
            K::OutputParser => Prepared::OutputParser(output_parser::OutputParserPre::new(pre)?),
            K::LogitsProcessor => {
                Prepared::LogitsProcessor(logits_processor::LogitsProcessorPre::new(pre)?)
            }
            K::CacheKey => wasmtime::bail!("gateway:plugins@0.1.0 has no cache-key world"),
        })
    }

    pub fn kind(&self) -> super::PluginKind {
        use super::PluginKind as K;
        match self {
            Prepared::PromptTemplate(_) => K::PromptTemplate,
            Prepared::Reranker(_) => K::Reranker,
            Prepared::OutputParser(_) => K::OutputParser,
            Prepared::LogitsProcessor(_) => K::LogitsProcessor,
        }
    }

    pub async fn instantiate(&self, store: &mut Store<CallState>) -> wasmtime::Result<Bound> {
        Ok(match self {
            Prepared::PromptTemplate(p) => Bound::PromptTemplate(p.instantiate_async(store).await?),
            Prepared::Reranker(p) => Bound::Reranker(p.instantiate_async(store).await?),
            Prepared::OutputParser(p) => Bound::OutputParser(p.instantiate_async(store).await?),
            Prepared::LogitsProcessor(p) => {
                Bound::LogitsProcessor(p.instantiate_async(store).await?)
            }
        })
    }
}

/// The 0.1.0 names of `host`, `types` and `vocabulary`, served by the same `CallState`.
pub fn add_to_linker(linker: &mut Linker<CallState>) -> wasmtime::Result<()> {
    old_host::add_to_linker::<_, HasSelf<_>>(linker, |s| s)?;
    old_vocabulary::add_to_linker::<_, HasSelf<_>>(linker, |s| s)?;
    // `types` holds only types; its instance just has to exist under the old name.
    linker.instance("gateway:plugins/types@0.1.0")?;
    Ok(())
}

/// One call of a 0.1.0 plugin: the current contract's arguments, adapted; its result, adapted.
pub async fn invoke(
    store: &mut Store<CallState>,
    bound: &Bound,
    request: Request<'_>,
) -> wasmtime::Result<Result<Reply, bindings::types::PluginError>> {
    Ok(match (bound, request) {
        (Bound::PromptTemplate(p), Request::Render(r)) => {
            let old = prompt_template::ChatRequest {
                model: r.model.clone(),
                messages: r.messages.clone(),
                context: r.context.clone(),
            };
            let out = p.call_render(store, &old).await?;
            out.map(|r| {
                Reply::Render(match r {
                    prompt_template::RenderedPrompt::Prompt(t) => {
                        bindings::prompt_template::RenderedPrompt::Prompt(t)
                    }
                    prompt_template::RenderedPrompt::Messages(m) => {
                        bindings::prompt_template::RenderedPrompt::Messages(m)
                    }
                })
            })
        }
        (Bound::Reranker(p), Request::Rerank(q, c)) => {
            let old: Vec<reranker::Candidate> = c.iter().map(old_candidate).collect();
            let out = p.call_rerank(store, q, &old).await?;
            out.map(|scored| {
                Reply::Rerank(
                    scored
                        .into_iter()
                        .map(|s| bindings::reranker::Scored {
                            id: s.id,
                            score: s.score,
                        })
                        .collect(),
                )
            })
        }
        (Bound::OutputParser(p), Request::Parse(t, s)) => {
            let out = p.call_parse(store, t, s).await?;
            out.map(|p| {
                Reply::Parse(bindings::output_parser::Parsed {
                    json: p.json,
                    repairs: p.repairs,
                })
            })
        }
        _ => unreachable!("the plugin's kind is checked before it is called"),
    })
}

/// A logits processor's `start`, adapted.
pub async fn start(
    p: &logits_processor::LogitsProcessor,
    store: &mut Store<CallState>,
    s: &bindings::logits_processor::SequenceStart,
) -> wasmtime::Result<Result<bindings::logits_processor::Decision, bindings::types::PluginError>> {
    let old = logits_processor::SequenceStart {
        model: s.model.clone(),
        prompt: s.prompt.clone(),
        max_tokens: s.max_tokens,
    };
    Ok(p.call_start(store, &old).await?.map(decision))
}

/// A logits processor's `step`, adapted.
pub async fn step(
    p: &logits_processor::LogitsProcessor,
    store: &mut Store<CallState>,
    tokens: &[u32],
    text: &str,
) -> wasmtime::Result<Result<bindings::logits_processor::Decision, bindings::types::PluginError>> {
    Ok(p.call_step(store, tokens, text).await?.map(decision))
}

fn decision(d: logits_processor::Decision) -> bindings::logits_processor::Decision {
    bindings::logits_processor::Decision {
        banned: d.banned,
        biases: d.biases,
        stop: d.stop,
    }
}

fn old_candidate(c: &bindings::reranker::Candidate) -> reranker::Candidate {
    reranker::Candidate {
        id: c.id.clone(),
        text: c.text.clone(),
        metadata: c
            .metadata
            .iter()
            .map(|(k, v)| (k.clone(), bindings::config_value(v).as_text()))
            .collect(),
        score: c.score,
    }
}

impl old_host::Host for CallState {
    fn log(&mut self, level: old_host::LogLevel, message: String) {
        use bindings::host::LogLevel as L;
        let level = match level {
            old_host::LogLevel::Trace => L::Trace,
            old_host::LogLevel::Debug => L::Debug,
            old_host::LogLevel::Info => L::Info,
            old_host::LogLevel::Warn => L::Warn,
            old_host::LogLevel::Error => L::Error,
        };
        bindings::host::Host::log(self, level, message)
    }

    fn config_get(&mut self, key: String) -> Option<String> {
        self.config.get(&key).map(|v| v.as_text())
    }
}

impl old_vocabulary::Host for CallState {
    fn token_text(&mut self, id: u32) -> String {
        bindings::vocabulary::Host::token_text(self, id)
    }

    fn tokens_with_prefix(&mut self, prefix: String, ignore_case: bool) -> Vec<u32> {
        bindings::vocabulary::Host::tokens_with_prefix(self, prefix, ignore_case)
    }

    fn tokens_containing(&mut self, text: String, ignore_case: bool) -> Vec<u32> {
        bindings::vocabulary::Host::tokens_containing(self, text, ignore_case)
    }
}
