//! Payloads captured from real engines (`tests/fixtures/captured/`, see its
//! README): the decoder and the normalizer against what vLLM 0.32 and
//! SGLang 0.5.23 really publish, not against our reading of their sources.

use std::path::PathBuf;
use switchyard_core::index::{CacheTier, IndexEvent};
use switchyard_wire::kv_events::{decode_batch, Format, KvEvent, KvEventBatch};
use switchyard_wire::normalize::{Normalized, Normalizer};

fn captured(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/captured")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Decodes `name` in `format` and in auto-detection alike.
fn batch(name: &str, format: Format) -> KvEventBatch {
    let bytes = captured(name);
    let batch = decode_batch(&bytes, format).unwrap_or_else(|e| panic!("{name}: {e}"));
    let auto = decode_batch(&bytes, Format::Auto).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(batch.events.len(), auto.events.len(), "{name}");
    batch
}

/// The one `BlockStored` of `batch`.
fn stored(batch: &KvEventBatch) -> &switchyard_wire::kv_events::BlockStored {
    match &batch.events[..] {
        [KvEvent::BlockStored(s)] => s,
        other => panic!("one BlockStored, not {other:?}"),
    }
}

/// Normalizes every event at `block_size`: each must be applied, none skipped.
fn applied(batch: &KvEventBatch, block_size: u32) -> Vec<IndexEvent> {
    let mut normalizer = Normalizer::new(block_size);
    batch
        .events
        .iter()
        .map(|e| match normalizer.normalize(e) {
            Normalized::Index(CacheTier::Device, event) => event,
            other => panic!("{e:?} was not applied to the device tier: {other:?}"),
        })
        .collect()
}

#[test]
fn vllm_032_stores_a_prompts_full_blocks_in_one_event_chained_to_the_last() {
    let first = batch("vllm-0.32.0-cpu-stored-0.msgpack", Format::Vllm);
    let second = batch("vllm-0.32.0-cpu-stored-1.msgpack", Format::Vllm);
    assert_eq!(first.data_parallel_rank, Some(0));
    let (a, b) = (stored(&first), stored(&second));
    for s in [a, b] {
        assert_eq!(s.block_size, 32);
        assert_eq!(s.token_ids.len(), 32 * s.block_hashes.len());
        assert_eq!(s.medium.as_deref(), Some("GPU"));
        // vLLM 0.32 names the cache group of every store.
        assert_eq!(s.group_idx, Some(0));
        assert_eq!(s.kv_cache_spec_kind.as_deref(), Some("full_attention"));
    }
    assert!(a.parent_block_hash.is_none() && a.block_hashes.len() >= 3);
    assert_eq!(
        b.parent_block_hash,
        a.block_hashes.last().copied(),
        "the longer prompt's new block chains onto the first prompt's last"
    );
    match &applied(&first, 32)[..] {
        [IndexEvent::Stored {
            parent: None,
            blocks,
        }] => {
            assert_eq!(blocks.len(), a.block_hashes.len())
        }
        other => panic!("{other:?}"),
    }
    // At another block size every store is refused, never misread.
    let mut at_16 = Normalizer::new(16);
    assert!(matches!(
        at_16.normalize(&first.events[0]),
        Normalized::Skipped(_)
    ));
}

#[test]
fn sglang_0523_merges_a_prompts_pages_into_one_event_with_signed_hashes() {
    let merged = batch("sglang-0.5.23-cpu-1.msgpack", Format::Sglang);
    let next = batch("sglang-0.5.23-cpu-2.msgpack", Format::Sglang);
    let salted = batch("sglang-0.5.23-cpu-3.msgpack", Format::Sglang);
    let cleared = batch("sglang-0.5.23-cpu-4.msgpack", Format::Sglang);
    assert_eq!(
        merged.data_parallel_rank,
        Some(0),
        "SGLang always fills its rank"
    );
    let (m, n, s) = (stored(&merged), stored(&next), stored(&salted));
    assert_eq!(m.block_hashes.len(), 9, "nine pages, one event");
    assert_eq!(n.parent_block_hash, m.block_hashes.last().copied());
    assert_eq!(s.cache_salt.as_deref(), Some("tenant-a"));
    for e in [m, n, s] {
        assert_eq!(
            e.token_ids.len(),
            32 * e.block_hashes.len(),
            "no partial page"
        );
    }
    let blocks = |events: Vec<IndexEvent>| match &events[..] {
        [IndexEvent::Stored { blocks, .. }] => blocks.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(blocks(applied(&merged, 32)).len(), 9);
    // The salt folds into the router's hashes: the salted chain's first
    // block is not the unsalted hash of the same tokens.
    let salted_blocks = blocks(applied(&salted, 32));
    let mut unsalted = s.clone();
    unsalted.cache_salt = None;
    let plain = blocks(applied(
        &KvEventBatch {
            ts: salted.ts,
            events: vec![KvEvent::BlockStored(Box::new(unsalted))],
            data_parallel_rank: Some(0),
        },
        32,
    ));
    assert_ne!(salted_blocks[0].local_hash, plain[0].local_hash);
    assert_eq!(applied(&cleared, 32), vec![IndexEvent::Cleared]);
}
