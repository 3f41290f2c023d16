//! The direct reader: the batches engines send (vLLM's map-tagged events,
//! the array-tagged ones, the sim-worker's) decoded straight from the
//! bytes, without an `rmpv` value for every token id and hash. Building
//! that tree was most of the decoding cost (about 4% of `serve`'s CPU on
//! agent sessions' long prompts, in a `perf` profile).
//!
//! It reads only what it reads exactly as the tree decoder does
//! ([`super::decode`]) and gives up (`None`) on anything else — a map
//! batch, an unknown tag or key, a repeated key, `extra_keys`,
//! `lookahead_token_ids` or `metadata` set, token pairs, any value the tree
//! decoder would refuse — so the caller decodes those through the tree:
//! the two cannot disagree (property-tested against each other). The
//! caller checks the payload against its limits first, as for the tree.

use super::{BlockRemoved, BlockStored, Format, KvEvent, KvEventBatch, REMOVED, STORED};
use rmp::Marker;
use switchyard_core::EngineHash;

/// The batch in `bytes`, when every part of it is a shape this reader
/// knows; `None` sends the caller to the tree decoder.
pub(super) fn decode(bytes: &[u8], format: Format, max_events: usize) -> Option<KvEventBatch> {
    let mut rd = bytes;
    let len = array_len(marker(&mut rd)?, &mut rd)?;
    if !(2..=3).contains(&len) {
        return None;
    }
    let ts = match marker(&mut rd)? {
        Marker::F64 => f64::from_be_bytes(be(&mut rd)?),
        Marker::F32 => f64::from(f32::from_be_bytes(be(&mut rd)?)),
        other => int(other, &mut rd)?.as_f64(),
    };
    let count = array_len(marker(&mut rd)?, &mut rd)?;
    if count > max_events {
        return None;
    }
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        events.push(event(&mut rd, format)?);
    }
    let data_parallel_rank = if len == 3 {
        opt_i64(marker(&mut rd)?, &mut rd)?
    } else {
        None
    };
    rd.is_empty().then_some(KvEventBatch {
        ts,
        events,
        data_parallel_rank,
    })
}

fn event(rd: &mut &[u8], format: Format) -> Option<KvEvent> {
    match marker(rd)? {
        m @ (Marker::FixMap(_) | Marker::Map16 | Marker::Map32) => {
            let len = map_len(m, rd)?;
            map_event(rd, len, format)
        }
        m => {
            let len = array_len(m, rd)?;
            array_event(rd, len, format)
        }
    }
}

/// The fields a `BlockStored` or `BlockRemoved` event may carry, read
/// before the tag is known (a map's `type` may come anywhere).
#[derive(Default)]
struct Fields {
    tag: Option<String>,
    block_hashes: Option<Vec<EngineHash>>,
    token_ids: Option<Vec<u32>>,
    block_size: Option<u32>,
    stored: BlockStored,
}

/// Keys a map event may carry, each once (their bit in `seen`).
const KEYS: [&str; 18] = [
    "type",
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
    "kv_cache_spec_sliding_window",
    "locality",
    "ownership",
    "session_id",
    "lookahead_token_ids",
    "cache_salt",
    "metadata",
];

fn map_event(rd: &mut &[u8], len: usize, format: Format) -> Option<KvEvent> {
    let mut fields = Fields::default();
    let mut seen = 0u32;
    for _ in 0..len {
        let key = string(marker(rd)?, rd)?;
        let index = KEYS.iter().position(|k| *k == key)?;
        if seen & (1 << index) != 0 {
            return None;
        }
        seen |= 1 << index;
        let m = marker(rd)?;
        let s = &mut fields.stored;
        match key {
            "type" => fields.tag = Some(string(m, rd)?.to_owned()),
            "block_hashes" => fields.block_hashes = Some(hashes(m, rd, format)?),
            "parent_block_hash" => s.parent_block_hash = opt_hash(m, rd, format)?,
            "token_ids" => fields.token_ids = Some(tokens(m, rd)?),
            "block_size" => fields.block_size = Some(token(m, rd)?),
            "lora_id" => s.lora_id = opt_i64(m, rd)?,
            "medium" => s.medium = opt_string(m, rd)?,
            "lora_name" => s.lora_name = opt_string(m, rd)?,
            "group_idx" => s.group_idx = opt_i64(m, rd)?,
            "kv_cache_spec_kind" => s.kv_cache_spec_kind = opt_string(m, rd)?,
            "kv_cache_spec_sliding_window" => s.kv_cache_spec_sliding_window = opt_i64(m, rd)?,
            "locality" => s.locality = opt_string(m, rd)?,
            "ownership" => s.ownership = opt_string(m, rd)?,
            "session_id" => s.session_id = opt_string(m, rd)?,
            "cache_salt" => s.cache_salt = opt_string(m, rd)?,
            // Opaque or nested: only their absence is read here.
            _ => nil(m)?,
        }
    }
    let tag = fields.tag.take()?;
    finish(&tag, fields)
}

fn array_event(rd: &mut &[u8], len: usize, format: Format) -> Option<KvEvent> {
    let tag = string(marker(rd)?, rd)?;
    let mut left = len.checked_sub(1)?;
    // Positional fields in declaration order; a missing tail reads as nil.
    let mut next = |rd: &mut &[u8]| -> Option<Marker> {
        if left == 0 {
            return Some(Marker::Null);
        }
        left -= 1;
        marker(rd)
    };
    let mut fields = Fields::default();
    match tag {
        STORED if len <= 15 => {
            fields.block_hashes = Some(hashes(next(rd)?, rd, format)?);
            fields.stored.parent_block_hash = opt_hash(next(rd)?, rd, format)?;
            fields.token_ids = Some(tokens(next(rd)?, rd)?);
            fields.block_size = Some(token(next(rd)?, rd)?);
            let s = &mut fields.stored;
            s.lora_id = opt_i64(next(rd)?, rd)?;
            s.medium = opt_string(next(rd)?, rd)?;
            s.lora_name = opt_string(next(rd)?, rd)?;
            nil(next(rd)?)?; // extra_keys
            s.group_idx = opt_i64(next(rd)?, rd)?;
            s.kv_cache_spec_kind = opt_string(next(rd)?, rd)?;
            s.kv_cache_spec_sliding_window = opt_i64(next(rd)?, rd)?;
            s.locality = opt_string(next(rd)?, rd)?;
            s.ownership = opt_string(next(rd)?, rd)?;
            s.session_id = opt_string(next(rd)?, rd)?;
        }
        REMOVED if len <= 6 => {
            fields.block_hashes = Some(hashes(next(rd)?, rd, format)?);
            let s = &mut fields.stored;
            s.medium = opt_string(next(rd)?, rd)?;
            s.group_idx = opt_i64(next(rd)?, rd)?;
            s.locality = opt_string(next(rd)?, rd)?;
            s.ownership = opt_string(next(rd)?, rd)?;
        }
        "AllBlocksCleared" if len == 1 => {}
        _ => return None,
    }
    finish(tag, fields)
}

/// The event `tag` names, from the fields read.
fn finish(tag: &str, fields: Fields) -> Option<KvEvent> {
    let Fields {
        block_hashes,
        token_ids,
        block_size,
        stored,
        ..
    } = fields;
    match tag {
        STORED => Some(KvEvent::BlockStored(Box::new(BlockStored {
            block_hashes: block_hashes?,
            token_ids: token_ids?,
            block_size: block_size?,
            ..stored
        }))),
        REMOVED => Some(KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: block_hashes?,
            medium: stored.medium,
            group_idx: stored.group_idx,
            locality: stored.locality,
            ownership: stored.ownership,
        })),
        "AllBlocksCleared" => Some(KvEvent::AllBlocksCleared),
        _ => None,
    }
}

fn marker(rd: &mut &[u8]) -> Option<Marker> {
    rmp::decode::read_marker(rd).ok()
}

/// The next `N` bytes.
fn be<const N: usize>(rd: &mut &[u8]) -> Option<[u8; N]> {
    let (head, tail) = rd.split_first_chunk::<N>()?;
    *rd = tail;
    Some(*head)
}

fn take<'a>(rd: &mut &'a [u8], len: usize) -> Option<&'a [u8]> {
    if rd.len() < len {
        return None;
    }
    let (head, tail) = rd.split_at(len);
    *rd = tail;
    Some(head)
}

/// A length of `N` big-endian bytes.
fn len_of<const N: usize>(rd: &mut &[u8]) -> Option<usize> {
    let bytes = be::<N>(rd)?;
    let mut wide = [0u8; 8];
    wide[8 - N..].copy_from_slice(&bytes);
    usize::try_from(u64::from_be_bytes(wide)).ok()
}

fn array_len(m: Marker, rd: &mut &[u8]) -> Option<usize> {
    match m {
        Marker::FixArray(n) => Some(usize::from(n)),
        Marker::Array16 => len_of::<2>(rd),
        Marker::Array32 => len_of::<4>(rd),
        _ => None,
    }
}

fn map_len(m: Marker, rd: &mut &[u8]) -> Option<usize> {
    match m {
        Marker::FixMap(n) => Some(usize::from(n)),
        Marker::Map16 => len_of::<2>(rd),
        Marker::Map32 => len_of::<4>(rd),
        _ => None,
    }
}

/// A msgpack integer as `rmpv` holds it: non-negative ones (whatever
/// their marker) as unsigned, negative ones as signed.
#[derive(Clone, Copy)]
enum Int {
    Unsigned(u64),
    Negative(i64),
}

impl Int {
    fn signed(value: i64) -> Self {
        u64::try_from(value).map_or(Int::Negative(value), Int::Unsigned)
    }

    fn as_u64(self) -> Option<u64> {
        match self {
            Int::Unsigned(n) => Some(n),
            Int::Negative(_) => None,
        }
    }

    fn as_i64(self) -> Option<i64> {
        match self {
            Int::Unsigned(n) => i64::try_from(n).ok(),
            Int::Negative(n) => Some(n),
        }
    }

    fn as_f64(self) -> f64 {
        match self {
            Int::Unsigned(n) => n as f64,
            Int::Negative(n) => n as f64,
        }
    }
}

fn int(m: Marker, rd: &mut &[u8]) -> Option<Int> {
    Some(match m {
        Marker::FixPos(n) => Int::Unsigned(u64::from(n)),
        Marker::U8 => Int::Unsigned(u64::from(u8::from_be_bytes(be(rd)?))),
        Marker::U16 => Int::Unsigned(u64::from(u16::from_be_bytes(be(rd)?))),
        Marker::U32 => Int::Unsigned(u64::from(u32::from_be_bytes(be(rd)?))),
        Marker::U64 => Int::Unsigned(u64::from_be_bytes(be(rd)?)),
        Marker::FixNeg(n) => Int::signed(i64::from(n)),
        Marker::I8 => Int::signed(i64::from(i8::from_be_bytes(be(rd)?))),
        Marker::I16 => Int::signed(i64::from(i16::from_be_bytes(be(rd)?))),
        Marker::I32 => Int::signed(i64::from(i32::from_be_bytes(be(rd)?))),
        Marker::I64 => Int::signed(i64::from_be_bytes(be(rd)?)),
        _ => return None,
    })
}

fn string<'a>(m: Marker, rd: &mut &'a [u8]) -> Option<&'a str> {
    let len = match m {
        Marker::FixStr(n) => usize::from(n),
        Marker::Str8 => len_of::<1>(rd)?,
        Marker::Str16 => len_of::<2>(rd)?,
        Marker::Str32 => len_of::<4>(rd)?,
        _ => return None,
    };
    std::str::from_utf8(take(rd, len)?).ok()
}

fn nil(m: Marker) -> Option<()> {
    (m == Marker::Null).then_some(())
}

fn opt_string(m: Marker, rd: &mut &[u8]) -> Option<Option<String>> {
    match m {
        Marker::Null => Some(None),
        m => Some(Some(string(m, rd)?.to_owned())),
    }
}

fn opt_i64(m: Marker, rd: &mut &[u8]) -> Option<Option<i64>> {
    match m {
        Marker::Null => Some(None),
        m => Some(Some(int(m, rd)?.as_i64()?)),
    }
}

/// A token id (or a block size): an unsigned integer that fits `u32`.
fn token(m: Marker, rd: &mut &[u8]) -> Option<u32> {
    u32::try_from(int(m, rd)?.as_u64()?).ok()
}

/// Flat token ids; pairs are left to the tree decoder.
fn tokens(m: Marker, rd: &mut &[u8]) -> Option<Vec<u32>> {
    let len = array_len(m, rd)?;
    // Each id takes at least one byte: a length past the bytes left is a
    // truncated payload, not a reason to reserve.
    let mut ids = Vec::with_capacity(len.min(rd.len()));
    for _ in 0..len {
        ids.push(token(marker(rd)?, rd)?);
    }
    Some(ids)
}

/// A block hash, as the tree decoder reads one: any integer (a negative
/// one as its two's complement) or, outside SGLang, bytes whose last 8
/// are the big-endian `u64`.
fn hash(m: Marker, rd: &mut &[u8], format: Format) -> Option<EngineHash> {
    let len = match m {
        Marker::Bin8 => len_of::<1>(rd)?,
        Marker::Bin16 => len_of::<2>(rd)?,
        Marker::Bin32 => len_of::<4>(rd)?,
        m => {
            return Some(EngineHash(match int(m, rd)? {
                Int::Unsigned(n) => n,
                Int::Negative(n) => n as u64,
            }))
        }
    };
    let bytes = take(rd, len)?;
    if format == Format::Sglang || len < 8 {
        return None;
    }
    Some(EngineHash(u64::from_be_bytes(
        bytes[len - 8..].try_into().ok()?,
    )))
}

fn opt_hash(m: Marker, rd: &mut &[u8], format: Format) -> Option<Option<EngineHash>> {
    match m {
        Marker::Null => Some(None),
        m => Some(Some(hash(m, rd, format)?)),
    }
}

fn hashes(m: Marker, rd: &mut &[u8], format: Format) -> Option<Vec<EngineHash>> {
    let len = array_len(m, rd)?;
    let mut out = Vec::with_capacity(len.min(rd.len()));
    for _ in 0..len {
        out.push(hash(marker(rd)?, rd, format)?);
    }
    Some(out)
}
