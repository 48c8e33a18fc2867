//! The usage ledger on a filesystem that fills up (a real 1 MiB tmpfs, mounted for the test):
//! rows of requests already served are kept and written once space returns, new billable
//! requests are refused with 503 meanwhile, and no row is lost or counted twice.

mod support;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{model_path, Server, MODEL};

/// A tmpfs of `size` mounted at `dir`, unmounted on drop; None where mounting is not allowed.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Option<Self> {
        std::fs::create_dir_all(dir).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Self(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Fills the filesystem holding `path` with one file, until it is full.
fn fill(path: &Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let block = vec![0u8; 4096];
    while f.write_all(&block).and_then(|()| f.flush()).is_ok() {}
}

fn rows(ledger: &Path) -> i64 {
    let conn = rusqlite::Connection::open(ledger).unwrap();
    conn.query_row("SELECT COUNT(*) FROM requests", [], |r| r.get(0))
        .unwrap()
}

fn chat(s: &Server) -> (u16, serde_json::Value) {
    s.post(
        "/v1/chat/completions",
        &json!({"model": MODEL, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Hi"}]}),
    )
}

#[test]
fn a_full_disk_keeps_or_refuses_but_never_loses_a_row() {
    let root = std::env::temp_dir().join(format!("gateway-ledger-full-{}", rand::random::<u64>()));
    let Some(fs) = Tmpfs::mount(&root.join("fs"), "1m") else {
        println!("SKIPPED: mounting a tmpfs needs root (CAP_SYS_ADMIN)");
        return;
    };
    let ledger = fs.0.join("usage.sqlite");
    let config = root.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "ledger = \"{}\"\ncollections_dir = \"{}/collections\"\n\
             [[models]]\nname = \"{MODEL}\"\npath = \"{}\"\n",
            ledger.display(),
            root.display(),
            model_path()
        ),
    )
    .unwrap();
    let mut s = Server::start(&["--config", config.to_str().unwrap()]);
    let mut served = 0;
    for _ in 0..3 {
        assert_eq!(chat(&s).0, 200);
        served += 1;
    }
    // The disk fills up: requests are served until a row can be written neither to the
    // ledger nor to the spill file beside it (the last rows written before may be the ones).
    let filler = fs.0.join("filler");
    fill(&filler);
    let deadline = Instant::now() + Duration::from_secs(10);
    let refusal = loop {
        let (status, body) = chat(&s);
        if status == 503 {
            break body;
        }
        assert_eq!(status, 200, "{body}");
        served += 1;
        assert!(Instant::now() < deadline, "billable requests still served");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(refusal["error"]["code"], "ledger_unavailable", "{refusal}");
    assert_eq!(s.metric("gateway_ledger_failing"), 1.0);
    assert!(s.metric("gateway_ledger_pending_rows") >= 1.0);
    // Requests that bill nothing still work.
    assert_eq!(s.get("/v1/models").0, 200);

    // Space comes back: the held rows are written and requests are served again.
    std::fs::remove_file(&filler).unwrap();
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let (status, _) = chat(&s);
        if status == 200 {
            served += 1;
            break;
        }
        assert!(Instant::now() < deadline, "the ledger did not recover");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(s.metric("gateway_ledger_failing"), 0.0);
    assert_eq!(s.terminate(), Some(0));
    assert_eq!(rows(&ledger), served, "ledger rows vs requests served");
    drop(fs);
    let _ = std::fs::remove_dir_all(root);
}

#[test]
fn rows_spilled_while_the_ledger_is_full_are_replayed_once() {
    let root = std::env::temp_dir().join(format!("gateway-ledger-spill-{}", rand::random::<u64>()));
    let Some(fs) = Tmpfs::mount(&root.join("fs"), "1m") else {
        println!("SKIPPED: mounting a tmpfs needs root (CAP_SYS_ADMIN)");
        return;
    };
    // The spill file lives on another filesystem than the (full) ledger.
    let ledger = fs.0.join("usage.sqlite");
    let spill = root.join("spill.jsonl");
    let config = root.join("gateway.toml");
    std::fs::write(
        &config,
        format!(
            "ledger = \"{}\"\nledger_spill = \"{}\"\ncollections_dir = \"{}/collections\"\n\
             [[models]]\nname = \"{MODEL}\"\npath = \"{}\"\n",
            ledger.display(),
            spill.display(),
            root.display(),
            model_path()
        ),
    )
    .unwrap();
    let mut s = Server::start(&["--config", config.to_str().unwrap()]);
    assert_eq!(chat(&s).0, 200);
    let filler = fs.0.join("filler");
    fill(&filler);
    // Served throughout: the rows go to the spill file.
    for _ in 0..5 {
        assert_eq!(chat(&s).0, 200);
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while s.metric("gateway_ledger_spilled_rows") < 5.0 {
        assert!(Instant::now() < deadline, "rows were not spilled");
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(s.metric("gateway_ledger_failing"), 0.0);
    // The first row may have been committed or spilled; either way it is on disk one 20 ms
    // batch after its response (the window a crash may lose, as documented).
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(s.metric("gateway_ledger_pending_rows"), 0.0);
    // A crash now: the spill file survives it, and a restart with space replays it.
    s.kill();
    std::fs::remove_file(&filler).unwrap();
    let mut s = Server::start(&["--config", config.to_str().unwrap()]);
    assert_eq!(s.metric("gateway_ledger_spilled_rows"), 0.0);
    assert!(!spill.exists(), "the replayed spill file is removed");
    assert_eq!(s.terminate(), Some(0));
    assert_eq!(rows(&ledger), 6);
    drop(fs);
    let _ = std::fs::remove_dir_all(root);
}
