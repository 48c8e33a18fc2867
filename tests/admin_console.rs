//! The admin console, end to end over HTTP: its pages (embedded, strict CSP, only on a listener
//! with admin rights), sign-in sessions (cookie flags, CSRF on writes, roles, sign-out), the
//! endpoints behind its screens (overview, tenants with a dry run, plugin stats and rollback),
//! and the whole console driven in a real browser (headless Chromium through Playwright).

mod support;

use serde_json::{json, Value};
use support::wasm::component;
use support::{key_sha256, model_path, Server, MODEL};

const TOKEN: &str = "console-admin-token-0123456789";
const VIEWER: &str = "console-viewer-token-0123456789";

struct Gateway {
    server: Server,
    /// Where `/admin/*` is served (a listener of its own).
    admin: String,
    dir: std::path::PathBuf,
}

fn start() -> Gateway {
    start_with("[admin]\nlisten = \"127.0.0.1:0\"\n")
}

/// A gateway whose config ends with `admin` (its `[admin]` table, or nothing: then one listener
/// serves the API and `/admin/*`).
fn start_with(admin: &str) -> Gateway {
    let dir = std::env::temp_dir().join(format!(
        "gateway-console-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(dir.join("plugins")).unwrap();
    let policy = format!(
        "# tenants\n[[tenants]]\nname = \"acme\"\nkeys = [{{ id = \"k\", sha256 = \"{}\" }}]\n",
        key_sha256("sk-acme")
    );
    std::fs::write(dir.join("policies.toml"), policy).unwrap();
    let config = format!(
        "admin_token = \"{TOKEN}\"\npolicies = \"{d}/policies.toml\"\nledger = \"{d}/usage.sqlite\"\n\
         collections_dir = \"{d}/collections\"\n\
         [plugins]\ndir = \"{d}/plugins\"\n{admin}\
         [[admin.accounts]]\nname = \"vera\"\nrole = \"viewer\"\ntoken_sha256 = \"{v}\"\n\
         [[models]]\nname = \"{MODEL}\"\npath = \"{m}\"\n",
        d = dir.display(),
        m = model_path(),
        v = key_sha256(VIEWER),
    );
    std::fs::write(dir.join("gateway.toml"), config).unwrap();
    let path = dir.join("gateway.toml");
    let server = Server::start(&["--config", path.to_str().unwrap()]);
    let admin = match admin.is_empty() {
        true => server.base.clone(),
        false => format!(
            "http://{}",
            server.logged_addr("serving the admin API addr=")
        ),
    };
    Gateway { server, admin, dir }
}

fn client() -> reqwest::blocking::Client {
    support::patient_client()
}

/// Signs in with `token`: the session cookie (`name=value`), the CSRF token, the response.
fn sign_in(g: &Gateway, token: &str) -> (String, String, reqwest::header::HeaderMap) {
    let r = client()
        .post(format!("{}/admin/session", g.admin))
        .json(&json!({"token": token}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let headers = r.headers().clone();
    let set = headers["set-cookie"].to_str().unwrap().to_string();
    let cookie = set.split(';').next().unwrap().to_string();
    let v: Value = r.json().unwrap();
    (
        cookie,
        v["csrf_token"].as_str().unwrap().to_string(),
        headers,
    )
}

/// A request with a session cookie (and a CSRF token, when given).
fn with_session(
    g: &Gateway,
    method: &str,
    path: &str,
    cookie: &str,
    csrf: Option<&str>,
    body: Option<Value>,
) -> (u16, Value) {
    let mut r = client()
        .request(method.parse().unwrap(), format!("{}{path}", g.admin))
        .header("cookie", cookie);
    if let Some(t) = csrf {
        r = r.header("x-csrf-token", t);
    }
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

/// A request with the admin token as a bearer.
fn admin(g: &Gateway, method: &str, path: &str, body: Option<Vec<u8>>) -> (u16, Value) {
    let mut r = client()
        .request(method.parse().unwrap(), format!("{}{path}", g.admin))
        .bearer_auth(TOKEN);
    if let Some(b) = body {
        r = r.body(b);
    }
    let r = r.send().unwrap();
    let status = r.status().as_u16();
    (status, r.json().unwrap_or(Value::Null))
}

#[test]
fn pages_are_served_only_where_admins_are_with_a_strict_policy() {
    let g = start();
    let r = client()
        .get(format!("{}/admin/ui", g.admin))
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let csp = r.headers()["content-security-policy"].to_str().unwrap();
    assert!(csp.contains("script-src 'self'") && csp.contains("frame-ancestors 'none'"));
    assert!(!csp.contains("unsafe-inline"), "{csp}");
    assert_eq!(r.headers()["x-content-type-options"], "nosniff");
    let etag = r.headers()["etag"].to_str().unwrap().to_string();
    let page = r.text().unwrap();
    assert!(page.contains("/admin/ui/app.js"), "{page}");
    // Every file the page names is served, and revalidates by its ETag.
    for f in [
        "app.js",
        "tenants.js",
        "views.js",
        "app.css",
        "vendor/uPlot.iife.min.js",
        "vendor/uPlot.min.css",
    ] {
        let r = client()
            .get(format!("{}/admin/ui/{f}", g.admin))
            .send()
            .unwrap();
        assert_eq!(r.status(), 200, "{f}");
    }
    let again = client()
        .get(format!("{}/admin/ui", g.admin))
        .header("if-none-match", &etag)
        .send()
        .unwrap();
    assert_eq!(again.status(), 304);
    // Not on the API listener, not a file outside the console, not for a tenant's key.
    let r = client()
        .get(format!("{}/admin/ui", g.server.base))
        .send()
        .unwrap();
    assert_eq!(r.status(), 404);
    for path in ["/admin/uinope", "/admin/ui/nope.js"] {
        let r = client().get(format!("{}{path}", g.admin)).send().unwrap();
        assert_eq!(r.status(), 404, "{path}");
    }
    let r = client()
        .post(format!("{}/admin/session", g.admin))
        .json(&json!({"token": "sk-acme"}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 401);
    let r = client()
        .get(format!("{}/admin/overview", g.admin))
        .bearer_auth("sk-acme")
        .send()
        .unwrap();
    assert_eq!(r.status(), 401);
    std::fs::remove_dir_all(&g.dir).ok();
}

#[test]
fn sessions_need_csrf_for_writes_keep_roles_and_end() {
    let g = start();
    let (cookie, csrf, headers) = sign_in(&g, TOKEN);
    let set = headers["set-cookie"].to_str().unwrap();
    for flag in ["HttpOnly", "SameSite=Strict", "Path=/admin"] {
        assert!(set.contains(flag), "{set}");
    }
    // Plain HTTP: a `Secure` cookie would never be sent back.
    assert!(!set.contains("Secure"), "{set}");
    let (status, me) = with_session(&g, "GET", "/admin/session", &cookie, None, None);
    assert_eq!((status, me["role"].as_str()), (200, Some("admin")));
    assert_eq!(me["csrf_token"], csrf.as_str());
    let (status, _) = with_session(&g, "GET", "/admin/tenants", &cookie, None, None);
    assert_eq!(status, 200);

    // A write without the CSRF token (or with another) is refused and changes nothing.
    let body = json!({"models": ["*"], "weight": 2});
    for bad in [None, Some("0000")] {
        let (status, v) = with_session(
            &g,
            "PUT",
            "/admin/tenants/t2",
            &cookie,
            bad,
            Some(body.clone()),
        );
        assert_eq!(
            (status, v["error"]["code"].as_str()),
            (403, Some("csrf_failed")),
            "{v}"
        );
    }
    assert_eq!(admin(&g, "GET", "/admin/tenants/t2", None).0, 404);
    let (status, v) = with_session(
        &g,
        "PUT",
        "/admin/tenants/t2",
        &cookie,
        Some(&csrf),
        Some(body.clone()),
    );
    assert_eq!(status, 201, "{v}");

    // A viewer's session reads; its writes are refused by the server, CSRF token or not.
    let (vcookie, vcsrf, _) = sign_in(&g, VIEWER);
    assert_eq!(
        with_session(&g, "GET", "/admin/tenants", &vcookie, None, None).0,
        200
    );
    let (status, v) = with_session(
        &g,
        "DELETE",
        "/admin/tenants/t2",
        &vcookie,
        Some(&vcsrf),
        None,
    );
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (403, Some("not_allowed")),
        "{v}"
    );
    assert_eq!(admin(&g, "GET", "/admin/tenants/t2", None).0, 200);

    // Signing out ends the session on the server: the cookie is worth nothing after.
    let (status, _) = with_session(&g, "DELETE", "/admin/session", &cookie, None, None);
    assert_eq!(status, 200);
    let (status, v) = with_session(&g, "GET", "/admin/tenants", &cookie, None, None);
    assert_eq!(status, 401, "{v}");
    // Wrong tokens get nothing; the audit log names who made the change.
    let r = client()
        .post(format!("{}/admin/session", g.admin))
        .json(&json!({"token": "nope"}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 401);
    let (_, log) = admin(&g, "GET", "/admin/audit?action=tenant.create", None);
    assert_eq!(log["data"][0]["actor"], "admin_token", "{log}");
    assert_eq!(log["data"][0]["target"], "t2", "{log}");
    std::fs::remove_dir_all(&g.dir).ok();
}

#[test]
fn tenants_are_previewed_validated_applied_and_removed() {
    let g = start();
    let fields = json!({"models": [MODEL], "requests_per_minute": 1000, "token_budget": {"tokens": 100000, "period": "day"}});
    let body = |v: &Value| Some(serde_json::to_vec(v).unwrap());
    // A dry run shows the lines that would change and applies nothing.
    let (status, v) = admin(&g, "PUT", "/admin/tenants/beta?dry_run=true", body(&fields));
    assert_eq!((status, v["status"].as_str()), (200, Some("valid")), "{v}");
    let added: Vec<&str> = v["diff"]["added"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l.as_str().unwrap())
        .collect();
    assert!(added.contains(&"name = \"beta\""), "{added:?}");
    assert_eq!(admin(&g, "GET", "/admin/tenants/beta", None).0, 404);
    // Applied: in force, the other tenant (and the file's comment) untouched.
    let (status, v) = admin(&g, "PUT", "/admin/tenants/beta", body(&fields));
    assert_eq!(status, 201, "{v}");
    let file = std::fs::read_to_string(g.dir.join("policies.toml")).unwrap();
    assert!(
        file.starts_with("# tenants\n[[tenants]]\nname = \"acme\""),
        "{file}"
    );
    let (_, t) = admin(&g, "GET", "/admin/tenants/beta", None);
    assert_eq!(t["policy"]["requests_per_minute"], 1000, "{t}");
    assert_eq!(t["budget"]["tokens"], 100000, "{t}");
    assert_eq!(t["budget"]["used"], 0, "{t}");
    assert!(
        t["toml"].as_str().unwrap().contains("name = \"beta\""),
        "{t}"
    );
    // An edit the policy file would not take is refused with its problem named; nothing
    // changes.
    let bad = json!({"models": [MODEL], "weight": 0});
    let (status, v) = admin(&g, "PUT", "/admin/tenants/beta", body(&bad));
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("weight: must be at least 1"),
        "{v}"
    );
    let (_, t) = admin(&g, "GET", "/admin/tenants/beta", None);
    assert_eq!(t["policy"]["requests_per_minute"], 1000, "{t}");
    // Keys are not edited through the tenant; the list shows both tenants.
    let (status, _) = admin(&g, "PUT", "/admin/tenants/beta", body(&json!({"keys": []})));
    assert_eq!(status, 400);
    let (_, list) = admin(&g, "GET", "/admin/tenants", None);
    let names: Vec<&str> = list["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["acme", "beta"]);
    assert_eq!(list["data"][0]["keys"], 1);
    assert_eq!(admin(&g, "DELETE", "/admin/tenants/beta", None).0, 200);
    assert_eq!(admin(&g, "GET", "/admin/tenants/beta", None).0, 404);
    std::fs::remove_dir_all(&g.dir).ok();
}

#[test]
fn plugins_show_their_calls_and_roll_back_to_the_version_they_replaced() {
    let g = start();
    let (v1, v2) = (
        std::fs::read(component("noop")).unwrap(),
        std::fs::read(component("echo-reranker")).unwrap(),
    );
    assert_eq!(
        admin(&g, "PUT", "/admin/plugins/acme/r", Some(v1.clone())).0,
        201
    );
    let (status, first) = admin(&g, "POST", "/admin/plugins/acme/r/rollback", None);
    assert_eq!(
        (status, first["error"]["code"].as_str()),
        (404, Some("no_previous_version"))
    );
    let (status, second) = admin(&g, "PUT", "/admin/plugins/acme/r", Some(v2));
    assert_eq!(status, 200, "{second}");
    for _ in 0..3 {
        let (status, v) = g.server.post_as(
            "sk-acme",
            "/v1/rerank",
            &json!({"model": "r", "query": "q", "documents": ["a", "b"]}),
        );
        assert_eq!(status, 200, "{v}");
    }
    let (_, list) = admin(&g, "GET", "/admin/plugins", None);
    let p = &list["data"][0];
    assert_eq!(p["sha256"], second["sha256"], "{list}");
    assert_eq!(p["calls"], 3, "{p}");
    assert!(p["p50_ms"].as_f64().unwrap() > 0.0 && p["p99_ms"].as_f64() >= p["p50_ms"].as_f64());
    assert!(p["load_ms"].as_f64().unwrap() > 0.0, "{p}");
    let v1_sha = gateway::plugins::hex(&<sha2::Sha256 as sha2::Digest>::digest(&v1));
    assert_eq!(p["previous"]["sha256"], v1_sha.as_str(), "{p}");
    // Rolled back: the first version serves again, and the second is the one kept.
    let (status, v) = admin(&g, "POST", "/admin/plugins/acme/r/rollback", None);
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["sha256"], v1_sha.as_str());
    assert_eq!(v["rolled_back_from"], second["sha256"]);
    let (_, list) = admin(&g, "GET", "/admin/plugins", None);
    assert_eq!(list["data"][0]["sha256"], v1_sha.as_str());
    assert_eq!(list["data"][0]["previous"]["sha256"], second["sha256"]);
    let (_, log) = admin(&g, "GET", "/admin/audit?action=plugin.rollback", None);
    assert_eq!(log["data"][0]["target"], "acme/r", "{log}");
    std::fs::remove_dir_all(&g.dir).ok();
}

#[test]
fn the_overview_charts_what_the_metrics_count() {
    let g = start();
    let (_, v) = admin(&g, "GET", "/admin/overview", None);
    assert_eq!(v["models"][0]["id"], MODEL, "{v}");
    assert_eq!(v["models"][0]["kind"], "local");
    for _ in 0..3 {
        let (status, _) = g.server.post_as(
            "sk-acme",
            "/v1/chat/completions",
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}),
        );
        assert_eq!(status, 200);
    }
    // Samples come every 2 s; requests and tokens show up in one within a few.
    support::wait_for(
        "a sample with the requests",
        std::time::Duration::from_secs(10),
        || {
            let (_, v) = admin(&g, "GET", "/admin/overview", None);
            let sum = |k: &str| {
                v["series"][k]
                    .as_array()
                    .map_or(0.0, |a| a.iter().filter_map(Value::as_f64).sum::<f64>())
            };
            sum("requests_per_s") > 0.0 && sum("tokens_per_s") > 0.0
        },
    );
    std::fs::remove_dir_all(&g.dir).ok();
}

/// The whole console in headless Chromium (Debian's), driven by Playwright for Python:
/// `tests/admin_console.py` signs in, creates a tenant and a key, sees the key's call in
/// Usage, uploads a plugin, sees an invalid edit refused, revokes the key, and checks a
/// viewer's write is refused by the server.
#[test]
fn the_console_works_in_a_real_browser() {
    // One listener: the scenario calls the API and the console at one address.
    let g = start_with("");
    let wasm = component("noop");
    let mut run = browser_scenario(&g, &wasm);
    if run.hung {
        // A hang (not a failed assertion) has been seen once on a fresh CI machine, with no
        // output to say where: the scenario dumps its Python stack before the deadline, printed
        // here, and gets one more try. A second hang fails the test.
        eprintln!(
            "the browser scenario hung; its stacks:\n{}\n{}",
            run.out, run.err
        );
        run = browser_scenario(&g, &wasm);
    }
    assert!(
        run.ok && run.out.contains("admin console scenario: ok"),
        "the browser scenario failed{} (host/scripts/test.sh installs Playwright and Chromium):\n{}\n{}",
        if run.hung { " by hanging" } else { "" },
        run.out,
        run.err
    );
    for line in run.out.lines().filter(|l| l.contains(" ms: ")) {
        println!("{line}");
    }
    std::fs::remove_dir_all(&g.dir).ok();
}

struct BrowserRun {
    ok: bool,
    hung: bool,
    out: String,
    err: String,
}

/// Runs tests/admin_console.py under coreutils `timeout`, which signals the whole process
/// group (Playwright's driver and Chromium too), so nothing outlives the deadline or holds the
/// output pipes open. The scenario takes seconds; its own stack dump comes at 150 s.
fn browser_scenario(g: &Gateway, wasm: &std::path::Path) -> BrowserRun {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/admin_console.py");
    let run = std::process::Command::new("timeout")
        .args(["-k", "10", "180", "python3", script])
        .args([
            &g.admin,
            TOKEN,
            VIEWER,
            MODEL,
            wasm.to_str().unwrap(),
            "reranker",
        ])
        .env("SCENARIO_DEADLINE_S", "150")
        .output()
        .expect("timeout and python3 run");
    let err = String::from_utf8_lossy(&run.stderr).into_owned();
    BrowserRun {
        ok: run.status.success(),
        // 124/137: `timeout` fired; the dump alone means the scenario's own deadline did.
        hung: matches!(run.status.code(), Some(124) | Some(137) | None)
            || err.contains("Timeout (0:"),
        out: String::from_utf8_lossy(&run.stdout).into_owned(),
        err,
    }
}
