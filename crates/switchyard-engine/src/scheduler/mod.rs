//! The scheduler core: a pure loop of steps over waiting and running queues.
//!
//! One [`Engine::step`]:
//!
//! 0. state slots left with holes (a finished, cancelled or preempted
//!    sequence) are compacted: the highest owned slot moves down
//!    (`CompactSlot`, `SyncSecondary`, `DetachSlot`);
//! 1. running sequences first, in order: each gets its remaining tokens (a
//!    decode token, or the next prefill chunk) within the step's token
//!    budget; a reservation answered `Exhausted` keeps that sequence out of
//!    this step (it is not launched ahead of the memory it needs) while the
//!    others run and may free blocks; only when no running sequence can be
//!    launched at all is the newest one preempted (LIFO) — recomputed later,
//!    or with `preemption = "spill"` its computed KV saved to the host
//!    (`SaveSequenceState`, `SyncSecondary`, then `ReleaseSeq`) and loaded
//!    back on resume — and the step planned again;
//! 2. if nothing was preempted or kept out, waiting sequences in order while
//!    the budget, `max_num_seqs` and the state slots allow: a spilled
//!    sequence loads its saved state (`LoadSequenceState`); others take
//!    prefix hits on the device, then the restore
//!    protocol ([`crate::restore`]: from the host tier, or from another
//!    engine's capture lease for a request added with
//!    [`Engine::add_rendezvous_request`]), then a reservation for the first
//!    chunk; a dry pool leaves the request waiting, and so stops admission,
//!    while a rendezvous not yet delivered is passed over;
//! 3. launch the step on the device layer and read its result, and with
//!    `read_logits` copy the sampling rows' logits to the host (`ReadLogits`
//!    → `HostLogits`, charged to the step);
//! 4. advance every scheduled sequence, cache its newly full blocks, sample a
//!    synthetic token where a sequence caught up, finish those at `max_tokens`.
//!
//! Nothing here reads a clock or does I/O: the step's duration comes back
//! from the device layer as model milliseconds, and the driver decides what
//! a millisecond is.
//!
//! Files, by role: `request.rs`, `report.rs` and `counters.rs` are what
//! goes in and comes out; `step.rs` plans, launches and applies a step
//! (1, 3, 4); `admit.rs` takes waiting sequences in (2); `preempt.rs` makes
//! room (preemption, spill and resume, slot compaction); `rendezvous.rs`
//! is the lease and transfer API; `tokens.rs` the deterministic synthetic
//! tokens and draft draws; `tests/` the tests, by the same roles. This
//! file holds the engine's state, its accessors, queueing and cancelling,
//! and the bookkeeping they share.

mod admit;
mod counters;
mod preempt;
mod rendezvous;
mod report;
mod request;
mod step;
#[cfg(test)]
mod tests;
mod tokens;

pub use counters::{EngineCounters, RestoreCounters};
pub use rendezvous::DeliverError;
pub use report::{FinishReason, Finished, Observation, StepReport, TokenOutput};
pub use request::{AdmitError, NewRequest};
pub use tokens::{accepted_drafts, synthetic_token};

use crate::blocks::{BlockManager, SeqId};
use crate::checkpoints::CheckpointCache;
use crate::config::{ConfigError, EngineConfig};
use crate::device::{DeviceError, DeviceLayer, Label};
use crate::events::KvEvent;
use crate::lease::LeaseTable;
use crate::restore::{RestoreDecision, RestoreDeferral};
use crate::slots::{SlotError, SlotTable};
use rendezvous::Rendezvous;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use switchyard_core::hashing::{chain_hash, local_block_hash};
use switchyard_core::{LocalHash, RequestId, SequenceHash};

/// An engine fault: the device layer broke.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The device layer failed.
    #[error("device layer: {0}")]
    Device(#[from] DeviceError),
    /// The configuration is invalid.
    #[error("config: {0}")]
    Config(#[from] ConfigError),
    /// The state-slot table refused an operation the core asked for.
    #[error("state slots: {0}")]
    Slots(#[from] SlotError),
}

const MAX_BUFFERED_OBSERVATIONS: usize = 4_096;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Waiting,
    Running,
}

struct Seq {
    request: RequestId,
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    num_computed: usize,
    hashes: Vec<SequenceHash>,
    seed: u64,
    /// The LoRA adapter (`None`: the base model), for its KV events.
    lora_name: Option<Arc<str>>,
    committed_blocks: usize,
    phase: Phase,
    deferral: Option<RestoreDeferral>,
    /// The rendezvous this request restores from, until it is done with it.
    rendezvous: Option<Rendezvous>,
    prompt_counted: bool,
    cached_tokens: usize,
    /// Tokens whose KV a spill preemption saved to the host, until they
    /// are loaded back or dropped.
    spilled: Option<usize>,
    /// Draft positions reserved for the step being planned (speculative
    /// decoding; 0 outside a step).
    drafts: usize,
    /// Hybrid models, Marconi: the block count at which this prompt left
    /// a cached prefix (a branch point), to be checkpointed on the way.
    branch_blocks: Option<usize>,
}

impl Seq {
    fn outputs(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    fn ensure_hashes(&mut self, blocks: usize, block_size: usize) {
        while self.hashes.len() < blocks {
            let i = self.hashes.len();
            let local = local_block_hash(
                &self.tokens[i * block_size..(i + 1) * block_size],
                self.seed,
            );
            let hash = match self.hashes.last() {
                None => SequenceHash(local.0),
                Some(&prev) => chain_hash(prev, LocalHash(local.0)),
            };
            self.hashes.push(hash);
        }
    }
}

enum Admission {
    Scheduled(usize),
    /// Nothing fits now: admit nothing more this step.
    Blocked,
    /// Waiting for its rendezvous: the requests behind it may go first.
    NotReady,
    Removed,
}

/// The scheduler core over a device layer `D`.
pub struct Engine<D> {
    config: EngineConfig,
    kv: BlockManager,
    device: D,
    slots: Vec<Option<Seq>>,
    free_slots: Vec<u32>,
    by_request: FxHashMap<RequestId, SeqId>,
    waiting: VecDeque<SeqId>,
    running: Vec<SeqId>,
    counters: EngineCounters,
    observations: Vec<Observation>,
    scheduled: Vec<(SeqId, usize)>,
    leases: LeaseTable,
    state_slots: SlotTable,
    /// Spill-area blocks held by spilled sequences.
    spill_used_blocks: usize,
    /// A hybrid model's SSM checkpoints (`None`: attention only).
    checkpoints: Option<CheckpointCache>,
    /// SSM states copied (checkpoints saved, resumes loaded) during the
    /// step being run: their time is the step's too.
    state_copies: u64,
}

impl<D: DeviceLayer> Engine<D> {
    /// An idle engine over `device`.
    pub fn new(config: EngineConfig, device: D) -> Result<Self, EngineError> {
        config.validate()?;
        Ok(Self {
            kv: BlockManager::new(config.kv()),
            device,
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_request: FxHashMap::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            counters: EngineCounters::default(),
            observations: Vec::new(),
            scheduled: Vec::new(),
            leases: LeaseTable::new(config.max_leases),
            state_slots: SlotTable::new(config.state_slots),
            spill_used_blocks: 0,
            checkpoints: config
                .hybrid
                .map(|h| CheckpointCache::new(h.checkpoints, h.max_checkpoints, h.flop_weight)),
            state_copies: 0,
            config,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    /// The block manager (read-only).
    pub fn kv(&self) -> &BlockManager {
        &self.kv
    }

    /// The device layer.
    pub fn device(&self) -> &D {
        &self.device
    }

    /// The device layer, for scripting.
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.device
    }

    /// The state-slot table (empty when `state_slots` is 0).
    pub fn state_slots(&self) -> &SlotTable {
        &self.state_slots
    }

    /// Spill-area blocks held by spilled sequences now.
    pub fn spill_used_blocks(&self) -> usize {
        self.spill_used_blocks
    }

    /// Waits for the device's secondary (copy) stream.
    pub fn sync_secondary(&mut self) -> Result<(), EngineError> {
        Ok(self.device.sync_secondary()?)
    }

    /// Stops the device taking new work: a step with work to do is then
    /// refused ([`DeviceError::Quiesced`]); cancels still release.
    pub fn quiesce(&mut self) -> Result<(), EngineError> {
        Ok(self.device.quiesce()?)
    }

    /// Tears the device down (quiesce first). Every later effect — a step
    /// with work, a cancel of a running request — is refused with
    /// [`DeviceError::ShutDown`].
    pub fn shutdown(&mut self) -> Result<(), EngineError> {
        Ok(self.device.ep_shutdown()?)
    }

    /// Counters so far.
    pub fn counters(&self) -> EngineCounters {
        self.counters
    }

    /// Requests running.
    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting.
    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// Whether any request is in the engine.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Used / total device blocks.
    pub fn kv_usage(&self) -> f64 {
        self.kv.used_blocks() as f64 / self.kv.num_blocks() as f64
    }

    /// Moves buffered KV events into `out`.
    pub fn drain_kv_events(&mut self, out: &mut Vec<KvEvent>) {
        self.kv.drain_events_into(out);
    }

    /// Moves buffered observations into `out`.
    pub fn drain_observations(&mut self, out: &mut Vec<Observation>) {
        out.append(&mut self.observations);
    }

    /// Drops every cached block (`AllBlocksCleared`); refused while any
    /// request holds blocks.
    pub fn reset_prefix_cache(&mut self) -> bool {
        let reset = self.kv.reset_prefix_cache();
        if reset {
            // `AllBlocksCleared` covers every group: the states go too.
            if let Some(checkpoints) = self.checkpoints.as_mut() {
                checkpoints.clear();
            }
        }
        reset
    }

    /// A hybrid model's SSM checkpoints (`None`: attention only).
    pub fn checkpoints(&self) -> Option<&CheckpointCache> {
        self.checkpoints.as_ref()
    }

    /// Queues a request.
    pub fn add_request(&mut self, request: NewRequest) -> Result<(), AdmitError> {
        if self.by_request.contains_key(&request.id) {
            return Err(AdmitError::Duplicate(request.id));
        }
        if request.prompt.is_empty() {
            return Err(AdmitError::EmptyPrompt);
        }
        if request.max_tokens == 0 {
            return Err(AdmitError::NoOutput);
        }
        let total = request.prompt.len() + request.max_tokens as usize;
        let pool_tokens = self.config.num_blocks * self.config.block_size;
        let limit = self.config.max_model_len.min(pool_tokens);
        if total > limit {
            return Err(AdmitError::TooLong {
                prompt_tokens: request.prompt.len(),
                max_tokens: request.max_tokens,
                limit,
            });
        }
        if self.waiting.len() >= self.config.max_waiting {
            return Err(AdmitError::QueueFull(self.config.max_waiting));
        }
        let seq = Seq {
            request: request.id,
            prompt_len: request.prompt.len(),
            tokens: request.prompt,
            max_tokens: request.max_tokens as usize,
            num_computed: 0,
            hashes: Vec::new(),
            seed: request.hash_seed,
            lora_name: request.lora_name.clone(),
            committed_blocks: 0,
            phase: Phase::Waiting,
            deferral: None,
            rendezvous: None,
            prompt_counted: false,
            cached_tokens: 0,
            spilled: None,
            drafts: 0,
            branch_blocks: None,
        };
        let id = match self.free_slots.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some(seq);
                SeqId(slot)
            }
            None => {
                self.slots.push(Some(seq));
                SeqId(self.slots.len() as u32 - 1)
            }
        };
        self.kv.set_adapter(id, request.lora_name);
        self.by_request.insert(request.id, id);
        self.waiting.push_back(id);
        Ok(())
    }

    /// Cancels a request wherever it is; its blocks stay cached. Returns
    /// what it had done, or `None` when the engine does not hold it.
    pub fn cancel(&mut self, request: RequestId) -> Result<Option<Finished>, EngineError> {
        let Some(&id) = self.by_request.get(&request) else {
            return Ok(None);
        };
        let phase = self.seq(id).phase;
        // Effects first: a device that refuses them leaves the request
        // where it was.
        if let Some(tokens) = self.seq(id).spilled {
            self.device.drop_sequence_state(id)?;
            self.seq_mut(id).spilled = None;
            self.spill_used_blocks -= tokens.div_ceil(self.config.block_size);
            self.counters.spill_drops += 1;
        }
        self.release(id, true, Label("cancelled"))?;
        match phase {
            Phase::Waiting => self.waiting.retain(|&s| s != id),
            Phase::Running => self.running.retain(|&s| s != id),
        }
        self.counters.cancelled += 1;
        Ok(Some(self.remove(id, FinishReason::Cancelled)))
    }

    fn release(&mut self, id: SeqId, cache: bool, what: Label) -> Result<(), EngineError> {
        if self.device.reserves_ahead() {
            self.device.rollback(&mut self.kv, id)?;
        }
        self.device.release_seq(&mut self.kv, id, cache, what)?;
        Ok(())
    }

    fn remove(&mut self, id: SeqId, reason: FinishReason) -> Finished {
        let seq = self.slots[id.0 as usize]
            .take()
            .expect("removed sequences are live");
        if let Some(rv) = &seq.rendezvous {
            // Gone before its rendezvous was used: the lease is not needed.
            self.observe(Observation::RendezvousDone {
                request: seq.request,
                lease: rv.lease.id,
                restored: false,
            });
        }
        self.by_request.remove(&seq.request);
        self.free_slots.push(id.0);
        self.free_state_slot(id);
        Finished {
            request: seq.request,
            reason,
            prompt_tokens: seq.prompt_len,
            cached_tokens: seq.cached_tokens,
            output_tokens: seq.outputs(),
        }
    }

    /// Counts a restore decision and observes it.
    fn note_decision(&mut self, request: RequestId, decision: RestoreDecision) {
        let counters = &mut self.counters.restores;
        match decision {
            RestoreDecision::NoReusableEntry => counters.no_reusable_entry += 1,
            RestoreDecision::NativeRestoreSkipped => counters.native_restore_skipped += 1,
            RestoreDecision::SequenceCapacityNotReady { .. } => {
                counters.sequence_capacity_not_ready += 1
            }
            RestoreDecision::RetainedSourceLost => counters.retained_source_lost += 1,
            RestoreDecision::RequestStateNotReady => counters.request_state_not_ready += 1,
            RestoreDecision::Restore { .. } => {}
        }
        self.observe(Observation::RestoreDecided { request, decision });
    }

    fn observe(&mut self, observation: Observation) {
        push_bounded(
            &mut self.observations,
            &mut self.counters.observations_dropped,
            observation,
        );
    }

    fn seq(&self, id: SeqId) -> &Seq {
        self.slots[id.0 as usize]
            .as_ref()
            .expect("scheduler ids name live sequences")
    }

    fn seq_mut(&mut self, id: SeqId) -> &mut Seq {
        self.slots[id.0 as usize]
            .as_mut()
            .expect("scheduler ids name live sequences")
    }
}

fn push_bounded(buffer: &mut Vec<Observation>, dropped: &mut u64, observation: Observation) {
    if buffer.len() >= MAX_BUFFERED_OBSERVATIONS {
        *dropped += 1;
    } else {
        buffer.push(observation);
    }
}
