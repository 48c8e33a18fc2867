//! Prompt-lookup drafting for speculative decoding (no draft model): the sequence's last few
//! tokens are looked up earlier in its own prompt and output, and the tokens that followed
//! that occurrence become the draft. It pays when outputs copy spans of their input
//! (extraction, quoting, code edits, RAG answers) and costs nothing when no n-gram matches.
//!
//! Verification samples each position with the sequence's own sampler and accepts drafts
//! while the sampled token equals the draft. For a draft proposed with certainty this is
//! exactly speculative sampling's rule (accept with probability p(d), else sample from p
//! without d), so the output distribution is unchanged, greedy or sampled.

/// Longest suffix n-gram looked up (longest first: a longer match predicts better).
const NGRAM_MAX: usize = 4;

/// Most decode steps a sequence goes without single-token lookups after repeated misses.
const MAX_PAUSE: usize = 16;

/// Up to `max` draft tokens for the continuation of `tokens`: what followed the most recent
/// earlier occurrence of its longest matching suffix n-gram of at least `min_n` tokens, and
/// that n; empty when none matches.
fn prompt_lookup(tokens: &[u32], max: usize, min_n: usize) -> (Vec<u32>, usize) {
    let len = tokens.len();
    if max == 0 {
        return (Vec::new(), 0);
    }
    for n in (min_n.max(1)..=NGRAM_MAX).rev() {
        if len <= n {
            continue;
        }
        let suffix = &tokens[len - n..];
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            let from = start + n;
            return (tokens[from..(from + max).min(len)].to_vec(), n);
        }
    }
    (Vec::new(), 0)
}

/// Weight each earlier round keeps in a sequence's acceptance rates: an answer copies in
/// spans, so the rates follow the last few rounds.
const DECAY: f64 = 0.75;

/// A rate measured from hits out of trials, each round's weight decaying by `DECAY`, one half
/// before anything is seen.
#[derive(Debug, Clone, Copy, Default)]
struct Rate {
    hits: f64,
    tried: f64,
}

impl Rate {
    fn get(self) -> f64 {
        (self.hits + 1.0) / (self.tried + 2.0)
    }

    fn learn(&mut self, hits: usize, tried: usize) {
        if tried == 0 {
            return;
        }
        self.hits = self.hits * DECAY + hits as f64;
        self.tried = self.tried * DECAY + tried as f64;
    }
}

/// A sequence's drafting state.
///
/// Each step drafts as many tokens as maximise the tokens expected per unit of step time: k
/// drafts give `1 + f·(1 + n + … + n^(k−1))` tokens, with `f` this sequence's rate of accepted
/// first drafts and `n` that of drafts after an accepted one, and cost what `StepCosts`
/// measured for k more rows. Where extra rows cost little (a step bound by reading the
/// weights: Qwen2.5 1.5B on two cores, 2 rows 1.2x and 4 rows 1.55x one) long drafts pay at
/// moderate acceptance; where rows cost arithmetic (SmolLM2: 2 rows 1.4x, 5 rows 2.2x one)
/// it is one or two drafts, or none, so speculation no longer slows a model down. The rates are measured on the whole lookup of
/// `max` tokens whatever part of it was sent: the tokens a step generated (accepted drafts and
/// the one sampled after them) are compared with it, so a sequence that drafts little or
/// nothing still learns when its lookups start to match.
///
/// Lookups go down to a single token: a copied span often starts with a token the prompt
/// never has in that context (an email at the start of a line is "ada" in the answer, " ada"
/// in the text), and its last token recovers it (Qwen2.5 1.5B, email extraction: 1.18x with
/// bigrams at least, 1.56x with single tokens). But one token nearly always matches
/// somewhere, so a single-token draft that misses pauses single-token lookups for 1, 2, 4 …
/// `MAX_PAUSE` steps (an accepted draft resets it), while longer matches keep drafting.
#[derive(Debug, Clone)]
pub struct Drafter {
    max: usize,
    /// How often a round's first draft is accepted, and how often a draft after an accepted
    /// one is: a lookup either follows a span the answer is copying, and then goes on
    /// matching, or misses at once.
    first: Rate,
    next: Rate,
    /// The last lookup (up to `max` tokens), and the sequence's length when it was made: what
    /// the next call compares with the tokens generated since.
    predicted: Vec<u32>,
    at: usize,
    /// Steps left without single-token lookups, and the length of the last such pause.
    skip: usize,
    pause: usize,
    /// The n-gram length behind the drafts awaiting verification.
    last_n: usize,
}

impl Drafter {
    pub fn new(max: usize) -> Self {
        Self {
            max,
            first: Rate::default(),
            next: Rate::default(),
            predicted: Vec::new(),
            at: 0,
            skip: 0,
            pause: 0,
            last_n: 0,
        }
    }

    /// The draft length that maximises expected tokens per unit of step time, for a step of
    /// `base` rows without it (one per decoding sequence).
    fn length(&self, costs: &StepCosts, base: usize) -> usize {
        let (first, next, base) = (self.first.get(), self.next.get(), base.max(1));
        let (mut best, mut value) = (0, 1.0);
        let (mut expected, mut p) = (base as f64, first);
        for k in 1..=self.max {
            expected += p;
            p *= next;
            let v = expected / base as f64 / costs.ratio(base, base + k);
            if v > value {
                (best, value) = (k, v);
            }
        }
        best
    }

    /// Compares the last lookup with the tokens generated since: its first token counts for
    /// `first`, the ones after a hit for `next`, up to the first miss or the last token seen.
    fn measure(&mut self, tokens: &[u32]) {
        let predicted = std::mem::take(&mut self.predicted);
        let generated = tokens.get(self.at..).unwrap_or_default();
        let seen = predicted.len().min(generated.len());
        if seen == 0 {
            return;
        }
        let hits = predicted
            .iter()
            .zip(generated)
            .take_while(|(p, g)| p == g)
            .count();
        self.first.learn(usize::from(hits > 0), 1);
        if hits > 0 {
            let missed = usize::from(hits < seen);
            self.next.learn(hits - 1, hits - 1 + missed);
        }
    }

    /// This decode step's drafts for `tokens`, at most `cap` of them, in a step of `base` rows
    /// without them; called once per step.
    pub fn propose(
        &mut self,
        tokens: &[u32],
        cap: usize,
        costs: &StepCosts,
        base: usize,
    ) -> Vec<u32> {
        self.measure(tokens);
        let min_n = match self.skip {
            0 => 1,
            _ => 2,
        };
        self.skip = self.skip.saturating_sub(1);
        let (lookup, n) = prompt_lookup(tokens, self.max, min_n);
        let len = self.length(costs, base).min(cap).min(lookup.len());
        (self.predicted, self.at, self.last_n) = (lookup, tokens.len(), n);
        self.predicted[..len].to_vec()
    }

    /// How many of the last `drafted` drafts were accepted.
    pub fn update(&mut self, drafted: usize, accepted: usize) {
        if accepted > 0 {
            self.pause = 0;
            return;
        }
        if drafted > 0 && self.last_n == 1 {
            self.pause = (self.pause * 2).clamp(1, MAX_PAUSE);
            self.skip = self.pause;
        }
    }
}

/// Most rows per step whose cost is tracked.
const COST_ROWS: usize = 64;

/// Steps of one row count its mean cost averages over, so it follows the machine's load.
const COST_WINDOW: f64 = 32.0;

/// What a step of generated rows (decode, draft verification) costs the forward pass, by its
/// rows: the mean time of each row count seen, and a line fitted through them (weighted by how
/// often each was seen), so a count not run lately is estimated from the others. A step's
/// cost grows about linearly in its rows once arithmetic rather than reading the weights bounds
/// it (SmolLM2's step matrices on two Zen 3 cores: 5.4, 7.4, 10.3 and 18.1 ms at 1, 2, 4 and 8
/// rows).
#[derive(Debug, Clone)]
pub struct StepCosts {
    mean: Vec<f64>,
    seen: Vec<f64>,
}

impl Default for StepCosts {
    fn default() -> Self {
        Self {
            mean: vec![0.0; COST_ROWS + 1],
            seen: vec![0.0; COST_ROWS + 1],
        }
    }
}

impl StepCosts {
    /// A step of `rows` generated rows took `secs`.
    pub fn observe(&mut self, rows: usize, secs: f64) {
        let Some(n) = self.seen.get_mut(rows).filter(|_| rows > 0) else {
            return;
        };
        if !secs.is_finite() || secs < 0.0 {
            return;
        }
        *n = (*n + 1.0).min(COST_WINDOW);
        self.mean[rows] += (secs - self.mean[rows]) / *n;
    }

    /// A step of `rows` against one of `base` rows, at least 1. Until two row counts have
    /// been seen, more rows are taken to cost nothing: drafting is tried, and so measured.
    pub fn ratio(&self, base: usize, rows: usize) -> f64 {
        let Some((a, b)) = self.line() else {
            return 1.0;
        };
        let cost = |r: usize| a + b * r as f64;
        match cost(base) {
            c if c > 0.0 => (cost(rows) / c).max(1.0),
            _ => 1.0,
        }
    }

    /// `(a, b)` of the least-squares line `a + b·rows` through the means, each weighted by
    /// its count; rows never cost less than fewer rows, so the slope is at least zero.
    fn line(&self) -> Option<(f64, f64)> {
        let (mut w, mut sx, mut sy, mut sxx, mut sxy, mut counts) = (0.0, 0.0, 0.0, 0.0, 0.0, 0);
        for (r, (&y, &n)) in self.mean.iter().zip(&self.seen).enumerate() {
            if n > 0.0 {
                let x = r as f64;
                (w, sx, sy) = (w + n, sx + n * x, sy + n * y);
                (sxx, sxy, counts) = (sxx + n * x * x, sxy + n * x * y, counts + 1);
            }
        }
        let det = w * sxx - sx * sx;
        if counts < 2 || det <= 0.0 {
            return None;
        }
        let b = (w * sxy - sx * sy) / det;
        if b <= 0.0 {
            return Some((sy / w, 0.0));
        }
        Some(((sy - b * sx) / w, b))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_what_followed_the_latest_longest_match() {
        // ... 1 2 3 9 ... 1 2 3 7 8 ... 1 2 3 → the latest "1 2 3" was followed by 7 8.
        let t = [1, 2, 3, 9, 5, 1, 2, 3, 7, 8, 6, 1, 2, 3];
        assert_eq!(prompt_lookup(&t, 2, 1), (vec![7, 8], 3));
        assert_eq!(prompt_lookup(&t, 10, 1).0, vec![7, 8, 6, 1, 2, 3]);
        // A 4-gram match beats a more recent 2-gram one.
        let t = [4, 1, 2, 3, 50, 60, 2, 3, 70, 4, 1, 2, 3];
        assert_eq!(prompt_lookup(&t, 2, 1), (vec![50, 60], 4));
    }

    #[test]
    fn nothing_matching_means_no_draft() {
        assert!(prompt_lookup(&[1, 2, 3, 4, 5, 6], 4, 1).0.is_empty());
        assert!(prompt_lookup(&[1], 4, 1).0.is_empty(), "nothing before it");
        assert!(prompt_lookup(&[1, 2, 1, 2], 0, 1).0.is_empty());
        assert_eq!(prompt_lookup(&[1, 2, 1, 2], 4, 1).0, vec![1, 2]);
        // One token is enough to draft what followed it, unless longer matches are asked for.
        assert_eq!(prompt_lookup(&[7, 8, 9, 5, 7], 2, 1), (vec![8, 9], 1));
        assert!(prompt_lookup(&[7, 8, 9, 5, 7], 2, 2).0.is_empty());
    }

    /// Costs on the line `a + b·rows` (ms), each count seen a few times.
    fn costs(a: f64, b: f64, rows: &[usize]) -> StepCosts {
        let mut c = StepCosts::default();
        for _ in 0..4 {
            for &r in rows {
                c.observe(r, (a + b * r as f64) / 1e3);
            }
        }
        c
    }

    #[test]
    fn step_costs_fit_a_line() {
        let c = costs(3.6, 1.8, &[1, 2, 5]);
        // 1 row 5.4 ms, 9 rows 19.8 ms: estimated from counts never seen.
        assert!((c.ratio(1, 9) - 19.8 / 5.4).abs() < 1e-9);
        assert!((c.ratio(2, 5) - 12.6 / 7.2).abs() < 1e-9);
        assert_eq!(c.ratio(5, 2), 1.0, "fewer rows never cost less than 1");
        // One count seen, or rows that seem to cost less: more rows are taken as free.
        assert_eq!(costs(3.6, 1.8, &[1]).ratio(1, 5), 1.0);
        assert_eq!(costs(9.0, -1.0, &[1, 4]).ratio(1, 4), 1.0);
        let mut c = StepCosts::default();
        c.observe(0, 1.0);
        c.observe(COST_ROWS + 1, 1.0);
        c.observe(3, f64::NAN);
        assert!(c.line().is_none(), "nothing usable was observed");
    }

    /// One decode step of a sequence whose next tokens are `truth(position)`: drafts proposed,
    /// verified, and the accepted ones and the token after them appended. The drafts' count.
    fn step(
        d: &mut Drafter,
        tokens: &mut Vec<u32>,
        truth: impl Fn(usize) -> u32,
        costs: &StepCosts,
    ) -> usize {
        let drafts = d.propose(tokens, usize::MAX, costs, 1);
        let at = tokens.len();
        let accepted = (0..drafts.len())
            .take_while(|&i| drafts[i] == truth(at + i))
            .count();
        tokens.extend((at..=at + accepted).map(truth));
        d.update(drafts.len(), accepted);
        drafts.len()
    }

    #[test]
    fn draft_length_follows_acceptance_and_cost() {
        let (free, memory) = (StepCosts::default(), costs(42.0, 0.1, &[1, 5]));
        let arithmetic = costs(3.6, 1.8, &[1, 2, 5]);
        // 0..40, then the answer copies it from its start.
        let copy = |p: usize| (p % 40) as u32;
        let mut tokens: Vec<u32> = (0..41).map(copy).collect();
        let mut d = Drafter::new(8);
        // Before anything is measured (rates of one half): all 8 where rows cost nothing,
        // most where they cost little, one where each costs a third of a one-row step, none
        // in a step of four rows, where one accepted draft adds a quarter to the step's
        // tokens and its row a sixth to its time.
        assert_eq!(d.propose(&tokens, usize::MAX, &free, 1).len(), 8);
        assert!(d.propose(&tokens, usize::MAX, &memory, 1).len() >= 4);
        assert_eq!(d.propose(&tokens, usize::MAX, &arithmetic, 1).len(), 1);
        assert!(d.propose(&tokens, usize::MAX, &arithmetic, 4).is_empty());
        assert_eq!(
            d.propose(&tokens, 3, &free, 1).len(),
            3,
            "capped by the caller"
        );
        // Copying goes on: longer drafts pay there too, though one draft at a time measures
        // only the token after it.
        let sent: Vec<_> = (0..6)
            .map(|_| step(&mut d, &mut tokens, copy, &arithmetic))
            .collect();
        assert_eq!(sent[0], 1);
        assert!(sent[5] >= 4, "drafts per step while copying: {sent:?}");
        // The answer stops copying (each token 7 after the last, where the text had the next
        // one): no draft pays there, while rows that cost little still carry one.
        let other = |p: usize| (p * 7 % 40) as u32;
        for _ in 0..40 {
            step(&mut d, &mut tokens, other, &arithmetic);
        }
        assert!(d.propose(&tokens, usize::MAX, &arithmetic, 1).is_empty());
        assert!(!d.propose(&tokens, usize::MAX, &memory, 1).is_empty());
    }

    #[test]
    fn acceptance_is_measured_while_nothing_is_drafted() {
        let arithmetic = costs(3.6, 1.8, &[1, 2, 5]);
        let mut d = Drafter::new(4);
        let (mut tokens, other) = (Vec::from_iter(0..41), |p: usize| (p * 7 % 40) as u32);
        for _ in 0..40 {
            step(&mut d, &mut tokens, other, &arithmetic);
        }
        // The answer starts copying the text: no draft is sent until the lookups, compared
        // with the tokens generated, have shown that drafting pays.
        let start = tokens.len();
        let copy = |p: usize| ((p - start) % 40) as u32;
        let sent: Vec<_> = (0..12)
            .map(|_| step(&mut d, &mut tokens, copy, &arithmetic))
            .collect();
        assert_eq!(sent[0], 0, "{sent:?}");
        assert!(
            sent.iter().any(|&n| n > 0),
            "drafting never resumed: {sent:?}"
        );
    }

    #[test]
    fn single_token_misses_pause_single_token_lookups_only() {
        // The last token, 5, occurs once before (a 1-gram match); "9 5" occurs nowhere.
        let one = [5, 6, 7, 9, 5];
        let free = StepCosts::default();
        let mut d = Drafter::new(1);
        assert_eq!(d.propose(&one, usize::MAX, &free, 1), [6]);
        let mut pauses = Vec::new();
        for _ in 0..7 {
            d.update(1, 0);
            let mut skipped = 0;
            while d.propose(&one, usize::MAX, &free, 1).is_empty() {
                skipped += 1;
            }
            pauses.push(skipped);
        }
        assert_eq!(pauses, [1, 2, 4, 8, 16, 16, 16]);
        // While paused, a longer match still drafts.
        d.update(1, 0);
        assert_eq!(d.propose(&[1, 2, 3, 1, 2], usize::MAX, &free, 1), [3]);
    }
}
