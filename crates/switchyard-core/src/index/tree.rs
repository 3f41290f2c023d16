//! The exact prefix index: a trie of local block hashes with per-worker holders.
//!
//! Layout, chosen for the `overlaps` walk:
//!
//! - Nodes live in one arena (`Vec<Node>`, 24 bytes each) addressed by `u32`.
//!   A chain stored in one event gets consecutive slots, so a walk down it
//!   reads memory in order. The arena grows by an eighth at a time, not by
//!   doubling, so at most an eighth of it is slack.
//! - A node's children are encoded in one `u32`: none, one child (the common
//!   case: most of a prompt is a chain), or an index into a side arena of
//!   hash maps for branch points. A single child in the very next slot, as a
//!   chain stored in one event gets, is its own code: a walk then computes
//!   the next address instead of loading it, so the CPU can fetch the chain's
//!   nodes ahead of the comparisons.
//! - Which workers hold a node is a bitset indexed by worker slot: the first
//!   64 slots inline in the node, further slots in a side array of
//!   `stride − 1` words per node that exists only once a 65th worker appears.
//! - Each worker keeps a map from the engine's block hash to the node it
//!   named, so `Removed` events find their blocks: a [`BlockMap`], an
//!   open-addressing table of 12-byte entries without tombstones (see its
//!   docs for why not hashbrown here).
//!
//! - What one worker may hold is capped ([`PrefixIndex::max_blocks_per_worker`],
//!   default [`DEFAULT_MAX_BLOCKS_PER_WORKER`] engine block names): past it,
//!   the worker's oldest names (in the order first stored) are dropped and
//!   counted ([`IndexCounters::evicted_over_cap`]), so a worker that
//!   publishes endless new hashes can neither exhaust memory nor claim every
//!   prefix. The order is a queue of names per worker; a name removed by the
//!   engine stays in the queue, counted in a small map, until it reaches the
//!   front or the queue is compacted (when it is twice the live names).
//!
//! Invariants, checked by the property tests in this module:
//!
//! - A node is in the arena iff it is the root, or some worker holds it, or it
//!   has a child. Nodes no worker holds are reclaimed at once, so memory tracks
//!   live (block, worker) pairs, not history.
//! - `live_pairs()` equals the number of (worker, node) pairs with the
//!   worker's bit set; it returns to zero when everything is removed.

use super::block_map::BlockMap;
use crate::maps::{map_bytes, FxHashMap};
use crate::types::{EngineHash, LocalHash, WorkerId};
use std::collections::VecDeque;

/// Most engine block names one worker may hold in one index (1 Mi: 16 Mi
/// tokens at 16-token blocks); past it the worker's oldest are dropped.
pub const DEFAULT_MAX_BLOCKS_PER_WORKER: usize = 1 << 20;

/// A worker's queue of names is compacted once it holds this many more
/// entries than twice its live names.
const ORDER_SLACK: usize = 1024;

const ROOT: u32 = 0;
const NO_CHILD: u32 = u32::MAX;
/// The single child is the node in the next arena slot.
const NEXT_CHILD: u32 = u32::MAX - 1;
const MANY_FLAG: u32 = 1 << 31;
/// Largest arena index a single-child link can address.
const MAX_NODES: usize = (MANY_FLAG - 1) as usize;

/// One block an engine reports stored: its engine-side id and the router's own
/// local hash of its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StoredBlock {
    /// The engine's opaque block id.
    pub engine_hash: EngineHash,
    /// The router's hash of the block's token ids.
    pub local_hash: LocalHash,
}

/// A KV-cache event for one worker, already normalized to router hashes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IndexEvent {
    /// Blocks stored as a chain under `parent` (`None`: from the root).
    Stored {
        /// The engine hash of the block the first one follows.
        parent: Option<EngineHash>,
        /// The chain, in prompt order.
        blocks: Vec<StoredBlock>,
    },
    /// Blocks evicted, by engine hash.
    Removed {
        /// Engine hashes of the evicted blocks.
        blocks: Vec<EngineHash>,
    },
    /// The worker dropped its whole cache.
    Cleared,
}

/// What applying one event did. Every variant is an outcome, not a fault:
/// malformed or stale input is counted and skipped, never applied halfway.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ApplyOutcome {
    /// Applied; `changed` (worker, block) pairs were added or removed.
    Applied {
        /// Pairs that appeared or disappeared.
        changed: usize,
        /// Engine hashes the event named that the worker was not known to
        /// hold (a `Removed` for an evicted-twice block, say); skipped.
        unknown: usize,
    },
    /// A `Stored` whose parent the worker does not hold: dropped whole.
    UnknownParent,
    /// A `Removed` or `Cleared` for a worker the index has never seen.
    UnknownWorker,
    /// The arena is at its addressable limit; the event was dropped.
    Full,
}

/// Counters for metrics; they only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexCounters {
    /// `Stored` events applied.
    pub stored_events: u64,
    /// `Removed` events applied.
    pub removed_events: u64,
    /// `Cleared` events applied (worker removals included).
    pub cleared_events: u64,
    /// `Stored` events dropped because their parent was unknown.
    pub unknown_parent: u64,
    /// Engine hashes in `Removed` events that the worker did not hold.
    pub unknown_removed_blocks: u64,
    /// Events for workers the index does not know.
    pub unknown_worker: u64,
    /// Events dropped because the arena was full.
    pub dropped_full: u64,
    /// Blocks dropped because their worker was past its cap (its oldest).
    pub evicted_over_cap: u64,
}

/// Heap bytes of a [`PrefixIndex`] by structure.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct IndexMemory {
    /// The node arena (24 bytes a node) and wide holder words.
    pub nodes: usize,
    /// Free lists of nodes and child maps.
    pub free_lists: usize,
    /// Child maps of branch nodes.
    pub child_maps: usize,
    /// Per-worker engine-hash maps and worker slots.
    pub engine_maps: usize,
}

impl IndexMemory {
    /// All of it.
    pub fn total(&self) -> usize {
        self.nodes + self.free_lists + self.child_maps + self.engine_maps
    }
}

/// One worker's match for a query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WorkerOverlap {
    /// The worker.
    pub worker: WorkerId,
    /// Leading query blocks the worker holds.
    pub depth: u32,
    /// Blocks the worker holds in all (a tie-break: fewer is emptier).
    pub cached_blocks: usize,
}

/// Answer of [`PrefixIndex::overlaps`]: one entry per worker with a nonzero
/// match, in no particular order. Reuse one value across queries to avoid
/// allocating.
#[derive(Clone, Debug, Default)]
pub struct OverlapScores {
    /// Workers with at least one matched block.
    pub entries: Vec<WorkerOverlap>,
    scratch: Vec<u64>,
}

impl OverlapScores {
    /// An empty answer.
    pub fn new() -> Self {
        Self::default()
    }

    /// The matched depth of `worker` (0 when it matched nothing).
    pub fn depth(&self, worker: WorkerId) -> u32 {
        self.entries
            .iter()
            .find(|e| e.worker == worker)
            .map_or(0, |e| e.depth)
    }

    /// The deepest match of any worker.
    pub fn max_depth(&self) -> u32 {
        self.entries.iter().map(|e| e.depth).max().unwrap_or(0)
    }
}

#[derive(Clone, Copy, Debug)]
struct Node {
    local: u64,
    /// Holder bits of worker slots 0..64.
    holders: u64,
    parent: u32,
    /// `NO_CHILD`, `NEXT_CHILD` (the single child is this node's index + 1),
    /// a single child's index, or `MANY_FLAG | child map index`.
    children: u32,
}

impl WorkerSlot {
    /// Drops the names the engine removed from the order queue.
    fn compact_order(&mut self) {
        let gone = &mut self.gone;
        self.order.retain(|name| match gone.get_mut(name) {
            Some(stale) if *stale > 0 => {
                *stale -= 1;
                false
            }
            _ => true,
        });
        gone.clear();
    }
}

#[derive(Debug, Clone)]
struct WorkerSlot {
    id: WorkerId,
    /// Engine hash → node it names.
    blocks: BlockMap,
    /// Nodes named by more than one engine hash of this worker, with the
    /// number of extra names. Rare (e.g. multimodal prompts whose placeholder
    /// tokens match but whose engine hashes differ).
    aliases: FxHashMap<u32, u32>,
    /// Distinct nodes this worker holds.
    held: usize,
    /// Names in the order first stored, oldest first, for the cap. Names
    /// the engine removed since stay until popped or compacted: `gone`
    /// counts them per name (they always precede the name's live entry).
    order: VecDeque<u64>,
    gone: FxHashMap<u64, u32>,
}

/// The exact prefix index. See the module docs for layout and invariants.
#[derive(Debug, Clone)]
pub struct PrefixIndex {
    nodes: Vec<Node>,
    free_nodes: Vec<u32>,
    /// Holder words beyond the first, `stride − 1` per node.
    wide_holders: Vec<u64>,
    stride: usize,
    child_maps: Vec<FxHashMap<u64, u32>>,
    free_child_maps: Vec<u32>,
    worker_slots: FxHashMap<WorkerId, u32>,
    slots: Vec<Option<WorkerSlot>>,
    live_nodes: usize,
    live_pairs: usize,
    counters: IndexCounters,
    max_blocks_per_worker: usize,
}

impl Default for PrefixIndex {
    fn default() -> Self {
        Self::new()
    }
}

impl PrefixIndex {
    /// An empty index, each worker capped at
    /// [`DEFAULT_MAX_BLOCKS_PER_WORKER`] blocks.
    pub fn new() -> Self {
        Self::with_max_blocks_per_worker(DEFAULT_MAX_BLOCKS_PER_WORKER)
    }

    /// An empty index in which a worker holds at most `cap` block names
    /// (at least 1); past it, its oldest are dropped.
    pub fn with_max_blocks_per_worker(cap: usize) -> Self {
        Self {
            nodes: vec![Node {
                local: 0,
                holders: 0,
                parent: ROOT,
                children: NO_CHILD,
            }],
            free_nodes: Vec::new(),
            wide_holders: Vec::new(),
            stride: 1,
            child_maps: Vec::new(),
            free_child_maps: Vec::new(),
            worker_slots: FxHashMap::default(),
            slots: Vec::new(),
            live_nodes: 0,
            live_pairs: 0,
            counters: IndexCounters::default(),
            max_blocks_per_worker: cap.max(1),
        }
    }

    /// Most block names one worker may hold here.
    pub fn max_blocks_per_worker(&self) -> usize {
        self.max_blocks_per_worker
    }

    /// Applies one event for `worker`.
    pub fn apply(&mut self, worker: WorkerId, event: &IndexEvent) -> ApplyOutcome {
        match event {
            IndexEvent::Stored { parent, blocks } => self.store(worker, *parent, blocks),
            IndexEvent::Removed { blocks } => self.remove(worker, blocks),
            IndexEvent::Cleared => self.clear(worker),
        }
    }

    /// Stores a chain of blocks for `worker` under `parent` (`None`: the
    /// root). Re-storing blocks the worker already holds changes nothing. A
    /// parent the worker does not hold drops the event whole.
    pub fn store(
        &mut self,
        worker: WorkerId,
        parent: Option<EngineHash>,
        blocks: &[StoredBlock],
    ) -> ApplyOutcome {
        let slot = match parent {
            None => self.slot_or_insert(worker),
            Some(_) => match self.worker_slots.get(&worker) {
                Some(&slot) => slot,
                None => {
                    self.counters.unknown_parent += 1;
                    return ApplyOutcome::UnknownParent;
                }
            },
        };
        let cur = match parent {
            None => ROOT,
            Some(p) => match self.slot(slot).blocks.get(p.0) {
                Some(node) => node,
                None => {
                    self.counters.unknown_parent += 1;
                    return ApplyOutcome::UnknownParent;
                }
            },
        };
        if self.live_nodes + blocks.len() >= MAX_NODES {
            self.counters.dropped_full += 1;
            return ApplyOutcome::Full;
        }
        self.hang_chain(slot, cur, blocks)
    }

    /// Hangs `blocks` below node `cur` for the worker in `slot`, each the
    /// child of the one before (room already checked).
    fn hang_chain(&mut self, slot: u32, mut cur: u32, blocks: &[StoredBlock]) -> ApplyOutcome {
        let mut changed = 0;
        for block in blocks {
            let child = self.child_or_insert(cur, block.local_hash.0);
            changed += self.hold(slot, block.engine_hash.0, child);
            cur = child;
        }
        self.evict_over_cap(slot);
        self.counters.stored_events += 1;
        ApplyOutcome::Applied {
            changed,
            unknown: 0,
        }
    }

    /// Stores a chain of blocks for `worker` under the prefix `path` (local
    /// hashes from the root, the parent's last), whether or not the worker
    /// holds any block of it: for a tier whose blocks arrive without their
    /// parent, placed where another tier's index says the parent lives
    /// ([`Self::path_of`]). Nodes of `path` no one holds are kept as
    /// structure while the chain hangs below them. An empty chain changes
    /// nothing.
    pub fn store_under_path(
        &mut self,
        worker: WorkerId,
        path: &[LocalHash],
        blocks: &[StoredBlock],
    ) -> ApplyOutcome {
        if blocks.is_empty() {
            return ApplyOutcome::Applied {
                changed: 0,
                unknown: 0,
            };
        }
        if self.live_nodes + path.len() + blocks.len() >= MAX_NODES {
            self.counters.dropped_full += 1;
            return ApplyOutcome::Full;
        }
        let slot = self.slot_or_insert(worker);
        let mut cur = ROOT;
        for local in path {
            cur = self.child_or_insert(cur, local.0);
        }
        self.hang_chain(slot, cur, blocks)
    }

    /// The prefix of the block `worker` calls `engine_hash`: local hashes
    /// from the root down to that block, written into `out` (cleared
    /// first). `false`, with `out` empty, when the worker holds no such
    /// block.
    pub fn path_of(
        &self,
        worker: WorkerId,
        engine_hash: EngineHash,
        out: &mut Vec<LocalHash>,
    ) -> bool {
        out.clear();
        let Some(mut node) = self
            .worker_slots
            .get(&worker)
            .and_then(|&slot| self.slot(slot).blocks.get(engine_hash.0))
        else {
            return false;
        };
        while node != ROOT {
            let n = self.nodes[node as usize];
            out.push(LocalHash(n.local));
            node = n.parent;
        }
        out.reverse();
        true
    }

    /// Each worker's run of held blocks along a prompt starting at the
    /// block `start(worker)` (0-based): how many consecutive prompt blocks
    /// from there the worker holds, whether or not it holds the blocks
    /// before. Written into `out` (cleared first), one entry per worker
    /// with a nonzero run, `depth` being the run's length. One walk down
    /// the prompt's path plus, per worker of this index, its run: cost is
    /// proportional to the path's depth plus the workers here plus the
    /// runs, never to what else is cached.
    pub fn runs_from(
        &self,
        hashes: &[LocalHash],
        start: impl Fn(WorkerId) -> u32,
        out: &mut OverlapScores,
    ) {
        out.entries.clear();
        let mut path = std::mem::take(&mut out.scratch);
        self.query_path(hashes, &mut path);
        if !path.is_empty() {
            for (slot, worker) in self.slots.iter().enumerate() {
                let Some(worker) = worker else { continue };
                let from = start(worker.id) as usize;
                let run = path
                    .get(from..)
                    .unwrap_or_default()
                    .iter()
                    .take_while(|&&node| self.bit(node as u32, slot as u32))
                    .count();
                if run > 0 {
                    out.entries.push(WorkerOverlap {
                        worker: worker.id,
                        depth: run as u32,
                        cached_blocks: worker.held,
                    });
                }
            }
        }
        out.scratch = path;
    }

    /// Each worker's deepest held block along a prompt within its first
    /// `limit(worker)` blocks, whether or not it holds the blocks before:
    /// for a sparse tier (SSM checkpoints of a hybrid model sit at a few
    /// block boundaries, under another tier's path). Written into `out`
    /// (cleared first), one entry per worker of this index with a held
    /// block there, `depth` being that block's 1-based position. Cost is
    /// the path's depth plus, per worker here, its limit.
    pub fn deepest_within(
        &self,
        hashes: &[LocalHash],
        limit: impl Fn(WorkerId) -> u32,
        out: &mut OverlapScores,
    ) {
        out.entries.clear();
        let mut path = std::mem::take(&mut out.scratch);
        self.query_path(hashes, &mut path);
        if !path.is_empty() {
            for (slot, worker) in self.slots.iter().enumerate() {
                let Some(worker) = worker else { continue };
                let within = (limit(worker.id) as usize).min(path.len());
                let deepest = path[..within]
                    .iter()
                    .rposition(|&node| self.bit(node as u32, slot as u32));
                if let Some(at) = deepest {
                    out.entries.push(WorkerOverlap {
                        worker: worker.id,
                        depth: at as u32 + 1,
                        cached_blocks: worker.held,
                    });
                }
            }
        }
        out.scratch = path;
    }

    /// The nodes along a prompt's path from the root, as far as the trie
    /// has it, written into `path` (cleared first).
    fn query_path(&self, hashes: &[LocalHash], path: &mut Vec<u64>) {
        path.clear();
        let mut cur = ROOT;
        for hash in hashes {
            let Some(child) = self.child(cur, hash.0) else {
                break;
            };
            path.push(u64::from(child));
            cur = child;
        }
    }

    /// Removes blocks of `worker` by engine hash. Hashes the worker does not
    /// hold are counted and skipped.
    pub fn remove(&mut self, worker: WorkerId, blocks: &[EngineHash]) -> ApplyOutcome {
        let Some(&slot) = self.worker_slots.get(&worker) else {
            self.counters.unknown_worker += 1;
            return ApplyOutcome::UnknownWorker;
        };
        let (mut changed, mut unknown) = (0, 0);
        for engine_hash in blocks {
            let worker = self.slot_mut(slot);
            match worker.blocks.remove(engine_hash.0) {
                Some(node) => {
                    *worker.gone.entry(engine_hash.0).or_insert(0) += 1;
                    changed += self.release(slot, node);
                }
                None => unknown += 1,
            }
        }
        self.counters.removed_events += 1;
        self.counters.unknown_removed_blocks += unknown as u64;
        ApplyOutcome::Applied { changed, unknown }
    }

    /// Drops every block of `worker`; the worker stays known.
    pub fn clear(&mut self, worker: WorkerId) -> ApplyOutcome {
        let Some(&slot) = self.worker_slots.get(&worker) else {
            self.counters.unknown_worker += 1;
            return ApplyOutcome::UnknownWorker;
        };
        let changed = self.clear_slot(slot);
        self.counters.cleared_events += 1;
        ApplyOutcome::Applied {
            changed,
            unknown: 0,
        }
    }

    /// Forgets `worker` entirely. Returns whether it was known.
    pub fn remove_worker(&mut self, worker: WorkerId) -> bool {
        let Some(slot) = self.worker_slots.remove(&worker) else {
            return false;
        };
        self.clear_slot(slot);
        self.counters.cleared_events += 1;
        self.slots[slot as usize] = None;
        true
    }

    /// Each worker's matched prefix depth for a prompt's local block hashes,
    /// written into `out` (cleared first). Cost is proportional to the matched
    /// depth plus the number of matching workers, independent of the fleet's
    /// size and of how many blocks are cached.
    pub fn overlaps(&self, hashes: &[LocalHash], out: &mut OverlapScores) {
        out.entries.clear();
        if self.stride == 1 {
            self.overlaps_narrow(hashes, out);
        } else {
            self.overlaps_wide(hashes, out);
        }
    }

    /// Convenience form of [`Self::overlaps`] that allocates its answer.
    pub fn find_overlaps(&self, hashes: &[LocalHash]) -> OverlapScores {
        let mut out = OverlapScores::new();
        self.overlaps(hashes, &mut out);
        out
    }

    fn overlaps_narrow(&self, hashes: &[LocalHash], out: &mut OverlapScores) {
        let mut cur = ROOT;
        let mut active = u64::MAX;
        let mut depth = 0u32;
        for hash in hashes {
            let Some(child) = self.child(cur, hash.0) else {
                break;
            };
            let held = self.nodes[child as usize].holders;
            let dropped = active & !held;
            if dropped != 0 && depth > 0 {
                self.push_bits(dropped, 0, depth, out);
            }
            active &= held;
            if active == 0 {
                return;
            }
            depth += 1;
            cur = child;
        }
        if depth > 0 {
            self.push_bits(active, 0, depth, out);
        }
    }

    fn overlaps_wide(&self, hashes: &[LocalHash], out: &mut OverlapScores) {
        let stride = self.stride;
        let mut active = std::mem::take(&mut out.scratch);
        active.clear();
        active.resize(stride, u64::MAX);
        let mut cur = ROOT;
        let mut depth = 0u32;
        for hash in hashes {
            let Some(child) = self.child(cur, hash.0) else {
                break;
            };
            let extra = &self.wide_holders[child as usize * (stride - 1)..][..stride - 1];
            let first = self.nodes[child as usize].holders;
            let mut any = 0;
            let held = std::iter::once(first).chain(extra.iter().copied());
            for (word, (a, h)) in active.iter_mut().zip(held).enumerate() {
                let dropped = *a & !h;
                if dropped != 0 && depth > 0 {
                    self.push_bits(dropped, word, depth, out);
                }
                *a &= h;
                any |= *a;
            }
            if any == 0 {
                depth = 0;
                break;
            }
            depth += 1;
            cur = child;
        }
        if depth > 0 {
            for (word, &a) in active.iter().enumerate() {
                self.push_bits(a, word, depth, out);
            }
        }
        out.scratch = active;
    }

    fn push_bits(&self, mut bits: u64, word: usize, depth: u32, out: &mut OverlapScores) {
        while bits != 0 {
            let slot = word * 64 + bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if let Some(Some(s)) = self.slots.get(slot) {
                out.entries.push(WorkerOverlap {
                    worker: s.id,
                    depth,
                    cached_blocks: s.held,
                });
            }
        }
    }

    /// Blocks `worker` holds (0 for an unknown worker).
    pub fn worker_blocks(&self, worker: WorkerId) -> usize {
        self.worker_slots
            .get(&worker)
            .map_or(0, |&slot| self.slot(slot).held)
    }

    /// Whether the index knows `worker` (it stored something and was not
    /// removed since).
    pub fn knows(&self, worker: WorkerId) -> bool {
        self.worker_slots.contains_key(&worker)
    }

    /// Workers the index knows, in slot order.
    pub fn workers(&self) -> impl Iterator<Item = WorkerId> + '_ {
        self.slots.iter().flatten().map(|s| s.id)
    }

    /// Whether `worker` holds the block the engine calls `engine_hash`.
    pub fn holds(&self, worker: WorkerId, engine_hash: EngineHash) -> bool {
        self.worker_slots
            .get(&worker)
            .is_some_and(|&slot| self.slot(slot).blocks.contains(engine_hash.0))
    }

    /// Live (block, worker) pairs.
    pub fn live_pairs(&self) -> usize {
        self.live_pairs
    }

    /// Live trie nodes, the root excluded.
    pub fn live_nodes(&self) -> usize {
        self.live_nodes
    }

    /// Event counters for metrics.
    pub fn counters(&self) -> IndexCounters {
        self.counters
    }

    /// Estimate of heap bytes in use, from allocated capacities.
    pub fn estimated_bytes(&self) -> usize {
        self.memory().total()
    }

    /// Heap bytes by structure, from allocated capacities.
    pub fn memory(&self) -> IndexMemory {
        IndexMemory {
            nodes: self.nodes.capacity() * std::mem::size_of::<Node>()
                + self.wide_holders.capacity() * 8,
            free_lists: self.free_nodes.capacity() * 4 + self.free_child_maps.capacity() * 4,
            child_maps: self.child_maps.capacity() * std::mem::size_of::<FxHashMap<u64, u32>>()
                + self.child_maps.iter().map(map_bytes).sum::<usize>(),
            engine_maps: self
                .slots
                .iter()
                .flatten()
                .map(|s| {
                    s.blocks.bytes()
                        + map_bytes(&s.aliases)
                        + s.order.capacity() * 8
                        + map_bytes(&s.gone)
                })
                .sum::<usize>()
                + map_bytes(&self.worker_slots)
                + self.slots.capacity() * std::mem::size_of::<Option<WorkerSlot>>(),
        }
    }

    // --- internals ---------------------------------------------------------

    fn slot(&self, slot: u32) -> &WorkerSlot {
        self.slots[slot as usize]
            .as_ref()
            .expect("worker_slots only maps to occupied slots")
    }

    fn slot_mut(&mut self, slot: u32) -> &mut WorkerSlot {
        self.slots[slot as usize]
            .as_mut()
            .expect("worker_slots only maps to occupied slots")
    }

    fn slot_or_insert(&mut self, worker: WorkerId) -> u32 {
        if let Some(&slot) = self.worker_slots.get(&worker) {
            return slot;
        }
        // Lowest free slot first keeps the holder bitsets narrow.
        let slot = match self.slots.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        self.slots[slot] = Some(WorkerSlot {
            id: worker,
            blocks: BlockMap::default(),
            aliases: FxHashMap::default(),
            held: 0,
            order: VecDeque::new(),
            gone: FxHashMap::default(),
        });
        if slot >= self.stride * 64 {
            self.widen(slot / 64 + 1);
        }
        let slot = slot as u32;
        self.worker_slots.insert(worker, slot);
        slot
    }

    fn widen(&mut self, stride: usize) {
        let (old, new) = (self.stride - 1, stride - 1);
        let mut wide = vec![0u64; self.nodes.len() * new];
        if old > 0 {
            for (node, words) in self.wide_holders.chunks_exact(old).enumerate() {
                wide[node * new..][..old].copy_from_slice(words);
            }
        }
        self.wide_holders = wide;
        self.stride = stride;
    }

    /// The child of `node` whose local hash is `local`.
    ///
    /// The `NEXT_CHILD` case is a branch, not a select, on purpose: the next
    /// node's address then follows from `node` alone, and a walk down a chain
    /// does not wait for each node's link to arrive before fetching the next.
    #[inline(always)]
    fn child(&self, node: u32, local: u64) -> Option<u32> {
        let children = self.nodes[node as usize].children;
        let single = if children == NEXT_CHILD {
            node + 1
        } else if children & MANY_FLAG == 0 {
            children
        } else if children == NO_CHILD {
            return None;
        } else {
            return self.branch_child(children, local);
        };
        (self.nodes[single as usize].local == local).then_some(single)
    }

    fn branch_child(&self, children: u32, local: u64) -> Option<u32> {
        self.child_maps[(children & !MANY_FLAG) as usize]
            .get(&local)
            .copied()
    }

    /// The single child `children` encodes for `node`, if it encodes one.
    #[inline]
    fn single_child(node: u32, children: u32) -> Option<u32> {
        if children == NEXT_CHILD {
            Some(node + 1)
        } else if children & MANY_FLAG == 0 {
            Some(children)
        } else {
            None
        }
    }

    /// The code for `parent`'s only child being `child`.
    #[inline]
    fn single_link(parent: u32, child: u32) -> u32 {
        if child == parent + 1 {
            NEXT_CHILD
        } else {
            child
        }
    }

    fn child_or_insert(&mut self, parent: u32, local: u64) -> u32 {
        if let Some(child) = self.child(parent, local) {
            return child;
        }
        let node = Node {
            local,
            holders: 0,
            parent,
            children: NO_CHILD,
        };
        let child = match self.free_nodes.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                if self.nodes.len() == self.nodes.capacity() {
                    self.nodes.reserve_exact(self.nodes.len() / 8 + 64);
                }
                self.nodes.push(node);
                if self.stride > 1 {
                    self.wide_holders
                        .resize(self.nodes.len() * (self.stride - 1), 0);
                }
                (self.nodes.len() - 1) as u32
            }
        };
        self.live_nodes += 1;
        let children = self.nodes[parent as usize].children;
        self.nodes[parent as usize].children = if children == NO_CHILD {
            Self::single_link(parent, child)
        } else if let Some(sibling) = Self::single_child(parent, children) {
            let map = self.new_child_map();
            debug_assert!(
                map | MANY_FLAG < NEXT_CHILD,
                "fewer branch nodes than nodes"
            );
            let m = &mut self.child_maps[map as usize];
            m.insert(self.nodes[sibling as usize].local, sibling);
            m.insert(local, child);
            map | MANY_FLAG
        } else {
            self.child_maps[(children & !MANY_FLAG) as usize].insert(local, child);
            children
        };
        child
    }

    fn new_child_map(&mut self) -> u32 {
        match self.free_child_maps.pop() {
            Some(i) => i,
            None => {
                self.child_maps.push(FxHashMap::default());
                (self.child_maps.len() - 1) as u32
            }
        }
    }

    fn word_mut(&mut self, node: u32, slot: u32) -> &mut u64 {
        match slot as usize / 64 {
            0 => &mut self.nodes[node as usize].holders,
            w => &mut self.wide_holders[node as usize * (self.stride - 1) + w - 1],
        }
    }

    fn bit(&self, node: u32, slot: u32) -> bool {
        let word = match slot as usize / 64 {
            0 => self.nodes[node as usize].holders,
            w => self.wide_holders[node as usize * (self.stride - 1) + w - 1],
        };
        word & (1 << (slot % 64)) != 0
    }

    fn set_bit(&mut self, node: u32, slot: u32, on: bool) {
        let word = self.word_mut(node, slot);
        if on {
            *word |= 1 << (slot % 64);
        } else {
            *word &= !(1 << (slot % 64));
        }
    }

    /// Makes `slot` hold `node` under the name `engine_hash`; returns the
    /// number of pairs added (0 or 1).
    fn hold(&mut self, slot: u32, engine_hash: u64, node: u32) -> usize {
        let worker = self.slot_mut(slot);
        let previous = match worker.blocks.insert(engine_hash, node) {
            Some(old) if old == node => return 0,
            None => {
                worker.order.push_back(engine_hash);
                if worker.order.len() > 2 * worker.blocks.len() + ORDER_SLACK {
                    worker.compact_order();
                }
                None
            }
            previous => previous,
        };
        let mut added = 0;
        if self.bit(node, slot) {
            *self.slot_mut(slot).aliases.entry(node).or_insert(0) += 1;
        } else {
            self.set_bit(node, slot, true);
            self.slot_mut(slot).held += 1;
            self.live_pairs += 1;
            added = 1;
        }
        // The engine reused a name for other content: drop the old meaning.
        // `node` now has a holder, so releasing cannot reclaim it.
        if let Some(old) = previous {
            self.release(slot, old);
        }
        added
    }

    /// Drops one name of `node` held by `slot` (already removed from the
    /// worker's map); returns pairs removed (0 or 1).
    fn release(&mut self, slot: u32, node: u32) -> usize {
        let worker = self.slot_mut(slot);
        if worker.aliases.is_empty() {
            // The common case: no block of this worker has two names.
        } else if let Some(extra) = worker.aliases.get_mut(&node) {
            *extra -= 1;
            if *extra == 0 {
                worker.aliases.remove(&node);
            }
            return 0;
        }
        worker.held -= 1;
        self.set_bit(node, slot, false);
        self.live_pairs -= 1;
        self.reclaim_upward(node);
        1
    }

    /// Drops the worker's oldest names while it holds more than the cap.
    fn evict_over_cap(&mut self, slot: u32) {
        let cap = self.max_blocks_per_worker;
        while self.slot(slot).blocks.len() > cap {
            let worker = self.slot_mut(slot);
            let Some(name) = worker.order.pop_front() else {
                break;
            };
            if let Some(stale) = worker.gone.get_mut(&name) {
                *stale -= 1;
                if *stale == 0 {
                    worker.gone.remove(&name);
                }
                continue;
            }
            if let Some(node) = worker.blocks.remove(name) {
                self.release(slot, node);
                self.counters.evicted_over_cap += 1;
            }
        }
    }

    fn clear_slot(&mut self, slot: u32) -> usize {
        let worker = self.slot_mut(slot);
        let blocks = worker.blocks.take();
        worker.aliases.clear();
        worker.order = VecDeque::new();
        worker.gone = FxHashMap::default();
        let mut changed = 0;
        for node in blocks.nodes() {
            if self.bit(node, slot) {
                self.set_bit(node, slot, false);
                self.live_pairs -= 1;
                changed += 1;
                self.reclaim_upward(node);
            }
        }
        self.slot_mut(slot).held = 0;
        changed
    }

    fn unheld(&self, node: u32) -> bool {
        self.nodes[node as usize].holders == 0
            && (self.stride == 1
                || self.wide_holders[node as usize * (self.stride - 1)..][..self.stride - 1]
                    .iter()
                    .all(|&w| w == 0))
    }

    /// Frees `node` and then its ancestors while each is held by no worker
    /// and has no child.
    fn reclaim_upward(&mut self, mut node: u32) {
        while node != ROOT && self.nodes[node as usize].children == NO_CHILD && self.unheld(node) {
            let Node { local, parent, .. } = self.nodes[node as usize];
            self.unlink_child(parent, local, node);
            self.free_nodes.push(node);
            self.live_nodes -= 1;
            node = parent;
        }
    }

    fn unlink_child(&mut self, parent: u32, local: u64, child: u32) {
        let children = self.nodes[parent as usize].children;
        if let Some(only) = Self::single_child(parent, children) {
            debug_assert_eq!(only, child);
            self.nodes[parent as usize].children = NO_CHILD;
            return;
        }
        let map_index = children & !MANY_FLAG;
        let map = &mut self.child_maps[map_index as usize];
        map.remove(&local);
        if map.len() == 1 {
            let (_, &only) = map.iter().next().expect("len is 1");
            self.nodes[parent as usize].children = Self::single_link(parent, only);
        } else {
            return;
        }
        // Demoted to a single link: recycle the map, releasing big ones.
        let map = &mut self.child_maps[map_index as usize];
        if map.capacity() > 64 {
            *map = FxHashMap::default();
        } else {
            map.clear();
        }
        self.free_child_maps.push(map_index);
    }

    #[cfg(test)]
    fn check_invariants(&self) {
        let mut pairs = 0;
        let mut live = 0;
        let free: std::collections::HashSet<u32> = self.free_nodes.iter().copied().collect();
        for i in 1..self.nodes.len() as u32 {
            if free.contains(&i) {
                continue;
            }
            live += 1;
            let node = self.nodes[i as usize];
            assert!(
                !self.unheld(i) || node.children != NO_CHILD,
                "node {i} is neither held nor a parent"
            );
            assert_eq!(self.child(node.parent, node.local), Some(i));
            for s in 0..self.slots.len() as u32 {
                if self.bit(i, s) {
                    assert!(self.slots[s as usize].is_some());
                    pairs += 1;
                }
            }
        }
        assert_eq!(live, self.live_nodes);
        assert_eq!(pairs, self.live_pairs);
        let held: usize = self.slots.iter().flatten().map(|s| s.held).sum();
        assert_eq!(held, self.live_pairs);
        for worker in self.slots.iter().flatten() {
            let stale: usize = worker.gone.values().map(|&n| n as usize).sum();
            assert_eq!(worker.order.len(), worker.blocks.len() + stale);
            assert!(worker.blocks.len() <= self.max_blocks_per_worker);
        }
    }
}

#[cfg(test)]
#[path = "tree_tests.rs"]
mod tests;
