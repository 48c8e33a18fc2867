//! Small helpers several domains share: hex encoding, atomic file writes, and the alphabet of
//! names that end up in file paths. Depends on nothing else in the crate.

/// The log lines a request's plugins wrote, kept for the caller who asked to see them.
pub type LogSink = std::sync::Arc<std::sync::Mutex<Vec<String>>>;

/// A value an admin's policy gives a tenant's plugins (`config-get`), with its type: what
/// `gateway:plugins@0.2.0` calls a `value`. Plugins built against 0.1.0 see it as text
/// (`ConfigValue::as_text`).
#[derive(Debug, Clone, PartialEq, serde::Deserialize, serde::Serialize)]
#[serde(untagged, try_from = "serde_json::Value")]
pub enum ConfigValue {
    Text(String),
    Boolean(bool),
    Number(f64),
    TextList(Vec<String>),
}

impl TryFrom<serde_json::Value> for ConfigValue {
    type Error = String;

    fn try_from(v: serde_json::Value) -> Result<Self, String> {
        use serde_json::Value;
        let bad = |v: &Value| {
            let mut text = v.to_string();
            if text.len() > 80 {
                text.truncate(text.floor_char_boundary(80));
                text.push('…');
            }
            format!(
                "plugin config value {text} is not a string, number, boolean or array of strings"
            )
        };
        match v {
            Value::String(t) => Ok(ConfigValue::Text(t)),
            Value::Bool(b) => Ok(ConfigValue::Boolean(b)),
            Value::Number(ref n) => n.as_f64().map(ConfigValue::Number).ok_or_else(|| bad(&v)),
            Value::Array(ref items) => items
                .iter()
                .map(|i| i.as_str().map(String::from))
                .collect::<Option<Vec<_>>>()
                .map(ConfigValue::TextList)
                .ok_or_else(|| bad(&v)),
            _ => Err(bad(&v)),
        }
    }
}

impl ConfigValue {
    /// The value as 0.1.0 of the contract carried it: text as is, numbers and booleans as
    /// their shortest text (`3`, `1.5`, `true`), lists joined with commas.
    pub fn as_text(&self) -> String {
        match self {
            ConfigValue::Text(t) => t.clone(),
            ConfigValue::Boolean(b) => b.to_string(),
            ConfigValue::Number(n) => n.to_string(),
            ConfigValue::TextList(items) => items.join(","),
        }
    }
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Writes via a temporary file and a rename, so readers never see half a file.
pub fn write_atomically(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    // A name of its own per write: two writers of one path in this process (an admin request
    // and the cluster follower applying the same change) must not rename each other's file.
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = path.with_extension(format!("tmp{}-{n}", std::process::id()));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, path)
}

/// Tenant and plugin names end up in file paths: keep them to a safe alphabet.
pub fn valid_name(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_')
        && s.as_bytes()[0].is_ascii_alphanumeric()
}

/// A folder watch whose events, debounced, run a callback on a thread of its own (a copy or an
/// editor's save arrives as several events). Watching lasts as long as this value.
pub struct Watch {
    _watcher: notify::RecommendedWatcher,
    /// Sends a change by hand (a SIGHUP, say).
    pub trigger: std::sync::mpsc::Sender<()>,
}

/// Watches `dirs` (recursively or not) and calls `on_change` once events for paths that
/// `relevant` accepts have been quiet for `quiet`.
pub fn watch(
    thread: &str,
    dirs: &[(std::path::PathBuf, bool)],
    relevant: impl Fn(&std::path::Path) -> bool + Send + 'static,
    quiet: std::time::Duration,
    mut on_change: impl FnMut() + Send + 'static,
) -> notify::Result<Watch> {
    use notify::{RecursiveMode, Watcher};
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let events = tx.clone();
    let mut watcher = notify::recommended_watcher(move |ev: notify::Result<notify::Event>| {
        if ev.is_ok_and(|ev| ev.paths.iter().any(|p| relevant(p))) {
            let _ = events.send(());
        }
    })?;
    for (dir, recursive) in dirs {
        let mode = if *recursive {
            RecursiveMode::Recursive
        } else {
            RecursiveMode::NonRecursive
        };
        watcher.watch(dir, mode)?;
    }
    std::thread::Builder::new()
        .name(thread.into())
        .spawn(move || {
            while rx.recv().is_ok() {
                while rx.recv_timeout(quiet).is_ok() {}
                on_change();
            }
        })
        .map_err(|e| notify::Error::generic(&e.to_string()))?;
    Ok(Watch {
        _watcher: watcher,
        trigger: tx,
    })
}

/// Kubernetes updates a mounted ConfigMap or Secret by pointing the `..data` link at a new
/// folder (the files are links through it): the only event is that rename, never one on the
/// files' own names, so every watcher takes it as a change.
pub fn kubernetes_swap(p: &std::path::Path) -> bool {
    p.file_name().is_some_and(|n| n == "..data")
}

/// The folder holding `path` (`.` for a bare file name): watch that, since editors replace
/// files by rename, which a watch on the file itself would lose.
pub fn parent_dir(path: &std::path::Path) -> std::path::PathBuf {
    path.parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(std::path::Path::new("."))
        .to_path_buf()
}

/// A connection to PostgreSQL for the state replicas share (`[cluster] postgres`). Bounded
/// waits everywhere, so a database that is away costs a request at most a few seconds, never
/// a hang. TLS is rustls: `sslmode=require` in the URL insists on it (the certificate is
/// verified, against the Mozilla roots or the PEM file named by `sslrootcert=`, as libpq's
/// `verify-full`); the default `prefer` uses it when the server offers it.
pub fn postgres_connect(url: &str) -> Result<postgres::Client, postgres::Error> {
    use std::time::Duration;
    let (url, root) = take_param(url, "sslrootcert");
    let mut cfg: postgres::Config = url.parse()?;
    cfg.connect_timeout(Duration::from_secs(3))
        .tcp_user_timeout(Duration::from_secs(10))
        .keepalives_idle(Duration::from_secs(30))
        .options("-c statement_timeout=10000 -c lock_timeout=5000")
        .application_name("gateway");
    cfg.connect(postgres_tls(root.as_deref()))
}

/// One PostgreSQL connection, made on first use (its `schema` run then), and dropped on any
/// failed call so that a database that comes back is used again: a database away at start
/// costs its store's requests, not the gateway its start.
pub struct LazyPostgres {
    url: String,
    schema: &'static str,
    client: std::sync::Mutex<Option<postgres::Client>>,
}

impl LazyPostgres {
    pub fn new(url: &str, schema: &'static str) -> Self {
        Self {
            url: url.to_string(),
            schema,
            client: std::sync::Mutex::new(None),
        }
    }

    /// Runs `f` on the connection, connecting (and creating the tables) first if needed.
    pub fn with<T, E: From<postgres::Error>>(
        &self,
        f: impl FnOnce(&mut postgres::Client) -> Result<T, postgres::Error>,
    ) -> Result<T, E> {
        let mut slot = self.client.lock().unwrap_or_else(|e| e.into_inner());
        let client = match &mut *slot {
            Some(c) if !c.is_closed() => c,
            _ => {
                let mut c = postgres_connect(&self.url)?;
                c.batch_execute(self.schema)?;
                slot.insert(c)
            }
        };
        f(client).map_err(|e| {
            *slot = None;
            e.into()
        })
    }
}

impl Drop for LazyPostgres {
    /// The client closes its connection by blocking on a runtime of its own, which may not
    /// happen on a thread that drives the server's: it is closed on a thread of its own.
    fn drop(&mut self) {
        let slot = self.client.get_mut().unwrap_or_else(|e| e.into_inner());
        if let Some(client) = slot.take() {
            let _ = std::thread::spawn(move || drop(client)).join();
        }
    }
}

/// `url` without the query parameter `key`, and its value: parameters libpq knows that the
/// driver's parser does not.
fn take_param(url: &str, key: &str) -> (String, Option<String>) {
    let Some((base, query)) = url.split_once('?') else {
        return (url.to_string(), None);
    };
    let mut value = None;
    let kept: Vec<&str> = query
        .split('&')
        .filter(
            |kv| match kv.strip_prefix(key).and_then(|r| r.strip_prefix('=')) {
                Some(v) => {
                    value = Some(v.to_string());
                    false
                }
                None => true,
            },
        )
        .collect();
    match kept.is_empty() {
        true => (base.to_string(), value),
        false => (format!("{base}?{}", kept.join("&")), value),
    }
}

fn postgres_tls(root: Option<&str>) -> tokio_postgres_rustls::MakeRustlsConnect {
    let mut roots = rustls::RootCertStore::empty();
    match root {
        Some(path) => {
            use rustls::pki_types::{pem::PemObject, CertificateDer};
            let certs: Result<Vec<_>, _> =
                CertificateDer::pem_file_iter(path).and_then(|it| it.collect());
            match certs {
                Ok(certs) => {
                    roots.add_parsable_certificates(certs);
                }
                // The connection then fails verification, with the server's certificate named.
                Err(e) => tracing::error!(path, error = %e, "cannot read sslrootcert"),
            }
        }
        None => roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned()),
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("ring supports the default versions")
    .with_root_certificates(roots)
    .with_no_client_auth();
    tokio_postgres_rustls::MakeRustlsConnect::new(config)
}

#[cfg(test)]
mod tests {
    use super::{take_param, write_atomically, ConfigValue};

    #[test]
    fn config_values_keep_their_type_and_refuse_the_rest() {
        #[derive(serde::Deserialize)]
        struct T {
            config: std::collections::BTreeMap<String, ConfigValue>,
        }
        let t: T = toml::from_str(
            "[config]\npersona = \"Ava\"\nn = 3\nf = 1.5\non = true\ntags = [\"a\", \"b\"]",
        )
        .unwrap();
        let text: Vec<String> = t.config.values().map(ConfigValue::as_text).collect();
        assert_eq!(text, ["1.5", "3", "true", "Ava", "a,b"]);
        assert_eq!(t.config["n"], ConfigValue::Number(3.0));
        assert_eq!(
            t.config["tags"],
            ConfigValue::TextList(vec!["a".into(), "b".into()])
        );
        for bad in ["x = { y = 1 }", "x = [1, 2]"] {
            let e = toml::from_str::<T>(&format!("[config]\n{bad}"))
                .err()
                .unwrap();
            assert!(
                e.to_string()
                    .contains("is not a string, number, boolean or array of strings"),
                "{e}"
            );
        }
    }

    #[test]
    fn concurrent_atomic_writes_of_one_path_all_succeed() {
        let dir = std::env::temp_dir().join(format!("gateway-atomic-{}", std::process::id()));
        let path = dir.join("policies.toml");
        std::thread::scope(|s| {
            for t in 0..4u8 {
                let path = &path;
                s.spawn(move || {
                    for _ in 0..50 {
                        write_atomically(path, &[t; 64]).expect("every write lands");
                    }
                });
            }
        });
        let last = std::fs::read(&path).unwrap();
        assert!(last.len() == 64 && last.iter().all(|&b| b == last[0]));
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn libpq_parameters_the_driver_lacks_are_taken_out() {
        let (url, root) = take_param(
            "postgres://u@h/db?sslmode=require&sslrootcert=/ca.pem&connect_timeout=5",
            "sslrootcert",
        );
        assert_eq!(url, "postgres://u@h/db?sslmode=require&connect_timeout=5");
        assert_eq!(root.as_deref(), Some("/ca.pem"));
        let (url, root) = take_param("postgres://u@h/db?sslrootcert=/ca.pem", "sslrootcert");
        assert_eq!(
            (url.as_str(), root.as_deref()),
            ("postgres://u@h/db", Some("/ca.pem"))
        );
        let (url, root) = take_param("postgres://u@h/db", "sslrootcert");
        assert_eq!((url.as_str(), root), ("postgres://u@h/db", None));
    }
}

/// What a request is for. The route table maps paths to it; dispatch, the replies, the usage
/// ledger and the HTTP metrics all name requests by it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
    /// `POST /v1/responses`.
    Responses,
    /// `/v1/responses/{id}` and its `input_items`: one stored response.
    Response,
    Rerank,
    Embeddings,
    Models,
    /// `/v1/models/{id}`.
    Model,
    /// `/v1/collections` and everything below it.
    Collections,
    /// A collection's search, and retrieval's query embedding (RAG).
    Search,
    /// Documents embedded into a collection.
    Documents,
    Health,
    Ready,
    Metrics,
    /// `/admin/*`.
    Admin,
}

impl Endpoint {
    /// The name the usage ledger records (and its CSV export shows).
    pub fn as_str(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat",
            Endpoint::Completions => "completions",
            Endpoint::Responses | Endpoint::Response => "responses",
            Endpoint::Rerank => "rerank",
            Endpoint::Embeddings => "embeddings",
            Endpoint::Models | Endpoint::Model => "models",
            Endpoint::Collections => "collections",
            Endpoint::Search => "search",
            Endpoint::Documents => "documents",
            Endpoint::Health => "health",
            Endpoint::Ready => "ready",
            Endpoint::Metrics => "metrics",
            Endpoint::Admin => "admin",
        }
    }

    /// The `route` label of the HTTP metrics.
    pub fn label(self) -> &'static str {
        match self {
            Endpoint::Chat => "chat_completions",
            Endpoint::Search | Endpoint::Documents => "collections",
            other => other.as_str(),
        }
    }
}
