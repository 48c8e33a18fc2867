#!/usr/bin/env bash
# Installs nvcc from NVIDIA's PyPI wheels (no driver, no system CUDA) into
# target/cuda-toolkit and prints the CUDA_HOME to use. Pinned to CUDA 13.0: a newer nvcc emits
# PTX that the 13.0 drivers of our GPU machines cannot load.
set -euo pipefail
cd "$(dirname "$0")/.."
dest=target/cuda-toolkit
home="$PWD/$dest/nvidia/cu13"
if [ ! -x "$home/bin/nvcc" ]; then
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$dest" \
    nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 \
    nvidia-cuda-runtime==13.0.88 nvidia-cuda-cccl==13.0.85 >&2
  chmod +x "$home"/bin/* "$home"/nvvm/bin/* 2>/dev/null || true
fi
echo "$home"
