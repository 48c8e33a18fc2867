#!/usr/bin/env bash
# The GPU check, split so the GPU machine needs no Rust toolchain:
#
#   kernels/gpu-check.sh build   # CPU machine: the kernel tests, the attention benchmark, the
#                                # engine's GPU-vs-CPU parity test and the gateway binary,
#                                # built with --features cuda for x86-64-v3 (the GPU host's
#                                # CPU is unknown; `native` could emit instructions it lacks)
#                                # into target/gpu-check/ (~70 MB stripped, ~16 MB as
#                                # target/gpu-check.tar.xz), and the default model split into
#                                # 16 MiB parts in target/gpu-model/ (tools that carry at most
#                                # 64 MiB per call can send it over several calls). A first
#                                # build compiles every dependency again (own target dir, ~20
#                                # min on 2 cores).
#   kernels/gpu-check.sh run     # GPU machine, repository root, target/gpu-check/ or its
#                                # archive present:
#                                # kernel correctness against the CPU reference, the bandwidth
#                                # table (about a minute on an H200) with PyTorch's fused SDPA
#                                # on the same shapes as the anchor, then, if every model part
#                                # is there, the 32-token greedy parity of the CUDA engine with
#                                # the CPU engine on the default model and `gateway bench` on
#                                # the GPU and on the CPU (tokens/s side by side).
#
# The binaries link only glibc; the CUDA driver and cuBLAS (libcublas.so.13, found in the
# CUDA toolkit or Python's nvidia-cublas package) are opened at run time. PEAK_GBPS overrides
# the 4800 GB/s used for "% peak".
set -euo pipefail
cd "$(dirname "$0")/.."
model=models/SmolLM2-135M-Instruct.Q4_1.gguf
parts=target/gpu-model
case "${1:-}" in
  build)
    CUDA_HOME="$(kernels/install-nvcc.sh)"
    export CUDA_HOME CARGO_TARGET_DIR=target/gpu-build RUSTFLAGS="-C target-cpu=x86-64-v3"
    out=target/gpu-check
    mkdir -p "$out" "$parts"
    for target in "-p gateway-kernels --test gpu_kernels" "-p gateway-kernels --bench attention" \
      "-p gateway --test gpu_parity" "-p gateway --bin gateway"; do
      name=${target##* }
      # shellcheck disable=SC2086
      exe=$(cargo build --release --features cuda $target --message-format=json |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$name")
      strip -o "$out/$name" "$exe"
    done
    # Compressed (~16 MB from ~70 MB) so the binaries and model parts fit the calls.
    tar -C target -cJf target/gpu-check.tar.xz gpu-check
    host/scripts/fetch-models.sh
    rm -f "$parts"/*
    split -b 16M -d "$model" "$parts/model.gguf.part"
    (cd "$(dirname "$model")" && sha256sum "$(basename "$model")") | cut -d' ' -f1 >"$parts/model.sha256"
    ls -la target/gpu-check.tar.xz "$parts"
    ;;
  run)
    if [ ! -x target/gpu-check/gpu_kernels ] && [ -f target/gpu-check.tar.xz ]; then
      python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])' \
        target/gpu-check.tar.xz target
    fi
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    target/gpu-check/gpu_kernels
    target/gpu-check/attention --bench
    python3 kernels/bench_torch.py || echo "torch anchor: FAILED (the kernel results above stand)"
    if [ -f "$parts/model.sha256" ] && cat "$parts"/model.gguf.part* 2>/dev/null >"$parts/model.gguf" &&
      [ "$(sha256sum "$parts/model.gguf" | cut -d' ' -f1)" = "$(cat "$parts/model.sha256")" ]; then
      lib=$(python3 -c 'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null |
        xargs -I{} find {} -name 'libcublas.so.13*' 2>/dev/null | head -1 || true)
      [ -n "$lib" ] && export LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      GATEWAY_TEST_MODEL="$parts/model.gguf" target/gpu-check/gpu_parity
      # End-to-end engine throughput, GPU (bf16) and this machine's CPU side by side.
      for dev in "--device cuda --dtype bf16" "--device cpu"; do
        # shellcheck disable=SC2086
        target/gpu-check/gateway bench --model "$parts/model.gguf" $dev --prompt-tokens 512 \
          --gen-tokens 128 --concurrency 1,16,64 --repeat 2 --kv-seqs 32 ||
          echo "gateway bench $dev: FAILED"
      done
    else
      echo "gpu_parity: SKIPPED: the model parts in $parts are missing or incomplete"
    fi
    ;;
  *)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
