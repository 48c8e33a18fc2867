//! Turning generated tokens into text as they arrive, and cutting it at stop strings.

use tokenizers::Tokenizer;

/// Streams text for a growing token list. Decoding token by token breaks multi-byte characters
/// and word-initial spaces, so each step decodes a short window and emits only the text that the
/// newest token added, holding back incomplete UTF-8 (decoded as U+FFFD) until it completes.
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// `context` is the tail of the prompt, so the first generated token decodes as it would
    /// mid-text (a leading space stays a space). A tail that ends inside a UTF-8 character
    /// (possible with token-id prompts) is not used: its text would not line up with the
    /// generated text's.
    pub fn new(tok: &Tokenizer, context: &[u32]) -> Self {
        let mut tail = &context[context.len().saturating_sub(4)..];
        if tok
            .decode(tail, true)
            .unwrap_or_default()
            .ends_with('\u{FFFD}')
        {
            tail = &[];
        }
        Self {
            ids: tail.to_vec(),
            prefix_offset: 0,
            read_offset: tail.len(),
        }
    }

    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        self.ids.push(id);
        let decode = |ids: &[u32]| tok.decode(ids, true).unwrap_or_default();
        let prefix = decode(&self.ids[self.prefix_offset..self.read_offset]);
        let full = decode(&self.ids[self.prefix_offset..]);
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            if let Some(new) = full.get(prefix.len()..) {
                let new = new.to_string();
                self.prefix_offset = self.read_offset;
                self.read_offset = self.ids.len();
                return new;
            }
        }
        String::new()
    }
}

/// Finds stop strings in streamed text. Text that could still turn out to be the start of a
/// stop string is held back, so a stop string split across tokens is never emitted.
pub struct StopMatcher {
    stops: Vec<String>,
    text: String,
    sent: usize,
}

pub enum StopOutcome {
    /// Text safe to send now (may be empty).
    Continue(String),
    /// A stop string was found: the text before it that was not yet sent.
    Stopped(String),
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            stops: stops.into_iter().filter(|s| !s.is_empty()).collect(),
            text: String::new(),
            sent: 0,
        }
    }

    pub fn push(&mut self, delta: &str) -> StopOutcome {
        self.text.push_str(delta);
        let pending = &self.text[self.sent..];
        if let Some(pos) = self
            .stops
            .iter()
            .filter_map(|s| pending.find(s.as_str()))
            .min()
        {
            let out = pending[..pos].to_string();
            self.sent = self.text.len();
            return StopOutcome::Stopped(out);
        }
        let hold = self
            .stops
            .iter()
            .map(|s| longest_suffix_prefix(pending, s))
            .max()
            .unwrap_or(0);
        let end = self.text.len() - hold;
        let out = self.text[self.sent..end].to_string();
        self.sent = end;
        StopOutcome::Continue(out)
    }

    /// What was held back, once generation ends for another reason.
    pub fn flush(&mut self) -> String {
        let out = self.text[self.sent..].to_string();
        self.sent = self.text.len();
        out
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of `stop`.
fn longest_suffix_prefix(text: &str, stop: &str) -> usize {
    let max = (stop.len() - 1).min(text.len());
    (1..=max)
        .rev()
        .find(|&k| {
            text.is_char_boundary(text.len() - k)
                && stop
                    .as_bytes()
                    .starts_with(&text.as_bytes()[text.len() - k..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn feed(stops: &[&str], deltas: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for d in deltas {
            match m.push(d) {
                StopOutcome::Continue(s) => out.push_str(&s),
                StopOutcome::Stopped(s) => {
                    out.push_str(&s);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_inside_one_delta() {
        assert_eq!(feed(&["END"], &["abc END def"]), ("abc ".into(), true));
    }

    #[test]
    fn stop_split_across_tokens_is_not_emitted() {
        assert_eq!(
            feed(&["\n\nUser:"], &["Hi", "\n", "\nUs", "er:", " x"]),
            ("Hi".into(), true)
        );
    }

    #[test]
    fn held_back_text_is_released_when_it_stops_matching() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert!(matches!(m.push("ab ST"), StopOutcome::Continue(s) if s == "ab "));
        assert!(matches!(m.push("AR"), StopOutcome::Continue(s) if s == "STAR"));
        assert_eq!(
            feed(&["STOP"], &["x ST"]),
            ("x ST".into(), false),
            "flushed at the end"
        );
    }

    #[test]
    fn earliest_of_several_stops_wins_and_multibyte_is_safe() {
        assert_eq!(feed(&["b", "a"], &["xxab"]), ("xx".into(), true));
        assert_eq!(feed(&["éé"], &["café", "é!"]), ("caf".into(), true));
        assert_eq!(feed(&["🚀x"], &["go 🚀", "y"]), ("go 🚀y".into(), false));
    }
}
