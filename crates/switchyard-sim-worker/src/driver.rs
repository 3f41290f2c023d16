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

use super::metrics::{Metrics, RequestOutcome};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use switchyard_core::{EngineHash, RequestId};
use switchyard_engine::scheduler::AdmitError;
use switchyard_engine::{
    Engine, FinishReason, KvEvent, Medium, NewRequest, StepReport, SyncDevice,
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

/// A command for the driver.
#[derive(Debug)]
pub enum Command {
    /// Run a request; its events go to `events` (capacity ≥ `max_tokens + 2`).
    Submit {
        /// The request.
        request: NewRequest,
        /// Where its tokens go.
        events: mpsc::Sender<GenEvent>,
    },
    /// Cancel a request.
    Cancel(RequestId),
    /// Report the cached blocks of both tiers (for `/debug/kv_cache`).
    Snapshot(oneshot::Sender<Vec<(Medium, EngineHash)>>),
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
        let capacity = request.max_tokens as usize + 2;
        let (tx, rx) = mpsc::channel(capacity);
        self.commands
            .send(Command::Submit {
                request,
                events: tx,
            })
            .await
            .ok()?;
        Some(rx)
    }

    /// Cancels a request (harmless when it already finished).
    pub async fn cancel(&self, id: RequestId) {
        let _ = self.commands.send(Command::Cancel(id)).await;
    }

    /// The cached blocks of both tiers, sorted; `None` when the driver stopped.
    pub async fn snapshot(&self) -> Option<Vec<(Medium, EngineHash)>> {
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
    let (tx, rx) = mpsc::channel(1024);
    std::thread::Builder::new()
        .name("sim-worker-engine".into())
        .spawn(move || run(engine, rx, metrics, kv_sink))?;
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

struct Driver {
    engine: Engine<SyncDevice>,
    streams: FxHashMap<RequestId, mpsc::Sender<GenEvent>>,
    metrics: Arc<Metrics>,
    kv_sink: Option<mpsc::Sender<Vec<KvEvent>>>,
    events: Vec<KvEvent>,
    /// Events in `events` already counted (held back by a full sink).
    held_events: usize,
    hung_up: Vec<RequestId>,
}

fn run(
    engine: Engine<SyncDevice>,
    mut commands: mpsc::Receiver<Command>,
    metrics: Arc<Metrics>,
    kv_sink: Option<mpsc::Sender<Vec<KvEvent>>>,
) {
    let mut driver = Driver {
        engine,
        streams: FxHashMap::default(),
        metrics,
        kv_sink,
        events: Vec::new(),
        held_events: 0,
        hung_up: Vec::new(),
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
            Command::Submit { request, events } => {
                let id = request.id;
                match self.engine.add_request(request) {
                    Ok(()) => {
                        self.streams.insert(id, events);
                    }
                    Err(err) => {
                        self.metrics.count_request(RequestOutcome::Rejected);
                        let _ = events.try_send(GenEvent::Rejected(err));
                    }
                }
            }
            Command::Cancel(id) => self.cancel(id),
            Command::Snapshot(reply) => {
                // Flush first so a reader that saw these events sees this state.
                self.publish();
                let _ = reply.send(self.engine.kv().cached_state());
            }
        }
    }

    fn cancel(&mut self, id: RequestId) {
        self.streams.remove(&id);
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
        let mut observations = Vec::new();
        self.engine.drain_observations(&mut observations);
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
