//! The discrete-event fleet simulator: the real routing core against N
//! simulated engine cores, in virtual time.
//!
//! Events, each at a simulated instant (ties in scheduling order):
//!
//! - **arrival** — a turn of a session arrives; its prompt is expanded and
//!   hashed exactly as the router would and submitted to the admission
//!   controller (the policy queue, plus the session-aware strategy when
//!   configured); each poll routes ready requests (`Router::route`), books
//!   them (`book`) and hands them to the chosen engine; when every worker is
//!   busy they wait until capacity frees or the periodic recheck;
//! - **step done** — an engine step launched earlier completes: its tokens
//!   reach the clients (a first token marks the prefill done, a last one
//!   frees the booking), its KV events leave for the router, and the engine
//!   launches its next step;
//! - **KV delivery** — KV events reach the router after `kv_event_delay_ms`,
//!   as they would over the network.
//!
//! A session's next turn arrives a think time after its previous turn ends.
//! Nothing reads a clock and every random choice is seeded: a run is a pure
//! function of its configuration and workload.

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
use switchyard_core::{LocalHash, RequestId, WorkerId};
use switchyard_engine::{
    Engine, EngineConfig, KvEvent, Medium, NewRequest, StepReport, SyncDevice,
};

/// One fleet and its router.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FleetConfig {
    /// Simulated workers.
    pub workers: usize,
    /// Every worker's engine.
    pub engine: EngineConfig,
    /// The router (its block size is forced to the engine's).
    pub router: RouterConfig,
    /// Delay from an engine emitting a KV event to the router applying it.
    pub kv_event_delay_ms: f64,
    /// Give the router expected prefill durations from the timing model.
    pub prefill_hints: bool,
    /// Width of the per-worker load timeline buckets.
    pub timeline_bucket_ms: f64,
    /// The policy queue.
    pub admission: AdmissionConfig,
    /// Session-aware admission (multi-turn sessions); `None`: no strategy.
    pub session_aware: Option<SessionAwareConfig>,
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
    /// KV events reach the router.
    KvDelivery {
        worker: usize,
        events: Vec<IndexEvent>,
    },
    /// The admission controller's recheck or reconcile is due.
    AdmissionTick,
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
}

/// Runs one simulation to completion.
pub fn simulate(
    config: &FleetConfig,
    workload: SessionStream,
    mut progress: impl FnMut(u64),
) -> Result<SimOutcome, SimError> {
    Fleet::new(config, workload)?.run(&mut progress)
}

struct Fleet {
    config: FleetConfig,
    router: Router,
    workers: Vec<WorkerState>,
    by_worker_id: FxHashMap<WorkerId, usize>,
    heap: BinaryHeap<Scheduled>,
    seq: u64,
    now: f64,
    workload: SessionStream,
    lookahead: Option<Session>,
    sessions: FxHashMap<u64, Session>,
    in_flight: FxHashMap<RequestId, InFlight>,
    admission: AdmissionController,
    payloads: FxHashMap<RequestId, Payload>,
    placed: Vec<Placed>,
    tick_at: Option<f64>,
    kv_scratch: Vec<KvEvent>,
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
}

impl Fleet {
    fn new(config: &FleetConfig, workload: SessionStream) -> Result<Self, SimError> {
        if config.workers == 0 {
            return Err(SimError::NoWorkers);
        }
        let mut config = config.clone();
        config.router.sequences.block_size = config.engine.block_size as u32;
        let mut router = Router::new(config.router)?;
        let mut workers = Vec::with_capacity(config.workers);
        let mut by_worker_id = FxHashMap::default();
        for i in 0..config.workers {
            let id = WorkerId::new(i as u64);
            let engine = Engine::new(
                config.engine.clone(),
                SyncDevice::new(config.engine.timing.clone()),
            )
            .map_err(|e| SimError::Engine(e.to_string()))?;
            router.add_worker(
                id,
                WorkerCapacity {
                    max_num_batched_tokens: Some(config.engine.max_num_batched_tokens as u64),
                    kv_blocks: Some(config.engine.num_blocks as u64),
                },
            );
            by_worker_id.insert(id, i);
            workers.push(WorkerState {
                id,
                engine,
                busy: false,
                pending: StepReport::default(),
                served_tokens: 0,
            });
        }
        let timeline = LoadTimeline::new(config.workers, config.timeline_bucket_ms.max(1.0));
        let strategy = match config.session_aware {
            Some(session) => Some(Box::new(
                SessionAwareStrategy::new(session)
                    .map_err(|e| SimError::Admission(e.to_string()))?,
            ) as Box<dyn AdmissionStrategy + Send>),
            None => None,
        };
        let admission = AdmissionController::new(config.admission.clone(), strategy)
            .map_err(|e| SimError::Admission(e.to_string()))?;
        Ok(Self {
            config,
            router,
            workers,
            by_worker_id,
            heap: BinaryHeap::new(),
            seq: 0,
            now: 0.0,
            workload,
            lookahead: None,
            sessions: FxHashMap::default(),
            in_flight: FxHashMap::default(),
            admission,
            payloads: FxHashMap::default(),
            placed: Vec::new(),
            tick_at: None,
            kv_scratch: Vec::new(),
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

    fn run(mut self, progress: &mut impl FnMut(u64)) -> Result<SimOutcome, SimError> {
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
                Event::StepDone { worker } => {
                    self.finish_step(worker, progress)?;
                    self.poll_admission();
                }
                Event::AdmissionTick => {
                    self.tick_at = None;
                    self.admission.tick(self.now);
                    self.poll_admission();
                }
                Event::KvDelivery { worker, events } => {
                    let id = self.workers[worker].id;
                    for e in &events {
                        self.router.apply_kv_event(id, e);
                    }
                }
            }
        }
        Ok(self.outcome())
    }

    fn request_id(session: u64, turn: usize) -> RequestId {
        RequestId(u128::from(session) << 32 | turn as u128)
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
        let facts = RequestFacts {
            id,
            session: multi_turn.then_some(SessionKey(session)),
            context_tokens: tokens.len() as u32,
            uncached_tokens: tokens.len() as u32,
            class: QueueClass::default(),
            eligible: &[],
            now_ms: self.now,
        };
        match self.admission.submit(&facts) {
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
        self.poll_admission();
    }

    /// Places every request the admission controller offers, books it and
    /// starts it on its engine; schedules the next recheck while work remains.
    fn poll_admission(&mut self) {
        let mut placed = std::mem::take(&mut self.placed);
        let now = self.now;
        let router = &mut self.router;
        let payloads = &self.payloads;
        let config = &self.config;
        self.admission.poll(now, &mut placed, |id, placement| {
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
            let outcome = router.route(request, eligible, now);
            if let SelectOutcome::Selected(decision) = outcome {
                let cached = (decision.overlap_blocks as u64 * config.engine.block_size as u64)
                    .min(p.tokens.len() as u64);
                let hint = config
                    .prefill_hints
                    .then(|| expected_prefill_ms(config, p.tokens.len() as u64 - cached));
                router.book(id, request, decision, hint, now);
            }
            outcome
        });
        for p in placed.drain(..) {
            match p {
                Placed::Selected {
                    ticket,
                    decision,
                    waited_ms,
                } => self.start(ticket, decision.worker, decision.overlap_blocks, waited_ms),
                Placed::NoWorkers { id } => {
                    if let Some(p) = self.payloads.remove(&id) {
                        self.fail(p.session);
                    }
                }
            }
        }
        self.placed = placed;
        let busy = !self.payloads.is_empty()
            || !self.in_flight.is_empty()
            || !self.sessions.is_empty()
            || self.lookahead.is_some();
        if let Some(at) = self.admission.next_wakeup_ms().filter(|_| busy) {
            let at = at.max(self.now + 1.0);
            if self.tick_at.is_none_or(|t| at < t) {
                self.tick_at = Some(at);
                self.schedule(at, Event::AdmissionTick);
            }
        }
    }

    /// Hands a placed (and booked) request to its engine.
    fn start(
        &mut self,
        ticket: ResponseTicket,
        worker_id: WorkerId,
        overlap_blocks: u32,
        waited_ms: f64,
    ) {
        let id = ticket.id();
        let Some(p) = self.payloads.remove(&id) else {
            self.router.free(id, self.now);
            self.admission.abort(ticket, self.now);
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
            self.router.free(id, self.now);
            self.admission.abort(ticket, self.now);
            self.fail(p.session);
            return;
        }
        self.admission.dispatched(&ticket, self.now);
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
                ticket: Some(ticket),
            },
        );
        self.kick(worker);
    }

    fn fail(&mut self, session: u64) {
        self.errors += 1;
        self.sessions.remove(&session);
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
            match r.first_token_ms {
                None => {
                    r.first_token_ms = Some(now);
                    self.ttft.push(now - r.arrival_ms);
                    self.router.mark_prefill_completed(token.request, now);
                }
                Some(_) => self.itl.push(now - r.last_token_ms),
            }
            r.last_token_ms = now;
        }
        for done in &report.finished {
            self.router.free(done.request, now);
            let Some(r) = self.in_flight.remove(&done.request) else {
                continue;
            };
            self.prompt_tokens += u64::from(r.prompt_tokens);
            self.cached_tokens += done.cached_tokens as u64;
            self.predicted_tokens += r.predicted_tokens;
            self.output_tokens += done.output_tokens as u64;
            self.e2e.push(now - r.arrival_ms);
            self.completed += 1;
            if let Some(ticket) = r.ticket {
                let context = u64::from(r.prompt_tokens) + done.output_tokens as u64;
                // A refusal gives the ticket back; it was dispatched, so none comes.
                let _ = self.admission.complete(ticket, context, now);
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
        self.admission.report_kv(
            self.workers[worker].id,
            KvUsage {
                capacity_tokens: capacity,
                used_tokens: Some((engine.kv_usage() * capacity as f64) as u64),
            },
        );
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
        SimOutcome {
            report,
            timeline: self.timeline,
            ttft_samples_ms: self.ttft,
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
