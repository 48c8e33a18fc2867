//! CRM guardrail, a logits processor: the model never writes a phrase from the tenant's deny
//! list (competitor names, internal project codes), not even one split across tokens.
//!
//! Config: `deny`, a list of phrases (`["Salesforce", "Project X"]`) or one comma-separated
//! text, matched ignoring ASCII case.
//!
//! How: tokens that contain a phrase whole are banned at every step. After each token the
//! plugin keeps the tail of the text; wherever the tail ends with the start of a phrase, the
//! tokens that would complete it (those starting with the rest) are banned for the next step.
//! The host answers "which tokens start with ..." from its vocabulary index, so a step costs a
//! few lookups, not a scan of the vocabulary.

use std::cell::RefCell;
use std::collections::HashMap;

use guest_sdk::logits_processor::{
    self as lp, config_text, tokens_containing, tokens_with_prefix, Decision, Guest, PluginError,
    SequenceStart,
};

/// The sequence's state: one instance serves one sequence.
#[derive(Default)]
pub struct Guard {
    phrases: Vec<String>,
    /// Tokens containing a phrase whole: banned everywhere.
    always: Vec<u32>,
    /// The end of the generated text, lowercased, as long as the longest phrase.
    tail: String,
    completions: HashMap<String, Vec<u32>>,
}

impl Guard {
    /// `containing(phrase)`: the tokens whose text contains `phrase` (ignoring case).
    pub fn new(deny: &str, containing: impl Fn(&str) -> Vec<u32>) -> Self {
        let phrases: Vec<String> = deny
            .split(',')
            .map(|p| p.trim().to_ascii_lowercase())
            .filter(|p| !p.is_empty())
            .collect();
        let mut always: Vec<u32> = phrases.iter().flat_map(|p| containing(p)).collect();
        always.sort_unstable();
        always.dedup();
        Self {
            phrases,
            always,
            ..Self::default()
        }
    }

    /// Appends a generated token's text.
    pub fn push(&mut self, text: &str) {
        self.tail.push_str(&text.to_ascii_lowercase());
        let keep = self.phrases.iter().map(String::len).max().unwrap_or(0);
        if self.tail.len() > keep {
            let mut cut = self.tail.len() - keep;
            while !self.tail.is_char_boundary(cut) {
                cut += 1;
            }
            self.tail.drain(..cut);
        }
    }

    /// The tokens banned next: those containing a phrase, and those completing one that the
    /// tail has begun.
    pub fn banned(&mut self, with_prefix: impl Fn(&str) -> Vec<u32>) -> Vec<u32> {
        let mut banned = self.always.clone();
        for p in &self.phrases {
            for (k, _) in p.char_indices().skip(1) {
                if self.tail.ends_with(&p[..k]) {
                    let rest = &p[k..];
                    let hits = self
                        .completions
                        .entry(rest.to_string())
                        .or_insert_with(|| with_prefix(rest));
                    banned.extend_from_slice(hits);
                }
            }
        }
        banned
    }
}

thread_local! {
    static GUARD: RefCell<Guard> = RefCell::default();
}

fn decision(banned: Vec<u32>) -> Decision {
    Decision {
        banned,
        biases: Vec::new(),
        stop: false,
    }
}

struct Plugin;

impl Guest for Plugin {
    fn start(request: SequenceStart) -> Result<Decision, PluginError> {
        let deny = config_text("deny").unwrap_or_default();
        let mut guard = Guard::new(&deny, |p| tokens_containing(p, true));
        // A completion continues its prompt: "Sales" at the prompt's end must not become
        // "Salesforce" either.
        guard.push(&request.prompt);
        let banned = guard.banned(|p| tokens_with_prefix(p, true));
        GUARD.with(|g| *g.borrow_mut() = guard);
        Ok(decision(banned))
    }

    fn step(tokens: Vec<u32>, _text: String) -> Result<Decision, PluginError> {
        GUARD.with(|g| {
            let mut guard = g.borrow_mut();
            // Token texts rather than the released text: that may lag behind the tokens
            // (held for a stop string or an incomplete character).
            for t in tokens {
                guard.push(&lp::token_text(t));
            }
            Ok(decision(guard.banned(|p| tokens_with_prefix(p, true))))
        })
    }
}

guest_sdk::export_logits_processor!(Plugin);

#[cfg(test)]
mod tests {
    use super::*;

    const VOCAB: &[&str] = &[
        "Our",
        " Sales",
        "force",
        "forces",
        " is",
        " great",
        "Salesforce",
        "fo",
        "rce",
    ];

    fn containing(p: &str) -> Vec<u32> {
        (0..VOCAB.len() as u32)
            .filter(|&i| VOCAB[i as usize].to_ascii_lowercase().contains(p))
            .collect()
    }

    fn with_prefix(p: &str) -> Vec<u32> {
        (0..VOCAB.len() as u32)
            .filter(|&i| VOCAB[i as usize].to_ascii_lowercase().starts_with(p))
            .collect()
    }

    /// The whole plugin, as the gateway calls it, against the SDK's fake host.
    #[test]
    fn the_guest_bans_completions_of_a_begun_phrase() {
        guest_sdk::testing::reset();
        guest_sdk::testing::set_vocabulary(VOCAB);
        guest_sdk::testing::set_config("deny", "Salesforce");
        let start = SequenceStart {
            model: "m".into(),
            prompt: "Who leads CRM?".into(),
            max_tokens: 8,
        };
        assert_eq!(Plugin::start(start).unwrap().banned, [6]);
        let d = Plugin::step(vec![1], " Sales".into()).unwrap();
        let mut banned = d.banned;
        banned.sort();
        assert_eq!(banned, [2, 3, 6]);
    }

    #[test]
    fn a_phrase_is_blocked_whole_and_across_tokens() {
        let mut g = Guard::new(" Salesforce , ", containing);
        assert_eq!(g.banned(with_prefix), [6], "the whole-phrase token, always");
        g.push("Our");
        g.push(" Sales");
        let banned = g.banned(with_prefix);
        assert!(banned.contains(&2) && banned.contains(&3), "{banned:?}");
        // "fo" is allowed (it does not complete the phrase); after it, "rce" is not.
        assert!(!banned.contains(&7));
        g.push("fo");
        assert!(g.banned(with_prefix).contains(&8));
        g.push(" is");
        assert_eq!(g.banned(with_prefix), [6]);
    }
}
