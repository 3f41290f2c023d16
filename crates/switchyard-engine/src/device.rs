//! The device layer: the effects the scheduler core asks for between steps,
//! and three implementations.
//!
//! The contract is the one a GPU backend would implement; the scheduler only
//! reacts to outcomes. A dry pool is an outcome ([`Reservation::Exhausted`]),
//! not an error; a [`DeviceError`] is a fault (a broken contract or a failed
//! device), and the scheduler surfaces it.
//!
//! - [`SyncDevice`] reserves exactly what a step needs and charges the
//!   timing model.
//! - [`AheadDevice`] reserves one decode position ahead of every request, as
//!   an engine overlapping scheduling with execution would, so the scheduler
//!   must [`DeviceLayer::rollback`] what a finished request no longer needs.
//! - [`ScriptedDevice`] behaves like [`SyncDevice`] but can be told to run
//!   dry, tamper with restore outputs or fail, and logs every effect.

use crate::blocks::{BlockManager, NoCapacity, SeqId};
use crate::restore::{RestoreOutput, RestoreTicket};
use crate::timing::{StepShape, TimingConfig};
use rustc_hash::FxHashMap;
use switchyard_core::SequenceHash;

/// Outcome of a KV reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reservation {
    /// The sequence now holds enough blocks; `blocks` were added.
    Reserved {
        /// Blocks this reservation added.
        blocks: usize,
    },
    /// The pool is dry: nothing was reserved.
    Exhausted,
}

/// Outcome of a launched step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct StepResult {
    /// Model milliseconds the step took.
    pub duration_ms: f64,
}

/// One effect, as the scripted device logs it. Lengths and ids only.
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    /// Reserve blocks so `seq` holds `tokens` tokens.
    ReserveKv {
        /// The sequence.
        seq: SeqId,
        /// Tokens it must hold after the step.
        tokens: usize,
    },
    /// Release what the last reservation of `seq` added.
    Rollback {
        /// The sequence.
        seq: SeqId,
    },
    /// Free `seq`'s blocks, offering them to the prefix cache when `cache`.
    ReleaseSeq {
        /// The sequence.
        seq: SeqId,
        /// Whether cached blocks stay cached.
        cache: bool,
    },
    /// Copy blocks into the device for `seq`: from the host tier, or
    /// from another engine's capture lease (a rendezvous).
    Restore {
        /// The sequence.
        seq: SeqId,
        /// What the scheduler admitted.
        ticket: RestoreTicket,
        /// Whether the source is a rendezvous (else the host tier).
        rendezvous: bool,
    },
    /// The scheduler installed a restore's progress.
    AckRestore {
        /// The sequence.
        seq: SeqId,
    },
    /// Run one step.
    LaunchStep {
        /// What it computes.
        shape: StepShape,
    },
    /// Collect the launched step's result.
    ReadStepResult,
}

/// A device fault or a broken contract.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum DeviceError {
    /// This device reserves nothing ahead, so there is nothing to roll back.
    #[error("this device layer does not reserve ahead; rollback is unsupported")]
    RollbackUnsupported,
    /// A result was read with no step launched.
    #[error("no step was launched")]
    NoStepLaunched,
    /// A restore did not fit.
    #[error(transparent)]
    NoCapacity(#[from] NoCapacity),
    /// A scripted failure.
    #[error("scripted failure: {0}")]
    Scripted(&'static str),
}

/// Where a restore's blocks come from.
#[derive(Clone, Copy, Debug)]
pub enum RestoreSource<'a> {
    /// This engine's host tier.
    Host,
    /// Another engine's capture lease, already transferred: the blocks'
    /// tokens, `block_size` per block, in the order of the hashes.
    Rendezvous {
        /// The transferred tokens.
        tokens: &'a [u32],
    },
}

/// The effects a scheduler core asks of a device between steps.
pub trait DeviceLayer {
    /// Whether reservations run ahead of the step (then finished sequences
    /// are rolled back before release).
    fn reserves_ahead(&self) -> bool;

    /// Makes `seq` hold blocks for `tokens` tokens (all or nothing).
    fn reserve_kv(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        tokens: usize,
    ) -> Result<Reservation, DeviceError>;

    /// Releases what `seq`'s last reservation added and no computed token
    /// occupies. Returns the blocks released.
    fn rollback(&mut self, kv: &mut BlockManager, seq: SeqId) -> Result<usize, DeviceError>;

    /// Frees every block of `seq` (cached blocks stay cached when `cache`).
    fn release_seq(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        cache: bool,
    ) -> Result<(), DeviceError>;

    /// Copies blocks `hashes` (following `parent`) from `source` into
    /// device blocks of `seq` and reports what it installed.
    fn restore(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        ticket: &RestoreTicket,
        parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
        source: RestoreSource<'_>,
    ) -> Result<RestoreOutput, DeviceError>;

    /// The scheduler has installed the restore's progress.
    fn acknowledge_restore(&mut self, seq: SeqId) -> Result<(), DeviceError>;

    /// Launches a step of `shape`.
    fn launch_step(&mut self, kv: &BlockManager, shape: &StepShape) -> Result<(), DeviceError>;

    /// The launched step's result.
    fn step_result(&mut self) -> Result<StepResult, DeviceError>;
}

fn blocks_for(tokens: usize, block_size: usize) -> usize {
    tokens.div_ceil(block_size)
}

fn restore_on(
    kv: &mut BlockManager,
    seq: SeqId,
    ticket: &RestoreTicket,
    parent: Option<SequenceHash>,
    hashes: &[SequenceHash],
    source: RestoreSource<'_>,
) -> Result<RestoreOutput, DeviceError> {
    let installed = match source {
        RestoreSource::Host => kv.restore_from_host(seq, parent, hashes)?,
        RestoreSource::Rendezvous { tokens } => {
            kv.restore_from_blocks(seq, parent, hashes, tokens)?
        }
    };
    Ok(RestoreOutput {
        request: ticket.request,
        prompt_tokens: ticket.prompt_tokens,
        restored_tokens: ticket.device_prefix_tokens + installed * kv.block_size(),
        blocks_installed: installed,
    })
}

/// Reserves exactly what each step needs; charges the timing model.
#[derive(Debug, Clone)]
pub struct SyncDevice {
    timing: TimingConfig,
    launched: Option<StepShape>,
}

impl SyncDevice {
    /// A device charging `timing`.
    pub fn new(timing: TimingConfig) -> Self {
        Self {
            timing,
            launched: None,
        }
    }
}

impl DeviceLayer for SyncDevice {
    fn reserves_ahead(&self) -> bool {
        false
    }

    fn reserve_kv(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        tokens: usize,
    ) -> Result<Reservation, DeviceError> {
        Ok(match kv.reserve(seq, blocks_for(tokens, kv.block_size())) {
            Some(blocks) => Reservation::Reserved { blocks },
            None => Reservation::Exhausted,
        })
    }

    fn rollback(&mut self, _kv: &mut BlockManager, _seq: SeqId) -> Result<usize, DeviceError> {
        Err(DeviceError::RollbackUnsupported)
    }

    fn release_seq(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        cache: bool,
    ) -> Result<(), DeviceError> {
        kv.release(seq, cache);
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
        restore_on(kv, seq, ticket, parent, hashes, source)
    }

    fn acknowledge_restore(&mut self, _seq: SeqId) -> Result<(), DeviceError> {
        Ok(())
    }

    fn launch_step(&mut self, _kv: &BlockManager, shape: &StepShape) -> Result<(), DeviceError> {
        self.launched = Some(*shape);
        Ok(())
    }

    fn step_result(&mut self) -> Result<StepResult, DeviceError> {
        let shape = self.launched.take().ok_or(DeviceError::NoStepLaunched)?;
        Ok(StepResult {
            duration_ms: self.timing.step_ms(&shape),
        })
    }
}

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

    fn reserve_kv(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        tokens: usize,
    ) -> Result<Reservation, DeviceError> {
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

    fn release_seq(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        cache: bool,
    ) -> Result<(), DeviceError> {
        self.last.remove(&seq);
        kv.release(seq, cache);
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
        restore_on(kv, seq, ticket, parent, hashes, source)
    }

    fn acknowledge_restore(&mut self, _seq: SeqId) -> Result<(), DeviceError> {
        Ok(())
    }

    fn launch_step(&mut self, kv: &BlockManager, shape: &StepShape) -> Result<(), DeviceError> {
        for r in self.last.values_mut() {
            r.launched = true;
        }
        self.inner.launch_step(kv, shape)
    }

    fn step_result(&mut self) -> Result<StepResult, DeviceError> {
        self.inner.step_result()
    }
}

/// A restore output rewrite, for tests of validation.
pub type RestoreTamper = fn(RestoreOutput) -> RestoreOutput;

/// A device for tests: [`SyncDevice`] behaviour plus a script, and a log of
/// every effect.
#[derive(Debug, Clone)]
pub struct ScriptedDevice {
    inner: SyncDevice,
    /// Reservations to answer `Exhausted` regardless of the pool.
    pub exhaust_next: u32,
    /// Rewrites every restore output before the scheduler sees it.
    pub tamper_restore: Option<RestoreTamper>,
    /// Fails the next restore with a device error.
    pub fail_next_restore: bool,
    /// Refuses the next restore's acknowledgement.
    pub fail_next_ack: bool,
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
            log: Vec::new(),
            record: true,
        }
    }

    fn note(&mut self, effect: Effect) {
        if self.record {
            self.log.push(effect);
        }
    }
}

impl DeviceLayer for ScriptedDevice {
    fn reserves_ahead(&self) -> bool {
        false
    }

    fn reserve_kv(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        tokens: usize,
    ) -> Result<Reservation, DeviceError> {
        self.note(Effect::ReserveKv { seq, tokens });
        if self.exhaust_next > 0 {
            self.exhaust_next -= 1;
            return Ok(Reservation::Exhausted);
        }
        self.inner.reserve_kv(kv, seq, tokens)
    }

    fn rollback(&mut self, kv: &mut BlockManager, seq: SeqId) -> Result<usize, DeviceError> {
        self.note(Effect::Rollback { seq });
        self.inner.rollback(kv, seq)
    }

    fn release_seq(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        cache: bool,
    ) -> Result<(), DeviceError> {
        self.note(Effect::ReleaseSeq { seq, cache });
        self.inner.release_seq(kv, seq, cache)
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
        let out = restore_on(kv, seq, ticket, parent, hashes, source)?;
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
        Ok(())
    }

    fn launch_step(&mut self, kv: &BlockManager, shape: &StepShape) -> Result<(), DeviceError> {
        self.note(Effect::LaunchStep { shape: *shape });
        self.inner.launch_step(kv, shape)
    }

    fn step_result(&mut self) -> Result<StepResult, DeviceError> {
        self.note(Effect::ReadStepResult);
        self.inner.step_result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::KvConfig;

    fn kv() -> BlockManager {
        BlockManager::new(KvConfig {
            block_size: 4,
            num_blocks: 16,
            ..KvConfig::default()
        })
    }

    #[test]
    fn rollback_on_the_synchronous_device_is_an_error() {
        let mut kv = kv();
        let mut dev = SyncDevice::new(TimingConfig::default());
        assert_eq!(
            dev.reserve_kv(&mut kv, SeqId(0), 5),
            Ok(Reservation::Reserved { blocks: 2 })
        );
        assert_eq!(
            dev.rollback(&mut kv, SeqId(0)),
            Err(DeviceError::RollbackUnsupported)
        );
        assert_eq!(kv.seq_blocks(SeqId(0)).len(), 2);
    }

    #[test]
    fn rollback_before_launch_releases_everything_the_last_reservation_added() {
        let mut kv = kv();
        let mut dev = AheadDevice::new(TimingConfig::default(), 1);
        assert_eq!(
            dev.reserve_kv(&mut kv, SeqId(0), 4),
            Ok(Reservation::Reserved { blocks: 2 })
        );
        assert_eq!(
            dev.reserve_kv(&mut kv, SeqId(0), 8),
            Ok(Reservation::Reserved { blocks: 1 })
        );
        assert_eq!(dev.rollback(&mut kv, SeqId(0)), Ok(1));
        assert_eq!(kv.seq_blocks(SeqId(0)).len(), 2);
        assert_eq!(kv.free_blocks(), 14);
    }

    #[test]
    fn rollback_after_launch_releases_only_the_lookahead() {
        let mut kv = kv();
        let mut dev = AheadDevice::new(TimingConfig::default(), 1);
        assert_eq!(
            dev.reserve_kv(&mut kv, SeqId(0), 8),
            Ok(Reservation::Reserved { blocks: 3 })
        );
        dev.launch_step(&kv, &StepShape::default()).unwrap();
        dev.step_result().unwrap();
        assert_eq!(dev.rollback(&mut kv, SeqId(0)), Ok(1));
        assert_eq!(kv.seq_blocks(SeqId(0)).len(), 2);
        assert_eq!(
            dev.rollback(&mut kv, SeqId(0)),
            Ok(0),
            "a second rollback has nothing left"
        );
    }

    #[test]
    fn the_ahead_device_falls_back_to_the_exact_need_when_the_lookahead_does_not_fit() {
        let mut kv = kv();
        let mut dev = AheadDevice::new(TimingConfig::default(), 1);
        assert_eq!(
            dev.reserve_kv(&mut kv, SeqId(0), 64),
            Ok(Reservation::Reserved { blocks: 16 })
        );
        assert_eq!(
            dev.reserve_kv(&mut kv, SeqId(1), 1),
            Ok(Reservation::Exhausted)
        );
    }

    #[test]
    fn a_result_without_a_launch_is_a_contract_error() {
        let mut dev = SyncDevice::new(TimingConfig::default());
        assert_eq!(dev.step_result(), Err(DeviceError::NoStepLaunched));
    }
}
