//! Disaggregated requests and borrowed prefixes: a prefill half's capture
//! handed to its decode half, a holder's prefix lent to the worker a request
//! was placed on, the transfer between them, and their leases' ends.

use super::event::Event;
use super::{Payload, Simulation};
use std::sync::Arc;
use switchyard_core::dispatch::Submission;
use switchyard_core::hashing::{local_block_hashes, seed_for};
use switchyard_core::{RequestId, WorkerId};
use switchyard_engine::lease::LeaseRef;
use switchyard_engine::{NewRequest, Observation};

/// The bit that marks a request id as the decode half of a disaggregated
/// request (the top bit is the router's, for peers' bookings).
pub(super) const DECODE_BIT: u128 = 1 << 126;

/// A disaggregated request between its halves: the prompt again (its
/// engine consumed it) and, once captured, where its KV is held.
pub(super) struct Handoff {
    pub(super) tokens: Vec<u32>,
    pub(super) output_tokens: u32,
    /// The prefill worker and its lease, once captured.
    pub(super) lease: Option<(usize, LeaseRef)>,
}

impl Simulation {
    /// The workers a new request may go to: with disaggregation, the
    /// prefill pool (or the decode pool, for `decode`); otherwise all
    /// (empty).
    pub(super) fn role_pool(&self, decode: bool) -> Vec<WorkerId> {
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
    pub(super) fn start_with_lease(
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
    pub(super) fn drop_handoff(&mut self, id: RequestId) {
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
    pub(super) fn hand_off(
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
    pub(super) fn settle_leases(&mut self, worker: usize) {
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
}
