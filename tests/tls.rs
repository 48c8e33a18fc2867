//! HTTPS end to end: a test CA made with rcgen, h2 and HTTP/1.1 by ALPN, the admin API on its
//! own listener behind client certificates, and certificate reload without dropping
//! connections.

mod support;

use std::path::Path;
use std::time::{Duration, Instant};

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair};
use reqwest::blocking::Client;
use support::{key_sha256, model_path, Server, MODEL};

const ADMIN: &str = "admin-token-for-tests-0123";

struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

impl Ca {
    fn new(name: &str) -> Self {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        Self {
            issuer: CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap(),
        }
    }

    /// A certificate for `names` signed by this CA, as (cert PEM, key PEM).
    fn issue(&self, names: &[&str]) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let params =
            CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }
}

fn client(ca: &Ca, identity: Option<(&str, &str)>, http1: bool) -> Client {
    let mut b = Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(ca.pem().as_bytes()).unwrap())
        .tls_built_in_root_certs(false)
        .timeout(Duration::from_secs(60));
    if let Some((cert, key)) = identity {
        b = b.identity(reqwest::Identity::from_pem(format!("{cert}{key}").as_bytes()).unwrap());
    }
    if http1 {
        b = b.http1_only();
    }
    b.build().unwrap()
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

#[test]
fn https_with_alpn_client_certs_for_admin_and_live_reload() {
    let dir = std::env::temp_dir().join(format!(
        "gateway-e2e-tls-{}-{}",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let (server_ca, admin_ca, next_ca) = (
        Ca::new("server CA"),
        Ca::new("admin clients CA"),
        Ca::new("next server CA"),
    );
    let (cert, key) = server_ca.issue(&["localhost"]);
    let cert_path = write(&dir, "cert.pem", &cert);
    let key_path = write(&dir, "key.pem", &key);
    let admin_ca_path = write(&dir, "admin-ca.pem", &admin_ca.pem());
    let key_hash = key_sha256("k-acme");
    write(
        &dir,
        "policies.toml",
        &format!(
            "[[tenants]]\nname = \"acme\"\nkeys = [{{ id = \"t\", sha256 = \"{key_hash}\" }}]\n"
        ),
    );
    let config = format!(
        "admin_token = \"{ADMIN}\"\npolicies = \"{d}/policies.toml\"\nledger = \"{d}/usage.sqlite\"\n\
         [tls]\ncert = \"{cert_path}\"\nkey = \"{key_path}\"\n\
         [admin]\nlisten = \"127.0.0.1:0\"\nclient_ca = \"{admin_ca_path}\"\n\
         [[models]]\nname = \"{MODEL}\"\npath = \"{m}\"\n",
        d = dir.display(),
        m = model_path(),
    );
    let s = Server::start(&["--config", &write(&dir, "gateway.toml", &config)]);
    let port = s.addr().rsplit(':').next().unwrap().to_string();
    let admin_port = s
        .logged_addr("serving the admin API addr=")
        .rsplit(':')
        .next()
        .unwrap()
        .to_string();
    let api = format!("https://localhost:{port}");
    let admin = format!("https://localhost:{admin_port}");

    // h2 by ALPN, and HTTP/1.1 for clients that only speak it.
    let h2 = client(&server_ca, None, false);
    let r = h2
        .get(format!("{api}/v1/models"))
        .bearer_auth("k-acme")
        .send()
        .unwrap();
    assert_eq!(
        (r.status().as_u16(), r.version()),
        (200, reqwest::Version::HTTP_2)
    );
    let r = client(&server_ca, None, true)
        .post(format!("{api}/v1/chat/completions"))
        .bearer_auth("k-acme")
        .json(&serde_json::json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}))
        .send()
        .unwrap();
    assert_eq!(
        (r.status().as_u16(), r.version()),
        (200, reqwest::Version::HTTP_11)
    );
    assert!(
        Client::new()
            .get(format!("http://127.0.0.1:{port}/health"))
            .send()
            .is_err(),
        "plain HTTP must not be served"
    );

    // The admin API lives only on its listener, and only for clients with a certificate from
    // the admin CA.
    let on_api = h2
        .get(format!("{api}/admin/policies"))
        .bearer_auth(ADMIN)
        .send()
        .unwrap();
    assert_eq!(on_api.status().as_u16(), 404);
    assert!(
        h2.get(format!("{admin}/admin/policies"))
            .bearer_auth(ADMIN)
            .send()
            .is_err(),
        "no client certificate"
    );
    let (ccert, ckey) = admin_ca.issue(&["ops"]);
    let (rogue_cert, rogue_key) = server_ca.issue(&["ops"]);
    assert!(
        client(&server_ca, Some((&rogue_cert, &rogue_key)), false)
            .get(format!("{admin}/admin/policies"))
            .bearer_auth(ADMIN)
            .send()
            .is_err(),
        "a certificate from another CA"
    );
    let ops = client(&server_ca, Some((&ccert, &ckey)), false);
    let r = ops
        .get(format!("{admin}/admin/policies"))
        .bearer_auth(ADMIN)
        .send()
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.text().unwrap().contains("acme"));
    assert_eq!(
        ops.get(format!("{admin}/v1/models"))
            .bearer_auth("k-acme")
            .send()
            .unwrap()
            .status()
            .as_u16(),
        404
    );

    // New certificate files: new handshakes get them, the open h2 connection keeps working.
    let (cert2, key2) = next_ca.issue(&["localhost"]);
    write(&dir, "key.pem.new", &key2);
    write(&dir, "cert.pem.new", &cert2);
    std::fs::rename(dir.join("key.pem.new"), dir.join("key.pem")).unwrap();
    std::fs::rename(dir.join("cert.pem.new"), dir.join("cert.pem")).unwrap();
    let fresh = client(&next_ca, None, false);
    let started = Instant::now();
    while fresh.get(format!("{api}/health")).send().is_err() {
        assert!(
            started.elapsed() < Duration::from_secs(20),
            "the new certificate was never served"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "new certificate served {:?} after the files changed",
        started.elapsed()
    );
    let r = h2
        .get(format!("{api}/v1/models"))
        .bearer_auth("k-acme")
        .send()
        .unwrap();
    assert_eq!(
        r.status().as_u16(),
        200,
        "the connection opened before the reload was dropped"
    );
    let _ = std::fs::remove_dir_all(dir);
}
