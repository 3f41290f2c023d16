//! TLS both ways, with a CA made at test time: an `inner` router serving
//! HTTPS (client certificates required) in front of a sim-worker, and an
//! `outer` router in front of it that reaches it as an `https://` worker,
//! trusting that CA and presenting a client certificate. Routers missing
//! the CA or the client certificate never get the worker into selection;
//! the inner router's certificate, replaced on disk, is what the next
//! handshake sees.

use crate::support::{machine, metric, metrics_text, router, scratch_file, sim_worker, PATIENCE};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::sync::Arc;

struct Ca {
    cert: rcgen::Certificate,
    key: rcgen::KeyPair,
}

impl Ca {
    fn new() -> Self {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let key = rcgen::KeyPair::generate().unwrap();
        Self {
            cert: params.self_signed(&key).unwrap(),
            key,
        }
    }

    /// A leaf for `names`, used for `purpose`: its (certificate, key) PEM.
    fn leaf(&self, names: &[&str], purpose: rcgen::ExtendedKeyUsagePurpose) -> (String, String) {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = rcgen::CertificateParams::new(names).unwrap();
        params.extended_key_usages = vec![purpose];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// Files `<tag>-cert.pem` and `<tag>-key.pem` holding `pair`: their paths.
fn pair_files(tag: &str, pair: &(String, String)) -> (String, String) {
    let cert = scratch_file(&format!("{tag}-cert.pem"), pair.0.as_bytes());
    let key = scratch_file(&format!("{tag}-key.pem"), pair.1.as_bytes());
    (
        cert.to_str().unwrap().to_owned(),
        key.to_str().unwrap().to_owned(),
    )
}

/// The certificate `base` (`https://HOST:PORT`) presents, read by a
/// handshake that trusts `ca` and presents `client`.
async fn served_certificate(base: &str, ca: &Ca, client: &(String, String)) -> Vec<u8> {
    let mut roots = rustls::RootCertStore::empty();
    roots.add(ca.cert.der().clone()).unwrap();
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(client.0.as_bytes())
        .collect::<Result<_, _>>()
        .unwrap();
    let key = PrivateKeyDer::from_pem_slice(client.1.as_bytes()).unwrap();
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(roots)
    .with_client_auth_cert(chain, key)
    .unwrap();
    let addr = base.trim_start_matches("https://");
    let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let tls = tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .expect("a handshake with the CA's certificate");
    tls.get_ref().1.peer_certificates().unwrap()[0].to_vec()
}

async fn ready(client: &reqwest::Client, base: &str) -> bool {
    client
        .get(format!("{base}/ready"))
        .send()
        .await
        .is_ok_and(|r| r.status() == 200)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_https_worker_is_reached_with_the_ca_and_a_client_certificate_and_its_certificate_reloads(
) {
    let _machine = machine().await;
    use rcgen::ExtendedKeyUsagePurpose::{ClientAuth, ServerAuth};
    let ca = Ca::new();
    let ca_file = scratch_file("tls-ca.pem", ca.cert.pem().as_bytes());
    let ca_file = ca_file.to_str().unwrap();
    let (server_cert, server_key) = pair_files(
        "tls-server",
        &ca.leaf(&["localhost", "127.0.0.1"], ServerAuth),
    );
    let client_pair = ca.leaf(&["outer"], ClientAuth);
    let (client_cert, client_key) = pair_files("tls-client", &client_pair);
    // A client certificate from a CA the inner router does not trust.
    let (stray_cert, stray_key) = pair_files("tls-stray", &Ca::new().leaf(&["stray"], ClientAuth));

    let w0 = sim_worker("0");
    let inner = router(
        &[w0.named("w0")],
        &[
            "--tls-cert",
            &server_cert,
            "--tls-key",
            &server_key,
            "--tls-client-ca-file",
            ca_file,
        ],
    );
    assert!(inner.base.starts_with("https://"), "{}", inner.base);
    let https_worker = format!("{},name=inner", inner.base);
    let outer = router(
        std::slice::from_ref(&https_worker),
        &[
            "--worker-ca-file",
            ca_file,
            "--worker-client-cert",
            &client_cert,
            "--worker-client-key",
            &client_key,
        ],
    );
    let client = reqwest::Client::new();
    crate::support::wait_for("the https worker in selection", PATIENCE, async || {
        ready(&client, &outer.base).await
    })
    .await;
    let response = client
        .post(format!("{}/v1/completions", outer.base))
        .json(&serde_json::json!({"prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(response.headers()["x-switchyard-worker"], "inner");
    assert!(response.text().await.unwrap().ends_with("data: [DONE]\n\n"));

    // Without the CA (the system's roots) or with a client certificate
    // the inner router does not trust, the worker never becomes ready.
    let untrusting = router(std::slice::from_ref(&https_worker), &[]);
    let stray = router(
        std::slice::from_ref(&https_worker),
        &[
            "--worker-ca-file",
            ca_file,
            "--worker-client-cert",
            &stray_cert,
            "--worker-client-key",
            &stray_key,
        ],
    );
    // A second of their health rounds (200 ms each): the trusted router
    // stays ready, the others never become so (they cannot, whatever the
    // machine's pace).
    for _ in 0..10 {
        assert!(ready(&client, &outer.base).await);
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(!ready(&client, &untrusting.base).await, "no CA: not ready");
    assert!(
        !ready(&client, &stray.base).await,
        "untrusted client: not ready"
    );
    // Plain HTTP at the HTTPS port is no request either.
    let plain = inner.base.replacen("https://", "http://", 1);
    assert!(client.get(format!("{plain}/health")).send().await.is_err());
    drop((untrusting, stray));

    // A new certificate on disk is what the next handshakes see.
    let before = served_certificate(&inner.base, &ca, &client_pair).await;
    let renewed = ca.leaf(&["localhost", "127.0.0.1"], ServerAuth);
    std::fs::write(&server_key, &renewed.1).unwrap();
    std::fs::write(&server_cert, &renewed.0).unwrap();
    let renewed_der = CertificateDer::from_pem_slice(renewed.0.as_bytes())
        .unwrap()
        .to_vec();
    assert_ne!(before, renewed_der);
    crate::support::wait_for("the renewed certificate served", PATIENCE, async || {
        served_certificate(&inner.base, &ca, &client_pair).await == renewed_der
    })
    .await;
    // And the outer router still reaches it.
    let response = client
        .post(format!("{}/v1/completions", outer.base))
        .json(&serde_json::json!({"prompt": [5, 6, 7, 8], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let text = metrics_text(&client, &outer.base).await;
    assert_eq!(
        metric(&text, "switchyard_worker_up{worker=\"inner\"}"),
        Some(1.0),
        "{text}"
    );
}
