//! `gateway plugin new`: a ready-to-build plugin project in Rust, Python or TypeScript, with
//! a case `gateway plugin run` checks (and, in Rust, a unit test), a README line on deploying
//! it, and the WIT this gateway speaks.

use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context};

use super::build::{Lang, WIT};
use crate::plugins::PluginKind;

macro_rules! by_kind {
    ($dir:literal, $ext:literal) => {
        [
            include_str!(concat!("templates/", $dir, "/prompt-template.", $ext)),
            include_str!(concat!("templates/", $dir, "/reranker.", $ext)),
            include_str!(concat!("templates/", $dir, "/output-parser.", $ext)),
            include_str!(concat!("templates/", $dir, "/logits-processor.", $ext)),
            include_str!(concat!("templates/", $dir, "/cache-key.", $ext)),
        ]
    };
}

const RUST: [&str; 5] = by_kind!("rust", "rs");
const PYTHON: [&str; 5] = by_kind!("python", "py");
const TYPESCRIPT: [&str; 5] = by_kind!("js", "ts");
const CASE: [&str; 5] = by_kind!("case", "json");

fn index(kind: PluginKind) -> usize {
    PluginKind::ALL
        .iter()
        .position(|k| *k == kind)
        .expect("ALL lists every kind")
}

/// The policy key that binds a plugin of `kind`.
fn binding(kind: PluginKind) -> &'static str {
    match kind {
        PluginKind::PromptTemplate => "prompt_template",
        PluginKind::Reranker => "reranker",
        PluginKind::OutputParser => "output_parser",
        PluginKind::LogitsProcessor => "logits_processor",
        PluginKind::CacheKey => "cache_key",
    }
}

/// `guest-sdk` beside this gateway's sources, when they are where it was built from.
fn default_sdk() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest-sdk");
    p.join("Cargo.toml")
        .exists()
        .then(|| p.canonicalize().ok())?
}

/// The project's files (path, text with `{{name}}`/`{{kind}}` still to fill).
fn files(
    kind: PluginKind,
    lang: Lang,
    sdk: Option<&Path>,
) -> anyhow::Result<Vec<(&'static str, String)>> {
    let i = index(kind);
    let mut files: Vec<(&str, String)> = vec![
        ("case.json", CASE[i].to_string()),
        (
            ".gitignore",
            include_str!("templates/gitignore").to_string(),
        ),
    ];
    let (lang_title, test_line) = match lang {
        Lang::Rust => {
            let Some(sdk) = sdk.map(Path::to_path_buf).or_else(default_sdk) else {
                bail!("where is the guest SDK? pass --sdk <gateway sources>/guest-sdk");
            };
            let dep = format!("{{ path = {:?} }}", sdk.display().to_string());
            let manifest = include_str!("templates/rust/Cargo.toml").replace("{{sdk}}", &dep);
            files.push(("Cargo.toml", manifest));
            files.push(("src/lib.rs", RUST[i].to_string()));
            ("Rust", "    cargo test                                              # the unit test, natively")
        }
        Lang::Python => {
            files.push(("app.py", PYTHON[i].to_string()));
            ("Python (componentize-py)", "")
        }
        Lang::Js => {
            let tsconfig = include_str!("templates/js/tsconfig.json");
            files.push(("tsconfig.json", tsconfig.to_string()));
            files.push(("src/plugin.ts", TYPESCRIPT[i].to_string()));
            let types = include_str!("templates/js/gateway.d.ts");
            files.push(("src/gateway.d.ts", types.to_string()));
            ("TypeScript (componentize-js)", "")
        }
    };
    if lang != Lang::Rust {
        // For editors (`componentize-py -d wit -w <kind> bindings .`); the build uses the
        // gateway's own copy.
        files.push(("wit/plugins.wit", WIT.to_string()));
        let lang = if lang == Lang::Python {
            "python"
        } else {
            "typescript"
        };
        let manifest = include_str!("templates/plugin.toml").replace("{{lang}}", lang);
        files.push(("plugin.toml", manifest));
    }
    let readme = include_str!("templates/README.md")
        .replace("{{lang_title}}", lang_title)
        .replace("{{test_line}}", test_line)
        .replace("{{binding}}", binding(kind));
    files.push(("README.md", readme));
    Ok(files)
}

/// Creates `<parent>/<name>`; returns its path. `sdk`: the guest SDK's folder for a Rust
/// project (default: the one in this gateway's source tree).
pub fn new(
    parent: &Path,
    name: &str,
    kind: PluginKind,
    lang: Lang,
    sdk: Option<&Path>,
) -> anyhow::Result<PathBuf> {
    let ok = name.len() <= 64
        && name.starts_with(|c: char| c.is_ascii_lowercase())
        && name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if !ok {
        bail!(
            "plugin name {name:?}: use lowercase letters, digits and '-', starting with a letter"
        );
    }
    let dir = parent.join(name);
    if dir.exists() {
        bail!("{} already exists", dir.display());
    }
    for (rel, text) in files(kind, lang, sdk)? {
        let path = dir.join(rel);
        let parent = path.parent().ok_or_else(|| anyhow!("no parent of {rel}"))?;
        std::fs::create_dir_all(parent)
            .with_context(|| format!("creating {}", parent.display()))?;
        let text = text
            .replace("{{name}}", name)
            .replace("{{kind}}", kind.as_str());
        std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(dir)
}
