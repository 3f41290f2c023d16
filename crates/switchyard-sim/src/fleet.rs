//! The discrete-event fleet simulator: the real routing core against N
//! simulated engine cores, in virtual time.
//!
//! Events, each at a simulated instant (ties in scheduling order):
//!
//! - **arrival** — a turn of a session arrives; a load balancer hands it to
//!   one router replica (one, unless [`FleetConfig::replicas`] says more);
//!   its prompt is expanded and hashed exactly as the router would and
//!   submitted to that replica's admission controller (the policy queue,
//!   plus the session-aware strategy when configured); each poll routes
//!   ready requests (`Router::route`), books them (`book_request`) and hands
//!   them to the chosen engine; when every worker is busy they wait until
//!   capacity frees or the periodic recheck;
//! - **step done** — an engine step launched earlier completes: its tokens
//!   reach the clients (a first token marks the prefill done, a last one
//!   frees the booking, both on the replica that routed the request), its KV
//!   events leave for the routers, and the engine launches its next step;
//! - **KV delivery** — KV events reach every replica after
//!   `kv_event_delay_ms`, as they would over the network;
//! - **replica sync** — a replica's booking, mark or free reaches its peers
//!   `sync_delay_ms` after it happened, and they apply it as a remote
//!   booking (see [`crate::replicas`]).
//!
//! A session's next turn arrives a think time after its previous turn ends.
//! Nothing reads a clock and every random choice is seeded: a run is a pure
//! function of its configuration and workload.

use crate::replicas::{replica_seed, Balancer, ReplicaStats, ReplicasConfig};
use crate::report::{coefficient_of_variation, Latency, LoadTimeline, PolicyReport};
use crate::trace::TraceError;
use crate::workload::{Session, SessionStream};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::collections::BinaryHeap;
use switchyard_core::admission::{
    AdmissionConfig, AdmissionController, AdmissionStrategy, KvUsage, Placed, Placement,
    QueueClass, RequestFacts, ResponseTicket, SessionAwareConfig, SessionAwareStrategy, SessionKey,
    SubmitOutcome,
};
use switchyard_core::hashing::{local_block_hashes, DEFAULT_SEED};
use switchyard_core::index::{IndexEvent, StoredBlock};
use switchyard_core::router::{Router, RouterConfig, RouterConfigError, WorkerCapacity};
use switchyard_core::select::{RoutingRequest, SelectOutcome};
use switchyard_core::sequences::{AddRequest, SequenceEvent};
use switchyard_core::{LocalHash, ReplicaId, RequestId, WorkerId};
use switchyard_engine::{
    Engine, EngineConfig, KvEvent, Medium, NewRequest, StepReport, SyncDevice,
};

/// One fleet and its router replicas.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// Simulated workers.
    pub workers: usize,
    /// Every worker's engine.
    pub engine: EngineConfig,
    /// Every replica's router (its block size is forced to the engine's).
    pub router: RouterConfig,
    /// Delay from an engine emitting a KV event to the routers applying it.
    pub kv_event_delay_ms: f64,
    /// Give the router expected prefill durations from the timing model.
    pub prefill_hints: bool,
    /// Width of the per-worker load timeline buckets.
    pub timeline_bucket_ms: f64,
    /// The policy queue.
    pub admission: AdmissionConfig,
    /// Session-aware admission (multi-turn sessions); `None`: no strategy.
    pub session_aware: Option<SessionAwareConfig>,
    /// Router replicas, their sync and the load balancer in front of them.
    pub replicas: ReplicasConfig,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            workers: 8,
            engine: EngineConfig::default(),
            router: RouterConfig::default(),
            kv_event_delay_ms: 10.0,
            prefill_hints: true,
            timeline_bucket_ms: 10_000.0,
            admission: AdmissionConfig::default(),
            session_aware: None,
            replicas: ReplicasConfig::default(),
        }
    }
}

/// A simulation that could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The workload could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// The router configuration is invalid.
    #[error("router: {0}")]
    Router(#[from] RouterConfigError),
    /// The engine configuration or device failed.
    #[error("engine: {0}")]
    Engine(String),
    /// The fleet has no workers.
    #[error("the fleet needs at least one worker")]
    NoWorkers,
    /// An admission setting is invalid.
    #[error("admission: {0}")]
    Admission(String),
    /// A replica setting is invalid.
    #[error("replicas: {0}")]
    Replicas(#[from] crate::replicas::ReplicasConfigError),
}

/// What a simulation produced.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct SimOutcome {
    /// The figures.
    pub report: PolicyReport,
    /// Per-worker load over time.
    pub timeline: LoadTimeline,
    /// Every TTFT sample (ms), sorted, for CDF plots.
    pub ttft_samples_ms: Vec<f64>,
    /// What the router replicas did and what their views cost.
    pub replicas: ReplicaStats,
}

#[derive(Clone, Copy, Debug, PartialEq)]
struct At(f64);

impl Eq for At {}

impl PartialOrd for At {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for At {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Debug)]
enum Event {
    /// The next session from the stream arrives.
    NextSession,
    /// Turn `turn` of an active session arrives.
    Turn { session: u64, turn: usize },
    /// A worker's running step completes.
    StepDone { worker: usize },
    /// KV events reach the routers.
    KvDelivery {
        worker: usize,
        events: Vec<IndexEvent>,
    },
    /// A replica's admission recheck or reconcile is due.
    AdmissionTick { replica: usize },
    /// A replica's lifecycle event reaches its peers.
    ReplicaSync { origin: usize, event: SequenceEvent },
}

struct Scheduled {
    at: At,
    seq: u64,
    event: Event,
}

impl PartialEq for Scheduled {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Scheduled {}

impl PartialOrd for Scheduled {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Scheduled {
    /// Reversed: the heap pops the earliest, then the first scheduled.
    fn cmp(&self, other: &Self) -> Ordering {
        other.at.cmp(&self.at).then(other.seq.cmp(&self.seq))
    }
}

struct InFlight {
    session: u64,
    turn: usize,
    arrival_ms: f64,
    prompt_tokens: u32,
    predicted_tokens: u64,
    first_token_ms: Option<f64>,
    last_token_ms: f64,
    worker: usize,
    replica: usize,
    ticket: Option<ResponseTicket>,
}

/// A submitted request waiting for placement: the driver owns its payload.
struct Payload {
    session: u64,
    turn: usize,
    arrival_ms: f64,
    tokens: Vec<u32>,
    blocks: Vec<LocalHash>,
    output_tokens: u32,
}

struct WorkerState {
    id: WorkerId,
    engine: Engine<SyncDevice>,
    busy: bool,
    pending: StepReport,
    served_tokens: u64,
    /// Requests booked on this worker by any replica (the truth the
    /// replicas' views approximate).
    booked: u64,
}

/// One router replica: a routing core and the admission in front of it, as
/// one `switchyard serve` process holds them.
struct Replica {
    id: ReplicaId,
    router: Router,
    admission: AdmissionController,
    placed: Vec<Placed>,
    tick_at: Option<f64>,
    routed: u64,
}

/// Simulated milliseconds between `Router::expire` sweeps.
const EXPIRE_EVERY_MS: f64 = 1_000.0;

/// Runs one simulation to completion.
pub fn simulate(
    config: &FleetConfig,
    workload: SessionStream,
    mut progress: impl FnMut(u64),
) -> Result<SimOutcome, SimError> {
    Fleet::new(config, workload)?.run(&mut progress, |_| {})
}

struct Fleet {
    config: FleetConfig,
    replicas: Vec<Replica>,
    balancer: Balancer,
    /// The replica of each multi-turn session, with session-aware admission.
    session_replica: FxHashMap<u64, usize>,
    workers: Vec<WorkerState>,
    by_worker_id: FxHashMap<WorkerId, usize>,
    heap: BinaryHeap<Scheduled>,
    seq: u64,
    now: f64,
    workload: SessionStream,
    lookahead: Option<Session>,
    sessions: FxHashMap<u64, Session>,
    in_flight: FxHashMap<RequestId, InFlight>,
    payloads: FxHashMap<RequestId, Payload>,
    kv_scratch: Vec<KvEvent>,
    outbox: Vec<SequenceEvent>,
    // Figures.
    ttft: Vec<f64>,
    itl: Vec<f64>,
    e2e: Vec<f64>,
    queue: Vec<f64>,
    prompt_tokens: u64,
    cached_tokens: u64,
    predicted_tokens: u64,
    output_tokens: u64,
    completed: u64,
    errors: u64,
    sessions_completed: u64,
    first_arrival: Option<f64>,
    last_completion: f64,
    timeline: LoadTimeline,
    view_error_sum: f64,
    excess_sum: f64,
    decisions: u64,
    next_expiry_ms: f64,
}

impl Fleet {
    fn new(config: &FleetConfig, workload: SessionStream) -> Result<Self, SimError> {
        if config.workers == 0 {
            return Err(SimError::NoWorkers);
        }
        config.replicas.validate()?;
        let mut config = config.clone();
        config.router.sequences.block_size = config.engine.block_size as u32;
        let mut workers = Vec::with_capacity(config.workers);
        let mut by_worker_id = FxHashMap::default();
        let mut capacities = Vec::with_capacity(config.workers);
        for i in 0..config.workers {
            let id = WorkerId::new(i as u64);
            let engine = Engine::new(
                config.engine.clone(),
                SyncDevice::new(config.engine.timing.clone()),
            )
            .map_err(|e| SimError::Engine(e.to_string()))?;
            capacities.push((
                id,
                WorkerCapacity {
                    max_num_batched_tokens: Some(config.engine.max_num_batched_tokens as u64),
                    kv_blocks: Some(config.engine.num_blocks as u64),
                },
            ));
            by_worker_id.insert(id, i);
            workers.push(WorkerState {
                id,
                engine,
                busy: false,
                pending: StepReport::default(),
                served_tokens: 0,
                booked: 0,
            });
        }
        let mut replicas = Vec::with_capacity(config.replicas.count);
        for r in 0..config.replicas.count {
            let mut router = Router::new(RouterConfig {
                seed: replica_seed(config.router.seed, r),
                ..config.router
            })?;
            let id = ReplicaId(r as u64 + 1);
            router.set_replica_id(id);
            for &(worker, capacity) in &capacities {
                router.add_worker(worker, capacity);
            }
            let strategy = match config.session_aware {
                Some(session) => Some(Box::new(
                    SessionAwareStrategy::new(session)
                        .map_err(|e| SimError::Admission(e.to_string()))?,
                ) as Box<dyn AdmissionStrategy + Send>),
                None => None,
            };
            let admission = AdmissionController::new(config.admission.clone(), strategy)
                .map_err(|e| SimError::Admission(e.to_string()))?;
            replicas.push(Replica {
                id,
                router,
                admission,
                placed: Vec::new(),
                tick_at: None,
                routed: 0,
            });
        }
        let timeline = LoadTimeline::new(config.workers, config.timeline_bucket_ms.max(1.0));
        Ok(Self {
            balancer: Balancer::new(&config.replicas, config.router.seed),
            session_replica: FxHashMap::default(),
            replicas,
            config,
            workers,
            by_worker_id,
            heap: BinaryHeap::new(),
            seq: 0,
            now: 0.0,
            workload,
            lookahead: None,
            sessions: FxHashMap::default(),
            in_flight: FxHashMap::default(),
            payloads: FxHashMap::default(),
            kv_scratch: Vec::new(),
            outbox: Vec::new(),
            ttft: Vec::new(),
            itl: Vec::new(),
            e2e: Vec::new(),
            queue: Vec::new(),
            prompt_tokens: 0,
            cached_tokens: 0,
            predicted_tokens: 0,
            output_tokens: 0,
            completed: 0,
            errors: 0,
            sessions_completed: 0,
            first_arrival: None,
            last_completion: 0.0,
            timeline,
            view_error_sum: 0.0,
            excess_sum: 0.0,
            decisions: 0,
            next_expiry_ms: EXPIRE_EVERY_MS,
        })
    }

    fn schedule(&mut self, at: f64, event: Event) {
        self.seq += 1;
        self.heap.push(Scheduled {
            at: At(at),
            seq: self.seq,
            event,
        });
    }

    fn pull_next_session(&mut self) -> Result<(), SimError> {
        match self.workload.next() {
            Some(session) => {
                let session = session?;
                let at = session.arrival_ms.max(self.now);
                self.lookahead = Some(session);
                self.schedule(at, Event::NextSession);
            }
            None => self.lookahead = None,
        }
        Ok(())
    }

    /// Runs to the end; `after_event` sees the fleet after every event (tests
    /// check invariants there).
    fn run(
        mut self,
        progress: &mut impl FnMut(u64),
        mut after_event: impl FnMut(&Fleet),
    ) -> Result<SimOutcome, SimError> {
        self.pull_next_session()?;
        while let Some(Scheduled { at, event, .. }) = self.heap.pop() {
            self.now = at.0;
            if self.now >= self.next_expiry_ms {
                // As the server's tick does: frees lost bookings and keeps
                // the write model's expiry queue compacted.
                for replica in &mut self.replicas {
                    replica.router.expire(self.now);
                }
                self.next_expiry_ms = self.now + EXPIRE_EVERY_MS;
            }
            match event {
                Event::NextSession => {
                    if let Some(session) = self.lookahead.take() {
                        let id = session.id;
                        self.first_arrival.get_or_insert(self.now);
                        self.sessions.insert(id, session);
                        self.arrive(id, 0);
                    }
                    self.pull_next_session()?;
                }
                Event::Turn { session, turn } => self.arrive(session, turn),
                Event::StepDone { worker } => {
                    self.finish_step(worker, progress)?;
                    for replica in 0..self.replicas.len() {
                        self.poll_admission(replica);
                    }
                }
                Event::AdmissionTick { replica } => {
                    let r = &mut self.replicas[replica];
                    r.tick_at = None;
                    r.admission.tick(self.now);
                    self.poll_admission(replica);
                }
                Event::KvDelivery { worker, events } => {
                    let id = self.workers[worker].id;
                    for replica in &mut self.replicas {
                        for e in &events {
                            replica.router.apply_kv_event(id, e);
                        }
                    }
                }
                Event::ReplicaSync { origin, event } => self.apply_on_peers(origin, &event),
            }
            after_event(&self);
        }
        Ok(self.outcome())
    }

    fn request_id(session: u64, turn: usize) -> RequestId {
        RequestId(u128::from(session) << 32 | turn as u128)
    }

    /// The replica the load balancer hands a turn to: a session-affinity
    /// balancer keeps a session's turns together when admission is
    /// session-aware.
    fn pick_replica(&mut self, session: u64, multi_turn: bool) -> usize {
        if multi_turn && self.config.session_aware.is_some() {
            if let Some(&r) = self.session_replica.get(&session) {
                return r;
            }
            let r = self.balancer.pick();
            self.session_replica.insert(session, r);
            return r;
        }
        self.balancer.pick()
    }

    fn arrive(&mut self, session: u64, turn: usize) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        let multi_turn = s.turns.len() > 1;
        let spec = &s.turns[turn];
        let output_tokens = spec.output_tokens;
        let tokens = spec.prompt.tokens();
        let blocks = local_block_hashes(&tokens, self.config.engine.block_size, DEFAULT_SEED);
        let id = Self::request_id(session, turn);
        let replica = self.pick_replica(session, multi_turn);
        let facts = RequestFacts {
            id,
            session: multi_turn.then_some(SessionKey(session)),
            context_tokens: tokens.len() as u32,
            uncached_tokens: tokens.len() as u32,
            class: QueueClass::default(),
            eligible: &[],
            now_ms: self.now,
        };
        match self.replicas[replica].admission.submit(&facts) {
            SubmitOutcome::Queued | SubmitOutcome::Deferred => {
                self.payloads.insert(
                    id,
                    Payload {
                        session,
                        turn,
                        arrival_ms: self.now,
                        tokens,
                        blocks,
                        output_tokens,
                    },
                );
            }
            SubmitOutcome::Rejected { .. } | SubmitOutcome::Duplicate => self.fail(session),
        }
        self.poll_admission(replica);
    }

    /// Places every request `replica`'s admission controller offers, books
    /// it and starts it on its engine; schedules the next recheck while work
    /// remains.
    fn poll_admission(&mut self, replica: usize) {
        let now = self.now;
        let shares = self.config.replicas.shares_bookings();
        let Fleet {
            replicas,
            payloads,
            config,
            workers,
            by_worker_id,
            outbox,
            view_error_sum,
            excess_sum,
            decisions,
            ..
        } = self;
        let Replica {
            router,
            admission,
            placed,
            ..
        } = &mut replicas[replica];
        admission.poll(now, placed, |id, placement| {
            let Some(p) = payloads.get(&id) else {
                return SelectOutcome::NoWorkers;
            };
            let request = RoutingRequest {
                prompt_tokens: p.tokens.len() as u32,
                blocks: &p.blocks,
            };
            let exact;
            let eligible = match placement {
                Placement::Any => None,
                Placement::Exact(worker) => {
                    exact = [worker];
                    Some(&exact[..])
                }
            };
            let seen = router.sequences().active_requests() as f64;
            let booked: u64 = workers.iter().map(|w| w.booked).sum();
            *view_error_sum += (seen - booked as f64).abs();
            let outcome = router.route(request, eligible, now);
            if let SelectOutcome::Selected(decision) = outcome {
                let cached = (decision.overlap_blocks as u64 * config.engine.block_size as u64)
                    .min(p.tokens.len() as u64);
                let hint = config
                    .prefill_hints
                    .then(|| expected_prefill_ms(config, p.tokens.len() as u64 - cached));
                let add = AddRequest::for_decision(id, &request, &decision, hint);
                router.book_request(&add, now);
                let least = workers.iter().map(|w| w.booked).min().unwrap_or(0);
                let chosen = &mut workers[by_worker_id[&decision.worker]];
                *excess_sum += (chosen.booked - least) as f64;
                *decisions += 1;
                chosen.booked += 1;
                if shares {
                    outbox.push(SequenceEvent::Add(add));
                }
            }
            outcome
        });
        let mut placed = std::mem::take(placed);
        self.publish_outbox(replica);
        for p in placed.drain(..) {
            match p {
                Placed::Selected {
                    ticket,
                    decision,
                    waited_ms,
                } => self.start(
                    replica,
                    ticket,
                    decision.worker,
                    decision.overlap_blocks,
                    waited_ms,
                ),
                Placed::NoWorkers { id } => {
                    if let Some(p) = self.payloads.remove(&id) {
                        self.fail(p.session);
                    }
                }
            }
        }
        self.replicas[replica].placed = placed;
        let busy = !self.payloads.is_empty()
            || !self.in_flight.is_empty()
            || !self.sessions.is_empty()
            || self.lookahead.is_some();
        let r = &mut self.replicas[replica];
        if let Some(at) = r.admission.next_wakeup_ms().filter(|_| busy) {
            let at = at.max(self.now + 1.0);
            if r.tick_at.is_none_or(|t| at < t) {
                r.tick_at = Some(at);
                self.schedule(at, Event::AdmissionTick { replica });
            }
        }
    }

    /// Sends the lifecycle events `origin` queued to its peers: at once when
    /// the delay is zero, otherwise as one scheduled delivery each.
    fn publish_outbox(&mut self, origin: usize) {
        let mut outbox = std::mem::take(&mut self.outbox);
        for event in outbox.drain(..) {
            self.publish(origin, event);
        }
        self.outbox = outbox;
    }

    /// Shares one of `origin`'s lifecycle events with its peers, if replicas
    /// share bookings at all.
    fn publish(&mut self, origin: usize, event: SequenceEvent) {
        if !self.config.replicas.shares_bookings() {
            return;
        }
        let delay = self.config.replicas.sync_delay_ms;
        if delay == 0.0 {
            self.apply_on_peers(origin, &event);
        } else {
            self.schedule(self.now + delay, Event::ReplicaSync { origin, event });
        }
    }

    fn apply_on_peers(&mut self, origin: usize, event: &SequenceEvent) {
        let from = self.replicas[origin].id;
        let now = self.now;
        for (r, replica) in self.replicas.iter_mut().enumerate() {
            if r != origin {
                replica.router.apply_remote(from, event, now);
            }
        }
    }

    /// A request booked by `replica` ends before it ran (the engine refused
    /// it, or its payload is gone): free it there and tell the peers.
    fn unbook(&mut self, replica: usize, id: RequestId, worker: WorkerId) {
        self.replicas[replica].router.free(id, self.now);
        if let Some(&w) = self.by_worker_id.get(&worker) {
            self.workers[w].booked = self.workers[w].booked.saturating_sub(1);
        }
        self.publish(replica, SequenceEvent::Free(id));
    }

    /// Hands a placed (and booked) request to its engine.
    fn start(
        &mut self,
        replica: usize,
        ticket: ResponseTicket,
        worker_id: WorkerId,
        overlap_blocks: u32,
        waited_ms: f64,
    ) {
        let id = ticket.id();
        let Some(p) = self.payloads.remove(&id) else {
            self.unbook(replica, id, worker_id);
            self.replicas[replica].admission.abort(ticket, self.now);
            return;
        };
        let worker = self.by_worker_id[&worker_id];
        let prompt_tokens = p.tokens.len() as u32;
        let cached = (u64::from(overlap_blocks) * self.config.engine.block_size as u64)
            .min(u64::from(prompt_tokens));
        let admitted = self.workers[worker].engine.add_request(NewRequest {
            id,
            prompt: p.tokens,
            max_tokens: p.output_tokens,
            hash_seed: DEFAULT_SEED,
        });
        if admitted.is_err() {
            self.unbook(replica, id, worker_id);
            self.replicas[replica].admission.abort(ticket, self.now);
            self.fail(p.session);
            return;
        }
        self.replicas[replica]
            .admission
            .dispatched(&ticket, self.now);
        self.replicas[replica].routed += 1;
        self.queue.push(waited_ms);
        self.in_flight.insert(
            id,
            InFlight {
                session: p.session,
                turn: p.turn,
                arrival_ms: p.arrival_ms,
                prompt_tokens,
                predicted_tokens: cached,
                first_token_ms: None,
                last_token_ms: self.now,
                worker,
                replica,
                ticket: Some(ticket),
            },
        );
        self.kick(worker);
    }

    fn fail(&mut self, session: u64) {
        self.errors += 1;
        self.sessions.remove(&session);
        self.session_replica.remove(&session);
    }

    /// Launches a step on an idle worker that has work.
    fn kick(&mut self, worker: usize) {
        let w = &mut self.workers[worker];
        if w.busy || !w.engine.has_work() {
            return;
        }
        let mut report = std::mem::take(&mut w.pending);
        if w.engine.step(&mut report).is_err() {
            // The synchronous device layer does not fail; treat a failure as
            // an idle step so the simulation still ends.
            report = StepReport::default();
        }
        let duration = self.config.engine.timing.wall_ms(report.model_ms);
        let idle = report.is_idle();
        w.pending = report;
        if idle {
            // Work that cannot be scheduled yet (a deferred restore): look
            // again after a floor-length step.
            let retry = self
                .config
                .engine
                .timing
                .wall_ms(self.config.engine.timing.decode_floor_ms);
            if retry > 0.0 {
                w.busy = true;
                self.schedule(self.now + retry, Event::StepDone { worker });
            }
            return;
        }
        w.busy = true;
        self.schedule(self.now + duration, Event::StepDone { worker });
    }

    fn finish_step(
        &mut self,
        worker: usize,
        progress: &mut impl FnMut(u64),
    ) -> Result<(), SimError> {
        let now = self.now;
        let report = std::mem::take(&mut self.workers[worker].pending);
        let computed = report.shape.prefill_tokens + report.shape.decode_tokens;
        self.workers[worker].served_tokens += computed;
        self.timeline.add(worker, now, computed);
        for token in &report.tokens {
            let Some(r) = self.in_flight.get_mut(&token.request) else {
                continue;
            };
            if let Some(progress) = r.ticket.as_mut().and_then(ResponseTicket::progress) {
                progress.advance(1);
            }
            let first = r.first_token_ms.is_none();
            if first {
                r.first_token_ms = Some(now);
                self.ttft.push(now - r.arrival_ms);
            } else {
                self.itl.push(now - r.last_token_ms);
            }
            r.last_token_ms = now;
            let replica = r.replica;
            if first {
                self.replicas[replica]
                    .router
                    .mark_prefill_completed(token.request, now);
                self.publish(replica, SequenceEvent::MarkPrefillCompleted(token.request));
            }
        }
        for done in &report.finished {
            let Some(r) = self.in_flight.remove(&done.request) else {
                continue;
            };
            self.replicas[r.replica].router.free(done.request, now);
            self.workers[r.worker].booked = self.workers[r.worker].booked.saturating_sub(1);
            self.publish(r.replica, SequenceEvent::Free(done.request));
            self.prompt_tokens += u64::from(r.prompt_tokens);
            self.cached_tokens += done.cached_tokens as u64;
            self.predicted_tokens += r.predicted_tokens;
            self.output_tokens += done.output_tokens as u64;
            self.e2e.push(now - r.arrival_ms);
            self.completed += 1;
            if let Some(ticket) = r.ticket {
                let context = u64::from(r.prompt_tokens) + done.output_tokens as u64;
                // A refusal gives the ticket back; it was dispatched, so none comes.
                let _ = self.replicas[r.replica]
                    .admission
                    .complete(ticket, context, now);
            }
            self.last_completion = now;
            debug_assert_eq!(r.worker, worker);
            self.next_turn(r.session, r.turn);
            if self.completed % 256 == 0 {
                progress(self.completed);
            }
        }
        self.deliver_kv_events(worker);
        let engine = &self.workers[worker].engine;
        let capacity = (self.config.engine.num_blocks * self.config.engine.block_size) as u64;
        let usage = KvUsage {
            capacity_tokens: capacity,
            used_tokens: Some((engine.kv_usage() * capacity as f64) as u64),
        };
        let id = self.workers[worker].id;
        for replica in &mut self.replicas {
            replica.admission.report_kv(id, usage);
        }
        self.workers[worker].pending = report;
        self.workers[worker].busy = false;
        self.kick(worker);
        Ok(())
    }

    fn next_turn(&mut self, session: u64, turn: usize) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        if turn + 1 < s.turns.len() {
            let at = self.now + s.think_time_ms;
            self.schedule(
                at,
                Event::Turn {
                    session,
                    turn: turn + 1,
                },
            );
        } else {
            self.sessions.remove(&session);
            self.session_replica.remove(&session);
            self.sessions_completed += 1;
        }
    }

    fn deliver_kv_events(&mut self, worker: usize) {
        let mut raw = std::mem::take(&mut self.kv_scratch);
        raw.clear();
        self.workers[worker].engine.drain_kv_events(&mut raw);
        let block_size = self.config.engine.block_size;
        let events: Vec<IndexEvent> = raw
            .drain(..)
            .filter_map(|e| to_index_event(e, block_size))
            .collect();
        self.kv_scratch = raw;
        if !events.is_empty() {
            let at = self.now + self.config.kv_event_delay_ms;
            self.schedule(at, Event::KvDelivery { worker, events });
        }
    }

    fn outcome(mut self) -> SimOutcome {
        let makespan_ms = (self.last_completion - self.first_arrival.unwrap_or(0.0)).max(1e-9);
        let served: Vec<f64> = self
            .workers
            .iter()
            .map(|w| w.served_tokens as f64)
            .collect();
        let report = PolicyReport {
            ttft_ms: Latency::of(&mut self.ttft),
            itl_ms: Latency::of(&mut self.itl),
            e2e_ms: Latency::of(&mut self.e2e),
            queue_ms: Latency::of(&mut self.queue),
            hit_rate: self.cached_tokens as f64 / self.prompt_tokens.max(1) as f64,
            predicted_hit_rate: self.predicted_tokens as f64 / self.prompt_tokens.max(1) as f64,
            throughput_rps: self.completed as f64 / (makespan_ms / 1000.0),
            output_tokens_per_sec: self.output_tokens as f64 / (makespan_ms / 1000.0),
            load_cv: coefficient_of_variation(&served),
            preemptions: self
                .workers
                .iter()
                .map(|w| w.engine.counters().preemptions)
                .sum(),
            completed: self.completed,
            errors: self.errors,
            sessions_completed: self.sessions_completed,
            makespan_s: makespan_ms / 1000.0,
            engine_steps: self.workers.iter().map(|w| w.engine.counters().steps).sum(),
        };
        let decisions = self.decisions.max(1) as f64;
        let replicas = ReplicaStats {
            replicas: self.replicas.len(),
            sync: self.config.replicas.sync,
            sync_delay_ms: self.config.replicas.sync_delay_ms,
            routed_per_replica: self.replicas.iter().map(|r| r.routed).collect(),
            remote_applied: self
                .replicas
                .iter()
                .map(|r| r.router.remote().counters().applied)
                .sum(),
            remote_ignored: self
                .replicas
                .iter()
                .map(|r| r.router.remote().counters().ignored)
                .sum(),
            view_error_requests: self.view_error_sum / decisions,
            excess_requests: self.excess_sum / decisions,
        };
        SimOutcome {
            report,
            timeline: self.timeline,
            ttft_samples_ms: self.ttft,
            replicas,
        }
    }
}

/// Expected prefill time of `tokens` uncached tokens, chunked as the engine
/// batches them, in simulated milliseconds.
fn expected_prefill_ms(config: &FleetConfig, tokens: u64) -> f64 {
    let timing = &config.engine.timing;
    let chunk = config.engine.max_num_batched_tokens.max(1) as u64;
    let mut left = tokens;
    let mut ms = 0.0;
    while left > 0 {
        let t = left.min(chunk);
        ms += timing.prefill_ms(t);
        left -= t;
    }
    timing.wall_ms(ms)
}

/// An engine's KV event as the router's index sees it: device-tier events
/// only (the index tracks what is on the GPU), local hashes recomputed from
/// the event's tokens as the router's normalizer does.
pub fn to_index_event(event: KvEvent, block_size: usize) -> Option<IndexEvent> {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            medium: Medium::Device,
            ..
        } => {
            let locals = local_block_hashes(&token_ids, block_size, DEFAULT_SEED);
            if locals.len() != block_hashes.len() {
                return None;
            }
            Some(IndexEvent::Stored {
                parent: parent_block_hash,
                blocks: block_hashes
                    .into_iter()
                    .zip(locals)
                    .map(|(engine_hash, local_hash)| StoredBlock {
                        engine_hash,
                        local_hash,
                    })
                    .collect(),
            })
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium: Medium::Device,
        } => Some(IndexEvent::Removed {
            blocks: block_hashes,
        }),
        KvEvent::AllBlocksCleared => Some(IndexEvent::Cleared),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{PromptSpec, Turn};
    use switchyard_core::select::PolicyKind;

    fn sessions(list: Vec<Session>) -> SessionStream {
        Box::new(list.into_iter().map(Ok))
    }

    fn one_turn(id: u64, arrival_ms: f64, prompt: Vec<u32>, output_tokens: u32) -> Session {
        Session {
            id,
            arrival_ms,
            think_time_ms: 0.0,
            turns: vec![Turn {
                prompt: PromptSpec::Tokens(prompt.into()),
                output_tokens,
            }],
        }
    }

    fn fleet(workers: usize, policy: PolicyKind) -> FleetConfig {
        let mut config = FleetConfig {
            workers,
            ..FleetConfig::default()
        };
        config.engine.timing.speedup = 1.0;
        config.router.policy = policy;
        config
    }

    #[test]
    fn one_request_on_one_worker_takes_the_timing_models_time() {
        let config = fleet(1, PolicyKind::Kv);
        let prompt: Vec<u32> = (0..100).collect();
        let out = simulate(&config, sessions(vec![one_turn(0, 0.0, prompt, 3)]), |_| {}).unwrap();
        let r = &out.report;
        // One prefill step of 100 tokens: 4.209989e-7·100² + 1.518344e-2·100 + 16.50142.
        let prefill = 4.209989e-7 * 1e4 + 1.518344e-2 * 100.0 + 16.50142;
        assert!(
            (r.ttft_ms.mean - prefill).abs() < 1e-9,
            "{}",
            r.ttft_ms.mean
        );
        // Two decode steps at almost-empty KV usage: about 5.74 ms each.
        let decode = r.e2e_ms.mean - r.ttft_ms.mean;
        assert!((2.0 * 5.74..2.0 * 5.8).contains(&decode), "{decode}");
        assert_eq!((r.completed, r.errors), (1, 0));
        assert_eq!(r.hit_rate, 0.0);
    }

    #[test]
    fn a_repeated_prompt_goes_where_its_prefix_is_cached() {
        let config = fleet(2, PolicyKind::Kv);
        let prompt: Vec<u32> = (0..100).collect();
        let out = simulate(
            &config,
            sessions(vec![
                one_turn(0, 0.0, prompt.clone(), 3),
                one_turn(1, 1000.0, prompt, 3),
            ]),
            |_| {},
        )
        .unwrap();
        // The second request reuses the 6 full 16-token blocks: 96 of 200
        // prompt tokens, and the router predicted exactly that.
        assert!(
            (out.report.hit_rate - 96.0 / 200.0).abs() < 1e-12,
            "{}",
            out.report.hit_rate
        );
        assert_eq!(out.report.predicted_hit_rate, out.report.hit_rate);
        // Round-robin sends it to the other, cold worker.
        let config = fleet(2, PolicyKind::RoundRobin);
        let prompt: Vec<u32> = (0..100).collect();
        let out = simulate(
            &config,
            sessions(vec![
                one_turn(0, 0.0, prompt.clone(), 3),
                one_turn(1, 1000.0, prompt, 3),
            ]),
            |_| {},
        )
        .unwrap();
        assert_eq!(out.report.hit_rate, 0.0);
    }

    #[test]
    fn a_sessions_next_turn_waits_for_the_previous_one_and_its_think_time() {
        let config = fleet(1, PolicyKind::Kv);
        let first: Vec<u32> = (0..64).collect();
        let mut second = first.clone();
        second.extend(1000..1064);
        let session = Session {
            id: 0,
            arrival_ms: 0.0,
            think_time_ms: 5000.0,
            turns: vec![
                Turn {
                    prompt: PromptSpec::Tokens(first.into()),
                    output_tokens: 2,
                },
                Turn {
                    prompt: PromptSpec::Tokens(second.into()),
                    output_tokens: 2,
                },
            ],
        };
        let out = simulate(&config, sessions(vec![session]), |_| {}).unwrap();
        assert_eq!(out.report.completed, 2);
        assert_eq!(out.report.sessions_completed, 1);
        // Makespan covers both turns and the think time between them.
        assert!(
            out.report.makespan_s > 5.0 && out.report.makespan_s < 5.2,
            "{}",
            out.report.makespan_s
        );
        // The second turn hits the first turn's 4 full blocks: 64 of 192.
        assert!(
            (out.report.hit_rate - 64.0 / 192.0).abs() < 1e-12,
            "{}",
            out.report.hit_rate
        );
    }

    #[test]
    fn a_request_the_engine_refuses_is_counted_not_lost() {
        let mut config = fleet(1, PolicyKind::Kv);
        config.engine.num_blocks = 4;
        let big: Vec<u32> = (0..1000).collect();
        let out = simulate(&config, sessions(vec![one_turn(0, 0.0, big, 3)]), |_| {}).unwrap();
        assert_eq!((out.report.completed, out.report.errors), (0, 1));
    }

    #[test]
    fn the_same_seed_gives_the_same_figures() {
        let run = || {
            let mut config = fleet(3, PolicyKind::PowerOfTwo);
            config.router.seed = 11;
            let workload = crate::workload::synthetic(crate::workload::SyntheticConfig {
                sessions: 40,
                sessions_per_sec: 20.0,
                think_time_ms: 100.0,
                ..Default::default()
            });
            let out = simulate(&config, workload, |_| {}).unwrap();
            serde_json::to_string(&out).unwrap()
        };
        let first = run();
        assert_eq!(first, run());
        assert!(first.contains("\"completed\""));
    }

    #[test]
    fn zero_workers_is_a_clear_error() {
        let config = fleet(0, PolicyKind::Kv);
        let err = simulate(&config, sessions(vec![]), |_| {}).unwrap_err();
        assert_eq!(err.to_string(), "the fleet needs at least one worker");
    }

    #[test]
    fn a_malformed_trace_line_stops_the_run_with_its_line_number() {
        let text = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [0]}\nnot json\n";
        let workload = crate::workload::mooncake(text.as_bytes(), 3000.0);
        let err = simulate(&fleet(1, PolicyKind::Kv), workload, |_| {}).unwrap_err();
        assert!(err.to_string().starts_with("line 2"), "{err}");
    }
}

#[cfg(test)]
mod admission_tests {
    use super::*;
    use crate::workload::{synthetic, SyntheticConfig};
    use switchyard_core::select::PolicyKind;

    fn config(session_aware: bool) -> FleetConfig {
        let mut config = FleetConfig {
            workers: 4,
            session_aware: session_aware.then(SessionAwareConfig::default),
            ..FleetConfig::default()
        };
        config.engine.timing.speedup = 4.0;
        config.router.policy = PolicyKind::Kv;
        config
    }

    fn workload() -> SessionStream {
        synthetic(SyntheticConfig {
            sessions: 60,
            sessions_per_sec: 10.0,
            think_time_ms: 200.0,
            ..Default::default()
        })
    }

    #[test]
    fn session_aware_admission_completes_every_turn_and_ends() {
        let out = simulate(&config(true), workload(), |_| {}).unwrap();
        let expected: u64 = workload().map(|s| s.unwrap().turns.len() as u64).sum();
        assert_eq!(out.report.completed, expected);
        assert_eq!(out.report.errors, 0);
        assert_eq!(out.report.sessions_completed, 60);
    }

    #[test]
    fn session_aware_admission_is_deterministic() {
        let run = || {
            serde_json::to_string(&simulate(&config(true), workload(), |_| {}).unwrap()).unwrap()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn sticking_sessions_to_their_worker_keeps_their_prefix_cached() {
        let with = simulate(&config(true), workload(), |_| {}).unwrap().report;
        let mut rr = config(false);
        rr.router.policy = PolicyKind::RoundRobin;
        let without = simulate(&rr, workload(), |_| {}).unwrap().report;
        assert!(
            with.hit_rate > without.hit_rate,
            "session-aware kv {} vs round-robin {}",
            with.hit_rate,
            without.hit_rate
        );
    }
}

#[cfg(test)]
mod replica_tests {
    use super::*;
    use crate::replicas::Balance;
    use crate::workload::{synthetic, PromptSpec, SyntheticConfig, Turn};
    use switchyard_core::select::PolicyKind;

    fn config(replicas: usize, sync: bool, sync_delay_ms: f64) -> FleetConfig {
        let mut config = FleetConfig {
            workers: 4,
            replicas: ReplicasConfig {
                count: replicas,
                sync,
                sync_delay_ms,
                balance: Balance::RoundRobin,
            },
            ..FleetConfig::default()
        };
        config.engine.timing.speedup = 4.0;
        config.router.policy = PolicyKind::Kv;
        config
    }

    fn workload() -> SessionStream {
        synthetic(SyntheticConfig {
            sessions: 60,
            sessions_per_sec: 20.0,
            think_time_ms: 50.0,
            ..Default::default()
        })
    }

    /// Per worker: requests, decode blocks, prefill tokens, active prompt blocks.
    type Loads = Vec<(WorkerId, usize, usize, u64, usize)>;

    /// Everything a replica's selector reads from shared state: per-worker
    /// requests, decode blocks, prefill tokens now and active prompt blocks;
    /// the index's live pairs.
    fn view(router: &Router, now_ms: f64) -> (Loads, usize) {
        let registry = router.sequences().registry();
        let loads = registry
            .loads()
            .map(|l| {
                (
                    l.worker,
                    l.requests,
                    l.decode_blocks,
                    l.active_prefill_tokens(now_ms),
                    registry.active_blocks(l.worker),
                )
            })
            .collect();
        (loads, router.index().live_pairs())
    }

    fn run(config: &FleetConfig, workload: SessionStream, check: impl FnMut(&Fleet)) -> SimOutcome {
        Fleet::new(config, workload)
            .unwrap()
            .run(&mut |_| {}, check)
            .unwrap()
    }

    #[test]
    fn with_sync_at_delay_zero_every_replica_sees_the_same_state_after_every_event() {
        let mut events = 0u64;
        let mut busy_views = 0u64;
        let out = run(&config(3, true, 0.0), workload(), |fleet| {
            events += 1;
            let first = view(&fleet.replicas[0].router, fleet.now);
            for r in &fleet.replicas[1..] {
                assert_eq!(view(&r.router, fleet.now), first, "at {} ms", fleet.now);
            }
            // And the shared view is the truth: every booking anywhere.
            let booked: u64 = fleet.workers.iter().map(|w| w.booked).sum();
            assert_eq!(
                fleet.replicas[0].router.sequences().active_requests() as u64,
                booked
            );
            busy_views += u64::from(booked > 0);
        });
        assert!(
            events > 1000 && busy_views > 100,
            "{events} events, {busy_views} busy"
        );
        assert_eq!(out.replicas.view_error_requests, 0.0);
        assert!(out.replicas.routed_per_replica.iter().all(|&n| n > 50));
        assert_eq!(out.report.errors, 0);
    }

    #[test]
    fn a_delayed_sync_frees_every_booking_everywhere_and_ignores_nothing() {
        let mut last_active = Vec::new();
        let out = run(&config(4, true, 7.0), workload(), |fleet| {
            last_active = fleet
                .replicas
                .iter()
                .map(|r| r.router.sequences().active_requests())
                .collect();
        });
        assert_eq!(last_active, vec![0; 4]);
        assert_eq!(out.replicas.remote_ignored, 0);
        // Each of 3 peers applies add, mark and free of every request.
        let requests: u64 = out.replicas.routed_per_replica.iter().sum();
        assert_eq!(out.replicas.remote_applied, requests * 3 * 3);
        assert!(out.replicas.view_error_requests > 0.0);
    }

    #[test]
    fn without_sync_peers_learn_nothing_but_kv_events_still_reach_every_replica() {
        let mut pairs = Vec::new();
        let out = run(&config(2, false, 7.0), workload(), |fleet| {
            pairs = fleet
                .replicas
                .iter()
                .map(|r| r.router.index().live_pairs())
                .collect();
        });
        assert_eq!(out.replicas.remote_applied, 0);
        assert!(pairs[0] > 0);
        assert_eq!(pairs[0], pairs[1]);
    }

    /// Rounds of two equal requests 5 ms apart on two workers, each round
    /// done before the next: a replica that sees the first booking sends the
    /// second request to the other worker; without sync the two replicas
    /// choose independently and often pick the same one.
    fn pairs(rounds: u64) -> SessionStream {
        let sessions: Vec<Session> = (0..rounds * 2)
            .map(|i| Session {
                id: i,
                arrival_ms: (i / 2) as f64 * 2_000.0 + (i % 2) as f64 * 5.0,
                think_time_ms: 0.0,
                turns: vec![Turn {
                    prompt: PromptSpec::Random {
                        seed: i,
                        tokens: 2048,
                    },
                    output_tokens: 64,
                }],
            })
            .collect();
        Box::new(sessions.into_iter().map(Ok))
    }

    #[test]
    fn without_sync_load_balance_is_measurably_worse() {
        let fleet = |sync| {
            let mut c = config(2, sync, 1.0);
            c.workers = 2;
            c
        };
        let on = run(&fleet(true), pairs(40), |_| {});
        let off = run(&fleet(false), pairs(40), |_| {});
        // With sync every second request of a pair sees the first one's
        // booking and goes to the idle worker.
        assert_eq!(on.replicas.excess_requests, 0.0);
        assert!(
            off.replicas.excess_requests >= 0.1,
            "excess without sync: {}",
            off.replicas.excess_requests
        );
        // A collision batches two prefills on one worker: slower first tokens.
        assert!(
            off.report.ttft_ms.p90 > on.report.ttft_ms.p90,
            "TTFT p90 {} (off) vs {} (on)",
            off.report.ttft_ms.p90,
            on.report.ttft_ms.p90
        );
        assert_eq!((on.report.completed, off.report.completed), (80, 80));
    }

    #[test]
    fn replicas_with_random_balance_are_deterministic_for_a_seed() {
        let run = || {
            let mut c = config(3, true, 7.0);
            c.replicas.balance = Balance::Random;
            c.router.seed = 9;
            serde_json::to_string(&simulate(&c, workload(), |_| {}).unwrap()).unwrap()
        };
        assert_eq!(run(), run());
    }

    #[test]
    fn with_session_aware_admission_a_sessions_turns_stay_on_one_replica() {
        let mut c = config(3, true, 7.0);
        c.session_aware = Some(SessionAwareConfig::default());
        let mut sticky = true;
        let out = run(&c, workload(), |fleet| {
            for (id, f) in &fleet.in_flight {
                let session = (id.0 >> 32) as u64;
                if let Some(&r) = fleet.session_replica.get(&session) {
                    sticky &= r == f.replica;
                }
            }
        });
        assert!(sticky);
        let expected: u64 = workload().map(|s| s.unwrap().turns.len() as u64).sum();
        assert_eq!(out.report.completed, expected);
    }
}
