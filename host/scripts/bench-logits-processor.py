#!/usr/bin/env python3
"""Decode cost of a logits-processor plugin, side by side in one run: output tok/s of a plain
tenant and of a tenant whose completions go through the CRM guardrail (plugins/crm-guardrail),
same prompts, same concurrency, alternating rounds; then the guardrail's per-step call time
(p50 / p99 from the gateway's histogram).

Needs target/release/gateway and the guardrail component
(cargo build --release --target wasm32-wasip2 --target-dir target/wasm -p crm-guardrail).

Usage: host/scripts/bench-logits-processor.py [--concurrency 8] [--tokens 128] [--rounds 3]
"""
import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = "smollm2-135m-instruct"


def sha(key):
    return hashlib.sha256(key.encode()).hexdigest()


def start(work):
    plugins = os.path.join(work, "plugins")
    os.makedirs(os.path.join(plugins, "guard"))
    shutil.copy(os.path.join(ROOT, "target/wasm/wasm32-wasip2/release/crm_guardrail.wasm"),
                os.path.join(plugins, "guard", "guardrail.wasm"))
    with open(os.path.join(work, "policies.toml"), "w") as f:
        f.write(f"""[[tenants]]
name = "guard"
keys = [{{ id = "g", sha256 = "{sha('sk-guard')}" }}]
logits_processor = "guardrail"
[tenants.config]
deny = "Salesforce, HubSpot, Zoho, Pipedrive, PRJ-7731"
[[tenants]]
name = "open"
keys = [{{ id = "o", sha256 = "{sha('sk-open')}" }}]
""")
    with open(os.path.join(work, "gateway.toml"), "w") as f:
        f.write(f"""policies = "{work}/policies.toml"
ledger = "{work}/usage.sqlite"
[plugins]
dir = "{plugins}"
[[models]]
name = "{MODEL}"
path = "{ROOT}/models/SmolLM2-135M-Instruct.Q4_1.gguf"
""")
    log = open(os.path.join(work, "gateway.log"), "w")
    p = subprocess.Popen([os.path.join(ROOT, "target/release/gateway"), "serve", "--listen", "127.0.0.1:0",
                          "--config", os.path.join(work, "gateway.toml")], stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):
        time.sleep(0.1)
        text = open(os.path.join(work, "gateway.log")).read()
        if "serving the OpenAI API" in text:
            line = [l for l in text.splitlines() if "serving the OpenAI API" in l][0]
            return p, "http://" + line.split("addr=")[1].split()[0]
    p.kill()
    sys.exit("the gateway did not start:\n" + open(os.path.join(work, "gateway.log")).read())


def post(base, key, body):
    req = urllib.request.Request(base + "/v1/chat/completions", json.dumps(body).encode(),
                                 {"content-type": "application/json", "authorization": "Bearer " + key,
                                  "cache-control": "no-cache"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.load(r)


def round_(base, key, c, tokens, seed):
    body = lambda i: {"model": MODEL, "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0, "seed": seed * 100 + i,
                      "messages": [{"role": "user", "content": f"Write account note {i} for the sales team."}]}
    t = time.time()
    with ThreadPoolExecutor(c) as ex:
        out = list(ex.map(lambda i: post(base, key, body(i)), range(c)))
    return sum(r["usage"]["completion_tokens"] for r in out) / (time.time() - t)


def quantile(buckets, count, q):
    """Upper bound of the bucket holding quantile q (Prometheus cumulative buckets)."""
    for le, n in buckets:
        if n >= q * count:
            return le
    return float("inf")


def step_times(base):
    text = urllib.request.urlopen(base + "/metrics").read().decode()
    buckets, count = [], 0
    for l in text.splitlines():
        if l.startswith("gateway_logits_processor_step_seconds_bucket"):
            le = l.split('le="')[1].split('"')[0]
            buckets.append((float(le), float(l.rsplit(" ", 1)[1])))
        if l.startswith("gateway_logits_processor_step_seconds_count"):
            count = float(l.rsplit(" ", 1)[1])
    return count, quantile(buckets, count, 0.5), quantile(buckets, count, 0.99)


def main():
    a = argparse.ArgumentParser()
    a.add_argument("--concurrency", type=int, default=8)
    a.add_argument("--tokens", type=int, default=128)
    a.add_argument("--rounds", type=int, default=3)
    o = a.parse_args()
    work = tempfile.mkdtemp(prefix="bench-logits-")
    p, base = start(work)
    try:
        round_(base, "sk-open", o.concurrency, 16, 0)  # warm-up
        round_(base, "sk-guard", o.concurrency, 16, 0)
        rates = {"sk-open": [], "sk-guard": []}
        for r in range(o.rounds):
            for key in rates:
                rates[key].append(round_(base, key, o.concurrency, o.tokens, r + 1))
        med = {k: sorted(v)[len(v) // 2] for k, v in rates.items()}
        count, p50, p99 = step_times(base)
        print(f"| concurrency {o.concurrency}, {o.tokens} tokens, median of {o.rounds} | plain | guardrail | ratio |")
        print("|---|---:|---:|---:|")
        print(f"| output tok/s | {med['sk-open']:.1f} | {med['sk-guard']:.1f} | {med['sk-guard'] / med['sk-open']:.3f}x |")
        print(f"guardrail step (5 phrases): p50 <= {p50 * 1e6:.0f} µs, p99 <= {p99 * 1e6:.0f} µs over {count:.0f} steps (histogram bucket bounds)")
    finally:
        p.terminate()
        p.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
