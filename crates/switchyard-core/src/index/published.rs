//! An exact [`TieredIndex`] (both tiers' prefix indexes) whose reads never
//! wait for its writes.
//!
//! [`publish`] splits an index into an [`IndexWriter`] and an
//! [`IndexReader`] (the `left-right` crate: two copies of the index; the
//! writer changes one while readers read the other, and `publish` swaps
//! them once no reader is left in the old one). A reader's
//! [`IndexReader::with`] is wait-free: it never waits for a KV event being
//! applied, however long that takes or however the writer's thread is
//! scheduled. The writer waits for readers instead (a routing decision's
//! lookup, about a microsecond), and every change is applied to both
//! copies, so writes cost about twice and the index twice the memory.
//!
//! The server's router reads through an `IndexReader` inside its routing
//! state and applies KV events through the `IndexWriter` beside it, under a
//! lock of the writer's own. The simulator keeps the plain index: one
//! thread, nothing to wait for.

use super::{CacheTier, IndexEvent, TieredIndex};
use crate::types::WorkerId;
use left_right::{Absorb, ReadHandle, WriteHandle};

/// A change to the index, applied to both copies in turn.
#[derive(Debug, Clone)]
pub enum IndexOp {
    /// A worker's KV event about one tier.
    Apply(WorkerId, CacheTier, IndexEvent),
    /// Forget a worker and everything it held.
    RemoveWorker(WorkerId),
}

impl Absorb<IndexOp> for TieredIndex {
    fn absorb_first(&mut self, op: &mut IndexOp, _: &Self) {
        match op {
            IndexOp::Apply(worker, tier, event) => {
                self.apply(*worker, *tier, event);
            }
            IndexOp::RemoveWorker(worker) => {
                self.remove_worker(*worker);
            }
        }
    }

    fn sync_with(&mut self, first: &Self) {
        self.clone_from(first);
    }
}

/// The writing side (one; `Send`, not shared: put it behind a lock).
pub struct IndexWriter(WriteHandle<TieredIndex, IndexOp>);

/// The reading side.
pub struct IndexReader(ReadHandle<TieredIndex>);

impl std::fmt::Debug for IndexWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexWriter").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for IndexReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IndexReader").finish_non_exhaustive()
    }
}

/// Splits `index` into its writer and a reader; both start with its
/// contents.
pub fn publish(index: TieredIndex) -> (IndexWriter, IndexReader) {
    let (mut writer, reader) = left_right::new_from_empty(index);
    writer.publish();
    (IndexWriter(writer), IndexReader(reader))
}

impl IndexWriter {
    /// Applies a worker's KV event about `tier` and makes it visible to
    /// readers.
    pub fn apply(&mut self, worker: WorkerId, tier: CacheTier, event: &IndexEvent) {
        self.0.append(IndexOp::Apply(worker, tier, event.clone()));
        self.0.publish();
    }

    /// Forgets `worker` in both tiers and makes that visible to readers.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.0.append(IndexOp::RemoveWorker(worker));
        self.0.publish();
    }
}

impl IndexReader {
    /// Makes readers of the same index for other threads.
    pub(crate) fn factory(&self) -> left_right::ReadHandleFactory<TieredIndex> {
        self.0.factory()
    }

    /// Runs `read` on the indexes as last published; never waits for the
    /// writer. With the writer gone, `read` sees empty indexes.
    pub fn with<R>(&self, read: impl FnOnce(&TieredIndex) -> R) -> R {
        match self.0.enter() {
            Some(index) => read(&index),
            None => read(&TieredIndex::new()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{OverlapScores, PrefixIndex, StoredBlock};
    use crate::types::{EngineHash, LocalHash};

    fn stored(hashes: &[u64]) -> IndexEvent {
        IndexEvent::Stored {
            parent: None,
            blocks: hashes
                .iter()
                .map(|&h| StoredBlock {
                    engine_hash: EngineHash(h),
                    local_hash: LocalHash(h),
                })
                .collect(),
        }
    }

    fn depth(reader: &IndexReader, hashes: &[u64]) -> Vec<(WorkerId, u32)> {
        let local: Vec<LocalHash> = hashes.iter().copied().map(LocalHash).collect();
        let mut scores = OverlapScores::default();
        reader.with(|index| index.device().overlaps(&local, &mut scores));
        let mut out: Vec<_> = scores.entries.iter().map(|e| (e.worker, e.depth)).collect();
        out.sort();
        out
    }

    #[test]
    fn readers_see_each_write_once_it_is_applied_and_the_same_as_a_plain_index() {
        let mut plain = PrefixIndex::new();
        plain.apply(WorkerId::new(1), &stored(&[1, 2]));
        let (mut writer, reader) = publish(TieredIndex::new());
        writer.apply(WorkerId::new(1), CacheTier::Device, &stored(&[1, 2]));
        assert_eq!(depth(&reader, &[1, 2, 3]), [(WorkerId::new(1), 2)]);
        let events = [
            (WorkerId::new(1), stored(&[1, 2, 3])),
            (WorkerId::new(2), stored(&[1])),
            (
                WorkerId::new(1),
                IndexEvent::Removed {
                    blocks: vec![EngineHash(3)],
                },
            ),
            (WorkerId::new(2), IndexEvent::Cleared),
            (WorkerId::new(3), stored(&[1, 2])),
        ];
        for (worker, event) in &events {
            writer.apply(*worker, CacheTier::Device, event);
            plain.apply(*worker, event);
            let mut expected = OverlapScores::default();
            plain.overlaps(&[LocalHash(1), LocalHash(2), LocalHash(3)], &mut expected);
            let mut expected: Vec<_> = expected
                .entries
                .iter()
                .map(|e| (e.worker, e.depth))
                .collect();
            expected.sort();
            assert_eq!(depth(&reader, &[1, 2, 3]), expected);
            assert_eq!(
                reader.with(|index| index.device().live_pairs()),
                plain.live_pairs()
            );
        }
        writer.remove_worker(WorkerId::new(1));
        assert_eq!(depth(&reader, &[1, 2, 3]), [(WorkerId::new(3), 2)]);
    }

    #[test]
    fn a_change_is_invisible_until_published() {
        let (mut writer, reader) = publish(TieredIndex::new());
        writer.0.append(IndexOp::Apply(
            WorkerId::new(1),
            CacheTier::Device,
            stored(&[7, 8]),
        ));
        assert_eq!(reader.with(|index| index.device().live_pairs()), 0);
        writer.0.publish();
        assert_eq!(reader.with(|index| index.device().live_pairs()), 2);
        // And the other copy catches up: the next publish shows both.
        writer.apply(WorkerId::new(2), CacheTier::Device, &stored(&[7]));
        assert_eq!(reader.with(|index| index.device().live_pairs()), 3);
    }

    #[test]
    fn with_the_writer_gone_readers_see_an_empty_index() {
        let (writer, reader) = publish(TieredIndex::new());
        drop(writer);
        assert_eq!(reader.with(|index| index.device().live_pairs()), 0);
    }
}
