//! What steers a sequence's next token besides the model: its grammar (a `Guide`) and a
//! logits processor (tenant code, behind the `LogitsProcessor` trait so the engine knows no
//! plugins). Both are prepared on a second thread while the forward pass runs; at sampling
//! time the processor's bans and biases and the grammar's mask are applied together.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use super::constraint::Guide;
use super::EngineError;

/// The decision for the next token.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Steer {
    pub banned: Vec<u32>,
    pub biases: Vec<(u32, f32)>,
    /// End the sequence before another token.
    pub stop: bool,
}

/// Per-sequence code in the decode loop. `step` gets what was generated since the last call
/// and returns the decision for the next token; an error fails the sequence, and reaches the
/// client as the implementation's own error type.
pub trait LogitsProcessor: Send {
    fn step(&mut self, tokens: &[u32], text: &str) -> Result<Steer, ProcessorError>;
}

pub type ProcessorError = Arc<dyn std::error::Error + Send + Sync>;

/// A started processor and its decision for the first token, handed to the engine with the
/// request. Cloning shares it (a request is cloned per choice before each gets its own).
#[derive(Clone)]
pub struct ProcessorSlot(Arc<Mutex<Option<Started>>>);

type Started = (Box<dyn LogitsProcessor>, Steer);

impl ProcessorSlot {
    pub fn new(p: Box<dyn LogitsProcessor>, first: Steer) -> Self {
        Self(Arc::new(Mutex::new(Some((p, first)))))
    }

    fn take(&self) -> Option<Started> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl std::fmt::Debug for ProcessorSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ProcessorSlot")
    }
}

struct Processor {
    code: Box<dyn LogitsProcessor>,
    /// The decision for the next token, once known.
    next: Option<Result<Steer, ProcessorError>>,
    /// Generated since the last call.
    tokens: Vec<u32>,
    text: String,
}

/// A sequence's grammar and processor.
pub(super) struct Steering {
    pub(super) guide: Option<Guide>,
    processor: Option<Processor>,
}

/// Seconds spent preparing one step: the grammar mask, the processor call.
#[derive(Default)]
pub(super) struct Prepared {
    pub(super) mask: Option<f64>,
    pub(super) processor: Option<f64>,
}

impl Steering {
    pub(super) fn new(guide: Option<Guide>, processor: Option<ProcessorSlot>) -> Self {
        let processor = processor
            .and_then(|s| s.take())
            .map(|(code, first)| Processor {
                code,
                next: Some(Ok(first)),
                tokens: Vec::new(),
                text: String::new(),
            });
        Self { guide, processor }
    }

    pub(super) fn is_active(&self) -> bool {
        self.guide.is_some() || self.processor.is_some()
    }

    /// Computes what the next token needs, unless it is ready.
    pub(super) fn prepare(&mut self) -> Prepared {
        let mut out = Prepared::default();
        if let Some(g) = self.guide.as_mut() {
            out.mask = g.prepare();
        }
        if let Some(p) = self.processor.as_mut().filter(|p| p.next.is_none()) {
            let started = Instant::now();
            p.next = Some(p.code.step(&p.tokens, &p.text));
            p.tokens.clear();
            p.text.clear();
            out.processor = Some(started.elapsed().as_secs_f64());
        }
        out
    }

    /// Applies bans, biases and the grammar's mask to the next token's logits. `Ok(true)`:
    /// the processor ends the sequence here.
    pub(super) fn apply(&mut self, logits: &mut [f32]) -> Result<bool, EngineError> {
        if self.processor.is_some() {
            self.prepare();
        }
        if let Some(p) = self.processor.as_mut() {
            let steer = p
                .next
                .take()
                .expect("prepared")
                .map_err(EngineError::Processor)?;
            if steer.stop {
                return Ok(true);
            }
            for t in steer.banned {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = f32::NEG_INFINITY;
                }
            }
            for (t, b) in steer.biases {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l += b.clamp(-100.0, 100.0);
                }
            }
        }
        if let Some(g) = self.guide.as_mut() {
            g.apply(logits).map_err(EngineError::Grammar)?;
        }
        let banned_all = || logits.iter().all(|l| *l == f32::NEG_INFINITY);
        if self.processor.is_some() && banned_all() {
            let why =
                "no token is allowed next (the grammar and the processor's bans exclude every one)";
            return Err(EngineError::Grammar(why.to_string()));
        }
        Ok(false)
    }

    /// The grammar consumes a generated token (or refuses it).
    pub(super) fn commit(&mut self, token: u32) -> Result<(), String> {
        match self.guide.as_mut() {
            Some(g) => g.commit(token),
            None => Ok(()),
        }
    }

    /// The processor sees a generated token, and the text it released, on its next call.
    pub(super) fn record(&mut self, token: u32, text: &str) {
        if let Some(p) = self.processor.as_mut() {
            p.tokens.push(token);
            p.text.push_str(text);
        }
    }

    /// The grammar is complete.
    pub(super) fn finished(&self) -> bool {
        self.guide.as_ref().is_some_and(Guide::finished)
    }

    /// Tokens the grammar forces next, unless a processor must see every choice.
    pub(super) fn forced(&mut self) -> Vec<u32> {
        match (self.guide.as_mut(), &self.processor) {
            (Some(g), None) => g.forced(),
            _ => Vec::new(),
        }
    }
}

/// The forward pass over `batch`. The masks of the constrained sequences that sample this step
/// (`steered`) are computed on a second thread while it runs: the grammar adds no latency
/// unless it is slower.
pub(super) fn forward_steering(
    runner: &mut super::runner::Runner,
    batch: &[super::batch::BatchSeq],
    mut steered: Vec<&mut Steering>,
    g: &crate::metrics::GrammarMetrics,
    model: &str,
) -> Result<Vec<Vec<f32>>, crate::engine::ModelError> {
    if steered.is_empty() {
        return runner.forward(batch);
    }
    let mask_hist = g.mask_seconds.with_label_values(&[model]);
    let step_hist = g.processor_seconds.with_label_values(&[model]);
    std::thread::scope(|scope| {
        let masks = scope.spawn(|| {
            for s in steered.iter_mut() {
                let took = s.prepare();
                took.mask.inspect(|&t| mask_hist.observe(t));
                took.processor.inspect(|&t| step_hist.observe(t));
            }
        });
        let result = runner.forward(batch);
        if let Err(panic) = masks.join() {
            std::panic::resume_unwind(panic);
        }
        result
    })
}
