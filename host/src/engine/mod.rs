//! The inference engine: one model, its paged KV cache, and a scheduler thread that runs
//! continuous batching. Requests come in over a channel as token ids and sampling parameters;
//! events (text deltas, then a finish) go back over a channel per request.
//!
//! Must not depend on: HTTP, JSON request shapes, tenants. The server turns API requests into a
//! [`GenerationRequest`] and events into responses.

pub mod batch;
pub mod block_manager;
mod buffers;
pub mod chat_template;
pub mod constraint;
mod cpu_ops;
pub mod detokenizer;
mod engine_loop;
#[cfg(feature = "cuda")]
mod gpu;
pub mod model;
pub mod paged_attention;
pub mod profile;
pub mod quant;
pub mod runner;
pub mod sampler;
pub mod scheduler;
mod spec;
pub mod steering;
pub mod team;
pub mod tokenizer;
pub mod weights;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use tokenizers::Tokenizer;
use tokio::sync::mpsc as tokio_mpsc;

use crate::config::ModelConfig;
use crate::metrics::Metrics;
use batch::Pool;
use chat_template::ChatTemplate;
use model::ModelShape;
pub use sampler::{SamplingParams, TokenLogprobs};
use weights::LoadedModel;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("model not found at {0} (run scripts/fetch-models.sh for the default model)")]
    NotFound(PathBuf),
    #[error("cannot read {0}: {1}")]
    Io(PathBuf, std::io::Error),
    #[error("unsupported or malformed model: {0}")]
    Format(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("tensor operation failed: {0}")]
    Candle(#[from] candle_core::Error),
    #[error("chat template: {0}")]
    Template(#[from] minijinja::Error),
    #[error("KV cache budget of {budget} bytes holds {blocks} blocks; at least one is needed")]
    KvBudget { budget: usize, blocks: usize },
    #[error("device: {0}")]
    Device(String),
    /// The machine has no usable GPU (no driver, no device, or no cuBLAS).
    #[error("no GPU: {0}")]
    NoGpu(String),
}

/// What the engine needs to generate: token ids in, limits and sampling settings.
#[derive(Debug, Clone)]
pub struct GenerationRequest {
    pub prompt: Vec<u32>,
    pub sampling: SamplingParams,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// The request's owner (tenant): prefix-cache entries are shared only between requests
    /// with the same salt, and admission is fair between salts.
    pub cache_salt: u64,
    /// The owner's share of admissions under contention (weighted fair queuing; at least 1).
    pub weight: u32,
    /// Allow prompt-lookup speculative decoding for this request (when the engine has it on).
    pub speculative: bool,
    /// A grammar every generated token must follow (structured output, tool calls).
    pub constraint: Option<constraint::Constraint>,
    /// Tenant code that bans or biases each next token, started for this sequence.
    pub processor: Option<steering::ProcessorSlot>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// One generated token and the text it released (empty while text is held back for a
    /// possible stop string or an incomplete UTF-8 character).
    Token {
        id: u32,
        text: String,
        logprobs: Option<TokenLogprobs>,
    },
    Done(Usage, FinishReason),
    Failed(EngineError),
}

/// Why a generation failed midway. Only the sequence fails; the engine keeps serving.
#[derive(Debug, Clone, thiserror::Error)]
pub enum EngineError {
    #[error("inference failed: {0}")]
    Inference(String),
    /// A bug caught in a step: every sequence in flight failed and the KV pool was reset.
    #[error("internal engine error: {0}")]
    Internal(String),
    #[error("constrained decoding failed: {0}")]
    Grammar(String),
    /// The sequence's logits processor failed; the error is the processor's own (the server
    /// knows its type).
    #[error("{0}")]
    Processor(Arc<dyn std::error::Error + Send + Sync>),
}

impl PartialEq for EngineError {
    fn eq(&self, other: &Self) -> bool {
        self.to_string() == other.to_string()
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
}

enum Command {
    // Boxed: a request is a few hundred bytes, a cancellation eight.
    Add(
        u64,
        Box<GenerationRequest>,
        tokio_mpsc::UnboundedSender<Event>,
    ),
    Cancel(u64),
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the engine queue is full ({0} requests waiting); retry later")]
    QueueFull(usize),
    #[error("the engine has stopped")]
    Stopped,
}

/// Static facts about a served model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    pub name: String,
    /// Longest prompt + completion this engine accepts (model window capped by the KV pool).
    pub max_model_len: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    /// Rows of the embedding / width of the logits.
    pub vocab_size: usize,
}

/// Handle to a running engine thread; cheap to share behind an `Arc`.
pub struct Engine {
    pub info: ModelInfo,
    pub tokenizer: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub bos: Option<u32>,
    pub add_bos: bool,
    /// Compiles (and caches) the grammars of constrained requests for this vocabulary.
    pub grammars: Arc<constraint::Grammars>,
    tx: mpsc::Sender<Command>,
    next_id: AtomicU64,
    /// Requests submitted and not yet admitted (or cancelled); the engine thread decrements it.
    waiting: Arc<AtomicUsize>,
    max_waiting: usize,
    profile: Arc<profile::StepProfile>,
}

/// Events of one request. Dropping it (client gone, stream closed) cancels the request and
/// frees its KV blocks on the engine's next step.
pub struct EventStream {
    id: u64,
    rx: tokio_mpsc::UnboundedReceiver<Event>,
    tx: mpsc::Sender<Command>,
    done: bool,
}

impl EventStream {
    pub async fn recv(&mut self) -> Option<Event> {
        let ev = self.rx.recv().await;
        if matches!(ev, None | Some(Event::Done(..)) | Some(Event::Failed(_))) {
            self.done = true;
        }
        ev
    }
}

impl Drop for EventStream {
    fn drop(&mut self) {
        if !self.done {
            let _ = self.tx.send(Command::Cancel(self.id));
        }
    }
}

impl Engine {
    /// Loads the model and starts its scheduler thread.
    pub fn start(cfg: &ModelConfig, metrics: Arc<Metrics>) -> Result<Self, ModelError> {
        let loaded = load(cfg)?;
        let e = &cfg.engine;
        let shape = loaded.model.shape.clone();
        let s = &shape;
        let LoadedModel {
            mut model,
            tokenizer,
            template,
            stop_ids,
            bos,
            add_bos,
        } = loaded;
        let window = match cfg.max_model_len {
            0 => s.context_length,
            n => n.min(s.context_length),
        };
        let profile = Arc::new(profile::StepProfile::default());
        model.set_profile(profile.clone());
        let (runner, pool) = runner::Runner::new(model, e, window)?;
        let num_blocks = pool.num_blocks;
        let watermark_blocks = (num_blocks as f32 * e.watermark) as usize;
        // A sequence must fit in the pool on its own, or it could never be scheduled.
        let max_model_len = window.min((num_blocks - watermark_blocks) * e.block_size);
        log_loaded(cfg, s, &pool, max_model_len);
        let info = ModelInfo {
            name: cfg.name.clone(),
            max_model_len,
            num_blocks,
            block_size: e.block_size,
            vocab_size: s.vocab_size,
        };
        let grammars = constraint::Grammars::new(
            &tokenizer,
            s.vocab_size,
            &stop_ids,
            &cfg.name,
            metrics.clone(),
        )?;
        let (tx, rx) = mpsc::channel();
        let waiting = Arc::new(AtomicUsize::new(0));
        let engine_loop = engine_loop::EngineLoop::new(
            runner,
            tokenizer.clone(),
            stop_ids,
            cfg,
            num_blocks,
            watermark_blocks,
            max_model_len,
            metrics,
            waiting.clone(),
            profile.clone(),
        );
        std::thread::Builder::new()
            .name(format!("engine-{}", cfg.name))
            .spawn(move || engine_loop.run(rx))
            .map_err(|e| ModelError::Io("engine thread".into(), e))?;
        Ok(Self {
            info,
            tokenizer: Arc::new(tokenizer),
            template,
            bos,
            add_bos,
            grammars: Arc::new(grammars),
            tx,
            next_id: AtomicU64::new(1),
            waiting,
            max_waiting: e.max_waiting,
            profile,
        })
    }

    /// Where this engine's steps have spent their time since it started.
    pub fn profile(&self) -> profile::Snapshot {
        self.profile.snapshot()
    }

    /// Requests submitted and not yet admitted to the running batch.
    pub fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    pub fn submit(&self, req: GenerationRequest) -> Result<EventStream, SubmitError> {
        self.waiting
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                (w < self.max_waiting).then_some(w + 1)
            })
            .map_err(SubmitError::QueueFull)?;
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (etx, erx) = tokio_mpsc::unbounded_channel();
        if self.tx.send(Command::Add(id, Box::new(req), etx)).is_err() {
            self.waiting.fetch_sub(1, Ordering::AcqRel);
            return Err(SubmitError::Stopped);
        }
        Ok(EventStream {
            id,
            rx: erx,
            tx: self.tx.clone(),
            done: false,
        })
    }

    /// Token ids of a prompt; with `add_bos`, the model's BOS first when the model asks for one.
    /// Special tokens written in the text (e.g. `<|im_start|>`) are parsed as such.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>, ModelError> {
        let enc = self
            .tokenizer
            .encode(text, false)
            .map_err(|e| ModelError::Tokenizer(e.to_string()))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }
}

/// The model's weights and tokenizer, with the configured chat template in place of its own.
fn load(cfg: &ModelConfig) -> Result<LoadedModel, ModelError> {
    let mut loaded = weights::load(&cfg.path)?;
    if let Some(t) = &cfg.chat_template {
        let source = match t.as_str() {
            "chatml" => chat_template::CHATML.to_string(),
            path => std::fs::read_to_string(path).map_err(|e| ModelError::Io(path.into(), e))?,
        };
        loaded.template = loaded.template.with_source(source)?;
    }
    Ok(loaded)
}

fn log_loaded(cfg: &ModelConfig, s: &ModelShape, pool: &Pool, max_model_len: usize) {
    tracing::info!(
        model = %cfg.name,
        layers = s.num_layers,
        heads = s.num_heads,
        kv_heads = s.num_kv_heads,
        kv_blocks = pool.num_blocks,
        block_size = cfg.engine.block_size,
        device = %cfg.engine.device,
        kv_mib = (pool.num_blocks * pool.block_bytes) >> 20,
        max_model_len,
        "model loaded"
    );
}
