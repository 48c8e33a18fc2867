use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use gateway::config::{named_path, Config, EmbeddingModelConfig, ModelConfig};
use gateway::engine::Engine;
use gateway::metrics::Metrics;
use gateway::plugins::{Registry, Runtime};
use gateway::server::{self, AppState};
use gateway::tenancy::{ledger::Ledger, Tenancy};

/// WebAssembly-pluggable AI gateway: an OpenAI-compatible API over a native paged-attention engine.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the OpenAI-compatible API.
    Serve(ServeArgs),
    /// Measure prefill, decode and batched throughput of a model (no HTTP), and print a table.
    Bench(BenchArgs),
    /// Manage API keys.
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Load text, markdown or JSONL files into a collection of a running gateway.
    Index(IndexArgs),
    /// Measure retrieval quality (nDCG@10, Recall@100, MRR@10 per mode) on a labelled set.
    EvalRetrieval(EvalArgs),
    /// Scaffold, build, check or run a plugin without a server or a model.
    #[command(subcommand)]
    Plugin(gateway::plugin_tool::cli::PluginCommand),
}

#[derive(Args)]
struct IndexArgs {
    /// The collection (created if missing).
    collection: String,
    /// Files or folders: JSONL is one document per line (`id`, `text`, `metadata`); any
    /// other file is one document.
    #[arg(required = true)]
    paths: Vec<PathBuf>,
    /// The gateway's base URL.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: String,
    /// The tenant's API key.
    #[arg(long, env = "GATEWAY_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// A CA certificate (PEM) to trust for an HTTPS gateway.
    #[arg(long)]
    ca_cert: Option<PathBuf>,
}

#[derive(Args)]
struct EvalArgs {
    /// Documents: BEIR corpus.jsonl (`_id`, `title`, `text`) or TSV (`id<TAB>text`).
    #[arg(long)]
    corpus: PathBuf,
    /// Queries: BEIR queries.jsonl or TSV.
    #[arg(long)]
    queries: PathBuf,
    /// Judgements: BEIR qrels TSV or TREC qrels.
    #[arg(long)]
    qrels: PathBuf,
    /// The embedding model folder, optionally as NAME=PATH.
    #[arg(long, default_value = "all-minilm-l6-v2=models/all-MiniLM-L6-v2")]
    embedding_model: String,
    /// Tokens per chunk (default: the server's default).
    #[arg(long)]
    chunk_tokens: Option<usize>,
    /// Print the results as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
enum KeysCommand {
    /// Print a new API key (once) and the policy line holding its SHA-256.
    New {
        /// The tenant the key is for.
        #[arg(long)]
        tenant: String,
        /// The key's id in the usage ledger and logs.
        #[arg(long, default_value = "default")]
        id: String,
    },
}

#[derive(Args)]
struct EngineArgs {
    /// TOML config file; flags below override it.
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Model to serve: a .gguf file or an HF folder, optionally as NAME=PATH, or the name of
    /// the embedded default (smollm2-135m-instruct). Repeat for several models. Replaces the
    /// config file's [[models]].
    #[arg(long = "model", short)]
    models: Vec<String>,
    /// Embedding model for /v1/embeddings: an HF BERT folder, optionally as NAME=PATH.
    /// Repeat for several. Replaces the config file's [[embeddings]].
    #[arg(long = "embedding-model")]
    embedding_models: Vec<String>,
    /// Bytes of KV cache per model (all layers, K and V).
    #[arg(long)]
    kv_cache_bytes: Option<usize>,
    /// Tokens per KV block.
    #[arg(long)]
    block_size: Option<usize>,
    /// Most sequences in one engine step.
    #[arg(long)]
    max_num_seqs: Option<usize>,
    /// Most tokens (prefill chunks + decodes) in one engine step.
    #[arg(long)]
    max_num_batched_tokens: Option<usize>,
    /// Longest prompt + completion in tokens (0 = the model's context length).
    #[arg(long)]
    max_model_len: Option<usize>,
    /// Turn off reuse of KV blocks across requests with the same prompt prefix.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Compute threads per model (0 = one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Bits the CPU decode kernels round activations to for k-quant weights: 16 (default,
    /// greedy output as the f32 reference's) or 8 (faster decode, as llama.cpp).
    #[arg(long)]
    decode_activation_bits: Option<u8>,
    /// Where models run: cpu, cuda or cuda:N (CUDA needs a build with --features cuda).
    #[arg(long)]
    device: Option<gateway::config::ComputeDevice>,
    /// Element type on CUDA (auto = bf16).
    #[arg(long, value_enum)]
    dtype: Option<gateway::config::GpuDtype>,
    /// Fraction of GPU memory an engine may use; its KV pool gets what weights leave of it.
    #[arg(long)]
    gpu_memory_utilization: Option<f32>,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    engine: EngineArgs,
    /// Address to listen on.
    #[arg(long, short)]
    listen: Option<SocketAddr>,
    /// Largest request body in bytes (bigger ones get 413).
    #[arg(long)]
    max_body_bytes: Option<usize>,
    /// Tenant plugin folder (`<dir>/<tenant>/<name>.wasm`), watched for changes.
    #[arg(long)]
    plugins_dir: Option<PathBuf>,
    /// Serve HTTPS with this certificate chain (PEM); reloaded on change or SIGHUP.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key (PEM) for --tls-cert.
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Policy file (tenants, keys, limits), watched for changes.
    #[arg(long)]
    policies: Option<PathBuf>,
    /// SQLite usage ledger.
    #[arg(long)]
    ledger: Option<PathBuf>,
    /// Folder of the tenants' search collections.
    #[arg(long)]
    collections_dir: Option<PathBuf>,
    /// Bearer token for the admin API (`/admin/*`); off when unset.
    #[arg(long, env = "GATEWAY_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    engine: EngineArgs,
    #[command(flatten)]
    opts: gateway::bench::BenchOptions,
}

impl EngineArgs {
    fn config(&self) -> anyhow::Result<Config> {
        let mut cfg = match &self.config {
            Some(p) => Config::from_file(p)?,
            None => Config::default(),
        };
        if !self.models.is_empty() {
            cfg.models = self
                .models
                .iter()
                .map(|m| ModelConfig::from_arg(m))
                .collect();
        }
        if !self.embedding_models.is_empty() {
            cfg.embeddings = self
                .embedding_models
                .iter()
                .map(|m| EmbeddingModelConfig::from_arg(m))
                .collect();
        }
        for m in &mut cfg.models {
            let e = &mut m.engine;
            e.kv_cache_bytes = self.kv_cache_bytes.unwrap_or(e.kv_cache_bytes);
            e.block_size = self.block_size.unwrap_or(e.block_size);
            e.max_num_seqs = self.max_num_seqs.unwrap_or(e.max_num_seqs);
            e.max_num_batched_tokens = self
                .max_num_batched_tokens
                .unwrap_or(e.max_num_batched_tokens);
            e.prefix_caching &= !self.no_prefix_caching;
            e.threads = self.threads.unwrap_or(e.threads);
            e.decode_activation_bits = self
                .decode_activation_bits
                .unwrap_or(e.decode_activation_bits);
            e.device = self.device.unwrap_or(e.device);
            e.dtype = self.dtype.unwrap_or(e.dtype);
            e.gpu_memory_utilization = self
                .gpu_memory_utilization
                .unwrap_or(e.gpu_memory_utilization);
            m.max_model_len = self.max_model_len.unwrap_or(m.max_model_len);
        }
        cfg.validate()?;
        Ok(cfg)
    }
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,hnsw_rs=warn".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli.command {
        Command::Serve(args) => rt.block_on(serve(args)),
        Command::Bench(args) => {
            let cfg = args.engine.config()?;
            rt.block_on(gateway::bench::run(&cfg.models[0], &args.opts))
        }
        Command::Index(a) => gateway::cli::index(
            &a.collection,
            &a.paths,
            &gateway::cli::IndexOptions {
                url: a.url,
                api_key: a.api_key,
                ca_cert: a.ca_cert,
            },
        ),
        Command::EvalRetrieval(a) => {
            let (name, path) = named_path(&a.embedding_model, |_| "embeddings".into());
            let embedder = gateway::search::embedder::Embedder::load(&name, &path)
                .with_context(|| format!("loading embedding model {}", path.display()))?;
            gateway::cli::eval_retrieval(gateway::cli::EvalOptions {
                corpus: a.corpus,
                queries: a.queries,
                qrels: a.qrels,
                embedder: Arc::new(embedder),
                chunk_tokens: a.chunk_tokens,
                json: a.json,
            })
        }
        Command::Plugin(cmd) => gateway::plugin_tool::cli::run(cmd, &rt),
        Command::Keys(KeysCommand::New { tenant, id }) => {
            let (key, line) = gateway::tenancy::keys::new_key(&tenant, &id);
            println!("{key}");
            eprintln!("The key is shown only this once. Policy entry:\n{line}");
            Ok(())
        }
    }
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    let cfg = args.config()?;
    let metrics = Arc::new(Metrics::new());
    let engines = load_engines(&cfg, &metrics)?;
    let upstreams = gateway::upstream::Upstreams::new(&cfg.upstreams, &metrics)?;
    let (plugins, _plugin_watch) = load_plugins(&cfg)?;
    let embedders = load_embedders(&cfg)?;
    let collections = Arc::new(tokio::task::block_in_place(|| {
        gateway::search::Collections::open(cfg.collections_dir.clone(), embedders.clone())
    }));
    let (tenancy, _policy_watch) = open_tenancy(&cfg, &metrics)?;
    let registry = plugins.clone();
    let wrong = tenancy.check_plugin_kinds(Box::new(move |tenant, name| {
        registry.get(tenant, name).map(|p| p.kind().as_str())
    }));
    for problem in wrong {
        tracing::warn!(%problem, "policy binds a plugin of the wrong kind; its requests will fail");
    }
    let cluster = gateway::cluster::join(&cfg.cluster, &tenancy, &plugins, &collections, &metrics)?;
    let (listeners, tls_watches) = bind_listeners(&cfg).await?;
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let state = Arc::new(AppState {
        engines,
        embedders,
        collections,
        metrics,
        max_body_bytes: cfg.max_body_bytes,
        started,
        plugins,
        tenancy: tenancy.clone(),
        admin_token: cfg.admin_token.clone(),
        max_upload_bytes: cfg.plugins.max_upload_bytes,
        shutdown: Default::default(),
        http: edge_limits(&cfg),
        vocabularies: Default::default(),
        upstreams,
        cluster,
        fallbacks: cfg
            .models
            .iter()
            .map(|m| {
                let f = server::Fallback {
                    chain: m.fallback.clone(),
                    saturated_waiting: m.saturated_waiting,
                };
                (m.name.clone(), f)
            })
            .collect(),
    });
    state.upstreams.start_probes().await;
    let drain = std::time::Duration::from_secs(cfg.drain_seconds);
    let collections = state.collections.clone();
    server::serve(listeners, state, drain).await?;
    tokio::task::block_in_place(|| collections.save_graphs());
    drop(tls_watches);
    if let Some(l) = &tenancy.ledger {
        l.close();
        tracing::info!("usage ledger flushed");
    }
    Ok(())
}

impl ServeArgs {
    /// The config file (or defaults) with this command's flags on top, validated.
    fn config(self) -> anyhow::Result<Config> {
        let mut cfg = self.engine.config()?;
        cfg.listen = self.listen.unwrap_or(cfg.listen);
        cfg.max_body_bytes = self.max_body_bytes.unwrap_or(cfg.max_body_bytes);
        cfg.plugins.dir = self.plugins_dir.or(cfg.plugins.dir);
        cfg.admin_token = self.admin_token.or(cfg.admin_token);
        cfg.policies = self.policies.or(cfg.policies);
        match (self.tls_cert, self.tls_key) {
            (Some(cert), Some(key)) => cfg.tls = Some(gateway::config::TlsConfig { cert, key }),
            (None, None) => {}
            _ => anyhow::bail!("--tls-cert and --tls-key go together"),
        }
        if let Some(l) = self.ledger {
            cfg.ledger = Some(l);
        }
        cfg.collections_dir = self.collections_dir.unwrap_or(cfg.collections_dir);
        cfg.validate()?;
        Ok(cfg)
    }
}

/// One engine (thread, KV pool) per configured model.
fn load_engines(
    cfg: &Config,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<std::collections::BTreeMap<String, Arc<Engine>>> {
    let mut engines = std::collections::BTreeMap::new();
    for m in &cfg.models {
        tracing::info!(model = %m.name, path = %m.path.display(), "loading model");
        let started = std::time::Instant::now();
        let engine = tokio::task::block_in_place(|| Engine::start(m, metrics.clone()))
            .with_context(|| format!("loading model {}", m.name))?;
        tracing::info!(model = %m.name, seconds = started.elapsed().as_secs_f32(), "model ready");
        engines.insert(m.name.clone(), Arc::new(engine));
    }
    Ok(engines)
}

type Embedders = std::collections::BTreeMap<String, Arc<gateway::search::embedder::Embedder>>;

/// The embedding models; the default one is skipped (with a warning) when not fetched.
fn load_embedders(cfg: &Config) -> anyhow::Result<Embedders> {
    let mut embedders = Embedders::new();
    for e in &cfg.embeddings {
        if *e == gateway::config::EmbeddingModelConfig::default() && !e.path.exists() {
            tracing::warn!(path = %e.path.display(), "default embedding model not found (host/scripts/fetch-models.sh fetches it); /v1/embeddings has no model");
            continue;
        }
        let loaded = tokio::task::block_in_place(|| {
            gateway::search::embedder::Embedder::load(&e.name, &e.path)
        })
        .with_context(|| format!("loading embedding model {}", e.name))?;
        tracing::info!(model = %e.name, dim = loaded.dim, "embedding model ready");
        embedders.insert(e.name.clone(), Arc::new(loaded));
    }
    Ok(embedders)
}

/// Policies (watched for changes when from a file) and the usage ledger.
fn open_tenancy(
    cfg: &Config,
    metrics: &Arc<Metrics>,
) -> anyhow::Result<(Arc<Tenancy>, Option<gateway::common::Watch>)> {
    let ledger = match (&cfg.ledger, &cfg.cluster.postgres) {
        (Some(p), Some(url)) => Some(
            Ledger::open_postgres(url, ledger_durability(cfg, p))
                .context("opening the usage ledger in PostgreSQL")?,
        ),
        (Some(p), None) => Some(
            Ledger::open(p, ledger_durability(cfg, p))
                .with_context(|| format!("opening the usage ledger {}", p.display()))?,
        ),
        (None, _) => None,
    };
    let tenancy = Arc::new(
        Tenancy::new(cfg.policies.clone(), ledger, metrics.clone())
            .map_err(|e| anyhow::anyhow!("invalid policy file:\n{e}"))?,
    );
    let Some(p) = &cfg.policies else {
        tracing::warn!(
            "no policy file: requests are not authenticated and all belong to tenant `default`"
        );
        return Ok((tenancy, None));
    };
    tracing::info!(path = %p.display(), "policies loaded");
    let watch = gateway::tenancy::watch::watch(tenancy.clone())
        .with_context(|| format!("watching {}", p.display()))?;
    Ok((tenancy, Some(watch)))
}

/// The API listener and, when configured, the admin one, with their TLS (watched for changes).
async fn bind_listeners(
    cfg: &Config,
) -> anyhow::Result<(Vec<server::Listener>, Vec<gateway::common::Watch>)> {
    let tls = match &cfg.tls {
        Some(t) => Some(load_tls(t.cert.clone(), t.key.clone(), None)?),
        None => None,
    };
    let mut watches = Vec::new();
    let tcp = tokio::net::TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding {}", cfg.listen))?;
    if let Some(t) = &tls {
        tracing::info!("TLS on: h2 and HTTP/1.1 by ALPN");
        watches.push(server::tls::watch(t.clone()).context("watching the TLS files")?);
    }
    tracing::info!(addr = %tcp.local_addr()?, "serving the OpenAI API");
    let role = match cfg.admin.listen {
        Some(_) => server::Role::Api,
        None => server::Role::All,
    };
    let mut listeners = vec![server::Listener {
        tcp,
        tls: tls.clone(),
        role,
    }];
    let Some(addr) = cfg.admin.listen else {
        return Ok((listeners, watches));
    };
    let tcp = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the admin listener {addr}"))?;
    let admin_tls = match (&cfg.tls, &cfg.admin.client_ca) {
        (Some(t), Some(ca)) => {
            let t = load_tls(t.cert.clone(), t.key.clone(), Some(ca.clone()))?;
            watches.push(server::tls::watch(t.clone()).context("watching the TLS files")?);
            Some(t)
        }
        _ => tls,
    };
    let client_certs = cfg.admin.client_ca.is_some();
    tracing::info!(client_certs, "admin API on its own listener");
    tracing::info!(addr = %tcp.local_addr()?, "serving the admin API");
    listeners.push(server::Listener {
        tcp,
        tls: admin_tls,
        role: server::Role::Admin,
    });
    Ok((listeners, watches))
}

fn ledger_durability(
    cfg: &Config,
    ledger: &std::path::Path,
) -> gateway::tenancy::ledger::Durability {
    let mut d = gateway::tenancy::ledger::Durability::beside(ledger);
    if let Some(spill) = &cfg.ledger_spill {
        d.spill = spill.clone();
    }
    d.refuse_when_failing = cfg.ledger_unwritable == gateway::config::LedgerUnwritable::Refuse;
    d.spill_max_bytes = cfg.ledger_spill_max_mb.saturating_mul(1 << 20);
    d
}

/// The HTTP limits in force. The open-file limit is raised to its hard limit first; an unset
/// connection cap then keeps a quarter of the descriptors for models, plugins, indexes and
/// the ledger.
fn edge_limits(cfg: &Config) -> gateway::config::HttpConfig {
    const DEFAULT_MAX_CONNECTIONS: usize = 10_000;
    let mut http = cfg.http.clone();
    let room =
        server::raise_fd_limit().map(|files| ((files as usize).saturating_sub(64) * 3 / 4).max(1));
    match (http.max_connections, room) {
        (0, Some(room)) => http.max_connections = DEFAULT_MAX_CONNECTIONS.min(room),
        (0, None) => http.max_connections = DEFAULT_MAX_CONNECTIONS,
        (n, Some(room)) if n > room => tracing::warn!(
            max_connections = n,
            fits = room,
            "max_connections is above what the open-file limit leaves room for"
        ),
        _ => {}
    }
    http
}

/// The plugin runtime and registry, filled from the plugin folder (watched for changes) when
/// one is configured. The watcher lives as long as the returned handle.
fn load_plugins(cfg: &Config) -> anyhow::Result<(Arc<Registry>, Option<gateway::common::Watch>)> {
    let mut pc = cfg.plugins.clone();
    if pc.cache_dir.is_none() {
        pc.cache_dir = pc.dir.as_ref().map(|d| d.join(".compiled"));
    }
    let runtime = Runtime::new(&pc).context("starting the plugin runtime")?;
    let registry = Arc::new(Registry::new(runtime, pc.dir.clone()));
    let Some(dir) = &pc.dir else {
        return Ok((registry, None));
    };
    if !dir.exists() {
        // Said out loud: a typo in the path would otherwise look like "no plugins".
        tracing::warn!(dir = %dir.display(), "the plugin folder does not exist; creating it");
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let started = std::time::Instant::now();
    let report = tokio::task::block_in_place(|| registry.sync_dir());
    tracing::info!(
        dir = %dir.display(),
        loaded = report.loaded.len(),
        rejected = report.rejected.len(),
        seconds = started.elapsed().as_secs_f32(),
        "plugins loaded"
    );
    let watcher = gateway::plugins::watch::watch(registry.clone())
        .with_context(|| format!("watching {}", dir.display()))?;
    Ok((registry, Some(watcher)))
}

fn load_tls(
    cert: PathBuf,
    key: PathBuf,
    client_ca: Option<PathBuf>,
) -> anyhow::Result<Arc<server::tls::Tls>> {
    Ok(server::tls::Tls::load(server::tls::TlsFiles {
        cert,
        key,
        client_ca,
    })?)
}
