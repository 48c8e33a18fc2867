//! A cache key that drops timestamps (`YYYY-MM-DDTHH:MM:SS` with `Z` or `±HH:MM`) and
//! `[ts=...]` tags from every message, and keys on the model, the messages (`role: content`
//! lines) and the parameters, one per line; a request with `NOCACHE` in any message is not
//! cached. `strip-timestamp-py` is the same plugin in Python and gives the same keys.

use guest_sdk::cache_key::{CacheRequest, Guest, PluginError};

struct Plugin;

/// Whether `s` starts with `shape`, where `d` stands for any digit.
fn starts_like(s: &[u8], shape: &str) -> bool {
    s.len() >= shape.len()
        && shape.bytes().zip(s).all(|(p, c)| match p {
            b'd' => c.is_ascii_digit(),
            p => *c == p,
        })
}

/// The length of the volatile text at the start of `s`, if any: a timestamp with its zone,
/// or a `[ts=...]` tag up to its first `]`.
fn volatile_len(s: &[u8]) -> Option<usize> {
    if s.starts_with(b"[ts=") {
        return s.iter().position(|&c| c == b']').map(|end| end + 1);
    }
    if !starts_like(s, "dddd-dd-ddTdd:dd:dd") {
        return None;
    }
    let zone = &s[19..];
    if starts_like(zone, "Z") {
        Some(20)
    } else if starts_like(zone, "+dd:dd") || starts_like(zone, "-dd:dd") {
        Some(25)
    } else {
        None
    }
}

fn strip(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match volatile_len(&bytes[i..]) {
            Some(n) => i += n,
            None => {
                out.push(bytes[i]);
                i += 1;
            }
        }
    }
    // What was cut starts and ends on ASCII characters, so the rest is still UTF-8.
    String::from_utf8(out).expect("cut at ASCII characters")
}

impl Guest for Plugin {
    fn key(request: CacheRequest) -> Result<Option<String>, PluginError> {
        if request
            .messages
            .iter()
            .any(|m| m.content.contains("NOCACHE"))
        {
            return Ok(None);
        }
        let mut lines = vec![request.model];
        lines.extend(
            request
                .messages
                .iter()
                .map(|m| format!("{}: {}", m.role, strip(&m.content))),
        );
        lines.push(request.parameters);
        Ok(Some(lines.join("\n")))
    }
}

guest_sdk::export_cache_key!(Plugin);
