//! The prefix index: which workers hold which prefix blocks.
//!
//! - [`PrefixIndex`] is exact: it follows the engines' own KV events
//!   (`Stored`, `Removed`, `Cleared`) per worker.
//! - [`ApproxIndex`] is for engines that publish no events: it records the
//!   router's own decisions as if the chosen worker had cached the prompt,
//!   with a TTL and a size cap.
//!
//! - [`TieredIndex`] pairs two exact indexes, one per cache tier (device
//!   and host): the router's view of the fleet when it follows KV events.
//! - [`published`] puts a tiered index behind a wait-free reader: the
//!   router reads one copy while the KV-event writer changes the other.
//!
//! Both answer [`PrefixIndex::overlaps`]: for a prompt's local block hashes,
//! each worker's matched prefix depth, in time proportional to the prompt.

mod approx;
mod block_map;
pub mod published;
mod tiered;
mod tree;

pub use approx::{ApproxConfig, ApproxConfigError, ApproxIndex};
pub use tiered::{CacheTier, TieredIndex};
pub use tree::{
    ApplyOutcome, IndexCounters, IndexEvent, IndexMemory, OverlapScores, PrefixIndex, StoredBlock,
    WorkerOverlap, DEFAULT_MAX_BLOCKS_PER_WORKER,
};

/// Tests: a `Stored` chain of `(engine hash, local hash)` pairs under
/// `parent` (`None`: the root).
#[cfg(test)]
pub(crate) fn stored_chain(parent: Option<u64>, pairs: &[(u64, u64)]) -> IndexEvent {
    IndexEvent::Stored {
        parent: parent.map(crate::types::EngineHash),
        blocks: pairs
            .iter()
            .map(|&(e, l)| StoredBlock {
                engine_hash: crate::types::EngineHash(e),
                local_hash: crate::types::LocalHash(l),
            })
            .collect(),
    }
}
