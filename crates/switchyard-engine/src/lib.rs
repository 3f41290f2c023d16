//! Switchyard's simulated engine: a real engine core without a model.
//!
//! Pure: nothing here reads a clock, sleeps or does I/O. The fleet simulator
//! drives it in virtual time; `switchyard sim-worker` drives it in real time.
//!
//! Modules, in the order one step meets them:
//!
//! - [`config`] — [`EngineConfig`]: every knob, documented defaults, `validate()`.
//! - [`scheduler`] — [`Engine`]: waiting and running queues, continuous
//!   batching, chunked prefill, preemption (recompute or spill) only when
//!   nothing can run; one [`Engine::step`] plans a batch, asks the device
//!   layer for effects, applies the outcomes. A file a role: `step` (plan,
//!   launch, advance), `admit` (waiting sequences in, through the restore
//!   protocol), `preempt` (preemption, spill and resume, slot compaction),
//!   `rendezvous` (capture leases and transfers), `request`, `report` and
//!   `counters` (what goes in and comes out), `tokens` (synthetic tokens
//!   and draft draws).
//! - [`device`] — the [`DeviceLayer`] contract: every [`Effect`] with its
//!   [`Label`] and outcome (reserve, roll back, release, restore, launch,
//!   result, logits read-back, slot compaction, spill save/load/drop, SSM
//!   checkpoint, catch-up ring, stream sync, quiesce, shutdown), the
//!   device's states, and its synchronous (`sync`), reserve-ahead
//!   (`ahead`) and scripted (`scripted`) implementations, a file each.
//! - [`slots`] — [`slots::SlotTable`]: fixed per-sequence state slots
//!   (an SSM's), allocated, compacted, detached and freed so that no slot is
//!   ever freed twice.
//! - [`blocks`] — [`BlockManager`]: the paged KV pool, ref counts, prefix
//!   cache, LRU eviction, optional host tier.
//! - [`restore`] — the restore protocol (host tier and rendezvous):
//!   decisions, deferral guard, validation.
//! - [`lease`] — capture leases: a prefix's KV pinned for another engine
//!   to restore from, authenticated by a secret, bounded, expiring.
//! - [`timing`] — [`TimingConfig`]: step and restore durations.
//! - [`events`] — [`KvEvent`]: the typed KV events every store, removal and
//!   clear emits, independent of any wire format.
//! - [`adapters`] — [`adapters::AdapterSlots`]: the LoRA adapters loaded,
//!   bounded, the least recently used evicted.
//!
//! Data flow: requests enter [`Engine::add_request`]; each step emits sampled
//! tokens and finished requests in a [`StepReport`]; the block manager's
//! events and the scheduler's observations are drained by the driver.

#![warn(missing_docs)]

pub mod adapters;
pub mod blocks;
pub mod checkpoints;
pub mod config;
pub mod device;
pub mod events;
pub mod lease;
pub mod restore;
pub mod scheduler;
pub mod slots;
pub mod timing;

pub use blocks::{engine_hash, BlockManager, SeqId};
pub use checkpoints::CheckpointPolicy;
pub use config::{EngineConfig, Hybrid, Preemption, SpecDecode};
pub use device::{
    AheadDevice, DeviceError, DeviceLayer, DeviceState, Effect, Label, ScriptedDevice, SyncDevice,
};
pub use events::{KvEvent, Medium};
pub use scheduler::{
    Engine, FinishReason, Finished, NewRequest, Observation, StepReport, TokenOutput,
};
pub use timing::TimingConfig;
