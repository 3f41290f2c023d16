//! Admission (step 2): waiting sequences into the step, in order. A spilled
//! sequence loads its saved state; others take their prefix hit on the
//! device, then the restore protocol ([`crate::restore`]: a rendezvous, or
//! the host tier), then a reservation for their first chunk.

use super::{
    Admission, Engine, EngineError, FinishReason, Observation, Phase, Rendezvous, StepReport,
};
use crate::blocks::SeqId;
use crate::checkpoints::CheckpointPolicy;
use crate::device::{DeviceLayer, Label, Reservation, RestoreSource};
use crate::restore::{
    self, RestoreDecision, RestoreDeferral, RestoreError, RestoreQuery, RestoreTicket,
};

/// Where an admission's restore decision leaves it.
enum RestorePlan {
    /// The admission ends here, with this answer.
    Stop(Admission),
    /// It goes on, restoring this many prompt tokens first (`None`: none).
    Go(Option<usize>),
}

impl<D: DeviceLayer> Engine<D> {
    /// Admits waiting sequences in order while the budget, `max_num_seqs`
    /// and the state slots allow. A request still waiting for its
    /// rendezvous is passed over (`next` moves past it); anything else that
    /// does not fit stops admission.
    pub(super) fn admit_waiting(
        &mut self,
        scheduled: &mut Vec<(SeqId, usize)>,
        mut budget: usize,
        restore_tokens: &mut usize,
        report: &mut StepReport,
    ) -> Result<(), EngineError> {
        let mut next = 0;
        while budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(&id) = self.waiting.get(next) else {
                break;
            };
            // A sequence with state needs a slot to start: none free,
            // none can start.
            if self.config.state_slots > 0 && self.state_slots.allocate(id).is_err() {
                break;
            }
            let admission = self.admit(id, budget, restore_tokens, report)?;
            if !matches!(admission, Admission::Scheduled(_)) {
                self.free_state_slot(id);
            }
            match admission {
                Admission::Scheduled(n) => {
                    self.waiting.remove(next);
                    self.seq_mut(id).phase = Phase::Running;
                    self.running.push(id);
                    scheduled.push((id, n));
                    budget -= n;
                }
                Admission::NotReady => next += 1,
                Admission::Blocked => break,
                Admission::Removed => {
                    self.waiting.remove(next);
                }
            }
        }
        Ok(())
    }

    /// Admits waiting `id` within `budget`: its device hit, its restore
    /// (decided, then installed and acknowledged), then its first chunk.
    fn admit(
        &mut self,
        id: SeqId,
        budget: usize,
        restore_tokens: &mut usize,
        report: &mut StepReport,
    ) -> Result<Admission, EngineError> {
        if let Some(tokens) = self.seq(id).spilled {
            return self.resume_spilled(id, tokens, budget, restore_tokens);
        }
        if self.seq(id).rendezvous.is_none() && self.prefix_in_flight(id) {
            self.counters.prefix_in_flight_waits += 1;
            return Ok(Admission::NotReady);
        }
        let bs = self.config.block_size;
        let (hit, max_hit_blocks) = self.device_hit(id);

        // A deferred restore's source, held (pinned) until this admission
        // is done with it.
        let mut retained = None;
        // The rendezvous, out of the sequence while this admission decides.
        let mut rendezvous = self.seq_mut(id).rendezvous.take();
        let plan = if rendezvous.is_some() {
            self.decide_rendezvous(id, &mut rendezvous, hit, max_hit_blocks, report)?
        } else if self.kv.has_host_tier() {
            self.decide_host_restore(id, &mut retained, hit, max_hit_blocks)
        } else {
            RestorePlan::Go(None)
        };
        let restored = match plan {
            RestorePlan::Stop(admission) => return Ok(admission),
            RestorePlan::Go(restored) => restored,
        };

        let seq = self.slots[id.0 as usize].as_ref().expect("live");
        self.kv.acquire_prefix(id, &seq.hashes[..hit]);
        let mut computed_blocks = hit;
        if let Some(candidate_prefix_tokens) = restored {
            let from_host = rendezvous.is_none();
            let Some(computed_tokens) = self.restore_prefix(
                id,
                hit,
                candidate_prefix_tokens,
                rendezvous.as_ref(),
                retained.take(),
                report,
            )?
            else {
                return Ok(Admission::Removed);
            };
            computed_blocks = computed_tokens / bs;
            // A rendezvous is carried by the transfer, not by the step:
            // only a host-tier copy costs step time.
            if from_host {
                *restore_tokens += computed_tokens - hit * bs;
            }
        }
        drop(retained);
        self.start_admitted(id, computed_blocks, budget)
    }

    /// Whether the first block of `id`'s prompt past its device hit is
    /// being computed now by a running sequence still in its prefill (a
    /// sibling with the same prefix, admitted before it). vLLM caches a
    /// block from the step that schedules it, so a request behind another
    /// with the same prefix computes that prefix once; here the block is
    /// cached when its step ends, so `id` waits for it rather than compute
    /// it a second time.
    fn prefix_in_flight(&mut self, id: SeqId) -> bool {
        let bs = self.config.block_size;
        let seq = self.slots[id.0 as usize].as_mut().expect("live");
        let max_hit_blocks = (seq.tokens.len() - 1) / bs;
        seq.ensure_hashes(max_hit_blocks, bs);
        let hashes = &self.slots[id.0 as usize].as_ref().expect("live").hashes;
        let hit = self.kv.lookup_prefix(&hashes[..max_hit_blocks]);
        let Some(&next) = hashes[..max_hit_blocks].get(hit) else {
            return false;
        };
        self.running.iter().any(|&r| {
            self.slots[r.0 as usize].as_ref().is_some_and(|r| {
                r.num_computed < r.prompt_len
                    && r.num_computed / bs <= hit
                    && r.hashes.get(hit) == Some(&next)
            })
        })
    }

    /// `id`'s prefix hit on the device, in blocks, and the most it could
    /// hit (its full blocks before the last prompt token). A hybrid model
    /// resumes only as deep as its deepest SSM checkpoint within the hit.
    fn device_hit(&mut self, id: SeqId) -> (usize, usize) {
        let bs = self.config.block_size;
        let seq = self.slots[id.0 as usize]
            .as_mut()
            .expect("waiting sequences are live");
        let max_hit_blocks = (seq.tokens.len() - 1) / bs;
        seq.ensure_hashes(max_hit_blocks, bs);
        let mut hit = self.kv.lookup_prefix(&seq.hashes[..max_hit_blocks]);
        if let Some(checkpoints) = self.checkpoints.as_mut() {
            // A hybrid model resumes from its deepest SSM state within the
            // cached attention prefix; what lies beyond is recomputed.
            let usable = checkpoints.deepest(&seq.hashes[..hit]);
            if checkpoints.policy() == CheckpointPolicy::Marconi && usable < hit {
                // The prompt leaves a cached prefix here: a branch point.
                seq.branch_blocks = Some(hit);
            }
            if usable > 0 {
                checkpoints.touch(seq.hashes[usable - 1]);
            }
            if !seq.prompt_counted {
                self.counters.ssm_unusable_hit_tokens += ((hit - usable) * bs) as u64;
            }
            hit = usable;
        }
        (hit, max_hit_blocks)
    }

    /// The restore decision of a request added with a rendezvous (taken
    /// out of it into `rendezvous`): put back while it waits for the
    /// transfer or for capacity, dropped when it recomputes instead. A
    /// transfer holding another prompt's blocks cancels the request.
    fn decide_rendezvous(
        &mut self,
        id: SeqId,
        rendezvous: &mut Option<Rendezvous>,
        hit: usize,
        max_hit_blocks: usize,
        report: &mut StepReport,
    ) -> Result<RestorePlan, EngineError> {
        let bs = self.config.block_size;
        let rv = rendezvous
            .as_mut()
            .expect("decided only for a rendezvous request");
        let seq = self.seq(id);
        let request = seq.request;
        let decided = restore::decide_rendezvous(
            rv.delivered.as_ref(),
            &seq.hashes[..max_hit_blocks],
            hit,
            self.kv.free_blocks(),
            bs,
        );
        let mut decision = match decided {
            Ok(decision) => decision,
            Err(error) => {
                // Another prompt's blocks: cancel, never fall back.
                let lease = rv.lease.id;
                self.counters.restores.failed += 1;
                self.observe(Observation::RestoreFailed {
                    request,
                    error: Some(error),
                });
                self.observe(Observation::RendezvousDone {
                    request,
                    lease,
                    restored: false,
                });
                self.device
                    .release_seq(&mut self.kv, id, false, Label("rendezvous_mismatch"))?;
                let finished = self.remove(id, FinishReason::RestoreFailed);
                report.finished.push(finished);
                return Ok(RestorePlan::Stop(Admission::Removed));
            }
        };
        if matches!(decision, RestoreDecision::SequenceCapacityNotReady { .. })
            && rv.deferrals >= self.config.max_restore_deferrals
        {
            decision = RestoreDecision::NativeRestoreSkipped;
        }
        // Waiting for the transfer is decided once, not every step.
        let first_wait = decision == RestoreDecision::RequestStateNotReady
            && !std::mem::replace(&mut rv.waited, true);
        if decision != RestoreDecision::RequestStateNotReady || first_wait {
            self.note_decision(request, decision);
        }
        Ok(match decision {
            RestoreDecision::RequestStateNotReady => {
                self.seq_mut(id).rendezvous = rendezvous.take();
                RestorePlan::Stop(Admission::NotReady)
            }
            RestoreDecision::SequenceCapacityNotReady { .. } => {
                rv.deferrals += 1;
                self.seq_mut(id).rendezvous = rendezvous.take();
                RestorePlan::Stop(Admission::Blocked)
            }
            RestoreDecision::Restore {
                candidate_prefix_tokens,
            } => RestorePlan::Go(Some(candidate_prefix_tokens)),
            RestoreDecision::NoReusableEntry
            | RestoreDecision::NativeRestoreSkipped
            | RestoreDecision::RetainedSourceLost => {
                let lease = rv.lease.id;
                self.observe(Observation::RendezvousDone {
                    request,
                    lease,
                    restored: false,
                });
                *rendezvous = None;
                RestorePlan::Go(None)
            }
        })
    }

    /// The restore decision from the host tier: a retry restores the
    /// source it was deferred with (moved into `retained`, pinned until the
    /// admission is done with it); a new decision reads the host index. A
    /// deferral pins its source in a new deferral on the sequence.
    fn decide_host_restore(
        &mut self,
        id: SeqId,
        retained: &mut Option<RestoreDeferral>,
        hit: usize,
        max_hit_blocks: usize,
    ) -> RestorePlan {
        let bs = self.config.block_size;
        let timing = &self.config.timing;
        let seq = self.slots[id.0 as usize].as_mut().expect("live");
        *retained = seq.deferral.take();
        let attempts = retained.as_ref().map_or(0, |d| d.attempts);
        let mut decision = match &*retained {
            // A retry restores the source it was deferred with; it
            // never re-selects from the index.
            Some(deferral) => restore::retry(deferral, hit, self.kv.free_blocks(), bs),
            None => restore::decide(
                &RestoreQuery {
                    prompt_tokens: seq.tokens.len(),
                    device_hit_blocks: hit,
                    host_run_blocks: self.kv.lookup_host(&seq.hashes[hit..max_hit_blocks]),
                    free_device_blocks: self.kv.free_blocks(),
                    block_size: bs,
                    min_restore_tokens: self.config.min_restore_tokens,
                },
                timing,
            ),
        };
        if matches!(decision, RestoreDecision::SequenceCapacityNotReady { .. })
            && attempts >= self.config.max_restore_deferrals
        {
            decision = RestoreDecision::NativeRestoreSkipped;
        }
        let request = seq.request;
        self.note_decision(request, decision);
        let seq = self.slots[id.0 as usize].as_mut().expect("live");
        match decision {
            RestoreDecision::SequenceCapacityNotReady {
                candidate_prefix_tokens,
            } => {
                let blocks = candidate_prefix_tokens / bs;
                let pins = self.kv.pin_host(&seq.hashes[hit..hit + blocks]);
                seq.deferral = Some(RestoreDeferral::new(hit, blocks, bs, attempts + 1, pins));
                RestorePlan::Stop(Admission::Blocked)
            }
            RestoreDecision::Restore {
                candidate_prefix_tokens,
            } => RestorePlan::Go(Some(candidate_prefix_tokens)),
            RestoreDecision::NoReusableEntry
            | RestoreDecision::NativeRestoreSkipped
            | RestoreDecision::RetainedSourceLost
            | RestoreDecision::RequestStateNotReady => RestorePlan::Go(None),
        }
    }

    /// Restores `candidate_prefix_tokens` of `id`'s prompt after its device
    /// hit of `hit` blocks, from `rendezvous`'s transfer or else the host
    /// tier (`retained` is released once the new source is pinned); then
    /// validates, acknowledges, and only then observes. Returns the tokens
    /// now computed, or `None` when the restore failed and the request was
    /// cancelled (into `report`).
    fn restore_prefix(
        &mut self,
        id: SeqId,
        hit: usize,
        candidate_prefix_tokens: usize,
        rendezvous: Option<&Rendezvous>,
        retained: Option<RestoreDeferral>,
        report: &mut StepReport,
    ) -> Result<Option<usize>, EngineError> {
        let bs = self.config.block_size;
        let blocks = candidate_prefix_tokens / bs;
        let seq = self.slots[id.0 as usize].as_mut().expect("live");
        let hashes = std::mem::take(&mut seq.hashes);
        let ticket = RestoreTicket {
            request: seq.request,
            prompt_tokens: seq.tokens.len(),
            device_prefix_tokens: hit * bs,
            blocks,
        };
        let source = &hashes[hit..hit + blocks];
        let (pins, from) = match rendezvous {
            Some(rv) => {
                let tokens = &rv
                    .delivered
                    .as_ref()
                    .expect("a rendezvous restore was decided on a delivery")
                    .tokens;
                (
                    None,
                    RestoreSource::Rendezvous {
                        tokens: &tokens[hit * bs..(hit + blocks) * bs],
                    },
                )
            }
            None => (Some(self.kv.pin_host(source)), RestoreSource::Host),
        };
        drop(retained);
        let parent = hit.checked_sub(1).map(|p| hashes[p]);
        let outcome = self
            .device
            .restore(&mut self.kv, id, &ticket, parent, source, from);
        let checked = match outcome {
            Ok(output) => {
                let table = self.kv.installed_after(id, hit, source);
                restore::validate(&ticket, &output, &table, bs).map_err(Some)
            }
            Err(_) => Err(None),
        };
        self.seq_mut(id).hashes = hashes;
        // Install the progress, then acknowledge; only then observe. A
        // refused acknowledgement fails this request like an invalid
        // output: the device published a restore it does not stand by.
        let acknowledged = checked.and_then(|computed_tokens| {
            self.device
                .acknowledge_restore(id)
                .map(|()| computed_tokens)
                .map_err(|_| Some(RestoreError::AcknowledgeFailed))
        });
        drop(pins);
        let done = |restored| {
            rendezvous.map(|rv| Observation::RendezvousDone {
                request: ticket.request,
                lease: rv.lease.id,
                restored,
            })
        };
        match acknowledged {
            Ok(computed_tokens) => {
                self.counters.restores.restored += 1;
                self.observe(Observation::Restored {
                    request: ticket.request,
                    candidate_prefix_tokens,
                });
                if let Some(done) = done(true) {
                    self.observe(done);
                }
                Ok(Some(computed_tokens))
            }
            Err(error) => {
                self.device
                    .release_seq(&mut self.kv, id, false, Label("restore_failed"))?;
                self.counters.restores.failed += 1;
                self.observe(Observation::RestoreFailed {
                    request: ticket.request,
                    error,
                });
                if let Some(done) = done(false) {
                    self.observe(done);
                }
                let finished = self.remove(id, FinishReason::RestoreFailed);
                report.finished.push(finished);
                Ok(None)
            }
        }
    }

    /// Starts admitted `id` from `computed_blocks` (a hybrid model loads
    /// its SSM state there), counts its prompt at its first admission, and
    /// reserves its first chunk within `budget`.
    fn start_admitted(
        &mut self,
        id: SeqId,
        computed_blocks: usize,
        budget: usize,
    ) -> Result<Admission, EngineError> {
        let bs = self.config.block_size;
        if self.checkpoints.is_some() && computed_blocks > 0 {
            // The SSM state at the resume point, into the sequence's slot.
            let slot = self
                .state_slots
                .slot_of(id)
                .expect("a hybrid sequence is admitted with a state slot");
            self.device
                .load_checkpoint(&self.kv, id, slot, computed_blocks * bs)?;
            self.counters.ssm_resumes += 1;
            self.state_copies += 1;
        }
        let seq = self.slots[id.0 as usize].as_mut().expect("live");
        seq.num_computed = computed_blocks * bs;
        seq.committed_blocks = computed_blocks;
        if !seq.prompt_counted {
            seq.prompt_counted = true;
            seq.cached_tokens = seq.num_computed;
            self.counters.prompt_tokens += seq.prompt_len as u64;
            self.counters.prefix_hit_tokens += seq.num_computed as u64;
        }
        let n = (seq.tokens.len() - seq.num_computed).min(budget);
        let target = seq.num_computed + n;
        match self.device.reserve_kv(&mut self.kv, id, target)? {
            Reservation::Reserved { .. } => Ok(Admission::Scheduled(n)),
            Reservation::Exhausted => self.release_blocked(id, Label("admission_blocked")),
        }
    }
}
