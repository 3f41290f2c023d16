//! The [`Transport`] contract and the in-process implementation.
//!
//! A transport publishes opaque payloads on a subject and delivers every
//! payload published on a subject to each of its subscribers, in publish
//! order per publisher. Nothing here knows the payload format.

use bytes::Bytes;
use futures_util::stream::BoxStream;
use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// A stream of payloads on one subject.
pub type Subscription = BoxStream<'static, Bytes>;

/// A transport failed.
#[derive(Debug, Clone, thiserror::Error)]
pub enum TransportError {
    /// Could not connect.
    #[error("connecting to the replica plane: {0}")]
    Connect(String),
    /// A publish failed.
    #[error("publishing on the replica plane: {0}")]
    Publish(String),
    /// A subscription failed.
    #[error("subscribing to the replica plane: {0}")]
    Subscribe(String),
}

/// Moves payloads between replicas.
pub trait Transport: Send + Sync + 'static {
    /// Whether one message may carry many events. Transports that carry one
    /// event per message get batches of one.
    fn batching(&self) -> bool;

    /// The largest payload to publish in one message (the publisher
    /// splits batches to stay within it). Unbounded by default.
    fn max_payload(&self) -> usize {
        usize::MAX
    }

    /// Publishes one payload. May wait (back-pressure); the publisher task
    /// abandons the future on shutdown, so it must be cancel-safe in the
    /// sense that dropping it loses at most this payload.
    fn publish(
        &self,
        subject: &str,
        payload: Bytes,
    ) -> impl Future<Output = Result<(), TransportError>> + Send;

    /// Subscribes to a subject; payloads published after this returns are
    /// delivered.
    fn subscribe(
        &self,
        subject: &str,
    ) -> impl Future<Output = Result<Subscription, TransportError>> + Send;
}

impl<T: Transport> Transport for Arc<T> {
    fn batching(&self) -> bool {
        (**self).batching()
    }
    fn max_payload(&self) -> usize {
        (**self).max_payload()
    }
    fn publish(
        &self,
        subject: &str,
        payload: Bytes,
    ) -> impl Future<Output = Result<(), TransportError>> + Send {
        (**self).publish(subject, payload)
    }
    fn subscribe(
        &self,
        subject: &str,
    ) -> impl Future<Output = Result<Subscription, TransportError>> + Send {
        (**self).subscribe(subject)
    }
}

/// Subject → subscribers' inboxes, shared by every [`InProcessTransport`]
/// made from it: replicas in one process need no broker.
#[derive(Debug, Default)]
pub struct InProcessBus {
    subjects: Mutex<HashMap<String, Vec<mpsc::Sender<Bytes>>>>,
}

impl InProcessBus {
    /// An empty bus.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }
}

/// One replica's handle on an [`InProcessBus`]. Each subscriber's inbox
/// holds `inbox_capacity` payloads; a publisher waits while one is full
/// (back-pressure, like a slow network), which is what lets tests block it.
#[derive(Debug, Clone)]
pub struct InProcessTransport {
    bus: Arc<InProcessBus>,
    batching: bool,
    inbox_capacity: usize,
    max_payload: usize,
}

impl InProcessTransport {
    /// A handle on `bus`; `batching` false makes it a singleton transport.
    pub fn new(bus: Arc<InProcessBus>, batching: bool, inbox_capacity: usize) -> Self {
        Self {
            bus,
            batching,
            inbox_capacity: inbox_capacity.max(1),
            max_payload: usize::MAX,
        }
    }

    /// Refuses payloads larger than `bytes`, as a NATS server does past
    /// its `max_payload`.
    pub fn with_max_payload(mut self, bytes: usize) -> Self {
        self.max_payload = bytes;
        self
    }
}

impl Transport for InProcessTransport {
    fn batching(&self) -> bool {
        self.batching
    }

    fn max_payload(&self) -> usize {
        self.max_payload
    }

    async fn publish(&self, subject: &str, payload: Bytes) -> Result<(), TransportError> {
        if payload.len() > self.max_payload {
            return Err(TransportError::Publish(format!(
                "payload of {} bytes over the limit of {}",
                payload.len(),
                self.max_payload
            )));
        }
        let inboxes: Vec<mpsc::Sender<Bytes>> = {
            let mut subjects = self.bus.subjects.lock().expect("bus lock poisoned");
            let Some(inboxes) = subjects.get_mut(subject) else {
                return Ok(());
            };
            inboxes.retain(|tx| !tx.is_closed());
            inboxes.clone()
        };
        for inbox in inboxes {
            // A subscriber that went away between the lookup and the send
            // just misses the payload.
            let _ = inbox.send(payload.clone()).await;
        }
        Ok(())
    }

    async fn subscribe(&self, subject: &str) -> Result<Subscription, TransportError> {
        let (tx, rx) = mpsc::channel(self.inbox_capacity);
        self.bus
            .subjects
            .lock()
            .expect("bus lock poisoned")
            .entry(subject.to_owned())
            .or_default()
            .push(tx);
        Ok(Box::pin(futures_util::stream::unfold(rx, |mut rx| async {
            rx.recv().await.map(|payload| (payload, rx))
        })))
    }
}
