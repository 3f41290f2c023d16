//! The subscriber: peers' batches into the local routing state.
//!
//! One task per replica decodes each message, ignores its own batches, and
//! hands the rest to a [`ReplicaSink`]; every `expiry_check_ms` it asks the
//! sink to free the bookings of silent peers. Malformed messages are counted
//! and skipped.

use super::config::ReplicaConfig;
use super::metrics::ReplicaMetrics;
use super::transport::{Transport, TransportError};
use super::Clock;
use futures_util::StreamExt as _;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use switchyard_core::{ReplicaId, Router};
use switchyard_wire::replica::{decode_batch, ReplicaBatch, SessionBinding};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What applying one batch did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchReport {
    /// Lifecycle events that changed the local model.
    pub applied: u64,
    /// Session bindings handed to the admission strategy.
    pub sessions_applied: u64,
}

/// Where peers' events go: the server implements it over its shared
/// routing state (`server::replica`), and [`RouterSink`] over a bare
/// `Arc<Mutex<Router>>` (the plane on its own: tests, `bench replica`).
/// Calls are short and synchronous; they run on the subscriber task.
pub trait ReplicaSink: Send + Sync + 'static {
    /// Applies a peer's batch (never one of this replica's own); an empty
    /// batch is a heartbeat.
    fn apply_batch(&self, batch: &ReplicaBatch) -> BatchReport;

    /// Frees the bookings of peers silent past the expiry; returns how many.
    fn expire_silent(&self) -> u64;
}

/// Applies a peer's lifecycle events to `router` (the sender's heartbeat
/// first, then each event in order); returns how many changed the model.
/// Every [`ReplicaSink`] over a `Router` goes through here. Session
/// bindings are the caller's: they belong to its admission strategy.
pub fn apply_events(router: &mut Router, batch: &ReplicaBatch, now_ms: f64) -> u64 {
    router.replica_heartbeat(batch.router_id, now_ms);
    let mut applied = 0;
    for event in &batch.events {
        let outcome = router.apply_remote(event.router_id, &event.to_sequence_event(), now_ms);
        applied += u64::from(outcome.applied());
    }
    applied
}

/// Applies a session binding (the server's admission strategy).
pub type SessionHook = Box<dyn Fn(&SessionBinding, f64) + Send + Sync>;

/// [`ReplicaSink`] over a `Router` behind a `std::sync::Mutex`, with the
/// replica's clock (the one its request path passes as `now_ms`) and an
/// optional session-binding hook: the replica plane without a server.
pub struct RouterSink {
    router: Arc<Mutex<Router>>,
    clock: Clock,
    sessions: Option<SessionHook>,
}

impl std::fmt::Debug for RouterSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RouterSink")
            .field("clock", &self.clock)
            .field("session_hook", &self.sessions.is_some())
            .finish_non_exhaustive()
    }
}

impl RouterSink {
    /// A sink over `router`; sets the router's replica id to `id` so that
    /// its own events are ignored at the core too.
    pub fn new(router: Arc<Mutex<Router>>, id: ReplicaId, clock: Clock) -> Self {
        router
            .lock()
            .expect("router lock poisoned")
            .set_replica_id(id);
        Self {
            router,
            clock,
            sessions: None,
        }
    }

    /// Session bindings go to `hook` (say, an admission strategy's
    /// `observe_remote_binding(..)`).
    pub fn with_session_hook(mut self, hook: SessionHook) -> Self {
        self.sessions = Some(hook);
        self
    }
}

impl ReplicaSink for RouterSink {
    fn apply_batch(&self, batch: &ReplicaBatch) -> BatchReport {
        let now_ms = self.clock.now_ms();
        let applied = apply_events(
            &mut self.router.lock().expect("router lock poisoned"),
            batch,
            now_ms,
        );
        let mut report = BatchReport {
            applied,
            sessions_applied: 0,
        };
        if let Some(hook) = &self.sessions {
            for binding in &batch.sessions {
                hook(binding, now_ms);
                report.sessions_applied += 1;
            }
        }
        report
    }

    fn expire_silent(&self) -> u64 {
        let now_ms = self.clock.now_ms();
        let mut router = self.router.lock().expect("router lock poisoned");
        router.expire_silent_replicas(now_ms).len() as u64
    }
}

/// Subscribes replica `id` to `subject` (live when this returns) and starts
/// the task that applies peers' batches to `sink`.
pub async fn spawn_subscriber<T: Transport, S: ReplicaSink>(
    transport: T,
    subject: &str,
    id: ReplicaId,
    sink: S,
    config: &ReplicaConfig,
    metrics: Arc<ReplicaMetrics>,
    cancel: CancellationToken,
) -> Result<JoinHandle<()>, TransportError> {
    let mut subscription = transport.subscribe(subject).await?;
    let check = Duration::from_secs_f64(config.expiry_check_ms / 1e3);
    Ok(tokio::spawn(async move {
        let mut expiry = tokio::time::interval(check);
        expiry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                _ = expiry.tick() => {
                    ReplicaMetrics::add(&metrics.expired, sink.expire_silent());
                }
                payload = subscription.next() => {
                    let Some(payload) = payload else { return };
                    let batch = match decode_batch(&payload) {
                        Ok(batch) => batch,
                        Err(_) => {
                            ReplicaMetrics::add(&metrics.batches_malformed, 1);
                            continue;
                        }
                    };
                    if batch.router_id == id {
                        ReplicaMetrics::add(&metrics.batches_own, 1);
                        continue;
                    }
                    ReplicaMetrics::add(&metrics.batches_received, 1);
                    ReplicaMetrics::add(&metrics.received, batch.events.len() as u64);
                    let report = sink.apply_batch(&batch);
                    ReplicaMetrics::add(&metrics.applied, report.applied);
                    ReplicaMetrics::add(&metrics.sessions_applied, report.sessions_applied);
                }
            }
        }
    }))
}
