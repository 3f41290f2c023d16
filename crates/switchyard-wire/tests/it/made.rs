//! Payloads made with vLLM 0.32's own event classes
//! (`tests/fixtures/made/`, see its README): the offloading connector's
//! CPU and storage tiers, which vLLM's CPU platform cannot run, decoded and
//! normalized as the subscriber does.

use std::path::PathBuf;
use switchyard_core::index::{CacheTier, IndexEvent};
use switchyard_core::EngineHash;
use switchyard_wire::kv_events::{decode_batch, Format, KvEvent, KvEventBatch};
use switchyard_wire::normalize::{Normalized, Normalizer, SkipReason};

fn made(name: &str) -> KvEventBatch {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/made")
        .join(name);
    let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let batch = decode_batch(&bytes, Format::Vllm).unwrap_or_else(|e| panic!("{name}: {e}"));
    let auto = decode_batch(&bytes, Format::Auto).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(batch.events.len(), auto.events.len(), "{name}");
    batch
}

fn normalized(batch: &KvEventBatch, normalizer: &mut Normalizer) -> Vec<Normalized> {
    batch
        .events
        .iter()
        .map(|e| normalizer.normalize(e))
        .collect()
}

#[test]
fn a_self_describing_cpu_store_lands_in_the_host_tier_on_the_devices_prefix() {
    let batch = made("vllm-0.32.0-offload-cpu.msgpack");
    let KvEvent::BlockStored(cpu) = &batch.events[1] else {
        panic!("{:?}", batch.events[1]);
    };
    assert_eq!(cpu.medium.as_deref(), Some("CPU"));
    assert_eq!(cpu.locality.as_deref(), Some("LOCAL"));
    assert_eq!((cpu.block_size, cpu.token_ids.len()), (32, 64));
    let mut normalizer = Normalizer::new(32);
    match &normalized(&batch, &mut normalizer)[..] {
        [Normalized::Index(
            CacheTier::Device,
            IndexEvent::Stored {
                parent: None,
                blocks: device,
            },
        ), Normalized::Index(
            CacheTier::Host,
            IndexEvent::Stored {
                parent: None,
                blocks: host,
            },
        ), Normalized::Index(CacheTier::Device, IndexEvent::Removed { blocks: removed })] => {
            assert_eq!(host, device, "the same blocks, hashed the same way");
            assert_eq!(
                host.iter().map(|b| b.engine_hash).collect::<Vec<_>>(),
                [EngineHash(11), EngineHash(12)]
            );
            assert_eq!(removed, &[EngineHash(12)], "evicted from the device only");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_cpu_store_without_its_tokens_is_skipped_and_counted() {
    let batch = made("vllm-0.32.0-offload-cpu-raw.msgpack");
    let mut normalizer = Normalizer::new(32);
    assert_eq!(
        normalized(&batch, &mut normalizer),
        [Normalized::Skipped(SkipReason::HostTierWithoutTokens)]
    );
    assert_eq!(
        normalizer
            .counters()
            .skipped(SkipReason::HostTierWithoutTokens),
        1
    );
}

#[test]
fn storage_and_remote_tiers_are_skipped_and_a_local_cpu_removal_applies() {
    let batch = made("vllm-0.32.0-offload-storage-remote.msgpack");
    let mut normalizer = Normalizer::new(32);
    match &normalized(&batch, &mut normalizer)[..] {
        [Normalized::Skipped(SkipReason::DiskTier), Normalized::Skipped(SkipReason::DiskTier), Normalized::Index(CacheTier::Host, IndexEvent::Removed { blocks })] =>
        {
            assert_eq!(blocks, &[EngineHash(11)]);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(normalizer.counters().skipped(SkipReason::DiskTier), 2);
}
