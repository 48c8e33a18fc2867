#!/usr/bin/env bash
# Everything the test suite needs on a fresh machine, then the whole suite: unit tests, the
# tokenizer parity test, and end-to-end tests against the real binary and model.
set -euo pipefail
cd "$(dirname "$0")/../.."
host/scripts/fetch-models.sh
# The end-to-end suite drives the server with the official OpenAI Python SDK.
python3 -c 'import openai' 2>/dev/null || python3 -m pip install --quiet --disable-pip-version-check 'openai>=1.40,<3'
cargo test --release --workspace "$@"
