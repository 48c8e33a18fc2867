#!/usr/bin/env bash
# The gateway as a CPU without AVX-512 runs it (AMD Zen 2/3, Intel client cores), side by side
# with llama.cpp built the same way, on this machine: the gateway built for x86-64-v3 (AVX2,
# FMA, F16C, BMI2; its own target folder) and llama.cpp with LLAMA_PEER_CPU=avx2, then
# bench-vs-llama.sh with both. Usage: host/scripts/bench-avx2.sh MODEL.gguf [CONC...]
set -euo pipefail
cd "$(dirname "$0")/../.."
target="$PWD/target/x86-64-v3"
# RUSTFLAGS replaces .cargo/config.toml's target-cpu=native for this build only.
CARGO_TARGET_DIR="$target" RUSTFLAGS="-C target-cpu=x86-64-v3" \
  cargo build --release --quiet --bin gateway
LLAMA_PEER_CPU=avx2 GATEWAY_BIN="$target/release/gateway" host/scripts/bench-vs-llama.sh "$@"
