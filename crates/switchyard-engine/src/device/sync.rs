//! [`SyncDevice`]: reserves exactly what each step needs and charges the
//! timing model; the other devices build on it.

use super::{
    admit, blocks_for, restore_on, CatchupRing, Checkpoint, DeviceError, DeviceLayer, DeviceState,
    HostLogits, Label, Reservation, RestoreSource, SavedState, StepResult, CATCHUP_RING_DEPTH,
};
use crate::blocks::{BlockManager, SeqId};
use crate::restore::{RestoreOutput, RestoreTicket};
use crate::slots::SlotId;
use crate::timing::{StepShape, TimingConfig};
use rustc_hash::FxHashMap;
use switchyard_core::SequenceHash;

/// Reserves exactly what each step needs; charges the timing model.
#[derive(Debug, Clone)]
pub struct SyncDevice {
    timing: TimingConfig,
    launched: Option<StepShape>,
    state: DeviceState,
    /// Spilled sequences' host copies: tokens held.
    saved: FxHashMap<SeqId, usize>,
    /// Copies issued on the secondary stream since its last sync.
    secondary_pending: usize,
    /// Catch-up rings: newest position and entries held, per sequence.
    catchup: FxHashMap<SeqId, CatchupRing>,
}

impl SyncDevice {
    /// An SSM state copied between a slot and a checkpoint (`effect` says
    /// which way) at `tokens`, a nonzero block boundary: new work, a copy
    /// on the secondary stream.
    fn copy_checkpoint(
        &mut self,
        kv: &BlockManager,
        effect: Label,
        slot: SlotId,
        tokens: usize,
    ) -> Result<Checkpoint, DeviceError> {
        admit(self.state, effect, true)?;
        let block_size = kv.block_size();
        if tokens == 0 || tokens % block_size != 0 {
            return Err(DeviceError::UnalignedCheckpoint { tokens, block_size });
        }
        self.secondary_pending += 1;
        Ok(Checkpoint { slot, tokens })
    }

    /// A device charging `timing`.
    pub fn new(timing: TimingConfig) -> Self {
        Self {
            timing,
            launched: None,
            state: DeviceState::Running,
            saved: FxHashMap::default(),
            secondary_pending: 0,
            catchup: FxHashMap::default(),
        }
    }

    /// Spilled sequences whose host copy is held.
    pub fn saved_len(&self) -> usize {
        self.saved.len()
    }

    /// Copies issued on the secondary stream and not yet synchronised.
    pub fn secondary_pending(&self) -> usize {
        self.secondary_pending
    }
}

impl DeviceLayer for SyncDevice {
    fn reserves_ahead(&self) -> bool {
        false
    }

    fn state(&self) -> DeviceState {
        self.state
    }

    fn reserve_kv(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        tokens: usize,
    ) -> Result<Reservation, DeviceError> {
        admit(self.state, Label("reserve_kv"), true)?;
        Ok(match kv.reserve(seq, blocks_for(tokens, kv.block_size())) {
            Some(blocks) => Reservation::Reserved { blocks },
            None => Reservation::Exhausted,
        })
    }

    fn rollback(&mut self, _kv: &mut BlockManager, _seq: SeqId) -> Result<usize, DeviceError> {
        admit(self.state, Label("rollback"), false)?;
        Err(DeviceError::RollbackUnsupported)
    }

    fn rollback_overrun(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        keep_tokens: usize,
    ) -> Result<usize, DeviceError> {
        admit(self.state, Label("rollback_overrun"), false)?;
        Ok(kv.truncate(seq, blocks_for(keep_tokens, kv.block_size())))
    }

    fn release_seq(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        cache: bool,
        _what: Label,
    ) -> Result<(), DeviceError> {
        admit(self.state, Label("release_seq"), false)?;
        kv.release(seq, cache);
        self.catchup.remove(&seq);
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
        admit(self.state, Label("restore"), true)?;
        restore_on(kv, seq, ticket, parent, hashes, source)
    }

    fn acknowledge_restore(&mut self, _seq: SeqId) -> Result<(), DeviceError> {
        admit(self.state, Label("ack_restore"), false)
    }

    fn launch_step(&mut self, _kv: &BlockManager, shape: &StepShape) -> Result<(), DeviceError> {
        admit(self.state, Label("launch_step"), true)?;
        self.launched = Some(*shape);
        Ok(())
    }

    fn step_result(&mut self) -> Result<StepResult, DeviceError> {
        admit(self.state, Label("read_step_result"), false)?;
        let shape = self.launched.take().ok_or(DeviceError::NoStepLaunched)?;
        Ok(StepResult {
            duration_ms: self.timing.step_ms(&shape),
        })
    }

    fn read_logits(
        &mut self,
        rows: usize,
        vocab: usize,
        elem_bytes: u32,
    ) -> Result<HostLogits, DeviceError> {
        admit(self.state, Label("read_logits"), false)?;
        let bytes = rows as u64 * vocab as u64 * u64::from(elem_bytes);
        Ok(HostLogits {
            rows,
            elem_bytes,
            bytes,
            duration_ms: self.timing.host_copy_ms(bytes),
        })
    }

    fn compact_slot(&mut self, _seq: SeqId, _from: SlotId, _to: SlotId) -> Result<(), DeviceError> {
        admit(self.state, Label("compact_slot"), true)?;
        self.secondary_pending += 1;
        Ok(())
    }

    fn detach_slot(&mut self, _slot: SlotId) -> Result<(), DeviceError> {
        admit(self.state, Label("detach_slot"), false)
    }

    fn save_sequence_state(
        &mut self,
        _kv: &BlockManager,
        seq: SeqId,
        tokens: usize,
    ) -> Result<SavedState, DeviceError> {
        let effect = Label("save_sequence_state");
        admit(self.state, effect, false)?;
        if self.saved.contains_key(&seq) {
            return Err(DeviceError::SavedState { effect, seq });
        }
        self.saved.insert(seq, tokens);
        self.secondary_pending += 1;
        Ok(SavedState {
            tokens,
            duration_ms: self.timing.restore_ms(tokens as u64),
        })
    }

    fn load_sequence_state(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        tokens: usize,
        _device_prefix_blocks: usize,
    ) -> Result<Reservation, DeviceError> {
        let effect = Label("load_sequence_state");
        admit(self.state, effect, true)?;
        if self.saved.get(&seq) != Some(&tokens) {
            return Err(DeviceError::SavedState { effect, seq });
        }
        let outcome = match kv.reserve(seq, blocks_for(tokens, kv.block_size())) {
            Some(blocks) => Reservation::Reserved { blocks },
            None => return Ok(Reservation::Exhausted),
        };
        self.saved.remove(&seq);
        self.secondary_pending += 1;
        Ok(outcome)
    }

    fn drop_sequence_state(&mut self, seq: SeqId) -> Result<usize, DeviceError> {
        let effect = Label("drop_sequence_state");
        admit(self.state, effect, false)?;
        self.saved
            .remove(&seq)
            .ok_or(DeviceError::SavedState { effect, seq })
    }

    fn marconi_checkpoint(
        &mut self,
        kv: &BlockManager,
        _seq: SeqId,
        slot: SlotId,
        tokens: usize,
    ) -> Result<Checkpoint, DeviceError> {
        self.copy_checkpoint(kv, Label("marconi_checkpoint"), slot, tokens)
    }

    fn load_checkpoint(
        &mut self,
        kv: &BlockManager,
        _seq: SeqId,
        slot: SlotId,
        tokens: usize,
    ) -> Result<Checkpoint, DeviceError> {
        self.copy_checkpoint(kv, Label("load_checkpoint"), slot, tokens)
    }

    fn save_hidden_catchup(
        &mut self,
        seq: SeqId,
        tokens: usize,
    ) -> Result<CatchupRing, DeviceError> {
        admit(self.state, Label("save_hidden_catchup"), true)?;
        let ring = self.catchup.entry(seq).or_insert(CatchupRing {
            newest_tokens: 0,
            held: 0,
        });
        if ring.held > 0 && tokens <= ring.newest_tokens {
            return Err(DeviceError::CatchupOutOfOrder {
                seq,
                tokens,
                newest: ring.newest_tokens,
            });
        }
        ring.newest_tokens = tokens;
        ring.held = (ring.held + 1).min(CATCHUP_RING_DEPTH);
        Ok(*ring)
    }

    fn sync_secondary(&mut self) -> Result<(), DeviceError> {
        admit(self.state, Label("sync_secondary"), false)?;
        self.secondary_pending = 0;
        Ok(())
    }

    fn quiesce(&mut self) -> Result<(), DeviceError> {
        admit(self.state, Label("quiesce"), false)?;
        self.secondary_pending = 0;
        self.state = DeviceState::Quiesced;
        Ok(())
    }

    fn ep_shutdown(&mut self) -> Result<(), DeviceError> {
        admit(self.state, Label("ep_shutdown"), false)?;
        if self.state != DeviceState::Quiesced {
            return Err(DeviceError::NotQuiesced);
        }
        self.state = DeviceState::Shutdown;
        self.launched = None;
        Ok(())
    }
}
