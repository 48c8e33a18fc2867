//! Hot reload of the policy file: its folder is watched and changes to the file are debounced
//! into `Tenancy::reload` on a thread of its own.

use std::sync::Arc;
use std::time::Duration;

use super::Tenancy;
use crate::common::Watch;

const QUIET: Duration = Duration::from_millis(50);

pub fn watch(tenancy: Arc<Tenancy>) -> notify::Result<Watch> {
    let path = tenancy.path.clone().expect("watch needs a policy file");
    let name = path.file_name().map(|n| n.to_os_string());
    let relevant = move |p: &std::path::Path| {
        p.file_name().map(|n| n.to_os_string()) == name || crate::common::kubernetes_swap(p)
    };
    let dirs = [(crate::common::parent_dir(&path), false)];
    crate::common::watch("policy-watch", &dirs, relevant, QUIET, move || {
        tenancy.reload()
    })
}
