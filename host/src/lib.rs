//! The gateway library: an OpenAI-compatible server over a native paged-attention engine.
//! See ARCHITECTURE.md for the map.

pub mod app;
pub mod audit;
pub mod bench;
pub mod cache;
pub mod cli;
pub mod cluster;
pub mod common;
pub mod config;
pub mod conversations;
pub mod engine;
pub mod metrics;
pub mod pipeline;
pub mod plugin_tool;
pub mod plugins;
pub mod search;
pub mod server;
pub mod structured;
pub mod tenancy;
pub mod upstream;
