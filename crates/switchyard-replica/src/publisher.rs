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
//! that does not batch), splits a batch whose encoding would exceed the
//! transport's payload limit into several messages (in order), and sends
//! a heartbeat after `heartbeat_ms` idle. A digest of live bookings is
//! published after everything queued before it, in parts that each fit
//! one message.
//! Cancellation ends it promptly: an in-flight publish is abandoned and its
//! events counted as dropped.

use super::config::ReplicaConfig;
use super::metrics::ReplicaMetrics;
use super::signing::BatchSigner;
use super::transport::Transport;
use bytes::Bytes;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use switchyard_core::sequences::{AddRequest, SequenceEvent};
use switchyard_core::{ReplicaId, RequestId, WorkerId};
use switchyard_wire::replica::{
    encode_batch_into, ActiveSequenceData, ActiveSequenceEvent, DigestPart, ReplicaBatch,
    SessionBinding, StoredResponse,
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
    Response(StoredResponse),
    /// The request ids of every live local booking, at one instant.
    Digest(Vec<RequestId>),
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

    /// Enqueues a stored response's worker (a `/v1/responses` answer).
    pub fn response_stored(&self, stored: StoredResponse) -> Result<(), PublishError> {
        self.enqueue(Outgoing::Response(stored), RequestId(0))
    }

    /// Enqueues a digest of this replica's live bookings (their request
    /// ids): the task publishes it after everything queued before it, in
    /// parts that each fit one message.
    pub fn digest(&self, live: Vec<RequestId>) -> Result<(), PublishError> {
        self.enqueue(Outgoing::Digest(live), RequestId(0))
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
    let signer = config.signer().unwrap_or_else(|why| {
        eprintln!("switchyard: replica batches will not be sent: {why}");
        BatchSigner::Unreadable(why)
    });
    let task = PublisherTask {
        transport,
        subject,
        id,
        rx,
        max_events,
        max_batch_bytes: config.max_batch_bytes,
        signer,
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
    /// Largest message, signature aside (peers refuse larger ones).
    max_batch_bytes: usize,
    signer: BatchSigner,
    max_delay: Duration,
    heartbeat: Duration,
    metrics: Arc<ReplicaMetrics>,
    cancel: CancellationToken,
}

impl<T: Transport> PublisherTask<T> {
    /// The largest encoded batch one message may carry: under the
    /// transport's limit with the signature, and under what peers accept.
    fn payload_limit(&self) -> usize {
        self.transport
            .max_payload()
            .saturating_sub(self.signer.overhead())
            .min(self.max_batch_bytes)
    }

    async fn run(mut self) {
        let mut batch = ReplicaBatch::heartbeat(self.id);
        loop {
            let first = tokio::select! {
                biased;
                () = self.cancel.cancelled() => return,
                first = tokio::time::timeout(self.heartbeat, self.rx.recv()) => first,
            };
            let mut digest = None;
            match first {
                Err(_idle) => {}
                Ok(None) => return,
                Ok(Some(Outgoing::Digest(live))) => digest = Some(live),
                Ok(Some(item)) => {
                    push(&mut batch, item);
                    if !self.fill(&mut batch, &mut digest).await {
                        return;
                    }
                }
            }
            // A digest alone needs no heartbeat before it.
            let heartbeat_only = batch.is_heartbeat();
            if (digest.is_none() || !heartbeat_only) && !self.send(&batch).await {
                return;
            }
            batch.events.clear();
            batch.sessions.clear();
            batch.responses.clear();
            if let Some(live) = digest {
                if !self.send_digest(live).await {
                    return;
                }
            }
        }
    }

    /// Publishes `batch` in as many messages as the transport's payload
    /// limit needs, in order. `false` when the task must end.
    async fn send(&mut self, batch: &ReplicaBatch) -> bool {
        let limit = self.payload_limit();
        if !batch.responses.is_empty() {
            // Stored responses go in messages of their own, each a few
            // hundred bytes at most an entry (ids are at most 128 bytes).
            for chunk in batch.responses.chunks((limit / 256).max(1)) {
                let only = ReplicaBatch {
                    responses: chunk.to_vec(),
                    ..ReplicaBatch::heartbeat(self.id)
                };
                let mut buf = Vec::new();
                encode_batch_into(&only, &mut buf);
                if buf.len() > limit {
                    self.metrics.dropped.inc_by(chunk.len() as u64);
                    continue;
                }
                let message = Encoded {
                    payload: Bytes::from(buf),
                    events: 0,
                    sessions: 0,
                    digest: false,
                };
                if !self.publish(message).await {
                    return false;
                }
            }
            if batch.events.is_empty() && batch.sessions.is_empty() {
                return true;
            }
            let rest = ReplicaBatch {
                responses: Vec::new(),
                ..batch.clone()
            };
            return self.send_events(&rest, limit).await;
        }
        self.send_events(batch, limit).await
    }

    /// [`Self::send`] of a batch without stored responses.
    async fn send_events(&mut self, batch: &ReplicaBatch, limit: usize) -> bool {
        let split = encode_within(batch, limit);
        if split.messages.len() > 1 {
            self.metrics.batches_split.inc();
        }
        self.metrics.truncated.inc_by(split.truncated);
        if split.unsendable > 0 {
            self.metrics.dropped.inc_by(split.unsendable);
            eprintln!(
                "switchyard: dropped {} replica events larger than the {limit}-byte message limit",
                split.unsendable
            );
        }
        for message in split.messages {
            if !self.publish(message).await {
                return false;
            }
        }
        true
    }

    /// Publishes one encoded message, counting it. `false` when cancelled.
    async fn publish(&mut self, message: Encoded) -> bool {
        let Encoded {
            payload,
            events,
            sessions,
            digest,
        } = message;
        let Some(payload) = self.signer.seal(&self.subject, payload) else {
            self.metrics.dropped.inc_by(events);
            return true;
        };
        let sent = tokio::select! {
            biased;
            () = self.cancel.cancelled() => {
                self.metrics.dropped.inc_by(events);
                return false;
            }
            sent = self.transport.publish(&self.subject, payload) => sent,
        };
        match sent {
            Ok(()) => {
                self.metrics.published.inc_by(events);
                self.metrics.sessions_published.inc_by(sessions);
                self.metrics.digests_published.inc_by(u64::from(digest));
                self.metrics.batches_published.inc();
            }
            Err(err) => {
                self.metrics.dropped.inc_by(events);
                eprintln!("switchyard: dropped {events} replica events: {err}");
            }
        }
        true
    }

    /// Publishes a digest of `live` in parts that each fit one message.
    async fn send_digest(&mut self, live: Vec<RequestId>) -> bool {
        let limit = self.payload_limit();
        for part in DigestPart::split(live, digest_ids_per_message(limit)) {
            let batch = ReplicaBatch {
                digest: Some(part),
                ..ReplicaBatch::heartbeat(self.id)
            };
            let mut buf = Vec::new();
            encode_batch_into(&batch, &mut buf);
            let message = Encoded {
                payload: Bytes::from(buf),
                events: 0,
                sessions: 0,
                digest: true,
            };
            if !self.publish(message).await {
                return false;
            }
        }
        true
    }

    /// Adds queued items until the batch is full or `max_delay` has passed
    /// since its first item; a digest ends the batch (it is published
    /// after it). `false` when the task must end.
    async fn fill(
        &mut self,
        batch: &mut ReplicaBatch,
        digest: &mut Option<Vec<RequestId>>,
    ) -> bool {
        if self.max_events <= 1 {
            return true;
        }
        let deadline = Instant::now() + self.max_delay;
        while len(batch) < self.max_events {
            // Take what is queued without waiting first.
            let item = match self.rx.try_recv() {
                Ok(item) => item,
                Err(mpsc::error::TryRecvError::Disconnected) => return true,
                Err(mpsc::error::TryRecvError::Empty) => tokio::select! {
                    biased;
                    () = self.cancel.cancelled() => {
                        self.metrics.dropped.inc_by(batch.events.len() as u64);
                        return false;
                    }
                    () = tokio::time::sleep_until(deadline.into()) => return true,
                    item = self.rx.recv() => match item {
                        Some(item) => item,
                        None => return true,
                    },
                },
            };
            match item {
                Outgoing::Digest(live) => {
                    *digest = Some(live);
                    return true;
                }
                item => push(batch, item),
            }
        }
        true
    }
}

/// One message ready to publish, and what it carries (for the counters).
#[derive(Debug)]
struct Encoded {
    payload: Bytes,
    events: u64,
    sessions: u64,
    digest: bool,
}

/// A batch encoded into messages of at most a payload limit.
#[derive(Debug, Default)]
struct Split {
    messages: Vec<Encoded>,
    /// Bookings whose block list was cut so that the event fits alone.
    truncated: u64,
    /// Events that fit no message even alone (dropped).
    unsendable: u64,
}

/// Encodes `batch` into messages of at most `limit` bytes each, keeping
/// its events in order: a batch over the limit is halved until each half
/// fits. A lone booking over the limit keeps as many leading blocks as fit
/// (its load still counts on peers; the rest of its prefix does not).
fn encode_within(batch: &ReplicaBatch, limit: usize) -> Split {
    let mut split = Split::default();
    encode_into(batch, limit, &mut split);
    split
}

fn encode_into(batch: &ReplicaBatch, limit: usize, split: &mut Split) {
    let mut buf = Vec::new();
    encode_batch_into(batch, &mut buf);
    let events = batch.events.len();
    let sessions = batch.sessions.len();
    if buf.len() <= limit {
        split.messages.push(Encoded {
            payload: Bytes::from(buf),
            events: events as u64,
            sessions: sessions as u64,
            digest: false,
        });
        return;
    }
    let part = |events: &[ActiveSequenceEvent], sessions: &[SessionBinding]| ReplicaBatch {
        router_id: batch.router_id,
        events: events.to_vec(),
        sessions: sessions.to_vec(),
        digest: None,
        responses: Vec::new(),
    };
    if events + sessions <= 1 {
        if let [event] = batch.events.as_slice() {
            if let Some(trimmed) = trim_to_fit(batch, event, limit) {
                split.truncated += 1;
                split.messages.push(trimmed);
                return;
            }
            split.unsendable += 1;
        }
        // A lone session binding is a few dozen bytes: only a limit too
        // small for any message gets here.
        return;
    }
    if events >= 2 {
        let mid = events / 2;
        encode_into(&part(&batch.events[..mid], &[]), limit, split);
        encode_into(&part(&batch.events[mid..], &batch.sessions), limit, split);
    } else if events == 1 {
        encode_into(&part(&batch.events, &[]), limit, split);
        encode_into(&part(&[], &batch.sessions), limit, split);
    } else {
        let mid = sessions / 2;
        encode_into(&part(&[], &batch.sessions[..mid]), limit, split);
        encode_into(&part(&[], &batch.sessions[mid..]), limit, split);
    }
}

/// A lone booking cut to its leading blocks so that it fits `limit`.
fn trim_to_fit(batch: &ReplicaBatch, event: &ActiveSequenceEvent, limit: usize) -> Option<Encoded> {
    let ActiveSequenceData::AddRequest { blocks, .. } = &event.data else {
        return None;
    };
    // Each block hash is at most 9 bytes of MessagePack; the rest of the
    // message is a few dozen bytes plus the LoRA name.
    let overhead = 128 + event.lora_name.as_ref().map_or(0, String::len);
    let keep = limit.checked_sub(overhead)? / 9;
    let mut trimmed = event.clone();
    if let ActiveSequenceData::AddRequest { blocks: b, .. } = &mut trimmed.data {
        b.truncate(keep.min(blocks.len()));
    }
    let one = ReplicaBatch {
        router_id: batch.router_id,
        events: vec![trimmed],
        sessions: Vec::new(),
        digest: None,
        responses: Vec::new(),
    };
    let mut buf = Vec::new();
    encode_batch_into(&one, &mut buf);
    (buf.len() <= limit).then(|| Encoded {
        payload: Bytes::from(buf),
        events: 1,
        sessions: 0,
        digest: false,
    })
}

/// Request ids per digest message under `limit`: each id is 18 bytes of
/// MessagePack (a 16-byte binary), the envelope under 128.
fn digest_ids_per_message(limit: usize) -> usize {
    (limit.saturating_sub(128) / 18).clamp(1, 1 << 20)
}

fn len(batch: &ReplicaBatch) -> usize {
    batch.events.len() + batch.sessions.len() + batch.responses.len()
}

fn push(batch: &mut ReplicaBatch, item: Outgoing) {
    match item {
        Outgoing::Event(event) => batch.events.push(event),
        Outgoing::Session(binding) => batch.sessions.push(binding),
        Outgoing::Response(stored) => batch.responses.push(stored),
        // Digests never reach a batch (see `fill`); nothing to add.
        Outgoing::Digest(_) => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::LocalHash;
    use switchyard_wire::replica::decode_batch;

    fn booking(id: u128, blocks: u64) -> ActiveSequenceEvent {
        ActiveSequenceEvent::add(
            ReplicaId(1),
            &AddRequest {
                request: RequestId(id),
                worker: WorkerId::new(0),
                prompt_tokens: blocks as u32 * 16,
                blocks: (0..blocks).map(|b| LocalHash(u64::MAX - b)).collect(),
                overlap_blocks: 0,
                expected_prefill_ms: None,
            },
            None,
        )
    }

    #[test]
    fn a_batch_over_the_limit_is_split_in_order_into_messages_under_it() {
        let limit = 16 * 1024;
        let mut batch = ReplicaBatch::heartbeat(ReplicaId(1));
        batch.events = (0..128).map(|id| booking(id, 500)).collect();
        batch.sessions = vec![SessionBinding {
            session: switchyard_core::admission::SessionKey(3),
            worker: WorkerId::new(0),
            context_tokens: 9,
        }];
        let split = encode_within(&batch, limit);
        assert!(split.messages.len() > 1);
        assert_eq!((split.truncated, split.unsendable), (0, 0));
        let mut events = Vec::new();
        let mut sessions = Vec::new();
        for m in &split.messages {
            assert!(m.payload.len() <= limit, "{}", m.payload.len());
            let decoded = decode_batch(&m.payload).unwrap();
            assert_eq!(decoded.events.len() as u64, m.events);
            events.extend(decoded.events);
            sessions.extend(decoded.sessions);
        }
        assert_eq!(events, batch.events);
        assert_eq!(sessions, batch.sessions);
        // A batch under the limit is one message.
        batch.events.truncate(2);
        assert_eq!(encode_within(&batch, limit).messages.len(), 1);
    }

    #[test]
    fn a_lone_booking_over_the_limit_keeps_its_leading_blocks() {
        let limit = 4 * 1024;
        let mut batch = ReplicaBatch::heartbeat(ReplicaId(1));
        batch.events = vec![booking(1, 2_000)];
        let split = encode_within(&batch, limit);
        assert_eq!((split.messages.len(), split.truncated), (1, 1));
        assert!(split.messages[0].payload.len() <= limit);
        let event = &decode_batch(&split.messages[0].payload).unwrap().events[0];
        let ActiveSequenceData::AddRequest { blocks, .. } = &event.data else {
            panic!("an add")
        };
        let ActiveSequenceData::AddRequest { blocks: all, .. } = &batch.events[0].data else {
            panic!("an add")
        };
        assert!(!blocks.is_empty() && blocks.len() < all.len());
        assert_eq!(blocks[..], all[..blocks.len()]);
    }

    #[test]
    fn digest_parts_fit_the_limit() {
        for limit in [1024, 64 * 1024, 1024 * 1024] {
            let live: Vec<RequestId> = (0..20_000u128)
                .map(|i| RequestId(i * 7919 + (i << 100)))
                .collect();
            for part in DigestPart::split(live, digest_ids_per_message(limit)) {
                let batch = ReplicaBatch {
                    digest: Some(part),
                    ..ReplicaBatch::heartbeat(ReplicaId(u64::MAX))
                };
                let mut buf = Vec::new();
                encode_batch_into(&batch, &mut buf);
                assert!(buf.len() <= limit, "{} > {limit}", buf.len());
            }
        }
    }
}
