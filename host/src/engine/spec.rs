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

/// A sequence's drafting state.
///
/// The draft length halves after a round with nothing accepted and doubles after one with
/// everything accepted, so sequences whose output stops copying stop paying for drafts.
///
/// Lookups go down to a single token: a copied span often starts with a token the prompt
/// never has in that context (an email at the start of a line is "ada" in the answer, " ada"
/// in the text), and its last token recovers it (Qwen2.5 1.5B, email extraction: 1.18x with
/// bigrams at least, 1.56x with single tokens). But one token nearly always matches
/// somewhere, so a single-token draft that misses pauses single-token lookups for 1, 2, 4 …
/// `MAX_PAUSE` steps (an accepted draft resets it), while longer matches keep drafting.
#[derive(Debug, Clone, Copy)]
pub struct Drafter {
    current: usize,
    max: usize,
    /// Steps left without single-token lookups, and the length of the last such pause.
    skip: usize,
    pause: usize,
    /// The n-gram length behind the drafts awaiting verification.
    last_n: usize,
}

impl Drafter {
    pub fn new(max: usize) -> Self {
        Self {
            current: max,
            max,
            skip: 0,
            pause: 0,
            last_n: 0,
        }
    }

    /// This decode step's drafts for `tokens`, at most `cap` of them; called once per step.
    pub fn propose(&mut self, tokens: &[u32], cap: usize) -> Vec<u32> {
        let min_n = match self.skip {
            0 => 1,
            _ => 2,
        };
        self.skip = self.skip.saturating_sub(1);
        let (drafts, n) = prompt_lookup(tokens, self.current.min(cap), min_n);
        self.last_n = n;
        drafts
    }

    /// How many of the last `drafted` drafts were accepted.
    pub fn update(&mut self, drafted: usize, accepted: usize) {
        if accepted > 0 {
            self.pause = 0;
            if accepted == drafted {
                self.current = (self.current * 2).min(self.max);
            }
            return;
        }
        if self.last_n == 1 {
            self.pause = (self.pause * 2).clamp(1, MAX_PAUSE);
            self.skip = self.pause;
        }
        self.current = (self.current / 2).max(1);
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

    #[test]
    fn draft_length_adapts_to_acceptance() {
        let copy: Vec<u32> = (0..40).chain(0..20).collect();
        let mut d = Drafter::new(8);
        let mut sizes = Vec::new();
        for accepted in [0, 0, 1, 2, 4, 8] {
            let drafts = d.propose(&copy, usize::MAX);
            sizes.push(drafts.len());
            d.update(drafts.len(), accepted);
        }
        assert_eq!(sizes, [8, 4, 2, 2, 4, 8]);
        assert_eq!(d.propose(&copy, 3).len(), 3, "capped by the caller");
    }

    #[test]
    fn single_token_misses_pause_single_token_lookups_only() {
        // The last token, 5, occurs once before (a 1-gram match); "9 5" occurs nowhere.
        let one = [5, 6, 7, 9, 5];
        let mut d = Drafter::new(1);
        assert_eq!(d.propose(&one, usize::MAX), [6]);
        let mut pauses = Vec::new();
        for _ in 0..7 {
            d.update(1, 0);
            let mut skipped = 0;
            while d.propose(&one, usize::MAX).is_empty() {
                skipped += 1;
            }
            pauses.push(skipped);
        }
        assert_eq!(pauses, [1, 2, 4, 8, 16, 16, 16]);
        // While paused, a longer match still drafts.
        d.update(1, 0);
        assert_eq!(d.propose(&[1, 2, 3, 1, 2], usize::MAX), [3]);
    }
}
