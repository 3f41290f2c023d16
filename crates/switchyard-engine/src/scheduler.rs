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

use crate::blocks::{engine_hash, BlockManager, SeqId};
use crate::checkpoints::{CheckpointCache, CheckpointPolicy};
use crate::config::{ConfigError, EngineConfig, Preemption};
use crate::device::{DeviceError, DeviceLayer, Label, Reservation, RestoreSource};
use crate::events::KvEvent;
use crate::lease::{LeaseCounters, LeaseError, LeaseId, LeaseRef, LeaseTable, LeasedKv};
use crate::restore::{
    self, RestoreDecision, RestoreDeferral, RestoreError, RestoreQuery, RestoreTicket,
};
use crate::slots::{SlotError, SlotTable};
use crate::timing::StepShape;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::sync::Arc;
use switchyard_core::hashing::{chain_hash, local_block_hash};
use switchyard_core::{LocalHash, RequestId, SequenceHash};

/// A request as the engine takes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewRequest {
    /// Its id.
    pub id: RequestId,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Output tokens to generate (at least 1).
    pub max_tokens: u32,
    /// Block-hash seed (see `switchyard_core::hashing::seed_for`): the
    /// prefix cache's keys, so requests share cached blocks only under
    /// the same seed. A LoRA request's is its adapter's,
    /// `seed_for(lora_name, cache_salt)`, the seed a router hashes the
    /// prompt with and a subscriber hashes the published tokens with.
    pub hash_seed: u64,
    /// The LoRA adapter the request runs under (`None`: the base model),
    /// named on the KV events of the blocks it caches, as vLLM names it.
    /// `hash_seed` must fold it in (the engine shares blocks by hash).
    pub lora_name: Option<Arc<str>>,
}

/// Why a request was refused. Bad input, not an engine fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The id is already in the engine.
    #[error("request {0} is already in the engine")]
    Duplicate(RequestId),
    /// An empty prompt.
    #[error("the prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` of zero.
    #[error("max_tokens must be at least 1")]
    NoOutput,
    /// Prompt plus output exceeds the model length or the pool.
    #[error("prompt of {prompt_tokens} tokens plus {max_tokens} output tokens exceeds the limit of {limit}")]
    TooLong {
        /// Prompt length.
        prompt_tokens: usize,
        /// Requested output.
        max_tokens: u32,
        /// The limit.
        limit: usize,
    },
    /// The waiting queue is full.
    #[error("the waiting queue is full ({0} requests)")]
    QueueFull(usize),
    /// A hybrid model's KV transfer would need its SSM state moved too,
    /// which is not modelled.
    #[error("a hybrid model takes no KV transfer (its SSM state is not transferred)")]
    HybridTransfer,
}

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

/// Why a request left the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// It generated `max_tokens` (or hit the model length).
    Length,
    /// It was cancelled.
    Cancelled,
    /// A published restore failed; the request was cancelled.
    RestoreFailed,
}

/// A request that left the engine. Lengths only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Finished {
    /// The request.
    pub request: RequestId,
    /// Why.
    pub reason: FinishReason,
    /// Its prompt length.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the cache (device hit plus restore) at first admission.
    pub cached_tokens: usize,
    /// Output tokens generated.
    pub output_tokens: usize,
}

/// One synthetic output token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenOutput {
    /// The request.
    pub request: RequestId,
    /// The token id.
    pub token: u32,
    /// 0-based output position.
    pub index: u32,
}

/// What a step did. The buffers are reused from step to step.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct StepReport {
    /// Model milliseconds the step took (0 when idle).
    pub model_ms: f64,
    /// What it computed.
    pub shape: StepShape,
    /// Sequences scheduled.
    pub scheduled: usize,
    /// Tokens sampled this step.
    pub tokens: Vec<TokenOutput>,
    /// Requests that finished this step.
    pub finished: Vec<Finished>,
}

impl StepReport {
    /// Whether the step computed nothing.
    pub fn is_idle(&self) -> bool {
        self.scheduled == 0
    }

    fn clear(&mut self) {
        self.model_ms = 0.0;
        self.shape = StepShape::default();
        self.scheduled = 0;
        self.tokens.clear();
        self.finished.clear();
    }
}

/// Something worth exporting that happened inside the core. Lengths only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Observation {
    /// A restore decision was taken (`Restore` is only an intent).
    RestoreDecided {
        /// The request.
        request: RequestId,
        /// The decision.
        decision: RestoreDecision,
    },
    /// A restore was installed and acknowledged.
    Restored {
        /// The request.
        request: RequestId,
        /// Tokens restored.
        candidate_prefix_tokens: usize,
    },
    /// A published restore failed; the request was cancelled.
    RestoreFailed {
        /// The request.
        request: RequestId,
        /// Why, when the output was invalid or its acknowledgement refused
        /// (`None`: the device failed the restore itself).
        error: Option<RestoreError>,
    },
    /// A request restoring from a rendezvous no longer needs its lease
    /// (restored, failed, recomputing instead, or gone): the driver
    /// releases it at the source. Exactly one per rendezvous request.
    RendezvousDone {
        /// The request.
        request: RequestId,
        /// The lease it was given.
        lease: LeaseId,
        /// Whether its blocks were restored from the lease.
        restored: bool,
    },
    /// A running request was preempted (recompute, or spill when followed
    /// by `Spilled`).
    Preempted {
        /// The request.
        request: RequestId,
    },
    /// A preempted request's computed KV was saved to the host; it is
    /// loaded back on resume, or dropped if the request is cancelled first.
    Spilled {
        /// The request.
        request: RequestId,
        /// Tokens saved.
        tokens: usize,
    },
}

/// Counts of restore outcomes, by decision.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RestoreCounters {
    /// `NoReusableEntry` decisions.
    pub no_reusable_entry: u64,
    /// `SequenceCapacityNotReady` decisions (deferrals).
    pub sequence_capacity_not_ready: u64,
    /// `NativeRestoreSkipped` decisions.
    pub native_restore_skipped: u64,
    /// `RetainedSourceLost` decisions (a retry's source no longer follows
    /// the device prefix).
    pub retained_source_lost: u64,
    /// `RequestStateNotReady` decisions (a rendezvous not yet delivered).
    pub request_state_not_ready: u64,
    /// Restores acknowledged (`Restored`).
    pub restored: u64,
    /// Restores that failed after publication.
    pub failed: u64,
}

/// Engine counters (monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineCounters {
    /// Steps that computed something.
    pub steps: u64,
    /// Prompt tokens admitted (counted once per request).
    pub prompt_tokens: u64,
    /// Prompt tokens served from the cache at first admission.
    pub prefix_hit_tokens: u64,
    /// Output tokens sampled.
    pub generated_tokens: u64,
    /// Preemptions (recompute and spill).
    pub preemptions: u64,
    /// Running sequences kept out of a step because their reservation
    /// answered `Exhausted` (counted once per sequence and step).
    pub kept_out: u64,
    /// Preemptions that saved the sequence's state to the host.
    pub spills: u64,
    /// Spilled states loaded back on resume.
    pub spill_loads: u64,
    /// Spilled states dropped (their request cancelled while spilled).
    pub spill_drops: u64,
    /// Spill preemptions that recomputed instead (the spill area was full).
    pub spill_fallbacks: u64,
    /// State-slot compactions.
    pub slot_compactions: u64,
    /// Logits bytes read back to the host.
    pub logits_bytes: u64,
    /// Requests finished at their length.
    pub finished: u64,
    /// Requests cancelled.
    pub cancelled: u64,
    /// Restore outcomes.
    pub restores: RestoreCounters,
    /// Observations dropped because nobody drained them.
    pub observations_dropped: u64,
    /// Speculative decoding: draft positions verified.
    pub draft_tokens_proposed: u64,
    /// Speculative decoding: drafts accepted (emitted as output tokens).
    pub draft_tokens_accepted: u64,
    /// Speculative decoding: over-runs rolled back (steps that rejected a
    /// draft, `RollbackOverrun`).
    pub spec_rollbacks: u64,
    /// Speculative decoding: blocks those rollbacks released.
    pub spec_rollback_blocks: u64,
    /// Speculative decoding: decode steps that ran without drafts because
    /// the over-run's reservation answered `Exhausted` and one position
    /// fitted.
    pub spec_fallbacks: u64,
    /// Hybrid models: SSM checkpoints saved (`MarconiCheckpoint`).
    pub ssm_checkpoints: u64,
    /// Hybrid models: SSM checkpoints evicted.
    pub ssm_checkpoint_evictions: u64,
    /// Hybrid models: admissions resumed from an SSM checkpoint
    /// (`LoadCheckpoint`).
    pub ssm_resumes: u64,
    /// Hybrid models: cached attention tokens an admission could not use
    /// because no SSM state was kept that deep (recomputed).
    pub ssm_unusable_hit_tokens: u64,
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

/// A request's rendezvous source: the lease it was given and, once the
/// driver has transferred it, the captured blocks (kept across capacity
/// deferrals: the retry uses exactly these).
struct Rendezvous {
    lease: LeaseRef,
    delivered: Option<LeasedKv>,
    deferrals: u32,
    /// Whether `RequestStateNotReady` was decided (and counted) already.
    waited: bool,
}

/// Why a transfer could not be handed to a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DeliverError {
    /// The engine does not hold the request.
    #[error("no such request")]
    UnknownRequest,
    /// The request restores from no rendezvous, or no longer needs it.
    #[error("the request awaits no rendezvous")]
    NotAwaited,
    /// A transfer was already handed over.
    #[error("the rendezvous was already delivered")]
    AlreadyDelivered,
    /// The tokens are not `block_size` per hash.
    #[error("{tokens} tokens for {blocks} blocks of {block_size}")]
    Malformed {
        /// Tokens delivered.
        tokens: usize,
        /// Hashes delivered.
        blocks: usize,
        /// Tokens per block here.
        block_size: usize,
    },
}

/// The block hashes of `tokens`' first `blocks` full blocks.
fn block_hashes(tokens: &[u32], seed: u64, blocks: usize, block_size: usize) -> Vec<SequenceHash> {
    let mut hashes: Vec<SequenceHash> = Vec::with_capacity(blocks);
    for chunk in tokens.chunks_exact(block_size).take(blocks) {
        let local = local_block_hash(chunk, seed);
        hashes.push(match hashes.last() {
            None => SequenceHash(local.0),
            Some(&prev) => chain_hash(prev, LocalHash(local.0)),
        });
    }
    hashes
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

    /// Queues a request that restores its prefix from another engine's
    /// capture `lease` (a rendezvous): it waits (`RequestStateNotReady`,
    /// letting the requests behind it go first) until the driver hands the
    /// transfer over with [`Self::deliver_rendezvous`].
    pub fn add_rendezvous_request(
        &mut self,
        request: NewRequest,
        lease: LeaseRef,
    ) -> Result<(), AdmitError> {
        if self.checkpoints.is_some() {
            return Err(AdmitError::HybridTransfer);
        }
        let id = request.id;
        self.add_request(request)?;
        let seq = self.by_request[&id];
        self.seq_mut(seq).rendezvous = Some(Rendezvous {
            lease,
            delivered: None,
            deferrals: 0,
            waited: false,
        });
        Ok(())
    }

    /// Hands a transferred capture to the request waiting for it. Checked
    /// for shape here and against the prompt at admission.
    pub fn deliver_rendezvous(
        &mut self,
        request: RequestId,
        transfer: LeasedKv,
    ) -> Result<(), DeliverError> {
        let bs = self.config.block_size;
        let &id = self
            .by_request
            .get(&request)
            .ok_or(DeliverError::UnknownRequest)?;
        let Some(rendezvous) = self.seq_mut(id).rendezvous.as_mut() else {
            return Err(DeliverError::NotAwaited);
        };
        if rendezvous.delivered.is_some() {
            return Err(DeliverError::AlreadyDelivered);
        }
        if transfer.tokens.len() != transfer.hashes.len() * bs {
            return Err(DeliverError::Malformed {
                tokens: transfer.tokens.len(),
                blocks: transfer.hashes.len(),
                block_size: bs,
            });
        }
        rendezvous.delivered = Some(transfer);
        Ok(())
    }

    /// Captures the leading blocks of `prompt` the device caches under a
    /// lease for another engine to restore from, until `expires_at_ms`;
    /// `token` is its secret (the driver draws it from a CSPRNG). Returns
    /// the lease and the blocks it holds.
    pub fn capture(
        &mut self,
        prompt: &[u32],
        hash_seed: u64,
        token: u128,
        expires_at_ms: f64,
    ) -> Result<(LeaseRef, usize), LeaseError> {
        let bs = self.config.block_size;
        let hashes = block_hashes(prompt, hash_seed, prompt.len() / bs, bs);
        self.leases
            .capture(&mut self.kv, &hashes, token, expires_at_ms)
    }

    /// Leading full blocks of `prompt` this engine's device caches now (a
    /// transfer need not move those).
    pub fn cached_prefix_blocks(&self, prompt: &[u32], hash_seed: u64) -> usize {
        let bs = self.config.block_size;
        self.kv
            .lookup_prefix(&block_hashes(prompt, hash_seed, prompt.len() / bs, bs))
    }

    /// A lease's blocks, for the transfer to the engine restoring them.
    pub fn read_lease(&mut self, lease: LeaseRef) -> Result<LeasedKv, LeaseError> {
        self.leases.read(&self.kv, lease)
    }

    /// Releases a lease (its blocks stay cached, evictable again).
    pub fn release_lease(&mut self, lease: LeaseRef) -> Result<(), LeaseError> {
        self.leases.release(&mut self.kv, lease)
    }

    /// Releases the leases past their expiry; returns how many.
    pub fn expire_leases(&mut self, now_ms: f64) -> usize {
        self.leases.expire(&mut self.kv, now_ms)
    }

    /// Leases held now.
    pub fn leases_held(&self) -> usize {
        self.leases.len()
    }

    /// Lease counters so far.
    pub fn lease_counters(&self) -> LeaseCounters {
        self.leases.counters()
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
        let mut budget;
        let mut preempted = false;
        let mut kept_out;
        let mut restore_tokens = 0usize;
        let mut saved_tokens = 0usize;

        loop {
            budget = self.config.max_num_batched_tokens;
            kept_out = false;
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
            if !kept_out || !scheduled.is_empty() {
                break;
            }
            let Some(&victim) = self.running.last() else {
                break;
            };
            saved_tokens += self.preempt(victim)?;
            preempted = true;
        }

        if !preempted && !kept_out {
            // In order; a request still waiting for its rendezvous is
            // passed over (`next` moves past it), anything else that does
            // not fit stops admission.
            let mut next = 0;
            while budget > 0 && self.running.len() < self.config.max_num_seqs {
                let Some(&id) = self.waiting.get(next) else {
                    break;
                };
                // A sequence with state needs a slot to start: none free,
                // none can start.
                if self.config.state_slots > 0 && self.state_slots.allocate(id).is_err() {
                    break;
                }
                let admission = self.admit(id, budget, &mut restore_tokens, report)?;
                if !matches!(admission, Admission::Scheduled(_)) {
                    self.free_state_slot(id);
                }
                match admission {
                    Admission::Scheduled(n) => {
                        self.waiting.remove(next);
                        self.seq_mut(id).phase = Phase::Running;
                        self.running.push(id);
                        scheduled.push((id, n));
                        budget -= n;
                    }
                    Admission::NotReady => next += 1,
                    Admission::Blocked => break,
                    Admission::Removed => {
                        self.waiting.remove(next);
                    }
                }
            }
        }

        if scheduled.is_empty() {
            // Nothing launched, but a spill may have copied state to the
            // host: that time passes all the same.
            if saved_tokens > 0 {
                report.model_ms = self.config.timing.restore_ms(saved_tokens as u64);
            }
            return Ok(());
        }

        let mut shape = StepShape {
            restore_tokens: restore_tokens as u64,
            saved_tokens: saved_tokens as u64,
            kv_used_blocks: self.kv.used_blocks() as u64,
            kv_total_blocks: self.kv.num_blocks() as u64,
            ..StepShape::default()
        };
        for &(id, n) in scheduled.iter() {
            let seq = self.seq(id);
            if n == 1 && seq.outputs() > 0 && seq.num_computed + 1 == seq.tokens.len() {
                shape.decode_tokens += 1;
                shape.draft_tokens += seq.drafts as u64;
            } else {
                shape.prefill_tokens += n as u64;
            }
        }
        self.device.launch_step(&self.kv, &shape)?;
        let result = self.device.step_result()?;
        report.model_ms = result.duration_ms;
        if self.config.read_logits {
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
        }
        report.shape = shape;
        report.scheduled = scheduled.len();
        self.counters.steps += 1;

        let bs = self.config.block_size;
        let vocabulary = self.config.output_vocabulary.as_deref();
        let acceptance_rate = self.config.spec_decode.map_or(0.0, |s| s.acceptance_rate);
        let mut any_finished = false;
        // Hybrid models: the block boundaries each sequence passed.
        let mut passed: Vec<(SeqId, usize, usize)> = Vec::new();
        for &(id, n) in scheduled.iter() {
            let max_model_len = self.config.max_model_len;
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
                    any_finished = true;
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
        }
        for (id, first, full) in passed {
            self.checkpoint_blocks(id, first, full)?;
        }
        if let Some(hybrid) = self.config.hybrid {
            let copies = std::mem::take(&mut self.state_copies);
            report.model_ms += self.config.timing.host_copy_ms(copies * hybrid.state_bytes);
        }
        if any_finished {
            for &(id, _) in scheduled.iter() {
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
        }
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

    fn admit(
        &mut self,
        id: SeqId,
        budget: usize,
        restore_tokens: &mut usize,
        report: &mut StepReport,
    ) -> Result<Admission, EngineError> {
        if let Some(tokens) = self.seq(id).spilled {
            return self.resume_spilled(id, tokens, budget, restore_tokens);
        }
        let bs = self.config.block_size;
        let timing = &self.config.timing;
        let seq = self.slots[id.0 as usize]
            .as_mut()
            .expect("waiting sequences are live");
        let max_hit_blocks = (seq.tokens.len() - 1) / bs;
        seq.ensure_hashes(max_hit_blocks, bs);
        let mut hit = self.kv.lookup_prefix(&seq.hashes[..max_hit_blocks]);
        if let Some(checkpoints) = self.checkpoints.as_mut() {
            // A hybrid model resumes from its deepest SSM state within the
            // cached attention prefix; what lies beyond is recomputed.
            let usable = checkpoints.deepest(&seq.hashes[..hit]);
            if checkpoints.policy() == CheckpointPolicy::Marconi && usable < hit {
                // The prompt leaves a cached prefix here: a branch point.
                seq.branch_blocks = Some(hit);
            }
            if usable > 0 {
                checkpoints.touch(seq.hashes[usable - 1]);
            }
            if !seq.prompt_counted {
                self.counters.ssm_unusable_hit_tokens += ((hit - usable) * bs) as u64;
            }
            hit = usable;
        }
        let mut computed_blocks = hit;
        let mut restored = None;

        // A deferred restore's source, held (pinned) until this admission
        // is done with it.
        let mut retained = None;
        // The rendezvous, out of the sequence while this admission decides.
        let mut rendezvous = seq.rendezvous.take();
        if let Some(rv) = rendezvous.as_mut() {
            let request = seq.request;
            let decided = restore::decide_rendezvous(
                rv.delivered.as_ref(),
                &seq.hashes[..max_hit_blocks],
                hit,
                self.kv.free_blocks(),
                bs,
            );
            let mut decision = match decided {
                Ok(decision) => decision,
                Err(error) => {
                    // Another prompt's blocks: cancel, never fall back.
                    let lease = rv.lease.id;
                    self.counters.restores.failed += 1;
                    self.observe(Observation::RestoreFailed {
                        request,
                        error: Some(error),
                    });
                    self.observe(Observation::RendezvousDone {
                        request,
                        lease,
                        restored: false,
                    });
                    self.device.release_seq(
                        &mut self.kv,
                        id,
                        false,
                        Label("rendezvous_mismatch"),
                    )?;
                    let finished = self.remove(id, FinishReason::RestoreFailed);
                    report.finished.push(finished);
                    return Ok(Admission::Removed);
                }
            };
            if matches!(decision, RestoreDecision::SequenceCapacityNotReady { .. })
                && rv.deferrals >= self.config.max_restore_deferrals
            {
                decision = RestoreDecision::NativeRestoreSkipped;
            }
            // Waiting for the transfer is decided once, not every step.
            let first_wait = decision == RestoreDecision::RequestStateNotReady
                && !std::mem::replace(&mut rv.waited, true);
            if decision != RestoreDecision::RequestStateNotReady || first_wait {
                self.note_decision(request, decision);
            }
            match decision {
                RestoreDecision::RequestStateNotReady => {
                    self.seq_mut(id).rendezvous = rendezvous;
                    return Ok(Admission::NotReady);
                }
                RestoreDecision::SequenceCapacityNotReady { .. } => {
                    rv.deferrals += 1;
                    self.seq_mut(id).rendezvous = rendezvous;
                    return Ok(Admission::Blocked);
                }
                RestoreDecision::Restore {
                    candidate_prefix_tokens,
                } => restored = Some(candidate_prefix_tokens),
                RestoreDecision::NoReusableEntry
                | RestoreDecision::NativeRestoreSkipped
                | RestoreDecision::RetainedSourceLost => {
                    let lease = rv.lease.id;
                    self.observe(Observation::RendezvousDone {
                        request,
                        lease,
                        restored: false,
                    });
                    rendezvous = None;
                }
            }
        } else if self.kv.has_host_tier() {
            retained = seq.deferral.take();
            let attempts = retained.as_ref().map_or(0, |d| d.attempts);
            let mut decision = match &retained {
                // A retry restores the source it was deferred with; it
                // never re-selects from the index.
                Some(deferral) => restore::retry(deferral, hit, self.kv.free_blocks(), bs),
                None => restore::decide(
                    &RestoreQuery {
                        prompt_tokens: seq.tokens.len(),
                        device_hit_blocks: hit,
                        host_run_blocks: self.kv.lookup_host(&seq.hashes[hit..max_hit_blocks]),
                        free_device_blocks: self.kv.free_blocks(),
                        block_size: bs,
                        min_restore_tokens: self.config.min_restore_tokens,
                    },
                    timing,
                ),
            };
            if matches!(decision, RestoreDecision::SequenceCapacityNotReady { .. })
                && attempts >= self.config.max_restore_deferrals
            {
                decision = RestoreDecision::NativeRestoreSkipped;
            }
            let request = seq.request;
            self.note_decision(request, decision);
            let seq = self.slots[id.0 as usize].as_mut().expect("live");
            match decision {
                RestoreDecision::SequenceCapacityNotReady {
                    candidate_prefix_tokens,
                } => {
                    let blocks = candidate_prefix_tokens / bs;
                    let pins = self.kv.pin_host(&seq.hashes[hit..hit + blocks]);
                    seq.deferral = Some(RestoreDeferral::new(hit, blocks, bs, attempts + 1, pins));
                    return Ok(Admission::Blocked);
                }
                RestoreDecision::Restore {
                    candidate_prefix_tokens,
                } => {
                    restored = Some(candidate_prefix_tokens);
                }
                RestoreDecision::NoReusableEntry
                | RestoreDecision::NativeRestoreSkipped
                | RestoreDecision::RetainedSourceLost
                | RestoreDecision::RequestStateNotReady => {}
            }
        }

        let seq = self.slots[id.0 as usize].as_mut().expect("live");
        let hashes = std::mem::take(&mut seq.hashes);
        self.kv.acquire_prefix(id, &hashes[..hit]);
        if let Some(candidate_prefix_tokens) = restored {
            let blocks = candidate_prefix_tokens / bs;
            let seq = self.slots[id.0 as usize].as_mut().expect("live");
            let ticket = RestoreTicket {
                request: seq.request,
                prompt_tokens: seq.tokens.len(),
                device_prefix_tokens: hit * bs,
                blocks,
            };
            let source = &hashes[hit..hit + blocks];
            let (pins, from) = match &rendezvous {
                Some(rv) => {
                    let tokens = &rv
                        .delivered
                        .as_ref()
                        .expect("a rendezvous restore was decided on a delivery")
                        .tokens;
                    (
                        None,
                        RestoreSource::Rendezvous {
                            tokens: &tokens[hit * bs..(hit + blocks) * bs],
                        },
                    )
                }
                None => (Some(self.kv.pin_host(source)), RestoreSource::Host),
            };
            drop(retained.take());
            let parent = hit.checked_sub(1).map(|p| hashes[p]);
            let outcome = self
                .device
                .restore(&mut self.kv, id, &ticket, parent, source, from);
            let checked = match outcome {
                Ok(output) => {
                    let table = self.kv.installed_after(id, hit, source);
                    restore::validate(&ticket, &output, &table, bs).map_err(Some)
                }
                Err(_) => Err(None),
            };
            self.seq_mut(id).hashes = hashes;
            // Install the progress, then acknowledge; only then observe. A
            // refused acknowledgement fails this request like an invalid
            // output: the device published a restore it does not stand by.
            let acknowledged = checked.and_then(|computed_tokens| {
                self.device
                    .acknowledge_restore(id)
                    .map(|()| computed_tokens)
                    .map_err(|_| Some(RestoreError::AcknowledgeFailed))
            });
            drop(pins);
            let done = |restored| {
                rendezvous.as_ref().map(|rv| Observation::RendezvousDone {
                    request: ticket.request,
                    lease: rv.lease.id,
                    restored,
                })
            };
            match acknowledged {
                Ok(computed_tokens) => {
                    computed_blocks = computed_tokens / bs;
                    // A rendezvous is carried by the transfer, not by the
                    // step: only a host-tier copy costs step time.
                    if rendezvous.is_none() {
                        *restore_tokens += computed_tokens - hit * bs;
                    }
                    self.counters.restores.restored += 1;
                    self.observe(Observation::Restored {
                        request: ticket.request,
                        candidate_prefix_tokens,
                    });
                    if let Some(done) = done(true) {
                        self.observe(done);
                    }
                }
                Err(error) => {
                    self.device
                        .release_seq(&mut self.kv, id, false, Label("restore_failed"))?;
                    self.counters.restores.failed += 1;
                    self.observe(Observation::RestoreFailed {
                        request: ticket.request,
                        error,
                    });
                    if let Some(done) = done(false) {
                        self.observe(done);
                    }
                    let finished = self.remove(id, FinishReason::RestoreFailed);
                    report.finished.push(finished);
                    return Ok(Admission::Removed);
                }
            }
        } else {
            self.seq_mut(id).hashes = hashes;
        }
        drop(retained);

        if self.checkpoints.is_some() && computed_blocks > 0 {
            // The SSM state at the resume point, into the sequence's slot.
            let slot = self
                .state_slots
                .slot_of(id)
                .expect("a hybrid sequence is admitted with a state slot");
            self.device
                .load_checkpoint(&self.kv, id, slot, computed_blocks * bs)?;
            self.counters.ssm_resumes += 1;
            self.state_copies += 1;
        }
        let seq = self.slots[id.0 as usize].as_mut().expect("live");
        seq.num_computed = computed_blocks * bs;
        seq.committed_blocks = computed_blocks;
        if !seq.prompt_counted {
            seq.prompt_counted = true;
            seq.cached_tokens = seq.num_computed;
            self.counters.prompt_tokens += seq.prompt_len as u64;
            self.counters.prefix_hit_tokens += seq.num_computed as u64;
        }
        let n = (seq.tokens.len() - seq.num_computed).min(budget);
        let target = seq.num_computed + n;
        match self.device.reserve_kv(&mut self.kv, id, target)? {
            Reservation::Reserved { .. } => Ok(Admission::Scheduled(n)),
            Reservation::Exhausted => self.release_blocked(id, Label("admission_blocked")),
        }
    }

    /// Preempts running `id` (the newest): with `preemption = "spill"` and
    /// room in the spill area its computed KV is saved to the host first,
    /// and the copy synchronised before its blocks are released. Returns
    /// the tokens saved (0: it recomputes).
    fn preempt(&mut self, id: SeqId) -> Result<usize, EngineError> {
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
    fn resume_spilled(
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
    fn compact_slots(&mut self) -> Result<(), EngineError> {
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
    fn free_state_slot(&mut self, id: SeqId) {
        // `NotOwned` is the answer for a sequence that never took a slot
        // (state_slots = 0, or not admitted yet): nothing to free.
        let _ = self.state_slots.free(id);
    }

    /// Frees a sequence whose reservation came back `Exhausted` before it
    /// ran (nothing reserved to roll back): its blocks go back, cached
    /// ones stay cached, and it will compute its tokens again.
    fn release_blocked(&mut self, id: SeqId, what: Label) -> Result<Admission, EngineError> {
        self.device.release_seq(&mut self.kv, id, true, what)?;
        let seq = self.seq_mut(id);
        seq.num_computed = 0;
        seq.committed_blocks = 0;
        Ok(Admission::Blocked)
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

/// The synthetic token sampled at output position `index` of `request`:
/// deterministic, drawn from `vocabulary` when given and not empty
/// ([`EngineConfig::validate`] refuses an empty one), else spread over
/// 32,000 ids above the special ids.
pub fn synthetic_token(request: RequestId, index: u32, vocabulary: Option<&[u32]>) -> u32 {
    let mut x = (request.0 as u64)
        ^ ((request.0 >> 64) as u64)
        ^ (u64::from(index) << 32 | u64::from(index));
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    match vocabulary {
        Some(ids) if !ids.is_empty() => ids[(x % ids.len() as u64) as usize],
        _ => 100 + (x % 32_000) as u32,
    }
}

/// Drafts accepted of `drafts` proposed after output position
/// `first_index` of `request`: each with probability `rate`, stopping at
/// the first rejection. Deterministic (a hash of the request and the
/// position, as [`synthetic_token`]): no random state.
pub fn accepted_drafts(request: RequestId, first_index: u32, drafts: usize, rate: f64) -> usize {
    (0..drafts as u32)
        .take_while(|&j| draft_draw(request, first_index.wrapping_add(j)) < rate)
        .count()
}

/// A uniform draw in `[0, 1)` for the draft at output position `index`.
fn draft_draw(request: RequestId, index: u32) -> f64 {
    let mut x = (request.0 as u64)
        ^ ((request.0 >> 64) as u64).rotate_left(29)
        ^ u64::from(index).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    x ^= x >> 30;
    x = x.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x ^= x >> 27;
    x = x.wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^= x >> 31;
    (x >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{AheadDevice, Effect, ScriptedDevice, SyncDevice};
    use crate::lease::{LeaseError, LeaseRef, LeasedKv};
    use crate::restore::RestoreOutput;
    use crate::slots::SlotId;
    use crate::timing::TimingConfig;
    use switchyard_core::hashing::DEFAULT_SEED;

    fn config() -> EngineConfig {
        EngineConfig {
            block_size: 16,
            num_blocks: 256,
            ..EngineConfig::default()
        }
    }

    fn request(id: u128, prompt: Vec<u32>, max_tokens: u32) -> NewRequest {
        NewRequest {
            id: RequestId(id),
            prompt,
            max_tokens,
            hash_seed: DEFAULT_SEED,
            lora_name: None,
        }
    }

    fn run_to_end<D: DeviceLayer>(engine: &mut Engine<D>) -> Vec<StepReport> {
        let mut reports = Vec::new();
        for _ in 0..10_000 {
            if !engine.has_work() {
                return reports;
            }
            let mut report = StepReport::default();
            engine.step(&mut report).unwrap();
            reports.push(report);
        }
        panic!("engine did not drain");
    }

    /// Runs `prompts` one after the other (one output token each) on a
    /// hybrid engine with 4-token blocks, keeping checkpoints by `policy`.
    fn hybrid_run(policy: CheckpointPolicy, prompts: &[Vec<u32>]) -> Engine<ScriptedDevice> {
        let cfg = EngineConfig {
            block_size: 4,
            max_num_seqs: 8,
            ..config()
        }
        .hybrid(policy);
        let mut engine = Engine::new(cfg, ScriptedDevice::new(TimingConfig::default())).unwrap();
        for (i, prompt) in prompts.iter().enumerate() {
            engine
                .add_request(request(i as u128 + 1, prompt.clone(), 1))
                .unwrap();
            run_to_end(&mut engine);
        }
        engine
    }

    #[test]
    fn a_hybrid_engine_resumes_only_from_an_ssm_checkpoint() {
        // A: 5 blocks; B and C share A's first 4 blocks, then diverge.
        let a: Vec<u32> = (0..20).collect();
        let tail = |from: u32| (0..16).chain(from..from + 8).collect::<Vec<u32>>();
        let (b, c) = (tail(100), tail(200));

        // Marconi keeps A's prompt end (block 5), not block 4: B finds 4
        // attention blocks cached and no state within them, recomputes,
        // and keeps the branch point (block 4) and its own end (block 6).
        // C resumes from B's branch point.
        let engine = hybrid_run(
            CheckpointPolicy::Marconi,
            &[a.clone(), b.clone(), c.clone()],
        );
        let counters = engine.counters();
        assert_eq!(
            counters.ssm_checkpoints, 4,
            "ends of A, B and C, and B's branch point"
        );
        assert_eq!(counters.ssm_resumes, 1);
        assert_eq!(
            counters.ssm_unusable_hit_tokens, 16,
            "B's 4 cached blocks, recomputed"
        );
        assert_eq!(counters.prefix_hit_tokens, 16, "C's resumed prefix");
        let log = &engine.device().log;
        let load = log
            .iter()
            .find(|e| matches!(e, Effect::LoadCheckpoint { .. }))
            .expect("C loads the branch point's state");
        assert!(matches!(load, Effect::LoadCheckpoint { tokens: 16, .. }));
        let mut events = Vec::new();
        let mut engine = engine;
        engine.drain_kv_events(&mut events);
        let stored = events
            .iter()
            .filter(|e| matches!(e, KvEvent::CheckpointStored { .. }))
            .count();
        assert_eq!(stored, 4, "every checkpoint is published");

        // Every block: B resumes from A's block-4 state at once.
        let engine = hybrid_run(CheckpointPolicy::EveryBlock, &[a, b]);
        let counters = engine.counters();
        assert_eq!(counters.ssm_resumes, 1);
        assert_eq!(counters.ssm_unusable_hit_tokens, 0);
        assert_eq!(
            counters.ssm_checkpoints,
            5 + 2,
            "A's 5 blocks, B's 2 new ones"
        );
        // A KV transfer would need the SSM state moved too: refused.
        let mut engine = engine;
        let lease = LeaseRef {
            id: crate::lease::LeaseId(1),
            token: 7,
        };
        assert_eq!(
            engine.add_rendezvous_request(request(9, (0..24).collect(), 1), lease),
            Err(AdmitError::HybridTransfer)
        );
    }

    #[test]
    fn a_hybrid_models_prefill_costs_its_attention_share_plus_its_ssm_layers() {
        let plain = TimingConfig::default();
        let hybrid = TimingConfig {
            ssm: Some(crate::timing::SsmTiming::default()),
            ..TimingConfig::default()
        };
        // Long prompts: seven eighths of the quadratic term are gone.
        let [a, _, _] = plain.prefill;
        let saved = plain.prefill_ms(16_000) - hybrid.prefill_ms(16_000);
        assert!((saved - 0.875 * a * 16_000f64.powi(2)).abs() < 1e-6);
        let [_, b, c] = plain.prefill;
        assert!(
            (hybrid.prefill_ms(1) - (0.125 * (plain.prefill[0] + b) + c + 0.875 * b)).abs() < 1e-9
        );
        assert!(hybrid.decode_ms(1.0) <= plain.decode_ms(1.0));
    }

    #[test]
    fn the_second_of_two_requests_sharing_a_prefix_computes_only_its_suffix() {
        let timing = TimingConfig::default();
        let mut engine = Engine::new(config(), SyncDevice::new(timing.clone())).unwrap();
        let shared: Vec<u32> = (0..1000).collect();
        let mut first = shared.clone();
        first.extend(5000..5100);
        let mut second = shared.clone();
        second.extend(7000..7100);

        engine.add_request(request(1, first, 1)).unwrap();
        let reports = run_to_end(&mut engine);
        assert_eq!(reports[0].shape.prefill_tokens, 1100);

        engine.add_request(request(2, second, 1)).unwrap();
        let reports = run_to_end(&mut engine);
        // 62 full blocks (992 tokens) of the shared prefix are cached.
        assert_eq!(reports[0].shape.prefill_tokens, 1100 - 992);
        assert!((reports[0].model_ms - timing.prefill_ms(108)).abs() < 1e-9);
        assert_eq!(engine.counters().prefix_hit_tokens, 992);
        assert_eq!(engine.kv().free_blocks(), 256);
    }

    #[test]
    fn an_adapters_blocks_are_its_own_and_its_events_name_it() {
        use switchyard_core::hashing::seed_for;
        let mut engine = Engine::new(config(), SyncDevice::new(TimingConfig::default())).unwrap();
        // 70 tokens: 4 full 16-token blocks (64 tokens) and 6 more.
        let prompt: Vec<u32> = (0..70).collect();
        let under = |id: u128, lora: Option<&str>| NewRequest {
            hash_seed: seed_for(lora, None),
            lora_name: lora.map(Arc::from),
            ..request(id, prompt.clone(), 1)
        };
        // Each request alone; returns (prefill tokens, cached tokens).
        let mut serve = |request: NewRequest| {
            engine.add_request(request).unwrap();
            let reports = run_to_end(&mut engine);
            let finished = reports.iter().flat_map(|r| &r.finished).next().unwrap();
            (reports[0].shape.prefill_tokens, finished.cached_tokens)
        };
        assert_eq!(serve(under(1, None)), (70, 0), "base: cold");
        assert_eq!(
            serve(under(2, Some("sql"))),
            (70, 0),
            "sql: not the base's KV"
        );
        assert_eq!(
            serve(under(3, Some("sql"))),
            (6, 64),
            "sql again: its 4 blocks"
        );
        assert_eq!(serve(under(4, Some("chat"))), (70, 0), "chat: not sql's KV");
        assert_eq!(serve(under(5, None)), (6, 64), "base again: its 4 blocks");
        assert_eq!(engine.counters().prefix_hit_tokens, 128);
        assert_eq!(
            engine.kv().cached_blocks(),
            12,
            "4 blocks each of base, sql, chat"
        );

        // Each computation published its blocks under its adapter's name.
        let mut events = Vec::new();
        engine.drain_kv_events(&mut events);
        let stored: Vec<(usize, Option<&str>)> = events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored {
                    block_hashes,
                    lora_name,
                    ..
                } => Some((block_hashes.len(), lora_name.as_deref())),
                _ => None,
            })
            .collect();
        assert_eq!(stored, vec![(4, None), (4, Some("sql")), (4, Some("chat"))]);
    }

    #[test]
    fn an_output_vocabulary_supplies_every_generated_token_deterministically() {
        let vocabulary: std::sync::Arc<[u32]> = vec![279, 3_015, 42_000].into();
        let cfg = EngineConfig {
            output_vocabulary: Some(vocabulary.clone()),
            ..config()
        };
        let generate = |cfg: EngineConfig| {
            let mut engine = Engine::new(cfg, SyncDevice::new(TimingConfig::default())).unwrap();
            engine
                .add_request(request(1, (0..40).collect(), 64))
                .unwrap();
            let tokens: Vec<u32> = run_to_end(&mut engine)
                .iter()
                .flat_map(|r| r.tokens.iter().map(|t| t.token))
                .collect();
            tokens
        };
        let drawn = generate(cfg.clone());
        assert_eq!(drawn.len(), 64);
        assert!(drawn.iter().all(|t| vocabulary.contains(t)), "{drawn:?}");
        assert!(vocabulary.iter().all(|v| drawn.contains(v)), "{drawn:?}");
        assert_eq!(generate(cfg), drawn);
        // Without one, the ids are what they always were.
        let default: Vec<u32> = (0..64)
            .map(|i| synthetic_token(RequestId(1), i, None))
            .collect();
        assert_eq!(generate(config()), default);
        assert!(default.iter().all(|t| (100..32_100).contains(t)));
    }

    #[test]
    fn a_long_prompt_is_prefilled_in_chunks_within_the_token_budget() {
        let cfg = EngineConfig {
            max_num_batched_tokens: 512,
            ..config()
        };
        let mut engine = Engine::new(cfg, SyncDevice::new(TimingConfig::default())).unwrap();
        engine
            .add_request(request(1, (0..1200).collect(), 2))
            .unwrap();
        let reports = run_to_end(&mut engine);
        let prefill: Vec<u64> = reports.iter().map(|r| r.shape.prefill_tokens).collect();
        assert_eq!(prefill, vec![512, 512, 176, 0]);
        assert_eq!(
            reports[2].tokens.len(),
            1,
            "the first token comes with the last chunk"
        );
        assert_eq!(reports[3].finished.len(), 1);
        assert_eq!(reports[3].finished[0].output_tokens, 2);
    }

    #[test]
    fn a_dry_pool_preempts_the_newest_running_request_and_it_recomputes() {
        let cfg = EngineConfig {
            num_blocks: 8,
            ..config()
        };
        let mut engine = Engine::new(cfg, SyncDevice::new(TimingConfig::default())).unwrap();
        engine
            .add_request(request(1, (0..48).collect(), 40))
            .unwrap();
        engine
            .add_request(request(2, (100..148).collect(), 40))
            .unwrap();
        let reports = run_to_end(&mut engine);
        assert!(engine.counters().preemptions > 0);
        let finished: Vec<_> = reports.iter().flat_map(|r| r.finished.clone()).collect();
        assert_eq!(finished.len(), 2);
        assert!(finished.iter().all(|f| f.output_tokens == 40));
        assert_eq!(
            finished[0].request,
            RequestId(1),
            "the older request is never the victim"
        );
        assert_eq!(engine.kv().free_blocks(), 8);
    }

    #[test]
    fn cancelling_a_running_request_frees_its_blocks() {
        let mut engine = Engine::new(config(), SyncDevice::new(TimingConfig::default())).unwrap();
        engine
            .add_request(request(1, (0..100).collect(), 50))
            .unwrap();
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert!(engine.kv().used_blocks() > 0);
        let finished = engine.cancel(RequestId(1)).unwrap().unwrap();
        assert_eq!(finished.reason, FinishReason::Cancelled);
        assert_eq!(engine.kv().free_blocks(), 256);
        assert!(!engine.has_work());
        assert_eq!(
            engine.cancel(RequestId(1)),
            Ok(None),
            "cancelling twice is harmless"
        );
    }

    #[test]
    fn bad_requests_are_refused_with_a_reason() {
        let mut engine = Engine::new(config(), SyncDevice::new(TimingConfig::default())).unwrap();
        assert_eq!(
            engine.add_request(request(1, vec![], 1)),
            Err(AdmitError::EmptyPrompt)
        );
        assert_eq!(
            engine.add_request(request(1, vec![1], 0)),
            Err(AdmitError::NoOutput)
        );
        assert!(matches!(
            engine.add_request(request(1, vec![1; 5000], 1)),
            Err(AdmitError::TooLong { .. })
        ));
        engine.add_request(request(1, vec![1], 1)).unwrap();
        assert_eq!(
            engine.add_request(request(1, vec![1], 1)),
            Err(AdmitError::Duplicate(RequestId(1)))
        );
    }

    #[test]
    fn the_ahead_device_rolls_back_lookahead_blocks_when_a_request_finishes() {
        let mut engine =
            Engine::new(config(), AheadDevice::new(TimingConfig::default(), 1)).unwrap();
        engine
            .add_request(request(1, (0..32).collect(), 1))
            .unwrap();
        let reports = run_to_end(&mut engine);
        assert_eq!(reports.len(), 1);
        assert_eq!(engine.kv().free_blocks(), 256);
        assert_eq!(
            engine.kv().cached_blocks(),
            2,
            "the lookahead block was never offered to the cache"
        );
    }

    /// An engine with a host tier ([`host_config`]) on the scripted device.
    fn host_engine() -> Engine<ScriptedDevice> {
        Engine::new(host_config(), ScriptedDevice::new(TimingConfig::default())).unwrap()
    }

    fn host_config() -> EngineConfig {
        EngineConfig {
            num_blocks: 64,
            host_blocks: 256,
            min_restore_tokens: 16,
            ..config()
        }
    }

    /// Fills the host tier with `prompt`'s blocks: run it, then flush the device.
    fn spill_prompt<D: DeviceLayer>(engine: &mut Engine<D>, prompt: &[u32]) {
        engine
            .add_request(request(900, prompt.to_vec(), 1))
            .unwrap();
        run_to_end(engine);
        engine
            .add_request(request(901, (50_000..50_000 + 63 * 16).collect(), 1))
            .unwrap();
        run_to_end(engine);
    }

    fn observations<D: DeviceLayer>(engine: &mut Engine<D>) -> Vec<Observation> {
        let mut out = Vec::new();
        engine.drain_observations(&mut out);
        out
    }

    #[test]
    fn a_host_tier_hit_is_restored_then_acknowledged_then_observed() {
        let mut engine = host_engine();
        let prompt: Vec<u32> = (0..640).collect();
        spill_prompt(&mut engine, &prompt);
        observations(&mut engine);
        engine.device_mut().log.clear();
        engine.add_request(request(1, prompt.clone(), 1)).unwrap();
        let reports = run_to_end(&mut engine);
        let obs = observations(&mut engine);
        assert!(
            obs.contains(&Observation::Restored {
                request: RequestId(1),
                candidate_prefix_tokens: 608
            }),
            "{obs:?}"
        );
        // One prompt block survived on the device; 38 came back from the
        // host; the last block is computed (no logits are cached).
        assert_eq!(reports[0].shape.prefill_tokens, 16);
        assert_eq!(reports[0].shape.restore_tokens, 608);
        let log = &engine.device().log;
        let restore_at = log
            .iter()
            .position(|e| matches!(e, Effect::Restore { .. }))
            .unwrap();
        let ack_at = log
            .iter()
            .position(|e| matches!(e, Effect::AckRestore { .. }))
            .unwrap();
        assert!(restore_at < ack_at);
        assert_eq!(engine.counters().restores.restored, 1);
    }

    /// An engine with a 640-token prompt spilled to its host tier and
    /// request 2 holding most of its device for `outputs` tokens; request 1
    /// (that prompt) queued behind it.
    fn restore_behind_a_long_request(outputs: u32) -> Engine<ScriptedDevice> {
        let mut engine = host_engine();
        let prompt: Vec<u32> = (0..640).collect();
        spill_prompt(&mut engine, &prompt);
        engine
            .add_request(request(2, (90_000..90_000 + 40 * 16).collect(), outputs))
            .unwrap();
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        engine.add_request(request(1, prompt, 1)).unwrap();
        engine
    }

    #[test]
    fn a_restore_without_device_capacity_is_deferred_with_its_source_pinned() {
        let mut engine = restore_behind_a_long_request(200);
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        let obs = observations(&mut engine);
        assert!(obs.contains(&Observation::RestoreDecided {
            request: RequestId(1),
            decision: RestoreDecision::SequenceCapacityNotReady {
                candidate_prefix_tokens: 624
            }
        }));
        assert_eq!(engine.waiting_len(), 1);
        // Cancelling drops the deferral, which unpins the source.
        engine.cancel(RequestId(1)).unwrap();
        assert_eq!(engine.counters().restores.sequence_capacity_not_ready, 1);
    }

    #[test]
    fn a_deferred_restore_is_retried_from_its_retained_source() {
        let mut engine = restore_behind_a_long_request(5);
        engine.device_mut().log.clear();
        observations(&mut engine);
        run_to_end(&mut engine);
        let obs = observations(&mut engine);
        let decided: Vec<_> = obs
            .iter()
            .filter_map(|o| match o {
                Observation::RestoreDecided {
                    request: RequestId(1),
                    decision,
                } => Some(*decision),
                _ => None,
            })
            .collect();
        // Deferred while request 2 held the device, then restored: the
        // same 39 blocks each time (the retained source), nothing re-read.
        let deferred = RestoreDecision::SequenceCapacityNotReady {
            candidate_prefix_tokens: 624,
        };
        assert_eq!(decided[0], deferred, "{decided:?}");
        assert_eq!(
            decided.last(),
            Some(&RestoreDecision::Restore {
                candidate_prefix_tokens: 624
            })
        );
        assert!(
            decided[..decided.len() - 1].iter().all(|d| *d == deferred),
            "{decided:?}"
        );
        assert!(obs.contains(&Observation::Restored {
            request: RequestId(1),
            candidate_prefix_tokens: 624
        }));
        let tickets: Vec<_> = engine
            .device()
            .log
            .iter()
            .filter_map(|e| match e {
                Effect::Restore { ticket, .. } => Some(*ticket),
                _ => None,
            })
            .collect();
        assert_eq!(tickets.len(), 1);
        assert_eq!(
            (tickets[0].device_prefix_tokens, tickets[0].blocks),
            (0, 39)
        );
        assert_eq!(engine.counters().restores.retained_source_lost, 0);
    }

    #[test]
    fn a_refused_acknowledgement_cancels_that_request_and_nothing_else() {
        let mut engine = host_engine();
        let prompt: Vec<u32> = (0..640).collect();
        spill_prompt(&mut engine, &prompt);
        observations(&mut engine);
        engine.device_mut().fail_next_ack = true;
        engine.add_request(request(1, prompt, 1)).unwrap();
        engine
            .add_request(request(2, (70_000..70_000 + 64).collect(), 4))
            .unwrap();
        let reports = run_to_end(&mut engine);
        let finished: Vec<_> = reports.iter().flat_map(|r| r.finished.clone()).collect();
        let reason = |id| {
            finished
                .iter()
                .find(|f| f.request == RequestId(id))
                .map(|f| f.reason)
        };
        assert_eq!(reason(1), Some(FinishReason::RestoreFailed));
        assert_eq!(reason(2), Some(FinishReason::Length), "the step went on");
        let obs = observations(&mut engine);
        assert!(obs.contains(&Observation::RestoreFailed {
            request: RequestId(1),
            error: Some(RestoreError::AcknowledgeFailed)
        }));
        assert!(!obs
            .iter()
            .any(|o| matches!(o, Observation::Restored { .. })));
        assert_eq!(engine.counters().restores.failed, 1);
        assert_eq!(engine.kv().used_blocks(), 0, "every block came back");
    }

    #[test]
    fn a_restore_report_the_block_table_contradicts_cancels_the_request() {
        let mut engine = host_engine();
        let prompt: Vec<u32> = (0..640).collect();
        spill_prompt(&mut engine, &prompt);
        observations(&mut engine);
        // A report consistent with itself (one block fewer, sixteen tokens
        // fewer) that the block manager's table does not bear out.
        engine.device_mut().tamper_restore = Some(|out: RestoreOutput| RestoreOutput {
            restored_tokens: out.restored_tokens - 16,
            blocks_installed: out.blocks_installed - 1,
            ..out
        });
        engine.add_request(request(1, prompt, 1)).unwrap();
        let reports = run_to_end(&mut engine);
        assert_eq!(reports[0].finished[0].reason, FinishReason::RestoreFailed);
        let obs = observations(&mut engine);
        assert!(
            obs.iter().any(|o| matches!(
                o,
                Observation::RestoreFailed {
                    error: Some(RestoreError::TableMismatch { .. }),
                    ..
                }
            )),
            "{obs:?}"
        );
        assert!(!engine
            .device()
            .log
            .iter()
            .any(|e| matches!(e, Effect::AckRestore { .. })));
    }

    /// A prefill engine that has computed `prompt` and captured it.
    fn captured(prompt: &[u32]) -> (Engine<ScriptedDevice>, LeaseRef) {
        let mut source =
            Engine::new(config(), ScriptedDevice::new(TimingConfig::default())).unwrap();
        source
            .add_request(request(900, prompt.to_vec(), 1))
            .unwrap();
        run_to_end(&mut source);
        let (lease, blocks) = source
            .capture(prompt, DEFAULT_SEED, 0xfeed, 1_000.0)
            .unwrap();
        assert_eq!(blocks, prompt.len() / 16);
        (source, lease)
    }

    fn decode_engine() -> Engine<ScriptedDevice> {
        Engine::new(config(), ScriptedDevice::new(TimingConfig::default())).unwrap()
    }

    #[test]
    fn a_decode_engine_restores_a_capture_then_acknowledges_then_observes() {
        let prompt: Vec<u32> = (0..640).collect();
        let (mut source, lease) = captured(&prompt);
        let mut target = decode_engine();
        target
            .add_rendezvous_request(request(1, prompt.clone(), 2), lease)
            .unwrap();
        target
            .add_request(request(2, (5_000..5_064).collect(), 1))
            .unwrap();
        // The transfer has not arrived: request 2, behind it, goes first.
        let mut report = StepReport::default();
        target.step(&mut report).unwrap();
        assert_eq!(report.finished.len(), 1);
        assert_eq!(report.finished[0].request, RequestId(2));
        target.step(&mut report).unwrap();
        assert!(report.is_idle(), "still waiting");
        assert_eq!(target.counters().restores.request_state_not_ready, 1);
        // The driver moves the capture over.
        let transfer = source.read_lease(lease).unwrap();
        target.deliver_rendezvous(RequestId(1), transfer).unwrap();
        target.device_mut().log.clear();
        observations(&mut target);
        let reports = run_to_end(&mut target);
        // 39 blocks restored, the last block computed (no logits cached),
        // and the restore is not charged to the step: the transfer was.
        assert_eq!(reports[0].shape.prefill_tokens, 16);
        assert_eq!(reports[0].shape.restore_tokens, 0);
        let obs = observations(&mut target);
        let restored_at = obs
            .iter()
            .position(|o| {
                *o == Observation::Restored {
                    request: RequestId(1),
                    candidate_prefix_tokens: 624,
                }
            })
            .expect("restored");
        assert_eq!(
            obs[restored_at + 1],
            Observation::RendezvousDone {
                request: RequestId(1),
                lease: lease.id,
                restored: true
            }
        );
        let log = &target.device().log;
        let restore_at = log
            .iter()
            .position(|e| {
                matches!(
                    e,
                    Effect::Restore {
                        rendezvous: true,
                        ..
                    }
                )
            })
            .unwrap();
        let ack_at = log
            .iter()
            .position(|e| matches!(e, Effect::AckRestore { .. }))
            .unwrap();
        assert!(restore_at < ack_at);
        // The driver releases the lease once; a second release is refused.
        source.release_lease(lease).unwrap();
        assert_eq!(source.release_lease(lease), Err(LeaseError::Unknown));
        assert_eq!(source.leases_held(), 0);
    }

    #[test]
    fn a_rendezvous_holding_another_prompt_cancels_the_request() {
        let (mut source, lease) = captured(&(0..640).collect::<Vec<u32>>());
        let mut target = decode_engine();
        let other: Vec<u32> = (10_000..10_640).collect();
        target
            .add_rendezvous_request(request(1, other, 1), lease)
            .unwrap();
        target
            .deliver_rendezvous(RequestId(1), source.read_lease(lease).unwrap())
            .unwrap();
        let reports = run_to_end(&mut target);
        assert_eq!(reports[0].finished[0].reason, FinishReason::RestoreFailed);
        let obs = observations(&mut target);
        assert!(obs.contains(&Observation::RestoreFailed {
            request: RequestId(1),
            error: Some(RestoreError::SourceMismatch)
        }));
        assert!(obs.contains(&Observation::RendezvousDone {
            request: RequestId(1),
            lease: lease.id,
            restored: false
        }));
        assert_eq!(target.kv().used_blocks(), 0);
    }

    #[test]
    fn deliveries_are_checked_before_they_are_kept() {
        let prompt: Vec<u32> = (0..64).collect();
        let (mut source, lease) = captured(&prompt);
        let mut target = decode_engine();
        let transfer = source.read_lease(lease).unwrap();
        assert_eq!(
            target.deliver_rendezvous(RequestId(1), transfer.clone()),
            Err(DeliverError::UnknownRequest)
        );
        target.add_request(request(2, prompt.clone(), 1)).unwrap();
        assert_eq!(
            target.deliver_rendezvous(RequestId(2), transfer.clone()),
            Err(DeliverError::NotAwaited)
        );
        target
            .add_rendezvous_request(request(1, prompt, 1), lease)
            .unwrap();
        let short = LeasedKv {
            tokens: transfer.tokens[..10].to_vec(),
            ..transfer.clone()
        };
        assert!(matches!(
            target.deliver_rendezvous(RequestId(1), short),
            Err(DeliverError::Malformed { .. })
        ));
        target
            .deliver_rendezvous(RequestId(1), transfer.clone())
            .unwrap();
        assert_eq!(
            target.deliver_rendezvous(RequestId(1), transfer),
            Err(DeliverError::AlreadyDelivered)
        );
    }

    proptest::proptest! {
        /// Whatever happens to rendezvous requests — delivered or not,
        /// cancelled while waiting, the device failing the restore or
        /// refusing its acknowledgement — each ends its lease exactly once
        /// (one `RendezvousDone`), and none that restored produces a token
        /// before its restore was acknowledged.
        #[test]
        fn each_rendezvous_request_ends_its_lease_exactly_once(
            plan in proptest::collection::vec((0u8..5, proptest::bool::ANY), 1..6),
        ) {
            let prompt: Vec<u32> = (0..320).collect();
            let (mut source, lease) = captured(&prompt);
            let transfer = source.read_lease(lease).unwrap();
            let mut target = decode_engine();
            for (i, &(fate, _)) in plan.iter().enumerate() {
                let id = RequestId(i as u128 + 1);
                target.add_rendezvous_request(request(id.0, prompt.clone(), 2), lease).unwrap();
                if fate != 0 {
                    target.deliver_rendezvous(id, transfer.clone()).unwrap();
                }
            }
            let mut obs = Vec::new();
            let mut report = StepReport::default();
            for round in 0..40 {
                if let Some(&(fate, fail_ack)) = plan.get(round) {
                    target.device_mut().fail_next_ack = fail_ack;
                    target.device_mut().fail_next_restore = fate == 4;
                    if fate == 0 {
                        target.cancel(RequestId(round as u128 + 1)).unwrap();
                    }
                }
                target.step(&mut report).unwrap();
                target.drain_observations(&mut obs);
                // A token means the request ran: its lease was resolved
                // first (restored and acknowledged, or given up).
                for token in &report.tokens {
                    let resolved = obs.iter().any(|o| matches!(o, Observation::RendezvousDone { request, .. } if *request == token.request));
                    proptest::prop_assert!(resolved, "{:?} ran with its lease unresolved", token.request);
                }
            }
            for i in 0..plan.len() {
                let id = RequestId(i as u128 + 1);
                let dones = obs.iter().filter(|o| matches!(o, Observation::RendezvousDone { request, .. } if *request == id)).count();
                proptest::prop_assert_eq!(dones, 1, "{:?}", id);
                let restored = obs.iter().any(|o| matches!(o, Observation::Restored { request, .. } if *request == id));
                let done_restored = obs.iter().any(|o| matches!(o, Observation::RendezvousDone { request, restored: true, .. } if *request == id));
                proptest::prop_assert_eq!(restored, done_restored);
            }
            // Acknowledged restores and `Restored` observations agree.
            let acks = target.device().log.iter().filter(|e| matches!(e, Effect::AckRestore { .. })).count();
            let refused = target.counters().restores.failed as usize;
            let restored = obs.iter().filter(|o| matches!(o, Observation::Restored { .. })).count();
            proptest::prop_assert!(restored <= acks && acks <= restored + refused);
            proptest::prop_assert_eq!(target.kv().used_blocks(), 0);
        }
    }

    #[test]
    fn a_prompt_with_nothing_on_the_host_is_no_reusable_entry() {
        let mut engine = host_engine();
        engine
            .add_request(request(1, (0..64).collect(), 1))
            .unwrap();
        run_to_end(&mut engine);
        assert_eq!(engine.counters().restores.no_reusable_entry, 1);
    }

    #[test]
    fn an_invalid_restore_output_cancels_the_request_instead_of_falling_back() {
        let mut engine = host_engine();
        let prompt: Vec<u32> = (0..640).collect();
        spill_prompt(&mut engine, &prompt);
        observations(&mut engine);
        engine.device_mut().tamper_restore = Some(|out: RestoreOutput| RestoreOutput {
            restored_tokens: out.prompt_tokens,
            ..out
        });
        engine.add_request(request(1, prompt, 1)).unwrap();
        let reports = run_to_end(&mut engine);
        assert_eq!(reports[0].finished[0].reason, FinishReason::RestoreFailed);
        let obs = observations(&mut engine);
        assert!(obs.contains(&Observation::RestoreFailed {
            request: RequestId(1),
            error: Some(RestoreError::NoSuffixLeft)
        }));
        assert!(!obs
            .iter()
            .any(|o| matches!(o, Observation::Restored { .. })));
        assert_eq!(engine.kv().free_blocks(), 64);
        assert!(!engine
            .device()
            .log
            .iter()
            .any(|e| matches!(e, Effect::AckRestore { .. })));
    }

    #[test]
    fn a_device_failure_during_restore_cancels_the_request() {
        let mut engine = host_engine();
        let prompt: Vec<u32> = (0..640).collect();
        spill_prompt(&mut engine, &prompt);
        engine.device_mut().fail_next_restore = true;
        engine.add_request(request(1, prompt, 1)).unwrap();
        let reports = run_to_end(&mut engine);
        assert_eq!(reports[0].finished[0].reason, FinishReason::RestoreFailed);
        assert_eq!(engine.counters().restores.failed, 1);
    }

    #[test]
    fn a_scripted_dry_pool_leaves_a_new_request_waiting() {
        let mut engine =
            Engine::new(config(), ScriptedDevice::new(TimingConfig::default())).unwrap();
        engine.device_mut().exhaust_next = 1;
        engine
            .add_request(request(1, (0..40).collect(), 1))
            .unwrap();
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert!(report.is_idle());
        assert_eq!(engine.waiting_len(), 1);
        engine.step(&mut report).unwrap();
        assert_eq!(report.finished.len(), 1);
    }

    /// Two requests of 40 prompt tokens and `max_tokens` outputs, both
    /// admitted and prefilled by one step.
    fn two_running(cfg: EngineConfig, max_tokens: u32) -> Engine<ScriptedDevice> {
        let mut engine = Engine::new(cfg, ScriptedDevice::new(TimingConfig::default())).unwrap();
        engine
            .add_request(request(1, (0..40).collect(), max_tokens))
            .unwrap();
        engine
            .add_request(request(2, (1_000..1_040).collect(), max_tokens))
            .unwrap();
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert_eq!(engine.running_len(), 2);
        engine.device_mut().log.clear();
        engine
    }

    fn finished_outputs(reports: &[StepReport]) -> Vec<(RequestId, usize)> {
        let mut out: Vec<_> = reports
            .iter()
            .flat_map(|r| r.finished.iter().map(|f| (f.request, f.output_tokens)))
            .collect();
        out.sort();
        out
    }

    #[test]
    fn every_release_names_its_caller() {
        let mut engine =
            Engine::new(config(), ScriptedDevice::new(TimingConfig::default())).unwrap();
        engine
            .add_request(request(1, (0..40).collect(), 1))
            .unwrap();
        engine
            .add_request(request(2, (100..140).collect(), 9))
            .unwrap();
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        engine.cancel(RequestId(2)).unwrap();
        let whats: Vec<_> = engine
            .device()
            .log
            .iter()
            .filter_map(|e| match e {
                Effect::ReleaseSeq { seq, what, .. } => Some((*seq, what.0)),
                _ => None,
            })
            .collect();
        assert_eq!(whats, vec![(SeqId(0), "finished"), (SeqId(1), "cancelled")]);
    }

    #[test]
    fn an_exhausted_reservation_keeps_that_sequence_out_of_the_step_and_preempts_nothing() {
        let mut engine = two_running(config(), 5);
        engine.device_mut().exhaust_next = 1;
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert_eq!(report.scheduled, 1, "request 1 was not launched");
        assert_eq!(report.tokens.len(), 1);
        assert_eq!(report.tokens[0].request, RequestId(2));
        assert_eq!(engine.counters().preemptions, 0);
        assert_eq!(engine.counters().kept_out, 1);
        assert_eq!(engine.running_len(), 2, "it keeps its place and its blocks");
        let reports = run_to_end(&mut engine);
        assert_eq!(
            finished_outputs(&reports),
            vec![(RequestId(1), 5), (RequestId(2), 5)]
        );
    }

    #[test]
    fn only_when_nothing_can_run_is_the_newest_preempted() {
        let mut engine = two_running(config(), 5);
        engine.device_mut().exhaust_next = 2;
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert_eq!(engine.counters().preemptions, 1);
        assert_eq!(report.scheduled, 1);
        assert_eq!(report.tokens[0].request, RequestId(1), "the older runs");
        let obs = observations(&mut engine);
        assert!(obs.contains(&Observation::Preempted {
            request: RequestId(2)
        }));
        assert!(engine.device().log.contains(&Effect::ReleaseSeq {
            seq: SeqId(1),
            cache: true,
            what: Label("preempted")
        }));
        let reports = run_to_end(&mut engine);
        assert_eq!(
            finished_outputs(&reports),
            vec![(RequestId(1), 5), (RequestId(2), 5)]
        );
    }

    fn spill_config() -> EngineConfig {
        EngineConfig {
            preemption: Preemption::Spill,
            spill_blocks: 64,
            ..config()
        }
    }

    #[test]
    fn a_spilled_sequence_is_saved_synchronised_released_and_loaded_back_on_resume() {
        let mut engine = two_running(spill_config(), 5);
        engine.device_mut().exhaust_next = 2;
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        // Request 2 had computed its 40 prompt tokens: they go to the host,
        // the copy is waited for, and only then are its blocks released.
        let log = &engine.device().log;
        let at = |effect: &Effect| log.iter().position(|e| e == effect).unwrap();
        let save = at(&Effect::SaveSequenceState {
            seq: SeqId(1),
            tokens: 40,
        });
        let release = at(&Effect::ReleaseSeq {
            seq: SeqId(1),
            cache: true,
            what: Label("spilled"),
        });
        assert_eq!(log[save + 1], Effect::SyncSecondary);
        assert_eq!(save + 2, release);
        assert_eq!(report.shape.saved_tokens, 40, "the save is charged");
        assert_eq!(engine.spill_used_blocks(), 3);
        assert!(observations(&mut engine).contains(&Observation::Spilled {
            request: RequestId(2),
            tokens: 40
        }));
        // Resumed: its two full blocks are still cached on the device, the
        // last 8 tokens come back from the host, and nothing is recomputed.
        engine.device_mut().log.clear();
        engine.step(&mut report).unwrap();
        assert!(engine.device().log.contains(&Effect::LoadSequenceState {
            seq: SeqId(1),
            tokens: 40,
            device_prefix_blocks: 2
        }));
        assert_eq!(report.shape.restore_tokens, 8);
        assert_eq!(report.shape.prefill_tokens, 0);
        assert_eq!(report.shape.decode_tokens, 2);
        assert_eq!(engine.device().saved_len(), 0);
        assert_eq!(engine.spill_used_blocks(), 0);
        let reports = run_to_end(&mut engine);
        assert_eq!(
            finished_outputs(&reports),
            vec![(RequestId(1), 5), (RequestId(2), 5)]
        );
        let counters = engine.counters();
        assert_eq!((counters.spills, counters.spill_loads), (1, 1));
        assert_eq!(engine.kv().used_blocks(), 0);
    }

    #[test]
    fn a_request_cancelled_while_spilled_drops_its_saved_state() {
        let mut engine = two_running(spill_config(), 5);
        engine.device_mut().exhaust_next = 2;
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert_eq!(engine.device().saved_len(), 1);
        engine.cancel(RequestId(2)).unwrap().unwrap();
        assert!(engine
            .device()
            .log
            .contains(&Effect::DropSequenceState { seq: SeqId(1) }));
        assert_eq!(engine.device().saved_len(), 0);
        assert_eq!(engine.counters().spill_drops, 1);
        assert_eq!(engine.spill_used_blocks(), 0);
    }

    #[test]
    fn a_spill_that_leaves_nothing_to_run_still_takes_its_copy_time() {
        let timing = TimingConfig::default();
        let mut engine = Engine::new(spill_config(), ScriptedDevice::new(timing.clone())).unwrap();
        engine
            .add_request(request(1, (0..40).collect(), 5))
            .unwrap();
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        engine.device_mut().exhaust_next = 1;
        engine.step(&mut report).unwrap();
        assert!(report.is_idle());
        assert_eq!(engine.counters().spills, 1);
        assert!((report.model_ms - timing.restore_ms(40)).abs() < 1e-12);
        let reports = run_to_end(&mut engine);
        assert_eq!(finished_outputs(&reports), vec![(RequestId(1), 5)]);
    }

    #[test]
    fn a_full_spill_area_falls_back_to_recompute() {
        let cfg = EngineConfig {
            spill_blocks: 2,
            ..spill_config()
        };
        let mut engine = two_running(cfg, 5);
        engine.device_mut().exhaust_next = 2;
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert_eq!(engine.counters().spill_fallbacks, 1);
        assert_eq!(engine.counters().spills, 0);
        assert!(!engine
            .device()
            .log
            .iter()
            .any(|e| matches!(e, Effect::SaveSequenceState { .. })));
    }

    #[test]
    fn sampling_rows_read_their_logits_back_at_the_models_width() {
        let cfg = EngineConfig {
            read_logits: true,
            vocab_size: 1_000,
            ..config()
        };
        let timing = TimingConfig::default();
        let mut engine = Engine::new(cfg, ScriptedDevice::new(timing.clone())).unwrap();
        engine
            .add_request(request(1, (0..40).collect(), 2))
            .unwrap();
        engine
            .add_request(request(2, (100..140).collect(), 2))
            .unwrap();
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert!(engine.device().log.contains(&Effect::ReadLogits {
            rows: 2,
            vocab: 1_000,
            elem_bytes: 2
        }));
        let expected = timing.step_ms(&report.shape) + timing.host_copy_ms(4_000);
        assert!((report.model_ms - expected).abs() < 1e-9);
        assert_eq!(engine.counters().logits_bytes, 4_000);
    }

    #[test]
    fn logits_of_another_width_than_the_models_are_a_device_error() {
        let cfg = EngineConfig {
            read_logits: true,
            ..config()
        };
        let mut engine = Engine::new(cfg, ScriptedDevice::new(TimingConfig::default())).unwrap();
        engine.device_mut().logits_width = Some(4);
        engine
            .add_request(request(1, (0..40).collect(), 2))
            .unwrap();
        let mut report = StepReport::default();
        assert_eq!(
            engine.step(&mut report),
            Err(EngineError::Device(DeviceError::LogitsWidth {
                expected: 2,
                got: 4
            }))
        );
    }

    #[test]
    fn without_read_logits_nothing_is_copied_to_the_host() {
        let mut engine = two_running(config(), 2);
        run_to_end(&mut engine);
        assert!(!engine
            .device()
            .log
            .iter()
            .any(|e| matches!(e, Effect::ReadLogits { .. })));
    }

    fn slot_config(slots: u32) -> EngineConfig {
        EngineConfig {
            state_slots: slots,
            ..config()
        }
    }

    #[test]
    fn state_slots_bound_the_running_sequences() {
        let mut engine =
            Engine::new(slot_config(2), ScriptedDevice::new(TimingConfig::default())).unwrap();
        for id in 1..=3 {
            engine
                .add_request(request(
                    id,
                    (id as u32 * 100..id as u32 * 100 + 40).collect(),
                    3,
                ))
                .unwrap();
        }
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert_eq!((engine.running_len(), engine.waiting_len()), (2, 1));
        assert_eq!(engine.state_slots().free_len(), 0);
        let reports = run_to_end(&mut engine);
        assert_eq!(finished_outputs(&reports).len(), 3);
        assert_eq!(engine.state_slots().free_len(), 2);
    }

    #[test]
    fn a_finished_sequence_leaves_a_hole_that_compaction_closes_before_the_next_step() {
        let mut engine =
            Engine::new(slot_config(3), ScriptedDevice::new(TimingConfig::default())).unwrap();
        engine
            .add_request(request(1, (0..40).collect(), 2))
            .unwrap();
        engine
            .add_request(request(2, (100..140).collect(), 9))
            .unwrap();
        engine
            .add_request(request(3, (200..240).collect(), 9))
            .unwrap();
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        engine.step(&mut report).unwrap();
        assert_eq!(report.finished[0].request, RequestId(1), "slot 0 is free");
        engine.device_mut().log.clear();
        engine.step(&mut report).unwrap();
        let log = &engine.device().log;
        assert_eq!(
            log[..3],
            [
                Effect::CompactSlot {
                    seq: SeqId(2),
                    from: SlotId(2),
                    to: SlotId(0)
                },
                Effect::SyncSecondary,
                Effect::DetachSlot { slot: SlotId(2) },
            ]
        );
        let slots = engine.state_slots();
        assert_eq!(slots.slot_of(SeqId(2)), Some(SlotId(0)));
        assert_eq!(slots.slot_of(SeqId(1)), Some(SlotId(1)));
        assert_eq!((slots.free_len(), slots.detached_len()), (1, 0));
        assert_eq!(engine.counters().slot_compactions, 1);
    }

    #[test]
    fn a_quiesced_engine_refuses_steps_but_cancels_and_a_shut_down_one_refuses_all() {
        let mut engine = two_running(config(), 5);
        engine.quiesce().unwrap();
        let mut report = StepReport::default();
        assert_eq!(
            engine.step(&mut report),
            Err(EngineError::Device(DeviceError::Quiesced {
                effect: Label("reserve_kv")
            }))
        );
        engine.cancel(RequestId(1)).unwrap().unwrap();
        engine.shutdown().unwrap();
        let err = engine.cancel(RequestId(2)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "device layer: the device is shut down and refuses release_seq"
        );
        assert!(
            matches!(
                engine.step(&mut report),
                Err(EngineError::Device(DeviceError::ShutDown { .. }))
            ),
            "request 2 is still held, and the device refuses to run it"
        );
        let log = &engine.device().log;
        let at = |effect: &Effect| log.iter().position(|e| e == effect).unwrap();
        assert!(at(&Effect::Quiesce) < at(&Effect::EpShutdown));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Arrive { len: u16, max_tokens: u8 },
        Cancel { pick: u8 },
        Step { dry: u8 },
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            2 => (1u16..200, 1u8..60).prop_map(|(len, max_tokens)| Op::Arrive { len, max_tokens }),
            1 => any::<u8>().prop_map(|pick| Op::Cancel { pick }),
            5 => (0u8..8).prop_map(|dry| Op::Step { dry: dry.saturating_sub(5) }),
        ]
    }

    proptest::proptest! {
        /// Random effect sequences — arrivals, cancels, steps with the
        /// device answering `Exhausted` at random — over a small pool with
        /// spill preemption and state slots: no slot is freed twice (the
        /// device and the table would refuse it and the step would fail),
        /// every running sequence holds exactly one slot and none stays
        /// detached, every spilled sequence is loaded back or dropped, and
        /// when all is done or cancelled no block, slot or saved state is
        /// left behind. Half the runs are a hybrid model (prompts sharing
        /// prefixes, SSM checkpoints by either policy, resumes from them):
        /// the checkpoint cache stays within its bound and every
        /// checkpoint saved is held or was evicted.
        #[test]
        fn no_slot_freed_twice_no_block_leaked_every_spill_restored_or_freed(
            ops in proptest::collection::vec(op(), 1..120),
            hybrid in proptest::option::of(proptest::bool::ANY),
        ) {
            let mut cfg = EngineConfig {
                num_blocks: 24,
                max_num_batched_tokens: 128,
                max_num_seqs: 4,
                preemption: Preemption::Spill,
                spill_blocks: 20,
                state_slots: 4,
                ..config()
            };
            if let Some(marconi) = hybrid {
                let policy = if marconi { CheckpointPolicy::Marconi } else { CheckpointPolicy::EveryBlock };
                cfg = cfg.hybrid(policy);
                cfg.hybrid.as_mut().unwrap().max_checkpoints = 5;
            }
            let mut engine = Engine::new(cfg, ScriptedDevice::new(TimingConfig::default())).unwrap();
            engine.device_mut().record = false;
            let mut next_id = 1u128;
            let mut live: Vec<RequestId> = Vec::new();
            let mut report = StepReport::default();
            let check = |engine: &Engine<ScriptedDevice>| -> Result<(), proptest::test_runner::TestCaseError> {
                let slots = engine.state_slots();
                proptest::prop_assert_eq!(slots.owned_len(), engine.running_len());
                proptest::prop_assert_eq!(slots.detached_len(), 0);
                let c = engine.counters();
                proptest::prop_assert_eq!(engine.device().saved_len() as u64, c.spills - c.spill_loads - c.spill_drops);
                proptest::prop_assert!(engine.spill_used_blocks() <= 20);
                if let Some(checkpoints) = engine.checkpoints() {
                    proptest::prop_assert!(checkpoints.len() <= 5);
                    proptest::prop_assert_eq!(
                        checkpoints.len() as u64,
                        c.ssm_checkpoints - c.ssm_checkpoint_evictions
                    );
                }
                Ok(())
            };
            for op in ops {
                match op {
                    Op::Arrive { len, max_tokens } => {
                        // A hybrid run's prompts share one of three prefixes.
                        let family = if hybrid.is_some() { next_id % 3 } else { next_id };
                        let base = (family as u32) * 1_000;
                        let prompt = (base..base + u32::from(len)).collect();
                        if engine.add_request(request(next_id, prompt, u32::from(max_tokens))).is_ok() {
                            live.push(RequestId(next_id));
                        }
                        next_id += 1;
                    }
                    Op::Cancel { pick } => {
                        if !live.is_empty() {
                            let id = live.remove(pick as usize % live.len());
                            engine.cancel(id).unwrap();
                        }
                    }
                    Op::Step { dry } => {
                        engine.device_mut().exhaust_next = u32::from(dry);
                        engine.step(&mut report).unwrap();
                        for f in &report.finished {
                            live.retain(|&r| r != f.request);
                        }
                    }
                }
                check(&engine)?;
            }
            engine.device_mut().exhaust_next = 0;
            for _ in 0..5_000 {
                if !engine.has_work() {
                    break;
                }
                engine.step(&mut report).unwrap();
                check(&engine)?;
            }
            proptest::prop_assert!(!engine.has_work(), "the engine drained");
            let c = engine.counters();
            proptest::prop_assert_eq!(c.spills, c.spill_loads + c.spill_drops);
            proptest::prop_assert_eq!(engine.device().saved_len(), 0);
            proptest::prop_assert_eq!(engine.spill_used_blocks(), 0);
            proptest::prop_assert_eq!(engine.kv().used_blocks(), 0);
            proptest::prop_assert_eq!(engine.state_slots().free_len(), 4);
        }
    }

    fn spec_config(draft_tokens: u32, acceptance_rate: f64) -> EngineConfig {
        EngineConfig {
            spec_decode: Some(crate::config::SpecDecode {
                draft_tokens,
                acceptance_rate,
            }),
            ..config()
        }
    }

    /// One request of `prompt_len` tokens, prefilled (one output token).
    fn one_decoding(cfg: EngineConfig, prompt_len: u32, max_tokens: u32) -> Engine<ScriptedDevice> {
        let mut engine = Engine::new(cfg, ScriptedDevice::new(TimingConfig::default())).unwrap();
        engine
            .add_request(request(7, (0..prompt_len).collect(), max_tokens))
            .unwrap();
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert_eq!(report.tokens.len(), 1, "the prefill samples one token");
        engine.device_mut().log.clear();
        engine
    }

    fn expected_outputs(request: u128, max_tokens: u32) -> Vec<u32> {
        (0..max_tokens)
            .map(|i| synthetic_token(RequestId(request), i, None))
            .collect()
    }

    #[test]
    fn at_full_acceptance_a_decode_step_emits_one_token_plus_every_draft() {
        let mut engine = one_decoding(spec_config(3, 1.0), 40, 9);
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert_eq!(report.tokens.len(), 4);
        assert_eq!(report.shape.decode_tokens, 1);
        assert_eq!(report.shape.draft_tokens, 3);
        let seq = SeqId(0);
        assert_eq!(
            engine.device().log,
            vec![
                // 41 tokens, the last not computed yet, plus 3 drafts.
                Effect::ReserveKv { seq, tokens: 44 },
                Effect::LaunchStep {
                    shape: report.shape
                },
                Effect::ReadStepResult,
                // Nothing rejected: no rollback; the ring moves to 44.
                Effect::SaveHiddenCatchup { seq, tokens: 44 },
            ]
        );
        let mut outputs = vec![synthetic_token(RequestId(7), 0, None)];
        outputs.extend(report.tokens.iter().map(|t| t.token));
        let reports = run_to_end(&mut engine);
        assert_eq!(
            reports.iter().map(|r| r.tokens.len()).collect::<Vec<_>>(),
            vec![4],
            "9 tokens: 1 + 4 + 4, never past max_tokens"
        );
        outputs.extend(
            reports
                .iter()
                .flat_map(|r| r.tokens.iter().map(|t| t.token)),
        );
        assert_eq!(
            outputs,
            expected_outputs(7, 9),
            "the same text as without drafts"
        );
        let c = engine.counters();
        assert_eq!((c.draft_tokens_proposed, c.draft_tokens_accepted), (6, 6));
        assert_eq!((c.spec_rollbacks, c.generated_tokens), (0, 9));
        assert_eq!(engine.kv().used_blocks(), 0);
    }

    #[test]
    fn at_zero_acceptance_a_decode_step_emits_one_token_and_rolls_back_every_draft() {
        // 47 prompt tokens: the drafts spill into a fourth block of 16.
        let mut engine = one_decoding(spec_config(3, 0.0), 47, 8);
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert_eq!(report.tokens.len(), 1);
        let seq = SeqId(0);
        assert_eq!(
            engine.device().log,
            vec![
                Effect::ReserveKv { seq, tokens: 51 },
                Effect::LaunchStep {
                    shape: report.shape
                },
                Effect::ReadStepResult,
                Effect::RollbackOverrun {
                    seq,
                    keep_tokens: 48
                },
                Effect::SaveHiddenCatchup { seq, tokens: 48 },
            ]
        );
        assert_eq!(engine.kv().used_blocks(), 3, "the drafts' block went back");
        let c = engine.counters();
        assert_eq!((c.spec_rollbacks, c.spec_rollback_blocks), (1, 1));
        let reports = run_to_end(&mut engine);
        assert!(reports.iter().all(|r| r.tokens.len() == 1));
        let mut outputs = vec![
            synthetic_token(RequestId(7), 0, None),
            report.tokens[0].token,
        ];
        outputs.extend(
            reports
                .iter()
                .flat_map(|r| r.tokens.iter().map(|t| t.token)),
        );
        assert_eq!(outputs, expected_outputs(7, 8));
        let c = engine.counters();
        // Drafts shrink as max_tokens nears: 3, 3, 3, 3, 2, 1, then none.
        assert_eq!((c.draft_tokens_proposed, c.draft_tokens_accepted), (15, 0));
        assert_eq!(c.spec_rollbacks, 6);
        assert_eq!(engine.kv().used_blocks(), 0);
    }

    #[test]
    fn acceptance_draws_are_deterministic_and_follow_the_rate() {
        let mut accepted = 0;
        for request in 0..2_000u128 {
            let k = accepted_drafts(RequestId(request), 5, 1, 0.7);
            assert_eq!(k, accepted_drafts(RequestId(request), 5, 1, 0.7));
            assert_eq!(accepted_drafts(RequestId(request), 5, 4, 1.0), 4);
            assert_eq!(accepted_drafts(RequestId(request), 5, 4, 0.0), 0);
            accepted += k;
        }
        assert!(
            (1_300..1_500).contains(&accepted),
            "{accepted} of 2000 at 0.7"
        );
    }

    #[test]
    fn an_exhausted_over_run_falls_back_to_a_plain_step_if_one_position_fits() {
        let mut engine = one_decoding(spec_config(3, 1.0), 40, 9);
        engine.device_mut().exhaust_next = 1;
        let mut report = StepReport::default();
        engine.step(&mut report).unwrap();
        assert_eq!(report.tokens.len(), 1);
        let seq = SeqId(0);
        assert_eq!(
            engine.device().log[..2],
            [
                Effect::ReserveKv { seq, tokens: 44 },
                Effect::ReserveKv { seq, tokens: 41 },
            ]
        );
        assert_eq!(report.shape.draft_tokens, 0);
        assert!(
            !engine
                .device()
                .log
                .iter()
                .any(|e| matches!(e, Effect::SaveHiddenCatchup { .. })),
            "a plain step keeps no catch-up entry"
        );
        let c = engine.counters();
        assert_eq!((c.spec_fallbacks, c.kept_out), (1, 0));

        // Neither fits: the existing Exhausted rule.
        engine.device_mut().exhaust_next = 2;
        engine.step(&mut report).unwrap();
        assert!(report.tokens.is_empty());
        let c = engine.counters();
        assert_eq!((c.spec_fallbacks, c.kept_out), (2, 1));
    }

    #[test]
    fn a_reserve_ahead_device_rolls_back_rejected_drafts_and_lookahead_without_a_leak() {
        let cfg = EngineConfig {
            block_size: 4,
            num_blocks: 64,
            ..spec_config(4, 0.5)
        };
        let mut engine = Engine::new(cfg, AheadDevice::new(TimingConfig::default(), 1)).unwrap();
        for id in 1..=4u128 {
            let base = id as u32 * 1_000;
            engine
                .add_request(request(id, (base..base + 10 + id as u32 * 3).collect(), 17))
                .unwrap();
        }
        let reports = run_to_end(&mut engine);
        for id in 1..=4u128 {
            let outputs: Vec<u32> = reports
                .iter()
                .flat_map(|r| r.tokens.iter())
                .filter(|t| t.request == RequestId(id))
                .map(|t| t.token)
                .collect();
            assert_eq!(outputs, expected_outputs(id, 17));
        }
        let c = engine.counters();
        assert!(c.spec_rollbacks > 0 && c.draft_tokens_accepted > 0);
        assert_eq!(engine.kv().used_blocks(), 0);
    }

    proptest::proptest! {
        /// Random acceptance rates, draft counts, lengths and dry
        /// reservations over a small pool: every request emits exactly its
        /// max_tokens, the text does not depend on the drafts, and no block
        /// is leaked by the rollbacks once all requests are done.
        #[test]
        fn speculative_decoding_leaks_no_block_and_emits_exactly_max_tokens(
            rate in 0.0f64..=1.0,
            drafts in 1u32..=6,
            requests in proptest::collection::vec((1u32..90, 1u32..40), 1..6),
            dry in proptest::collection::vec(0u32..3, 0..40),
        ) {
            let cfg = EngineConfig {
                block_size: 4,
                num_blocks: 48,
                max_num_batched_tokens: 64,
                ..spec_config(drafts, rate)
            };
            let mut engine = Engine::new(cfg, ScriptedDevice::new(TimingConfig::default())).unwrap();
            engine.device_mut().record = false;
            let start = engine.kv().used_blocks();
            for (i, &(len, max_tokens)) in requests.iter().enumerate() {
                let base = i as u32 * 1_000;
                engine.add_request(request(i as u128 + 1, (base..base + len).collect(), max_tokens)).unwrap();
            }
            let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
            let mut report = StepReport::default();
            let mut finished = 0;
            for round in 0..5_000 {
                if !engine.has_work() {
                    break;
                }
                engine.device_mut().exhaust_next = dry.get(round).copied().unwrap_or(0);
                engine.step(&mut report).unwrap();
                for t in &report.tokens {
                    let out = &mut outputs[t.request.0 as usize - 1];
                    proptest::prop_assert_eq!(t.index as usize, out.len());
                    out.push(t.token);
                }
                for f in &report.finished {
                    proptest::prop_assert_eq!(f.output_tokens, requests[f.request.0 as usize - 1].1 as usize);
                    finished += 1;
                }
            }
            proptest::prop_assert!(!engine.has_work(), "the engine drained");
            proptest::prop_assert_eq!(finished, requests.len());
            for (i, out) in outputs.iter().enumerate() {
                proptest::prop_assert_eq!(out, &expected_outputs(i as u128 + 1, requests[i].1));
            }
            proptest::prop_assert_eq!(engine.kv().used_blocks(), start);
            let c = engine.counters();
            proptest::prop_assert!(c.draft_tokens_accepted <= c.draft_tokens_proposed);
        }
    }
}
