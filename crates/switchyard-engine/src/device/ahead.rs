//! [`AheadDevice`]: reserves ahead of every request, as an engine
//! overlapping scheduling with execution would.

use super::{
    admit, blocks_for, CatchupRing, Checkpoint, DeviceError, DeviceLayer, DeviceState, HostLogits,
    Label, Reservation, RestoreSource, SavedState, StepResult, SyncDevice,
};
use crate::blocks::{BlockManager, SeqId};
use crate::restore::{RestoreOutput, RestoreTicket};
use crate::slots::SlotId;
use crate::timing::{StepShape, TimingConfig};
use rustc_hash::FxHashMap;
use switchyard_core::SequenceHash;

#[derive(Clone, Copy, Debug)]
struct AheadReservation {
    blocks_before: usize,
    blocks_needed: usize,
    launched: bool,
}

/// Reserves `lookahead_tokens` beyond what each step needs, so the next
/// decode position is already backed when the step ends.
///
/// A rollback releases what the last reservation added: all of it before
/// the step launched, only the lookahead part after (a rollback never frees
/// a block holding a computed token).
#[derive(Debug, Clone)]
pub struct AheadDevice {
    inner: SyncDevice,
    lookahead_tokens: usize,
    last: FxHashMap<SeqId, AheadReservation>,
}

impl AheadDevice {
    /// A device reserving `lookahead_tokens` ahead and charging `timing`.
    pub fn new(timing: TimingConfig, lookahead_tokens: usize) -> Self {
        Self {
            inner: SyncDevice::new(timing),
            lookahead_tokens,
            last: FxHashMap::default(),
        }
    }
}

impl DeviceLayer for AheadDevice {
    fn reserves_ahead(&self) -> bool {
        true
    }

    fn state(&self) -> DeviceState {
        self.inner.state()
    }

    fn reserve_kv(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        tokens: usize,
    ) -> Result<Reservation, DeviceError> {
        admit(self.inner.state(), Label("reserve_kv"), true)?;
        let bs = kv.block_size();
        let blocks_before = kv.seq_blocks(seq).len();
        let blocks_needed = blocks_for(tokens, bs);
        let with_lookahead = blocks_for(tokens + self.lookahead_tokens, bs).min(kv.num_blocks());
        let outcome = match kv.reserve(seq, with_lookahead) {
            Some(blocks) => Reservation::Reserved { blocks },
            None => match kv.reserve(seq, blocks_needed) {
                Some(blocks) => Reservation::Reserved { blocks },
                None => return Ok(Reservation::Exhausted),
            },
        };
        self.last.insert(
            seq,
            AheadReservation {
                blocks_before,
                blocks_needed,
                launched: false,
            },
        );
        Ok(outcome)
    }

    fn rollback(&mut self, kv: &mut BlockManager, seq: SeqId) -> Result<usize, DeviceError> {
        admit(self.inner.state(), Label("rollback"), false)?;
        let Some(last) = self.last.remove(&seq) else {
            return Ok(0);
        };
        let keep = if last.launched {
            last.blocks_needed.max(last.blocks_before)
        } else {
            last.blocks_before
        };
        Ok(kv.truncate(seq, keep))
    }

    fn rollback_overrun(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        keep_tokens: usize,
    ) -> Result<usize, DeviceError> {
        // The lookahead beyond the kept tokens goes with the over-run.
        self.last.remove(&seq);
        self.inner.rollback_overrun(kv, seq, keep_tokens)
    }

    fn release_seq(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        cache: bool,
        what: Label,
    ) -> Result<(), DeviceError> {
        self.inner.release_seq(kv, seq, cache, what)?;
        self.last.remove(&seq);
        Ok(())
    }

    fn restore(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        ticket: &RestoreTicket,
        parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
        source: RestoreSource<'_>,
    ) -> Result<RestoreOutput, DeviceError> {
        self.inner.restore(kv, seq, ticket, parent, hashes, source)
    }

    fn acknowledge_restore(&mut self, seq: SeqId) -> Result<(), DeviceError> {
        self.inner.acknowledge_restore(seq)
    }

    fn launch_step(&mut self, kv: &BlockManager, shape: &StepShape) -> Result<(), DeviceError> {
        self.inner.launch_step(kv, shape)?;
        for r in self.last.values_mut() {
            r.launched = true;
        }
        Ok(())
    }

    fn step_result(&mut self) -> Result<StepResult, DeviceError> {
        self.inner.step_result()
    }

    fn read_logits(
        &mut self,
        rows: usize,
        vocab: usize,
        elem_bytes: u32,
    ) -> Result<HostLogits, DeviceError> {
        self.inner.read_logits(rows, vocab, elem_bytes)
    }

    fn compact_slot(&mut self, seq: SeqId, from: SlotId, to: SlotId) -> Result<(), DeviceError> {
        self.inner.compact_slot(seq, from, to)
    }

    fn detach_slot(&mut self, slot: SlotId) -> Result<(), DeviceError> {
        self.inner.detach_slot(slot)
    }

    fn save_sequence_state(
        &mut self,
        kv: &BlockManager,
        seq: SeqId,
        tokens: usize,
    ) -> Result<SavedState, DeviceError> {
        self.inner.save_sequence_state(kv, seq, tokens)
    }

    fn load_sequence_state(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        tokens: usize,
        device_prefix_blocks: usize,
    ) -> Result<Reservation, DeviceError> {
        self.inner
            .load_sequence_state(kv, seq, tokens, device_prefix_blocks)
    }

    fn drop_sequence_state(&mut self, seq: SeqId) -> Result<usize, DeviceError> {
        self.inner.drop_sequence_state(seq)
    }

    fn marconi_checkpoint(
        &mut self,
        kv: &BlockManager,
        seq: SeqId,
        slot: SlotId,
        tokens: usize,
    ) -> Result<Checkpoint, DeviceError> {
        self.inner.marconi_checkpoint(kv, seq, slot, tokens)
    }

    fn load_checkpoint(
        &mut self,
        kv: &BlockManager,
        seq: SeqId,
        slot: SlotId,
        tokens: usize,
    ) -> Result<Checkpoint, DeviceError> {
        self.inner.load_checkpoint(kv, seq, slot, tokens)
    }

    fn save_hidden_catchup(
        &mut self,
        seq: SeqId,
        tokens: usize,
    ) -> Result<CatchupRing, DeviceError> {
        self.inner.save_hidden_catchup(seq, tokens)
    }

    fn sync_secondary(&mut self) -> Result<(), DeviceError> {
        self.inner.sync_secondary()
    }

    fn quiesce(&mut self) -> Result<(), DeviceError> {
        self.inner.quiesce()
    }

    fn ep_shutdown(&mut self) -> Result<(), DeviceError> {
        self.inner.ep_shutdown()
    }
}
