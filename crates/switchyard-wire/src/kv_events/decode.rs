//! Payload bytes → [`KvEventBatch`]: the shapes engines send read
//! directly ([`super::direct`]), any other through `rmpv` values.
//!
//! The value tree is built only after [`tree_cost`] has walked the bytes
//! without allocating and found the tree within [`DecodeLimits`]: a msgpack
//! `nil` is one byte on the wire but a whole `rmpv::Value` in the tree, so a
//! 64 MiB payload of them would otherwise cost gigabytes.

use super::{
    BlockRemoved, BlockStored, DecodeError, DecodeLimits, Format, KvEvent, KvEventBatch, REMOVED,
    STORED,
};
use rmpv::Value;
use switchyard_core::EngineHash;

/// Deepest nesting accepted. Real batches nest about five levels
/// (batch, events, event, token pair or `extra_keys` tuple); the cap keeps
/// hostile input from recursing deep.
const MAX_DEPTH: usize = 32;

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
/// others, within [`DecodeLimits::default`]. Fails only when the batch
/// envelope itself is bad or the payload is past the limits.
pub fn decode_batch_lossy(
    bytes: &[u8],
    format: Format,
) -> Result<(KvEventBatch, Vec<EventError>), DecodeError> {
    decode_batch_lossy_within(bytes, format, &DecodeLimits::default())
}

/// [`decode_batch_lossy`] within `limits`: a payload whose value tree would
/// take more than `limits.max_tree_bytes` is refused before any of it is
/// built ([`DecodeError::OverBudget`]), and one with more than
/// `limits.max_events` events is refused whole ([`DecodeError::TooManyEvents`]).
pub fn decode_batch_lossy_within(
    bytes: &[u8],
    format: Format,
    limits: &DecodeLimits,
) -> Result<(KvEventBatch, Vec<EventError>), DecodeError> {
    tree_cost(bytes, limits.max_tree_bytes)?;
    if let Some(batch) = super::direct::decode(bytes, format, limits.max_events) {
        return Ok((batch, Vec::new()));
    }
    decode_tree(bytes, format, limits)
}

/// [`decode_batch_lossy_within`] through the `rmpv` value tree, for any
/// shape (the direct reader's fallback), the limits already checked.
pub(super) fn decode_tree(
    bytes: &[u8],
    format: Format,
    limits: &DecodeLimits,
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
    if raw_events.len() > limits.max_events {
        return Err(DecodeError::TooManyEvents(raw_events.len()));
    }
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

/// Heap bytes one decoded value takes in the tree, its own slot included.
const VALUE_BYTES: usize = std::mem::size_of::<Value>();

/// What the `rmpv` tree of the one msgpack value at the start of `bytes`
/// would take, at most (a [`VALUE_BYTES`] slot per value, plus each value's
/// payload bytes: a string's, a binary's, an extension's, a number's), walked without allocating and without
/// recursion: `pending` counts the values still to read. Fails as soon as
/// the cost passes `budget`, and on truncated or invalid msgpack. Bytes
/// after the first value are left to the decoder to refuse.
pub(super) fn tree_cost(bytes: &[u8], budget: usize) -> Result<usize, DecodeError> {
    let truncated = || DecodeError::Msgpack("truncated or invalid msgpack".into());
    let mut at = 0usize;
    let mut pending: u64 = 1;
    let mut cost = 0usize;
    // The big-endian unsigned length of `n` bytes at `at`.
    let length = |at: usize, n: usize| -> Result<usize, DecodeError> {
        let field = bytes.get(at..at + n).ok_or_else(truncated)?;
        Ok(field.iter().fold(0usize, |v, &b| (v << 8) | usize::from(b)))
    };
    while pending > 0 {
        pending -= 1;
        let marker = *bytes.get(at).ok_or_else(truncated)?;
        at += 1;
        // (child values still to read, payload bytes after the header)
        let (children, payload) = match marker {
            // 0xc1 is reserved; `rmpv` reads it as nil, so it costs a value.
            0x00..=0x7f | 0xe0..=0xff | 0xc0..=0xc3 => (0, 0),
            0x80..=0x8f => (2 * u64::from(marker & 0x0f), 0),
            0x90..=0x9f => (u64::from(marker & 0x0f), 0),
            0xa0..=0xbf => (0, usize::from(marker & 0x1f)),
            0xc4 | 0xd9 => (0, take(&mut at, 1, length)?),
            0xc5 | 0xda => (0, take(&mut at, 2, length)?),
            0xc6 | 0xdb => (0, take(&mut at, 4, length)?),
            0xc7 => (0, take(&mut at, 1, length)? + 1),
            0xc8 => (0, take(&mut at, 2, length)? + 1),
            0xc9 => (0, take(&mut at, 4, length)? + 1),
            0xca => (0, 4),
            0xcb => (0, 8),
            0xcc | 0xd0 => (0, 1),
            0xcd | 0xd1 => (0, 2),
            0xce | 0xd2 => (0, 4),
            0xcf | 0xd3 => (0, 8),
            0xd4 => (0, 2),
            0xd5 => (0, 3),
            0xd6 => (0, 5),
            0xd7 => (0, 9),
            0xd8 => (0, 17),
            0xdc => (take(&mut at, 2, length)? as u64, 0),
            0xdd => (take(&mut at, 4, length)? as u64, 0),
            0xde => (2 * take(&mut at, 2, length)? as u64, 0),
            0xdf => (2 * take(&mut at, 4, length)? as u64, 0),
        };
        at = at.checked_add(payload).ok_or_else(truncated)?;
        if at > bytes.len() {
            return Err(truncated());
        }
        pending = pending.saturating_add(children);
        cost = cost.saturating_add(VALUE_BYTES).saturating_add(payload);
        if cost > budget {
            return Err(DecodeError::OverBudget { budget });
        }
    }
    Ok(cost)
}

/// Reads an `n`-byte length at `*at` and moves past it.
fn take(
    at: &mut usize,
    n: usize,
    length: impl Fn(usize, usize) -> Result<usize, DecodeError>,
) -> Result<usize, DecodeError> {
    let value = length(*at, n)?;
    *at += n;
    Ok(value)
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
