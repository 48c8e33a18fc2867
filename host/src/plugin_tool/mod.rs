//! `gateway plugin check` and `gateway plugin run`: a plugin author's loop without a server or
//! a model. `check` runs the loader's full validation (component, world, imports) and says
//! what the file is; `run` makes one call in the same sandbox as the server (same deadline and
//! memory cap, from the same `[plugins]` settings) and prints the result and its timing.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, Context};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};

use crate::config::PluginsConfig;
use crate::plugins::{ConfigValue, Plugin, Registry, Runtime, TenantValues};

pub mod build;
mod calls;
pub mod cli;
mod expected;
pub mod scaffold;

fn load(path: &Path, cfg: &PluginsConfig) -> anyhow::Result<(Arc<Plugin>, Arc<Runtime>, f64)> {
    let wasm = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    // One cache folder per component file: the registry prunes its cache to the plugins it
    // holds, so a folder shared by every file would keep only the last one run.
    let mut cfg = cfg.clone();
    if let Some(root) = &cfg.cache_dir {
        let key = std::path::absolute(path)?;
        let key = crate::plugins::hex(&Sha256::digest(key.as_os_str().as_encoded_bytes()));
        let dir = root.join(&key[..16]);
        // The use time orders the folders when the cache is trimmed.
        let _ = std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(dir.join("used"), b""));
        trim_cache(root, CACHE_BUDGET);
        cfg.cache_dir = Some(dir);
    }
    let rt = Runtime::new(&cfg).map_err(|e| anyhow!("starting the plugin runtime: {e}"))?;
    let registry = Registry::new(rt.clone(), None);
    let started = Instant::now();
    let plugin = registry
        .install("local", "plugin", &wasm, None)
        .map_err(|e| anyhow!("{}: {e}", path.display()))?;
    Ok((plugin, rt, started.elapsed().as_secs_f64() * 1e3))
}

/// What the per-file compile caches may hold in all: ~25 Python or TypeScript components.
const CACHE_BUDGET: u64 = 1 << 30;

/// Deletes the least recently used per-file folders under `root` until the rest fit in
/// `budget` bytes: every file run gets a folder, and files in temporary project folders
/// (scaffolds, CI) would otherwise pile up compiled code without end.
fn trim_cache(root: &Path, budget: u64) {
    let Ok(entries) = std::fs::read_dir(root) else {
        return;
    };
    let mut folders: Vec<(std::time::SystemTime, u64, std::path::PathBuf)> = entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| {
            let files: Vec<std::fs::Metadata> = std::fs::read_dir(e.path())
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|f| f.metadata().ok())
                .collect();
            let used = files.iter().filter_map(|m| m.modified().ok()).max();
            let size = files.iter().map(std::fs::Metadata::len).sum();
            (used.unwrap_or(std::time::UNIX_EPOCH), size, e.path())
        })
        .collect();
    folders.sort_by_key(|f| std::cmp::Reverse(f.0));
    let mut total = 0;
    for (_, size, path) in folders {
        total += size;
        if total > budget {
            if let Err(e) = std::fs::remove_dir_all(&path) {
                tracing::warn!(path = %path.display(), error = %e, "could not trim the plugin compile cache");
            }
        }
    }
}

/// What `check` prints for a component that loads; an error says why it does not.
pub fn check(path: &Path, cfg: &PluginsConfig) -> anyhow::Result<String> {
    let (p, _, ms) = load(path, cfg)?;
    Ok(format!(
        "{}: a {} plugin (world `{}` of gateway:plugins@{}), {} bytes, sha256 {}, compiled and linked in {ms:.0} ms",
        path.display(),
        p.kind(),
        p.kind(),
        p.wit_version(),
        p.size,
        p.sha256
    ))
}

/// The configuration a call sees: the case's own `config` object (typed as a policy's would
/// be), then `--config-value`s: JSON when the value parses as a string, number, boolean or
/// array of strings (`n=3`, `tags=["a","b"]`), text otherwise.
fn values(input: &Value, cli: BTreeMap<String, String>) -> anyhow::Result<TenantValues> {
    let mut values = BTreeMap::new();
    if let Some(cfg) = input["config"].as_object() {
        for (k, v) in cfg {
            let v = ConfigValue::try_from(v.clone()).map_err(|e| anyhow!("config.{k}: {e}"))?;
            values.insert(k.clone(), v);
        }
    }
    for (k, v) in cli {
        let typed = serde_json::from_str::<Value>(&v)
            .ok()
            .and_then(|j| ConfigValue::try_from(j).ok());
        values.insert(k, typed.unwrap_or(ConfigValue::Text(v)));
    }
    Ok(Arc::new(values))
}

/// Calls `path` with `input` (the world's arguments as JSON, see the README; `config` and
/// `expect` keys are the case's tenant configuration and expected result), `repeat` times.
/// Returns the first result with its timing, the later calls' p50/p99, and whether the result
/// matched `expect` (a mismatch is an error).
pub async fn run(
    path: &Path,
    input: &Value,
    config: BTreeMap<String, String>,
    cfg: &PluginsConfig,
    repeat: usize,
) -> anyhow::Result<Value> {
    let (p, rt, compile_ms) = load(path, cfg)?;
    let values = values(input, config)?;
    let mut times = Vec::with_capacity(repeat.max(1));
    let mut result = Value::Null;
    for _ in 0..repeat.max(1) {
        let started = Instant::now();
        result = calls::call(&p, &rt, &values, input).await?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
    }
    let mut out = json!({"kind": p.kind().as_str(), "result": result,
                         "compile_ms": compile_ms, "call_ms": times[0]});
    if times.len() > 1 {
        let mut later = times[1..].to_vec();
        later.sort_by(f64::total_cmp);
        let at = |q: f64| later[((later.len() - 1) as f64 * q).round() as usize];
        out["later_calls"] = json!({"n": later.len(), "p50_ms": at(0.5), "p99_ms": at(0.99)});
    }
    if let Some(expect) = input.get("expect") {
        expected::check(expect, &out["result"], "result")
            .map_err(|e| anyhow!("the result does not match `expect`: {e}\n{}", out["result"]))?;
        out["expect"] = json!("ok");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_compile_cache_keeps_the_most_recently_used_folders_within_its_budget() {
        let root = std::env::temp_dir().join(format!("plugin-cache-{}", rand::random::<u64>()));
        for (i, name) in ["old", "mid", "new"].iter().enumerate() {
            let dir = root.join(name);
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(dir.join("a.cwasm"), vec![0u8; 100]).unwrap();
            let t = std::time::UNIX_EPOCH + std::time::Duration::from_secs(1_000 * (i as u64 + 1));
            let f = std::fs::File::options()
                .write(true)
                .open(dir.join("a.cwasm"))
                .unwrap();
            f.set_modified(t).unwrap();
        }
        trim_cache(&root, 250);
        let mut left: Vec<String> = std::fs::read_dir(&root)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["mid", "new"]);
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn a_file_that_is_not_a_component_is_one_clear_line() {
        let dir = std::env::temp_dir().join(format!("plugin-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("x.wasm");
        std::fs::write(&f, b"\0asm\x01\0\0\0").unwrap();
        let err = check(&f, &PluginsConfig::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains("core WebAssembly module"), "{err}");
        let _ = std::fs::remove_dir_all(dir);
    }
}
