//! What a [`Dispatcher`](super::Dispatcher) call hands its driver: the
//! [`Effects`] to carry out (requests to send, requests that ended,
//! events for peers, session bindings, circuit changes, counts), and what
//! a peer's batch applied.

use super::split::Half;
use crate::admission::{ProgressUpdater, SessionKey, ShedReason};
use crate::health::CircuitState;
use crate::replica::RemoteCounters;
use crate::sequences::SequenceEvent;
use crate::types::{RequestId, WorkerId};

/// A request to send: booked on `worker` under `booking`.
#[derive(Debug)]
pub struct Dispatch {
    /// The request.
    pub id: RequestId,
    /// The booking's id (the id to send to the worker).
    pub booking: RequestId,
    /// Where it goes.
    pub worker: WorkerId,
    /// Leading blocks the router expects the worker to have cached (with
    /// `peer`, once the restore is in).
    pub overlap_blocks: u32,
    /// Have the worker restore the prompt's leading blocks from this peer
    /// first (only when the dispatcher's estimator has a transfer link).
    pub peer: Option<crate::select::PeerSource>,
    /// Load the request's LoRA adapter on the worker first (unloading the
    /// named one before, when the worker's slots are full). The router
    /// already counts it as loaded there (ready after the load time).
    pub adapter_load: Option<crate::adapters::AdapterLoad>,
    /// Time it waited in the queue.
    pub waited_ms: f64,
    /// Live progress (tokens generated so far), when a strategy tracks the
    /// request: the response path sets it without calling back here.
    pub progress: Option<ProgressUpdater>,
    /// Which half of a disaggregated request this is
    /// ([`Dispatcher::submit_split`]); `None`: a whole request.
    pub half: Option<Half>,
}

/// A request shed: it has ended without waiting in the router's queue.
///
/// The driver answers HTTP 429 with `Retry-After: retry_after_ms`
/// (rounded up to whole seconds). 429 rather than the 529 Dynamo uses for
/// overload, because the official OpenAI clients retry a 429 on their
/// own (with backoff, honouring `Retry-After`), so a shed request comes
/// back later without the caller writing any retry logic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Shed {
    /// The request.
    pub id: RequestId,
    /// Why it was shed.
    pub reason: ShedReason,
    /// Suggested `Retry-After`.
    pub retry_after_ms: u64,
}

/// A lifecycle event of one of this replica's bookings, for its peers.
#[derive(Clone, Debug, PartialEq)]
pub struct Published {
    /// The booking's worker (the wire names it on every event).
    pub worker: WorkerId,
    /// What happened.
    pub event: SequenceEvent,
}

/// A session's turn was dispatched: peers pin the session there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SessionBound {
    /// The session.
    pub session: SessionKey,
    /// Its worker.
    pub worker: WorkerId,
    /// The turn's prompt length.
    pub context_tokens: u64,
}

/// A worker's circuit entered a state.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CircuitChange {
    /// The worker.
    pub worker: WorkerId,
    /// The state entered.
    pub to: CircuitState,
    /// When an open circuit turns half-open.
    pub open_until_ms: Option<f64>,
}

/// Counts of one call, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Routing decisions the selector made.
    pub decisions: u32,
    /// Decisions taken from a route made outside the lock
    /// ([`Dispatcher::submit_proposed`]); they are among `decisions`.
    pub proposals_used: u32,
    /// Routes made outside the lock that were set aside and made again
    /// under it (the request waited, or its worker could no longer take
    /// it).
    pub proposals_rerouted: u32,
    /// Waiting requests whose client gave up.
    pub cancelled: u32,
    /// This replica's bookings freed because their worker left.
    pub freed_by_removal: u32,
    /// This replica's bookings freed by the safety-net expiry (their end
    /// was never reported).
    pub expired: u32,
    /// Peers' bookings freed because their replica went silent.
    pub expired_remote: u32,
}

/// What the driver must do after a call. Dropping it unread loses work:
/// a [`Dispatch`] not sent stays booked until the driver ends the request
/// or the safety-net expiry frees it.
#[derive(Debug, Default)]
#[must_use = "effects are what the driver must carry out"]
pub struct Effects {
    /// Requests to send to their workers, in placement order.
    pub dispatch: Vec<Dispatch>,
    /// Requests that no worker can take: they have ended (HTTP 503).
    pub no_worker: Vec<RequestId>,
    /// Requests shed (a sheddable band under overload, or a deadline that
    /// cannot be met): they have ended (HTTP 429 with `Retry-After`).
    pub shed: Vec<Shed>,
    /// Lifecycle events for peer replicas (empty unless replica sync is on).
    pub publish: Vec<Published>,
    /// Session bindings for peer replicas (replica sync with a strategy).
    pub bindings: Vec<SessionBound>,
    /// Circuit transitions, in order.
    pub circuits: Vec<CircuitChange>,
    /// Counts for metrics.
    pub counts: Counts,
}

impl Effects {
    /// Whether there is nothing to do.
    pub fn is_empty(&self) -> bool {
        self.dispatch.is_empty()
            && self.no_worker.is_empty()
            && self.shed.is_empty()
            && self.publish.is_empty()
            && self.bindings.is_empty()
            && self.circuits.is_empty()
            && self.counts == Counts::default()
    }

    /// Appends what a later call asked for.
    pub fn append(&mut self, mut other: Effects) {
        self.dispatch.append(&mut other.dispatch);
        self.no_worker.append(&mut other.no_worker);
        self.shed.append(&mut other.shed);
        self.publish.append(&mut other.publish);
        self.bindings.append(&mut other.bindings);
        self.circuits.append(&mut other.circuits);
        let c = &mut self.counts;
        let o = other.counts;
        c.decisions += o.decisions;
        c.proposals_used += o.proposals_used;
        c.proposals_rerouted += o.proposals_rerouted;
        c.cancelled += o.cancelled;
        c.freed_by_removal += o.freed_by_removal;
        c.expired += o.expired;
        c.expired_remote += o.expired_remote;
    }
}

/// What [`Dispatcher::apply_replica_batch`] applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchApplied {
    /// Lifecycle events that changed a remote booking.
    pub applied: u64,
    /// Session bindings handed to the strategy.
    pub sessions: u64,
    /// What the batch added to the remote-booking counters (drops by
    /// reason, clamps, digest frees, session evictions).
    pub remote: RemoteCounters,
}

/// One part of a peer's digest of its live bookings: its bookings with
/// request ids in `lo..=hi` are exactly `live`.
#[derive(Clone, Copy, Debug)]
pub struct DigestPart<'a> {
    /// First request id the part covers.
    pub lo: RequestId,
    /// Last request id the part covers.
    pub hi: RequestId,
    /// The sender's live bookings in the range.
    pub live: &'a [RequestId],
}
