//! [`ScriptedDevice`]: a device for tests, scripted to run dry, tamper or
//! fail, that logs every effect.

use super::{
    CatchupRing, Checkpoint, DeviceError, DeviceLayer, DeviceState, Effect, HostLogits, Label,
    Reservation, RestoreSource, SavedState, StepResult, SyncDevice,
};
use crate::blocks::{BlockManager, SeqId};
use crate::restore::{RestoreOutput, RestoreTicket};
use crate::slots::SlotId;
use crate::timing::{StepShape, TimingConfig};
use switchyard_core::SequenceHash;

/// A restore output rewrite, for tests of validation.
pub type RestoreTamper = fn(RestoreOutput) -> RestoreOutput;

/// A device for tests: [`SyncDevice`] behaviour plus a script, and a log of
/// every effect.
#[derive(Debug, Clone)]
pub struct ScriptedDevice {
    inner: SyncDevice,
    /// Reservations (and state loads) to answer `Exhausted` regardless of
    /// the pool.
    pub exhaust_next: u32,
    /// Rewrites every restore output before the scheduler sees it.
    pub tamper_restore: Option<RestoreTamper>,
    /// Fails the next restore with a device error.
    pub fail_next_restore: bool,
    /// Refuses the next restore's acknowledgement.
    pub fail_next_ack: bool,
    /// Reports logits this many bytes wide, whatever was asked.
    pub logits_width: Option<u32>,
    /// Every effect asked, in order.
    pub log: Vec<Effect>,
    /// Whether to record the log (off for long property runs).
    pub record: bool,
}

impl ScriptedDevice {
    /// A scripted device charging `timing`, recording its log.
    pub fn new(timing: TimingConfig) -> Self {
        Self {
            inner: SyncDevice::new(timing),
            exhaust_next: 0,
            tamper_restore: None,
            fail_next_restore: false,
            fail_next_ack: false,
            logits_width: None,
            log: Vec::new(),
            record: true,
        }
    }

    /// Spilled sequences whose host copy is held.
    pub fn saved_len(&self) -> usize {
        self.inner.saved_len()
    }

    /// Copies issued on the secondary stream and not yet synchronised.
    pub fn secondary_pending(&self) -> usize {
        self.inner.secondary_pending()
    }

    fn note(&mut self, effect: Effect) {
        if self.record {
            self.log.push(effect);
        }
    }

    fn scripted_exhaustion(&mut self) -> bool {
        if self.exhaust_next > 0 && self.inner.state() == DeviceState::Running {
            self.exhaust_next -= 1;
            return true;
        }
        false
    }
}

impl DeviceLayer for ScriptedDevice {
    fn reserves_ahead(&self) -> bool {
        false
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
        self.note(Effect::ReserveKv { seq, tokens });
        if self.scripted_exhaustion() {
            return Ok(Reservation::Exhausted);
        }
        self.inner.reserve_kv(kv, seq, tokens)
    }

    fn rollback(&mut self, kv: &mut BlockManager, seq: SeqId) -> Result<usize, DeviceError> {
        self.note(Effect::Rollback { seq });
        self.inner.rollback(kv, seq)
    }

    fn rollback_overrun(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        keep_tokens: usize,
    ) -> Result<usize, DeviceError> {
        self.note(Effect::RollbackOverrun { seq, keep_tokens });
        self.inner.rollback_overrun(kv, seq, keep_tokens)
    }

    fn release_seq(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        cache: bool,
        what: Label,
    ) -> Result<(), DeviceError> {
        self.note(Effect::ReleaseSeq { seq, cache, what });
        self.inner.release_seq(kv, seq, cache, what)
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
        self.note(Effect::Restore {
            seq,
            ticket: *ticket,
            rendezvous: matches!(source, RestoreSource::Rendezvous { .. }),
        });
        if std::mem::take(&mut self.fail_next_restore) {
            return Err(DeviceError::Scripted("restore failed"));
        }
        let out = self
            .inner
            .restore(kv, seq, ticket, parent, hashes, source)?;
        Ok(match self.tamper_restore {
            Some(tamper) => tamper(out),
            None => out,
        })
    }

    fn acknowledge_restore(&mut self, seq: SeqId) -> Result<(), DeviceError> {
        self.note(Effect::AckRestore { seq });
        if std::mem::take(&mut self.fail_next_ack) {
            return Err(DeviceError::Scripted("acknowledgement refused"));
        }
        self.inner.acknowledge_restore(seq)
    }

    fn launch_step(&mut self, kv: &BlockManager, shape: &StepShape) -> Result<(), DeviceError> {
        self.note(Effect::LaunchStep { shape: *shape });
        self.inner.launch_step(kv, shape)
    }

    fn step_result(&mut self) -> Result<StepResult, DeviceError> {
        self.note(Effect::ReadStepResult);
        self.inner.step_result()
    }

    fn read_logits(
        &mut self,
        rows: usize,
        vocab: usize,
        elem_bytes: u32,
    ) -> Result<HostLogits, DeviceError> {
        self.note(Effect::ReadLogits {
            rows,
            vocab,
            elem_bytes,
        });
        let width = self.logits_width.unwrap_or(elem_bytes);
        self.inner.read_logits(rows, vocab, width)
    }

    fn compact_slot(&mut self, seq: SeqId, from: SlotId, to: SlotId) -> Result<(), DeviceError> {
        self.note(Effect::CompactSlot { seq, from, to });
        self.inner.compact_slot(seq, from, to)
    }

    fn detach_slot(&mut self, slot: SlotId) -> Result<(), DeviceError> {
        self.note(Effect::DetachSlot { slot });
        self.inner.detach_slot(slot)
    }

    fn save_sequence_state(
        &mut self,
        kv: &BlockManager,
        seq: SeqId,
        tokens: usize,
    ) -> Result<SavedState, DeviceError> {
        self.note(Effect::SaveSequenceState { seq, tokens });
        self.inner.save_sequence_state(kv, seq, tokens)
    }

    fn load_sequence_state(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        tokens: usize,
        device_prefix_blocks: usize,
    ) -> Result<Reservation, DeviceError> {
        self.note(Effect::LoadSequenceState {
            seq,
            tokens,
            device_prefix_blocks,
        });
        if self.scripted_exhaustion() {
            return Ok(Reservation::Exhausted);
        }
        self.inner
            .load_sequence_state(kv, seq, tokens, device_prefix_blocks)
    }

    fn drop_sequence_state(&mut self, seq: SeqId) -> Result<usize, DeviceError> {
        self.note(Effect::DropSequenceState { seq });
        self.inner.drop_sequence_state(seq)
    }

    fn marconi_checkpoint(
        &mut self,
        kv: &BlockManager,
        seq: SeqId,
        slot: SlotId,
        tokens: usize,
    ) -> Result<Checkpoint, DeviceError> {
        self.note(Effect::MarconiCheckpoint { seq, slot, tokens });
        self.inner.marconi_checkpoint(kv, seq, slot, tokens)
    }

    fn load_checkpoint(
        &mut self,
        kv: &BlockManager,
        seq: SeqId,
        slot: SlotId,
        tokens: usize,
    ) -> Result<Checkpoint, DeviceError> {
        self.note(Effect::LoadCheckpoint { seq, slot, tokens });
        self.inner.load_checkpoint(kv, seq, slot, tokens)
    }

    fn save_hidden_catchup(
        &mut self,
        seq: SeqId,
        tokens: usize,
    ) -> Result<CatchupRing, DeviceError> {
        self.note(Effect::SaveHiddenCatchup { seq, tokens });
        self.inner.save_hidden_catchup(seq, tokens)
    }

    fn sync_secondary(&mut self) -> Result<(), DeviceError> {
        self.note(Effect::SyncSecondary);
        self.inner.sync_secondary()
    }

    fn quiesce(&mut self) -> Result<(), DeviceError> {
        self.note(Effect::Quiesce);
        self.inner.quiesce()
    }

    fn ep_shutdown(&mut self) -> Result<(), DeviceError> {
        self.note(Effect::EpShutdown);
        self.inner.ep_shutdown()
    }
}
