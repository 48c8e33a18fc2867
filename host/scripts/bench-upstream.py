#!/usr/bin/env python3
"""Routing through a front gateway, side by side in one run (stdlib only).

1. Overhead: the same 1-token completions sent straight to an engine gateway and through a
   front gateway that routes to it, interleaved, at a fixed offered rate (open loop) and
   closed loop. Prints p50/p99/p99.9 of each and the difference.
2. Scaling: saturated output tok/s of one engine replica pinned to core 0 (direct), against
   two replicas pinned to cores 0 and 1 behind the front (the front unpinned, sharing them).

Usage: host/scripts/bench-upstream.py [--rate 100] [--seconds 10] [--conc 8]
Needs target/release/gateway (cargo build --release) and the default model.
"""
import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GW = os.path.join(ROOT, "target", "release", "gateway")
MODEL = "smollm2-135m-instruct"
MODEL_PATH = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, cpus=None, log="engine"):
    cmd = [GW, "serve"] + args
    if cpus is not None:
        cmd = ["taskset", "-c", cpus] + cmd
    err = open(os.path.join(tempfile.gettempdir(), f"bench-upstream-{log}.log"), "w")
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
    return p


def wait_ready(port, timeout=60):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            c.request("GET", "/ready")
            if c.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    sys.exit(f"port {port} never became ready")


def engine(port, cpus, threads, tmp):
    return start(["--listen", f"127.0.0.1:{port}", "--model", f"{MODEL}={MODEL_PATH}",
                  "--threads", str(threads), "--ledger", os.path.join(tmp, f"l{port}.sqlite"),
                  "--collections-dir", os.path.join(tmp, f"c{port}")], cpus, f"engine-{port}")


def front(port, replicas, tmp):
    urls = ", ".join(f'"http://127.0.0.1:{p}/v1"' for p in replicas)
    cfg = os.path.join(tmp, f"front{port}.toml")
    with open(cfg, "w") as f:
        f.write(f'listen = "127.0.0.1:{port}"\nmodels = []\nembeddings = []\n'
                f'ledger = "{tmp}/front{port}.sqlite"\ncollections_dir = "{tmp}/cf{port}"\n'
                f'[[upstreams]]\nname = "{MODEL}"\nreplicas = [{urls}]\nhealth_path = "/ready"\n')
    return start(["--config", cfg], None, f"front-{port}")


class Split:
    """Spreads a client's requests over several servers by worker: no router in between."""

    def __init__(self, clients):
        self.clients = clients
        self.local = threading.local()
        self.next = 0
        self.lock = threading.Lock()

    def post(self, path, body):
        if not hasattr(self.local, "c"):
            with self.lock:
                self.local.c = self.clients[self.next % len(self.clients)]
                self.next += 1
        return self.local.c.post(path, body)


class Client:
    """One keep-alive connection per thread."""

    def __init__(self, port):
        self.port = port
        self.local = threading.local()

    def post(self, path, body):
        c = getattr(self.local, "c", None)
        if c is None:
            c = self.local.c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        data = json.dumps(body)
        try:
            c.request("POST", path, data, {"content-type": "application/json", "cache-control": "no-cache"})
            r = c.getresponse()
            out = r.read()
        except (http.client.HTTPException, OSError):
            self.local.c = None
            raise
        if r.status != 200:
            raise RuntimeError(f"{r.status}: {out[:200]}")
        return json.loads(out)


ONE = {"model": MODEL, "prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def open_loop(clients, rate, seconds):
    """Offers `rate` req/s in all, alternating the targets; returns latencies (ms) per target."""
    lat = {name: [] for name in clients}
    lock = threading.Lock()
    errors = [0]
    names = list(clients)
    total = int(rate * seconds)
    start = time.perf_counter()
    sem = threading.Semaphore(64)

    def one(i):
        name = names[i % len(names)]
        t0 = time.perf_counter()
        try:
            clients[name].post("/v1/completions", ONE)
            with lock:
                lat[name].append((time.perf_counter() - t0) * 1e3)
        except Exception:
            with lock:
                errors[0] += 1
        finally:
            sem.release()

    for i in range(total):
        due = start + i / rate
        now = time.perf_counter()
        if due > now:
            time.sleep(due - now)
        sem.acquire()
        threading.Thread(target=one, args=(i,), daemon=True).start()
    for _ in range(64):
        sem.acquire()
    achieved = sum(len(v) for v in lat.values()) / (time.perf_counter() - start)
    return lat, errors[0], achieved


def closed_loop(client, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        client.post("/v1/completions", ONE)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def saturate(client, conc, seconds, max_tokens=64):
    """Output tok/s at `conc` concurrent streams of distinct prompts."""
    toks = [0]
    lock = threading.Lock()
    stop = time.time() + seconds

    def worker(k):
        i = 0
        while time.time() < stop:
            body = {"model": MODEL, "max_tokens": max_tokens, "ignore_eos": True,
                    "messages": [{"role": "user", "content": f"Worker {k} story {i}."}]}
            r = client.post("/v1/chat/completions", body)
            with lock:
                toks[0] += r["usage"]["completion_tokens"]
            i += 1

    t0 = time.time()
    ts = [threading.Thread(target=worker, args=(k,)) for k in range(conc)]
    [t.start() for t in ts]
    [t.join() for t in ts]
    return toks[0] / (time.time() - t0)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=100)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--conc", type=int, default=8)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="bench-upstream-")
    procs = []
    try:
        e1, e2, f1, f2 = (free_port() for _ in range(4))
        procs.append(engine(e1, "0", 1, tmp))
        procs.append(engine(e2, "1", 1, tmp))
        wait_ready(e1)
        wait_ready(e2)
        procs.append(front(f1, [e1], tmp))
        procs.append(front(f2, [e1, e2], tmp))
        wait_ready(f1)
        wait_ready(f2)
        direct, routed = Client(e1), Client(f1)
        closed_loop(direct, 50)
        closed_loop(routed, 50)
        print("## routing overhead: 1-token completions, engine on core 0")
        d = closed_loop(direct, 300)
        r = closed_loop(routed, 300)
        print(f"closed loop, 300 each: direct p50 {pct(d, 50):.2f} ms p99 {pct(d, 99):.2f} | "
              f"via front p50 {pct(r, 50):.2f} ms p99 {pct(r, 99):.2f} | "
              f"added p50 {pct(r, 50) - pct(d, 50):+.2f} ms p99 {pct(r, 99) - pct(d, 99):+.2f} ms")
        lat, errors, achieved = open_loop({"direct": direct, "front": routed}, a.rate, a.seconds)
        d, r = lat["direct"], lat["front"]
        print(f"open loop, offered {a.rate:.0f} req/s (achieved {achieved:.0f}), {errors} errors: "
              f"direct p50 {pct(d, 50):.2f} p99 {pct(d, 99):.2f} p99.9 {pct(d, 99.9):.2f} | "
              f"via front p50 {pct(r, 50):.2f} p99 {pct(r, 99):.2f} p99.9 {pct(r, 99.9):.2f} | "
              f"added p50 {pct(r, 50) - pct(d, 50):+.2f} ms p99 {pct(r, 99) - pct(d, 99):+.2f} ms")
        print(f"## scaling: output tok/s, concurrency {a.conc}, 64 tokens out")
        one = saturate(direct, a.conc, a.seconds * 2)
        split = saturate(Split([Client(e1), Client(e2)]), a.conc, a.seconds * 2)
        two = saturate(Client(f2), a.conc, a.seconds * 2)
        print(f"one replica (core 0) direct: {one:.1f} tok/s | two replicas, client split "
              f"evenly, no front: {split:.1f} tok/s ({split / one:.2f}x) | two replicas via "
              f"front: {two:.1f} tok/s ({two / one:.2f}x)")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait()


if __name__ == "__main__":
    main()
