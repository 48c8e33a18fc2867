//! Hot reload from the plugin directory: filesystem events (inotify on Linux, through
//! `notify`) trigger a debounced `Registry::sync_dir` on a thread of its own, so compiling a
//! new version never runs on a request's path.

use std::sync::Arc;
use std::time::Duration;

use super::Registry;
use crate::common::Watch;

/// Events closer together than this are one change (a copy arrives in several writes).
const QUIET: Duration = Duration::from_millis(100);

/// Watches the registry's directory until the returned watch is dropped.
pub fn watch(registry: Arc<Registry>) -> notify::Result<Watch> {
    let dir = registry
        .dir()
        .expect("watch needs a plugin directory")
        .to_path_buf();
    let root = dir.clone();
    // Component and manifest files, and folders; not the hidden compile cache; a mounted
    // ConfigMap's swap.
    let relevant = move |p: &std::path::Path| {
        let rel = p.strip_prefix(&root).unwrap_or(p);
        let hidden = rel
            .components()
            .any(|c| c.as_os_str().to_string_lossy().starts_with('.'));
        let file = p.extension().is_none_or(|e| e == "wasm" || e == "toml");
        (!hidden && file) || crate::common::kubernetes_swap(p)
    };
    crate::common::watch("plugin-watch", &[(dir, true)], relevant, QUIET, move || {
        registry.sync_dir();
    })
}
