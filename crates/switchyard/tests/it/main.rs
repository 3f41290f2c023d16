//! The `switchyard` binary's integration tests, in one test binary (`it`):
//! each module starts the built binary (`CARGO_BIN_EXE_switchyard`) as real
//! processes on loopback and drives them over real sockets. What they share
//! (processes that die with the test, `/metrics`, waits on conditions, the
//! machine itself: every test holds it shared, a test that times the router
//! to the millisecond holds it alone) is in `support`.
//!
//! One module per command or concern; run one with
//! `cargo test -p switchyard --test it serve_migration::`.

mod support;
// Workers that fail on purpose; the server crate's tests use them too.
#[path = "../../../switchyard-server/tests/it/scripted_worker.rs"]
mod scripted_worker;

mod agentic_clients;
mod calibrate;
mod cli;
mod deploy;
mod events_decode;
mod layout;
mod openai_client;
mod replay_tune;
mod replica_security;
mod serve_adapters;
mod serve_boundaries;
mod serve_boundaries_budget;
mod serve_chaos;
mod serve_disagg;
mod serve_dp;
mod serve_ending;
mod serve_errors;
mod serve_limits;
mod serve_migration;
mod serve_models;
mod serve_reliability;
mod serve_replica_sync;
mod serve_response_chain;
mod serve_routing;
mod serve_security;
mod serve_tenants;
mod serve_tls;
mod sim_worker;
mod sim_worker_apis;
