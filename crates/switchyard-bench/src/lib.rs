//! `switchyard bench ...`: benchmarks that print figures and write JSON,
//! out of the product's crates. They drive the router, the sim-workers and
//! the simulator through the binary's own commands (`switchyard-commands`:
//! the load generator, `replay`, the child processes, the real-engine
//! environment); the criterion benches (`benches/`: routing, admission,
//! metrics) sit beside them.
//!
//! - [`admission`] — live progress and session-aware admission;
//! - [`micro`] — the standard indexer micro-workload;
//! - [`trace`] — the index under a real trace's event stream;
//! - [`engine`] — simulated-engine scheduler steps per minute;
//! - [`replica`] — replica events per second over NATS and booking →
//!   visibility latency on a peer;
//! - [`proxy`] — the router's added latency and request rate against one
//!   sim-worker directly and, with `--peer`, against SGLang's routers;
//! - [`relay`] — a TCP relay that copies bytes only: `bench proxy`'s
//!   floor for what one extra hop adds;
//! - [`peer`] — SGLang's routers as peers: install, launch, readiness;
//! - [`soak`] — bounded memory under a long load: the routing core driven
//!   by simulated engines' KV events, or the router server under a
//!   demo-like load; a plateau verdict on the samples;
//! - [`itl`] — does a sim-worker keep its timing model's time: model
//!   against measured TTFT and inter-token latency per speed-up;
//! - [`twin`] — does `replay` predict `serve`: one trace slice through the
//!   fleet simulator and through the router and sim-worker processes;
//! - [`contention`] — routing decisions while KV events from several
//!   workers are applied concurrently;
//! - [`tokenize`] — the router's tokenizer (fast path, segment cache)
//!   against the `tokenizers` crate;
//! - [`tokenize_gate`] — a light tenant's latency beside a noisy tenant's
//!   long prompts, with the router's tokenizing gate and without;
//! - [`versus`] — Switchyard against SGLang's routers (`smg`,
//!   `sglang-router`) on the same conversations, each in front of fresh
//!   sim-workers.

pub mod admission;
pub mod contention;
pub mod engine;
pub mod itl;
pub mod micro;
pub mod peer;
pub mod proxy;
pub mod relay;
pub mod replica;
pub mod soak;
pub mod tokenize;
pub mod tokenize_gate;
pub mod trace;
pub mod twin;
pub mod versus;

use clap::Subcommand;

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Prefix-index benchmarks.
    #[command(subcommand)]
    Index(IndexBench),
    /// Simulated-engine scheduler steps per minute on one core.
    Engine(engine::EngineBench),
    /// Admission: live progress, admit + event with many sessions retained.
    Admission(admission::AdmissionArgs),
    /// Replica sync over a local NATS server: events/s and visibility latency.
    Replica(replica::ReplicaArgs),
    /// Router overhead: the same load to one sim-worker directly, through the router, through a relay that only copies bytes (the floor of an extra hop) and through SGLang's routers.
    Proxy(proxy::ProxyArgs),
    /// A TCP relay that copies bytes and parses nothing (`bench proxy`
    /// runs it as the floor of a proxy's added latency).
    #[command(hide = true)]
    Relay(relay::RelayArgs),
    /// Bounded memory: the core (or, with --server, the router process) under a long load.
    Soak(soak::SoakArgs),
    /// Sim-worker timing: model against measured TTFT and inter-token latency per speed-up.
    Itl(itl::ItlArgs),
    /// Does replay predict serve: one trace slice through the simulator and through real processes.
    Twin(twin::TwinArgs),
    /// Switchyard against SGLang's routers (smg, sglang-router) on the same conversations.
    Versus(Box<versus::VersusArgs>),
    /// The router's tokenizer against the tokenizers crate: fresh prompts and a long chat's last turn.
    Tokenize(tokenize::TokenizeArgs),
    /// Routing decisions at 64 workers while KV events from 8 are applied concurrently.
    Contention(contention::ContentionArgs),
    /// A light tenant's TTFT beside a noisy tenant's long prompts: the tokenizing gate against none.
    TokenizeGate(tokenize_gate::TokenizeGateArgs),
}

/// Prefix-index benchmarks.
#[derive(Debug, Subcommand)]
pub enum IndexBench {
    /// The standard indexer micro-workload (store, remove, overlaps hit/miss).
    Micro(micro::MicroArgs),
    /// Replay a Mooncake trace as KV events and queries.
    Trace(trace::TraceArgs),
}

/// Runs a benchmark.
pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Index(IndexBench::Micro(args)) => micro::run(args),
        BenchCommand::Index(IndexBench::Trace(args)) => trace::run(args),
        BenchCommand::Engine(opts) => engine::run(opts),
        BenchCommand::Admission(args) => admission::run(args),
        BenchCommand::Replica(args) => replica::run(args),
        BenchCommand::Proxy(args) => proxy::run(args),
        BenchCommand::Relay(args) => relay::run(args),
        BenchCommand::Soak(args) => soak::run(args),
        BenchCommand::Itl(args) => itl::run(args),
        BenchCommand::Twin(args) => twin::run(args),
        BenchCommand::Versus(args) => versus::run(*args),
        BenchCommand::Tokenize(args) => tokenize::run(args),
        BenchCommand::Contention(args) => contention::run(args),
        BenchCommand::TokenizeGate(args) => tokenize_gate::run(args),
    }
}
