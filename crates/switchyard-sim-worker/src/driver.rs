//! The real-time driver: one tokio task owns the engine core and steps it,
//! pacing each step by the timing model divided by the speed-up factor.
//!
//! HTTP handlers talk to it only through a bounded command channel; each
//! request gets a channel of its own sized to its `max_tokens`, so the driver
//! never waits on a client. A request whose receiver is gone (the client
//! hung up) is cancelled at the next token.

use super::metrics::{Metrics, RequestOutcome};
use rustc_hash::FxHashMap;
use std::sync::Arc;
use std::time::Duration;
use switchyard_core::{EngineHash, RequestId};
use switchyard_engine::scheduler::AdmitError;
use switchyard_engine::{
    Engine, FinishReason, KvEvent, Medium, NewRequest, StepReport, SyncDevice,
};
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

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

/// Starts the driver task. KV events go to `kv_sink` when given; while the
/// sink is full they wait in the driver (up to the engine's event buffer
/// size; beyond it the newest are dropped and counted).
pub fn spawn(
    engine: Engine<SyncDevice>,
    metrics: Arc<Metrics>,
    kv_sink: Option<mpsc::Sender<Vec<KvEvent>>>,
) -> DriverHandle {
    let (tx, rx) = mpsc::channel(1024);
    tokio::spawn(run(engine, rx, metrics, kv_sink));
    DriverHandle { commands: tx }
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

async fn run(
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
    loop {
        if !driver.engine.has_work() {
            match commands.recv().await {
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
        let started = Instant::now();
        if let Err(err) = driver.engine.step(&mut report) {
            // The simulated device has no faults; a contract error is a bug.
            eprintln!("switchyard sim-worker: engine step failed: {err}");
            return;
        }
        driver.dispatch(&report);
        driver.publish();
        let wall_ms = driver.engine.config().timing.wall_ms(report.model_ms);
        if wall_ms > 0.0 {
            tokio::time::sleep_until(started + Duration::from_secs_f64(wall_ms / 1e3)).await;
        } else {
            tokio::task::yield_now().await;
        }
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
