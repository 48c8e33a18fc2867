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
        let mut pg = Self {
            child: None,
            port,
            dir,
            bin,
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
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(30);
        while postgres::Client::connect(&self.url(), postgres::NoTls).is_err() {
            assert!(Instant::now() < deadline, "postgres did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.url(), postgres::NoTls).unwrap()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
