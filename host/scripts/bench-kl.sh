#!/usr/bin/env bash
# Precision as the field measures it, ours and llama.cpp's side by side on one GGUF and the same
# tokens: perplexity, KL divergence from the full-precision distribution (the GGUF's weights
# dequantized to f32, f32 activations) and top-1 agreement.
#   host/scripts/bench-kl.sh MODEL.gguf [CHUNKS]   (default 40 chunks of 512 tokens)
# The text is Debian's FAQ (`apt-get download debian-faq`, ~43k tokens). llama.cpp writes the
# reference once: `llama-quantize --allow-requantize` turns the GGUF into F32, and
# `llama-perplexity --kl-divergence-base` scores the text with it (cached outside the clone, keyed
# by the GGUF's sha256). Then `llama-perplexity --kl-divergence` gives llama.cpp's figures and
# `gateway eval-kl --llama-base` ours, against both our own f32 path and llama.cpp's.
# KERNELS picks our settings (`eval-kl --kernels`, for example `decode16,decode8`).
set -euo pipefail
cd "$(dirname "$0")/../.."
model="${1:?usage: bench-kl.sh MODEL.gguf [CHUNKS]}"
chunks="${2:-40}"
peer="$(host/scripts/build-llama-peer.sh)"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/gateway-kl"
mkdir -p "$cache"
text="$cache/debian-faq.en.txt"
if [ ! -s "$text" ]; then
  (cd "$cache" && { ls debian-faq_*.deb >/dev/null 2>&1 || apt-get download debian-faq; })
  deb="$(ls "$cache"/debian-faq_*.deb | tail -1)"
  dpkg-deb --fsys-tarfile "$deb" | tar -xO ./usr/share/doc/debian/FAQ/debian-faq.en.txt.gz |
    gunzip >"$text.part"
  mv "$text.part" "$text"
fi
# ggml's AMX and repacked weight buffers crash on some CPUs with AMX (a segfault in
# ggml::cpu::amx on this machine's Sapphire Rapids vCPUs): llama.cpp runs without them there.
repack=()
"$peer/llama-bench" -m "$model" -t 1 -p 8 -n 0 -r 1 >/dev/null 2>&1 || repack=(--no-repack)
sum="$(sha256sum "$model" | cut -c1-16)"
base="$cache/$sum.c512x$chunks.base"
if [ ! -s "$base" ]; then
  f32="$cache/$sum.f32.gguf"
  "$peer/llama-quantize" --allow-requantize "$model" "$f32" F32 >/dev/null 2>&1
  "$peer/llama-perplexity" -m "$f32" -f "$text" -c 512 --chunks "$chunks" -t "$(nproc)" \
    "${repack[@]}" --kl-divergence-base "$base.part" >/dev/null 2>&1
  rm -f "$f32"
  mv "$base.part" "$base"
fi
echo "## llama.cpp on $(basename "$model") ${repack[*]}"
"$peer/llama-perplexity" -m "$model" -c 512 -t "$(nproc)" "${repack[@]}" \
  --kl-divergence-base "$base" --kl-divergence 2>&1 |
  grep -E '^(Mean PPL\(Q\) |Mean PPL\(base\)|Mean +KLD|Median +KLD|99\.0% +KLD|Maximum KLD|Same top p)'
echo "## gateway"
cargo build --release --quiet --bin gateway
target/release/gateway eval-kl -m "$model" --llama-base "$base" \
  ${KERNELS:+--kernels "$KERNELS"} 2>/dev/null
