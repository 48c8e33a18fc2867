//! The allowed dependencies between the gateway's modules (ARCHITECTURE.md, "Module rules"),
//! checked by reading every `crate::<module>` path in `host/src`: a new edge fails CI until the
//! rule (and the architecture) says it is meant. Inside a module, the files (a folder counts as
//! one) must not use each other in a cycle: each `super::`, `self::` and `crate::` path is
//! resolved to the file it reaches.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each module and the modules it may use. `server` is the edge and `app` wires it to the
/// domains: they may use everything.
const RULES: &[(&str, &[&str])] = &[
    ("common", &[]),
    ("audit", &["common"]),
    ("config", &[]),
    ("conversations", &["common", "config"]),
    ("metrics", &[]),
    ("engine", &["config", "metrics"]),
    ("plugins", &["common", "config"]),
    ("search", &["common", "config", "engine"]),
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
    ("cache", &["config", "metrics", "search"]),
    (
        "pipeline",
        &[
            "cache",
            "common",
            "conversations",
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
    ("app", &["*"]),
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

/// A file's module path under `src`: `engine/quant/mod.rs` is `engine::quant`, `lib.rs` the root.
fn module_of(rel: &Path) -> Vec<String> {
    let mut path: Vec<String> = rel
        .iter()
        .map(|s| s.to_str().unwrap().trim_end_matches(".rs").to_string())
        .collect();
    if matches!(path.last().map(String::as_str), Some("mod" | "lib")) {
        path.pop();
    }
    path
}

/// `text` with comments and string and character literals blanked out (lines kept), so that
/// what remains is code.
fn code_only(text: &str) -> String {
    let c: Vec<char> = text.chars().collect();
    let mut out = c.clone();
    let mut i = 0;
    while i < c.len() {
        let Some(end) = not_code_end(&c, i) else {
            i += 1;
            continue;
        };
        for ch in out[i..end].iter_mut().filter(|ch| **ch != '\n') {
            *ch = ' ';
        }
        i = end;
    }
    out.into_iter().collect()
}

/// Where the comment or literal starting at `c[i]` ends, if one starts there.
fn not_code_end(c: &[char], i: usize) -> Option<usize> {
    let at = |k: usize| c.get(k).copied();
    let ident = |k: usize| c[k].is_alphanumeric() || c[k] == '_';
    let find = |from: usize, what: &[char]| {
        (from..c.len())
            .find(|&k| c[k..].starts_with(what))
            .map_or(c.len(), |k| k + what.len())
    };
    match (c[i], at(i + 1), at(i + 2)) {
        ('/', Some('/'), _) => Some(find(i, &['\n'])),
        ('/', Some('*'), _) => {
            let (mut depth, mut k) = (0, i);
            while k < c.len() {
                match (c[k], at(k + 1)) {
                    ('/', Some('*')) => (depth, k) = (depth + 1, k + 1),
                    ('*', Some('/')) => (depth, k) = (depth - 1, k + 1),
                    _ => {}
                }
                k += 1;
                if depth == 0 {
                    break;
                }
            }
            Some(k)
        }
        ('"', _, _) => {
            let mut k = i + 1;
            while k < c.len() && c[k] != '"' {
                k += if c[k] == '\\' { 2 } else { 1 };
            }
            Some((k + 1).min(c.len()))
        }
        // A raw string, `r"…"` or `r#"…"#` (also after `b`), not a raw identifier (`r#type`).
        ('r', Some('"' | '#'), _)
            if i == 0 || !ident(i - 1) || (c[i - 1] == 'b' && (i == 1 || !ident(i - 2))) =>
        {
            let hashes = c[i + 1..].iter().take_while(|&&h| h == '#').count();
            let close: Vec<char> = std::iter::once('"')
                .chain(std::iter::repeat_n('#', hashes))
                .collect();
            (at(i + 1 + hashes) == Some('"')).then(|| find(i + 2 + hashes, &close))
        }
        // A character, `'x'` or `'\n'`; a lifetime (`'a`) is code.
        ('\'', Some('\\'), _) => Some(find(i + 3, &['\''])),
        ('\'', _, Some('\'')) => Some(i + 3),
        _ => None,
    }
}

/// For each line of `code`, the inline modules (`mod tests { … }`) it is inside; rustfmt puts
/// a module's closing brace alone at the indentation of its `mod` line.
fn inline_modules(code: &str) -> Vec<Vec<String>> {
    let mut open: Vec<(usize, String)> = Vec::new();
    let mut per_line = Vec::new();
    for line in code.lines() {
        let indent = line.len() - line.trim_start().len();
        if line.trim() == "}" && open.last().is_some_and(|(i, _)| *i == indent) {
            open.pop();
        }
        per_line.push(open.iter().map(|(_, name)| name.clone()).collect());
        let item = line.trim_start();
        let item = match item.strip_prefix("pub") {
            Some(rest) => rest.split_once(' ').map_or("", |(_, r)| r),
            None => item,
        };
        if let Some(rest) = item.strip_prefix("mod ") {
            if let Some(name) = rest.strip_suffix(" {") {
                open.push((indent, name.to_string()));
            }
        }
    }
    per_line
}

/// The paths written at `at` in `code` (`super::{a, b::X}` is `super::a` and `super::b::X`).
fn path_tree(code: &[char], at: &mut usize, prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    let skip_space = |at: &mut usize| {
        while *at < code.len() && code[*at].is_whitespace() {
            *at += 1;
        }
    };
    let mut path = prefix;
    loop {
        skip_space(at);
        match code.get(*at) {
            Some('{') => {
                *at += 1;
                loop {
                    skip_space(at);
                    match code.get(*at) {
                        None => return,
                        Some('}') => {
                            *at += 1;
                            return;
                        }
                        Some(',') => *at += 1,
                        Some(_) => path_tree(code, at, path.clone(), out),
                    }
                }
            }
            Some(c) if c.is_alphanumeric() || *c == '_' => {
                let start = *at;
                while *at < code.len() && (code[*at].is_alphanumeric() || code[*at] == '_') {
                    *at += 1;
                }
                let name: String = code[start..*at].iter().collect();
                // `b::{self, X}` names `b`.
                if name != "self" || path.is_empty() {
                    path.push(name);
                }
                if code[*at..].starts_with(&[':', ':']) {
                    *at += 2;
                    continue;
                }
                break;
            }
            _ => break,
        }
    }
    out.push(path);
}

/// Every `crate::`, `self::` and `super::` path in a file, with its line (1-based).
fn relative_paths(code: &str) -> Vec<(usize, Vec<String>)> {
    let chars: Vec<char> = code.chars().collect();
    let keywords: Vec<Vec<char>> = ["crate::", "self::", "super::"]
        .iter()
        .map(|k| k.chars().collect())
        .collect();
    let mut found = Vec::new();
    let mut line = 1;
    for i in 0..chars.len() {
        if chars[i] == '\n' {
            line += 1;
        }
        let starts = keywords.iter().any(|k| chars[i..].starts_with(k));
        let inside_word = i > 0 && (chars[i - 1].is_alphanumeric() || chars[i - 1] == '_');
        let inside_path = i > 1 && chars[i - 2..i] == [':', ':'];
        if !starts || inside_word || inside_path {
            continue;
        }
        let mut paths = Vec::new();
        path_tree(&chars, &mut { i }, Vec::new(), &mut paths);
        found.extend(paths.into_iter().map(|p| (line, p)));
    }
    found
}

/// The module a path names, from `base` (the module the path is written in): the longest
/// prefix that is a file's module, `None` if it leaves the crate.
fn resolve(
    base: &[String],
    path: &[String],
    modules: &BTreeSet<Vec<String>>,
) -> Option<Vec<String>> {
    let mut at = base.to_vec();
    let mut rest = path.iter().peekable();
    match rest.next().map(String::as_str) {
        Some("crate") => at.clear(),
        Some("self") => {}
        Some("super") => {
            at.pop()?;
        }
        _ => return None,
    }
    while rest.peek().is_some_and(|s| *s == "super") {
        rest.next();
        at.pop()?;
    }
    at.extend(rest.cloned());
    (0..=at.len())
        .rev()
        .map(|n| at[..n].to_vec())
        .find(|m| modules.contains(m))
}

/// The groups of siblings that reach each other through `edges` (strongly connected, more
/// than one member), in order.
fn cycles(edges: &BTreeMap<(Vec<String>, Vec<String>), String>) -> Vec<BTreeSet<Vec<String>>> {
    let mut next: BTreeMap<&Vec<String>, Vec<&Vec<String>>> = BTreeMap::new();
    for (from, to) in edges.keys() {
        next.entry(from).or_default().push(to);
    }
    let reach = |start: &Vec<String>| {
        let mut seen = BTreeSet::new();
        let mut todo = vec![start.clone()];
        while let Some(n) = todo.pop() {
            for m in next.get(&n).into_iter().flatten() {
                if seen.insert((*m).clone()) {
                    todo.push((*m).clone());
                }
            }
        }
        seen
    };
    let reached: BTreeMap<&Vec<String>, BTreeSet<Vec<String>>> =
        next.keys().map(|n| (*n, reach(n))).collect();
    let mut groups: Vec<BTreeSet<Vec<String>>> = Vec::new();
    for (n, from_n) in &reached {
        if !from_n.contains(*n) || groups.iter().any(|g| g.contains(*n)) {
            continue;
        }
        let group = from_n
            .iter()
            .filter(|m| reached.get(m).is_some_and(|r| r.contains(*n)))
            .cloned()
            .collect();
        groups.push(group);
    }
    groups
}

#[test]
fn files_inside_a_module_use_each_other_in_no_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    // The binary is a crate of its own: its `crate::` is not the library's.
    files.retain(|f| *f != src.join("main.rs"));
    // Each module as a report names it: `search/bm25.rs`, `engine/quant/`.
    let mut shown_as = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let name = match rel.file_name().unwrap().to_str().unwrap() {
            "mod.rs" => format!("{}/", rel.parent().unwrap().display()),
            _ => rel.display().to_string(),
        };
        shown_as.entry(module_of(rel)).or_insert(name);
    }
    let modules: BTreeSet<Vec<String>> = shown_as.keys().cloned().collect();
    // Sibling → sibling (a folder counts as one sibling), with the first use that makes it.
    let mut edges = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap();
        let from = module_of(rel);
        let code = code_only(&std::fs::read_to_string(f).unwrap());
        let inline = inline_modules(&code);
        for (line, path) in relative_paths(&code) {
            let mut base = from.clone();
            base.extend(inline[line - 1].iter().cloned());
            let Some(to) = resolve(&base, &path, &modules) else {
                continue;
            };
            let common = from.iter().zip(&to).take_while(|(a, b)| a == b).count();
            // A module naming its own parent or child is no use between siblings.
            if common == from.len() || common == to.len() {
                continue;
            }
            let evidence = format!("{}:{line} names `{}`", rel.display(), path.join("::"));
            edges
                .entry((from[..=common].to_vec(), to[..=common].to_vec()))
                .or_insert(evidence);
        }
    }
    let mut report = Vec::new();
    for group in cycles(&edges) {
        let members: Vec<String> = group.iter().map(|m| shown_as[m].clone()).collect();
        report.push(format!("cycle among {}:", members.join(", ")));
        for ((from, to), evidence) in &edges {
            if group.contains(from) && group.contains(to) {
                report.push(format!(
                    "  {} → {} ({evidence})",
                    shown_as[from], shown_as[to]
                ));
            }
        }
    }
    assert!(
        report.is_empty(),
        "files that use each other in a cycle (move what they share so that one use goes):\n{}",
        report.join("\n")
    );
}

#[test]
fn paths_are_read_through_groups_inline_modules_comments_and_literals() {
    let text = r##"use super::{a, b::{self, X}};
// super::commented
let s = ("crate::quoted", r#"self::raw"#, '"', 'x');
mod tests {
    use super::super::c::Y;
}
let d = crate::d::f();
"##;
    let code = code_only(text);
    assert_eq!(code.lines().count(), text.lines().count());
    let paths: Vec<(usize, String)> = relative_paths(&code)
        .into_iter()
        .map(|(line, p)| (line, p.join("::")))
        .collect();
    let want = [
        (1, "super::a"),
        (1, "super::b"),
        (1, "super::b::X"),
        (5, "super::super::c::Y"),
        (7, "crate::d::f"),
    ];
    assert_eq!(paths, want.map(|(l, p)| (l, p.to_string())));
    let inline = inline_modules(&code);
    assert_eq!(
        (inline[4].clone(), inline[5].len()),
        (vec!["tests".to_string()], 0)
    );
    let modules = [vec![], vec!["m".into()], vec!["m".into(), "c".into()]];
    let modules: BTreeSet<Vec<String>> = modules.into_iter().collect();
    let base = ["m", "file", "tests"].map(String::from);
    let path = ["super", "super", "c", "Y"].map(String::from);
    assert_eq!(
        resolve(&base, &path, &modules),
        Some(["m", "c"].map(String::from).to_vec())
    );
}
