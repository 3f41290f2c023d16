//! Trace loaders and (to come) the discrete-event fleet simulator.
//!
//! - [`trace`] — streaming readers for public LLM-serving traces, with errors
//!   that name the offending line, and the deterministic expansion of
//!   Mooncake's 512-token hash ids into synthetic token ids.
//! - [`workload`] — every trace as a stream of sessions of turns, with
//!   compact prompts expanded only at dispatch; the synthetic multi-turn
//!   generator.
//! - [`reference`] — the infinite-cache bound and the pooled-LRU reference
//!   that policies' hit rates are read against.

#![warn(missing_docs)]

pub mod reference;
pub mod trace;
pub mod workload;
