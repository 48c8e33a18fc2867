#!/usr/bin/env bash
# Builds llama.cpp's llama-bench, llama-server, llama-perplexity and llama-quantize (the peer the
# benchmarks and the precision test compare against) from
# the llama.cpp vendored in the llama-cpp-python sdist on PyPI, once, into a cache outside the
# clone ($LLAMA_PEER_DIR, default ~/.cache/llama-peer). Prints the folder holding the binaries.
# LLAMA_PEER_CPU=avx2 builds it for AVX2 + FMA without AVX-512 (its own folder), the peer of a
# gateway built for x86-64-v3 (host/scripts/bench-avx2.sh); the default targets this CPU.
# LLAMA_PEER_CPU=avx512 builds it for AVX-512 (F, VBMI, VNNI, BF16) without AMX: on CPUs whose
# AMX tiles crash ggml's AMX buffers (Sapphire Rapids vCPUs), the native build must run with
# --no-repack, which also drops its repacked AVX-512 GEMMs; this build keeps them, as on a Zen 4.
# Needs cmake, ninja and a C++ compiler (Debian: cmake ninja-build g++); ~15 min on 2 cores.
set -euo pipefail
version=0.3.36
dir="${LLAMA_PEER_DIR:-$HOME/.cache/llama-peer}"
case "${LLAMA_PEER_CPU:-native}" in
  native) build="$dir/build-$version" cpu_flags=(-DGGML_NATIVE=ON) ;;
  avx2) build="$dir/build-$version-avx2" cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON
    -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
  avx512) build="$dir/build-$version-avx512" cpu_flags=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON
    -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON
    -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=OFF -DGGML_AMX_TILE=OFF
    -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF) ;;
  *) echo "LLAMA_PEER_CPU is native, avx2 or avx512" >&2; exit 1 ;;
esac
bin="$build/bin"
tools=(llama-bench llama-server llama-cli llama-perplexity llama-quantize)
built=1
for t in "${tools[@]}"; do [ -x "$bin/$t" ] || built=0; done
if [ "$built" = 1 ]; then
  echo "$bin"
  exit 0
fi
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  if [ "$(id -u)" = 0 ]; then apt-get install -y -qq cmake ninja-build g++ >&2 || { apt-get update -qq && apt-get install -y -qq cmake ninja-build g++ >&2; }
  else echo "cmake and ninja are required" >&2; exit 1; fi
fi
mkdir -p "$dir"
tarball="$dir/llama_cpp_python-$version.tar.gz"
[ -f "$tarball" ] || python3 -m pip download --quiet --no-deps --no-binary llama-cpp-python \
  --disable-pip-version-check "llama-cpp-python==$version" -d "$dir" >&2
src="$dir/src-$version"
if [ ! -d "$src" ]; then
  rm -rf "$src.part" && mkdir -p "$src.part"
  tar -xzf "$tarball" -C "$src.part" --strip-components=3 "llama_cpp_python-$version/vendor/llama.cpp"
  mv "$src.part" "$src"
fi
cmake -S "$src" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${cpu_flags[@]}" \
  -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$build" --target "${tools[@]}" -j "$(nproc)" >&2
echo "$bin"
