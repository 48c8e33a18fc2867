//! Token sampling: penalties, temperature, top-k / top-p / min-p truncation, seeded randomness
//! and log-probabilities. One `Sampler` per sequence, so seeds and penalty state are per request.

use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    pub top_p: f32,
    /// 0 means no top-k cut.
    pub top_k: usize,
    pub min_p: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Multiplicative penalty on tokens seen in the prompt or output (1 = off), as in HF/vLLM.
    pub repetition_penalty: f32,
    pub seed: Option<u64>,
    /// Most alternatives to report per position when logprobs are asked for; `None` = no logprobs.
    pub logprobs: Option<usize>,
    /// Added to the logits of these tokens before sampling (OpenAI `logit_bias`).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            seed: None,
            logprobs: None,
            logit_bias: Vec::new(),
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: u32,
    /// Log-probability of the chosen token and the top alternatives under the model's
    /// distribution (before penalties and temperature), when asked for.
    pub logprobs: Option<TokenLogprobs>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    prompt_tokens: HashSet<u32>,
    output_counts: HashMap<u32, u32>,
}

impl Sampler {
    pub fn new(params: SamplingParams, prompt: &[u32]) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let prompt_tokens = if params.repetition_penalty != 1.0 {
            prompt.iter().copied().collect()
        } else {
            HashSet::new()
        };
        Self {
            params,
            rng,
            prompt_tokens,
            output_counts: HashMap::new(),
        }
    }

    /// Picks the next token from one row of logits (modified in place) and records it for the
    /// penalties of later steps.
    pub fn sample(&mut self, logits: &mut [f32]) -> Sampled {
        let logprobs = self.params.logprobs.map(|k| log_softmax_top(logits, k));
        self.apply_penalties(logits);
        // Below this, 1/temperature overflows the softmax; such temperatures mean greedy anyway.
        let token = if self.params.temperature < 1e-5 {
            argmax(logits)
        } else {
            self.sample_random(logits)
        };
        *self.output_counts.entry(token).or_default() += 1;
        let logprobs = logprobs.map(|(lse, top)| TokenLogprobs {
            logprob: lse.chosen(token),
            top,
        });
        Sampled { token, logprobs }
    }

    fn apply_penalties(&self, logits: &mut [f32]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 {
            let seen = self
                .prompt_tokens
                .iter()
                .chain(self.output_counts.keys())
                .collect::<HashSet<_>>();
            for &t in seen {
                let l = &mut logits[t as usize];
                *l = if *l > 0.0 {
                    *l / p.repetition_penalty
                } else {
                    *l * p.repetition_penalty
                };
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &self.output_counts {
                logits[t as usize] -= p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
        for &(t, b) in &p.logit_bias {
            logits[t as usize] += b;
        }
    }

    fn sample_random(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let inv_t = 1.0 / p.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        // Candidates sorted by probability, descending; only as many as the cuts can keep.
        let mut probs: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .map(|(i, &l)| (i as u32, ((l - max) * inv_t).exp()))
            .collect();
        let total: f32 = probs.iter().map(|x| x.1).sum();
        let by_prob = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1);
        let keep_k = if p.top_k > 0 {
            p.top_k.min(probs.len())
        } else {
            probs.len()
        };
        // Grow a sorted head until it covers top_p of the mass; avoids sorting the whole vocab.
        let mut head = 64.min(keep_k);
        loop {
            if head < probs.len() {
                probs.select_nth_unstable_by(head, by_prob);
            }
            probs[..head].sort_unstable_by(by_prob);
            let mass: f32 = probs[..head].iter().map(|x| x.1).sum::<f32>() / total;
            if head == keep_k || mass >= p.top_p {
                break;
            }
            head = (head * 4).min(keep_k);
        }
        probs.truncate(head);
        let top_prob = probs[0].1;
        let mut cum = 0.0;
        let mut cut = probs.len();
        for (i, &(_, pr)) in probs.iter().enumerate() {
            if pr < p.min_p * top_prob {
                cut = i;
                break;
            }
            cum += pr / total;
            if cum >= p.top_p {
                cut = i + 1;
                break;
            }
        }
        probs.truncate(cut.max(1));
        let kept: f32 = probs.iter().map(|x| x.1).sum();
        let mut r = self.rng.random::<f32>() * kept;
        for &(t, pr) in &probs {
            r -= pr;
            if r <= 0.0 {
                return t;
            }
        }
        probs[probs.len() - 1].0
    }
}

pub fn argmax(xs: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in xs.iter().enumerate() {
        if x > xs[best] {
            best = i;
        }
    }
    best as u32
}

struct LogSumExp(f32, Vec<f32>);

impl LogSumExp {
    fn chosen(&self, token: u32) -> f32 {
        self.1[token as usize] - self.0
    }
}

fn log_softmax_top(logits: &[f32], k: usize) -> (LogSumExp, Vec<(u32, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let k = k.min(idx.len());
    let cmp = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]);
    if k > 0 && k < idx.len() {
        idx.select_nth_unstable_by(k - 1, cmp);
    }
    idx.truncate(k);
    idx.sort_unstable_by(cmp);
    let top = idx
        .into_iter()
        .map(|t| (t, logits[t as usize] - lse))
        .collect();
    (LogSumExp(lse, logits.to_vec()), top)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(f: impl FnOnce(&mut SamplingParams)) -> SamplingParams {
        let mut p = SamplingParams {
            seed: Some(1),
            ..Default::default()
        };
        f(&mut p);
        p
    }

    #[test]
    fn greedy_picks_argmax() {
        let mut s = Sampler::new(params(|p| p.temperature = 0.0), &[]);
        assert_eq!(s.sample(&mut [0.1, 3.0, 2.0]).token, 1);
        let mut s = Sampler::new(params(|p| p.temperature = 1e-45), &[]);
        assert_eq!(
            s.sample(&mut [0.1, 3.0, 2.0]).token,
            1,
            "a subnormal temperature is greedy"
        );
    }

    #[test]
    fn same_seed_same_tokens_different_seed_differs() {
        let logits: Vec<f32> = (0..500).map(|i| ((i * 37) % 101) as f32 / 30.0).collect();
        let run = |seed| {
            let mut s = Sampler::new(params(|p| p.seed = Some(seed)), &[]);
            (0..40)
                .map(|_| s.sample(&mut logits.clone()).token)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(11), run(11));
        assert_ne!(run(11), run(12));
    }

    #[test]
    fn top_k_and_top_p_restrict_support() {
        let logits = [5.0, 4.0, 3.0, 0.0, -1.0];
        let mut s = Sampler::new(params(|p| p.top_k = 2), &[]);
        for _ in 0..200 {
            assert!(s.sample(&mut logits.clone()).token < 2);
        }
        // Probabilities ≈ [0.665, 0.245, 0.090, ...]: top_p 0.5 keeps only the first.
        let mut s = Sampler::new(params(|p| p.top_p = 0.5), &[]);
        for _ in 0..200 {
            assert_eq!(s.sample(&mut logits.clone()).token, 0);
        }
        let mut s = Sampler::new(params(|p| p.top_p = 0.95), &[]);
        let seen: HashSet<u32> = (0..2000)
            .map(|_| s.sample(&mut logits.clone()).token)
            .collect();
        assert_eq!(seen, HashSet::from([0, 1, 2]));
    }

    #[test]
    fn min_p_drops_unlikely_tokens() {
        let logits = [5.0, 4.9, 0.0];
        let mut s = Sampler::new(params(|p| p.min_p = 0.5), &[]);
        let seen: HashSet<u32> = (0..500)
            .map(|_| s.sample(&mut logits.clone()).token)
            .collect();
        assert_eq!(seen, HashSet::from([0, 1]));
    }

    #[test]
    fn penalties_push_away_from_repeats() {
        // Greedy with frequency penalty: after picking 0 twice, 1 wins.
        let mut s = Sampler::new(
            params(|p| {
                p.temperature = 0.0;
                p.frequency_penalty = 0.6;
            }),
            &[],
        );
        let picks: Vec<u32> = (0..3).map(|_| s.sample(&mut [2.0, 1.0]).token).collect();
        assert_eq!(picks, vec![0, 0, 1]);
        // Presence penalty is flat: one use is enough to flip.
        let mut s = Sampler::new(
            params(|p| {
                p.temperature = 0.0;
                p.presence_penalty = 1.5;
            }),
            &[],
        );
        let picks: Vec<u32> = (0..2).map(|_| s.sample(&mut [2.0, 1.0]).token).collect();
        assert_eq!(picks, vec![0, 1]);
        // Repetition penalty covers prompt tokens, dividing positive and multiplying negative.
        let mut s = Sampler::new(
            params(|p| {
                p.temperature = 0.0;
                p.repetition_penalty = 2.0;
            }),
            &[0, 2],
        );
        let mut logits = [3.0, 2.0, -1.0, -1.5];
        assert_eq!(s.sample(&mut logits).token, 1);
        assert_eq!(logits, [1.5, 2.0, -2.0, -1.5]);
    }

    #[test]
    fn logit_bias_shifts_and_bans_tokens() {
        let mut s = Sampler::new(
            params(|p| {
                p.temperature = 0.0;
                p.logit_bias = vec![(0, -100.0), (2, 1.5)];
            }),
            &[],
        );
        assert_eq!(s.sample(&mut [5.0, 1.0, 4.0]).token, 2);
        let mut s = Sampler::new(params(|p| p.logit_bias = vec![(0, -100.0)]), &[]);
        assert!(
            (0..200).all(|_| s.sample(&mut [5.0, 4.0]).token == 1),
            "-100 bans a token"
        );
    }

    #[test]
    fn logprobs_are_normalised_and_sorted() {
        let mut s = Sampler::new(
            params(|p| {
                p.temperature = 0.0;
                p.logprobs = Some(2);
            }),
            &[],
        );
        let out = s.sample(&mut [1.0, 3.0, 2.0]);
        let lp = out.logprobs.unwrap();
        let z = (1f32.exp() + 3f32.exp() + 2f32.exp()).ln();
        assert!((lp.logprob - (3.0 - z)).abs() < 1e-5);
        assert_eq!(lp.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2]);
        assert!((lp.top[1].1 - (2.0 - z)).abs() < 1e-5);
    }
}
