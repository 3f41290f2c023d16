//! The real-time driver: one thread owns the engine core and steps it,
//! pacing each step by the timing model divided by the speed-up factor.
//!
//! A step is computed when it is launched, but its tokens and KV events go
//! out only at its deadline, when its modeled duration has passed — as the
//! fleet simulator delivers them at the step's end. Deadlines are absolute
//! ([`Pacer`]): each step's deadline counts from the previous step's
//! deadline, not from when the sleep returned, so a sleep's overshoot is
//! made up by the next steps instead of adding up; a worker that falls more
//! than [`MAX_LAG`] behind resumes from the present and counts the time
//! given up.
//!
//! The driver is a plain thread, not a tokio task, because tokio's timer
//! counts whole milliseconds: steps are 0.4–6 ms at the speed-ups in use,
//! so a tokio sleep would deliver tokens in millisecond bursts (right on
//! average once deadlines carry over, but not token by token). A thread's
//! sleep wakes within tens of microseconds. The thread blocks only on its
//! own command channel and its sleeps; everything it sends (tokens, KV
//! events) goes through non-blocking `try_send`.
//!
//! HTTP handlers talk to it only through a bounded command channel; each
//! request gets a channel of its own sized to its `max_tokens`, so the driver
//! never waits on a client. A request whose receiver is gone (the client
//! hung up) is cancelled at the next token.

use super::metrics::{DisaggFailure, Metrics, RequestOutcome};
use crate::transfer::{LeaseHandle, TransferError};
use rustc_hash::FxHashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use switchyard_core::{EngineHash, RequestId};
use switchyard_engine::lease::{LeaseError, LeaseId, LeaseRef, LeasedKv};
use switchyard_engine::scheduler::AdmitError;
use switchyard_engine::{
    Engine, FinishReason, KvEvent, Medium, NewRequest, Observation, StepReport, SyncDevice,
};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot};

/// What a request's receiver sees.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GenEvent {
    /// The engine refused the request.
    Rejected(AdmitError),
    /// One output token.
    Token {
        /// Token id.
        token: u32,
        /// 0-based output position.
        index: u32,
    },
    /// The prefill's prompt KV was captured under `lease` (sent before
    /// `Finished`, for requests submitted with a [`Capture`]).
    Captured {
        /// The lease (its secret included).
        lease: LeaseRef,
        /// The captured blocks' chained hashes.
        block_ids: Vec<u64>,
    },
    /// The capture was refused: why, for the answer and the metric.
    CaptureRefused(DisaggFailure),
    /// The rendezvous transfer failed; the request was cancelled.
    TransferFailed(TransferError),
    /// The request left the engine.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Prompt length.
        prompt_tokens: usize,
        /// Prompt tokens served from the cache.
        cached_tokens: usize,
        /// Output tokens.
        output_tokens: usize,
    },
}

/// A prefill's capture of its prompt's KV when it finishes (a
/// disaggregated prefill).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Capture {
    /// The lease's secret (from a CSPRNG).
    pub token: u128,
    /// SGLang's room the lease is held under.
    pub room: Option<u64>,
}

impl std::fmt::Debug for Capture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Capture")
            .field("token", &"<redacted>")
            .field("room", &self.room)
            .finish()
    }
}

/// A lease on another worker that a decode request restored from: released
/// there when the engine is done with it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteLease {
    /// The worker (its HTTP or bootstrap address).
    pub peer: SocketAddr,
    /// The lease.
    pub lease: LeaseHandle,
}

/// The driver's part in disaggregation (`--disagg`).
#[derive(Debug)]
pub struct DriverDisagg {
    /// Captured leases live this long, wall ms.
    pub lease_ttl_ms: f64,
    /// Rooms held at once.
    pub max_rooms: usize,
    /// Where leases the engine is done with go to be released.
    pub releases: mpsc::Sender<RemoteLease>,
}

/// A command for the driver.
#[derive(Debug)]
pub enum Command {
    /// Run a request; its events go to `events` (capacity ≥ `max_tokens + 3`).
    Submit {
        /// The request.
        request: NewRequest,
        /// Where its tokens go.
        events: mpsc::Sender<GenEvent>,
        /// Capture its prompt's KV when it finishes.
        capture: Option<Capture>,
    },
    /// Run a request that restores its prompt's KV from another worker's
    /// lease, delivered later with [`Command::Deliver`].
    SubmitRendezvous {
        /// The request.
        request: NewRequest,
        /// Where its tokens go.
        events: mpsc::Sender<GenEvent>,
        /// Whether the engine took it, and if so how many of its leading
        /// prompt blocks this engine caches already (a transfer need not
        /// move those).
        admitted: oneshot::Sender<Result<usize, AdmitError>>,
    },
    /// The transfer a rendezvous request waits for.
    Deliver {
        /// The request.
        request: RequestId,
        /// The KV.
        kv: LeasedKv,
        /// Released when the engine is done with it.
        release: RemoteLease,
    },
    /// The transfer failed: cancel the request, tell its client why.
    TransferFailed {
        /// The request.
        request: RequestId,
        /// Why.
        error: TransferError,
    },
    /// Read a lease's KV (a peer's pull).
    ReadLease(LeaseRef, oneshot::Sender<Result<LeasedKv, LeaseError>>),
    /// Take a room's lease and read its KV (an SGLang peer's pull); a room
    /// is taken at most once.
    TakeRoom(u64, oneshot::Sender<Option<(LeaseRef, LeasedKv)>>),
    /// Release a lease (a peer is done with it).
    ReleaseLease(LeaseRef, oneshot::Sender<Result<(), LeaseError>>),
    /// Expire leases and rooms past their time.
    Tick,
    /// Cancel a request.
    Cancel(RequestId),
    /// Report the cached blocks of both tiers and a hybrid model's SSM
    /// checkpoints (for `/debug/kv_cache`).
    Snapshot(oneshot::Sender<KvSnapshot>),
}

/// What an engine caches, as `/debug/kv_cache` shows it.
#[derive(Clone, Debug, Default)]
pub struct KvSnapshot {
    /// Cached blocks of both tiers, by engine hash.
    pub blocks: Vec<(Medium, EngineHash)>,
    /// A hybrid model's SSM checkpoints, by the engine hash of the block
    /// each ends (empty for an attention model).
    pub ssm_checkpoints: Vec<EngineHash>,
}

/// Handle to the driver task.
#[derive(Clone, Debug)]
pub struct DriverHandle {
    commands: mpsc::Sender<Command>,
}

impl DriverHandle {
    /// Submits `request`; returns the receiver of its events, or `None`
    /// when the driver has stopped.
    pub async fn submit(&self, request: NewRequest) -> Option<mpsc::Receiver<GenEvent>> {
        self.submit_capturing(request, None).await
    }

    /// Submits `request`, capturing its prompt's KV when it finishes.
    pub async fn submit_capturing(
        &self,
        request: NewRequest,
        capture: Option<Capture>,
    ) -> Option<mpsc::Receiver<GenEvent>> {
        let (tx, rx) = mpsc::channel(request.max_tokens as usize + 3);
        self.commands
            .send(Command::Submit {
                request,
                events: tx,
                capture,
            })
            .await
            .ok()?;
        Some(rx)
    }

    /// Submits a request restoring from another worker's lease; deliver
    /// the transfer with [`Self::deliver`] or fail it with
    /// [`Self::transfer_failed`]. Returns its events and whether the engine
    /// took it (with the prompt blocks cached here already); `None` when
    /// the driver has stopped.
    pub async fn submit_rendezvous(
        &self,
        request: NewRequest,
    ) -> Option<(mpsc::Receiver<GenEvent>, Result<usize, AdmitError>)> {
        let (tx, rx) = mpsc::channel(request.max_tokens as usize + 3);
        let (admitted, answer) = oneshot::channel();
        self.commands
            .send(Command::SubmitRendezvous {
                request,
                events: tx,
                admitted,
            })
            .await
            .ok()?;
        Some((rx, answer.await.ok()?))
    }

    /// Hands a rendezvous request its transfer.
    pub async fn deliver(&self, request: RequestId, kv: LeasedKv, release: RemoteLease) {
        let _ = self
            .commands
            .send(Command::Deliver {
                request,
                kv,
                release,
            })
            .await;
    }

    /// Cancels a rendezvous request whose transfer failed.
    pub async fn transfer_failed(&self, request: RequestId, error: TransferError) {
        let _ = self
            .commands
            .send(Command::TransferFailed { request, error })
            .await;
    }

    /// A lease's KV; `None` when the driver stopped.
    pub async fn read_lease(&self, lease: LeaseRef) -> Option<Result<LeasedKv, LeaseError>> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::ReadLease(lease, tx))
            .await
            .ok()?;
        rx.await.ok()
    }

    /// Takes a room: `Some(None)` when no lease is held under it.
    pub async fn take_room(&self, room: u64) -> Option<Option<(LeaseRef, LeasedKv)>> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::TakeRoom(room, tx)).await.ok()?;
        rx.await.ok()
    }

    /// Releases a lease; `None` when the driver stopped.
    pub async fn release_lease(&self, lease: LeaseRef) -> Option<Result<(), LeaseError>> {
        let (tx, rx) = oneshot::channel();
        self.commands
            .send(Command::ReleaseLease(lease, tx))
            .await
            .ok()?;
        rx.await.ok()
    }

    /// Starts a task asking the driver to expire leases and rooms every
    /// `period`, also while it is idle. It holds no handle of its own
    /// between ticks, so the driver still stops when the last
    /// [`DriverHandle`] is gone.
    pub fn spawn_ticker(&self, period: Duration) {
        let weak = self.commands.downgrade();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(period);
            loop {
                every.tick().await;
                let Some(commands) = weak.upgrade() else {
                    return;
                };
                if commands.send(Command::Tick).await.is_err() {
                    return;
                }
            }
        });
    }

    /// Cancels a request (harmless when it already finished).
    pub async fn cancel(&self, id: RequestId) {
        let _ = self.commands.send(Command::Cancel(id)).await;
    }

    /// The cached blocks of both tiers and the SSM checkpoints; `None`
    /// when the driver stopped.
    pub async fn snapshot(&self) -> Option<KvSnapshot> {
        let (tx, rx) = oneshot::channel();
        self.commands.send(Command::Snapshot(tx)).await.ok()?;
        rx.await.ok()
    }
}

/// Starts the driver thread; it ends when every [`DriverHandle`] is gone.
/// KV events go to `kv_sink` when given; while the sink is full they wait
/// in the driver (up to the engine's event buffer size; beyond it the
/// newest are dropped and counted).
pub fn spawn(
    engine: Engine<SyncDevice>,
    metrics: Arc<Metrics>,
    kv_sink: Option<mpsc::Sender<Vec<KvEvent>>>,
) -> std::io::Result<DriverHandle> {
    spawn_with(engine, metrics, kv_sink, None)
}

/// [`spawn`], taking part in disaggregation when `disagg` is given.
pub fn spawn_with(
    engine: Engine<SyncDevice>,
    metrics: Arc<Metrics>,
    kv_sink: Option<mpsc::Sender<Vec<KvEvent>>>,
    disagg: Option<DriverDisagg>,
) -> std::io::Result<DriverHandle> {
    let (tx, rx) = mpsc::channel(1024);
    std::thread::Builder::new()
        .name("sim-worker-engine".into())
        .spawn(move || run(engine, rx, metrics, kv_sink, disagg))?;
    Ok(DriverHandle { commands: tx })
}

/// How far behind its schedule a worker may fall and still catch up. Up
/// to this lag, late steps run back to back (a burst of at most this much
/// model time) until the schedule is met again; it covers the timer's
/// millisecond granularity and ordinary scheduling delays several times
/// over. Beyond it (the process was descheduled, the machine is
/// overloaded) the next step starts now: the worker then runs that much
/// slower than its model, and the time is counted in
/// `switchyard_engine_pacing_dropped_seconds_total` rather than made up in
/// one unbounded burst.
pub const MAX_LAG: Duration = Duration::from_millis(5);

/// One step's place on the wall clock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PacedStep {
    /// When the step's outputs are due.
    pub deadline: Instant,
    /// Schedule given up because the step launched more than the allowed
    /// lag behind it (zero when on time or catching up).
    pub dropped: Duration,
}

/// Absolute-deadline pacing of engine steps (pure: the caller passes the
/// time). A step's nominal start is the previous step's deadline — or the
/// moment it launches, after an idle spell or when it launches more than
/// `max_lag` late — and its deadline is that start plus its duration.
#[derive(Clone, Copy, Debug)]
pub struct Pacer {
    deadline: Option<Instant>,
    max_lag: Duration,
}

impl Pacer {
    /// A pacer that catches up on at most `max_lag` of lateness.
    pub fn new(max_lag: Duration) -> Self {
        Self {
            deadline: None,
            max_lag,
        }
    }

    /// The engine ran out of work: the next step starts when it launches.
    pub fn idle(&mut self) {
        self.deadline = None;
    }

    /// Places a step of `duration` launched at `now`.
    pub fn schedule(&mut self, now: Instant, duration: Duration) -> PacedStep {
        let (start, dropped) = match self.deadline {
            Some(previous) if now <= previous + self.max_lag => (previous, Duration::ZERO),
            Some(previous) => (now, now - previous),
            None => (now, Duration::ZERO),
        };
        let deadline = start + duration;
        self.deadline = Some(deadline);
        PacedStep { deadline, dropped }
    }
}

/// How often a `--no-delay` worker whose only work waits (a rendezvous
/// transfer on its way) looks at it again.
const IDLE_POLL: Duration = Duration::from_micros(200);

struct Driver {
    engine: Engine<SyncDevice>,
    streams: FxHashMap<RequestId, mpsc::Sender<GenEvent>>,
    metrics: Arc<Metrics>,
    kv_sink: Option<mpsc::Sender<Vec<KvEvent>>>,
    events: Vec<KvEvent>,
    /// Events in `events` already counted (held back by a full sink).
    held_events: usize,
    hung_up: Vec<RequestId>,
    observations: Vec<Observation>,
    disagg: Option<DriverDisagg>,
    /// Prompts to capture when their prefill finishes, with their hash
    /// seed (an adapter's blocks are cached under the adapter's); one per
    /// request the engine holds (bounded by its queues).
    captures: FxHashMap<RequestId, (Vec<u32>, u64, Capture)>,
    /// SGLang's rooms: the lease held under each and its expiry (ms since
    /// `started`); at most `max_rooms`.
    rooms: FxHashMap<u64, (LeaseRef, f64)>,
    /// Remote leases delivered to rendezvous requests the engine holds,
    /// released at their `RendezvousDone` (bounded by its queues).
    remote: FxHashMap<RequestId, RemoteLease>,
    started: Instant,
}

fn run(
    engine: Engine<SyncDevice>,
    mut commands: mpsc::Receiver<Command>,
    metrics: Arc<Metrics>,
    kv_sink: Option<mpsc::Sender<Vec<KvEvent>>>,
    disagg: Option<DriverDisagg>,
) {
    let mut driver = Driver {
        engine,
        streams: FxHashMap::default(),
        metrics,
        kv_sink,
        events: Vec::new(),
        held_events: 0,
        hung_up: Vec::new(),
        observations: Vec::new(),
        disagg,
        captures: FxHashMap::default(),
        rooms: FxHashMap::default(),
        remote: FxHashMap::default(),
        started: Instant::now(),
    };
    let mut report = StepReport::default();
    let mut pacer = Pacer::new(MAX_LAG);
    loop {
        if !driver.engine.has_work() {
            pacer.idle();
            match commands.blocking_recv() {
                Some(cmd) => driver.handle(cmd),
                None => return,
            }
        }
        while let Ok(cmd) = commands.try_recv() {
            driver.handle(cmd);
        }
        if !driver.engine.has_work() {
            driver.publish();
            continue;
        }
        if let Err(err) = driver.engine.step(&mut report) {
            // The simulated device has no faults; a contract error is a bug.
            eprintln!("switchyard sim-worker: engine step failed: {err}");
            return;
        }
        let timing = &driver.engine.config().timing;
        // Work that cannot be scheduled yet (a deferred restore) is looked
        // at again after a floor-length step, as the fleet simulator does,
        // or after the time an idle step still took (a spill's copy).
        let model_ms = if report.is_idle() {
            timing.decode_floor_ms.max(report.model_ms)
        } else {
            report.model_ms
        };
        let wall_ms = timing.wall_ms(model_ms);
        if wall_ms <= 0.0 && report.is_idle() {
            // Only work that waits (a transfer on its way) and no clock to
            // pace it (`--no-delay`): look again shortly, not in a spin.
            std::thread::sleep(IDLE_POLL);
        }
        if wall_ms > 0.0 {
            let duration = Duration::from_secs_f64(wall_ms / 1e3);
            let step = pacer.schedule(Instant::now(), duration);
            driver.metrics.record_pacing(duration, step.dropped);
            let now = Instant::now();
            if step.deadline > now {
                std::thread::sleep(step.deadline - now);
            }
        }
        // Counters first: a client that has its last token may read
        // /metrics at once, and must find that token counted (a busy
        // machine can hold this thread between the two).
        driver.metrics.observe(&driver.engine);
        driver.dispatch(&report);
        driver.publish();
    }
}

impl Driver {
    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Submit {
                request,
                events,
                capture,
            } => {
                let id = request.id;
                let prompt = capture.map(|c| (request.prompt.clone(), request.hash_seed, c));
                match self.engine.add_request(request) {
                    Ok(()) => {
                        self.streams.insert(id, events);
                        if let Some(prompt) = prompt {
                            self.captures.insert(id, prompt);
                        }
                    }
                    Err(err) => {
                        self.metrics.count_request(RequestOutcome::Rejected);
                        let _ = events.try_send(GenEvent::Rejected(err));
                    }
                }
            }
            Command::SubmitRendezvous {
                request,
                events,
                admitted,
            } => {
                let id = request.id;
                let own = self
                    .engine
                    .cached_prefix_blocks(&request.prompt, request.hash_seed);
                // The engine names the lease only in `RendezvousDone`; the
                // remote lease is kept here, by request, once delivered.
                let placeholder = LeaseRef {
                    id: LeaseId(0),
                    token: 0,
                };
                match self.engine.add_rendezvous_request(request, placeholder) {
                    Ok(()) => {
                        self.streams.insert(id, events);
                        if admitted.send(Ok(own)).is_err() {
                            // The handler is gone: nothing will deliver.
                            self.cancel(id);
                        }
                    }
                    Err(err) => {
                        self.metrics.count_request(RequestOutcome::Rejected);
                        let _ = admitted.send(Err(err));
                    }
                }
            }
            Command::Deliver {
                request,
                kv,
                release,
            } => match self.engine.deliver_rendezvous(request, kv) {
                Ok(()) => {
                    self.remote.insert(request, release);
                }
                // The request is gone (its client hung up) or refused the
                // transfer: the lease is not needed.
                Err(_) => self.send_release(release),
            },
            Command::TransferFailed { request, error } => {
                let events = self.streams.remove(&request);
                if let Ok(Some(_)) = self.engine.cancel(request) {
                    self.metrics.count_request(RequestOutcome::Cancelled);
                }
                if let Some(events) = events {
                    let _ = events.try_send(GenEvent::TransferFailed(error));
                }
            }
            Command::ReadLease(lease, reply) => {
                let _ = reply.send(self.engine.read_lease(lease));
            }
            Command::TakeRoom(room, reply) => {
                let taken = self
                    .rooms
                    .remove(&room)
                    .and_then(|(lease, _)| Some((lease, self.engine.read_lease(lease).ok()?)));
                let _ = reply.send(taken);
            }
            Command::ReleaseLease(lease, reply) => {
                let _ = reply.send(self.engine.release_lease(lease));
            }
            Command::Tick => self.expire(),
            Command::Cancel(id) => self.cancel(id),
            Command::Snapshot(reply) => {
                // Flush first so a reader that saw these events sees this state.
                self.publish();
                let ssm_checkpoints = self
                    .engine
                    .checkpoints()
                    .map(|c| c.hashes().map(switchyard_engine::engine_hash).collect())
                    .unwrap_or_default();
                let _ = reply.send(KvSnapshot {
                    blocks: self.engine.kv().cached_state(),
                    ssm_checkpoints,
                });
            }
        }
    }

    fn now_ms(&self) -> f64 {
        self.started.elapsed().as_secs_f64() * 1e3
    }

    /// Expires the engine's leases past their time, and the rooms of the
    /// leases gone with them.
    fn expire(&mut self) {
        let now = self.now_ms();
        self.engine.expire_leases(now);
        self.rooms.retain(|_, (_, expires)| *expires > now);
    }

    /// Queues a remote lease's release; a full queue drops and counts it
    /// (the lease then expires at its worker).
    fn send_release(&mut self, release: RemoteLease) {
        let sent = self
            .disagg
            .as_ref()
            .is_some_and(|d| d.releases.try_send(release).is_ok());
        if !sent {
            self.metrics
                .count_disagg_failure(DisaggFailure::ReleaseDropped);
        }
    }

    /// Captures a finished prefill's prompt KV; the result goes to its
    /// client before `Finished`.
    fn capture(&mut self, prompt: &[u32], hash_seed: u64, capture: Capture) -> GenEvent {
        let (ttl, max_rooms) = match &self.disagg {
            Some(d) => (d.lease_ttl_ms, d.max_rooms),
            None => return GenEvent::CaptureRefused(DisaggFailure::CaptureRefused),
        };
        if let Some(room) = capture.room {
            if self.rooms.contains_key(&room) {
                return self.refuse_capture(DisaggFailure::RoomConflict);
            }
            if self.rooms.len() >= max_rooms {
                return self.refuse_capture(DisaggFailure::RoomsFull);
            }
        }
        let expires = self.now_ms() + ttl;
        let lease = match self
            .engine
            .capture(prompt, hash_seed, capture.token, expires)
        {
            Ok((lease, _)) => lease,
            Err(LeaseError::NothingCached) => {
                return self.refuse_capture(DisaggFailure::NothingCached)
            }
            Err(_) => return self.refuse_capture(DisaggFailure::CaptureRefused),
        };
        let block_ids = match self.engine.read_lease(lease) {
            Ok(kv) => kv.hashes.iter().map(|h| h.0).collect(),
            Err(_) => return self.refuse_capture(DisaggFailure::CaptureRefused),
        };
        if let Some(room) = capture.room {
            self.rooms.insert(room, (lease, expires));
        }
        self.metrics.disagg_captures.inc();
        GenEvent::Captured { lease, block_ids }
    }

    fn refuse_capture(&self, why: DisaggFailure) -> GenEvent {
        self.metrics.count_disagg_failure(why);
        GenEvent::CaptureRefused(why)
    }

    fn cancel(&mut self, id: RequestId) {
        self.streams.remove(&id);
        self.captures.remove(&id);
        if let Ok(Some(_)) = self.engine.cancel(id) {
            self.metrics.count_request(RequestOutcome::Cancelled);
        }
    }

    fn dispatch(&mut self, report: &StepReport) {
        for out in &report.tokens {
            if let Some(tx) = self.streams.get(&out.request) {
                let event = GenEvent::Token {
                    token: out.token,
                    index: out.index,
                };
                if tx.try_send(event).is_err() {
                    self.hung_up.push(out.request);
                }
            }
        }
        for f in &report.finished {
            let captured = match self.captures.remove(&f.request) {
                Some((prompt, hash_seed, capture)) if f.reason == FinishReason::Length => {
                    Some(self.capture(&prompt, hash_seed, capture))
                }
                _ => None,
            };
            if let (Some(event), Some(tx)) = (captured, self.streams.get(&f.request)) {
                let _ = tx.try_send(event);
            }
            let outcome = match f.reason {
                FinishReason::Length => RequestOutcome::Finished,
                FinishReason::Cancelled => RequestOutcome::Cancelled,
                FinishReason::RestoreFailed => RequestOutcome::RestoreFailed,
            };
            self.metrics.count_request(outcome);
            if let Some(tx) = self.streams.remove(&f.request) {
                let _ = tx.try_send(GenEvent::Finished {
                    reason: f.reason,
                    prompt_tokens: f.prompt_tokens,
                    cached_tokens: f.cached_tokens,
                    output_tokens: f.output_tokens,
                });
            }
        }
        let mut hung_up = std::mem::take(&mut self.hung_up);
        for id in hung_up.drain(..) {
            self.cancel(id);
        }
        self.hung_up = hung_up;
    }

    fn publish(&mut self) {
        self.engine.drain_kv_events(&mut self.events);
        let mut observations = std::mem::take(&mut self.observations);
        self.engine.drain_observations(&mut observations);
        for o in observations.drain(..) {
            if let Observation::RendezvousDone { request, .. } = o {
                if let Some(release) = self.remote.remove(&request) {
                    self.send_release(release);
                }
            }
        }
        self.observations = observations;
        let cap = self.engine.config().max_buffered_events;
        if self.events.len() > cap {
            let dropped = (self.events.len() - cap) as u64;
            self.events.truncate(cap);
            self.metrics.kv_events_dropped.inc_by(dropped);
        }
        let new_events = self.events.len().saturating_sub(self.held_events) as u64;
        self.metrics.kv_events.inc_by(new_events);
        self.held_events = 0;
        if !self.events.is_empty() {
            match &self.kv_sink {
                Some(sink) => match sink.try_send(std::mem::take(&mut self.events)) {
                    Ok(()) => {}
                    Err(TrySendError::Full(batch)) => {
                        self.held_events = batch.len();
                        self.events = batch;
                    }
                    Err(TrySendError::Closed(batch)) => {
                        self.metrics.kv_events_dropped.inc_by(batch.len() as u64);
                    }
                },
                None => self.events.clear(),
            }
        }
        self.metrics.observe(&self.engine);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: f64) -> Duration {
        Duration::from_secs_f64(n / 1e3)
    }

    #[test]
    fn each_deadline_counts_from_the_previous_deadline_not_from_the_wake_up() {
        let t0 = Instant::now();
        let mut pacer = Pacer::new(MAX_LAG);
        let first = pacer.schedule(t0, ms(1.5));
        assert_eq!(first.deadline, t0 + ms(1.5));
        // The timer woke 0.5 ms late; the next step is still due 1.5 ms
        // after the first one's deadline, not after the wake-up.
        let second = pacer.schedule(t0 + ms(2.0), ms(1.5));
        assert_eq!(second.deadline, t0 + ms(3.0));
        assert_eq!(second.dropped, Duration::ZERO);
        // Ten steps woken late each still end where the model says.
        let mut now = second.deadline;
        let mut last = second;
        for _ in 0..10 {
            now = last.deadline + ms(0.9);
            last = pacer.schedule(now, ms(1.5));
        }
        assert_eq!(last.deadline, t0 + ms(18.0));
        assert!(now < last.deadline);
    }

    #[test]
    fn a_late_worker_catches_up_back_to_back_within_the_bound() {
        let t0 = Instant::now();
        let mut pacer = Pacer::new(ms(5.0));
        pacer.schedule(t0, ms(0.25));
        // Launched 4 ms after the last deadline: within the bound, so the
        // step keeps its nominal start and is already due.
        let late = t0 + ms(4.25);
        let step = pacer.schedule(late, ms(0.25));
        assert_eq!(step.deadline, t0 + ms(0.5));
        assert!(step.deadline <= late, "due at once: catching up");
        assert_eq!(step.dropped, Duration::ZERO);
        // Steps launched at that same instant stay due until caught up.
        let mut due_at_once = 1;
        while pacer.schedule(late, ms(0.25)).deadline <= late {
            due_at_once += 1;
        }
        assert_eq!(
            due_at_once, 16,
            "4 ms of 0.25 ms steps, then back on schedule"
        );
    }

    #[test]
    fn beyond_the_bound_the_worker_resynchronises_and_counts_what_it_gave_up() {
        let t0 = Instant::now();
        let mut pacer = Pacer::new(ms(5.0));
        pacer.schedule(t0, ms(1.0));
        let stalled = t0 + ms(31.0);
        let step = pacer.schedule(stalled, ms(1.0));
        assert_eq!(step.dropped, ms(30.0));
        assert_eq!(step.deadline, stalled + ms(1.0));
        // And from there on the schedule holds again.
        let next = pacer.schedule(step.deadline + ms(0.2), ms(1.0));
        assert_eq!(
            (next.deadline, next.dropped),
            (stalled + ms(2.0), Duration::ZERO)
        );
    }

    #[test]
    fn after_an_idle_spell_the_next_step_starts_when_it_launches() {
        let t0 = Instant::now();
        let mut pacer = Pacer::new(MAX_LAG);
        pacer.schedule(t0, ms(1.0));
        pacer.idle();
        let later = t0 + ms(500.0);
        let step = pacer.schedule(later, ms(2.0));
        assert_eq!(
            (step.deadline, step.dropped),
            (later + ms(2.0), Duration::ZERO)
        );
    }
}
