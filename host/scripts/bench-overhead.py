#!/usr/bin/env python3
"""Request overhead through the whole server, for requests that generate nothing and a chat that
generates one token, two gateway binaries side by side in one run (stdlib only).

Each binary serves on its own port with its own policies, ledger and collections; the rounds
alternate between them so that the machine's drift falls on both. Measured, per binary, over
keep-alive HTTP/1.1 from one client: p50 / p99 in µs of
- `GET /v1/models` (admission, routing, a JSON answer),
- a BM25 search of a 200-document collection (admission, the pipeline's retrieval stage,
  tantivy on the blocking pool, the query charge on the ledger),
- `/v1/rerank` of 20 documents by the CRM reranker plugin (the pipeline's plugin stage, a
  wasmtime call on the blocking pool), when its component is built (the tests build it),
- a greedy chat with a system and a user message and `max_tokens: 1` on the default model
  (the chat pipeline's checks, template, tokenization, reservation, one engine step).

Usage: host/scripts/bench-overhead.py BASE_BINARY [NEW_BINARY] [--rounds 6] [--requests 300]
"""
import argparse
import hashlib
import http.client
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
EMBED_PATH = os.path.join(ROOT, "models", "all-MiniLM-L6-v2")
RERANKER = os.path.join(ROOT, "target", "wasm", "wasm32-wasip2", "release",
                        "crm_field_reranker.wasm")
KEY = "bench-overhead-key"
WORDS = ("refund invoice password login export billing pipeline deal stage owner security "
         "report contact account renewal discount quote order shipment ticket").split()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Gateway:
    def __init__(self, binary, tmp, name):
        d = os.path.join(tmp, name)
        os.makedirs(os.path.join(d, "plugins", "acme"))
        sha = hashlib.sha256(KEY.encode()).hexdigest()
        rerank = 'plugins = ["crm-field-reranker"]\nreranker = "crm-field-reranker"\n'
        with open(os.path.join(d, "policies.toml"), "w") as f:
            f.write(f'[[tenants]]\nname = "acme"\n{rerank if os.path.exists(RERANKER) else ""}'
                    f'keys = [{{ id = "k", sha256 = "{sha}" }}]\n')
        if os.path.exists(RERANKER):
            shutil.copy(RERANKER, os.path.join(d, "plugins", "acme", "crm-field-reranker.wasm"))
        self.port = free_port()
        self.log = open(os.path.join(d, "log"), "w")
        self.proc = subprocess.Popen(
            [binary, "serve", "--listen", f"127.0.0.1:{self.port}", "--threads", "1",
             "--embedding-model", f"minilm={EMBED_PATH}",
             "--policies", os.path.join(d, "policies.toml"),
             "--plugins-dir", os.path.join(d, "plugins"),
             "--ledger", os.path.join(d, "usage.sqlite"),
             "--collections-dir", os.path.join(d, "collections")],
            stdout=subprocess.DEVNULL, stderr=self.log)
        deadline = time.time() + 120
        while True:
            try:
                if self.call("GET", "/ready")[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline or self.proc.poll() is not None:
                sys.exit(f"{binary} did not start; see {d}/log")
            time.sleep(0.2)
        self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)

    def call(self, method, path, body=None):
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            return self.send(c, method, path, body)
        finally:
            c.close()

    def send(self, c, method, path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        headers = {"authorization": f"Bearer {KEY}", "content-type": "application/json",
                   "cache-control": "no-cache"}
        c.request(method, path, body=data, headers=headers)
        r = c.getresponse()
        return r.status, r.read()

    def timed(self, method, path, body, n):
        out = []
        for _ in range(n):
            t0 = time.perf_counter()
            status, data = self.send(self.conn, method, path, body)
            out.append((time.perf_counter() - t0) * 1e6)
            if status != 200:
                sys.exit(f"{method} {path}: {status} {data[:300]!r}")
        return out

    def stop(self):
        self.proc.terminate()
        self.proc.wait(30)


def documents(n):
    docs = []
    for i in range(n):
        text = " ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(40))
        docs.append({"id": f"doc-{i}", "text": text, "metadata": {"team": WORDS[i % 5]}})
    return docs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("binaries", nargs="+")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--requests", type=int, default=300)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="gateway-bench-overhead-")
    gws = []
    try:
        for i, b in enumerate(a.binaries):
            g = Gateway(b, tmp, f"gw{i}")
            gws.append(g)
            st, body = g.call("POST", "/v1/collections", {"name": "kb"})
            assert st == 201, body
            st, body = g.call("POST", "/v1/collections/kb/documents", {"documents": documents(200)})
            assert st == 200, body
        cases = [("GET /v1/models", "GET", "/v1/models", None),
                 ("search, BM25, top 10", "POST", "/v1/collections/kb/search",
                  {"query": "refund invoice export", "mode": "bm25", "top_k": 10})]
        chat = {"model": "smollm2-135m-instruct", "max_tokens": 1, "temperature": 0,
                "messages": [{"role": "system", "content": "You are a CRM assistant."},
                             {"role": "user", "content": "Which stage is the Acme deal in?"}]}
        cases.append(("chat, 1 token", "POST", "/v1/chat/completions", chat))
        if os.path.exists(RERANKER):
            cases.append(("/v1/rerank, 20 documents", "POST", "/v1/rerank",
                          {"query": "refund invoice", "documents": [d["text"] for d in documents(20)]}))
        samples = {(c[0], i): [] for c in cases for i in range(len(gws))}
        for _ in range(a.rounds):
            for name, method, path, body in cases:
                for i, g in enumerate(gws):
                    g.timed(method, path, body, 20)  # warm the connection and caches
                    samples[(name, i)] += g.timed(method, path, body, a.requests)
        header = "| request | " + " | ".join(f"{os.path.basename(b)} p50 / p99 µs" for b in a.binaries)
        header += " | p50 ratio |" if len(gws) == 2 else " |"
        print(header)
        print("|---" * (header.count("|") - 1) + "|")
        for name, *_ in cases:
            cells, p50s = [], []
            for i in range(len(gws)):
                s = sorted(samples[(name, i)])
                p50, p99 = statistics.median(s), s[int(len(s) * 0.99)]
                p50s.append(p50)
                cells.append(f"{p50:.0f} / {p99:.0f}")
            ratio = f" {p50s[1] / p50s[0]:.3f} |" if len(gws) == 2 else ""
            print(f"| {name} | " + " | ".join(cells) + " |" + ratio)
    finally:
        for g in gws:
            g.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
