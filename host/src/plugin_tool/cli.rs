//! The `gateway plugin` subcommands' arguments and what each one prints.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{anyhow, Context};
use clap::Subcommand;

use super::build::{cache_dir, Lang};
use crate::plugins::PluginKind;

#[derive(Subcommand)]
pub enum PluginCommand {
    /// Create a plugin project: source, a case to run, a README on deploying it.
    New {
        /// The plugin's name (lowercase letters, digits, '-'); also its folder.
        name: String,
        #[arg(long, value_parser = parse_kind)]
        kind: PluginKind,
        #[arg(long, value_enum, default_value = "rust")]
        lang: Lang,
        /// The folder to create it in.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// The guest SDK's folder, for a Rust plugin (default: beside this gateway's sources).
        #[arg(long)]
        sdk: Option<PathBuf>,
    },
    /// Build a plugin project (Rust, Python or TypeScript) into a component.
    Build {
        #[arg(default_value = ".")]
        dir: PathBuf,
        /// Where to write the component (default: `<dir>/<name>.wasm`).
        #[arg(short, long)]
        out: Option<PathBuf>,
    },
    /// Validate a component as the gateway's loader does and say what it is.
    Check {
        file: PathBuf,
        /// A config file whose `[plugins]` settings (memory cap, deadline) apply.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// Call a component in the gateway's sandbox; print the result and its timing (JSON),
    /// and fail when the input's `expect` does not match.
    Run {
        file: PathBuf,
        /// The call's arguments as JSON (`-` for stdin): {"messages", "context", "model"} for a
        /// prompt template, {"query", "candidates"} for a reranker, {"text", "schema"} for an
        /// output parser, {"vocabulary", "prompt", "tokens"} for a logits processor, {"model",
        /// "endpoint", "messages", "parameters"} for a cache key; optional "config" (tenant
        /// values) and "expect" (the result's parts to check).
        #[arg(long)]
        input: PathBuf,
        /// A tenant configuration value the plugin reads with config-get (repeatable).
        #[arg(long = "config-value", value_name = "KEY=VALUE")]
        values: Vec<String>,
        /// Call this many times; the later calls' p50/p99 are printed.
        #[arg(long, default_value_t = 1)]
        repeat: usize,
        /// A config file whose `[plugins]` settings (memory cap, deadline) apply.
        #[arg(long)]
        config: Option<PathBuf>,
    },
}

fn parse_kind(s: &str) -> Result<PluginKind, String> {
    PluginKind::parse(s).ok_or_else(|| {
        format!(
            "one of {}",
            PluginKind::ALL.map(PluginKind::as_str).join(", ")
        )
    })
}

/// The `[plugins]` settings of a config file, or the defaults; compiled code is cached (in
/// `~/.cache/gateway/plugins` unless the file says where), so a second run skips compiling.
fn plugin_settings(path: Option<&PathBuf>) -> anyhow::Result<crate::config::PluginsConfig> {
    let mut cfg: crate::config::PluginsConfig = match path {
        Some(p) => crate::config::Config::from_file(p)?.plugins,
        None => Default::default(),
    };
    if cfg.cache_dir.is_none() {
        cfg.cache_dir = cache_dir("plugins");
    }
    Ok(cfg)
}

pub fn run(cmd: PluginCommand, rt: &tokio::runtime::Runtime) -> anyhow::Result<()> {
    match cmd {
        PluginCommand::New {
            name,
            kind,
            lang,
            dir,
            sdk,
        } => {
            let made = super::scaffold::new(&dir, &name, kind, lang, sdk.as_deref())?;
            println!("created {} (see its README.md)", made.display());
        }
        PluginCommand::Build { dir, out } => {
            let built = super::build::build(&dir, out.as_deref())?;
            let size = std::fs::metadata(&built)?.len();
            println!("built {} ({size} bytes)", built.display());
        }
        PluginCommand::Check { file, config } => {
            println!(
                "{}",
                super::check(&file, &plugin_settings(config.as_ref())?)?
            );
        }
        PluginCommand::Run {
            file,
            input,
            values,
            repeat,
            config,
        } => {
            let text = match input.to_str() {
                Some("-") => std::io::read_to_string(std::io::stdin())?,
                _ => std::fs::read_to_string(&input)
                    .with_context(|| format!("reading {}", input.display()))?,
            };
            let input: serde_json::Value =
                serde_json::from_str(&text).context("the input is not JSON")?;
            let values: BTreeMap<String, String> = values
                .iter()
                .map(|kv| {
                    kv.split_once('=')
                        .map(|(k, v)| (k.to_string(), v.to_string()))
                        .ok_or_else(|| anyhow!("--config-value {kv:?} is not KEY=VALUE"))
                })
                .collect::<anyhow::Result<_>>()?;
            let cfg = plugin_settings(config.as_ref())?;
            let out = rt.block_on(super::run(&file, &input, values, &cfg, repeat))?;
            println!("{}", serde_json::to_string_pretty(&out)?);
        }
    }
    Ok(())
}
