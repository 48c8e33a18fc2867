#!/usr/bin/env bash
# Fetches the default model if needed, builds the gateway (release) and serves the OpenAI API on
# 127.0.0.1:8080. Extra arguments go to `gateway serve` (see `gateway serve --help`).
set -euo pipefail
cd "$(dirname "$0")/../.."
host/scripts/fetch-models.sh
exec cargo run --release --bin gateway -- serve "$@"
