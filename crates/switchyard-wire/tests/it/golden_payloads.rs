//! Golden payloads, one per shape the engines send, checked byte for byte.
//!
//! Each fixture under `tests/fixtures/` is written here by hand as msgpack
//! values following the engines' struct definitions (field order and names
//! from vLLM `vllm/distributed/kv_events.py` and SGLang
//! `python/sglang/srt/disaggregation/kv_events.py`), independently of our
//! encoder. This file is also the generator: run
//! `SWITCHYARD_BLESS=1 cargo test -p switchyard-wire --test it golden_payloads` to
//! rewrite the files, then review the diff.

use rmpv::Value;
use std::path::PathBuf;
use switchyard_core::index::{CacheTier, IndexEvent};
use switchyard_core::EngineHash;
use switchyard_wire::kv_events::{decode_batch, Format, KvEvent};
use switchyard_wire::normalize::{Normalized, Normalizer, SkipReason};

fn fixture(name: &str, value: &Value) -> Vec<u8> {
    let mut built = Vec::new();
    rmpv::encode::write_value(&mut built, value).unwrap();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    if std::env::var_os("SWITCHYARD_BLESS").is_some() {
        std::fs::write(&path, &built).unwrap();
    }
    let stored = std::fs::read(&path).unwrap();
    assert_eq!(stored, built, "{name} differs from its definition here");
    stored
}

fn s(text: &str) -> Value {
    Value::from(text)
}

fn map(entries: Vec<(&str, Value)>) -> Value {
    Value::Map(entries.into_iter().map(|(k, v)| (s(k), v)).collect())
}

fn ints<T: Into<Value> + Copy>(items: &[T]) -> Value {
    Value::Array(items.iter().map(|&i| i.into()).collect())
}

const TOKENS: [u32; 8] = [128000, 9125, 271, 0, 1, 42, 65535, 65536];

/// vLLM, current shape: 3-element array batch of type-tagged map events,
/// 64-bit integer hashes, `data_parallel_rank` 0.
#[test]
fn a_vllm_batch_with_integer_hashes_decodes_field_by_field() {
    let bytes = fixture(
        "vllm_int_hashes.msgpack",
        &Value::Array(vec![
            Value::F64(1757500000.25),
            Value::Array(vec![
                map(vec![
                    ("type", s("BlockStored")),
                    ("block_hashes", ints(&[u64::MAX - 1, 7u64])),
                    ("parent_block_hash", Value::from(3u64)),
                    ("token_ids", ints(&TOKENS)),
                    ("block_size", Value::from(4)),
                    ("lora_id", Value::Nil),
                    ("medium", s("GPU")),
                    ("lora_name", Value::Nil),
                ]),
                map(vec![
                    ("type", s("BlockRemoved")),
                    ("block_hashes", ints(&[7u64])),
                    ("medium", s("GPU")),
                ]),
                map(vec![("type", s("AllBlocksCleared"))]),
            ]),
            Value::from(0),
        ]),
    );
    let batch = decode_batch(&bytes, Format::Vllm).unwrap();
    assert_eq!(batch.ts, 1757500000.25);
    assert_eq!(batch.data_parallel_rank, Some(0));
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(
        stored.block_hashes,
        vec![EngineHash(u64::MAX - 1), EngineHash(7)]
    );
    assert_eq!(stored.parent_block_hash, Some(EngineHash(3)));
    assert_eq!(stored.token_ids, TOKENS.to_vec());
    assert_eq!(stored.block_size, 4);
    assert_eq!(stored.medium.as_deref(), Some("GPU"));
    assert_eq!(stored.lora_name, None);
    let KvEvent::BlockRemoved(removed) = &batch.events[1] else {
        panic!()
    };
    assert_eq!(removed.block_hashes, vec![EngineHash(7)]);
    assert_eq!(batch.events[2], KvEvent::AllBlocksCleared);
}

/// vLLM with a sha256 block hash function: 32-byte hashes, and the
/// hybrid-model group fields.
#[test]
fn a_vllm_batch_with_32_byte_hashes_keeps_their_last_8_bytes() {
    let hash = |tail: u64| {
        let mut bytes: Vec<u8> = (0u8..24)
            .map(|b| b.wrapping_mul(37).wrapping_add(1))
            .collect();
        bytes.extend_from_slice(&tail.to_be_bytes());
        Value::Binary(bytes)
    };
    let bytes = fixture(
        "vllm_bytes32_hashes.msgpack",
        &Value::Array(vec![
            Value::F64(1757500001.5),
            Value::Array(vec![
                map(vec![
                    ("type", s("BlockStored")),
                    (
                        "block_hashes",
                        Value::Array(vec![hash(0xDEAD_BEEF_0000_0001), hash(2)]),
                    ),
                    ("parent_block_hash", Value::Nil),
                    ("token_ids", ints(&TOKENS)),
                    ("block_size", Value::from(4)),
                    ("lora_id", Value::Nil),
                    ("medium", s("GPU")),
                    ("lora_name", s("sql-adapter")),
                    ("group_idx", Value::from(0)),
                    ("kv_cache_spec_kind", s("full_attention")),
                ]),
                map(vec![
                    ("type", s("BlockRemoved")),
                    ("block_hashes", Value::Array(vec![hash(2)])),
                    ("medium", s("GPU")),
                    ("group_idx", Value::from(0)),
                ]),
            ]),
            Value::from(1),
        ]),
    );
    let batch = decode_batch(&bytes, Format::Vllm).unwrap();
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(
        stored.block_hashes,
        vec![EngineHash(0xDEAD_BEEF_0000_0001), EngineHash(2)]
    );
    assert_eq!(stored.lora_name.as_deref(), Some("sql-adapter"));
    assert_eq!(stored.group_idx, Some(0));
    assert_eq!(stored.kv_cache_spec_kind.as_deref(), Some("full_attention"));
    assert_eq!(batch.data_parallel_rank, Some(1));
    assert!(decode_batch(&bytes, Format::Sglang).is_err());
}

/// Older vLLM (and SGLang): array-shaped events, positional fields,
/// trailing defaults omitted, batch without a rank.
#[test]
fn an_old_array_shaped_batch_decodes_positionally() {
    let bytes = fixture(
        "vllm_legacy_array.msgpack",
        &Value::Array(vec![
            Value::F64(1700000000.0),
            Value::Array(vec![
                Value::Array(vec![
                    s("BlockStored"),
                    ints(&[11u64, 12]),
                    Value::Nil,
                    ints(&TOKENS),
                    Value::from(4),
                    Value::Nil,
                ]),
                Value::Array(vec![s("BlockRemoved"), ints(&[12u64])]),
                Value::Array(vec![s("AllBlocksCleared")]),
            ]),
        ]),
    );
    let batch = decode_batch(&bytes, Format::Auto).unwrap();
    assert_eq!(batch.data_parallel_rank, None);
    let KvEvent::BlockStored(stored) = &batch.events[0] else {
        panic!()
    };
    assert_eq!(stored.block_hashes, vec![EngineHash(11), EngineHash(12)]);
    assert_eq!(stored.parent_block_hash, None);
    assert_eq!(stored.medium, None);
    assert_eq!(batch.events.len(), 3);
}

/// SGLang: one event per page, signed 64-bit hashes, the last page partial,
/// `attn_dp_rank` in the batch's third slot.
#[test]
fn an_sglang_batch_with_signed_hashes_drops_only_its_partial_last_page() {
    let page = |hash: i64, parent: Option<i64>, tokens: &[u32]| {
        map(vec![
            ("type", s("BlockStored")),
            ("block_hashes", Value::Array(vec![Value::from(hash)])),
            ("parent_block_hash", parent.map_or(Value::Nil, Value::from)),
            ("token_ids", ints(tokens)),
            ("block_size", Value::from(4)),
            ("lora_id", Value::Nil),
            ("medium", s("GPU")),
        ])
    };
    let bytes = fixture(
        "sglang_signed_partial.msgpack",
        &Value::Array(vec![
            Value::F64(1757500002.0),
            Value::Array(vec![
                page(-5, None, &TOKENS[..4]),
                page(i64::MIN, Some(-5), &TOKENS[4..]),
                page(42, Some(i64::MIN), &[7, 8]),
            ]),
            Value::from(0),
        ]),
    );
    let batch = decode_batch(&bytes, Format::Sglang).unwrap();
    let hashes: Vec<_> = batch
        .events
        .iter()
        .map(|e| match e {
            KvEvent::BlockStored(s) => (s.block_hashes[0], s.parent_block_hash),
            _ => panic!(),
        })
        .collect();
    assert_eq!(
        hashes,
        vec![
            (EngineHash(u64::MAX - 4), None),
            (EngineHash(1 << 63), Some(EngineHash(u64::MAX - 4))),
            (EngineHash(42), Some(EngineHash(1 << 63))),
        ]
    );
    let mut normalizer = Normalizer::new(4);
    let out: Vec<_> = batch
        .events
        .iter()
        .map(|e| normalizer.normalize(e))
        .collect();
    assert!(matches!(
        out[0],
        Normalized::Index(CacheTier::Device, IndexEvent::Stored { .. })
    ));
    assert!(matches!(
        out[1],
        Normalized::Index(CacheTier::Device, IndexEvent::Stored { .. })
    ));
    assert_eq!(out[2], Normalized::Skipped(SkipReason::PartialBlock));
}
