//! Engine KV-cache events: the typed batch, its decoder and its encoder.
//!
//! Wire facts, checked against the engines' own struct definitions (vLLM
//! `vllm/distributed/kv_events.py`, SGLang
//! `python/sglang/srt/disaggregation/kv_events.py`; both use msgspec):
//!
//! - A payload is one msgpack value: the batch `[ts, events, rank]`
//!   (msgspec `array_like`). vLLM calls the rank `data_parallel_rank`, SGLang
//!   `attn_dp_rank`; with `omit_defaults` a nil rank is left off, giving a
//!   two-element array (older vLLM, and SGLang before `attn_dp_rank`
//!   existed: SGLang's publisher has filled the rank since at least 0.5.5).
//!   One vLLM revision encoded the batch as a map
//!   (`{"ts", "events", "data_parallel_rank"}`); the decoder takes both.
//! - Each event is a map tagged by `"type"` (current vLLM and SGLang) or an
//!   array whose first element is the tag (older vLLM and SGLang). Array
//!   fields are positional in declaration order; trailing defaulted fields
//!   may be absent.
//! - `BlockStored` declares, in order: `block_hashes`, `parent_block_hash`,
//!   `token_ids`, `block_size`, `lora_id`, `medium`, `lora_name`, then the
//!   defaulted `extra_keys`, `group_idx`, `kv_cache_spec_kind`,
//!   `kv_cache_spec_sliding_window`, `locality`, `ownership`, `session_id`
//!   (vLLM; later fields appeared over releases). SGLang's has `block_hashes`,
//!   `parent_block_hash`, `token_ids`, `block_size`, `lora_id`, `medium`, and
//!   in map form (0.5.20 on) `cache_salt`, `session_id` and (0.5.22 on)
//!   `lora_name`, each only when set; 0.5.18's arrays carry a trailing
//!   `metadata` map holding `cache_salt`. Since 0.5.18 SGLang merges a
//!   prompt's consecutive pages into one event with several hashes, and it
//!   never publishes a partial page. Payloads captured from vLLM 0.32 and
//!   SGLang 0.5.23 are tested as they are (`tests/fixtures/captured`).
//! - `BlockRemoved`: `block_hashes`, `medium`, then `group_idx`, `locality`,
//!   `ownership`.
//! - A block hash is any msgpack integer (SGLang's are signed 64-bit: the
//!   decoder reinterprets them as `u64`, two's complement) or bytes (vLLM's
//!   32-byte hashes: the last 8 bytes, big-endian, are the `u64`).
//! - `medium` strings: `"GPU"`, `"CPU"`, `"CPU_PINNED"`, `"DISK"`,
//!   `"STORAGE"`, `"EXTERNAL"`, or nil (= device).
//!
//! Decoding is liberal where engines differ (unknown keys, extra trailing
//! array elements, missing optional fields) and strict where a wrong value
//! would corrupt the index (a hash, a token id, a block size of the wrong
//! type is an error, never a guess).

mod decode;
mod direct;
mod encode;

pub use decode::{decode_batch, decode_batch_lossy, decode_batch_lossy_within, EventError};
pub use encode::{encode_batch, encode_batch_with, HashEncoding};

use switchyard_core::EngineHash;

/// The default ZMQ topic of both engines (empty: every message matches).
pub const DEFAULT_TOPIC: &str = "";

/// Sequence number of the replay end marker (`-1` as signed big-endian).
pub const END_OF_REPLAY_SEQ: u64 = u64::MAX;

/// One published batch of KV events, as the engine sent it.
#[derive(Clone, Debug, PartialEq)]
pub struct KvEventBatch {
    /// Engine wall-clock time of the batch, in seconds since the epoch.
    pub ts: f64,
    /// Events in the order the engine produced them.
    pub events: Vec<KvEvent>,
    /// The data-parallel rank that published the batch (SGLang: its
    /// attention-DP rank), when the engine said.
    pub data_parallel_rank: Option<i64>,
}

/// One KV-cache event.
#[derive(Clone, Debug, PartialEq)]
pub enum KvEvent {
    /// A chain of blocks was stored (or reused: inserts are idempotent).
    /// Boxed: it is several times the size of the other variants.
    BlockStored(Box<BlockStored>),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The engine dropped its whole cache.
    AllBlocksCleared,
    /// An event type this decoder does not know: kept so the batch's other
    /// events survive; the normalizer counts and skips it.
    Unknown {
        /// The tag the engine sent.
        tag: String,
    },
}

/// The tags of the block events on the wire.
const STORED: &str = "BlockStored";
const REMOVED: &str = "BlockRemoved";

impl KvEvent {
    /// The event's tag on the wire.
    pub fn type_name(&self) -> &str {
        match self {
            KvEvent::BlockStored(_) => STORED,
            KvEvent::BlockRemoved(_) => REMOVED,
            KvEvent::AllBlocksCleared => "AllBlocksCleared",
            KvEvent::Unknown { tag } => tag,
        }
    }
}

/// `BlockStored`, fields under vLLM's names.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockStored {
    /// Engine ids of the stored blocks, in prompt order.
    pub block_hashes: Vec<EngineHash>,
    /// Engine id of the block the first one follows (`None`: a root chain).
    pub parent_block_hash: Option<EngineHash>,
    /// All tokens of the listed blocks (the first element of each entry when
    /// the engine sent `(token, next_token)` pairs).
    pub token_ids: Vec<u32>,
    /// The second elements, when the engine sent pairs (EAGLE-style caches).
    pub token_pair_next_ids: Option<Vec<u32>>,
    /// Tokens per block, as the engine counts them.
    pub block_size: u32,
    /// Deprecated LoRA adapter id.
    pub lora_id: Option<i64>,
    /// Storage tier name (see [`crate::normalize::Tier`]); `None` = device.
    pub medium: Option<String>,
    /// LoRA adapter name; folds into the router's hash seed.
    pub lora_name: Option<String>,
    /// Per-block extra hash inputs (multimodal ids, salt, ...), opaque.
    pub extra_keys: Option<rmpv::Value>,
    /// KV-cache group of a hybrid model.
    pub group_idx: Option<i64>,
    /// The group's attention kind (`"full_attention"`, `"sliding_window"`, ...).
    pub kv_cache_spec_kind: Option<String>,
    /// The group's sliding window, for windowed kinds.
    pub kv_cache_spec_sliding_window: Option<i64>,
    /// `LOCAL` or `REMOTE` relative to the publisher.
    pub locality: Option<String>,
    /// Secondary offloading tier identifier.
    pub ownership: Option<String>,
    /// Session id the engine attached, if any.
    pub session_id: Option<String>,
    /// Speculative look-ahead tokens, opaque.
    pub lookahead_token_ids: Option<rmpv::Value>,
    /// SGLang's cache salt; folds into the router's hash seed.
    pub cache_salt: Option<String>,
}

/// `BlockRemoved`, fields under vLLM's names.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct BlockRemoved {
    /// Engine ids of the evicted blocks.
    pub block_hashes: Vec<EngineHash>,
    /// Storage tier the blocks left; `None` = device.
    pub medium: Option<String>,
    /// KV-cache group of a hybrid model.
    pub group_idx: Option<i64>,
    /// `LOCAL` or `REMOTE` relative to the publisher.
    pub locality: Option<String>,
    /// Secondary offloading tier identifier.
    pub ownership: Option<String>,
}

/// Which engine's shapes the decoder accepts. `Auto` accepts the union;
/// the others reject shapes that engine never sends, which makes a
/// misconfigured endpoint fail loudly rather than decode by luck.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Format {
    /// Every shape either engine has shipped.
    #[default]
    Auto,
    /// vLLM: array or map batch; map or array events; int or bytes hashes.
    Vllm,
    /// SGLang: array batch; map or array events; integer hashes only.
    Sglang,
}

/// How much one payload may cost to decode. A real batch is far below both
/// defaults: a 128 Ki-token prompt stored in one step is about 130 Ki
/// values (about 4 MiB of tree), and an engine step's events number in the
/// hundreds to thousands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DecodeLimits {
    /// Most bytes the intermediate value tree may take (one `rmpv::Value`
    /// per msgpack value, plus string and binary bytes). Default 64 MiB.
    pub max_tree_bytes: usize,
    /// Most events one batch may carry. Default 65,536.
    pub max_events: usize,
}

impl Default for DecodeLimits {
    fn default() -> Self {
        Self {
            max_tree_bytes: 64 << 20,
            max_events: 65_536,
        }
    }
}

/// Why a payload or one of its events could not be decoded. Every variant
/// is an outcome of bad input, never a bug; [`DecodeError::reason`] is a
/// stable label for metrics.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum DecodeError {
    /// Not one well-formed msgpack value.
    #[error("not valid msgpack: {0}")]
    Msgpack(String),
    /// Bytes left over after the payload's one value.
    #[error("{0} trailing bytes after the batch")]
    TrailingBytes(usize),
    /// The batch is neither `[ts, events, ...]` nor a map with those keys.
    #[error("batch is not [ts, events, rank] or a map with ts and events")]
    BatchShape,
    /// The batch shape is valid msgpack but not one the chosen format sends.
    #[error("batch shape not sent by {0:?}")]
    FormatMismatch(Format),
    /// A required field is absent.
    #[error("{event}: missing field `{field}`")]
    MissingField {
        /// Event type (or `batch`).
        event: &'static str,
        /// Field name.
        field: &'static str,
    },
    /// A field has the wrong msgpack type or an out-of-range value.
    #[error("{event}: field `{field}` has an invalid value")]
    InvalidField {
        /// Event type (or `batch`).
        event: &'static str,
        /// Field name.
        field: &'static str,
    },
    /// An event is neither a tagged map nor a tagged array.
    #[error("event is neither a map with a \"type\" nor an array with a tag")]
    EventShape,
    /// The payload's value tree would take more than the decode budget;
    /// nothing of it was built.
    #[error("payload would decode past the {budget}-byte budget")]
    OverBudget {
        /// [`DecodeLimits::max_tree_bytes`].
        budget: usize,
    },
    /// More events in one batch than [`DecodeLimits::max_events`].
    #[error("{0} events in one batch, past the cap")]
    TooManyEvents(usize),
}

impl DecodeError {
    /// Stable label for `switchyard_kv_events_dropped_total{reason}`.
    pub fn reason(&self) -> &'static str {
        match self {
            DecodeError::Msgpack(_) | DecodeError::TrailingBytes(_) => "invalid_msgpack",
            DecodeError::BatchShape | DecodeError::FormatMismatch(_) => "invalid_batch",
            DecodeError::MissingField { .. } => "missing_field",
            DecodeError::InvalidField { .. } => "invalid_field",
            DecodeError::EventShape => "invalid_event",
            DecodeError::OverBudget { .. } => "over_decode_budget",
            DecodeError::TooManyEvents(_) => "too_many_events",
        }
    }
}

#[cfg(test)]
mod tests;
