//! `deploy/kubernetes`: the manifests pass the Kubernetes schemas (`kubernetes-validate` from
//! PyPI, installed by host/scripts/test.sh) and agree with the gateway (its configs parse, the
//! drain fits the grace period, the front finds the engine Service, KEDA's query names a gauge
//! the gateway exports); and a ConfigMap update as Kubernetes makes it (the `..data` link
//! renamed over) reloads policies and plugins.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use support::{key_sha256, wait_for, Server, MODEL};

fn manifests() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../deploy/kubernetes"))
}

/// Every YAML document of the manifests, as JSON (PyYAML comes with kubernetes-validate).
fn documents() -> Vec<Value> {
    let script = "import glob, json, sys, yaml\n\
        docs = [d for f in sorted(glob.glob(sys.argv[1] + '/*.yaml')) for d in yaml.safe_load_all(open(f)) if d]\n\
        print(json.dumps(docs))";
    let out = Command::new("python3")
        .args(["-c", script, manifests().to_str().unwrap()])
        .output()
        .expect("python3 runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind && d["metadata"]["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {name}"))
}

fn config(docs: &[Value], name: &str) -> gateway::config::Config {
    let text = find(docs, "ConfigMap", name)["data"]["gateway.toml"]
        .as_str()
        .unwrap();
    let cfg: gateway::config::Config =
        toml::from_str(text).unwrap_or_else(|e| panic!("{name}: {e}"));
    cfg.validate().unwrap_or_else(|e| panic!("{name}: {e}"));
    cfg
}

#[test]
fn manifests_pass_the_schemas_and_agree_with_the_gateway() {
    let files: Vec<PathBuf> = std::fs::read_dir(manifests())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    let out = Command::new("kubernetes-validate")
        .args(["--strict", "--quiet", "--no-warn"])
        .args(&files)
        .output()
        .expect("kubernetes-validate runs (host/scripts/test.sh installs it from PyPI)");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );

    let docs = documents();
    let engine = config(&docs, "gateway-engine-config");
    let front = config(&docs, "gateway-front-config");
    let policies = find(&docs, "ConfigMap", "gateway-policies")["data"]["policies.toml"]
        .as_str()
        .unwrap();
    gateway::tenancy::policy::Policies::parse(policies).expect("the example policy is valid");

    // The drain fits in the grace period, after preStop's sleep; readiness is /ready.
    for (deployment, cfg) in [("gateway-engine", &engine), ("gateway-front", &front)] {
        let spec = &find(&docs, "Deployment", deployment)["spec"]["template"]["spec"];
        let container = &spec["containers"][0];
        let sleep = container["lifecycle"]["preStop"]["sleep"]["seconds"]
            .as_u64()
            .unwrap();
        let grace = spec["terminationGracePeriodSeconds"].as_u64().unwrap();
        assert!(
            grace > sleep + cfg.drain_seconds,
            "{deployment}: {grace} s grace"
        );
        assert_eq!(container["readinessProbe"]["httpGet"]["path"], "/ready");
    }
    // The engine loads the file its init container fetches.
    let path = engine.models[0].path.to_str().unwrap().to_string();
    let engine_spec = &find(&docs, "Deployment", "gateway-engine")["spec"]["template"]["spec"];
    let fetch = engine_spec["initContainers"][0]["args"][0]
        .as_str()
        .unwrap();
    assert!(fetch.contains(Path::new(&path).file_name().unwrap().to_str().unwrap()));

    // The front follows the engine's headless Service, by name and port, on /ready.
    let up = &front.upstreams[0];
    assert_eq!(up.health_path, "/ready");
    let service = find(&docs, "Service", "gateway-engine");
    assert_eq!(service["spec"]["clusterIP"], "None");
    let port = service["spec"]["ports"][0]["port"].as_u64().unwrap();
    assert_eq!(
        up.replicas,
        [format!("dns+http://gateway-engine:{port}/v1")]
    );
    assert_eq!(up.name, engine.models[0].name);

    // KEDA scales the engine Deployment on a gauge a gateway exports under that model name.
    let keda = find(&docs, "ScaledObject", "gateway-engine");
    assert_eq!(keda["spec"]["scaleTargetRef"]["name"], "gateway-engine");
    let query = keda["spec"]["triggers"][0]["metadata"]["query"]
        .as_str()
        .unwrap();
    let series = query
        .trim_start_matches("sum(")
        .trim_end_matches(')')
        .replace(&engine.models[0].name, MODEL);
    let (_, metrics) = Server::start(&[]).get("/metrics");
    assert!(metrics.contains(&series), "{series} is not in /metrics");
}

/// A folder mounted from a ConfigMap, updated the way Kubernetes' atomic writer does it:
/// files live in a timestamped folder, `..data` links to it, and each visible name links
/// through `..data`; an update writes a new folder and renames a new link over `..data`.
struct ConfigMapDir {
    dir: PathBuf,
    version: u32,
}

impl ConfigMapDir {
    fn new(dir: &Path, files: &[(&str, &[u8])]) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let mut me = Self {
            dir: dir.to_path_buf(),
            version: 0,
        };
        me.update(files);
        for (name, _) in files {
            let top = name.split('/').next().unwrap();
            let link = dir.join(top);
            if std::fs::symlink_metadata(&link).is_err() {
                std::os::unix::fs::symlink(format!("..data/{top}"), link).unwrap();
            }
        }
        me
    }

    fn update(&mut self, files: &[(&str, &[u8])]) {
        self.version += 1;
        let stamp = format!(
            "..2026_12_01_00_00_0{}.000000{}",
            self.version, self.version
        );
        for (name, bytes) in files {
            let path = self.dir.join(&stamp).join(name);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, bytes).unwrap();
        }
        let tmp = self.dir.join("..data_tmp");
        std::os::unix::fs::symlink(&stamp, &tmp).unwrap();
        std::fs::rename(&tmp, self.dir.join("..data")).unwrap();
    }
}

#[test]
fn configmap_updates_reload_policies_and_plugins() {
    let root = std::env::temp_dir().join(format!(
        "gateway-deploy-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let tenant = |key: &str| {
        format!(
            "[[tenants]]\nname = \"acme\"\nkeys = [{{ id = \"k\", sha256 = \"{}\" }}]\n",
            key_sha256(key)
        )
    };
    let v1 = tenant("old-key");
    let mut policies =
        ConfigMapDir::new(&root.join("policies"), &[("policies.toml", v1.as_bytes())]);
    let noop = std::fs::read(support::wasm::component("noop")).unwrap();
    let reranker = std::fs::read(support::wasm::component("crm-field-reranker")).unwrap();
    let mut plugins = ConfigMapDir::new(&root.join("plugins"), &[("acme/noop.wasm", &noop)]);
    let admin = "admin-token-for-deploy-tests";
    let server = Server::start(&[
        "--policies",
        root.join("policies/policies.toml").to_str().unwrap(),
        "--plugins-dir",
        root.join("plugins").to_str().unwrap(),
        "--admin-token",
        admin,
    ])
    .remove_on_drop(&root);
    let models = |key: &str| server.request("GET", "/v1/models", vec![], Some(key)).0;
    assert_eq!(models("old-key"), 200);

    let v2 = tenant("new-key");
    policies.update(&[("policies.toml", v2.as_bytes())]);
    wait_for("the policy reload", Duration::from_secs(20), || {
        models("new-key") == 200
    });
    assert_eq!(models("old-key"), 401);

    plugins.update(&[
        ("acme/noop.wasm", &noop),
        ("acme/crm-field-reranker.wasm", &reranker),
    ]);
    let listed = || {
        let (_, body) = server.request("GET", "/admin/plugins", vec![], Some(admin));
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["name"] == "crm-field-reranker")
    };
    wait_for("the plugin reload", Duration::from_secs(20), listed);
}
