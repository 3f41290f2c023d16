//! Cache-hit references a policy's hit rate is read against.
//!
//! - **Infinite-cache bound**: every block ever seen stays cached; a prompt
//!   hits its leading blocks seen before. No fleet can beat it.
//! - **Pooled LRU**: one LRU cache with the whole fleet's capacity, perfectly
//!   shared, serving the trace in arrival order. A partitioned fleet rarely
//!   beats it: it is the honest yardstick at a given capacity.
//!
//! Both work on chained block hashes (a block's hash names its whole prefix),
//! so "leading blocks present" is well defined.

use rustc_hash::{FxHashMap, FxHashSet};
use std::cmp::Reverse;
use std::collections::BTreeSet;
use switchyard_core::SequenceHash;

/// An LRU set of blocks that evicts least recently used first and, among
/// blocks touched by the same request, deeper blocks first (tails before
/// their prefixes, as engines do).
#[derive(Debug, Default)]
pub struct BlockLru {
    stamp: FxHashMap<u64, (u64, u32)>,
    order: BTreeSet<(u64, Reverse<u32>, u64)>,
}

impl BlockLru {
    /// Marks `hash` (at prompt position `depth`) used at `tick`.
    pub fn touch(&mut self, hash: u64, tick: u64, depth: u32) {
        if let Some(old) = self.stamp.insert(hash, (tick, depth)) {
            self.order.remove(&(old.0, Reverse(old.1), hash));
        }
        self.order.insert((tick, Reverse(depth), hash));
    }

    /// Whether `hash` is cached.
    pub fn contains(&self, hash: u64) -> bool {
        self.stamp.contains_key(&hash)
    }

    /// Evicts the least recently used block.
    pub fn evict(&mut self) -> Option<u64> {
        let (_, _, hash) = self.order.pop_first()?;
        self.stamp.remove(&hash);
        Some(hash)
    }

    /// Cached blocks.
    pub fn len(&self) -> usize {
        self.stamp.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.stamp.is_empty()
    }
}

/// Accumulates both references over prompts in arrival order.
#[derive(Debug)]
pub struct References {
    block_size: usize,
    seen: FxHashSet<u64>,
    pooled: BlockLru,
    pooled_capacity: usize,
    tick: u64,
    prompt_tokens: u64,
    bound_hit_tokens: u64,
    pooled_hit_tokens: u64,
}

impl References {
    /// References for blocks of `block_size` tokens and a pooled cache of
    /// `pooled_capacity` blocks.
    pub fn new(block_size: usize, pooled_capacity: usize) -> Self {
        Self {
            block_size,
            seen: FxHashSet::default(),
            pooled: BlockLru::default(),
            pooled_capacity,
            tick: 0,
            prompt_tokens: 0,
            bound_hit_tokens: 0,
            pooled_hit_tokens: 0,
        }
    }

    /// Feeds one prompt: its length and the sequence hashes of its full
    /// blocks.
    pub fn observe(&mut self, prompt_tokens: u64, blocks: &[SequenceHash]) {
        self.prompt_tokens += prompt_tokens;
        let bs = self.block_size as u64;
        let bound = blocks
            .iter()
            .take_while(|b| self.seen.contains(&b.0))
            .count() as u64;
        let pooled = blocks
            .iter()
            .take_while(|b| self.pooled.contains(b.0))
            .count() as u64;
        self.bound_hit_tokens += bound * bs;
        self.pooled_hit_tokens += pooled * bs;
        self.tick += 1;
        for (depth, b) in blocks.iter().enumerate() {
            self.seen.insert(b.0);
            self.pooled.touch(b.0, self.tick, depth as u32);
        }
        while self.pooled.len() > self.pooled_capacity {
            self.pooled.evict();
        }
    }

    /// Hit rate with an infinite cache.
    pub fn bound_hit_rate(&self) -> f64 {
        self.bound_hit_tokens as f64 / self.prompt_tokens.max(1) as f64
    }

    /// Hit rate of one pooled LRU cache of the fleet's capacity.
    pub fn pooled_lru_hit_rate(&self) -> f64 {
        self.pooled_hit_tokens as f64 / self.prompt_tokens.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{MooncakeReader, MOONCAKE_BLOCK_TOKENS};
    use switchyard_core::hashing::sequence_hashes;
    use switchyard_core::LocalHash;

    fn seq(ids: &[u64]) -> Vec<SequenceHash> {
        sequence_hashes(&ids.iter().map(|&i| LocalHash(i)).collect::<Vec<_>>())
    }

    #[test]
    fn the_bound_counts_leading_blocks_seen_before() {
        let mut r = References::new(10, 100);
        r.observe(30, &seq(&[1, 2, 3]));
        r.observe(30, &seq(&[1, 2, 4]));
        // Second prompt hits 2 of 3 blocks: 20 of 60 tokens overall.
        assert!((r.bound_hit_rate() - 20.0 / 60.0).abs() < 1e-12);
        assert_eq!(r.pooled_lru_hit_rate(), r.bound_hit_rate());
    }

    #[test]
    fn a_small_pooled_cache_evicts_tails_before_prefixes() {
        let mut r = References::new(10, 2);
        r.observe(30, &seq(&[1, 2, 3]));
        // Capacity 2: block 3 (deepest) was evicted, 1 and 2 stay.
        r.observe(30, &seq(&[1, 2, 3]));
        assert!((r.pooled_lru_hit_rate() - 20.0 / 60.0).abs() < 1e-12);
        assert!((r.bound_hit_rate() - 30.0 / 60.0).abs() < 1e-12);
    }

    /// The figures published for the conversation trace, counted per
    /// 512-token hash id (a partial last block counts as a block): bound
    /// 0.366; pooled LRU 0.088 (4,096 blocks), 0.181 (8,192). Weighted by
    /// tokens and counting only full blocks, the bound is 0.373.
    #[test]
    fn the_conversation_trace_matches_its_published_references() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../data/traces/mooncake_conversation.jsonl"
        );
        let file = std::io::BufReader::new(std::fs::File::open(path).unwrap());
        let records: Vec<_> = MooncakeReader::new(file).map(Result::unwrap).collect();
        for (capacity, pooled) in [(4096, 0.088), (8192, 0.181)] {
            let mut r = References::new(MOONCAKE_BLOCK_TOKENS, capacity);
            for rec in &records {
                let blocks = rec.hash_ids.len();
                r.observe((blocks * MOONCAKE_BLOCK_TOKENS) as u64, &seq(&rec.hash_ids));
            }
            assert!(
                (r.bound_hit_rate() - 0.366).abs() < 0.005,
                "bound {}",
                r.bound_hit_rate()
            );
            assert!(
                (r.pooled_lru_hit_rate() - pooled).abs() < 0.01,
                "pooled {} at {capacity}: {}",
                pooled,
                r.pooled_lru_hit_rate()
            );
        }
    }
}
