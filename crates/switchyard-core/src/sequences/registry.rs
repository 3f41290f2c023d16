//! The read model selectors use: per-worker load.

use super::prefill::{MissingExpectedDuration, PrefillSummary};
use crate::types::WorkerId;

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
/// [`super::ActiveSequences`] and never writes back. (Which prompt blocks
/// are active where is answered by the write model's own reference counts,
/// [`super::ActiveSequences::active_prompt_overlaps`].)
#[derive(Debug, Default)]
pub struct PromptRegistry {
    loads: Vec<Option<WorkerLoad>>,
}

impl PromptRegistry {
    /// Loads of every worker, in slot order.
    pub fn loads(&self) -> impl Iterator<Item = &WorkerLoad> + '_ {
        self.loads.iter().flatten()
    }

    /// Loads of every worker with its slot ([`super::ActiveSequences::slot_of`]),
    /// in slot order.
    pub fn slots(&self) -> impl Iterator<Item = (usize, &WorkerLoad)> + '_ {
        self.loads
            .iter()
            .enumerate()
            .filter_map(|(slot, load)| Some((slot, load.as_ref()?)))
    }

    /// One past the highest slot in use.
    pub fn slot_count(&self) -> usize {
        self.loads.len()
    }

    /// The load in `slot`, if a worker is there.
    pub fn slot(&self, slot: usize) -> Option<&WorkerLoad> {
        self.loads.get(slot)?.as_ref()
    }

    /// The load of one worker.
    pub fn load(&self, worker: WorkerId) -> Option<&WorkerLoad> {
        self.loads().find(|l| l.worker == worker)
    }

    pub(super) fn set_load(&mut self, slot: usize, load: Option<WorkerLoad>) {
        if self.loads.len() <= slot {
            self.loads.resize(slot + 1, None);
        }
        self.loads[slot] = load;
    }

    pub(super) fn drop_worker(&mut self, slot: usize) {
        self.set_load(slot, None);
    }

    /// Estimate of heap bytes in use.
    pub fn estimated_bytes(&self) -> usize {
        self.loads.capacity() * std::mem::size_of::<Option<WorkerLoad>>()
    }
}
