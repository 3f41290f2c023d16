//! The subscriber: peers' batches into the local routing state.
//!
//! One task per replica refuses messages over `max_batch_bytes` and,
//! when the plane signs, messages without a valid signature (each
//! counted, see [`crate::signing`]), decodes each message, ignores its own batches (a
//! forged batch claiming this replica's id changes nothing), and hands the
//! rest to a [`ReplicaSink`]; every `expiry_check_ms` it asks the sink to
//! free the bookings of silent peers. Malformed messages are counted and
//! skipped. What a peer's batch may change is checked in the core
//! (`switchyard_core::replica`: clamps, origins, unknown workers, caps);
//! its drops and clamps are counted here ([`ReplicaMetrics::record_remote`]).
//! [`spawn_digests`] publishes this replica's digest of live bookings.

use super::config::ReplicaConfig;
use super::metrics::ReplicaMetrics;
use super::publisher::ReplicaPublisher;
use super::signing::{BatchSigner, Refusal};
use super::transport::{Transport, TransportError};
use futures_util::StreamExt as _;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use switchyard_core::dispatch::{DigestPart, Dispatcher, Effects, Published, SessionBound};
use switchyard_core::replica::RemoteCounters;
use switchyard_core::sequences::SequenceEvent;
use switchyard_core::{ReplicaId, RequestId};
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
    /// What the batch added to the core's remote-booking counters: drops
    /// by reason, clamps, digest frees, session evictions.
    pub remote: RemoteCounters,
}

/// Where peers' events go: the server implements it over its shared
/// routing state, and [`DispatcherSink`] over a bare dispatcher (the plane
/// on its own: tests, `bench replica`); both through [`apply_batch`].
/// Calls are short and synchronous; they run on the subscriber task.
pub trait ReplicaSink: Send + Sync + 'static {
    /// Applies a peer's batch (never one of this replica's own); an empty
    /// batch is a heartbeat.
    fn apply_batch(&self, batch: &ReplicaBatch) -> BatchReport;

    /// Frees the bookings of peers silent past the expiry; returns how many.
    fn expire_silent(&self) -> u64;

    /// The request ids of this replica's live bookings (for its digest).
    fn local_bookings(&self) -> Vec<RequestId>;
}

impl<S: ReplicaSink> ReplicaSink for Arc<S> {
    fn apply_batch(&self, batch: &ReplicaBatch) -> BatchReport {
        (**self).apply_batch(batch)
    }
    fn expire_silent(&self) -> u64 {
        (**self).expire_silent()
    }
    fn local_bookings(&self) -> Vec<RequestId> {
        (**self).local_bookings()
    }
}

/// Applies a peer's batch to `dispatcher` — remote bookings (keyed by the
/// origin each event names), the sender's heartbeat, session bindings into
/// the admission strategy — and returns what it applied and the effects
/// the driver must carry out (a peer's free may place a waiting request).
/// Every [`ReplicaSink`] goes through here: the one path from the wire
/// into the core.
pub fn apply_batch(
    dispatcher: &mut Dispatcher,
    batch: &ReplicaBatch,
    now_ms: f64,
) -> (BatchReport, Effects) {
    let events = batch
        .events
        .iter()
        .map(|e| (e.router_id, e.to_sequence_event()));
    let bindings = batch.sessions.iter().map(|b| SessionBound {
        session: b.session,
        worker: b.worker,
        context_tokens: b.context_tokens,
    });
    let digest = batch.digest.as_ref().map(|d| DigestPart {
        lo: d.lo,
        hi: d.hi,
        live: &d.live,
    });
    let (applied, fx) =
        dispatcher.apply_replica_batch(batch.router_id, events, bindings, digest, now_ms);
    let report = BatchReport {
        applied: applied.applied,
        sessions_applied: applied.sessions,
        remote: applied.remote,
    };
    (report, fx)
}

/// Enqueues what a dispatcher published ([`Effects::publish`],
/// [`Effects::bindings`]) on `publisher`, in order. Never blocks; a refused
/// enqueue was counted (and its log rate-limited) by the publisher.
pub fn publish_effects(
    publisher: &ReplicaPublisher,
    published: &[Published],
    bindings: &[SessionBound],
) {
    for p in published {
        let _ = match &p.event {
            SequenceEvent::Add(add) => publisher.added(add, None),
            SequenceEvent::MarkPrefillCompleted(id) => publisher.prefill_completed(*id, p.worker),
            SequenceEvent::Free(id) => publisher.freed(*id, p.worker),
        };
    }
    for b in bindings {
        let _ = publisher.session_bound(SessionBinding {
            session: b.session,
            worker: b.worker,
            context_tokens: b.context_tokens,
        });
    }
}

/// What a [`DispatcherSink`] does with the effects of a peer's batch.
pub type EffectsHandler = Box<dyn Fn(Effects) + Send + Sync>;

/// [`ReplicaSink`] over a bare [`Dispatcher`] behind a `std::sync::Mutex`:
/// the replica plane without a server (tests, `bench replica`). Its clock
/// is milliseconds since `epoch`, which must be the clock the dispatcher's
/// other callers use; the effects of each batch go to `on_effects`.
pub struct DispatcherSink {
    dispatcher: Arc<Mutex<Dispatcher>>,
    epoch: Instant,
    on_effects: EffectsHandler,
}

impl std::fmt::Debug for DispatcherSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DispatcherSink").finish_non_exhaustive()
    }
}

impl DispatcherSink {
    /// A sink over `dispatcher`, which becomes replica `id` (its own
    /// events are then ignored at the core too).
    pub fn new(
        dispatcher: Arc<Mutex<Dispatcher>>,
        id: ReplicaId,
        epoch: Instant,
        on_effects: EffectsHandler,
    ) -> Self {
        lock(&dispatcher).set_replica(id);
        Self {
            dispatcher,
            epoch,
            on_effects,
        }
    }

    fn now_ms(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1e3
    }
}

fn lock(dispatcher: &Mutex<Dispatcher>) -> std::sync::MutexGuard<'_, Dispatcher> {
    dispatcher.lock().unwrap_or_else(|p| p.into_inner())
}

impl ReplicaSink for DispatcherSink {
    fn apply_batch(&self, batch: &ReplicaBatch) -> BatchReport {
        let now_ms = self.now_ms();
        let (report, fx) = apply_batch(&mut lock(&self.dispatcher), batch, now_ms);
        (self.on_effects)(fx);
        report
    }

    fn expire_silent(&self) -> u64 {
        let now_ms = self.now_ms();
        let fx = lock(&self.dispatcher).tick(now_ms);
        let expired = u64::from(fx.counts.expired_remote);
        (self.on_effects)(fx);
        expired
    }

    fn local_bookings(&self) -> Vec<RequestId> {
        lock(&self.dispatcher).local_booking_ids()
    }
}

/// Starts the task that, every `digest_ms`, enqueues a digest of the
/// sink's live local bookings on `publisher` (after whatever is queued).
pub fn spawn_digests<S: ReplicaSink>(
    sink: S,
    publisher: ReplicaPublisher,
    config: &ReplicaConfig,
    cancel: CancellationToken,
) -> JoinHandle<()> {
    let period = Duration::from_secs_f64(config.digest_ms / 1e3);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + period, period);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                _ = tick.tick() => {
                    // A full queue drops the digest (counted); the next
                    // one comes a period later.
                    let _ = publisher.digest(sink.local_bookings());
                }
            }
        }
    })
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
    let signer = config.signer().unwrap_or_else(BatchSigner::Unreadable);
    let max_message = config.max_batch_bytes + signer.overhead();
    let subject = subject.to_owned();
    let mut subscription = transport.subscribe(&subject).await?;
    let check = Duration::from_secs_f64(config.expiry_check_ms / 1e3);
    Ok(tokio::spawn(async move {
        let mut expiry = tokio::time::interval(check);
        expiry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                biased;
                () = cancel.cancelled() => return,
                _ = expiry.tick() => {
                    metrics.expired.inc_by(sink.expire_silent());
                }
                payload = subscription.next() => {
                    let Some(payload) = payload else { return };
                    if payload.len() > max_message {
                        metrics.batches_oversized.inc();
                        continue;
                    }
                    let body = match signer.open(&subject, &payload) {
                        Ok(body) => body,
                        Err(Refusal::Unsigned) => {
                            metrics.batches_unsigned.inc();
                            continue;
                        }
                        Err(Refusal::BadSignature) => {
                            metrics.batches_bad_signature.inc();
                            continue;
                        }
                    };
                    let batch = match decode_batch(body) {
                        Ok(batch) => batch,
                        Err(_) => {
                            metrics.batches_malformed.inc();
                            continue;
                        }
                    };
                    if batch.router_id == id {
                        metrics.batches_own.inc();
                        continue;
                    }
                    metrics.batches_received.inc();
                    metrics.received.inc_by(batch.events.len() as u64);
                    metrics.digests_received.inc_by(u64::from(batch.digest.is_some()));
                    let report = sink.apply_batch(&batch);
                    metrics.applied.inc_by(report.applied);
                    metrics.sessions_applied.inc_by(report.sessions_applied);
                    metrics.record_remote(&report.remote);
                }
            }
        }
    }))
}
