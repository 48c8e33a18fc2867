#!/usr/bin/env bash
# Runs the CUDA kernel tests and the CUDA engine's parity test on the CPU, through an emulator
# of the CUDA driver and cuBLAS (this folder), so every run checks the GPU path's indexing,
# launch arguments, memory layout and driver calls even on machines without a GPU. A tiny
# random model (tiny_model.py) keeps the emulated parity test to about a minute; speed and the
# default model's numerics need a real GPU (kernels/gpu-check.sh).
#
# Needs: g++ (C++17, _Float16: GCC 12+), x86-64 (the fiber switch is assembly), python3 with
# the `gguf` package (installed if missing), CUDA_HOME for the cuda-feature builds.
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ "$(uname -m)" != x86_64 ]; then
  echo "CUDA emulator: SKIPPED: needs x86-64 (this is $(uname -m))"
  exit 0
fi
out=target/emu
mkdir -p "$out"
# CUDA code reads one type through a pointer to another (16-byte loads split into halves), which
# nvcc allows; GCC's strict-aliasing optimisations would not.
flags=(-O2 -march=native -std=c++17 -fno-strict-aliasing -fPIC -Ikernels/emu)
for src in sched driver attention layers; do
  g++ "${flags[@]}" -c "kernels/emu/$src.cpp" -o "$out/$src.o"
done
g++ -shared -o "$out/libcuda.so" "$out"/{sched,driver,attention,layers}.o
g++ "${flags[@]}" -O3 -shared kernels/emu/cublas.cpp -o "$out/libcublas.so"
python3 -c 'import gguf' 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check 'gguf>=0.17,<1'
python3 kernels/emu/tiny_model.py models/SmolLM2-135M-Instruct.Q4_1.gguf "$out/tiny.gguf"
echo "CUDA emulator: kernel tests and engine parity on the CPU (no GPU involved)"
export LD_LIBRARY_PATH="$PWD/$out" EMU_TOTAL_MB=2048
log="$out/emu-tests.log"
{
  cargo test --release -p gateway-kernels --features cuda --test gpu_kernels
  GATEWAY_TEST_MODEL="$PWD/$out/tiny.gguf" cargo test --release -p gateway --features cuda --test gpu_parity
} 2>&1 | tee "$log"
# Both tests print SKIPPED rather than fail when they find no usable device; under the emulator
# there always is one, so a skip here means the GPU path did not run: fail.
if grep -q SKIPPED "$log"; then
  echo "CUDA emulator: a GPU test was SKIPPED under the emulator; the GPU path did not run" >&2
  exit 1
fi
