//! The publisher: the request path enqueues, one task publishes.
//!
//! Contract for the request path: mutate the local `Router` first, then call
//! a [`ReplicaPublisher`] method. It never awaits and never blocks: when the
//! bounded queue is full the newest event is dropped, counted and logged
//! (with its request id and the capacity), and the call returns
//! [`PublishError::QueueFull`] for the caller to ignore or count.
//!
//! The task drains the queue in order (one queue, one task: per-request
//! order is the enqueue order), batches up to `batch_max_events` or
//! `batch_max_delay_ms` whichever comes first (singletons on a transport
//! that does not batch), and sends a heartbeat after `heartbeat_ms` idle.
//! Cancellation ends it promptly: an in-flight publish is abandoned and its
//! events counted as dropped.

use super::config::ReplicaConfig;
use super::metrics::ReplicaMetrics;
use super::transport::Transport;
use bytes::Bytes;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use switchyard_core::sequences::{AddRequest, SequenceEvent};
use switchyard_core::{ReplicaId, RequestId, WorkerId};
use switchyard_wire::replica::{
    encode_batch_into, ActiveSequenceEvent, ReplicaBatch, SessionBinding,
};
use tokio::sync::mpsc::{self, error::TrySendError};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Why an event was not enqueued.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PublishError {
    /// The queue was full: this (the newest) event was dropped.
    #[error(
        "replica event queue full (capacity {capacity}): dropped the newest event, for request {request_id}"
    )]
    QueueFull {
        /// The dropped event's request (zero for a session binding).
        request_id: RequestId,
        /// The queue's capacity.
        capacity: usize,
    },
    /// The publisher task is gone.
    #[error("{}", if *during_shutdown {
        "replica event queue closed during shutdown"
    } else {
        "replica event queue closed while not shutting down: the publisher task ended unexpectedly"
    })]
    Closed {
        /// Whether the plane was being shut down.
        during_shutdown: bool,
    },
}

#[derive(Debug)]
enum Outgoing {
    Event(ActiveSequenceEvent),
    Session(SessionBinding),
}

/// The request path's handle: cheap to clone, every method non-blocking.
#[derive(Debug, Clone)]
pub struct ReplicaPublisher {
    tx: mpsc::Sender<Outgoing>,
    id: ReplicaId,
    capacity: usize,
    metrics: Arc<ReplicaMetrics>,
    cancel: CancellationToken,
    last_drop_log: Arc<AtomicU64>,
}

impl ReplicaPublisher {
    /// This replica's id (stamped on every event).
    pub fn id(&self) -> ReplicaId {
        self.id
    }

    /// The counters this publisher updates.
    pub fn metrics(&self) -> &Arc<ReplicaMetrics> {
        &self.metrics
    }

    /// Events waiting in the queue now.
    pub fn queued(&self) -> usize {
        self.tx.max_capacity() - self.tx.capacity()
    }

    /// Enqueues a booking (call after `Router::book` applied it).
    pub fn added(&self, add: &AddRequest, lora_name: Option<String>) -> Result<(), PublishError> {
        self.publish(ActiveSequenceEvent::add(self.id, add, lora_name))
    }

    /// Enqueues a prefill completion.
    pub fn prefill_completed(
        &self,
        request: RequestId,
        worker: WorkerId,
    ) -> Result<(), PublishError> {
        self.publish(ActiveSequenceEvent::from_sequence_event(
            self.id,
            worker,
            &SequenceEvent::MarkPrefillCompleted(request),
            None,
        ))
    }

    /// Enqueues a free.
    pub fn freed(&self, request: RequestId, worker: WorkerId) -> Result<(), PublishError> {
        self.publish(ActiveSequenceEvent::from_sequence_event(
            self.id,
            worker,
            &SequenceEvent::Free(request),
            None,
        ))
    }

    /// Enqueues a session binding (a session's turn was dispatched).
    pub fn session_bound(&self, binding: SessionBinding) -> Result<(), PublishError> {
        self.enqueue(Outgoing::Session(binding), RequestId(0))
    }

    /// Enqueues any event.
    pub fn publish(&self, event: ActiveSequenceEvent) -> Result<(), PublishError> {
        let id = event.request_id;
        self.enqueue(Outgoing::Event(event), id)
    }

    fn enqueue(&self, item: Outgoing, request_id: RequestId) -> Result<(), PublishError> {
        match self.tx.try_send(item) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                self.metrics.dropped.inc();
                let err = PublishError::QueueFull {
                    request_id,
                    capacity: self.capacity,
                };
                self.log_drop(&err);
                Err(err)
            }
            Err(TrySendError::Closed(_)) => Err(PublishError::Closed {
                during_shutdown: self.cancel.is_cancelled(),
            }),
        }
    }

    /// Logs at most one drop a second (each line names the request and the
    /// capacity, plus the running count), so a full queue cannot flood the
    /// log from the request path.
    fn log_drop(&self, err: &PublishError) {
        let now_s = epoch_seconds();
        let last = self.last_drop_log.load(Ordering::Relaxed);
        if now_s > last
            && self
                .last_drop_log
                .compare_exchange(last, now_s, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            eprintln!(
                "switchyard: {err} ({} replica events dropped so far)",
                self.metrics.dropped.get()
            );
        }
    }
}

fn epoch_seconds() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Starts the publisher task of replica `id` on `subject`. The task ends
/// when `cancel` fires or every handle is dropped.
pub fn spawn_publisher<T: Transport>(
    transport: T,
    subject: String,
    id: ReplicaId,
    config: &ReplicaConfig,
    metrics: Arc<ReplicaMetrics>,
    cancel: CancellationToken,
) -> (ReplicaPublisher, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(config.queue_capacity);
    let max_events = if transport.batching() {
        config.batch_max_events
    } else {
        1
    };
    let task = PublisherTask {
        transport,
        subject,
        id,
        rx,
        max_events,
        max_delay: Duration::from_secs_f64(config.batch_max_delay_ms / 1e3),
        heartbeat: Duration::from_secs_f64(config.heartbeat_ms / 1e3),
        metrics: metrics.clone(),
        cancel: cancel.clone(),
    };
    let handle = tokio::spawn(task.run());
    (
        ReplicaPublisher {
            tx,
            id,
            capacity: config.queue_capacity,
            metrics,
            cancel,
            last_drop_log: Arc::new(AtomicU64::new(0)),
        },
        handle,
    )
}

struct PublisherTask<T> {
    transport: T,
    subject: String,
    id: ReplicaId,
    rx: mpsc::Receiver<Outgoing>,
    max_events: usize,
    max_delay: Duration,
    heartbeat: Duration,
    metrics: Arc<ReplicaMetrics>,
    cancel: CancellationToken,
}

impl<T: Transport> PublisherTask<T> {
    async fn run(mut self) {
        let mut batch = ReplicaBatch::heartbeat(self.id);
        let mut buf = Vec::with_capacity(64 * 1024);
        loop {
            let first = tokio::select! {
                biased;
                () = self.cancel.cancelled() => return,
                first = tokio::time::timeout(self.heartbeat, self.rx.recv()) => first,
            };
            match first {
                Err(_idle) => {}
                Ok(None) => return,
                Ok(Some(item)) => {
                    push(&mut batch, item);
                    if !self.fill(&mut batch).await {
                        return;
                    }
                }
            }
            buf.clear();
            encode_batch_into(&batch, &mut buf);
            let events = batch.events.len() as u64;
            let sessions = batch.sessions.len() as u64;
            let payload = Bytes::copy_from_slice(&buf);
            let sent = tokio::select! {
                biased;
                () = self.cancel.cancelled() => {
                    self.metrics.dropped.inc_by(events);
                    return;
                }
                sent = self.transport.publish(&self.subject, payload) => sent,
            };
            match sent {
                Ok(()) => {
                    self.metrics.published.inc_by(events);
                    self.metrics.sessions_published.inc_by(sessions);
                    self.metrics.batches_published.inc();
                }
                Err(err) => {
                    self.metrics.dropped.inc_by(events);
                    eprintln!("switchyard: dropped {events} replica events: {err}");
                }
            }
            batch.events.clear();
            batch.sessions.clear();
        }
    }

    /// Adds queued items until the batch is full or `max_delay` has passed
    /// since its first item. `false` when the task must end.
    async fn fill(&mut self, batch: &mut ReplicaBatch) -> bool {
        if self.max_events <= 1 {
            return true;
        }
        let deadline = Instant::now() + self.max_delay;
        while len(batch) < self.max_events {
            // Take what is queued without waiting first.
            match self.rx.try_recv() {
                Ok(item) => {
                    push(batch, item);
                    continue;
                }
                Err(mpsc::error::TryRecvError::Disconnected) => return true,
                Err(mpsc::error::TryRecvError::Empty) => {}
            }
            tokio::select! {
                biased;
                () = self.cancel.cancelled() => {
                    self.metrics.dropped.inc_by(batch.events.len() as u64);
                    return false;
                }
                () = tokio::time::sleep_until(deadline.into()) => return true,
                item = self.rx.recv() => match item {
                    Some(item) => push(batch, item),
                    None => return true,
                },
            }
        }
        true
    }
}

fn len(batch: &ReplicaBatch) -> usize {
    batch.events.len() + batch.sessions.len()
}

fn push(batch: &mut ReplicaBatch, item: Outgoing) {
    match item {
        Outgoing::Event(event) => batch.events.push(event),
        Outgoing::Session(binding) => batch.sessions.push(binding),
    }
}
