//! The NATS transport (`async-nats`, core pub/sub, no JetStream): the
//! replica plane across machines.
//!
//! NATS delivers a connection's messages on a subject in publish order,
//! which keeps per-request order (add, mark, free) from one replica.
//! Messages up to the server's `max_payload` (1 MiB by default) carry a
//! whole batch, so this transport batches.

use super::transport::{Subscription, Transport, TransportError};
use bytes::Bytes;
use futures_util::StreamExt as _;

/// A NATS connection.
#[derive(Debug, Clone)]
pub struct NatsTransport {
    client: async_nats::Client,
}

impl NatsTransport {
    /// Connects to `url` (`nats://HOST:PORT`).
    pub async fn connect(url: &str) -> Result<Self, TransportError> {
        let client = async_nats::ConnectOptions::new()
            .name("switchyard-replica")
            .connect(url)
            .await
            .map_err(|e| TransportError::Connect(format!("{url}: {e}")))?;
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

impl Transport for NatsTransport {
    fn batching(&self) -> bool {
        true
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
