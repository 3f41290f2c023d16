//! The `switchyard` binary's commands beside the router (`serve`:
//! `switchyard-server`), the simulated worker (`sim-worker`:
//! `switchyard-sim-worker`) and the benchmarks (`bench`:
//! `switchyard-bench`, which builds on these).
//!
//! The binary (`crates/switchyard`) only parses the command line and
//! dispatches to these modules; its integration tests drive the same
//! modules and the built binary.
//!
//! - [`agentic`] — the agent workload's file (`--agentic-config`) and
//!   vocabulary, which `replay` and `loadgen` share.
//! - [`calibrate`] — `switchyard calibrate`: a live engine's prefill and
//!   decode times fitted into an engine profile (`--engine-profile`).
//! - [`child`] — this binary's subcommands started as child processes
//!   (sim-workers, routers) and the address each prints, and the cores a
//!   benchmark gives each.
//! - [`data`] — finding the bundled data files.
//! - [`demo`] — `switchyard demo`: sim-workers and the router on loopback,
//!   the default policy against `round-robin`.
//! - [`engines`] — real engines (vLLM's CPU build) on this machine: their
//!   pinned Python environment, tiny test models, servers as child
//!   processes; `switchyard engines ...`.
//! - [`events`] — `switchyard events ...`: inspect engines' KV events.
//! - [`loadgen`] — `switchyard loadgen`: the OpenAI-API load generator.
//! - [`replay`] — `switchyard replay`: policies compared in the fleet
//!   simulator, with a table, JSON and SVG plots.
//! - [`tenants`] — tenant mixes: the scenario file `replay --tenants` and
//!   `loadgen --tenants` share.
//! - [`stats`] — what every reporting command shares: latency summaries,
//!   JSON output, resident memory.

pub mod agentic;
pub mod calibrate;
pub mod child;
pub mod data;
pub mod demo;
pub mod engines;
pub mod events;
pub mod loadgen;
pub mod replay;
pub mod stats;
pub mod tenants;
