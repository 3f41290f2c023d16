//! The real-engine tier: vLLM's CPU build behind `switchyard serve`, on
//! loopback, in one test binary (`engines`).
//!
//! The sim-worker shares the router's tokenizer, hashing and metric names,
//! so it cannot show the router drifting from the engines its users run.
//! These tests start real vLLM servers (tiny random-weight models made on
//! the spot, prefix caching and ZMQ KV events on) and check what the router
//! depends on against vLLM's own behaviour and counters.
//!
//! Run it with `scripts/test` (which installs what is missing, then runs
//! every test), or alone once the environment exists:
//!
//! ```sh
//! cargo run -p switchyard -- engines setup     # once: vLLM into a cached venv
//! cargo test -p switchyard --test engines
//! ```
//!
//! Without vLLM's environment each test prints why and passes, unless
//! `SWITCHYARD_REQUIRE_ENGINES=1` (`scripts/test` and CI set it): then a
//! missing environment fails. Tests run one at a time (each starts one or
//! two vLLM servers bound to their own core), each within a time bound;
//! every process a test starts is stopped when it ends, by a pass, a
//! failure or the bound.

#[allow(dead_code, unused_imports)]
#[path = "../it/support.rs"]
mod support;
mod tier;

mod adapters;
mod agentic;
mod data_parallel;
mod disagg;
mod kv_events;
mod migration;
mod twin;
mod two_models;
mod worker_state;
