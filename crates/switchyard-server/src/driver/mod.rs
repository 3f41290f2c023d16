//! The router's shared state: the core's [`Dispatcher`], the worker table
//! and the requests waiting for placement, behind one `std::sync::Mutex`,
//! and the shell that carries out the dispatcher's [`Effects`].
//!
//! Why a `std` mutex and not tokio's, nor an actor: every critical section
//! is short, synchronous work on in-memory structures (a booking, or a
//! route + book, is a few microseconds at 64 workers) and never spans an `.await`, so a plain
//! mutex is the cheapest correct choice — an uncontended lock is ~20 ns, an
//! actor round trip through a channel is 220–560 ns plus a task wake-up
//! (figures from `bench admission`'s notes).
//!
//! Routes are made before that lock when they can be: with exact cache
//! tracking and a policy that keeps no state between decisions, each
//! request is routed on the published index and load board
//! (`switchyard_core::router::board`) first, and under the lock the
//! dispatcher only admits it, checks that the chosen worker may still take
//! it, and books it (or routes it there after all: a queued request, a
//! worker gone or busy meanwhile). The changes a call made to the loads
//! leave the lock in order and are applied to the board after it
//! ([`Locked`], `BoardPublisher`).
//!
//! KV events never take that lock: with exact cache tracking the router's
//! prefix indexes (device and host tier, one `TieredIndex`) are published
//! (`switchyard_core::index::published`) and events of both tiers go
//! through its one writer, under a lock of their own that also holds the
//! liveness table the events are checked against (which workers are in
//! the router, under which events epoch); routing reads the last
//! published copy and never waits for an event being applied. `bench
//! contention` measures the difference.
//!
//! Every lifecycle decision is the dispatcher's; this module only drives
//! it: each call takes the lock, calls the dispatcher with the router's
//! clock, and carries out the effects before releasing the lock — a
//! dispatch goes to the handler waiting for it (a oneshot send, which
//! never blocks), replica events and session bindings to the publisher's
//! bounded queue (never blocks; a full queue drops and counts), circuit
//! transitions to the worker table and the log, counts to the metrics. A
//! dispatch whose handler is gone is aborted at once.
//!
//! - [`board`] — routes made before the lock: the published load board
//!   and its publisher, and the lock guard that queues load changes.
//! - [`workers`] — the driver's calls on the worker table
//!   (`crate::roster`, the one table): workers joining,
//!   leaving, in or out of selection, their health, capacity, roles,
//!   models and adapters; KV events checked against their liveness.
//!
//! - [`booking`] — the guards a handler holds: a `WaitHandle` until its
//!   request is placed, then a `Booking` whose drop ends it (finished,
//!   aborted, or handed to a migration). They wrap the assignments this
//!   module hands out; nothing outside this module sees the dispatcher or
//!   the lock.

mod board;
pub mod booking;
mod workers;

use crate::metrics::{AdmissionDecision, ServerMetrics};
use crate::metrics_state::{RoutingStateCollector, Snapshot, WorkerRow};
use crate::roster::{Role, Roster, UnknownModel};
use prometheus_client::registry::Registry;
use rustc_hash::FxHashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;
use switchyard_core::admission::{ProgressUpdater, QueueClass, SessionKey};
use switchyard_core::dispatch::{
    prefill_half, Admitted, Dispatcher, Effects, MigrateError, Pairing, Refused, SplitError,
    SplitPlan, Submission,
};
use switchyard_core::{Eligible, LocalHash, ReplicaId, RequestId, WorkerId};
use switchyard_replica::{BatchReport, ReplicaMetrics, ReplicaPublisher};
use switchyard_wire::replica::ReplicaBatch;
use tokio::sync::oneshot;

use board::{Locked, PreRouting};
use workers::EventWriter;

/// Where a request goes, handed from the dispatcher to its waiting handler
/// (see [`crate::driver::booking::WaitHandle`]).
#[derive(Debug)]
pub enum Assignment {
    /// Placed and booked on a worker.
    Dispatched {
        /// The booking's id: what the worker is told (`x-request-id`).
        booking: RequestId,
        /// The worker.
        worker: WorkerId,
        /// Its name.
        name: Arc<str>,
        /// Its base URL.
        url: Arc<str>,
        /// Its name and URL as requests use them.
        endpoint: Arc<crate::roster::Endpoint>,
        /// Blocks the router expects it to have cached.
        overlap_blocks: u32,
        /// Time spent queued.
        waited_ms: f64,
        /// Live progress, when an admission strategy tracks the request.
        progress: Option<ProgressUpdater>,
        /// Load the request's adapter there first.
        adapter_load: Option<switchyard_core::adapters::AdapterLoad>,
    },
    /// No worker can take it: the request has ended.
    NoWorkers,
    /// Shed by admission (a sheddable band under overload, or a TTFT
    /// deadline that cannot be met): the request has ended; answer 429
    /// with `Retry-After`.
    Shed {
        /// Suggested `Retry-After`.
        retry_after_ms: u64,
        /// Shed because its deadline could not be met.
        late: bool,
    },
}

/// What a request brings to admission.
#[derive(Debug)]
pub struct Request<'a> {
    /// Local block hashes of its prompt.
    pub blocks: Vec<LocalHash>,
    /// Prompt length.
    pub prompt_tokens: u32,
    /// The session, when the client named one.
    pub session: Option<SessionKey>,
    /// The requested model (the base model of a request for an adapter:
    /// the workers that may serve it).
    pub model: Option<&'a str>,
    /// The LoRA adapter it names.
    pub adapter: Option<&'a str>,
    /// Its model's block size and policy (`[[models]]`), where they are
    /// not the router's.
    pub settings: switchyard_core::select::ModelSettings,
    /// Its tenant, band and deadline, resolved with the dispatcher's
    /// [`FlowPolicy`](switchyard_core::admission::FlowPolicy) (the
    /// default: no tenant, the top band, no deadline).
    pub flow: switchyard_core::admission::Flow,
    /// The one worker it may go to (a Responses turn continuing a
    /// response that worker stores); `None`: any eligible worker.
    pub pinned: Option<WorkerId>,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubmitError {
    /// 429 with this retry-after.
    QueueFull {
        /// Suggested wait.
        retry_after_ms: u64,
    },
    /// No worker serves the model.
    UnknownModel,
    /// The request id is already in use here (ids are fresh per request and
    /// migration: a bug, never the client's doing).
    Duplicate,
}

struct Inner {
    dispatcher: Dispatcher,
    roster: Roster,
    /// Handlers waiting for their request's placement.
    waiting: FxHashMap<RequestId, oneshot::Sender<Assignment>>,
    /// Replica sync, when on.
    publisher: Option<ReplicaPublisher>,
}

impl Inner {
    /// Registers the handler waiting for `id`'s placement, before the call
    /// whose effects may dispatch it; `false` when another handler waits
    /// for that id already (left alone).
    fn wait_for(&mut self, id: RequestId, tx: oneshot::Sender<Assignment>) -> bool {
        match self.waiting.entry(id) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(tx);
                true
            }
        }
    }

    /// A submission's outcome: its effects, or the refusal (the handlers
    /// registered for `ids` removed).
    fn admitted(
        &mut self,
        submitted: Result<(Admitted, Effects), Refused>,
        ids: &[RequestId],
    ) -> (Result<Admitted, SubmitError>, Effects) {
        match submitted {
            Ok((admitted, fx)) => (Ok(admitted), fx),
            Err(refused) => {
                for id in ids {
                    self.waiting.remove(id);
                }
                let error = match refused {
                    Refused::Full { retry_after_ms } => SubmitError::QueueFull { retry_after_ms },
                    Refused::Duplicate => SubmitError::Duplicate,
                };
                (Err(error), Effects::default())
            }
        }
    }
}

impl Request<'_> {
    /// What the dispatcher is given, placed among `eligible`.
    fn into_submission(self, eligible: Eligible) -> Submission {
        Submission {
            blocks: self.blocks,
            prompt_tokens: self.prompt_tokens,
            session: self.session,
            eligible,
            class: QueueClass::default(),
            adapter: self.adapter.map(Into::into),
            model: self.settings,
            flow: self.flow,
        }
    }
}

/// The dispatcher's driver: the core's `Dispatcher` behind one lock, its
/// effects carried out; every handler holds it behind an `Arc`.
pub struct Driver {
    inner: Mutex<Inner>,
    /// Routes made before the lock, when the policy and index allow.
    pre: Option<PreRouting>,
    /// The exact prefix indexes' writer (KV events of both tiers) and the
    /// workers' liveness, when the router follows KV events: routing reads
    /// the indexes without waiting for it (see
    /// `switchyard_core::index::published`), and events never take
    /// `inner`. Lock order: this, then `inner`, never the other way round.
    index_writer: Option<Mutex<EventWriter>>,
    epoch: Instant,
    metrics: Arc<ServerMetrics>,
    /// LoRA adapters: the catalogue and loads in flight
    /// ([`crate::adapters`]).
    pub adapters: crate::adapters::Adapters,
    /// Which worker stores which response (`/v1/responses`), once the
    /// server's state made the map: peers' stored responses go in it.
    pub(crate) stored_responses: std::sync::OnceLock<Arc<crate::response_map::ResponseMap>>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver").finish_non_exhaustive()
    }
}

impl Driver {
    /// Wraps a dispatcher (with no workers yet); an exact index is
    /// published so that KV events never hold the routing lock while they
    /// are applied.
    pub fn new(mut dispatcher: Dispatcher, metrics: Arc<ServerMetrics>) -> Self {
        let index_writer = dispatcher.publish_index().map(|index| {
            Mutex::new(EventWriter {
                index,
                live: FxHashMap::default(),
            })
        });
        let pre = dispatcher
            .pre_routes()
            .map(|(routes, writer)| PreRouting::new(routes, writer));
        Self {
            index_writer,
            pre,
            inner: Mutex::new(Inner {
                dispatcher,
                roster: Roster::default(),
                waiting: FxHashMap::default(),
                publisher: None,
            }),
            epoch: Instant::now(),
            metrics,
            adapters: crate::adapters::Adapters::default(),
            stored_responses: std::sync::OnceLock::new(),
        }
    }

    /// The same router with this adapter catalogue (`[[adapters]]`).
    pub fn with_adapters(mut self, adapters: crate::adapters::Adapters) -> Self {
        self.adapters = adapters;
        self
    }

    /// Router metrics.
    pub fn metrics(&self) -> &Arc<ServerMetrics> {
        &self.metrics
    }

    /// Milliseconds since the router started: the core's clock.
    pub fn now_ms(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1e3
    }

    /// A fresh request id: 126 bits from the thread's CSPRNG (ChaCha,
    /// seeded from the OS and reseeded by `rand`), so ids are unique across
    /// router processes with overwhelming probability and unpredictable:
    /// clients see them in `x-request-id`, and no one can guess the next
    /// one. The top two bits are clear (the core keeps peers' bookings
    /// under keys with the top one set,
    /// `switchyard_core::replica::REMOTE_KEY_BIT`, and names a
    /// disaggregated request's prefill half with the next,
    /// `switchyard_core::dispatch::PREFILL_HALF_BIT`). Never zero.
    pub fn next_request_id(&self) -> RequestId {
        use rand::Rng as _;
        RequestId((rand::thread_rng().gen::<u128>() >> 2).max(1))
    }

    fn lock(&self) -> Locked<'_> {
        // A panic while holding the lock leaves the state as consistent as
        // the dispatcher's own invariants make it; keep serving.
        Locked {
            guard: Some(self.inner.lock().unwrap_or_else(|p| p.into_inner())),
            board: self.pre.as_ref().map(|pre| &pre.board),
        }
    }

    /// Runs one dispatcher call with the lock held and carries out its
    /// effects; routing decisions it made are timed as the call's time
    /// shared between them.
    fn drive<R>(&self, call: impl FnOnce(&mut Inner, f64) -> (R, Effects)) -> R {
        self.drive_from(Instant::now(), self.now_ms(), call)
    }

    /// [`Self::drive`] for a call whose work began at `started` (a route
    /// made before the lock), at core time `now`.
    fn drive_from<R>(
        &self,
        started: Instant,
        now: f64,
        call: impl FnOnce(&mut Inner, f64) -> (R, Effects),
    ) -> R {
        let mut inner = self.lock();
        let (result, fx) = call(&mut inner, now);
        let decisions = fx.counts.decisions;
        self.carry_out(&mut inner, fx, now);
        if decisions > 0 {
            let each = started.elapsed().as_secs_f64() / f64::from(decisions);
            for _ in 0..decisions {
                self.metrics.routing_decision.observe(each);
            }
        }
        result
    }

    /// Carries out effects (and those of the aborts they cause).
    fn carry_out(&self, inner: &mut Inner, fx: Effects, now: f64) {
        // The aborts' effects wait in `pending`, allocated only when a
        // placement found nobody waiting for it.
        let (mut next, mut pending) = (Some(fx), Vec::new());
        while let Some(fx) = next.take().or_else(|| pending.pop()) {
            let counts = fx.counts;
            if counts.proposals_used > 0 {
                self.metrics
                    .pre_routes_used
                    .inc_by(u64::from(counts.proposals_used));
            }
            if counts.proposals_rerouted > 0 {
                self.metrics
                    .pre_routes_rerouted
                    .inc_by(u64::from(counts.proposals_rerouted));
            }
            if counts.cancelled > 0 {
                self.metrics
                    .count_admissions(AdmissionDecision::Cancelled, counts.cancelled);
            }
            self.metrics
                .freed_by_removal
                .inc_by(u64::from(counts.freed_by_removal));
            if let Some(publisher) = &inner.publisher {
                publisher
                    .metrics()
                    .expired
                    .inc_by(u64::from(counts.expired_remote));
                switchyard_replica::publish_effects(publisher, &fx.publish, &fx.bindings);
            }
            for change in &fx.circuits {
                inner.roster.circuit_changed(change);
            }
            for sent in fx.dispatch {
                if let Some(load) = &sent.adapter_load {
                    self.adapters.begin(sent.worker, &load.adapter);
                }
                let handed = match (
                    inner.waiting.remove(&sent.id),
                    inner.roster.get(sent.worker),
                ) {
                    (Some(tx), Some(info)) => tx
                        .send(Assignment::Dispatched {
                            booking: sent.booking,
                            worker: sent.worker,
                            name: info.name.clone(),
                            url: info.url.clone(),
                            endpoint: info.endpoint.clone(),
                            overlap_blocks: sent.overlap_blocks,
                            waited_ms: sent.waited_ms,
                            progress: sent.progress,
                            adapter_load: sent.adapter_load,
                        })
                        .is_ok(),
                    _ => false,
                };
                if !handed {
                    // Nobody waits for it any more (the client went away).
                    pending.push(inner.dispatcher.abort(sent.id, now));
                }
            }
            for id in fx.no_worker {
                if let Some(tx) = inner.waiting.remove(&id) {
                    let _ = tx.send(Assignment::NoWorkers);
                }
            }
            for shed in fx.shed {
                if let Some(tx) = inner.waiting.remove(&shed.id) {
                    let _ = tx.send(Assignment::Shed {
                        retry_after_ms: shed.retry_after_ms,
                        late: shed.reason == switchyard_core::admission::ShedReason::Late,
                    });
                }
            }
        }
    }

    // ---- Requests (through the guards in `booking`) --------------------

    /// Admission: queues the request and tries to place it at once; the
    /// receiver gets its assignment (use [`crate::driver::booking::WaitHandle`],
    /// whose drop ends a request nobody waits for any more).
    pub(crate) fn submit(
        &self,
        id: RequestId,
        request: Request<'_>,
    ) -> Result<oneshot::Receiver<Assignment>, SubmitError> {
        self.submit_in(id, request, Role::Both)
    }

    /// [`Self::submit`] to the workers of one pool of a disaggregated
    /// fleet (`Prefill` or `Decode`; `Both`: any worker): the same
    /// admission, policy and booking, over fewer workers.
    pub(crate) fn submit_in(
        &self,
        id: RequestId,
        request: Request<'_>,
        pool: Role,
    ) -> Result<oneshot::Receiver<Assignment>, SubmitError> {
        let (tx, rx) = oneshot::channel();
        let started = Instant::now();
        let now = self.now_ms();
        let proposal = self.pre_route(&request, now);
        let admitted = self.drive_from(started, now, |inner, now| {
            let eligible = match inner.roster.eligible_in(request.model, pool) {
                // Pinned: that worker only, if it may serve the model at
                // all (else no worker: the request is never placed
                // elsewhere).
                Ok(eligible) => match request.pinned {
                    Some(w) if eligible.allows(w) => Eligible::one(w),
                    Some(_) => Eligible::none(),
                    None => eligible,
                },
                Err(UnknownModel) => return (Err(SubmitError::UnknownModel), Effects::default()),
            };
            if let Some(pre) = &self.pre {
                pre.every_worker
                    .store(eligible.is_every(), Ordering::Relaxed);
            }
            let submission = request.into_submission(eligible);
            // Registered first: the submit's own effects may dispatch it.
            // An id already waiting is another handler's: left alone.
            if !inner.wait_for(id, tx) {
                return (Err(SubmitError::Duplicate), Effects::default());
            }
            let submitted = inner
                .dispatcher
                .submit_proposed(id, submission, proposal, now);
            inner.admitted(submitted, &[id])
        });
        self.count_admission(&admitted);
        admitted?;
        Ok(rx)
    }

    /// Admission of a disaggregated request `id`
    /// ([`Dispatcher::submit_split`]): its prefill half (id
    /// [`prefill_half`]) in the prefill pool, and with
    /// [`Pairing::Together`] its decode half (id `id`) in the decode pool;
    /// the receivers get their halves' assignments. A decode half placed
    /// after the prefill is waited for with [`Self::handed_over`].
    pub(crate) fn submit_split(
        &self,
        id: RequestId,
        request: Request<'_>,
        pairing: Pairing,
        transfer_limit: u32,
    ) -> Result<
        (
            oneshot::Receiver<Assignment>,
            Option<oneshot::Receiver<Assignment>>,
        ),
        SubmitError,
    > {
        let (prefill_tx, prefill_rx) = oneshot::channel();
        let (decode_tx, decode_rx) = oneshot::channel();
        let together = pairing == Pairing::Together;
        let admitted = self.drive(|inner, now| {
            let pools = inner
                .roster
                .eligible_in(request.model, Role::Prefill)
                .and_then(|p| Ok((p, inner.roster.eligible_in(request.model, Role::Decode)?)));
            let Ok((prefill_pool, decode_pool)) = pools else {
                return (Err(SubmitError::UnknownModel), Effects::default());
            };
            let plan = SplitPlan {
                pairing,
                prefill_pool,
                decode_pool,
                transfer_limit,
            };
            let halves = [prefill_half(id), id];
            let halves = if together { &halves[..] } else { &halves[..1] };
            // Registered first, as in `submit_in`; an id already waited
            // for is another handler's and stays.
            if !inner.wait_for(halves[0], prefill_tx) {
                return (Err(SubmitError::Duplicate), Effects::default());
            }
            if together && !inner.wait_for(id, decode_tx) {
                inner.waiting.remove(&halves[0]);
                return (Err(SubmitError::Duplicate), Effects::default());
            }
            let submitted = inner.dispatcher.submit_split(
                id,
                request.into_submission(Eligible::Every),
                plan,
                now,
            );
            inner.admitted(submitted, halves)
        });
        self.count_admission(&admitted);
        admitted?;
        Ok((prefill_rx, together.then_some(decode_rx)))
    }

    /// The prefill half of disaggregated request `id` answered and its KV
    /// is held for the decode ([`Dispatcher::handed_over`]): the receiver
    /// of its decode half's assignment when the dispatcher places it now
    /// (`None`: the decode half is already placed or waited for, or the
    /// request is gone).
    pub(crate) fn handed_over(&self, id: RequestId) -> Option<oneshot::Receiver<Assignment>> {
        let (tx, rx) = oneshot::channel();
        self.drive(|inner, now| {
            let waits = inner.dispatcher.placement_of(id).is_none() && inner.wait_for(id, tx);
            let fx = inner.dispatcher.handed_over(id, now);
            if waits
                && !inner.dispatcher.is_known(id)
                && !fx.no_worker.contains(&id)
                && !fx.shed.iter().any(|s| s.id == id)
            {
                // Nothing was submitted for it (paired together, its
                // decode half ended first; or the request is gone).
                inner.waiting.remove(&id);
                return (false, fx);
            }
            (waits, fx)
        })
        .then_some(rx)
    }

    /// The prefill of disaggregated request `id` is done again
    /// ([`Dispatcher::redo_prefill`]); the receiver gets the new prefill
    /// half's assignment. A guard of the old prefill half must be gone
    /// first: its drop would end the new one.
    pub(crate) fn redo_prefill(
        &self,
        id: RequestId,
        transfer_failed: bool,
    ) -> Result<oneshot::Receiver<Assignment>, SplitError> {
        let (tx, rx) = oneshot::channel();
        let half = prefill_half(id);
        self.drive(|inner, now| {
            inner.waiting.remove(&half);
            inner.waiting.insert(half, tx);
            match inner.dispatcher.redo_prefill(id, transfer_failed, now) {
                Ok(fx) => (Ok(()), fx),
                Err(e) => {
                    inner.waiting.remove(&half);
                    (Err(e), Effects::default())
                }
            }
        })?;
        Ok(rx)
    }

    fn count_admission(&self, admitted: &Result<Admitted, SubmitError>) {
        match admitted {
            Ok(Admitted::Queued) => self.metrics.count_admissions(AdmissionDecision::Queued, 1),
            Ok(Admitted::Deferred) => self
                .metrics
                .count_admissions(AdmissionDecision::Deferred, 1),
            Err(SubmitError::QueueFull { .. }) => self
                .metrics
                .count_admissions(AdmissionDecision::Rejected, 1),
            Err(SubmitError::UnknownModel | SubmitError::Duplicate) => {}
        }
    }

    /// The request's first token arrived.
    pub(crate) fn first_token(&self, id: RequestId) {
        self.drive(|inner, now| ((), inner.dispatcher.first_token(id, now)));
    }

    /// Its worker failed it (the circuit breaker hears it once per booking).
    pub(crate) fn worker_failed(&self, id: RequestId) {
        self.drive(|inner, now| ((), inner.dispatcher.worker_failed(id, now)));
    }

    /// It finished with `context_tokens` (prompt plus generated).
    pub(crate) fn finish(&self, id: RequestId, context_tokens: u64) {
        self.drive(|inner, now| ((), inner.dispatcher.finish(id, context_tokens, now)));
    }

    /// It ended without a result, wherever it was.
    pub(crate) fn abort(&self, id: RequestId) {
        self.drive(|inner, now| {
            inner.waiting.remove(&id);
            ((), inner.dispatcher.abort(id, now))
        });
    }

    /// Moves a placed request off its worker under the new `booking` id
    /// (with `prompt`, when it changes); the receiver gets its next
    /// assignment.
    pub(crate) fn migrate(
        &self,
        id: RequestId,
        booking: RequestId,
        prompt: Option<(Vec<LocalHash>, u32)>,
    ) -> Result<oneshot::Receiver<Assignment>, MigrateError> {
        let (tx, rx) = oneshot::channel();
        self.drive(|inner, now| {
            inner.waiting.insert(id, tx);
            match inner.dispatcher.migrate(id, booking, prompt, now) {
                Ok(fx) => (Ok(()), fx),
                Err(e) => {
                    inner.waiting.remove(&id);
                    (Err(e), Effects::default())
                }
            }
        })?;
        Ok(rx)
    }

    /// Periodic work: admission reconcile and rechecks, expiry, silent
    /// peers, circuit cooldowns.
    pub fn tick(&self) {
        self.drive(|inner, now| ((), inner.dispatcher.tick(now)));
    }

    /// When `tick` is next due, on [`Self::now_ms`]'s clock.
    pub fn next_wakeup_ms(&self) -> f64 {
        self.lock().dispatcher.next_wakeup_ms()
    }

    // ---- Replica sync -------------------------------------------------

    /// Turns replica sync on as replica `id`, publishing through
    /// `publisher`.
    pub fn attach_replica(&self, id: ReplicaId, publisher: ReplicaPublisher) {
        let mut inner = self.lock();
        inner.dispatcher.set_replica(id);
        inner.publisher = Some(publisher);
    }

    /// The replica plane's counters, with sync on.
    pub fn replica_metrics(&self) -> Option<Arc<ReplicaMetrics>> {
        self.lock().publisher.as_ref().map(|p| p.metrics().clone())
    }

    /// The booking ids of this replica's live bookings (its digest).
    pub fn local_booking_ids(&self) -> Vec<RequestId> {
        self.lock().dispatcher.local_booking_ids()
    }

    /// Applies one of a peer's batches.
    pub fn apply_replica_batch(&self, batch: &ReplicaBatch) -> BatchReport {
        if !batch.responses.is_empty() {
            if let Some(map) = self.stored_responses.get() {
                let now = std::time::Instant::now();
                for stored in &batch.responses {
                    let holder = crate::response_map::Holder {
                        worker: stored.worker,
                        session: stored.session,
                        owner: stored.owner.map(crate::response_map::Owner),
                    };
                    // An id another key holds is not moved (counted).
                    map.insert(&stored.id, holder, now);
                }
            }
        }
        self.drive(|inner, now| switchyard_replica::apply_batch(&mut inner.dispatcher, batch, now))
    }

    /// Tells peer replicas (with sync on) that `worker` stores response
    /// `id`; never blocks (a full queue drops and counts).
    pub(crate) fn publish_stored_response(&self, id: &str, holder: crate::response_map::Holder) {
        if let Some(publisher) = &self.lock().publisher {
            let _ = publisher.response_stored(switchyard_wire::replica::StoredResponse {
                id: id.to_owned(),
                worker: holder.worker,
                session: holder.session,
                owner: holder.owner.map(|o| o.0),
            });
        }
    }

    /// Frees the bookings of peers silent past their expiry; returns how
    /// many (the plane's subscriber, which asks, counts them).
    pub fn expire_silent_replicas(&self) -> u64 {
        self.drive(|inner, now| {
            let mut fx = inner.dispatcher.tick(now);
            let expired = std::mem::take(&mut fx.counts.expired_remote);
            (u64::from(expired), fx)
        })
    }

    // ---- Metrics ------------------------------------------------------

    /// What `/metrics` shows of the routing state, read under one lock.
    pub fn snapshot(&self) -> Snapshot {
        let now = self.now_ms();
        let inner = self.lock();
        let router = inner.dispatcher.router();
        let registry = router.sequences().registry();
        let workers = inner
            .roster
            .sorted()
            .into_iter()
            .map(|info| {
                let load = registry.load(info.id);
                let requests = load.map_or(0, |l| l.requests);
                let remote = router.remote().remote_requests_on(info.id);
                WorkerRow {
                    name: info.name.clone(),
                    prefill_tokens: load.map_or(0, |l| l.active_prefill_tokens(now)),
                    decode_blocks: load.map_or(0, |l| l.decode_blocks),
                    requests,
                    local_requests: requests.saturating_sub(remote),
                    remote_requests: remote,
                    up: info.in_router && !info.draining,
                    kv_usage: info.kv_usage,
                    circuit: info.circuit,
                    circuit_transitions: info.circuit_transitions,
                }
            })
            .collect();
        let admission = inner.dispatcher.admission();
        Snapshot {
            workers,
            active_requests: router.sequences().active_requests(),
            index_blocks: router.with_index(|index| index.live_pairs()),
            index_bytes: router.estimated_bytes(),
            index_evicted_blocks: router.index_evicted_over_cap(),
            queue_depth: admission.queue().len(),
            strategy: admission.strategy().map(|s| (s.name(), s.event_counts())),
            flows: {
                let flows = inner.dispatcher.flows();
                inner
                    .dispatcher
                    .flow_counters()
                    .into_iter()
                    .map(|s| crate::metrics_state::FlowRow {
                        tenant: flows.tenant_name(s.tenant).to_owned(),
                        band: flows.band_name(s.band).to_owned(),
                        waiting: s.waiting,
                        counters: s.counters,
                    })
                    .collect()
            },
        }
    }

    /// Registers what `/metrics` shows of this router into `registry`: its
    /// own counters and histograms, the routing state (a [`Snapshot`] per
    /// scrape) and, with replica sync attached (call after
    /// [`Self::attach_replica`]), the replica plane's counters.
    pub fn register_metrics(self: &Arc<Self>, registry: &mut Registry) {
        self.metrics.register(registry);
        let driver = self.clone();
        registry.register_collector(Box::new(RoutingStateCollector::new(move || {
            driver.snapshot()
        })));
        if let Some(replica) = self.replica_metrics() {
            replica.register(registry);
        }
    }
}

#[cfg(test)]
mod tests;
