//! A turn's way onto an engine: submitted to the replica the load balancer
//! picks, the dispatcher's effects carried out, and the placed request
//! started on its engine (once its adapter is loaded).

use super::config::DisaggConfig;
use super::disagg::Handoff;
use super::event::Event;
use super::{InFlight, Payload, Phase, Simulation};
use crate::workload::SessionFlow;
use std::sync::Arc;
use switchyard_core::admission::ask::Asked;
use switchyard_core::admission::{Flow, FlowPolicy, SessionKey};
use switchyard_core::dispatch::{request_of, Dispatch, Effects, Half, Submission};
use switchyard_core::hashing::{local_block_hashes, seed_for};
use switchyard_core::RequestId;
use switchyard_engine::NewRequest;

impl Simulation {
    fn request_id(session: u64, turn: usize) -> RequestId {
        RequestId(u128::from(session) << 32 | turn as u128)
    }

    /// The replica the load balancer hands a turn to: a session-affinity
    /// balancer keeps a session's turns together when admission is
    /// session-aware.
    pub(super) fn pick_replica(&mut self, session: u64, multi_turn: bool) -> usize {
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
    pub(super) fn lora_of(&self, session: u64) -> Option<Arc<str>> {
        let mix = self.config.adapters?;
        let k = mix.adapter_of(&self.adapter_cdf, session);
        Some(crate::adapters::adapter_name(k).into())
    }

    pub(super) fn arrive(&mut self, session: u64, turn: usize) {
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
        let session_flow = s.flow;
        let id = Self::request_id(session, turn);
        let replica = self.pick_replica(session, multi_turn);
        let flow = Self::flow_of(
            self.replicas[replica].dispatcher.flows(),
            session_flow,
            output_tokens,
            self.now,
        );
        let Some(eligible) = self.chain_eligible(replica, session, turn) else {
            // Its previous response is known nowhere: the turn ends.
            self.chain_broken += 1;
            self.fail(session);
            return;
        };
        let submission = Submission {
            blocks,
            prompt_tokens: tokens.len() as u32,
            session: multi_turn.then_some(SessionKey(session)),
            adapter,
            flow,
            eligible,
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
                flow,
                resumed: None,
            },
        );
        let plan = self.split_plan();
        let dispatcher = &mut self.replicas[replica].dispatcher;
        let submitted = match plan {
            None => dispatcher.submit(id, submission, self.now),
            Some(plan) => dispatcher.submit_split(id, submission, plan, self.now),
        };
        match submitted {
            Ok((_, fx)) => self.carry_out(replica, fx),
            Err(_) => {
                self.payloads.remove(&id);
                self.fail(session);
            }
        }
    }

    /// A turn's flow as `serve` would resolve it: the session's tenant,
    /// the band it asks for capped by the tenant's ceiling (its own band
    /// when it asks for none), its TTFT budget from now, and its output
    /// length as the expected output (a request that asks for exactly
    /// that much, priced by the core's [`Asked`]).
    fn flow_of(flows: &FlowPolicy, session: SessionFlow, output_tokens: u32, now_ms: f64) -> Flow {
        Flow {
            tenant: session.tenant,
            band: flows.cap_band(session.tenant, session.band),
            deadline_ms: session.ttft_budget_ms.map(|b| now_ms + f64::from(b)),
            expected_output_tokens: Asked {
                choices: 1,
                output_tokens: Some(output_tokens),
            }
            .expected_output_tokens(),
        }
    }

    /// Carries out what a dispatcher asked for, and whatever that leads to
    /// (a peer's dispatches at sync delay 0, an engine refusal's free), in
    /// order.
    pub(super) fn carry_out(&mut self, replica: usize, fx: Effects) {
        self.effects.push_back((replica, fx));
        while let Some((replica, fx)) = self.effects.pop_front() {
            let Effects {
                dispatch,
                no_worker,
                shed,
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
                // A half no worker can take ends its request.
                let id = request_of(id);
                self.drop_handoff(id);
                if let Some(p) = self.payloads.remove(&id) {
                    self.fail(p.session);
                }
            }
            for s in shed {
                // A shed half ends its request (both halves are shed).
                let id = request_of(s.id);
                self.drop_handoff(id);
                self.shed(id, s.reason);
            }
        }
    }

    /// Hands a dispatched (and booked) request to its engine.
    fn start(&mut self, replica: usize, sent: Dispatch) {
        let id = sent.id;
        let Some(worker) = self.engine_for(sent.worker) else {
            // Not a target of this fleet: nothing can run it.
            self.drop_handoff(request_of(id));
            let fx = self.replicas[replica].dispatcher.abort(id, self.now);
            self.effects.push_back((replica, fx));
            if let Some(p) = self.payloads.remove(&request_of(id)) {
                self.fail(p.session);
            }
            return;
        };
        if self.workers[worker].down {
            self.refused_by_down_worker(replica, &sent);
            return;
        }
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
        let phase = match sent.half {
            None => Phase::Whole,
            Some(Half::Prefill) => Phase::Prefill,
            Some(Half::Decode) => Phase::Decode,
        };
        // A prefill half leaves its request's prompt for the decode half.
        let payload = match phase {
            Phase::Prefill => self.payloads.get(&request_of(id)).cloned(),
            Phase::Whole | Phase::Decode => self.payloads.remove(&id),
        };
        let Some(p) = payload else {
            self.drop_handoff(request_of(id));
            let fx = self.replicas[replica].dispatcher.abort(id, self.now);
            self.effects.push_back((replica, fx));
            return;
        };
        let prompt_tokens = p.tokens.len() as u32;
        let cached = (u64::from(sent.overlap_blocks) * self.config.engine.block_size as u64)
            .min(u64::from(prompt_tokens));
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
                    self.handoffs.insert(id, Handoff { lease });
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
                // prefill worker.
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
            // The engine refused it: the request ends (both halves).
            self.drop_handoff(request_of(id));
            self.payloads.remove(&request_of(id));
            let dispatcher = &mut self.replicas[replica].dispatcher;
            let mut fx = dispatcher.abort(id, self.now);
            fx.append(dispatcher.abort(request_of(id), self.now));
            self.effects.push_back((replica, fx));
            self.fail(p.session);
            return;
        }
        self.workers[worker].booked += 1;
        self.replicas[replica].routed += 1;
        self.queue.push(sent.waited_ms);
        self.tally(p.session).wait.push(sent.waited_ms);
        let before = p.resumed.map_or(0, |r| r.generated);
        self.in_flight.insert(
            id,
            InFlight {
                session: p.session,
                turn: p.turn,
                arrival_ms: p.arrival_ms,
                prompt_tokens,
                predicted_tokens: cached,
                first_token_ms: p.resumed.map(|r| r.first_token_ms),
                last_token_ms: p.resumed.map_or(self.now, |r| r.last_token_ms),
                itl_share_ms: 0.0,
                worker,
                replica,
                progress: sent.progress,
                phase,
                flow: p.flow,
                generated: before,
                generated_before: before,
                placement_started: false,
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
        let (at, loaded) =
            self.workers[worker]
                .adapters
                .acquire(&name, unload, load_wall_ms, self.now);
        let figures = &mut self.adapter_figures;
        figures.requests += 1;
        figures.loads += u64::from(loaded);
        figures.waited += u64::from(at > self.now);
        Some(at)
    }
}
