//! Disaggregated requests and borrowed prefixes: a prefill half's capture
//! handed to its decode half, a holder's prefix lent to the worker a request
//! was placed on, the transfer between them, and their leases' ends.

use super::event::Event;
use super::Simulation;
use std::sync::Arc;
use switchyard_core::dispatch::{request_of, Pairing, SplitPlan};
use switchyard_core::eligibility::{eligible_in, Candidate, Role};
use switchyard_core::hashing::seed_for;
use switchyard_core::{Eligible, RequestId};
use switchyard_engine::lease::LeaseRef;
use switchyard_engine::{NewRequest, Observation};

/// Where a request's prompt KV is held for it to restore: its prefill
/// half's worker and lease (a disaggregated request), or the peer lending
/// it a prefix; `None` once the capture failed.
pub(super) struct Handoff {
    pub(super) lease: Option<(usize, LeaseRef)>,
}

impl Simulation {
    /// With disaggregation, how a request's halves are placed: the
    /// prefill pool, then (once the prefill handed its KV over) the decode
    /// pool. The simulated link never loses a transfer.
    /// The pools are the core's eligibility (`serve`'s too): the first
    /// `prefill_workers` engines have role prefill, the rest decode.
    pub(super) fn split_plan(&self) -> Option<SplitPlan> {
        let d = self.config.disagg.as_ref()?;
        let candidates = self.workers.iter().enumerate().map(|(i, w)| Candidate {
            id: w.id,
            models: &[],
            in_router: !w.down,
            draining: false,
            role: if i < d.prefill_workers {
                Role::Prefill
            } else {
                Role::Decode
            },
        });
        let pool =
            |role| eligible_in(candidates.clone(), None, role).unwrap_or_else(|_| Eligible::none());
        Some(SplitPlan {
            pairing: Pairing::AfterPrefill,
            prefill_pool: pool(Role::Prefill),
            decode_pool: pool(Role::Decode),
            transfer_limit: 0,
        })
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

    /// The prefill half `prefill` ended on `worker` (routed by `replica`):
    /// its prompt's KV is captured there, and the dispatcher ends the half
    /// and places the decode half.
    pub(super) fn hand_off(&mut self, worker: usize, replica: usize, prefill: RequestId) {
        let id = request_of(prefill);
        let Some(p) = self.payloads.get(&id) else {
            // The request ended meanwhile: so does its prefill half.
            let fx = self.replicas[replica].dispatcher.abort(prefill, self.now);
            self.carry_out(replica, fx);
            return;
        };
        let ttl = self.config.disagg.map_or(0.0, |d| d.lease_ttl_ms);
        // The secret would come from a CSPRNG in a real driver; the
        // simulator has no adversary and stays deterministic.
        let token = id.0 ^ 0x5eed_5eed_5eed_5eed;
        let seed = seed_for(self.lora_of(p.session).as_deref(), None);
        let lease = self.workers[worker]
            .engine
            .capture(&p.tokens, seed, token, self.now + ttl)
            .ok()
            .map(|(lease, _)| (worker, lease));
        self.handoffs.insert(id, Handoff { lease });
        let fx = self.replicas[replica].dispatcher.handed_over(id, self.now);
        self.carry_out(replica, fx);
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
