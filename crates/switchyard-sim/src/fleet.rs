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
//! disaggregated proxy sends it), the rest decode. When a prefill ends, its
//! engine captures the prompt's KV under a lease, the prefill's booking
//! ends, and the request is submitted again, to the decode workers only;
//! the decode engine restores the transferred blocks through the restore
//! protocol (source `Rendezvous`) and computes the last prompt token and
//! the output. The time to first token is the client's: from arrival to
//! the decode worker's first token (the prefill's own token is not
//! returned). The lease is released when the decode engine says it is done
//! with it, or expires.
//!
//! Peer restore ([`FleetConfig::peer_restore`]) uses the same path in an
//! aggregated fleet: when the `ttft` policy's decision names a holder of
//! the prompt's prefix, the holder captures it and the chosen worker
//! restores it after the transfer.
//!
//! A session's next turn arrives a think time after its previous turn ends.
//! Nothing reads a clock and every random choice is seeded: a run is a pure
//! function of its configuration and workload.

use crate::engine_events::EngineEventStream;
use crate::replicas::{replica_seed, Balancer, ReplicaStats, ReplicasConfig};
use crate::report::{
    coefficient_of_variation, Latency, LoadTimeline, PolicyReport, SpecFigures, SsmFigures,
};
use crate::trace::TraceError;
use crate::workload::{Session, SessionStream};
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::collections::{BinaryHeap, VecDeque};
use std::sync::Arc;
use switchyard_core::admission::{
    AdmissionConfig, AdmissionStrategy, ProgressUpdater, SessionAwareConfig, SessionAwareStrategy,
    SessionKey,
};
use switchyard_core::dispatch::{
    Dispatch, Dispatcher, DispatcherConfig, DispatcherConfigError, Effects, Published,
    SessionBound, Submission,
};
use switchyard_core::estimate::{EstimatorConfig, PeerTransferModel};
use switchyard_core::hashing::{local_block_hashes, seed_for};
use switchyard_core::index::{CacheTier, IndexEvent};
use switchyard_core::router::{RouterConfig, WorkerCapacity};
use switchyard_core::{ReplicaId, RequestId, WorkerId};
use switchyard_engine::lease::{LeaseRef, LeasedKv};
use switchyard_engine::{
    Engine, EngineConfig, KvEvent, NewRequest, Observation, StepReport, SyncDevice,
};

/// The bit that marks a request id as the decode half of a disaggregated
/// request (the top bit is the router's, for peers' bookings).
const DECODE_BIT: u128 = 1 << 126;

/// Prefill/decode disaggregation of a fleet.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DisaggConfig {
    /// Workers `0..prefill_workers` prefill; the rest decode.
    pub prefill_workers: usize,
    /// The link KV moves over.
    pub transfer: TransferConfig,
    /// How long a captured prefix is held for its decode worker
    /// (simulated ms); a lease not released by then expires.
    pub lease_ttl_ms: f64,
}

impl Default for DisaggConfig {
    fn default() -> Self {
        Self {
            prefill_workers: 1,
            transfer: TransferConfig::default(),
            lease_ttl_ms: 60_000.0,
        }
    }
}

/// The link between workers: a transfer of `b` bytes takes `latency_ms +
/// b / bandwidth` model milliseconds (divided by the engines' speed-up in
/// wall time, as their steps are).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransferConfig {
    /// Bytes per second. Default 25 GB/s: the line rate of one 200 Gb/s
    /// RDMA NIC (an assumption about the hardware, not a measurement).
    pub bandwidth_bytes_per_s: f64,
    /// Fixed cost per transfer, in ms. Default 1 ms: an assumption for the
    /// handshake and the completion notice, not a measurement.
    pub latency_ms: f64,
}

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            bandwidth_bytes_per_s: 25e9,
            latency_ms: 1.0,
        }
    }
}

impl TransferConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.bandwidth_bytes_per_s.is_finite() && self.bandwidth_bytes_per_s > 0.0) {
            return Err(format!(
                "transfer bandwidth must be > 0 bytes/s, got {}",
                self.bandwidth_bytes_per_s
            ));
        }
        if !(self.latency_ms.is_finite() && self.latency_ms >= 0.0) {
            return Err(format!(
                "transfer latency must be >= 0 ms, got {}",
                self.latency_ms
            ));
        }
        Ok(())
    }

    /// Model milliseconds to move `bytes`.
    pub fn transfer_ms(&self, bytes: u64) -> f64 {
        self.latency_ms + bytes as f64 / self.bandwidth_bytes_per_s * 1e3
    }
}

impl DisaggConfig {
    /// Checks it against a fleet of `workers`.
    pub fn validate(&self, workers: usize) -> Result<(), String> {
        if self.prefill_workers == 0 || self.prefill_workers >= workers {
            return Err(format!(
                "{} prefill workers in a fleet of {workers}: at least one of each role is needed",
                self.prefill_workers
            ));
        }
        self.transfer.validate()?;
        if !(self.lease_ttl_ms.is_finite() && self.lease_ttl_ms > 0.0) {
            return Err(format!(
                "the lease ttl must be > 0 ms, got {}",
                self.lease_ttl_ms
            ));
        }
        Ok(())
    }
}

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
    /// Fit each worker's prefill-duration hints online from observed times
    /// to first token, as `serve` does (the model itself is always the
    /// engines' timing model).
    pub online_prefill_fit: bool,
    /// Width of the per-worker load timeline buckets.
    pub timeline_bucket_ms: f64,
    /// The policy queue.
    pub admission: AdmissionConfig,
    /// Session-aware admission (multi-turn sessions); `None`: no strategy.
    pub session_aware: Option<SessionAwareConfig>,
    /// Router replicas, their sync and the load balancer in front of them.
    pub replicas: ReplicasConfig,
    /// Prefill/decode disaggregation; `None`: every worker does both.
    pub disagg: Option<DisaggConfig>,
    /// Peer prefix restore in an aggregated fleet, over this link: the
    /// `ttft` policy may place a request on a worker together with a
    /// restore of the prompt's longest cached prefix from the worker
    /// holding it, when the transfer and the rest beat waiting (the
    /// router's estimator gets the same link). `None`: off.
    pub peer_restore: Option<TransferConfig>,
    /// With hybrid engines: the routers skip the engines' SSM-checkpoint
    /// events and credit each worker's whole attention prefix, as a router
    /// that does not know hybrid models does. `false`: they credit a
    /// hybrid worker only up to its deepest checkpoint.
    pub attention_only_routing: bool,
    /// LoRA adapters: each session asks for one of a mix, each engine
    /// holds a few ([`crate::adapters`]); `None`: base model only. The
    /// routers' adapter affinity is `router.adapters` (`blind` for
    /// adapter-blind routing).
    pub adapters: Option<crate::adapters::AdapterMix>,
}

impl Default for FleetConfig {
    fn default() -> Self {
        Self {
            workers: 8,
            engine: EngineConfig::default(),
            router: RouterConfig::default(),
            kv_event_delay_ms: 10.0,
            online_prefill_fit: false,
            timeline_bucket_ms: 10_000.0,
            admission: AdmissionConfig::default(),
            session_aware: None,
            replicas: ReplicasConfig::default(),
            disagg: None,
            peer_restore: None,
            attention_only_routing: false,
            adapters: None,
        }
    }
}

impl FleetConfig {
    /// The dispatcher settings of replica `index`: the router with the
    /// engine's block size and the replica's seed, and prefill hints from
    /// the engines' own timing model (their prefill polynomial, batch
    /// budget, host-tier restore cost and speed-up).
    pub fn dispatcher(&self, index: usize) -> DispatcherConfig {
        let mut router = RouterConfig {
            seed: replica_seed(self.router.seed, index),
            ..self.router
        };
        router.sequences.block_size = self.engine.block_size as u32;
        let timing = &self.engine.timing;
        if let Some(mix) = &self.adapters {
            // The routers price a load in wall ms, as everything else.
            router.adapters.load_ms = timing.wall_ms(mix.load_ms);
        }
        DispatcherConfig {
            router,
            admission: self.admission.clone(),
            estimator: EstimatorConfig {
                prefill_curve: timing.prefill,
                decode_curve: timing.decode,
                decode_floor_ms: timing.decode_floor_ms,
                chunk_tokens: self.engine.max_num_batched_tokens.max(1) as u32,
                restore_ms_per_token: timing.restore_ms_per_token(),
                speedup: timing.speedup,
                online: self.online_prefill_fit,
                peer_transfer: self.peer_restore.map(|t| PeerTransferModel {
                    latency_ms: t.latency_ms,
                    ms_per_token: timing.bytes_per_token as f64 / t.bandwidth_bytes_per_s * 1e3,
                }),
                ..EstimatorConfig::default()
            },
            ..DispatcherConfig::default()
        }
    }
}

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
        events: Vec<(CacheTier, IndexEvent)>,
    },
    /// A replica's dispatcher asked to be ticked.
    Tick { replica: usize },
    /// A replica's published events reach its peers.
    ReplicaSync {
        origin: usize,
        events: Vec<Published>,
        bindings: Vec<SessionBound>,
    },
    /// A LoRA adapter is loaded: its request may start.
    AdapterReady {
        worker: usize,
        replica: usize,
        session: u64,
        request: NewRequest,
    },
    /// A captured prefix reaches the decode worker of `request`.
    Transfer {
        worker: usize,
        request: RequestId,
        kv: LeasedKv,
    },
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
    /// This step's share of the time since the previous token, per token
    /// (speculative decoding emits several tokens in one step).
    itl_share_ms: f64,
    worker: usize,
    replica: usize,
    progress: Option<ProgressUpdater>,
    phase: Phase,
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
struct Payload {
    session: u64,
    turn: usize,
    arrival_ms: f64,
    tokens: Vec<u32>,
    output_tokens: u32,
}

/// A disaggregated request between its halves: the prompt again (its
/// engine consumed it) and, once captured, where its KV is held.
struct Handoff {
    tokens: Vec<u32>,
    output_tokens: u32,
    /// The prefill worker and its lease, once captured.
    lease: Option<(usize, LeaseRef)>,
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
}

/// One router replica: one dispatcher, as one `switchyard serve` process
/// holds it.
struct Replica {
    id: ReplicaId,
    dispatcher: Dispatcher,
    tick_at: Option<f64>,
    routed: u64,
}

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
    sessions_completed: u64,
    first_arrival: Option<f64>,
    last_completion: f64,
    timeline: LoadTimeline,
    view_error_sum: f64,
    excess_sum: f64,
    decisions: u64,
}

impl Fleet {
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
        let config = config.clone();
        let block_size = config.engine.block_size as u32;
        let mut workers = Vec::with_capacity(config.workers);
        let mut by_worker_id = FxHashMap::default();
        for i in 0..config.workers {
            let id = WorkerId::new(i as u64);
            let engine = Engine::new(
                config.engine.clone(),
                SyncDevice::new(config.engine.timing.clone()),
            )
            .map_err(|e| SimError::Engine(e.to_string()))?;
            by_worker_id.insert(id, i);
            workers.push(WorkerState {
                id,
                engine,
                busy: false,
                pending: StepReport::default(),
                served_tokens: 0,
                booked: 0,
                events: if config.attention_only_routing {
                    EngineEventStream::attention_only(block_size)
                } else {
                    EngineEventStream::new(block_size)
                },
                adapters: Default::default(),
            });
        }
        let capacity = WorkerCapacity {
            max_num_batched_tokens: Some(config.engine.max_num_batched_tokens as u64),
            kv_blocks: Some(config.engine.num_blocks as u64),
            kv_tokens: Some((config.engine.num_blocks * config.engine.block_size) as u64),
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
            for w in &workers {
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
                tick_at: None,
                routed: 0,
            });
        }
        let timeline = LoadTimeline::new(config.workers, config.timeline_bucket_ms.max(1.0));
        let adapter_cdf = config.adapters.map(|m| m.cdf()).unwrap_or_default();
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
            sessions_completed: 0,
            first_arrival: None,
            last_completion: 0.0,
            timeline,
            view_error_sum: 0.0,
            excess_sum: 0.0,
            decisions: 0,
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
                Event::StepDone { worker } => self.finish_step(worker, progress),
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
                    if self.in_flight.contains_key(&id) {
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

    /// The LoRA adapter `session`'s requests run under (`None`: the base
    /// model, always without adapters).
    fn lora_of(&self, session: u64) -> Option<Arc<str>> {
        let mix = self.config.adapters?;
        let k = mix.adapter_of(&self.adapter_cdf, session);
        Some(crate::adapters::adapter_name(k).into())
    }

    fn arrive(&mut self, session: u64, turn: usize) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        let multi_turn = s.turns.len() > 1;
        let spec = &s.turns[turn];
        let output_tokens = spec.output_tokens;
        let tokens = spec.prompt.tokens();
        let lora = self.lora_of(session);
        // An adapter's KV is its own (vLLM hashes its blocks with the
        // adapter): the router hashes the prompt with the adapter's seed,
        // as `serve` does, and so does the engine (`NewRequest::hash_seed`),
        // whose events name the adapter for the router's normalizer.
        let blocks = local_block_hashes(
            &tokens,
            self.config.engine.block_size,
            seed_for(lora.as_deref(), None),
        );
        let adapter = lora.as_deref().map(Box::from);
        let id = Self::request_id(session, turn);
        let replica = self.pick_replica(session, multi_turn);
        let submission = Submission {
            blocks,
            prompt_tokens: tokens.len() as u32,
            session: multi_turn.then_some(SessionKey(session)),
            eligible: self.role_pool(false),
            adapter,
            ..Submission::default()
        };
        self.payloads.insert(
            id,
            Payload {
                session,
                turn,
                arrival_ms: self.now,
                tokens,
                output_tokens,
            },
        );
        match self.replicas[replica]
            .dispatcher
            .submit(id, submission, self.now)
        {
            Ok((_, fx)) => self.carry_out(replica, fx),
            Err(_) => {
                self.payloads.remove(&id);
                self.fail(session);
            }
        }
    }

    /// Carries out what a dispatcher asked for, and whatever that leads to
    /// (a peer's dispatches at sync delay 0, an engine refusal's free), in
    /// order.
    fn carry_out(&mut self, replica: usize, fx: Effects) {
        self.effects.push_back((replica, fx));
        while let Some((replica, fx)) = self.effects.pop_front() {
            let Effects {
                dispatch,
                no_worker,
                publish,
                bindings,
                ..
            } = fx;
            if !publish.is_empty() || !bindings.is_empty() {
                self.publish(replica, publish, bindings);
            }
            for sent in dispatch {
                self.start(replica, sent);
            }
            for id in no_worker {
                self.drop_handoff(id);
                if let Some(p) = self.payloads.remove(&id) {
                    self.fail(p.session);
                }
            }
        }
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

    /// Sends `origin`'s published events to its peers: at once when the
    /// delay is zero, otherwise as one scheduled delivery.
    fn publish(&mut self, origin: usize, events: Vec<Published>, bindings: Vec<SessionBound>) {
        let delay = self.config.replicas.sync_delay_ms;
        if delay == 0.0 {
            self.apply_on_peers(origin, events, bindings);
        } else {
            self.schedule(
                self.now + delay,
                Event::ReplicaSync {
                    origin,
                    events,
                    bindings,
                },
            );
        }
    }

    fn apply_on_peers(
        &mut self,
        origin: usize,
        events: Vec<Published>,
        bindings: Vec<SessionBound>,
    ) {
        let from = self.replicas[origin].id;
        for r in 0..self.replicas.len() {
            if r == origin {
                continue;
            }
            let (_, fx) = self.replicas[r].dispatcher.apply_replica_batch(
                from,
                events.iter().map(|e| (from, e.event.clone())),
                bindings.iter().copied(),
                None,
                self.now,
            );
            self.effects.push_back((r, fx));
        }
    }

    /// Hands a dispatched (and booked) request to its engine.
    fn start(&mut self, replica: usize, sent: Dispatch) {
        let id = sent.id;
        let worker = self.by_worker_id[&sent.worker];
        // What the routing replica saw against the truth, at this decision.
        let seen = self.replicas[replica]
            .dispatcher
            .router()
            .sequences()
            .active_requests() as f64;
        let booked: u64 = self.workers.iter().map(|w| w.booked).sum::<u64>() + 1;
        self.view_error_sum += (seen - booked as f64).abs();
        let least = self.workers.iter().map(|w| w.booked).min().unwrap_or(0);
        self.excess_sum += (self.workers[worker].booked - least) as f64;
        self.decisions += 1;
        let Some(p) = self.payloads.remove(&id) else {
            self.drop_handoff(id);
            let fx = self.replicas[replica].dispatcher.abort(id, self.now);
            self.effects.push_back((replica, fx));
            return;
        };
        let prompt_tokens = p.tokens.len() as u32;
        let cached = (u64::from(sent.overlap_blocks) * self.config.engine.block_size as u64)
            .min(u64::from(prompt_tokens));
        let phase = match (&self.config.disagg, id.0 & DECODE_BIT != 0) {
            (None, _) => Phase::Whole,
            (Some(_), false) => Phase::Prefill,
            (Some(_), true) => Phase::Decode,
        };
        let lora = self.lora_of(p.session);
        let admitted = match phase {
            Phase::Whole => match sent.peer {
                Some(peer) => {
                    // Lent by its holder: captured there now, restored here
                    // once the transfer is in.
                    let holder = self.by_worker_id[&peer.holder];
                    let bs = self.config.engine.block_size;
                    let lent = (peer.blocks as usize * bs).min(p.tokens.len());
                    let ttl = DisaggConfig::default().lease_ttl_ms;
                    let lease = self.workers[holder]
                        .engine
                        .capture(
                            &p.tokens[..lent],
                            seed_for(lora.as_deref(), None),
                            id.0 ^ 0x5eed_5eed,
                            self.now + ttl,
                        )
                        .ok()
                        .map(|(lease, _)| (holder, lease));
                    self.handoffs.insert(
                        id,
                        Handoff {
                            tokens: Vec::new(),
                            output_tokens: p.output_tokens,
                            lease,
                        },
                    );
                    self.start_with_lease(worker, id, p.tokens, p.output_tokens, lora)
                }
                None => {
                    let request = NewRequest {
                        id,
                        prompt: p.tokens,
                        max_tokens: p.output_tokens,
                        hash_seed: seed_for(lora.as_deref(), None),
                        lora_name: lora,
                    };
                    match self.adapter_ready_at(worker, p.session, &sent) {
                        Some(at) if at > self.now => {
                            self.schedule(
                                at,
                                Event::AdapterReady {
                                    worker,
                                    replica,
                                    session: p.session,
                                    request,
                                },
                            );
                            Ok(())
                        }
                        _ => self.workers[worker].engine.add_request(request),
                    }
                }
            },
            Phase::Prefill => {
                // One output token, as a disaggregated proxy asks of a
                // prefill worker; the prompt is kept for the capture.
                self.handoffs.insert(
                    id,
                    Handoff {
                        tokens: p.tokens.clone(),
                        output_tokens: p.output_tokens,
                        lease: None,
                    },
                );
                self.workers[worker].engine.add_request(NewRequest {
                    id,
                    prompt: p.tokens,
                    max_tokens: 1,
                    hash_seed: seed_for(lora.as_deref(), None),
                    lora_name: lora,
                })
            }
            Phase::Decode => self.start_with_lease(worker, id, p.tokens, p.output_tokens, lora),
        };
        if admitted.is_err() {
            self.drop_handoff(id);
            let fx = self.replicas[replica].dispatcher.abort(id, self.now);
            self.effects.push_back((replica, fx));
            self.fail(p.session);
            return;
        }
        self.workers[worker].booked += 1;
        self.replicas[replica].routed += 1;
        self.queue.push(sent.waited_ms);
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
                itl_share_ms: 0.0,
                worker,
                replica,
                progress: sent.progress,
                phase,
            },
        );
        self.kick(worker);
    }

    /// When the adapter of `session`'s request can run on `worker` (`None`
    /// without adapters): now, or once a load under way or made now (the
    /// placement's, or the engine's own when the router did not ask for
    /// one) is done.
    fn adapter_ready_at(&mut self, worker: usize, session: u64, sent: &Dispatch) -> Option<f64> {
        let mix = self.config.adapters?;
        let name = crate::adapters::adapter_name(mix.adapter_of(&self.adapter_cdf, session));
        let unload = sent.adapter_load.as_ref().and_then(|l| l.unload.as_deref());
        let load_wall_ms = self.config.engine.timing.wall_ms(mix.load_ms);
        let (at, loaded) = self.workers[worker].adapters.acquire(
            &name,
            unload,
            mix.max_loras,
            load_wall_ms,
            self.now,
        );
        let figures = &mut self.adapter_figures;
        figures.requests += 1;
        figures.loads += u64::from(loaded);
        figures.waited += u64::from(at > self.now);
        Some(at)
    }

    /// The workers a new request may go to: with disaggregation, the
    /// prefill pool (or the decode pool, for `decode`); otherwise all
    /// (empty).
    fn role_pool(&self, decode: bool) -> Vec<WorkerId> {
        match &self.config.disagg {
            None => Vec::new(),
            Some(d) => {
                let range = if decode {
                    d.prefill_workers..self.workers.len()
                } else {
                    0..d.prefill_workers
                };
                self.workers[range].iter().map(|w| w.id).collect()
            }
        }
    }

    /// Queues `id` on `worker` restoring from the lease its handoff holds
    /// (its prefill worker's, or the peer lending it a prefix), whose
    /// blocks arrive after the transfer time; computing the prompt itself
    /// when there is no lease to read.
    fn start_with_lease(
        &mut self,
        worker: usize,
        id: RequestId,
        prompt: Vec<u32>,
        output_tokens: u32,
        lora: Option<Arc<str>>,
    ) -> Result<(), switchyard_engine::scheduler::AdmitError> {
        let request = NewRequest {
            id,
            prompt,
            max_tokens: output_tokens,
            hash_seed: seed_for(lora.as_deref(), None),
            lora_name: lora,
        };
        let lease = self.handoffs.get(&id).and_then(|h| h.lease);
        let read =
            lease.map(|(source, lease)| (lease, self.workers[source].engine.read_lease(lease)));
        match read {
            Some((lease, Ok(kv))) => {
                // Only the blocks this worker lacks cross the link.
                let own = self.workers[worker]
                    .engine
                    .cached_prefix_blocks(&request.prompt, request.hash_seed);
                let moved_tokens =
                    (kv.blocks().saturating_sub(own) * self.config.engine.block_size) as u64;
                self.workers[worker]
                    .engine
                    .add_rendezvous_request(request, lease)?;
                let bytes = moved_tokens.saturating_mul(self.config.engine.timing.bytes_per_token);
                let transfer = self
                    .config
                    .disagg
                    .map(|d| d.transfer)
                    .or(self.config.peer_restore)
                    .expect("a lease is taken only with a transfer link");
                let at = self.now
                    + self
                        .config
                        .engine
                        .timing
                        .wall_ms(transfer.transfer_ms(bytes));
                self.transfers += 1;
                self.transfer_bytes += bytes;
                self.schedule(
                    at,
                    Event::Transfer {
                        worker,
                        request: id,
                        kv,
                    },
                );
                Ok(())
            }
            _ => {
                // Nothing captured, or the lease is gone: compute it here.
                self.transfer_fallbacks += 1;
                self.drop_handoff(id);
                self.workers[worker].engine.add_request(request)
            }
        }
    }

    /// Forgets a handoff, releasing its lease (a decode half that will not
    /// restore from it).
    fn drop_handoff(&mut self, id: RequestId) {
        if let Some(Handoff {
            lease: Some((source, lease)),
            ..
        }) = self.handoffs.remove(&id)
        {
            let _ = self.workers[source].engine.release_lease(lease);
        }
    }

    /// The prefill half of `id` ended on `worker`: capture its prompt's KV
    /// and submit the decode half to the decode pool.
    fn hand_off(
        &mut self,
        worker: usize,
        id: RequestId,
        session: u64,
        turn: usize,
        arrival_ms: f64,
    ) {
        let Some(mut handoff) = self.handoffs.remove(&id) else {
            return;
        };
        let ttl = self.config.disagg.map_or(0.0, |d| d.lease_ttl_ms);
        // The secret would come from a CSPRNG in a real driver; the
        // simulator has no adversary and stays deterministic.
        let token = id.0 ^ 0x5eed_5eed_5eed_5eed;
        let seed = seed_for(self.lora_of(session).as_deref(), None);
        handoff.lease = self.workers[worker]
            .engine
            .capture(&handoff.tokens, seed, token, self.now + ttl)
            .ok()
            .map(|(lease, _)| (worker, lease));
        let decode = RequestId(id.0 | DECODE_BIT);
        let tokens = std::mem::take(&mut handoff.tokens);
        let blocks = local_block_hashes(&tokens, self.config.engine.block_size, seed);
        let submission = Submission {
            blocks,
            prompt_tokens: tokens.len() as u32,
            eligible: self.role_pool(true),
            ..Submission::default()
        };
        self.payloads.insert(
            decode,
            Payload {
                session,
                turn,
                arrival_ms,
                tokens,
                output_tokens: handoff.output_tokens,
            },
        );
        self.handoffs.insert(decode, handoff);
        let replica = self.pick_replica(session, false);
        match self.replicas[replica]
            .dispatcher
            .submit(decode, submission, self.now)
        {
            Ok((_, fx)) => self.carry_out(replica, fx),
            Err(_) => {
                self.payloads.remove(&decode);
                self.drop_handoff(decode);
                self.fail(session);
            }
        }
    }

    /// Releases the leases the engine of `worker` is done with, and those
    /// past their expiry on it.
    fn settle_leases(&mut self, worker: usize) {
        let mut observations = std::mem::take(&mut self.observations);
        observations.clear();
        self.workers[worker]
            .engine
            .drain_observations(&mut observations);
        for o in &observations {
            if let Observation::RendezvousDone { request, .. } = o {
                self.drop_handoff(*request);
            }
        }
        self.observations = observations;
        let now = self.now;
        self.workers[worker].engine.expire_leases(now);
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
        let report_ms = report.model_ms;
        let duration = self.config.engine.timing.wall_ms(report_ms);
        let idle = report.is_idle();
        w.pending = report;
        if idle {
            // Work that cannot be scheduled yet (a deferred restore): look
            // again after a floor-length step, or after the time an idle
            // step still took (a spill's copy to the host).
            let timing = &self.config.engine.timing;
            let retry = timing.wall_ms(timing.decode_floor_ms.max(report_ms));
            if retry > 0.0 {
                w.busy = true;
                self.schedule(self.now + retry, Event::StepDone { worker });
            }
            return;
        }
        w.busy = true;
        self.schedule(self.now + duration, Event::StepDone { worker });
    }

    fn finish_step(&mut self, worker: usize, progress: &mut impl FnMut(u64)) {
        let now = self.now;
        let report = std::mem::take(&mut self.workers[worker].pending);
        let computed =
            report.shape.prefill_tokens + report.shape.decode_tokens + report.shape.draft_tokens;
        self.workers[worker].served_tokens += computed;
        self.timeline.add(worker, now, computed);
        // A request's tokens of one step are adjacent; with speculative
        // decoding a step emits several, and each of them is charged an
        // equal share of the time since the request's previous token (so
        // the ITL samples are the time per output token, never zeros).
        let mut run_start = 0;
        for (i, token) in report.tokens.iter().enumerate() {
            if i == 0 || report.tokens[i - 1].request != token.request {
                run_start = i;
            }
            let Some(r) = self.in_flight.get_mut(&token.request) else {
                continue;
            };
            if i == run_start {
                let run = report.tokens[i..]
                    .iter()
                    .take_while(|t| t.request == token.request)
                    .count();
                let later = run - usize::from(r.first_token_ms.is_none());
                r.itl_share_ms = if later > 0 {
                    (now - r.last_token_ms) / later as f64
                } else {
                    0.0
                };
            }
            if let Some(progress) = r.progress.as_mut() {
                progress.advance(1);
            }
            let first = r.first_token_ms.is_none();
            // A prefill half's token is not the client's.
            let client = r.phase != Phase::Prefill;
            if first {
                r.first_token_ms = Some(now);
                if client {
                    self.ttft.push(now - r.arrival_ms);
                }
            } else if client {
                self.itl.push(r.itl_share_ms);
            }
            r.last_token_ms = now;
            let replica = r.replica;
            if first {
                let fx = self.replicas[replica]
                    .dispatcher
                    .first_token(token.request, now);
                self.carry_out(replica, fx);
            }
        }
        for done in &report.finished {
            let Some(r) = self.in_flight.remove(&done.request) else {
                continue;
            };
            self.workers[r.worker].booked = self.workers[r.worker].booked.saturating_sub(1);
            if r.phase == Phase::Prefill {
                // The prompt's cache hit is the prefill worker's.
                self.prompt_tokens += u64::from(r.prompt_tokens);
                self.cached_tokens += done.cached_tokens as u64;
                self.predicted_tokens += r.predicted_tokens;
                let context = u64::from(r.prompt_tokens) + done.output_tokens as u64;
                let fx = self.replicas[r.replica]
                    .dispatcher
                    .finish(done.request, context, now);
                self.carry_out(r.replica, fx);
                if done.reason == switchyard_engine::FinishReason::Length {
                    self.hand_off(worker, done.request, r.session, r.turn, r.arrival_ms);
                } else {
                    self.drop_handoff(done.request);
                    self.fail(r.session);
                }
                continue;
            }
            if r.phase == Phase::Whole {
                self.prompt_tokens += u64::from(r.prompt_tokens);
                self.cached_tokens += done.cached_tokens as u64;
                self.predicted_tokens += r.predicted_tokens;
            }
            self.output_tokens += done.output_tokens as u64;
            self.e2e.push(now - r.arrival_ms);
            self.completed += 1;
            let context = u64::from(r.prompt_tokens) + done.output_tokens as u64;
            let fx = self.replicas[r.replica]
                .dispatcher
                .finish(done.request, context, now);
            self.carry_out(r.replica, fx);
            self.last_completion = now;
            debug_assert_eq!(r.worker, worker);
            self.next_turn(r.session, r.turn);
            if self.completed % 256 == 0 {
                progress(self.completed);
            }
        }
        if self.config.disagg.is_some() || self.config.peer_restore.is_some() {
            self.settle_leases(worker);
        }
        self.deliver_kv_events(worker);
        let usage = self.workers[worker].engine.kv_usage();
        let id = self.workers[worker].id;
        for replica in &mut self.replicas {
            replica.dispatcher.report_kv(id, Some(usage));
        }
        self.workers[worker].pending = report;
        self.workers[worker].busy = false;
        self.kick(worker);
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
        let mut events = Vec::new();
        self.workers[worker]
            .events
            .normalize(raw.drain(..), &mut events);
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
            transfers: self.transfers,
            transfer_bytes: self.transfer_bytes,
            transfer_fallbacks: self.transfer_fallbacks,
            spec_decode: self.config.engine.spec_decode.map(|_| {
                let mut f = SpecFigures::default();
                for w in &self.workers {
                    let c = w.engine.counters();
                    f.draft_tokens_proposed += c.draft_tokens_proposed;
                    f.draft_tokens_accepted += c.draft_tokens_accepted;
                    f.rollbacks += c.spec_rollbacks;
                    f.rollback_blocks += c.spec_rollback_blocks;
                    f.fallbacks += c.spec_fallbacks;
                }
                f.acceptance =
                    f.draft_tokens_accepted as f64 / f.draft_tokens_proposed.max(1) as f64;
                f
            }),
            adapters: self.config.adapters.map(|_| self.adapter_figures),
            ssm: self.config.engine.hybrid.map(|_| {
                let mut f = SsmFigures::default();
                let mut unusable = 0;
                for w in &self.workers {
                    let c = w.engine.counters();
                    f.checkpoints += c.ssm_checkpoints;
                    f.evictions += c.ssm_checkpoint_evictions;
                    f.resumes += c.ssm_resumes;
                    unusable += c.ssm_unusable_hit_tokens;
                }
                f.unusable_hit_share = unusable as f64 / self.prompt_tokens.max(1) as f64;
                f
            }),
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
                .map(|r| r.dispatcher.router().remote().counters().applied)
                .sum(),
            remote_ignored: self
                .replicas
                .iter()
                .map(|r| r.dispatcher.router().remote().counters().ignored)
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
    fn adapter_affinity_loads_fewer_adapters_and_waits_less_than_blind_routing() {
        let run = |policy: PolicyKind, blind: bool| {
            let mut config = fleet(4, policy);
            config.adapters = Some(crate::adapters::AdapterMix {
                count: 4,
                skew: 0.0,
                max_loras: 1,
                load_ms: 200.0,
                seed: 7,
            });
            config.router.adapters.blind = blind;
            let list = (0..200)
                .map(|i| {
                    one_turn(
                        i,
                        i as f64 * 20.0,
                        (0..64).map(|t| t + i as u32 * 64).collect(),
                        4,
                    )
                })
                .collect();
            simulate(&config, sessions(list), |_| {}).unwrap().report
        };
        for policy in [PolicyKind::Ttft, PolicyKind::LeastLoaded] {
            let affinity = run(policy, false);
            let blind = run(policy, true);
            let (a, b) = (affinity.adapters.unwrap(), blind.adapters.unwrap());
            assert_eq!((affinity.completed, blind.completed), (200, 200));
            assert_eq!((a.requests, b.requests), (200, 200));
            assert!(a.loads * 4 < b.loads, "{policy:?}: {a:?} against {b:?}");
            assert!(
                affinity.ttft_ms.p90 < blind.ttft_ms.p90,
                "{policy:?}: {} against {}",
                affinity.ttft_ms.p90,
                blind.ttft_ms.p90
            );
        }
        assert_eq!(fleet(1, PolicyKind::Ttft).adapters, None);
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
    fn speculative_decoding_at_full_acceptance_decodes_in_fewer_steps_with_the_same_tokens() {
        let run = |spec: Option<switchyard_engine::SpecDecode>| {
            let mut config = fleet(1, PolicyKind::Kv);
            config.engine.spec_decode = spec;
            let prompt: Vec<u32> = (0..100).collect();
            simulate(&config, sessions(vec![one_turn(0, 0.0, prompt, 9)]), |_| {})
                .unwrap()
                .report
        };
        let plain = run(None);
        let spec = run(Some(switchyard_engine::SpecDecode {
            draft_tokens: 3,
            acceptance_rate: 1.0,
        }));
        assert_eq!(plain.spec_decode, None);
        // 9 tokens: a prefill, then 8 decode steps or 2 of 1 + 3 drafts.
        assert_eq!((plain.engine_steps, spec.engine_steps), (9, 3));
        assert_eq!(spec.completed, 1);
        let f = spec.spec_decode.expect("counted");
        assert_eq!((f.draft_tokens_proposed, f.draft_tokens_accepted), (6, 6));
        assert_eq!((f.acceptance, f.rollbacks), (1.0, 0));
        // Each token of a step is charged its share: the mean ITL is the
        // decode time per output token, shorter than one step.
        assert!(spec.itl_ms.p50 > 0.0);
        assert!(spec.itl_ms.mean < plain.itl_ms.mean);
        assert!(spec.e2e_ms.mean < plain.e2e_ms.mean);
    }

    #[test]
    fn a_disaggregated_request_prefills_transfers_then_decodes_from_the_restored_prefix() {
        let mut config = fleet(2, PolicyKind::Kv);
        config.disagg = Some(DisaggConfig {
            prefill_workers: 1,
            ..DisaggConfig::default()
        });
        let prompt: Vec<u32> = (0..100).collect();
        let out = simulate(&config, sessions(vec![one_turn(0, 0.0, prompt, 3)]), |_| {}).unwrap();
        let r = &out.report;
        assert_eq!((r.completed, r.errors), (1, 0));
        // Six full blocks of 16 tokens at 128 KiB a token moved once.
        assert_eq!((r.transfers, r.transfer_fallbacks), (1, 0));
        assert_eq!(r.transfer_bytes, 96 * 131_072);
        let prefill = |t: f64| 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142;
        let transfer = 1.0 + 96.0 * 131_072.0 / 25e9 * 1e3;
        // The client's first token: the prefill of 100 tokens, the
        // transfer, then the decode worker computing the 4 tokens past the
        // restored blocks; a waiting engine looks again every floor step.
        let floor = config.engine.timing.decode_floor_ms;
        let least = prefill(100.0) + transfer + prefill(4.0);
        assert!(
            (least..least + floor + 1e-9).contains(&r.ttft_ms.mean),
            "{} not within a floor step of {least}",
            r.ttft_ms.mean
        );
        // Two decode steps after it, on the decode worker.
        let decode = r.e2e_ms.mean - r.ttft_ms.mean;
        assert!((2.0 * 5.74..2.0 * 5.8).contains(&decode), "{decode}");
        // Each worker ran its half: the prefill worker computed the prompt,
        // the decode worker only the suffix and the output.
        let served: Vec<u64> = out.timeline.tokens.iter().map(|w| w.iter().sum()).collect();
        assert_eq!(served, vec![100, 4 + 2]);
    }

    #[test]
    fn a_disaggregated_fleet_ends_every_lease_and_loses_no_request() {
        let mut config = fleet(4, PolicyKind::Kv);
        config.disagg = Some(DisaggConfig {
            prefill_workers: 2,
            ..DisaggConfig::default()
        });
        let turns: Vec<Session> = (0..40)
            .map(|i| {
                let prompt: Vec<u32> = (0..(64 + (i % 7) * 50))
                    .map(|t| t + (i % 3) * 10_000)
                    .collect();
                one_turn(u64::from(i), f64::from(i) * 5.0, prompt, 1 + i % 5)
            })
            .collect();
        let mut leases_at_end = None;
        let fleet_run = Fleet::new(&config, sessions(turns)).unwrap();
        let out = fleet_run
            .run(&mut |_| {}, |f| {
                leases_at_end = Some(
                    f.workers
                        .iter()
                        .map(|w| w.engine.leases_held())
                        .sum::<usize>(),
                );
            })
            .unwrap();
        let r = &out.report;
        assert_eq!((r.completed, r.errors), (40, 0));
        assert_eq!(r.transfers + r.transfer_fallbacks, 40);
        assert_eq!(leases_at_end, Some(0), "every lease released");
        assert!(r.hit_rate > 0.0, "prefixes shared on the prefill pool");
    }

    #[test]
    fn with_peer_restore_a_busy_holder_lends_its_prefix_and_every_lease_ends() {
        // A long shared prefix: the first request caches it on one worker,
        // then a burst of requests extending it arrives at once.
        let shared: Vec<u32> = (0..4_096).collect();
        let mut turns = vec![one_turn(0, 0.0, shared.clone(), 1)];
        for i in 1..24u32 {
            let mut prompt = shared.clone();
            prompt.extend((0..64).map(|t| 100_000 + i * 100 + t));
            turns.push(one_turn(u64::from(i), 500.0, prompt, 4));
        }
        let run = |peer: bool| {
            let mut config = fleet(4, PolicyKind::Ttft);
            config.peer_restore = peer.then(TransferConfig::default);
            let mut leases = None;
            let out = Fleet::new(&config, sessions(turns.clone()))
                .unwrap()
                .run(&mut |_| {}, |f| {
                    leases = Some(
                        f.workers
                            .iter()
                            .map(|w| w.engine.leases_held())
                            .sum::<usize>(),
                    );
                })
                .unwrap();
            (out.report, leases)
        };
        let (plain, _) = run(false);
        let (lent, leases) = run(true);
        assert_eq!(plain.transfers, 0);
        assert!(lent.transfers > 0, "some requests were lent the prefix");
        assert_eq!((lent.completed, lent.errors), (24, 0));
        assert_eq!(leases, Some(0), "every lease released");
        // What moved is prefix the other workers would have computed.
        // The burst spreads over idle workers instead of queueing on the
        // holder or recomputing the prefix (simulated time: deterministic).
        assert!(
            lent.ttft_ms.mean < plain.ttft_ms.mean,
            "{:?} vs {:?}",
            lent.ttft_ms,
            plain.ttft_ms
        );
        assert!(lent.load_cv < plain.load_cv);
        assert_eq!(
            lent.hit_rate, plain.hit_rate,
            "restored blocks count as cached"
        );
    }

    #[test]
    fn a_disaggregation_needs_a_worker_of_each_role() {
        for prefill_workers in [0, 2] {
            let mut config = fleet(2, PolicyKind::Kv);
            config.disagg = Some(DisaggConfig {
                prefill_workers,
                ..DisaggConfig::default()
            });
            let err = simulate(&config, sessions(vec![]), |_| {}).err().unwrap();
            assert!(err.to_string().contains("one of each role"), "{err}");
        }
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
    fn an_engines_host_tier_reaches_the_routers_host_index() {
        // One worker with room for 16 device blocks (256 tokens) and a host
        // tier of 64: ten distinct 200-token prompts evict one another, and
        // evicted blocks spill into the host tier.
        let mut config = fleet(1, PolicyKind::Ttft);
        config.engine.num_blocks = 16;
        config.engine.host_blocks = 64;
        config.kv_event_delay_ms = 0.0;
        let turns = (0..10u32)
            .map(|i| {
                let prompt = (i * 1000..i * 1000 + 200).collect();
                one_turn(u64::from(i), f64::from(i) * 1000.0, prompt, 2)
            })
            .collect();
        let mut last = (0, 0, 0);
        Fleet::new(&config, sessions(turns))
            .unwrap()
            .run(&mut |_| {}, |fleet: &Fleet| {
                let router = fleet.replicas[0].dispatcher.router();
                last = (
                    router.with_host_index(|h| h.live_pairs()),
                    fleet.workers[0].engine.kv().host_blocks(),
                    router.with_host_index(|h| h.counters().unknown_parent),
                );
            })
            .unwrap();
        let (indexed, engine, dropped) = last;
        assert!(engine > 0, "the engine spilled nothing");
        assert_eq!(indexed, engine, "every host block is indexed");
        assert_eq!(dropped, 0, "every spill found its parent");
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
    fn view(router: &switchyard_core::Router, now_ms: f64) -> (Loads, usize) {
        let sequences = router.sequences();
        let loads = sequences
            .registry()
            .loads()
            .map(|l| {
                (
                    l.worker,
                    l.requests,
                    l.decode_blocks,
                    l.active_prefill_tokens(now_ms),
                    sequences.active_blocks(l.worker),
                )
            })
            .collect();
        (loads, router.with_index(|index| index.live_pairs()))
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
            let first = view(fleet.replicas[0].dispatcher.router(), fleet.now);
            for r in &fleet.replicas[1..] {
                assert_eq!(
                    view(r.dispatcher.router(), fleet.now),
                    first,
                    "at {} ms",
                    fleet.now
                );
            }
            // And the shared view is the truth: every booking anywhere.
            let booked: u64 = fleet.workers.iter().map(|w| w.booked).sum();
            assert_eq!(
                fleet.replicas[0]
                    .dispatcher
                    .router()
                    .sequences()
                    .active_requests() as u64,
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
                .map(|r| r.dispatcher.router().sequences().active_requests())
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
                .map(|r| r.dispatcher.router().with_index(|index| index.live_pairs()))
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
