//! Making room: preemption (recompute, or spill to the host and load back on
//! resume), state-slot compaction, and freeing what a blocked admission took.

use super::{Admission, Engine, EngineError, Observation, Phase};
use crate::blocks::SeqId;
use crate::config::Preemption;
use crate::device::{DeviceLayer, Label, Reservation};

impl<D: DeviceLayer> Engine<D> {
    /// Preempts running `id` (the newest): with `preemption = "spill"` and
    /// room in the spill area its computed KV is saved to the host first,
    /// and the copy synchronised before its blocks are released. Returns
    /// the tokens saved (0: it recomputes).
    pub(super) fn preempt(&mut self, id: SeqId) -> Result<usize, EngineError> {
        let popped = self.running.pop();
        debug_assert_eq!(popped, Some(id));
        let (request, computed) = {
            let seq = self.seq(id);
            (seq.request, seq.num_computed)
        };
        let spill_blocks = computed.div_ceil(self.config.block_size);
        let mut saved = 0;
        if self.config.preemption == Preemption::Spill && computed > 0 {
            if self.spill_used_blocks + spill_blocks <= self.config.spill_blocks {
                saved = self
                    .device
                    .save_sequence_state(&self.kv, id, computed)?
                    .tokens;
                // The copy reads the blocks: it must finish before they
                // can be handed to anyone else.
                self.device.sync_secondary()?;
                self.spill_used_blocks += spill_blocks;
                self.seq_mut(id).spilled = Some(saved);
                self.counters.spills += 1;
            } else {
                self.counters.spill_fallbacks += 1;
            }
        }
        let what = Label(if saved > 0 { "spilled" } else { "preempted" });
        self.release(id, true, what)?;
        self.free_state_slot(id);
        let seq = self.seq_mut(id);
        seq.num_computed = 0;
        seq.committed_blocks = 0;
        seq.phase = Phase::Waiting;
        self.waiting.push_front(id);
        self.counters.preemptions += 1;
        self.observe(Observation::Preempted { request });
        if saved > 0 {
            self.observe(Observation::Spilled {
                request,
                tokens: saved,
            });
        }
        Ok(saved)
    }

    /// Admits a spilled sequence: its device-cached prefix is shared, the
    /// rest of its saved state loaded back (charged as restore tokens), and
    /// its next tokens reserved. Nothing is asked of the device unless all
    /// of it fits now.
    pub(super) fn resume_spilled(
        &mut self,
        id: SeqId,
        tokens: usize,
        budget: usize,
        restore_tokens: &mut usize,
    ) -> Result<Admission, EngineError> {
        let bs = self.config.block_size;
        let seq = self.slots[id.0 as usize].as_mut().expect("live");
        let full = tokens / bs;
        seq.ensure_hashes(full, bs);
        let hit = self.kv.lookup_prefix(&seq.hashes[..full]);
        let n = (seq.tokens.len() - tokens).min(budget);
        let need = (tokens + n).div_ceil(bs).saturating_sub(hit);
        if need > self.kv.free_blocks() {
            return Ok(Admission::Blocked);
        }
        let hashes = std::mem::take(&mut seq.hashes);
        self.kv.acquire_prefix(id, &hashes[..hit]);
        self.seq_mut(id).hashes = hashes;
        match self
            .device
            .load_sequence_state(&mut self.kv, id, tokens, hit)?
        {
            Reservation::Reserved { .. } => {}
            Reservation::Exhausted => {
                self.device
                    .release_seq(&mut self.kv, id, true, Label("resume_blocked"))?;
                return Ok(Admission::Blocked);
            }
        }
        self.spill_used_blocks -= tokens.div_ceil(bs);
        self.counters.spill_loads += 1;
        *restore_tokens += tokens - hit * bs;
        let seq = self.seq_mut(id);
        seq.spilled = None;
        seq.num_computed = tokens;
        seq.committed_blocks = hit;
        match self.device.reserve_kv(&mut self.kv, id, tokens + n)? {
            Reservation::Reserved { .. } => Ok(Admission::Scheduled(n)),
            // Loaded but unable to go on: its state is dropped with its
            // blocks and it recomputes, like any preempted sequence.
            Reservation::Exhausted => self.release_blocked(id, Label("resume_blocked")),
        }
    }

    /// Moves the highest owned state slot into the lowest free one until
    /// the owned slots are packed at the bottom of the table: each move is
    /// a copy (`CompactSlot`), synchronised before the old slot is disowned
    /// (`DetachSlot`) and only then free again.
    pub(super) fn compact_slots(&mut self) -> Result<(), EngineError> {
        while let Some((seq, _)) = self.state_slots.highest_owned() {
            let Some(moved) = self.state_slots.compact(seq)? else {
                break;
            };
            self.device.compact_slot(moved.seq, moved.from, moved.to)?;
            self.device.sync_secondary()?;
            self.device.detach_slot(moved.from)?;
            self.state_slots.detach(moved.from)?;
            self.counters.slot_compactions += 1;
        }
        Ok(())
    }

    /// Frees `id`'s state slot if it owns one.
    pub(super) fn free_state_slot(&mut self, id: SeqId) {
        // `NotOwned` is the answer for a sequence that never took a slot
        // (state_slots = 0, or not admitted yet): nothing to free.
        let _ = self.state_slots.free(id);
    }

    /// Frees a sequence whose reservation came back `Exhausted` before it
    /// ran (nothing reserved to roll back): its blocks go back, cached
    /// ones stay cached, and it will compute its tokens again.
    pub(super) fn release_blocked(
        &mut self,
        id: SeqId,
        what: Label,
    ) -> Result<Admission, EngineError> {
        self.device.release_seq(&mut self.kv, id, true, what)?;
        let seq = self.seq_mut(id);
        seq.num_computed = 0;
        seq.committed_blocks = 0;
        Ok(Admission::Blocked)
    }
}
