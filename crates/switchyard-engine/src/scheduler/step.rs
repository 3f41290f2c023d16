//! One step, the numbered list in the module's comment: plan the running
//! sequences (1), let admission fill the rest (2, in `admit.rs`), launch the
//! step and read its result (3), and advance every scheduled sequence (4).

use super::{
    accepted_drafts, synthetic_token, Engine, EngineError, FinishReason, Seq, StepReport,
    TokenOutput,
};
use crate::blocks::{engine_hash, SeqId};
use crate::checkpoints::{CheckpointCache, CheckpointPolicy};
use crate::device::{DeviceError, DeviceLayer, Label, Reservation};
use crate::events::KvEvent;
use crate::timing::StepShape;

/// What planning the running sequences leaves for the waiting ones.
struct RunningPlan {
    /// Token budget left.
    budget: usize,
    /// Whether a sequence was preempted (then nothing is admitted).
    preempted: bool,
    /// Whether a sequence was kept out (then nothing is admitted).
    kept_out: bool,
    /// Tokens spill preemptions saved to the host.
    saved_tokens: usize,
}

impl<D: DeviceLayer> Engine<D> {
    /// Runs one step. `report` is cleared and filled.
    pub fn step(&mut self, report: &mut StepReport) -> Result<(), EngineError> {
        report.clear();
        let mut scheduled = std::mem::take(&mut self.scheduled);
        scheduled.clear();
        let result = self.plan_and_run(&mut scheduled, report);
        self.scheduled = scheduled;
        result
    }

    fn plan_and_run(
        &mut self,
        scheduled: &mut Vec<(SeqId, usize)>,
        report: &mut StepReport,
    ) -> Result<(), EngineError> {
        if self.state_slots.free_len() > 0 {
            self.compact_slots()?;
        }
        let running = self.plan_running(scheduled)?;
        let mut restore_tokens = 0usize;
        if !running.preempted && !running.kept_out {
            self.admit_waiting(scheduled, running.budget, &mut restore_tokens, report)?;
        }

        if scheduled.is_empty() {
            // Nothing launched, but a spill may have copied state to the
            // host: that time passes all the same.
            if running.saved_tokens > 0 {
                report.model_ms = self.config.timing.restore_ms(running.saved_tokens as u64);
            }
            return Ok(());
        }

        let shape = self.step_shape(scheduled, restore_tokens, running.saved_tokens);
        self.launch(scheduled, &shape, report)?;
        report.shape = shape;
        report.scheduled = scheduled.len();
        self.counters.steps += 1;

        if self.advance_scheduled(scheduled, report)? {
            self.finish_done(scheduled, report)?;
        }
        Ok(())
    }

    /// The running sequences, in order, within the token budget: each gets
    /// its remaining tokens (with speculative decoding, a decode step's
    /// drafts too); a reservation answered `Exhausted` keeps its sequence
    /// out. Only when none can run is the newest preempted and the plan
    /// made again.
    fn plan_running(
        &mut self,
        scheduled: &mut Vec<(SeqId, usize)>,
    ) -> Result<RunningPlan, EngineError> {
        let mut preempted = false;
        let mut saved_tokens = 0usize;
        loop {
            let mut budget = self.config.max_num_batched_tokens;
            let mut kept_out = false;
            let mut i = 0;
            while i < self.running.len() && budget > 0 {
                let id = self.running[i];
                let seq = self.seq(id);
                let n = (seq.tokens.len() - seq.num_computed).min(budget);
                let target = seq.num_computed + n;
                let drafts = self.drafts_for(seq, n, budget);
                if drafts > 0 {
                    // The over-run: the drafted positions are reserved
                    // with the step's own.
                    match self.device.reserve_kv(&mut self.kv, id, target + drafts)? {
                        Reservation::Reserved { .. } => {
                            self.seq_mut(id).drafts = drafts;
                            scheduled.push((id, n));
                            budget -= n + drafts;
                            i += 1;
                            continue;
                        }
                        // No room for the drafts: a plain one-token step
                        // if that fits (below), else the Exhausted rule.
                        Reservation::Exhausted => self.counters.spec_fallbacks += 1,
                    }
                }
                match self.device.reserve_kv(&mut self.kv, id, target)? {
                    Reservation::Reserved { .. } => {
                        scheduled.push((id, n));
                        budget -= n;
                    }
                    // Not launched ahead of the memory it needs: it sits
                    // this step out, holding what it has.
                    Reservation::Exhausted => {
                        kept_out = true;
                        self.counters.kept_out += 1;
                    }
                }
                i += 1;
            }
            // Preempt only when nothing can run: then no step would free
            // a block. Nothing was reserved this round, so nothing leaks.
            if kept_out && scheduled.is_empty() {
                if let Some(&victim) = self.running.last() {
                    saved_tokens += self.preempt(victim)?;
                    preempted = true;
                    continue;
                }
            }
            return Ok(RunningPlan {
                budget,
                preempted,
                kept_out,
                saved_tokens,
            });
        }
    }

    /// What the planned step computes: its prefill and decode tokens (and
    /// the drafts it verifies), the restores and saves charged to it, and
    /// the pool's use.
    fn step_shape(
        &self,
        scheduled: &[(SeqId, usize)],
        restore_tokens: usize,
        saved_tokens: usize,
    ) -> StepShape {
        let mut shape = StepShape {
            restore_tokens: restore_tokens as u64,
            saved_tokens: saved_tokens as u64,
            kv_used_blocks: self.kv.used_blocks() as u64,
            kv_total_blocks: self.kv.num_blocks() as u64,
            ..StepShape::default()
        };
        for &(id, n) in scheduled {
            let seq = self.seq(id);
            if n == 1 && seq.outputs() > 0 && seq.num_computed + 1 == seq.tokens.len() {
                shape.decode_tokens += 1;
                shape.draft_tokens += seq.drafts as u64;
            } else {
                shape.prefill_tokens += n as u64;
            }
        }
        shape
    }

    /// Launches the step on the device layer and reads its result into
    /// `report`; with `read_logits`, the sampling rows' logits are copied to
    /// the host too, charged to the step.
    fn launch(
        &mut self,
        scheduled: &[(SeqId, usize)],
        shape: &StepShape,
        report: &mut StepReport,
    ) -> Result<(), EngineError> {
        self.device.launch_step(&self.kv, shape)?;
        let result = self.device.step_result()?;
        report.model_ms = result.duration_ms;
        if !self.config.read_logits {
            return Ok(());
        }
        // A verifying sequence reads a row per drafted position too.
        let rows = scheduled
            .iter()
            .map(|&(id, n)| {
                let seq = self.seq(id);
                if seq.num_computed + n == seq.tokens.len() {
                    1 + seq.drafts
                } else {
                    0
                }
            })
            .sum();
        if rows > 0 {
            let expected = self.config.logits_elem_bytes;
            let logits = self
                .device
                .read_logits(rows, self.config.vocab_size, expected)?;
            if logits.elem_bytes != expected {
                return Err(DeviceError::LogitsWidth {
                    expected,
                    got: logits.elem_bytes,
                }
                .into());
            }
            report.model_ms += logits.duration_ms;
            self.counters.logits_bytes += logits.bytes;
        }
        Ok(())
    }

    /// Advances every scheduled sequence past what the step computed, then
    /// checkpoints the block boundaries a hybrid model's sequences passed
    /// and charges the step their state copies. Returns whether any
    /// sequence reached its end.
    fn advance_scheduled(
        &mut self,
        scheduled: &[(SeqId, usize)],
        report: &mut StepReport,
    ) -> Result<bool, EngineError> {
        let mut any_finished = false;
        // Hybrid models: the block boundaries each sequence passed.
        let mut passed: Vec<(SeqId, usize, usize)> = Vec::new();
        for &(id, n) in scheduled {
            any_finished |= self.advance(id, n, report, &mut passed)?;
        }
        for (id, first, full) in passed {
            self.checkpoint_blocks(id, first, full)?;
        }
        if let Some(hybrid) = self.config.hybrid {
            let copies = std::mem::take(&mut self.state_copies);
            report.model_ms += self.config.timing.host_copy_ms(copies * hybrid.state_bytes);
        }
        Ok(any_finished)
    }

    /// Advances sequence `id` by the `n` tokens the step computed for it
    /// and the drafts it accepted: caches its newly full blocks (noting
    /// them in `passed` for a hybrid model), samples a synthetic token
    /// where it caught up, and rolls back the drafts it rejected. Returns
    /// whether it reached its end (`max_tokens`, or the model length).
    fn advance(
        &mut self,
        id: SeqId,
        n: usize,
        report: &mut StepReport,
        passed: &mut Vec<(SeqId, usize, usize)>,
    ) -> Result<bool, EngineError> {
        let bs = self.config.block_size;
        let max_model_len = self.config.max_model_len;
        let vocabulary = self.config.output_vocabulary.as_deref();
        let acceptance_rate = self.config.spec_decode.map_or(0.0, |s| s.acceptance_rate);
        let mut finished = false;
        let seq = self.slots[id.0 as usize]
            .as_mut()
            .expect("scheduled sequences are live");
        let drafts = std::mem::take(&mut seq.drafts);
        // The accepted drafts are output tokens whose KV this step
        // computed; the token after them is sampled below as usual.
        let accepted = if drafts > 0 {
            accepted_drafts(seq.request, seq.outputs() as u32, drafts, acceptance_rate)
        } else {
            0
        };
        for _ in 0..accepted {
            let index = seq.outputs() as u32;
            let token = synthetic_token(seq.request, index, vocabulary);
            seq.tokens.push(token);
            report.tokens.push(TokenOutput {
                request: seq.request,
                token,
                index,
            });
        }
        seq.num_computed += n + accepted;
        let full = seq.num_computed / bs;
        if full > seq.committed_blocks {
            seq.ensure_hashes(full, bs);
            let first = seq.committed_blocks;
            let parent = first.checked_sub(1).map(|p| seq.hashes[p]);
            self.kv.commit(
                id,
                first,
                parent,
                &seq.hashes[first..full],
                &seq.tokens[first * bs..full * bs],
            );
            seq.committed_blocks = full;
            if self.checkpoints.is_some() {
                passed.push((id, first, full));
            }
        }
        if seq.num_computed == seq.tokens.len() {
            let index = seq.outputs() as u32;
            let token = synthetic_token(seq.request, index, vocabulary);
            seq.tokens.push(token);
            report.tokens.push(TokenOutput {
                request: seq.request,
                token,
                index,
            });
            self.counters.generated_tokens += 1 + accepted as u64;
            if seq.outputs() >= seq.max_tokens || seq.tokens.len() >= max_model_len {
                finished = true;
            }
        }
        if drafts > 0 {
            self.counters.draft_tokens_proposed += drafts as u64;
            self.counters.draft_tokens_accepted += accepted as u64;
            let kept = seq.num_computed;
            if accepted < drafts {
                // The rejected positions' KV is discarded; the
                // sequence goes on from its kept tokens.
                let released = self.device.rollback_overrun(&mut self.kv, id, kept)?;
                self.counters.spec_rollbacks += 1;
                self.counters.spec_rollback_blocks += released as u64;
            }
            self.device.save_hidden_catchup(id, kept)?;
        }
        Ok(finished)
    }

    /// Releases and removes every scheduled sequence that reached its end
    /// this step, into `report`'s finished requests.
    fn finish_done(
        &mut self,
        scheduled: &[(SeqId, usize)],
        report: &mut StepReport,
    ) -> Result<(), EngineError> {
        for &(id, _) in scheduled {
            let done = {
                let seq = self.seq(id);
                seq.num_computed + 1 == seq.tokens.len()
                    && (seq.outputs() >= seq.max_tokens
                        || seq.tokens.len() >= self.config.max_model_len)
            };
            if done {
                self.release(id, true, Label("finished"))?;
                self.counters.finished += 1;
                let finished = self.remove(id, FinishReason::Length);
                report.finished.push(finished);
            }
        }
        let slots = &self.slots;
        self.running.retain(|s| slots[s.0 as usize].is_some());
        Ok(())
    }

    /// A hybrid model's checkpoints at the block boundaries `first + 1 ..=
    /// full` that sequence `id` has just computed: every one (the naive
    /// policy), or, with Marconi's admission, the end of its prompt and
    /// the branch point it left a cached prefix at. Each is a
    /// `MarconiCheckpoint` of the sequence's state slot and a published
    /// checkpoint event; what the cache evicts for it is published too.
    fn checkpoint_blocks(
        &mut self,
        id: SeqId,
        first: usize,
        full: usize,
    ) -> Result<(), EngineError> {
        let Some(policy) = self.checkpoints.as_ref().map(CheckpointCache::policy) else {
            return Ok(());
        };
        let bs = self.config.block_size;
        let slot = self
            .state_slots
            .slot_of(id)
            .expect("a running hybrid sequence holds a state slot");
        for blocks in first + 1..=full {
            let seq = self.seq(id);
            let keep = match policy {
                CheckpointPolicy::EveryBlock => true,
                CheckpointPolicy::Marconi => {
                    blocks == seq.prompt_len / bs || seq.branch_blocks == Some(blocks)
                }
            };
            if !keep {
                continue;
            }
            let hash = seq.hashes[blocks - 1];
            let parent = blocks.checked_sub(2).map(|p| engine_hash(seq.hashes[p]));
            let tokens = seq.tokens[(blocks - 1) * bs..blocks * bs].to_vec();
            let lora_name = seq.lora_name.clone();
            let saves_ms = self.config.timing.prefill_ms((blocks * bs) as u64);
            let checkpoints = self.checkpoints.as_mut().expect("hybrid");
            if checkpoints.contains(hash) {
                checkpoints.touch(hash);
                continue;
            }
            self.device
                .marconi_checkpoint(&self.kv, id, slot, blocks * bs)?;
            let checkpoints = self.checkpoints.as_mut().expect("hybrid");
            let inserted = checkpoints.insert(hash, blocks * bs, saves_ms);
            self.counters.ssm_checkpoints += 1;
            self.counters.ssm_checkpoint_evictions += inserted.evicted.len() as u64;
            self.state_copies += 1;
            if !inserted.evicted.is_empty() {
                self.kv.push_event(KvEvent::CheckpointRemoved {
                    block_hashes: inserted.evicted.into_iter().map(engine_hash).collect(),
                });
            }
            self.kv.push_event(KvEvent::CheckpointStored {
                block_hash: engine_hash(hash),
                parent_block_hash: parent,
                token_ids: tokens,
                block_size: bs as u32,
                lora_name,
            });
        }
        Ok(())
    }

    /// Draft positions a decode step of `seq` computing `n` tokens within
    /// `budget` verifies: none without speculative decoding or outside a
    /// decode step; never more than could be emitted (its `max_tokens`,
    /// the model length) nor than the budget leaves.
    fn drafts_for(&self, seq: &Seq, n: usize, budget: usize) -> usize {
        let Some(spec) = self.config.spec_decode else {
            return 0;
        };
        if n != 1 || seq.outputs() == 0 || seq.num_computed + 1 != seq.tokens.len() {
            return 0;
        }
        let left = seq.max_tokens.saturating_sub(seq.outputs() + 1);
        let room = self
            .config
            .max_model_len
            .saturating_sub(seq.tokens.len() + 1);
        (spec.draft_tokens as usize)
            .min(left)
            .min(room)
            .min(budget.saturating_sub(1))
    }
}
