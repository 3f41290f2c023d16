//! Active sequences: one write model, one derived read model.
//!
//! A lifecycle event (`AddRequest`, `MarkPrefillCompleted`, `Free`) flows one
//! way:
//!
//! ```text
//! event → WorkerTable + RequestIndex → per-worker active sequences (authoritative)
//!       → PromptRegistry (derived) → selectors read
//! ```
//!
//! - [`WorkerTable`] maps worker identity to a dense slot; [`RequestIndex`]
//!   maps a request to the slot that owns it. With the per-worker state they
//!   keep the invariants: a request is owned by exactly one worker, is freed
//!   at most once, and freeing it returns every block it held.
//! - [`PromptRegistry`] is a projection for selectors: per-worker load. It
//!   never writes back. Which prompt prefixes are active where is read
//!   from the write model's per-worker block counts
//!   ([`ActiveSequences::active_prompt_overlaps`]), so a booking keeps no
//!   second structure in step.
//!
//! Duplicate and stale events are outcomes ([`LifecycleOutcome`]), never
//! faults. Requests older than `expiry_ms` are freed by [`ActiveSequences::expire`]
//! (a lost `Free`, a dead replica).

mod prefill;
mod registry;
mod tables;

pub use prefill::{MissingExpectedDuration, PrefillSummary};
pub use registry::{PromptRegistry, WorkerLoad};
pub use tables::{RequestIndex, WorkerTable};

use crate::hashing::{extend_sequence_hashes, sequence_hashes};
use crate::index::{OverlapScores, WorkerOverlap};
use crate::maps::{map_bytes, FxHashMap};
use crate::types::{LocalHash, RequestId, SequenceHash, WorkerId};
use prefill::PrefillTracker;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::sync::Arc;

/// Settings of [`ActiveSequences`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SequencesConfig {
    /// Tokens per KV block (must match the engines').
    pub block_size: u32,
    /// Requests older than this are freed by [`ActiveSequences::expire`].
    pub expiry_ms: f64,
}

impl Default for SequencesConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            expiry_ms: 300_000.0,
        }
    }
}

/// Why a [`SequencesConfig`] was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SequencesConfigError {
    /// Block size of zero.
    #[error("block_size must be at least 1")]
    BlockSize,
    /// Expiry not positive.
    #[error("expiry_ms must be positive and finite, got {0}")]
    Expiry(f64),
}

impl SequencesConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), SequencesConfigError> {
        if self.block_size == 0 {
            return Err(SequencesConfigError::BlockSize);
        }
        if !(self.expiry_ms.is_finite() && self.expiry_ms > 0.0) {
            return Err(SequencesConfigError::Expiry(self.expiry_ms));
        }
        Ok(())
    }
}

/// Booking of a request on a worker.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AddRequest {
    /// The request.
    pub request: RequestId,
    /// The worker it was dispatched to.
    pub worker: WorkerId,
    /// Prompt length in tokens.
    pub prompt_tokens: u32,
    /// Local hashes of the prompt's full blocks.
    pub blocks: Vec<LocalHash>,
    /// Leading blocks the router expects the worker to have cached.
    pub overlap_blocks: u32,
    /// Expected prefill duration, when the driver can model it.
    pub expected_prefill_ms: Option<f64>,
}

/// A lifecycle event of the write model.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum SequenceEvent {
    /// Book a request.
    Add(AddRequest),
    /// The request's first token arrived: its prefill is done.
    MarkPrefillCompleted(RequestId),
    /// The request ended (completed, failed or cancelled).
    Free(RequestId),
}

/// What applying a lifecycle event did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LifecycleOutcome {
    /// The event changed state.
    Applied,
    /// Already applied (a duplicate `Add`, a second mark): nothing changed.
    Duplicate,
    /// The request is not active (never booked, or already freed).
    UnknownRequest,
    /// The worker is not in the table.
    UnknownWorker,
}

/// Counters for metrics; they only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SequenceCounters {
    /// Requests booked.
    pub added: u64,
    /// Requests freed by `Free`.
    pub freed: u64,
    /// Requests freed by expiry.
    pub expired: u64,
    /// Requests freed because their worker was removed.
    pub dropped_with_worker: u64,
    /// Duplicate or stale events ignored.
    pub ignored: u64,
}

/// Heap bytes of [`ActiveSequences`] by structure, from allocated capacities.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SequencesMemory {
    /// Per-worker request maps and each request's boxed block list.
    pub requests: usize,
    /// Per-worker block reference counts.
    pub block_refs: usize,
    /// Per-worker prefill trackers.
    pub prefill: usize,
    /// The worker table, the request index and the per-worker slot array.
    pub tables: usize,
    /// The expiry queue (bookings in arrival order, freed ones included
    /// until the next [`ActiveSequences::expire`] compacts it).
    pub expiry_queue: usize,
    /// The derived read model ([`PromptRegistry`]).
    pub registry: usize,
}

impl SequencesMemory {
    /// All of it.
    pub fn total(&self) -> usize {
        self.requests
            + self.block_refs
            + self.prefill
            + self.tables
            + self.expiry_queue
            + self.registry
    }
}

#[derive(Debug)]
struct ActiveRequest {
    /// Shared with the change journal's copy, when one is kept.
    blocks: Arc<[SequenceHash]>,
    partial_block: bool,
    added_ms: f64,
}

/// Authoritative state of one worker.
#[derive(Debug, Default)]
struct WorkerSequences {
    requests: FxHashMap<RequestId, ActiveRequest>,
    /// Active requests holding each prompt block (shared blocks count once).
    block_refs: FxHashMap<SequenceHash, u32>,
    /// Requests whose prompt ends in a partial block: each such block is its
    /// own.
    partial_blocks: usize,
    prefill: PrefillTracker,
    /// Tokens per KV block on this worker (its model's).
    block_size: u32,
}

impl WorkerSequences {
    fn active_blocks(&self) -> usize {
        self.block_refs.len() + self.partial_blocks
    }
}

/// The write model of active sequences, with its read model kept in step.
#[derive(Debug)]
pub struct ActiveSequences {
    config: SequencesConfig,
    workers: WorkerTable,
    requests: RequestIndex,
    per_worker: Vec<Option<WorkerSequences>>,
    /// Bookings in arrival order, for expiry; entries of requests already
    /// freed are skipped.
    expiry_queue: VecDeque<(f64, RequestId)>,
    registry: PromptRegistry,
    counters: SequenceCounters,
    /// What changed for the routes' read model since the last
    /// [`ActiveSequences::drain_changes`], once [`ActiveSequences::record_changes`]
    /// turned it on (a published copy replays it).
    journal: Option<Vec<SequenceChange>>,
}

/// A change to what a route reads of the active sequences (each worker's
/// load and prompt-block counts), recorded for a published copy to replay
/// ([`crate::router::board`]).
#[derive(Clone, Debug)]
pub enum SequenceChange {
    /// The worker in `slot` has this load now (a new worker: idle).
    Load {
        /// Its registry slot.
        slot: usize,
        /// Its load.
        load: WorkerLoad,
    },
    /// A request's prompt blocks became active in `slot`.
    AddBlocks {
        /// The worker's registry slot.
        slot: usize,
        /// The prompt's chained hashes.
        blocks: Arc<[SequenceHash]>,
    },
    /// A request's prompt blocks in `slot` ended.
    FreeBlocks {
        /// The worker's registry slot.
        slot: usize,
        /// The prompt's chained hashes.
        blocks: Arc<[SequenceHash]>,
    },
    /// The worker in `slot` left, with every booking on it.
    Removed {
        /// Its registry slot.
        slot: usize,
    },
}

/// The leading blocks of a prompt active in a worker's prompt-block counts
/// `refs`, or `None` without its first block (no chain is built then).
/// `chain` holds the prompt's chained hashes once built (reused across
/// workers; cleared by the caller per prompt). A worker's active blocks
/// are prefix-closed (a request holding a block holds every block before
/// it, and a block's chained hash names its whole prefix), so the depth
/// is where the chain stops being counted.
pub(crate) fn active_depth(
    refs: &FxHashMap<SequenceHash, u32>,
    blocks: &[LocalHash],
    chain: &mut Vec<SequenceHash>,
) -> Option<u32> {
    // A prompt's first chained hash is its first local hash.
    let first = SequenceHash(blocks.first()?.0);
    if refs.is_empty() || !refs.contains_key(&first) {
        return None;
    }
    if chain.is_empty() {
        extend_sequence_hashes(blocks, chain);
    }
    Some(chain.partition_point(|h| refs.contains_key(h)) as u32)
}

/// Counts `blocks` once more in `refs`.
pub(crate) fn count_blocks(refs: &mut FxHashMap<SequenceHash, u32>, blocks: &[SequenceHash]) {
    for &s in blocks {
        *refs.entry(s).or_insert(0) += 1;
    }
}

/// Counts `blocks` once less in `refs`, dropping what reaches zero;
/// `false` if one of them was not counted (a broken invariant).
pub(crate) fn uncount_blocks(
    refs: &mut FxHashMap<SequenceHash, u32>,
    blocks: &[SequenceHash],
) -> bool {
    use hashbrown::hash_map::Entry;
    let mut all_counted = true;
    for &s in blocks {
        // One probe per block, whether it is dropped or counted down.
        match refs.entry(s) {
            Entry::Occupied(counted) if *counted.get() <= 1 => {
                counted.remove();
            }
            Entry::Occupied(mut counted) => *counted.get_mut() -= 1,
            Entry::Vacant(_) => all_counted = false,
        }
    }
    all_counted
}

impl ActiveSequences {
    /// An empty model; `config` must validate.
    pub fn new(config: SequencesConfig) -> Result<Self, SequencesConfigError> {
        config.validate()?;
        Ok(Self {
            config,
            workers: WorkerTable::default(),
            requests: RequestIndex::default(),
            per_worker: Vec::new(),
            expiry_queue: VecDeque::new(),
            registry: PromptRegistry::default(),
            counters: SequenceCounters::default(),
            journal: None,
        })
    }

    /// Starts recording [`SequenceChange`]s, beginning with every worker's
    /// current state, for [`Self::drain_changes`].
    pub fn record_changes(&mut self) {
        let mut journal = Vec::new();
        for (slot, state) in self.per_worker.iter().enumerate() {
            let Some(state) = state else { continue };
            if let Some(load) = self.registry.slot(slot) {
                journal.push(SequenceChange::Load { slot, load: *load });
            }
            for request in state.requests.values() {
                journal.push(SequenceChange::AddBlocks {
                    slot,
                    blocks: Arc::clone(&request.blocks),
                });
            }
        }
        self.journal = Some(journal);
    }

    /// The changes recorded since the last call, in order (none unless
    /// [`Self::record_changes`] is on).
    pub fn drain_changes(&mut self) -> impl Iterator<Item = SequenceChange> + '_ {
        self.journal
            .iter_mut()
            .flat_map(|journal| journal.drain(..))
    }

    fn record(&mut self, change: impl FnOnce() -> SequenceChange) {
        if let Some(journal) = &mut self.journal {
            journal.push(change());
        }
    }

    /// The settings in force.
    pub fn config(&self) -> &SequencesConfig {
        &self.config
    }

    /// Adds a worker (idempotent).
    pub fn add_worker(&mut self, worker: WorkerId) {
        self.add_worker_with_block_size(worker, self.config.block_size);
    }

    /// [`ActiveSequences::add_worker`] for a worker whose model has a
    /// block size of its own (a fleet of several models): its bookings'
    /// blocks are counted in `block_size` (0: the config's). A worker
    /// added again keeps its bookings and takes the new size for later
    /// ones.
    pub fn add_worker_with_block_size(&mut self, worker: WorkerId, block_size: u32) {
        let slot = self.workers.insert(worker) as usize;
        if self.per_worker.len() <= slot {
            self.per_worker.resize_with(slot + 1, || None);
        }
        let block_size = if block_size == 0 {
            self.config.block_size
        } else {
            block_size
        };
        match &mut self.per_worker[slot] {
            Some(state) => state.block_size = block_size,
            none => {
                *none = Some(WorkerSequences {
                    block_size,
                    ..WorkerSequences::default()
                });
                self.registry.set_load(slot, Some(WorkerLoad::idle(worker)));
                self.record(|| SequenceChange::Load {
                    slot,
                    load: WorkerLoad::idle(worker),
                });
            }
        }
    }

    /// Removes a worker, freeing every request booked on it; returns them.
    pub fn remove_worker(&mut self, worker: WorkerId) -> Vec<RequestId> {
        let Some(slot) = self.workers.remove(worker) else {
            return Vec::new();
        };
        let state = self.per_worker[slot as usize]
            .take()
            .expect("a slot in the table has state");
        let freed: Vec<RequestId> = state.requests.keys().copied().collect();
        for id in &freed {
            self.requests.remove(*id);
        }
        self.counters.dropped_with_worker += freed.len() as u64;
        self.registry.drop_worker(slot as usize);
        self.record(|| SequenceChange::Removed {
            slot: slot as usize,
        });
        freed
    }

    /// Applies one lifecycle event at `now_ms`.
    pub fn apply(&mut self, event: &SequenceEvent, now_ms: f64) -> LifecycleOutcome {
        match event {
            SequenceEvent::Add(add) => self.add_request(add, now_ms),
            SequenceEvent::MarkPrefillCompleted(id) => self.mark_prefill_completed(*id, now_ms),
            SequenceEvent::Free(id) => self.free(*id, now_ms),
        }
    }

    /// Books a request on its worker.
    pub fn add_request(&mut self, add: &AddRequest, now_ms: f64) -> LifecycleOutcome {
        let Some(slot) = self.workers.slot(add.worker) else {
            self.counters.ignored += 1;
            return LifecycleOutcome::UnknownWorker;
        };
        if self.requests.owner(add.request).is_some() {
            self.counters.ignored += 1;
            return LifecycleOutcome::Duplicate;
        }
        let seq: Arc<[SequenceHash]> = sequence_hashes(&add.blocks).into();
        let state = self.per_worker[slot as usize]
            .as_mut()
            .expect("a slot in the table has state");
        let block_size = state.block_size;
        // Count every prompt block once per worker: what the worker holds
        // for its active requests, and which prompt prefixes are active on
        // it (`active_prompt_overlaps`).
        count_blocks(&mut state.block_refs, &seq);
        let partial_block = add.prompt_tokens as u64 > seq.len() as u64 * block_size as u64;
        if partial_block {
            state.partial_blocks += 1;
        }
        let cached = (add.overlap_blocks as u64 * block_size as u64).min(add.prompt_tokens as u64);
        let prefill_tokens = add.prompt_tokens as u64 - cached;
        if prefill_tokens > 0 {
            state
                .prefill
                .insert(add.request, prefill_tokens, add.expected_prefill_ms, now_ms);
        }
        state.requests.insert(
            add.request,
            ActiveRequest {
                blocks: Arc::clone(&seq),
                partial_block,
                added_ms: now_ms,
            },
        );
        self.requests.insert(add.request, slot);
        self.expiry_queue.push_back((now_ms, add.request));
        // Bounded here, not only by the sweep: left to grow (a driver that
        // sweeps rarely or never, as `bench contention` did), the queue
        // touched a fresh page every 128 bookings, and the booking that
        // met the page fault took some 25 µs more on a VM.
        self.compact_expiry_queue();
        self.counters.added += 1;
        self.record(|| SequenceChange::AddBlocks {
            slot: slot as usize,
            blocks: seq,
        });
        self.publish_load(slot);
        LifecycleOutcome::Applied
    }

    /// Marks a request's prefill done (its first token arrived).
    pub fn mark_prefill_completed(&mut self, id: RequestId, now_ms: f64) -> LifecycleOutcome {
        let Some(slot) = self.requests.owner(id) else {
            self.counters.ignored += 1;
            return LifecycleOutcome::UnknownRequest;
        };
        let state = self.per_worker[slot as usize]
            .as_mut()
            .expect("an owner slot has state");
        if !state.prefill.remove(id, now_ms) {
            self.counters.ignored += 1;
            return LifecycleOutcome::Duplicate;
        }
        self.publish_load(slot);
        LifecycleOutcome::Applied
    }

    /// Frees a request, returning every block it held.
    pub fn free(&mut self, id: RequestId, now_ms: f64) -> LifecycleOutcome {
        if self.free_inner(id, now_ms) {
            self.counters.freed += 1;
            LifecycleOutcome::Applied
        } else {
            self.counters.ignored += 1;
            LifecycleOutcome::UnknownRequest
        }
    }

    fn free_inner(&mut self, id: RequestId, now_ms: f64) -> bool {
        let Some(slot) = self.requests.remove(id) else {
            return false;
        };
        let state = self.per_worker[slot as usize]
            .as_mut()
            .expect("an owner slot has state");
        let request = state
            .requests
            .remove(&id)
            .expect("the request index and the worker agree");
        state.prefill.remove(id, now_ms);
        if request.partial_block {
            state.partial_blocks -= 1;
        }
        let counted = uncount_blocks(&mut state.block_refs, &request.blocks);
        debug_assert!(counted, "a booked block is counted");
        if state.requests.is_empty() {
            // Give memory back after a burst.
            state.block_refs.shrink_to(64);
            state.requests.shrink_to(64);
        }
        self.record(|| SequenceChange::FreeBlocks {
            slot: slot as usize,
            blocks: request.blocks,
        });
        self.publish_load(slot);
        true
    }

    /// Frees every request booked at or before `now_ms − expiry_ms`; returns
    /// their ids.
    pub fn expire(&mut self, now_ms: f64) -> Vec<RequestId> {
        let deadline = now_ms - self.config.expiry_ms;
        let mut expired = Vec::new();
        while let Some(&(added, id)) = self.expiry_queue.front() {
            if added > deadline {
                break;
            }
            self.expiry_queue.pop_front();
            let current = self.requests.owner(id).and_then(|slot| {
                self.per_worker[slot as usize]
                    .as_ref()
                    .and_then(|s| s.requests.get(&id))
                    .map(|r| r.added_ms == added)
            });
            if current == Some(true) && self.free_inner(id, now_ms) {
                expired.push(id);
            }
        }
        self.counters.expired += expired.len() as u64;
        self.compact_expiry_queue();
        expired
    }

    /// Drops the expiry entries of requests already freed once they
    /// outnumber the live ones (plus 1,024): the queue stays within twice
    /// the active requests however rarely [`Self::expire`] runs, and the
    /// pass over it is paid once per at least 1,024 bookings.
    fn compact_expiry_queue(&mut self) {
        if self.expiry_queue.len() > 2 * self.requests.len() + 1024 {
            let requests = &self.requests;
            self.expiry_queue
                .retain(|(_, id)| requests.owner(*id).is_some());
        }
    }

    /// The worker a request is booked on.
    pub fn owner(&self, id: RequestId) -> Option<WorkerId> {
        self.requests
            .owner(id)
            .and_then(|slot| self.workers.id(slot))
    }

    /// Active requests across all workers.
    pub fn active_requests(&self) -> usize {
        self.requests.len()
    }

    /// The derived read model.
    pub fn registry(&self) -> &PromptRegistry {
        &self.registry
    }

    /// The registry slot of a worker in the model
    /// ([`PromptRegistry::slots`]).
    pub fn slot_of(&self, worker: WorkerId) -> Option<usize> {
        self.workers.slot(worker).map(|slot| slot as usize)
    }

    /// Leading blocks of a prompt (its local block hashes) already active
    /// on each worker, written into `out` (cleared first; workers with
    /// none are left out). `chain` is scratch for the prompt's chained
    /// hashes (reuse one to avoid allocating).
    ///
    /// Answered from each worker's prompt-block reference counts: a
    /// worker's active blocks are prefix-closed (a request holding a block
    /// holds every block before it, and a block's chained hash names its
    /// whole prefix), so its depth is where the prompt's chained hashes
    /// stop being counted there — one lookup for a worker without the
    /// prompt's first block, about log2(blocks) more with it. Keeping no
    /// second structure for this makes a booking and a free a few
    /// counter changes per block.
    pub fn active_prompt_overlaps(
        &self,
        blocks: &[LocalHash],
        chain: &mut Vec<SequenceHash>,
        out: &mut OverlapScores,
    ) {
        out.entries.clear();
        self.active_prompt_depths(blocks, chain, |slot, depth| {
            let state = self.per_worker[slot]
                .as_ref()
                .expect("a slot with a depth has state");
            out.entries.push(WorkerOverlap {
                worker: self
                    .workers
                    .id(slot as u32)
                    .expect("a slot with state is in the table"),
                depth,
                cached_blocks: state.block_refs.len(),
            });
        });
    }

    /// [`Self::active_prompt_overlaps`] by registry slot
    /// ([`PromptRegistry::slots`]): `each(slot, depth)` for every worker
    /// with a nonzero depth, in slot order.
    pub fn active_prompt_depths(
        &self,
        blocks: &[LocalHash],
        chain: &mut Vec<SequenceHash>,
        mut each: impl FnMut(usize, u32),
    ) {
        chain.clear();
        for (slot, state) in self.per_worker.iter().enumerate() {
            let Some(state) = state else { continue };
            if let Some(depth) = active_depth(&state.block_refs, blocks, chain) {
                each(slot, depth);
            }
        }
    }

    /// Distinct full prompt blocks active on `worker`.
    pub fn active_blocks(&self, worker: WorkerId) -> usize {
        self.workers
            .slot(worker)
            .and_then(|slot| self.per_worker[slot as usize].as_ref())
            .map_or(0, |state| state.block_refs.len())
    }

    /// Whether `worker` is in the table.
    pub fn has_worker(&self, worker: WorkerId) -> bool {
        self.workers.slot(worker).is_some()
    }

    /// Workers in the table.
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.workers.iter()
    }

    /// Counters for metrics.
    pub fn counters(&self) -> SequenceCounters {
        self.counters
    }

    /// Heap bytes by structure. Visits every active request (for its block
    /// list): call it for reports, not per request.
    pub fn memory(&self) -> SequencesMemory {
        let mut memory = SequencesMemory {
            tables: self.workers.estimated_bytes()
                + self.requests.estimated_bytes()
                + self.per_worker.capacity() * std::mem::size_of::<Option<WorkerSequences>>(),
            expiry_queue: self.expiry_queue.capacity() * std::mem::size_of::<(f64, RequestId)>(),
            registry: self.registry.estimated_bytes(),
            ..SequencesMemory::default()
        };
        for state in self.per_worker.iter().flatten() {
            memory.requests += map_bytes(&state.requests)
                + state
                    .requests
                    .values()
                    .map(|r| r.blocks.len() * std::mem::size_of::<SequenceHash>())
                    .sum::<usize>();
            memory.block_refs += map_bytes(&state.block_refs);
            memory.prefill += state.prefill.estimated_bytes();
        }
        memory
    }

    fn publish_load(&mut self, slot: u32) {
        let worker = self.workers.id(slot).expect("slot is in the table");
        let state = self.per_worker[slot as usize]
            .as_ref()
            .expect("slot has state");
        let load = WorkerLoad {
            worker,
            prefill: state.prefill.summary(),
            decode_blocks: state.active_blocks(),
            requests: state.requests.len(),
        };
        self.registry.set_load(slot as usize, Some(load));
        self.record(|| SequenceChange::Load {
            slot: slot as usize,
            load,
        });
    }

    #[cfg(test)]
    fn check_invariants(&self) {
        use std::collections::HashMap;
        let mut owned = 0;
        for (slot, state) in self.per_worker.iter().enumerate() {
            let Some(state) = state else { continue };
            let worker = self
                .workers
                .id(slot as u32)
                .expect("state has a table entry");
            let mut recount: HashMap<SequenceHash, u32> = HashMap::new();
            let mut partial = 0;
            for (id, r) in &state.requests {
                assert_eq!(self.requests.owner(*id), Some(slot as u32));
                for b in r.blocks.iter() {
                    *recount.entry(*b).or_default() += 1;
                }
                partial += r.partial_block as usize;
                owned += 1;
            }
            let counted: HashMap<SequenceHash, u32> =
                state.block_refs.iter().map(|(k, v)| (*k, *v)).collect();
            assert_eq!(counted, recount);
            assert_eq!(state.partial_blocks, partial);
            let load = self
                .registry
                .load(worker)
                .expect("registry has every worker");
            assert_eq!(load.decode_blocks, recount.len() + partial);
            assert_eq!(load.requests, state.requests.len());
            assert_eq!(self.active_blocks(worker), recount.len());
        }
        assert_eq!(owned, self.requests.len());
    }
}

#[cfg(test)]
mod tests;
