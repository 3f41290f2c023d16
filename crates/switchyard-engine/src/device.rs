//! The device layer: the effects the scheduler core asks for between steps,
//! and three implementations.
//!
//! The contract is the one a GPU backend would implement; the scheduler only
//! reacts to outcomes. A dry pool is an outcome ([`Reservation::Exhausted`]),
//! not an error; a [`DeviceError`] is a fault (a broken contract, a failed
//! device, or a device that was shut down), and the scheduler surfaces it.
//!
//! Every effect has a [`Label`] (its name in logs, errors and metrics) and an
//! outcome; [`Effect`] lists them as the scripted device logs them. A device
//! is a small state machine ([`DeviceState`]): `Running` takes every effect;
//! `Quiesced` (after [`DeviceLayer::quiesce`]) launches and reserves nothing
//! new but still releases, rolls back, saves and disowns, so a driver can
//! drain it; `Shutdown` (after [`DeviceLayer::ep_shutdown`], only from
//! `Quiesced`) refuses every effect with [`DeviceError::ShutDown`].
//!
//! - [`SyncDevice`] reserves exactly what a step needs and charges the
//!   timing model.
//! - [`AheadDevice`] reserves one decode position ahead of every request, as
//!   an engine overlapping scheduling with execution would, so the scheduler
//!   must [`DeviceLayer::rollback`] what a finished request no longer needs.
//! - [`ScriptedDevice`] behaves like [`SyncDevice`] but can be told to run
//!   dry, tamper with restore outputs or logits, or fail, and logs every
//!   effect.

use crate::blocks::{BlockManager, NoCapacity, SeqId};
use crate::restore::{RestoreOutput, RestoreTicket};
use crate::slots::SlotId;
use crate::timing::{StepShape, TimingConfig};
use rustc_hash::FxHashMap;
use switchyard_core::SequenceHash;

/// A static name: what an effect is, or who asked for it (a release's
/// `what`). Carried into errors and failure logs; never a prompt's content.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Label(pub &'static str);

impl std::fmt::Display for Label {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.0)
    }
}

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

/// Outcome of [`DeviceLayer::read_logits`]: the rows now on the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct HostLogits {
    /// Rows (sequences) copied.
    pub rows: usize,
    /// Bytes per logit as copied (the model's element width: 2 for bf16).
    pub elem_bytes: u32,
    /// Bytes copied.
    pub bytes: u64,
    /// Model milliseconds the copy took.
    pub duration_ms: f64,
}

/// Outcome of [`DeviceLayer::save_sequence_state`]: a sequence's computed
/// KV now lives on the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SavedState {
    /// Tokens saved.
    pub tokens: usize,
    /// Model milliseconds the copy took.
    pub duration_ms: f64,
}

/// Outcome of [`DeviceLayer::marconi_checkpoint`]: a slot's SSM state
/// snapshot at a block boundary.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checkpoint {
    /// The slot snapshotted.
    pub slot: SlotId,
    /// The position (a multiple of the block size) the snapshot stands for.
    pub tokens: usize,
}

/// Outcome of [`DeviceLayer::save_hidden_catchup`]: the sequence's
/// catch-up ring for multi-token prediction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CatchupRing {
    /// The newest position whose hidden state the ring holds.
    pub newest_tokens: usize,
    /// Entries held (at most [`CATCHUP_RING_DEPTH`]).
    pub held: usize,
}

/// Hidden states a sequence's catch-up ring keeps: the oldest is
/// overwritten beyond it.
pub const CATCHUP_RING_DEPTH: usize = 4;

/// Where a device is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceState {
    /// Takes every effect.
    Running,
    /// Launches and reserves nothing new; releases, rollbacks, saves and
    /// detaches still run so a driver can drain it.
    Quiesced,
    /// Refuses every effect.
    Shutdown,
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
    /// Release what the last reservation of `seq` added and no kept token
    /// occupies.
    Rollback {
        /// The sequence.
        seq: SeqId,
    },
    /// Release `seq`'s blocks beyond those its first `keep_tokens` tokens
    /// occupy — a discarded over-run (rejected draft positions) — while
    /// the sequence continues.
    RollbackOverrun {
        /// The sequence.
        seq: SeqId,
        /// Tokens whose KV is kept.
        keep_tokens: usize,
    },
    /// Free `seq`'s blocks, offering them to the prefix cache when `cache`.
    ReleaseSeq {
        /// The sequence.
        seq: SeqId,
        /// Whether cached blocks stay cached.
        cache: bool,
        /// Who released it (for failure logs).
        what: Label,
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
    /// Copy the last step's logits rows to the host.
    ReadLogits {
        /// Rows (sequences that sampled).
        rows: usize,
        /// Logits per row.
        vocab: usize,
        /// Bytes per logit the model produces.
        elem_bytes: u32,
    },
    /// Move `seq`'s state from slot `from` to slot `to`.
    CompactSlot {
        /// The sequence.
        seq: SeqId,
        /// Its old slot.
        from: SlotId,
        /// Its new slot.
        to: SlotId,
    },
    /// Disown a slot a compaction moved away from.
    DetachSlot {
        /// The slot.
        slot: SlotId,
    },
    /// Copy `seq`'s first `tokens` computed tokens of KV to the host (spill
    /// preemption).
    SaveSequenceState {
        /// The sequence.
        seq: SeqId,
        /// Tokens saved.
        tokens: usize,
    },
    /// Copy a spilled sequence's state back into device blocks (resume).
    LoadSequenceState {
        /// The sequence.
        seq: SeqId,
        /// Tokens it held when spilled.
        tokens: usize,
        /// Leading blocks the device still caches (not copied).
        device_prefix_blocks: usize,
    },
    /// Free a spilled sequence's host copy without loading it.
    DropSequenceState {
        /// The sequence.
        seq: SeqId,
    },
    /// Snapshot slot `slot`'s SSM state at block boundary `tokens` (a
    /// hybrid model keeping an SSM checkpoint).
    MarconiCheckpoint {
        /// The sequence.
        seq: SeqId,
        /// Its state slot.
        slot: SlotId,
        /// The position snapshotted.
        tokens: usize,
    },
    /// Copy the SSM checkpoint at block boundary `tokens` into slot
    /// `slot` (a hybrid sequence resuming from a cached prefix).
    LoadCheckpoint {
        /// The sequence.
        seq: SeqId,
        /// Its state slot.
        slot: SlotId,
        /// The position it resumes from.
        tokens: usize,
    },
    /// Keep `seq`'s hidden state at position `tokens` in its multi-token
    /// prediction catch-up ring (asked after every speculative decode step).
    SaveHiddenCatchup {
        /// The sequence.
        seq: SeqId,
        /// The position.
        tokens: usize,
    },
    /// Wait for the secondary (copy) stream to finish what it was given.
    SyncSecondary,
    /// Stop taking new work.
    Quiesce,
    /// Tear the device (and its expert-parallel group) down.
    EpShutdown,
}

impl Effect {
    /// The effect's name in logs, errors and metrics.
    pub fn label(&self) -> Label {
        Label(match self {
            Effect::ReserveKv { .. } => "reserve_kv",
            Effect::Rollback { .. } => "rollback",
            Effect::RollbackOverrun { .. } => "rollback_overrun",
            Effect::ReleaseSeq { .. } => "release_seq",
            Effect::Restore { .. } => "restore",
            Effect::AckRestore { .. } => "ack_restore",
            Effect::LaunchStep { .. } => "launch_step",
            Effect::ReadStepResult => "read_step_result",
            Effect::ReadLogits { .. } => "read_logits",
            Effect::CompactSlot { .. } => "compact_slot",
            Effect::DetachSlot { .. } => "detach_slot",
            Effect::SaveSequenceState { .. } => "save_sequence_state",
            Effect::LoadSequenceState { .. } => "load_sequence_state",
            Effect::DropSequenceState { .. } => "drop_sequence_state",
            Effect::MarconiCheckpoint { .. } => "marconi_checkpoint",
            Effect::LoadCheckpoint { .. } => "load_checkpoint",
            Effect::SaveHiddenCatchup { .. } => "save_hidden_catchup",
            Effect::SyncSecondary => "sync_secondary",
            Effect::Quiesce => "quiesce",
            Effect::EpShutdown => "ep_shutdown",
        })
    }
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
    /// The device was shut down; it takes no effect any more.
    #[error("the device is shut down and refuses {effect}")]
    ShutDown {
        /// The refused effect.
        effect: Label,
    },
    /// The device is quiesced; it takes no new work.
    #[error("the device is quiesced and refuses {effect}")]
    Quiesced {
        /// The refused effect.
        effect: Label,
    },
    /// A shutdown was asked of a device still running.
    #[error("ep_shutdown needs a quiesced device")]
    NotQuiesced,
    /// A sequence's state was saved twice, or loaded or dropped unsaved.
    #[error("{effect}: sequence {seq:?} has no matching saved state")]
    SavedState {
        /// The effect.
        effect: Label,
        /// The sequence.
        seq: SeqId,
    },
    /// Logits came back with another element width than the model's.
    #[error("logits came back {got} bytes wide, the model's are {expected}")]
    LogitsWidth {
        /// The model's element width.
        expected: u32,
        /// What the device reported.
        got: u32,
    },
    /// An SSM checkpoint asked off a block boundary.
    #[error("a checkpoint at {tokens} tokens is not on a block boundary of {block_size}")]
    UnalignedCheckpoint {
        /// The position asked.
        tokens: usize,
        /// Tokens per block.
        block_size: usize,
    },
    /// A catch-up entry not past the ring's newest.
    #[error("catch-up for {seq:?} at {tokens} tokens is not past its newest ({newest})")]
    CatchupOutOfOrder {
        /// The sequence.
        seq: SeqId,
        /// The position asked.
        tokens: usize,
        /// The ring's newest position.
        newest: usize,
    },
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

    /// Where the device is in its life.
    fn state(&self) -> DeviceState;

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

    /// Releases `seq`'s blocks beyond those its first `keep_tokens` tokens
    /// occupy: an over-run it reserved and computed but discarded (rejected
    /// draft positions), while the sequence continues. Every device
    /// supports it (the caller says what it keeps). A block holding a kept
    /// token stays; returns the blocks released.
    fn rollback_overrun(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        keep_tokens: usize,
    ) -> Result<usize, DeviceError>;

    /// Frees every block of `seq` (cached blocks stay cached when `cache`);
    /// `what` names the caller for failure logs.
    fn release_seq(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        cache: bool,
        what: Label,
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

    /// Copies `rows` rows of `vocab` logits, `elem_bytes` each, to the host.
    fn read_logits(
        &mut self,
        rows: usize,
        vocab: usize,
        elem_bytes: u32,
    ) -> Result<HostLogits, DeviceError>;

    /// Moves `seq`'s state from slot `from` to slot `to`; `from` is
    /// detached until [`Self::detach_slot`].
    fn compact_slot(&mut self, seq: SeqId, from: SlotId, to: SlotId) -> Result<(), DeviceError>;

    /// Disowns `slot` (after a compaction moved away from it).
    fn detach_slot(&mut self, slot: SlotId) -> Result<(), DeviceError>;

    /// Copies `seq`'s first `tokens` computed tokens of KV to the host. The
    /// device blocks stay `seq`'s until [`Self::release_seq`].
    fn save_sequence_state(
        &mut self,
        kv: &BlockManager,
        seq: SeqId,
        tokens: usize,
    ) -> Result<SavedState, DeviceError>;

    /// Copies a spilled `seq` back: `seq` already holds
    /// `device_prefix_blocks` cached blocks; the rest of `tokens` is
    /// reserved (all or nothing) and copied in. `Exhausted` keeps the host
    /// copy for a later try.
    fn load_sequence_state(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        tokens: usize,
        device_prefix_blocks: usize,
    ) -> Result<Reservation, DeviceError>;

    /// Frees a spilled `seq`'s host copy. Returns the tokens it held.
    fn drop_sequence_state(&mut self, seq: SeqId) -> Result<usize, DeviceError>;

    /// Snapshots `slot`'s SSM state at `tokens`, which must be a multiple
    /// of the block size (Marconi-style checkpoints after decode steps).
    fn marconi_checkpoint(
        &mut self,
        kv: &BlockManager,
        seq: SeqId,
        slot: SlotId,
        tokens: usize,
    ) -> Result<Checkpoint, DeviceError>;

    /// Copies the SSM checkpoint at `tokens` (a multiple of the block
    /// size) into `slot`, the state a resuming hybrid sequence starts from.
    fn load_checkpoint(
        &mut self,
        kv: &BlockManager,
        seq: SeqId,
        slot: SlotId,
        tokens: usize,
    ) -> Result<Checkpoint, DeviceError>;

    /// Pushes `seq`'s hidden state at `tokens` (past the ring's newest)
    /// into its catch-up ring; a released sequence's ring is gone.
    fn save_hidden_catchup(
        &mut self,
        seq: SeqId,
        tokens: usize,
    ) -> Result<CatchupRing, DeviceError>;

    /// Waits for the secondary (copy) stream.
    fn sync_secondary(&mut self) -> Result<(), DeviceError>;

    /// Stops taking new work (see [`DeviceState::Quiesced`]); syncs the
    /// secondary stream first. Quiescing twice is harmless.
    fn quiesce(&mut self) -> Result<(), DeviceError>;

    /// Tears the device down; it must be quiesced. Every effect after it is
    /// refused with [`DeviceError::ShutDown`].
    fn ep_shutdown(&mut self) -> Result<(), DeviceError>;
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

/// Whether an effect may run in `state`: a shut-down device takes nothing,
/// a quiesced one nothing new.
fn admit(state: DeviceState, effect: Label, new_work: bool) -> Result<(), DeviceError> {
    match state {
        DeviceState::Shutdown => Err(DeviceError::ShutDown { effect }),
        DeviceState::Quiesced if new_work => Err(DeviceError::Quiesced { effect }),
        _ => Ok(()),
    }
}

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
        self.inner.state
    }

    fn reserve_kv(
        &mut self,
        kv: &mut BlockManager,
        seq: SeqId,
        tokens: usize,
    ) -> Result<Reservation, DeviceError> {
        admit(self.inner.state, Label("reserve_kv"), true)?;
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
        admit(self.inner.state, Label("rollback"), false)?;
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
        if self.exhaust_next > 0 && self.inner.state == DeviceState::Running {
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
        self.inner.state
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
    fn an_overrun_rollback_keeps_the_blocks_of_kept_tokens_on_every_device() {
        let mut kv = kv();
        let mut dev = ScriptedDevice::new(TimingConfig::default());
        // 5 kept tokens and a 4-position over-run: 9 tokens, 3 blocks.
        assert_eq!(
            dev.reserve_kv(&mut kv, SeqId(0), 9),
            Ok(Reservation::Reserved { blocks: 3 })
        );
        assert_eq!(dev.rollback_overrun(&mut kv, SeqId(0), 6), Ok(1));
        assert_eq!(kv.seq_blocks(SeqId(0)).len(), 2);
        assert_eq!(
            dev.rollback_overrun(&mut kv, SeqId(0), 6),
            Ok(0),
            "nothing beyond the kept tokens is left"
        );
        assert_eq!(
            dev.log[1],
            Effect::RollbackOverrun {
                seq: SeqId(0),
                keep_tokens: 6
            }
        );
        let mut ahead = AheadDevice::new(TimingConfig::default(), 1);
        ahead.reserve_kv(&mut kv, SeqId(1), 9).unwrap();
        assert_eq!(kv.seq_blocks(SeqId(1)).len(), 3, "the lookahead fits in");
        assert_eq!(ahead.rollback_overrun(&mut kv, SeqId(1), 4), Ok(2));
        assert_eq!(
            ahead.rollback(&mut kv, SeqId(1)),
            Ok(0),
            "nothing ahead left"
        );
        assert_eq!(kv.seq_blocks(SeqId(1)).len(), 1);
        ahead.quiesce().unwrap();
        assert_eq!(
            ahead.rollback_overrun(&mut kv, SeqId(1), 0),
            Ok(1),
            "a quiesced device still rolls back"
        );
    }

    #[test]
    fn every_effect_has_its_own_label() {
        let effects = [
            Effect::ReserveKv {
                seq: SeqId(0),
                tokens: 1,
            },
            Effect::Rollback { seq: SeqId(0) },
            Effect::RollbackOverrun {
                seq: SeqId(0),
                keep_tokens: 4,
            },
            Effect::ReleaseSeq {
                seq: SeqId(0),
                cache: true,
                what: Label("finished"),
            },
            Effect::AckRestore { seq: SeqId(0) },
            Effect::LaunchStep {
                shape: StepShape::default(),
            },
            Effect::ReadStepResult,
            Effect::ReadLogits {
                rows: 1,
                vocab: 8,
                elem_bytes: 2,
            },
            Effect::CompactSlot {
                seq: SeqId(0),
                from: SlotId(1),
                to: SlotId(0),
            },
            Effect::DetachSlot { slot: SlotId(1) },
            Effect::SaveSequenceState {
                seq: SeqId(0),
                tokens: 4,
            },
            Effect::LoadSequenceState {
                seq: SeqId(0),
                tokens: 4,
                device_prefix_blocks: 0,
            },
            Effect::DropSequenceState { seq: SeqId(0) },
            Effect::MarconiCheckpoint {
                seq: SeqId(0),
                slot: SlotId(0),
                tokens: 4,
            },
            Effect::LoadCheckpoint {
                seq: SeqId(0),
                slot: SlotId(0),
                tokens: 4,
            },
            Effect::SaveHiddenCatchup {
                seq: SeqId(0),
                tokens: 4,
            },
            Effect::SyncSecondary,
            Effect::Quiesce,
            Effect::EpShutdown,
        ];
        let labels: std::collections::BTreeSet<Label> = effects.iter().map(Effect::label).collect();
        assert_eq!(labels.len(), effects.len());
    }

    #[test]
    fn a_quiesced_device_takes_no_new_work_but_still_releases() {
        let mut kv = kv();
        let mut dev = ScriptedDevice::new(TimingConfig::default());
        dev.reserve_kv(&mut kv, SeqId(0), 8).unwrap();
        assert_eq!(dev.ep_shutdown(), Err(DeviceError::NotQuiesced));
        dev.quiesce().unwrap();
        dev.quiesce().unwrap();
        assert_eq!(dev.state(), DeviceState::Quiesced);
        assert_eq!(
            dev.reserve_kv(&mut kv, SeqId(1), 8),
            Err(DeviceError::Quiesced {
                effect: Label("reserve_kv")
            })
        );
        assert!(dev.launch_step(&kv, &StepShape::default()).is_err());
        dev.release_seq(&mut kv, SeqId(0), true, Label("cancelled"))
            .unwrap();
        assert_eq!(kv.free_blocks(), 16);
    }

    #[test]
    fn a_shut_down_device_refuses_every_effect_with_a_clear_error() {
        let mut kv = kv();
        let mut dev = SyncDevice::new(TimingConfig::default());
        dev.quiesce().unwrap();
        dev.ep_shutdown().unwrap();
        assert_eq!(dev.state(), DeviceState::Shutdown);
        let refused = [
            dev.reserve_kv(&mut kv, SeqId(0), 1).map(|_| ()),
            dev.release_seq(&mut kv, SeqId(0), true, Label("cancelled")),
            dev.step_result().map(|_| ()),
            dev.read_logits(1, 8, 2).map(|_| ()),
            dev.detach_slot(SlotId(0)),
            dev.save_sequence_state(&kv, SeqId(0), 4).map(|_| ()),
            dev.drop_sequence_state(SeqId(0)).map(|_| ()),
            dev.sync_secondary(),
            dev.quiesce(),
            dev.ep_shutdown(),
        ];
        for outcome in refused {
            assert!(
                matches!(outcome, Err(DeviceError::ShutDown { .. })),
                "{outcome:?}"
            );
        }
        let message = dev
            .reserve_kv(&mut kv, SeqId(0), 1)
            .unwrap_err()
            .to_string();
        assert_eq!(message, "the device is shut down and refuses reserve_kv");
    }

    #[test]
    fn a_saved_state_is_loaded_or_dropped_exactly_once() {
        let mut kv = kv();
        let mut dev = SyncDevice::new(TimingConfig::default());
        let saved = dev.save_sequence_state(&kv, SeqId(0), 8).unwrap();
        assert_eq!(saved.tokens, 8);
        assert!((saved.duration_ms - TimingConfig::default().restore_ms(8)).abs() < 1e-12);
        assert!(
            dev.save_sequence_state(&kv, SeqId(0), 8).is_err(),
            "saved twice"
        );
        assert_eq!(dev.secondary_pending(), 1);
        dev.sync_secondary().unwrap();
        assert_eq!(dev.secondary_pending(), 0);
        assert!(
            dev.load_sequence_state(&mut kv, SeqId(0), 4, 0).is_err(),
            "another extent than was saved"
        );
        assert_eq!(
            dev.load_sequence_state(&mut kv, SeqId(0), 8, 0),
            Ok(Reservation::Reserved { blocks: 2 })
        );
        assert_eq!(
            dev.drop_sequence_state(SeqId(0)),
            Err(DeviceError::SavedState {
                effect: Label("drop_sequence_state"),
                seq: SeqId(0)
            }),
            "loaded already"
        );
        dev.save_sequence_state(&kv, SeqId(1), 4).unwrap();
        assert_eq!(dev.drop_sequence_state(SeqId(1)), Ok(4));
        assert_eq!(dev.saved_len(), 0);
    }

    #[test]
    fn logits_come_back_at_the_asked_width_and_cost_their_bytes() {
        let mut dev = SyncDevice::new(TimingConfig::default());
        let logits = dev.read_logits(3, 1_000, 2).unwrap();
        assert_eq!(
            (logits.rows, logits.elem_bytes, logits.bytes),
            (3, 2, 6_000)
        );
        assert!((logits.duration_ms - 6_000.0 / 64e9 * 1e3).abs() < 1e-12);
    }

    #[test]
    fn an_ssm_checkpoint_is_taken_only_on_a_block_boundary() {
        let kv = kv();
        let mut dev = ScriptedDevice::new(TimingConfig::default());
        assert_eq!(
            dev.marconi_checkpoint(&kv, SeqId(0), SlotId(1), 8),
            Ok(Checkpoint {
                slot: SlotId(1),
                tokens: 8
            })
        );
        assert_eq!(
            dev.marconi_checkpoint(&kv, SeqId(0), SlotId(1), 9),
            Err(DeviceError::UnalignedCheckpoint {
                tokens: 9,
                block_size: 4
            })
        );
        assert_eq!(dev.secondary_pending(), 1, "a snapshot is a copy");
        // Resuming from one: the same alignment rule, a copy too.
        assert_eq!(
            dev.load_checkpoint(&kv, SeqId(1), SlotId(0), 4),
            Ok(Checkpoint {
                slot: SlotId(0),
                tokens: 4
            })
        );
        assert!(dev.load_checkpoint(&kv, SeqId(1), SlotId(0), 0).is_err());
        assert_eq!(dev.secondary_pending(), 2);
        assert_eq!(
            dev.log[0],
            Effect::MarconiCheckpoint {
                seq: SeqId(0),
                slot: SlotId(1),
                tokens: 8
            }
        );
    }

    #[test]
    fn the_catch_up_ring_keeps_its_newest_entries_in_order_until_release() {
        let mut kv = kv();
        let mut dev = SyncDevice::new(TimingConfig::default());
        for tokens in 1..=6 {
            let ring = dev.save_hidden_catchup(SeqId(0), tokens).unwrap();
            assert_eq!(ring.newest_tokens, tokens);
            assert_eq!(ring.held, tokens.min(CATCHUP_RING_DEPTH));
        }
        assert_eq!(
            dev.save_hidden_catchup(SeqId(0), 6),
            Err(DeviceError::CatchupOutOfOrder {
                seq: SeqId(0),
                tokens: 6,
                newest: 6
            })
        );
        dev.release_seq(&mut kv, SeqId(0), true, Label("finished"))
            .unwrap();
        assert_eq!(
            dev.save_hidden_catchup(SeqId(0), 1).map(|r| r.held),
            Ok(1),
            "a released sequence's ring starts over"
        );
    }

    #[test]
    fn a_result_without_a_launch_is_a_contract_error() {
        let mut dev = SyncDevice::new(TimingConfig::default());
        assert_eq!(dev.step_result(), Err(DeviceError::NoStepLaunched));
    }
}
