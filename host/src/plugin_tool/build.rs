//! `gateway plugin build DIR`: one command for every language a plugin may be written in. The
//! project's `plugin.toml` names its kind and language (a Rust crate needs none); the build
//! runs the language's own toolchain against the WIT this gateway speaks, so a component
//! built here always matches the loader.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{anyhow, bail, Context};
use serde::Deserialize;

use crate::plugins::PluginKind;

/// The contract, as compiled into this gateway.
pub const WIT: &str = include_str!("../../../wit/plugins.wit");

/// The pinned toolchains; `build` says how to install a missing one.
pub const COMPONENTIZE_PY: &str = "componentize-py==0.25.1";
pub const COMPONENTIZE_JS: &str = "@bytecodealliance/componentize-js@0.23.0";
pub const TYPESCRIPT: &str = "typescript@5.9.3";

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Lang {
    Rust,
    Python,
    /// TypeScript (compiled with `tsc`) or JavaScript.
    #[value(alias = "ts", alias = "typescript")]
    Js,
}

/// `plugin.toml`: what a non-Rust project is.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub name: String,
    pub kind: String,
    pub lang: String,
    /// Python: the module defining `WitWorld` (default `app`). JS: the entry file (default
    /// `src/plugin.ts`, or `plugin.js` without a `tsconfig.json`).
    pub entry: Option<String>,
}

impl Manifest {
    pub fn read(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join("plugin.toml");
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let m: Manifest =
            toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
        PluginKind::parse(&m.kind).ok_or_else(|| {
            anyhow!(
                "{}: kind {:?} is none of {}",
                path.display(),
                m.kind,
                PluginKind::ALL.map(PluginKind::as_str).join(", ")
            )
        })?;
        Ok(m)
    }

    fn lang(&self) -> anyhow::Result<Lang> {
        match self.lang.as_str() {
            "rust" => Ok(Lang::Rust),
            "python" => Ok(Lang::Python),
            "js" | "javascript" | "ts" | "typescript" => Ok(Lang::Js),
            other => {
                bail!("plugin.toml: lang {other:?} is none of rust, python, typescript, javascript")
            }
        }
    }
}

/// A folder of its own under the user's cache (`~/.cache/gateway/<what>`).
pub fn cache_dir(what: &str) -> Option<PathBuf> {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .map(|c| c.join("gateway").join(what))
}

fn run(cmd: &mut Command, what: &str) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("starting {what} ({:?})", cmd.get_program()))?;
    if !status.success() {
        bail!("{what} failed ({status})");
    }
    Ok(())
}

/// Builds the project in `dir` into `out` (default `<dir>/<name>.wasm`); returns the path.
pub fn build(dir: &Path, out: Option<&Path>) -> anyhow::Result<PathBuf> {
    let dir = dir
        .canonicalize()
        .with_context(|| format!("no project folder {}", dir.display()))?;
    if !dir.join("plugin.toml").exists() && dir.join("Cargo.toml").exists() {
        return build_rust(&dir, out);
    }
    let m = Manifest::read(&dir)?;
    let out = out.map_or_else(|| dir.join(format!("{}.wasm", m.name)), Path::to_path_buf);
    let out = std::path::absolute(&out)?;
    // The WIT goes to a scratch folder of the build's own: the toolchains read it from a
    // relative path (componentize-js sees only its working folder).
    let scratch = Scratch::new()?;
    std::fs::create_dir(scratch.0.join("wit"))?;
    std::fs::write(scratch.0.join("wit/plugins.wit"), WIT)?;
    match m.lang()? {
        Lang::Rust => return build_rust(&dir, Some(&out)),
        Lang::Python => build_python(&dir, &m, &scratch.0, &out)?,
        Lang::Js => build_js(&dir, &m, &scratch.0, &out)?,
    }
    Ok(out)
}

/// A temporary folder, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> anyhow::Result<Self> {
        let p = std::env::temp_dir().join(format!(
            "gateway-plugin-build-{}-{}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir_all(&p)?;
        Ok(Self(p))
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn build_python(dir: &Path, m: &Manifest, scratch: &Path, out: &Path) -> anyhow::Result<()> {
    let tool = which("componentize-py").ok_or_else(|| {
        anyhow!("componentize-py is not installed: python3 -m pip install {COMPONENTIZE_PY}")
    })?;
    // From a copy: the interpreter componentize-py runs at build time writes `__pycache__`
    // next to the sources it imports, whatever PYTHONDONTWRITEBYTECODE says.
    let src = scratch.join("src");
    copy_sources(dir, &src)?;
    run(
        Command::new(tool)
            .current_dir(scratch)
            .args(["-d", "wit", "-w", &m.kind, "componentize"])
            .arg(m.entry.as_deref().unwrap_or("app"))
            .args(["-p", "src", "-o"])
            .arg(out),
        "componentize-py",
    )
}

/// The project's files without build output, caches, hidden folders or components.
fn copy_sources(from: &Path, to: &Path) -> anyhow::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let name = entry.file_name();
        let name = name.to_string_lossy();
        let skip = name.starts_with('.')
            || ["__pycache__", "target", "dist", "node_modules"].contains(&name.as_ref())
            || name.ends_with(".wasm");
        if skip {
            continue;
        }
        let (src, dst) = (entry.path(), to.join(entry.file_name()));
        if entry.file_type()?.is_dir() {
            copy_sources(&src, &dst)?;
        } else {
            std::fs::copy(&src, &dst)?;
        }
    }
    Ok(())
}

/// `componentize-js` and `tsc`: on the PATH, or in `~/.cache/gateway/js-tools` where the
/// install hint puts them.
fn js_tool(name: &str) -> anyhow::Result<PathBuf> {
    which(name)
        .or_else(|| {
            let p = cache_dir("js-tools")?.join("node_modules/.bin").join(name);
            p.exists().then_some(p)
        })
        .ok_or_else(|| {
            anyhow!(
                "{name} is not installed: npm install --prefix {} {COMPONENTIZE_JS} {TYPESCRIPT}",
                cache_dir("js-tools").map_or("<folder>".into(), |p| p.display().to_string())
            )
        })
}

fn build_js(dir: &Path, m: &Manifest, scratch: &Path, out: &Path) -> anyhow::Result<()> {
    let typescript = dir.join("tsconfig.json").exists();
    let default_entry = if typescript {
        "src/plugin.ts"
    } else {
        "plugin.js"
    };
    let entry = dir.join(m.entry.as_deref().unwrap_or(default_entry));
    let js = if typescript {
        // Compiled into the scratch folder: the project stays free of build output.
        let js_dir = scratch.join("js");
        run(
            Command::new(js_tool("tsc")?)
                .arg("-p")
                .arg(dir)
                .arg("--outDir")
                .arg(&js_dir),
            "tsc",
        )?;
        let stem = entry
            .file_stem()
            .ok_or_else(|| anyhow!("no entry file name"))?;
        js_dir.join(stem).with_extension("js")
    } else {
        entry
    };
    run(
        Command::new(js_tool("componentize-js")?)
            .current_dir(scratch)
            .args(["--wit", "wit", "--world-name", &m.kind])
            // No outbound HTTP: the gateway grants plugins no network.
            .args(["--disable", "http", "fetch-event", "-o"])
            .arg(out)
            .arg(js),
        "componentize-js",
    )
}

/// A Rust crate, built for `wasm32-wasip2` into a target folder shared by every plugin (the
/// environment's `CARGO_TARGET_DIR`, else `~/.cache/gateway/plugin-target`), so a second
/// plugin does not compile wit-bindgen again.
fn build_rust(dir: &Path, out: Option<&Path>) -> anyhow::Result<PathBuf> {
    let manifest: toml::Table = toml::from_str(&std::fs::read_to_string(dir.join("Cargo.toml"))?)?;
    let name = manifest
        .get("package")
        .and_then(|p| p.get("name"))
        .and_then(|n| n.as_str())
        .ok_or_else(|| anyhow!("{}/Cargo.toml has no package name", dir.display()))?
        .to_string();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .or_else(|| cache_dir("plugin-target"))
        .ok_or_else(|| anyhow!("no CARGO_TARGET_DIR and no home folder for the target folder"))?;
    run(
        Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
            .current_dir(dir)
            .args([
                "build",
                "--release",
                "--target",
                "wasm32-wasip2",
                "--target-dir",
            ])
            .arg(&target)
            // Components carry no debug info: smaller files, faster loading in the gateway.
            .env("CARGO_PROFILE_RELEASE_DEBUG", "false"),
        "cargo build (needs `rustup target add wasm32-wasip2`)",
    )?;
    let built = target.join(format!(
        "wasm32-wasip2/release/{}.wasm",
        name.replace('-', "_")
    ));
    let out = out.map_or_else(|| dir.join(format!("{name}.wasm")), Path::to_path_buf);
    std::fs::copy(&built, &out).with_context(|| format!("copying {}", built.display()))?;
    Ok(out)
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}
