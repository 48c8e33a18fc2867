//! The policy file (`policies.toml`): tenants, their hashed API keys, what they may use and how
//! much. Parsed into typed structs, then checked as a whole; every problem names its field.

use std::collections::{BTreeMap, HashSet};

use serde::Deserialize;

#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Policies {
    #[serde(default)]
    pub tenants: Vec<TenantPolicy>,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TenantPolicy {
    pub name: String,
    /// API keys, stored as SHA-256 hashes (`gateway keys new --tenant T` makes one).
    #[serde(default)]
    pub keys: Vec<KeyPolicy>,
    /// Models the tenant may call; `["*"]` (the default) allows all.
    #[serde(default = "all")]
    pub models: Vec<String>,
    /// The tenant's plugins it may call by name; `["*"]` (the default) allows all of its own.
    #[serde(default = "all")]
    pub plugins: Vec<String>,
    /// Search collections the tenant may use; `["*"]` (the default) allows all of its own.
    #[serde(default = "all")]
    pub collections: Vec<String>,
    /// Plugin bound to the prompt stage of chat completions.
    pub prompt_template: Option<String>,
    /// Plugin that parses output when a request sets `response_format` (or always, with
    /// `parse_output`).
    pub output_parser: Option<String>,
    #[serde(default)]
    pub parse_output: bool,
    /// Requests may send `x-gateway-debug: plugins` to get the model's raw text beside the
    /// parsed output and their plugins' log lines in the response.
    #[serde(default)]
    pub plugin_debug: bool,
    /// Plugin that steers every generated token (bans, biases, stop) of this tenant's
    /// completions.
    pub logits_processor: Option<String>,
    /// Plugin serving `/v1/rerank` when the request names none.
    pub reranker: Option<String>,
    /// Plugin that decides the response cache's key for this tenant's requests (`cache-key`
    /// world).
    pub cache_key: Option<String>,
    pub requests_per_second: Option<u32>,
    pub requests_per_minute: Option<u32>,
    /// Prompt + completion tokens per minute (reserved at admission).
    pub tokens_per_minute: Option<u32>,
    pub token_budget: Option<Budget>,
    /// Requests of this tenant in flight at once.
    pub max_concurrent: Option<u32>,
    /// Share of the engine under contention, relative to other tenants' weights.
    #[serde(default = "one")]
    pub weight: u32,
    /// Values the tenant's plugins read with `config-get`: strings, numbers, booleans or
    /// arrays of strings.
    #[serde(default)]
    pub config: BTreeMap<String, crate::common::ConfigValue>,
    /// Retrieval applied to every chat request that does not set `rag` itself.
    pub rag: Option<crate::search::request::RagSettings>,
    /// The response cache: exact (on by default for deterministic requests) and semantic.
    #[serde(default)]
    pub cache: super::cache_policy::CachePolicy,
}

#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct KeyPolicy {
    /// Names the key in the usage ledger and logs (never the key itself).
    pub id: String,
    /// Lower-case hex SHA-256 of the key.
    pub sha256: String,
    /// Unix seconds after which the key is refused (401); never when unset.
    pub expires_at: Option<i64>,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    pub tokens: u64,
    pub period: Period,
}

#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Period {
    Day,
    Month,
}

impl Period {
    /// The UTC calendar day or month containing `now`, as [start, end) Unix seconds: the
    /// ledger's periods, so a budget counted in Redis and one counted from the ledger agree.
    pub fn bounds(self, now: i64) -> (i64, i64) {
        let day = now.div_euclid(86_400);
        match self {
            Period::Day => (day * 86_400, (day + 1) * 86_400),
            Period::Month => {
                let (y, m, _) = civil_from_days(day);
                let (ny, nm) = if m == 12 { (y + 1, 1) } else { (y, m + 1) };
                (
                    days_from_civil(y, m, 1) * 86_400,
                    days_from_civil(ny, nm, 1) * 86_400,
                )
            }
        }
    }
}

/// Days since 1970-01-01 of a proleptic Gregorian date (H. Hinnant's algorithm).
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let doy = (153 * (m + if m > 2 { -3 } else { 9 }) + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// The date (year, month, day) of a day count since 1970-01-01.
fn civil_from_days(z: i64) -> (i64, i64, i64) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

fn all() -> Vec<String> {
    vec!["*".into()]
}

fn one() -> u32 {
    1
}

/// Everything wrong with a policy file, one line per problem.
#[derive(Debug, thiserror::Error)]
#[error("{}", .0.join("\n"))]
pub struct PolicyError(pub Vec<String>);

impl TenantPolicy {
    /// Each plugin binding (policy field, the plugin kind it needs, the plugin named).
    pub fn plugin_bindings(&self) -> [(&'static str, &'static str, Option<&String>); 5] {
        [
            (
                "prompt_template",
                "prompt-template",
                self.prompt_template.as_ref(),
            ),
            (
                "output_parser",
                "output-parser",
                self.output_parser.as_ref(),
            ),
            ("reranker", "reranker", self.reranker.as_ref()),
            (
                "logits_processor",
                "logits-processor",
                self.logits_processor.as_ref(),
            ),
            ("cache_key", "cache-key", self.cache_key.as_ref()),
        ]
    }
}

impl Policies {
    /// Parses and checks a policy file's text. TOML errors carry line and column.
    pub fn parse(text: &str) -> Result<Self, PolicyError> {
        let p: Policies = toml::from_str(text).map_err(|e| PolicyError(vec![e.to_string()]))?;
        p.validate()?;
        Ok(p)
    }

    fn validate(&self) -> Result<(), PolicyError> {
        let mut problems = Vec::new();
        let mut names = HashSet::new();
        let mut hashes = HashSet::new();
        for (i, t) in self.tenants.iter().enumerate() {
            let at = format!("tenants[{i}] ({:?})", t.name);
            if !crate::common::valid_name(&t.name) {
                problems.push(format!(
                    "{at}.name: use 1 to 64 characters from a-z, 0-9, '-' and '_'"
                ));
            }
            if !names.insert(&t.name) {
                problems.push(format!("{at}.name: tenant configured twice"));
            }
            check_keys(&at, t, &mut hashes, &mut problems);
            for (field, _, v) in t.plugin_bindings() {
                if let Some(p) = v {
                    if !crate::common::valid_name(p) {
                        problems.push(format!("{at}.{field}: {p:?} is not a valid plugin name"));
                    } else if !allows(&t.plugins, p) {
                        problems.push(format!("{at}.{field}: {p:?} is bound but not in `plugins`"));
                    }
                }
            }
            for (field, v) in [
                ("requests_per_second", t.requests_per_second),
                ("requests_per_minute", t.requests_per_minute),
                ("tokens_per_minute", t.tokens_per_minute),
                ("max_concurrent", t.max_concurrent),
            ] {
                if v == Some(0) {
                    problems.push(format!(
                        "{at}.{field}: must be at least 1 (leave it out for no limit)"
                    ));
                }
            }
            if t.weight == 0 {
                problems.push(format!("{at}.weight: must be at least 1"));
            }
            if let Some(r) = &t.rag {
                check_rag(&at, r, &t.collections, &mut problems);
            }
            problems.extend(t.cache.problems(&at));
            if t.token_budget.is_some_and(|b| b.tokens == 0) {
                problems.push(format!("{at}.token_budget.tokens: must be at least 1"));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(PolicyError(problems))
        }
    }
}

/// A tenant's keys: well-formed hashes, none listed twice in the whole policy (`hashes`), ids
/// unique within the tenant.
fn check_keys<'a>(
    at: &str,
    t: &'a TenantPolicy,
    hashes: &mut HashSet<&'a String>,
    problems: &mut Vec<String>,
) {
    let mut ids = HashSet::new();
    for (j, k) in t.keys.iter().enumerate() {
        let hex = |b: u8| b.is_ascii_digit() || (b'a'..=b'f').contains(&b);
        if k.sha256.len() != 64 || !k.sha256.bytes().all(hex) {
            problems.push(format!(
                "{at}.keys[{j}].sha256: expected 64 lower-case hex digits (the SHA-256 of the key)"
            ));
        }
        if !hashes.insert(&k.sha256) {
            problems.push(format!("{at}.keys[{j}].sha256: this key is listed twice"));
        }
        if k.id.is_empty() || !ids.insert(&k.id) {
            problems.push(format!(
                "{at}.keys[{j}].id: must be non-empty and unique within the tenant"
            ));
        }
    }
}

/// A tenant's default retrieval: a collection it may use, a top_k in range, a valid filter.
fn check_rag(
    at: &str,
    r: &crate::search::request::RagSettings,
    collections: &[String],
    problems: &mut Vec<String>,
) {
    use crate::search::request::MAX_RAG_TOP_K;
    if let Err(m) = crate::search::valid_name(&r.collection) {
        problems.push(format!("{at}.rag.collection: {m}"));
    } else if !allows(collections, &r.collection) {
        problems.push(format!(
            "{at}.rag.collection: {:?} is not in `collections`",
            r.collection
        ));
    }
    if !(1..=MAX_RAG_TOP_K).contains(&r.top_k()) {
        problems.push(format!("{at}.rag.top_k: must be 1 to {MAX_RAG_TOP_K}"));
    }
    if let Some(f) = r.filter() {
        if let Err(m) = crate::search::filter::Filter::parse(f) {
            problems.push(format!("{at}.rag.filter: {m}"));
        }
    }
}

/// Whether an allow-list (`["*"]` = everything) holds `name`.
pub fn allows(list: &[String], name: &str) -> bool {
    list.iter().any(|x| x == "*" || x == name)
}

#[cfg(test)]
mod tests {
    #[test]
    fn periods_are_calendar_days_and_months() {
        // 2024-02-29 12:00 UTC: a leap day.
        let now = 1_709_208_000;
        assert_eq!(Period::Day.bounds(now), (1_709_164_800, 1_709_251_200));
        // 2024-02-01 .. 2024-03-01.
        assert_eq!(Period::Month.bounds(now), (1_706_745_600, 1_709_251_200));
        // December rolls into January: 2023-12-31 23:59:59.
        assert_eq!(
            Period::Month.bounds(1_704_067_199),
            (1_701_388_800, 1_704_067_200)
        );
    }

    use super::*;

    #[test]
    fn defaults_and_limits_parse() {
        let p = Policies::parse(
            r#"
            [[tenants]]
            name = "acme"
            requests_per_second = 5
            token_budget = { tokens = 1000, period = "day" }
            keys = [{ id = "prod", sha256 = "2c26b46b68ffc68ff99b453c1d30413413422d706483bfa0f98a5e886266e7ae" }]
            "#,
        )
        .unwrap();
        let t = &p.tenants[0];
        assert_eq!(t.models, ["*"]);
        assert_eq!(t.weight, 1);
        assert_eq!(
            t.token_budget,
            Some(Budget {
                tokens: 1000,
                period: Period::Day
            })
        );
    }

    #[test]
    fn every_problem_is_named() {
        let err = Policies::parse(
            r#"
            [[tenants]]
            name = "acme"
            max_concurrent = 0
            plugins = ["a"]
            reranker = "b"
            cache_key = "c"
            keys = [{ id = "k", sha256 = "XYZ" }]
            [[tenants]]
            name = "acme"
            "#,
        )
        .unwrap_err()
        .to_string();
        for want in [
            "keys[0].sha256",
            "reranker: \"b\" is bound but not in `plugins`",
            "cache_key: \"c\" is bound but not in `plugins`",
            "max_concurrent",
            "tenants[1] (\"acme\").name: tenant configured twice",
        ] {
            assert!(err.contains(want), "{want} not in:\n{err}");
        }
        let err = Policies::parse("[[tenants]]\nname = \"a\"\nweigth = 2\n")
            .unwrap_err()
            .to_string();
        assert!(err.contains("line 3") && err.contains("weigth"), "{err}");
    }
}
