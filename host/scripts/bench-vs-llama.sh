#!/usr/bin/env bash
# Side by side on one GGUF and the same cores, in one run: `gateway bench` against llama.cpp's
# `llama-bench` (prefill and single-stream decode), then both servers over HTTP at the same
# concurrency levels (aggregate output tok/s, 128-token prompts, 64 tokens out, greedy).
# Prints the figures and the ratios. Usage: host/scripts/bench-vs-llama.sh MODEL.gguf [CONC...]
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
peer="$(host/scripts/build-llama-peer.sh)"
cargo build --release --quiet --bin gateway
gw=target/release/gateway

echo "## engines without HTTP ($threads threads)"
"$gw" bench -m "$model" --prompt-tokens 512 --gen-tokens 64 --concurrency 1 --repeat 3 --kv-seqs 2 \
  2>/dev/null | tee /tmp/bench-vs-llama.gateway
"$peer/llama-bench" -m "$model" -t "$threads" -p 512 -n 64 -r 3 -o md 2>/dev/null | tee /tmp/bench-vs-llama.llama

echo "## servers over HTTP"
port_gw=18180 port_ll=18181
"$gw" serve -m "bench=$model" -l "127.0.0.1:$port_gw" --no-prefix-caching >/tmp/bench-vs-llama.gw.log 2>&1 &
pid_gw=$!
"$peer/llama-server" -m "$model" -t "$threads" --port "$port_ll" -np "$np" -c $((4096 * np)) \
  >/tmp/bench-vs-llama.ll.log 2>&1 &
pid_ll=$!
trap 'kill $pid_gw $pid_ll 2>/dev/null || true' EXIT
python3 - "$port_gw" "$port_ll" /tmp/bench-vs-llama.gateway /tmp/bench-vs-llama.llama "${conc[@]}" <<'PY'
import json, re, sys, threading, time, urllib.request

gw, ll, gw_table, ll_table = sys.argv[1:5]
levels = [int(c) for c in " ".join(sys.argv[5:]).split()]

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
                                 {"content-type": "application/json"})
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
    g = sorted(aggregate(gw, c, f"g{n}{r}") for r in range(3))[1]
    l = sorted(aggregate(ll, c, f"l{n}{r}") for r in range(3))[1]
    print(f"| {c} | {g:.1f} | {l:.1f} | {g / l:.2f}x |")

def num(pattern, text):
    m = re.search(pattern, text)
    return float(m.group(1)) if m else float("nan")
g, l = open(gw_table).read(), open(ll_table).read()
rows = [("prefill, 512-token prompt", num(r"prefill, 512 prompt tokens \| ([\d.]+)", g), num(r"pp512 \|\s+([\d.]+)", l)),
        ("decode, single stream", num(r"decode, single stream \| ([\d.]+)", g), num(r"tg64 \|\s+([\d.]+)", l))]
print()
print("| engine, no HTTP | gateway tok/s | llama-bench tok/s | ratio |")
print("|---|---|---|---|")
for name, a, b in rows:
    print(f"| {name} | {a:.1f} | {b:.1f} | {a / b:.2f}x |")
PY
