//! Prompt-lookup drafting for speculative decoding (no draft model): the sequence's last few
//! tokens are looked up earlier in its own prompt and output, and the tokens that followed
//! that occurrence become the draft. It pays when outputs copy spans of their input
//! (extraction, quoting, code edits, RAG answers) and costs nothing when no n-gram matches.
//!
//! Verification samples each position with the sequence's own sampler and accepts drafts
//! while the sampled token equals the draft. For a draft proposed with certainty this is
//! exactly speculative sampling's rule (accept with probability p(d), else sample from p
//! without d), so the output distribution is unchanged, greedy or sampled.

/// Longest and shortest suffix n-gram looked up (longest first: a longer match predicts better).
const NGRAM_MAX: usize = 4;
const NGRAM_MIN: usize = 2;

/// Up to `max` draft tokens for the continuation of `tokens`: what followed the most recent
/// earlier occurrence of its longest matching suffix n-gram; empty when none matches.
pub fn prompt_lookup(tokens: &[u32], max: usize) -> Vec<u32> {
    let len = tokens.len();
    if max == 0 {
        return Vec::new();
    }
    for n in (NGRAM_MIN..=NGRAM_MAX).rev() {
        if len <= n {
            continue;
        }
        let suffix = &tokens[len - n..];
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == suffix) {
            let from = start + n;
            return tokens[from..(from + max).min(len)].to_vec();
        }
    }
    Vec::new()
}

/// Per-sequence draft length: halves after a round with nothing accepted, doubles after one
/// with everything accepted, so sequences whose output stops copying stop paying for drafts.
#[derive(Debug, Clone, Copy)]
pub struct DraftLength {
    current: usize,
    max: usize,
}

impl DraftLength {
    pub fn new(max: usize) -> Self {
        Self { current: max, max }
    }

    pub fn get(&self) -> usize {
        self.current
    }

    pub fn update(&mut self, drafted: usize, accepted: usize) {
        if accepted == 0 {
            self.current = (self.current / 2).max(1);
        } else if accepted == drafted {
            self.current = (self.current * 2).min(self.max);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_what_followed_the_latest_longest_match() {
        // ... 1 2 3 9 ... 1 2 3 7 8 ... 1 2 3 → the latest "1 2 3" was followed by 7 8.
        let t = [1, 2, 3, 9, 5, 1, 2, 3, 7, 8, 6, 1, 2, 3];
        assert_eq!(prompt_lookup(&t, 2), vec![7, 8]);
        assert_eq!(prompt_lookup(&t, 10), vec![7, 8, 6, 1, 2, 3]);
        // A 4-gram match beats a more recent 2-gram one.
        let t = [4, 1, 2, 3, 50, 60, 2, 3, 70, 4, 1, 2, 3];
        assert_eq!(prompt_lookup(&t, 2), vec![50, 60]);
    }

    #[test]
    fn nothing_matching_means_no_draft() {
        assert!(prompt_lookup(&[1, 2, 3, 4, 5, 6], 4).is_empty());
        assert!(
            prompt_lookup(&[1, 1], 4).is_empty(),
            "too short for an n-gram"
        );
        assert!(prompt_lookup(&[1, 2, 1, 2], 0).is_empty());
        assert_eq!(prompt_lookup(&[1, 2, 1, 2], 4), vec![1, 2]);
    }

    #[test]
    fn draft_length_adapts_to_acceptance() {
        let mut d = DraftLength::new(8);
        d.update(8, 0);
        d.update(4, 0);
        assert_eq!(d.get(), 2);
        d.update(2, 1);
        assert_eq!(d.get(), 2);
        d.update(2, 2);
        d.update(4, 4);
        d.update(8, 8);
        assert_eq!(d.get(), 8);
        for _ in 0..5 {
            d.update(1, 0);
        }
        assert_eq!(d.get(), 1);
    }
}
