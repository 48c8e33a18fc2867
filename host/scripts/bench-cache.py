#!/usr/bin/env python3
"""What the response cache costs and saves, one gateway pinned to one core, one run (stdlib
only). Requests take turns so that drift falls on every case alike. Prints p50 / p99 in µs:

- an exact hit (1-token greedy chat, non-streamed) beside `GET /v1/models`, the cheapest
  authenticated request, and beside the same chat run by the model (`Cache-Control: no-cache`);
- a miss for a tenant with the semantic cache (the last user message embedded and looked up)
  beside a miss for a tenant with only the exact cache, and one whose cache is off: each
  request a new question, so each is a miss.

Usage: host/scripts/bench-cache.py [GATEWAY_BINARY] [--requests 300]
"""
import argparse
import hashlib
import http.client
import json
import os
import random
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = "smollm2-135m-instruct"
MODEL_PATH = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
EMBEDDINGS = os.path.join(ROOT, "models", "all-MiniLM-L6-v2")
TENANTS = {"exact": "", "semantic": "cache = { semantic = true }", "off": "cache = { enabled = false }"}


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config(tmp, port):
    policy = ""
    for name, extra in TENANTS.items():
        sha = hashlib.sha256(f"sk-{name}".encode()).hexdigest()
        policy += f'[[tenants]]\nname = "{name}"\nkeys = [{{ id = "k", sha256 = "{sha}" }}]\n{extra}\n'
    with open(os.path.join(tmp, "policies.toml"), "w") as f:
        f.write(policy)
    path = os.path.join(tmp, "gateway.toml")
    with open(path, "w") as f:
        f.write(f'listen = "127.0.0.1:{port}"\npolicies = "{tmp}/policies.toml"\n'
                f'ledger = "{tmp}/usage.sqlite"\ncollections_dir = "{tmp}/collections"\n'
                f'[[models]]\nname = "{MODEL}"\npath = "{MODEL_PATH}"\n[models.engine]\nthreads = 1\n'
                f'[[embeddings]]\nname = "all-minilm-l6-v2"\npath = "{EMBEDDINGS}"\n')
    return path


def connect(port, proc, tmp):
    deadline = time.time() + 120
    while True:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            c.request("GET", "/ready")
            c.getresponse().read()
            return c
        except OSError:
            if time.time() > deadline or proc.poll() is not None:
                sys.exit(f"the gateway did not start; see {tmp}/log")
            time.sleep(0.2)


def timed(conn, method, path, tenant, body=None, headers=None):
    h = {"authorization": f"Bearer sk-{tenant}", "content-type": "application/json"}
    h.update(headers or {})
    t0 = time.perf_counter()
    conn.request(method, path, body=json.dumps(body) if body else None, headers=h)
    r = conn.getresponse()
    data = r.read()
    us = (time.perf_counter() - t0) * 1e6
    if r.status != 200:
        sys.exit(f"{path}: {r.status} {data[:300]!r}")
    return us, r.getheader("x-gateway-cache")


WORDS = ("invoice renewal contract discount pipeline forecast churn onboarding refund escalation "
         "warranty shipment quota territory webinar lead campaign subscription upgrade outage "
         "password migration audit compliance budget headcount roadmap feature bug latency "
         "dashboard export import integration webhook calendar meeting proposal negotiation "
         "partner reseller license seat trial survey feedback ticket priority deadline holiday "
         "weather recipe garden guitar mountain river planet poem history chemistry football").split()


def question(rng):
    return "Explain " + " and ".join(rng.sample(WORDS, 3)) + f" for {rng.choice(WORDS)} teams?"


def chat(text):
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
            "temperature": 0}


def report(samples, base=None):
    rows = []
    for name, xs in samples.items():
        xs = sorted(xs)
        p50, p99 = statistics.median(xs), xs[int(len(xs) * 0.99) - 1]
        rows.append((name, p50, p99))
    for name, p50, p99 in rows:
        ratio = f"  {p50 / rows[0][1]:.2f}x of {rows[0][0]}" if base else ""
        print(f"  {name:<34} p50 {p50:9.0f} µs   p99 {p99:9.0f} µs{ratio}")
    return {name: p50 for name, p50, _ in rows}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary", nargs="?", default=os.path.join(ROOT, "target", "release", "gateway"))
    ap.add_argument("--requests", type=int, default=300)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="gateway-bench-cache-")
    port = free_port()
    cmd = [a.binary, "serve", "--config", config(tmp, port)]
    if shutil.which("taskset"):
        cmd = ["taskset", "-c", "0"] + cmd
    log = open(os.path.join(tmp, "log"), "w")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)
    try:
        conn = connect(port, proc, tmp)
        q = chat("Which stage is the Acme deal in?")
        timed(conn, "POST", "/v1/chat/completions", "exact", q)
        hits = {"GET /v1/models": [], "exact hit (chat)": [], "the same chat, run (no-cache)": []}
        for i in range(a.requests + 20):
            m, _ = timed(conn, "GET", "/v1/models", "exact")
            h, state = timed(conn, "POST", "/v1/chat/completions", "exact", q)
            assert state == "hit", state
            r, _ = timed(conn, "POST", "/v1/chat/completions", "exact", q, {"cache-control": "no-cache"})
            if i >= 20:
                for k, v in zip(hits, (m, h, r)):
                    hits[k].append(v)
        print(f"exact hits, {a.requests} requests each, gateway on one core:")
        report(hits, base=True)

        misses = {f"miss, cache {t}": [] for t in ("off", "exact", "semantic")}
        rng = random.Random(7)
        for i in range(a.requests + 20):
            for t in ("off", "exact", "semantic"):
                # A question no tenant asked before, and unlike the others: a miss for the
                # semantic cache too (questions differing in a number alone would hit it).
                body = chat(question(rng))
                us, state = timed(conn, "POST", "/v1/chat/completions", t, body)
                assert state == (None if t == "off" else "miss"), (t, state)
                if i >= 20:
                    misses[f"miss, cache {t}"].append(us)
        print(f"misses (1-token greedy chat, a new question each), {a.requests} requests each:")
        p = report(misses)
        print(f"  semantic lookup adds {(p['miss, cache semantic'] - p['miss, cache exact']) / 1e3:.2f} ms p50 "
              f"to a miss; the exact cache adds {(p['miss, cache exact'] - p['miss, cache off']) / 1e3:.2f} ms")
    finally:
        proc.terminate()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
