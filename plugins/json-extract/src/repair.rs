//! Locating a JSON value in free text and rewriting the common faults into strict JSON.

/// The JSON-looking span of `text`: inside the first fenced block that holds one, else from
/// the first `{` or `[` to where its brackets balance (or to the end, if they never do).
pub fn locate(text: &str) -> Option<&str> {
    let mut rest = text;
    while let Some(open) = rest.find("```") {
        let after = &rest[open + 3..];
        let body_start = after.find('\n').map_or(after.len(), |i| i + 1);
        let body = &after[body_start..];
        let end = body.find("```").unwrap_or(body.len());
        if let Some(span) = balanced_from_first_bracket(&body[..end]) {
            return Some(span);
        }
        rest = &body[end.min(body.len())..];
        if end == body.len() {
            break;
        }
        rest = &rest[3..];
    }
    balanced_from_first_bracket(text)
}

fn balanced_from_first_bracket(text: &str) -> Option<&str> {
    let start = text.find(['{', '['])?;
    let bytes = text.as_bytes();
    let mut depth = 0usize;
    let mut quote: Option<u8> = None;
    let mut escaped = false;
    for (i, &b) in bytes.iter().enumerate().skip(start) {
        if let Some(q) = quote {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == q {
                quote = None;
            }
            continue;
        }
        match b {
            b'"' | b'\'' => quote = Some(b),
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start..=i]);
                }
            }
            _ => {}
        }
    }
    Some(&text[start..])
}

#[derive(Default)]
struct Counts {
    keys: usize,
    single_quoted: usize,
    literals: usize,
    trailing_commas: usize,
}

/// Rewrites `src` into strict JSON; returns it with one note per kind of fix applied.
pub fn repair(src: &str) -> (String, Vec<String>) {
    let chars: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len() + 8);
    let mut counts = Counts::default();
    let mut stack: Vec<char> = Vec::new();
    let mut unterminated = false;
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' => {
                let (end, closed) = copy_string(&chars, i, &mut out);
                if c == '\'' {
                    counts.single_quoted += 1;
                }
                unterminated |= !closed;
                i = end;
                continue;
            }
            '{' => stack.push('}'),
            '[' => stack.push(']'),
            '}' | ']' => {
                stack.pop();
            }
            ',' => {
                let next = chars[i + 1..].iter().find(|c| !c.is_whitespace());
                if matches!(next, Some('}') | Some(']') | None) {
                    counts.trailing_commas += 1;
                    i += 1;
                    continue;
                }
            }
            c if c.is_alphabetic() || c == '_' || c == '$' => {
                let end = (i..chars.len())
                    .find(|&j| !(chars[j].is_alphanumeric() || matches!(chars[j], '_' | '$' | '-')))
                    .unwrap_or(chars.len());
                let word: String = chars[i..end].iter().collect();
                let is_key = chars[end..].iter().find(|c| !c.is_whitespace()) == Some(&':');
                match (is_key, word.as_str()) {
                    (true, _) => {
                        counts.keys += 1;
                        out.push('"');
                        out.push_str(&word);
                        out.push('"');
                    }
                    (false, "true" | "false" | "null") => out.push_str(&word),
                    (false, "True") => push_literal(&mut out, &mut counts, "true"),
                    (false, "False") => push_literal(&mut out, &mut counts, "false"),
                    (false, "None") => push_literal(&mut out, &mut counts, "null"),
                    // Not ours to guess: leave it for the strict parser to reject.
                    _ => out.push_str(&word),
                }
                i = end;
                continue;
            }
            _ => {}
        }
        out.push(c);
        i += 1;
    }
    let mut notes = Vec::new();
    if counts.keys > 0 {
        notes.push(format!("quoted {} keys", counts.keys));
    }
    if counts.single_quoted > 0 {
        notes.push(format!(
            "converted {} single-quoted strings",
            counts.single_quoted
        ));
    }
    if counts.literals > 0 {
        notes.push(format!("replaced {} Python literals", counts.literals));
    }
    if counts.trailing_commas > 0 {
        notes.push(format!(
            "removed {} trailing commas",
            counts.trailing_commas
        ));
    }
    if unterminated {
        out.push('"');
        notes.push("closed an unterminated string".to_string());
    }
    if !stack.is_empty() {
        // Generation stopped inside an object: finish or drop a member left half-written.
        let kept = out.trim_end().len();
        out.truncate(kept);
        if stack.last() == Some(&'}') {
            if out.ends_with(':') {
                out.push_str("null");
                notes.push("filled a missing value with null".to_string());
            } else if let Some(key_start) = dangling_key(&out) {
                out.truncate(key_start);
                let kept = out.trim_end().trim_end_matches(',').len();
                out.truncate(kept);
                notes.push("dropped a key without a value".to_string());
            }
        }
        notes.push(format!("closed {} open brackets", stack.len()));
        while let Some(close) = stack.pop() {
            out.push(close);
        }
    }
    (out, notes)
}

/// Where the last member of `out` starts, when that member is a lone string in key position
/// (right after `{` or `,` of an object), i.e. a key whose value never came.
fn dangling_key(out: &str) -> Option<usize> {
    let body = out.strip_suffix('"')?;
    let bytes = body.as_bytes();
    let mut i = bytes.len();
    while i > 0 {
        i -= 1;
        if bytes[i] == b'"' {
            let backslashes = bytes[..i].iter().rev().take_while(|b| **b == b'\\').count();
            if backslashes % 2 == 0 {
                let before = body[..i].trim_end();
                return (before.ends_with('{') || before.ends_with(',')).then_some(i);
            }
        }
    }
    None
}

fn push_literal(out: &mut String, counts: &mut Counts, literal: &str) {
    counts.literals += 1;
    out.push_str(literal);
}

/// Copies the string starting at `chars[start]` as a double-quoted JSON string.
/// Returns the index after it and whether it was closed.
fn copy_string(chars: &[char], start: usize, out: &mut String) -> (usize, bool) {
    let quote = chars[start];
    out.push('"');
    let mut i = start + 1;
    while i < chars.len() {
        let c = chars[i];
        if c == '\\' && i + 1 < chars.len() {
            // `\'` is not a JSON escape; inside a double-quoted string it is just `'`.
            if chars[i + 1] == '\'' {
                out.push('\'');
            } else {
                out.push(c);
                out.push(chars[i + 1]);
            }
            i += 2;
            continue;
        }
        if c == quote {
            out.push('"');
            return (i + 1, true);
        }
        if c == '"' {
            out.push_str("\\\"");
        } else if c == '\n' {
            out.push_str("\\n");
        } else {
            out.push(c);
        }
        i += 1;
    }
    (i, false)
}
