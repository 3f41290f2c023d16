//! SSM checkpoints of a hybrid (SSM + attention) model.
//!
//! A hybrid model's attention layers keep per-token KV like any other
//! model, but its SSM (Mamba) layers keep one fixed-size state per
//! sequence that is overwritten token by token. A cached prefix is
//! therefore reusable only up to a position where the engine kept a copy
//! of the SSM state — a checkpoint — and only if the attention KV up to
//! there is cached too. Checkpoints sit at block boundaries (vLLM's
//! "align" mode for Mamba prefix caching does the same) and are large
//! (an SSM state, not a block), so an engine keeps a bounded number of
//! them and must choose which.
//!
//! Two policies choose, as Marconi (arXiv 2411.19379) compares them:
//!
//! - [`CheckpointPolicy::EveryBlock`], the naive one: a checkpoint at
//!   every block boundary a sequence computes, evicted least recently used
//!   first. Most of them are never reused, and a long prompt's own
//!   checkpoints push everyone else's out.
//! - [`CheckpointPolicy::Marconi`]: admit only states likely to be reused
//!   — the end of a prompt (the next turn of a conversation extends it)
//!   and branch points (where a new prompt leaves a prefix already cached,
//!   such as a shared system prompt) — and evict by a utility that adds
//!   recency to what a checkpoint saves (the model time to recompute its
//!   prefix, Marconi's FLOP efficiency: every state has the same size, so
//!   the saving per byte is the saving), each normalised over the cache.
//!
//! The cache is keyed by the chained hash of the prefix a checkpoint ends
//! (the block hash at its boundary), so a checkpoint stands for exactly one
//! prefix, whatever became of the attention blocks since.

use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use switchyard_core::SequenceHash;

/// Which SSM states a hybrid engine keeps.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckpointPolicy {
    /// Ends of prompts and branch points, evicted by recency plus the
    /// recompute time saved.
    #[default]
    Marconi,
    /// Every block boundary, evicted least recently used first.
    EveryBlock,
}

impl CheckpointPolicy {
    /// Stable name for reports (`marconi`, `every-block`).
    pub const fn as_str(self) -> &'static str {
        match self {
            CheckpointPolicy::Marconi => "marconi",
            CheckpointPolicy::EveryBlock => "every-block",
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    /// The position (tokens) the state stands for.
    tokens: usize,
    /// Model ms to recompute the prefix it ends.
    saves_ms: f64,
    /// Logical time of its last use (or insertion).
    used: u64,
}

/// What one insertion did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inserted {
    /// Whether the checkpoint is new (a state was copied).
    pub new: bool,
    /// Checkpoints evicted to make room.
    pub evicted: Vec<SequenceHash>,
}

/// A bounded set of SSM checkpoints (see the module docs).
#[derive(Clone, Debug)]
pub struct CheckpointCache {
    policy: CheckpointPolicy,
    capacity: usize,
    /// Marconi's weight of the saving against recency.
    flop_weight: f64,
    entries: FxHashMap<SequenceHash, Entry>,
    /// `used` → hash, oldest first (LRU order; `used` values are unique).
    by_use: BTreeMap<u64, SequenceHash>,
    clock: u64,
    evictions: u64,
}

impl CheckpointCache {
    /// An empty cache of at most `capacity` (≥ 1) checkpoints.
    pub fn new(policy: CheckpointPolicy, capacity: usize, flop_weight: f64) -> Self {
        Self {
            policy,
            capacity: capacity.max(1),
            flop_weight,
            entries: FxHashMap::default(),
            by_use: BTreeMap::new(),
            clock: 0,
            evictions: 0,
        }
    }

    /// The admission and eviction policy.
    pub fn policy(&self) -> CheckpointPolicy {
        self.policy
    }

    /// Checkpoints held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Checkpoints evicted so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Whether a checkpoint ends the prefix `hash` names.
    pub fn contains(&self, hash: SequenceHash) -> bool {
        self.entries.contains_key(&hash)
    }

    /// The deepest block count `n` (1-based, ≤ `hashes.len()`) with a
    /// checkpoint at the end of block `n`; 0 when there is none.
    pub fn deepest(&self, hashes: &[SequenceHash]) -> usize {
        hashes
            .iter()
            .rposition(|h| self.entries.contains_key(h))
            .map_or(0, |i| i + 1)
    }

    /// Marks the checkpoint at `hash` used now (a request resumed from it).
    pub fn touch(&mut self, hash: SequenceHash) {
        self.clock += 1;
        let now = self.clock;
        if let Some(entry) = self.entries.get_mut(&hash) {
            self.by_use.remove(&entry.used);
            entry.used = now;
            self.by_use.insert(now, hash);
        }
    }

    /// Keeps a checkpoint of the prefix `hash` ends, at `tokens`, which
    /// would take `saves_ms` to recompute; evicts by the policy when full.
    /// Keeping one already held only marks it used.
    pub fn insert(&mut self, hash: SequenceHash, tokens: usize, saves_ms: f64) -> Inserted {
        if self.entries.contains_key(&hash) {
            self.touch(hash);
            return Inserted::default();
        }
        let mut evicted = Vec::new();
        while self.entries.len() >= self.capacity {
            let Some(victim) = self.victim() else { break };
            self.remove(victim);
            self.evictions += 1;
            evicted.push(victim);
        }
        self.clock += 1;
        let used = self.clock;
        self.entries.insert(
            hash,
            Entry {
                tokens,
                saves_ms: saves_ms.max(0.0),
                used,
            },
        );
        self.by_use.insert(used, hash);
        Inserted { new: true, evicted }
    }

    /// Drops every checkpoint; returns the hashes dropped.
    pub fn clear(&mut self) -> Vec<SequenceHash> {
        self.by_use.clear();
        self.entries.drain().map(|(hash, _)| hash).collect()
    }

    /// The prefixes whose checkpoints are held, oldest use first.
    pub fn hashes(&self) -> impl Iterator<Item = SequenceHash> + '_ {
        self.by_use.values().copied()
    }

    /// The position the checkpoint at `hash` stands for.
    pub fn tokens(&self, hash: SequenceHash) -> Option<usize> {
        self.entries.get(&hash).map(|e| e.tokens)
    }

    fn remove(&mut self, hash: SequenceHash) {
        if let Some(entry) = self.entries.remove(&hash) {
            self.by_use.remove(&entry.used);
        }
    }

    /// The checkpoint to evict: the least recently used (every block), or
    /// the lowest recency-plus-saving utility (Marconi; ties to the older).
    fn victim(&self) -> Option<SequenceHash> {
        let (&oldest, &lru) = self.by_use.iter().next()?;
        if self.policy == CheckpointPolicy::EveryBlock {
            return Some(lru);
        }
        let newest = *self.by_use.keys().next_back()?;
        let span = (newest - oldest).max(1) as f64;
        let most = self
            .entries
            .values()
            .map(|e| e.saves_ms)
            .fold(0.0_f64, f64::max)
            .max(f64::MIN_POSITIVE);
        let utility =
            |e: &Entry| (e.used - oldest) as f64 / span + self.flop_weight * (e.saves_ms / most);
        self.by_use
            .values()
            .map(|h| (h, &self.entries[h]))
            .min_by(|a, b| utility(a.1).total_cmp(&utility(b.1)))
            .map(|(h, _)| *h)
    }

    /// Estimate of heap bytes.
    pub fn estimated_bytes(&self) -> usize {
        self.entries.capacity() * (std::mem::size_of::<(SequenceHash, Entry)>() + 1)
            + self.by_use.len() * (std::mem::size_of::<(u64, SequenceHash)>() + 16)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn h(n: u64) -> SequenceHash {
        SequenceHash(n)
    }

    #[test]
    fn the_deepest_checkpoint_within_a_prefix_is_found() {
        let mut cache = CheckpointCache::new(CheckpointPolicy::EveryBlock, 8, 1.0);
        cache.insert(h(2), 32, 1.0);
        cache.insert(h(4), 64, 2.0);
        let prefix = [h(1), h(2), h(3), h(4), h(5)];
        assert_eq!(cache.deepest(&prefix), 4);
        assert_eq!(cache.deepest(&prefix[..3]), 2);
        assert_eq!(cache.deepest(&prefix[..1]), 0);
        assert_eq!(cache.tokens(h(4)), Some(64));
    }

    #[test]
    fn every_block_evicts_the_least_recently_used() {
        let mut cache = CheckpointCache::new(CheckpointPolicy::EveryBlock, 2, 1.0);
        cache.insert(h(1), 16, 100.0);
        cache.insert(h(2), 32, 1.0);
        cache.touch(h(1));
        let inserted = cache.insert(h(3), 48, 1.0);
        assert_eq!(inserted.evicted, vec![h(2)]);
        assert!(cache.contains(h(1)) && cache.contains(h(3)));
        assert_eq!(cache.evictions(), 1);
    }

    #[test]
    fn marconi_keeps_a_long_prefixs_state_over_more_recent_short_ones() {
        let fill = |weight: f64| {
            let mut cache = CheckpointCache::new(CheckpointPolicy::Marconi, 3, weight);
            // A 4,000-token prompt's end, then two short ones'.
            cache.insert(h(1), 4_000, 400.0);
            cache.insert(h(2), 16, 1.0);
            cache.insert(h(3), 32, 2.0);
            cache.insert(h(4), 64, 4.0).evicted
        };
        assert_eq!(fill(1.0), vec![h(2)], "recency alone would evict h(1)");
        // With no weight on the saving it is recency alone.
        assert_eq!(fill(0.0), vec![h(1)]);
    }

    #[test]
    fn keeping_a_held_checkpoint_copies_nothing() {
        let mut cache = CheckpointCache::new(CheckpointPolicy::Marconi, 4, 1.0);
        assert!(cache.insert(h(1), 16, 1.0).new);
        assert_eq!(cache.insert(h(1), 16, 1.0), Inserted::default());
        assert_eq!(cache.len(), 1);
        assert_eq!(cache.clear(), vec![h(1)]);
        assert!(cache.is_empty());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(u64, u16),
        Touch(u64),
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            6 => (0..24u64, 1..2_000u16).prop_map(|(k, t)| Op::Insert(k, t)),
            3 => (0..24u64).prop_map(Op::Touch),
            1 => Just(Op::Clear),
        ]
    }

    proptest! {
        /// Against a naive model (a list in use order): never over
        /// capacity; the LRU policy evicts exactly the model's oldest; an
        /// eviction happens only when full; `deepest` agrees; the use
        /// order index matches the entries.
        #[test]
        fn the_cache_agrees_with_a_naive_model(
            ops in proptest::collection::vec(op(), 1..200),
            capacity in 1..6usize,
            marconi in any::<bool>(),
        ) {
            let policy = if marconi { CheckpointPolicy::Marconi } else { CheckpointPolicy::EveryBlock };
            let mut cache = CheckpointCache::new(policy, capacity, 1.0);
            // Hashes in use order, oldest first.
            let mut model: Vec<u64> = Vec::new();
            for op in ops {
                match op {
                    Op::Insert(k, t) => {
                        let held = model.contains(&k);
                        let inserted = cache.insert(h(k), usize::from(t), f64::from(t));
                        prop_assert_eq!(inserted.new, !held);
                        if held {
                            prop_assert!(inserted.evicted.is_empty());
                        } else if model.len() >= capacity {
                            prop_assert_eq!(inserted.evicted.len(), 1);
                            if !marconi {
                                prop_assert_eq!(inserted.evicted[0], h(model[0]));
                            }
                        } else {
                            prop_assert!(inserted.evicted.is_empty());
                        }
                        model.retain(|&m| m != k && !inserted.evicted.contains(&h(m)));
                        model.push(k);
                    }
                    Op::Touch(k) => {
                        cache.touch(h(k));
                        if model.contains(&k) {
                            model.retain(|&m| m != k);
                            model.push(k);
                        }
                    }
                    Op::Clear => {
                        let mut dropped: Vec<u64> = cache.clear().iter().map(|x| x.0).collect();
                        dropped.sort_unstable();
                        model.sort_unstable();
                        prop_assert_eq!(&dropped, &model);
                        model.clear();
                    }
                }
                prop_assert!(cache.len() <= capacity);
                prop_assert_eq!(cache.len(), model.len());
                prop_assert_eq!(cache.by_use.len(), cache.entries.len());
                let order: Vec<u64> = cache.by_use.values().map(|x| x.0).collect();
                prop_assert_eq!(&order, &model);
                let probe: Vec<SequenceHash> = (0..24).map(h).collect();
                let naive = (1..=probe.len()).rev().find(|&n| model.contains(&(n as u64 - 1))).unwrap_or(0);
                prop_assert_eq!(cache.deepest(&probe), naive);
            }
        }
    }
}
