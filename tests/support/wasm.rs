//! The plugin components the tests install: built from `plugins/` and `tests/plugins/` for
//! `wasm32-wasip2` on first use (once per test binary; cargo makes it a no-op when fresh).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

const CRATES: &[&str] = &[
    "crm-persona-template",
    "crm-field-reranker",
    "json-extract",
    "crm-guardrail",
    "faulty-reranker",
    "bad-parser",
    "bad-template",
    "noop",
    "bad-processor",
    "legacy-reranker",
    "echo-reranker",
    "strip-timestamp",
];

fn root() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// The built component of crate `name` (one of `CRATES`).
pub fn component(name: &str) -> PathBuf {
    static BUILT: OnceLock<()> = OnceLock::new();
    BUILT.get_or_init(|| {
        let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        cmd.current_dir(root())
            .args(["build", "--release", "--target", "wasm32-wasip2", "--target-dir", "target/wasm"])
            // Components carry no debug info: smaller files, faster compiles in the gateway.
            .env("CARGO_PROFILE_RELEASE_DEBUG", "false");
        for c in CRATES {
            cmd.args(["-p", c]);
        }
        let status = cmd.status().expect("cargo runs");
        assert!(status.success(), "building the plugin components failed (is the wasm32-wasip2 target installed? `rustup target add wasm32-wasip2`)");
    });
    assert!(CRATES.contains(&name), "{name} is not a test plugin crate");
    root().join(format!(
        "target/wasm/wasm32-wasip2/release/{}.wasm",
        name.replace('-', "_")
    ))
}

/// Runs `gateway plugin <args>` (the real CLI) and returns its stdout; panics with its
/// output when it fails.
pub fn plugin_cli(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_gateway"))
        .arg("plugin")
        .args(args)
        .output()
        .expect("gateway runs");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "gateway plugin {args:?} failed:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

/// The component of the Python or TypeScript project `plugins/<dir>` (or
/// `tests/plugins/<dir>`), built by `gateway plugin build` (componentize-py / componentize-js,
/// installed by host/scripts/test.sh).
/// Built once per test binary: tests running in parallel share the file.
pub fn language_component(dir: &str) -> PathBuf {
    static BUILT: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    let out = root().join(format!("target/wasm/languages/{dir}.wasm"));
    if !built.iter().any(|d| d == dir) {
        std::fs::create_dir_all(out.parent().unwrap()).unwrap();
        let project = ["plugins", "tests/plugins"]
            .iter()
            .map(|p| root().join(p).join(dir))
            .find(|p| p.join("plugin.toml").exists())
            .unwrap_or_else(|| panic!("no plugin project {dir} in plugins/ or tests/plugins/"));
        plugin_cli(&[
            "build",
            project.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]);
        built.push(dir.to_string());
    }
    out
}
