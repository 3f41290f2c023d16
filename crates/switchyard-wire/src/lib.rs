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
//! - [`agentic`] — the Responses and Anthropic Messages request bodies,
//!   read as their equivalent chat conversation, and their error bodies;
//!   [`agentic_events`] — their stream events, written (by the simulated
//!   worker and by the router's resumed streams alike).
//! - [`body_fields`] — a request body's top-level fields without a JSON
//!   tree, for rewriting a few of them; [`resume`] — the bodies of a
//!   stream resumed on another worker: which requests may be resumed, the
//!   token-id completion that resumes them, and (Responses, Messages) the
//!   resumed chunks rewritten into the API's events; [`disagg`] — what a
//!   disaggregated request's halves are sent and what is read of their
//!   answers (vLLM's transfer parameters, SGLang's bootstrap fields).
//! - [`stream_codec`] — what each API makes of a stream the router relays:
//!   one codec per API ([`stream_codec::chat::Chunks`],
//!   [`stream_codec::named::Named`]) reads the worker's events and writes
//!   the client's, a resumed worker's chunks in the API's shape included.
//! - [`engine_body`] — what of a client's body an engine is not told (a
//!   client's `priority` and `request_id`: the router's band and the
//!   engine's own ids speak instead).
//! - [`openai`] — the OpenAI HTTP API: request bodies, answers and chunks,
//!   the error body; plain serde types that the router, the simulated
//!   worker and the load generator all read and write.
//! - [`sse`] — server-sent events: an incremental parser for any framing,
//!   the chunk classifier (done, error, delta) and the rewriter that moves a
//!   chunk into another response's shape.
//! - [`replica`] — replica events: one router replica's bookings
//!   ([`replica::ActiveSequenceEvent`]) and session bindings in a
//!   [`replica::ReplicaBatch`], MessagePack-encoded, for its peers.
//! - [`prometheus`] — the Prometheus text format, read: one bounded,
//!   lossy reader ([`prometheus::Scrape`]) for every `/metrics` page the
//!   router and the tools look at, with a series' value by name and
//!   labels, and a metric's sum over its label sets.
//! - [`engine_metrics`] — what an engine's `/metrics` page says, in the
//!   sim-worker's, vLLM's and SGLang's own names: prefix-cache counters
//!   ([`engine_metrics::PrefixCacheCounters`]), KV usage, and vLLM's KV
//!   capacity ([`engine_metrics::KvCapacity`]).
//!
//! Data flows: socket bytes → [`kv_events::decode_batch_lossy`] →
//! [`normalize::Normalizer::normalize`] → `PrefixIndex::apply`; a
//! worker's stream → [`sse::SseParser`] → [`sse::classify`] →
//! [`sse::StreamShape::rewrite`]; and a worker's `/metrics` body →
//! [`prometheus::Scrape::parse_bytes`] → [`engine_metrics`]. Sockets and
//! HTTP frameworks live in the crates that serve; nothing here blocks,
//! allocates without bound or panics on input.

#![warn(missing_docs)]

pub mod agentic;
pub mod agentic_events;
pub mod body_fields;
pub mod disagg;
pub mod engine_body;
pub mod engine_metrics;
pub mod kv_events;
pub mod normalize;
pub mod openai;
pub mod prometheus;
pub mod replica;
pub mod resume;
pub mod sse;
pub mod stream_codec;
