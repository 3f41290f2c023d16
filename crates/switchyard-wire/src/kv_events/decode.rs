//! Payload bytes → [`KvEventBatch`], through `rmpv` values.

use super::{BlockRemoved, BlockStored, DecodeError, Format, KvEvent, KvEventBatch};
use rmpv::Value;
use switchyard_core::EngineHash;

/// Deepest nesting accepted. Real batches nest about five levels
/// (batch, events, event, token pair or `extra_keys` tuple); the cap keeps
/// hostile input from recursing deep.
const MAX_DEPTH: usize = 32;

const STORED: &str = "BlockStored";
const REMOVED: &str = "BlockRemoved";

/// One event of a batch that could not be decoded; the batch's other events
/// are still usable.
#[derive(Clone, Debug, PartialEq)]
pub struct EventError {
    /// Position of the event in the batch.
    pub index: usize,
    /// What was wrong with it.
    pub error: DecodeError,
}

/// Decodes one payload strictly: any bad event fails the whole batch. For
/// inspection tools; a subscriber wants [`decode_batch_lossy`].
pub fn decode_batch(bytes: &[u8], format: Format) -> Result<KvEventBatch, DecodeError> {
    let (batch, errors) = decode_batch_lossy(bytes, format)?;
    match errors.into_iter().next() {
        Some(first) => Err(first.error),
        None => Ok(batch),
    }
}

/// Decodes one payload, keeping every event that decodes and reporting the
/// others. Fails only when the batch envelope itself is bad.
pub fn decode_batch_lossy(
    bytes: &[u8],
    format: Format,
) -> Result<(KvEventBatch, Vec<EventError>), DecodeError> {
    let mut reader = bytes;
    let value = rmpv::decode::read_value_with_max_depth(&mut reader, MAX_DEPTH)
        .map_err(|err| DecodeError::Msgpack(err.to_string()))?;
    if !reader.is_empty() {
        return Err(DecodeError::TrailingBytes(reader.len()));
    }
    let (ts, events, rank) = match value {
        Value::Array(items) => {
            let mut items = items.into_iter();
            match (items.next(), items.next()) {
                (Some(ts), Some(events)) => (ts, events, items.next()),
                _ => return Err(DecodeError::BatchShape),
            }
        }
        Value::Map(_) if format == Format::Sglang => {
            return Err(DecodeError::FormatMismatch(format))
        }
        Value::Map(entries) => {
            let (mut ts, mut events, mut rank) = (None, None, None);
            for (key, value) in entries {
                match key.as_str() {
                    Some("ts") => ts = Some(value),
                    Some("events") => events = Some(value),
                    Some("data_parallel_rank" | "attn_dp_rank") => rank = Some(value),
                    _ => {}
                }
            }
            match (ts, events) {
                (Some(ts), Some(events)) => (ts, events, rank),
                _ => return Err(DecodeError::BatchShape),
            }
        }
        _ => return Err(DecodeError::BatchShape),
    };
    let ts = match ts {
        Value::F64(v) => v,
        Value::F32(v) => f64::from(v),
        Value::Integer(n) => n.as_f64().ok_or(DecodeError::BatchShape)?,
        _ => return Err(DecodeError::BatchShape),
    };
    let data_parallel_rank = match rank {
        None => None,
        Some(v) => opt_i64(v, "batch", "data_parallel_rank")?,
    };
    let Value::Array(raw_events) = events else {
        return Err(DecodeError::BatchShape);
    };
    let mut decoded = Vec::with_capacity(raw_events.len());
    let mut errors = Vec::new();
    for (index, raw) in raw_events.into_iter().enumerate() {
        match decode_event(raw, format) {
            Ok(event) => decoded.push(event),
            Err(error) => errors.push(EventError { index, error }),
        }
    }
    Ok((
        KvEventBatch {
            ts,
            events: decoded,
            data_parallel_rank,
        },
        errors,
    ))
}

fn decode_event(value: Value, format: Format) -> Result<KvEvent, DecodeError> {
    match value {
        Value::Map(entries) => decode_map_event(entries, format),
        Value::Array(items) => decode_array_event(items, format),
        _ => Err(DecodeError::EventShape),
    }
}

fn decode_map_event(entries: Vec<(Value, Value)>, format: Format) -> Result<KvEvent, DecodeError> {
    let tag = entries
        .iter()
        .find(|(k, _)| k.as_str() == Some("type"))
        .and_then(|(_, v)| v.as_str())
        .ok_or(DecodeError::EventShape)?
        .to_owned();
    match tag.as_str() {
        STORED => {
            let mut stored = BlockStored::default();
            let (mut hashes, mut tokens, mut block_size) = (None, None, None);
            for (key, value) in entries {
                let Some(key) = key.as_str() else { continue };
                match key {
                    "block_hashes" => hashes = Some(value),
                    "parent_block_hash" => {
                        stored.parent_block_hash =
                            opt_hash(value, format, STORED, "parent_block_hash")?
                    }
                    "token_ids" => tokens = Some(value),
                    "block_size" => block_size = Some(value),
                    "lora_id" => stored.lora_id = opt_i64(value, STORED, "lora_id")?,
                    "medium" => stored.medium = opt_string(value, STORED, "medium")?,
                    "lora_name" => stored.lora_name = opt_string(value, STORED, "lora_name")?,
                    "extra_keys" => stored.extra_keys = opaque(value),
                    "group_idx" => stored.group_idx = opt_i64(value, STORED, "group_idx")?,
                    "kv_cache_spec_kind" => {
                        stored.kv_cache_spec_kind = opt_string(value, STORED, "kv_cache_spec_kind")?
                    }
                    "kv_cache_spec_sliding_window" => {
                        stored.kv_cache_spec_sliding_window =
                            opt_i64(value, STORED, "kv_cache_spec_sliding_window")?
                    }
                    "locality" => stored.locality = opt_string(value, STORED, "locality")?,
                    "ownership" => stored.ownership = opt_string(value, STORED, "ownership")?,
                    "session_id" => stored.session_id = opt_string(value, STORED, "session_id")?,
                    "lookahead_token_ids" => stored.lookahead_token_ids = opaque(value),
                    "cache_salt" => stored.cache_salt = opt_string(value, STORED, "cache_salt")?,
                    "metadata" => {
                        if let Some(salt) = metadata_salt(value)? {
                            stored.cache_salt = Some(salt);
                        }
                    }
                    _ => {}
                }
            }
            stored.block_hashes = hashes_field(hashes, format, STORED)?;
            let (ids, next) = token_ids(tokens.ok_or(missing(STORED, "token_ids"))?)?;
            stored.token_ids = ids;
            stored.token_pair_next_ids = next;
            stored.block_size = block_size_field(block_size)?;
            Ok(KvEvent::BlockStored(Box::new(stored)))
        }
        REMOVED => {
            let mut removed = BlockRemoved::default();
            let mut hashes = None;
            for (key, value) in entries {
                let Some(key) = key.as_str() else { continue };
                match key {
                    "block_hashes" => hashes = Some(value),
                    "medium" => removed.medium = opt_string(value, REMOVED, "medium")?,
                    "group_idx" => removed.group_idx = opt_i64(value, REMOVED, "group_idx")?,
                    "locality" => removed.locality = opt_string(value, REMOVED, "locality")?,
                    "ownership" => removed.ownership = opt_string(value, REMOVED, "ownership")?,
                    _ => {}
                }
            }
            removed.block_hashes = hashes_field(hashes, format, REMOVED)?;
            Ok(KvEvent::BlockRemoved(removed))
        }
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        _ => Ok(KvEvent::Unknown { tag }),
    }
}

fn decode_array_event(items: Vec<Value>, format: Format) -> Result<KvEvent, DecodeError> {
    let mut items = items.into_iter();
    let tag = items
        .next()
        .and_then(|v| v.as_str().map(str::to_owned))
        .ok_or(DecodeError::EventShape)?;
    // Positional fields in declaration order; a missing tail is all defaults.
    let mut next = || items.next().unwrap_or(Value::Nil);
    match tag.as_str() {
        STORED => {
            let hashes = next();
            let parent = next();
            let tokens = next();
            let block_size = next();
            let mut stored = BlockStored {
                block_hashes: hashes_field(Some(hashes), format, STORED)?,
                parent_block_hash: opt_hash(parent, format, STORED, "parent_block_hash")?,
                block_size: block_size_field(Some(block_size))?,
                lora_id: opt_i64(next(), STORED, "lora_id")?,
                medium: opt_string(next(), STORED, "medium")?,
                ..BlockStored::default()
            };
            let (ids, pair_next) = token_ids(tokens)?;
            stored.token_ids = ids;
            stored.token_pair_next_ids = pair_next;
            // vLLM declares `lora_name` here; SGLang's salted variant puts its
            // keyword-only `metadata` map in the same slot.
            match next() {
                map @ Value::Map(_) => stored.cache_salt = metadata_salt(map)?,
                other => stored.lora_name = opt_string(other, STORED, "lora_name")?,
            }
            stored.extra_keys = opaque(next());
            stored.group_idx = opt_i64(next(), STORED, "group_idx")?;
            stored.kv_cache_spec_kind = opt_string(next(), STORED, "kv_cache_spec_kind")?;
            stored.kv_cache_spec_sliding_window =
                opt_i64(next(), STORED, "kv_cache_spec_sliding_window")?;
            stored.locality = opt_string(next(), STORED, "locality")?;
            stored.ownership = opt_string(next(), STORED, "ownership")?;
            stored.session_id = opt_string(next(), STORED, "session_id")?;
            Ok(KvEvent::BlockStored(Box::new(stored)))
        }
        REMOVED => {
            let hashes = next();
            Ok(KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: hashes_field(Some(hashes), format, REMOVED)?,
                medium: opt_string(next(), REMOVED, "medium")?,
                group_idx: opt_i64(next(), REMOVED, "group_idx")?,
                locality: opt_string(next(), REMOVED, "locality")?,
                ownership: opt_string(next(), REMOVED, "ownership")?,
            }))
        }
        "AllBlocksCleared" => Ok(KvEvent::AllBlocksCleared),
        _ => Ok(KvEvent::Unknown { tag }),
    }
}

fn missing(event: &'static str, field: &'static str) -> DecodeError {
    DecodeError::MissingField { event, field }
}

fn invalid(event: &'static str, field: &'static str) -> DecodeError {
    DecodeError::InvalidField { event, field }
}

/// A block hash: any integer (negative ones reinterpreted as two's
/// complement) or, outside SGLang, bytes whose last 8 are the big-endian
/// `u64` (vLLM's 32-byte hashes). Fewer than 8 bytes is invalid.
fn hash(value: &Value, format: Format) -> Option<EngineHash> {
    match value {
        Value::Integer(n) => n
            .as_u64()
            .or_else(|| n.as_i64().map(|signed| signed as u64))
            .map(EngineHash),
        Value::Binary(bytes) if format != Format::Sglang && bytes.len() >= 8 => {
            let mut tail = [0u8; 8];
            tail.copy_from_slice(&bytes[bytes.len() - 8..]);
            Some(EngineHash(u64::from_be_bytes(tail)))
        }
        _ => None,
    }
}

fn opt_hash(
    value: Value,
    format: Format,
    event: &'static str,
    field: &'static str,
) -> Result<Option<EngineHash>, DecodeError> {
    match value {
        Value::Nil => Ok(None),
        other => hash(&other, format).map(Some).ok_or(invalid(event, field)),
    }
}

fn hashes_field(
    value: Option<Value>,
    format: Format,
    event: &'static str,
) -> Result<Vec<EngineHash>, DecodeError> {
    match value {
        None | Some(Value::Nil) => Err(missing(event, "block_hashes")),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| hash(v, format).ok_or(invalid(event, "block_hashes")))
            .collect(),
        Some(_) => Err(invalid(event, "block_hashes")),
    }
}

fn token(value: &Value) -> Option<u32> {
    value.as_u64().and_then(|t| u32::try_from(t).ok())
}

/// Token ids, flat or as `(token, next_token)` pairs (all entries one way).
type TokenColumns = (Vec<u32>, Option<Vec<u32>>);

fn token_ids(value: Value) -> Result<TokenColumns, DecodeError> {
    let bad = || invalid(STORED, "token_ids");
    let Value::Array(items) = value else {
        return Err(bad());
    };
    match items.first() {
        Some(Value::Array(_)) => {
            let mut ids = Vec::with_capacity(items.len());
            let mut next = Vec::with_capacity(items.len());
            for item in &items {
                match item {
                    Value::Array(pair) if pair.len() >= 2 => {
                        ids.push(token(&pair[0]).ok_or_else(bad)?);
                        next.push(token(&pair[1]).ok_or_else(bad)?);
                    }
                    _ => return Err(bad()),
                }
            }
            Ok((ids, Some(next)))
        }
        _ => {
            let ids = items
                .iter()
                .map(|t| token(t).ok_or_else(bad))
                .collect::<Result<_, _>>()?;
            Ok((ids, None))
        }
    }
}

fn block_size_field(value: Option<Value>) -> Result<u32, DecodeError> {
    match value {
        None | Some(Value::Nil) => Err(missing(STORED, "block_size")),
        Some(v) => token(&v).ok_or(invalid(STORED, "block_size")),
    }
}

fn opt_i64(
    value: Value,
    event: &'static str,
    field: &'static str,
) -> Result<Option<i64>, DecodeError> {
    match value {
        Value::Nil => Ok(None),
        Value::Integer(n) => n.as_i64().map(Some).ok_or(invalid(event, field)),
        _ => Err(invalid(event, field)),
    }
}

fn opt_string(
    value: Value,
    event: &'static str,
    field: &'static str,
) -> Result<Option<String>, DecodeError> {
    match value {
        Value::Nil => Ok(None),
        Value::String(s) => s.into_str().map(Some).ok_or(invalid(event, field)),
        _ => Err(invalid(event, field)),
    }
}

fn opaque(value: Value) -> Option<Value> {
    match value {
        Value::Nil => None,
        other => Some(other),
    }
}

/// SGLang's `metadata` map: `{"cache_salt": str}`; other keys ignored.
fn metadata_salt(value: Value) -> Result<Option<String>, DecodeError> {
    match value {
        Value::Nil => Ok(None),
        Value::Map(entries) => {
            for (key, value) in entries {
                if key.as_str() == Some("cache_salt") {
                    return opt_string(value, STORED, "metadata.cache_salt");
                }
            }
            Ok(None)
        }
        _ => Err(invalid(STORED, "metadata")),
    }
}
