//! The router's shared state: the routing core, admission and the worker
//! table behind one `std::sync::Mutex`.
//!
//! Why a `std` mutex and not tokio's, nor an actor: every critical section
//! is short, synchronous work on in-memory structures (a route + book is a
//! few microseconds at 64 workers) and never spans an `.await`, so a plain
//! mutex is the cheapest correct choice — an uncontended lock is ~20 ns,
//! an actor round trip through a channel is 220–560 ns plus a task wake-up
//! (figures from `bench admission`'s notes). tokio's mutex is for holding a
//! lock across awaits, which this state must never do.
//!
//! [`SharedRouter`] is the small interface everything else uses: request
//! admission and placement ([`SharedRouter::submit`] returning a
//! [`WaitHandle`], then a [`Booking`] guard whose drop frees the request),
//! KV events ([`SharedRouter::apply_worker_event`]), worker changes
//! (`add_worker`/`remove_worker`/`set_draining`), and
//! [`SharedRouter::with_core`] for anything else — such as applying replica
//! events to the same `Router` — with the lock held for the closure only.

use super::health::{self, WorkerCircuit};
use super::metrics::{render_by_worker, render_one, AdmissionDecision, ServerMetrics};
use rustc_hash::{FxHashMap, FxHashSet};
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;
use switchyard_core::admission::{
    AdmissionController, CancelOutcome, KvUsage, Placed, Placement, QueueClass, RequestFacts,
    ResponseTicket, SessionKey, SubmitOutcome,
};
use switchyard_core::health::{CircuitConfig, CircuitEvent, CircuitState};
use switchyard_core::index::IndexEvent;
use switchyard_core::router::WorkerCapacity;
use switchyard_core::select::{Decision, RoutingRequest, SelectOutcome};
use switchyard_core::sequences::{AddRequest, LifecycleOutcome};
use switchyard_core::{LocalHash, RequestId, Router, WorkerId};
use tokio::sync::oneshot;

/// One worker as the router knows it.
#[derive(Debug, Clone)]
pub struct WorkerInfo {
    /// Stable id in the routing core.
    pub id: WorkerId,
    /// Name in metrics, logs and `x-switchyard-worker`.
    pub name: Arc<str>,
    /// Base URL, `http://host:port`.
    pub url: Arc<str>,
    /// Models from its `/v1/models` (empty until first fetched).
    pub models: Vec<String>,
    /// In the routing core (healthy and not removed).
    pub in_router: bool,
    /// Draining: no new requests; removed once idle.
    pub draining: bool,
    /// Consecutive failed health checks.
    pub failures: u32,
    /// What it can hold, from its `/get_server_info` (for busy thresholds).
    pub capacity: WorkerCapacity,
    /// Fraction of its KV cache in use, from its `/metrics` (read only when
    /// an admission strategy needs it).
    pub kv_usage: Option<f64>,
    /// Passive failure detection; reset whenever the worker enters or
    /// leaves the router.
    pub circuit: WorkerCircuit,
    /// Counts entries into the router: KV events from a subscriber started
    /// for an earlier entry are stale and dropped.
    pub events_epoch: u64,
}

/// Where a placed request goes, handed from the core to the waiting handler.
#[derive(Debug)]
pub enum Assignment {
    /// A worker was chosen and the request is booked on it.
    Selected {
        /// Admission's ticket.
        ticket: ResponseTicket,
        /// The selector's decision.
        decision: Decision,
        /// The worker's name.
        name: Arc<str>,
        /// The worker's base URL.
        url: Arc<str>,
        /// Time spent queued.
        waited_ms: f64,
        /// The worker's circuit generation at dispatch: the request's
        /// results are reported with it.
        circuit_generation: u64,
    },
    /// No worker can take it.
    NoWorkers,
}

struct Waiter {
    blocks: Vec<LocalHash>,
    prompt_tokens: u32,
    session: Option<SessionKey>,
    eligible: Vec<WorkerId>,
    tx: oneshot::Sender<Assignment>,
}

/// Everything behind the lock.
pub struct Core {
    /// The routing brain.
    pub router: Router,
    /// Policy queue and admission strategy.
    pub admission: AdmissionController,
    /// The fleet, by id.
    pub workers: FxHashMap<WorkerId, WorkerInfo>,
    /// Settings of every worker's circuit breaker.
    pub circuit_config: CircuitConfig,
    waiting: FxHashMap<RequestId, Waiter>,
    placed: Vec<Placed>,
    /// Replica sync, when on: told of every local mutation, lock held.
    pub(super) replica: Option<super::replica::ReplicaLink>,
}

impl std::fmt::Debug for Core {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Core")
            .field("router", &self.router)
            .field("workers", &self.workers.len())
            .field("waiting", &self.waiting.len())
            .finish_non_exhaustive()
    }
}

impl Core {
    /// Tells the admission strategy a worker's KV capacity (its device
    /// blocks × the block size, when its `/get_server_info` said) and, when
    /// measured, the tokens in use. Without a capacity the strategy cannot
    /// pause sessions on that worker.
    fn report_kv(&mut self, id: WorkerId, used_fraction: Option<f64>) {
        let Some(info) = self.workers.get(&id) else {
            return;
        };
        let Some(blocks) = info.capacity.kv_blocks else {
            return;
        };
        let block_size = u64::from(self.router.config().sequences.block_size);
        let capacity_tokens = blocks.saturating_mul(block_size);
        self.admission.report_kv(
            id,
            KvUsage {
                capacity_tokens,
                used_tokens: used_fraction.map(|f| (f * capacity_tokens as f64) as u64),
            },
        );
    }

    /// Offers queued requests to the router and hands placements to their
    /// waiters. Call after anything that may make room.
    pub(super) fn poll(&mut self, now_ms: f64, metrics: &ServerMetrics) {
        if self.admission.queue().ready_len() == 0 {
            return;
        }
        let Core {
            router,
            admission,
            waiting,
            placed,
            replica,
            workers,
            circuit_config,
            ..
        } = self;
        admission.poll(now_ms, placed, |id, placement| {
            let Some(waiter) = waiting.get(&id) else {
                return SelectOutcome::NoWorkers;
            };
            let exact;
            let eligible = match placement {
                Placement::Exact(worker) => {
                    exact = [worker];
                    Some(&exact[..])
                }
                Placement::Any if waiter.eligible.is_empty() => None,
                Placement::Any => Some(&waiter.eligible[..]),
            };
            let request = RoutingRequest {
                prompt_tokens: waiter.prompt_tokens,
                blocks: &waiter.blocks,
            };
            let started = Instant::now();
            let outcome = router.route(request, eligible, now_ms);
            if let SelectOutcome::Selected(decision) = outcome {
                let add = AddRequest::for_decision(id, &request, &decision, None);
                let booked = router.book_request(&add, now_ms);
                if let (Some(link), LifecycleOutcome::Applied) = (replica.as_ref(), booked) {
                    link.booked(&add);
                }
                // A half-open worker takes this one probe, then no more
                // until its verdict: decided before the next placement.
                if let Some(info) = workers.get_mut(&decision.worker) {
                    let generation = info.circuit.breaker.generation();
                    health::step(
                        router,
                        info,
                        CircuitEvent::Dispatched,
                        generation,
                        circuit_config,
                        now_ms,
                    );
                }
            }
            metrics
                .routing_decision
                .observe(started.elapsed().as_secs_f64());
            outcome
        });
        let mut placed = std::mem::take(&mut self.placed);
        for p in placed.drain(..) {
            match p {
                Placed::Selected {
                    ticket,
                    decision,
                    waited_ms,
                } => {
                    let id = ticket.id();
                    let info = self.workers.get(&decision.worker);
                    // Read under the same lock hold as the dispatch above:
                    // nothing can have opened the circuit in between.
                    let dispatch = Dispatch {
                        worker: decision.worker,
                        circuit_generation: info.map_or(0, |i| i.circuit.breaker.generation()),
                        verdict: false,
                    };
                    let waiter = self.waiting.remove(&id);
                    match (waiter, info) {
                        (Some(waiter), Some(info)) => {
                            self.admission.dispatched(&ticket, now_ms);
                            if let (Some(link), Some(session), Some(_)) =
                                (&self.replica, waiter.session, self.admission.strategy())
                            {
                                let context = u64::from(waiter.prompt_tokens);
                                link.session_bound(session, decision.worker, context);
                            }
                            let assignment = Assignment::Selected {
                                ticket,
                                decision,
                                name: info.name.clone(),
                                url: info.url.clone(),
                                waited_ms,
                                circuit_generation: dispatch.circuit_generation,
                            };
                            if let Err(Assignment::Selected { ticket, .. }) =
                                waiter.tx.send(assignment)
                            {
                                self.release(id, dispatch, Some(ticket), false, 0, now_ms);
                            }
                        }
                        (_, _) => self.release(id, dispatch, Some(ticket), false, 0, now_ms),
                    }
                }
                Placed::NoWorkers { id } => {
                    if let Some(waiter) = self.waiting.remove(&id) {
                        let _ = waiter.tx.send(Assignment::NoWorkers);
                    }
                }
            }
        }
        self.placed = placed;
    }

    /// Frees a booking and ends its ticket. A booking that reached its
    /// worker's circuit with no verdict (no first token, no failure)
    /// reports `Released` here, on every path that ends one — the
    /// handler's drop, a placement nobody waits for any more — so a
    /// half-open worker's probe slot is never lost.
    fn release(
        &mut self,
        id: RequestId,
        dispatch: Dispatch,
        ticket: Option<ResponseTicket>,
        completed: bool,
        context_tokens: u64,
        now_ms: f64,
    ) {
        if !dispatch.verdict {
            health::circuit_event(
                self,
                dispatch.worker,
                CircuitEvent::Released,
                dispatch.circuit_generation,
                now_ms,
            );
        }
        let worker = self.router.sequences().owner(id);
        let freed = self.router.free(id, now_ms);
        if let (Some(link), Some(worker), LifecycleOutcome::Applied) =
            (&self.replica, worker, freed)
        {
            link.freed(id, worker);
        }
        if let Some(ticket) = ticket {
            if completed {
                if let Err(invalid) = self.admission.complete(ticket, context_tokens, now_ms) {
                    let _ = self.admission.abort(invalid.ticket, now_ms);
                }
            } else {
                let _ = self.admission.abort(ticket, now_ms);
            }
        }
    }

    /// Workers that may take new requests for `model`, minus `exclude`
    /// (empty: all of them).
    fn eligible_for(&self, model: Option<&str>, exclude: &[WorkerId]) -> Result<Vec<WorkerId>, ()> {
        let mut any_draining = false;
        let mut any_excluded = false;
        let mut all = 0usize;
        let mut eligible = Vec::new();
        for info in self.workers.values() {
            if !info.in_router {
                continue;
            }
            all += 1;
            any_draining |= info.draining;
            let serves = match model {
                None => true,
                Some(m) => info.models.is_empty() || info.models.iter().any(|x| x == m),
            };
            let excluded = exclude.contains(&info.id);
            any_excluded |= excluded;
            if serves && !info.draining && !excluded {
                eligible.push(info.id);
            }
        }
        if eligible.is_empty() && all > 0 && model.is_some() && !any_draining && !any_excluded {
            return Err(());
        }
        if eligible.len() == all && !any_draining {
            eligible.clear();
        } else if eligible.is_empty() {
            // Nothing may take it; a nonexistent id keeps the router from
            // choosing a draining worker.
            eligible.push(WorkerId::new(u64::MAX));
        }
        Ok(eligible)
    }
}

/// A booking as its worker's circuit breaker saw it dispatched.
#[derive(Clone, Copy, Debug)]
struct Dispatch {
    worker: WorkerId,
    /// The breaker's generation at dispatch.
    circuit_generation: u64,
    /// A success or failure was reported for it.
    verdict: bool,
}

/// What a request brings to admission.
#[derive(Debug)]
pub struct Submission<'a> {
    /// Local block hashes of its prompt.
    pub blocks: Vec<LocalHash>,
    /// Prompt length.
    pub prompt_tokens: u32,
    /// The session, when the client named one.
    pub session: Option<SessionKey>,
    /// The requested model.
    pub model: Option<&'a str>,
    /// Workers that must not take it: those that already failed this
    /// request (migration). Empty for a first attempt.
    pub exclude: &'a [WorkerId],
}

/// Why a submission was not queued.
#[derive(Debug)]
pub enum SubmitError {
    /// 429 with this retry-after.
    QueueFull {
        /// Suggested wait.
        retry_after_ms: u64,
    },
    /// No worker serves the model.
    UnknownModel,
}

/// The shared state; cheap to clone behind an `Arc`.
pub struct SharedRouter {
    core: Mutex<Core>,
    epoch: Instant,
    next_request: AtomicU64,
    request_salt: u64,
    /// Router metrics.
    pub metrics: Arc<ServerMetrics>,
}

impl std::fmt::Debug for SharedRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedRouter").finish_non_exhaustive()
    }
}

impl SharedRouter {
    /// Wraps a router and an admission controller.
    pub fn new(
        router: Router,
        admission: AdmissionController,
        metrics: Arc<ServerMetrics>,
    ) -> Self {
        Self {
            core: Mutex::new(Core {
                router,
                admission,
                workers: FxHashMap::default(),
                circuit_config: CircuitConfig::default(),
                waiting: FxHashMap::default(),
                placed: Vec::new(),
                replica: None,
            }),
            epoch: Instant::now(),
            next_request: AtomicU64::new(1),
            request_salt: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
            metrics,
        }
    }

    /// Milliseconds since the router started: the core's clock.
    pub fn now_ms(&self) -> f64 {
        self.epoch.elapsed().as_secs_f64() * 1e3
    }

    /// A fresh request id, unique across router processes with high
    /// probability (start-time salt in the high half).
    pub fn next_request_id(&self) -> RequestId {
        let n = self.next_request.fetch_add(1, Ordering::Relaxed);
        RequestId((u128::from(self.request_salt) << 64) | u128::from(n))
    }

    fn lock(&self) -> MutexGuard<'_, Core> {
        // A panic while holding the lock leaves the core as consistent as
        // the core's own invariants make it; keep serving.
        self.core.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `f` with the lock held; keep it short and never await inside.
    pub fn with_core<R>(&self, f: impl FnOnce(&mut Core) -> R) -> R {
        f(&mut self.lock())
    }

    /// Registers a worker (not yet in selection until `set_in_router`).
    pub fn add_worker(&self, name: &str, url: &str) -> Result<WorkerId, String> {
        let mut core = self.lock();
        if core.workers.values().any(|w| &*w.name == name) {
            return Err(format!("a worker named {name:?} exists"));
        }
        // Replicas name workers by id: derive it from the name, not the order.
        let id = switchyard_replica::worker_id_for_name(name);
        if core.workers.contains_key(&id) {
            return Err(format!(
                "the worker name {name:?} collides with another's id"
            ));
        }
        core.workers.insert(
            id,
            WorkerInfo {
                id,
                name: name.into(),
                url: url.trim_end_matches('/').into(),
                models: Vec::new(),
                in_router: false,
                draining: false,
                failures: 0,
                capacity: WorkerCapacity::default(),
                kv_usage: None,
                circuit: WorkerCircuit::default(),
                events_epoch: 0,
            },
        );
        Ok(id)
    }

    /// Puts a worker into selection or takes it out. Taking it out drops
    /// its index entries and active sequences (`Router::remove_worker`).
    pub fn set_in_router(&self, id: WorkerId, in_router: bool) {
        let now = self.now_ms();
        let mut core = self.lock();
        let Some(info) = core.workers.get_mut(&id) else {
            return;
        };
        if info.in_router == in_router {
            return;
        }
        info.in_router = in_router;
        // Entering or leaving the router starts the circuit afresh (a
        // reset out of open or half-open counts as a close).
        if info.circuit.breaker.state() != CircuitState::Closed {
            info.circuit.transitions[CircuitState::Closed as usize] += 1;
        }
        info.circuit.breaker.reset();
        if in_router {
            info.failures = 0;
            info.events_epoch += 1;
            let capacity = info.capacity;
            core.router.add_worker(id, capacity);
        } else {
            // Peers' bookings on the worker go too, but they are theirs to
            // free and to count: only this replica's own are published
            // and counted.
            let remote: FxHashSet<RequestId> = core.router.remote().requests_on(id).collect();
            let mut freed = core.router.remove_worker(id);
            freed.retain(|request| !remote.contains(request));
            if let Some(link) = &core.replica {
                freed.iter().for_each(|&request| link.freed(request, id));
            }
            self.metrics
                .freed_by_removal
                .fetch_add(freed.len() as u64, Ordering::Relaxed);
        }
        core.poll(now, &self.metrics);
    }

    /// Sets every worker's circuit-breaker settings.
    pub fn set_circuit_config(&self, config: CircuitConfig) {
        self.lock().circuit_config = config;
    }

    /// Feeds one outcome of a request dispatched in the breaker's
    /// `generation` to `worker`'s circuit breaker (a late one, of an
    /// earlier generation, changes nothing).
    pub fn circuit_event(&self, worker: WorkerId, event: CircuitEvent, generation: u64) {
        let now = self.now_ms();
        let mut core = self.lock();
        health::circuit_event(&mut core, worker, event, generation, now);
        core.poll(now, &self.metrics);
    }

    /// The epoch a KV-event subscriber started now belongs to (`None` while
    /// the worker is out of the router).
    pub fn events_epoch(&self, id: WorkerId) -> Option<u64> {
        let core = self.lock();
        let info = core.workers.get(&id)?;
        info.in_router.then_some(info.events_epoch)
    }

    /// Applies a KV event from the subscriber of `epoch`; a stale
    /// subscriber's (the worker left the router since) is dropped and
    /// counted. Returns whether it was applied.
    pub fn apply_worker_event(&self, worker: WorkerId, epoch: u64, event: &IndexEvent) -> bool {
        let mut core = self.lock();
        let live = core
            .workers
            .get(&worker)
            .is_some_and(|w| w.in_router && w.events_epoch == epoch);
        if live {
            core.router.apply_kv_event(worker, event);
        } else {
            self.metrics.stale_kv_events.fetch_add(1, Ordering::Relaxed);
        }
        live
    }

    /// Removes a worker entirely.
    pub fn remove_worker(&self, id: WorkerId) -> Option<WorkerInfo> {
        self.set_in_router(id, false);
        self.lock().workers.remove(&id)
    }

    /// Marks a worker draining (no new requests).
    pub fn set_draining(&self, id: WorkerId) {
        if let Some(info) = self.lock().workers.get_mut(&id) {
            info.draining = true;
        }
    }

    /// Records one health-check result; returns whether the worker should
    /// now be in selection.
    pub fn health_result(&self, id: WorkerId, ok: bool, threshold: u32) -> Option<bool> {
        let mut core = self.lock();
        let info = core.workers.get_mut(&id)?;
        if ok {
            info.failures = 0;
            Some(true)
        } else {
            info.failures = info.failures.saturating_add(1);
            Some(info.failures < threshold && info.in_router)
        }
    }

    /// Snapshot of the worker table.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        let mut list: Vec<_> = self.lock().workers.values().cloned().collect();
        list.sort_by(|a, b| a.name.cmp(&b.name));
        list
    }

    /// Sets a worker's capacity (applies when it next enters selection).
    pub fn set_capacity(&self, id: WorkerId, capacity: WorkerCapacity) {
        let mut core = self.lock();
        let Some(info) = core.workers.get_mut(&id) else {
            return;
        };
        info.capacity = capacity;
        let used = info.kv_usage;
        core.report_kv(id, used);
    }

    /// Whether an admission strategy wants the workers' KV usage.
    pub fn wants_kv_usage(&self) -> bool {
        self.lock().admission.strategy().is_some()
    }

    /// Records a worker's measured KV usage (a fraction, clamped to 0..=1)
    /// and passes it, in tokens, to the admission strategy.
    pub fn set_kv_usage(&self, id: WorkerId, fraction: f64) {
        let mut core = self.lock();
        let Some(info) = core.workers.get_mut(&id) else {
            return;
        };
        let fraction = if fraction.is_finite() {
            fraction.clamp(0.0, 1.0)
        } else {
            return;
        };
        info.kv_usage = Some(fraction);
        core.report_kv(id, Some(fraction));
    }

    /// Sets a worker's model list.
    pub fn set_models(&self, id: WorkerId, models: Vec<String>) {
        if let Some(info) = self.lock().workers.get_mut(&id) {
            info.models = models;
        }
    }

    /// Active requests booked on `id` (0 when unknown): this replica's
    /// and, with replica sync on, its peers'. This is the worker's load.
    pub fn active_requests(&self, id: WorkerId) -> usize {
        self.lock()
            .router
            .sequences()
            .registry()
            .load(id)
            .map_or(0, |l| l.requests)
    }

    /// Requests this replica booked on `id` and has not freed (0 when
    /// unknown): [`Self::active_requests`] minus peers' remote bookings.
    /// Draining waits for these only — a peer's bookings end on the peer,
    /// and this replica never sees them end if it stops routing there.
    pub fn local_requests(&self, id: WorkerId) -> usize {
        let core = self.lock();
        let all = core
            .router
            .sequences()
            .registry()
            .load(id)
            .map_or(0, |l| l.requests);
        all.saturating_sub(core.router.remote().remote_requests_on(id))
    }

    /// Admission: queues the request and tries to place it at once.
    pub fn submit(
        self: &Arc<Self>,
        id: RequestId,
        submission: Submission<'_>,
    ) -> Result<WaitHandle, SubmitError> {
        let now = self.now_ms();
        let (tx, rx) = oneshot::channel();
        let mut core = self.lock();
        let eligible = core
            .eligible_for(submission.model, submission.exclude)
            .map_err(|()| SubmitError::UnknownModel)?;
        let facts = RequestFacts {
            id,
            session: submission.session,
            context_tokens: submission.prompt_tokens,
            uncached_tokens: submission.prompt_tokens,
            class: QueueClass::default(),
            eligible: &eligible,
            now_ms: now,
        };
        match core.admission.submit(&facts) {
            SubmitOutcome::Rejected { retry_after_ms, .. } => {
                self.metrics.count_admission(AdmissionDecision::Rejected);
                return Err(SubmitError::QueueFull { retry_after_ms });
            }
            SubmitOutcome::Queued | SubmitOutcome::Duplicate => {
                self.metrics.count_admission(AdmissionDecision::Queued)
            }
            SubmitOutcome::Deferred => self.metrics.count_admission(AdmissionDecision::Deferred),
        }
        core.waiting.insert(
            id,
            Waiter {
                blocks: submission.blocks,
                prompt_tokens: submission.prompt_tokens,
                session: submission.session,
                eligible,
                tx,
            },
        );
        core.poll(now, &self.metrics);
        Ok(WaitHandle {
            shared: self.clone(),
            id,
            rx: Some(rx),
        })
    }

    /// Periodic work: admission reconcile and rechecks, request expiry.
    pub fn tick(&self) {
        let now = self.now_ms();
        let mut core = self.lock();
        core.admission.tick(now);
        core.router.expire(now);
        let silent = core.router.expire_silent_replicas(now).len();
        if let Some(link) = &core.replica {
            link.count_expired(silent);
        }
        health::poll_circuits(&mut core, now);
        core.poll(now, &self.metrics);
    }

    /// When `tick` is next due (ms on [`Self::now_ms`]'s clock), if sooner
    /// than the regular expiry sweep.
    pub fn next_wakeup_ms(&self) -> Option<f64> {
        let core = self.lock();
        let admission = core.admission.next_wakeup_ms();
        match (admission, health::next_cooldown_end(&core)) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Appends the per-worker gauges, index size and queue depth.
    pub fn render_gauges(&self, out: &mut String) {
        let now = self.now_ms();
        let core = self.lock();
        let mut rows: Vec<(&str, u64, usize, usize)> = core
            .workers
            .values()
            .map(|info| {
                let load = core.router.sequences().registry().load(info.id);
                (
                    &*info.name,
                    load.map_or(0, |l| l.active_prefill_tokens(now)),
                    load.map_or(0, |l| l.decode_blocks),
                    load.map_or(0, |l| l.requests),
                )
            })
            .collect();
        rows.sort_unstable_by(|a, b| a.0.cmp(b.0));
        render_by_worker(
            out,
            "switchyard_worker_active_prefill_tokens",
            "gauge",
            "Uncached prefill tokens booked on the worker.",
            rows.iter().map(|r| (r.0, r.1)),
        );
        render_by_worker(
            out,
            "switchyard_worker_active_decode_blocks",
            "gauge",
            "KV blocks held by the worker's active requests.",
            rows.iter().map(|r| (r.0, r.2)),
        );
        render_by_worker(
            out,
            "switchyard_worker_active_requests",
            "gauge",
            "Requests booked on the worker and not yet freed.",
            rows.iter().map(|r| (r.0, r.3)),
        );
        let mut workers: Vec<&WorkerInfo> = core.workers.values().collect();
        workers.sort_unstable_by(|a, b| a.name.cmp(&b.name));
        render_by_worker(
            out,
            "switchyard_worker_up",
            "gauge",
            "1 while the worker is in selection.",
            workers
                .iter()
                .map(|w| (&*w.name, u8::from(w.in_router && !w.draining))),
        );
        render_by_worker(
            out,
            "switchyard_worker_kv_usage_ratio",
            "gauge",
            "Fraction of the worker's KV cache in use, from its /metrics (read while an admission strategy is on).",
            workers.iter().filter_map(|w| Some((&*w.name, w.kv_usage?))),
        );
        health::render(&workers, out);
        render_one(
            out,
            "switchyard_active_requests",
            "gauge",
            "Requests booked on any worker.",
            core.router.sequences().active_requests(),
        );
        render_one(
            out,
            "switchyard_index_blocks",
            "gauge",
            "Live (block, worker) pairs in the prefix index.",
            core.router.index().live_pairs(),
        );
        render_one(
            out,
            "switchyard_index_bytes",
            "gauge",
            "Estimated heap bytes of the index and the registry.",
            core.router.estimated_bytes(),
        );
        render_one(
            out,
            "switchyard_queue_depth",
            "gauge",
            "Requests waiting in the admission queue.",
            core.admission.queue().len(),
        );
        if let Some(strategy) = core.admission.strategy() {
            out.push_str(
                "# HELP switchyard_admission_strategy_events_total Events of the admission strategy (deferrals, pauses, resumes, expiries).\n# TYPE switchyard_admission_strategy_events_total counter\n",
            );
            for (event, n) in strategy.event_counts() {
                let _ = writeln!(
                    out,
                    "switchyard_admission_strategy_events_total{{strategy=\"{}\",event=\"{event}\"}} {n}",
                    strategy.name()
                );
            }
        }
    }
}

/// A request waiting for placement. Dropping it before it resolves (the
/// client went away) takes the request out of the queue, or, if it was
/// placed meanwhile, frees the booking: no path leaks one.
#[derive(Debug)]
pub struct WaitHandle {
    shared: Arc<SharedRouter>,
    id: RequestId,
    rx: Option<oneshot::Receiver<Assignment>>,
}

impl WaitHandle {
    /// Waits for placement; the booking is owned by the returned guard.
    pub async fn placed(mut self) -> Result<Booking, ()> {
        let rx = self
            .rx
            .as_mut()
            .expect("the receiver is present until resolved");
        let result = rx.await;
        self.rx = None;
        match result {
            Ok(Assignment::Selected {
                ticket,
                decision,
                name,
                url,
                waited_ms,
                circuit_generation,
            }) => Ok(Booking {
                shared: self.shared.clone(),
                id: self.id,
                worker: decision.worker,
                name,
                url,
                ticket: Some(ticket),
                prefill_marked: false,
                verdict: AtomicBool::new(false),
                failed: AtomicBool::new(false),
                completed: false,
                context_tokens: 0,
                overlap_blocks: decision.overlap_blocks,
                waited_ms,
                circuit_generation,
            }),
            Ok(Assignment::NoWorkers) | Err(_) => Err(()),
        }
    }
}

impl Drop for WaitHandle {
    fn drop(&mut self) {
        let Some(mut rx) = self.rx.take() else {
            return;
        };
        let now = self.shared.now_ms();
        let mut core = self.shared.lock();
        core.waiting.remove(&self.id);
        if core.admission.cancel(self.id, now) == CancelOutcome::Removed {
            self.shared
                .metrics
                .count_admission(AdmissionDecision::Cancelled);
        }
        rx.close();
        if let Ok(Assignment::Selected {
            ticket,
            decision,
            circuit_generation,
            ..
        }) = rx.try_recv()
        {
            // Placed (and dispatched to the circuit) but never handed over.
            let dispatch = Dispatch {
                worker: decision.worker,
                circuit_generation,
                verdict: false,
            };
            core.release(self.id, dispatch, Some(ticket), false, 0, now);
        }
        core.poll(now, &self.shared.metrics);
    }
}

/// A request booked on a worker. Its drop frees the booking (and completes
/// or aborts the admission ticket), however the response ends.
#[derive(Debug)]
pub struct Booking {
    shared: Arc<SharedRouter>,
    id: RequestId,
    /// The worker.
    pub worker: WorkerId,
    /// Its name.
    pub name: Arc<str>,
    /// Its base URL.
    pub url: Arc<str>,
    ticket: Option<ResponseTicket>,
    prefill_marked: bool,
    /// A success or failure reached the worker's circuit breaker.
    verdict: AtomicBool,
    /// A failure did (counted once per request). Atomics only so that
    /// `worker_failed` takes `&self`.
    failed: AtomicBool,
    completed: bool,
    context_tokens: u64,
    /// Blocks the router predicted cached.
    pub overlap_blocks: u32,
    /// Time queued before placement.
    pub waited_ms: f64,
    /// The worker's circuit generation at dispatch.
    circuit_generation: u64,
}

impl Booking {
    /// The request id.
    pub fn id(&self) -> RequestId {
        self.id
    }

    /// The first token arrived: prefill is done (once).
    pub fn mark_first_token(&mut self) {
        if self.prefill_marked {
            return;
        }
        self.prefill_marked = true;
        let now = self.shared.now_ms();
        let mut core = self.shared.lock();
        let marked = core.router.mark_prefill_completed(self.id, now);
        // Duplicate: the worker's own mark came first; peers may not have it.
        if let (Some(link), LifecycleOutcome::Applied | LifecycleOutcome::Duplicate) =
            (&core.replica, marked)
        {
            link.prefill_completed(self.id, self.worker);
        }
        if !self.verdict.swap(true, Ordering::Relaxed) {
            health::circuit_event(
                &mut core,
                self.worker,
                CircuitEvent::Success,
                self.circuit_generation,
                now,
            );
        }
        core.poll(now, &self.shared.metrics);
    }

    /// Live progress: `generated` tokens so far (no lock, no allocation).
    pub fn progress(&mut self, generated: u64) {
        if let Some(updater) = self.ticket.as_mut().and_then(|t| t.progress()) {
            updater.set(generated);
        }
    }

    /// The response ended normally with `context_tokens` (prompt plus
    /// generated); the drop then completes rather than aborts.
    pub fn completed(&mut self, context_tokens: u64) {
        self.completed = true;
        self.context_tokens = context_tokens;
    }

    /// The worker failed this request (connect refused, reset, 5xx,
    /// first-token timeout, broken stream): one failure for its circuit
    /// breaker, which takes it out of selection after `failure_threshold`
    /// in a row. Counted once per request (per booking: each worker a
    /// migrated request visits has its own) however often it is called —
    /// also after the first token: a stream that breaks mid-way counted a
    /// success at its first token and now counts a failure too, since a
    /// worker killed mid-stream is a failing worker. A failure of a request
    /// dispatched before the circuit last opened is late and changes
    /// nothing.
    pub fn worker_failed(&self) {
        self.shared
            .metrics
            .upstream_failures
            .fetch_add(1, Ordering::Relaxed);
        if self.failed.swap(true, Ordering::Relaxed) {
            return;
        }
        self.verdict.store(true, Ordering::Relaxed);
        self.shared
            .circuit_event(self.worker, CircuitEvent::Failure, self.circuit_generation);
    }
}

impl Drop for Booking {
    fn drop(&mut self) {
        let now = self.shared.now_ms();
        let mut core = self.shared.lock();
        let dispatch = Dispatch {
            worker: self.worker,
            circuit_generation: self.circuit_generation,
            verdict: self.verdict.load(Ordering::Relaxed),
        };
        core.release(
            self.id,
            dispatch,
            self.ticket.take(),
            self.completed,
            self.context_tokens,
            now,
        );
        core.poll(now, &self.shared.metrics);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{build_router, ServerConfig};

    fn shared_with(names: &[&str]) -> (Arc<SharedRouter>, Vec<WorkerId>) {
        let config = ServerConfig::default();
        let router = build_router(&config).unwrap();
        let admission = AdmissionController::new(config.queue.clone(), None).unwrap();
        let shared = Arc::new(SharedRouter::new(router, admission, Arc::default()));
        let ids = names
            .iter()
            .map(|name| {
                let id = shared
                    .add_worker(name, &format!("http://{name}:1"))
                    .unwrap();
                shared.set_in_router(id, true);
                id
            })
            .collect();
        (shared, ids)
    }

    fn submission(exclude: &[WorkerId]) -> Submission<'_> {
        Submission {
            blocks: Vec::new(),
            prompt_tokens: 4,
            session: None,
            model: Some("any"),
            exclude,
        }
    }

    #[tokio::test]
    async fn an_excluded_worker_is_never_chosen() {
        let (shared, ids) = shared_with(&["a", "b", "c"]);
        for i in 0..12 {
            let booking = shared
                .submit(RequestId(i), submission(&ids[..2]))
                .unwrap()
                .placed()
                .await
                .unwrap();
            assert_eq!(booking.worker, ids[2]);
        }
    }

    /// A peer replica's booking of request `id` on `worker`, as replica
    /// sync applies it.
    fn book_remotely(shared: &SharedRouter, id: u128, worker: WorkerId) {
        use switchyard_core::sequences::SequenceEvent;
        use switchyard_core::ReplicaId;
        let now = shared.now_ms();
        let add = AddRequest {
            request: RequestId(id),
            worker,
            prompt_tokens: 4,
            blocks: Vec::new(),
            overlap_blocks: 0,
            expected_prefill_ms: None,
        };
        let outcome = shared.with_core(|c| {
            c.router
                .apply_remote(ReplicaId(7), &SequenceEvent::Add(add), now)
        });
        assert!(outcome.applied());
    }

    #[tokio::test]
    async fn local_requests_leave_out_peers_bookings_on_the_worker() {
        let (shared, ids) = shared_with(&["a"]);
        book_remotely(&shared, 1_000, ids[0]);
        book_remotely(&shared, 1_001, ids[0]);
        assert_eq!(shared.active_requests(ids[0]), 2, "the load counts them");
        assert_eq!(shared.local_requests(ids[0]), 0);
        let booking = shared
            .submit(RequestId(1), submission(&[]))
            .unwrap()
            .placed()
            .await
            .unwrap();
        assert_eq!(shared.active_requests(ids[0]), 3);
        assert_eq!(shared.local_requests(ids[0]), 1);
        drop(booking);
        assert_eq!(shared.local_requests(ids[0]), 0);
    }

    #[tokio::test]
    async fn removing_a_worker_counts_only_this_replicas_bookings_as_freed() {
        let (shared, ids) = shared_with(&["a"]);
        book_remotely(&shared, 1_000, ids[0]);
        let booking = shared
            .submit(RequestId(1), submission(&[]))
            .unwrap()
            .placed()
            .await
            .unwrap();
        shared.set_in_router(ids[0], false);
        assert_eq!(
            shared.metrics.freed_by_removal.load(Ordering::Relaxed),
            1,
            "the peer's booking is the peer's to free"
        );
        assert_eq!(shared.active_requests(ids[0]), 0);
        drop(booking);
    }

    /// One worker whose circuit is half-open (its one failure opened it,
    /// and the 1 ms cooldown is over).
    async fn half_open_worker() -> (Arc<SharedRouter>, WorkerId) {
        let (shared, ids) = shared_with(&["a"]);
        shared.set_circuit_config(CircuitConfig {
            failure_threshold: 1,
            cooldown_ms: 1,
            max_cooldown_ms: 1,
        });
        let booking = shared
            .submit(RequestId(1), submission(&[]))
            .unwrap()
            .placed()
            .await
            .unwrap();
        booking.worker_failed();
        drop(booking);
        // Sleeping is a lower bound: any machine gets past the cooldown.
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        shared.tick();
        let state = shared.with_core(|c| c.workers[&ids[0]].circuit.breaker.state());
        assert_eq!(state, CircuitState::HalfOpen);
        (shared, ids[0])
    }

    #[tokio::test]
    async fn a_probe_placed_but_dropped_before_its_handler_took_it_frees_the_probe_slot() {
        let (shared, worker) = half_open_worker().await;
        // Placed at once (the probe is dispatched), then the client goes
        // away before the handler reads the placement.
        let wait = shared.submit(RequestId(2), submission(&[])).unwrap();
        assert!(shared.with_core(|c| !c.workers[&worker].circuit.breaker.admits()));
        drop(wait);
        assert_eq!(
            shared.with_core(|c| c.router.sequences().active_requests()),
            0
        );
        assert!(
            shared.with_core(|c| c.workers[&worker].circuit.breaker.admits()),
            "the circuit may probe again"
        );
        let probe = shared
            .submit(RequestId(3), submission(&[]))
            .unwrap()
            .placed()
            .await
            .expect("the next request is the probe");
        assert_eq!(probe.worker, worker);
    }

    #[tokio::test]
    async fn a_late_result_of_a_request_dispatched_before_the_opening_is_ignored() {
        let (shared, ids) = shared_with(&["a"]);
        shared.set_circuit_config(CircuitConfig {
            failure_threshold: 1,
            cooldown_ms: 1,
            max_cooldown_ms: 1,
        });
        let mut early = shared
            .submit(RequestId(1), submission(&[]))
            .unwrap()
            .placed()
            .await
            .unwrap();
        let failing = shared
            .submit(RequestId(2), submission(&[]))
            .unwrap()
            .placed()
            .await
            .unwrap();
        failing.worker_failed();
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        shared.tick();
        let probe = shared
            .submit(RequestId(3), submission(&[]))
            .unwrap()
            .placed()
            .await
            .unwrap();
        // The early request's first token is not the probe's success.
        early.mark_first_token();
        let state = shared.with_core(|c| c.workers[&ids[0]].circuit.breaker.state());
        assert_eq!(state, CircuitState::HalfOpen);
        // Nor does its end free the probe slot.
        drop(early);
        assert!(shared.with_core(|c| !c.workers[&ids[0]].circuit.breaker.admits()));
        drop((failing, probe));
    }

    #[test]
    fn a_booking_still_running_at_the_request_timeout_stays_in_the_load_view() {
        for request_timeout_secs in [1.0, 600.0, 3_600.0] {
            let config = ServerConfig {
                request_timeout_secs,
                ..ServerConfig::default()
            };
            let mut router = build_router(&config).unwrap();
            let worker = WorkerId::new(1);
            router.add_worker(worker, Default::default());
            let add = AddRequest {
                request: RequestId(1),
                worker,
                prompt_tokens: 4,
                blocks: Vec::new(),
                overlap_blocks: 0,
                expected_prefill_ms: None,
            };
            router.book_request(&add, 0.0);
            let timeout_ms = request_timeout_secs * 1e3;
            assert!(router.expire(timeout_ms).is_empty());
            assert_eq!(router.sequences().active_requests(), 1);
            // A booking whose end was never seen still goes, later.
            assert_eq!(router.expire(timeout_ms + 3_600_000.0).len(), 1);
        }
    }

    #[tokio::test]
    async fn excluding_every_worker_means_no_workers_not_an_unknown_model() {
        let (shared, ids) = shared_with(&["a", "b"]);
        let wait = shared.submit(RequestId(1), submission(&ids)).unwrap();
        assert!(wait.placed().await.is_err());
        assert_eq!(
            shared.with_core(|c| c.router.sequences().active_requests()),
            0
        );
    }
}
