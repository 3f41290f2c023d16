//! The simulated engine's KV events as every consumer sees them: mapped
//! onto vLLM's wire shapes ([`to_wire`], what a sim-worker publishes over
//! ZMQ), and from there through the router's one normalizer
//! (`switchyard_wire::normalize`) into index events ([`EngineEventStream`],
//! what the fleet simulator and the core soak feed the router). The
//! simulator thus applies exactly what the server would receive from a
//! sim-worker, by the same code: device-tier events to the router's device
//! index, host-tier events (an engine with a host tier spills evicted
//! blocks into it) to its host index.

use switchyard_core::index::{CacheTier, IndexEvent};
use switchyard_engine::{KvEvent, Medium};
use switchyard_wire::kv_events::{self as wire, BlockRemoved, BlockStored};
use switchyard_wire::normalize::{NormalizeCounters, Normalized, Normalizer};

/// vLLM's medium name for an engine medium.
fn medium(m: Medium) -> Option<String> {
    Some(m.vllm_name().to_owned())
}

/// Maps engine events onto the wire's vLLM shapes (fields the engine does
/// not have stay absent). A LoRA adapter's blocks carry its name as
/// `lora_name`, as vLLM's do; `lora_id`, vLLM's deprecated integer id of
/// the adapter, stays absent (a simulated engine numbers no adapters).
pub fn to_wire(events: Vec<KvEvent>) -> Vec<wire::KvEvent> {
    events.into_iter().map(event_to_wire).collect()
}

fn event_to_wire(event: KvEvent) -> wire::KvEvent {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium: m,
            lora_name,
        } => wire::KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            medium: medium(m),
            lora_name: lora_name.map(|name| name.to_string()),
            ..BlockStored::default()
        })),
        KvEvent::BlockRemoved {
            block_hashes,
            medium: m,
        } => wire::KvEvent::BlockRemoved(BlockRemoved {
            block_hashes,
            medium: medium(m),
            ..BlockRemoved::default()
        }),
        // A hybrid model's SSM checkpoints, as vLLM publishes its mamba
        // cache group: group 1 of kind "mamba", on the device.
        KvEvent::CheckpointStored {
            block_hash,
            parent_block_hash,
            token_ids,
            block_size,
            lora_name,
        } => wire::KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: vec![block_hash],
            parent_block_hash,
            token_ids,
            block_size,
            medium: medium(Medium::Device),
            lora_name: lora_name.map(|name| name.to_string()),
            group_idx: Some(SSM_GROUP),
            kv_cache_spec_kind: Some("mamba".to_owned()),
            ..BlockStored::default()
        })),
        KvEvent::CheckpointRemoved { block_hashes } => wire::KvEvent::BlockRemoved(BlockRemoved {
            block_hashes,
            medium: medium(Medium::Device),
            group_idx: Some(SSM_GROUP),
            ..BlockRemoved::default()
        }),
        KvEvent::AllBlocksCleared => wire::KvEvent::AllBlocksCleared,
    }
}

/// The cache group a hybrid engine's SSM checkpoints are published under
/// (its attention blocks carry no group: a single-group engine's shape,
/// which the router reads as full attention).
pub const SSM_GROUP: i64 = 1;

/// One engine's KV events into index events, through the normalizer a
/// router's subscriber runs for that engine's stream.
#[derive(Clone, Debug)]
pub struct EngineEventStream {
    normalizer: Normalizer,
}

impl EngineEventStream {
    /// A stream for a router hashing `block_size`-token blocks.
    pub fn new(block_size: u32) -> Self {
        Self {
            normalizer: Normalizer::new(block_size),
        }
    }

    /// A stream for a router that ignores SSM checkpoints (credits a
    /// hybrid worker's whole attention prefix).
    pub fn attention_only(block_size: u32) -> Self {
        Self {
            normalizer: Normalizer::attention_only(block_size),
        }
    }

    /// Appends the index events of `events` to `out`, each with the tier
    /// it is about (skipped events are counted, as the subscriber counts
    /// them).
    pub fn normalize(
        &mut self,
        events: impl IntoIterator<Item = KvEvent>,
        out: &mut Vec<(CacheTier, IndexEvent)>,
    ) {
        for event in events {
            if let Normalized::Index(tier, e) = self.normalizer.normalize(&event_to_wire(event)) {
                out.push((tier, e));
            }
        }
    }

    /// What the normalizer applied and skipped so far.
    pub fn counters(&self) -> &NormalizeCounters {
        self.normalizer.counters()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::hashing::{local_block_hashes, DEFAULT_SEED};
    use switchyard_core::index::StoredBlock;
    use switchyard_core::EngineHash;

    #[test]
    fn engine_events_map_onto_vllm_shapes_with_gpu_and_cpu_media() {
        let wire = to_wire(vec![
            KvEvent::BlockStored {
                block_hashes: vec![EngineHash(1), EngineHash(2)],
                parent_block_hash: Some(EngineHash(9)),
                token_ids: (0..32).collect(),
                block_size: 16,
                medium: Medium::Device,
                lora_name: None,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![EngineHash(1)],
                medium: Medium::Host,
            },
            KvEvent::AllBlocksCleared,
        ]);
        let wire::KvEvent::BlockStored(stored) = &wire[0] else {
            panic!("not stored")
        };
        assert_eq!(stored.block_hashes, vec![EngineHash(1), EngineHash(2)]);
        assert_eq!(stored.parent_block_hash, Some(EngineHash(9)));
        assert_eq!(stored.token_ids.len(), 32);
        assert_eq!(stored.medium.as_deref(), Some("GPU"));
        let wire::KvEvent::BlockRemoved(removed) = &wire[1] else {
            panic!("not removed")
        };
        assert_eq!(removed.medium.as_deref(), Some("CPU"));
        assert_eq!(wire[2], wire::KvEvent::AllBlocksCleared);
    }

    #[test]
    fn an_adapters_blocks_carry_its_name_and_index_under_its_seed() {
        let tokens: Vec<u32> = (0..32).collect();
        let adapter = || KvEvent::BlockStored {
            block_hashes: vec![EngineHash(1), EngineHash(2)],
            parent_block_hash: None,
            token_ids: tokens.clone(),
            block_size: 16,
            medium: Medium::Device,
            lora_name: Some("sql".into()),
        };
        let wire = to_wire(vec![adapter()]);
        let wire::KvEvent::BlockStored(stored) = &wire[0] else {
            panic!("not stored")
        };
        assert_eq!(stored.lora_name.as_deref(), Some("sql"));
        assert_eq!(stored.lora_id, None);

        let mut stream = EngineEventStream::new(16);
        let mut out = Vec::new();
        stream.normalize([adapter()], &mut out);
        let [(CacheTier::Device, IndexEvent::Stored { blocks, .. })] = &out[..] else {
            panic!("one device store expected, got {out:?}")
        };
        let locals: Vec<_> = blocks.iter().map(|b| b.local_hash).collect();
        let seed = switchyard_core::hashing::seed_for(Some("sql"), None);
        assert_eq!(locals, local_block_hashes(&tokens, 16, seed));
        assert_ne!(locals, local_block_hashes(&tokens, 16, DEFAULT_SEED));
    }

    #[test]
    fn device_and_host_tier_events_become_index_events_of_their_tier() {
        let mut stream = EngineEventStream::new(16);
        let tokens: Vec<u32> = (0..32).collect();
        let mut out = Vec::new();
        stream.normalize(
            [
                KvEvent::BlockStored {
                    block_hashes: vec![EngineHash(1), EngineHash(2)],
                    parent_block_hash: None,
                    token_ids: tokens.clone(),
                    block_size: 16,
                    medium: Medium::Device,
                    lora_name: None,
                },
                KvEvent::BlockStored {
                    block_hashes: vec![EngineHash(3)],
                    parent_block_hash: None,
                    token_ids: tokens[..16].to_vec(),
                    block_size: 16,
                    medium: Medium::Host,
                    lora_name: None,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![EngineHash(2)],
                    medium: Medium::Device,
                },
            ],
            &mut out,
        );
        let locals = local_block_hashes(&tokens, 16, DEFAULT_SEED);
        assert_eq!(
            out,
            vec![
                (
                    CacheTier::Device,
                    IndexEvent::Stored {
                        parent: None,
                        blocks: vec![
                            StoredBlock {
                                engine_hash: EngineHash(1),
                                local_hash: locals[0]
                            },
                            StoredBlock {
                                engine_hash: EngineHash(2),
                                local_hash: locals[1]
                            },
                        ],
                    }
                ),
                (
                    CacheTier::Host,
                    IndexEvent::Stored {
                        parent: None,
                        blocks: vec![StoredBlock {
                            engine_hash: EngineHash(3),
                            local_hash: locals[0]
                        }],
                    }
                ),
                (
                    CacheTier::Device,
                    IndexEvent::Removed {
                        blocks: vec![EngineHash(2)]
                    }
                ),
            ]
        );
        let counters = stream.counters();
        assert_eq!(
            (counters.stored, counters.removed, counters.host),
            (2, 1, 1)
        );
        assert_eq!(counters.skipped.iter().sum::<u64>(), 0);
    }
}
