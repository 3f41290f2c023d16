//! Admission: the policy queue and admission strategies.
//!
//! The driver (the HTTP server or the fleet simulator) owns request payloads,
//! cancellation and dispatch; this module owns only ids, lengths and decision
//! state. One value, [`AdmissionController`], is what a driver calls:
//!
//! ```text
//! submit(facts) ─► strategy.admit ─► Bypass/Ready ─► ready queue ─┐
//!                                  └► Defer ─► deferred ─(MakeReady)┤
//! poll(try_place) ◄─────────────────────────────────────────────────┘
//!   └► Placed::Selected { ticket } ─► dispatched(&ticket) ─► complete(ticket) | abort(ticket)
//! ```
//!
//! - [`queue`] — the policy queue: ready and deferred storage, order
//!   (`fcfs`, `lcfs`, `wspt`), per-class limits and counters.
//! - [`lifecycle`] — the per-request record
//!   `pending → selected → dispatched → completed | aborted` and the
//!   [`ResponseTicket`] that carries cancellation ownership past dispatch.
//! - [`progress`] — live progress: one unique updater, many readers, over one
//!   atomic.
//! - [`session`] — the session-aware strategy.
//! - [`responses`] — response affinity: which worker holds a stored
//!   response, for whom; a chain's later turns go there (bounded,
//!   expiring, owned per key).
//! - [`tenants`] — tenants and priority bands: the flow-control
//!   configuration and how a request's tenant, band and deadline resolve.
//! - [`ask`] — what a request asks to generate and what that costs it
//!   (flow control's expected output, a rate limit's token charge).
//! - [`controller`] — the [`AdmissionController`] tying them together.
//! - [`gate`] — the fair gate: a few slots of the router's own work
//!   (tokenizing long prompts) handed out by band, then fair share.
//!
//! Without a strategy the controller creates no lifecycle records and no
//! progress handles: admission is the policy queue alone.

pub mod ask;
pub mod controller;
pub mod gate;
pub mod lifecycle;
pub mod progress;
pub mod queue;
pub mod responses;
pub mod session;
pub mod tenants;

#[cfg(test)]
mod fair_tests;
#[cfg(test)]
mod tests;

pub use controller::{
    AdmissionConfig, AdmissionConfigError, AdmissionController, AdmissionCounters, CancelOutcome,
    Placed, RejectReason, SubmitOutcome,
};
pub use lifecycle::{InvalidTransition, ResponseTicket, Stage, TransitionOutcome};
pub use progress::{progress_pair, ProgressReader, ProgressUpdater};
pub use queue::{
    ClassLimits, Demand, FlowCounters, FlowStats, PolicyQueue, QueueConfig, QueueConfigError,
    QueueCounters, QueueOrder, ShedReason,
};
pub use session::{Affinity, SessionAwareConfig, SessionAwareStrategy, SessionConfigError};
pub use tenants::{
    Band, BandConfig, Flow, FlowConfig, FlowConfigError, FlowError, FlowPolicy, TenantConfig,
    TenantId, ACTIVE_WINDOW_MS, MAX_BANDS, MAX_DEADLINE_MS, MAX_NAME_BYTES, MAX_TENANTS,
};

use crate::types::{Eligible, RequestId, WorkerId};
use serde::{Deserialize, Serialize};

/// A session, as a hash of the client's session id: the text itself never
/// enters the core.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct SessionKey(pub u64);

impl SessionKey {
    /// Seed that keeps session keys apart from block hashes.
    const SEED: u64 = 0x5e55_1011_5e55_1011;

    /// The key of a client-supplied session id (header `x-session-id` or the
    /// body's `session_id`).
    pub fn from_client_id(id: &str) -> Self {
        Self(xxhash_rust::xxh3::xxh3_64_with_seed(
            id.as_bytes(),
            Self::SEED,
        ))
    }

    /// The key of session `id` within `namespace` (the name of the client
    /// key that sent it): two clients naming the same id have two
    /// sessions, so one cannot hold back the other's turns. The
    /// namespace's length goes first, so no (namespace, id) pair hashes
    /// the same input as another.
    pub fn namespaced(namespace: &str, id: &str) -> Self {
        let mut hasher = xxhash_rust::xxh3::Xxh3::with_seed(Self::SEED);
        hasher.update(&(namespace.len() as u64).to_le_bytes());
        hasher.update(namespace.as_bytes());
        hasher.update(id.as_bytes());
        Self(hasher.digest())
    }

    /// The session a request names: the `x-session-id` header's id, else
    /// the body's `session_id` (an empty id is none), within the sending
    /// client key's `namespace` when client keys are on (its name), in
    /// one shared space of ids when they are off.
    pub fn of_request(
        header: Option<&str>,
        body: Option<&str>,
        namespace: Option<&str>,
    ) -> Option<Self> {
        let id = header.or(body).filter(|s| !s.is_empty())?;
        Some(match namespace {
            Some(name) => Self::namespaced(name, id),
            None => Self::from_client_id(id),
        })
    }
}

/// A queue class (tenant, priority band): each has its own limits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct QueueClass(pub u16);

/// Immutable facts about one request, as a strategy and the queue see them.
#[derive(Clone, Copy, Debug)]
pub struct RequestFacts<'a> {
    /// The request.
    pub id: RequestId,
    /// Its session, when the client named one.
    pub session: Option<SessionKey>,
    /// Prompt length in tokens (the whole conversation so far, for a turn).
    pub context_tokens: u32,
    /// Prompt tokens the best worker is not expected to have cached (the
    /// `wspt` order key); `context_tokens` when unknown.
    pub uncached_tokens: u32,
    /// The queue class whose limits apply.
    pub class: QueueClass,
    /// Workers allowed to serve it.
    pub eligible: &'a Eligible,
    /// The driver's clock at arrival.
    pub now_ms: f64,
    /// Its tenant, band, deadline and expected output: its place in the
    /// fair queue (the default: the default tenant in the top band).
    pub flow: Flow,
}

impl RequestFacts<'_> {
    /// Whether `worker` may serve the request.
    pub fn allows(&self, worker: WorkerId) -> bool {
        self.eligible.allows(worker)
    }
}

/// Where a ready request may go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Any eligible worker, as the selector chooses.
    Any,
    /// This worker only.
    Exact(WorkerId),
}

/// A strategy's answer for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admission {
    /// Not the strategy's business: no record, no events, nothing retained.
    Bypass,
    /// Route now, with this placement; the request is tracked.
    Ready(Placement),
    /// Hold it until the strategy answers [`MakeReady`]; the request is
    /// tracked.
    Defer,
}

/// Lifecycle events a strategy receives, serialized, for tracked requests
/// only. Each tracked request gets exactly one terminal event (`Completed`
/// or `Aborted`).
#[derive(Clone, Debug)]
pub enum LifecycleEvent {
    /// The request was sent to `worker`; `progress` reads its generated
    /// tokens from now on.
    Dispatched {
        /// The request.
        id: RequestId,
        /// Where it went.
        worker: WorkerId,
        /// Its live progress.
        progress: ProgressReader,
    },
    /// The request finished; `context_tokens` (prompt plus generated) is
    /// authoritative.
    Completed {
        /// The request.
        id: RequestId,
        /// Context length after the turn.
        context_tokens: u64,
    },
    /// The dispatched request's worker failed it and it waits again for
    /// another worker (migration): it is still the session's current turn,
    /// no longer running on `from`. A `Dispatched` follows when it is
    /// placed again (possibly elsewhere), or a terminal event.
    Migrating {
        /// The request.
        id: RequestId,
        /// The worker that failed it.
        from: WorkerId,
    },
    /// The request ended without a result (cancelled, failed, unroutable);
    /// it commits nothing.
    Aborted {
        /// The request.
        id: RequestId,
    },
    /// Periodic: sent at least every [`AdmissionStrategy::reconcile_interval_ms`]
    /// while the driver follows [`AdmissionController::next_wakeup_ms`].
    Reconcile,
}

/// A strategy's action: the deferred request `id` may now be routed.
/// Actions for requests that are not deferred are ignored and counted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MakeReady {
    /// The deferred request.
    pub id: RequestId,
    /// Where it may go.
    pub placement: Placement,
}

/// Why an `Exact` placement could not be honoured.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unavailable {
    /// The worker is over its busy threshold.
    Busy,
    /// The worker is gone or not eligible.
    Invalid,
}

/// What to do with a request whose `Exact` worker is unavailable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// Route it to any eligible worker now.
    Any,
    /// Keep waiting for that worker.
    Wait,
    /// Give up: the request is aborted.
    Abort,
}

/// A worker's KV cache as the driver last saw it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvUsage {
    /// Tokens the worker's KV cache holds in all.
    pub capacity_tokens: u64,
    /// Tokens in use, when the engine reports it; otherwise the strategy
    /// estimates from its own sessions and live progress.
    pub used_tokens: Option<u64>,
}

/// A stateful admission strategy. It owns only the state it needs to answer;
/// the controller guarantees the calling contract:
///
/// - `admit` is called exactly once per request;
/// - each request answered `Ready` or `Defer` receives exactly one of
///   `Completed` / `Aborted`, and nothing after it; before it, `Dispatched`
///   once per placement, and between two placements a `Migrating`;
/// - `Reconcile` arrives at least every `reconcile_interval_ms()` while the
///   driver follows the controller's wake-ups.
///
/// A strategy must still treat duplicate, stale or unknown events as no-ops.
pub trait AdmissionStrategy {
    /// The strategy's name, as the CLI spells it.
    fn name(&self) -> &'static str;

    /// Decides one request.
    fn admit(&mut self, facts: &RequestFacts<'_>) -> Admission;

    /// Applies one lifecycle event; actions go to `out`.
    fn on_event(&mut self, event: &LifecycleEvent, now_ms: f64, out: &mut Vec<MakeReady>);

    /// How often `Reconcile` is wanted.
    fn reconcile_interval_ms(&self) -> f64;

    /// The `Exact` worker of a ready request is unavailable. The default
    /// falls back to any worker.
    fn on_unavailable(&mut self, _id: RequestId, _worker: WorkerId, _why: Unavailable) -> Fallback {
        Fallback::Any
    }

    /// The driver's latest view of a worker's KV cache. Default: ignored.
    fn observe_kv(&mut self, _worker: WorkerId, _usage: KvUsage) {}

    /// A peer router replica dispatched a turn of `session` to `worker`
    /// (replica sync): a strategy with session affinity pins the session
    /// there unless it has the session's turn in flight itself. Advisory;
    /// the default ignores it.
    fn observe_remote_binding(
        &mut self,
        _session: SessionKey,
        _worker: WorkerId,
        _context_tokens: u64,
        _now_ms: f64,
    ) {
    }

    /// Forgets a peer's binding of `session` (its sender is past its
    /// per-replica cap of bindings) unless the session is active here.
    /// Nothing by default.
    fn forget_remote_binding(&mut self, _session: SessionKey) {}

    /// Requests the strategy currently tracks (for tests and metrics).
    fn tracked_requests(&self) -> usize;

    /// The strategy's own event counters as `(label, count)`, for metrics
    /// (pauses, resumes, deferrals, expiries...). None by default.
    fn event_counts(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
}

impl<S: AdmissionStrategy + ?Sized> AdmissionStrategy for Box<S> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn admit(&mut self, facts: &RequestFacts<'_>) -> Admission {
        (**self).admit(facts)
    }
    fn on_event(&mut self, event: &LifecycleEvent, now_ms: f64, out: &mut Vec<MakeReady>) {
        (**self).on_event(event, now_ms, out)
    }
    fn reconcile_interval_ms(&self) -> f64 {
        (**self).reconcile_interval_ms()
    }
    fn on_unavailable(&mut self, id: RequestId, worker: WorkerId, why: Unavailable) -> Fallback {
        (**self).on_unavailable(id, worker, why)
    }
    fn observe_kv(&mut self, worker: WorkerId, usage: KvUsage) {
        (**self).observe_kv(worker, usage)
    }
    fn observe_remote_binding(
        &mut self,
        session: SessionKey,
        worker: WorkerId,
        context_tokens: u64,
        now_ms: f64,
    ) {
        (**self).observe_remote_binding(session, worker, context_tokens, now_ms)
    }
    fn forget_remote_binding(&mut self, session: SessionKey) {
        (**self).forget_remote_binding(session)
    }
    fn tracked_requests(&self) -> usize {
        (**self).tracked_requests()
    }
    fn event_counts(&self) -> Vec<(&'static str, u64)> {
        (**self).event_counts()
    }
}
