//! A logits processor that fails on purpose, as the tenant's `mode` config says, after the
//! sequence's third token: `panic`, `spin` (runs past its deadline), `wild-id` (bans a token
//! outside the vocabulary), `reject` (returns a plugin error). Anything else: it never fails.

use std::cell::Cell;

use guest_sdk::logits_processor::{
    config_text, error, Decision, Guest, PluginError, SequenceStart,
};

thread_local! {
    static SEEN: Cell<usize> = const { Cell::new(0) };
}

fn allow_all() -> Decision {
    Decision {
        banned: Vec::new(),
        biases: Vec::new(),
        stop: false,
    }
}

struct Plugin;

impl Guest for Plugin {
    fn start(_request: SequenceStart) -> Result<Decision, PluginError> {
        SEEN.with(|s| s.set(0));
        Ok(allow_all())
    }

    fn step(tokens: Vec<u32>, _text: String) -> Result<Decision, PluginError> {
        let seen = SEEN.with(|s| {
            s.set(s.get() + tokens.len());
            s.get()
        });
        if seen < 3 {
            return Ok(allow_all());
        }
        match config_text("mode").as_deref() {
            Some("panic") => panic!("bad-processor: deliberate panic"),
            Some("spin") => {
                let mut x = 0u64;
                loop {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }
            Some("wild-id") => Ok(Decision {
                banned: vec![u32::MAX - 1],
                ..allow_all()
            }),
            Some("reject") => Err(error("policy", "this sequence is refused")),
            _ => Ok(allow_all()),
        }
    }
}

guest_sdk::export_logits_processor!(Plugin);
