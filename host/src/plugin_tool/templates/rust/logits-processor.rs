//! {{name}}: a logits processor. The model never writes a token containing one of the words
//! in config `deny` (a list, or one comma-separated text; any case). One instance serves one
//! sequence, so the banned list is computed once, at its start.

use std::cell::RefCell;

use guest_sdk::logits_processor::{
    config, tokens_containing, Decision, Guest, PluginError, SequenceStart, Value,
};

thread_local! {
    static BANNED: RefCell<Vec<u32>> = const { RefCell::new(Vec::new()) };
}

struct Plugin;

fn decision() -> Decision {
    Decision { banned: BANNED.with(|b| b.borrow().clone()), biases: vec![], stop: false }
}

impl Guest for Plugin {
    fn start(_request: SequenceStart) -> Result<Decision, PluginError> {
        let deny: Vec<String> = match config("deny") {
            Some(Value::TextList(words)) => words,
            Some(other) => other.to_text().split(',').map(String::from).collect(),
            None => Vec::new(),
        };
        let mut banned: Vec<u32> = deny
            .iter()
            .map(|w| w.trim())
            .filter(|w| !w.is_empty())
            .flat_map(|w| tokens_containing(w, true))
            .collect();
        banned.sort_unstable();
        banned.dedup();
        BANNED.with(|b| *b.borrow_mut() = banned);
        Ok(decision())
    }

    fn step(_tokens: Vec<u32>, _text: String) -> Result<Decision, PluginError> {
        Ok(decision())
    }
}

guest_sdk::export_logits_processor!(Plugin);

#[cfg(test)]
mod tests {
    use super::*;
    use guest_sdk::testing;

    #[test]
    fn denied_words_are_banned() {
        testing::reset();
        testing::set_config("deny", "acme");
        testing::set_vocabulary(&["hello", " Acme", "acmeCorp", "world"]);
        let start = SequenceStart { model: "m".into(), prompt: "p".into(), max_tokens: 8 };
        assert_eq!(Plugin::start(start).unwrap().banned, vec![1, 2]);
        assert_eq!(Plugin::step(vec![0], "hello".into()).unwrap().banned, vec![1, 2]);
    }
}
