#!/usr/bin/env python3
"""Prompt-lookup speculation off and on over HTTP, one gateway binary on one GGUF.

Usage: host/scripts/bench-speculation.py GATEWAY_BIN MODEL.gguf [SPECULATIVE_TOKENS]
Env: N (tokens per answer, default 96), REPS (median of, default 3), DECODE_BITS (the engine's
decode_activation_bits, default auto).

Three greedy workloads: extracting every email address of a CRM export (the answer copies
spans of the prompt), rewriting a source file with its comments removed (long copies), and
free text (little to copy). Each prompt is sent once first, so both timings reuse its cached
prefix and measure decoding. Prints the times, the ratio, whether the two outputs are
identical, and the drafted / accepted counts from /metrics.
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

gateway, model = sys.argv[1], sys.argv[2]
spec_tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 4
tokens, reps = int(os.environ.get("N", "96")), int(os.environ.get("REPS", "3"))
bits = os.environ.get("DECODE_BITS", "auto")
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
base = f"http://127.0.0.1:{port}"


def contacts():
    names = ["Ada Park", "Bo Chen", "Cruz Ortiz", "Dee Novak", "Eli Haddad", "Fay Moreau"]
    text = "Account notes, week 48.\n"
    for i in range(18):
        n = names[i % 6]
        user = n.lower().replace(" ", ".")
        domain = ["corp", "retail", "labs"][i % 3]
        text += f"- {n} (ticket #{4100 + i * 7}) wrote from {user}{i}@example-{domain}.com about renewal terms.\n"
    return text + "\nEvery email address in the notes above, one per line:\n"


source = open(os.path.join(os.path.dirname(__file__), "../src/engine/spec.rs")).read()[:1500]
workloads = {
    "extraction": contacts(),
    "code edit": "Rewrite this Rust code with the doc comments removed:\n" + source + "\n\n",
    "free text": "Write a short story about a lighthouse keeper who finds a strange map.",
}


def complete(prompt, speculative, n):
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
                       "ignore_eos": True, "speculative": speculative}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body, {"content-type": "application/json", "cache-control": "no-cache"})
    t0 = time.time()
    with urllib.request.urlopen(req, timeout=600) as r:
        text = json.load(r)["choices"][0]["text"]
    return time.time() - t0, text


def counters():
    with urllib.request.urlopen(f"{base}/metrics") as r:
        lines = r.read().decode().splitlines()
    pick = lambda name: sum(float(l.split()[-1]) for l in lines if l.startswith(name))
    return pick("gateway_spec_draft_tokens_total"), pick("gateway_spec_accepted_tokens_total")


with tempfile.TemporaryDirectory() as tmp:
    config = os.path.join(tmp, "bench.toml")
    with open(config, "w") as f:
        f.write(f'listen = "127.0.0.1:{port}"\nembeddings = []\nledger = "{tmp}/usage.sqlite"\n'
                f'collections_dir = "{tmp}/collections"\n[[models]]\nname = "m"\npath = "{model}"\n'
                f"[models.engine]\nspeculative_tokens = {spec_tokens}\n"
                f'decode_activation_bits = "{bits}"\n')
    server = subprocess.Popen([gateway, "serve", "--config", config],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(f"{base}/health", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        print(f"{os.path.basename(model)}, speculative_tokens = {spec_tokens}, "
              f"decode_activation_bits = {bits}, {tokens} tokens, median of {reps}")
        print("| workload | off s | on s | ratio | outputs | drafted | accepted |")
        print("|---|---:|---:|---:|---|---:|---:|")
        for name, prompt in workloads.items():
            complete(prompt, False, 1)
            d0, a0 = counters()
            times, texts = {False: [], True: []}, {}
            for _ in range(reps):
                for speculative in (False, True):
                    dt, texts[speculative] = complete(prompt, speculative, tokens)
                    times[speculative].append(dt)
            off, on = (sorted(times[k])[reps // 2] for k in (False, True))
            d1, a1 = counters()
            same = "identical" if texts[False] == texts[True] else "DIFFER"
            print(f"| {name} | {off:.2f} | {on:.2f} | {off / on:.2f}x | {same} | {d1 - d0:.0f} | {a1 - a0:.0f} |")
    finally:
        server.kill()
        server.wait()
