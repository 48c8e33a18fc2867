#!/usr/bin/env python3
"""`/v1/embeddings` throughput beside sentence-transformers (PyTorch, CPU) on the same model
files (models/all-MiniLM-L6-v2) and the same texts, one run (issue 42). Stdlib only here; the
peer runs in its own venv, as a subprocess, so that its CPU time and RSS are its own.

Texts: English paragraphs of 20-120 words from Debian's documentation packages (debian-handbook,
debian-reference-en, debian-faq: `apt-get download`, HTML <p> / <div class="para">), deduplicated
and shuffled with a fixed seed, so that any first N mixes the three; cached as a JSON list in
${XDG_CACHE_HOME:-~/.cache}/gateway-bench/. --texts N takes the first N.

Measured, then printed as one table (texts/s, tokens/s, CPU-seconds per 2,000 texts, RSS):
1. the gateway, batches of 32 in corpus order, 1 keep-alive client;
2. the same batches, 4 concurrent clients (threads, a connection each);
3. sentence-transformers `encode(texts, batch_size=32)`, torch.set_num_threads(2) (note: it
   sorts texts by length before batching, so it pads less than corpus-order batches);
then the ratios, the cosine of the gateway's and ST's vector of each text, and 200 one-at-a-time
short queries (<= 16 tokens) with p50/p90 over HTTP (ST: in-process, no HTTP).
Gateway CPU is utime+stime of its pid from /proc around each phase; its peak RSS is VmHWM after
`clear_refs` 5 (which resets the high-water mark) at the start of the phase. Each phase starts
after one untimed batch. `serve` needs a chat model: the default one (SmolLM2-135M) is loaded
too, and is in the gateway's idle RSS. The client shares the machine's cores with the gateway; its own CPU
time is printed too (vectors come back as base64 to keep it small), and so is the CPU that other
processes took during each phase (from /proc/stat): a run beside a build is not a measurement
(torch with 2 threads on 1 free core suffers most: its query p90 goes from ~11 ms to ~500 ms).

Peer venv (4.8 GB, ~3 min): host/scripts/bench-embeddings-peer.sh creates it idempotently,
torch 2.15 and sentence-transformers 6.3 from PyPI. PyPI's Linux torch is the CUDA build, which
cannot be imported without the nvidia-* libraries, so those are installed (triton is not).

Usage: host/scripts/bench-embeddings.py [--texts 2000] [--skip-peer] [--gateway PATH]
"""
import argparse
import ast
import base64
import glob
import html.parser
import http.client
import json
import math
import os
import random
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from array import array
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL_DIR = os.path.join(ROOT, "models", "all-MiniLM-L6-v2")
NAME = "all-minilm-l6-v2"
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gateway-bench")
PEER_PY = os.path.join(CACHE, "st-venv", "bin", "python")
BATCH, CLIENTS, QUERIES, QUERY_TOKENS, ST_THREADS = 32, 4, 200, 16, 2
WORDS_MIN, WORDS_MAX = 20, 120
PACKAGES = (("debian-handbook", "usr/share/doc/debian-handbook/html/en-US/*.html"),
            ("debian-reference-en", "usr/share/debian-reference/*.en.html"),
            ("debian-faq", "usr/share/doc/debian/FAQ/*.en.html"))
CLK = os.sysconf("SC_CLK_TCK")

# Runs in the venv: counts tokens, encodes, reports wall / CPU / RSS as JSON on stdout.
PEER = r'''
import json, os, sys, time
import numpy as np, sentence_transformers, torch
from sentence_transformers import SentenceTransformer, models
from tokenizers import Tokenizer
model_dir, texts_path, queries_path, out, threads = sys.argv[1:6]
texts, queries = json.load(open(texts_path)), json.load(open(queries_path))
tok = Tokenizer.from_file(model_dir + "/tokenizer.json")
tok.no_padding()  # its tokenizer.json pads and truncates to 128; count what each text is
tok.no_truncation()
tokens = sum(len(e.ids) for e in tok.encode_batch(texts))  # [CLS] and [SEP] included
torch.set_num_threads(int(threads))
bert = models.Transformer(model_dir, max_seq_length=256)  # the folder has no modules.json
pool = models.Pooling(bert.get_word_embedding_dimension(), pooling_mode="mean")
st = SentenceTransformer(modules=[bert, pool, models.Normalize()], device="cpu")
def kb(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
def busy():
    v = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    return (sum(v[:3]) + sum(v[5:])) / CLK
CLK = os.sysconf("SC_CLK_TCK")
st.encode(texts[:32], batch_size=32)  # warm-up
idle = kb("VmRSS")
open("/proc/self/clear_refs", "w").write("5")
c0, b0, t0 = time.process_time(), busy(), time.perf_counter()
vecs = st.encode(texts, batch_size=32, convert_to_numpy=True)
wall, cpu, peak = time.perf_counter() - t0, time.process_time() - c0, kb("VmHWM")
others = busy() - b0 - cpu
np.save(out, np.ascontiguousarray(vecs, dtype="<f4"))
lat, b0, c0 = [], busy(), time.process_time()
for q in queries:
    t = time.perf_counter()
    st.encode([q])
    lat.append(time.perf_counter() - t)
lat_others = max(0, busy() - b0 - time.process_time() + c0) / (sum(lat) * os.cpu_count())
print(json.dumps({"wall": wall, "cpu": cpu, "others": others, "lat_others": lat_others, "idle_kb": idle, "peak_kb": peak, "tokens": tokens,
                  "lat": lat, "threads": torch.get_num_threads(), "torch": torch.__version__,
                  "st": sentence_transformers.__version__}))
'''


class Paragraphs(html.parser.HTMLParser):
    """The text of each outermost <p> or <div class="para"> (the handbook's Publican HTML),
    whitespace collapsed, code blocks and tables left out."""
    SKIP = ("pre", "table", "script", "style")

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.out, self.buf, self.stack, self.depth, self.skip = [], [], [], 0, 0

    def handle_starttag(self, tag, attrs):
        if tag in self.SKIP:
            self.skip += 1
        elif tag in ("p", "div"):
            para = tag == "p" or ("class", "para") in attrs
            self.stack.append(para)
            if para:
                self.buf = self.buf if self.depth else []
                self.depth += 1

    def handle_endtag(self, tag):
        if tag in self.SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag in ("p", "div") and self.stack and self.stack.pop():
            self.depth -= 1
            if not self.depth:
                self.out.append(" ".join("".join(self.buf).split()))

    def handle_data(self, data):
        if self.depth and not self.skip:
            self.buf.append(data)


def corpus():
    path = os.path.join(CACHE, f"debian-docs-{WORDS_MIN}-{WORDS_MAX}w.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    docs = os.path.join(CACHE, "debian-docs")
    os.makedirs(docs, exist_ok=True)
    paras, seen = [], set()
    for pkg, pattern in PACKAGES:
        if not glob.glob(os.path.join(docs, f"{pkg}_*.deb")):
            subprocess.run(["apt-get", "download", pkg], cwd=docs, check=True)
        deb = sorted(glob.glob(os.path.join(docs, f"{pkg}_*.deb")))[-1]
        unpacked = os.path.join(docs, os.path.basename(deb)[:-4])
        if not os.path.isdir(unpacked):
            subprocess.run(["dpkg-deb", "-x", deb, unpacked + ".part"], check=True)
            os.rename(unpacked + ".part", unpacked)
        for html_file in sorted(glob.glob(os.path.join(unpacked, pattern))):
            p = Paragraphs()
            with open(html_file, encoding="utf-8") as f:
                p.feed(f.read())
            for t in p.out:
                if WORDS_MIN <= len(t.split()) <= WORDS_MAX and t not in seen:
                    seen.add(t)
                    paras.append(t)
    random.Random(42).shuffle(paras)
    with open(path + ".part", "w") as f:
        json.dump(paras, f)
    os.replace(path + ".part", path)
    return paras


def kb(pid, key):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith(key))


def machine_busy():
    """CPU-seconds that the whole machine has been busy (user, nice, system, irq, softirq, steal)."""
    v = [int(x) for x in open("/proc/stat").readline().split()[1:9]]
    return (sum(v[:3]) + sum(v[5:])) / CLK


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK  # utime, stime: all its threads


class Gateway:
    def __init__(self, binary, tmp, precision):
        self.log_path = os.path.join(tmp, "gateway.log")
        # cwd=ROOT: with no --model, serve loads the default chat model from models/ (it needs one).
        self.proc = subprocess.Popen(
            [binary, "serve", "--listen", "127.0.0.1:0", "--embedding-model", f"{NAME}={MODEL_DIR}",
             "--embedding-precision", precision, "--ledger", os.path.join(tmp, "usage.sqlite"),
             "--collections-dir", os.path.join(tmp, "collections")],
            cwd=ROOT, stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT)
        self.pid, self.local = self.proc.pid, threading.local()
        deadline = time.time() + 120
        while True:
            text = open(self.log_path).read()
            if "serving the OpenAI API addr=" in text:
                self.port = int(text.split("serving the OpenAI API addr=")[1].split()[0].rsplit(":", 1)[1])
                self.kernel = text.split("kernel=")[1].split()[0] if "kernel=" in text else "?"
                return
            if time.time() > deadline or self.proc.poll() is not None:
                self.proc.kill()
                sys.exit(f"the gateway did not start:\n{text[-3000:]}")
            time.sleep(0.1)

    def request(self, method, path, body=None, headers=None, ok=(200,)):
        """The response body's bytes; exits unless its status is in `ok`."""
        data = json.dumps(body) if body is not None else None
        headers = {"content-type": "application/json", **(headers or {})}
        for retry in (False, True):
            conn = getattr(self.local, "conn", None)  # one keep-alive connection per client thread
            if conn is None:
                conn = self.local.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
            try:
                conn.request(method, path, body=data, headers=headers)
                r = conn.getresponse()
                break
            except (ConnectionError, http.client.RemoteDisconnected):
                # The server closes keep-alive connections left idle (the main thread's, while
                # a phase runs on other threads): open a new one, once.
                conn.close()
                self.local.conn = None
                if retry:
                    raise
        data = r.read()
        if r.status not in ok:
            sys.exit(f"{method} {path}: {r.status} {data[:500]!r}")
        return data

    def embed(self, texts):
        out = json.loads(self.request("POST", "/v1/embeddings",
                                      {"model": NAME, "input": texts, "encoding_format": "base64"}))
        # little-endian f32 bytes; array("f") is native, which is little-endian on x86 and arm
        vecs = [array("f", base64.b64decode(d["embedding"])) for d in sorted(out["data"], key=lambda d: d["index"])]
        return vecs, out["usage"]["prompt_tokens"]

    def server_seconds(self):
        """Sum and count of gateway_http_request_seconds (time to response head), from /metrics."""
        text = self.request("GET", "/metrics").decode()
        val = lambda k: float(next(l.split()[-1] for l in text.splitlines() if l.startswith(k + " ")))
        return val("gateway_http_request_seconds_sum"), val("gateway_http_request_seconds_count")


def phase(gw, batches, clients):
    gw.embed(batches[0])  # warm-up
    idle = kb(gw.pid, "VmRSS")
    with open(f"/proc/{gw.pid}/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    cpu0, client0, busy0, t0 = cpu_seconds(gw.pid), time.process_time(), machine_busy(), time.perf_counter()
    with ThreadPoolExecutor(clients) as ex:
        results = list(ex.map(gw.embed, batches))
    wall = time.perf_counter() - t0
    cpu, client = cpu_seconds(gw.pid) - cpu0, time.process_time() - client0
    return {"wall": wall, "cpu": cpu, "client_cpu": client, "others": machine_busy() - busy0 - cpu - client,
            "idle_kb": idle, "peak_kb": kb(gw.pid, "VmHWM"),
            "vecs": [v for vs, _ in results for v in vs], "tokens": sum(t for _, t in results)}


def queries(gw, texts):
    """Short queries: the first 8-12 words of passages, those of at most QUERY_TOKENS tokens by the
    gateway's count (each sent once, untimed, which is also the warm-up)."""
    out = []
    for i, t in enumerate(texts * 4):
        q = " ".join(t.split()[: 8 + i % 5])
        if gw.embed([q])[1] <= QUERY_TOKENS and q not in out:
            out.append(q)
        if len(out) == QUERIES:
            break
    return out


def latency(gw, qs):
    s0, n0 = gw.server_seconds()
    lat, busy0, own0 = [], machine_busy(), cpu_seconds(gw.pid) + time.process_time()
    for q in qs:
        t = time.perf_counter()
        gw.embed([q])
        lat.append(time.perf_counter() - t)
    others = machine_busy() - busy0 - (cpu_seconds(gw.pid) + time.process_time() - own0)
    s1, n1 = gw.server_seconds()
    # the first /metrics call is in the count: ~0.5% off
    return lat, (s1 - s0) / (n1 - n0), max(0, others / (sum(lat) * os.cpu_count()))


def read_npy(path):
    with open(path, "rb") as f:
        assert f.read(6) == b"\x93NUMPY"
        major = f.read(2)[0]
        (hlen,) = struct.unpack("<H" if major == 1 else "<I", f.read(2 if major == 1 else 4))
        header = ast.literal_eval(f.read(hlen).decode("latin1"))
        assert header["descr"] == "<f4" and not header["fortran_order"], header
        n, d = header["shape"]
        a = array("f")
        a.frombytes(f.read())
    return [a[i * d:(i + 1) * d] for i in range(n)]


def cosines(xs, ys):
    dot = lambda a, b: math.fsum(p * q for p, q in zip(a, b))
    return [dot(x, y) / math.sqrt(dot(x, x) * dot(y, y)) for x, y in zip(xs, ys)]


def pct(xs, q):
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def run_peer(tmp, texts, qs):
    paths = [os.path.join(tmp, n) for n in ("texts.json", "queries.json", "st.npy")]
    for p, data in zip(paths, (texts, qs)):
        with open(p, "w") as f:
            json.dump(data, f)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([PEER_PY, "-c", PEER, MODEL_DIR, *paths, str(ST_THREADS)],
                       capture_output=True, text=True, env=env)
    if r.returncode:
        sys.exit(f"sentence-transformers failed:\n{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["vecs"] = read_npy(paths[2])
    return res


def cpu_model():
    with open("/proc/cpuinfo") as f:
        return next((l.split(":", 1)[1].strip() for l in f if l.startswith("model name")), "?")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--skip-peer", action="store_true", help="the gateway only (no venv needed)")
    ap.add_argument("--gateway", default=os.path.join(ROOT, "target", "release", "gateway"))
    ap.add_argument("--precision", choices=("auto", "f32", "bf16"), default="auto",
                    help="the gateway's --embedding-precision (auto: BF16 AMX tiles where the CPU has them)")
    a = ap.parse_args()
    if not a.skip_peer and not os.path.exists(PEER_PY):
        sys.exit(f"no peer venv at {PEER_PY}: run host/scripts/bench-embeddings-peer.sh, or pass --skip-peer")
    pool = corpus()
    if a.texts > len(pool):
        sys.exit(f"--texts {a.texts}: the corpus has {len(pool)} paragraphs")
    texts = pool[: a.texts]
    batches = [texts[i:i + BATCH] for i in range(0, len(texts), BATCH)]
    tmp = tempfile.mkdtemp(prefix="gateway-bench-embeddings-")
    try:
        gw = Gateway(a.gateway, tmp, a.precision)
        try:
            print(f"gateway: pid {gw.pid}; {len(texts)} texts in {len(batches)} batches", file=sys.stderr)
            one = phase(gw, batches, 1)
            four = phase(gw, batches, CLIENTS)
            qs = queries(gw, texts)
            lat, server_mean, lat_others = latency(gw, qs)
        finally:
            gw.proc.terminate()  # stopped before the peer runs, so that it has the machine alone
            gw.proc.wait()
        st = None
        if not a.skip_peer:
            print("sentence-transformers...", file=sys.stderr)
            st = run_peer(tmp, texts, qs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    n, tokens, ncpu = len(texts), one["tokens"], os.cpu_count()
    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs, {len(os.sched_getaffinity(0))} usable; "
          f"gateway encoder threads: one per usable CPU; torch threads: {st['threads'] if st else '-'}")
    print(f"gateway precision: {a.precision} (encoder kernel: {gw.kernel})")
    print(f"gateway: {a.gateway}, built {time.strftime('%Y-%m-%d %H:%M', time.localtime(os.path.getmtime(a.gateway)))}")
    if st:
        print(f"peer: torch {st['torch']}, sentence-transformers {st['st']}")
    print(f"texts: {n} Debian documentation paragraphs ({WORDS_MIN}-{WORDS_MAX} words), {tokens} tokens "
          f"by the gateway's count, {tokens / n:.1f} per text; "
          f"tokenizers' count: {st['tokens'] if st else '-'} ([CLS]/[SEP] included); batches of {BATCH}")
    print()
    print(f"{'':34}{'texts/s':>9}{'tokens/s':>10}{'CPU-s/2000':>12}{'idle RSS':>10}{'peak RSS':>10}{'delta':>9}"
          f"{'others':>8}")
    rows = [("gateway, 1 client", one), (f"gateway, {CLIENTS} clients", four)]
    if st:
        rows.append((f"sentence-transformers ({st['threads']} thr)", st))
    for name, r in rows:
        print(f"{name:34}{n / r['wall']:9.1f}{tokens / r['wall']:10.0f}{r['cpu'] * 2000 / n:12.1f}"
              f"{r['idle_kb'] / 1024:7.0f} MiB{r['peak_kb'] / 1024:6.0f} MiB{(r['peak_kb'] - r['idle_kb']) / 1024:5.0f} MiB"
              f"{max(0, 100 * r['others'] / (r['wall'] * ncpu)):7.0f}%")
    print("(others: the CPU that other processes used meanwhile, % of the machine; above a few %, "
          "the run was not alone and its times are not to be trusted)")
    print(f"(the Python client's own CPU: {one['client_cpu'] * 2000 / n:.1f} s / {four['client_cpu'] * 2000 / n:.1f} s "
          f"per 2000 texts, 1 / {CLIENTS} clients, on the same cores)")
    print()
    if st:
        for name, r in rows[:2]:
            print(f"{name} / sentence-transformers, texts/s: {st['wall'] / r['wall']:.2f}x")
        c = cosines(one["vecs"], st["vecs"])
        diff = max(abs(p - q) for x, y in zip(one["vecs"], st["vecs"]) for p, q in zip(x, y))
        print(f"cosine, gateway vs sentence-transformers, per text: min {min(c):.6f}  mean {statistics.fmean(c):.6f}"
              f"  (1 - min: {1 - min(c):.1e}; largest |difference| of a component: {diff:.1e})")
    c = cosines(one["vecs"], four["vecs"])
    print(f"cosine, gateway 1 client vs {CLIENTS} clients (cross-request batching): min {min(c):.6f}"
          f"  (1 - min: {1 - min(c):.1e})")
    print()
    print(f"{len(qs)} single queries (<= {QUERY_TOKENS} tokens), one at a time:")
    print(f"  gateway over HTTP:                p50 {pct(lat, 0.5):7.2f} ms  p90 {pct(lat, 0.9):7.2f} ms; "
          f"its own time to response head, mean {server_mean * 1e3:.2f} ms (/metrics); others {100 * lat_others:.0f}%")
    if st:
        print(f"  sentence-transformers in-process: p50 {pct(st['lat'], 0.5):7.2f} ms  p90 {pct(st['lat'], 0.9):7.2f} ms; "
              f"others {100 * st['lat_others']:.0f}%")


if __name__ == "__main__":
    main()
