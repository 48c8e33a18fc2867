//! {{name}}: a reranker. Scores each candidate by the share of the query's words it contains,
//! times a boost for candidates whose metadata field `tier` equals config `boost_tier`.

use guest_sdk::reranker::{config, error, Candidate, Guest, PluginError, Scored, Value};

struct Plugin;

fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

impl Guest for Plugin {
    fn rerank(query: String, candidates: Vec<Candidate>) -> Result<Vec<Scored>, PluginError> {
        let terms = words(&query);
        if terms.is_empty() {
            return Err(error("invalid-input", "the query has no words"));
        }
        let boost_tier = config("boost_tier");
        Ok(candidates
            .into_iter()
            .map(|c| {
                let have = words(&c.text);
                let hits = terms.iter().filter(|t| have.contains(t)).count();
                let mut score = hits as f32 / terms.len() as f32;
                // Metadata and config values keep their type (`Value::Text`, `Value::TextList`,
                // `Value::Number`, `Value::Boolean`).
                if boost_tier.is_some() && c.field("tier") == boost_tier.as_ref() {
                    score *= 1.5;
                }
                Scored { id: c.id, score }
            })
            .collect())
    }
}

guest_sdk::export_reranker!(Plugin);

#[cfg(test)]
mod tests {
    use super::*;
    use guest_sdk::testing;

    fn candidate(id: &str, text: &str, tier: &str) -> Candidate {
        Candidate {
            id: id.into(),
            document_id: None,
            text: text.into(),
            metadata: vec![("tier".into(), Value::Text(tier.into()))],
            score: 0.0,
        }
    }

    #[test]
    fn overlap_and_boost_decide() {
        testing::reset();
        testing::set_config("boost_tier", "enterprise");
        let out = Plugin::rerank(
            "export invoices".into(),
            vec![
                candidate("a", "How to export invoices", "free"),
                candidate("b", "Export invoices as CSV", "enterprise"),
                candidate("c", "Reset a password", "enterprise"),
            ],
        )
        .unwrap();
        let score = |id: &str| out.iter().find(|s| s.id == id).unwrap().score;
        assert!(score("b") > score("a") && score("a") > score("c"));
    }
}
