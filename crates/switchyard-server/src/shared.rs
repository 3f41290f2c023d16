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
//! Handlers use the guards in [`crate::request::booking`], which wrap the
//! assignments this module hands out; nothing outside this module sees the
//! dispatcher or the lock.

use crate::gauges::{RoutingStateCollector, Snapshot, WorkerRow};
use crate::metrics::{AdmissionDecision, ServerMetrics};
use crate::roster::{Role, Roster, UnknownModel, WorkerInfo};
use prometheus_client::registry::Registry;
use rustc_hash::FxHashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use switchyard_core::admission::{ProgressUpdater, QueueClass, SessionKey};
use switchyard_core::dispatch::{Admitted, Dispatcher, Effects, MigrateError, Refused, Submission};
use switchyard_core::health::{CircuitConfig, CircuitConfigError, CircuitState};
use switchyard_core::index::published::IndexWriter;
use switchyard_core::index::{CacheTier, IndexEvent};
use switchyard_core::router::board::{BoardWriter, LoadChange, PreRouter, PreRoutes, Proposal};
use switchyard_core::router::WorkerCapacity;
use switchyard_core::select::RoutingRequest;
use switchyard_core::{LocalHash, ReplicaId, RequestId, WorkerId};
use switchyard_replica::{BatchReport, ReplicaMetrics, ReplicaPublisher};
use switchyard_wire::replica::ReplicaBatch;
use tokio::sync::oneshot;

/// The KV-event side of the routing state: the published indexes' writer
/// and the liveness table events are checked against, so that applying
/// an event never takes the routing lock.
struct EventWriter {
    index: IndexWriter,
    /// The workers in the router and the events epoch of each: a
    /// subscriber's event is applied only while its epoch is its worker's
    /// here. Mirrors the roster's `in_router` entries (as bounded as the
    /// roster), kept in step by [`SharedRouter::set_in_router`] under this
    /// lock.
    live: FxHashMap<WorkerId, u64>,
}

/// The event writer's lock; a panic while it was held leaves the index as
/// consistent as its own invariants make it.
fn lock_writer(writer: &Mutex<EventWriter>) -> MutexGuard<'_, EventWriter> {
    writer.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where a request goes, handed from the dispatcher to its waiting handler
/// (see [`crate::request::booking::WaitHandle`]).
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

/// Routing outside the lock (`switchyard_core::router::board`): a
/// request is routed on the published index and load board before the
/// lock is taken, and the dispatcher takes that route as its decision
/// when it places the request at once.
struct PreRouting {
    routes: PreRoutes,
    board: BoardPublisher,
    /// Pre-routers not in use: a placing thread takes one for a route
    /// and puts it back (made on demand: at most one per thread routing
    /// at the same moment).
    idle: Mutex<Vec<PreRouter>>,
    /// Whether the last request submitted could go to every worker: the
    /// next one is routed among all before the lock, and its eligibility
    /// checked under it. Requests of a fleet whose models or roles split
    /// the workers are routed under the lock.
    every_worker: AtomicBool,
}

/// The board of loads that routes outside the lock read, and its writer.
///
/// Changes leave the dispatcher in order, under its lock, into `queue`
/// (lock order: `inner`, then `queue`); whoever then gets `writer`
/// applies everything queued, after letting go of `inner`, so that
/// neither the changes' second application nor the writer's wait for
/// routes still reading the old copy holds the routing lock. A caller
/// that finds the writer busy leaves its changes to the holder, which
/// looks at the queue again once it lets go.
struct BoardPublisher {
    queue: Mutex<Vec<LoadChange>>,
    /// The writer and a spare buffer swapped with the queue.
    writer: Mutex<(BoardWriter, Vec<LoadChange>)>,
}

impl BoardPublisher {
    /// Applies every change queued, unless another thread is applying
    /// (it will apply ours too).
    fn flush(&self) {
        loop {
            {
                let mut held = match self.writer.try_lock() {
                    Ok(held) => held,
                    Err(std::sync::TryLockError::WouldBlock) => return,
                    Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
                };
                let (writer, spare) = &mut *held;
                std::mem::swap(
                    &mut *self.queue.lock().unwrap_or_else(|p| p.into_inner()),
                    spare,
                );
                writer.apply(spare);
            }
            // Changes queued while this thread applied were left to it.
            if self
                .queue
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_empty()
            {
                return;
            }
        }
    }
}

/// The router's state as a call holds it; on release the changes it made
/// to the loads are queued for the board, in order, and applied once the
/// lock is let go.
struct Locked<'a> {
    guard: Option<MutexGuard<'a, Inner>>,
    board: Option<&'a BoardPublisher>,
}

impl std::ops::Deref for Locked<'_> {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        self.guard.as_ref().expect("held until dropped")
    }
}

impl std::ops::DerefMut for Locked<'_> {
    fn deref_mut(&mut self) -> &mut Inner {
        self.guard.as_mut().expect("held until dropped")
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        let (Some(mut inner), Some(board)) = (self.guard.take(), self.board) else {
            return;
        };
        let queued = {
            let mut queue = board.queue.lock().unwrap_or_else(|p| p.into_inner());
            inner.dispatcher.take_load_changes(&mut queue);
            !queue.is_empty()
        };
        drop(inner);
        // Nothing queued: nothing for this thread to apply (a holder of
        // the writer applies what others queued meanwhile).
        if queued {
            board.flush();
        }
    }
}

/// The shared state; cheap to share behind an `Arc`.
pub struct SharedRouter {
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
}

impl std::fmt::Debug for SharedRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedRouter").finish_non_exhaustive()
    }
}

impl SharedRouter {
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
        let pre = dispatcher.pre_routes().map(|(routes, writer)| PreRouting {
            routes,
            board: BoardPublisher {
                queue: Mutex::new(Vec::new()),
                writer: Mutex::new((writer, Vec::new())),
            },
            idle: Mutex::new(Vec::new()),
            every_worker: AtomicBool::new(true),
        });
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
        }
    }

    /// The same router with this adapter catalogue (`[[adapters]]`).
    pub fn with_adapters(mut self, adapters: crate::adapters::Adapters) -> Self {
        self.adapters = adapters;
        self
    }

    /// A worker's loaded adapters as its `/v1/models` lists them.
    pub(crate) fn adapter_report(&self, id: WorkerId, names: &[String]) {
        let now = self.now_ms();
        let mut inner = self.lock();
        let table = inner.dispatcher.adapters_mut();
        table.set_loaded(id, names.iter().map(String::as_str), now);
        let (total, dropped) = (table.total(), table.counters().dropped);
        drop(inner);
        self.adapters.observe_table(total, dropped);
    }

    /// Marks adapter `name` as one the router cannot load (learned from a
    /// worker, not configured), or clears the mark: see
    /// [`switchyard_core::adapters::AdapterTable::set_holders_only`].
    pub(crate) fn adapter_holders_only(&self, name: &str, on: bool) {
        self.lock()
            .dispatcher
            .adapters_mut()
            .set_holders_only(name, on);
    }

    /// A worker's adapter slots (`max_loras`), when it reports them.
    pub(crate) fn adapter_slots(&self, id: WorkerId, slots: Option<usize>) {
        self.lock().dispatcher.adapters_mut().set_slots(id, slots);
    }

    /// The adapter slots the router knows of worker `id`.
    pub(crate) fn adapter_slots_of(&self, id: WorkerId) -> Option<usize> {
        self.lock().dispatcher.router().adapters().slots(id)
    }

    /// `adapter` is loaded on worker `id` now (a load the router made).
    pub(crate) fn adapter_loaded(&self, id: WorkerId, adapter: &str) {
        let now = self.now_ms();
        self.lock()
            .dispatcher
            .adapters_mut()
            .mark_loaded(id, adapter, now, now);
    }

    /// `adapter` is not (or no longer) loaded on worker `id`.
    pub(crate) fn adapter_unloaded(&self, id: WorkerId, adapter: &str) {
        self.lock()
            .dispatcher
            .adapters_mut()
            .mark_unloaded(id, adapter);
    }

    /// Router metrics.
    pub fn metrics(&self) -> &Arc<ServerMetrics> {
        &self.metrics
    }

    /// Milliseconds since the router started: the core's clock.
    pub fn now_ms(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1e3
    }

    /// A fresh request id: 127 bits from the thread's CSPRNG (ChaCha,
    /// seeded from the OS and reseeded by `rand`), so ids are unique across
    /// router processes with overwhelming probability and unpredictable:
    /// clients see them in `x-request-id`, and no one can guess the next
    /// one. The top bit is clear (the core keeps peers' bookings under
    /// keys with it set, `switchyard_core::replica::REMOTE_KEY_BIT`).
    /// Never zero.
    pub fn next_request_id(&self) -> RequestId {
        use rand::Rng as _;
        RequestId((rand::thread_rng().gen::<u128>() >> 1).max(1))
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
        }
    }

    // ---- Requests (through the guards in `booking`) --------------------

    /// Admission: queues the request and tries to place it at once; the
    /// receiver gets its assignment (use [`crate::request::booking::WaitHandle`],
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
                Ok(eligible) => eligible,
                Err(UnknownModel) => return (Err(SubmitError::UnknownModel), Effects::default()),
            };
            if let Some(pre) = &self.pre {
                pre.every_worker
                    .store(eligible.is_empty(), Ordering::Relaxed);
            }
            let submission = Submission {
                blocks: request.blocks,
                prompt_tokens: request.prompt_tokens,
                session: request.session,
                eligible,
                class: QueueClass::default(),
                adapter: request.adapter.map(Into::into),
                model: request.settings,
            };
            // Registered first: the submit's own effects may dispatch it.
            // An id already waiting is another handler's: left alone.
            match inner.waiting.entry(id) {
                std::collections::hash_map::Entry::Occupied(_) => {
                    return (Err(SubmitError::Duplicate), Effects::default());
                }
                std::collections::hash_map::Entry::Vacant(slot) => {
                    slot.insert(tx);
                }
            }
            match inner
                .dispatcher
                .submit_proposed(id, submission, proposal, now)
            {
                Ok((admitted, fx)) => (Ok(admitted), fx),
                Err(refused) => {
                    inner.waiting.remove(&id);
                    let error = match refused {
                        Refused::Full { retry_after_ms } => {
                            SubmitError::QueueFull { retry_after_ms }
                        }
                        Refused::Duplicate => SubmitError::Duplicate,
                    };
                    (Err(error), Effects::default())
                }
            }
        });
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
        admitted?;
        Ok(rx)
    }

    /// The request routed on the published index and load board, before
    /// the lock (`None` when routing outside the lock is off, the last
    /// request could not go to every worker, or the route must be made
    /// under the lock: see `PreRouter::route`).
    fn pre_route(&self, request: &Request<'_>, now: f64) -> Option<Proposal> {
        let pre = self.pre.as_ref()?;
        if !pre.every_worker.load(Ordering::Relaxed) {
            return None;
        }
        let taken = pre.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut router = taken.unwrap_or_else(|| pre.routes.router());
        let routing = RoutingRequest {
            prompt_tokens: request.prompt_tokens,
            blocks: &request.blocks,
            adapter: request.adapter,
            model: request.settings,
        };
        let proposal = router.route(routing, None, now);
        pre.idle
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(router);
        proposal
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

    // ---- Workers ------------------------------------------------------

    /// Registers a worker (not yet in selection until `set_in_router`).
    pub fn add_worker(&self, name: &str, url: &str) -> Result<WorkerId, String> {
        // Replicas name workers by id: derive it from the name, not the order.
        let id = switchyard_replica::worker_id_for_name(name);
        self.lock().roster.insert(id, name, url)?;
        Ok(id)
    }

    /// Puts a worker into selection or takes it out. Taking it out drops
    /// its index entries and bookings; putting it back starts a fresh
    /// circuit and a new KV-event epoch.
    pub fn set_in_router(&self, id: WorkerId, in_router: bool) {
        // The event writer's lock first (the lock order), held across the
        // roster change: an event checked after it sees the new liveness,
        // one checked before has been applied already.
        let mut events = self.index_writer.as_ref().map(lock_writer);
        let epoch = self.drive(|inner, now| {
            let Some(info) = inner.roster.get_mut(id) else {
                return (None, Effects::default());
            };
            if info.in_router == in_router {
                return (None, Effects::default());
            }
            info.in_router = in_router;
            if in_router {
                info.failures = 0;
                info.events_epoch += 1;
                let (capacity, used, epoch) = (info.capacity, info.kv_usage, info.events_epoch);
                let fx = inner.dispatcher.add_worker(id, capacity, now);
                inner.dispatcher.report_kv(id, used);
                (Some(epoch), fx)
            } else {
                (Some(0), inner.dispatcher.remove_worker(id, now))
            }
        });
        if let (Some(events), Some(epoch)) = (events.as_mut(), epoch) {
            if in_router {
                events.live.insert(id, epoch);
            } else {
                events.live.remove(&id);
                events.index.remove_worker(id);
            }
        }
    }

    /// Sets every worker's circuit-breaker settings.
    pub fn set_circuit_config(&self, config: CircuitConfig) -> Result<(), CircuitConfigError> {
        self.lock().dispatcher.set_circuit_config(config)
    }

    /// A worker's circuit state, while it is in the router.
    pub fn circuit_state(&self, id: WorkerId) -> Option<CircuitState> {
        self.lock().dispatcher.circuit_state(id)
    }

    /// Whether a worker's circuit would take a request now.
    pub fn circuit_admits(&self, id: WorkerId) -> Option<bool> {
        self.lock().dispatcher.circuit_admits(id)
    }

    /// The epoch a KV-event subscriber started now belongs to (`None` while
    /// the worker is out of the router).
    pub fn events_epoch(&self, id: WorkerId) -> Option<u64> {
        let inner = self.lock();
        let info = inner.roster.get(id)?;
        info.in_router.then_some(info.events_epoch)
    }

    /// Applies a KV event about one of `worker`'s cache tiers from the
    /// subscriber of `epoch`; a stale subscriber's (the worker left the
    /// router since) is dropped and counted. Returns whether it was
    /// applied. Both tiers take the same path: with a published index, the
    /// writer's lock alone (the liveness check is its table's); otherwise
    /// the routing lock.
    pub fn apply_worker_event(
        &self,
        worker: WorkerId,
        epoch: u64,
        tier: CacheTier,
        event: &IndexEvent,
    ) -> bool {
        let live = match &self.index_writer {
            Some(writer) => {
                let mut writer = lock_writer(writer);
                let live = writer.live.get(&worker) == Some(&epoch);
                if live {
                    writer.index.apply(worker, tier, event);
                }
                live
            }
            None => {
                let mut inner = self.lock();
                let live = inner
                    .roster
                    .get(worker)
                    .is_some_and(|w| w.in_router && w.events_epoch == epoch);
                if live {
                    inner.dispatcher.apply_kv_event(worker, tier, event);
                }
                live
            }
        };
        if !live {
            self.metrics.stale_kv_events.inc();
        }
        live
    }

    /// Removes a worker entirely.
    pub fn remove_worker(&self, id: WorkerId) -> Option<WorkerInfo> {
        self.set_in_router(id, false);
        self.lock().roster.remove(id)
    }

    /// Sets a worker's part in a disaggregated fleet (and, for SGLang, its
    /// bootstrap port).
    pub fn set_role(&self, id: WorkerId, role: Role, bootstrap_port: Option<u16>) {
        if let Some(info) = self.lock().roster.get_mut(id) {
            info.role = role;
            info.bootstrap_port = bootstrap_port;
        }
    }

    /// A worker's role and bootstrap port.
    pub fn role_of(&self, id: WorkerId) -> Option<(Role, Option<u16>)> {
        let inner = self.lock();
        let info = inner.roster.get(id)?;
        Some((info.role, info.bootstrap_port))
    }

    /// Whether the fleet has a prefill and a decode worker
    /// ([`Roster::disaggregated`]).
    pub fn disaggregated(&self) -> bool {
        self.lock().roster.disaggregated()
    }

    /// Marks a worker draining (no new requests).
    pub fn set_draining(&self, id: WorkerId) {
        if let Some(info) = self.lock().roster.get_mut(id) {
            info.draining = true;
        }
    }

    /// Records one health-check result; returns whether the worker should
    /// now be in selection.
    pub fn health_result(&self, id: WorkerId, ok: bool, threshold: u32) -> Option<bool> {
        let mut inner = self.lock();
        let info = inner.roster.get_mut(id)?;
        if ok {
            info.failures = 0;
            Some(true)
        } else {
            info.failures = info.failures.saturating_add(1);
            Some(info.failures < threshold && info.in_router)
        }
    }

    /// Snapshot of the worker table, sorted by name.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        self.lock().roster.sorted().into_iter().cloned().collect()
    }

    /// Sets a worker's capacity (the busy thresholds use it from its next
    /// entry into selection; the admission strategy at once).
    pub fn set_capacity(&self, id: WorkerId, capacity: WorkerCapacity) {
        let mut inner = self.lock();
        let Some(info) = inner.roster.get_mut(id) else {
            return;
        };
        info.capacity = capacity;
        let (in_router, used) = (info.in_router, info.kv_usage);
        if in_router {
            // Updates the capacity in place: places nothing new.
            let now = self.now_ms();
            let fx = inner.dispatcher.add_worker(id, capacity, now);
            self.carry_out(&mut inner, fx, now);
            inner.dispatcher.report_kv(id, used);
        }
    }

    /// Whether an admission strategy wants the workers' KV usage.
    pub fn wants_kv_usage(&self) -> bool {
        self.lock().dispatcher.admission().strategy().is_some()
    }

    /// Records a worker's measured KV usage (a fraction, clamped to 0..=1;
    /// not a number: ignored) and passes it to the admission strategy.
    pub fn set_kv_usage(&self, id: WorkerId, fraction: f64) {
        if !fraction.is_finite() {
            return;
        }
        let fraction = fraction.clamp(0.0, 1.0);
        let mut inner = self.lock();
        let Some(info) = inner.roster.get_mut(id) else {
            return;
        };
        info.kv_usage = Some(fraction);
        inner.dispatcher.report_kv(id, Some(fraction));
    }

    /// Sets a worker's model list.
    pub fn set_models(&self, id: WorkerId, models: Vec<String>) {
        if let Some(info) = self.lock().roster.get_mut(id) {
            info.models = models;
        }
    }

    /// Active requests booked on `id` (0 when unknown): this replica's
    /// and, with replica sync on, its peers'. This is the worker's load.
    pub fn active_requests(&self, id: WorkerId) -> usize {
        self.lock()
            .dispatcher
            .router()
            .sequences()
            .registry()
            .load(id)
            .map_or(0, |l| l.requests)
    }

    /// Requests booked on any worker.
    pub fn total_active_requests(&self) -> usize {
        self.lock()
            .dispatcher
            .router()
            .sequences()
            .active_requests()
    }

    /// Requests this replica booked on `id` and has not freed. Draining
    /// waits for these only — a peer's bookings end on the peer.
    pub fn local_requests(&self, id: WorkerId) -> usize {
        self.lock().dispatcher.local_requests_on(id)
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
        self.drive(|inner, now| switchyard_replica::apply_batch(&mut inner.dispatcher, batch, now))
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
        }
    }

    /// Registers what `/metrics` shows of this router into `registry`: its
    /// own counters and histograms, the routing state (a [`Snapshot`] per
    /// scrape) and, with replica sync attached (call after
    /// [`Self::attach_replica`]), the replica plane's counters.
    pub fn register_metrics(self: &Arc<Self>, registry: &mut Registry) {
        self.metrics.register(registry);
        let shared = self.clone();
        registry.register_collector(Box::new(RoutingStateCollector::new(move || {
            shared.snapshot()
        })));
        if let Some(replica) = self.replica_metrics() {
            replica.register(registry);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AdmissionMode;
    use crate::request::booking::WaitHandle;
    use crate::testing::{book_remotely, place, request, shared_with};
    use crate::ServerConfig;
    use switchyard_core::select::PolicyKind;

    fn round_robin() -> ServerConfig {
        ServerConfig {
            policy: PolicyKind::RoundRobin,
            ..ServerConfig::default()
        }
    }

    #[test]
    fn request_ids_are_distinct_and_share_no_predictable_part() {
        let (shared, _) = shared_with(&ServerConfig::default(), &["a"]);
        let ids: Vec<u128> = (0..2_000).map(|_| shared.next_request_id().0).collect();
        let distinct: std::collections::HashSet<u128> = ids.iter().copied().collect();
        assert_eq!(distinct.len(), ids.len());
        assert!(ids
            .iter()
            .all(|&id| id != 0 && id & switchyard_core::replica::REMOTE_KEY_BIT == 0));
        // A start-time salt and a counter would repeat the high half and
        // step the low half by one; 128 random bits do neither.
        let highs: std::collections::HashSet<u64> =
            ids.iter().map(|&id| (id >> 64) as u64).collect();
        assert!(highs.len() > 1_990, "{} distinct high halves", highs.len());
        let steps = ids
            .windows(2)
            .filter(|w| w[1].wrapping_sub(w[0]) == 1)
            .count();
        assert_eq!(steps, 0);
        // Still a valid header value: 32 lowercase hex digits.
        let text = RequestId(ids[0]).to_string();
        assert_eq!(text.len(), 32);
        assert!(text.bytes().all(|b| b.is_ascii_hexdigit()));
    }

    #[tokio::test]
    async fn a_migrated_request_never_goes_back_to_a_worker_that_failed_it() {
        let (shared, _) = shared_with(&round_robin(), &["a", "b", "c"]);
        // Failing every worker in turn must not open their circuits.
        with_circuit(&shared, 100, 60_000);
        for _ in 0..4 {
            let mut booking = place(&shared, request(&[], 4)).await.unwrap();
            let mut failed = Vec::new();
            for _ in 0..2 {
                booking.worker_failed();
                failed.push(booking.worker);
                let wait = booking.migrate(None).unwrap();
                booking = wait.placed().await.unwrap();
                assert!(!failed.contains(&booking.worker), "{failed:?}");
            }
            // The last worker fails it too: no worker can take it.
            booking.worker_failed();
            assert!(booking.migrate(None).unwrap().placed().await.is_err());
            assert_eq!(shared.total_active_requests(), 0);
        }
    }

    /// The default router following KV events (an exact, published index).
    fn following_events() -> ServerConfig {
        ServerConfig {
            cache: crate::config::CacheMode::Events,
            ..ServerConfig::default()
        }
    }

    #[test]
    fn without_kv_events_every_route_is_made_under_the_lock() {
        let (shared, _) = shared_with(&ServerConfig::default(), &["a"]);
        assert!(
            shared.pre.is_none(),
            "the approximate index is the router's own"
        );
        let (shared, _) = shared_with(
            &ServerConfig {
                policy: PolicyKind::CacheAware,
                ..following_events()
            },
            &["a"],
        );
        assert!(shared.pre.is_none(), "cache-aware keeps its own tree");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn requests_placed_from_many_threads_are_routed_before_the_lock_and_all_booked() {
        let (shared, ids) = shared_with(&following_events(), &["a", "b", "c", "d"]);
        assert!(
            shared.pre.is_some(),
            "the default policy routes outside the lock when it follows KV events"
        );
        let placing = (0..8u64).map(|t| {
            let shared = shared.clone();
            tokio::spawn(async move {
                // Every other booking is freed at once: frees and
                // bookings of all threads interleave.
                let mut bookings = Vec::new();
                for n in 0..100u64 {
                    let blocks: Vec<u64> = (0..4).map(|b| t * 1_000 + n * 10 + b).collect();
                    let booking = place(&shared, request(&blocks, 70)).await.unwrap();
                    if n % 2 == 0 {
                        bookings.push(booking);
                    }
                }
                bookings
            })
        });
        let mut bookings = Vec::new();
        for task in placing {
            bookings.extend(task.await.unwrap());
        }
        assert_eq!(bookings.len(), 400);
        assert_eq!(shared.total_active_requests(), 400);
        let on = |id| bookings.iter().filter(|b| b.worker == id).count();
        assert!(ids.iter().all(|&id| on(id) > 0), "load spreads");
        let metrics = shared.metrics();
        let (used, rerouted) = (
            metrics.pre_routes_used.get(),
            metrics.pre_routes_rerouted.get(),
        );
        assert_eq!(
            used + rerouted,
            800,
            "every request was routed before the lock"
        );
        assert!(used > 0);
        drop(bookings);
        assert_eq!(shared.total_active_requests(), 0);
        // Every change reached the board, in order: it shows no load left.
        let pre = shared.pre.as_ref().unwrap();
        let mut router = pre.routes.router();
        let blocks: Vec<LocalHash> = (0..4).map(LocalHash).collect();
        let routing = RoutingRequest {
            prompt_tokens: 70,
            blocks: &blocks,
            adapter: None,
            model: Default::default(),
        };
        assert!(router.route(routing, None, shared.now_ms()).is_some());
        let seen = router.last_candidates();
        assert_eq!(seen.len(), 4);
        for c in seen {
            assert_eq!(
                (
                    c.active_requests,
                    c.active_decode_blocks,
                    c.active_prefill_tokens
                ),
                (0, 0, 0),
                "{c:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_fleet_whose_models_split_the_workers_routes_under_the_lock() {
        let (shared, ids) = shared_with(&following_events(), &["a", "b"]);
        shared.set_models(ids[0], vec!["m1".into()]);
        shared.set_models(ids[1], vec!["m2".into()]);
        let for_m2 = || Request {
            model: Some("m2"),
            ..request(&[1, 2], 40)
        };
        // The first request finds out that not every worker may take it.
        let first = place(&shared, for_m2()).await.unwrap();
        assert_eq!(first.worker, ids[1]);
        let metrics = shared.metrics();
        let counts = || {
            (
                metrics.pre_routes_used.get(),
                metrics.pre_routes_rerouted.get(),
            )
        };
        let after_first = counts();
        assert_eq!(after_first.0 + after_first.1, 1, "{after_first:?}");
        for _ in 0..5 {
            let booking = place(&shared, for_m2()).await.unwrap();
            assert_eq!(booking.worker, ids[1]);
        }
        assert_eq!(counts(), after_first, "none routed before the lock");
    }

    #[tokio::test]
    async fn local_requests_leave_out_peers_bookings_on_the_worker() {
        let (shared, ids) = shared_with(&ServerConfig::default(), &["a"]);
        book_remotely(&shared, 1_000, ids[0]);
        book_remotely(&shared, 1_001, ids[0]);
        assert_eq!(shared.active_requests(ids[0]), 2, "the load counts them");
        assert_eq!(shared.local_requests(ids[0]), 0);
        let booking = place(&shared, request(&[], 4)).await.unwrap();
        assert_eq!(shared.active_requests(ids[0]), 3);
        assert_eq!(shared.local_requests(ids[0]), 1);
        drop(booking);
        assert_eq!(shared.local_requests(ids[0]), 0);
    }

    #[tokio::test]
    async fn removing_a_worker_counts_only_this_replicas_bookings_as_freed() {
        let (shared, ids) = shared_with(&ServerConfig::default(), &["a"]);
        book_remotely(&shared, 1_000, ids[0]);
        let booking = place(&shared, request(&[], 4)).await.unwrap();
        shared.set_in_router(ids[0], false);
        assert_eq!(
            shared.metrics().freed_by_removal.get(),
            1,
            "the peer's booking is the peer's to free"
        );
        assert_eq!(shared.active_requests(ids[0]), 0);
        drop(booking);
    }

    #[tokio::test]
    async fn kv_events_count_only_while_their_subscriber_s_epoch_is_the_worker_s() {
        let config = ServerConfig {
            cache: crate::config::CacheMode::Events,
            ..ServerConfig::default()
        };
        let (shared, ids) = shared_with(&config, &["a"]);
        let stored = |hashes: &[u64]| IndexEvent::Stored {
            parent: None,
            blocks: hashes
                .iter()
                .map(|&h| switchyard_core::index::StoredBlock {
                    engine_hash: switchyard_core::EngineHash(h),
                    local_hash: LocalHash(h),
                })
                .collect(),
        };
        let overlap = |shared: Arc<SharedRouter>| async move {
            place(&shared, request(&[1, 2, 3], 48))
                .await
                .unwrap()
                .overlap_blocks
        };
        let first = shared.events_epoch(ids[0]).unwrap();
        assert!(shared.apply_worker_event(ids[0], first, CacheTier::Device, &stored(&[1, 2])));
        assert_eq!(overlap(shared.clone()).await, 2, "routing sees the event");
        // Out of the router: its index entries go, and its events are stale.
        shared.set_in_router(ids[0], false);
        assert_eq!(shared.events_epoch(ids[0]), None);
        assert!(!shared.apply_worker_event(ids[0], first, CacheTier::Device, &stored(&[1])));
        // Back in, under a new epoch: the old subscriber's events still are.
        shared.set_in_router(ids[0], true);
        let second = shared.events_epoch(ids[0]).unwrap();
        assert_ne!(second, first);
        assert!(!shared.apply_worker_event(ids[0], first, CacheTier::Device, &stored(&[1, 2, 3])));
        assert_eq!(shared.metrics().stale_kv_events.get(), 2);
        assert_eq!(overlap(shared.clone()).await, 0, "nothing of the old epoch");
        assert!(shared.apply_worker_event(ids[0], second, CacheTier::Device, &stored(&[1, 2, 3])));
        assert_eq!(overlap(shared.clone()).await, 3);
        // A worker the router never knew: dropped and counted too.
        let unknown = WorkerId::new(9_999);
        assert!(!shared.apply_worker_event(unknown, 1, CacheTier::Device, &stored(&[1])));
        assert_eq!(shared.metrics().stale_kv_events.get(), 3);
    }

    /// Breakers that open after `threshold` failures for 1 ms (or a minute).
    fn with_circuit(shared: &SharedRouter, threshold: u32, cooldown_ms: u64) {
        shared
            .set_circuit_config(CircuitConfig {
                failure_threshold: threshold,
                cooldown_ms,
                max_cooldown_ms: cooldown_ms,
            })
            .unwrap();
    }

    /// One worker whose circuit is half-open (its one failure opened it,
    /// and the 1 ms cooldown is over).
    async fn half_open_worker() -> (Arc<SharedRouter>, WorkerId) {
        let (shared, ids) = shared_with(&ServerConfig::default(), &["a"]);
        with_circuit(&shared, 1, 1);
        let booking = place(&shared, request(&[], 4)).await.unwrap();
        booking.worker_failed();
        drop(booking);
        // Sleeping is a lower bound: any machine gets past the cooldown.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        shared.tick();
        assert_eq!(shared.circuit_state(ids[0]), Some(CircuitState::HalfOpen));
        (shared, ids[0])
    }

    #[tokio::test]
    async fn a_probe_placed_but_dropped_before_its_handler_took_it_frees_the_probe_slot() {
        let (shared, worker) = half_open_worker().await;
        // Placed at once (the probe is dispatched), then the client goes
        // away before the handler reads the placement.
        let wait = WaitHandle::submit(&shared, RequestId(2), request(&[], 4)).unwrap();
        assert_eq!(shared.circuit_admits(worker), Some(false));
        drop(wait);
        assert_eq!(shared.total_active_requests(), 0);
        assert_eq!(
            shared.circuit_admits(worker),
            Some(true),
            "the circuit may probe again"
        );
        let probe = place(&shared, request(&[], 4))
            .await
            .expect("the next request is the probe");
        assert_eq!(probe.worker, worker);
    }

    #[tokio::test]
    async fn a_late_result_of_a_request_dispatched_before_the_opening_is_ignored() {
        let (shared, ids) = shared_with(&ServerConfig::default(), &["a"]);
        with_circuit(&shared, 1, 1);
        let mut early = place(&shared, request(&[], 4)).await.unwrap();
        let failing = place(&shared, request(&[], 4)).await.unwrap();
        failing.worker_failed();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        shared.tick();
        let probe = place(&shared, request(&[], 4)).await.unwrap();
        // The early request's first token is not the probe's success.
        early.mark_first_token();
        assert_eq!(shared.circuit_state(ids[0]), Some(CircuitState::HalfOpen));
        // Nor does its end free the probe slot.
        drop(early);
        assert_eq!(shared.circuit_admits(ids[0]), Some(false));
        drop((failing, probe));
    }

    #[tokio::test]
    async fn failed_bookings_open_the_circuit_and_no_request_reaches_that_worker_again() {
        let (shared, ids) = shared_with(&round_robin(), &["w0", "w1"]);
        with_circuit(&shared, 2, 60_000);
        let mut failures = 0;
        while failures < 2 {
            let booking = place(&shared, request(&[], 1))
                .await
                .expect("a worker is free");
            if booking.worker == ids[0] {
                booking.worker_failed();
                // Reported twice, counted once.
                booking.worker_failed();
                failures += 1;
            }
        }
        assert_eq!(shared.circuit_state(ids[0]), Some(CircuitState::Open));
        for _ in 0..10 {
            let booking = place(&shared, request(&[], 1)).await.unwrap();
            assert_eq!(booking.worker, ids[1]);
        }
        // The worker is still in the router: only selection skips it.
        let info = shared
            .workers()
            .into_iter()
            .find(|w| w.id == ids[0])
            .unwrap();
        assert!(info.in_router);
        assert_eq!(info.circuit, CircuitState::Open);
        assert_eq!(info.circuit_transitions[CircuitState::Open as usize], 1);
    }

    #[tokio::test]
    async fn a_first_token_is_a_success_that_resets_the_failure_streak() {
        let (shared, ids) = shared_with(&ServerConfig::default(), &["w0"]);
        with_circuit(&shared, 2, 60_000);
        place(&shared, request(&[], 1))
            .await
            .unwrap()
            .worker_failed();
        place(&shared, request(&[], 1))
            .await
            .unwrap()
            .mark_first_token();
        place(&shared, request(&[], 1))
            .await
            .unwrap()
            .worker_failed();
        assert_eq!(
            shared.circuit_state(ids[0]),
            Some(CircuitState::Closed),
            "the streak was broken"
        );
        place(&shared, request(&[], 1))
            .await
            .unwrap()
            .worker_failed();
        assert_eq!(shared.circuit_state(ids[0]), Some(CircuitState::Open));
        assert!(
            place(&shared, request(&[], 1)).await.is_none(),
            "no worker can take it"
        );
    }

    #[tokio::test]
    async fn a_worker_that_leaves_and_reenters_the_router_starts_with_a_closed_circuit() {
        let (shared, ids) = shared_with(&ServerConfig::default(), &["w0"]);
        with_circuit(&shared, 2, 60_000);
        place(&shared, request(&[], 1))
            .await
            .unwrap()
            .worker_failed();
        place(&shared, request(&[], 1))
            .await
            .unwrap()
            .worker_failed();
        assert_eq!(shared.circuit_state(ids[0]), Some(CircuitState::Open));
        shared.set_in_router(ids[0], false);
        shared.set_in_router(ids[0], true);
        assert_eq!(shared.circuit_state(ids[0]), Some(CircuitState::Closed));
        let info = shared.workers().remove(0);
        assert_eq!(
            info.circuit_transitions[CircuitState::Closed as usize],
            1,
            "the reset out of open counts as a close"
        );
        assert!(place(&shared, request(&[], 1)).await.is_some());
    }

    #[test]
    fn a_booking_still_running_at_the_request_timeout_stays_in_the_load_view() {
        for request_timeout_secs in [1.0, 600.0, 3_600.0] {
            let config = ServerConfig {
                request_timeout_secs,
                ..ServerConfig::default()
            };
            let expiry_ms = crate::dispatcher_config(&config).router.sequences.expiry_ms;
            assert!(
                expiry_ms >= request_timeout_secs * 1e3 + 60_000.0,
                "{expiry_ms} for a {request_timeout_secs} s timeout"
            );
        }
    }

    /// Session-aware routing state over two workers.
    fn sessions() -> (Arc<SharedRouter>, Vec<WorkerId>) {
        let config = ServerConfig {
            admission: AdmissionMode::SessionAware,
            policy: PolicyKind::RoundRobin,
            ..ServerConfig::default()
        };
        shared_with(&config, &["a", "b"])
    }

    fn turn(session: u64, blocks: &[u64]) -> Request<'static> {
        Request {
            session: Some(SessionKey(session)),
            ..request(blocks, blocks.len() as u32 * 16)
        }
    }

    #[tokio::test]
    async fn a_migrated_turn_stays_its_sessions_turn_and_the_session_follows_it() {
        let (shared, _) = sessions();
        let mut first = place(&shared, turn(9, &[1, 2])).await.unwrap();
        first.mark_first_token();
        // The next turn arrives while the first runs: it waits.
        let next =
            WaitHandle::submit(&shared, shared.next_request_id(), turn(9, &[1, 2, 3])).unwrap();
        // The first turn's worker fails it mid-stream; it moves.
        first.worker_failed();
        let failed = first.worker;
        let mut moved = first.migrate(None).unwrap().placed().await.unwrap();
        assert_ne!(moved.worker, failed);
        tokio::task::yield_now().await;
        assert_eq!(
            shared.snapshot().queue_depth,
            1,
            "the next turn still waits for the migrated one"
        );
        // The migrated turn completes: the next turn goes where it ended.
        moved.mark_first_token();
        moved.completed(48);
        let worker = moved.worker;
        drop(moved);
        let next = next.placed().await.unwrap();
        assert_eq!(next.worker, worker, "the session re-pinned");
        let counts = shared.snapshot().strategy.unwrap().1;
        assert!(counts.contains(&("migrated_turns", 1)), "{counts:?}");
    }
}
