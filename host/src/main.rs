//! The `gateway` command: arguments parsed here, everything else done by the library.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use gateway::config::{named_path, Config, EmbeddingModelConfig, EmbeddingPrecision, ModelConfig};

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
    /// Measure a GGUF's kernels against full precision: perplexity, KL divergence, top-1
    /// agreement (optionally against llama.cpp's `--kl-divergence-base` file too).
    EvalKl(gateway::bench::kl::KlOptions),
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
    /// Arithmetic of the encoder's matrix products.
    #[arg(long, value_enum, default_value_t)]
    precision: EmbeddingPrecision,
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
    /// Arithmetic of every embedding model's matrix products (auto: BF16 AMX tiles where the
    /// CPU has them, else f32).
    #[arg(long, value_enum)]
    embedding_precision: Option<EmbeddingPrecision>,
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
    /// Bits the CPU decode kernels round activations to: auto (default: 8 on AVX2 and on
    /// AVX-512 with VNNI, where bytes cost a step less arithmetic, else 16), 16 (greedy
    /// output as the f32 reference's), 8 (llama.cpp's rounding for k-quants and, on AVX2,
    /// Q4_0-Q5_1; KL divergence from f32 below llama.cpp's; Q8_0 keeps 16) or 8-all (on AVX2
    /// Q8_0 at 8 bits too: KL above llama.cpp's on Gemma 3).
    #[arg(long)]
    decode_activation_bits: Option<gateway::config::DecodeBits>,
    /// How the CPU prompt kernels (prefill) meet quantized weights: auto (BF16 AMX tiles where
    /// the CPU has them, else int8), int8 (k-quant activations rounded to bytes as llama.cpp's)
    /// or int16 (greedy output as the f32 reference's).
    #[arg(long, value_enum)]
    prompt_precision: Option<gateway::config::PromptPrecision>,
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
    /// The response cache on (`true`) or off (`false`) for every tenant, over `[cache]
    /// enabled`.
    #[arg(long)]
    response_cache: Option<bool>,
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
        for e in &mut cfg.embeddings {
            e.precision = self.embedding_precision.unwrap_or(e.precision);
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
            e.prompt_precision = self.prompt_precision.unwrap_or(e.prompt_precision);
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
        Command::Serve(args) => rt.block_on(async {
            gateway::app::Gateway::build(&args.config()?)
                .await?
                .serve()
                .await
        }),
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
            let embedder = gateway::search::embedder::Embedder::load(&name, &path, a.precision)
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
        Command::EvalKl(o) => {
            let report = gateway::bench::kl::run(&o)?;
            match o.json {
                true => println!("{}", serde_json::to_string_pretty(&report)?),
                false => gateway::bench::kl::print(&report),
            }
            Ok(())
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

impl ServeArgs {
    /// The config file (or defaults) with this command's flags on top, validated.
    fn config(self) -> anyhow::Result<Config> {
        let mut cfg = self.engine.config()?;
        cfg.listen = self.listen.unwrap_or(cfg.listen);
        cfg.max_body_bytes = self.max_body_bytes.unwrap_or(cfg.max_body_bytes);
        cfg.plugins.dir = self.plugins_dir.or(cfg.plugins.dir);
        cfg.admin_token = self.admin_token.or(cfg.admin_token);
        cfg.cache.enabled = self.response_cache.unwrap_or(cfg.cache.enabled);
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
