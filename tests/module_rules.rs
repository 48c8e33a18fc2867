//! The allowed dependencies between the gateway's modules (ARCHITECTURE.md, "Module rules"),
//! checked by reading every `crate::<module>` path in `host/src`: a new edge fails CI until the
//! rule (and the architecture) says it is meant.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Each module and the modules it may use. `server` is the edge: it may use everything.
const RULES: &[(&str, &[&str])] = &[
    ("common", &[]),
    ("config", &[]),
    ("metrics", &[]),
    ("engine", &["config", "metrics"]),
    ("plugins", &["common", "config"]),
    ("search", &["common"]),
    ("tenancy", &["common", "config", "metrics", "search"]),
    ("structured", &["engine"]),
    ("plugin_tool", &["config", "plugins"]),
    ("bench", &["config", "engine", "metrics", "structured"]),
    ("cli", &["search"]),
    (
        "cluster",
        &[
            "common", "config", "metrics", "plugins", "search", "tenancy",
        ],
    ),
    ("upstream", &["config", "metrics"]),
    (
        "pipeline",
        &[
            "common",
            "engine",
            "metrics",
            "plugins",
            "search",
            "structured",
            "tenancy",
            "upstream",
        ],
    ),
    ("server", &["*"]),
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        let p = entry.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|e| e == "rs") {
            out.push(p);
        }
    }
}

/// The modules a file names as `crate::<module>`, outside comments.
fn uses(text: &str) -> BTreeSet<String> {
    let mut found = BTreeSet::new();
    for line in text.lines().map(str::trim_start) {
        if line.starts_with("//") {
            continue;
        }
        for (at, _) in line.match_indices("crate::") {
            let rest = &line[at + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                found.insert(name);
            }
        }
    }
    found
}

#[test]
fn modules_use_only_what_their_rule_allows() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut broken = Vec::new();
    for file in &files {
        let rel = file.strip_prefix(&src).unwrap();
        let first = rel.iter().next().unwrap().to_str().unwrap();
        let module = first.trim_end_matches(".rs");
        if matches!(module, "lib" | "main") {
            continue;
        }
        let Some((_, allowed)) = RULES.iter().find(|(m, _)| *m == module) else {
            broken.push(format!("{}: module `{module}` has no rule", rel.display()));
            continue;
        };
        for used in uses(&std::fs::read_to_string(file).unwrap()) {
            if used != module && !allowed.contains(&"*") && !allowed.contains(&used.as_str()) {
                broken.push(format!(
                    "{}: `{module}` may not use `{used}`",
                    rel.display()
                ));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "module rules broken:\n{}",
        broken.join("\n")
    );
}
