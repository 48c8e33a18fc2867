//! One encoder thread for every caller, like the decoder's scheduler: requests queue their
//! sequences, and each forward packs sequences from all waiting requests up to a token budget,
//! so concurrent clients fill one batch instead of running four forwards side by side on two
//! cores (each with its own buffers). The shortest pending request goes first, so a search
//! query is not held behind a 10,000-document ingest, which still gets the rest of every batch.

use std::sync::mpsc;
use std::sync::Arc;

use super::{Encoder, Scratch};

type Reply = Result<Vec<Vec<f32>>, String>;

struct Job {
    seqs: Vec<Vec<u32>>,
    reply: mpsc::SyncSender<Reply>,
}

/// A job being worked through: the next sequence to embed and the vectors so far.
struct Pending {
    job: Job,
    next: usize,
    done: Vec<Vec<f32>>,
    tokens_left: usize,
}

pub struct Batcher {
    tx: parking_lot::Mutex<mpsc::Sender<Job>>,
}

impl Batcher {
    /// Starts the encoder thread; each forward holds at most `budget` tokens (a longer
    /// sequence goes alone).
    pub fn new(encoder: Arc<Encoder>, budget: usize) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("encoder".into())
            .spawn(move || work(&encoder, &rx, budget))
            .expect("spawn the encoder thread");
        Self {
            tx: parking_lot::Mutex::new(tx),
        }
    }

    /// Queues `seqs` for embedding and returns at once; `Ticket::wait` gives their vectors,
    /// so the caller can do other work (a BM25 search) while the encoder runs.
    pub fn submit(&self, seqs: Vec<Vec<u32>>) -> Result<Ticket, String> {
        let (reply, rx) = mpsc::sync_channel(1);
        if seqs.is_empty() {
            reply.send(Ok(Vec::new())).expect("the receiver is here");
            return Ok(Ticket(rx));
        }
        let sent = self.tx.lock().send(Job { seqs, reply });
        sent.map_err(|_| "the encoder thread has stopped".to_string())?;
        Ok(Ticket(rx))
    }
}

/// Embeddings on their way.
pub struct Ticket(mpsc::Receiver<Reply>);

impl Ticket {
    /// The vectors, in order; blocks until they are computed.
    pub fn wait(self) -> Reply {
        self.0
            .recv()
            .map_err(|_| "the encoder thread has stopped".to_string())?
    }
}

/// Until every `Batcher` handle is gone: take what is queued, run one batch, answer the jobs
/// it finished.
fn work(encoder: &Encoder, rx: &mpsc::Receiver<Job>, budget: usize) {
    let mut scratch = Scratch::default();
    let mut pending: Vec<Pending> = Vec::new();
    loop {
        if pending.is_empty() {
            match rx.recv() {
                Ok(job) => pending.push(start(job)),
                Err(_) => return,
            }
        }
        pending.extend(rx.try_iter().map(start));
        pending.sort_by_key(|p| p.tokens_left);
        let picks = pick(&pending, budget);
        let seqs: Vec<&[u32]> = picks
            .iter()
            .map(|&(j, i)| pending[j].job.seqs[i].as_slice())
            .collect();
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            encoder.forward(&seqs, &mut scratch)
        }));
        match run {
            Ok(vectors) => {
                for (&(j, i), v) in picks.iter().zip(vectors) {
                    let p = &mut pending[j];
                    p.tokens_left -= p.job.seqs[i].len();
                    p.done.push(v);
                    p.next += 1;
                }
            }
            Err(_) => {
                // A bug, not an input (inputs are checked before they queue): the jobs in this
                // batch fail, the thread and the others go on.
                tracing::error!("the encoder panicked; failing the requests of this batch");
                scratch = Scratch::default();
                let failed: std::collections::BTreeSet<usize> =
                    picks.iter().map(|&(j, _)| j).collect();
                for &j in failed.iter().rev() {
                    let p = pending.remove(j);
                    let _ = p.job.reply.send(Err("the encoder failed".into()));
                }
                continue;
            }
        }
        pending.retain_mut(|p| {
            let finished = p.next == p.job.seqs.len();
            if finished {
                let _ = p.job.reply.send(Ok(std::mem::take(&mut p.done)));
            }
            !finished
        });
    }
}

fn start(job: Job) -> Pending {
    Pending {
        tokens_left: job.seqs.iter().map(Vec::len).sum(),
        done: Vec::with_capacity(job.seqs.len()),
        next: 0,
        job,
    }
}

/// (job, sequence) pairs for one forward: sequences in order from the jobs in order, up to
/// `budget` tokens (at least one sequence).
fn pick(pending: &[Pending], budget: usize) -> Vec<(usize, usize)> {
    let mut picks = Vec::new();
    let mut tokens = 0;
    for (j, p) in pending.iter().enumerate() {
        for i in p.next..p.job.seqs.len() {
            let len = p.job.seqs[i].len();
            if !picks.is_empty() && tokens + len > budget {
                return picks;
            }
            picks.push((j, i));
            tokens += len;
        }
    }
    picks
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pending(lens: &[usize]) -> Pending {
        let (reply, _) = mpsc::sync_channel(1);
        start(Job {
            seqs: lens.iter().map(|&n| vec![0; n]).collect(),
            reply,
        })
    }

    #[test]
    fn a_batch_fills_up_to_the_budget_across_jobs() {
        let jobs = [pending(&[3, 4]), pending(&[5, 5, 5])];
        assert_eq!(pick(&jobs, 12), [(0, 0), (0, 1), (1, 0)]);
        // A sequence longer than the budget still goes, alone.
        assert_eq!(pick(&[pending(&[20, 1])], 8), [(0, 0)]);
    }
}
