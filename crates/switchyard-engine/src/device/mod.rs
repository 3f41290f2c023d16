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
//!
//! Files, by role: this one holds the contract (the trait, its effects,
//! outcomes and errors, and the checks every device shares); `sync.rs`,
//! `ahead.rs` and `scripted.rs` one implementation each; `tests.rs`.

mod ahead;
mod scripted;
mod sync;
#[cfg(test)]
mod tests;

pub use ahead::AheadDevice;
pub use scripted::{RestoreTamper, ScriptedDevice};
pub use sync::SyncDevice;

use crate::blocks::{BlockManager, NoCapacity, SeqId};
use crate::restore::{RestoreOutput, RestoreTicket};
use crate::slots::SlotId;
use crate::timing::StepShape;
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
