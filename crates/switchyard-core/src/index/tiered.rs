//! One exact prefix index per cache tier: what each worker holds on its
//! device (GPU memory) and what it holds in its host tier (CPU memory, the
//! blocks an engine restores by a copy instead of recomputing them).
//!
//! The two are independent [`PrefixIndex`]es, bounded the same way (memory
//! tracks live (block, worker) pairs), so a fleet without a host tier pays
//! nothing for it: its host index stays empty. One rule joins them, and it
//! lives here: a host-tier block is placed by its prefix, and that prefix
//! may be in either tier. An engine spills a block to its host tier when it
//! evicts it from the device, usually while the block's parent is still on
//! the device; a host-tier `Stored` whose parent the host tier does not
//! hold is therefore placed under the parent's path in the device index
//! ([`PrefixIndex::store_under_path`]). A parent neither tier holds drops
//! the event (counted as an unknown parent in the host index).
//!
//! A third index holds the SSM checkpoints of hybrid (SSM + attention)
//! models: the block boundaries at which an engine kept a sequence's SSM
//! state (vLLM publishes them as the stores of its `"mamba"` cache group).
//! A hybrid engine can reuse a cached prefix only up to such a boundary,
//! so a checkpoint is placed like a host block, under its parent's device
//! path, and read by [`PrefixIndex::deepest_within`]: a worker that has
//! ever published a checkpoint is credited only up to its deepest one
//! within its device prefix ([`TieredIndex::is_hybrid`]).
//!
//! `Cleared` is the worker's whole cache, whatever tier it names: an engine
//! that resets its prefix cache, or a stream with a gap the router cannot
//! fill, leaves nothing trustworthy in any tier.

use super::{ApplyOutcome, IndexEvent, IndexMemory, PrefixIndex};
use crate::types::{LocalHash, WorkerId};

/// Which cache tier an index event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CacheTier {
    /// Device (GPU) memory: blocks a request uses as they are.
    Device,
    /// Host (CPU) memory: blocks a request restores by a copy.
    Host,
    /// SSM-state checkpoints of a hybrid model, at block boundaries: where
    /// a device prefix can be resumed from.
    Checkpoint,
}

impl CacheTier {
    /// Every tier, device first.
    pub const ALL: [CacheTier; 3] = [CacheTier::Device, CacheTier::Host, CacheTier::Checkpoint];

    /// Stable label for metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            CacheTier::Device => "device",
            CacheTier::Host => "host",
            CacheTier::Checkpoint => "ssm_checkpoint",
        }
    }
}

/// The device, host and SSM-checkpoint prefix indexes of a fleet (see the
/// module docs).
#[derive(Clone, Debug, Default)]
pub struct TieredIndex {
    device: PrefixIndex,
    host: PrefixIndex,
    checkpoint: PrefixIndex,
    /// Scratch for a host block's parent path; empty between calls.
    path: Vec<LocalHash>,
}

impl TieredIndex {
    /// Empty indexes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Empty indexes in which a worker holds at most `cap` block names per
    /// tier ([`PrefixIndex::with_max_blocks_per_worker`]).
    pub fn with_max_blocks_per_worker(cap: usize) -> Self {
        Self {
            device: PrefixIndex::with_max_blocks_per_worker(cap),
            host: PrefixIndex::with_max_blocks_per_worker(cap),
            checkpoint: PrefixIndex::with_max_blocks_per_worker(cap),
            path: Vec::new(),
        }
    }

    /// Blocks dropped in every tier because their worker was past its cap.
    pub fn evicted_over_cap(&self) -> u64 {
        [&self.device, &self.host, &self.checkpoint]
            .iter()
            .map(|index| index.counters().evicted_over_cap)
            .sum()
    }

    /// Applies one event of `worker`'s `tier`. `Cleared` clears every
    /// tier; its outcome is `UnknownWorker` only when no tier knew the
    /// worker.
    pub fn apply(&mut self, worker: WorkerId, tier: CacheTier, event: &IndexEvent) -> ApplyOutcome {
        if *event == IndexEvent::Cleared {
            return self.clear(worker);
        }
        let (index, device, path) = match tier {
            CacheTier::Device => (&mut self.device, None, &mut self.path),
            CacheTier::Host => (&mut self.host, Some(&self.device), &mut self.path),
            CacheTier::Checkpoint => (&mut self.checkpoint, Some(&self.device), &mut self.path),
        };
        match (event, device) {
            (IndexEvent::Stored { parent, blocks }, Some(device)) => match parent {
                // A block whose parent is on the device only: placed under
                // the parent's device path.
                Some(p) if !index.holds(worker, *p) && device.path_of(worker, *p, path) => {
                    let outcome = index.store_under_path(worker, path, blocks);
                    path.clear();
                    outcome
                }
                _ => index.store(worker, *parent, blocks),
            },
            (event, _) => index.apply(worker, event),
        }
    }

    /// Clears `worker` in every tier (a hybrid worker stays known as one).
    fn clear(&mut self, worker: WorkerId) -> ApplyOutcome {
        let mut outcome = ApplyOutcome::UnknownWorker;
        for index in [&mut self.device, &mut self.host, &mut self.checkpoint] {
            if !index.knows(worker) {
                continue;
            }
            if let ApplyOutcome::Applied { changed, .. } = index.clear(worker) {
                let before = match outcome {
                    ApplyOutcome::Applied { changed, .. } => changed,
                    _ => 0,
                };
                outcome = ApplyOutcome::Applied {
                    changed: before + changed,
                    unknown: 0,
                };
            }
        }
        if outcome == ApplyOutcome::UnknownWorker {
            // Counted as the device index counts an unknown worker.
            self.device.clear(worker);
        }
        outcome
    }

    /// Forgets `worker` in every tier. Returns whether any knew it.
    pub fn remove_worker(&mut self, worker: WorkerId) -> bool {
        let device = self.device.remove_worker(worker);
        let host = self.host.remove_worker(worker);
        let checkpoint = self.checkpoint.remove_worker(worker);
        device || host || checkpoint
    }

    /// The SSM-checkpoint tier's index.
    pub fn checkpoint(&self) -> &PrefixIndex {
        &self.checkpoint
    }

    /// Whether `worker` runs a hybrid model: it has published an SSM
    /// checkpoint since it joined (a cleared cache keeps it hybrid).
    pub fn is_hybrid(&self, worker: WorkerId) -> bool {
        self.checkpoint.knows(worker)
    }

    /// The device tier's index.
    pub fn device(&self) -> &PrefixIndex {
        &self.device
    }

    /// The host tier's index.
    pub fn host(&self) -> &PrefixIndex {
        &self.host
    }

    /// Whether any worker holds any host-tier block: routing reads the
    /// host index only then.
    pub fn has_host_blocks(&self) -> bool {
        self.host.live_pairs() > 0
    }

    /// Heap bytes of the device index and of the host and checkpoint
    /// indexes together.
    pub fn memory(&self) -> (IndexMemory, IndexMemory) {
        let (host, checkpoint) = (self.host.memory(), self.checkpoint.memory());
        let others = IndexMemory {
            nodes: host.nodes + checkpoint.nodes,
            free_lists: host.free_lists + checkpoint.free_lists,
            child_maps: host.child_maps + checkpoint.child_maps,
            engine_maps: host.engine_maps + checkpoint.engine_maps,
        };
        (self.device.memory(), others)
    }

    /// Estimate of heap bytes of every tier.
    pub fn estimated_bytes(&self) -> usize {
        self.device.estimated_bytes()
            + self.host.estimated_bytes()
            + self.checkpoint.estimated_bytes()
            + self.path.capacity() * std::mem::size_of::<LocalHash>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::OverlapScores;
    use crate::types::EngineHash;

    fn w(id: u64) -> WorkerId {
        WorkerId::new(id)
    }

    use crate::index::stored_chain as stored;

    fn locals(hashes: &[u64]) -> Vec<LocalHash> {
        hashes.iter().copied().map(LocalHash).collect()
    }

    fn host_run(index: &TieredIndex, worker: WorkerId, query: &[u64], from: u32) -> u32 {
        let mut runs = OverlapScores::new();
        index.host().runs_from(&locals(query), |_| from, &mut runs);
        runs.depth(worker)
    }

    #[test]
    fn device_and_host_events_go_to_their_own_tier() {
        let mut index = TieredIndex::new();
        index.apply(w(1), CacheTier::Device, &stored(None, &[(11, 1), (12, 2)]));
        index.apply(w(1), CacheTier::Host, &stored(None, &[(21, 1)]));
        assert_eq!(index.device().live_pairs(), 2);
        assert_eq!(index.host().live_pairs(), 1);
        // A host-tier removal never removes the device copy.
        index.apply(
            w(1),
            CacheTier::Host,
            &IndexEvent::Removed {
                blocks: vec![EngineHash(11)],
            },
        );
        assert_eq!(index.device().live_pairs(), 2);
        assert!(index.has_host_blocks());
    }

    #[test]
    fn a_block_spilled_below_a_device_parent_is_placed_under_the_parents_path() {
        // The engine evicts block 3 (tail first) and spills it to its host
        // tier while blocks 1 and 2 stay on the device.
        let mut index = TieredIndex::new();
        index.apply(
            w(1),
            CacheTier::Device,
            &stored(None, &[(11, 1), (12, 2), (13, 3)]),
        );
        index.apply(
            w(1),
            CacheTier::Device,
            &IndexEvent::Removed {
                blocks: vec![EngineHash(13)],
            },
        );
        let outcome = index.apply(w(1), CacheTier::Host, &stored(Some(12), &[(13, 3)]));
        assert!(matches!(outcome, ApplyOutcome::Applied { changed: 1, .. }));
        assert_eq!(host_run(&index, w(1), &[1, 2, 3, 4], 2), 1);
        // Then block 2 goes the same way: now under a host-held block 3's
        // parent path too, and the run from block 1 is two long.
        index.apply(
            w(1),
            CacheTier::Device,
            &IndexEvent::Removed {
                blocks: vec![EngineHash(12)],
            },
        );
        index.apply(w(1), CacheTier::Host, &stored(Some(11), &[(12, 2)]));
        assert_eq!(host_run(&index, w(1), &[1, 2, 3, 4], 1), 2);
        // A parent neither tier holds drops the event.
        let outcome = index.apply(w(1), CacheTier::Host, &stored(Some(77), &[(14, 4)]));
        assert_eq!(outcome, ApplyOutcome::UnknownParent);
        assert_eq!(index.host().counters().unknown_parent, 1);
    }

    #[test]
    fn ssm_checkpoints_hang_under_their_device_path_and_mark_the_worker_hybrid() {
        let mut index = TieredIndex::new();
        index.apply(
            w(1),
            CacheTier::Device,
            &stored(None, &[(11, 1), (12, 2), (13, 3), (14, 4)]),
        );
        assert!(!index.is_hybrid(w(1)));
        // vLLM's mamba group stores the boundary blocks alone, each under
        // its attention parent.
        index.apply(w(1), CacheTier::Checkpoint, &stored(Some(11), &[(12, 2)]));
        index.apply(w(1), CacheTier::Checkpoint, &stored(Some(13), &[(14, 4)]));
        assert!(index.is_hybrid(w(1)));
        let mut out = OverlapScores::new();
        let query = locals(&[1, 2, 3, 4, 5]);
        index.checkpoint().deepest_within(&query, |_| 3, &mut out);
        assert_eq!(
            out.depth(w(1)),
            2,
            "block 4's checkpoint lies past a 3-block prefix"
        );
        index.checkpoint().deepest_within(&query, |_| 4, &mut out);
        assert_eq!(out.depth(w(1)), 4);
        index.apply(
            w(1),
            CacheTier::Checkpoint,
            &IndexEvent::Removed {
                blocks: vec![EngineHash(14)],
            },
        );
        index.checkpoint().deepest_within(&query, |_| 4, &mut out);
        assert_eq!(out.depth(w(1)), 2);
        assert_eq!(
            index.device().live_pairs(),
            4,
            "the device tier is untouched"
        );
        // A cleared cache leaves no checkpoint, but the worker stays hybrid.
        index.apply(w(1), CacheTier::Device, &IndexEvent::Cleared);
        assert_eq!(index.checkpoint().live_pairs(), 0);
        assert!(index.is_hybrid(w(1)));
        assert!(index.remove_worker(w(1)));
        assert!(!index.is_hybrid(w(1)));
    }

    #[test]
    fn a_clear_clears_both_tiers_and_a_removed_worker_leaves_both() {
        let mut index = TieredIndex::new();
        index.apply(w(1), CacheTier::Device, &stored(None, &[(11, 1)]));
        index.apply(w(1), CacheTier::Host, &stored(None, &[(21, 2)]));
        index.apply(w(2), CacheTier::Host, &stored(None, &[(31, 2)]));
        assert_eq!(
            index.apply(w(1), CacheTier::Device, &IndexEvent::Cleared),
            ApplyOutcome::Applied {
                changed: 2,
                unknown: 0
            }
        );
        assert_eq!(index.device().live_pairs(), 0);
        assert_eq!(index.host().live_pairs(), 1);
        // Known to the host tier only: still cleared.
        assert!(matches!(
            index.apply(w(2), CacheTier::Device, &IndexEvent::Cleared),
            ApplyOutcome::Applied { changed: 1, .. }
        ));
        assert_eq!(
            index.apply(w(9), CacheTier::Host, &IndexEvent::Cleared),
            ApplyOutcome::UnknownWorker
        );
        index.apply(w(1), CacheTier::Device, &stored(None, &[(11, 1)]));
        index.apply(w(1), CacheTier::Host, &stored(None, &[(21, 2)]));
        assert!(index.remove_worker(w(1)));
        assert_eq!(index.device().workers().count(), 0);
        assert!(!index.host().workers().any(|x| x == w(1)));
        assert!(!index.remove_worker(w(1)));
    }

    #[test]
    fn the_estimate_counts_both_tiers() {
        let mut index = TieredIndex::new();
        let empty = index.estimated_bytes();
        index.apply(w(1), CacheTier::Host, &stored(None, &[(21, 2), (22, 3)]));
        assert!(index.estimated_bytes() > empty);
        let (device, host) = index.memory();
        assert_eq!(
            index.estimated_bytes(),
            device.total() + host.total() + index.path.capacity() * 8
        );
    }
}
