//! `switchyard bench ...`: benchmarks that print figures and write JSON.

use clap::Subcommand;

pub mod engine;

/// Benchmarks.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Prefix-index benchmarks.
    #[command(subcommand)]
    Index(IndexBench),
    /// Simulated-engine scheduler steps per minute on one core.
    Engine(engine::EngineBench),
}

/// Prefix-index benchmarks.
#[derive(Debug, Subcommand)]
pub enum IndexBench {
    /// The standard indexer micro-workload.
    Micro,
}

pub fn run(cmd: BenchCommand) -> anyhow::Result<()> {
    match cmd {
        BenchCommand::Index(IndexBench::Micro) => anyhow::bail!("not built yet"),
        BenchCommand::Engine(opts) => engine::run(opts),
    }
}
