//! The scheduler thread: intake commands, schedule a step, run one batched forward, sample,
//! stream events. A plain thread that never awaits; it blocks only on its command channel when
//! there is nothing to do.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use tokenizers::Tokenizer;
use tokio::sync::mpsc as tokio_mpsc;

use super::batch::{generated_only, BatchSeq};
use super::block_manager::BlockManager;
use super::constraint::Guide;
use super::detokenizer::{IncrementalDecoder, StopMatcher, StopOutcome};
use super::profile::{Phase, StepProfile};
use super::runner::Runner;
use super::sampler::Sampler;
use super::scheduler::{Scheduled, Scheduler, SchedulerConfig, SeqId, Sequence};
use super::spec::{Drafter, StepCosts};
use super::steering::{forward_steering, Steering};
use super::{Command, EngineError, Event, FinishReason, GenerationRequest, TokenLogprobs, Usage};
use crate::config::ModelConfig;
use crate::metrics::Metrics;

/// An engine with nothing to run this long frees its model's step buffers (about 100 MB after
/// a long prompt on a 1.5B model); a busy one keeps them, so back-to-back requests never pay
/// for them again.
const IDLE_RELEASE: Duration = Duration::from_secs(10);

struct SeqState {
    tx: tokio_mpsc::UnboundedSender<Event>,
    sampler: Sampler,
    decoder: IncrementalDecoder,
    stop: StopMatcher,
    stop_ids: Vec<u32>,
    max_tokens: usize,
    prompt_len: usize,
    cached_tokens: usize,
    arrived: Instant,
    last_token: Option<Instant>,
    /// Scheduled at least once; until then it counts against the submission queue.
    admitted: bool,
    /// Prompt-lookup drafting allowed for this request, and its drafting state.
    speculative: bool,
    drafter: Drafter,
    /// The grammar this sequence follows and the processor steering it, if any.
    steering: Steering,
    /// Logprobs were asked for: every token then goes through sampling, none is forced.
    wants_logprobs: bool,
}

pub(super) struct EngineLoop {
    name: String,
    runner: Runner,
    tokenizer: Tokenizer,
    eos_ids: Vec<u32>,
    sched: Scheduler,
    states: HashMap<SeqId, SeqState>,
    metrics: Arc<Metrics>,
    waiting: Arc<AtomicUsize>,
    /// No sequence grows past this, whatever its request asked for.
    max_model_len: usize,
    profile: Arc<StepProfile>,
    /// Draft tokens per step (0: no speculation) and the most running sequences it runs with.
    spec_tokens: usize,
    spec_max_seqs: usize,
    /// What steps of generated rows cost, by rows: how long drafts may be.
    step_costs: StepCosts,
}

impl EngineLoop {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn new(
        runner: Runner,
        tokenizer: Tokenizer,
        eos_ids: Vec<u32>,
        cfg: &ModelConfig,
        num_blocks: usize,
        watermark_blocks: usize,
        max_model_len: usize,
        metrics: Arc<Metrics>,
        waiting: Arc<AtomicUsize>,
        profile: Arc<StepProfile>,
    ) -> Self {
        let e = &cfg.engine;
        let sched = Scheduler::new(
            SchedulerConfig {
                max_num_seqs: e.max_num_seqs,
                max_num_batched_tokens: e.max_num_batched_tokens,
                watermark_blocks,
            },
            BlockManager::new(num_blocks, e.block_size, e.prefix_caching),
        );
        metrics
            .kv_blocks_total
            .with_label_values(&[&cfg.name])
            .set(num_blocks as i64);
        let (bs, blocks) = (e.block_size.to_string(), num_blocks.to_string());
        metrics
            .vllm
            .cache_config
            .with_label_values(&[&cfg.name, &bs, &blocks])
            .set(1);
        // Every per-model series exists from the start, at zero, so dashboards see them.
        for c in [
            &metrics.prompt_tokens,
            &metrics.generation_tokens,
            &metrics.prefix_cache_hit_tokens,
            &metrics.preemptions,
            &metrics.spec_draft_tokens,
            &metrics.spec_accepted_tokens,
        ] {
            c.with_label_values(&[&cfg.name]).inc_by(0);
        }
        for h in [
            &metrics.ttft,
            &metrics.inter_token,
            &metrics.batch_seqs,
            &metrics.batch_tokens,
        ] {
            h.with_label_values(&[&cfg.name]);
        }
        let spec_tokens = match runner.verifies_drafts() {
            true => e.speculative_tokens,
            false => 0,
        };
        let this = Self {
            name: cfg.name.clone(),
            spec_tokens,
            spec_max_seqs: e.speculative_max_seqs,
            step_costs: StepCosts::default(),
            runner,
            tokenizer,
            eos_ids,
            sched,
            states: HashMap::new(),
            metrics,
            waiting,
            max_model_len,
            profile,
        };
        this.publish_gauges();
        this
    }

    pub(super) fn run(mut self, rx: mpsc::Receiver<Command>) {
        loop {
            if self.sched.is_idle() {
                let cmd = match rx.recv_timeout(IDLE_RELEASE) {
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        self.runner.release_buffers();
                        rx.recv().ok()
                    }
                    cmd => cmd.ok(),
                };
                match cmd {
                    Some(cmd) => self.handle(cmd),
                    None => return,
                }
            }
            while let Ok(cmd) = rx.try_recv() {
                self.handle(cmd);
            }
            // A bug anywhere in a step must not take the model down for every later request:
            // fail what was in flight, start from an empty pool, keep serving.
            if let Err(panic) = catch_unwind(AssertUnwindSafe(|| self.step())) {
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic".into());
                tracing::error!(panic = %msg, "engine step panicked; failing in-flight requests and resetting the KV pool");
                self.reset(&msg);
            }
            self.publish_gauges();
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Add(id, req, tx) => self.add(id, *req, tx),
            Command::Cancel(id) => self.finish(id, None),
        }
    }

    fn add(&mut self, id: SeqId, req: GenerationRequest, tx: tokio_mpsc::UnboundedSender<Event>) {
        let GenerationRequest {
            prompt,
            sampling,
            max_tokens,
            stop,
            mut stop_token_ids,
            ignore_eos,
            cache_salt,
            weight,
            speculative,
            constraint,
            processor,
        } = req;
        if !ignore_eos {
            stop_token_ids.extend(&self.eos_ids);
        }
        let wants_logprobs = sampling.logprobs.is_some();
        self.states.insert(
            id,
            SeqState {
                tx,
                sampler: Sampler::new(sampling, &prompt),
                decoder: IncrementalDecoder::new(&self.tokenizer, &prompt),
                stop: StopMatcher::new(stop),
                stop_ids: stop_token_ids,
                max_tokens,
                prompt_len: prompt.len(),
                cached_tokens: 0,
                arrived: Instant::now(),
                last_token: None,
                admitted: false,
                // Drafts are not checked against the grammar or the processor; constrained
                // sequences get forced tokens instead.
                speculative: speculative && constraint.is_none() && processor.is_none(),
                drafter: Drafter::new(self.spec_tokens),
                wants_logprobs,
                steering: Steering::new(constraint.map(Guide::new), processor),
            },
        );
        self.metrics
            .prompt_tokens
            .with_label_values(&[self.name.as_str()])
            .inc_by(prompt.len() as u64);
        self.sched
            .add(Sequence::new(id, prompt, cache_salt), weight);
    }

    fn step(&mut self) {
        let t0 = Instant::now();
        self.propose_drafts();
        let step = self.sched.schedule();
        if !step.preempted.is_empty() {
            self.metrics
                .preemptions
                .with_label_values(&[&self.name])
                .inc_by(step.preempted.len() as u64);
        }
        if step.scheduled.is_empty() {
            return;
        }
        self.note_admissions(&step.scheduled);
        let model = self.name.as_str();
        let batch = batch_of(&self.sched, &step.scheduled);
        let num_tokens: usize = step.scheduled.iter().map(|s| s.len).sum();
        let m = &self.metrics;
        m.batch_seqs
            .with_label_values(&[model])
            .observe(batch.len() as f64);
        m.batch_tokens
            .with_label_values(&[model])
            .observe(num_tokens as f64);
        self.profile.add(Phase::Schedule, t0);
        self.profile.step(batch.len(), num_tokens);
        let started = Instant::now();
        let sampling: Vec<SeqId> = step
            .scheduled
            .iter()
            .zip(&batch)
            .filter(|(_, b)| b.want_logits)
            .map(|(sc, _)| sc.id)
            .collect();
        let steered: Vec<&mut Steering> = self
            .states
            .iter_mut()
            .filter(|(id, st)| sampling.contains(id) && st.steering.is_active())
            .map(|(_, st)| &mut st.steering)
            .collect();
        let grammar = &self.metrics.grammar;
        let generated = generated_only(&batch);
        let result = forward_steering(&mut self.runner, &batch, steered, grammar, model);
        if generated {
            let secs = started.elapsed().as_secs_f64();
            self.step_costs.observe(num_tokens, secs);
        }
        self.profile.add(Phase::Forward, started);
        let sampled = Instant::now();
        tracing::trace!(
            seqs = batch.len(),
            tokens = num_tokens,
            ms = started.elapsed().as_secs_f64() * 1e3,
            "step"
        );
        drop(batch);
        let mut logits = match result {
            Ok(l) => l.into_iter(),
            Err(e) => {
                tracing::error!(error = %e, "forward pass failed; failing the batch");
                for sc in &step.scheduled {
                    self.fail(sc.id, EngineError::Inference(e.to_string()));
                }
                return;
            }
        };
        for sc in &step.scheduled {
            if self.sched.complete(sc) {
                let drafts = self.sched.running_mut(sc.id).map_or(0, |s| s.draft);
                let rows: Vec<Vec<f32>> = (0..=drafts)
                    .map(|_| logits.next().expect("logits rows per finished sequence"))
                    .collect();
                self.on_rows(sc.id, rows);
            }
        }
        self.profile.add(Phase::Sample, sampled);
    }

    /// First admission of a request: it leaves the submission queue, and its first chunk's
    /// start is how much of the prompt the prefix cache covered.
    fn note_admissions(&mut self, scheduled: &[Scheduled]) {
        let hits = self
            .metrics
            .prefix_cache_hit_tokens
            .with_label_values(&[&self.name]);
        for sc in scheduled {
            if let Some(st) = self.states.get_mut(&sc.id).filter(|st| !st.admitted) {
                st.admitted = true;
                self.waiting.fetch_sub(1, Ordering::Relaxed);
                st.cached_tokens = sc.start;
                hits.inc_by(sc.start as u64);
            }
        }
    }

    /// Appends prompt-lookup drafts to each decoding sequence that may speculate, while the
    /// batch is small, as many as pay for the rows they add (`Drafter`).
    fn propose_drafts(&mut self) {
        if self.spec_tokens == 0 || self.sched.running.len() > self.spec_max_seqs {
            return;
        }
        let base = self.sched.running.len();
        for seq in self.sched.running.iter_mut() {
            let decoding = seq.draft == 0 && seq.num_computed + 1 == seq.tokens.len();
            let Some(st) = self
                .states
                .get_mut(&seq.id)
                .filter(|st| st.speculative && decoding)
            else {
                continue;
            };
            // Accepted drafts plus the token sampled after them must fit the request's
            // max_tokens and the model's window.
            let left = st.max_tokens.saturating_sub(seq.generated().len() + 1);
            let window = self.max_model_len.saturating_sub(seq.tokens.len() + 1);
            let cap = left.min(window);
            let drafts = st.drafter.propose(&seq.tokens, cap, &self.step_costs, base);
            seq.draft = drafts.len();
            seq.tokens.extend(drafts);
        }
    }

    /// Samples a sequence's logits rows in order: one for a plain step; with drafts, the
    /// rows of the last token and of each draft. Drafts are accepted while the sampled token
    /// equals them; the first token that differs (or the one after the last draft) ends it.
    fn on_rows(&mut self, id: SeqId, rows: Vec<Vec<f32>>) {
        let drafts = match self.sched.running_mut(id) {
            Some(seq) if seq.draft > 0 => seq.tokens.split_off(seq.tokens.len() - seq.draft),
            _ => Vec::new(),
        };
        let mut accepted = 0;
        for (i, row) in rows.into_iter().enumerate() {
            match self.on_logits(id, row) {
                Some(t) if drafts.get(i) == Some(&t) => accepted += 1,
                _ => break,
            }
        }
        if !drafts.is_empty() {
            let model = self.name.as_str();
            let m = &self.metrics;
            m.spec_draft_tokens
                .with_label_values(&[model])
                .inc_by(drafts.len() as u64);
            m.spec_accepted_tokens
                .with_label_values(&[model])
                .inc_by(accepted as u64);
            if let Some(st) = self.states.get_mut(&id) {
                st.drafter.update(drafts.len(), accepted);
            }
            self.sched.settle_drafts(id);
        }
    }

    /// Samples one token from `row` and streams it, then any tokens the grammar forces after
    /// it; `None` when the sequence ended (or was already gone), else the sampled token.
    fn on_logits(&mut self, id: SeqId, mut row: Vec<f32>) -> Option<u32> {
        let st = self.states.get_mut(&id)?;
        if st.steering.is_active() {
            match st.steering.apply(&mut row) {
                Ok(false) => {}
                Ok(true) => {
                    self.finish(id, Some(FinishReason::Stop));
                    return None;
                }
                Err(e) => {
                    self.fail(id, e);
                    return None;
                }
            }
        }
        let sampled = st.sampler.sample(&mut row);
        let now = Instant::now();
        let model = self.name.as_str();
        match st.last_token {
            None => self
                .metrics
                .ttft
                .with_label_values(&[model])
                .observe((now - st.arrived).as_secs_f64()),
            Some(t) => self
                .metrics
                .inter_token
                .with_label_values(&[model])
                .observe((now - t).as_secs_f64()),
        }
        st.last_token = Some(now);
        self.emit(id, sampled.token, sampled.logprobs)?;
        self.force(id)?;
        Some(sampled.token)
    }

    /// Appends the tokens the grammar allows no alternative to, without sampling steps: the
    /// next forward pass computes them together, as a short prefill.
    fn force(&mut self, id: SeqId) -> Option<()> {
        let st = self.states.get_mut(&id)?;
        if st.wants_logprobs {
            return Some(());
        }
        let forced = st.steering.forced();
        if forced.is_empty() {
            return Some(());
        }
        self.metrics
            .grammar
            .forced_tokens
            .with_label_values(&[self.name.as_str()])
            .inc_by(forced.len() as u64);
        for t in forced {
            self.emit(id, t, None)?;
        }
        Some(())
    }

    /// Appends `token` to the sequence and streams its text; `None` when that ended the
    /// sequence (stop, length, grammar complete, client gone, grammar error).
    fn emit(&mut self, id: SeqId, token: u32, logprobs: Option<TokenLogprobs>) -> Option<()> {
        let st = self.states.get_mut(&id)?;
        let hit_stop_token = st.stop_ids.contains(&token);
        if !hit_stop_token {
            if let Err(e) = st.steering.commit(token) {
                self.fail(id, EngineError::Grammar(e));
                return None;
            }
        }
        let grammar_done = st.steering.finished();
        self.metrics
            .generation_tokens
            .with_label_values(&[self.name.as_str()])
            .inc();
        let seq = self.sched.running_mut(id).expect("sampled sequences run");
        seq.tokens.push(token);
        let generated = seq.generated().len();
        let at_window = seq.tokens.len() >= self.max_model_len;
        let (text, finish) = if hit_stop_token {
            (st.stop.flush(), Some(FinishReason::Stop))
        } else {
            let delta = st.decoder.push(&self.tokenizer, token);
            match st.stop.push(&delta) {
                StopOutcome::Stopped(t) => (t, Some(FinishReason::Stop)),
                StopOutcome::Continue(t) if grammar_done => {
                    (t + &st.stop.flush(), Some(FinishReason::Stop))
                }
                StopOutcome::Continue(t) if generated >= st.max_tokens || at_window => {
                    (t + &st.stop.flush(), Some(FinishReason::Length))
                }
                StopOutcome::Continue(t) => (t, None),
            }
        };
        st.steering.record(token, &text);
        let ev = Event::Token {
            id: token,
            text,
            // A stop token is not part of the content, so it gets no logprobs entry (as OpenAI).
            logprobs: logprobs.filter(|_| !hit_stop_token),
        };
        if st.tx.send(ev).is_err() {
            // The client went away: free its blocks now rather than generating into the void.
            self.finish(id, None);
            return None;
        }
        if let Some(reason) = finish {
            self.finish(id, Some(reason));
            return None;
        }
        Some(())
    }

    fn reset(&mut self, msg: &str) {
        for (_, st) in self.states.drain() {
            if !st.admitted {
                self.waiting.fetch_sub(1, Ordering::Relaxed);
            }
            let _ = st
                .tx
                .send(Event::Failed(EngineError::Internal(msg.to_string())));
        }
        self.sched.reset();
    }

    fn fail(&mut self, id: SeqId, msg: EngineError) {
        if let Some(st) = self.states.get(&id) {
            let _ = st.tx.send(Event::Failed(msg));
        }
        self.finish(id, None);
    }

    /// Removes a sequence and frees its blocks; with a reason, reports usage to the client.
    fn finish(&mut self, id: SeqId, reason: Option<FinishReason>) {
        let seq = self.sched.remove(id);
        let Some(st) = self.states.remove(&id) else {
            return;
        };
        if !st.admitted {
            self.waiting.fetch_sub(1, Ordering::Relaxed);
        }
        let model = self.name.as_str();
        let label = reason.map_or("cancelled", FinishReason::as_str);
        self.metrics
            .requests
            .with_label_values(&[model, label])
            .inc();
        if let (Some(reason), Some(seq)) = (reason, seq) {
            let usage = Usage {
                prompt_tokens: st.prompt_len,
                completion_tokens: seq.generated().len(),
                cached_tokens: st.cached_tokens,
            };
            let _ = st.tx.send(Event::Done(usage, reason));
        }
    }

    fn publish_gauges(&self) {
        let m = &self.metrics;
        let model = self.name.as_str();
        m.queue_depth
            .with_label_values(&[model])
            .set(self.sched.waiting.len() as i64);
        m.running_seqs
            .with_label_values(&[model])
            .set(self.sched.running.len() as i64);
        let used = self.sched.blocks.num_blocks() - self.sched.blocks.num_free();
        m.kv_blocks_used
            .with_label_values(&[model])
            .set(used as i64);
        m.kv_utilisation
            .with_label_values(&[model])
            .set(self.sched.kv_utilisation());
        let v = &m.vllm;
        // Not yet admitted (still counted by `submit`), plus preempted sequences back in line.
        let preempted = self
            .sched
            .waiting
            .iter()
            .filter(|s| self.states.get(&s.id).is_some_and(|st| st.admitted))
            .count();
        let waiting = self.waiting.load(Ordering::Relaxed) + preempted;
        v.waiting.with_label_values(&[model]).set(waiting as i64);
        v.running
            .with_label_values(&[model])
            .set(self.sched.running.len() as i64);
        let total = self.sched.blocks.num_blocks().max(1);
        v.kv_usage
            .with_label_values(&[model])
            .set(used as f64 / total as f64);
    }
}

/// The forward pass's view of the scheduled chunks: each sequence's blocks and new tokens,
/// with logits (and draft rows) wanted where a chunk finishes its sequence's known tokens.
fn batch_of<'a>(sched: &'a Scheduler, scheduled: &[Scheduled]) -> Vec<BatchSeq<'a>> {
    scheduled
        .iter()
        .map(|sc| {
            let seq = sched
                .running
                .iter()
                .find(|s| s.id == sc.id)
                .expect("scheduled sequences run");
            let done = sc.start + sc.len == seq.tokens.len();
            BatchSeq {
                block_table: &seq.blocks,
                start: sc.start,
                tokens: &seq.tokens[sc.start..sc.start + sc.len],
                want_logits: done,
                draft_rows: if done { seq.draft } else { 0 },
                prompt_len: seq.prompt_len,
            }
        })
        .collect()
}
