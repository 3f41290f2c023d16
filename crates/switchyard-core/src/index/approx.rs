//! Approximate prefix index for engines that publish no KV events.
//!
//! The router records each of its own decisions as if the chosen worker had
//! cached the prompt. A recorded block lives for a TTL (refreshed when a later
//! decision records it again) and the whole index is capped: past the cap the
//! entries closest to expiry are pruned until the index is back to
//! `prune_ratio` of it, deeper blocks before their prefixes.
//!
//! One prompt takes at most a share of the cap, a sixteenth by default
//! ([`ApproxConfig::max_record_blocks`]): only its first blocks are
//! recorded. However long a prompt is, recording it displaces no more of
//! everyone else's entries than a prompt of that many blocks would, so a
//! huge prompt can never prune the index of the others' entries.

use super::tree::{OverlapScores, PrefixIndex, StoredBlock};
use crate::hashing::sequence_hashes;
use crate::maps::{map_bytes, FxHashMap};
use crate::types::{EngineHash, LocalHash, WorkerId};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Settings of [`ApproxIndex`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApproxConfig {
    /// How long a recorded block is assumed cached, in milliseconds.
    pub ttl_ms: f64,
    /// Most (block, worker) pairs kept.
    pub max_blocks: usize,
    /// After exceeding `max_blocks`, prune down to this fraction of it.
    pub prune_ratio: f64,
    /// The fraction of `max_blocks` one record may take; see
    /// [`ApproxConfig::max_record_blocks`].
    pub record_share: f64,
}

impl Default for ApproxConfig {
    fn default() -> Self {
        Self {
            ttl_ms: 120_000.0,
            max_blocks: 1 << 20,
            prune_ratio: 0.8,
            record_share: 1.0 / 16.0,
        }
    }
}

/// Why an [`ApproxConfig`] was refused.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ApproxConfigError {
    /// TTL not a positive finite number.
    #[error("approximate index ttl_ms must be positive and finite, got {0}")]
    Ttl(f64),
    /// Cap of zero.
    #[error("approximate index max_blocks must be at least 1")]
    MaxBlocks,
    /// Ratio outside (0, 1].
    #[error("approximate index prune_ratio must be in (0, 1], got {0}")]
    PruneRatio(f64),
    /// Share outside (0, 1].
    #[error("approximate index record_share must be in (0, 1], got {0}")]
    RecordShare(f64),
}

impl ApproxConfig {
    /// Most blocks one [`ApproxIndex::record`] stores: `record_share` of
    /// `max_blocks` (at least 1); of a longer prompt, its first blocks
    /// only (the prefix is what later prompts match). At the defaults,
    /// 65 536 blocks: a million tokens at 16 per block.
    pub fn max_record_blocks(&self) -> usize {
        ((self.max_blocks as f64 * self.record_share) as usize).max(1)
    }

    /// Checks ranges.
    pub fn validate(&self) -> Result<(), ApproxConfigError> {
        if !(self.ttl_ms.is_finite() && self.ttl_ms > 0.0) {
            return Err(ApproxConfigError::Ttl(self.ttl_ms));
        }
        if self.max_blocks == 0 {
            return Err(ApproxConfigError::MaxBlocks);
        }
        if !(self.prune_ratio > 0.0 && self.prune_ratio <= 1.0) {
            return Err(ApproxConfigError::PruneRatio(self.prune_ratio));
        }
        if !(self.record_share > 0.0 && self.record_share <= 1.0) {
            return Err(ApproxConfigError::RecordShare(self.record_share));
        }
        Ok(())
    }
}

#[derive(Clone, Copy, Debug)]
struct Expiry {
    at_ms: f64,
    worker: WorkerId,
    seq_hash: u64,
}

/// Prefix index predicted from the router's own decisions.
#[derive(Debug)]
pub struct ApproxIndex {
    config: ApproxConfig,
    index: PrefixIndex,
    /// (worker, sequence hash) → current expiry. The source of truth for
    /// which queue entries are still current.
    expiries: FxHashMap<(WorkerId, u64), f64>,
    /// Expiries in recording order (so in expiry order: the TTL is fixed);
    /// entries superseded by a refresh are skipped when popped.
    queue: VecDeque<Expiry>,
    expired: u64,
    pruned: u64,
}

impl ApproxIndex {
    /// An empty index; `config` must pass [`ApproxConfig::validate`].
    pub fn new(config: ApproxConfig) -> Result<Self, ApproxConfigError> {
        config.validate()?;
        Ok(Self {
            config,
            index: PrefixIndex::new(),
            expiries: FxHashMap::default(),
            queue: VecDeque::new(),
            expired: 0,
            pruned: 0,
        })
    }

    /// Records that `worker` was chosen for a prompt with these local hashes
    /// at `now_ms`: every block up to [`ApproxConfig::max_record_blocks`]
    /// is (re)stored and its TTL restarts; later blocks are not recorded.
    /// Expired entries are dropped first, and the cap is enforced after.
    pub fn record(&mut self, worker: WorkerId, local: &[LocalHash], now_ms: f64) {
        self.expire(now_ms);
        let local = &local[..local.len().min(self.config.max_record_blocks())];
        if local.is_empty() {
            return;
        }
        let seq = sequence_hashes(local);
        let chain: Vec<StoredBlock> = seq
            .iter()
            .zip(local)
            .map(|(s, &l)| StoredBlock {
                engine_hash: EngineHash(s.0),
                local_hash: l,
            })
            .collect();
        self.index.store(worker, None, &chain);
        let at_ms = now_ms + self.config.ttl_ms;
        // Deepest first, so that among equal expiries tails go before
        // their prefixes.
        for s in seq.iter().rev() {
            self.expiries.insert((worker, s.0), at_ms);
            self.queue.push_back(Expiry {
                at_ms,
                worker,
                seq_hash: s.0,
            });
        }
        if self.index.live_pairs() > self.config.max_blocks {
            let target = (self.config.max_blocks as f64 * self.config.prune_ratio) as usize;
            while self.index.live_pairs() > target {
                if !self.pop_front() {
                    break;
                }
                self.pruned += 1;
            }
        }
        self.compact_queue();
    }

    /// Drops every entry whose TTL has passed at `now_ms`; returns how many.
    pub fn expire(&mut self, now_ms: f64) -> usize {
        let mut n = 0;
        while self.queue.front().is_some_and(|e| e.at_ms <= now_ms) {
            if self.pop_front() {
                n += 1;
            }
        }
        self.expired += n as u64;
        n
    }

    /// Removes the front queue entry; returns whether it was current (and so
    /// removed a block).
    fn pop_front(&mut self) -> bool {
        let Some(e) = self.queue.pop_front() else {
            return false;
        };
        let key = (e.worker, e.seq_hash);
        if self.expiries.get(&key) != Some(&e.at_ms) {
            return false;
        }
        self.expiries.remove(&key);
        self.index.remove(e.worker, &[EngineHash(e.seq_hash)]);
        true
    }

    /// Keeps the queue within a constant factor of the live entries by
    /// dropping superseded entries once they dominate.
    fn compact_queue(&mut self) {
        if self.queue.len() <= 2 * self.expiries.len() + 1024 {
            return;
        }
        let expiries = &self.expiries;
        self.queue
            .retain(|e| expiries.get(&(e.worker, e.seq_hash)) == Some(&e.at_ms));
    }

    /// Forgets `worker` and everything recorded for it.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.index.remove_worker(worker);
        self.expiries.retain(|(w, _), _| *w != worker);
        self.queue.retain(|e| e.worker != worker);
    }

    /// Each worker's predicted matched depth; see [`PrefixIndex::overlaps`].
    pub fn overlaps(&self, hashes: &[LocalHash], out: &mut OverlapScores) {
        self.index.overlaps(hashes, out);
    }

    /// The underlying index (read-only).
    pub fn index(&self) -> &PrefixIndex {
        &self.index
    }

    /// Entries dropped because their TTL passed.
    pub fn expired_total(&self) -> u64 {
        self.expired
    }

    /// Entries dropped to enforce the cap.
    pub fn pruned_total(&self) -> u64 {
        self.pruned
    }

    /// Estimate of heap bytes in use.
    pub fn estimated_bytes(&self) -> usize {
        self.index.estimated_bytes()
            + map_bytes(&self.expiries)
            + self.queue.capacity() * std::mem::size_of::<Expiry>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn locals(hashes: &[u64]) -> Vec<LocalHash> {
        hashes.iter().map(|&h| LocalHash(h)).collect()
    }

    fn index(ttl_ms: f64, max_blocks: usize) -> ApproxIndex {
        ApproxIndex::new(ApproxConfig {
            ttl_ms,
            max_blocks,
            prune_ratio: 0.8,
            record_share: 1.0,
        })
        .unwrap()
    }

    /// [`index`] with the default record share.
    fn shared_index(max_blocks: usize) -> ApproxIndex {
        ApproxIndex::new(ApproxConfig {
            ttl_ms: 1e9,
            max_blocks,
            ..ApproxConfig::default()
        })
        .unwrap()
    }

    fn depth(index: &ApproxIndex, worker: WorkerId, query: &[u64]) -> u32 {
        let mut out = OverlapScores::new();
        index.overlaps(&locals(query), &mut out);
        out.depth(worker)
    }

    #[test]
    fn a_recorded_decision_predicts_a_cache_hit_until_its_ttl() {
        let w = WorkerId::new(1);
        let mut idx = index(1000.0, 100);
        idx.record(w, &locals(&[1, 2, 3]), 0.0);
        assert_eq!(depth(&idx, w, &[1, 2, 3, 4]), 3);
        idx.expire(999.0);
        assert_eq!(depth(&idx, w, &[1, 2, 3]), 3);
        assert_eq!(idx.expire(1000.0), 3);
        assert_eq!(depth(&idx, w, &[1, 2, 3]), 0);
        assert_eq!(idx.index().live_pairs(), 0);
    }

    #[test]
    fn recording_again_refreshes_the_ttl() {
        let w = WorkerId::new(1);
        let mut idx = index(1000.0, 100);
        idx.record(w, &locals(&[1, 2]), 0.0);
        idx.record(w, &locals(&[1]), 600.0);
        idx.expire(1200.0);
        assert_eq!(depth(&idx, w, &[1, 2]), 1);
        idx.expire(1600.0);
        assert_eq!(depth(&idx, w, &[1, 2]), 0);
    }

    #[test]
    fn the_cap_prunes_oldest_entries_down_to_the_ratio() {
        let w = WorkerId::new(1);
        let mut idx = index(1e9, 10);
        idx.record(w, &locals(&[1, 2, 3, 4, 5, 6]), 0.0);
        idx.record(w, &locals(&[7, 8, 9, 10, 11]), 1.0);
        // 11 > 10: prune to 8, oldest (the first prompt, tail first) first.
        assert_eq!(idx.index().live_pairs(), 8);
        assert_eq!(idx.pruned_total(), 3);
        assert_eq!(depth(&idx, w, &[1, 2, 3, 4, 5, 6]), 3);
        assert_eq!(depth(&idx, w, &[7, 8, 9, 10, 11]), 5);
    }

    #[test]
    fn one_huge_prompt_never_prunes_everyone_elses_entries() {
        let cap = 4096;
        let mut idx = shared_index(cap);
        // 200 small prompts of 8 blocks each on two workers: 1600 entries,
        // well under the cap.
        let small = |i: u64| -> Vec<u64> { (0..8).map(|b| 1_000_000 * (i + 1) + b).collect() };
        for i in 0..200 {
            idx.record(WorkerId::new(1 + i % 2), &locals(&small(i)), i as f64);
        }
        // One prompt of ten times the cap.
        let huge: Vec<u64> = (0..10 * cap as u64).map(|b| 7_000_000_000 + b).collect();
        let w = WorkerId::new(3);
        idx.record(w, &locals(&huge), 1000.0);
        for i in 0..200 {
            assert_eq!(
                depth(&idx, WorkerId::new(1 + i % 2), &small(i)),
                8,
                "small prompt {i} kept"
            );
        }
        assert_eq!(idx.pruned_total(), 0);
        // Its prefix is recorded, up to a sixteenth of the cap.
        let share = idx.config.max_record_blocks();
        assert_eq!(share, cap / 16);
        assert_eq!(depth(&idx, w, &huge), share as u32);
        assert_eq!(idx.index().live_pairs(), 1600 + share);
        // With the index full, a huge prompt displaces no more than a
        // prompt of `share` blocks: the prune to 80 % of the cap, oldest
        // first, and the newest small prompts survive it.
        let mut full = shared_index(cap);
        for i in 0..(cap as u64 / 8) {
            full.record(WorkerId::new(1), &locals(&small(i)), i as f64);
        }
        full.record(w, &locals(&huge), 1e6);
        assert!(full.index().live_pairs() <= cap);
        let newest = cap as u64 / 8 - 1;
        assert_eq!(depth(&full, WorkerId::new(1), &small(newest)), 8);
        let kept = (0..cap as u64 / 8)
            .filter(|&i| depth(&full, WorkerId::new(1), &small(i)) == 8)
            .count();
        assert!(
            kept * 8 >= cap * 8 / 10 - share - 8,
            "{kept} small prompts kept"
        );
    }

    #[test]
    fn the_queue_stays_bounded_under_refreshes() {
        let w = WorkerId::new(1);
        let mut idx = index(1e9, 1000);
        for t in 0..10_000 {
            idx.record(w, &locals(&[1, 2, 3]), t as f64);
        }
        assert!(idx.queue.len() <= 2 * 3 + 1024 + 3);
        assert_eq!(idx.index().live_pairs(), 3);
    }

    #[test]
    fn bad_settings_are_refused() {
        let bad = [
            ApproxConfig {
                ttl_ms: 0.0,
                ..Default::default()
            },
            ApproxConfig {
                ttl_ms: f64::NAN,
                ..Default::default()
            },
            ApproxConfig {
                max_blocks: 0,
                ..Default::default()
            },
            ApproxConfig {
                prune_ratio: 1.5,
                ..Default::default()
            },
            ApproxConfig {
                prune_ratio: 0.0,
                ..Default::default()
            },
            ApproxConfig {
                record_share: 0.0,
                ..Default::default()
            },
            ApproxConfig {
                record_share: f64::NAN,
                ..Default::default()
            },
        ];
        for config in bad {
            assert!(ApproxIndex::new(config).is_err(), "{config:?}");
        }
        assert!(ApproxConfig::default().validate().is_ok());
    }

    #[test]
    fn removing_a_worker_forgets_its_records() {
        let (a, b) = (WorkerId::new(1), WorkerId::new(2));
        let mut idx = index(1000.0, 100);
        idx.record(a, &locals(&[1, 2]), 0.0);
        idx.record(b, &locals(&[1]), 0.0);
        idx.remove_worker(a);
        assert_eq!(depth(&idx, a, &[1, 2]), 0);
        assert_eq!(depth(&idx, b, &[1, 2]), 1);
        assert_eq!(idx.expire(2000.0), 1);
    }
}
