//! Token ids of text segments already seen: a conversation's earlier
//! messages are tokenized once, not on every turn.
//!
//! A chat template renders each message between special tokens
//! (`<|im_start|>user\n…<|im_end|>`), and the tokenizer splits text at
//! special tokens before anything else, so the text between two of them
//! always maps to the same ids, wherever it appears. [`SegmentCache`] keeps
//! those ids, keyed by a 128-bit hash of the segment under a per-process
//! random seed (a client cannot aim a collision at another's segment
//! without the seed; a collision would change routing hints only, never
//! what a worker computes).
//!
//! The cache is bounded by weight (ids held plus a per-entry overhead),
//! evicts by S3-FIFO (`quick_cache`), and counts lookups, hits and
//! evictions for `/metrics`.

use quick_cache::sync::Cache;
use quick_cache::{Lifecycle, Weighter};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Segments shorter than this are tokenized every time (a role name and
/// a newline cost less to tokenize than to look up).
pub const MIN_CACHED_BYTES: usize = 64;

/// The weight of one entry beyond its ids: key, pointer and the cache's
/// own bookkeeping, in units of one id (4 bytes).
const ENTRY_OVERHEAD: u64 = 16;

/// The default capacity, in ids: 4 Mi ids, some 16 MiB with overheads
/// ([`ENTRY_OVERHEAD`]).
pub const DEFAULT_CAPACITY_IDS: u64 = 4 * 1024 * 1024;

/// What the cache has done since it was made.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SegmentCacheStats {
    /// Lookups of segments long enough to cache.
    pub lookups: u64,
    /// Lookups answered from the cache.
    pub hits: u64,
    /// Entries evicted (or refused as heavier than the whole cache).
    pub evictions: u64,
    /// Entries held now.
    pub entries: u64,
    /// Ids held now.
    pub ids: u64,
}

#[derive(Debug, Default)]
struct Counters {
    lookups: AtomicU64,
    hits: AtomicU64,
    evictions: AtomicU64,
}

#[derive(Clone)]
struct IdsWeight;

impl Weighter<u128, Arc<[u32]>> for IdsWeight {
    fn weight(&self, _key: &u128, ids: &Arc<[u32]>) -> u64 {
        ids.len() as u64 + ENTRY_OVERHEAD
    }
}

#[derive(Clone)]
struct CountEvictions(Arc<Counters>);

impl Lifecycle<u128, Arc<[u32]>> for CountEvictions {
    type RequestState = ();

    fn on_evict(&self, _: &mut (), _key: u128, _ids: Arc<[u32]>) {
        self.0.evictions.fetch_add(1, Relaxed);
    }
}

/// A bounded, concurrent map from segment text to its token ids.
pub struct SegmentCache {
    cache: Cache<u128, Arc<[u32]>, IdsWeight, std::hash::RandomState, CountEvictions>,
    enabled: bool,
    seed: u64,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for SegmentCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SegmentCache")
            .field("stats", &self.stats())
            .finish()
    }
}

impl SegmentCache {
    /// A cache of at most `capacity_ids` ids (entry overheads included);
    /// `0` caches nothing.
    pub fn new(capacity_ids: u64) -> Self {
        let counters = Arc::new(Counters::default());
        let estimated_items = usize::try_from(capacity_ids / 256)
            .unwrap_or(usize::MAX)
            .max(16);
        Self {
            cache: Cache::with(
                estimated_items,
                capacity_ids.max(1),
                IdsWeight,
                std::hash::RandomState::new(),
                CountEvictions(counters.clone()),
            ),
            enabled: capacity_ids > 0,
            seed: random_seed(),
            counters,
        }
    }

    /// Appends the ids of `segment` to `out`: from the cache when it holds
    /// them, else from `encode` (whose ids the cache then keeps). Segments
    /// shorter than [`MIN_CACHED_BYTES`] go straight to `encode`.
    pub fn encode_with(
        &self,
        segment: &str,
        out: &mut Vec<u32>,
        encode: impl FnOnce(&str, &mut Vec<u32>),
    ) {
        if segment.len() < MIN_CACHED_BYTES || !self.enabled {
            return encode(segment, out);
        }
        self.counters.lookups.fetch_add(1, Relaxed);
        let key = xxhash_rust::xxh3::xxh3_128_with_seed(segment.as_bytes(), self.seed);
        if let Some(ids) = self.cache.get(&key) {
            self.counters.hits.fetch_add(1, Relaxed);
            out.extend_from_slice(&ids);
            return;
        }
        let start = out.len();
        encode(segment, out);
        self.cache.insert(key, Arc::from(&out[start..]));
    }

    /// Counts since the cache was made, and what it holds now.
    pub fn stats(&self) -> SegmentCacheStats {
        SegmentCacheStats {
            lookups: self.counters.lookups.load(Relaxed),
            hits: self.counters.hits.load(Relaxed),
            evictions: self.counters.evictions.load(Relaxed),
            entries: self.cache.len() as u64,
            ids: self
                .cache
                .weight()
                .saturating_sub(self.cache.len() as u64 * ENTRY_OVERHEAD),
        }
    }
}

/// A seed no client can know: the standard library's per-process random
/// hash keys, drawn from the operating system.
fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::hash::RandomState::new().build_hasher();
    hasher.write_u64(0x5357_4954_4348_5944);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count_bytes(text: &str, out: &mut Vec<u32>) {
        out.extend(text.bytes().map(u32::from));
    }

    #[test]
    fn a_segment_seen_before_is_not_encoded_again() {
        let cache = SegmentCache::new(1 << 20);
        let text = "x".repeat(MIN_CACHED_BYTES);
        let (mut first, mut second) = (Vec::new(), vec![7]);
        cache.encode_with(&text, &mut first, count_bytes);
        cache.encode_with(&text, &mut second, |_, _| panic!("encoded twice"));
        assert_eq!(second[0], 7, "appended, not replaced");
        assert_eq!(&second[1..], &first[..]);
        let stats = cache.stats();
        assert_eq!((stats.lookups, stats.hits, stats.entries), (2, 1, 1));
        assert_eq!(stats.ids, MIN_CACHED_BYTES as u64);
    }

    #[test]
    fn short_segments_are_neither_cached_nor_counted() {
        let cache = SegmentCache::new(1 << 20);
        let mut out = Vec::new();
        cache.encode_with("user\n", &mut out, count_bytes);
        cache.encode_with("user\n", &mut out, count_bytes);
        assert_eq!(out.len(), 10);
        assert_eq!(cache.stats(), SegmentCacheStats::default());
    }

    #[test]
    fn the_cache_stays_within_its_capacity_and_counts_evictions() {
        let capacity = 64 * 1024;
        let cache = SegmentCache::new(capacity);
        let mut out = Vec::new();
        for i in 0..2_000 {
            let text = format!("{i:0>200}");
            out.clear();
            cache.encode_with(&text, &mut out, count_bytes);
            assert_eq!(out.len(), 200);
        }
        let stats = cache.stats();
        assert!(
            stats.ids + stats.entries * ENTRY_OVERHEAD <= capacity,
            "{stats:?}"
        );
        assert!(stats.evictions > 0, "{stats:?}");
        assert_eq!(stats.entries + stats.evictions, 2_000, "{stats:?}");
    }

    #[test]
    fn a_zero_capacity_cache_holds_nothing() {
        let cache = SegmentCache::new(0);
        let text = "y".repeat(100);
        let mut out = Vec::new();
        cache.encode_with(&text, &mut out, count_bytes);
        cache.encode_with(&text, &mut out, count_bytes);
        assert_eq!(out.len(), 200);
        assert_eq!(cache.stats().entries, 0);
    }
}
