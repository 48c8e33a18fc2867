#!/usr/bin/env python3
"""Soak and chaos run for the gateway: mixed traffic at saturation, hot reloads and a kill -9.

Not part of CI (it runs for half an hour by default). Python 3 standard library only. Build
and fetch first, from the repository root:

    cargo build --release
    cargo build --release --target wasm32-wasip2 --target-dir target/wasm \\
        -p crm-persona-template -p crm-field-reranker -p json-extract
    host/scripts/fetch-models.sh

then run, e.g.

    host/scripts/soak.py                          # 30 minutes, 8 workers
    host/scripts/soak.py --minutes 120 --concurrency 16 --kill-at 45
    host/scripts/soak.py --minutes 2 --concurrency 4 --workdir /tmp/soak   # a quick check

What it does, in a work directory (`--workdir`, default a fresh temporary one):

* writes a config (a free loopback port, admin token, ledger, collections dir, plugin dir, the
  chat model and the default embedding model) and a policy file with three tenants (alpha,
  beta, gamma), each with its own random API key (stored as its SHA-256), allowed the chat
  model, the embedding model, its plugins and the collection `kb`. Every tenant's plugin folder
  holds the three example plugins (`persona`, `ranker`, `json`); every tenant reranks with
  `ranker` (/v1/rerank and `"rerank": true` in searches); alpha's chat goes through the
  `persona` template, and through the `json` output parser when it asks for `response_format`;
* starts the gateway, waits for /ready, creates and seeds `kb` for each tenant, then runs
  `--concurrency` worker threads back to back across the tenants: chat completions
  (max_tokens 16-32; some with `response_format`, `documents` or `rag`), streamed chat with
  `stream_options.include_usage` (about 30% hung up on after a few chunks), embeddings,
  collection upserts and searches (all modes, some reranked) and /v1/rerank;
* every minute rewrites the policy file (a new rate limit and config value; in place, by
  atomic rename or through PUT /admin/policies, in turn) and replaces one plugin's .wasm
  atomically with a copy carrying a new custom section (a byte-identical copy has the same
  SHA-256, which the gateway rightly skips), checks through the admin API that both took
  effect, and prints one line: minute, gateway RSS, requests done, errors by kind;
* once, at `--kill-at` minutes (default: random, in the middle third), kill -9's the gateway
  and restarts it on the same config;
* at the end stops it with SIGTERM (it must exit 0), starts it once more to read
  /admin/usage, and prints the ledger's tokens next to the usage the clients were told, per
  tenant and per endpoint, then the RSS growth from minute 5 to the last minute and a summary
  of the gateway's log (`<workdir>/gateway.log`).

Exit status: 0 on a clean run; 1 when the gateway died unexpectedly (anything but the planned
kill), did not exit 0 on SIGTERM, or a tenant's ledger total is below its client total by more
than a kill -9 may lose (the ledger commits in 20 ms batches, so the usage of responses that
completed within a second of a kill is set aside); 2 when something needed is missing.
"""

import argparse
import hashlib
import http.client
import json
import os
import random
import secrets
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict, namedtuple
from contextlib import closing
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MODEL_PATH = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBED_NAME = "all-minilm-l6-v2"
EMBED_PATH = "models/all-MiniLM-L6-v2"
WASM_DIR = "target/wasm/wasm32-wasip2/release"
# Plugin name in the policy -> the example component it is a copy of.
PLUGINS = {
    "json": "json_extract.wasm",
    "persona": "crm_persona_template.wasm",
    "ranker": "crm_field_reranker.wasm",
}
BUILD_PLUGINS = (
    "cargo build --release --target wasm32-wasip2 --target-dir target/wasm "
    "-p crm-persona-template -p crm-field-reranker -p json-extract"
)
TENANT_NAMES = ("alpha", "beta", "gamma")
COLLECTION = "kb"
DRAIN_SECONDS = 30
REQUEST_TIMEOUT = 180
# Relative share of each request kind in the traffic.
MIX = {"chat": 30, "stream": 25, "embeddings": 12, "search": 15, "upsert": 6, "rerank": 12}
# Client requests -> the ledger's `endpoint` column.
ENDPOINT = {"chat": "chat", "stream": "chat", "embeddings": "embeddings",
            "search": "search", "upsert": "documents", "rerank": "rerank"}
# Usage of responses completed this close to a kill -9 may be missing from the ledger.
KILL_WINDOW_S = 1.0
# Errors the traffic provokes on purpose: the json output parser refusing prose.
EXPECTED_ERRORS = {"chat: 422 plugin_rejected", "stream: 422 plugin_rejected",
                   "stream: stream-error plugin_rejected"}

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How do I reset my password?",
    "Explain what an invoice is in one sentence.",
    "List three colours.",
    "Summarise the benefits of single sign-on.",
    "How long do refunds take?",
    "Tell me a short joke about databases.",
]
JSON_PROMPT = ("Give a JSON object with keys name and city for a customer called Ada from "
               "Paris. Answer with JSON only.")
SENTENCES = [
    "Refunds are issued to the original payment method within five business days.",
    "Administrators can export all invoices as CSV from the Billing settings page.",
    "To reset a forgotten password, click 'Forgot password' on the sign-in screen.",
    "Single sign-on with SAML is configured by an owner under Security.",
    "Sales pipelines have customizable stages; drag a deal card between columns.",
    "Webhooks retry failed deliveries with exponential backoff.",
    "API tokens can be rotated without downtime.",
    "Orders ship within two days from our Dublin warehouse.",
    "Enterprise customers get a dedicated account manager and priority support.",
    "Quarterly forecasts depend on pipeline coverage and renewal rates.",
]
QUERIES = [
    "export invoices", "reset password link", "refund payment days", "SAML single sign-on",
    "move a deal to the next stage", "webhook retries", "rotate API tokens",
    "shipping warehouse", "enterprise support", "forecast renewal rates",
]
TEAMS = ["billing", "support", "sales"]

Tenant = namedtuple("Tenant", "name key sha256 bound")


class GatewayError(Exception):
    """The gateway could not be started or queried."""


# ---------------------------------------------------------------------------------------------
# Arguments and prerequisites


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gateway", default="target/release/gateway", help="the gateway binary")
    p.add_argument("--minutes", type=int, default=30, help="length of the run (default 30)")
    p.add_argument("--concurrency", type=int, default=8, help="worker threads (default 8)")
    p.add_argument("--model", default=DEFAULT_MODEL_NAME,
                   help="chat model: NAME=PATH, a .gguf path or the embedded default's name "
                        f"(default {DEFAULT_MODEL_NAME})")
    p.add_argument("--workdir", help="work directory (default: a fresh temporary one)")
    p.add_argument("--kill-at", type=float,
                   help="minute of the kill -9 (default: random, in the middle third; "
                        "negative: no kill)")
    p.add_argument("--seed", type=int, help="random seed (default: random)")
    args = p.parse_args()
    if args.minutes < 1 or args.concurrency < 1:
        p.error("--minutes and --concurrency must be at least 1")
    if args.seed is None:
        args.seed = random.randrange(1 << 30)
    if args.kill_at is None:
        rng = random.Random(args.seed)
        args.kill_at = round(rng.uniform(args.minutes / 3, 2 * args.minutes / 3), 1)
    return args


def fail(message):
    print(f"soak: {message}", file=sys.stderr)
    sys.exit(2)


def repo_path(p):
    """`p` as given when it exists (or is absolute), else relative to the repository root."""
    p = Path(p)
    return (p if p.is_absolute() or p.exists() else REPO / p).resolve()


def resolve_model(spec):
    """(name, path) of `--model`, read the way `gateway serve --model` reads it."""
    if "=" in spec:
        name, path = spec.split("=", 1)
    elif spec == DEFAULT_MODEL_NAME:
        name, path = spec, DEFAULT_MODEL_PATH
    else:
        name, path = Path(spec).stem.lower(), spec
    return name, repo_path(path)


def check_prerequisites(args):
    """The binary, model, embedding model and plugin components, or exit saying what is missing."""
    binary = repo_path(args.gateway)
    if not binary.is_file():
        fail(f"{binary} not found: build it with `cargo build --release`")
    model, model_path = resolve_model(args.model)
    if not model_path.exists():
        fail(f"model {model_path} not found: run host/scripts/fetch-models.sh")
    embed_path = REPO / EMBED_PATH
    if not embed_path.is_dir():
        fail(f"embedding model {embed_path} not found: run host/scripts/fetch-models.sh")
    components = {name: REPO / WASM_DIR / f for name, f in PLUGINS.items()}
    missing = [str(p) for p in components.values() if not p.is_file()]
    if missing:
        fail("plugin components missing:\n  " + "\n  ".join(missing)
             + f"\nbuild them from the repository root with:\n  {BUILD_PLUGINS}")
    wasm = {name: p.read_bytes() for name, p in components.items()}
    return binary, model, model_path, embed_path, wasm


# ---------------------------------------------------------------------------------------------
# Files: config, policy, plugins


def toml_str(value):
    """A TOML basic string (JSON's escapes are valid TOML)."""
    return json.dumps(str(value))


def write_atomically(path, data):
    tmp = path.with_name(f".{path.name}.part")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def leb128(n):
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def with_custom_section(wasm, text):
    """`wasm` plus a trailing custom section: the same component, a different SHA-256."""
    name = b"soak-reload"
    payload = leb128(len(name)) + name + text.encode()
    return wasm + b"\x00" + leb128(len(payload)) + payload


def policy_text(soak, generation):
    """The policy file; `generation` changes a rate limit and a config value, nothing else."""
    parts = []
    for i, t in enumerate(soak.tenants):
        lines = [
            "[[tenants]]",
            f"name = {toml_str(t.name)}",
            f'keys = [{{ id = "soak", sha256 = "{t.sha256}" }}]',
            f"models = [{toml_str(soak.model)}, {toml_str(EMBED_NAME)}]",
            f"plugins = [{', '.join(toml_str(n) for n in sorted(PLUGINS))}]",
            f"collections = [{toml_str(COLLECTION)}]",
            f"requests_per_minute = {1_000_000 + generation}",
            f"weight = {i + 1}",
            'reranker = "ranker"',
        ]
        if t.bound:
            lines += ['prompt_template = "persona"', 'output_parser = "json"']
        lines += [
            "[tenants.config]",
            f'persona = "You are the support assistant of {t.name.title()} CRM."',
            'boosts = "tier=enterprise:2"',
            f'soak_generation = "{generation}"',
        ]
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def install_plugins(soak):
    for t in soak.tenants:
        folder = soak.plugins_dir / t.name
        folder.mkdir(parents=True, exist_ok=True)
        for name, wasm in soak.wasm.items():
            write_atomically(folder / f"{name}.wasm", wasm)


def free_port():
    with closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------
# HTTP


def send(conn, method, path, body=None, key=None, content_type="application/json"):
    # The soak measures the engine and the edge, not the response cache.
    headers = {"Cache-Control": "no-cache"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None
    if body is not None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers["Content-Type"] = content_type
    conn.request(method, path, body=data, headers=headers)
    return conn.getresponse()


def decode(resp, raw):
    if "json" in (resp.getheader("content-type") or ""):
        return json.loads(raw)
    return raw.decode(errors="replace")


def request(conn, method, path, body=None, key=None, content_type="application/json"):
    resp = send(conn, method, path, body, key, content_type)
    return resp.status, decode(resp, resp.read())


def http_once(port, method, path, body=None, key=None, timeout=30.0,
              content_type="application/json"):
    """One request on its own connection: (status, JSON or text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        return request(conn, method, path, body, key, content_type)
    finally:
        conn.close()


def error_kind(status, body):
    err = body.get("error") if isinstance(body, dict) else None
    code = (err or {}).get("code") or (err or {}).get("type") or "?"
    return f"{status} {code}"


def usage_tokens(usage):
    usage = usage or {}
    return int(usage.get("prompt_tokens") or 0) + int(usage.get("completion_tokens") or 0)


def wait_until(check, timeout):
    """Seconds until `check()` held (HTTP errors count as not yet), or None after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if check():
                return time.monotonic() - start
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError):
            pass
        time.sleep(0.05)
    return None


# ---------------------------------------------------------------------------------------------
# The gateway process


class Gateway:
    def __init__(self, binary, workdir, write_config):
        self.binary, self.workdir, self.write_config = binary, workdir, write_config
        self.port = free_port()
        self.proc = None
        self.starts = 0
        self.log_path = workdir / "gateway.log"

    def start(self, timeout=600.0):
        """Starts it and waits for /ready; a port lost to another process gets a new one."""
        for _ in range(3):
            config = self.write_config(self.port)
            self.starts += 1
            with open(self.log_path, "ab") as log:
                log.write(f"\n===== soak: start #{self.starts} on port {self.port}, "
                          f"{time.ctime()} =====\n".encode())
                log.flush()
                self.proc = subprocess.Popen(
                    [str(self.binary), "serve", "--config", str(config)],
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    cwd=self.workdir, start_new_session=True)
            if self.wait_ready(timeout):
                return
            if "binding" not in self.log_tail(5):
                break
            self.port = free_port()
        raise GatewayError(f"the gateway did not become ready ({describe_exit(self.proc)}); "
                           f"last log lines:\n{self.log_tail(30)}")

    def wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                if http_once(self.port, "GET", "/ready", timeout=5)[0] == 200:
                    return True
            except (OSError, http.client.HTTPException, ValueError):
                pass
            time.sleep(0.25)
        self.proc.kill()
        self.proc.wait()
        return False

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def kill9(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def terminate(self, timeout):
        """SIGTERM and wait: the exit code, or None if it had to be killed."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None

    def rss_kib(self):
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        return int(line.split()[1])
        except OSError:
            pass
        return None

    def log_tail(self, n):
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.log_path) - 65536))
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])


def describe_exit(proc):
    code = proc.returncode if proc else None
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


# ---------------------------------------------------------------------------------------------
# Client-side bookkeeping


class Stats:
    """Requests done, errors by kind and usage the clients were told, shared by the workers."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests = 0
        self.cancelled = 0
        self.ok = Counter()
        self.errors = Counter()
        self.tokens = Counter()            # tenant -> tokens
        self.by_endpoint = Counter()       # (tenant, ledger endpoint) -> tokens
        self.timeline = defaultdict(int)   # (tenant, unix second) -> tokens

    def record(self, tenant, op, kind, tokens=0):
        now = int(time.time())
        with self.lock:
            self.requests += 1
            if kind is None:
                self.ok[op] += 1
                self.tokens[tenant] += tokens
                self.by_endpoint[(tenant, ENDPOINT[op])] += tokens
                self.timeline[(tenant, now)] += tokens
            elif kind == "cancelled":
                self.cancelled += 1
            else:
                self.errors[kind] += 1

    def snapshot(self):
        with self.lock:
            return self.requests, dict(self.errors)

    def near(self, tenant, moments, window):
        """Tokens of responses to `tenant` completed within `window` s of any of `moments`."""
        with self.lock:
            return sum(tok for (t, sec), tok in self.timeline.items() if t == tenant
                       and any(abs(sec - m) <= window + 1 for m in moments))


class Client:
    """A worker's keep-alive connection, reopened after errors and when the port changes."""

    def __init__(self, gateway):
        self.gateway = gateway
        self.conn = None
        self.port = None

    def connection(self):
        if self.conn is None or self.port != self.gateway.port:
            self.close()
            self.port = self.gateway.port
            self.conn = http.client.HTTPConnection("127.0.0.1", self.port,
                                                   timeout=REQUEST_TIMEOUT)
        return self.conn

    def reused(self):
        return self.conn is not None and self.conn.sock is not None

    def close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def call(self, path, body, key):
        """POST: (error kind or None, tokens the response reported)."""
        status, obj = request(self.connection(), "POST", path, body, key)
        if status == 200 and isinstance(obj, dict):
            return None, usage_tokens(obj.get("usage"))
        return error_kind(status, obj), 0

    def stream(self, body, key, cut_after):
        """A streamed chat, hung up on after `cut_after` events (0: read to the end)."""
        resp = send(self.connection(), "POST", "/v1/chat/completions", body, key)
        if resp.status != 200:
            return error_kind(resp.status, decode(resp, resp.read())), 0
        events, usage, error = 0, None, None
        while True:
            line = resp.readline()
            if not line:
                self.close()
                return "stream-truncated", 0
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                resp.read()
                if error:
                    return f"stream-error {error}", 0
                return (None, usage_tokens(usage)) if usage else ("stream-no-usage", 0)
            event = json.loads(data)
            if isinstance(event.get("error"), dict):
                error = event["error"].get("code") or event["error"].get("type") or "?"
            usage = event.get("usage") or usage
            events += 1
            if cut_after and events >= cut_after:
                self.close()
                return "cancelled", 0


# ---------------------------------------------------------------------------------------------
# Traffic


def chat_body(rng, soak, tenant, stream):
    body = {
        "model": soak.model,
        "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
        "max_tokens": rng.randint(16, 32),
        "temperature": rng.choice([0, 0.7, 1.0]),
        "seed": rng.randrange(1 << 31),
    }
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    roll = rng.random()
    if tenant.bound and roll < 0.3:
        body["messages"][0]["content"] = JSON_PROMPT
        body["response_format"] = {"type": "json_object"}
    elif tenant.bound and roll < 0.45:
        body["documents"] = [{"id": f"d{i}", "text": s}
                             for i, s in enumerate(rng.sample(SENTENCES, 2))]
    elif roll < 0.6:
        body["rag"] = {"collection": COLLECTION, "top_k": 2, "mode": rng.choice(["bm25", "hybrid"])}
    return body


def documents(rng, wid, n):
    return [{
        "id": f"w{wid}-{rng.randrange(25)}",
        "text": " ".join(rng.sample(SENTENCES, 2)),
        "metadata": {"team": rng.choice(TEAMS), "year": rng.randint(2019, 2025),
                     "tier": rng.choice(["free", "enterprise"])},
    } for _ in range(n)]


def op_chat(w, tenant):
    return w.client.call("/v1/chat/completions", chat_body(w.rng, w.soak, tenant, False), tenant.key)


def op_stream(w, tenant):
    cut_after = w.rng.randint(1, 6) if w.rng.random() < 0.3 else 0
    return w.client.stream(chat_body(w.rng, w.soak, tenant, True), tenant.key, cut_after)


def op_embeddings(w, tenant):
    body = {"model": EMBED_NAME, "input": w.rng.sample(SENTENCES, w.rng.randint(1, 4)),
            "encoding_format": w.rng.choice(["float", "base64"])}
    return w.client.call("/v1/embeddings", body, tenant.key)


def op_search(w, tenant):
    body = {"query": w.rng.choice(QUERIES), "top_k": w.rng.choice([3, 5, 10]),
            "mode": w.rng.choice(["bm25", "vector", "hybrid"]), "rerank": w.rng.random() < 0.3}
    if w.rng.random() < 0.2:
        body["filter"] = {"team": w.rng.choice(TEAMS)}
    return w.client.call(f"/v1/collections/{COLLECTION}/search", body, tenant.key)


def op_upsert(w, tenant):
    body = {"documents": documents(w.rng, w.wid, w.rng.randint(1, 3))}
    return w.client.call(f"/v1/collections/{COLLECTION}/documents", body, tenant.key)


def op_rerank(w, tenant):
    docs = [s if w.rng.random() < 0.5 else {"text": s, "tier": w.rng.choice(["free", "enterprise"])}
            for s in w.rng.sample(SENTENCES, 5)]
    body = {"query": w.rng.choice(QUERIES), "documents": docs, "top_n": 3}
    return w.client.call("/v1/rerank", body, tenant.key)


OPS = {"chat": op_chat, "stream": op_stream, "embeddings": op_embeddings,
       "search": op_search, "upsert": op_upsert, "rerank": op_rerank}
DROPPED = (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError)


class Worker(threading.Thread):
    def __init__(self, soak, wid):
        super().__init__(name=f"soak-worker-{wid}", daemon=True)
        self.soak, self.wid = soak, wid
        self.rng = random.Random(soak.args.seed * 1000 + wid)
        self.client = Client(soak.gateway)

    def run(self):
        ops, weights = list(MIX), list(MIX.values())
        while not self.soak.stop.is_set():
            tenant = self.rng.choice(self.soak.tenants)
            op = self.rng.choices(ops, weights)[0]
            kind, tokens = self.attempt(op, tenant)
            if kind not in (None, "cancelled"):
                kind = f"{op}: {kind}"
            self.soak.stats.record(tenant.name, op, self.soak.label(kind), tokens)
        self.client.close()

    def attempt(self, op, tenant):
        reused = self.client.reused()
        try:
            return OPS[op](self, tenant)
        except (OSError, http.client.HTTPException, ValueError) as e:
            self.client.close()
            if isinstance(e, ConnectionRefusedError):
                time.sleep(0.25)
            kind = type(e).__name__
            if reused and isinstance(e, DROPPED):
                kind += " (reused connection)"
            return kind, 0


# ---------------------------------------------------------------------------------------------
# The run


class Soak:
    def __init__(self, args, binary, model, model_path, embed_path, wasm):
        self.args, self.model, self.model_path, self.embed_path = args, model, model_path, embed_path
        self.wasm = wasm
        self.workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gateway-soak-")).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.policy_path = self.workdir / "policies.toml"
        self.ledger_path = self.workdir / "usage.sqlite"
        self.collections_dir = self.workdir / "collections"
        self.plugins_dir = self.workdir / "plugins"
        self.admin_token = "soak-admin-" + secrets.token_hex(16)
        self.tenants = []
        for i, name in enumerate(TENANT_NAMES):
            key = "sk-soak-" + secrets.token_hex(24)
            self.tenants.append(Tenant(name, key, hashlib.sha256(key.encode()).hexdigest(), i == 0))
        self.stats = Stats()
        self.stop = threading.Event()
        self.phase = ""           # "kill" or "crash" while the gateway is down
        self.deaths = []          # unix times of kills and crashes
        self.crashes = []         # what died unexpectedly
        self.problems = []        # reloads not observed, admin calls refused
        self.rss = []             # (minute, pid, KiB)
        self.lives = []           # (minute the process became ready, pid)
        self.since = int(time.time())
        self.t0 = time.monotonic()
        install_plugins(self)
        self.policy_path.write_text(policy_text(self, 0))
        self.gateway = Gateway(binary, self.workdir, self.write_config)

    def write_config(self, port):
        path = self.workdir / "gateway.toml"
        path.write_text("\n".join([
            f'listen = "127.0.0.1:{port}"',
            f"admin_token = {toml_str(self.admin_token)}",
            f"policies = {toml_str(self.policy_path)}",
            f"ledger = {toml_str(self.ledger_path)}",
            f"collections_dir = {toml_str(self.collections_dir)}",
            f"drain_seconds = {DRAIN_SECONDS}",
            "[plugins]",
            f"dir = {toml_str(self.plugins_dir)}",
            "[[models]]",
            f"name = {toml_str(self.model)}",
            f"path = {toml_str(self.model_path)}",
            "[[embeddings]]",
            f"name = {toml_str(EMBED_NAME)}",
            f"path = {toml_str(self.embed_path)}",
        ]) + "\n")
        return path

    def minute(self):
        return (time.monotonic() - self.t0) / 60

    def say(self, message):
        print(f"[{self.minute():6.2f} min] {message}", flush=True)

    def label(self, kind):
        """Errors while the gateway is down on purpose (or after a crash) are marked so."""
        if kind is None or kind == "cancelled" or not self.phase:
            return kind
        return f"{self.phase}: {kind}"

    def admin(self, method, path, body=None, content_type="application/json"):
        return http_once(self.gateway.port, method, path, body, self.admin_token,
                         timeout=60, content_type=content_type)


def seed_collections(soak):
    rng = random.Random(soak.args.seed)
    for t in soak.tenants:
        port = soak.gateway.port
        status, body = http_once(port, "POST", "/v1/collections", {"name": COLLECTION}, t.key)
        if status not in (201, 409):
            raise GatewayError(f"creating {t.name}/{COLLECTION}: {status} {body}")
        docs = {"documents": documents(rng, "seed", 12)}
        status, body = http_once(port, "POST", f"/v1/collections/{COLLECTION}/documents", docs,
                                 t.key, timeout=REQUEST_TIMEOUT)
        if status != 200:
            raise GatewayError(f"seeding {t.name}/{COLLECTION}: {status} {body}")
        soak.stats.record(t.name, "upsert", None, usage_tokens(body.get("usage")))


def reload_policy(soak, generation):
    """Rewrites the policy (in place, by rename or by PUT, in turn): seconds until in force."""
    text = policy_text(soak, generation)
    how = ("admin PUT", "in place", "rename")[generation % 3]
    try:
        if how == "admin PUT":
            status, body = soak.admin("PUT", "/admin/policies", text.encode(), "application/toml")
            if status != 200:
                soak.problems.append(f"PUT /admin/policies (generation {generation}): {status} {body}")
                return how, None
        elif how == "in place":
            soak.policy_path.write_text(text)
        else:
            write_atomically(soak.policy_path, text.encode())
    except (OSError, http.client.HTTPException) as e:
        soak.problems.append(f"policy rewrite {generation} ({how}): {type(e).__name__}: {e}")
        return how, None
    marker = f'soak_generation = "{generation}"'
    took = wait_until(lambda: marker in soak.admin("GET", "/admin/policies")[1], 10)
    if took is None:
        soak.problems.append(f"policy generation {generation} ({how}) not in force after 10 s")
    return how, took


def reload_plugin(soak, minute):
    """Replaces one tenant plugin's file with a new build of it: seconds until it serves."""
    combos = [(t.name, n) for n in sorted(PLUGINS) for t in soak.tenants]
    tenant, name = combos[(minute - 1) % len(combos)]
    wasm = with_custom_section(soak.wasm[name], f"soak minute {minute}")
    sha = hashlib.sha256(wasm).hexdigest()
    write_atomically(soak.plugins_dir / tenant / f"{name}.wasm", wasm)

    def loaded():
        status, body = soak.admin("GET", "/admin/plugins")
        return status == 200 and any(p["tenant"] == tenant and p["name"] == name
                                     and p["sha256"] == sha for p in body["data"])
    took = wait_until(loaded, 30)
    if took is None:
        soak.problems.append(f"plugin {tenant}/{name} (minute {minute}) not reloaded after 30 s")
    return f"{tenant}/{name}", took


def fmt_errors(errors):
    if not errors:
        return "none"
    return ", ".join(f"{k} x{v}" for k, v in sorted(errors.items(), key=lambda kv: -kv[1]))


def fmt_s(seconds):
    return "NOT SEEN" if seconds is None else f"{seconds:.2f}s"


def minute_tick(soak, minute):
    how, policy_s = reload_policy(soak, minute)
    plugin, plugin_s = reload_plugin(soak, minute)
    rss = soak.gateway.rss_kib()
    soak.rss.append((minute, soak.gateway.proc.pid, rss))
    requests, errors = soak.stats.snapshot()
    rss_text = "?" if rss is None else f"{rss / 1024:.1f} MiB"
    print(f"minute {minute:3d}  rss {rss_text}  requests {requests}  errors: {fmt_errors(errors)}"
          f"  [policy {how} {fmt_s(policy_s)}, plugin {plugin} {fmt_s(plugin_s)}]", flush=True)


def restart_after(soak, phase, what):
    """Restarts a dead gateway; requests failing meanwhile are labelled with `phase`."""
    soak.phase = phase
    soak.deaths.append(time.time())
    started = time.monotonic()
    soak.gateway.start()
    soak.lives.append((soak.minute(), soak.gateway.proc.pid))
    soak.say(f"{what}; restarted as pid {soak.gateway.proc.pid}, ready after "
             f"{time.monotonic() - started:.1f} s")
    time.sleep(1)
    soak.phase = ""


def planned_kill(soak):
    pid = soak.gateway.proc.pid
    soak.phase = "kill"
    soak.gateway.kill9()
    restart_after(soak, "kill", f"kill -9 of pid {pid} (planned)")


def watch_for_crash(soak):
    gw = soak.gateway
    if gw.alive():
        return
    what = f"pid {gw.proc.pid} {describe_exit(gw.proc)}"
    soak.crashes.append(f"minute {soak.minute():.2f}: {what}")
    soak.say(f"UNEXPECTED: the gateway died ({what}); last log lines:\n{gw.log_tail(40)}")
    restart_after(soak, "crash", "after the crash")


def run_schedule(soak):
    args = soak.args
    start = soak.t0 = time.monotonic()
    kill_at = start + args.kill_at * 60 if 0 <= args.kill_at < args.minutes else None
    minute = 1
    while minute <= args.minutes:
        watch_for_crash(soak)
        now = time.monotonic()
        if kill_at is not None and now >= kill_at:
            planned_kill(soak)
            kill_at = None
        elif now >= start + minute * 60:
            minute_tick(soak, minute)
            minute += 1
        else:
            time.sleep(0.5)


# ---------------------------------------------------------------------------------------------
# The end: ledger against clients, RSS, log


def ledger_usage(soak):
    """Restarts the stopped gateway, reads /admin/usage for the run, stops it: (totals, exit)."""
    gw = soak.gateway
    gw.start()
    try:
        status, body = soak.admin("GET", f"/admin/usage?from={soak.since}&group_by=model")
    finally:
        code = gw.terminate(DRAIN_SECONDS + 60)
    if status != 200:
        raise GatewayError(f"/admin/usage answered {status}: {body}")
    totals = Counter()
    for row in body["data"]:
        totals[row["tenant"]] += int(row["total_tokens"])
    return totals, code


def ledger_breakdown(soak):
    """(tenant, endpoint, status) -> (requests, tokens), read from the ledger file itself."""
    uri = soak.ledger_path.as_uri() + "?mode=ro"
    try:
        with closing(sqlite3.connect(uri, uri=True)) as db:
            rows = db.execute(
                "SELECT tenant, endpoint, status, COUNT(*), "
                "SUM(prompt_tokens + completion_tokens) FROM requests WHERE ts >= ? "
                "GROUP BY tenant, endpoint, status", (soak.since,)).fetchall()
    except sqlite3.Error as e:
        print(f"(could not read {soak.ledger_path}: {e})")
        return {}
    return {(t, e, s): (n, tok or 0) for t, e, s, n, tok in rows}


def compare_tokens(soak, ledger, breakdown):
    """Prints ledger vs client per tenant; returns the tenants whose ledger is too low."""
    print("\nTokens per tenant (prompt + completion), ledger vs what clients were told:")
    print(f"  {'tenant':8} {'client':>10} {'ledger':>10} {'diff':>9} {'cancelled':>10} "
          f"{'error':>8} {'kill window':>12}  verdict")
    low = []
    for t in soak.tenants:
        client, led = soak.stats.tokens[t.name], ledger.get(t.name, 0)
        by_status = Counter()
        for (tenant, _, status), (_, tok) in breakdown.items():
            if tenant == t.name:
                by_status[status] += tok
        at_risk = soak.stats.near(t.name, soak.deaths, KILL_WINDOW_S)
        verdict = "ok"
        if led < client:
            verdict = "within kill window" if led >= client - at_risk else "LEDGER LOW"
        if verdict == "LEDGER LOW":
            low.append(t.name)
        print(f"  {t.name:8} {client:>10} {led:>10} {led - client:>+9} "
              f"{by_status['cancelled']:>10} {by_status['error']:>8} {at_risk:>12}  {verdict}")
    print("  The ledger also holds what clients never saw counted: streams they hung up on\n"
          "  (status cancelled, charged the tokens sent, which may be all of them when the\n"
          "  stream had finished), failed requests, and the searches RAG chats made (endpoint\n"
          "  search). Requests cut by the kill -9 are counted by neither side (the process died\n"
          "  before settling them). So ledger >= client is expected; 'kill window' is client\n"
          f"  usage of responses completed within {KILL_WINDOW_S:.0f} s of a kill, which the ledger\n"
          "  may have lost (it commits in 20 ms batches).")
    return low


def print_endpoints(soak, breakdown):
    print("\nPer endpoint: client tokens | ledger ok tokens (requests) | ledger cancelled | error")
    keys = sorted({(t, e) for t, e, _ in breakdown} | set(soak.stats.by_endpoint))
    for tenant, endpoint in keys:
        ok_n, ok_tok = breakdown.get((tenant, endpoint, "ok"), (0, 0))
        _, can_tok = breakdown.get((tenant, endpoint, "cancelled"), (0, 0))
        _, err_tok = breakdown.get((tenant, endpoint, "error"), (0, 0))
        client = soak.stats.by_endpoint.get((tenant, endpoint), 0)
        print(f"  {tenant:8} {endpoint:11} {client:>9} | {ok_tok:>9} ({ok_n:>6}) | "
              f"{can_tok:>8} | {err_tok:>7}")


def report_rss(soak):
    """RSS growth from minute 5 of each process's life to its last sample."""
    print("\nRSS:")
    grew = False
    for born, pid in soak.lives:
        samples = [(m, r) for m, p, r in soak.rss if p == pid and r is not None]
        base = next(((m, r) for m, r in samples if m - born >= 5), None)
        if base is None or samples[-1][0] <= base[0]:
            continue
        (m0, r0), (m1, r1) = base, samples[-1]
        grew = True
        print(f"  pid {pid}: minute {m0} {r0 / 1024:.1f} MiB -> minute {m1} {r1 / 1024:.1f} MiB "
              f"({(r1 - r0) * 100 / r0:+.1f}%)")
    if not grew:
        print("  run too short for a growth figure (a process must live past minute 5 "
              "and be sampled later)")
    for m, p, r in soak.rss:
        print(f"    minute {m:3d} pid {p}: {'?' if r is None else f'{r / 1024:.1f} MiB'}")


def report_log(soak):
    try:
        lines = soak.gateway.log_path.read_text(errors="replace").splitlines()
    except OSError:
        return
    count = lambda s: sum(s in line for line in lines)
    at_start = len(soak.tenants) * len(PLUGINS) * soak.gateway.starts
    print(f"\nGateway log {soak.gateway.log_path}: {count('policies reloaded')} policy reloads "
          f"from the file, {count('policies replaced')} by PUT, {count('policy file rejected')} "
          f"policy files rejected, {count('plugin loaded')} plugin loads ({at_start} of them at "
          f"the {soak.gateway.starts} starts), {count('plugin rejected')} plugins rejected, "
          f"{count('panicked')} panics, {count(' WARN ')} WARN, {count(' ERROR ')} ERROR lines")
    seen = Counter()
    for line in lines:
        if " WARN " in line or " ERROR " in line or "panicked" in line:
            seen[line.split(" ", 1)[-1][:300]] += 1
    for text, n in seen.most_common(15):
        print(f"  x{n}: {text}")


def suspicious_errors(soak):
    _, errors = soak.stats.snapshot()
    return {k: v for k, v in errors.items()
            if k not in EXPECTED_ERRORS and not k.startswith("kill: ")}


def finish(soak, workers):
    soak.stop.set()
    for w in workers:
        w.join(REQUEST_TIMEOUT + 10)
    requests, errors = soak.stats.snapshot()
    soak.say(f"traffic stopped: {requests} requests, {soak.stats.cancelled} streams hung up on "
             f"on purpose, ok by kind {dict(soak.stats.ok)}")
    time.sleep(2)   # hung-up streams settle when the gateway notices
    watch_for_crash(soak)
    failures = [f"unexpected gateway death: {c}" for c in soak.crashes]
    code = soak.gateway.terminate(DRAIN_SECONDS + 60)
    soak.say(f"SIGTERM: the gateway {describe_exit(soak.gateway.proc)}")
    if code != 0:
        failures.append(f"the gateway did not exit 0 on SIGTERM ({describe_exit(soak.gateway.proc)})")
    ledger, code = ledger_usage(soak)
    if code != 0:
        failures.append(f"the usage-check gateway did not exit 0 on SIGTERM "
                        f"({describe_exit(soak.gateway.proc)})")
    breakdown = ledger_breakdown(soak)
    low = compare_tokens(soak, ledger, breakdown)
    failures += [f"ledger total below client total for tenant {t}" for t in low]
    print_endpoints(soak, breakdown)
    report_rss(soak)
    report_log(soak)
    return verdict(soak, failures)


def verdict(soak, failures):
    odd = suspicious_errors(soak)
    print(f"\nErrors by kind: {fmt_errors(soak.stats.snapshot()[1])}")
    if odd:
        print(f"Errors worth a look (not provoked on purpose, not during the planned kill): "
              f"{fmt_errors(odd)}")
    for p in soak.problems:
        print(f"Problem: {p}")
    if failures:
        print("\nFAIL:\n  " + "\n  ".join(failures))
        return 1
    print("\nPASS: no unexpected gateway deaths, clean SIGTERM exits, ledger >= client for "
          "every tenant")
    return 0


def main():
    args = parse_args()
    soak = Soak(args, *check_prerequisites(args))
    print(f"soak: workdir {soak.workdir}, {args.minutes} min, {args.concurrency} workers, "
          f"model {soak.model}, kill -9 at minute "
          f"{args.kill_at if 0 <= args.kill_at < args.minutes else 'never'}, seed {args.seed}",
          flush=True)
    try:
        soak.gateway.start()
        soak.lives.append((0.0, soak.gateway.proc.pid))
        soak.say(f"gateway pid {soak.gateway.proc.pid} ready on 127.0.0.1:{soak.gateway.port}")
        seed_collections(soak)
        workers = [Worker(soak, i) for i in range(args.concurrency)]
        for w in workers:
            w.start()
        run_schedule(soak)
        return finish(soak, workers)
    except GatewayError as e:
        print(f"\nFAIL: {e}", flush=True)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted", flush=True)
        return 130
    finally:
        soak.stop.set()
        if soak.gateway.alive():
            soak.gateway.terminate(DRAIN_SECONDS + 10)


if __name__ == "__main__":
    sys.exit(main())
