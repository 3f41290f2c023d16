//! The `switchyard` binary's library: everything that does I/O.
//!
//! `main.rs` only parses the command line and dispatches to these modules;
//! integration tests in `tests/` drive the same modules and the built binary.
//!
//! - [`bench`] — `switchyard bench ...`: benchmarks that print figures and
//!   write JSON.
//! - [`data`] — finding the bundled data files.
//! - [`demo`] — `switchyard demo`: sim-workers and the router on loopback,
//!   `kv` against `round-robin`.
//! - [`events`] — the KV-event plane: engine KV events over ZMQ (publisher,
//!   subscriber with gap replay, metrics) and `switchyard events ...`.
//! - [`loadgen`] — `switchyard loadgen`: the OpenAI-API load generator.
//! - [`replica`] — replica sync: bookings shared between router replicas
//!   over NATS (or in process), publisher, subscriber, worker-origin marks.
//! - [`replay`] — `switchyard replay`: policies compared in the fleet
//!   simulator, with a table, JSON and SVG plots.
//! - [`server`] — `switchyard serve`: the router's HTTP frontend, proxy,
//!   worker fleet, admission wiring and metrics.
//! - [`sim_worker`] — `switchyard sim-worker`: a simulated engine behind an
//!   OpenAI-compatible HTTP server, driven in real time.

pub mod bench;
pub mod data;
pub mod demo;
pub mod events;
pub mod loadgen;
pub mod replay;
pub mod replica;
pub mod server;
pub mod sim_worker;
