//! The spill file (JSON lines): where rows go while the ledger's store refuses writes, until
//! they are replayed into it. Bounded: past `max_bytes` it refuses rows like a full disk.

use std::io::{BufRead, Write};
use std::path::Path;

use super::Row;

/// Appends `rows` to the spill file and syncs it; on failure the file is cut back to where it
/// was, so a half-written line never follows.
pub(super) fn append(path: &Path, rows: &[Row], max_bytes: u64) -> std::io::Result<()> {
    let mut text = Vec::new();
    for r in rows {
        serde_json::to_writer(&mut text, r).map_err(std::io::Error::other)?;
        text.push(b'\n');
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    let before = f.metadata()?.len();
    if before + text.len() as u64 > max_bytes {
        return Err(std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            format!("the spill file has reached its limit of {max_bytes} bytes"),
        ));
    }
    let written = f.write_all(&text).and_then(|()| f.sync_data());
    if written.is_err() {
        let _ = f.set_len(before);
    }
    written
}

pub(super) fn read(path: &Path) -> std::io::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for line in std::io::BufReader::new(std::fs::File::open(path)?).lines() {
        let line = line?;
        match serde_json::from_str(&line) {
            Ok(r) => rows.push(r),
            Err(e) => tracing::error!(error = %e, "skipping an unreadable usage ledger spill line"),
        }
    }
    Ok(rows)
}

pub(super) fn count(path: &Path) -> usize {
    std::fs::File::open(path)
        .map(|f| std::io::BufReader::new(f).lines().count())
        .unwrap_or(0)
}
