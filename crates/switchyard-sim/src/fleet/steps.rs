//! The workers' engines: a step launched on an idle worker, and what it
//! carries back when it ends (tokens to the clients and first and last
//! tokens to the routing replica, finished requests, KV events and usage
//! for the routers, the session's next turn and the sessions a turn
//! spawns).

use super::event::Event;
use super::{Phase, Simulation};
use switchyard_engine::StepReport;

impl Simulation {
    /// Launches a step on an idle worker that has work.
    pub(super) fn kick(&mut self, worker: usize) {
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
                let epoch = w.epoch;
                self.schedule(self.now + retry, Event::StepDone { worker, epoch });
            }
            return;
        }
        w.busy = true;
        let epoch = w.epoch;
        self.schedule(self.now + duration, Event::StepDone { worker, epoch });
    }

    pub(super) fn finish_step(&mut self, worker: usize, progress: &mut impl FnMut(u64)) {
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
        let mut first_client_token = None;
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
            let client = r.phase != Phase::Prefill;
            r.generated = r.generated.saturating_add(u32::from(client));
            let placement_first = !std::mem::replace(&mut r.placement_started, true);
            let first = r.first_token_ms.is_none();
            // A prefill half's token is not the client's.
            if first {
                r.first_token_ms = Some(now);
                if client {
                    self.ttft.push(now - r.arrival_ms);
                    first_client_token = Some((r.session, now - r.arrival_ms));
                }
            } else if client {
                self.itl.push(r.itl_share_ms);
            }
            r.last_token_ms = now;
            let replica = r.replica;
            if let Some((session, ttft)) = first_client_token.take() {
                self.tally(session).ttft.push(ttft);
            }
            if placement_first {
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
            self.failure_histories.remove(&done.request);
            self.workers[r.worker].booked = self.workers[r.worker].booked.saturating_sub(1);
            if r.phase == Phase::Prefill {
                // The prompt's cache hit is the prefill worker's.
                self.prompt_tokens += u64::from(r.prompt_tokens);
                self.cached_tokens += done.cached_tokens as u64;
                if r.turn == 0 {
                    self.bursts
                        .first_call_ended(r.session, done.cached_tokens as u64);
                }
                self.predicted_tokens += r.predicted_tokens;
                if done.reason == switchyard_engine::FinishReason::Length {
                    self.hand_off(worker, r.replica, done.request);
                } else {
                    // The prefill did not run to its one token: the
                    // request ends.
                    let id = switchyard_core::dispatch::request_of(done.request);
                    self.payloads.remove(&id);
                    let fx = self.replicas[r.replica].dispatcher.abort(done.request, now);
                    self.carry_out(r.replica, fx);
                    self.fail(r.session);
                }
                continue;
            }
            if r.phase == Phase::Whole {
                self.prompt_tokens += u64::from(r.prompt_tokens);
                self.cached_tokens += done.cached_tokens as u64;
                if r.turn == 0 {
                    self.bursts
                        .first_call_ended(r.session, done.cached_tokens as u64);
                }
                self.predicted_tokens += r.predicted_tokens;
            }
            self.output_tokens += done.output_tokens as u64 + u64::from(r.generated_before);
            self.e2e.push(now - r.arrival_ms);
            self.completed += 1;
            let computed = u64::from(r.prompt_tokens).saturating_sub(done.cached_tokens as u64);
            let tally = self.tally(r.session);
            tally.completed += 1;
            tally.tokens_served += computed + done.output_tokens as u64;
            if self.config.tenant_window_ms.is_some_and(|w| now <= w) {
                let tally = self.tally(r.session);
                tally.tokens_served_in_window += computed + done.output_tokens as u64;
            }
            self.store_response(r.replica, r.worker, r.session, r.turn);
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
        let usage = self.reported_usage(worker);
        let id = self.workers[worker].id;
        for replica in &mut self.replicas {
            replica.dispatcher.report_kv(id, Some(usage));
        }
        self.workers[worker].pending = report;
        self.workers[worker].busy = false;
        self.kick(worker);
    }

    /// After turn `turn` of `session` ended: the sessions it spawns arrive,
    /// and the session's next turn follows its pause (after the spawned
    /// sessions have all ended, when it spawned any), or the session ends.
    fn next_turn(&mut self, session: u64, turn: usize) {
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        let spec = &s.turns[turn];
        let pause = spec.pause_ms.unwrap_or(s.think_time_ms);
        let spawn = spec.spawn.clone();
        let next = (turn + 1 < s.turns.len()).then_some(turn + 1);
        let children = spawn.len();
        if children > 1 {
            let quiet = self.workers.iter().all(|w| w.engine.waiting_len() == 0);
            let block_size = self.config.engine.block_size as u32;
            self.bursts.open(&spawn, block_size, quiet);
        }
        for child in spawn {
            let id = child.id;
            let at = self.now + child.arrival_ms.max(0.0);
            self.sessions.insert(id, child);
            self.parent_of.insert(id, session);
            self.schedule(
                at,
                Event::Turn {
                    session: id,
                    turn: 0,
                },
            );
        }
        match next {
            Some(next) if children > 0 => {
                self.waiting.insert(
                    session,
                    super::Waiting {
                        children,
                        next_turn: next,
                        pause_ms: pause,
                    },
                );
            }
            Some(next) => self.schedule(
                self.now + pause,
                Event::Turn {
                    session,
                    turn: next,
                },
            ),
            None => {
                self.sessions_completed += 1;
                self.end_session(session);
            }
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
}
