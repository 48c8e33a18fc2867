//! A redis-server of the bench's own on a free loopback port, and tenancies sharing their
//! limits through it: the replicas of the Redis-shared benchmarks.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use gateway::metrics::Metrics;
use gateway::tenancy::Tenancy;

/// Stopped when dropped.
pub struct Redis {
    child: std::process::Child,
    pub port: u16,
}

impl Redis {
    /// None when `redis-server` is not installed.
    pub fn start() -> Option<Self> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .ok()?
            .local_addr()
            .ok()?
            .port();
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(std::process::Stdio::null())
            .spawn()
            .ok()?;
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            std::thread::sleep(Duration::from_millis(10));
        }
        Some(Self { child, port })
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    /// `n` tenancies on the policy file `policies`, sharing their limits through this Redis
    /// (each its own metrics, as separate processes would have).
    pub fn replicas(
        &self,
        n: usize,
        policies: &Path,
        rt: &tokio::runtime::Runtime,
    ) -> Vec<Arc<Tenancy>> {
        let cfg = gateway::config::ClusterConfig::default();
        (0..n)
            .map(|_| {
                let metrics = Arc::new(Metrics::new());
                let t = Tenancy::new(Some(policies.to_path_buf()), None, metrics.clone()).unwrap();
                let _guard = rt.enter();
                let shared =
                    gateway::tenancy::shared::Shared::new(&cfg, &self.url(), metrics).unwrap();
                t.share_limits(Arc::new(shared));
                Arc::new(t)
            })
            .collect()
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
