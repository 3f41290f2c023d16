//! TLS on both sides of the router: rustls with ring, no OpenSSL.
//!
//! - **Workers at `https://` URLs.** The upstream client (health checks,
//!   probes and proxied requests alike) verifies a worker's certificate
//!   against `--worker-ca-file` (PEM), else against the system's roots,
//!   and presents `--worker-client-cert`/`--worker-client-key` when given
//!   (a worker that requires client certificates). `http://` workers are
//!   unchanged.
//! - **The front door.** With `--tls-cert`/`--tls-key` (PEM) the router
//!   serves HTTPS only. The pair is read again when either file changes
//!   (checked at most once a second, at a handshake), so a renewed
//!   certificate is served without a restart; a new pair that does not
//!   load is logged and the last good one kept. With
//!   `--tls-client-ca-file`, a client must present a certificate that CA
//!   signed. A handshake must end within the header-read timeout.

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// How often, at most, the front door looks at its certificate files.
pub(crate) const RELOAD_CHECK: Duration = Duration::from_secs(1);

/// A TLS setting that cannot be used.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub(crate) struct TlsError(String);

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| TlsError(format!("{}: no PEM certificates: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(TlsError(format!(
            "{}: no PEM certificate in it",
            path.display()
        )));
    }
    Ok(certs)
}

fn private_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    PrivateKeyDer::from_pem_file(path)
        .map_err(|e| TlsError(format!("{}: no PEM private key: {e}", path.display())))
}

fn roots(path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut store = rustls::RootCertStore::empty();
    for cert in certificates(path)? {
        store
            .add(cert)
            .map_err(|e| TlsError(format!("{}: a CA certificate: {e}", path.display())))?;
    }
    Ok(store)
}

/// How the router reaches `https://` workers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct WorkerTls {
    /// PEM roots a worker's certificate must chain to (`None`: the
    /// system's).
    pub ca_file: Option<PathBuf>,
    /// A client certificate chain (PEM) and its key, presented to workers.
    pub client_cert: Option<(PathBuf, PathBuf)>,
}

impl WorkerTls {
    /// A client configuration that trusts no root: for a router whose
    /// workers are all `http://`.
    pub(crate) fn no_roots() -> rustls::ClientConfig {
        rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .expect("ring supports the default protocol versions")
            .with_root_certificates(rustls::RootCertStore::empty())
            .with_no_client_auth()
    }

    /// The upstream client's TLS configuration.
    pub(crate) fn client_config(&self) -> Result<rustls::ClientConfig, TlsError> {
        let roots = match &self.ca_file {
            Some(path) => roots(path)?,
            None => {
                // A machine without system roots still serves http://
                // workers; an https:// one then fails its handshake,
                // naming the certificate it could not verify.
                let mut store = rustls::RootCertStore::empty();
                match rustls_native_certs::load_native_certs() {
                    Ok(native) => {
                        store.add_parsable_certificates(native);
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, "no system root certificates");
                    }
                }
                store
            }
        };
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError(e.to_string()))?
            .with_root_certificates(roots);
        // No ALPN here: the connector offers HTTP/1.1 itself.
        match &self.client_cert {
            Some((cert, key)) => builder
                .with_client_auth_cert(certificates(cert)?, private_key(key)?)
                .map_err(|e| TlsError(format!("{}: {e}", cert.display()))),
            None => Ok(builder.with_no_client_auth()),
        }
    }
}

/// The front door's TLS settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FrontTls {
    /// The certificate chain (PEM).
    pub cert: PathBuf,
    /// Its private key (PEM).
    pub key: PathBuf,
    /// Clients must present a certificate this CA (PEM) signed.
    pub client_ca: Option<PathBuf>,
}

impl FrontTls {
    /// The acceptor: fails when the files do not load now.
    pub(crate) fn acceptor(&self) -> Result<tokio_rustls::TlsAcceptor, TlsError> {
        let resolver = ReloadingCert::load(self.cert.clone(), self.key.clone())?;
        let builder = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError(e.to_string()))?;
        let builder = match &self.client_ca {
            Some(path) => {
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots(path)?), provider())
                        .build()
                        .map_err(|e| TlsError(format!("{}: {e}", path.display())))?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let mut config = builder.with_cert_resolver(Arc::new(resolver));
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
    }
}

/// The front door's certificate, read again when its files change.
#[derive(Debug)]
struct ReloadingCert {
    cert: PathBuf,
    key: PathBuf,
    state: Mutex<Loaded>,
}

#[derive(Debug)]
struct Loaded {
    key: Arc<CertifiedKey>,
    /// The files' modification times when last read.
    stamps: (Option<SystemTime>, Option<SystemTime>),
    checked: Instant,
}

fn stamp(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

fn certified_key(cert: &Path, key: &Path) -> Result<CertifiedKey, TlsError> {
    let chain = certificates(cert)?;
    let key = private_key(key)?;
    let key = provider()
        .key_provider
        .load_private_key(key)
        .map_err(|e| TlsError(format!("{}: {e}", cert.display())))?;
    let certified = CertifiedKey::new(chain, key);
    certified
        .keys_match()
        .map_err(|e| TlsError(format!("{}: {e}", cert.display())))?;
    Ok(certified)
}

impl ReloadingCert {
    fn load(cert: PathBuf, key: PathBuf) -> Result<Self, TlsError> {
        let stamps = (stamp(&cert), stamp(&key));
        let loaded = certified_key(&cert, &key)?;
        Ok(Self {
            state: Mutex::new(Loaded {
                key: Arc::new(loaded),
                stamps,
                checked: Instant::now(),
            }),
            cert,
            key,
        })
    }

    /// The current pair, read again first when a file changed since the
    /// last look (at most every [`RELOAD_CHECK`]).
    fn current(&self) -> Arc<CertifiedKey> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if state.checked.elapsed() >= RELOAD_CHECK {
            state.checked = Instant::now();
            let stamps = (stamp(&self.cert), stamp(&self.key));
            if stamps != state.stamps {
                state.stamps = stamps;
                match certified_key(&self.cert, &self.key) {
                    Ok(key) => {
                        state.key = Arc::new(key);
                        tracing::info!(cert = %self.cert.display(), "TLS certificate reloaded");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "the changed TLS certificate does not load: the last good one is kept");
                    }
                }
            }
        }
        state.key.clone()
    }
}

impl ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Pair {
        cert: String,
        key: String,
    }

    fn ca() -> (rcgen::Certificate, rcgen::KeyPair) {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().unwrap();
        (params.self_signed(&key).unwrap(), key)
    }

    fn leaf(ca: &(rcgen::Certificate, rcgen::KeyPair), name: &str) -> Pair {
        let params = rcgen::CertificateParams::new(vec![name.to_owned()]).unwrap();
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &ca.0, &ca.1).unwrap();
        Pair {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("switchyard-tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn files_that_are_no_certificate_or_key_are_named_in_the_error() {
        let dir = scratch("bad");
        let junk = write(&dir, "junk.pem", "not a certificate");
        let ca = ca();
        let pair = leaf(&ca, "localhost");
        let cert = write(&dir, "cert.pem", &pair.cert);
        let key = write(&dir, "key.pem", &pair.key);
        let front = |cert: &Path, key: &Path| FrontTls {
            cert: cert.to_owned(),
            key: key.to_owned(),
            client_ca: None,
        };
        assert!(front(&cert, &key).acceptor().is_ok());
        let err = |f: FrontTls| f.acceptor().err().expect("refused").to_string();
        let e = err(front(&junk, &key));
        assert!(e.contains("junk.pem"), "{e}");
        let e = err(front(&cert, &junk));
        assert!(e.contains("junk.pem"), "{e}");
        // A key that is not the certificate's.
        let other = write(&dir, "other.pem", &leaf(&ca, "localhost").key);
        assert!(front(&cert, &other).acceptor().is_err());
        let workers = WorkerTls {
            ca_file: Some(junk.clone()),
            client_cert: None,
        };
        assert!(workers.client_config().is_err());
        let workers = WorkerTls {
            ca_file: None,
            client_cert: Some((cert.clone(), key.clone())),
        };
        assert!(workers.client_config().is_ok());
    }

    #[test]
    fn a_changed_pair_is_served_and_a_broken_one_is_not() {
        let dir = scratch("reload");
        let ca = ca();
        let first = leaf(&ca, "localhost");
        let cert = write(&dir, "cert.pem", &first.cert);
        let key = write(&dir, "key.pem", &first.key);
        let resolver = ReloadingCert::load(cert.clone(), key.clone()).unwrap();
        let der = |k: &CertifiedKey| k.cert[0].to_vec();
        let before = der(&resolver.current());
        // A new pair: served once the check interval has passed and a
        // file's time changed.
        let second = leaf(&ca, "localhost");
        std::fs::write(&cert, &second.cert).unwrap();
        std::fs::write(&key, &second.key).unwrap();
        resolver.state.lock().unwrap().stamps = (None, None);
        resolver.state.lock().unwrap().checked = Instant::now() - RELOAD_CHECK;
        let after = der(&resolver.current());
        assert_ne!(before, after);
        // A broken file keeps the last good pair.
        std::fs::write(&cert, "garbage").unwrap();
        resolver.state.lock().unwrap().stamps = (None, None);
        resolver.state.lock().unwrap().checked = Instant::now() - RELOAD_CHECK;
        assert_eq!(der(&resolver.current()), after);
    }
}
