//! {{name}}: a cache key. Two requests share a cached answer when their parameters and
//! messages match once volatile text is dropped: ISO-8601 timestamps
//! (`2026-12-05T04:24:11Z`) and `request-id: <token>`. A request whose last user message
//! names one of config `no_cache_intents` (a list of words) is not cached at all.

use guest_sdk::cache_key::{config, error, CacheRequest, Guest, PluginError, Value};

struct Plugin;

fn words(text: &str) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|w| !w.is_empty())
        .map(str::to_lowercase)
        .collect()
}

/// Whether `s` starts with `shape`, where `d` stands for any digit.
fn starts_like(s: &[u8], shape: &str) -> bool {
    s.len() >= shape.len()
        && shape.bytes().zip(s).all(|(p, c)| match p {
            b'd' => c.is_ascii_digit(),
            p => *c == p,
        })
}

/// The length of the ISO-8601 timestamp at the start of `s` (`YYYY-MM-DDTHH:MM:SS`, then
/// optional fractional seconds and an optional `Z` or `+HH:MM`), if one is there.
fn timestamp_len(s: &[u8]) -> Option<usize> {
    if !starts_like(s, "dddd-dd-ddTdd:dd:dd") {
        return None;
    }
    let mut end = 19;
    if starts_like(&s[end..], ".d") {
        end += 2;
        while starts_like(&s[end..], "d") {
            end += 1;
        }
    }
    if starts_like(&s[end..], "Z") {
        end += 1;
    } else if starts_like(&s[end..], "+dd:dd") || starts_like(&s[end..], "-dd:dd") {
        end += 6;
    }
    Some(end)
}

/// `text` without timestamps and `request-id: <token>`, its whitespace collapsed.
fn clean(text: &str) -> String {
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        if let Some(n) = timestamp_len(&text.as_bytes()[i..]) {
            i += n;
        } else if lower[i..].starts_with("request-id:") {
            let rest = &text[i + "request-id:".len()..];
            let token = rest.trim_start();
            let skipped = rest.len() - token.len();
            let len = token.find(char::is_whitespace).unwrap_or(token.len());
            i += "request-id:".len() + skipped + len;
        } else {
            let c = text[i..]
                .chars()
                .next()
                .expect("i is on a character boundary");
            out.push(c);
            i += c.len_utf8();
        }
    }
    out.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// The words of config `no_cache_intents`: a list, or one comma-separated text.
fn no_cache_intents() -> Result<Vec<String>, PluginError> {
    Ok(match config("no_cache_intents") {
        None => Vec::new(),
        Some(Value::TextList(l)) => l.iter().map(|w| w.trim().to_lowercase()).collect(),
        Some(Value::Text(t)) => t.split(',').map(|w| w.trim().to_lowercase()).collect(),
        Some(_) => {
            return Err(error(
                "invalid-config",
                "no_cache_intents must be a list of words",
            ));
        }
    })
}

impl Guest for Plugin {
    fn key(request: CacheRequest) -> Result<Option<String>, PluginError> {
        let intents = no_cache_intents()?;
        let last_user = request.messages.iter().rev().find(|m| m.role == "user");
        if let Some(m) = last_user {
            if words(&m.content).iter().any(|w| intents.contains(w)) {
                return Ok(None);
            }
        }
        // The gateway keeps the tenant, model and versions in the key itself; the endpoint is
        // ours to add, so that a completion's prompt never shares a chat message's answer.
        let mut key = format!("{}\n{}", request.endpoint, request.parameters);
        for m in &request.messages {
            key.push('\n');
            key.push_str(&format!("{}: {}", m.role, clean(&m.content)));
        }
        Ok(Some(key))
    }
}

guest_sdk::export_cache_key!(Plugin);

#[cfg(test)]
mod tests {
    use super::*;
    use guest_sdk::cache_key::Message;
    use guest_sdk::testing;

    fn request(system: &str, user: &str) -> CacheRequest {
        let message = |role: &str, content: &str| Message {
            role: role.into(),
            content: content.into(),
            name: None,
        };
        CacheRequest {
            model: "local".into(),
            endpoint: "chat".into(),
            messages: vec![message("system", system), message("user", user)],
            parameters: "{}".into(),
        }
    }

    #[test]
    fn volatile_text_is_dropped_and_intents_are_not_cached() {
        testing::reset();
        testing::set_config("no_cache_intents", ["latest", "today"]);
        let a = Plugin::key(request(
            "Now: 2026-12-05T04:24:11Z. request-id: 7f3a",
            "Export invoices?",
        ));
        let b = Plugin::key(request(
            "Now: 2026-12-06T09:00:00.5+01:00. request-id: 99",
            "Export invoices?",
        ));
        assert_eq!(a.unwrap(), b.unwrap());
        let c = Plugin::key(request("Now:", "What are today's invoices?")).unwrap();
        assert_eq!(c, None);
    }
}
