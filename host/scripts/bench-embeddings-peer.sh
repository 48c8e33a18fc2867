#!/usr/bin/env bash
# Creates the Python venv of bench-embeddings.py's peer (sentence-transformers on PyTorch, CPU),
# once, outside the clone: ${XDG_CACHE_HOME:-~/.cache}/gateway-bench/st-venv. Idempotent: an
# existing venv whose imports work is left as it is. Prints the venv's python.
#
# Only PyPI is reachable (no download.pytorch.org, so no "+cpu" wheel), and the Linux x86 torch
# wheel on PyPI is the CUDA build: `import torch` loads libcudart, cuBLAS, cuDNN... even on a
# CPU-only machine, so the nvidia-* and cuda-* packages (~3 GB) must be installed. Triton (~1 GB,
# only for torch.compile) is left out. pip's resolver adds the dependencies of packages already
# installed too, so torch and sentence-transformers both go in with --no-deps, then their
# requirements (read from the installed metadata) less torch and triton. pip then warns that
# triton is missing, which is expected. ST_PEER_TRITON=1 keeps triton.
set -euo pipefail
torch_version=2.15.0
st_version=6.3.0
venv="${XDG_CACHE_HOME:-$HOME/.cache}/gateway-bench/st-venv"
py="$venv/bin/python"
check='import torch, sentence_transformers; print("torch", torch.__version__, "threads", torch.get_num_threads(), "cuda", torch.cuda.is_available(), "sentence-transformers", sentence_transformers.__version__)'
if [ -x "$py" ] && "$py" -c "$check" >/dev/null 2>&1; then
  echo "$py"
  exit 0
fi
rm -rf "$venv"
mkdir -p "$(dirname "$venv")"
python3 -m venv "$venv"
pip=("$py" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" --no-deps "torch==$torch_version" "sentence-transformers==$st_version" >&2
skip='torch|triton'
[ "${ST_PEER_TRITON:-0}" = 1 ] && skip='torch'
mapfile -t deps < <("$py" -c '
import importlib.metadata as m, re, sys
for pkg in ("torch", "sentence-transformers"):
    for r in m.requires(pkg) or []:
        if "extra ==" not in r and not re.match(rf"({sys.argv[1]})\b", r, re.I):
            print(r)' "$skip")
"${pip[@]}" "${deps[@]}" >&2
"$py" -c "$check" >&2
echo "$py"
