#!/usr/bin/env bash
# Side by side on one GGUF and the same cores, in one run: `gateway bench` against llama.cpp's
# `llama-bench` (prefill and single-stream decode; the gateway's decode also with the decode
# activation bits its default did not take: 16 where `auto` took 8, else 8), then both servers
# over HTTP at the same
# concurrency levels (aggregate output tok/s, 128-token prompts, 64 tokens out, greedy).
# Prints the figures and the ratios. Usage: host/scripts/bench-vs-llama.sh MODEL.gguf [CONC...]
# GATEWAY_FLAGS adds engine flags to every gateway run (for example `--prompt-precision int8`,
# what a CPU without AMX tiles runs by default); LLAMA_PEER_CPU picks the peer's build
# (build-llama-peer.sh).
# Builds the llama.cpp peer once (host/scripts/build-llama-peer.sh, cached outside the clone).
set -euo pipefail
cd "$(dirname "$0")/../.."
model="${1:?usage: bench-vs-llama.sh MODEL.gguf [concurrency...]}"
shift
conc=("${@:-1 4}")
[ "${#conc[@]}" -gt 0 ] || conc=(1 4)
# llama-server gets as many slots as the highest concurrency (`-np 4` for the default levels),
# each with a 4096-token context.
np=1
for c in ${conc[*]}; do [ "$c" -gt "$np" ] && np="$c"; done
threads="$(nproc)"
# GATEWAY_BIN: a gateway built elsewhere (host/scripts/bench-avx2.sh passes its AVX2 build).
gw="${GATEWAY_BIN:-target/release/gateway}"
[ -n "${GATEWAY_BIN:-}" ] || cargo build --release --quiet --bin gateway
read -r -a gwflags <<<"${GATEWAY_FLAGS:-}"
peer="$(host/scripts/build-llama-peer.sh)"
# ggml's AMX buffers segfault on some CPUs with AMX (this machine's Sapphire Rapids vCPUs), and
# `--repack 0`, which avoids them, also drops llama.cpp's repacked AVX-512 GEMMs. There the peer
# is llama.cpp built for AVX-512 without AMX (build-llama-peer.sh, LLAMA_PEER_CPU=avx512), as it
# runs on a Zen 4; only a peer chosen by LLAMA_PEER_CPU that crashes runs with `--repack 0`.
repacks=0,1 server_repack=()
# (The group's stderr is dropped, so the shell does not report the crash it expects.)
if ! { "$peer/llama-bench" -m "$model" -t 1 -p 8 -n 0 -r 1 >/dev/null 2>&1; } 2>/dev/null; then
  if [ -z "${LLAMA_PEER_CPU:-}" ]; then
    peer="$(LLAMA_PEER_CPU=avx512 host/scripts/build-llama-peer.sh)"
    echo "llama.cpp's AMX buffers crash on this CPU: the peer is its AVX-512 build without AMX"
  else
    repacks=0 server_repack=(--no-repack)
    echo "llama.cpp crashes with its repacked weights on this CPU: it runs with --no-repack"
  fi
fi
# llama-bench runs with and without repacked weights and each round keeps its faster figure per
# test (repacking speeds its decode up and, on some CPUs, slows prefill down); llama-server runs
# with its default, repacked weights.
best_of_repacks() {
  awk -F'|' '/pp512|tg64/ { t = ($0 ~ /pp512/) ? "pp512" : "tg64"; v = $(NF - 1) + 0
    if (v > best[t]) best[t] = v }
    END { for (t in best) printf "| %s | %.2f |\n", t, best[t] }'
}

# Prefill and decode alternate between the engines, a round each at a time: on a shared
# machine the rate at which memory streams drifts by a third within minutes, and a ratio of
# two runs minutes apart measured the drift.
rounds=3
: >/tmp/bench-vs-llama.gateway
: >/tmp/bench-vs-llama.gateway8
: >/tmp/bench-vs-llama.llama
echo "## engines without HTTP ($threads threads, $rounds alternating rounds)"
for _ in $(seq "$rounds"); do
  "$gw" bench -m "$model" "${gwflags[@]}" --prompt-tokens 512 --gen-tokens 64 --repeat 1 --single-stream-only \
    2>/dev/null >>/tmp/bench-vs-llama.gateway
  # Decode only, with the other decode activation bits (8, llama.cpp's own rounding, or 16).
  other=8
  grep -q ', 8-bit decode activations' /tmp/bench-vs-llama.gateway && other=16
  "$gw" bench -m "$model" "${gwflags[@]}" --decode-activation-bits "$other" --prompt-tokens 16 --gen-tokens 64 \
    --repeat 1 --single-stream-only 2>/dev/null >>/tmp/bench-vs-llama.gateway8
  "$peer/llama-bench" -m "$model" -t "$threads" --repack "$repacks" -p 512 -n 64 -r 1 -o md 2>/dev/null \
    | best_of_repacks >>/tmp/bench-vs-llama.llama
done
"$gw" bench -m "$model" "${gwflags[@]}" --prompt-tokens 512 --gen-tokens 64 --concurrency 1 --repeat 3 --kv-seqs 2 \
  2>/dev/null

echo "## servers over HTTP"
port_gw=18180 port_ll=18181
"$gw" serve -m "bench=$model" "${gwflags[@]}" -l "127.0.0.1:$port_gw" --no-prefix-caching >/tmp/bench-vs-llama.gw.log 2>&1 &
pid_gw=$!
"$peer/llama-server" -m "$model" -t "$threads" "${server_repack[@]}" --port "$port_ll" -np "$np" -c $((4096 * np)) \
  >/tmp/bench-vs-llama.ll.log 2>&1 &
pid_ll=$!
trap 'kill $pid_gw $pid_ll 2>/dev/null || true' EXIT
python3 - "$port_gw" "$port_ll" /tmp/bench-vs-llama.gateway /tmp/bench-vs-llama.llama \
  /tmp/bench-vs-llama.gateway8 "${conc[@]}" <<'PY'
import json, re, sys, threading, time, urllib.request

gw, ll, gw_table, ll_table, gw8_table = sys.argv[1:6]
levels = [int(c) for c in " ".join(sys.argv[6:]).split()]

def wait(port):
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return
        except Exception:
            time.sleep(0.5)
    raise SystemExit(f"server on {port} did not come up")

def complete(port, prompt):
    body = json.dumps({"model": "bench", "prompt": prompt, "max_tokens": 64, "temperature": 0,
                       "ignore_eos": True, "speculative": False}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"content-type": "application/json", "cache-control": "no-cache"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)["usage"]["completion_tokens"]

TEXT = ("The quarterly report shows that customer satisfaction improved across all regions, "
        "driven by faster support response times and a simpler onboarding flow. ")

def aggregate(port, c, salt):
    prompts = [f"Request {salt}-{i}. " + TEXT * 4 for i in range(c)]
    out = [0] * c
    def run(i):
        out[i] = complete(port, prompts[i])
    t0 = time.time()
    ts = [threading.Thread(target=run, args=(i,)) for i in range(c)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return sum(out) / (time.time() - t0)

wait(gw); wait(ll)
complete(gw, "warm up"); complete(ll, "warm up")
print("| concurrency | gateway tok/s | llama-server tok/s | ratio |")
print("|---|---|---|---|")
for n, c in enumerate(levels):
    # Alternating rounds here too; medians of three.
    runs = [(aggregate(gw, c, f"g{n}{r}"), aggregate(ll, c, f"l{n}{r}")) for r in range(3)]
    g, l = (sorted(x)[1] for x in zip(*runs))
    print(f"| {c} | {g:.1f} | {l:.1f} | {g / l:.2f}x |")

def nums(pattern, text):
    return [float(v) for v in re.findall(pattern, text)]
g, l, g8 = open(gw_table).read(), open(ll_table).read(), open(gw8_table).read()
bits = lambda text: (re.findall(r", (\d+)-bit decode activations", text) or ["?"])[0]
decode = r"decode, single stream \| ([\d.]+)"
rows = [("prefill, 512-token prompt", nums(r"prefill, 512 prompt tokens \| ([\d.]+)", g), nums(r"pp512 \|\s+([\d.]+)", l)),
        (f"decode, single stream ({bits(g)}-bit activations, the default)", nums(decode, g), nums(r"tg64 \|\s+([\d.]+)", l)),
        (f"decode, `--decode-activation-bits {bits(g8)}`", nums(decode, g8), nums(r"tg64 \|\s+([\d.]+)", l))]
print()
print("| engine, no HTTP | gateway tok/s, per round | llama-bench tok/s, per round | ratio per round | median ratio |")
print("|---|---|---|---|---|")
for name, a, b in rows:
    ratios = sorted(x / y for x, y in zip(a, b))
    show = lambda xs: " / ".join(f"{x:.1f}" for x in xs)
    med = ratios[len(ratios) // 2] if ratios else float("nan")
    print(f"| {name} | {show(a)} | {show(b)} | {' / '.join(f'{x / y:.2f}x' for x, y in zip(a, b))} | {med:.2f}x |")
PY
