//! The paged KV block manager: a fixed pool of device blocks, reference
//! counts, prefix caching by chained block hash, LRU eviction, and an
//! optional host tier that evicted device blocks spill into.
//!
//! Invariants:
//!
//! - every block is in exactly one place: referenced by at least one
//!   sequence table, on the evictable LRU list (cached, unreferenced), or on
//!   the empty stack (uncached, unreferenced);
//! - a cached hash names exactly one device block; a sequence that completes
//!   a block whose hash is already cached switches to the cached block;
//! - a sequence's table holds its prefix in order, so whenever a block is
//!   referenced its whole prefix is referenced too. Released tables go onto
//!   the LRU tail-first, so among unreferenced blocks a tail is evicted before
//!   its prefix.
//!
//! Unlike vLLM, which keeps one free queue, never-cached free blocks are
//! handed out before any cached block is evicted: the cache keeps a little
//! longer and no event is lost by it.

use crate::events::{KvEvent, Medium};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;
use switchyard_core::{EngineHash, SequenceHash};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// A sequence's slot in the block manager (assigned by the scheduler).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u32);

/// Index of a device block in the pool.
pub type BlockId = u32;

const NIL: u32 = u32::MAX;
const ENGINE_HASH_SEED: u64 = 0x5157_4954_4348_5944;

/// The engine-side id published for a block: derived from, but never equal
/// to, the router's chained hash, so nothing downstream can rely on them
/// matching (real engines hash differently).
#[inline]
pub fn engine_hash(hash: SequenceHash) -> EngineHash {
    EngineHash(xxh3_64_with_seed(&hash.0.to_le_bytes(), ENGINE_HASH_SEED))
}

/// Block-manager knobs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvConfig {
    /// Tokens per block.
    pub block_size: usize,
    /// Device blocks in the pool.
    pub num_blocks: usize,
    /// Host-tier capacity in blocks (`0`: no host tier).
    pub host_blocks: usize,
    /// Whether to record KV events at all.
    pub emit_events: bool,
    /// Events buffered between drains; beyond it the newest are dropped and counted.
    pub max_buffered_events: usize,
}

impl Default for KvConfig {
    fn default() -> Self {
        Self {
            block_size: 16,
            num_blocks: 16_384,
            host_blocks: 0,
            emit_events: true,
            max_buffered_events: 1 << 16,
        }
    }
}

/// Counters of the block manager (monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvCounters {
    /// Cached device blocks evicted to make room.
    pub device_evictions: u64,
    /// Evicted device blocks stored into the host tier.
    pub host_spills: u64,
    /// Host blocks evicted to make room.
    pub host_evictions: u64,
    /// Spills dropped because every host block was pinned.
    pub host_spills_dropped: u64,
    /// Events dropped because the buffer was full.
    pub events_dropped: u64,
}

#[derive(Clone, Copy, Debug)]
struct Block {
    ref_count: u32,
    hash: Option<SequenceHash>,
    parent: Option<SequenceHash>,
    prev: u32,
    next: u32,
    on_lru: bool,
}

struct HostEntry {
    tokens: Box<[u32]>,
    pin: Arc<AtomicU32>,
    stamp: u64,
}

struct HostTier {
    capacity: usize,
    entries: FxHashMap<SequenceHash, HostEntry>,
    order: BTreeMap<u64, SequenceHash>,
    clock: u64,
}

/// Host-tier blocks held against eviction. Dropping the guard unpins them.
#[must_use = "dropping the pins releases the host blocks at once"]
#[derive(Debug, Default)]
pub struct HostPins {
    pins: Vec<Arc<AtomicU32>>,
}

impl HostPins {
    /// Number of blocks pinned.
    pub fn len(&self) -> usize {
        self.pins.len()
    }

    /// Whether nothing is pinned.
    pub fn is_empty(&self) -> bool {
        self.pins.is_empty()
    }
}

impl Drop for HostPins {
    fn drop(&mut self) {
        for pin in &self.pins {
            pin.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// What the block manager's own table says a restore installed for the
/// sequence: the blocks after the device prefix, and whether they are the
/// source's blocks, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InstalledTable {
    /// Blocks in the sequence's table after its device prefix.
    pub blocks: usize,
    /// Whether those blocks hold the source's hashes, in order.
    pub matches_source: bool,
}

/// A restore asked for blocks the pool cannot hold now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("restore needs {needed} free device blocks, {free} are free")]
pub struct NoCapacity {
    /// Blocks the restore needs.
    pub needed: usize,
    /// Blocks free.
    pub free: usize,
}

/// The paged KV block manager (see the module docs for its invariants).
pub struct BlockManager {
    config: KvConfig,
    blocks: Vec<Block>,
    tokens: Vec<u32>,
    cached: FxHashMap<SequenceHash, BlockId>,
    empty: Vec<BlockId>,
    lru_head: u32,
    lru_tail: u32,
    lru_len: usize,
    tables: Vec<Vec<BlockId>>,
    /// Each sequence's LoRA adapter (indexed like `tables`; `None`: the
    /// base model), named on the events of the blocks it caches.
    seq_adapters: Vec<Option<Arc<str>>>,
    /// The adapter of each cached block (by block id), named when an
    /// evicted block spills to the host. Meaningful only while cached.
    block_adapters: Vec<Option<Arc<str>>>,
    host: Option<HostTier>,
    events: Vec<KvEvent>,
    counters: KvCounters,
}

impl BlockManager {
    /// A pool of `config.num_blocks` empty blocks.
    ///
    /// # Panics
    /// If `block_size` or `num_blocks` is zero or the pool exceeds `u32` ids
    /// (the engine config validates these first).
    pub fn new(config: KvConfig) -> Self {
        assert!(config.block_size > 0 && config.num_blocks > 0);
        assert!(config.num_blocks < NIL as usize);
        let blocks = vec![
            Block {
                ref_count: 0,
                hash: None,
                parent: None,
                prev: NIL,
                next: NIL,
                on_lru: false,
            };
            config.num_blocks
        ];
        let host = (config.host_blocks > 0).then(|| HostTier {
            capacity: config.host_blocks,
            entries: FxHashMap::default(),
            order: BTreeMap::new(),
            clock: 0,
        });
        Self {
            blocks,
            tokens: vec![0; config.num_blocks * config.block_size],
            cached: FxHashMap::default(),
            empty: (0..config.num_blocks as u32).rev().collect(),
            lru_head: NIL,
            lru_tail: NIL,
            lru_len: 0,
            tables: Vec::new(),
            seq_adapters: Vec::new(),
            block_adapters: vec![None; config.num_blocks],
            host,
            events: Vec::new(),
            counters: KvCounters::default(),
            config,
        }
    }

    /// Tokens per block.
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// Device blocks in the pool.
    pub fn num_blocks(&self) -> usize {
        self.config.num_blocks
    }

    /// Blocks no sequence references (empty or evictable).
    pub fn free_blocks(&self) -> usize {
        self.empty.len() + self.lru_len
    }

    /// Blocks referenced by at least one sequence.
    pub fn used_blocks(&self) -> usize {
        self.config.num_blocks - self.free_blocks()
    }

    /// Device blocks holding a cached hash (referenced or not).
    pub fn cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// Blocks in the host tier.
    pub fn host_blocks(&self) -> usize {
        self.host.as_ref().map_or(0, |h| h.entries.len())
    }

    /// Whether a host tier is configured.
    pub fn has_host_tier(&self) -> bool {
        self.host.is_some()
    }

    /// Counters so far.
    pub fn counters(&self) -> KvCounters {
        self.counters
    }

    /// The cached state as the events describe it: every (medium, engine
    /// hash) pair that is cached now, sorted.
    pub fn cached_state(&self) -> Vec<(Medium, EngineHash)> {
        let mut out: Vec<_> = self
            .cached
            .keys()
            .map(|&h| (Medium::Device, engine_hash(h)))
            .chain(
                self.host
                    .iter()
                    .flat_map(|h| h.entries.keys().map(|&k| (Medium::Host, engine_hash(k)))),
            )
            .collect();
        out.sort_unstable();
        out
    }

    /// Sets the LoRA adapter `seq` runs under (`None`: the base model),
    /// named on the `BlockStored` events of the blocks it caches or
    /// restores from now on. Set by the scheduler at admission (a slot's
    /// next sequence overwrites it). The adapter must already be folded
    /// into the sequence's hashes: the manager shares blocks by hash alone.
    pub fn set_adapter(&mut self, seq: SeqId, adapter: Option<Arc<str>>) {
        let i = seq.0 as usize;
        if self.seq_adapters.len() <= i {
            if adapter.is_none() {
                return;
            }
            self.seq_adapters.resize(i + 1, None);
        }
        self.seq_adapters[i] = adapter;
    }

    /// The adapter `seq` runs under (`None`: the base model).
    fn adapter_of(&self, seq: SeqId) -> Option<Arc<str>> {
        self.seq_adapters.get(seq.0 as usize).cloned().flatten()
    }

    /// The blocks `seq` holds, in prompt order.
    pub fn seq_blocks(&self, seq: SeqId) -> &[BlockId] {
        self.tables
            .get(seq.0 as usize)
            .map_or(&[], |t| t.as_slice())
    }

    /// What `seq`'s table holds after its first `prefix` blocks, checked
    /// against `source` (the hashes a restore was asked to install): the
    /// restore's validation reads this, not the device's report alone.
    pub fn installed_after(
        &self,
        seq: SeqId,
        prefix: usize,
        source: &[SequenceHash],
    ) -> InstalledTable {
        let after = self.seq_blocks(seq).get(prefix..).unwrap_or(&[]);
        let matches_source = after.len() <= source.len()
            && after
                .iter()
                .zip(source)
                .all(|(&block, &hash)| self.blocks[block as usize].hash == Some(hash));
        InstalledTable {
            blocks: after.len(),
            matches_source,
        }
    }

    /// Moves the buffered events into `out` (appending).
    pub fn drain_events_into(&mut self, out: &mut Vec<KvEvent>) {
        out.append(&mut self.events);
    }

    /// Number of leading `hashes` cached on the device.
    pub fn lookup_prefix(&self, hashes: &[SequenceHash]) -> usize {
        hashes
            .iter()
            .take_while(|h| self.cached.contains_key(h))
            .count()
    }

    /// Number of leading `hashes` present in the host tier.
    pub fn lookup_host(&self, hashes: &[SequenceHash]) -> usize {
        match &self.host {
            None => 0,
            Some(host) => hashes
                .iter()
                .take_while(|h| host.entries.contains_key(h))
                .count(),
        }
    }

    /// Pins host blocks `hashes` (those present) against eviction.
    pub fn pin_host(&mut self, hashes: &[SequenceHash]) -> HostPins {
        let mut pins = Vec::new();
        if let Some(host) = &self.host {
            for h in hashes {
                if let Some(entry) = host.entries.get(h) {
                    entry.pin.fetch_add(1, Ordering::Relaxed);
                    pins.push(Arc::clone(&entry.pin));
                }
            }
        }
        HostPins { pins }
    }

    /// Appends the cached blocks `hashes` to `seq`'s table, taking a
    /// reference on each. Precondition: each is cached ([`Self::lookup_prefix`]).
    pub fn acquire_prefix(&mut self, seq: SeqId, hashes: &[SequenceHash]) {
        for h in hashes {
            let block = *self
                .cached
                .get(h)
                .expect("acquire_prefix is called only with hashes lookup_prefix found");
            self.take_ref(block);
            self.table_mut(seq).push(block);
        }
    }

    /// Grows `seq`'s table to `total_blocks` blocks, all or nothing. Returns
    /// the number of blocks added, or `None` when the pool is dry.
    pub fn reserve(&mut self, seq: SeqId, total_blocks: usize) -> Option<usize> {
        let have = self.seq_blocks(seq).len();
        let need = total_blocks.saturating_sub(have);
        if need > self.free_blocks() {
            return None;
        }
        for _ in 0..need {
            let block = self.alloc_block().expect("free blocks were counted above");
            self.table_mut(seq).push(block);
        }
        Some(need)
    }

    /// Releases `seq`'s blocks beyond the first `keep`, tail first. Returns
    /// how many were released.
    pub fn truncate(&mut self, seq: SeqId, keep: usize) -> usize {
        let Some(table) = self.tables.get_mut(seq.0 as usize) else {
            return 0;
        };
        if table.len() <= keep {
            return 0;
        }
        let tail: Vec<BlockId> = table.drain(keep..).rev().collect();
        for &block in &tail {
            self.drop_ref(block, true);
        }
        tail.len()
    }

    /// Releases every block of `seq`, tail first. With `cache`, cached blocks
    /// stay cached (evictable); without it, a cached block whose last
    /// reference this was is removed from the cache.
    pub fn release(&mut self, seq: SeqId, cache: bool) -> usize {
        let Some(table) = self.tables.get_mut(seq.0 as usize) else {
            return 0;
        };
        let blocks = std::mem::take(table);
        for &block in blocks.iter().rev() {
            self.drop_ref(block, cache);
        }
        // Keep the allocation for the slot's next sequence.
        let n = blocks.len();
        let mut blocks = blocks;
        blocks.clear();
        self.tables[seq.0 as usize] = blocks;
        n
    }

    /// Caches `seq`'s blocks `first..first + hashes.len()`, which have just
    /// been filled with `tokens` (`block_size` per block). `parent` is the
    /// hash of block `first - 1`. A hash already cached on another block
    /// switches the table to that block. Emits one `BlockStored` per run of
    /// newly cached blocks.
    pub fn commit(
        &mut self,
        seq: SeqId,
        first: usize,
        parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
        tokens: &[u32],
    ) {
        let bs = self.config.block_size;
        debug_assert_eq!(tokens.len(), hashes.len() * bs);
        let adapter = self.adapter_of(seq);
        let mut run_start: Option<usize> = None;
        let mut prev = parent;
        for (i, &hash) in hashes.iter().enumerate() {
            let slot = first + i;
            let own = self.tables[seq.0 as usize][slot];
            match self.cached.get(&hash).copied() {
                Some(existing) if existing == own => {
                    self.flush_run(&mut run_start, i, parent, hashes, tokens, &adapter);
                }
                Some(existing) => {
                    self.flush_run(&mut run_start, i, parent, hashes, tokens, &adapter);
                    self.take_ref(existing);
                    self.tables[seq.0 as usize][slot] = existing;
                    self.drop_ref(own, true);
                }
                None => {
                    let b = &mut self.blocks[own as usize];
                    debug_assert!(b.hash.is_none());
                    b.hash = Some(hash);
                    b.parent = prev;
                    let dst = own as usize * bs;
                    self.tokens[dst..dst + bs].copy_from_slice(&tokens[i * bs..(i + 1) * bs]);
                    self.cached.insert(hash, own);
                    self.block_adapters[own as usize].clone_from(&adapter);
                    run_start.get_or_insert(i);
                }
            }
            prev = Some(hash);
        }
        self.flush_run(
            &mut run_start,
            hashes.len(),
            parent,
            hashes,
            tokens,
            &adapter,
        );
    }

    /// Installs host-tier blocks `hashes` as the next blocks of `seq` (they
    /// follow `parent`), copying them to device blocks. Blocks meanwhile
    /// cached on the device are shared instead. Returns the blocks installed.
    pub fn restore_from_host(
        &mut self,
        seq: SeqId,
        parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
    ) -> Result<usize, NoCapacity> {
        let tokens: Vec<Box<[u32]>> = hashes
            .iter()
            .map_while(|h| self.host.as_ref()?.entries.get(h).map(|e| e.tokens.clone()))
            .collect();
        let tokens: Vec<&[u32]> = tokens.iter().map(|t| &t[..]).collect();
        self.install(seq, parent, &hashes[..tokens.len()], &tokens)
    }

    /// Installs blocks another engine handed over (a rendezvous: `hashes`
    /// with `tokens`, `block_size` per block) as the next blocks of `seq`,
    /// following `parent`. Blocks already cached here are shared instead.
    /// Returns the blocks installed.
    pub fn restore_from_blocks(
        &mut self,
        seq: SeqId,
        parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
        tokens: &[u32],
    ) -> Result<usize, NoCapacity> {
        let bs = self.config.block_size;
        let per_block: Vec<&[u32]> = tokens.chunks_exact(bs).take(hashes.len()).collect();
        self.install(seq, parent, &hashes[..per_block.len()], &per_block)
    }

    fn install(
        &mut self,
        seq: SeqId,
        parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
        tokens: &[&[u32]],
    ) -> Result<usize, NoCapacity> {
        let fresh = hashes
            .iter()
            .filter(|h| !self.cached.contains_key(h))
            .count();
        if fresh > self.free_blocks() {
            return Err(NoCapacity {
                needed: fresh,
                free: self.free_blocks(),
            });
        }
        let bs = self.config.block_size;
        let adapter = self.adapter_of(seq);
        let mut stored_hashes = Vec::new();
        let mut stored_tokens = Vec::new();
        let mut run_parent = parent;
        let mut prev = parent;
        for (&hash, &block_tokens) in hashes.iter().zip(tokens) {
            if let Some(&existing) = self.cached.get(&hash) {
                self.emit_stored(run_parent, &mut stored_hashes, &mut stored_tokens, &adapter);
                self.take_ref(existing);
                self.table_mut(seq).push(existing);
                run_parent = Some(hash);
            } else {
                let block = self.alloc_block().expect("capacity was checked above");
                let b = &mut self.blocks[block as usize];
                b.hash = Some(hash);
                b.parent = prev;
                b.ref_count = 1;
                let dst = block as usize * bs;
                self.tokens[dst..dst + bs].copy_from_slice(block_tokens);
                self.cached.insert(hash, block);
                self.block_adapters[block as usize].clone_from(&adapter);
                self.table_mut(seq).push(block);
                stored_hashes.push(hash);
                stored_tokens.extend_from_slice(block_tokens);
            }
            prev = Some(hash);
        }
        self.emit_stored(run_parent, &mut stored_hashes, &mut stored_tokens, &adapter);
        Ok(hashes.len().min(tokens.len()))
    }

    /// Takes a reference on each block of the leading run of `hashes` the
    /// device caches, so none is evicted until [`Self::unpin_blocks`]
    /// gives them back (a capture lease holds them). Returns the blocks.
    pub fn pin_cached_prefix(&mut self, hashes: &[SequenceHash]) -> Vec<BlockId> {
        let blocks: Vec<BlockId> = hashes
            .iter()
            .map_while(|h| self.cached.get(h).copied())
            .collect();
        for &block in &blocks {
            self.take_ref(block);
        }
        blocks
    }

    /// Gives back the references [`Self::pin_cached_prefix`] took; the
    /// blocks stay cached (onto the LRU once nothing else holds them).
    pub fn unpin_blocks(&mut self, blocks: &[BlockId]) {
        for &block in blocks.iter().rev() {
            self.drop_ref(block, true);
        }
    }

    /// The tokens of a cached block (what a transfer copies).
    pub fn block_tokens(&self, block: BlockId) -> &[u32] {
        let bs = self.config.block_size;
        let start = block as usize * bs;
        &self.tokens[start..start + bs]
    }

    /// Drops every cached block of both tiers, as vLLM's prefix-cache reset
    /// does; refused (returns `false`) while any block is referenced.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.used_blocks() > 0 {
            return false;
        }
        while self.lru_head != NIL {
            let block = self.lru_head;
            self.lru_unlink(block);
            let b = &mut self.blocks[block as usize];
            b.hash = None;
            b.parent = None;
            self.block_adapters[block as usize] = None;
            self.empty.push(block);
        }
        self.cached.clear();
        if let Some(host) = &mut self.host {
            host.entries.clear();
            host.order.clear();
        }
        self.push_event(KvEvent::AllBlocksCleared);
        true
    }

    fn table_mut(&mut self, seq: SeqId) -> &mut Vec<BlockId> {
        let i = seq.0 as usize;
        if self.tables.len() <= i {
            self.tables.resize_with(i + 1, Vec::new);
        }
        &mut self.tables[i]
    }

    fn take_ref(&mut self, block: BlockId) {
        if self.blocks[block as usize].ref_count == 0 && self.blocks[block as usize].on_lru {
            self.lru_unlink(block);
        }
        self.blocks[block as usize].ref_count += 1;
    }

    fn drop_ref(&mut self, block: BlockId, cache: bool) {
        let b = &mut self.blocks[block as usize];
        debug_assert!(
            b.ref_count > 0,
            "block {block} released more often than taken"
        );
        b.ref_count -= 1;
        if b.ref_count > 0 {
            return;
        }
        match b.hash {
            Some(_) if cache => self.lru_push_back(block),
            Some(hash) => {
                b.hash = None;
                b.parent = None;
                self.cached.remove(&hash);
                self.block_adapters[block as usize] = None;
                self.push_event(KvEvent::BlockRemoved {
                    block_hashes: vec![engine_hash(hash)],
                    medium: Medium::Device,
                });
                self.empty.push(block);
            }
            None => self.empty.push(block),
        }
    }

    fn alloc_block(&mut self) -> Option<BlockId> {
        if let Some(block) = self.empty.pop() {
            self.blocks[block as usize].ref_count = 1;
            return Some(block);
        }
        let block = self.lru_head;
        if block == NIL {
            return None;
        }
        self.lru_unlink(block);
        let b = &mut self.blocks[block as usize];
        let hash = b.hash.take().expect("blocks on the LRU list are cached");
        let parent = b.parent.take();
        b.ref_count = 1;
        self.cached.remove(&hash);
        let adapter = self.block_adapters[block as usize].take();
        self.counters.device_evictions += 1;
        self.push_event(KvEvent::BlockRemoved {
            block_hashes: vec![engine_hash(hash)],
            medium: Medium::Device,
        });
        if self.host.is_some() {
            let bs = self.config.block_size;
            let src = block as usize * bs;
            let tokens: Box<[u32]> = self.tokens[src..src + bs].into();
            self.spill(hash, parent, tokens, adapter);
        }
        Some(block)
    }

    fn spill(
        &mut self,
        hash: SequenceHash,
        parent: Option<SequenceHash>,
        tokens: Box<[u32]>,
        adapter: Option<Arc<str>>,
    ) {
        let block_size = self.config.block_size as u32;
        let Some(host) = &mut self.host else { return };
        host.clock += 1;
        let stamp = host.clock;
        if let Some(entry) = host.entries.get_mut(&hash) {
            host.order.remove(&entry.stamp);
            entry.stamp = stamp;
            host.order.insert(stamp, hash);
            return;
        }
        let mut removed = None;
        if host.entries.len() >= host.capacity {
            let victim = host
                .order
                .iter()
                .find(|(_, h)| host.entries[h].pin.load(Ordering::Relaxed) == 0)
                .map(|(&s, &h)| (s, h));
            match victim {
                Some((s, h)) => {
                    host.order.remove(&s);
                    host.entries.remove(&h);
                    removed = Some(h);
                }
                None => {
                    self.counters.host_spills_dropped += 1;
                    return;
                }
            }
        }
        let event_tokens = tokens.to_vec();
        host.entries.insert(
            hash,
            HostEntry {
                tokens,
                pin: Arc::new(AtomicU32::new(0)),
                stamp,
            },
        );
        host.order.insert(stamp, hash);
        if let Some(h) = removed {
            self.counters.host_evictions += 1;
            self.push_event(KvEvent::BlockRemoved {
                block_hashes: vec![engine_hash(h)],
                medium: Medium::Host,
            });
        }
        self.counters.host_spills += 1;
        self.push_event(KvEvent::BlockStored {
            block_hashes: vec![engine_hash(hash)],
            parent_block_hash: parent.map(engine_hash),
            token_ids: event_tokens,
            block_size,
            medium: Medium::Host,
            lora_name: adapter,
        });
    }

    fn flush_run(
        &mut self,
        run_start: &mut Option<usize>,
        end: usize,
        parent: Option<SequenceHash>,
        hashes: &[SequenceHash],
        tokens: &[u32],
        adapter: &Option<Arc<str>>,
    ) {
        let Some(start) = run_start.take() else {
            return;
        };
        if !self.config.emit_events {
            return;
        }
        let bs = self.config.block_size;
        let run_parent = if start == 0 {
            parent
        } else {
            Some(hashes[start - 1])
        };
        let event = KvEvent::BlockStored {
            block_hashes: hashes[start..end].iter().map(|&h| engine_hash(h)).collect(),
            parent_block_hash: run_parent.map(engine_hash),
            token_ids: tokens[start * bs..end * bs].to_vec(),
            block_size: bs as u32,
            medium: Medium::Device,
            lora_name: adapter.clone(),
        };
        self.push_event(event);
    }

    fn emit_stored(
        &mut self,
        parent: Option<SequenceHash>,
        hashes: &mut Vec<SequenceHash>,
        tokens: &mut Vec<u32>,
        adapter: &Option<Arc<str>>,
    ) {
        if hashes.is_empty() {
            return;
        }
        let event = KvEvent::BlockStored {
            block_hashes: hashes.iter().map(|&h| engine_hash(h)).collect(),
            parent_block_hash: parent.map(engine_hash),
            token_ids: std::mem::take(tokens),
            block_size: self.config.block_size as u32,
            medium: Medium::Device,
            lora_name: adapter.clone(),
        };
        hashes.clear();
        self.push_event(event);
    }

    /// Buffers an event (dropped and counted when the buffer is full; not
    /// at all when events are off).
    pub(crate) fn push_event(&mut self, event: KvEvent) {
        if !self.config.emit_events {
            return;
        }
        if self.events.len() >= self.config.max_buffered_events {
            self.counters.events_dropped += 1;
            return;
        }
        self.events.push(event);
    }

    fn lru_push_back(&mut self, block: BlockId) {
        let tail = self.lru_tail;
        {
            let b = &mut self.blocks[block as usize];
            b.prev = tail;
            b.next = NIL;
            b.on_lru = true;
        }
        if tail == NIL {
            self.lru_head = block;
        } else {
            self.blocks[tail as usize].next = block;
        }
        self.lru_tail = block;
        self.lru_len += 1;
    }

    fn lru_unlink(&mut self, block: BlockId) {
        let (prev, next) = {
            let b = &mut self.blocks[block as usize];
            debug_assert!(b.on_lru);
            b.on_lru = false;
            (
                std::mem::replace(&mut b.prev, NIL),
                std::mem::replace(&mut b.next, NIL),
            )
        };
        if prev == NIL {
            self.lru_head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.lru_tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        self.lru_len -= 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::hashing::{local_block_hashes, sequence_hashes, DEFAULT_SEED};

    fn manager(num_blocks: usize, host_blocks: usize) -> BlockManager {
        BlockManager::new(KvConfig {
            block_size: 4,
            num_blocks,
            host_blocks,
            ..KvConfig::default()
        })
    }

    fn hashes(tokens: &[u32]) -> Vec<SequenceHash> {
        sequence_hashes(&local_block_hashes(tokens, 4, DEFAULT_SEED))
    }

    fn fill(kv: &mut BlockManager, seq: SeqId, tokens: &[u32]) -> Vec<SequenceHash> {
        let h = hashes(tokens);
        assert_eq!(kv.reserve(seq, h.len()), Some(h.len()));
        kv.commit(seq, 0, None, &h, tokens);
        h
    }

    #[test]
    fn a_released_sequence_leaves_its_blocks_cached_and_free() {
        let mut kv = manager(8, 0);
        let tokens: Vec<u32> = (0..12).collect();
        let h = fill(&mut kv, SeqId(0), &tokens);
        assert_eq!(kv.used_blocks(), 3);
        kv.release(SeqId(0), true);
        assert_eq!(kv.free_blocks(), 8);
        assert_eq!(kv.lookup_prefix(&h), 3);
    }

    #[test]
    fn eviction_takes_tail_blocks_before_their_prefixes() {
        let mut kv = manager(3, 0);
        let tokens: Vec<u32> = (0..12).collect();
        let h = fill(&mut kv, SeqId(0), &tokens);
        kv.release(SeqId(0), true);
        assert_eq!(kv.reserve(SeqId(1), 1), Some(1));
        assert_eq!(kv.lookup_prefix(&h), 2, "the tail went first");
        assert_eq!(kv.reserve(SeqId(1), 2), Some(1));
        assert_eq!(kv.lookup_prefix(&h), 1);
    }

    #[test]
    fn a_duplicate_block_is_shared_not_cached_twice() {
        let mut kv = manager(8, 0);
        let tokens: Vec<u32> = (0..8).collect();
        fill(&mut kv, SeqId(0), &tokens);
        fill(&mut kv, SeqId(1), &tokens);
        assert_eq!(kv.cached_blocks(), 2);
        assert_eq!(kv.used_blocks(), 2);
        assert_eq!(kv.seq_blocks(SeqId(0)), kv.seq_blocks(SeqId(1)));
    }

    #[test]
    fn a_dry_pool_reserves_nothing() {
        let mut kv = manager(2, 0);
        assert_eq!(kv.reserve(SeqId(0), 3), None);
        assert_eq!(kv.seq_blocks(SeqId(0)).len(), 0);
        assert_eq!(kv.free_blocks(), 2);
    }

    #[test]
    fn evicted_blocks_spill_to_the_host_tier_and_come_back() {
        let mut kv = manager(2, 4);
        let tokens: Vec<u32> = (0..8).collect();
        let h = fill(&mut kv, SeqId(0), &tokens);
        kv.release(SeqId(0), true);
        assert_eq!(kv.reserve(SeqId(1), 2), Some(2));
        assert_eq!(kv.lookup_prefix(&h), 0);
        assert_eq!(kv.lookup_host(&h), 2);
        kv.release(SeqId(1), true);
        assert_eq!(kv.restore_from_host(SeqId(2), None, &h), Ok(2));
        assert_eq!(kv.lookup_prefix(&h), 2);
    }

    #[test]
    fn an_adapters_blocks_name_it_when_stored_spilled_and_restored() {
        let mut kv = manager(2, 4);
        let tokens: Vec<u32> = (0..8).collect();
        kv.set_adapter(SeqId(0), Some("sql".into()));
        let h = fill(&mut kv, SeqId(0), &tokens);
        kv.release(SeqId(0), true);
        // A base sequence in the same slot later names no adapter.
        kv.set_adapter(SeqId(0), None);
        assert_eq!(
            kv.reserve(SeqId(0), 2),
            Some(2),
            "evicts sql's blocks to the host"
        );
        kv.release(SeqId(0), false);
        kv.set_adapter(SeqId(1), Some("sql".into()));
        assert_eq!(kv.restore_from_host(SeqId(1), None, &h), Ok(2));
        let mut events = Vec::new();
        kv.drain_events_into(&mut events);
        let stored: Vec<(Medium, usize, Option<&str>)> = events
            .iter()
            .filter_map(|e| match e {
                KvEvent::BlockStored {
                    block_hashes,
                    medium,
                    lora_name,
                    ..
                } => Some((*medium, block_hashes.len(), lora_name.as_deref())),
                _ => None,
            })
            .collect();
        assert_eq!(
            stored,
            vec![
                (Medium::Device, 2, Some("sql")),
                (Medium::Host, 1, Some("sql")),
                (Medium::Host, 1, Some("sql")),
                (Medium::Device, 2, Some("sql")),
            ]
        );
    }

    #[test]
    fn pinned_host_blocks_survive_host_pressure_until_unpinned() {
        let mut kv = manager(1, 1);
        let a: Vec<u32> = (0..4).collect();
        let b: Vec<u32> = (10..14).collect();
        let c: Vec<u32> = (20..24).collect();
        let ha = fill(&mut kv, SeqId(0), &a);
        kv.release(SeqId(0), true);
        fill(&mut kv, SeqId(1), &b);
        kv.release(SeqId(1), true);
        assert_eq!(kv.lookup_host(&ha), 1);
        let pins = kv.pin_host(&ha);
        fill(&mut kv, SeqId(2), &c);
        kv.release(SeqId(2), true);
        assert_eq!(kv.lookup_host(&ha), 1, "pinned: b's spill was dropped");
        assert_eq!(kv.counters().host_spills_dropped, 1);
        drop(pins);
        assert_eq!(kv.reserve(SeqId(3), 1), Some(1));
        assert_eq!(kv.lookup_host(&ha), 0, "unpinned: c's spill evicted a");
    }
}
