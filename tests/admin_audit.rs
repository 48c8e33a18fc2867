//! The admin API's accounts and audit log, end to end over HTTP: the shared token and named
//! accounts with roles (a viewer reads; the server refuses its writes), a tenant key cannot
//! reach it, and every change (policy, plugin, cache) is in `GET /admin/audit` with who made it
//! and what changed.

mod support;

use serde_json::{json, Value};
use support::wasm::component;
use support::{key_sha256, model_path, Server, MODEL};

const TOKEN: &str = "admin-token-for-tests-0123";
const ALICE: &str = "alice-admin-token-0123456789";
const BOB: &str = "bob-viewer-token-0123456789";

fn policy(extra: &str) -> String {
    format!(
        "[[tenants]]\nname = \"acme\"\nkeys = [{{ id = \"k\", sha256 = \"{}\" }}]\n{extra}\n",
        key_sha256("sk-acme")
    )
}

fn start() -> (Server, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!(
        "gateway-audit-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("policies.toml"), policy("")).unwrap();
    let config = format!(
        "admin_token = \"{TOKEN}\"\npolicies = \"{d}/policies.toml\"\nledger = \"{d}/usage.sqlite\"\n\
         collections_dir = \"{d}/collections\"\n\
         [[models]]\nname = \"{MODEL}\"\npath = \"{m}\"\n\
         [[embeddings]]\nname = \"all-minilm-l6-v2\"\npath = \"{e}\"\n\
         [[admin.accounts]]\nname = \"alice\"\nrole = \"admin\"\ntoken_sha256 = \"{alice}\"\n\
         [[admin.accounts]]\nname = \"bob\"\nrole = \"viewer\"\ntoken_sha256 = \"{bob}\"\n",
        d = dir.display(),
        m = model_path(),
        e = concat!(env!("CARGO_MANIFEST_DIR"), "/../models/all-MiniLM-L6-v2"),
        alice = key_sha256(ALICE),
        bob = key_sha256(BOB),
    );
    std::fs::write(dir.join("gateway.toml"), config).unwrap();
    let path = dir.join("gateway.toml");
    (Server::start(&["--config", path.to_str().unwrap()]), dir)
}

fn audit(s: &Server, who: &str, query: &str) -> Vec<Value> {
    let (status, v) = s.request("GET", &format!("/admin/audit{query}"), vec![], Some(who));
    assert_eq!(status, 200, "{v}");
    v["data"].as_array().unwrap().clone()
}

#[test]
fn accounts_have_roles_and_every_change_is_audited() {
    let (s, dir) = start();
    // Who may call: the shared token and both accounts read; a tenant key and no key cannot.
    for who in [TOKEN, ALICE, BOB] {
        assert_eq!(
            s.request("GET", "/admin/policies", vec![], Some(who)).0,
            200
        );
    }
    for who in [Some("sk-acme"), Some("wrong"), None] {
        let (status, v) = s.request("GET", "/admin/policies", vec![], who);
        assert_eq!(status, 401, "{who:?}: {v}");
    }

    // A viewer's writes are refused by the server, and change nothing.
    let changed = policy("requests_per_minute = 60");
    let (status, v) = s.request(
        "PUT",
        "/admin/policies",
        changed.clone().into_bytes(),
        Some(BOB),
    );
    assert_eq!(status, 403, "{v}");
    assert_eq!(v["error"]["code"], "not_allowed");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("viewer"),
        "{v}"
    );
    let (status, _) = s.request("DELETE", "/admin/cache?tenant=acme", vec![], Some(BOB));
    assert_eq!(status, 403);
    let wasm = std::fs::read(component("noop")).unwrap();
    let put = "/admin/plugins/acme/noop?kind=reranker";
    assert_eq!(s.request("PUT", put, wasm.clone(), Some(BOB)).0, 403);
    assert!(audit(&s, TOKEN, "").is_empty(), "nothing was changed");

    // An admin's changes are applied and audited: who, what, and what changed.
    let (status, v) = s.request("PUT", "/admin/policies", changed.into_bytes(), Some(ALICE));
    assert_eq!(status, 200, "{v}");
    let (status, plugin) = s.request("PUT", put, wasm, Some(ALICE));
    assert!(status == 200 || status == 201, "{plugin}");
    let (status, _) = s.request("DELETE", "/admin/cache?tenant=acme", vec![], Some(TOKEN));
    assert_eq!(status, 200);
    let log = audit(&s, BOB, "");
    let actions: Vec<(&str, &str)> = log
        .iter()
        .map(|e| (e["actor"].as_str().unwrap(), e["action"].as_str().unwrap()))
        .collect();
    assert_eq!(
        actions,
        [
            ("admin_token", "cache.clear"),
            ("alice", "plugin.put"),
            ("alice", "policy.replace")
        ]
    );
    assert_eq!(
        log[2]["detail"]["added"],
        json!(["requests_per_minute = 60"])
    );
    assert_eq!(log[1]["detail"]["sha256"], plugin["sha256"]);
    assert_eq!(log[1]["target"], "acme/noop");
    assert!(log[0]["ts"].as_i64().unwrap() > 1_700_000_000);

    // Filters and paging.
    assert_eq!(audit(&s, TOKEN, "?actor=alice").len(), 2);
    assert_eq!(audit(&s, TOKEN, "?action=plugin.put").len(), 1);
    let page = audit(&s, TOKEN, "?limit=1");
    assert_eq!(page[0]["action"], "cache.clear");
    let before = page[0]["id"].as_i64().unwrap();
    assert_eq!(
        audit(&s, TOKEN, &format!("?limit=1&before={before}"))[0]["action"],
        "plugin.put"
    );
    assert_eq!(
        s.request("GET", "/admin/audit?limit=0", vec![], Some(TOKEN))
            .0,
        400
    );
    assert_eq!(
        s.request("GET", "/admin/audit?color=red", vec![], Some(TOKEN))
            .0,
        400
    );

    // Policy history: each version applied through the API, compared and applied again.
    let second = policy("requests_per_minute = 120");
    let (status, v) = s.request("PUT", "/admin/policies", second.into_bytes(), Some(TOKEN));
    assert_eq!(status, 200, "{v}");
    let (_, versions) = s.request("GET", "/admin/policies/versions", vec![], Some(BOB));
    let versions = versions["data"].as_array().unwrap().clone();
    let actors: Vec<&str> = versions
        .iter()
        .map(|v| v["actor"].as_str().unwrap())
        .collect();
    assert_eq!(actors, ["admin_token", "alice"]);
    let first = versions[1]["id"].as_i64().unwrap();
    let diff_path = format!("/admin/policies/versions/{first}/diff");
    let (status, diff) = s.request("GET", &diff_path, vec![], Some(BOB));
    assert_eq!(status, 200, "{diff}");
    let lines =
        json!({"removed": ["requests_per_minute = 60"], "added": ["requests_per_minute = 120"]});
    assert_eq!(diff, lines, "from the first version to the policy in force");
    let apply = format!("/admin/policies/versions/{first}/apply");
    assert_eq!(
        s.request("POST", &apply, vec![], Some(BOB)).0,
        403,
        "a viewer cannot"
    );
    let (status, v) = s.request("POST", &apply, vec![], Some(ALICE));
    assert_eq!(status, 200, "{v}");
    let (_, diff) = s.request("GET", &diff_path, vec![], Some(TOKEN));
    assert_eq!(
        diff,
        json!({"removed": [], "added": []}),
        "the first version is in force again"
    );
    let last = &audit(&s, TOKEN, "?limit=1")[0];
    assert_eq!(last["actor"], "alice");
    assert_eq!(last["detail"]["reapplied"], first);
    let missing = s.request("GET", "/admin/policies/versions/999", vec![], Some(TOKEN));
    assert_eq!(missing.0, 404);
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn keys_are_made_shown_once_expired_and_revoked_through_the_admin_api() {
    let (s, dir) = start();
    let keys = "/admin/tenants/acme/keys";
    let (status, made) = s.request("POST", keys, br#"{"id": "crm-prod"}"#.to_vec(), Some(ALICE));
    assert_eq!(status, 201, "{made}");
    let key = made["key"].as_str().unwrap().to_string();
    assert_eq!(made["sha256"], key_sha256(&key));
    let models = |k: &str| s.request("GET", "/v1/models", vec![], Some(k)).0;
    assert_eq!(models(&key), 200, "the new key works at once");
    // Only its hash is kept: the listing and the policy never show the key.
    let (_, listed) = s.request("GET", keys, vec![], Some(BOB));
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["k", "crm-prod"]);
    let (_, text) = s.request("GET", "/admin/policies", vec![], Some(TOKEN));
    assert!(!listed.to_string().contains(&key) && !text.to_string().contains(&key));
    let (status, _) = s.request("POST", keys, br#"{"id": "crm-prod"}"#.to_vec(), Some(ALICE));
    assert_eq!(status, 400, "ids are unique");
    assert_eq!(
        s.request("POST", keys, br#"{"id": "x"}"#.to_vec(), Some(BOB))
            .0,
        403
    );

    // An expiry in the past refuses the key; clearing it lets it in again.
    let one = format!("{keys}/crm-prod");
    let (status, v) = s.request(
        "PUT",
        &one,
        br#"{"expires_at": 1000}"#.to_vec(),
        Some(ALICE),
    );
    assert_eq!(status, 200, "{v}");
    let (status, v) = s.request("GET", "/v1/models", vec![], Some(&key));
    assert_eq!(status, 401);
    assert!(
        v["error"]["message"].as_str().unwrap().contains("expired"),
        "{v}"
    );
    let (status, _) = s.request(
        "PUT",
        &one,
        br#"{"expires_at": null}"#.to_vec(),
        Some(ALICE),
    );
    assert_eq!(status, 200);
    assert_eq!(models(&key), 200);

    // Revoked: refused from the next request on (the policy is in force when DELETE answers).
    let (status, v) = s.request("DELETE", &one, vec![], Some(TOKEN));
    assert_eq!(status, 200, "{v}");
    assert_eq!(models(&key), 401);
    assert_eq!(models("sk-acme"), 200, "the tenant's other key stays");
    assert_eq!(s.request("DELETE", &one, vec![], Some(TOKEN)).0, 404);
    let log = audit(&s, TOKEN, "?actor=alice");
    let actions: Vec<&str> = log.iter().map(|e| e["action"].as_str().unwrap()).collect();
    assert!(
        actions.contains(&"key.create") && actions.contains(&"key.expiry"),
        "{actions:?}"
    );
    assert_eq!(
        audit(&s, TOKEN, "?action=key.revoke")[0]["target"],
        "acme/crm-prod"
    );
    assert!(
        !log.iter().any(|e| e.to_string().contains(&key)),
        "the key is never logged"
    );
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn usage_exports_as_csv_and_collections_show_their_size() {
    let (s, dir) = start();
    let chat = json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                      "max_tokens": 2, "temperature": 0});
    assert_eq!(s.post_as("sk-acme", "/v1/chat/completions", &chat).0, 200);
    let r = support::patient_client()
        .get(format!("{}/admin/usage?format=csv&group_by=model", s.base))
        .bearer_auth(BOB)
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/csv"));
    let text = r.text().unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(
        lines[0],
        "tenant,model,requests,prompt_tokens,completion_tokens,total_tokens,failed_requests,cached_requests,mean_latency_ms,plugin_ms"
    );
    assert!(lines[1].starts_with(&format!("acme,{MODEL},1,")), "{text}");

    let (status, v) = s.post_as("sk-acme", "/v1/collections", &json!({"name": "kb"}));
    assert!(status == 200 || status == 201, "{v}");
    let docs = json!({"documents": [{"id": "a", "text": "Refunds take five days."},
                                    {"id": "b", "text": "Renewals are yearly."}]});
    let (status, v) = s.post_as("sk-acme", "/v1/collections/kb/documents", &docs);
    assert_eq!(status, 200, "{v}");
    let (status, listed) = s.request("GET", "/admin/collections", vec![], Some(BOB));
    assert_eq!(status, 200, "{listed}");
    let kb = &listed["data"][0];
    assert_eq!(
        (kb["tenant"].as_str(), kb["name"].as_str()),
        (Some("acme"), Some("kb"))
    );
    assert_eq!(
        (kb["documents"].as_u64(), kb["chunks"].as_u64()),
        (Some(2), Some(2))
    );
    assert!(kb["bytes"].as_u64().unwrap() > 1000, "{listed}");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn an_edit_of_the_policy_file_is_kept_and_audited_as_made_by_file() {
    let (s, dir) = start();
    std::fs::write(dir.join("policies.toml"), policy("max_concurrent = 4")).unwrap();
    support::wait_for(
        "the file's edit in the audit log",
        std::time::Duration::from_secs(10),
        || !audit(&s, BOB, "?actor=file").is_empty(),
    );
    let change = &audit(&s, BOB, "?actor=file")[0];
    assert_eq!(change["action"], "policy.replace");
    assert_eq!(change["detail"]["added"], json!(["max_concurrent = 4"]));
    let (_, versions) = s.request("GET", "/admin/policies/versions", vec![], Some(BOB));
    assert_eq!(versions["data"][0]["actor"], "file");
    // A replace through the API writes the file too: it is recorded once, by its maker.
    let (status, _) = s.request(
        "PUT",
        "/admin/policies",
        policy("").into_bytes(),
        Some(ALICE),
    );
    assert_eq!(status, 200);
    std::thread::sleep(std::time::Duration::from_millis(300));
    assert_eq!(audit(&s, BOB, "?actor=file").len(), 1);
    assert_eq!(audit(&s, BOB, "?actor=alice").len(), 1);
    let _ = std::fs::remove_dir_all(dir);
}
