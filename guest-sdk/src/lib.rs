//! Write plugins for the gateway: prompt templates, rerankers, output parsers, logits
//! processors and cache keys that run inside the gateway's request path as sandboxed WebAssembly components.
//!
//! A plugin is a `cdylib` crate that depends on this one, implements the `Guest` trait of one
//! world and exports it with that world's macro. Build it with
//! `cargo build --target wasm32-wasip2 --release`; the `.wasm` file is the component to
//! deploy. See the crate README for the ten-minute walkthrough.
//!
//! | kind | module | trait to implement | export macro |
//! |------|--------|--------------------|--------------|
//! | prompt template | [`prompt_template`] | `prompt_template::Guest` | [`export_prompt_template!`] |
//! | reranker | [`reranker`] | `reranker::Guest` | [`export_reranker!`] |
//! | output parser | [`output_parser`] | `output_parser::Guest` | [`export_output_parser!`] |
//! | logits processor | [`logits_processor`] | `logits_processor::Guest` | [`export_logits_processor!`] |
//! | cache key | [`cache_key`] | `cache_key::Guest` | [`export_cache_key!`] |
//!
//! # A prompt template
//! ```no_run
//! use guest_sdk::prompt_template::{ChatRequest, Guest, Message, PluginError, RenderedPrompt};
//!
//! struct Persona;
//!
//! impl Guest for Persona {
//!     fn render(request: ChatRequest) -> Result<RenderedPrompt, PluginError> {
//!         let persona = guest_sdk::prompt_template::config_text("persona")
//!             .unwrap_or_else(|| "You are a helpful CRM assistant.".into());
//!         let mut messages = vec![Message { role: "system".into(), content: persona, name: None }];
//!         messages.extend(request.messages.into_iter().filter(|m| m.role != "system"));
//!         Ok(RenderedPrompt::Messages(messages))
//!     }
//! }
//!
//! guest_sdk::export_prompt_template!(Persona);
//! ```
//!
//! # A reranker
//! ```no_run
//! use guest_sdk::reranker::{Candidate, Guest, PluginError, Scored};
//!
//! struct ShortAndVip;
//!
//! impl Guest for ShortAndVip {
//!     fn rerank(_query: String, candidates: Vec<Candidate>) -> Result<Vec<Scored>, PluginError> {
//!         // Shorter passages first, doubled for documents tagged `vip` (metadata values keep
//!         // their type: `tags` is a list, `priority` a number).
//!         Ok(candidates
//!             .into_iter()
//!             .map(|c| {
//!                 let vip = c.field("tags").and_then(|t| t.as_list()).is_some_and(|t| t.iter().any(|t| t == "vip"));
//!                 let boost = if vip { 2.0 } else { 1.0 };
//!                 Scored { score: boost / (1.0 + c.text.len() as f32), id: c.id }
//!             })
//!             .collect())
//!     }
//! }
//!
//! guest_sdk::export_reranker!(ShortAndVip);
//! ```
//!
//! # An output parser
//! ```no_run
//! use guest_sdk::output_parser::{Guest, Parsed, PluginError};
//!
//! struct Strict;
//!
//! impl Guest for Strict {
//!     fn parse(text: String, _schema: Option<String>) -> Result<Parsed, PluginError> {
//!         let value: serde_json::Value = guest_sdk::output_parser::from_json(text.trim())?;
//!         Ok(Parsed { json: value.to_string(), repairs: Vec::new() })
//!     }
//! }
//!
//! guest_sdk::export_output_parser!(Strict);
//! ```
//!
//! # A logits processor
//! One instance per generated sequence: keep the sequence's state in a `static`. Ask the
//! host's vocabulary which tokens spell what ([`logits_processor::tokens_with_prefix`]), never
//! walk the vocabulary yourself; return short ban lists, not masks.
//! ```no_run
//! use guest_sdk::logits_processor::{Decision, Guest, PluginError, SequenceStart};
//!
//! struct NoShouting;
//!
//! impl Guest for NoShouting {
//!     fn start(_request: SequenceStart) -> Result<Decision, PluginError> {
//!         Ok(Decision { banned: guest_sdk::logits_processor::tokens_containing("!!", false), biases: vec![], stop: false })
//!     }
//!     fn step(_tokens: Vec<u32>, _text: String) -> Result<Decision, PluginError> {
//!         Self::start(SequenceStart { model: String::new(), prompt: String::new(), max_tokens: 0 })
//!     }
//! }
//!
//! guest_sdk::export_logits_processor!(NoShouting);
//! ```

//!
//! # A cache key
//! The text the tenant's response cache keys a request on, or `None` to leave it uncached.
//! ```no_run
//! use guest_sdk::cache_key::{CacheRequest, Guest, PluginError};
//!
//! struct LastUserMessage;
//!
//! impl Guest for LastUserMessage {
//!     fn key(request: CacheRequest) -> Result<Option<String>, PluginError> {
//!         // Requests asking for the same thing of the same model share an answer, whatever
//!         // the conversation before; anything about "today" is never cached.
//!         let Some(last) = request.messages.iter().rev().find(|m| m.role == "user") else {
//!             return Ok(None);
//!         };
//!         if last.content.to_lowercase().contains("today") {
//!             return Ok(None);
//!         }
//!         Ok(Some(format!("{}\n{}", request.parameters, last.content.trim())))
//!     }
//! }
//!
//! guest_sdk::export_cache_key!(LastUserMessage);
//! ```

/// Helpers every world module gets, bound to that world's own generated `host` import. Built
/// for anything but WebAssembly (a plugin's own `cargo test`), they read and write
/// [`testing`]'s fake host instead, so a `Guest` impl runs natively.
macro_rules! helpers {
    () => {
        pub use self::gateway::plugins::types::Value;
        helpers!(with_value);
    };
    // A world that names `value` itself (the reranker) already has it in scope.
    (with_value) => {
        pub use self::gateway::plugins::host::LogLevel;

        /// The tenant's configuration value for `key`, as set by the platform admin, with the
        /// type the policy gave it (`factor = 1.5` is a number, `tags = ["a"]` a text list).
        pub fn config(key: &str) -> Option<Value> {
            #[cfg(target_arch = "wasm32")]
            return self::gateway::plugins::host::config_get(key);
            #[cfg(not(target_arch = "wasm32"))]
            return $crate::testing::config(key).map(|v| match v {
                $crate::testing::Value::Text(t) => Value::Text(t),
                $crate::testing::Value::Number(n) => Value::Number(n),
                $crate::testing::Value::Boolean(b) => Value::Boolean(b),
                $crate::testing::Value::TextList(l) => Value::TextList(l),
            });
        }

        /// The tenant's configuration value for `key` as text, whatever its type
        /// ([`Value::to_text`]): for values that are text in every sensible policy.
        pub fn config_text(key: &str) -> Option<String> {
            config(key).map(|v| v.to_text())
        }

        impl Value {
            /// The text, if this is a `text` value.
            pub fn as_str(&self) -> Option<&str> {
                match self {
                    Value::Text(t) => Some(t),
                    _ => None,
                }
            }

            /// The number, if this is a `number` value.
            pub fn as_number(&self) -> Option<f64> {
                match self {
                    Value::Number(n) => Some(*n),
                    _ => None,
                }
            }

            /// The flag, if this is a `boolean` value.
            pub fn as_bool(&self) -> Option<bool> {
                match self {
                    Value::Boolean(b) => Some(*b),
                    _ => None,
                }
            }

            /// The items, if this is a `text-list` value.
            pub fn as_list(&self) -> Option<&[String]> {
                match self {
                    Value::TextList(l) => Some(l),
                    _ => None,
                }
            }

            /// The value as text: text as is, numbers and booleans as their shortest text
            /// (`3`, `1.5`, `true`), lists joined with commas (what 0.1.0 plugins were given).
            pub fn to_text(&self) -> String {
                match self {
                    Value::Text(t) => t.clone(),
                    Value::Number(n) => n.to_string(),
                    Value::Boolean(b) => b.to_string(),
                    Value::TextList(l) => l.join(","),
                }
            }
        }

        /// Writes `message` to the gateway log, tagged with tenant and plugin.
        pub fn log(level: LogLevel, message: &str) {
            #[cfg(target_arch = "wasm32")]
            self::gateway::plugins::host::log(level, message);
            #[cfg(not(target_arch = "wasm32"))]
            $crate::testing::log(
                format!("{level:?}").trim_start_matches("LogLevel::"),
                message,
            );
        }

        /// A plugin error with a machine-readable `code` and a message for the client.
        pub fn error(code: &str, message: impl Into<String>) -> PluginError {
            PluginError {
                code: code.into(),
                message: message.into(),
            }
        }

        /// Parses JSON text, mapping failures to an `invalid-json` plugin error.
        pub fn from_json<T: ::serde::de::DeserializeOwned>(text: &str) -> Result<T, PluginError> {
            ::serde_json::from_str(text).map_err(|e| error("invalid-json", e.to_string()))
        }
    };
}

/// A fake host for running a plugin's `Guest` impl natively in its own tests: configuration
/// values, captured log lines and (for logits processors) a vocabulary, per test thread.
///
/// ```
/// use guest_sdk::prompt_template::{config, config_text, Value};
/// guest_sdk::testing::set_config("persona", "You are Ava.");
/// guest_sdk::testing::set_config("max_facts", 3);
/// assert_eq!(config_text("persona").as_deref(), Some("You are Ava."));
/// assert_eq!(config("max_facts"), Some(Value::Number(3.0)));
/// guest_sdk::prompt_template::log(guest_sdk::prompt_template::LogLevel::Info, "hello");
/// assert_eq!(guest_sdk::testing::logs(), ["Info: hello"]);
/// ```
pub mod testing {
    use std::cell::RefCell;
    use std::collections::BTreeMap;

    /// A configuration value, as a policy gives it; converted to the world's own `Value`.
    #[derive(Debug, Clone, PartialEq)]
    pub enum Value {
        Text(String),
        Number(f64),
        Boolean(bool),
        TextList(Vec<String>),
    }

    impl From<&str> for Value {
        fn from(t: &str) -> Self {
            Value::Text(t.into())
        }
    }

    impl From<String> for Value {
        fn from(t: String) -> Self {
            Value::Text(t)
        }
    }

    impl From<f64> for Value {
        fn from(n: f64) -> Self {
            Value::Number(n)
        }
    }

    impl From<i32> for Value {
        fn from(n: i32) -> Self {
            Value::Number(n.into())
        }
    }

    impl From<bool> for Value {
        fn from(b: bool) -> Self {
            Value::Boolean(b)
        }
    }

    impl From<&[&str]> for Value {
        fn from(items: &[&str]) -> Self {
            Value::TextList(items.iter().map(|i| i.to_string()).collect())
        }
    }

    impl<const N: usize> From<[&str; N]> for Value {
        fn from(items: [&str; N]) -> Self {
            Value::from(&items[..])
        }
    }

    thread_local! {
        static CONFIG: RefCell<BTreeMap<String, Value>> = RefCell::default();
        static LOGS: RefCell<Vec<String>> = RefCell::default();
        static VOCAB: RefCell<Vec<String>> = RefCell::default();
    }

    /// Sets a configuration value the plugin reads with `config`: text, a number, a boolean
    /// or a list of texts (`set_config("tags", ["vip", "emea"])`).
    pub fn set_config(key: &str, value: impl Into<Value>) {
        CONFIG.with(|c| c.borrow_mut().insert(key.into(), value.into()));
    }

    /// The vocabulary a logits processor's lookups answer from: `tokens[id]` is token `id`'s
    /// text.
    pub fn set_vocabulary(tokens: &[&str]) {
        VOCAB.with(|v| *v.borrow_mut() = tokens.iter().map(|t| t.to_string()).collect());
    }

    /// The log lines written so far (`"<Level>: <message>"`), and forgets them.
    pub fn logs() -> Vec<String> {
        LOGS.with(|l| std::mem::take(&mut *l.borrow_mut()))
    }

    /// Forgets configuration, logs and vocabulary.
    pub fn reset() {
        CONFIG.with(|c| c.borrow_mut().clear());
        LOGS.with(|l| l.borrow_mut().clear());
        VOCAB.with(|v| v.borrow_mut().clear());
    }

    #[doc(hidden)]
    pub fn config(key: &str) -> Option<Value> {
        CONFIG.with(|c| c.borrow().get(key).cloned())
    }

    #[doc(hidden)]
    pub fn log(level: &str, message: &str) {
        LOGS.with(|l| l.borrow_mut().push(format!("{level}: {message}")));
    }

    fn matching(f: impl Fn(&str) -> bool) -> Vec<u32> {
        VOCAB.with(|v| {
            let v = v.borrow();
            (0..v.len() as u32).filter(|&i| f(&v[i as usize])).collect()
        })
    }

    fn fold(s: &str, ignore_case: bool) -> String {
        match ignore_case {
            true => s.to_ascii_lowercase(),
            false => s.to_string(),
        }
    }

    #[doc(hidden)]
    pub fn token_text(id: u32) -> String {
        VOCAB.with(|v| v.borrow().get(id as usize).cloned().unwrap_or_default())
    }

    #[doc(hidden)]
    pub fn tokens_with_prefix(prefix: &str, ignore_case: bool) -> Vec<u32> {
        let p = fold(prefix, ignore_case);
        match p.is_empty() {
            true => Vec::new(),
            false => matching(|t| fold(t, ignore_case).starts_with(&p)),
        }
    }

    #[doc(hidden)]
    pub fn tokens_containing(text: &str, ignore_case: bool) -> Vec<u32> {
        let p = fold(text, ignore_case);
        match p.is_empty() {
            true => Vec::new(),
            false => matching(|t| fold(t, ignore_case).contains(&p)),
        }
    }
}

/// The `prompt-template` world: turn a chat request into the model's prompt.
pub mod prompt_template {
    wit_bindgen::generate!({
        world: "prompt-template",
        path: "wit",
        default_bindings_module: "guest_sdk::prompt_template",
        pub_export_macro: true,
        additional_derives: [PartialEq],
        export_macro_name: "export_prompt_template_inner",
    });
    helpers!();
}

/// The `reranker` world: reorder candidate passages for a query.
pub mod reranker {
    wit_bindgen::generate!({
        world: "reranker",
        path: "wit",
        default_bindings_module: "guest_sdk::reranker",
        pub_export_macro: true,
        additional_derives: [PartialEq],
        export_macro_name: "export_reranker_inner",
    });
    helpers!(with_value);

    impl Candidate {
        /// The metadata field `name`, if the document has it.
        pub fn field(&self, name: &str) -> Option<&Value> {
            self.metadata
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v)
        }
    }
}

/// The `output-parser` world: extract and validate structured output from model text.
pub mod output_parser {
    wit_bindgen::generate!({
        world: "output-parser",
        path: "wit",
        default_bindings_module: "guest_sdk::output_parser",
        pub_export_macro: true,
        additional_derives: [PartialEq],
        export_macro_name: "export_output_parser_inner",
    });
    helpers!();
}

/// The `logits-processor` world: steer each generated token (bans, biases, stop).
pub mod logits_processor {
    wit_bindgen::generate!({
        world: "logits-processor",
        path: "wit",
        default_bindings_module: "guest_sdk::logits_processor",
        pub_export_macro: true,
        additional_derives: [PartialEq],
        export_macro_name: "export_logits_processor_inner",
    });
    helpers!();

    /// Token ids whose text starts with `prefix` (ASCII case folded with `ignore_case`).
    pub fn tokens_with_prefix(prefix: &str, ignore_case: bool) -> Vec<u32> {
        #[cfg(target_arch = "wasm32")]
        return self::gateway::plugins::vocabulary::tokens_with_prefix(prefix, ignore_case);
        #[cfg(not(target_arch = "wasm32"))]
        return crate::testing::tokens_with_prefix(prefix, ignore_case);
    }

    /// Token ids whose text contains `text`.
    pub fn tokens_containing(text: &str, ignore_case: bool) -> Vec<u32> {
        #[cfg(target_arch = "wasm32")]
        return self::gateway::plugins::vocabulary::tokens_containing(text, ignore_case);
        #[cfg(not(target_arch = "wasm32"))]
        return crate::testing::tokens_containing(text, ignore_case);
    }

    /// The text of token `id`.
    pub fn token_text(id: u32) -> String {
        #[cfg(target_arch = "wasm32")]
        return self::gateway::plugins::vocabulary::token_text(id);
        #[cfg(not(target_arch = "wasm32"))]
        return crate::testing::token_text(id);
    }
}

/// The `cache-key` world: what makes two requests the same for the tenant's response cache.
// The generated export takes the request's four strings and lists flattened: eight arguments.
#[allow(clippy::too_many_arguments)]
pub mod cache_key {
    wit_bindgen::generate!({
        world: "cache-key",
        path: "wit",
        default_bindings_module: "guest_sdk::cache_key",
        pub_export_macro: true,
        additional_derives: [PartialEq],
        export_macro_name: "export_cache_key_inner",
    });
    helpers!();
}

/// The `serde_json` this crate uses, so plugins need not add it to parse and write JSON.
pub use serde_json;

/// Exports a type implementing [`prompt_template::Guest`] as the plugin's entry point.
#[macro_export]
macro_rules! export_prompt_template {
    ($ty:ident) => {
        $crate::prompt_template::export_prompt_template_inner!($ty with_types_in $crate::prompt_template);
    };
}

/// Exports a type implementing [`reranker::Guest`] as the plugin's entry point.
#[macro_export]
macro_rules! export_reranker {
    ($ty:ident) => {
        $crate::reranker::export_reranker_inner!($ty with_types_in $crate::reranker);
    };
}

/// Exports a type implementing [`output_parser::Guest`] as the plugin's entry point.
#[macro_export]
macro_rules! export_output_parser {
    ($ty:ident) => {
        $crate::output_parser::export_output_parser_inner!($ty with_types_in $crate::output_parser);
    };
}

/// Exports a type implementing [`logits_processor::Guest`] as the plugin's entry point.
#[macro_export]
macro_rules! export_logits_processor {
    ($ty:ident) => {
        $crate::logits_processor::export_logits_processor_inner!($ty with_types_in $crate::logits_processor);
    };
}

/// Exports a type implementing [`cache_key::Guest`] as the plugin's entry point.
#[macro_export]
macro_rules! export_cache_key {
    ($ty:ident) => {
        $crate::cache_key::export_cache_key_inner!($ty with_types_in $crate::cache_key);
    };
}
