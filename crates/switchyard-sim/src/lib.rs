//! Trace loaders and the discrete-event fleet simulator.
//!
//! - [`trace`] — streaming readers for public LLM-serving traces, with errors
//!   that name the offending line, and the deterministic expansion of
//!   Mooncake's 512-token hash ids into synthetic token ids.
//! - [`workload`] — every trace as a stream of sessions of turns, with
//!   compact prompts expanded only at dispatch; ShareGPT conversations as
//!   sessions; the synthetic multi-turn generator.
//! - [`fleet`] — the simulator: the real request lifecycle (the core's
//!   dispatcher) against simulated engine cores in virtual time. A file a
//!   role: the event loop in `fleet` itself, `config` (fleet,
//!   disaggregation and link settings), `event` (the event queue's
//!   entries), `arrival` (a turn's way onto an engine), `steps` (engine
//!   steps and what they carry back), `disagg` (prefill and decode halves,
//!   lent prefixes, their transfers and leases), `replica_sync` (what the
//!   replicas publish reaching their peers), `outcome` (the figures).
//! - [`engine_events`] — the simulated engine's KV events in vLLM's wire
//!   shapes and, through the router's normalizer, as index events.
//! - [`replicas`] — several router replicas in front of one fleet: their
//!   booking sync (delay, or none), the load balancer that spreads requests
//!   over them, and what their stale views cost.
//! - [`report`] — latency summaries and per-policy figures.
//! - [`reference`] — the infinite-cache bound and the pooled-LRU reference
//!   that policies' hit rates are read against.

#![warn(missing_docs)]

pub mod adapters;
pub mod engine_events;
pub mod fleet;
pub mod reference;
pub mod replicas;
pub mod report;
pub mod trace;
pub mod workload;
