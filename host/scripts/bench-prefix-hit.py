#!/usr/bin/env python3
"""What a fully cached prompt costs the engine, one run (stdlib only).

A repeated prompt's KV comes from the prefix cache except for its last block, which the engine
recomputes: the cache never covers a prompt's last token, whose logits the first sampled
token needs. For each size of that last block (the prompt's length modulo the block size),
this prints the median time of the prompt's first one-token completion (a whole prefill), of
the repeated prompt's, the same for a
two-token prompt (what any request costs besides the model: HTTP, tokens, scheduling, one
step with nothing to recompute), the model's decode step (the time each further token adds),
and what the repeated prompt's step costs in decode steps (the short prompt's one step counted
as one). The response cache is bypassed (`Cache-Control: no-cache`), so the engine
runs every request. Several binaries (an old and a new build) run side by side, taking turns
round after round.

Usage: host/scripts/bench-prefix-hit.py [--model PATH] [--rounds 3] [--requests 7] BINARY...
"""
import argparse
import http.client
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BLOCK = 16
LAST_BLOCK = (1, 2, 4, 5, 8, 16)
DECODE_TOKENS = 33


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    def __init__(self, binary, model, tmp):
        self.port = free_port()
        self.log = open(os.path.join(tmp, f"log-{self.port}"), "w")
        cmd = [binary, "serve", "--model", f"m={model}", "--listen", f"127.0.0.1:{self.port}",
               "--block-size", str(BLOCK)]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 300
        while True:
            try:
                self.request({"max_tokens": 1, "prompt": [1, 2, 3]})
                return
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    sys.exit(f"{binary} did not start; see {self.log.name}")
                time.sleep(0.5)

    def request(self, body):
        """Seconds for a greedy completion of `body`, and the tokens it generated."""
        # Speculation off: a decode step is timed, and drafts would shorten it.
        body = dict(body, model="m", temperature=0, ignore_eos=True, speculative=False)
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t0 = time.perf_counter()
        c.request("POST", "/v1/completions", body=json.dumps(body),
                  headers={"content-type": "application/json", "cache-control": "no-cache"})
        r = c.getresponse()
        data = r.read()
        elapsed = time.perf_counter() - t0
        if r.status != 200:
            sys.exit(f"{r.status} {data[:300]!r}")
        return elapsed, json.loads(data)["usage"]["completion_tokens"]

    def stop(self):
        self.proc.terminate()
        self.proc.wait()


def measure(gw, rng, last, requests):
    """Seconds of a prompt whose last block holds `last` tokens, one token out: the first time
    (which fills the prefix cache) and, medians, again; of a two-token prompt; and of a decode
    step on the first."""
    prompt = [rng.randrange(1000, 20000) for _ in range(16 * BLOCK + last)]
    first, _ = gw.request({"prompt": prompt, "max_tokens": 1})
    hit = statistics.median(gw.request({"prompt": prompt, "max_tokens": 1})[0]
                            for _ in range(requests))
    short = statistics.median(gw.request({"prompt": prompt[:2], "max_tokens": 1})[0]
                              for _ in range(requests))
    steps = []
    for _ in range(max(requests // 2, 1)):
        long, n = gw.request({"prompt": prompt, "max_tokens": DECODE_TOKENS})
        one, _ = gw.request({"prompt": prompt, "max_tokens": 1})
        steps.append((long - one) / (n - 1))
    return first, hit, short, statistics.median(steps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binaries", nargs="+")
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=7)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="gateway-bench-prefix-")
    results = {(b, last): [] for b in a.binaries for last in LAST_BLOCK}
    for rnd in range(a.rounds):
        for b in a.binaries:
            gw = Gateway(b, a.model, tmp)
            try:
                for last in LAST_BLOCK:
                    rng = random.Random(rnd * 100 + last)
                    results[(b, last)].append(measure(gw, rng, last, a.requests))
            finally:
                gw.stop()
    print(f"{os.path.basename(a.model)}, block {BLOCK}, prompts of {16 * BLOCK} + last-block "
          f"tokens; medians over {a.rounds} rounds")
    print("| binary | last block | first time (ms) | repeated (ms) | 2-token prompt (ms) "
          "| decode step (ms) | repeated prompt's step (decode steps) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for b in a.binaries:
        for last in LAST_BLOCK:
            first, hit, short, step = (statistics.median(r[i] for r in results[(b, last)])
                                       for i in range(4))
            print(f"| {b} | {last} | {first * 1e3:.0f} | {hit * 1e3:.1f} | {short * 1e3:.1f} "
                  f"| {step * 1e3:.2f} | {1 + (hit - short) / step:.2f} |")


if __name__ == "__main__":
    main()
