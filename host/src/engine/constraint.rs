//! Constrained decoding with llguidance: the model's vocabulary as a token trie, grammars
//! (JSON schema, regex, Lark) compiled once and cached, and per sequence a matcher that masks
//! every sampled token and names the tokens the grammar forces.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory, TokenParser};
use parking_lot::Mutex;
use tokenizers::Tokenizer;

use super::tokenizer::token_bytes;
use super::ModelError;
use crate::metrics::GrammarMetrics;

/// Compiled grammars kept per model; the least recently used goes first. A compiled grammar
/// of a large schema holds megabytes of lexer state, so the cache stays small.
const CACHE_ENTRIES: usize = 64;

/// Why a grammar was refused: the message names what is wrong (an unsupported JSON-schema
/// keyword, a bad regex), for the client's 400.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

/// A compiled grammar, fresh (no token consumed). Cloning gives an independent parser, so
/// each choice of a request gets its own state. Boxed: a parser is over a kilobyte, and it
/// travels inside every request.
pub struct Constraint(Box<TokenParser>);

impl Clone for Constraint {
    fn clone(&self) -> Self {
        Self(Box::new(self.0.deep_clone()))
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

/// The vocabulary as llguidance sees it: each token's bytes (special tokens behind a marker
/// byte, so no grammar literal can produce them) and the tokenizer for literal strings.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            self.tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

/// Bytes of every row of the logits: special tokens by their name behind the marker, the rest
/// as the tokenizer spells them; rows past the tokenizer are unnamed specials.
fn vocabulary_bytes(tok: &Tokenizer, rows: usize) -> Vec<Vec<u8>> {
    let special = |name: &str| {
        let mut b = vec![TokTrie::SPECIAL_TOKEN_MARKER];
        b.extend_from_slice(name.as_bytes());
        b
    };
    (0..rows as u32)
        .map(|id| match tok.id_to_token(id) {
            Some(raw) if tok.get_added_vocabulary().is_special_token(&raw) => special(&raw),
            Some(_) => token_bytes(tok, id),
            None => special(&format!("<[{id}]>")),
        })
        .collect()
}

/// One model's grammar compiler and cache.
pub struct Grammars {
    factory: ParserFactory,
    cache: Mutex<Cache>,
    model: String,
    metrics: Arc<crate::metrics::Metrics>,
}

#[derive(Default)]
struct Cache {
    entries: HashMap<String, (TokenParser, u64)>,
    tick: u64,
}

impl Grammars {
    pub fn new(
        tokenizer: &Tokenizer,
        rows: usize,
        eos_ids: &[u32],
        model: &str,
        metrics: Arc<crate::metrics::Metrics>,
    ) -> Result<Self, ModelError> {
        let words = vocabulary_bytes(tokenizer, rows);
        let eos = eos_ids.first().copied().unwrap_or(0);
        let mut trie = TokTrie::from(&TokRxInfo::new(rows as u32, eos), &words);
        if eos_ids.len() > 1 {
            trie = trie.with_eos_tokens(eos_ids);
        }
        let env: TokEnv = Arc::new(Vocabulary {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| ModelError::Tokenizer(format!("grammar vocabulary: {e}")))?;
        factory.quiet();
        // Each sequence's parser grows its own lexer states (1-2 kB each) as it generates:
        // a fifth of llguidance's default bounds a hostile regex at tens of megabytes per
        // sequence. Errors without the parser's state dump, which is not for clients.
        *factory.limits_mut() = ParserLimits {
            max_lexer_states: 50_000,
            verbose_errors: false,
            ..ParserLimits::default()
        };
        Ok(Self {
            factory,
            cache: Mutex::new(Cache::default()),
            model: model.to_string(),
            metrics,
        })
    }

    fn metrics(&self) -> &GrammarMetrics {
        &self.metrics.grammar
    }

    /// The constraint for `grammar`: from the cache, or compiled (which may take milliseconds;
    /// call it off the async runtime).
    pub fn compile(&self, grammar: &TopLevelGrammar) -> Result<Constraint, GrammarError> {
        let key = serde_json::to_string(grammar).map_err(|e| GrammarError(e.to_string()))?;
        let hit = {
            let mut c = self.cache.lock();
            c.tick += 1;
            let tick = c.tick;
            c.entries.get_mut(&key).map(|(p, used)| {
                *used = tick;
                p.deep_clone()
            })
        };
        let result = |r: &str| self.metrics().cache.with_label_values(&[&self.model, r]);
        if let Some(parser) = hit {
            result("hit").inc();
            return Ok(Constraint(Box::new(parser)));
        }
        result("miss").inc();
        let started = Instant::now();
        let parser = self
            .factory
            .create_parser(grammar.clone())
            .map_err(|e| GrammarError(first_line(&e.to_string())))?;
        // Some grammars compile but cannot produce a first token (a `$ref` cycle, a rule past
        // the parser's limits): found here, they are the client's 400, not a failure midway.
        let mut probe = Matcher::new(Ok(parser.deep_clone()));
        match probe.compute_mask() {
            Ok(m) if !m.is_zero() => {}
            Ok(_) => return Err(GrammarError("the grammar allows no output at all".into())),
            Err(e) => return Err(GrammarError(first_line(&e.to_string()))),
        }
        self.metrics()
            .compile_seconds
            .with_label_values(&[&self.model])
            .observe(started.elapsed().as_secs_f64());
        let mut c = self.cache.lock();
        if c.entries.len() >= CACHE_ENTRIES {
            let oldest = c.entries.iter().min_by_key(|(_, (_, used))| *used);
            if let Some(k) = oldest.map(|(k, _)| k.clone()) {
                c.entries.remove(&k);
            }
        }
        let tick = c.tick;
        c.entries.insert(key, (parser.deep_clone(), tick));
        Ok(Constraint(Box::new(parser)))
    }
}

/// llguidance errors may carry a dump of the parser's state after the first line.
fn first_line(e: &str) -> String {
    e.lines().next().unwrap_or_default().trim().to_string()
}

/// A sequence's grammar state: the mask for its next token (computed ahead, while the forward
/// pass runs) and the tokens consumed so far.
pub(super) struct Guide {
    matcher: Matcher,
    mask: Option<Result<SimpleVob, String>>,
}

impl Guide {
    pub(super) fn new(c: Constraint) -> Self {
        Self {
            matcher: Matcher::new(Ok(*c.0)),
            mask: None,
        }
    }

    /// Computes the next token's mask unless it is ready; the seconds it took, if it ran.
    pub(super) fn prepare(&mut self) -> Option<f64> {
        if self.mask.is_some() {
            return None;
        }
        let started = Instant::now();
        self.mask = Some(
            self.matcher
                .compute_mask()
                .map_err(|e| first_line(&e.to_string())),
        );
        Some(started.elapsed().as_secs_f64())
    }

    /// Sets every token the grammar does not allow next to -inf.
    pub(super) fn apply(&mut self, logits: &mut [f32]) -> Result<(), String> {
        self.prepare();
        let mask = self.mask.take().expect("prepared")?;
        if mask.is_zero() {
            return Err("the grammar allows no next token".into());
        }
        mask.iter_unset_entries(|i| {
            if let Some(l) = logits.get_mut(i) {
                *l = f32::NEG_INFINITY;
            }
        });
        Ok(())
    }

    pub(super) fn commit(&mut self, token: u32) -> Result<(), String> {
        self.mask = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| first_line(&e.to_string()))
    }

    /// Tokens the grammar allows no alternative to from here (e.g. the rest of a key name).
    pub(super) fn forced(&mut self) -> Vec<u32> {
        if self.matcher.is_stopped() {
            return Vec::new();
        }
        self.matcher.compute_ff_tokens()
    }

    /// The grammar is complete and allows nothing more.
    pub(super) fn finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A byte-level vocabulary of single characters plus a few words, enough to drive a JSON
    /// grammar without a model file.
    fn tiny_tokenizer() -> Tokenizer {
        let mut vocab = serde_json::Map::new();
        let mut words: Vec<String> = (b' '..=b'~').map(|b| (b as char).to_string()).collect();
        words.extend(["true".into(), "false".into(), "\"name\"".into()]);
        for (i, w) in words.iter().enumerate() {
            vocab.insert(w.replace(' ', "Ġ"), json!(i));
        }
        let spec = json!({
            "version": "1.0",
            "added_tokens": [{"id": words.len(), "content": "<|eos|>", "single_word": false,
                "lstrip": false, "rstrip": false, "normalized": false, "special": true}],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "vocab": vocab, "merges": []}
        });
        spec.to_string().parse().unwrap()
    }

    fn grammars() -> (Grammars, u32) {
        let tok = tiny_tokenizer();
        let eos = tok.token_to_id("<|eos|>").unwrap();
        let rows = eos as usize + 1;
        let m = Arc::new(crate::metrics::Metrics::new());
        (Grammars::new(&tok, rows, &[eos], "t", m).unwrap(), eos)
    }

    #[test]
    fn masks_follow_the_schema_and_end_at_its_close() {
        let (g, eos) = grammars();
        let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"], "additionalProperties": false,
            "x-guidance": {"whitespace_flexible": false}});
        let c = g
            .compile(&TopLevelGrammar::from_json_schema(schema.clone()))
            .unwrap();
        let mut guide = Guide::new(c);
        let tok = tiny_tokenizer();
        let mut text = String::new();
        for _ in 0..20 {
            if guide.finished() {
                break;
            }
            // "Sampling" picks the allowed token with the highest id: never a valid JSON
            // answer by accident.
            let mut logits: Vec<f32> = (0..=eos).map(|i| i as f32).collect();
            guide.apply(&mut logits).unwrap();
            let t = crate::engine::sampler::argmax(&logits);
            if t == eos {
                break;
            }
            guide.commit(t).unwrap();
            text.push_str(&tok.decode(&[t], false).unwrap());
        }
        let v: serde_json::Value = serde_json::from_str(&text).expect(&text);
        assert!(v["ok"].is_boolean(), "{text}");
        assert!(g
            .compile(&TopLevelGrammar::from_json_schema(schema))
            .is_ok());
        let m = &g.metrics.grammar.cache;
        assert_eq!(m.with_label_values(&["t", "hit"]).get(), 1);
        assert_eq!(m.with_label_values(&["t", "miss"]).get(), 1);
    }

    #[test]
    fn added_tokens_are_their_text_and_specials_are_marked() {
        let mut tok = tiny_tokenizer();
        tok.add_tokens([tokenizers::AddedToken::from("<a b>", false)])
            .unwrap();
        let plain = tok.token_to_id("<a b>").unwrap();
        let eos = tok.token_to_id("<|eos|>").unwrap();
        let rows = vocabulary_bytes(&tok, plain as usize + 2);
        assert_eq!(rows[plain as usize], b"<a b>");
        assert_eq!(rows[eos as usize][0], TokTrie::SPECIAL_TOKEN_MARKER);
        assert_eq!(&rows[eos as usize][1..], b"<|eos|>");
        assert_eq!(rows[tok.token_to_id("\u{120}").unwrap() as usize], b" ");
        assert_eq!(rows[plain as usize + 1][0], TokTrie::SPECIAL_TOKEN_MARKER);
    }

    #[test]
    fn grammars_that_cannot_start_are_refused_at_compile() {
        let (g, _) = grammars();
        let cycle = json!({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}});
        let err = g
            .compile(&TopLevelGrammar::from_json_schema(cycle))
            .unwrap_err();
        assert!(!err.0.contains('\n'), "{err}");
    }

    #[test]
    fn unsupported_keywords_are_named() {
        let (g, _) = grammars();
        let schema = json!({"type": "object", "if": {"type": "object"}});
        let err = g
            .compile(&TopLevelGrammar::from_json_schema(schema))
            .unwrap_err();
        assert!(err.0.contains("\"if\""), "{err}");
    }
}
