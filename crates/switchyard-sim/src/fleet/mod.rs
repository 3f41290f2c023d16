//! The discrete-event fleet simulator: the real request lifecycle against N
//! simulated engine cores, in virtual time.
//!
//! Each router replica is one [`Dispatcher`] — the same value `switchyard
//! serve` drives from its HTTP handlers — and this module is its second
//! driver: it calls the dispatcher at the simulated instants a server would
//! (arrival, first token, end, ticks, KV events, peers' batches) and carries
//! out the [`Effects`] it returns (start a request on its engine, fail one
//! that can go nowhere, deliver replica events to peers). Nothing here books,
//! frees, publishes or admits on its own.
//!
//! Events, each at a simulated instant (ties in scheduling order):
//!
//! - **arrival** — a turn of a session arrives; a load balancer hands it to
//!   one router replica (one, unless [`FleetConfig::replicas`] says more);
//!   its prompt is expanded and hashed exactly as the router would and
//!   submitted to that replica's dispatcher;
//! - **step done** — an engine step launched earlier completes: its tokens
//!   reach the clients (a first token and a last one are reported to the
//!   replica that routed the request), its KV events leave for the routers,
//!   and the engine launches its next step;
//! - **KV delivery** — KV events reach every replica after
//!   `kv_event_delay_ms`, as they would over the network, normalized by the
//!   router's own normalizer ([`crate::engine_events`]);
//! - **tick** — a replica's dispatcher asked to be woken
//!   ([`Dispatcher::next_wakeup_ms`]: admission rechecks and reconciles, the
//!   expiry sweep), as the server's ticker does;
//! - **replica sync** — a replica's published events and session bindings
//!   reach its peers `sync_delay_ms` later, and they apply them as a
//!   peer's batch (see [`crate::replicas`]).
//!
//! - **transfer** — with [`FleetConfig::disagg`] (or
//!   [`FleetConfig::peer_restore`]), a worker's captured KV reaches the
//!   worker a request was placed on, a latency plus the size of what that
//!   worker lacks over the link's bandwidth after the placement.
//!
//! Disaggregated fleets ([`DisaggConfig`]): the first `prefill_workers`
//! workers compute prompts (each request with one output token, as vLLM's
//! disaggregated proxy sends it), the rest decode. The dispatcher
//! sequences the halves, as for `serve --disagg vllm`
//! (`Dispatcher::submit_split` with `Pairing::AfterPrefill`): when a
//! prefill ends, its engine captures the prompt's KV under a lease and the
//! dispatcher, told the prefill handed over, ends the prefill's booking and
//! places the decode half on a decode worker; the decode engine restores
//! the transferred blocks through the restore protocol (source
//! `Rendezvous`) and computes the last prompt token and the output. The time to first token is the client's: from arrival to
//! the decode worker's first token (the prefill's own token is not
//! returned). The lease is released when the decode engine says it is done
//! with it, or expires.
//!
//! Peer restore ([`FleetConfig::peer_restore`]) uses the same path in an
//! aggregated fleet: when the `ttft` policy's decision names a holder of
//! the prompt's prefix, the holder captures it and the chosen worker
//! restores it after the transfer.
//!
//! A session's next turn arrives a think time (or the turn's own pause)
//! after its previous turn ends. A turn may spawn sessions (an agent's
//! sub-agents): they arrive when its answer ends, and the session's next
//! turn waits until every one of them has ended (completed, failed or
//! shed), then its pause.
//! Nothing reads a clock and every random choice is seeded: a run is a pure
//! function of its configuration and workload.
//!
//! Files, by role: `config.rs` what a run is configured with; `event.rs`
//! the event queue's entries; this file the fleet's state and the event
//! loop; `arrival.rs` a turn's way onto an engine; `steps.rs` the engines'
//! steps and what they carry back; `disagg.rs` disaggregated requests and
//! lent prefixes, their transfers and leases; `dp.rs` workers of several
//! data-parallel ranks (each rank an engine; rank-aware targets, or one
//! rank-blind target per worker and the worker's own balancer);
//! `replica_sync.rs` what the
//! router replicas publish to each other; `bursts.rs` whether each burst
//! of spawned sessions computed its shared prefix once; `failures.rs`
//! workers going down and up, and what becomes of their requests;
//! `chain.rs` Responses chains (a turn goes where its previous response is
//! stored); `outcome.rs` the figures; the tests in `tests.rs`,
//! `admission_tests.rs`, `replica_tests.rs`, `dp_tests.rs`,
//! `failure_tests.rs` and `chain_tests.rs`.

#[cfg(test)]
mod admission_tests;
mod arrival;
mod bursts;
mod chain;
#[cfg(test)]
mod chain_tests;
mod config;
mod disagg;
mod dp;
#[cfg(test)]
mod dp_tests;
mod event;
#[cfg(test)]
mod failure_tests;
mod failures;
mod outcome;
mod replica_sync;
#[cfg(test)]
mod replica_tests;
mod steps;
#[cfg(test)]
mod tests;

pub use crate::report::DpFigures;
pub use config::{DisaggConfig, FleetConfig, TransferConfig};
pub use dp::{DpConfig, DpRouting, RankBalancer, MAX_DP_SIZE, STATS_INTERVAL_MS};
pub use failures::WorkerFailure;

use crate::engine_events::EngineEventStream;
use crate::replicas::{Balancer, ReplicaStats};
use crate::report::{LoadTimeline, PolicyReport};
use crate::trace::TraceError;
use crate::workload::{Session, SessionStream};
use disagg::Handoff;
use event::{At, Event, Scheduled};
use rustc_hash::FxHashMap;
use serde::Serialize;
use std::collections::{BinaryHeap, VecDeque};
use switchyard_core::admission::{AdmissionStrategy, ProgressUpdater, SessionAwareStrategy};
use switchyard_core::dispatch::{Dispatcher, DispatcherConfigError, Effects};
use switchyard_core::router::WorkerCapacity;
use switchyard_core::{ReplicaId, RequestId, WorkerId};
use switchyard_engine::{Engine, KvEvent, Observation, StepReport, SyncDevice};

/// A simulation that could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The workload could not be read.
    #[error(transparent)]
    Trace(#[from] TraceError),
    /// A routing setting is invalid.
    #[error("router: {0}")]
    Dispatcher(#[from] DispatcherConfigError),
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
    /// A disaggregation setting is invalid.
    #[error("disaggregation: {0}")]
    Disagg(String),
    /// A data-parallel setting is invalid.
    #[error("data-parallel ranks: {0}")]
    Dp(String),
    /// A worker failure cannot be simulated as configured.
    #[error("worker failures: {0}")]
    Failures(String),
    /// Responses chains cannot be simulated as configured.
    #[error("responses chains: {0}")]
    Chains(String),
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
    /// Every request admission shed, in the order it was shed (empty
    /// unless a band is sheddable or deadlines are refused). A shed turn
    /// ends its session, as a refused one does, but is not an error.
    /// Not serialized: reports count it per tenant as they need.
    #[serde(skip)]
    pub shed: Vec<ShedRequest>,
}

struct InFlight {
    session: u64,
    turn: usize,
    arrival_ms: f64,
    prompt_tokens: u32,
    predicted_tokens: u64,
    first_token_ms: Option<f64>,
    last_token_ms: f64,
    /// This step's share of the time since the previous token, per token
    /// (speculative decoding emits several tokens in one step).
    itl_share_ms: f64,
    worker: usize,
    replica: usize,
    progress: Option<ProgressUpdater>,
    phase: Phase,
    /// Its tenant and band.
    flow: switchyard_core::admission::Flow,
    /// Tokens streamed to the client, over all its placements.
    generated: u32,
    /// Of them, those streamed before this placement (a resumed stream's).
    generated_before: u32,
    /// This placement's first token reached its replica (a resumed
    /// stream's first token was the client's long before).
    placement_started: bool,
}

/// A stream resumed after its worker failed: what the client had.
#[derive(Clone, Copy, Debug)]
struct Resumed {
    first_token_ms: f64,
    last_token_ms: f64,
    generated: u32,
}

/// A session waiting for the sessions one of its turns spawned.
struct Waiting {
    /// Spawned sessions not yet ended.
    children: usize,
    /// The turn that follows them.
    next_turn: usize,
    /// The pause between the last of them ending and that turn.
    pause_ms: f64,
}

/// Which part of a request a worker is running.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// All of it (an aggregated fleet).
    Whole,
    /// The prompt, on a prefill worker; the output follows on a decode one.
    Prefill,
    /// The output, on a decode worker, after a prefill elsewhere.
    Decode,
}

/// A submitted request waiting for placement: the driver owns its payload
/// (the dispatcher holds only hashes and lengths).
#[derive(Clone)]
struct Payload {
    session: u64,
    turn: usize,
    arrival_ms: f64,
    tokens: Vec<u32>,
    output_tokens: u32,
    /// Its tenant and band as the dispatcher resolved them.
    flow: switchyard_core::admission::Flow,
    /// A stream resumed after a worker failure (`None`: a request as it
    /// came).
    resumed: Option<Resumed>,
}

/// A request admission shed (it ended without a worker): what a report
/// counts per tenant and band.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ShedRequest {
    /// Its session.
    pub session: u64,
    /// Its turn within the session.
    pub turn: usize,
    /// Its tenant.
    pub tenant: switchyard_core::admission::TenantId,
    /// Its band.
    pub band: switchyard_core::admission::Band,
    /// Why it was shed.
    pub reason: switchyard_core::admission::ShedReason,
    /// When it arrived (ms).
    pub arrival_ms: f64,
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
    /// The router's normalizer for this engine's event stream.
    events: EngineEventStream,
    /// Its LoRA adapters.
    adapters: crate::adapters::EngineAdapters,
    /// Failed and not back ([`FleetConfig::failures`]).
    down: bool,
    /// Engines this worker has had before its current one: a step of an
    /// earlier one never ends.
    epoch: u64,
}

/// One router replica: one dispatcher, as one `switchyard serve` process
/// holds it.
struct Replica {
    id: ReplicaId,
    dispatcher: Dispatcher,
    /// Which worker holds each stored response this replica routed
    /// ([`FleetConfig::responses_chain`]).
    responses: switchyard_core::admission::responses::ResponseAffinity,
    tick_at: Option<f64>,
    routed: u64,
}

/// Runs one simulation to completion.
pub fn simulate(
    config: &FleetConfig,
    workload: SessionStream,
    mut progress: impl FnMut(u64),
) -> Result<SimOutcome, SimError> {
    Simulation::new(config, workload)?.run(&mut progress, |_| {})
}

/// A worker's engine.
fn new_engine(config: &FleetConfig) -> Result<Engine<SyncDevice>, SimError> {
    Engine::new(
        config.engine.clone(),
        SyncDevice::new(config.engine.timing.clone()),
    )
    .map_err(|e| SimError::Engine(e.to_string()))
}

/// The router's normalizer for an engine's event stream.
fn event_stream(config: &FleetConfig) -> EngineEventStream {
    let block_size = config.engine.block_size as u32;
    if config.attention_only_routing {
        EngineEventStream::attention_only(block_size)
    } else {
        EngineEventStream::new(block_size)
    }
}

struct Simulation {
    config: FleetConfig,
    replicas: Vec<Replica>,
    balancer: Balancer,
    /// The replica of each multi-turn session, with session-aware admission.
    session_replica: FxHashMap<u64, usize>,
    /// One per engine: one per worker, or with data-parallel ranks one per
    /// (worker, rank), worker-major.
    workers: Vec<WorkerState>,
    /// The engine of each router target (a rank-blind worker's first rank).
    by_worker_id: FxHashMap<WorkerId, usize>,
    /// Data-parallel ranks (`None`: one engine per worker).
    dp: Option<dp::DpState>,
    heap: BinaryHeap<Scheduled>,
    seq: u64,
    now: f64,
    workload: SessionStream,
    lookahead: Option<Session>,
    sessions: FxHashMap<u64, Session>,
    /// Sessions whose next turn waits for the sessions a turn spawned.
    waiting: FxHashMap<u64, Waiting>,
    /// The session that spawned each running spawned session.
    parent_of: FxHashMap<u64, u64>,
    /// Fan-out bursts and what their first calls found cached.
    bursts: bursts::Bursts,
    in_flight: FxHashMap<RequestId, InFlight>,
    payloads: FxHashMap<RequestId, Payload>,
    /// Effects still to carry out, with the replica that produced them.
    effects: VecDeque<(usize, Effects)>,
    kv_scratch: Vec<KvEvent>,
    /// Disaggregated requests between or during their halves.
    handoffs: FxHashMap<RequestId, Handoff>,
    observations: Vec<Observation>,
    transfers: u64,
    transfer_bytes: u64,
    /// Decode halves that computed their prompt instead (no capture, or
    /// the lease gone before the transfer).
    transfer_fallbacks: u64,
    /// The adapter popularity's CDF (empty without adapters).
    adapter_cdf: Vec<f64>,
    adapter_figures: crate::adapters::AdapterFigures,
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
    shed: Vec<ShedRequest>,
    sessions_completed: u64,
    first_arrival: Option<f64>,
    last_completion: f64,
    timeline: LoadTimeline,
    view_error_sum: f64,
    excess_sum: f64,
    decisions: u64,
    /// Samples per tenant, by tenant index (the flow policy bounds them).
    tenants: Vec<crate::report::TenantTally>,
    /// The failures of requests that failed and are not over (bounded by
    /// the requests in flight and waiting).
    failure_histories: FxHashMap<RequestId, switchyard_core::dispatch::failure::FailureHistory>,
    failure_figures: crate::report::FailureFigures,
    /// Booking ids handed out to migrations.
    next_booking: u128,
    /// Responses chains: turns whose previous response no worker holds.
    chain_broken: u64,
    /// Responses chains: the engine (its worker's epoch) that stored each
    /// session's latest response; a worker that failed since lost it.
    chain_epochs: FxHashMap<u64, u64>,
}

impl Simulation {
    fn new(config: &FleetConfig, workload: SessionStream) -> Result<Self, SimError> {
        if config.workers == 0 {
            return Err(SimError::NoWorkers);
        }
        config.replicas.validate()?;
        if let Some(disagg) = &config.disagg {
            disagg.validate(config.workers).map_err(SimError::Disagg)?;
        }
        if let Some(link) = config.peer_restore {
            link.validate().map_err(SimError::Disagg)?;
        }
        if let Some(mix) = &config.adapters {
            mix.validate().map_err(SimError::Disagg)?;
        }
        if let Some(dp) = &config.dp {
            dp.validate().map_err(SimError::Dp)?;
            if config.disagg.is_some() || config.peer_restore.is_some() {
                return Err(SimError::Dp(
                    "data-parallel ranks are not modelled with disaggregation or peer restore"
                        .to_owned(),
                ));
            }
        }
        failures::check(config)?;
        chain::check(config)?;
        let config = config.clone();
        let ranks = config.dp.map_or(1, |dp| dp.size);
        let engines = config.workers * ranks;
        let mut workers = Vec::with_capacity(engines);
        let mut by_worker_id = FxHashMap::default();
        for i in 0..engines {
            let id = dp::router_id(i, config.dp);
            let engine = new_engine(&config)?;
            by_worker_id.entry(id).or_insert(i);
            workers.push(WorkerState {
                id,
                engine,
                busy: false,
                pending: StepReport::default(),
                served_tokens: 0,
                booked: 0,
                events: event_stream(&config),
                adapters: crate::adapters::EngineAdapters::new(
                    config.adapters.map_or(1, |mix| mix.max_loras),
                ),
                down: false,
                epoch: 0,
            });
        }
        // A rank-blind router sees a worker's ranks as one engine of their
        // pooled capacity.
        let pooled = match config.dp {
            Some(DpConfig {
                size,
                routing: DpRouting::Blind,
            }) => size as u64,
            _ => 1,
        };
        let capacity = WorkerCapacity {
            max_num_batched_tokens: Some(config.engine.max_num_batched_tokens as u64 * pooled),
            kv_blocks: Some(config.engine.num_blocks as u64 * pooled),
            kv_tokens: Some((config.engine.num_blocks * config.engine.block_size) as u64 * pooled),
            block_size: None,
        };
        let mut replicas = Vec::with_capacity(config.replicas.count);
        for r in 0..config.replicas.count {
            let strategy = match config.session_aware {
                Some(session) => Some(Box::new(
                    SessionAwareStrategy::new(session)
                        .map_err(|e| SimError::Admission(e.to_string()))?,
                ) as Box<dyn AdmissionStrategy + Send>),
                None => None,
            };
            let mut dispatcher = Dispatcher::new(config.dispatcher(r), strategy)?;
            let id = ReplicaId(r as u64 + 1);
            if config.replicas.shares_bookings() {
                dispatcher.set_replica(id);
            }
            // One target per rank, or per rank-blind worker.
            let targets = workers
                .iter()
                .enumerate()
                .filter(|&(i, w)| by_worker_id[&w.id] == i)
                .map(|(_, w)| w);
            for w in targets {
                // Nothing waits yet: adding a worker places nothing.
                let _ = dispatcher.add_worker(w.id, capacity, 0.0);
                if let Some(mix) = &config.adapters {
                    dispatcher
                        .adapters_mut()
                        .set_slots(w.id, Some(mix.max_loras));
                }
            }
            replicas.push(Replica {
                id,
                dispatcher,
                responses: chain::table(),
                tick_at: None,
                routed: 0,
            });
        }
        let timeline = LoadTimeline::new(engines, config.timeline_bucket_ms.max(1.0));
        let dp = config.dp.map(|c| dp::DpState::new(c, config.workers));
        let adapter_cdf = config.adapters.map(|m| m.cdf()).unwrap_or_default();
        Ok(Self {
            balancer: Balancer::new(&config.replicas, config.router.seed),
            session_replica: FxHashMap::default(),
            replicas,
            config,
            workers,
            by_worker_id,
            dp,
            heap: BinaryHeap::new(),
            seq: 0,
            now: 0.0,
            workload,
            lookahead: None,
            sessions: FxHashMap::default(),
            waiting: FxHashMap::default(),
            parent_of: FxHashMap::default(),
            bursts: bursts::Bursts::default(),
            in_flight: FxHashMap::default(),
            payloads: FxHashMap::default(),
            effects: VecDeque::new(),
            kv_scratch: Vec::new(),
            handoffs: FxHashMap::default(),
            observations: Vec::new(),
            transfers: 0,
            transfer_bytes: 0,
            transfer_fallbacks: 0,
            adapter_cdf,
            adapter_figures: Default::default(),
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
            shed: Vec::new(),
            sessions_completed: 0,
            first_arrival: None,
            last_completion: 0.0,
            timeline,
            view_error_sum: 0.0,
            excess_sum: 0.0,
            tenants: Vec::new(),
            decisions: 0,
            failure_histories: FxHashMap::default(),
            failure_figures: Default::default(),
            next_booking: 0,
            chain_broken: 0,
            chain_epochs: FxHashMap::default(),
        })
    }

    /// A new engine as every worker's.
    fn fresh_engine(&self) -> Result<Engine<SyncDevice>, SimError> {
        new_engine(&self.config)
    }

    /// The router's normalizer for a new engine's events.
    fn event_stream(&self) -> EngineEventStream {
        event_stream(&self.config)
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
        mut after_event: impl FnMut(&Simulation),
    ) -> Result<SimOutcome, SimError> {
        self.schedule_failures();
        self.pull_next_session()?;
        while let Some(Scheduled { at, event, .. }) = self.heap.pop() {
            self.now = at.0;
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
                Event::StepDone { worker, epoch } => {
                    // A step of an engine that died never ends.
                    if epoch == self.workers[worker].epoch {
                        self.finish_step(worker, progress);
                    }
                }
                Event::WorkerDown { worker } => self.worker_down(worker)?,
                Event::WorkerUp { worker } => self.worker_up(worker),
                Event::Tick { replica } => {
                    self.replicas[replica].tick_at = None;
                    let fx = self.replicas[replica].dispatcher.tick(self.now);
                    self.carry_out(replica, fx);
                }
                Event::KvDelivery { worker, events } => {
                    let id = self.workers[worker].id;
                    for replica in &mut self.replicas {
                        for (tier, e) in &events {
                            replica.dispatcher.apply_kv_event(id, *tier, e);
                        }
                    }
                }
                Event::ReplicaSync {
                    origin,
                    events,
                    bindings,
                } => self.apply_on_peers(origin, events, bindings),
                Event::AdapterReady {
                    worker,
                    replica,
                    session,
                    request,
                } => {
                    let id = request.id;
                    // Still there (its worker may have failed meanwhile).
                    if self.in_flight.get(&id).is_some_and(|r| r.worker == worker) {
                        if self.workers[worker].engine.add_request(request).is_ok() {
                            self.kick(worker);
                        } else {
                            self.in_flight.remove(&id);
                            self.workers[worker].booked =
                                self.workers[worker].booked.saturating_sub(1);
                            let fx = self.replicas[replica].dispatcher.abort(id, self.now);
                            self.carry_out(replica, fx);
                            self.fail(session);
                        }
                    }
                }
                Event::Transfer {
                    worker,
                    request,
                    kv,
                } => {
                    // The request may have gone meanwhile: then the lease
                    // was already given back through its `RendezvousDone`.
                    if self.workers[worker]
                        .engine
                        .deliver_rendezvous(request, kv)
                        .is_ok()
                    {
                        self.kick(worker);
                    }
                }
            }
            self.schedule_ticks();
            self.track_rank_idleness();
            after_event(&self);
        }
        Ok(self.outcome())
    }

    /// Asks for a tick of every replica at its dispatcher's next wake-up,
    /// while there is work left (a tick after the last request would keep
    /// an idle fleet ticking for ever).
    fn schedule_ticks(&mut self) {
        let busy = !self.payloads.is_empty()
            || !self.in_flight.is_empty()
            || !self.sessions.is_empty()
            || self.lookahead.is_some();
        if !busy {
            return;
        }
        for replica in 0..self.replicas.len() {
            let r = &mut self.replicas[replica];
            // As the server's ticker: at least 1 ms ahead.
            let at = r.dispatcher.next_wakeup_ms().max(self.now + 1.0);
            if r.tick_at.is_none_or(|t| at < t) {
                r.tick_at = Some(at);
                self.schedule(at, Event::Tick { replica });
            }
        }
    }

    /// The samples of `session`'s tenant (the default tenant's once the
    /// session is gone).
    fn tally(&mut self, session: u64) -> &mut crate::report::TenantTally {
        let tenant = self
            .sessions
            .get(&session)
            .map_or(0, |s| usize::from(s.flow.tenant.0));
        if self.tenants.len() <= tenant {
            self.tenants.resize_with(tenant + 1, Default::default);
        }
        &mut self.tenants[tenant]
    }

    fn fail(&mut self, session: u64) {
        self.tally(session).errors += 1;
        self.errors += 1;
        self.end_session(session);
    }

    /// Forgets a session that will send no further turn; a parent waiting
    /// for it as its last spawned session sends its next turn after its
    /// pause (unless it ended meanwhile).
    fn end_session(&mut self, session: u64) {
        self.sessions.remove(&session);
        self.chain_epochs.remove(&session);
        self.bursts.forget(session);
        self.session_replica.remove(&session);
        self.waiting.remove(&session);
        let Some(parent) = self.parent_of.remove(&session) else {
            return;
        };
        let Some(wait) = self.waiting.get_mut(&parent) else {
            return;
        };
        wait.children -= 1;
        if wait.children == 0 {
            let wait = self.waiting.remove(&parent).expect("just seen");
            self.schedule(
                self.now + wait.pause_ms,
                Event::Turn {
                    session: parent,
                    turn: wait.next_turn,
                },
            );
        }
    }

    /// A request admission shed: recorded, and its session ends (the
    /// simulated client does not retry).
    fn shed(
        &mut self,
        id: switchyard_core::RequestId,
        reason: switchyard_core::admission::ShedReason,
    ) {
        let Some(p) = self.payloads.remove(&id) else {
            return;
        };
        self.shed.push(ShedRequest {
            session: p.session,
            turn: p.turn,
            tenant: p.flow.tenant,
            band: p.flow.band,
            reason,
            arrival_ms: p.arrival_ms,
        });
        self.tally(p.session).shed += 1;
        self.end_session(p.session);
    }
}
