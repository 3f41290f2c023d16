//! Decoded KV events → [`IndexEvent`]s for one worker's stream.
//!
//! This lives in the wire crate, not the core: it is the one place that
//! knows both the engines' field semantics and the index's vocabulary, and
//! it stays pure (no I/O, no clock) so the subscriber, the simulator and
//! tests all run the same code.
//!
//! Rules, each skip counted by [`SkipReason`]:
//!
//! - **Router hashes.** Local hashes are recomputed from `token_ids` with the
//!   router's block size and seed (`seed_for(lora_name, cache_salt)`); the
//!   engine's hashes are only names for removals. An event with a `lora_id`
//!   but no `lora_name` is skipped: its seed is unknowable, and a base-model
//!   seed would claim hits the engine cannot serve.
//! - **Whole blocks only.** `token_ids.len()` must equal
//!   `block_hashes.len() × block_size`, and the event's `block_size` must be
//!   the router's. SGLang's partial last page fails this and is skipped
//!   (a partial block is not a block).
//! - **Device and host tiers.** `medium` maps to a [`Tier`]; device- and
//!   host-tier events are kept, each tagged with its [`CacheTier`] (the
//!   router keeps one index per tier, so a host-tier eviction never removes
//!   the device copy). Disk-tier stores and removals, those of a tier
//!   whose `locality` is `"REMOTE"` (not the worker's own), and unknown
//!   media, are skipped and counted. `AllBlocksCleared` carries no medium: it is
//!   tagged `Device` and clears every tier
//!   (`switchyard_core::index::TieredIndex`). A host-tier store without
//!   token ids (vLLM's offloading connector publishes its CPU blocks so,
//!   with no parent either) cannot be placed in a prefix and is skipped and
//!   counted as [`SkipReason::HostTierWithoutTokens`].
//! - **Full attention, and SSM checkpoints.** Hybrid models publish one
//!   group per cache spec (`group_idx`, `kv_cache_spec_kind`). Groups are
//!   learned from stores; a full-attention group describes a prefix (device
//!   or host tier as its medium says). A `"mamba"` group's stores are the
//!   block boundaries where the engine kept a sequence's SSM state: they go
//!   to the [`CacheTier::Checkpoint`] index, which limits how much of a
//!   hybrid worker's prefix the router credits — unless the normalizer was
//!   made [`Normalizer::attention_only`], which skips them like every other
//!   group (what an attention-only router sees). An event with no group is
//!   a single-group engine's and is kept; a group never described is kept
//!   until a full-attention group is known, then skipped.

use crate::kv_events::{BlockRemoved, BlockStored, KvEvent};
use switchyard_core::hashing::{local_block_hashes, seed_for};
use switchyard_core::index::{CacheTier, IndexEvent, StoredBlock};

/// Most distinct groups remembered per worker; real hybrid models have a
/// handful. Past the cap, events of new groups are skipped.
pub const MAX_GROUPS: usize = 64;

/// Where a cached block lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Tier {
    /// GPU memory (`"GPU"` or no `medium`).
    Device,
    /// CPU memory (`"CPU"`, `"CPU_PINNED"`).
    Host,
    /// Disk, storage or a remote pool (`"DISK"`, `"STORAGE"`, `"EXTERNAL"`).
    Disk,
}

impl Tier {
    /// The tier a `medium` string names; `None` for an unknown name.
    pub fn from_medium(medium: Option<&str>) -> Option<Tier> {
        match medium {
            None => Some(Tier::Device),
            Some(m) if m.eq_ignore_ascii_case("GPU") => Some(Tier::Device),
            Some(m) if m.eq_ignore_ascii_case("CPU") || m.eq_ignore_ascii_case("CPU_PINNED") => {
                Some(Tier::Host)
            }
            Some(m)
                if ["DISK", "STORAGE", "EXTERNAL"]
                    .iter()
                    .any(|d| m.eq_ignore_ascii_case(d)) =>
            {
                Some(Tier::Disk)
            }
            Some(_) => None,
        }
    }
}

/// Why an event did not reach the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// `token_ids.len() != block_hashes.len() × block_size`.
    TokenCountMismatch,
    /// One block's worth of hashes with fewer tokens than a block (a partial
    /// last page; SGLang trims its keys to whole pages before it stores
    /// them, so current releases do not send one).
    PartialBlock,
    /// The event's `block_size` is not the router's.
    BlockSizeMismatch,
    /// A `lora_id` without a `lora_name`: the hash seed is unknowable.
    LoraWithoutName,
    /// An event type this router does not know.
    UnknownEventType,
    /// A host-tier store without token ids, as vLLM's offloading
    /// connector sends (filtered, not malformed): nothing places its
    /// blocks in a prefix.
    HostTierWithoutTokens,
    /// A disk-tier store or removal (filtered, not malformed).
    DiskTier,
    /// A `medium` string no engine is known to send.
    UnknownMedium,
    /// A group other than full attention (filtered, not malformed).
    NonFullAttentionGroup,
    /// More than [`MAX_GROUPS`] groups.
    TooManyGroups,
}

impl SkipReason {
    /// Every reason, for metrics that export zeros too.
    pub const ALL: [SkipReason; 10] = [
        SkipReason::TokenCountMismatch,
        SkipReason::PartialBlock,
        SkipReason::BlockSizeMismatch,
        SkipReason::LoraWithoutName,
        SkipReason::UnknownEventType,
        SkipReason::HostTierWithoutTokens,
        SkipReason::DiskTier,
        SkipReason::UnknownMedium,
        SkipReason::NonFullAttentionGroup,
        SkipReason::TooManyGroups,
    ];

    /// Stable label for `switchyard_kv_events_dropped_total{reason}`.
    pub const fn as_str(self) -> &'static str {
        match self {
            SkipReason::TokenCountMismatch => "token_count_mismatch",
            SkipReason::PartialBlock => "partial_block",
            SkipReason::BlockSizeMismatch => "block_size_mismatch",
            SkipReason::LoraWithoutName => "lora_without_name",
            SkipReason::UnknownEventType => "unknown_event_type",
            SkipReason::HostTierWithoutTokens => "host_tier_without_tokens",
            SkipReason::DiskTier => "disk_tier",
            SkipReason::UnknownMedium => "unknown_medium",
            SkipReason::NonFullAttentionGroup => "non_full_attention_group",
            SkipReason::TooManyGroups => "too_many_groups",
        }
    }

    /// Whether the event was bad input (as opposed to deliberately filtered).
    pub fn is_malformed(self) -> bool {
        !matches!(
            self,
            SkipReason::HostTierWithoutTokens
                | SkipReason::DiskTier
                | SkipReason::NonFullAttentionGroup
        )
    }
}

/// What became of one event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Normalized {
    /// Apply this to the index of this tier.
    Index(CacheTier, IndexEvent),
    /// Skipped, for this reason.
    Skipped(SkipReason),
}

/// What a hybrid model's cache group holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum GroupKind {
    /// Full attention (MLA included): a prefix's KV.
    FullAttention,
    /// An SSM's (Mamba's) states at block boundaries.
    Ssm,
    /// Anything else (sliding windows, chunked local attention, ...).
    Other,
}

impl GroupKind {
    /// vLLM's `KVCacheSpecKind` values: `"full_attention"`,
    /// `"mla_attention"`, `"sink_full_attention"` are full attention;
    /// `"mamba"` is an SSM; `"sliding_window"`, `"sliding_window_mla"`,
    /// `"chunked_local_attention"`, ... are neither.
    fn of(kind: &str) -> GroupKind {
        let kind = kind.to_ascii_lowercase();
        if kind.contains("mamba") {
            GroupKind::Ssm
        } else if kind.contains("full") || kind == "mla_attention" {
            GroupKind::FullAttention
        } else {
            GroupKind::Other
        }
    }
}

/// Counters of one normalizer; they only grow.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NormalizeCounters {
    /// `BlockStored` events turned into index events.
    pub stored: u64,
    /// `BlockRemoved` events turned into index events.
    pub removed: u64,
    /// `AllBlocksCleared` events.
    pub cleared: u64,
    /// Of `stored` and `removed`, the host tier's.
    pub host: u64,
    /// Of `stored` and `removed`, the SSM-checkpoint tier's.
    pub checkpoint: u64,
    /// Skipped events, indexed like [`SkipReason::ALL`].
    pub skipped: [u64; SkipReason::ALL.len()],
}

impl NormalizeCounters {
    /// Events skipped for `reason`.
    pub fn skipped(&self, reason: SkipReason) -> u64 {
        self.skipped[reason as usize]
    }
}

/// Normalizes one worker's event stream. Keeps what it learns about the
/// worker's groups, so use one per worker (data-parallel rank).
#[derive(Clone, Debug)]
pub struct Normalizer {
    block_size: u32,
    /// Whether SSM-group events reach the checkpoint tier.
    ssm_checkpoints: bool,
    /// Each group's kind, learned from stores; at most [`MAX_GROUPS`]
    /// entries.
    groups: Vec<(i64, GroupKind)>,
    counters: NormalizeCounters,
}

impl Normalizer {
    /// A normalizer for a router hashing `block_size`-token blocks.
    pub fn new(block_size: u32) -> Self {
        Self {
            block_size,
            ssm_checkpoints: true,
            groups: Vec::new(),
            counters: NormalizeCounters::default(),
        }
    }

    /// A normalizer that skips SSM-checkpoint groups too: the view of a
    /// router that credits a hybrid worker's whole attention prefix.
    pub fn attention_only(block_size: u32) -> Self {
        Self {
            ssm_checkpoints: false,
            ..Self::new(block_size)
        }
    }

    /// The router block size this normalizer checks against.
    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// Counters so far.
    pub fn counters(&self) -> &NormalizeCounters {
        &self.counters
    }

    /// Normalizes one event, counting the outcome.
    pub fn normalize(&mut self, event: &KvEvent) -> Normalized {
        let outcome = match event {
            KvEvent::BlockStored(stored) => self.stored(stored),
            KvEvent::BlockRemoved(removed) => self.removed(removed),
            KvEvent::AllBlocksCleared => Ok((CacheTier::Device, IndexEvent::Cleared)),
            KvEvent::Unknown { .. } => Err(SkipReason::UnknownEventType),
        };
        match outcome {
            Ok((tier, index_event)) => {
                match &index_event {
                    IndexEvent::Stored { .. } => self.counters.stored += 1,
                    IndexEvent::Removed { .. } => self.counters.removed += 1,
                    IndexEvent::Cleared => self.counters.cleared += 1,
                }
                match tier {
                    CacheTier::Host => self.counters.host += 1,
                    CacheTier::Checkpoint => self.counters.checkpoint += 1,
                    CacheTier::Device => {}
                }
                Normalized::Index(tier, index_event)
            }
            Err(reason) => {
                self.counters.skipped[reason as usize] += 1;
                Normalized::Skipped(reason)
            }
        }
    }

    fn stored(&mut self, stored: &BlockStored) -> Result<(CacheTier, IndexEvent), SkipReason> {
        let mut tier = check_tier(stored.medium.as_deref(), stored.locality.as_deref())?;
        if tier == CacheTier::Host && stored.token_ids.is_empty() && !stored.block_hashes.is_empty()
        {
            return Err(SkipReason::HostTierWithoutTokens);
        }
        if self.check_group(stored.group_idx, stored.kv_cache_spec_kind.as_deref())?
            == GroupKind::Ssm
        {
            tier = checkpoint_tier(tier)?;
        }
        if stored.lora_id.is_some() && stored.lora_name.is_none() {
            return Err(SkipReason::LoraWithoutName);
        }
        if stored.block_size != self.block_size {
            return Err(SkipReason::BlockSizeMismatch);
        }
        let block_size = self.block_size as usize;
        let blocks = stored.block_hashes.len();
        let expected = blocks.checked_mul(block_size);
        if expected != Some(stored.token_ids.len()) {
            return Err(if blocks == 1 && stored.token_ids.len() < block_size {
                SkipReason::PartialBlock
            } else {
                SkipReason::TokenCountMismatch
            });
        }
        let seed = seed_for(stored.lora_name.as_deref(), stored.cache_salt.as_deref());
        let local = local_block_hashes(&stored.token_ids, block_size, seed);
        let event = IndexEvent::Stored {
            parent: stored.parent_block_hash,
            blocks: stored
                .block_hashes
                .iter()
                .zip(local)
                .map(|(&engine_hash, local_hash)| StoredBlock {
                    engine_hash,
                    local_hash,
                })
                .collect(),
        };
        Ok((tier, event))
    }

    fn removed(&mut self, removed: &BlockRemoved) -> Result<(CacheTier, IndexEvent), SkipReason> {
        let mut tier = check_tier(removed.medium.as_deref(), removed.locality.as_deref())?;
        if self.check_group(removed.group_idx, None)? == GroupKind::Ssm {
            tier = checkpoint_tier(tier)?;
        }
        let event = IndexEvent::Removed {
            blocks: removed.block_hashes.clone(),
        };
        Ok((tier, event))
    }

    /// The kind of the group an event names (learning it from a store's
    /// `kind`), or why its events are skipped. An event without a group is
    /// a single-group engine's: full attention.
    fn check_group(
        &mut self,
        group_idx: Option<i64>,
        kind: Option<&str>,
    ) -> Result<GroupKind, SkipReason> {
        let Some(group) = group_idx else {
            return Ok(GroupKind::FullAttention);
        };
        if let Some(kind) = kind {
            let kind = GroupKind::of(kind);
            let known = self.groups.len();
            match self.groups.iter_mut().find(|(g, _)| *g == group) {
                Some(entry) => entry.1 = kind,
                None if known >= MAX_GROUPS => return Err(SkipReason::TooManyGroups),
                None => self.groups.push((group, kind)),
            }
        }
        match self.groups.iter().find(|(g, _)| *g == group) {
            Some((_, GroupKind::FullAttention)) => Ok(GroupKind::FullAttention),
            Some((_, GroupKind::Ssm)) if self.ssm_checkpoints => Ok(GroupKind::Ssm),
            Some(_) => Err(SkipReason::NonFullAttentionGroup),
            None if self
                .groups
                .iter()
                .any(|(_, kind)| *kind == GroupKind::FullAttention) =>
            {
                Err(SkipReason::NonFullAttentionGroup)
            }
            None => Ok(GroupKind::FullAttention),
        }
    }
}

/// SSM checkpoints live on the device; one in another tier is not a
/// resumable state the router can credit (skipped as another group is).
fn checkpoint_tier(tier: CacheTier) -> Result<CacheTier, SkipReason> {
    match tier {
        CacheTier::Device => Ok(CacheTier::Checkpoint),
        _ => Err(SkipReason::NonFullAttentionGroup),
    }
}

/// The index tier of a `medium` at a `locality`, or why its events are
/// skipped. A `"REMOTE"` locality (vLLM 0.32: a tier held away from the
/// publishing engine, such as a shared pool) is not this worker's to
/// restore at its host tier's cost: skipped as a disk tier is.
fn check_tier(medium: Option<&str>, locality: Option<&str>) -> Result<CacheTier, SkipReason> {
    if locality.is_some_and(|l| l.eq_ignore_ascii_case("REMOTE")) {
        return Err(SkipReason::DiskTier);
    }
    match Tier::from_medium(medium) {
        Some(Tier::Device) => Ok(CacheTier::Device),
        Some(Tier::Host) => Ok(CacheTier::Host),
        Some(Tier::Disk) => Err(SkipReason::DiskTier),
        None => Err(SkipReason::UnknownMedium),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::hashing::DEFAULT_SEED;
    use switchyard_core::EngineHash;

    fn stored(hashes: &[u64], tokens: Vec<u32>) -> BlockStored {
        BlockStored {
            block_hashes: hashes.iter().map(|&h| EngineHash(h)).collect(),
            token_ids: tokens,
            block_size: 4,
            medium: Some("GPU".into()),
            ..BlockStored::default()
        }
    }

    fn store_event(s: BlockStored) -> KvEvent {
        KvEvent::BlockStored(Box::new(s))
    }

    #[test]
    fn local_hashes_are_recomputed_from_token_ids_with_the_router_seed() {
        let mut n = Normalizer::new(4);
        let tokens: Vec<u32> = (0..8).collect();
        let mut event = stored(&[11, 12], tokens.clone());
        event.parent_block_hash = Some(EngineHash(10));
        let Normalized::Index(CacheTier::Device, IndexEvent::Stored { parent, blocks }) =
            n.normalize(&store_event(event))
        else {
            panic!("not stored")
        };
        assert_eq!(parent, Some(EngineHash(10)));
        let expected = local_block_hashes(&tokens, 4, DEFAULT_SEED);
        assert_eq!(blocks[0].engine_hash, EngineHash(11));
        assert_eq!(blocks[0].local_hash, expected[0]);
        assert_eq!(blocks[1].local_hash, expected[1]);
        assert_eq!(n.counters().stored, 1);
    }

    #[test]
    fn the_lora_name_and_cache_salt_fold_into_the_seed() {
        let mut n = Normalizer::new(4);
        let tokens: Vec<u32> = (0..4).collect();
        let mut event = stored(&[1], tokens.clone());
        event.lora_name = Some("adapter".into());
        event.cache_salt = Some("tenant".into());
        let Normalized::Index(CacheTier::Device, IndexEvent::Stored { blocks, .. }) =
            n.normalize(&store_event(event))
        else {
            panic!("not stored")
        };
        let seed = seed_for(Some("adapter"), Some("tenant"));
        assert_eq!(
            blocks[0].local_hash,
            local_block_hashes(&tokens, 4, seed)[0]
        );
    }

    #[test]
    fn a_partial_last_page_is_not_a_block() {
        let mut n = Normalizer::new(4);
        let out = n.normalize(&store_event(stored(&[1], vec![1, 2, 3])));
        assert_eq!(out, Normalized::Skipped(SkipReason::PartialBlock));
        let out = n.normalize(&store_event(stored(&[1, 2], vec![1, 2, 3, 4, 5])));
        assert_eq!(out, Normalized::Skipped(SkipReason::TokenCountMismatch));
        assert_eq!(n.counters().skipped(SkipReason::PartialBlock), 1);
        assert_eq!(n.counters().skipped(SkipReason::TokenCountMismatch), 1);
        assert!(SkipReason::PartialBlock.is_malformed());
    }

    #[test]
    fn an_engine_block_size_other_than_the_routers_is_skipped() {
        let mut n = Normalizer::new(16);
        let out = n.normalize(&store_event(stored(&[1], vec![1, 2, 3, 4])));
        assert_eq!(out, Normalized::Skipped(SkipReason::BlockSizeMismatch));
    }

    #[test]
    fn host_tier_events_are_kept_for_the_host_index_and_disk_tier_events_skipped() {
        let mut n = Normalizer::new(4);
        let tokens = vec![1, 2, 3, 4];
        let mut host = stored(&[1], tokens.clone());
        host.medium = Some("CPU_PINNED".into());
        host.parent_block_hash = Some(EngineHash(7));
        let Normalized::Index(CacheTier::Host, IndexEvent::Stored { parent, blocks }) =
            n.normalize(&store_event(host))
        else {
            panic!("not a host-tier store")
        };
        assert_eq!(parent, Some(EngineHash(7)));
        assert_eq!(
            blocks[0].local_hash,
            local_block_hashes(&tokens, 4, DEFAULT_SEED)[0]
        );
        let host_removal = KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(1)],
            medium: Some("cpu".into()),
            ..BlockRemoved::default()
        });
        assert_eq!(
            n.normalize(&host_removal),
            Normalized::Index(
                CacheTier::Host,
                IndexEvent::Removed {
                    blocks: vec![EngineHash(1)]
                }
            )
        );
        assert_eq!(
            (n.counters().stored, n.counters().removed, n.counters().host),
            (1, 1, 2)
        );
        let disk_removal = KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(1)],
            medium: Some("DISK".into()),
            ..BlockRemoved::default()
        });
        assert_eq!(
            n.normalize(&disk_removal),
            Normalized::Skipped(SkipReason::DiskTier)
        );
        let odd = KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(1)],
            medium: Some("TAPE".into()),
            ..BlockRemoved::default()
        });
        assert_eq!(
            n.normalize(&odd),
            Normalized::Skipped(SkipReason::UnknownMedium)
        );
        assert_eq!(Tier::from_medium(None), Some(Tier::Device));
        assert_eq!(Tier::from_medium(Some("STORAGE")), Some(Tier::Disk));
        assert_eq!(Tier::from_medium(Some("EXTERNAL")), Some(Tier::Disk));
        assert_eq!(Tier::from_medium(Some("CPU")), Some(Tier::Host));
    }

    #[test]
    fn a_host_tier_store_without_tokens_is_skipped_and_counted_as_filtered() {
        // vLLM's offloading connector: CPU blocks with no token ids, no
        // parent and (newer versions) block size 0.
        let mut n = Normalizer::new(4);
        let mut offloaded = stored(&[1, 2], vec![]);
        offloaded.medium = Some("CPU".into());
        offloaded.block_size = 0;
        assert_eq!(
            n.normalize(&store_event(offloaded)),
            Normalized::Skipped(SkipReason::HostTierWithoutTokens)
        );
        assert_eq!(n.counters().skipped(SkipReason::HostTierWithoutTokens), 1);
        assert!(!SkipReason::HostTierWithoutTokens.is_malformed());
        // On the device the same shape is bad input.
        let mut device = stored(&[1, 2], vec![]);
        device.block_size = 4;
        assert_eq!(
            n.normalize(&store_event(device)),
            Normalized::Skipped(SkipReason::TokenCountMismatch)
        );
    }

    #[test]
    fn only_the_full_attention_group_of_a_hybrid_model_reaches_the_index() {
        let mut n = Normalizer::new(4);
        let mut full = stored(&[1], vec![1, 2, 3, 4]);
        full.group_idx = Some(0);
        full.kv_cache_spec_kind = Some("full_attention".into());
        let mut window = stored(&[2], vec![1, 2, 3, 4]);
        window.group_idx = Some(1);
        window.kv_cache_spec_kind = Some("sliding_window".into());
        assert!(matches!(
            n.normalize(&store_event(full)),
            Normalized::Index(..)
        ));
        assert_eq!(
            n.normalize(&store_event(window)),
            Normalized::Skipped(SkipReason::NonFullAttentionGroup)
        );
        let removal = |group| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![EngineHash(9)],
                group_idx: Some(group),
                ..BlockRemoved::default()
            })
        };
        assert!(matches!(n.normalize(&removal(0)), Normalized::Index(..)));
        assert_eq!(
            n.normalize(&removal(1)),
            Normalized::Skipped(SkipReason::NonFullAttentionGroup)
        );
        // A group never described, once a full-attention group is known.
        assert_eq!(
            n.normalize(&removal(7)),
            Normalized::Skipped(SkipReason::NonFullAttentionGroup)
        );
    }

    #[test]
    fn a_mamba_groups_stores_and_removals_go_to_the_checkpoint_tier() {
        let mut full = stored(&[1, 2], vec![1, 2, 3, 4, 5, 6, 7, 8]);
        full.group_idx = Some(0);
        full.kv_cache_spec_kind = Some("full_attention".into());
        let mut ssm = stored(&[2], vec![5, 6, 7, 8]);
        ssm.parent_block_hash = Some(EngineHash(1));
        ssm.group_idx = Some(1);
        ssm.kv_cache_spec_kind = Some("mamba".into());
        let removal = KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(2)],
            group_idx: Some(1),
            ..BlockRemoved::default()
        });
        let mut n = Normalizer::new(4);
        assert!(matches!(
            n.normalize(&store_event(full.clone())),
            Normalized::Index(CacheTier::Device, _)
        ));
        let Normalized::Index(CacheTier::Checkpoint, IndexEvent::Stored { parent, blocks }) =
            n.normalize(&store_event(ssm.clone()))
        else {
            panic!("a mamba store is a checkpoint");
        };
        assert_eq!(parent, Some(EngineHash(1)));
        assert_eq!(blocks.len(), 1);
        assert!(matches!(
            n.normalize(&removal),
            Normalized::Index(CacheTier::Checkpoint, IndexEvent::Removed { .. })
        ));
        assert_eq!(n.counters().checkpoint, 2);
        // An attention-only router skips them like any other group.
        let mut n = Normalizer::attention_only(4);
        n.normalize(&store_event(full));
        assert_eq!(
            n.normalize(&store_event(ssm.clone())),
            Normalized::Skipped(SkipReason::NonFullAttentionGroup)
        );
        // A checkpoint said to be off the device is no resumable state.
        let mut n = Normalizer::new(4);
        ssm.medium = Some("CPU".into());
        assert_eq!(
            n.normalize(&store_event(ssm)),
            Normalized::Skipped(SkipReason::NonFullAttentionGroup)
        );
        // A windowed MLA group is not full attention.
        assert_eq!(GroupKind::of("sliding_window_mla"), GroupKind::Other);
        assert_eq!(GroupKind::of("mla_attention"), GroupKind::FullAttention);
    }

    #[test]
    fn events_without_group_information_are_kept() {
        let mut n = Normalizer::new(4);
        let removal = KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![EngineHash(9)],
            group_idx: Some(0),
            ..BlockRemoved::default()
        });
        assert!(matches!(n.normalize(&removal), Normalized::Index(..)));
        assert!(matches!(
            n.normalize(&store_event(stored(&[1], vec![1, 2, 3, 4]))),
            Normalized::Index(..)
        ));
    }

    #[test]
    fn the_group_table_is_bounded() {
        let mut n = Normalizer::new(4);
        for group in 0..MAX_GROUPS as i64 + 1 {
            let mut s = stored(&[1], vec![1, 2, 3, 4]);
            s.group_idx = Some(group);
            s.kv_cache_spec_kind = Some("sliding_window".into());
            n.normalize(&store_event(s));
        }
        assert_eq!(n.counters().skipped(SkipReason::TooManyGroups), 1);
    }

    #[test]
    fn a_lora_id_without_a_name_is_skipped() {
        let mut n = Normalizer::new(4);
        let mut s = stored(&[1], vec![1, 2, 3, 4]);
        s.lora_id = Some(3);
        assert_eq!(
            n.normalize(&store_event(s)),
            Normalized::Skipped(SkipReason::LoraWithoutName)
        );
    }

    #[test]
    fn clears_pass_through_and_unknown_types_are_counted() {
        let mut n = Normalizer::new(4);
        assert_eq!(
            n.normalize(&KvEvent::AllBlocksCleared),
            Normalized::Index(CacheTier::Device, IndexEvent::Cleared)
        );
        assert_eq!(
            n.normalize(&KvEvent::Unknown { tag: "New".into() }),
            Normalized::Skipped(SkipReason::UnknownEventType)
        );
        assert_eq!(n.counters().cleared, 1);
        for (i, reason) in SkipReason::ALL.iter().enumerate() {
            assert_eq!(*reason as usize, i);
        }
    }
}
