//! The read model selectors use: per-worker load and active prompt prefixes.

use super::prefill::{MissingExpectedDuration, PrefillSummary};
use crate::index::{OverlapScores, PrefixIndex, StoredBlock};
use crate::types::{EngineHash, LocalHash, SequenceHash, WorkerId};

/// One worker's load as of its last lifecycle event.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct WorkerLoad {
    /// The worker.
    pub worker: WorkerId,
    /// Its prefill backlog; evaluate at any `now_ms`.
    pub prefill: PrefillSummary,
    /// KV blocks held by active requests (shared prompt blocks once).
    pub decode_blocks: usize,
    /// Active requests.
    pub requests: usize,
}

impl WorkerLoad {
    /// A worker with nothing active.
    pub fn idle(worker: WorkerId) -> Self {
        Self {
            worker,
            prefill: PrefillSummary::default(),
            decode_blocks: 0,
            requests: 0,
        }
    }

    /// Uncached prefill tokens still to compute at `now_ms`.
    pub fn active_prefill_tokens(&self, now_ms: f64) -> u64 {
        self.prefill.active_tokens_at(now_ms)
    }

    /// Modeled remaining prefill time at `now_ms`.
    pub fn remaining_prefill_ms(&self, now_ms: f64) -> Result<f64, MissingExpectedDuration> {
        self.prefill.remaining_ms_at(now_ms)
    }
}

/// Derived view of active sequences for selectors. It is written only by
/// [`super::ActiveSequences`] and never writes back; a driver that shares it
/// across threads may read it torn (load from one moment, membership from
/// another), which can cost a worse choice but never breaks the write model.
#[derive(Debug, Default)]
pub struct PromptRegistry {
    loads: Vec<Option<WorkerLoad>>,
    /// Prompt blocks active on each worker. Membership is prefix-closed (a
    /// request holding a block holds all blocks before it), so the same trie
    /// as the cache index answers "how many leading prompt blocks are active
    /// on each worker" in time proportional to the prompt.
    membership: PrefixIndex,
}

impl PromptRegistry {
    /// Loads of every worker, in slot order.
    pub fn loads(&self) -> impl Iterator<Item = &WorkerLoad> + '_ {
        self.loads.iter().flatten()
    }

    /// The load of one worker.
    pub fn load(&self, worker: WorkerId) -> Option<&WorkerLoad> {
        self.loads().find(|l| l.worker == worker)
    }

    /// Leading blocks of a prompt already active on each worker.
    pub fn active_prompt_overlaps(&self, hashes: &[LocalHash], out: &mut OverlapScores) {
        self.membership.overlaps(hashes, out);
    }

    /// Distinct full prompt blocks active on `worker`.
    pub fn active_blocks(&self, worker: WorkerId) -> usize {
        self.membership.worker_blocks(worker)
    }

    pub(super) fn set_load(&mut self, slot: usize, load: Option<WorkerLoad>) {
        if self.loads.len() <= slot {
            self.loads.resize(slot + 1, None);
        }
        self.loads[slot] = load;
    }

    pub(super) fn drop_worker(&mut self, slot: usize, worker: WorkerId) {
        self.set_load(slot, None);
        self.membership.remove_worker(worker);
    }

    pub(super) fn activate_block(
        &mut self,
        worker: WorkerId,
        parent: Option<SequenceHash>,
        block: SequenceHash,
        local: LocalHash,
    ) {
        self.membership.store(
            worker,
            parent.map(|p| EngineHash(p.0)),
            &[StoredBlock {
                engine_hash: EngineHash(block.0),
                local_hash: local,
            }],
        );
    }

    pub(super) fn deactivate_block(&mut self, worker: WorkerId, block: SequenceHash) {
        self.membership.remove(worker, &[EngineHash(block.0)]);
    }

    /// Estimate of heap bytes in use.
    pub fn estimated_bytes(&self) -> usize {
        self.membership.estimated_bytes()
            + self.loads.capacity() * std::mem::size_of::<Option<WorkerLoad>>()
    }
}
