#!/usr/bin/env python3
"""Collection ingest, search and RAG chat through the gateway's HTTP API, one run: the ingest
path's tokens/s against the raw `/v1/embeddings` rate on the same texts, and search latency
per mode at 50,000 chunks. Stdlib only; reuses bench-embeddings.py (its corpus, its Gateway).

Documents: bench-embeddings' corpus (3,477 Debian documentation paragraphs of 20-120 words,
cached in ${XDG_CACHE_HOME:-~/.cache}/gateway-bench/) split into sentences (at '. ', '? ', '! ';
sentences of 4 to 40 words kept), then document i (`d{i}`, metadata {"part": i % 10}) = 1 to 3
sentences drawn at random (random.Random(42)), at most 80 words, all documents distinct: short
enough that one document is one chunk (the default chunk_tokens is 200). --docs N of them.

Measured, then printed as one table (the raw and ingest phases with --clients keep-alive
clients, default 1; the rest with one):
1. raw: the first --ingest-docs documents through `POST /v1/embeddings` (base64), batches of
   100, after one untimed batch: docs/s, tokens/s (usage.prompt_tokens), gateway CPU-seconds;
2. ingest: a collection `kb` (default settings), the same documents upserted through
   `POST /v1/collections/kb/documents`, batches of 100 (embedding, SQLite, BM25 and HNSW,
   durable before the answer): the same figures, and its tokens/s as a % of raw;
3. the rest of the --docs documents upserted the same way (timed; HNSW inserts get dearer as
   the graph grows), then the collection's documents/chunks from `GET /v1/collections/kb`;
4. --queries searches per mode (bm25, vector, hybrid; top_k 10), one at a time, each 3 to 8
   consecutive words of a random document (fixed seed), after 20 untimed other queries:
   client-side p50/p90/p99 over HTTP and the gateway's own mean (gateway_search_seconds{mode}
   from /metrics: query embedding, both indexes, fusion); then hybrid with {"part": 3};
5. RAG chat: 20 chat completions (the default chat model, SmolLM2-135M, max_tokens 1,
   `Cache-Control: no-cache`) with `"rag": {"collection": "kb", "top_k": 4}` and the same 20
   without, interleaved, after 2 untimed of each: p50 of each, and what RAG adds (the search,
   and the prefill of the retrieved chunks in the system message).
Gateway CPU is utime+stime of its pid from /proc around each phase; "others" is the CPU that
other processes took meanwhile, % of the machine (from /proc/stat): a run beside a build is not
a measurement. The client shares the machine's cores with the gateway.

Usage: host/scripts/bench-search.py [--docs 50000] [--ingest-docs 10000] [--queries 300]
       [--clients 1] [--gateway PATH] [--precision auto|f32|bf16]
(50,000 documents take a while on 2 cores: try --docs 3000 --ingest-docs 1000 --queries 50 first)
"""
import argparse
from concurrent.futures import ThreadPoolExecutor
import importlib.util
import json
import os
import random
import re
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("bench_embeddings", os.path.join(HERE, "bench-embeddings.py"))
be = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(be)

BATCH, TOP_K, WARMUP, CHATS, CHAT_WARMUP, RAG_TOP_K = 100, 10, 20, 20, 2, 4
SENT_WORDS, DOC_WORDS, MAX_SENTENCES = (4, 40), 80, 3
MODES = ("bm25", "vector", "hybrid")
FILTER = {"part": 3}
COLLECTION = "kb"


def documents(paras, n):
    """n distinct short documents of 1-3 sentences of the paragraphs, drawn with a fixed seed."""
    sentences = [s for p in paras for s in re.split(r"(?<=[.?!]) ", p)
                 if SENT_WORDS[0] <= len(s.split()) <= SENT_WORDS[1]]
    rng, seen, docs = random.Random(42), set(), []
    while len(docs) < n:
        parts, words = [], 0
        for _ in range(rng.randint(1, MAX_SENTENCES)):
            s = rng.choice(sentences)
            w = len(s.split())
            if parts and words + w > DOC_WORDS:
                break
            parts.append(s)
            words += w
        text = " ".join(parts)
        if text not in seen:
            seen.add(text)
            i = len(docs)
            docs.append({"id": f"d{i}", "text": text, "metadata": {"part": i % 10}})
    return docs, len(sentences)


def make_queries(docs, n, seed):
    """n distinct queries, each 3-8 consecutive words of a random document."""
    rng, out, seen = random.Random(seed), [], set()
    while len(out) < n:
        words = rng.choice(docs)["text"].split()
        k = min(len(words), rng.randint(3, 8))
        start = rng.randint(0, len(words) - k)
        q = " ".join(words[start:start + k])
        if q not in seen:
            seen.add(q)
            out.append(q)
    return out


def call(gw, method, path, body=None, headers=None, ok=(200,)):
    """gw.request, its body parsed when it is JSON (else text)."""
    raw = gw.request(method, path, body, headers, ok)
    return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()


def search_metrics(gw):
    """{mode: (sum, count)} of gateway_search_seconds, from /metrics."""
    text = call(gw, "GET", "/metrics")
    out = {}
    for line in text.splitlines():
        m = re.match(r'gateway_search_seconds_(sum|count)\{[^}]*mode="([^"]+)"[^}]*\} (\S+)', line)
        if m:
            s, c = out.get(m.group(2), (0.0, 0.0))
            out[m.group(2)] = (s + float(m.group(3)), c) if m.group(1) == "sum" else (s, c + float(m.group(3)))
    return out


class Meter:
    """Wall, gateway CPU, client CPU and the others' share of the machine around a phase."""

    def __init__(self, gw):
        self.gw = gw

    def __enter__(self):
        self.cpu0, self.client0 = be.cpu_seconds(self.gw.pid), time.process_time()
        self.busy0, self.t0 = be.machine_busy(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.cpu = be.cpu_seconds(self.gw.pid) - self.cpu0
        self.client = time.process_time() - self.client0
        others = be.machine_busy() - self.busy0 - self.cpu - self.client
        self.others = max(0.0, others / (self.wall * os.cpu_count()))
        return False


def embed_phase(gw, docs, clients):
    batches = [[d["text"] for d in docs[i:i + BATCH]] for i in range(0, len(docs), BATCH)]
    gw.embed(batches[0])  # warm-up
    with Meter(gw) as m, ThreadPoolExecutor(clients) as ex:
        tokens = sum(r[1] for r in ex.map(gw.embed, batches))
    return {"docs": len(docs), "tokens": tokens, "m": m}


def upsert_phase(gw, docs, clients):
    path = f"/v1/collections/{COLLECTION}/documents"
    batches = [docs[i:i + BATCH] for i in range(0, len(docs), BATCH)]
    with Meter(gw) as m, ThreadPoolExecutor(clients) as ex:
        answers = list(ex.map(lambda b: call(gw, "POST", path, {"documents": b}), batches))
    tokens = sum(r["usage"]["prompt_tokens"] for r in answers)
    chunks = sum(r["chunks"] for r in answers)
    return {"docs": len(docs), "tokens": tokens, "chunks": chunks, "m": m}


def search_phase(gw, qs, warm, mode, filt=None):
    def body(q):
        b = {"query": q, "top_k": TOP_K, "mode": mode}
        if filt is not None:
            b["filter"] = filt
        return b
    path = f"/v1/collections/{COLLECTION}/search"
    for q in warm:
        call(gw, "POST", path, body(q))
    s0 = search_metrics(gw).get(mode, (0.0, 0.0))
    lat, hits = [], 0
    with Meter(gw) as m:
        for q in qs:
            t = time.perf_counter()
            r = call(gw, "POST", path, body(q))
            lat.append(time.perf_counter() - t)
            hits += len(r["data"])
    s1 = search_metrics(gw).get(mode, (0.0, 0.0))
    n = s1[1] - s0[1]
    server = (s1[0] - s0[0]) / n if n else None
    return {"lat": lat, "server": server, "server_n": n, "hits": hits / len(qs), "m": m}


def chat_phase(gw, model, qs, warm):
    def chat(q, rag):
        body = {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": 1}
        if rag:
            body["rag"] = {"collection": COLLECTION, "top_k": RAG_TOP_K}
        t = time.perf_counter()
        r = call(gw, "POST", "/v1/chat/completions", body, headers={"cache-control": "no-cache"})
        return time.perf_counter() - t, r["usage"]["prompt_tokens"], len(r.get("citations") or [])
    for q in warm:
        chat(q, True)
        chat(q, False)
    out = {True: [], False: []}
    s0 = search_metrics(gw)
    with Meter(gw) as m:
        for q in qs:
            for rag in (True, False):
                out[rag].append(chat(q, rag))
    s1 = search_metrics(gw)
    # the searches RAG made meanwhile (all modes: a chat's default is hybrid)
    ds = sum(v[0] for v in s1.values()) - sum(v[0] for v in s0.values())
    dn = sum(v[1] for v in s1.values()) - sum(v[1] for v in s0.values())
    return out, m, (ds / dn if dn else None, dn)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=50000, help="documents in the collection")
    ap.add_argument("--ingest-docs", type=int, default=10000,
                    help="the first N: embedded raw, then upserted, both timed against each other")
    ap.add_argument("--queries", type=int, default=300, help="timed searches per mode")
    ap.add_argument("--clients", type=int, default=1,
                    help="concurrent clients of the raw and ingest phases (2: one request's index "
                         "writes overlap the next one's embedding, as `gateway index` does)")
    ap.add_argument("--gateway", default=os.path.join(be.ROOT, "target", "release", "gateway"))
    ap.add_argument("--precision", choices=("auto", "f32", "bf16"), default="auto",
                    help="the gateway's --embedding-precision (auto: BF16 AMX tiles where the CPU has them)")
    a = ap.parse_args()
    if not 0 < a.ingest_docs <= a.docs:
        sys.exit("need 0 < --ingest-docs <= --docs")
    t_start = time.perf_counter()
    paras = be.corpus()
    docs, nsent = documents(paras, a.docs)
    words = [len(d["text"].split()) for d in docs]
    qs = make_queries(docs, WARMUP + a.queries + CHAT_WARMUP + CHATS, seed=7)
    warm, timed = qs[:WARMUP], qs[WARMUP:WARMUP + a.queries]
    chat_warm, chat_qs = qs[WARMUP + a.queries:][:CHAT_WARMUP], qs[WARMUP + a.queries + CHAT_WARMUP:]
    first, rest = docs[:a.ingest_docs], docs[a.ingest_docs:]

    tmp = tempfile.mkdtemp(prefix="gateway-bench-search-")
    gw = None
    try:
        gw = be.Gateway(a.gateway, tmp, a.precision)
        log = lambda s: print(f"[{time.perf_counter() - t_start:7.1f} s] {s}", file=sys.stderr, flush=True)
        log(f"gateway: pid {gw.pid}, encoder kernel {gw.kernel}; {len(docs)} documents")
        models = [m["id"] for m in call(gw, "GET", "/v1/models")["data"]]
        chat_model = next((m for m in models if m != be.NAME), None)
        if chat_model is None:
            sys.exit(f"no chat model in /v1/models: {models}")
        log(f"raw /v1/embeddings, {len(first)} documents...")
        raw = embed_phase(gw, first, a.clients)
        call(gw, "POST", "/v1/collections", {"name": COLLECTION}, ok=(200, 201))
        log(f"upsert of the same {len(first)}...")
        ing = upsert_phase(gw, first, a.clients)
        log(f"upsert of the other {len(rest)}...")
        more = upsert_phase(gw, rest, a.clients) if rest else None
        card = call(gw, "GET", f"/v1/collections/{COLLECTION}")
        searches = {}
        for mode in MODES:
            log(f"{len(timed)} searches, {mode}...")
            searches[mode] = search_phase(gw, timed, warm, mode)
        log(f"{len(timed)} searches, hybrid, filter {json.dumps(FILTER)}...")
        filtered = search_phase(gw, timed, warm, "hybrid", FILTER)
        log(f"{CHATS} chats with RAG and {CHATS} without, {chat_model}...")
        chats, chat_m, (rag_search, rag_n) = chat_phase(gw, chat_model, chat_qs, chat_warm)
    finally:
        if gw is not None:
            gw.proc.terminate()
            try:
                gw.proc.wait(timeout=120)  # it saves the HNSW snapshot on the way out
            except Exception:
                gw.proc.kill()
                gw.proc.wait()
            try:  # the gateway's warnings and errors, if any, before its log goes with tmp
                bad = [l.rstrip() for l in open(gw.log_path, errors="replace")
                       if re.search(r"\b(WARN|ERROR)\b", l) and "no policy file" not in l]
                for l in bad[:10]:
                    print(f"gateway log: {l[:300]}", file=sys.stderr)
                if len(bad) > 10:
                    print(f"gateway log: ... {len(bad) - 10} more WARN/ERROR lines", file=sys.stderr)
            except OSError:
                pass
        shutil.rmtree(tmp, ignore_errors=True)

    ncpu = os.cpu_count()
    ms = lambda x: f"{x * 1e3:.2f}"
    print(f"CPU: {be.cpu_model()}, {ncpu} logical CPUs, {len(os.sched_getaffinity(0))} usable")
    print(f"gateway: {a.gateway}, built {time.strftime('%Y-%m-%d %H:%M', time.localtime(os.path.getmtime(a.gateway)))}; "
          f"embedding precision {a.precision} (encoder kernel: {gw.kernel}); chat model {chat_model}")
    print(f"documents: {len(docs)} distinct, 1-{MAX_SENTENCES} of {nsent} sentences of {len(paras)} Debian documentation "
          f"paragraphs; words per document: mean {statistics.fmean(words):.1f}, max {max(words)}; "
          f"tokens per document (raw count): {raw['tokens'] / raw['docs']:.1f}")
    print(f"collection {COLLECTION}: {card['documents']} documents, {card['chunks']} chunks "
          f"(chunk_tokens {card.get('chunk_tokens')}); upserts answered {ing['chunks'] + (more['chunks'] if more else 0)} chunks")
    print()
    print(f"{'ingest (batches of %d, %d client%s)' % (BATCH, a.clients, 's' * (a.clients > 1)):44}{'docs':>7}{'tokens':>9}{'wall s':>8}{'docs/s':>8}"
          f"{'tokens/s':>10}{'CPU-s':>8}{'others':>8}")
    rows = [("raw POST /v1/embeddings", raw), ("upsert, the same documents", ing)]
    if more:
        rows.append((f"upsert, the other {len(rest)} (to {len(docs)})", more))
    for name, r in rows:
        m = r["m"]
        print(f"{name:44}{r['docs']:7}{r['tokens']:9}{m.wall:8.1f}{r['docs'] / m.wall:8.1f}{r['tokens'] / m.wall:10.0f}"
              f"{m.cpu:8.1f}{100 * m.others:7.0f}%")
    total_wall = ing["m"].wall + (more["m"].wall if more else 0)
    print(f"ingest tokens/s: {100 * (ing['tokens'] / ing['m'].wall) / (raw['tokens'] / raw['m'].wall):.0f}% of raw "
          f"(tokens counted: {ing['tokens']} upserted, {raw['tokens']} raw); "
          f"CPU-s per 1,000 docs: raw {1000 * raw['m'].cpu / raw['docs']:.1f}, upsert {1000 * ing['m'].cpu / ing['docs']:.1f}")
    print(f"whole load: {len(docs)} documents in {total_wall:.1f} s, {len(docs) / total_wall:.1f} docs/s")
    print()
    print(f"{'search at %d chunks, top_k %d, 1 client' % (card['chunks'], TOP_K):44}{'n':>5}{'p50 ms':>9}{'p90 ms':>9}"
          f"{'p99 ms':>9}{'gateway mean':>14}{'hits':>6}{'others':>8}")
    srows = [(m, searches[m]) for m in MODES] + [(f"hybrid, filter {json.dumps(FILTER)}", filtered)]
    for name, r in srows:
        server = f"{ms(r['server'])} ms" if r["server"] is not None else "-"
        print(f"{name:44}{len(r['lat']):5}{be.pct(r['lat'], 0.5):9.2f}{be.pct(r['lat'], 0.9):9.2f}"
              f"{be.pct(r['lat'], 0.99):9.2f}{server:>14}{r['hits']:6.1f}{100 * r['m'].others:7.0f}%")
    print(f"(queries: 3-8 consecutive words of a random document; gateway mean: gateway_search_seconds{{mode}} "
          f"from /metrics, query embedding + both indexes + fusion)")
    print()
    lr, ln = [x[0] for x in chats[True]], [x[0] for x in chats[False]]
    pr, pn = statistics.fmean(x[1] for x in chats[True]), statistics.fmean(x[1] for x in chats[False])
    cites = statistics.fmean(x[2] for x in chats[True])
    print(f"RAG chat, {chat_model}, max_tokens 1, {CHATS} each, interleaved, no-cache (others {100 * chat_m.others:.0f}%):")
    print(f"  with rag (top_k {RAG_TOP_K}):  p50 {be.pct(lr, 0.5):7.2f} ms  p90 {be.pct(lr, 0.9):7.2f} ms;"
          f"  prompt tokens {pr:.0f}, citations {cites:.1f}")
    print(f"  without:              p50 {be.pct(ln, 0.5):7.2f} ms  p90 {be.pct(ln, 0.9):7.2f} ms;  prompt tokens {pn:.0f}")
    search_s = (f"; its searches, gateway mean {ms(rag_search)} ms of {rag_n:.0f} (/metrics)"
                if rag_search is not None else "")
    print(f"  RAG adds: {be.pct(lr, 0.5) - be.pct(ln, 0.5):.2f} ms at p50 (search + prefill of {pr - pn:.0f} more "
          f"prompt tokens{search_s})")
    print("(others: the CPU that other processes used meanwhile, % of the machine; above a few %, "
          "the run was not alone and its times are not to be trusted)")


if __name__ == "__main__":
    main()
