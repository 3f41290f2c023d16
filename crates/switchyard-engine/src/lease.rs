//! Capture leases: a prompt prefix's KV held on the engine that computed
//! it, for another engine to restore from (a *rendezvous*: the prefill side
//! of disaggregated serving, or a busy worker lending a long cached prefix
//! to an idle one).
//!
//! A lease pins the device blocks of the prefix it captured (they cannot be
//! evicted) until it is released — once, by whoever holds its
//! [`LeaseRef`] — or until it expires. The reference carries a secret
//! token chosen by the driver from a CSPRNG: a reader must present it, so
//! the lease is the authenticated source, and a wrong token is refused and
//! counted, never told apart from an unknown lease. The table is bounded
//! (`max_leases`); a capture beyond it is refused and counted.
//!
//! Nothing here reads a clock: expiry takes the caller's `now_ms`.

use crate::blocks::{BlockId, BlockManager};
use rustc_hash::FxHashMap;
use switchyard_core::SequenceHash;

/// A lease's id, unique within the engine that issued it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId(pub u64);

/// What a restoring engine presents: the lease and its secret.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct LeaseRef {
    /// The lease.
    pub id: LeaseId,
    /// Its secret (from the driver's CSPRNG; never logged).
    pub token: u128,
}

impl std::fmt::Debug for LeaseRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LeaseRef")
            .field("id", &self.id)
            .field("token", &"<redacted>")
            .finish()
    }
}

/// A captured prefix as a transfer carries it: the blocks' hashes and
/// their tokens (`block_size` per block). The simulated KV "bytes" are
/// the tokens; a transfer's time comes from the timing model's size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeasedKv {
    /// Chained hashes of the blocks, from the first prompt block on.
    pub hashes: Vec<SequenceHash>,
    /// Their tokens, block after block.
    pub tokens: Vec<u32>,
}

impl LeasedKv {
    /// Blocks carried.
    pub fn blocks(&self) -> usize {
        self.hashes.len()
    }
}

/// Why a lease operation was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// No such lease here (never issued, released, expired), or a wrong
    /// token: the two are not told apart.
    #[error("no such lease")]
    Unknown,
    /// The table is full.
    #[error("capture refused: {0} leases are held")]
    Full(usize),
    /// The device caches none of the prefix.
    #[error("nothing of the prefix is cached")]
    NothingCached,
}

/// Lease counters (monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LeaseCounters {
    /// Leases issued.
    pub captured: u64,
    /// Leases released by their holder.
    pub released: u64,
    /// Leases that expired unreleased.
    pub expired: u64,
    /// Captures refused because the table was full.
    pub refused_full: u64,
    /// Reads or releases refused (unknown lease or wrong token).
    pub refused_unknown: u64,
}

struct Lease {
    token: u128,
    blocks: Vec<BlockId>,
    hashes: Vec<SequenceHash>,
    expires_at_ms: f64,
}

/// The leases an engine has issued.
pub struct LeaseTable {
    leases: FxHashMap<LeaseId, Lease>,
    next: u64,
    max_leases: usize,
    counters: LeaseCounters,
}

impl LeaseTable {
    /// An empty table holding at most `max_leases` leases.
    pub fn new(max_leases: usize) -> Self {
        Self {
            leases: FxHashMap::default(),
            next: 1,
            max_leases,
            counters: LeaseCounters::default(),
        }
    }

    /// Leases held now.
    pub fn len(&self) -> usize {
        self.leases.len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty()
    }

    /// Device blocks the leases hold (a block held by two counts twice).
    pub fn pinned_blocks(&self) -> usize {
        self.leases.values().map(|l| l.blocks.len()).sum()
    }

    /// Counters so far.
    pub fn counters(&self) -> LeaseCounters {
        self.counters
    }

    /// Captures the leading run of `hashes` the device caches, under
    /// `token`, until `expires_at_ms`.
    pub fn capture(
        &mut self,
        kv: &mut BlockManager,
        hashes: &[SequenceHash],
        token: u128,
        expires_at_ms: f64,
    ) -> Result<(LeaseRef, usize), LeaseError> {
        if self.leases.len() >= self.max_leases {
            self.counters.refused_full += 1;
            return Err(LeaseError::Full(self.leases.len()));
        }
        let blocks = kv.pin_cached_prefix(hashes);
        if blocks.is_empty() {
            return Err(LeaseError::NothingCached);
        }
        let id = LeaseId(self.next);
        self.next += 1;
        let n = blocks.len();
        self.leases.insert(
            id,
            Lease {
                token,
                hashes: hashes[..n].to_vec(),
                blocks,
                expires_at_ms,
            },
        );
        self.counters.captured += 1;
        Ok((LeaseRef { id, token }, n))
    }

    fn get(&mut self, lease: LeaseRef) -> Result<&Lease, LeaseError> {
        match self.leases.get(&lease.id) {
            Some(l) if l.token == lease.token => Ok(l),
            _ => {
                self.counters.refused_unknown += 1;
                Err(LeaseError::Unknown)
            }
        }
    }

    /// The captured prefix, for a transfer.
    pub fn read(&mut self, kv: &BlockManager, lease: LeaseRef) -> Result<LeasedKv, LeaseError> {
        let l = self.get(lease)?;
        let mut tokens = Vec::with_capacity(l.blocks.len() * kv.block_size());
        for &block in &l.blocks {
            tokens.extend_from_slice(kv.block_tokens(block));
        }
        Ok(LeasedKv {
            hashes: l.hashes.clone(),
            tokens,
        })
    }

    /// Releases a lease: its blocks go back to the cache's LRU.
    pub fn release(&mut self, kv: &mut BlockManager, lease: LeaseRef) -> Result<(), LeaseError> {
        self.get(lease)?;
        let l = self.leases.remove(&lease.id).expect("just found");
        kv.unpin_blocks(&l.blocks);
        self.counters.released += 1;
        Ok(())
    }

    /// Releases every lease past its expiry; returns how many.
    pub fn expire(&mut self, kv: &mut BlockManager, now_ms: f64) -> usize {
        let expired: Vec<LeaseId> = self
            .leases
            .iter()
            .filter(|(_, l)| l.expires_at_ms <= now_ms)
            .map(|(&id, _)| id)
            .collect();
        for id in &expired {
            let l = self.leases.remove(id).expect("listed above");
            kv.unpin_blocks(&l.blocks);
        }
        self.counters.expired += expired.len() as u64;
        expired.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blocks::{KvConfig, SeqId};
    use proptest::prelude::*;

    fn kv() -> BlockManager {
        BlockManager::new(KvConfig {
            block_size: 4,
            num_blocks: 32,
            host_blocks: 0,
            emit_events: false,
            max_buffered_events: 0,
        })
    }

    /// Caches a prompt of `blocks` blocks (hashes 1..=blocks) and releases
    /// the sequence that computed it: the blocks sit on the LRU.
    fn cache_prompt(
        kv: &mut BlockManager,
        seq: u32,
        first: u64,
        blocks: usize,
    ) -> Vec<SequenceHash> {
        let hashes: Vec<SequenceHash> = (0..blocks as u64)
            .map(|i| SequenceHash(first + i))
            .collect();
        let tokens: Vec<u32> = (0..(blocks * 4) as u32)
            .map(|t| t + first as u32 * 100)
            .collect();
        assert!(kv.reserve(SeqId(seq), blocks).is_some());
        kv.commit(SeqId(seq), 0, None, &hashes, &tokens);
        kv.release(SeqId(seq), true);
        hashes
    }

    #[test]
    fn a_lease_holds_its_blocks_against_eviction_until_released() {
        let mut kv = kv();
        let hashes = cache_prompt(&mut kv, 0, 1, 8);
        let mut table = LeaseTable::new(4);
        let (lease, n) = table.capture(&mut kv, &hashes, 7, 1_000.0).unwrap();
        assert_eq!(n, 8);
        // Another sequence wants the whole pool: the leased blocks stay.
        assert!(kv.reserve(SeqId(1), 32).is_none());
        assert!(kv.reserve(SeqId(1), 24).is_some());
        kv.release(SeqId(1), false);
        let read = table.read(&kv, lease).unwrap();
        assert_eq!(read.hashes, hashes);
        assert_eq!(read.tokens.len(), 32);
        assert_eq!(read.tokens[0], 100);
        table.release(&mut kv, lease).unwrap();
        assert_eq!(table.release(&mut kv, lease), Err(LeaseError::Unknown));
        assert!(kv.reserve(SeqId(1), 32).is_some(), "evictable again");
    }

    #[test]
    fn a_wrong_token_reads_nothing_and_is_counted() {
        let mut kv = kv();
        let hashes = cache_prompt(&mut kv, 0, 1, 2);
        let mut table = LeaseTable::new(4);
        let (lease, _) = table.capture(&mut kv, &hashes, 7, 1_000.0).unwrap();
        let forged = LeaseRef { token: 8, ..lease };
        assert_eq!(table.read(&kv, forged), Err(LeaseError::Unknown));
        assert_eq!(table.release(&mut kv, forged), Err(LeaseError::Unknown));
        assert_eq!(table.counters().refused_unknown, 2);
        assert!(table.read(&kv, lease).is_ok());
        assert!(
            !format!("{lease:?}").contains('7'),
            "the token is never printed"
        );
    }

    #[test]
    fn leases_are_bounded_and_expire() {
        let mut kv = kv();
        let hashes = cache_prompt(&mut kv, 0, 1, 2);
        let mut table = LeaseTable::new(2);
        table.capture(&mut kv, &hashes, 1, 10.0).unwrap();
        table.capture(&mut kv, &hashes, 2, 20.0).unwrap();
        assert_eq!(
            table.capture(&mut kv, &hashes, 3, 30.0),
            Err(LeaseError::Full(2))
        );
        assert_eq!(table.expire(&mut kv, 10.0), 1);
        assert_eq!(table.len(), 1);
        assert_eq!(table.expire(&mut kv, 25.0), 1);
        assert!(table.is_empty());
        assert_eq!(table.counters().expired, 2);
        assert_eq!(
            table.capture(&mut kv, &[SequenceHash(999)], 4, 1.0),
            Err(LeaseError::NothingCached)
        );
    }

    #[derive(Clone, Debug)]
    enum Op {
        Capture { blocks: usize, ttl: u8 },
        Release { which: usize, forge: bool },
        Expire { advance: u8 },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1usize..=8, 1u8..20).prop_map(|(blocks, ttl)| Op::Capture { blocks, ttl }),
            (0usize..8, any::<bool>()).prop_map(|(which, forge)| Op::Release { which, forge }),
            (0u8..10).prop_map(|advance| Op::Expire { advance }),
        ]
    }

    proptest! {
        /// Against a naive model: every lease ends exactly once (released
        /// by its holder or expired), a forged token never ends one, and
        /// once all have ended the pool is entirely evictable again.
        #[test]
        fn every_lease_is_released_exactly_once(ops in proptest::collection::vec(op(), 1..60)) {
            let mut kv = kv();
            let hashes = cache_prompt(&mut kv, 0, 1, 8);
            let mut table = LeaseTable::new(5);
            // The model: live leases with their expiry, and ended ones.
            let mut live: Vec<(LeaseRef, f64)> = Vec::new();
            let mut ended: Vec<LeaseRef> = Vec::new();
            let mut now = 0.0;
            let mut token = 0u128;
            for op in ops {
                match op {
                    Op::Capture { blocks, ttl } => {
                        token += 1;
                        let result = table.capture(&mut kv, &hashes[..blocks], token, now + f64::from(ttl));
                        if live.len() >= 5 {
                            prop_assert_eq!(result, Err(LeaseError::Full(5)));
                        } else {
                            let (lease, n) = result.unwrap();
                            prop_assert_eq!(n, blocks);
                            live.push((lease, now + f64::from(ttl)));
                        }
                    }
                    Op::Release { which, forge } => {
                        let all: Vec<LeaseRef> = live.iter().map(|l| l.0).chain(ended.iter().copied()).collect();
                        let Some(&lease) = all.get(which % all.len().max(1)) else { continue };
                        let presented = if forge { LeaseRef { token: lease.token + 1_000_000, ..lease } } else { lease };
                        let is_live = live.iter().any(|l| l.0 == lease);
                        let result = table.release(&mut kv, presented);
                        if is_live && !forge {
                            prop_assert_eq!(result, Ok(()));
                            live.retain(|l| l.0 != lease);
                            ended.push(lease);
                        } else {
                            prop_assert_eq!(result, Err(LeaseError::Unknown));
                        }
                    }
                    Op::Expire { advance } => {
                        now += f64::from(advance);
                        let due = live.iter().filter(|l| l.1 <= now).count();
                        prop_assert_eq!(table.expire(&mut kv, now), due);
                        ended.extend(live.iter().filter(|l| l.1 <= now).map(|l| l.0));
                        live.retain(|l| l.1 > now);
                    }
                }
                prop_assert_eq!(table.len(), live.len());
                let counters = table.counters();
                prop_assert_eq!(counters.released + counters.expired, ended.len() as u64);
            }
            table.expire(&mut kv, f64::INFINITY);
            prop_assert_eq!(kv.used_blocks(), 0);
            prop_assert!(kv.reserve(SeqId(1), 32).is_some());
        }
    }
}
