//! Worker failures ([`FleetConfig::failures`](super::FleetConfig)): a
//! worker's engine dies at a set instant, and the requests it had take the
//! server's way out, decided by the same core call
//! ([`FailureHistory::fail`]) and carried out with the same dispatcher
//! calls (`worker_failed`, `migrate`, `abort`).
//!
//! - **Down**: the engine and everything in it are gone (its KV cache, its
//!   queue, its loaded adapters; a step under way never ends). Each of its
//!   requests failed: one without a first token as a broken connection
//!   ([`Failure::Reset`]), retried as it came; one mid-stream
//!   ([`Failure::MidStream`]) resumed elsewhere with the tokens already
//!   streamed appended to its prompt and its output limit reduced by them,
//!   as `serve` resumes a stream by token ids. A request placed on a down
//!   worker is refused ([`Failure::Connect`]: the worker never saw it).
//!   The routers learn of the death only through these failures (their
//!   circuit breakers), as `serve` does.
//! - **Up** (after `down_ms`, when given): a fresh engine with an empty
//!   cache; the routers are told its cache is empty (`Cleared`) after the
//!   KV event delay, as `serve`'s KV subscriber clears a worker whose
//!   event sequence restarts.
//!
//! Counted per run: [`FailureFigures`]. Not modelled here: disaggregated
//! fleets, data-parallel ranks and peer restore (refused with a failure),
//! timeouts and 5xx answers (an engine here either runs or is down).

use super::event::Event;
use super::{Payload, Resumed, SimError, Simulation};
use crate::report::FailureFigures;
use serde::{Deserialize, Serialize};
use switchyard_core::dispatch::failure::{AttemptFailure, Failure, Phase, Progress, Verdict};
use switchyard_core::hashing::{local_block_hashes, seed_for};
use switchyard_core::index::{CacheTier, IndexEvent};
use switchyard_core::RequestId;

/// One worker's failure in a run: down at `at_ms`, up again `down_ms`
/// later (`None`: down for the rest of the run).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerFailure {
    /// When it goes down (simulated ms from the start).
    pub at_ms: f64,
    /// Which worker (0-based).
    pub worker: usize,
    /// How long it stays down.
    #[serde(default)]
    pub down_ms: Option<f64>,
}

impl WorkerFailure {
    /// Reads `AT_S:WORKER[:DOWN_S]` (seconds; a worker index from 0), as
    /// `replay --fail-worker` takes it.
    pub fn parse(spec: &str) -> Result<Self, String> {
        let parts: Vec<&str> = spec.split(':').collect();
        let secs = |s: &str, what: &str| {
            s.trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v >= 0.0)
                .ok_or_else(|| format!("{what} {s:?} is not a number of seconds >= 0"))
        };
        let (at, worker, down) = match parts.as_slice() {
            [at, worker] => (at, worker, None),
            [at, worker, down] => (at, worker, Some(secs(down, "the time down")?)),
            _ => return Err(format!("{spec:?} is not AT_S:WORKER[:DOWN_S]")),
        };
        let worker = worker
            .trim()
            .parse::<usize>()
            .map_err(|_| format!("worker {worker:?} is not a worker index (0, 1, ...)"))?;
        Ok(Self {
            at_ms: secs(at, "the failure time")? * 1e3,
            worker,
            down_ms: down.map(|d| d * 1e3),
        })
    }

    /// Refuses a failure the fleet cannot have.
    pub(super) fn validate(&self, workers: usize) -> Result<(), String> {
        if self.worker >= workers {
            return Err(format!(
                "worker {} fails, but the fleet has {workers} (0..{})",
                self.worker,
                workers.saturating_sub(1)
            ));
        }
        if !(self.at_ms.is_finite() && self.at_ms >= 0.0) {
            return Err(format!(
                "a failure time must be >= 0, got {} ms",
                self.at_ms
            ));
        }
        if let Some(d) = self.down_ms {
            if !(d.is_finite() && d > 0.0) {
                return Err(format!("a time down must be > 0, got {d} ms"));
            }
        }
        Ok(())
    }
}

/// Why the simulator refuses worker failures in this configuration.
pub(super) fn check(config: &super::FleetConfig) -> Result<(), SimError> {
    if config.failures.is_empty() {
        return Ok(());
    }
    if config.disagg.is_some() || config.dp.is_some() || config.peer_restore.is_some() {
        return Err(SimError::Failures(
            "worker failures are not modelled with disaggregation, data-parallel ranks or peer restore".to_owned(),
        ));
    }
    for f in &config.failures {
        f.validate(config.workers).map_err(SimError::Failures)?;
    }
    Ok(())
}

/// Where a failed request was.
pub(super) struct Failed {
    pub(super) id: RequestId,
    pub(super) replica: usize,
    pub(super) session: u64,
    pub(super) turn: usize,
    pub(super) arrival_ms: f64,
    pub(super) flow: switchyard_core::admission::Flow,
    pub(super) reason: Failure,
    /// Its placement's prompt length (a resumed one's includes what it
    /// had generated before).
    pub(super) prompt_tokens: u32,
    /// Tokens streamed to the client so far, over all its placements.
    pub(super) generated: u32,
    /// Its first and last client tokens, when it had any.
    pub(super) tokens_at: Option<(f64, f64)>,
}

impl Simulation {
    /// Schedules the configured failures (and restarts).
    pub(super) fn schedule_failures(&mut self) {
        for f in self.config.failures.clone() {
            self.schedule(f.at_ms, Event::WorkerDown { worker: f.worker });
            if let Some(down) = f.down_ms {
                self.schedule(f.at_ms + down, Event::WorkerUp { worker: f.worker });
            }
        }
    }

    /// `worker` dies: a fresh engine takes its place (empty, and refusing
    /// nothing: it is unreachable until [`Self::worker_up`]), and each of
    /// its requests fails.
    pub(super) fn worker_down(&mut self, worker: usize) -> Result<(), SimError> {
        if self.workers[worker].down {
            return Ok(());
        }
        let fresh = self.fresh_engine()?;
        let events = self.event_stream();
        let w = &mut self.workers[worker];
        w.down = true;
        w.epoch += 1;
        w.engine = fresh;
        w.busy = false;
        w.pending = Default::default();
        w.booked = 0;
        w.adapters = w.adapters.emptied();
        w.events = events;
        let mut lost: Vec<RequestId> = self
            .in_flight
            .iter()
            .filter(|(_, r)| r.worker == worker)
            .map(|(id, _)| *id)
            .collect();
        lost.sort_unstable();
        for id in lost {
            let Some(r) = self.in_flight.remove(&id) else {
                continue;
            };
            let tokens_at = r.first_token_ms.map(|first| (first, r.last_token_ms));
            self.attempt_failed(Failed {
                id,
                replica: r.replica,
                session: r.session,
                turn: r.turn,
                arrival_ms: r.arrival_ms,
                flow: r.flow,
                reason: if tokens_at.is_some() {
                    Failure::MidStream
                } else {
                    Failure::Reset
                },
                prompt_tokens: r.prompt_tokens,
                generated: r.generated,
                tokens_at,
            });
        }
        Ok(())
    }

    /// `worker` is back with an empty engine; the routers hear that its
    /// cache is empty after the KV event delay.
    pub(super) fn worker_up(&mut self, worker: usize) {
        self.workers[worker].down = false;
        let at = self.now + self.config.kv_event_delay_ms;
        self.schedule(
            at,
            Event::KvDelivery {
                worker,
                events: vec![(CacheTier::Device, IndexEvent::Cleared)],
            },
        );
    }

    /// A failed attempt, decided by the core and carried out: the worker
    /// reported, then the request moved (its payload back, a fresh
    /// booking id) or given up (aborted; its session ends as on an error).
    pub(super) fn attempt_failed(&mut self, failed: Failed) {
        let Some(payload) = self.payload_of(&failed) else {
            // Its session is gone: nothing to move.
            let fx = self.replicas[failed.replica]
                .dispatcher
                .abort(failed.id, self.now);
            self.effects.push_back((failed.replica, fx));
            return;
        };
        let Failed {
            id,
            replica,
            reason,
            prompt_tokens,
            generated,
            tokens_at,
            ..
        } = failed;
        let mut progress = Progress::default();
        progress.generated = u64::from(generated);
        let phase = if tokens_at.is_some() {
            Phase::MidStream
        } else {
            Phase::BeforeFirstToken
        };
        let history = self.failure_histories.entry(id).or_default();
        let decided = history.fail(
            self.config.migration,
            AttemptFailure {
                reason,
                phase,
                prompt_tokens: u64::from(prompt_tokens),
                progress: &progress,
                // The simulator's requests are plain text: what a resume
                // reproduces.
                resumable: Ok(()),
            },
        );
        self.failure_figures.failed_attempts += 1;
        let dispatcher = &mut self.replicas[replica].dispatcher;
        if decided.report_worker {
            let fx = dispatcher.worker_failed(id, self.now);
            self.effects.push_back((replica, fx));
        }
        if let Verdict::GiveUp(why) = decided.verdict {
            *self
                .failure_figures
                .gave_up_by_reason
                .entry(why.label())
                .or_default() += 1;
            self.give_up(id, replica, payload.session);
            return;
        }
        let resumed = payload.resumed.is_some();
        let prompt = resumed.then(|| {
            let seed = seed_for(self.lora_of(payload.session).as_deref(), None);
            let blocks = local_block_hashes(&payload.tokens, self.config.engine.block_size, seed);
            (blocks, payload.tokens.len() as u32)
        });
        let session = payload.session;
        self.next_booking += 1;
        let booking = RequestId(BOOKING_BIT | self.next_booking);
        self.payloads.insert(id, payload);
        match self.replicas[replica]
            .dispatcher
            .migrate(id, booking, prompt, self.now)
        {
            Ok(fx) => {
                if resumed {
                    self.failure_figures.resumed += 1;
                } else {
                    self.failure_figures.retried += 1;
                }
                self.effects.push_back((replica, fx));
            }
            Err(_) => {
                // Ended meanwhile (cannot happen: it was just placed).
                self.payloads.remove(&id);
                self.give_up(id, replica, session);
            }
        }
    }

    /// A request not moved on: aborted, counted, its session ended.
    fn give_up(&mut self, id: RequestId, replica: usize, session: u64) {
        self.failure_histories.remove(&id);
        self.failure_figures.gave_up += 1;
        let fx = self.replicas[replica].dispatcher.abort(id, self.now);
        self.effects.push_back((replica, fx));
        self.fail(session);
    }

    /// The payload that places a failed request again: its turn's prompt
    /// as the trace gives it, and after streamed tokens those tokens' ids
    /// appended and the output limit reduced by them.
    fn payload_of(&self, failed: &Failed) -> Option<Payload> {
        if let Some(p) = self.payloads.get(&failed.id) {
            // Refused before it reached an engine: placed as it was.
            return Some(p.clone());
        }
        let spec = self.sessions.get(&failed.session)?.turns.get(failed.turn)?;
        let mut tokens = spec.prompt.tokens();
        let generated = failed.generated;
        let resumed = failed.tokens_at.map(|(first_token_ms, last_token_ms)| {
            tokens.extend((0..generated).map(generated_token));
            Resumed {
                first_token_ms,
                last_token_ms,
                generated,
            }
        });
        Some(Payload {
            session: failed.session,
            turn: failed.turn,
            arrival_ms: failed.arrival_ms,
            tokens,
            output_tokens: spec.output_tokens.saturating_sub(generated).max(1),
            flow: failed.flow,
            resumed,
        })
    }

    /// A request placed on a worker that is down: refused, as a
    /// connection to a dead worker is (it never saw the prompt).
    pub(super) fn refused_by_down_worker(
        &mut self,
        replica: usize,
        sent: &switchyard_core::dispatch::Dispatch,
    ) {
        let Some(p) = self.payloads.get(&sent.id) else {
            let fx = self.replicas[replica].dispatcher.abort(sent.id, self.now);
            self.effects.push_back((replica, fx));
            return;
        };
        let failed = Failed {
            id: sent.id,
            replica,
            session: p.session,
            turn: p.turn,
            arrival_ms: p.arrival_ms,
            flow: p.flow,
            reason: Failure::Connect,
            prompt_tokens: p.tokens.len() as u32,
            generated: p.resumed.map_or(0, |r| r.generated),
            tokens_at: p.resumed.map(|r| (r.first_token_ms, r.last_token_ms)),
        };
        self.attempt_failed(failed);
    }

    /// What the failures did, when the run had any.
    pub(super) fn failure_figures(&self) -> Option<FailureFigures> {
        (!self.config.failures.is_empty()).then(|| self.failure_figures.clone())
    }
}

/// The bit that marks a booking id a migration made (below the prefill
/// half's bit 126; a request id uses at most 96 bits).
const BOOKING_BIT: u128 = 1 << 125;

/// The id the `k`-th generated token is resumed with: the simulated
/// engine's output ids stand for no text, so a resumed prompt only needs
/// ids no trace prompt uses (the top of the id space).
fn generated_token(k: u32) -> u32 {
    u32::MAX - (k % 1_000_000)
}
