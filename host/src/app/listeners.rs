//! The API listener and, when configured, the admin one, each with its TLS (reloaded when its
//! files change).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use tokio::net::TcpListener;

use crate::common::Watch;
use crate::config::{AdminConfig, Config};
use crate::server::tls::{self, Tls, TlsFiles};
use crate::server::{Listener, Role};

/// Binds the listeners `cfg` asks for, with the watchers of their TLS files.
pub(super) async fn bind(cfg: &Config) -> anyhow::Result<(Vec<Listener>, Vec<Watch>)> {
    let tls = match &cfg.tls {
        Some(t) => Some(load_tls(t.cert.clone(), t.key.clone(), None)?),
        None => None,
    };
    let mut watches = Vec::new();
    let tcp = TcpListener::bind(cfg.listen)
        .await
        .with_context(|| format!("binding {}", cfg.listen))?;
    if let Some(t) = &tls {
        tracing::info!("TLS on: h2 and HTTP/1.1 by ALPN");
        watches.push(tls::watch(t.clone()).context("watching the TLS files")?);
    }
    tracing::info!(addr = %tcp.local_addr()?, "serving the OpenAI API");
    let mut listeners = vec![Listener {
        tcp,
        tls: tls.clone(),
        role: api_role(&cfg.admin),
    }];
    let Some(addr) = cfg.admin.listen else {
        return Ok((listeners, watches));
    };
    let tcp = TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding the admin listener {addr}"))?;
    let admin_tls = match (&cfg.tls, &cfg.admin.client_ca) {
        (Some(t), Some(ca)) => {
            let t = load_tls(t.cert.clone(), t.key.clone(), Some(ca.clone()))?;
            watches.push(tls::watch(t.clone()).context("watching the TLS files")?);
            Some(t)
        }
        _ => tls,
    };
    let client_certs = cfg.admin.client_ca.is_some();
    tracing::info!(client_certs, "admin API on its own listener");
    tracing::info!(addr = %tcp.local_addr()?, "serving the admin API");
    listeners.push(Listener {
        tcp,
        tls: admin_tls,
        role: Role::Admin,
    });
    Ok((listeners, watches))
}

/// What the API listener serves: `/admin/*` as well, unless the admin API has its own.
fn api_role(admin: &AdminConfig) -> Role {
    match admin.listen {
        Some(_) => Role::Api,
        None => Role::All,
    }
}

fn load_tls(cert: PathBuf, key: PathBuf, client_ca: Option<PathBuf>) -> anyhow::Result<Arc<Tls>> {
    Ok(Tls::load(TlsFiles {
        cert,
        key,
        client_ca,
    })?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roles(listeners: &[Listener]) -> Vec<Role> {
        listeners.iter().map(|l| l.role).collect()
    }

    #[tokio::test]
    async fn the_api_listener_serves_admin_unless_admin_has_its_own() {
        let mut cfg = Config {
            listen: "127.0.0.1:0".parse().unwrap(),
            ..Config::default()
        };
        let (alone, _) = bind(&cfg).await.unwrap();
        assert_eq!(roles(&alone), [Role::All]);
        cfg.admin.listen = Some("127.0.0.1:0".parse().unwrap());
        let (apart, _) = bind(&cfg).await.unwrap();
        assert_eq!(roles(&apart), [Role::Api, Role::Admin]);
        let port = |l: &Listener| l.tcp.local_addr().unwrap().port();
        assert_ne!(port(&apart[0]), port(&apart[1]));
    }
}
