//! The request lifecycle: one dispatcher, two drivers.
//!
//! [`Dispatcher`] owns everything that decides about a request between its
//! arrival and its end — the [`Router`] (prefix index, active sequences,
//! selector), the [`AdmissionController`] (policy queue, strategy), the
//! request table, the [`PrefillEstimator`] and every worker's
//! [`CircuitBreaker`] — and exposes the lifecycle as pure calls that take
//! the time as an argument. Each call returns the [`Effects`] the driver
//! must carry out (requests to send to their workers, requests that can go
//! nowhere, replica events to publish, session bindings, circuit changes,
//! counts), in the spirit of raft-rs's `Ready`; nothing here performs I/O
//! or calls out. The HTTP server and the fleet simulator are two drivers of
//! this one value, so what `replay` measures is what `serve` does.
//!
//! One request:
//!
//! ```text
//! submit ─► waiting (queued or deferred) ─► Dispatch{booking, worker}   (Effects::dispatch)
//!                 │                              │
//!                 │ abort                        ├─ first_token ─ finish(context_tokens)
//!                 ▼                              ├─ worker_failed ─ migrate ─► waiting again
//!             (gone)                             └─ abort / expiry
//! ```
//!
//! - A request keeps its id (`RequestId`, the admission and session
//!   identity) for life; each placement books it under a *booking* id the
//!   driver chooses (the request id for the first placement), which is what
//!   the router's write model, peer replicas and worker-origin marks see.
//!   A migrated request books afresh, so a late event about its old booking
//!   can never touch the new one.
//! - Every mutating call ends with a poll of the admission queue: anything
//!   that frees capacity (a first token, a finish, a peer's free, a tick)
//!   may place waiting requests, and their [`Dispatch`]es come back with
//!   the call that made room.
//! - Booking hints: each booking carries the estimator's expected prefill
//!   duration for its uncached tokens on the chosen worker.
//! - A disaggregated request is two requests here, its prefill half and
//!   its decode half, sequenced by `split` ([`Dispatcher::submit_split`]).
//! - Replica events are emitted only once replica sync is on
//!   ([`Dispatcher::set_replica`]), and only for what this replica changed:
//!   an `Add` that was applied, a mark of a booking it holds, a `Free` that
//!   freed one of its bookings.
//! - Circuit breakers: a placement is a `Dispatched` event (the probe, when
//!   half-open); a first token a success; [`Dispatcher::worker_failed`] a
//!   failure (once per booking); a booking that ends with neither is
//!   `Released`. Results of an older breaker generation change nothing.

use crate::admission::{
    AdmissionConfig, AdmissionConfigError, AdmissionController, AdmissionStrategy, CancelOutcome,
    Demand, Flow, FlowPolicy, FlowStats, KvUsage, Placed, Placement, QueueClass, RequestFacts,
    ResponseTicket, SessionKey, ShedReason, SubmitOutcome,
};
use crate::estimate::{EstimatorConfig, EstimatorConfigError, PrefillEstimator};
use crate::health::{
    CircuitBreaker, CircuitConfig, CircuitConfigError, CircuitEvent, CircuitState,
};
use crate::index::{ApplyOutcome, CacheTier, IndexEvent};
use crate::maps::FxHashMap;
use crate::replica::{clamp_context_tokens, DropReason};
use crate::router::board::{BoardWriter, LoadChange, PreRoutes, Proposal};
use crate::router::{Router, RouterConfig, RouterConfigError, WorkerCapacity};
use crate::select::{ModelSettings, RoutingRequest, SelectOutcome};
use crate::sequences::{AddRequest, LifecycleOutcome, SequenceEvent};
use crate::types::{Eligible, LocalHash, ReplicaId, RequestId, WorkerId};
use serde::{Deserialize, Serialize};

mod effects;
pub mod failure;
#[cfg(test)]
mod flow_tests;
mod split;
#[cfg(test)]
mod split_tests;
#[cfg(test)]
mod tests;

pub use effects::{
    BatchApplied, CircuitChange, Counts, DigestPart, Dispatch, Effects, Published, SessionBound,
    Shed,
};
pub use split::{
    prefill_half, recovery, request_of, Half, HalfFailure, Pairing, Recovery, SplitError,
    SplitPlan, PREFILL_HALF_BIT,
};

/// Settings of a [`Dispatcher`]: one struct per part.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DispatcherConfig {
    /// The routing core.
    pub router: RouterConfig,
    /// The policy queue and the record cap.
    pub admission: AdmissionConfig,
    /// Prefill-duration hints.
    pub estimator: EstimatorConfig,
    /// Every worker's circuit breaker.
    pub circuit: CircuitConfig,
    /// How often [`Dispatcher::tick`] is due at the latest (expired
    /// bookings, silent replicas), in ms.
    pub sweep_interval_ms: f64,
}

impl Default for DispatcherConfig {
    fn default() -> Self {
        Self {
            router: RouterConfig::default(),
            admission: AdmissionConfig::default(),
            estimator: EstimatorConfig::default(),
            circuit: CircuitConfig::default(),
            sweep_interval_ms: 1_000.0,
        }
    }
}

/// Why a [`DispatcherConfig`] was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum DispatcherConfigError {
    /// A routing setting.
    #[error(transparent)]
    Router(#[from] RouterConfigError),
    /// An admission setting.
    #[error(transparent)]
    Admission(#[from] AdmissionConfigError),
    /// An estimator setting.
    #[error("estimator: {0}")]
    Estimator(#[from] EstimatorConfigError),
    /// A circuit-breaker setting.
    #[error(transparent)]
    Circuit(#[from] CircuitConfigError),
    /// A sweep interval that is not positive.
    #[error("sweep_interval_ms must be positive and finite, got {0}")]
    SweepInterval(f64),
    /// Capacity reserved for the top band without a busy threshold to
    /// reserve it from.
    #[error(
        "admission.flow.{what} ({share}) needs router.busy_threshold: \
         the reserve is a share of the busy threshold, and without one no \
         worker is ever busy"
    )]
    ReserveWithoutBusyThreshold {
        /// `reserve_for_top_band` or `reserve_for_light_tenants`.
        what: &'static str,
        /// The share.
        share: f64,
    },
}

impl DispatcherConfig {
    /// Checks every part.
    pub fn validate(&self) -> Result<(), DispatcherConfigError> {
        self.router.validate()?;
        self.admission.validate()?;
        self.estimator.validate()?;
        self.circuit.validate()?;
        if !(self.sweep_interval_ms.is_finite() && self.sweep_interval_ms > 0.0) {
            return Err(DispatcherConfigError::SweepInterval(self.sweep_interval_ms));
        }
        if let (Some((what, share)), None) = (
            self.admission.flow.reserve_needing_threshold(),
            self.router.busy_threshold,
        ) {
            return Err(DispatcherConfigError::ReserveWithoutBusyThreshold { what, share });
        }
        Ok(())
    }
}

/// What a request brings: ids and lengths, never prompt text.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Submission {
    /// Local block hashes of the prompt's full blocks.
    pub blocks: Vec<LocalHash>,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// The session, when the client named one.
    pub session: Option<SessionKey>,
    /// Workers allowed to serve it.
    pub eligible: Eligible,
    /// The queue class whose limits apply.
    pub class: QueueClass,
    /// The LoRA adapter it names (`None`: the base model).
    pub adapter: Option<Box<str>>,
    /// Its model's block size and policy, where they are not the
    /// router's.
    pub model: ModelSettings,
    /// Its tenant, band, TTFT deadline and expected output, resolved with
    /// [`Dispatcher::flows`] (the default: the default tenant in the top
    /// band, no deadline).
    pub flow: Flow,
}

/// A request accepted by [`Dispatcher::submit`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Admitted {
    /// In the ready queue (and possibly already dispatched: see the effects).
    Queued,
    /// Held by the admission strategy (a session's later turn, a paused
    /// session) until it makes the request ready.
    Deferred,
}

/// Why [`Dispatcher::submit`] refused a request. Nothing was retained.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refused {
    /// The queue or the record cap is full: retry after this long (HTTP 429).
    Full {
        /// Suggested `Retry-After`.
        retry_after_ms: u64,
    },
    /// The id is already known here.
    Duplicate,
}

/// Why [`Dispatcher::migrate`] did nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum MigrateError {
    /// The request is not known (ended, expired, never submitted).
    #[error("unknown request")]
    Unknown,
    /// The request is waiting, not placed on a worker.
    #[error("the request is not placed on a worker")]
    NotPlaced,
}

/// A placed request's booking.
#[derive(Debug)]
struct Booked {
    worker: WorkerId,
    /// `None` only between the selector's choice and the end of the poll.
    ticket: Option<ResponseTicket>,
    placed_ms: f64,
    overlap_blocks: u32,
    peer: Option<crate::select::PeerSource>,
    adapter_load: Option<crate::adapters::AdapterLoad>,
    /// When it was the only local prefill on its worker when placed (its
    /// time to first token then measures its prefill: an estimator
    /// sample), the configured model's time to its first token on the
    /// worker as it was, which the sample is compared with.
    sample_model_ms: Option<f64>,
    first_token: bool,
    circuit_generation: u64,
    /// A success or failure reached the breaker.
    verdict: bool,
    /// A failure did (counted once per booking).
    failed: bool,
}

#[derive(Debug)]
struct Request {
    booking: RequestId,
    blocks: Vec<LocalHash>,
    prompt_tokens: u32,
    session: Option<SessionKey>,
    eligible: Eligible,
    /// Workers that failed it (never chosen again for it).
    excluded: Vec<WorkerId>,
    class: QueueClass,
    adapter: Option<Box<str>>,
    model: ModelSettings,
    flow: Flow,
    booked: Option<Booked>,
}

#[derive(Debug)]
struct WorkerSlot {
    capacity: WorkerCapacity,
    breaker: CircuitBreaker,
    /// Local bookings placed here that have not had their first token.
    prefilling: u32,
}

/// The request lifecycle as one value (see the module docs).
pub struct Dispatcher {
    config: DispatcherConfig,
    router: Router,
    admission: AdmissionController,
    estimator: PrefillEstimator,
    workers: FxHashMap<WorkerId, WorkerSlot>,
    requests: FxHashMap<RequestId, Request>,
    /// Booking id → request id, for every placed request.
    bookings: FxHashMap<RequestId, RequestId>,
    /// Disaggregated requests while either half lives (bounded by
    /// `requests`: one is forgotten once neither half is known).
    splits: FxHashMap<RequestId, split::Split>,
    /// Replica sync is on: emit lifecycle events for peers.
    publishing: bool,
    last_sweep_ms: f64,
    placed: Vec<Placed>,
    scratch: Vec<WorkerId>,
    /// With `refuse_late`: waiting requests with a deadline, by the time
    /// after which their prefill estimate misses it (stale entries are
    /// skipped, and compacted beyond twice the requests known).
    late: std::collections::BinaryHeap<std::cmp::Reverse<(u64, RequestId)>>,
    shed_scratch: Vec<RequestId>,
}

/// The time of a [`time_key`].
fn key_time(key: u64) -> f64 {
    if key >> 63 == 1 {
        f64::from_bits(key & !(1 << 63))
    } else {
        f64::from_bits(!key)
    }
}

/// A time as a key that sorts like it (NaN last).
fn time_key(ms: f64) -> u64 {
    if ms.is_nan() {
        return u64::MAX;
    }
    let bits = ms.to_bits();
    if bits >> 63 == 1 {
        !bits
    } else {
        bits | (1 << 63)
    }
}

impl std::fmt::Debug for Dispatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatcher")
            .field("router", &self.router)
            .field("admission", &self.admission)
            .field("requests", &self.requests.len())
            .finish_non_exhaustive()
    }
}

impl Dispatcher {
    /// A dispatcher with no workers; `strategy` is the admission strategy,
    /// if any.
    pub fn new(
        config: DispatcherConfig,
        strategy: Option<Box<dyn AdmissionStrategy + Send>>,
    ) -> Result<Self, DispatcherConfigError> {
        config.validate()?;
        Ok(Self {
            router: Router::new(config.router)?,
            admission: AdmissionController::new(config.admission.clone(), strategy)?,
            estimator: PrefillEstimator::new(config.estimator)?,
            workers: FxHashMap::default(),
            requests: FxHashMap::default(),
            bookings: FxHashMap::default(),
            splits: FxHashMap::default(),
            publishing: false,
            last_sweep_ms: 0.0,
            placed: Vec::new(),
            scratch: Vec::new(),
            late: std::collections::BinaryHeap::new(),
            shed_scratch: Vec::new(),
            config,
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &DispatcherConfig {
        &self.config
    }

    /// Turns replica sync on as replica `id`: peers' events carrying `id`
    /// are ignored, and this replica's changes come back as
    /// [`Effects::publish`] and [`Effects::bindings`].
    pub fn set_replica(&mut self, id: ReplicaId) {
        self.router.set_replica_id(id);
        self.publishing = true;
    }

    /// The routing core (read-only).
    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Which worker has which LoRA adapter: the driver feeds it what the
    /// workers report (their `/v1/models`, loads and unloads it made).
    pub fn adapters_mut(&mut self) -> &mut crate::adapters::AdapterTable {
        self.router.adapters_mut()
    }

    /// Starts the board of the loads that routes outside the lock read
    /// and hands out its writer and what those routes need
    /// ([`Router::pre_routes`]; `None` when the router cannot: see
    /// there). After every call that changed the dispatcher, take its
    /// changes ([`Self::take_load_changes`]) before letting go of it.
    pub fn pre_routes(&mut self) -> Option<(PreRoutes, BoardWriter)> {
        let fits: Vec<_> = self.estimator.fits().collect();
        self.router.pre_routes(self.estimator.config(), fits)
    }

    /// The changes to the loads since the last call, for the board's
    /// writer ([`Router::take_load_changes`]).
    pub fn take_load_changes(&mut self, out: &mut Vec<LoadChange>) {
        self.router.take_load_changes(out);
    }

    /// Admission (read-only).
    pub fn admission(&self) -> &AdmissionController {
        &self.admission
    }

    /// The tenants and priority bands in force: drivers resolve each
    /// request's [`Flow`] with it ([`FlowPolicy::resolve`]), so the server
    /// and the simulator resolve alike.
    pub fn flows(&self) -> &FlowPolicy {
        self.admission.flows()
    }

    /// Every (tenant, band)'s queue figures (waiting now, virtual time,
    /// counters), for metrics; label them with [`FlowPolicy::tenant_name`]
    /// and [`FlowPolicy::band_name`].
    pub fn flow_counters(&self) -> Vec<FlowStats> {
        self.admission.queue().flow_stats()
    }

    /// The prefill estimator (read-only).
    pub fn estimator(&self) -> &PrefillEstimator {
        &self.estimator
    }

    /// Requests known here (waiting or placed).
    pub fn requests(&self) -> usize {
        self.requests.len()
    }

    /// Whether a request is known here (waiting or placed).
    pub fn is_known(&self, id: RequestId) -> bool {
        self.requests.contains_key(&id)
    }

    /// The worker a request is placed on, if it is.
    pub fn placement_of(&self, id: RequestId) -> Option<WorkerId> {
        self.requests.get(&id)?.booked.as_ref().map(|b| b.worker)
    }

    /// The booking ids of every placed local request: what a digest of
    /// this replica's live bookings lists (peers know them by these ids).
    pub fn local_booking_ids(&self) -> Vec<RequestId> {
        self.bookings.keys().copied().collect()
    }

    /// Requests this replica booked on `worker` and has not freed.
    pub fn local_requests_on(&self, worker: WorkerId) -> usize {
        let all = self
            .router
            .sequences()
            .registry()
            .load(worker)
            .map_or(0, |l| l.requests);
        all.saturating_sub(self.router.remote().remote_requests_on(worker))
    }

    /// A worker's circuit state, while it is in the fleet.
    pub fn circuit_state(&self, worker: WorkerId) -> Option<CircuitState> {
        self.workers.get(&worker).map(|w| w.breaker.state())
    }

    /// Whether a worker's breaker would admit a request now.
    pub fn circuit_admits(&self, worker: WorkerId) -> Option<bool> {
        self.workers.get(&worker).map(|w| w.breaker.admits())
    }

    /// Heap bytes of the dispatcher's own tables (the router's are in
    /// [`Router::memory`]).
    pub fn heap_bytes(&self) -> usize {
        crate::maps::map_bytes(&self.requests)
            + crate::maps::map_bytes(&self.bookings)
            + crate::maps::map_bytes(&self.workers)
            + crate::maps::map_bytes(&self.splits)
            + self
                .splits
                .values()
                .map(split::Split::heap_bytes)
                .sum::<usize>()
            + self
                .requests
                .values()
                .map(|r| {
                    (r.blocks.capacity()) * std::mem::size_of::<LocalHash>()
                        + r.eligible.heap_bytes()
                        + r.excluded.capacity() * std::mem::size_of::<WorkerId>()
                })
                .sum::<usize>()
            + self.admission.heap_bytes()
            + self.estimator.heap_bytes()
    }

    // ---- Workers -------------------------------------------------------

    /// Adds a worker (with a closed circuit), or updates its capacity.
    pub fn add_worker(
        &mut self,
        worker: WorkerId,
        capacity: WorkerCapacity,
        now_ms: f64,
    ) -> Effects {
        let mut fx = Effects::default();
        self.workers
            .entry(worker)
            .and_modify(|slot| slot.capacity = capacity)
            .or_insert_with(|| WorkerSlot {
                capacity,
                breaker: CircuitBreaker::default(),
                prefilling: 0,
            });
        self.router.add_worker(worker, capacity);
        self.report_kv(worker, None);
        self.poll_into(now_ms, &mut fx);
        fx
    }

    /// Removes a worker: it is never chosen again, its cached blocks are
    /// forgotten and its bookings freed (this replica's are published and
    /// counted; their requests end when their driver ends them). Its
    /// circuit starts closed if it comes back.
    pub fn remove_worker(&mut self, worker: WorkerId, now_ms: f64) -> Effects {
        let mut fx = Effects::default();
        if let Some(slot) = self.workers.remove(&worker) {
            if slot.breaker.state() != CircuitState::Closed {
                fx.circuits.push(CircuitChange {
                    worker,
                    to: CircuitState::Closed,
                    open_until_ms: None,
                });
            }
        }
        self.estimator.remove_worker(worker);
        for booking in self.router.remove_worker(worker) {
            if self.bookings.contains_key(&booking) {
                fx.counts.freed_by_removal += 1;
                if self.publishing {
                    fx.publish.push(Published {
                        worker,
                        event: SequenceEvent::Free(booking),
                    });
                }
            }
        }
        self.poll_into(now_ms, &mut fx);
        fx
    }

    /// Whether a worker is in the fleet.
    pub fn has_worker(&self, worker: WorkerId) -> bool {
        self.workers.contains_key(&worker)
    }

    /// Sets every worker's circuit-breaker settings (from the next result on).
    pub fn set_circuit_config(&mut self, circuit: CircuitConfig) -> Result<(), CircuitConfigError> {
        circuit.validate()?;
        self.config.circuit = circuit;
        Ok(())
    }

    /// Tells the admission strategy a worker's KV capacity (its tokens, or
    /// its device blocks × its block size, when known) and, when measured, the
    /// fraction in use (clamped to `0..=1`; a non-finite one is ignored).
    /// Without a capacity the strategy cannot pause sessions there.
    pub fn report_kv(&mut self, worker: WorkerId, used_fraction: Option<f64>) {
        let block_size = self.router.block_size_of(worker);
        let Some(capacity_tokens) = self
            .workers
            .get(&worker)
            .and_then(|w| w.capacity.kv_tokens_or(block_size))
        else {
            return;
        };
        let used_tokens = used_fraction
            .filter(|f| f.is_finite())
            .map(|f| (f.clamp(0.0, 1.0) * capacity_tokens as f64) as u64);
        self.admission.report_kv(
            worker,
            KvUsage {
                capacity_tokens,
                used_tokens,
            },
        );
    }

    // ---- Engine KV events and peers ----------------------------------

    /// Moves the router's exact index behind a wait-free reader and hands
    /// out its writer ([`Router::publish_index`]); KV events then go
    /// through the writer, not [`Dispatcher::apply_kv_event`].
    pub fn publish_index(&mut self) -> Option<crate::index::published::IndexWriter> {
        self.router.publish_index()
    }

    /// Applies an engine KV event about one of the worker's cache tiers
    /// (already normalized: see `switchyard_wire::normalize`). `None` in
    /// approximate mode.
    pub fn apply_kv_event(
        &mut self,
        worker: WorkerId,
        tier: CacheTier,
        event: &IndexEvent,
    ) -> Option<ApplyOutcome> {
        self.router.apply_kv_event(worker, tier, event)
    }

    /// Applies one batch from peer replica `sender` (a heartbeat even when
    /// empty): lifecycle events as advisory remote bookings keyed by
    /// (origin, request id) — an `Add` or `Free` must name the sender as
    /// its origin —, session bindings into the strategy (a known worker,
    /// context clamped, at most `max_sessions_per_replica` remembered per
    /// sender), and a digest part that frees the sender's stale bookings.
    /// A batch claiming this replica's own id changes nothing.
    pub fn apply_replica_batch(
        &mut self,
        sender: ReplicaId,
        events: impl IntoIterator<Item = (ReplicaId, SequenceEvent)>,
        bindings: impl IntoIterator<Item = SessionBound>,
        digest: Option<DigestPart<'_>>,
        now_ms: f64,
    ) -> (BatchApplied, Effects) {
        let mut fx = Effects::default();
        let mut applied = BatchApplied::default();
        let before = self.router.remote().counters();
        if !self.router.replica_heartbeat(sender, now_ms) {
            let own = events.into_iter().count() as u64;
            self.router.remote_mut().note_own(own);
            applied.remote = self.router.remote().counters().since(&before);
            return (applied, fx);
        }
        for (event_origin, event) in events {
            let outcome = self
                .router
                .apply_remote_from(sender, event_origin, &event, now_ms);
            applied.applied += u64::from(outcome.applied());
        }
        if let Some(strategy) = self.admission.strategy_mut() {
            for b in bindings {
                if !self.router.sequences().has_worker(b.worker) {
                    self.router
                        .remote_mut()
                        .note_dropped(DropReason::UnknownWorker);
                    continue;
                }
                let (context_tokens, clamped) = clamp_context_tokens(b.context_tokens);
                if clamped {
                    self.router.remote_mut().note_clamped();
                }
                if let Some(evicted) = self.router.remote_mut().bind_session(sender, b.session) {
                    strategy.forget_remote_binding(evicted);
                }
                strategy.observe_remote_binding(b.session, b.worker, context_tokens, now_ms);
                applied.sessions += 1;
            }
        }
        if let Some(part) = digest {
            self.router
                .apply_remote_digest(sender, part.lo, part.hi, part.live, now_ms);
        }
        applied.remote = self.router.remote().counters().since(&before);
        // A peer's free may have made room for a waiting request.
        self.poll_into(now_ms, &mut fx);
        (applied, fx)
    }

    // ---- The lifecycle -----------------------------------------------

    /// A request arrives: admission (the strategy may defer it), then a
    /// poll that may dispatch it at once. A request of a sheddable band
    /// that would wait, or (with `refuse_late`) whose deadline its
    /// prefill estimate says cannot be met, has ended when this returns:
    /// it is in [`Effects::shed`] (and the answer is still `Queued`).
    pub fn submit(
        &mut self,
        id: RequestId,
        submission: Submission,
        now_ms: f64,
    ) -> Result<(Admitted, Effects), Refused> {
        self.submit_proposed(id, submission, None, now_ms)
    }

    /// [`Self::submit`] with a route already made outside the lock
    /// ([`crate::router::board::PreRouter`]): when admission places the
    /// request at once, before any other request in the same poll, on a
    /// worker it may go to (eligible, not excluded, still in the router,
    /// selectable and not busy), and no booking since put more of its
    /// prompt in flight on any worker
    /// ([`crate::router::Router::missed_active_prefix`]), the proposal is
    /// the decision; otherwise the
    /// request is routed here as any other (counted in
    /// [`Counts::proposals_rerouted`]).
    pub fn submit_proposed(
        &mut self,
        id: RequestId,
        submission: Submission,
        proposal: Option<Proposal>,
        now_ms: f64,
    ) -> Result<(Admitted, Effects), Refused> {
        let mut fx = Effects::default();
        if let Some(reason) = self.shed_at_arrival(id, &submission, now_ms)? {
            self.admission.count_shed(submission.flow, reason);
            fx.shed.push(Shed {
                id,
                reason,
                retry_after_ms: self.admission.queue().retry_after_ms(),
            });
            return Ok((Admitted::Queued, fx));
        }
        let admitted = self.admit(id, submission, now_ms)?;
        let mut proposal = proposal.map(|p| (id, p));
        self.poll_proposed(now_ms, &mut fx, &mut proposal);
        if proposal.is_some() {
            fx.counts.proposals_rerouted += 1;
        }
        Ok((admitted, fx))
    }

    /// Offers waiting requests to the router again (call when
    /// [`Self::next_wakeup_ms`] says, after [`Self::tick`]; every other call
    /// polls on its own).
    pub fn poll(&mut self, now_ms: f64) -> Effects {
        let mut fx = Effects::default();
        self.poll_into(now_ms, &mut fx);
        fx
    }

    /// The request's first token arrived: its prefill is done (once).
    pub fn first_token(&mut self, id: RequestId, now_ms: f64) -> Effects {
        let mut fx = Effects::default();
        let Some(request) = self.requests.get_mut(&id) else {
            return fx;
        };
        let Some(booked) = request.booked.as_mut() else {
            return fx;
        };
        if booked.first_token {
            return fx;
        }
        booked.first_token = true;
        let (worker, booking) = (booked.worker, request.booking);
        if let Some(slot) = self.workers.get_mut(&worker) {
            slot.prefilling = slot.prefilling.saturating_sub(1);
        }
        let marked = self.router.mark_prefill_completed(booking, now_ms);
        // Duplicate: the worker's own mark came first; peers may not have it.
        if self.publishing
            && matches!(
                marked,
                LifecycleOutcome::Applied | LifecycleOutcome::Duplicate
            )
        {
            fx.publish.push(Published {
                worker,
                event: SequenceEvent::MarkPrefillCompleted(booking),
            });
        }
        if let Some(model_ms) = booked.sample_model_ms {
            self.estimator
                .observe(worker, model_ms, now_ms - booked.placed_ms);
            self.router.post_fit(worker, self.estimator.fit(worker));
        }
        if !booked.verdict {
            booked.verdict = true;
            let generation = booked.circuit_generation;
            self.circuit(worker, CircuitEvent::Success, generation, now_ms, &mut fx);
        }
        self.poll_into(now_ms, &mut fx);
        fx
    }

    /// The worker failed the request (refused, reset, 5xx, error event,
    /// timeout): one failure for its circuit breaker, once per booking
    /// however often it is called. The request stays booked: the driver
    /// then migrates or ends it.
    pub fn worker_failed(&mut self, id: RequestId, now_ms: f64) -> Effects {
        let mut fx = Effects::default();
        let Some(booked) = self.requests.get_mut(&id).and_then(|r| r.booked.as_mut()) else {
            return fx;
        };
        if booked.failed {
            return fx;
        }
        booked.failed = true;
        booked.verdict = true;
        let (worker, generation) = (booked.worker, booked.circuit_generation);
        self.circuit(worker, CircuitEvent::Failure, generation, now_ms, &mut fx);
        self.poll_into(now_ms, &mut fx);
        fx
    }

    /// The request finished; `context_tokens` (prompt plus generated) is
    /// authoritative for its session. A request that never got a worker
    /// ends as aborted.
    pub fn finish(&mut self, id: RequestId, context_tokens: u64, now_ms: f64) -> Effects {
        let fx = self.end(id, Some(context_tokens), now_ms);
        self.forget_split_if_over(id);
        fx
    }

    /// The request ended without a result (client gone, failure, timeout),
    /// wherever it was: waiting, it leaves the queue; placed, its booking
    /// is freed. It commits nothing to its session.
    pub fn abort(&mut self, id: RequestId, now_ms: f64) -> Effects {
        let fx = self.end(id, None, now_ms);
        self.forget_split_if_over(id);
        fx
    }

    /// The request's worker failed it and it moves: its booking there is
    /// freed, that worker is excluded for this request, and it waits again
    /// — still its session's current turn, so the session's next turn
    /// keeps waiting for it — until it is placed under the new `booking`
    /// id; the session then re-pins to the worker that takes it. `prompt`
    /// replaces the prompt (a stream resumed with its generated tokens).
    pub fn migrate(
        &mut self,
        id: RequestId,
        booking: RequestId,
        prompt: Option<(Vec<LocalHash>, u32)>,
        now_ms: f64,
    ) -> Result<Effects, MigrateError> {
        let mut fx = Effects::default();
        let request = self.requests.get_mut(&id).ok_or(MigrateError::Unknown)?;
        let mut booked = request.booked.take().ok_or(MigrateError::NotPlaced)?;
        let old = std::mem::replace(&mut request.booking, booking);
        if !request.excluded.contains(&booked.worker) {
            request.excluded.push(booked.worker);
        }
        if let Some((blocks, prompt_tokens)) = prompt {
            request.blocks = blocks;
            request.prompt_tokens = prompt_tokens;
        }
        let facts_tokens = request.prompt_tokens;
        let class = request.class;
        let session = request.session;
        let flow = request.flow;
        self.admission.release_flow(flow.tenant);
        let ticket = booked.ticket.take();
        self.bookings.remove(&old);
        self.release(old, &booked, now_ms, &mut fx);
        if let Some(ticket) = ticket {
            let facts = RequestFacts {
                id,
                session,
                context_tokens: facts_tokens,
                uncached_tokens: facts_tokens,
                class,
                eligible: &Eligible::Every,
                now_ms,
                flow,
            };
            if let Err(invalid) = self.admission.requeue(ticket, &facts) {
                // Not dispatched (cannot happen: placements are dispatched
                // before they are returned); end it rather than leak it.
                let _ = self.admission.abort(invalid.ticket, now_ms);
                self.requests.remove(&id);
                fx.no_worker.push(id);
                self.half_found_no_worker(id, now_ms, &mut fx);
            }
        }
        self.poll_into(now_ms, &mut fx);
        Ok(fx)
    }

    /// Periodic work: the strategy's reconcile, bookings past their
    /// deadline (their requests end as aborted), silent peers' bookings,
    /// circuit cooldowns that are over; then a poll.
    pub fn tick(&mut self, now_ms: f64) -> Effects {
        let mut fx = Effects::default();
        self.admission.tick(now_ms);
        for booking in self.router.expire(now_ms) {
            let Some(id) = self.bookings.remove(&booking) else {
                continue;
            };
            fx.counts.expired += 1;
            if let Some(mut request) = self.requests.remove(&id) {
                if let Some(mut booked) = request.booked.take() {
                    self.admission.release_flow(request.flow.tenant);
                    // Already out of the write model; peers expire it on
                    // the same deadline, so nothing is published.
                    self.settle_booking(&booked, now_ms, &mut fx);
                    if let Some(ticket) = booked.ticket.take() {
                        let _ = self.admission.abort(ticket, now_ms);
                    }
                }
            }
            self.forget_split_if_over(id);
        }
        fx.counts.expired_remote += self.router.expire_silent_replicas(now_ms).len() as u32;
        let due: Vec<WorkerId> = self
            .workers
            .iter()
            .filter(|(_, s)| s.breaker.open_until_ms().is_some_and(|t| t <= now_ms))
            .map(|(&w, _)| w)
            .collect();
        for worker in due {
            if let Some(slot) = self.workers.get_mut(&worker) {
                let changed = slot.breaker.poll(now_ms);
                Self::settle(&mut self.router, worker, slot, changed, &mut fx);
            }
        }
        self.last_sweep_ms = now_ms;
        self.poll_into(now_ms, &mut fx);
        fx
    }

    /// When [`Self::tick`] is next due: the strategy's reconcile, a recheck
    /// while requests wait for a busy fleet, the end of a circuit
    /// cooldown, or the periodic sweep, whichever comes first.
    pub fn next_wakeup_ms(&self) -> f64 {
        let sweep = self.last_sweep_ms + self.config.sweep_interval_ms;
        let cooldown = self
            .workers
            .values()
            .filter_map(|w| w.breaker.open_until_ms())
            .fold(f64::INFINITY, f64::min);
        let admission = self.admission.next_wakeup_ms().unwrap_or(f64::INFINITY);
        // With `refuse_late`: when the first waiting request becomes late.
        let late = self
            .late
            .peek()
            .map_or(f64::INFINITY, |std::cmp::Reverse((key, _))| key_time(*key));
        sweep.min(cooldown).min(admission).min(late)
    }

    // ---- Internals ---------------------------------------------------

    /// Whether a request is shed on arrival, before it is queued: a
    /// sheddable band's request when others already wait to be offered (it
    /// would wait behind them), or, with `refuse_late`, one whose deadline is closer
    /// than the best worker's expected prefill of its uncached tokens.
    fn shed_at_arrival(
        &self,
        id: RequestId,
        submission: &Submission,
        now_ms: f64,
    ) -> Result<Option<ShedReason>, Refused> {
        if self.requests.contains_key(&id) || self.bookings.contains_key(&id) {
            return Err(Refused::Duplicate);
        }
        let flows = self.admission.flows();
        let flow = self.admission.queue().normalize(submission.flow);
        // Requests that would be offered before it wait (a capped
        // tenant's do not count: they are not ahead of it).
        if flows.is_sheddable(flow.band) && self.admission.queue().offerable() {
            return Ok(Some(ShedReason::Overload));
        }
        if let (true, Some(deadline)) = (flows.config().refuse_late, flow.deadline_ms) {
            let best = self.best_prefill_ms(
                &submission.blocks,
                submission.prompt_tokens,
                &submission.eligible,
            );
            if let Some(best) = best {
                if deadline - now_ms < best {
                    return Ok(Some(ShedReason::Late));
                }
            }
        }
        Ok(None)
    }

    /// The estimator's prefill time of the request's uncached tokens on
    /// the worker that would prefill it soonest (its cached prefix
    /// counted); `None` when no worker may take it.
    fn best_prefill_ms(
        &self,
        blocks: &[LocalHash],
        prompt_tokens: u32,
        eligible: &Eligible,
    ) -> Option<f64> {
        let mut scores = crate::index::OverlapScores::default();
        self.router
            .with_index(|index| index.overlaps(blocks, &mut scores));
        let prompt = u64::from(prompt_tokens);
        self.router
            .sequences()
            .workers()
            .filter(|w| eligible.allows(*w))
            .map(|w| {
                let depth = scores
                    .entries
                    .iter()
                    .find(|e| e.worker == w)
                    .map_or(0, |e| u64::from(e.depth));
                let block_size = u64::from(self.router.block_size_of(w));
                let uncached = prompt - (depth * block_size).min(prompt);
                self.estimator.expected_ms(w, uncached)
            })
            .reduce(f64::min)
    }

    /// Sheds the waiting requests whose deadline can no longer be met
    /// (with `refuse_late`), then, after a poll, the ready requests of
    /// sheddable bands that no worker took.
    fn shed_waiting(&mut self, now_ms: f64, after_poll: bool, fx: &mut Effects) {
        let mut ids = std::mem::take(&mut self.shed_scratch);
        while let Some(&std::cmp::Reverse((key, id))) = self.late.peek() {
            if key > time_key(now_ms) {
                break;
            }
            self.late.pop();
            if self.requests.get(&id).is_some_and(|r| r.booked.is_none()) {
                ids.push(id);
            }
        }
        for id in ids.drain(..) {
            self.shed_one(id, ShedReason::Late, now_ms, fx);
        }
        if after_poll && self.admission.queue().sheddable_ready() > 0 {
            self.admission.queue().sheddable_ids(&mut ids);
            for id in ids.drain(..) {
                self.shed_one(id, ShedReason::Overload, now_ms, fx);
            }
        }
        self.shed_scratch = ids;
        if self.late.len() > 2 * self.requests.len() + 64 {
            let requests = &self.requests;
            self.late.retain(|std::cmp::Reverse((_, id))| {
                requests.get(id).is_some_and(|r| r.booked.is_none())
            });
        }
    }

    /// Sheds one waiting request (and the other half of a split one).
    fn shed_one(&mut self, id: RequestId, reason: ShedReason, now_ms: f64, fx: &mut Effects) {
        if !self.admission.shed(id, reason, now_ms) {
            return;
        }
        self.requests.remove(&id);
        let retry_after_ms = self.admission.queue().retry_after_ms();
        fx.shed.push(Shed {
            id,
            reason,
            retry_after_ms,
        });
        if !self.splits.is_empty() {
            let before = fx.no_worker.len();
            self.half_found_no_worker(id, now_ms, fx);
            // The other half ends with it, for the same reason.
            for other in fx.no_worker.drain(before..).collect::<Vec<_>>() {
                fx.shed.push(Shed {
                    id: other,
                    reason,
                    retry_after_ms,
                });
            }
        }
    }

    /// Admission of request `id` without offering it to a worker yet (the
    /// caller polls).
    fn admit(
        &mut self,
        id: RequestId,
        submission: Submission,
        now_ms: f64,
    ) -> Result<Admitted, Refused> {
        if self.requests.contains_key(&id) || self.bookings.contains_key(&id) {
            return Err(Refused::Duplicate);
        }
        // Without a class of its own a request is in its tenant's: the
        // queue's limits then hold per tenant, so one tenant's backlog
        // cannot fill the queue for the others.
        let mut submission = submission;
        if submission.class == QueueClass::default() {
            let tenant = self.admission.queue().normalize(submission.flow).tenant;
            submission.class = QueueClass(tenant.0);
        }
        let facts = RequestFacts {
            id,
            session: submission.session,
            context_tokens: submission.prompt_tokens,
            uncached_tokens: submission.prompt_tokens,
            class: submission.class,
            eligible: &submission.eligible,
            now_ms,
            flow: submission.flow,
        };
        let admitted = match self.admission.submit(&facts) {
            SubmitOutcome::Queued => Admitted::Queued,
            SubmitOutcome::Deferred => Admitted::Deferred,
            SubmitOutcome::Rejected { retry_after_ms, .. } => {
                return Err(Refused::Full { retry_after_ms })
            }
            SubmitOutcome::Duplicate => return Err(Refused::Duplicate),
        };
        self.requests.insert(
            id,
            Request {
                booking: id,
                blocks: submission.blocks,
                prompt_tokens: submission.prompt_tokens,
                session: submission.session,
                eligible: submission.eligible,
                excluded: Vec::new(),
                class: submission.class,
                adapter: submission.adapter,
                model: submission.model,
                flow: self.admission.queue().normalize(submission.flow),
                booked: None,
            },
        );
        if let (true, Some(deadline)) = (
            self.admission.flows().config().refuse_late,
            submission.flow.deadline_ms,
        ) {
            let request = &self.requests[&id];
            let best =
                self.best_prefill_ms(&request.blocks, request.prompt_tokens, &request.eligible);
            if let Some(best) = best {
                self.late
                    .push(std::cmp::Reverse((time_key(deadline - best), id)));
            }
        }
        Ok(admitted)
    }

    /// Ends a request wherever it is.
    fn end(&mut self, id: RequestId, context_tokens: Option<u64>, now_ms: f64) -> Effects {
        let mut fx = Effects::default();
        let Some(mut request) = self.requests.remove(&id) else {
            return fx;
        };
        match request.booked.take() {
            None => {
                if self.admission.cancel(id, now_ms) == CancelOutcome::Removed {
                    fx.counts.cancelled += 1;
                }
            }
            Some(mut booked) => {
                self.bookings.remove(&request.booking);
                self.admission.release_flow(request.flow.tenant);
                self.release(request.booking, &booked, now_ms, &mut fx);
                if let Some(ticket) = booked.ticket.take() {
                    match context_tokens {
                        Some(context) => {
                            if let Err(invalid) = self.admission.complete(ticket, context, now_ms) {
                                let _ = self.admission.abort(invalid.ticket, now_ms);
                            }
                        }
                        None => {
                            let _ = self.admission.abort(ticket, now_ms);
                        }
                    }
                }
            }
        }
        self.poll_into(now_ms, &mut fx);
        fx
    }

    /// Frees a booking: its prefill count, its breaker verdict (`Released`
    /// when it had none), its place in the write model (published when it
    /// freed one of ours).
    fn release(&mut self, booking: RequestId, booked: &Booked, now_ms: f64, fx: &mut Effects) {
        self.settle_booking(booked, now_ms, fx);
        if self.router.free(booking, now_ms) == LifecycleOutcome::Applied && self.publishing {
            fx.publish.push(Published {
                worker: booked.worker,
                event: SequenceEvent::Free(booking),
            });
        }
    }

    /// A booking ends: its worker has one prefill fewer if it never got its
    /// first token, and its breaker hears `Released` if it had no verdict
    /// (so a half-open worker's probe slot is never lost).
    fn settle_booking(&mut self, booked: &Booked, now_ms: f64, fx: &mut Effects) {
        if let Some(slot) = self.workers.get_mut(&booked.worker) {
            if !booked.first_token {
                slot.prefilling = slot.prefilling.saturating_sub(1);
            }
        }
        if !booked.verdict {
            self.circuit(
                booked.worker,
                CircuitEvent::Released,
                booked.circuit_generation,
                now_ms,
                fx,
            );
        }
    }

    /// Feeds one result to a worker's breaker and brings its selectability
    /// in line. Unknown workers (removed meanwhile) are ignored.
    fn circuit(
        &mut self,
        worker: WorkerId,
        event: CircuitEvent,
        generation: u64,
        now_ms: f64,
        fx: &mut Effects,
    ) {
        let Some(slot) = self.workers.get_mut(&worker) else {
            return;
        };
        let changed = slot
            .breaker
            .on_result(event, generation, now_ms, &self.config.circuit);
        Self::settle(&mut self.router, worker, slot, changed, fx);
    }

    fn settle(
        router: &mut Router,
        worker: WorkerId,
        slot: &WorkerSlot,
        changed: crate::health::Transitions,
        fx: &mut Effects,
    ) {
        for to in changed.iter() {
            fx.circuits.push(CircuitChange {
                worker,
                to,
                open_until_ms: slot.breaker.open_until_ms(),
            });
        }
        router.set_selectable(worker, slot.breaker.admits());
    }

    /// Places ready requests: route, book (with a prefill hint), tell the
    /// breaker, hand out the dispatch.
    fn poll_into(&mut self, now_ms: f64, fx: &mut Effects) {
        self.poll_proposed(now_ms, fx, &mut None);
    }

    /// [`Self::poll_into`], taking `proposal`'s decision for its request
    /// when that is placed first and may go there (then `proposal` is
    /// emptied).
    fn poll_proposed(
        &mut self,
        now_ms: f64,
        fx: &mut Effects,
        proposal: &mut Option<(RequestId, Proposal)>,
    ) {
        if !self.late.is_empty() {
            self.shed_waiting(now_ms, false, fx);
        }
        if self.admission.queue().ready_len() == 0 {
            return;
        }
        let mut first = true;
        let Dispatcher {
            router,
            admission,
            requests,
            estimator,
            workers,
            placed,
            scratch,
            publishing,
            config,
            ..
        } = self;
        admission.poll_charging(now_ms, placed, |id, placement, demand| {
            let Some(request) = requests.get_mut(&id) else {
                return (SelectOutcome::NoWorkers, None);
            };
            let exact;
            let eligible: Option<&[WorkerId]> = match placement {
                Placement::Exact(worker) if request.excluded.contains(&worker) => Some(&[]),
                // A strategy's worker outside the request's eligible set
                // (a session bound to a worker that cannot serve this
                // request: another model's, or not the one a stored
                // response pins it to) is no place for it: the request
                // goes where it may.
                Placement::Exact(worker) if !request.eligible.allows(worker) => {
                    request.eligible.without(
                        router.sequences().workers(),
                        &request.excluded,
                        scratch,
                    );
                    Some(&scratch[..])
                }
                Placement::Exact(worker) => {
                    exact = [worker];
                    Some(&exact)
                }
                Placement::Any if request.excluded.is_empty() => request.eligible.listed(),
                Placement::Any => {
                    request.eligible.without(
                        router.sequences().workers(),
                        &request.excluded,
                        scratch,
                    );
                    Some(&scratch[..])
                }
            };
            // Capacity held back for the top band, and for light tenants
            // from one that asks more than its share: the larger applies.
            let flow = &config.admission.flow;
            let mut headroom = 0.0_f64;
            if request.flow.band.0 > 0 {
                headroom = flow.reserve_for_top_band;
            }
            if demand == Demand::OverShare {
                headroom = headroom.max(flow.reserve_for_light_tenants);
            }
            let routing = RoutingRequest {
                prompt_tokens: request.prompt_tokens,
                blocks: &request.blocks,
                adapter: request.adapter.as_deref(),
                model: request.model,
                headroom,
            };
            fx.counts.decisions += 1;
            // A route made outside the lock is this request's decision
            // when nothing was placed before it in this poll, its worker
            // may still take it, and no booking it could not see put more
            // of its prompt in flight on any worker (a fan-out's siblings,
            // routed at once).
            let proposed = match proposal {
                Some((for_id, p))
                    if first
                        && *for_id == id
                        && matches!(placement, Placement::Any)
                        && request.excluded.is_empty()
                        && eligible.is_none_or(|e| e.contains(&p.decision.worker))
                        && router.may_take_with(p.decision.worker, now_ms, headroom)
                        && !router
                            .missed_active_prefix(p.decision.overlap_blocks, &request.blocks) =>
                {
                    Some(*p)
                }
                _ => None,
            };
            first = false;
            let outcome = match proposed {
                Some(p) => {
                    *proposal = None;
                    fx.counts.proposals_used += 1;
                    SelectOutcome::Selected(p.decision)
                }
                None => router.route_with(routing, eligible, &*estimator, now_ms),
            };
            let SelectOutcome::Selected(decision) = outcome else {
                return (outcome, None);
            };
            let prompt = u64::from(request.prompt_tokens);
            let block_size = u64::from(router.block_size_of(decision.worker));
            let cached = (u64::from(decision.overlap_blocks) * block_size).min(prompt);
            let uncached_tokens = prompt - cached;
            let hint = estimator.expected_ms(decision.worker, uncached_tokens);
            let add = AddRequest::for_decision(request.booking, &routing, &decision, Some(hint));
            let booked = router.book_request(&add, now_ms);
            if *publishing && booked == LifecycleOutcome::Applied {
                fx.publish.push(Published {
                    worker: decision.worker,
                    event: SequenceEvent::Add(add),
                });
            }
            let adapter_load = request
                .adapter
                .as_deref()
                .and_then(|a| router.adapters_mut().place(decision.worker, a, now_ms));
            let mut generation = 0;
            let mut sample_model_ms = None;
            if let Some(slot) = workers.get_mut(&decision.worker) {
                // A peer restore's or an adapter load's first token waits
                // for the transfer or the load too: not a sample of the
                // worker's prefill.
                if slot.prefilling == 0 && decision.peer.is_none() && adapter_load.is_none() {
                    let model = estimator.config();
                    let candidate = match &proposed {
                        Some(p) => Some(&p.candidate),
                        None => router.last_candidate(decision.worker),
                    };
                    sample_model_ms = Some(match candidate {
                        Some(c) => model.first_token_model_ms(
                            uncached_tokens,
                            c.active_requests,
                            c.held_share(),
                        ),
                        None => model.model_ms(uncached_tokens),
                    });
                }
                slot.prefilling += 1;
                // A half-open worker takes this one probe, then no more
                // until its verdict: decided before the next placement.
                generation = slot.breaker.generation();
                let changed = slot.breaker.on_result(
                    CircuitEvent::Dispatched,
                    generation,
                    now_ms,
                    &config.circuit,
                );
                Self::settle(router, decision.worker, slot, changed, fx);
            }
            request.booked = Some(Booked {
                worker: decision.worker,
                ticket: None,
                placed_ms: now_ms,
                overlap_blocks: decision.overlap_blocks,
                peer: decision.peer,
                adapter_load,
                sample_model_ms,
                first_token: false,
                circuit_generation: generation,
                verdict: false,
                failed: false,
            });
            (
                outcome,
                Some(uncached_tokens.min(u64::from(u32::MAX)) as u32),
            )
        });
        let mut placed = std::mem::take(&mut self.placed);
        for p in placed.drain(..) {
            match p {
                Placed::Selected {
                    mut ticket,
                    decision,
                    waited_ms,
                } => {
                    let id = ticket.id();
                    let half = self.half_of(id);
                    let Some(request) = self.requests.get_mut(&id) else {
                        // The poll closure saw it a moment ago.
                        let _ = self.admission.abort(ticket, now_ms);
                        continue;
                    };
                    self.admission.dispatched(&ticket, now_ms);
                    let progress = ticket.take_progress();
                    if let (true, Some(session), Some(_)) =
                        (self.publishing, request.session, self.admission.strategy())
                    {
                        fx.bindings.push(SessionBound {
                            session,
                            worker: decision.worker,
                            context_tokens: u64::from(request.prompt_tokens),
                        });
                    }
                    let booked = request
                        .booked
                        .as_mut()
                        .expect("a selected request was booked by the poll closure");
                    booked.ticket = Some(ticket);
                    self.bookings.insert(request.booking, id);
                    fx.dispatch.push(Dispatch {
                        id,
                        booking: request.booking,
                        worker: booked.worker,
                        overlap_blocks: booked.overlap_blocks,
                        peer: booked.peer,
                        adapter_load: booked.adapter_load.take(),
                        waited_ms,
                        progress,
                        half,
                    });
                }
                Placed::NoWorkers { id } => {
                    self.requests.remove(&id);
                    fx.no_worker.push(id);
                }
            }
        }
        self.placed = placed;
        self.shed_waiting(now_ms, true, fx);
        if !self.splits.is_empty() {
            // A half no worker can take ends its request (both halves).
            let ended = fx.no_worker.len();
            for i in 0..ended {
                let id = fx.no_worker[i];
                self.half_found_no_worker(id, now_ms, fx);
            }
        }
    }
}
