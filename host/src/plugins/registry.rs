//! Installed plugins per tenant, swapped atomically. Readers take an `Arc<Plugin>` and keep it
//! for the whole call, so replacing or removing a plugin never disturbs a call in flight.
//! Writers (directory sync, admin API) are serialised by one mutex and never block readers.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use sha2::{Digest, Sha256};

use super::{valid_name, LoadError, Plugin, PluginKind, Runtime};
use crate::common::{hex, write_atomically};

type Key = (String, String);

/// Beside the plugins: a copy of each plugin's last version that loaded, so a rejected file
/// dropped over a working one cannot lose the plugin at the next restart.
const LAST_GOOD: &str = ".last-good";
/// `<dir>/.previous/<tenant>/<name>.wasm`: the version the last good one replaced, which an
/// admin may roll back to.
const PREVIOUS: &str = ".previous";

pub struct Registry {
    runtime: Arc<Runtime>,
    /// `<dir>/<tenant>/<name>.wasm`, with an optional `<name>.toml` manifest beside it.
    dir: Option<PathBuf>,
    plugins: ArcSwap<BTreeMap<Key, Arc<Plugin>>>,
    /// Serialises writers; remembers each rejected file (by content and manifest), so an
    /// unchanged bad file is not recompiled (and re-logged) on every directory event, and so
    /// admins can see why.
    writer: Mutex<HashMap<PathBuf, Rejected>>,
}

struct Rejected {
    key: Key,
    /// `<sha256>:<manifest>` of the file that was refused.
    attempt: String,
    sha256: String,
    reason: String,
    at: SystemTime,
}

/// A plugin file that did not load, and what serves instead.
#[derive(Debug, Clone)]
pub struct Rejection {
    pub tenant: String,
    pub name: String,
    pub sha256: String,
    pub reason: String,
    pub at: SystemTime,
}

/// What one directory sync did.
#[derive(Debug, Default, PartialEq)]
pub struct SyncReport {
    pub loaded: Vec<String>,
    pub removed: Vec<String>,
    pub rejected: Vec<String>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Manifest {
    kind: PluginKind,
}

impl Registry {
    pub fn new(runtime: Arc<Runtime>, dir: Option<PathBuf>) -> Self {
        Self {
            runtime,
            dir,
            plugins: ArcSwap::default(),
            writer: Mutex::default(),
        }
    }

    pub fn runtime(&self) -> &Arc<Runtime> {
        &self.runtime
    }

    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    pub fn get(&self, tenant: &str, name: &str) -> Option<Arc<Plugin>> {
        self.plugins
            .load()
            .get(&(tenant.to_string(), name.to_string()))
            .cloned()
    }

    pub fn list(&self) -> Vec<Arc<Plugin>> {
        self.plugins.load().values().cloned().collect()
    }

    /// Files in the plugin directory that were refused, with the reason.
    pub fn rejections(&self) -> Vec<Rejection> {
        let rejected = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<Rejection> = rejected
            .values()
            .map(|r| Rejection {
                tenant: r.key.0.clone(),
                name: r.key.1.clone(),
                sha256: r.sha256.clone(),
                reason: r.reason.clone(),
                at: r.at,
            })
            .collect();
        out.sort_by(|a, b| (&a.tenant, &a.name).cmp(&(&b.tenant, &b.name)));
        out
    }

    /// Why the tenant's plugin file `name` was refused, if it was.
    pub fn rejection(&self, tenant: &str, name: &str) -> Option<String> {
        let k = key(tenant, name);
        let rejected = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        rejected
            .values()
            .find(|r| r.key == k)
            .map(|r| r.reason.clone())
    }

    /// Compiles and checks `wasm`, then makes it the tenant's plugin `name`. With a plugin
    /// directory the file (and a manifest naming the kind) is written there first, so the
    /// upload survives a restart. On error nothing changes.
    pub fn install(
        &self,
        tenant: &str,
        name: &str,
        wasm: &[u8],
        kind: Option<PluginKind>,
    ) -> Result<Arc<Plugin>, LoadError> {
        let plugin = self.prepare(tenant, name, wasm, kind)?;
        self.put(plugin, wasm)
    }

    /// Compiles and checks `wasm` as the tenant's plugin `name`, changing nothing: what
    /// `put` then serves (after, say, the upload is stored for the other replicas).
    pub fn prepare(
        &self,
        tenant: &str,
        name: &str,
        wasm: &[u8],
        kind: Option<PluginKind>,
    ) -> Result<Arc<Plugin>, LoadError> {
        check_names(tenant, name)?;
        self.build(tenant, name, wasm, kind)
    }

    /// Serves a prepared plugin (`wasm` is its component), writing it to the plugin directory
    /// first when there is one.
    pub fn put(&self, plugin: Arc<Plugin>, wasm: &[u8]) -> Result<Arc<Plugin>, LoadError> {
        let (tenant, name) = (&*plugin.tenant, &*plugin.name);
        let _writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(dir) = &self.dir {
            let base = dir.join(tenant);
            write_atomically(
                &base.join(format!("{name}.toml")),
                format!("kind = \"{}\"\n", plugin.kind()).as_bytes(),
            )?;
            write_atomically(&base.join(format!("{name}.wasm")), wasm)?;
            keep_last_good(dir, tenant, name, wasm, plugin.kind());
        }
        self.swap(|m| {
            m.insert(key(tenant, name), plugin.clone());
        });
        Ok(plugin)
    }

    /// The SHA-256 and size of the version `name`'s current one replaced, if it is still kept.
    pub fn previous_info(&self, tenant: &str, name: &str) -> Option<(String, u64)> {
        let base = self.dir.as_ref()?.join(PREVIOUS).join(tenant);
        let sha = std::fs::read_to_string(base.join(format!("{name}.sha256"))).ok()?;
        let size = std::fs::metadata(base.join(format!("{name}.wasm")))
            .ok()?
            .len();
        Some((sha.trim().to_string(), size))
    }

    /// The version `name`'s current one replaced (its component and kind), if still kept.
    pub fn previous(&self, tenant: &str, name: &str) -> Option<(Vec<u8>, Option<PluginKind>)> {
        check_names(tenant, name).ok()?;
        let base = self.dir.as_ref()?.join(PREVIOUS).join(tenant);
        let wasm = std::fs::read(base.join(format!("{name}.wasm"))).ok()?;
        let kind = manifest_kind(&base.join(format!("{name}.toml"))).ok()?;
        Some((wasm, kind))
    }

    /// Removes the tenant's plugin `name` (and its files). Calls in flight finish on it.
    pub fn remove(&self, tenant: &str, name: &str) -> Result<bool, LoadError> {
        check_names(tenant, name)?;
        let _writer = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(dir) = &self.dir {
            remove_files(&dir.join(tenant), name)?;
            remove_files(&dir.join(LAST_GOOD).join(tenant), name)?;
            remove_files(&dir.join(PREVIOUS).join(tenant), name)?;
        }
        let mut existed = false;
        self.swap(|m| existed = m.remove(&key(tenant, name)).is_some());
        Ok(existed)
    }

    /// Brings the registry in line with the plugin directory: new and changed files are
    /// compiled and swapped in, files that are gone are removed, and a file that fails to
    /// load leaves the previous version serving.
    pub fn sync_dir(&self) -> SyncReport {
        let mut report = SyncReport::default();
        let Some(dir) = &self.dir else { return report };
        let mut rejected = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        let found = scan(dir);
        let current = self.plugins.load_full();
        let mut next = (*current).clone();
        for ((tenant, name), path) in &found {
            let label = format!("{tenant}/{name}");
            let wasm = match std::fs::read(path) {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(plugin = %label, error = %e, "could not read plugin file");
                    continue;
                }
            };
            let sha = hex(&Sha256::digest(&wasm));
            let manifest_path = path.with_extension("toml");
            // A rejection is remembered per (component, manifest) pair: fixing either retries.
            let manifest = std::fs::read_to_string(&manifest_path).unwrap_or_default();
            let attempt = format!("{sha}:{manifest}");
            if current
                .get(&key(tenant, name))
                .is_some_and(|p| p.sha256 == sha)
                || rejected.get(path).is_some_and(|r| r.attempt == attempt)
            {
                continue;
            }
            let built = manifest_kind(&manifest_path)
                .and_then(|kind| self.build(tenant, name, &wasm, kind));
            match built {
                Ok(plugin) => {
                    tracing::info!(plugin = %label, kind = %plugin.kind(), sha256 = %&sha[..12], "plugin loaded");
                    keep_last_good(dir, tenant, name, &wasm, plugin.kind());
                    rejected.remove(path);
                    next.insert(key(tenant, name), plugin);
                    report.loaded.push(label);
                }
                Err(e) => {
                    let serving = current.contains_key(&key(tenant, name));
                    if let Some(p) = self.fallback(dir, (tenant, name), serving, &e) {
                        next.insert(key(tenant, name), p);
                        report.loaded.push(label.clone());
                    }
                    rejected.insert(
                        path.clone(),
                        Rejected {
                            key: key(tenant, name),
                            attempt,
                            sha256: sha,
                            reason: e.to_string(),
                            at: SystemTime::now(),
                        },
                    );
                    report.rejected.push(label);
                }
            }
        }
        next.retain(|k, _| {
            let keep = found.contains_key(k);
            if !keep {
                report.removed.push(removed(dir, k));
            }
            keep
        });
        rejected.retain(|p, _| p.exists());
        if !report.loaded.is_empty() || !report.removed.is_empty() || !report.rejected.is_empty() {
            self.runtime
                .prune_cache(&next.values().map(|p| p.sha256.as_str()).collect());
        }
        if !report.loaded.is_empty() || !report.removed.is_empty() {
            self.plugins.store(Arc::new(next));
        }
        report
    }

    /// Logs a rejected file and returns what serves in its place when the plugin is not in
    /// service (a restart): its kept last good copy, if any. A serving plugin keeps serving.
    fn fallback(
        &self,
        dir: &Path,
        (tenant, name): (&str, &str),
        serving: bool,
        e: &LoadError,
    ) -> Option<Arc<Plugin>> {
        let fallback = match serving {
            true => None,
            false => self.last_good(dir, tenant, name),
        };
        let kept = match (serving, &fallback) {
            (true, _) => "; the previous version stays",
            (false, Some(_)) => "; serving the last version that loaded",
            (false, None) => "",
        };
        tracing::warn!(plugin = %format!("{tenant}/{name}"), error = %e, "plugin rejected{kept}");
        fallback
    }

    /// The plugin's last version that loaded, if a copy was kept and still loads.
    fn last_good(&self, dir: &Path, tenant: &str, name: &str) -> Option<Arc<Plugin>> {
        let base = dir.join(LAST_GOOD).join(tenant);
        let wasm = std::fs::read(base.join(format!("{name}.wasm"))).ok()?;
        let kind = manifest_kind(&base.join(format!("{name}.toml"))).ok()?;
        match self.build(tenant, name, &wasm, kind) {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::warn!(plugin = %format!("{tenant}/{name}"), error = %e, "the kept last version does not load either");
                None
            }
        }
    }

    fn build(
        &self,
        tenant: &str,
        name: &str,
        wasm: &[u8],
        kind: Option<PluginKind>,
    ) -> Result<Arc<Plugin>, LoadError> {
        let start = std::time::Instant::now();
        let prepared = self.runtime.prepare(wasm, kind)?;
        Ok(Arc::new(Plugin {
            tenant: tenant.into(),
            name: name.into(),
            sha256: hex(&Sha256::digest(wasm)),
            size: wasm.len(),
            loaded_at: SystemTime::now(),
            load_time: start.elapsed(),
            stats: Default::default(),
            pool: super::warm::Pool::new(&self.runtime),
            prepared,
        }))
    }

    /// Changes the map (under the writer lock) and drops compiled code no plugin uses now.
    fn swap(&self, f: impl FnOnce(&mut BTreeMap<Key, Arc<Plugin>>)) {
        let mut next = (**self.plugins.load()).clone();
        f(&mut next);
        self.runtime
            .prune_cache(&next.values().map(|p| p.sha256.as_str()).collect());
        self.plugins.store(Arc::new(next));
    }
}

/// Keeps a copy of a version that loaded (unless the copy is already this version). Failing
/// to keep it only costs the fallback, so it is logged, not fatal.
fn keep_last_good(dir: &Path, tenant: &str, name: &str, wasm: &[u8], kind: PluginKind) {
    let base = dir.join(LAST_GOOD).join(tenant);
    let path = base.join(format!("{name}.wasm"));
    match std::fs::read(&path) {
        Ok(old) if old == wasm => return,
        Ok(old) => keep_previous(dir, (tenant, name), &old, &base),
        Err(_) => {}
    }
    let manifest = format!("kind = \"{kind}\"\n");
    let kept = write_atomically(&base.join(format!("{name}.toml")), manifest.as_bytes())
        .and_then(|()| write_atomically(&path, wasm));
    if let Err(e) = kept {
        tracing::warn!(plugin = %format!("{tenant}/{name}"), error = %e, "could not keep a copy of the loaded version");
    }
}

/// Keeps the last good version `old` (its manifest read from `from`) as the one to roll back
/// to, with its SHA-256 beside it so listing it reads no component.
fn keep_previous(dir: &Path, (tenant, name): (&str, &str), old: &[u8], from: &Path) {
    let base = dir.join(PREVIOUS).join(tenant);
    let manifest = std::fs::read(from.join(format!("{name}.toml"))).unwrap_or_default();
    let sha = hex(&Sha256::digest(old));
    let kept = write_atomically(&base.join(format!("{name}.toml")), &manifest)
        .and_then(|()| write_atomically(&base.join(format!("{name}.wasm")), old))
        .and_then(|()| write_atomically(&base.join(format!("{name}.sha256")), sha.as_bytes()));
    if let Err(e) = kept {
        tracing::warn!(plugin = %format!("{tenant}/{name}"), error = %e, "could not keep the replaced version for a rollback");
    }
}

/// Logs a plugin whose file was deleted and removes its kept copy too (the deletion was on
/// purpose); returns its label.
fn removed(dir: &Path, k: &Key) -> String {
    let label = format!("{}/{}", k.0, k.1);
    tracing::info!(plugin = %label, "plugin removed");
    for kept in [LAST_GOOD, PREVIOUS] {
        if let Err(e) = remove_files(&dir.join(kept).join(&k.0), &k.1) {
            tracing::warn!(plugin = %label, error = %e, "could not remove a kept version");
        }
    }
    label
}

/// Deletes `<base>/<name>.wasm` and its manifest; files already gone are fine.
fn remove_files(base: &Path, name: &str) -> std::io::Result<()> {
    for ext in ["wasm", "toml", "sha256"] {
        match std::fs::remove_file(base.join(format!("{name}.{ext}"))) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
    }
    Ok(())
}

fn key(tenant: &str, name: &str) -> Key {
    (tenant.to_string(), name.to_string())
}

fn check_names(tenant: &str, name: &str) -> Result<(), LoadError> {
    if !valid_name(tenant) {
        return Err(LoadError::BadName {
            what: "tenant",
            name: tenant.into(),
        });
    }
    if !valid_name(name) {
        return Err(LoadError::BadName {
            what: "plugin name",
            name: name.into(),
        });
    }
    Ok(())
}

/// Every `<tenant>/<name>.wasm` with valid names; anything else (hidden folders such as the
/// compile cache, temporary files) is skipped.
fn scan(dir: &Path) -> BTreeMap<Key, PathBuf> {
    let mut out = BTreeMap::new();
    let Ok(tenants) = std::fs::read_dir(dir) else {
        return out;
    };
    for t in tenants.flatten() {
        let tenant = t.file_name().to_string_lossy().into_owned();
        if !valid_name(&tenant) || !t.path().is_dir() {
            continue;
        }
        let Ok(files) = std::fs::read_dir(t.path()) else {
            continue;
        };
        for f in files.flatten() {
            let path = f.path();
            let Some(name) = path.file_stem().map(|s| s.to_string_lossy().into_owned()) else {
                continue;
            };
            if path.extension().is_some_and(|e| e == "wasm") && valid_name(&name) {
                out.insert((tenant.clone(), name), path);
            }
        }
    }
    out
}

fn manifest_kind(path: &Path) -> Result<Option<PluginKind>, LoadError> {
    match std::fs::read_to_string(path) {
        Ok(text) => toml::from_str::<Manifest>(&text)
            .map(|m| Some(m.kind))
            .map_err(|e| LoadError::Manifest(format!("{}: {e}", path.display()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e.into()),
    }
}
