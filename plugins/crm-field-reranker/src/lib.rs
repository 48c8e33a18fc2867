//! Reranker for CRM records: scores each candidate by how many of the query's terms it
//! contains, then applies the tenant's metadata boosts and a recency decay.
//!
//! Tenant configuration:
//! - `boosts`: `field=value:factor` rules, a list (`["tier=enterprise:1.5", "status=open:1.2"]`)
//!   or one comma-separated text; a candidate matching several rules gets their product. A
//!   list field (`tags = ["vip", "emea"]`) matches when any of its items does;
//! - `recency_field`: a metadata field holding a date (`YYYY-MM-DD...`) or Unix seconds;
//! - `recency_half_life_days`: a candidate this many days older than the newest one in the set
//!   gets half the boost (default 30). Relative to the newest candidate, so no clock is needed
//!   and the same input always ranks the same way.

use guest_sdk::reranker::{error, Candidate, Guest, PluginError, Scored, Value};

struct Plugin;

impl Guest for Plugin {
    fn rerank(query: String, candidates: Vec<Candidate>) -> Result<Vec<Scored>, PluginError> {
        rerank(&query, candidates, &guest_sdk::reranker::config)
    }
}

guest_sdk::export_reranker!(Plugin);

const STOP_WORDS: &[&str] = &[
    "a", "an", "and", "are", "as", "at", "be", "by", "do", "does", "for", "from", "how", "i", "in",
    "is", "it", "my", "of", "on", "or", "the", "to", "what", "when", "where", "which", "why",
    "with",
];

/// The reranker's logic, with configuration passed in so it also runs natively.
pub fn rerank(
    query: &str,
    candidates: Vec<Candidate>,
    config: &dyn Fn(&str) -> Option<Value>,
) -> Result<Vec<Scored>, PluginError> {
    let rules: Vec<String> = match config("boosts") {
        None => Vec::new(),
        Some(Value::TextList(rules)) => rules,
        Some(other) => other.to_text().split(',').map(String::from).collect(),
    };
    let boosts = parse_boosts(&rules)?;
    let terms = terms(query);
    if terms.is_empty() {
        return Err(error("invalid-input", "the query has no searchable terms"));
    }
    let recency = match config("recency_field") {
        Some(field) => {
            let field = field.to_text();
            let half_life = match config("recency_half_life_days") {
                Some(v) => number(&v).filter(|h| *h > 0.0).ok_or_else(|| {
                    error(
                        "invalid-config",
                        format!(
                            "recency_half_life_days {:?} is not a positive number",
                            v.to_text()
                        ),
                    )
                })? as f32,
                None => 30.0,
            };
            Some((field, half_life))
        }
        None => None,
    };
    let ages: Vec<Option<f32>> = candidates
        .iter()
        .map(|c| {
            recency
                .as_ref()
                .and_then(|(field, _)| c.field(field))
                .and_then(days)
        })
        .collect();
    let newest = ages
        .iter()
        .flatten()
        .copied()
        .fold(f32::NEG_INFINITY, f32::max);

    Ok(candidates
        .iter()
        .zip(&ages)
        .map(|(c, age)| {
            let words = terms_set(&c.text);
            let matched = terms.iter().filter(|t| words.contains(t.as_str())).count();
            let mut score = matched as f32 / terms.len() as f32;
            for (field, value, factor) in &boosts {
                if c.field(field).is_some_and(|v| matches(v, value)) {
                    score *= factor;
                }
            }
            if let (Some((_, half_life)), Some(day)) = (&recency, age) {
                score *= 0.5f32.powf((newest - day) / half_life);
            }
            Scored {
                id: c.id.clone(),
                score,
            }
        })
        .collect())
}

fn parse_boosts(rules: &[String]) -> Result<Vec<(String, String, f32)>, PluginError> {
    rules
        .iter()
        .map(|r| r.trim())
        .filter(|r| !r.is_empty())
        .map(|rule| {
            let bad = || {
                error(
                    "invalid-config",
                    format!("boost rule {rule:?} is not field=value:factor"),
                )
            };
            let (field, rest) = rule.split_once('=').ok_or_else(bad)?;
            let (value, factor) = rest.rsplit_once(':').ok_or_else(bad)?;
            let factor: f32 = factor.trim().parse().map_err(|_| bad())?;
            Ok((field.trim().to_string(), value.trim().to_string(), factor))
        })
        .collect()
}

/// Whether a metadata value is `wanted` (any case); a list matches when one of its items does.
fn matches(v: &Value, wanted: &str) -> bool {
    match v {
        Value::TextList(items) => items.iter().any(|i| i.eq_ignore_ascii_case(wanted)),
        other => other.to_text().eq_ignore_ascii_case(wanted),
    }
}

/// A number, or text that spells one.
fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => Some(*n),
        Value::Text(t) => t.trim().parse().ok(),
        _ => None,
    }
}

/// Days since the Unix epoch of a `YYYY-MM-DD` prefix or a Unix-seconds value.
fn days(value: &Value) -> Option<f32> {
    if let Some(secs) = number(value) {
        return Some((secs / 86_400.0) as f32);
    }
    let value = value.as_str()?;
    let date = value.get(..10)?;
    let mut parts = date.split('-');
    let (y, m, d): (i64, i64, i64) = (
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
        parts.next()?.parse().ok()?,
    );
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    // Days from civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * ((m + 9) % 12) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Some((era * 146_097 + doe - 719_468) as f32)
}

fn normalize(word: &str) -> String {
    let w = word.to_lowercase();
    // Plural folding is enough to match "invoices" with "invoice" in CRM records.
    match w.strip_suffix('s') {
        Some(stem) if stem.len() > 2 && !stem.ends_with('s') => stem.to_string(),
        _ => w,
    }
}

fn words(text: &str) -> impl Iterator<Item = &str> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
}

fn terms(query: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for w in words(query).filter(|w| !STOP_WORDS.contains(&w.to_lowercase().as_str())) {
        let t = normalize(w);
        if !out.contains(&t) {
            out.push(t);
        }
    }
    out
}

fn terms_set(text: &str) -> std::collections::HashSet<String> {
    words(text).map(normalize).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(t: &str) -> Value {
        Value::Text(t.into())
    }

    fn cand(id: &str, text: &str, meta: &[(&str, Value)]) -> Candidate {
        Candidate {
            id: id.into(),
            document_id: None,
            text: text.into(),
            metadata: meta
                .iter()
                .map(|(k, v)| (k.to_string(), v.clone()))
                .collect(),
            score: 0.0,
        }
    }

    #[test]
    fn overlap_boosts_and_recency_combine() {
        let config = |k: &str| match k {
            "boosts" => Some(Value::TextList(vec!["tier=enterprise:1.5".into()])),
            "recency_field" => Some(text("updated")),
            "recency_half_life_days" => Some(Value::Number(10.0)),
            _ => None,
        };
        let out = rerank(
            "How do I export invoices?",
            vec![
                cand(
                    "a",
                    "Export your invoice as PDF",
                    &[("tier", text("free")), ("updated", text("2024-03-11"))],
                ),
                cand(
                    "b",
                    "Export settings",
                    &[
                        ("tier", text("Enterprise")),
                        ("updated", text("2024-03-01")),
                    ],
                ),
                cand("c", "Unrelated", &[]),
            ],
            &config,
        )
        .unwrap();
        assert_eq!(out[0].score, 1.0);
        // Half the terms, ×1.5 for the tier, ×0.5 for being one half-life older.
        assert!((out[1].score - 0.375).abs() < 1e-6, "{}", out[1].score);
        assert_eq!(out[2].score, 0.0);
    }

    #[test]
    fn list_fields_and_text_rules_match() {
        let config = |k: &str| (k == "boosts").then(|| text("tags=vip:2, tier=gold:3"));
        let tags = Value::TextList(vec!["emea".into(), "VIP".into()]);
        let out = rerank(
            "export",
            vec![
                cand("a", "export", &[("tags", tags)]),
                cand("b", "export", &[]),
            ],
            &config,
        )
        .unwrap();
        assert_eq!((out[0].score, out[1].score), (2.0, 1.0));
    }

    #[test]
    fn bad_boost_rule_is_a_config_error() {
        let config = |k: &str| (k == "boosts").then(|| text("tier-enterprise"));
        let err = rerank("export", vec![cand("a", "x", &[])], &config).unwrap_err();
        assert_eq!(err.code, "invalid-config");
    }

    #[test]
    fn civil_days() {
        assert_eq!(days(&text("1970-01-01")), Some(0.0));
        assert_eq!(days(&text("2000-03-01T10:00:00Z")), Some(11_017.0));
        assert_eq!(days(&text("86400")), Some(1.0));
        assert_eq!(days(&Value::Number(86_400.0)), Some(1.0));
        assert_eq!(days(&text("yesterday")), None);
    }
}
