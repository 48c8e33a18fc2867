//! Hot reload from the plugin directory: filesystem events (inotify on Linux, through
//! `notify`) trigger a debounced `Registry::sync_dir` on a thread of its own, so compiling a
//! new version never runs on a request's path.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

use super::Registry;

/// Events closer together than this are one change (a copy arrives in several writes).
const QUIET: Duration = Duration::from_millis(100);

/// Watches the registry's directory until the returned watcher is dropped.
pub fn watch(registry: Arc<Registry>) -> notify::Result<notify::RecommendedWatcher> {
    let dir = registry
        .dir()
        .expect("watch needs a plugin directory")
        .to_path_buf();
    let (tx, rx) = mpsc::channel::<()>();
    let root = dir.clone();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        let relevant = ev.is_ok_and(|ev| {
            ev.paths.iter().any(|p| {
                let rel = p.strip_prefix(&root).unwrap_or(p);
                let hidden = rel
                    .components()
                    .any(|c| c.as_os_str().to_string_lossy().starts_with('.'));
                !hidden && (p.extension().is_none_or(|e| e == "wasm" || e == "toml"))
            })
        });
        if relevant {
            let _ = tx.send(());
        }
    })?;
    watcher.watch(&dir, RecursiveMode::Recursive)?;
    std::thread::Builder::new()
        .name("plugin-watch".into())
        .spawn(move || {
            while rx.recv().is_ok() {
                while rx.recv_timeout(QUIET).is_ok() {}
                registry.sync_dir();
            }
        })
        .map_err(|e| notify::Error::generic(&e.to_string()))?;
    Ok(watcher)
}
