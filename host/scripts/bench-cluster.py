#!/usr/bin/env python3
"""Cross-replica visibility and the cost of sharing, side by side in one run (stdlib only).

Two gateways share a PostgreSQL of the bench's own (Debian's binaries, loopback port,
temporary folder). Measured:
1. Plugin upload: the admin PUT's latency on one replica without `[cluster] postgres` and on
   replica A with it; then the delay from A's answer until replica B lists the new version.
2. Policy replacement: the PUT's latency, and the delay until replica B accepts the new key.
3. Collections: the upsert's latency on A, and the delay until B's search finds the document.
4. Usage: the delay until a request served by B shows in `/admin/usage` on A.
Prints p50 / p99 / max of each.

Usage: host/scripts/bench-cluster.py [--rounds 30]
Needs target/release/gateway, the default model, the test plugin components
(target/wasm/..., built by the tests) and PostgreSQL (`apt-get install postgresql`).
"""
import argparse
import glob
import hashlib
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GW = os.path.join(ROOT, "target", "release", "gateway")
MODEL = "smollm2-135m-instruct"
MODEL_PATH = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
WASM = os.path.join(ROOT, "target", "wasm", "wasm32-wasip2", "release")
ADMIN = "bench-cluster-admin-token"
EMBED_PATH = os.path.join(ROOT, "models", "all-MiniLM-L6-v2")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_postgres(cmd):
    return ["runuser", "-u", "postgres", "--"] + cmd if os.geteuid() == 0 else cmd


def start_postgres(tmp):
    bins = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(p.split("/")[-2]))
    if not bins:
        sys.exit("PostgreSQL is not installed (apt-get install postgresql)")
    bin_dir, port, data = bins[-1], free_port(), os.path.join(tmp, "pg")
    if os.geteuid() == 0:
        shutil.chown(tmp, "postgres")
    subprocess.run(as_postgres([f"{bin_dir}/initdb", "-D", data, "-U", "gateway", "-A", "trust",
                                "--no-sync", "-E", "UTF8", "--no-locale"]),
                   check=True, stdout=subprocess.DEVNULL)
    p = subprocess.Popen(as_postgres([f"{bin_dir}/postgres", "-D", data, "-p", str(port),
                                      "-h", "127.0.0.1", "-k", tmp]),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            time.sleep(0.5)
            stop = as_postgres([f"{bin_dir}/pg_ctl", "-D", data, "-m", "immediate", "stop"])
            return p, stop, f"postgres://gateway@127.0.0.1:{port}/postgres"
        except OSError:
            if time.time() > deadline:
                sys.exit("postgres did not start")
            time.sleep(0.1)


def policy(key):
    sha = hashlib.sha256(key.encode()).hexdigest()
    return f'[[tenants]]\nname = "acme"\nkeys = [{{ id = "k", sha256 = "{sha}" }}]\n'


def start_gateway(tmp, name, cluster):
    d = os.path.join(tmp, name)
    os.makedirs(d)
    with open(os.path.join(d, "policies.toml"), "w") as f:
        f.write(policy("key-0"))
    port = free_port()
    with open(os.path.join(d, "gateway.toml"), "w") as f:
        f.write(f'embeddings = [{{ name = "minilm", path = "{EMBED_PATH}" }}]\nadmin_token = "{ADMIN}"\npolicies = "{d}/policies.toml"\n'
                f'ledger = "{d}/usage.sqlite"\ncollections_dir = "{d}/collections"\n'
                f'[[models]]\nname = "{MODEL}"\npath = "{MODEL_PATH}"\n[models.engine]\nthreads = 1\n'
                f'[cluster]\n{cluster}\n')
    log = open(os.path.join(d, "log"), "w")
    p = subprocess.Popen([GW, "serve", "--listen", f"127.0.0.1:{port}", "--config",
                          os.path.join(d, "gateway.toml")], stdout=subprocess.DEVNULL, stderr=log)
    deadline = time.time() + 60
    while call(port, "GET", "/ready")[0] != 200:
        if time.time() > deadline or p.poll() is not None:
            sys.exit(f"gateway {name} did not start; see {d}/log")
        time.sleep(0.1)
    return p, port


def call(port, method, path, body=None, token=ADMIN):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        headers = {"authorization": f"Bearer {token}"} if token else {}
        c.request(method, path, body=body, headers=headers)
        r = c.getresponse()
        data = r.read()
        return r.status, (json.loads(data) if data.startswith(b"{") else data)
    except OSError:
        return 0, None


def until(check, limit=10.0):
    start = time.perf_counter()
    while not check():
        if time.perf_counter() - start > limit:
            sys.exit("a change never became visible")
        time.sleep(0.002)
    return time.perf_counter() - start


def timed(f):
    start = time.perf_counter()
    out = f()
    return time.perf_counter() - start, out


def report(name, xs):
    xs = sorted(x * 1000 for x in xs)
    p = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]
    print(f"  {name:<44} p50 {p(0.5):8.1f} ms   p99 {p(0.99):8.1f} ms   max {xs[-1]:8.1f} ms")


def plugin_sha(port, name):
    _, body = call(port, "GET", "/admin/plugins")
    for p in body.get("data", []) if isinstance(body, dict) else []:
        if p["name"] == name:
            return p["sha256"]
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=30)
    args = ap.parse_args()
    blobs = [open(os.path.join(WASM, f), "rb").read()
             for f in ("crm_field_reranker.wasm", "faulty_reranker.wasm")]
    shas = [hashlib.sha256(b).hexdigest() for b in blobs]
    tmp = tempfile.mkdtemp(prefix="bench-cluster-")
    procs, stop_pg = [], None
    try:
        pg, stop_pg, url = start_postgres(tmp)
        procs.append(pg)
        solo, solo_port = start_gateway(tmp, "solo", "")
        a, a_port = start_gateway(tmp, "a", f'postgres = "{url}"')
        b, b_port = start_gateway(tmp, "b", f'postgres = "{url}"')
        procs += [solo, a, b]
        put = "/admin/plugins/acme/ranker?kind=reranker"
        solo_put, shared_put, seen = [], [], []
        for i in range(args.rounds):
            blob, sha = blobs[i % 2], shas[i % 2]
            t, (st, _) = timed(lambda: call(solo_port, "PUT", put, blob))
            assert st in (200, 201), st
            solo_put.append(t)
            t, (st, body) = timed(lambda: call(a_port, "PUT", put, blob))
            assert st in (200, 201), body
            shared_put.append(t)
            seen.append(until(lambda: plugin_sha(b_port, "ranker") == sha))
        pol_put, pol_seen = [], []
        for i in range(1, args.rounds + 1):
            key = f"key-{i}"
            t, (st, body) = timed(lambda: call(a_port, "PUT", "/admin/policies", policy(key)))
            assert st == 200, body
            pol_put.append(t)
            pol_seen.append(until(lambda: call(b_port, "GET", "/v1/models", token=key)[0] == 200))
        key = f"key-{args.rounds}"
        st, body = call(a_port, "POST", "/v1/collections", json.dumps({"name": "kb"}), token=key)
        assert st == 201, body
        upsert, found = [], []
        for i in range(args.rounds):
            word = f"zq{i}x{os.getpid()}"
            doc = {"documents": [{"id": f"d{i}", "text": f"The {word} ticket covers a refund."}]}
            t, (st, body) = timed(lambda: call(a_port, "POST", "/v1/collections/kb/documents",
                                               json.dumps(doc), token=key))
            assert st == 200, body
            upsert.append(t)
            query = json.dumps({"query": word, "mode": "bm25", "top_k": 1})
            def hit():
                st, body = call(b_port, "POST", "/v1/collections/kb/search", query, token=key)
                return st == 200 and [h["id"] for h in body["data"]] == [f"d{i}"]
            found.append(until(hit))
        usage = []
        for _ in range(min(args.rounds, 10)):
            def requests():
                _, body = call(a_port, "GET", "/admin/usage?group_by=model")
                return sum(r["requests"] for r in body["data"])
            before = requests()
            body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 1})
            st, _ = call(b_port, "POST", "/v1/completions", body, token=key)
            assert st == 200
            usage.append(until(lambda: requests() > before))
        print(f"cluster visibility over PostgreSQL ({args.rounds} rounds, loopback, one run)")
        report("plugin PUT, one replica, no postgres", solo_put)
        report("plugin PUT on A, stored in postgres", shared_put)
        report("plugin: A answered -> B lists it", seen)
        report("policy PUT on A", pol_put)
        report("policy: A answered -> B takes the new key", pol_seen)
        report("upsert of one document on A (embedded, stored)", upsert)
        report("document: A answered -> B's search finds it", found)
        report("usage: B answered -> A's /admin/usage has it", usage)
    finally:
        if stop_pg:
            subprocess.run(stop_pg, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
