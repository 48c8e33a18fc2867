#!/usr/bin/env python3
"""Serving under staggered arrivals, one run (stdlib only): each of C clients sends a new
prompt as soon as its last answer ends, so prompts are prefilled beside the other clients'
decodes (mixed steps), as under real traffic, unlike a benchmark whose requests all start
together. Prompts are 256-271 random tokens, 48 tokens out, greedy, prefix caching,
speculation and the response cache off. Prints each binary's aggregate output tok/s, requests
finished and median time to first token (streamed), per round; binaries take turns.

Usage: host/scripts/bench-staggered.py [--model PATH] [--clients 4] [--seconds 30]
       [--rounds 2] BINARY...
"""
import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def request(port, prompt, tokens):
    """Seconds to the first streamed token, and the tokens streamed."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "speculative": False, "stream": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"content-type": "application/json",
                                  "cache-control": "no-cache"})
    t0, first, streamed = time.time(), None, 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if line.startswith(b"data: {"):
                first = first if first is not None else time.time() - t0
                streamed += 1
    return first, streamed


def run(binary, model, clients, seconds):
    port = free_port()
    proc = subprocess.Popen([binary, "serve", "-m", f"m={model}", "-l", f"127.0.0.1:{port}",
                             "--no-prefix-caching"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while True:
            try:
                request(port, [1, 2, 3], 1)
                break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    sys.exit(f"{binary} did not start")
                time.sleep(0.5)
        stop = time.time() + seconds
        firsts, total, lock = [], [0], threading.Lock()

        def client(i):
            rng = random.Random(i)
            while time.time() < stop:
                prompt = [rng.randrange(1000, 20000) for _ in range(256 + rng.randrange(16))]
                first, streamed = request(port, prompt, 48)
                with lock:
                    firsts.append(first)
                    total[0] += streamed

        t0 = time.time()
        threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return total[0] / (time.time() - t0), len(firsts), statistics.median(firsts)
    finally:
        proc.terminate()
        proc.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binaries", nargs="+")
    ap.add_argument("--model", default=os.path.join(ROOT, "models",
                                                    "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    print(f"{os.path.basename(a.model)}, {a.clients} clients, {a.seconds:.0f} s a round")
    print("| round | binary | output tok/s | requests | median time to first token (ms) |")
    print("|---:|---|---:|---:|---:|")
    for r in range(a.rounds):
        order = a.binaries if r % 2 == 0 else a.binaries[::-1]
        for b in order:
            rate, n, first = run(b, a.model, a.clients, a.seconds)
            print(f"| {r + 1} | {b} | {rate:.1f} | {n} | {first * 1e3:.0f} |", flush=True)


if __name__ == "__main__":
    main()
