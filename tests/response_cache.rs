//! The response cache end to end: a real gateway (and, for sharing, two replicas over a real
//! `redis-server`) driven over HTTP. Exact hits replay the answer's bytes, streamed or not, free
//! by default and only to their own tenant; what must miss misses (another tenant, a
//! non-deterministic request, `no-cache`, a policy change, TTL, the size cap, an admin clear);
//! paraphrases hit the semantic cache; a tenant's `cache-key` plugin (Rust and Python) makes
//! requests that differ only in a timestamp hit.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use serde_json::{json, Value};
use support::redis::redis;
use support::wasm::{component, language_component};
use support::{key_sha256, model_path, patient_client, Server, MODEL};

const ADMIN: &str = "admin-token-for-tests-0123";

fn tenant(name: &str, extra: &str) -> String {
    format!(
        "[[tenants]]\nname = \"{name}\"\nkeys = [{{ id = \"{name}-key\", sha256 = \"{}\" }}]\n{extra}\n",
        key_sha256(&format!("sk-{name}"))
    )
}

/// A gateway with `policies`, a ledger, the admin API and `more` config lines (after the
/// model table); its folder.
fn start(policies: &str, more: &str) -> (Server, PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "gateway-cache-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(dir.join("plugins")).unwrap();
    std::fs::write(dir.join("policies.toml"), policies).unwrap();
    let config = format!(
        "admin_token = \"{ADMIN}\"\npolicies = \"{d}/policies.toml\"\nledger = \"{d}/usage.sqlite\"\n\
         collections_dir = \"{d}/collections\"\n[plugins]\ndir = \"{d}/plugins\"\n\
         [[models]]\nname = \"{MODEL}\"\npath = \"{m}\"\n{more}\n",
        d = dir.display(),
        m = model_path(),
    );
    std::fs::write(dir.join("gateway.toml"), config).unwrap();
    let path = dir.join("gateway.toml");
    let args = [
        "--config",
        path.to_str().unwrap(),
        "--response-cache",
        "true",
    ];
    (Server::start(&args), dir)
}

/// One answer: status, `x-gateway-cache`, the similarity header, the body's bytes.
struct Answer {
    status: u16,
    cache: String,
    similarity: Option<f32>,
    body: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

fn send(s: &Server, who: &str, path: &str, body: &Value, headers: &[(&str, &str)]) -> Answer {
    let mut r = patient_client()
        .post(format!("{}{path}", s.base))
        .bearer_auth(format!("sk-{who}"))
        .json(body);
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    let r = r.send().unwrap();
    let header = |n: &str| r.headers().get(n).map(|v| v.to_str().unwrap().to_string());
    let cache = header("x-gateway-cache").unwrap_or_default();
    let similarity = header("x-gateway-cache-similarity").map(|v| v.parse().unwrap());
    Answer {
        status: r.status().as_u16(),
        cache,
        similarity,
        body: r.bytes().unwrap().to_vec(),
    }
}

fn chat(text: &str) -> Value {
    json!({"model": MODEL, "messages": [{"role": "user", "content": text}],
           "temperature": 0, "max_tokens": 12})
}

fn admin(s: &Server, method: &str, path: &str, body: Vec<u8>) -> (u16, Value) {
    s.request(method, path, body, Some(ADMIN))
}

#[test]
fn exact_hits_replay_the_answer_free_and_only_to_their_tenant() {
    let policies =
        tenant("a", "token_budget = { tokens = 100000, period = \"day\" }") + &tenant("b", "");
    let (s, dir) = start(&policies, "");
    let q = chat("Name three colors.");

    let first = send(&s, "a", "/v1/chat/completions", &q, &[]);
    assert_eq!((first.status, first.cache.as_str()), (200, "miss"));
    let hit = send(&s, "a", "/v1/chat/completions", &q, &[]);
    assert_eq!((hit.status, hit.cache.as_str()), (200, "hit"));
    let again = send(&s, "a", "/v1/chat/completions", &q, &[]);
    assert_eq!(
        hit.body, first.body,
        "a hit is the first answer, byte for byte"
    );
    assert_eq!(again.body, first.body);
    let f = first.json();
    assert!(f["usage"]["prompt_tokens"].as_u64().unwrap() > 0);

    // Another tenant never gets a's answer: it runs the model (a new id, its own tokens).
    let other = send(&s, "b", "/v1/chat/completions", &q, &[]);
    assert_eq!((other.status, other.cache.as_str()), (200, "miss"));
    assert_ne!(other.json()["id"], f["id"]);
    assert_eq!(send(&s, "b", "/v1/chat/completions", &q, &[]).cache, "hit");

    // A stream is replayed byte for byte.
    let mut streamed = q.clone();
    streamed["stream"] = json!(true);
    let s1 = send(&s, "a", "/v1/chat/completions", &streamed, &[]);
    assert_eq!(s1.cache, "miss");
    assert!(s1.body.ends_with(b"data: [DONE]\n\n"));
    let s2 = send(&s, "a", "/v1/chat/completions", &streamed, &[]);
    assert_eq!(s2.cache, "hit");
    assert_eq!(s1.body, s2.body);

    // What must not be served from the cache is not.
    let mut warm = q.clone();
    warm["temperature"] = json!(0.9);
    assert_eq!(
        send(&s, "a", "/v1/chat/completions", &warm, &[]).cache,
        "bypass"
    );
    assert_eq!(
        send(&s, "a", "/v1/chat/completions", &warm, &[]).cache,
        "bypass"
    );
    let mut seeded = warm.clone();
    seeded["seed"] = json!(7);
    assert_eq!(
        send(&s, "a", "/v1/chat/completions", &seeded, &[]).cache,
        "miss"
    );
    assert_eq!(
        send(&s, "a", "/v1/chat/completions", &seeded, &[]).cache,
        "hit"
    );
    for directive in ["no-cache", "no-store", "max-age=0, No-Cache"] {
        let r = send(
            &s,
            "a",
            "/v1/chat/completions",
            &q,
            &[("cache-control", directive)],
        );
        assert_eq!((r.status, r.cache.as_str()), (200, "bypass"), "{directive}");
    }

    // Completions are cached alike.
    let c = json!({"model": MODEL, "prompt": "The sky is", "max_tokens": 8, "temperature": 0});
    assert_eq!(send(&s, "a", "/v1/completions", &c, &[]).cache, "miss");
    assert_eq!(send(&s, "a", "/v1/completions", &c, &[]).cache, "hit");

    // A Responses request runs the same pipeline, and its cache: streamed or not.
    let r = json!({"model": MODEL, "input": "Name a metal.", "temperature": 0,
                   "max_output_tokens": 8, "store": false});
    let r1 = send(&s, "a", "/v1/responses", &r, &[]);
    assert_eq!((r1.status, r1.cache.as_str()), (200, "miss"));
    let r2 = send(&s, "a", "/v1/responses", &r, &[]);
    assert_eq!((r2.cache.as_str(), &r2.body), ("hit", &r1.body));
    let mut rs = r.clone();
    rs["stream"] = json!(true);
    let rs1 = send(&s, "a", "/v1/responses", &rs, &[]);
    assert_eq!(rs1.cache, "miss");
    let rs2 = send(&s, "a", "/v1/responses", &rs, &[]);
    assert_eq!((rs2.cache.as_str(), &rs2.body), ("hit", &rs1.body));

    // A stored Response deleted since is not handed out again: its id would be a 404.
    let kept = json!({"model": MODEL, "input": "Name a gas.", "temperature": 0,
                      "max_output_tokens": 8});
    let k1 = send(&s, "a", "/v1/responses", &kept, &[]);
    assert_eq!(k1.cache, "miss");
    assert_eq!(send(&s, "a", "/v1/responses", &kept, &[]).body, k1.body);
    let id = k1.json()["id"].as_str().unwrap().to_string();
    let path = format!("/v1/responses/{id}");
    assert_eq!(s.request("DELETE", &path, vec![], Some("sk-a")).0, 200);
    let k3 = send(&s, "a", "/v1/responses", &kept, &[]);
    assert_eq!((k3.status, k3.cache.as_str()), (200, "miss"));
    assert_ne!(k3.json()["id"], json!(id));

    // Hits are in the ledger, one row each, as `cached`, charged nothing.
    let (_, usage) = admin(&s, "GET", "/admin/usage?tenant=a", vec![]);
    assert_eq!(usage["data"][0]["cached_requests"], 8, "{usage}");
    assert_eq!(usage["data"][0]["failed_requests"], 0, "{usage}");
    let conn = rusqlite::Connection::open(dir.join("usage.sqlite")).unwrap();
    let (rows, tokens): (i64, i64) = conn
        .query_row(
            "SELECT COUNT(*), COALESCE(SUM(prompt_tokens + completion_tokens), 0) FROM requests \
             WHERE tenant = 'a' AND status = 'cached'",
            [],
            |r| Ok((r.get(0)?, r.get(1)?)),
        )
        .unwrap();
    assert_eq!((rows, tokens), (8, 0));
    let hits = "gateway_cache_lookups_total{kind=\"exact\",result=\"hit\",tenant=\"a\"}";
    // The deleted Response's entry was found (a lookup hit) but not served.
    assert_eq!(s.metric(hits), 9.0);

    // The admin API shows each tenant's share and clears one.
    let (status, held) = admin(&s, "GET", "/admin/cache", vec![]);
    assert_eq!(status, 200, "{held}");
    let a = held["data"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tenant"] == "a")
        .unwrap();
    assert_eq!(a["entries"], 7, "{held}");
    assert!(a["bytes"].as_u64().unwrap() > 1000, "{held}");
    let (status, cleared) = admin(&s, "DELETE", "/admin/cache?tenant=a", vec![]);
    assert_eq!(
        (status, cleared["deleted"].as_u64()),
        (200, Some(7)),
        "{cleared}"
    );
    assert_eq!(send(&s, "a", "/v1/chat/completions", &q, &[]).cache, "miss");
    assert_eq!(
        send(&s, "b", "/v1/chat/completions", &q, &[]).cache,
        "hit",
        "b's stays"
    );
    let (status, _) = admin(&s, "DELETE", "/admin/cache", vec![]);
    assert_eq!(status, 400, "a clear names its tenant");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn policy_changes_expiry_and_the_size_cap_make_misses() {
    let policies = tenant("a", "[tenants.config]\ntone = \"dry\"")
        + &tenant("t", "cache = { ttl_s = 1 }")
        + &tenant("small", "");
    let (s, dir) = start(&policies, "");
    let q = chat("Name a fruit.");
    assert_eq!(send(&s, "a", "/v1/chat/completions", &q, &[]).cache, "miss");
    assert_eq!(send(&s, "a", "/v1/chat/completions", &q, &[]).cache, "hit");
    let changed = policies.replace("tone = \"dry\"", "tone = \"warm\"");
    let (status, v) = admin(&s, "PUT", "/admin/policies", changed.clone().into_bytes());
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        send(&s, "a", "/v1/chat/completions", &q, &[]).cache,
        "miss",
        "plugins read `config`: a change of it is a new answer"
    );

    assert_eq!(send(&s, "t", "/v1/chat/completions", &q, &[]).cache, "miss");
    assert_eq!(send(&s, "t", "/v1/chat/completions", &q, &[]).cache, "hit");
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        send(&s, "t", "/v1/chat/completions", &q, &[]).cache,
        "miss",
        "expired"
    );

    // A cap of about two and a half answers: the third evicts the least recently used.
    let questions = ["Name a tree.", "Name a river.", "Name a bird."];
    let size = send(
        &s,
        "small",
        "/v1/chat/completions",
        &chat(questions[0]),
        &[],
    )
    .body
    .len();
    let cap = (size + 64 + MODEL.len()) as f64 * 2.5 / (1024.0 * 1024.0);
    let capped = changed.replace(
        &tenant("small", ""),
        &tenant("small", &format!("cache = {{ max_mb = {cap} }}")),
    );
    let (status, v) = admin(&s, "PUT", "/admin/policies", capped.into_bytes());
    assert_eq!(status, 200, "{v}");
    for q in &questions[1..] {
        assert_eq!(
            send(&s, "small", "/v1/chat/completions", &chat(q), &[]).cache,
            "miss"
        );
    }
    assert_eq!(
        send(
            &s,
            "small",
            "/v1/chat/completions",
            &chat(questions[2]),
            &[]
        )
        .cache,
        "hit"
    );
    assert_eq!(
        send(
            &s,
            "small",
            "/v1/chat/completions",
            &chat(questions[0]),
            &[]
        )
        .cache,
        "miss"
    );
    assert!(s.metric("gateway_cache_evictions_total{tenant=\"small\"}") >= 1.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn paraphrases_hit_the_semantic_cache_and_other_questions_miss() {
    let embeddings = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/all-MiniLM-L6-v2");
    let more = format!("[[embeddings]]\nname = \"all-minilm-l6-v2\"\npath = \"{embeddings}\"\n");
    let (s, dir) = start(&tenant("s", "cache = { semantic = true }"), &more);
    let q = chat("What is the capital city of France?");
    assert_eq!(send(&s, "s", "/v1/chat/completions", &q, &[]).cache, "miss");
    let near = send(
        &s,
        "s",
        "/v1/chat/completions",
        &chat("What's the capital of France?"),
        &[],
    );
    assert_eq!(near.cache, "hit");
    assert!(
        near.similarity.is_some_and(|x| x >= 0.95),
        "{:?}",
        near.similarity
    );
    for other in [
        "How do I bake sourdough bread?",
        "What is the capital city of Germany?",
    ] {
        let far = send(&s, "s", "/v1/chat/completions", &chat(other), &[]);
        assert_eq!(far.cache, "miss", "{other}");
        assert!(far.similarity.is_none());
    }
    let mut framed = chat("What is the capital city of France?");
    framed["messages"]
        .as_array_mut()
        .unwrap()
        .insert(0, json!({"role": "system", "content": "Answer in French."}));
    assert_eq!(
        send(&s, "s", "/v1/chat/completions", &framed, &[]).cache,
        "miss",
        "the same question under another system prompt"
    );
    let sem_hits = "gateway_cache_lookups_total{kind=\"semantic\",result=\"hit\",tenant=\"s\"}";
    assert_eq!(s.metric(sem_hits), 1.0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cache_key_plugins_in_rust_and_python_make_timestamps_not_matter() {
    let policies = tenant("rs", "cache_key = \"stamp\"") + &tenant("py", "cache_key = \"stamp\"");
    let (s, dir) = start(&policies, "");
    for (who, wasm) in [
        ("rs", component("strip-timestamp")),
        ("py", language_component("strip-timestamp-py")),
    ] {
        let (status, v) = admin(
            &s,
            "PUT",
            &format!("/admin/plugins/{who}/stamp?kind=cache-key"),
            std::fs::read(wasm).unwrap(),
        );
        assert!(status == 200 || status == 201, "{who}: {v}");
        let at = |ts: &str| chat(&format!("Summarise ticket 42 as of {ts}."));
        let first = send(
            &s,
            who,
            "/v1/chat/completions",
            &at("2026-12-05T04:24:11Z"),
            &[],
        );
        assert_eq!(first.cache, "miss", "{who}");
        let later = send(
            &s,
            who,
            "/v1/chat/completions",
            &at("2026-12-05T09:00:00+01:00"),
            &[],
        );
        assert_eq!(later.cache, "hit", "{who}: only the timestamp differs");
        let refused = chat("Summarise ticket 42, NOCACHE.");
        assert_eq!(
            send(&s, who, "/v1/chat/completions", &refused, &[]).cache,
            "bypass",
            "{who}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn replicas_share_hits_through_redis() {
    let Some(redis) = redis() else { return };
    let cluster = format!(
        "[cluster]\nredis = \"{}\"\nredis_timeout_ms = 1000\n",
        redis.url()
    );
    let policies = tenant("a", "");
    let (a, dir_a) = start(&policies, &cluster);
    let (b, dir_b) = start(&policies, &cluster);
    let q = chat("Name a planet.");
    let miss = send(&a, "a", "/v1/chat/completions", &q, &[]);
    assert_eq!(miss.cache, "miss");
    // A replica writes to Redis on a task after its answer has gone out, so the entry lands a
    // moment later: wait until b sees it there (asking b sooner would miss and store b's own).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let (_, held) = admin(&b, "GET", "/admin/cache?tenant=a", vec![]);
        if held["data"][0]["entries"].as_u64() == Some(1) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "a's answer never reached Redis: {held}"
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let hit = send(&b, "a", "/v1/chat/completions", &q, &[]);
    assert_eq!(hit.cache, "hit", "stored by a, served by b");
    assert_eq!(miss.body, hit.body);
    let (_, held) = admin(&b, "GET", "/admin/cache?tenant=a", vec![]);
    assert_eq!(
        (
            held["backend"].as_str(),
            held["data"][0]["entries"].as_u64()
        ),
        (Some("redis"), Some(1)),
        "{held}"
    );
    let (_, cleared) = admin(&b, "DELETE", "/admin/cache?tenant=a", vec![]);
    assert_eq!(cleared["deleted"], 1);
    assert_eq!(
        send(&a, "a", "/v1/chat/completions", &q, &[]).cache,
        "miss",
        "cleared for all"
    );
    for d in [dir_a, dir_b] {
        let _ = std::fs::remove_dir_all(d);
    }
}

#[test]
fn an_upstream_models_answers_are_cached_alike_and_charged_as_the_policy_says() {
    let engine = support::upstream::engine();
    let pool = support::upstream::pool("remote", &[&engine], "");
    let policies = tenant("a", "") + &tenant("full", "cache = { charge = \"full\" }");
    let (s, dir) = start(&policies, &pool);
    let q = json!({"model": "remote", "messages": [{"role": "user", "content": "Name a color."}],
                   "temperature": 0, "max_tokens": 8});
    let miss = send(&s, "a", "/v1/chat/completions", &q, &[]);
    assert_eq!((miss.status, miss.cache.as_str()), (200, "miss"));
    let runs = "gateway_tenant_requests_total{status=\"ok\",tenant=\"default\"}";
    let engine_runs = engine.metric(runs);
    let hit = send(&s, "a", "/v1/chat/completions", &q, &[]);
    assert_eq!((hit.cache.as_str(), &hit.body), ("hit", &miss.body));
    assert_eq!(
        engine.metric(runs),
        engine_runs,
        "a hit never reaches the upstream"
    );

    // `charge = "full"`: a hit costs the tokens of the answer it repeats, in the ledger too.
    assert_eq!(
        send(&s, "full", "/v1/chat/completions", &q, &[]).cache,
        "miss"
    );
    assert_eq!(
        send(&s, "full", "/v1/chat/completions", &q, &[]).cache,
        "hit"
    );
    admin(&s, "GET", "/admin/usage?tenant=full", vec![]);
    let conn = rusqlite::Connection::open(dir.join("usage.sqlite")).unwrap();
    let rows: Vec<(String, i64)> = conn
        .prepare(
            "SELECT status, prompt_tokens + completion_tokens FROM requests \
             WHERE tenant = 'full' ORDER BY ts, status DESC",
        )
        .unwrap()
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
        .unwrap()
        .map(Result::unwrap)
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    let ok = rows.iter().find(|r| r.0 == "ok").expect("the miss");
    let cached = rows.iter().find(|r| r.0 == "cached").expect("the hit");
    assert!(ok.1 > 0);
    assert_eq!(cached.1, ok.1, "the hit costs what the answer cost");
    let _ = std::fs::remove_dir_all(&dir);
}
