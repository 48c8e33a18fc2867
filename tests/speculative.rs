//! Prompt-lookup speculative decoding over HTTP: the same text with it on and off, greedy and
//! seeded sampling (verification samples each position exactly as plain decoding would), and
//! `/metrics` counting drafts and accepted drafts.

mod support;

use serde_json::{json, Value};
use support::{Server, MODEL};

/// A document the answer copies from: the extraction workload speculation is for.
fn document() -> String {
    let mut t = String::from("Contacts exported from the CRM:\n");
    for (i, n) in ["ada", "bo", "cruz", "dee", "eli", "fay", "gil", "hal"]
        .iter()
        .enumerate()
    {
        t += &format!(
            "- {n} <{n}.{i}@example-corp.com>, account #{}\n",
            7100 + 13 * i
        );
    }
    t + "\nRepeat the contact list above exactly:\n- ada <"
}

fn complete(s: &Server, extra: Value) -> String {
    let mut body =
        json!({"model": MODEL, "prompt": document(), "max_tokens": 96, "ignore_eos": true});
    body.as_object_mut()
        .unwrap()
        .extend(extra.as_object().unwrap().clone());
    let (status, v) = s.post("/v1/completions", &body);
    assert_eq!(status, 200, "{v}");
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

#[test]
fn speculation_changes_speed_not_text() {
    let s = Server::start(&[]);
    let series = |name: &str| format!("{name}{{model=\"{MODEL}\"}}");
    let accepted = || s.metric(&series("gateway_spec_accepted_tokens_total"));
    let drafted = || s.metric(&series("gateway_spec_draft_tokens_total"));

    let plain = complete(&s, json!({"temperature": 0, "speculative": false}));
    assert_eq!(drafted(), 0.0, "speculative: false drafts nothing");
    let fast = complete(&s, json!({"temperature": 0}));
    assert_eq!(fast, plain);
    assert!(
        accepted() > 10.0,
        "the copy was drafted: {} of {}",
        accepted(),
        drafted()
    );
    assert!(accepted() <= drafted());

    for seed in [3, 4] {
        let sampled = json!({"temperature": 0.9, "top_p": 0.95, "seed": seed});
        let mut off = sampled.clone();
        off["speculative"] = json!(false);
        assert_eq!(complete(&s, sampled), complete(&s, off), "seed {seed}");
    }
}
