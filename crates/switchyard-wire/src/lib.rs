//! Switchyard's wire formats: what crosses a socket, typed, with no I/O.
//!
//! Modules, in the order an engine's KV event meets them:
//!
//! - [`kv_events`] — the engines' KV-cache event batches (vLLM's format;
//!   SGLang's variant): typed [`kv_events::KvEventBatch`], a decoder for every
//!   shape the engines have shipped, and an encoder for the current vLLM shape
//!   (used by the simulated engine and by tests).
//! - [`normalize`] — decoded events to the prefix index's
//!   [`switchyard_core::index::IndexEvent`]: router-side block hashes from
//!   `token_ids`, partial blocks, storage tiers and hybrid-model groups
//!   filtered, every skip counted by reason.
//!
//! - [`openai`] — the OpenAI HTTP API: request bodies, answers and chunks,
//!   the error body; plain serde types that the router, the simulated
//!   worker and the load generator all read and write.
//! - [`sse`] — server-sent events: an incremental parser for any framing,
//!   the chunk classifier (done, error, delta) and the rewriter that moves a
//!   chunk into another response's shape.
//! - [`replica`] — replica events: one router replica's bookings
//!   ([`replica::ActiveSequenceEvent`]) and session bindings in a
//!   [`replica::ReplicaBatch`], MessagePack-encoded, for its peers.
//!
//! Data flows: socket bytes → [`kv_events::decode_batch_lossy`] →
//! [`normalize::Normalizer::normalize`] → `PrefixIndex::apply`; and a
//! worker's stream → [`sse::SseParser`] → [`sse::classify`] →
//! [`sse::StreamShape::rewrite`]. Sockets and HTTP frameworks live in the
//! crates that serve; nothing here blocks, allocates without bound or
//! panics on input.

#![warn(missing_docs)]

pub mod kv_events;
pub mod normalize;
pub mod openai;
pub mod replica;
pub mod sse;
