//! A decoded batch as the JSON `switchyard events decode` prints:
//! `{"ts", "data_parallel_rank", "events": [...]}`, each event with its
//! `type` and its fields under vLLM's names, hashes as unsigned 64-bit
//! integers, absent optional fields as `null`.

use rmpv::Value as Msgpack;
use serde_json::{json, Map, Value};
use switchyard_core::EngineHash;
use switchyard_wire::kv_events::{KvEvent, KvEventBatch};

/// The batch as JSON.
pub fn batch_json(batch: &KvEventBatch) -> Value {
    json!({
        "ts": batch.ts,
        "data_parallel_rank": batch.data_parallel_rank,
        "events": batch.events.iter().map(event_json).collect::<Vec<_>>(),
    })
}

fn hashes(list: &[EngineHash]) -> Value {
    Value::from(list.iter().map(|h| h.0).collect::<Vec<_>>())
}

fn event_json(event: &KvEvent) -> Value {
    match event {
        KvEvent::BlockStored(s) => {
            let token_ids = match &s.token_pair_next_ids {
                Some(next) => Value::from(
                    s.token_ids
                        .iter()
                        .zip(next)
                        .map(|(&t, &n)| json!([t, n]))
                        .collect::<Vec<_>>(),
                ),
                None => Value::from(s.token_ids.clone()),
            };
            json!({
                "type": "BlockStored",
                "block_hashes": hashes(&s.block_hashes),
                "parent_block_hash": s.parent_block_hash.map(|h| h.0),
                "token_ids": token_ids,
                "block_size": s.block_size,
                "lora_id": s.lora_id,
                "medium": s.medium,
                "lora_name": s.lora_name,
                "extra_keys": s.extra_keys.as_ref().map(msgpack_json),
                "group_idx": s.group_idx,
                "kv_cache_spec_kind": s.kv_cache_spec_kind,
                "kv_cache_spec_sliding_window": s.kv_cache_spec_sliding_window,
                "locality": s.locality,
                "ownership": s.ownership,
                "session_id": s.session_id,
                "lookahead_token_ids": s.lookahead_token_ids.as_ref().map(msgpack_json),
                "cache_salt": s.cache_salt,
            })
        }
        KvEvent::BlockRemoved(r) => json!({
            "type": "BlockRemoved",
            "block_hashes": hashes(&r.block_hashes),
            "medium": r.medium,
            "group_idx": r.group_idx,
            "locality": r.locality,
            "ownership": r.ownership,
        }),
        KvEvent::AllBlocksCleared => json!({ "type": "AllBlocksCleared" }),
        KvEvent::Unknown { tag } => json!({ "type": tag }),
    }
}

/// An opaque msgpack value as JSON: bytes become arrays of numbers, map
/// keys their text, extension types and non-finite floats `null`.
fn msgpack_json(value: &Msgpack) -> Value {
    match value {
        Msgpack::Nil | Msgpack::Ext(..) => Value::Null,
        Msgpack::Boolean(b) => Value::Bool(*b),
        Msgpack::Integer(n) => n
            .as_u64()
            .map(Value::from)
            .or_else(|| n.as_i64().map(Value::from))
            .unwrap_or(Value::Null),
        Msgpack::F32(f) => {
            serde_json::Number::from_f64(f64::from(*f)).map_or(Value::Null, Value::Number)
        }
        Msgpack::F64(f) => serde_json::Number::from_f64(*f).map_or(Value::Null, Value::Number),
        Msgpack::String(s) => Value::from(s.as_str().unwrap_or_default()),
        Msgpack::Binary(b) => Value::from(b.clone()),
        Msgpack::Array(items) => Value::from(items.iter().map(msgpack_json).collect::<Vec<_>>()),
        Msgpack::Map(entries) => {
            let mut map = Map::new();
            for (k, v) in entries {
                let key = match k.as_str() {
                    Some(s) => s.to_owned(),
                    None => k.to_string(),
                };
                map.insert(key, msgpack_json(v));
            }
            Value::Object(map)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_wire::kv_events::BlockStored;

    #[test]
    fn hashes_print_as_unsigned_and_absent_fields_as_null() {
        let batch = KvEventBatch {
            ts: 1.0,
            events: vec![KvEvent::BlockStored(Box::new(BlockStored {
                block_hashes: vec![EngineHash(u64::MAX)],
                token_ids: vec![1, 2],
                block_size: 2,
                ..BlockStored::default()
            }))],
            data_parallel_rank: None,
        };
        let v = batch_json(&batch);
        assert_eq!(v["data_parallel_rank"], Value::Null);
        assert_eq!(v["events"][0]["type"], "BlockStored");
        assert_eq!(v["events"][0]["block_hashes"][0], json!(u64::MAX));
        assert_eq!(v["events"][0]["parent_block_hash"], Value::Null);
        assert_eq!(v["events"][0]["lora_name"], Value::Null);
        assert!(v["events"][0]
            .as_object()
            .unwrap()
            .contains_key("group_idx"));
    }
}
