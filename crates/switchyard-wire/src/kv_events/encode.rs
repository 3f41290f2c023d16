//! [`KvEventBatch`] → payload bytes, in the current vLLM shape: the batch a
//! 3-element array `[ts, events, data_parallel_rank]` (2 elements when the
//! rank is `None`, as msgspec's `omit_defaults` does), each event a map
//! tagged by `"type"`. Required fields are always written (nil when
//! absent); defaulted ones only when set.

use super::{BlockRemoved, BlockStored, KvEvent, KvEventBatch};
use rmpv::Value;
use switchyard_core::EngineHash;

/// How block hashes go on the wire.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum HashEncoding {
    /// A msgpack unsigned integer (vLLM with a 64-bit hash function).
    #[default]
    Int,
    /// 32 bytes: 24 zero bytes then the `u64` big-endian (the shape of
    /// vLLM's sha256-based hashes, whose last 8 bytes the decoder reads).
    Bytes32,
}

/// Encodes a batch with integer hashes.
pub fn encode_batch(batch: &KvEventBatch) -> Vec<u8> {
    encode_batch_with(batch, HashEncoding::Int)
}

/// Encodes a batch with the given hash encoding.
pub fn encode_batch_with(batch: &KvEventBatch, hashes: HashEncoding) -> Vec<u8> {
    let mut fields = vec![
        Value::F64(batch.ts),
        Value::Array(
            batch
                .events
                .iter()
                .map(|event| event_value(event, hashes))
                .collect(),
        ),
    ];
    if let Some(rank) = batch.data_parallel_rank {
        fields.push(Value::from(rank));
    }
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &Value::Array(fields))
        .expect("writing msgpack into a Vec cannot fail");
    out
}

fn hash_value(hash: EngineHash, encoding: HashEncoding) -> Value {
    match encoding {
        HashEncoding::Int => Value::from(hash.0),
        HashEncoding::Bytes32 => {
            let mut bytes = vec![0u8; 32];
            bytes[24..].copy_from_slice(&hash.0.to_be_bytes());
            Value::Binary(bytes)
        }
    }
}

fn opt<T: Into<Value> + Clone>(value: &Option<T>) -> Value {
    value.clone().map_or(Value::Nil, Into::into)
}

fn key(name: &str) -> Value {
    Value::from(name)
}

fn event_value(event: &KvEvent, hashes: HashEncoding) -> Value {
    let mut map = vec![(key("type"), Value::from(event.type_name()))];
    match event {
        KvEvent::BlockStored(stored) => stored_fields(stored, hashes, &mut map),
        KvEvent::BlockRemoved(removed) => removed_fields(removed, hashes, &mut map),
        KvEvent::AllBlocksCleared | KvEvent::Unknown { .. } => {}
    }
    Value::Map(map)
}

fn hash_list(list: &[EngineHash], encoding: HashEncoding) -> Value {
    Value::Array(list.iter().map(|&h| hash_value(h, encoding)).collect())
}

fn stored_fields(stored: &BlockStored, hashes: HashEncoding, map: &mut Vec<(Value, Value)>) {
    let tokens = match &stored.token_pair_next_ids {
        Some(next) if next.len() == stored.token_ids.len() => stored
            .token_ids
            .iter()
            .zip(next)
            .map(|(&t, &n)| Value::Array(vec![Value::from(t), Value::from(n)]))
            .collect(),
        _ => stored.token_ids.iter().map(|&t| Value::from(t)).collect(),
    };
    map.push((key("block_hashes"), hash_list(&stored.block_hashes, hashes)));
    map.push((
        key("parent_block_hash"),
        stored
            .parent_block_hash
            .map_or(Value::Nil, |h| hash_value(h, hashes)),
    ));
    map.push((key("token_ids"), Value::Array(tokens)));
    map.push((key("block_size"), Value::from(stored.block_size)));
    map.push((key("lora_id"), opt(&stored.lora_id)));
    map.push((key("medium"), opt(&stored.medium)));
    map.push((key("lora_name"), opt(&stored.lora_name)));
    let optional: [(&str, Option<Value>); 9] = [
        ("extra_keys", stored.extra_keys.clone()),
        ("group_idx", stored.group_idx.map(Value::from)),
        (
            "kv_cache_spec_kind",
            stored.kv_cache_spec_kind.clone().map(Value::from),
        ),
        (
            "kv_cache_spec_sliding_window",
            stored.kv_cache_spec_sliding_window.map(Value::from),
        ),
        ("locality", stored.locality.clone().map(Value::from)),
        ("ownership", stored.ownership.clone().map(Value::from)),
        ("session_id", stored.session_id.clone().map(Value::from)),
        ("lookahead_token_ids", stored.lookahead_token_ids.clone()),
        ("cache_salt", stored.cache_salt.clone().map(Value::from)),
    ];
    map.extend(
        optional
            .into_iter()
            .filter_map(|(name, value)| value.map(|v| (key(name), v))),
    );
}

fn removed_fields(removed: &BlockRemoved, hashes: HashEncoding, map: &mut Vec<(Value, Value)>) {
    map.push((
        key("block_hashes"),
        hash_list(&removed.block_hashes, hashes),
    ));
    map.push((key("medium"), opt(&removed.medium)));
    let optional = [
        ("group_idx", removed.group_idx.map(Value::from)),
        ("locality", removed.locality.clone().map(Value::from)),
        ("ownership", removed.ownership.clone().map(Value::from)),
    ];
    map.extend(
        optional
            .into_iter()
            .filter_map(|(name, value)| value.map(|v| (key(name), v))),
    );
}
