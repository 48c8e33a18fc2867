//! A redis-server of the test's own (Debian's `redis-server`), on a free loopback port in a
//! temporary folder.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A redis-server of our own, removed with its folder when dropped.
pub struct Redis {
    child: Child,
    pub port: u16,
    dir: PathBuf,
}

impl Redis {
    pub fn start() -> Option<Self> {
        let port = TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
        Self::start_on(port)
    }

    pub fn start_on(port: u16) -> Option<Self> {
        let dir = std::env::temp_dir().join(format!("gateway-redis-{port}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
            ])
            .args(["--appendonly", "no", "--dir", dir.to_str()?])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .ok()?;
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(Self { child, port, dir })
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub fn redis() -> Option<Redis> {
    let r = Redis::start();
    if r.is_none() {
        assert!(
            std::env::var("GATEWAY_TEST_SERVICES").as_deref() != Ok("required"),
            "redis-server is not installed (host/scripts/test.sh installs it)"
        );
        println!("SKIPPED: redis-server is not installed (host/scripts/test.sh installs it)");
    }
    r
}
