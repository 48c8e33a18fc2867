//! Gateway replicas sharing one PostgreSQL (Debian's `postgresql`, started here on a loopback
//! port in a temporary folder): one usage ledger for all, spooled and replayed when the
//! database is away; plugin uploads, deletes and policy replacements through one replica
//! reach the others; collections written through one replica are searchable on the others; a
//! token budget whose Redis count is lost is reconciled from the ledger.

mod support;

use std::time::Duration;

use serde_json::{json, Value};
use support::collections::{ids, kb, EMBED};
use support::postgres::Postgres;
use support::redis::redis;
use support::wasm::component;
use support::{key_sha256, model_path, rerank_order, wait_for, Server, MODEL};

const KEY: &str = "acme-pg-key";
const ADMIN: &str = "pg-admin-token-of-the-test";

fn policy(key: &str, limits: &str) -> String {
    format!(
        "[[tenants]]\nname = \"acme\"\nkeys = [{{ id = \"k\", sha256 = \"{}\" }}]\n{limits}\n",
        key_sha256(key)
    )
}

/// A replica of the default model sharing `cluster` (TOML lines under `[cluster]`).
fn replica(cluster: &str, limits: &str) -> Server {
    replica_with(cluster, limits, "embeddings = []")
}

/// `replica`, with the embedding model collections need.
fn search_replica(cluster: &str) -> Server {
    let embeddings = format!(
        "embeddings = [{{ name = \"{EMBED}\", path = \"{}/../models/all-MiniLM-L6-v2\" }}]",
        env!("CARGO_MANIFEST_DIR")
    );
    replica_with(cluster, "", &embeddings)
}

fn replica_with(cluster: &str, limits: &str, embeddings: &str) -> Server {
    let dir = std::env::temp_dir().join(format!(
        "gateway-pg-replica-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("policies.toml"), policy(KEY, limits)).unwrap();
    let config = format!(
        "{embeddings}\nadmin_token = \"{ADMIN}\"\npolicies = \"{d}/policies.toml\"\n\
         ledger = \"{d}/usage.sqlite\"\ncollections_dir = \"{d}/collections\"\n\
         [[models]]\nname = \"{MODEL}\"\npath = \"{}\"\n[models.engine]\nthreads = 1\n\
         [cluster]\n{cluster}\n",
        model_path(),
        d = dir.display()
    );
    let path = dir.join("gateway.toml");
    std::fs::write(&path, config).unwrap();
    Server::start(&["--config", path.to_str().unwrap()]).remove_on_drop(&dir)
}

fn complete(s: &Server, max_tokens: u32) -> (u16, Value) {
    let body = json!({"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens,
                      "temperature": 0, "ignore_eos": true});
    s.post_as(KEY, "/v1/completions", &body)
}

fn admin(s: &Server, method: &str, path: &str, body: Vec<u8>) -> (u16, Value) {
    s.request(method, path, body, Some(ADMIN))
}

/// Requests the ledger holds for tenant `acme`, as `/admin/usage` on `s` reports them.
fn usage_requests(s: &Server) -> i64 {
    let (st, body) = admin(s, "GET", "/admin/usage?tenant=acme&group_by=model", vec![]);
    assert_eq!(st, 200, "{body}");
    body["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["requests"].as_i64().unwrap())
        .sum()
}

#[test]
fn both_replicas_share_one_ledger_which_spools_while_postgres_is_away() {
    let Some(mut pg) = Postgres::start() else {
        return;
    };
    let cluster = format!("postgres = \"{}\"", pg.url());
    let a = replica(&cluster, "");
    let b = replica(&cluster, "");
    assert_eq!(complete(&a, 4).0, 200);
    assert_eq!(complete(&b, 4).0, 200);
    // B's row is committed by B's writer within its batch interval; A reports it.
    wait_for("B's request in A's usage", Duration::from_secs(10), || {
        usage_requests(&a) == 2
    });

    // The database goes away: requests are still served and billed to the local spool, and a
    // plugin upload (which must reach every replica) is refused rather than made locally.
    pg.stop();
    for _ in 0..3 {
        let (st, body) = complete(&a, 4);
        assert_eq!(st, 200, "{body}");
    }
    a.wait_until("gateway_ledger_spilled_rows", |v| v >= 3.0, ">= 3");
    let wasm = std::fs::read(component("crm-field-reranker")).unwrap();
    let (st, body) = admin(&a, "PUT", "/admin/plugins/acme/ranker?kind=reranker", wasm);
    assert_eq!(st, 503, "{body}");
    assert_eq!(body["error"]["code"], "store_unavailable");
    assert_eq!(
        admin(&a, "GET", "/admin/plugins", vec![]).1["data"],
        json!([])
    );

    // Back: the spool is replayed, every row once.
    pg.resume();
    a.wait_until("gateway_ledger_spilled_rows", |v| v == 0.0, "= 0");
    let row = pg
        .client()
        .query_one(
            "SELECT count(*), count(DISTINCT rid) FROM gateway_requests",
            &[],
        )
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (5, 5));
    assert_eq!(usage_requests(&b), 5);
}

/// The order the tenant's reranker `model` gives three documents through `s`.
fn rerank(s: &Server, model: &str) -> Result<Vec<u64>, u16> {
    let req = json!({"model": model, "query": "export invoices",
                     "documents": ["export invoices", "reset", "export contacts"]});
    let (st, body) = s.post_as(KEY, "/v1/rerank", &req);
    if st != 200 {
        return Err(st);
    }
    Ok(rerank_order(&body))
}

#[test]
fn plugins_and_policies_changed_through_one_replica_reach_the_others() {
    let Some(pg) = Postgres::start() else { return };
    let cluster = format!("postgres = \"{}\"", pg.url());
    let a = replica(&cluster, "");
    let b = replica(&cluster, "");
    let wasm = std::fs::read(component("crm-field-reranker")).unwrap();

    let (st, body) = admin(&a, "PUT", "/admin/plugins/acme/ranker?kind=reranker", wasm);
    assert_eq!(st, 201, "{body}");
    let took = wait_for("the upload served on B", Duration::from_secs(10), || {
        rerank(&b, "ranker").is_ok()
    });
    println!("plugin uploaded through A served on B after {took:?}");
    assert_eq!(rerank(&b, "ranker").unwrap(), [0, 2, 1]);
    // A bad upload is refused where it is made and reaches nobody.
    let (st, _) = admin(&a, "PUT", "/admin/plugins/acme/ranker", b"garbage".to_vec());
    assert_eq!(st, 400);
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(rerank(&b, "ranker").unwrap(), [0, 2, 1]);

    // Deleted through B: gone on A.
    let (st, body) = admin(&b, "DELETE", "/admin/plugins/acme/ranker", vec![]);
    assert_eq!(st, 200, "{body}");
    wait_for("the delete on A", Duration::from_secs(10), || {
        rerank(&a, "ranker").is_err()
    });

    // A policy replaced through A revokes the key on B.
    assert_eq!(b.request("GET", "/v1/models", vec![], Some(KEY)).0, 200);
    let (st, body) = admin(
        &a,
        "PUT",
        "/admin/policies",
        policy("a-new-key", "").into_bytes(),
    );
    assert_eq!(st, 200, "{body}");
    let took = wait_for("the key revoked on B", Duration::from_secs(10), || {
        b.request("GET", "/v1/models", vec![], Some(KEY)).0 == 401
    });
    println!("policy replaced through A in force on B after {took:?}");
    assert_eq!(
        b.request("GET", "/v1/models", vec![], Some("a-new-key")).0,
        200
    );
    // A replica started later begins with the shared policy, not its own file's.
    let c = replica(&cluster, "");
    assert_eq!(c.request("GET", "/v1/models", vec![], Some(KEY)).0, 401);
    assert_eq!(
        c.request("GET", "/v1/models", vec![], Some("a-new-key")).0,
        200
    );
}

#[test]
fn a_budget_count_redis_lost_is_restored_from_the_shared_ledger() {
    let Some(pg) = Postgres::start() else { return };
    let Some(redis) = redis() else { return };
    let cluster = format!("postgres = \"{}\"\nredis = \"{}\"", pg.url(), redis.url());
    let limits = "token_budget = { tokens = 300, period = \"day\" }";
    let a = replica(&cluster, limits);
    // Two requests of ~105 tokens each (prompt + 100).
    for _ in 0..2 {
        let (st, body) = complete(&a, 100);
        assert_eq!(st, 200, "{body}");
    }
    wait_for("both rows in the ledger", Duration::from_secs(10), || {
        usage_requests(&a) == 2
    });
    // Redis loses everything (a restart without persistence, a failover).
    let mut con = redis::Client::open(redis.url())
        .unwrap()
        .get_connection()
        .unwrap();
    redis::cmd("FLUSHALL").exec(&mut con).unwrap();
    // Counting from zero would admit a third; counting from the ledger refuses it.
    let (st, body) = complete(&a, 100);
    assert_eq!(st, 429, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("budget"),
        "{body}"
    );
}

#[test]
fn collections_written_through_one_replica_are_searchable_on_the_others() {
    let Some(mut pg) = Postgres::start() else {
        return;
    };
    let cluster = format!("postgres = \"{}\"", pg.url());
    let (a, b) = (search_replica(&cluster), search_replica(&cluster));
    let search = |s: &Server, query: &str| {
        let body = json!({"query": query, "mode": "hybrid", "top_k": 1});
        let (st, body) = s.post_as(KEY, "/v1/collections/kb/search", &body);
        (st, ids(&body))
    };
    let (st, body) = a.post_as(KEY, "/v1/collections", &json!({"name": "kb"}));
    assert_eq!(st, 201, "{body}");
    // The name is taken on every replica.
    let took = wait_for("the collection on B", Duration::from_secs(10), || {
        b.post_as(KEY, "/v1/collections", &json!({"name": "kb"})).0 == 409
    });
    println!("collection created through A exists on B after {took:?}");
    let (st, body) = a.post_as(KEY, "/v1/collections/kb/documents", &kb());
    assert_eq!(st, 200, "{body}");
    // Read-your-writes on A; B converges.
    assert_eq!(search(&a, "export invoices as CSV").1, ["invoice-export"]);
    let took = wait_for("the documents on B", Duration::from_secs(10), || {
        search(&b, "export invoices as CSV").1 == ["invoice-export"]
    });
    println!("documents upserted through A searchable on B after {took:?}");
    // A delete through B reaches A.
    let (st, body) = b.post_as(
        KEY,
        "/v1/collections/kb/documents/delete",
        &json!({"ids": ["invoice-export"]}),
    );
    assert_eq!(st, 200, "{body}");
    wait_for("the delete on A", Duration::from_secs(10), || {
        search(&a, "export invoices as CSV").1 != ["invoice-export"]
    });
    // A replica started later builds its indexes from PostgreSQL.
    let c = search_replica(&cluster);
    assert_eq!(
        search(&c, "reset a forgotten password").1,
        ["password-reset"]
    );
    // PostgreSQL away: a write is refused, not made on one replica only; searches go on.
    pg.stop();
    let (st, body) = a.post_as(KEY, "/v1/collections/kb/documents", &kb());
    assert_eq!(st, 503, "{body}");
    assert_eq!(body["error"]["code"], "store_unavailable");
    assert_eq!(
        search(&b, "reset a forgotten password").1,
        ["password-reset"]
    );
    pg.resume();
    // The collection deleted through C (after the restart) is gone on A and B, and the name
    // can be taken again.
    let (st, body) = c.request("DELETE", "/v1/collections/kb", vec![], Some(KEY));
    assert_eq!(st, 200, "{body}");
    wait_for("the collection gone on B", Duration::from_secs(10), || {
        search(&b, "reset").0 == 404
    });
    let (st, body) = b.post_as(KEY, "/v1/collections", &json!({"name": "kb"}));
    assert_eq!(st, 201, "{body}");
    wait_for(
        "the new collection, empty, on A",
        Duration::from_secs(10),
        || {
            let (st, hits) = search(&a, "reset a forgotten password");
            st == 200 && hits.is_empty()
        },
    );
}

#[test]
fn postgres_over_tls_is_verified() {
    let Some((pg, ca)) = Postgres::start_tls() else {
        return;
    };
    let url = format!("{}?sslmode=require&sslrootcert={}", pg.url(), ca.display());
    let a = replica(&format!("postgres = \"{url}\""), "");
    assert_eq!(complete(&a, 4).0, 200);
    wait_for("the row, over TLS", Duration::from_secs(10), || {
        usage_requests(&a) == 1
    });
    let row = pg
        .client()
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a \
             JOIN pg_stat_ssl s USING (pid) WHERE a.application_name = 'gateway'",
            &[],
        )
        .unwrap();
    let (all, tls): (i64, i64) = (row.get(0), row.get(1));
    assert!(all >= 2, "{all} gateway connections");
    assert_eq!(tls, all, "every gateway connection uses TLS");
    // Without the CA the server's certificate is not trusted: nothing is stored there.
    let plain = pg.url() + "?sslmode=require";
    let b = replica(&format!("postgres = \"{plain}\""), "");
    assert_eq!(complete(&b, 4).0, 200);
    b.wait_until("gateway_ledger_spilled_rows", |v| v >= 1.0, ">= 1");
    // Nor a response: storing it is refused, and saying so is the answer.
    let body = json!({"model": MODEL, "input": "Hi", "max_output_tokens": 2});
    let (st, e) = b.post_as(KEY, "/v1/responses", &body);
    assert_eq!(
        (st, e["error"]["code"].as_str()),
        (503, Some("store_unavailable")),
        "{e}"
    );
}

#[test]
fn a_conversation_started_on_one_replica_continues_on_another() {
    let Some(pg) = Postgres::start() else {
        return;
    };
    let cluster = format!("postgres = \"{}\"", pg.url());
    let (mut a, b) = (replica(&cluster, ""), replica(&cluster, ""));
    let turn = |s: &Server, input: &str, previous: Option<&Value>| {
        let mut body = json!({"model": MODEL, "input": input, "max_output_tokens": 8,
                              "temperature": 0});
        if let Some(p) = previous {
            body["previous_response_id"] = p["id"].clone();
        }
        let (st, r) = s.post_as(KEY, "/v1/responses", &body);
        assert_eq!(st, 200, "{r}");
        r
    };
    let first = turn(&a, "My name is Ada.", None);
    let second = turn(&b, "What is my name?", Some(&first));
    assert_eq!(second["previous_response_id"], first["id"]);
    let (earlier, later) = (
        &first["usage"]["input_tokens"],
        &second["usage"]["input_tokens"],
    );
    assert!(
        later.as_u64() > earlier.as_u64(),
        "B continued A's conversation: {earlier} then {later} input tokens"
    );
    let path = format!("/v1/responses/{}", first["id"].as_str().unwrap());
    let (st, got) = b.request("GET", &path, Vec::new(), Some(KEY));
    assert_eq!((st, &got), (200, &first));
    let (st, items) = b.request("GET", &format!("{path}/input_items"), Vec::new(), Some(KEY));
    assert_eq!(st, 200, "{items}");
    assert_eq!(items["data"][0]["content"][0]["text"], "My name is Ada.");
    let (st, _) = a.request("DELETE", &path, Vec::new(), Some(KEY));
    assert_eq!(st, 200);
    let (st, _) = b.request("GET", &path, Vec::new(), Some(KEY));
    assert_eq!(st, 404, "deleted on A, gone on B");
    // The store's connection closes cleanly with the server.
    assert_eq!(a.terminate(), Some(0));
}

#[test]
fn one_audit_log_holds_every_replicas_changes() {
    let Some(pg) = Postgres::start() else { return };
    let cluster = format!("postgres = \"{}\"", pg.url());
    let a = replica(&cluster, "");
    let b = replica(&cluster, "");
    let (st, body) = admin(&a, "DELETE", "/admin/cache?tenant=acme", vec![]);
    assert_eq!(st, 200, "{body}");
    let (st, body) = admin(
        &b,
        "PUT",
        "/admin/policies",
        policy(KEY, "requests_per_minute = 600").into_bytes(),
    );
    assert_eq!(st, 200, "{body}");
    let (st, log) = admin(&a, "GET", "/admin/audit", vec![]);
    assert_eq!(st, 200, "{log}");
    let actions: Vec<&str> = log["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["action"].as_str().unwrap())
        .collect();
    assert_eq!(
        actions,
        ["policy.replace", "cache.clear"],
        "B's change is in A's log"
    );
    let (_, versions) = admin(&a, "GET", "/admin/policies/versions", vec![]);
    let id = versions["data"][0]["id"].as_i64().unwrap();
    let diff = format!("/admin/policies/versions/{id}/diff");
    wait_for("B's version in force on A", Duration::from_secs(10), || {
        admin(&a, "GET", &diff, vec![]).1 == json!({"removed": [], "added": []})
    });
    assert_eq!(
        log["data"][0]["detail"]["added"],
        json!(["requests_per_minute = 600"])
    );
}
