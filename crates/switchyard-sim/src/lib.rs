//! Trace loaders and (to come) the discrete-event fleet simulator.
//!
//! - [`trace`] — streaming readers for public LLM-serving traces, with errors
//!   that name the offending line, and the deterministic expansion of
//!   Mooncake's 512-token hash ids into synthetic token ids.

#![warn(missing_docs)]

pub mod trace;
