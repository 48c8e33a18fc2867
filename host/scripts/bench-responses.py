#!/usr/bin/env python3
"""What a Responses request costs beside the equivalent chat request, one gateway, one run
(stdlib only): the same 1-token greedy question as `/v1/chat/completions`, as `/v1/responses`
with `store: false`, and as `/v1/responses` stored (the default: one SQLite commit), taking
turns request by request so that drift falls on all three. Prints p50 / p99 in µs.

Usage: host/scripts/bench-responses.py [GATEWAY_BINARY] [--requests 300]
"""
import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = "smollm2-135m-instruct"
MODEL_PATH = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
QUESTION = "Which stage is the Acme deal in?"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binary", nargs="?", default=os.path.join(ROOT, "target", "release", "gateway"))
    ap.add_argument("--requests", type=int, default=300)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="gateway-bench-responses-")
    port = free_port()
    log = open(os.path.join(tmp, "log"), "w")
    proc = subprocess.Popen(
        [a.binary, "serve", "--listen", f"127.0.0.1:{port}", "--threads", "1",
         "--model", f"{MODEL}={MODEL_PATH}", "--ledger", os.path.join(tmp, "usage.sqlite"),
         "--collections-dir", os.path.join(tmp, "collections")],
        stdout=subprocess.DEVNULL, stderr=log)
    try:
        deadline = time.time() + 120
        conn = None
        while conn is None:
            try:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
                c.request("GET", "/ready")
                if c.getresponse().read() is not None:
                    conn = c
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    sys.exit(f"the gateway did not start; see {tmp}/log")
                time.sleep(0.2)
        cases = {
            "chat completion": ("/v1/chat/completions",
                                {"model": MODEL, "messages": [{"role": "user", "content": QUESTION}],
                                 "max_tokens": 1, "temperature": 0}),
            "response, store false": ("/v1/responses",
                                      {"model": MODEL, "input": QUESTION, "max_output_tokens": 1,
                                       "temperature": 0, "store": False}),
            "response, stored": ("/v1/responses",
                                 {"model": MODEL, "input": QUESTION, "max_output_tokens": 1,
                                  "temperature": 0}),
        }
        samples = {k: [] for k in cases}
        for i in range(a.requests + 20):
            for name, (path, body) in cases.items():
                t0 = time.perf_counter()
                conn.request("POST", path, body=json.dumps(body),
                             headers={"content-type": "application/json", "cache-control": "no-cache"})
                r = conn.getresponse()
                data = r.read()
                if r.status != 200:
                    sys.exit(f"{path}: {r.status} {data[:300]!r}")
                if i >= 20:  # warm-up
                    samples[name].append((time.perf_counter() - t0) * 1e6)
        print("| request | p50 µs | p99 µs | p50 vs chat |")
        print("|---|---:|---:|---:|")
        chat = statistics.median(samples["chat completion"])
        for name, s in samples.items():
            s.sort()
            p50 = statistics.median(s)
            print(f"| {name} | {p50:.0f} | {s[int(len(s) * 0.99)]:.0f} | {p50 / chat:.3f} |")
    finally:
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
