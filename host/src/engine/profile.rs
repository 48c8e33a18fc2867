//! Where an engine's steps spend their time, summed since it started: the scheduler, the
//! forward pass split into its weight products, attention, the vocabulary product and the rest
//! (norms, RoPE, activations, the KV write), then sampling and emitting tokens. `gateway bench`
//! prints the difference of two snapshots per step, so a batch that does not pay shows which
//! part grows with it. Timing costs two clock reads per part (~40 ns), against steps of
//! milliseconds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A part of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    Schedule,
    /// The whole forward pass, of which the next three are parts.
    Forward,
    Projections,
    Attention,
    LmHead,
    /// Sampling, stop checks, detokenizing and sending events.
    Sample,
}

const PHASES: usize = 6;

#[derive(Default)]
pub struct StepProfile {
    nanos: [AtomicU64; PHASES],
    steps: AtomicU64,
    rows: AtomicU64,
    seqs: AtomicU64,
}

impl StepProfile {
    pub fn add(&self, phase: Phase, since: Instant) {
        let ns = since.elapsed().as_nanos() as u64;
        self.nanos[phase as usize].fetch_add(ns, Ordering::Relaxed);
    }

    /// Runs `f`, counting its time to `phase`.
    pub fn time<T>(&self, phase: Phase, f: impl FnOnce() -> T) -> T {
        let t = Instant::now();
        let out = f();
        self.add(phase, t);
        out
    }

    /// One step of `seqs` sequences and `rows` rows done.
    pub fn step(&self, seqs: usize, rows: usize) {
        self.steps.fetch_add(1, Ordering::Relaxed);
        self.seqs.fetch_add(seqs as u64, Ordering::Relaxed);
        self.rows.fetch_add(rows as u64, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Snapshot {
        Snapshot {
            nanos: std::array::from_fn(|i| self.nanos[i].load(Ordering::Relaxed)),
            steps: self.steps.load(Ordering::Relaxed),
            rows: self.rows.load(Ordering::Relaxed),
            seqs: self.seqs.load(Ordering::Relaxed),
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
pub struct Snapshot {
    nanos: [u64; PHASES],
    pub steps: u64,
    pub rows: u64,
    pub seqs: u64,
}

impl Snapshot {
    /// What happened between `earlier` and this one.
    pub fn since(&self, earlier: &Snapshot) -> Snapshot {
        Snapshot {
            nanos: std::array::from_fn(|i| self.nanos[i] - earlier.nanos[i]),
            steps: self.steps - earlier.steps,
            rows: self.rows - earlier.rows,
            seqs: self.seqs - earlier.seqs,
        }
    }

    /// Mean time per step in `phase`.
    pub fn per_step(&self, phase: Phase) -> Duration {
        Duration::from_nanos(self.nanos[phase as usize] / self.steps.max(1))
    }

    /// The forward pass's time outside the weight products, attention and the vocabulary
    /// product, per step.
    pub fn other_forward(&self) -> Duration {
        let parts = [Phase::Projections, Phase::Attention, Phase::LmHead]
            .map(|p| self.per_step(p))
            .iter()
            .sum();
        self.per_step(Phase::Forward).saturating_sub(parts)
    }
}
