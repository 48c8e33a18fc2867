//! A PostgreSQL server of the test's own (Debian's `postgresql` binaries), on a free loopback
//! port in a temporary folder, stopped and removed when dropped. As root it runs as the
//! `postgres` user (the server refuses root).

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Postgres {
    child: Option<Child>,
    pub port: u16,
    dir: PathBuf,
    bin: PathBuf,
    /// Server settings (`-c name=value`) beyond the defaults.
    settings: Vec<String>,
}

/// The newest installed server's binaries.
fn bin_dir() -> Option<PathBuf> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .ok()?
        .filter_map(|e| Some(e.ok()?.path().join("bin")))
        .filter(|b| b.join("initdb").exists())
        .collect();
    found.sort_by_key(|p| {
        p.parent()
            .and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok())
            .unwrap_or(0)
    });
    found.pop()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

impl Postgres {
    /// None (with a SKIPPED line) when PostgreSQL is not installed, unless the test command
    /// requires it (`GATEWAY_TEST_SERVICES=required`, as `host/scripts/test.sh` sets).
    pub fn start() -> Option<Self> {
        Self::start_with(|_| Vec::new())
    }

    /// Like `start`, serving TLS only (`hostssl`) with a certificate for 127.0.0.1 from a CA of
    /// its own, whose PEM file is returned.
    pub fn start_tls() -> Option<(Self, PathBuf)> {
        let mut ca_file = PathBuf::new();
        let pg = Self::start_with(|dir| {
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            let ca =
                rcgen::CertifiedIssuer::self_signed(params, rcgen::KeyPair::generate().unwrap())
                    .unwrap();
            let key = rcgen::KeyPair::generate().unwrap();
            let cert = rcgen::CertificateParams::new(vec!["127.0.0.1".to_string()])
                .unwrap()
                .signed_by(&key, &ca)
                .unwrap();
            ca_file = dir.join("ca.pem");
            std::fs::write(&ca_file, ca.pem()).unwrap();
            std::fs::write(dir.join("server.pem"), cert.pem()).unwrap();
            let key_file = dir.join("server.key");
            std::fs::write(&key_file, key.serialize_pem()).unwrap();
            // The server refuses a key others can read.
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&key_file, std::fs::Permissions::from_mode(0o600)).unwrap();
            vec![
                "ssl=on".into(),
                format!("ssl_cert_file={}", dir.join("server.pem").display()),
                format!("ssl_key_file={}", dir.join("server.key").display()),
            ]
        })?;
        // Plain connections refused: only TLS gets in.
        let hba = pg.dir.join("data/pg_hba.conf");
        std::fs::write(
            &hba,
            "hostssl all all 127.0.0.1/32 trust\nlocal all all trust\n",
        )
        .unwrap();
        pg.command("pg_ctl")
            .arg("-D")
            .arg(pg.dir.join("data"))
            .arg("reload")
            .stdout(Stdio::null())
            .status()
            .unwrap();
        Some((pg, ca_file))
    }

    fn start_with(files: impl FnOnce(&std::path::Path) -> Vec<String>) -> Option<Self> {
        let Some(bin) = bin_dir() else {
            assert!(
                std::env::var("GATEWAY_TEST_SERVICES").as_deref() != Ok("required"),
                "PostgreSQL is not installed (host/scripts/test.sh installs it)"
            );
            println!("SKIPPED: PostgreSQL is not installed (host/scripts/test.sh installs it)");
            return None;
        };
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
        let dir = std::env::temp_dir().join(format!(
            "gateway-pg-{port}-{}-{}",
            std::process::id(),
            rand::random::<u32>()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let settings = files(&dir);
        let mut pg = Self {
            child: None,
            port,
            dir,
            bin,
            settings,
        };
        if is_root() {
            let ok = Command::new("chown")
                .args(["-R", "postgres:postgres"])
                .arg(&pg.dir)
                .status()
                .unwrap();
            assert!(ok.success(), "chown to the postgres user failed");
        }
        let data = pg.dir.join("data");
        let out = pg
            .command("initdb")
            .arg("-D")
            .arg(&data)
            .args([
                "-U",
                "gateway",
                "-A",
                "trust",
                "--no-sync",
                "-E",
                "UTF8",
                "--no-locale",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        pg.resume();
        Some(pg)
    }

    /// A command of the server's binaries, as the `postgres` user when we are root.
    fn command(&self, program: &str) -> Command {
        let path = self.bin.join(program);
        if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        }
    }

    pub fn url(&self) -> String {
        format!("postgres://gateway@127.0.0.1:{}/postgres", self.port)
    }

    /// Stops the server (fast shutdown), keeping its data for `resume`.
    pub fn stop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-m", "fast", "-w", "stop"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts the server on its port and data (again), and waits until it takes queries.
    pub fn resume(&mut self) {
        let child = self
            .command("postgres")
            .arg("-D")
            .arg(self.dir.join("data"))
            .args(["-p", &self.port.to_string(), "-h", "127.0.0.1", "-k"])
            .arg(&self.dir)
            // Tests need no crash safety of the database itself; they need it fast.
            .args(["-c", "fsync=off", "-c", "full_page_writes=off"])
            .args(self.settings.iter().flat_map(|s| ["-c", s.as_str()]))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while postgres::Client::connect(&self.socket(), postgres::NoTls).is_err() {
            assert!(Instant::now() < deadline, "postgres did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A connection of the test's own, through the server's Unix socket.
    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.socket(), postgres::NoTls).unwrap()
    }

    fn socket(&self) -> String {
        format!(
            "host={} port={} user=gateway dbname=postgres",
            self.dir.display(),
            self.port
        )
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
