//! Token-aware chunking: windows of at most `size` embedding-model tokens overlapping by
//! `overlap`, cut at a sentence or line end when one falls in the window's last quarter, so a
//! chunk rarely stops mid-sentence and never exceeds what the encoder takes.

/// A chunk as a byte range of the document text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

/// Splits `text`, given its tokens' byte offsets, into spans. Empty text gives no spans.
pub fn split(text: &str, offsets: &[(usize, usize)], size: usize, overlap: usize) -> Vec<Span> {
    let n = offsets.len();
    if n == 0 {
        return Vec::new();
    }
    if n <= size {
        return vec![Span {
            start: offsets[0].0,
            end: offsets[n - 1].1,
        }];
    }
    let overlap = overlap.min(size / 2);
    let mut spans = Vec::new();
    let mut s = 0;
    loop {
        let hard = (s + size).min(n);
        let cut = if hard == n {
            n
        } else {
            (s + size * 3 / 4 + 1..=hard)
                .rev()
                .find(|&b| ends_sentence(text, offsets, b))
                .unwrap_or(hard)
        };
        spans.push(Span {
            start: offsets[s].0,
            end: offsets[cut - 1].1,
        });
        if cut == n {
            return spans;
        }
        s = (cut - overlap).max(s + 1);
    }
}

/// Whether a cut before token `b` lands after a sentence or line end.
fn ends_sentence(text: &str, offsets: &[(usize, usize)], b: usize) -> bool {
    let (prev, next) = (offsets[b - 1], offsets[b]);
    let last = text.get(prev.0..prev.1).unwrap_or("");
    let gap = text.get(prev.1..next.0).unwrap_or("");
    matches!(last, "." | "!" | "?" | ":") || gap.contains('\n')
}

/// Unicode code point (not byte) offset of `byte` in `text`: what Python string slicing uses.
/// (JavaScript counts UTF-16 units, which differ beyond the Basic Multilingual Plane.)
pub fn char_offset(text: &str, byte: usize) -> usize {
    text.get(..byte).map_or(0, |t| t.chars().count())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whitespace "tokens" with punctuation split off, standing in for a tokenizer.
    fn offsets(text: &str) -> Vec<(usize, usize)> {
        let mut v = Vec::new();
        let mut start = None;
        for (i, c) in text.char_indices() {
            if c.is_alphanumeric() {
                start.get_or_insert(i);
                continue;
            }
            if let Some(s) = start.take() {
                v.push((s, i));
            }
            if !c.is_whitespace() {
                v.push((i, i + c.len_utf8()));
            }
        }
        if let Some(s) = start {
            v.push((s, text.len()));
        }
        v
    }

    #[test]
    fn short_text_is_one_chunk() {
        let t = "  Reset your password from the login page.  ";
        let o = offsets(t);
        assert_eq!(split(t, &o, 50, 10), [Span { start: 2, end: 42 }]);
        assert!(split("", &[], 50, 10).is_empty());
    }

    #[test]
    fn long_text_overlaps_and_prefers_sentence_ends() {
        let sentence = "the quick brown fox jumps. ";
        let t = sentence.repeat(60);
        let o = offsets(&t);
        let spans = split(&t, &o, 32, 8);
        assert!(spans.len() > 5);
        for w in spans.windows(2) {
            assert!(w[1].start < w[0].end, "consecutive chunks overlap");
        }
        for s in &spans[..spans.len() - 1] {
            assert!(t[..s.end].ends_with('.'), "{:?}", &t[s.start..s.end]);
            let tokens = o.iter().filter(|x| x.0 >= s.start && x.1 <= s.end).count();
            assert!(tokens <= 32);
        }
        assert_eq!(spans.last().unwrap().end, t.trim_end().len());
        assert_eq!(spans[0].start, 0);
    }

    #[test]
    fn text_without_sentence_ends_is_cut_at_the_size() {
        let t = "word ".repeat(100);
        let spans = split(&t, &offsets(&t), 10, 3);
        assert_eq!(spans[0], Span { start: 0, end: 49 });
        assert_eq!(spans[1].start, 35);
        assert_eq!(char_offset("héllo", 3), 2);
    }
}
