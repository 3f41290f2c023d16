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
//! `Cleared` is the worker's whole cache, whatever tier it names: an engine
//! that resets its prefix cache, or a stream with a gap the router cannot
//! fill, leaves nothing trustworthy in either tier.

use super::{ApplyOutcome, IndexEvent, IndexMemory, PrefixIndex};
use crate::types::{LocalHash, WorkerId};

/// Which cache tier an index event is about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CacheTier {
    /// Device (GPU) memory: blocks a request uses as they are.
    Device,
    /// Host (CPU) memory: blocks a request restores by a copy.
    Host,
}

impl CacheTier {
    /// Both tiers, device first.
    pub const ALL: [CacheTier; 2] = [CacheTier::Device, CacheTier::Host];

    /// Stable label for metrics.
    pub const fn as_str(self) -> &'static str {
        match self {
            CacheTier::Device => "device",
            CacheTier::Host => "host",
        }
    }
}

/// The device and host prefix indexes of a fleet (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct TieredIndex {
    device: PrefixIndex,
    host: PrefixIndex,
    /// Scratch for a host block's parent path; empty between calls.
    path: Vec<LocalHash>,
}

impl TieredIndex {
    /// Empty indexes.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event of `worker`'s `tier`. `Cleared` clears both tiers;
    /// its outcome is `UnknownWorker` only when neither tier knew the
    /// worker.
    pub fn apply(&mut self, worker: WorkerId, tier: CacheTier, event: &IndexEvent) -> ApplyOutcome {
        match (tier, event) {
            (_, IndexEvent::Cleared) => self.clear(worker),
            (CacheTier::Device, event) => self.device.apply(worker, event),
            (CacheTier::Host, IndexEvent::Stored { parent, blocks }) => match parent {
                Some(p)
                    if !self.host.holds(worker, *p)
                        && self.device.path_of(worker, *p, &mut self.path) =>
                {
                    let outcome = self.host.store_under_path(worker, &self.path, blocks);
                    self.path.clear();
                    outcome
                }
                _ => self.host.store(worker, *parent, blocks),
            },
            (CacheTier::Host, IndexEvent::Removed { blocks }) => self.host.remove(worker, blocks),
        }
    }

    /// Clears `worker` in both tiers.
    fn clear(&mut self, worker: WorkerId) -> ApplyOutcome {
        let host = if self.host.knows(worker) {
            self.host.clear(worker)
        } else {
            ApplyOutcome::UnknownWorker
        };
        match (self.device.clear(worker), host) {
            (
                ApplyOutcome::Applied { changed, .. },
                ApplyOutcome::Applied {
                    changed: host_changed,
                    ..
                },
            ) => ApplyOutcome::Applied {
                changed: changed + host_changed,
                unknown: 0,
            },
            (ApplyOutcome::UnknownWorker, applied) | (applied, _) => applied,
        }
    }

    /// Forgets `worker` in both tiers. Returns whether either knew it.
    pub fn remove_worker(&mut self, worker: WorkerId) -> bool {
        let device = self.device.remove_worker(worker);
        let host = self.host.remove_worker(worker);
        device || host
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

    /// Heap bytes of each tier's index.
    pub fn memory(&self) -> (IndexMemory, IndexMemory) {
        (self.device.memory(), self.host.memory())
    }

    /// Estimate of heap bytes of both tiers.
    pub fn estimated_bytes(&self) -> usize {
        self.device.estimated_bytes()
            + self.host.estimated_bytes()
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
