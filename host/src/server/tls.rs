//! TLS with rustls (ring provider): certificates from PEM files, ALPN for h2 and HTTP/1.1,
//! optional client-certificate authentication, and reload without dropping connections — a
//! reload swaps the acceptor new handshakes use; established connections keep their session.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;

#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Require client certificates signed by this CA (PEM).
    pub client_ca: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// The acceptor in use, replaced on reload.
pub struct Tls {
    files: TlsFiles,
    acceptor: ArcSwap<TlsAcceptor>,
}

impl Tls {
    pub fn load(files: TlsFiles) -> Result<Arc<Self>, TlsError> {
        let acceptor = acceptor(&files)?;
        Ok(Arc::new(Self {
            files,
            acceptor: ArcSwap::from_pointee(acceptor),
        }))
    }

    pub fn acceptor(&self) -> Arc<TlsAcceptor> {
        self.acceptor.load_full()
    }

    /// Re-reads the files; on any error the certificates in use stay.
    pub fn reload(&self) {
        match acceptor(&self.files) {
            Ok(a) => {
                self.acceptor.store(Arc::new(a));
                tracing::info!(cert = %self.files.cert.display(), "TLS certificates reloaded");
            }
            Err(e) => {
                tracing::warn!(error = %e, "TLS reload failed; keeping the certificates in use")
            }
        }
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }
}

fn file_err(path: &Path, e: impl std::fmt::Display) -> TlsError {
    TlsError::File {
        path: path.into(),
        message: e.to_string(),
    }
}

fn acceptor(files: &TlsFiles) -> Result<TlsAcceptor, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| file_err(&files.cert, e))?
        .collect::<Result<_, _>>()
        .map_err(|e| file_err(&files.cert, e))?;
    if certs.is_empty() {
        return Err(file_err(&files.cert, "no certificate in the file"));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| file_err(&files.key, e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for c in CertificateDer::pem_file_iter(ca).map_err(|e| file_err(ca, e))? {
                roots
                    .add(c.map_err(|e| file_err(ca, e))?)
                    .map_err(|e| file_err(ca, e))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| file_err(ca, e))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

/// Reloads on SIGHUP and when a certificate file changes (watching their folders, since
/// certificate tools replace files by rename).
pub fn watch(tls: Arc<Tls>) -> notify::Result<crate::common::Watch> {
    let f = tls.files().clone();
    let paths: Vec<PathBuf> = [Some(f.cert), Some(f.key), f.client_ca]
        .into_iter()
        .flatten()
        .collect();
    let names: Vec<_> = paths
        .iter()
        .filter_map(|p| p.file_name().map(|n| n.to_os_string()))
        .collect();
    let relevant = move |p: &Path| {
        p.file_name().is_some_and(|n| names.iter().any(|x| x == n))
            || crate::common::kubernetes_swap(p)
    };
    let mut dirs: Vec<(PathBuf, bool)> = paths
        .iter()
        .map(|p| (crate::common::parent_dir(p), false))
        .collect();
    dirs.dedup();
    let quiet = std::time::Duration::from_millis(100);
    let watch = crate::common::watch("tls-watch", &dirs, relevant, quiet, move || tls.reload())?;
    #[cfg(unix)]
    {
        let hup = watch.trigger.clone();
        tokio::spawn(async move {
            let Ok(mut sig) =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            else {
                return;
            };
            while sig.recv().await.is_some() {
                let _ = hup.send(());
            }
        });
    }
    Ok(watch)
}
