//! The NATS transport (`async-nats`, core pub/sub, no JetStream): the
//! replica plane across machines.
//!
//! NATS delivers a connection's messages on a subject in publish order,
//! which keeps per-request order (add, mark, free) from one replica.
//! Messages up to the server's `max_payload` (1 MiB by default) carry a
//! whole batch, so this transport batches; the publisher splits a batch
//! that would not fit [`payload_limit`] of the `max_payload` the server
//! announced.

use super::config::NatsAuth;
use super::transport::{Subscription, Transport, TransportError};
use bytes::Bytes;
use futures_util::StreamExt as _;

/// A NATS connection.
#[derive(Debug, Clone)]
pub struct NatsTransport {
    client: async_nats::Client,
}

/// A batch larger than this share of the server's `max_payload` is split:
/// the margin covers nothing in the payload itself (NATS counts payload
/// and headers, and replica messages carry no headers) but leaves room for
/// a server whose limit was lowered after we connected.
const PAYLOAD_MARGIN_DIVISOR: usize = 16;

/// The limit when the server announced none.
pub const FALLBACK_MAX_PAYLOAD: usize = 1024 * 1024;

impl NatsTransport {
    /// Connects to `url` (`nats://HOST:PORT`) without authentication.
    pub async fn connect(url: &str) -> Result<Self, TransportError> {
        Self::connect_with(url, &NatsAuth::default()).await
    }

    /// Connects to `url` (`nats://HOST:PORT`, or `tls://HOST:PORT` which
    /// requires TLS) with `auth`'s credentials and TLS settings. A refused
    /// login, an unreadable secret file or a TLS failure is an error
    /// naming what failed (never the secret).
    pub async fn connect_with(url: &str, auth: &NatsAuth) -> Result<Self, TransportError> {
        let connect_err = |e: String| TransportError::Connect(format!("{url}: {e}"));
        let mut options = async_nats::ConnectOptions::new()
            .name("switchyard-replica")
            .connection_timeout(std::time::Duration::from_secs(10));
        if let Some(user) = &auth.user {
            let password = auth
                .password()
                .map_err(|e| connect_err(e.to_string()))?
                .ok_or_else(|| connect_err("a NATS user needs a password".into()))?;
            options = options.user_and_password(user.clone(), password);
        }
        if let Some(token) = auth.token().map_err(|e| connect_err(e.to_string()))? {
            options = options.token(token);
        }
        if let Some(creds) = &auth.creds_file {
            options = options.credentials_file(creds).await.map_err(|e| {
                connect_err(format!(
                    "reading the NATS credentials file {}: {e}",
                    creds.display()
                ))
            })?;
        }
        for path in [&auth.tls_ca_file, &auth.tls_cert_file, &auth.tls_key_file]
            .into_iter()
            .flatten()
        {
            // async-nats reads these at connect time and says little about
            // which one failed: check they are readable first.
            std::fs::metadata(path)
                .map_err(|e| connect_err(format!("TLS file {}: {e}", path.display())))?;
        }
        if let Some(ca) = &auth.tls_ca_file {
            options = options.add_root_certificates(ca.clone());
        }
        if let (Some(cert), Some(key)) = (&auth.tls_cert_file, &auth.tls_key_file) {
            options = options.add_client_certificate(cert.clone(), key.clone());
        }
        if auth.require_tls || url.starts_with("tls://") {
            options = options.require_tls(true);
        }
        let client = options
            .connect(url)
            .await
            .map_err(|e| connect_err(e.to_string()))?;
        Ok(Self { client })
    }

    /// Waits until every message published so far has reached the server.
    pub async fn flush(&self) -> Result<(), TransportError> {
        self.client
            .flush()
            .await
            .map_err(|e| TransportError::Publish(e.to_string()))
    }
}

/// The largest replica message to send to a server announcing
/// `max_payload` (0: none announced, [`FALLBACK_MAX_PAYLOAD`]).
pub fn payload_limit(max_payload: usize) -> usize {
    let max = if max_payload == 0 {
        FALLBACK_MAX_PAYLOAD
    } else {
        max_payload
    };
    max - max / PAYLOAD_MARGIN_DIVISOR
}

impl Transport for NatsTransport {
    fn batching(&self) -> bool {
        true
    }

    fn max_payload(&self) -> usize {
        payload_limit(self.client.server_info().max_payload)
    }

    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), TransportError> {
        self.client
            .publish(subject.to_owned(), payload)
            .await
            .map_err(|e| TransportError::Publish(e.to_string()))
    }

    async fn subscribe(&self, subject: &str) -> Result<Subscription, TransportError> {
        let subscriber = self
            .client
            .subscribe(subject.to_owned())
            .await
            .map_err(|e| TransportError::Subscribe(e.to_string()))?;
        // The subscription is registered once the server has seen the SUB.
        self.flush()
            .await
            .map_err(|e| TransportError::Subscribe(e.to_string()))?;
        Ok(Box::pin(subscriber.map(|message| message.payload)))
    }
}
