//! The `vocabulary` interface a logits processor imports: token texts and lookups by prefix
//! or substring, answered in the host over an index built once per model, so a plugin never
//! has a vocabulary-sized table cross into its memory.

use std::collections::HashMap;
use std::sync::Mutex;

/// Most distinct substring lookups remembered per model (each is a scan of the vocabulary).
const MAX_CACHED_SCANS: usize = 1024;

pub struct VocabIndex {
    texts: Vec<String>,
    /// (text, id) sorted by text, and the same for ASCII-lowercased text: a prefix is a range.
    sorted: Vec<(String, u32)>,
    sorted_lower: Vec<(String, u32)>,
    scans: Mutex<HashMap<(String, bool), Vec<u32>>>,
}

impl VocabIndex {
    /// `texts[id]` is token `id`'s text.
    pub fn new(texts: Vec<String>) -> Self {
        let mut sorted: Vec<(String, u32)> = texts
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut sorted_lower: Vec<(String, u32)> = sorted
            .iter()
            .map(|(t, i)| (t.to_ascii_lowercase(), *i))
            .collect();
        sorted.sort_unstable();
        sorted_lower.sort_unstable();
        Self {
            texts,
            sorted,
            sorted_lower,
            scans: Mutex::default(),
        }
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.texts.is_empty()
    }

    pub fn text(&self, id: u32) -> String {
        self.texts.get(id as usize).cloned().unwrap_or_default()
    }

    pub fn with_prefix(&self, prefix: &str, ignore_case: bool) -> Vec<u32> {
        if prefix.is_empty() {
            return Vec::new();
        }
        let (list, prefix) = match ignore_case {
            true => (&self.sorted_lower, prefix.to_ascii_lowercase()),
            false => (&self.sorted, prefix.to_string()),
        };
        let start = list.partition_point(|(t, _)| t.as_str() < prefix.as_str());
        list[start..]
            .iter()
            .take_while(|(t, _)| t.starts_with(&prefix))
            .map(|(_, id)| *id)
            .collect()
    }

    pub fn containing(&self, text: &str, ignore_case: bool) -> Vec<u32> {
        if text.is_empty() {
            return Vec::new();
        }
        let key = (text.to_string(), ignore_case);
        if let Some(hit) = self
            .scans
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
        {
            return hit.clone();
        }
        let needle = match ignore_case {
            true => text.to_ascii_lowercase(),
            false => text.to_string(),
        };
        let found: Vec<u32> = self
            .texts
            .iter()
            .enumerate()
            .filter(|(_, t)| match ignore_case {
                true => t.to_ascii_lowercase().contains(&needle),
                false => t.contains(&needle),
            })
            .map(|(i, _)| i as u32)
            .collect();
        let mut scans = self.scans.lock().unwrap_or_else(|e| e.into_inner());
        if scans.len() >= MAX_CACHED_SCANS {
            scans.clear();
        }
        scans.insert(key, found.clone());
        found
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_and_substrings_with_and_without_case() {
        let v = VocabIndex::new(
            [
                "Sales",
                "force",
                " Force",
                "forces",
                "for",
                "Salesforce",
                "x",
            ]
            .map(String::from)
            .to_vec(),
        );
        assert_eq!(v.with_prefix("force", false), [1, 3]);
        let mut ci = v.with_prefix("FORCE", true);
        ci.sort();
        assert_eq!(ci, [1, 3]);
        assert_eq!(v.with_prefix(" f", true), [2]);
        assert!(v.with_prefix("", true).is_empty());
        assert_eq!(v.containing("esfor", true), [5]);
        assert_eq!(v.containing("Force", false), [2]);
        assert_eq!(v.text(0), "Sales");
        assert_eq!(v.text(99), "");
    }
}
