//! Hot reload of the policy file: its folder is watched (editors replace files by rename, which
//! a watch on the file itself would lose) and changes to the file are debounced into
//! `Tenancy::reload` on a thread of its own.

use std::sync::{mpsc, Arc};
use std::time::Duration;

use notify::{RecursiveMode, Watcher};

use super::Tenancy;

const QUIET: Duration = Duration::from_millis(50);

pub fn watch(tenancy: Arc<Tenancy>) -> notify::Result<notify::RecommendedWatcher> {
    let path = tenancy.path.clone().expect("watch needs a policy file");
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."))
        .to_path_buf();
    let name = path.file_name().map(|n| n.to_os_string());
    let (tx, rx) = mpsc::channel::<()>();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if ev.is_ok_and(|ev| {
            ev.paths
                .iter()
                .any(|p| p.file_name().map(|n| n.to_os_string()) == name)
        }) {
            let _ = tx.send(());
        }
    })?;
    watcher.watch(&dir, RecursiveMode::NonRecursive)?;
    std::thread::Builder::new()
        .name("policy-watch".into())
        .spawn(move || {
            while rx.recv().is_ok() {
                while rx.recv_timeout(QUIET).is_ok() {}
                tenancy.reload();
            }
        })
        .map_err(|e| notify::Error::generic(&e.to_string()))?;
    Ok(watcher)
}
