//! Replica sync: several router replicas share their bookings over an event
//! plane so each one's load view includes the others'.
//!
//! - [`config`] — [`ReplicaConfig`]: `--replica-sync nats://HOST:PORT` (off
//!   by default), namespace, endpoint, queue and batch limits, expiry,
//!   digest period, and [`NatsAuth`] (user/password, token, credentials
//!   file, TLS).
//! - [`args`] — [`NatsAuthArgs`]: the `--nats-*` flags of [`NatsAuth`],
//!   flattened into `switchyard serve`'s and `switchyard sim-worker`'s.
//! - [`transport`] — the [`Transport`] trait (publish bytes on a subject,
//!   subscribe to one) and its in-process implementation.
//! - [`nats`] — the NATS implementation (`async-nats`, authenticated and
//!   TLS when configured), for more than one machine; its payload limit is
//!   the server's announced `max_payload` less a margin.
//! - [`publisher`] — [`ReplicaPublisher`]: the request path's non-blocking
//!   handle onto a bounded queue, drained by one task that batches, encodes
//!   (splitting by bytes under the payload limit) and publishes; heartbeats
//!   when idle; digests of live bookings every `digest_ms`.
//! - [`signing`] — [`BatchSigner`]: batches signed with a key the
//!   replicas share (HMAC-SHA256), so a client of the NATS server that is
//!   not a replica cannot publish under a replica's name.
//! - [`subscriber`] — the task that refuses oversized and badly signed
//!   messages, decodes peers' batches and applies them
//!   through a [`ReplicaSink`] ([`apply_batch`] is the one way a peer's
//!   batch reaches a core `Dispatcher`; [`DispatcherSink`] is the sink over
//!   a bare dispatcher, the server's lives in its `replica` module), and
//!   expires silent peers; [`publish_effects`] is the one way a
//!   dispatcher's published events reach the wire.
//! - [`nats_server`] — a private `nats-server` for tests and benchmarks.
//! - [`worker_marks`] — a worker-side publisher of `MarkPrefillCompleted`.
//! - [`metrics`] — `switchyard_replica_events_total{direction}` and the
//!   other replica-sync counters, as `prometheus-client` families.
//!
//! Data flow on one replica: request path drives its `Dispatcher` →
//! enqueues the published events on [`ReplicaPublisher`] → publisher task → transport subject
//! `switchyard.<namespace>.<endpoint>.active_sequences` → every peer's
//! subscriber task → [`ReplicaSink::apply_batch`] → the peer's `Dispatcher`
//! (`Dispatcher::apply_replica_batch`). The semantics of remote bookings (advisory, owner-only
//! frees, silence expiry, no snapshot) live in `switchyard_core::replica`.

pub mod args;
pub mod config;
pub mod metrics;
pub mod nats;
pub mod nats_server;
pub mod publisher;
pub mod signing;
pub mod subscriber;
pub mod transport;
pub mod worker_marks;

#[cfg(test)]
mod tests;

pub use args::NatsAuthArgs;
pub use config::{NatsAuth, ReplicaConfig, ReplicaConfigError, Secret};
pub use metrics::ReplicaMetrics;
pub use nats::{payload_limit, NatsTransport};
pub use nats_server::LocalNatsServer;
pub use publisher::{spawn_publisher, PublishError, ReplicaPublisher};
pub use signing::BatchSigner;
pub use subscriber::{
    apply_batch, publish_effects, spawn_digests, spawn_subscriber, BatchReport, DispatcherSink,
    EffectsHandler, ReplicaSink,
};
pub use transport::{InProcessBus, InProcessTransport, Subscription, Transport, TransportError};
pub use worker_marks::{routed_request_id, WorkerMarks, REQUEST_ID_HEADER, ROUTER_ID_HEADER};

use std::sync::Arc;
use std::time::{Duration, Instant};
use switchyard_core::{ReplicaId, WorkerId};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// A fresh random replica id.
pub fn random_replica_id() -> ReplicaId {
    use rand::{RngCore, SeedableRng};
    ReplicaId(rand::rngs::StdRng::from_entropy().next_u64())
}

/// The [`WorkerId`] every replica (and the worker itself) gives the worker
/// named `name`. Replica events name workers by id, so an id must not
/// depend on the order in which a replica learned its workers: it is the
/// FNV-1a 64-bit hash of the name's bytes, stable across processes, builds
/// and platforms (unlike `std`'s hasher).
pub fn worker_id_for_name(name: &str) -> WorkerId {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let hash = name
        .bytes()
        .fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME));
    WorkerId::new(hash)
}

/// A running replica plane: the publisher handle for the request path, and
/// both tasks. Dropping it cancels the tasks.
#[derive(Debug)]
pub struct ReplicaPlane {
    /// This replica's id.
    pub id: ReplicaId,
    /// Enqueue local events here (cheap to clone).
    pub publisher: ReplicaPublisher,
    /// Counters of both directions.
    pub metrics: Arc<ReplicaMetrics>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    batch_delay: Duration,
}

impl ReplicaPlane {
    /// Starts the publisher and the subscriber of replica `id` over
    /// `transport`, applying peers' batches to `sink`.
    pub async fn start<T: Transport, S: ReplicaSink>(
        transport: Arc<T>,
        config: &ReplicaConfig,
        id: ReplicaId,
        sink: S,
    ) -> Result<Self, TransportError> {
        // A configured key that cannot be used stops the start, rather
        // than a plane that sends and accepts nothing.
        config.signer().map_err(TransportError::Connect)?;
        let metrics = Arc::new(ReplicaMetrics::default());
        let cancel = CancellationToken::new();
        let subject = config.subject();
        let sink = Arc::new(sink);
        let subscriber = spawn_subscriber(
            transport.clone(),
            &subject,
            id,
            sink.clone(),
            config,
            metrics.clone(),
            cancel.clone(),
        )
        .await?;
        let (publisher, task) = spawn_publisher(
            transport,
            subject,
            id,
            config,
            metrics.clone(),
            cancel.clone(),
        );
        let digests = spawn_digests(sink, publisher.clone(), config, cancel.clone());
        Ok(Self {
            id,
            publisher,
            metrics,
            cancel,
            tasks: vec![subscriber, task, digests],
            batch_delay: Duration::from_secs_f64(config.batch_max_delay_ms / 1e3),
        })
    }

    /// Best effort before [`Self::shutdown`]: waits (at most `grace`) until
    /// the queue is empty, then one batch delay for the last batch to go
    /// out, so that peers see the frees of a replica stopping gracefully
    /// instead of waiting for its silence expiry.
    pub async fn flush(&self, grace: Duration) {
        let deadline = Instant::now() + grace;
        while self.publisher.queued() > 0 && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let rest = deadline.saturating_duration_since(Instant::now());
        tokio::time::sleep(rest.min(self.batch_delay + Duration::from_millis(10))).await;
    }

    /// Stops both tasks promptly (an in-flight publish is dropped) and
    /// waits for them.
    pub async fn shutdown(mut self) {
        self.cancel.cancel();
        for task in self.tasks.drain(..) {
            let _ = task.await;
        }
    }
}

impl Drop for ReplicaPlane {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}
