#!/usr/bin/env bash
# The GPU check, in two halves so the GPU machine needs no Rust toolchain:
#
#   kernels/gpu-check.sh build   # on a CPU machine: builds the kernel test and benchmark with
#                                # --features cuda into target/gpu-check/
#   kernels/gpu-check.sh run     # on the GPU machine, from the repository root with
#                                # target/gpu-check/ copied over: kernel correctness against
#                                # the CPU reference, then the bandwidth table
#
# The binaries link only glibc; the CUDA driver is opened at run time. `run` takes about a
# minute on an H200 (PEAK_GBPS overrides the 4800 GB/s used for "% peak").
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  build)
    CUDA_HOME="$(kernels/install-nvcc.sh)"
    export CUDA_HOME
    out=target/gpu-check
    mkdir -p "$out"
    for target in "--test gpu_kernels" "--bench attention"; do
      # shellcheck disable=SC2086
      exe=$(cargo build --release -p gateway-kernels --features cuda $target --message-format=json |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"): print(m["executable"])' | tail -1)
      cp "$exe" "$out/$(basename "${target#* }")"
    done
    ls -la "$out"
    ;;
  run)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    target/gpu-check/gpu_kernels
    target/gpu-check/attention --bench
    ;;
  *)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
