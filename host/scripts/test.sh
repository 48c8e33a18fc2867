#!/usr/bin/env bash
# Everything the test suite needs on a fresh machine, then the whole suite: unit tests, the
# tokenizer parity test, plugin registry tests, and end-to-end tests against the real binary,
# model and plugin components.
set -euo pipefail
cd "$(dirname "$0")/../.."
host/scripts/fetch-models.sh
# Qwen2.5 1.5B and Gemma 3 270M (Q4_K_M) and llama.cpp's tokenizer vectors, cached outside
# the clone, for the real-model, kernel and tokenizer conformance tests.
host/scripts/fetch-real-models.sh
# The plugin tests build real WebAssembly components from plugins/ and tests/plugins/.
rustup target list --installed | grep -qx wasm32-wasip2 || rustup target add wasm32-wasip2
# Python and TypeScript plugins are built with the pinned componentize-py (PyPI) and
# componentize-js + TypeScript (npm, kept outside the clone where `gateway plugin build`
# looks for them).
python3 -m pip show componentize-py 2>/dev/null | grep -qx 'Version: 0.25.1' ||
  python3 -m pip install --quiet --disable-pip-version-check componentize-py==0.25.1
# The end-to-end suite drives the server with the official OpenAI Python SDK, and computes
# reference embeddings with numpy from the model's own files.
python3 -c 'import openai, numpy, safetensors, tokenizers, jsonschema, pydantic' 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check 'openai>=1.40,<3' numpy safetensors tokenizers jsonschema pydantic
# ... and the OpenAI Agents SDK runs an agent against the Responses API.
python3 -m pip show openai-agents 2>/dev/null | grep -qx 'Version: 0.24.0' ||
  python3 -m pip install --quiet --disable-pip-version-check openai-agents==0.24.0
# The Kubernetes manifests in deploy/ are checked offline against the Kubernetes schemas.
python3 -m pip show kubernetes-validate 2>/dev/null | grep -qx 'Version: 1.37.0' ||
  python3 -m pip install --quiet --disable-pip-version-check kubernetes-validate==1.37.0
# ... and with the official Node SDK (npm `openai`), kept outside the clone.
command -v node >/dev/null && command -v npm >/dev/null || {
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq nodejs npm; else sudo -n apt-get install -y -qq nodejs npm; fi
}
export GATEWAY_NODE_MODULES="${XDG_CACHE_HOME:-$HOME/.cache}/gateway-test-npm/node_modules"
[ -d "$GATEWAY_NODE_MODULES/openai" ] ||
  npm install --silent --no-audit --no-fund --prefix "$(dirname "$GATEWAY_NODE_MODULES")" openai@7
JS_TOOLS="${XDG_CACHE_HOME:-$HOME/.cache}/gateway/js-tools"
[ -x "$JS_TOOLS/node_modules/.bin/componentize-js" ] && [ -x "$JS_TOOLS/node_modules/.bin/tsc" ] ||
  npm install --silent --no-audit --no-fund --prefix "$JS_TOOLS" \
    @bytecodealliance/componentize-js@0.23.0 typescript@5.9.3
# The cluster tests share state between replicas through a real Redis and a real PostgreSQL
# (Debian's packages), which they start themselves on loopback ports in temporary folders;
# here they must not skip.
install_deb() {
  if [ "$(id -u)" = 0 ]; then apt-get install -y -qq "$@" >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq "$@"; }
  else sudo -n apt-get install -y -qq "$@"; fi
}
command -v redis-server >/dev/null || install_deb redis-server
# The admin console is tested in a real browser: Debian's headless Chromium, driven by
# Playwright for Python (pointed at it; Playwright's own browser download is not needed).
command -v chromium >/dev/null || install_deb chromium
python3 -m pip show playwright 2>/dev/null | grep -qx 'Version: 1.65.3' ||
  python3 -m pip install --quiet --disable-pip-version-check playwright==1.65.3
# The console's chart library is vendored in host/ui/vendor: it must be the lockfile's package,
# byte for byte.
npm ci --silent --no-audit --no-fund --prefix host/ui
for f in uPlot.iife.min.js uPlot.min.css; do
  cmp host/ui/vendor/$f host/ui/node_modules/uplot/dist/$f
done
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || install_deb postgresql
export GATEWAY_TEST_SERVICES=required
# The retrieval evaluation derives its labelled set from Debian's FAQ package (downloaded with
# `apt-get download`, which needs the package lists).
if ! apt-cache show debian-faq >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq; else sudo -n apt-get update -qq; fi
fi
command -v dpkg-deb >/dev/null || { echo "dpkg-deb is required (Debian/Ubuntu)" >&2; exit 1; }
# llama.cpp's llama-server, built once from the llama-cpp-python sdist into a cache outside the
# clone (~15 min cold): the upstream tests route to it as a server we did not write.
GATEWAY_LLAMA_SERVER="$(host/scripts/build-llama-peer.sh)/llama-server"
export GATEWAY_LLAMA_SERVER
cargo test --release --workspace "$@"
# The CUDA kernels, compiled for sm_80 and sm_90 by nvcc from PyPI (no driver needed), so a
# kernel that does not compile fails here, and the gateway's CUDA engine path built against
# them; without a GPU their device tests print SKIPPED.
CUDA_HOME="$(kernels/install-nvcc.sh)"
export CUDA_HOME
cargo test --release -p gateway-kernels --features cuda
cargo test --release -p gateway --features cuda --test gpu_parity
# The same kernel tests and the CUDA engine's parity test again, on the CPU through an emulator
# of the driver and cuBLAS, so the GPU path runs on every CI run even without a GPU.
kernels/emu/run.sh
