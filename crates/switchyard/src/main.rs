//! The `switchyard` command: router, simulated worker, simulator and benchmarks.
//!
//! Each subcommand lives in the crate that owns it: `serve` in
//! `switchyard-server`, `sim-worker` in `switchyard-sim-worker`, `bench` in
//! `switchyard-bench`, the others (`replay`, `loadgen`, `demo`,
//! `calibrate`, `engines`, `events`) in `switchyard-commands`; `main` only
//! parses and dispatches.

use switchyard_bench as bench;

use clap::{CommandFactory as _, Parser, Subcommand};
use std::io::Write as _;
use std::process::ExitCode;

/// `--version`: the crate's version and the commit it was built from
/// (`build.rs`: a short hash, `-dirty` when tracked files had changes,
/// `unknown` outside a git checkout).
const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("SWITCHYARD_COMMIT"),
    ")"
);

/// Switchyard: a KV-cache-aware, session-aware request router for LLM
/// inference fleets.
#[derive(Debug, Parser)]
#[command(name = "switchyard", version = VERSION, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Compare routing policies on a trace in the fleet simulator (the main
    /// job: with no arguments it replays the bundled Mooncake conversation
    /// trace on the default fleet).
    Replay(switchyard_commands::replay::ReplayArgs),
    /// Benchmarks of the routing core (figures on stdout, `--json PATH` for files).
    #[command(subcommand)]
    Bench(bench::BenchCommand),
    /// Inspect engine KV events: decode a payload file, or listen to an engine.
    #[command(subcommand)]
    Events(switchyard_commands::events::EventsCommand),
    /// Sim-workers and the router on loopback, driven by the load generator; the default policy against round-robin.
    Demo(switchyard_commands::demo::DemoArgs),
    /// Real engines on this machine: install vLLM's CPU build, make tiny test models.
    #[command(subcommand)]
    Engines(switchyard_commands::engines::EnginesCommand),
    /// Replay a trace against any OpenAI-compatible endpoint and report latencies.
    Loadgen(switchyard_commands::loadgen::LoadgenArgs),
    /// Profile a live engine's prefill and decode times and write an engine profile (TOML) for --engine-profile.
    Calibrate(switchyard_commands::calibrate::CalibrateArgs),
    /// The router: OpenAI-compatible HTTP frontend routing to a fleet of workers.
    Serve(Box<switchyard_server::ServeArgs>),
    /// A simulated engine worker: OpenAI HTTP API, synthetic tokens paced by the timing model.
    SimWorker(switchyard_sim_worker::SimWorkerArgs),
    /// Print a shell's completion script for switchyard to stdout
    /// (e.g. `switchyard completions bash > ~/.local/share/bash-completion/completions/switchyard`).
    Completions {
        /// bash, zsh, fish, elvish or powershell.
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

/// Writes `shell`'s completion script (generated whole, then written: a
/// reader that closes the pipe early, such as `head`, is not an error).
fn completions(shell: clap_complete::Shell) -> anyhow::Result<()> {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "switchyard", &mut script);
    match std::io::stdout().write_all(&script) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// mimalloc, not glibc's malloc: under `serve`'s load the request path's
/// buffers are allocated on one tokio worker thread and freed on another,
/// and glibc then takes the owning arena's lock (futex waits in a `perf`
/// profile of `bench proxy`'s throughput phase).
///
/// Built without transparent huge pages (the crate's `no_thp`: mimalloc
/// does not `madvise` its arenas for them): with them, a page of the heap
/// that mimalloc had returned to the kernel came back, on its first touch,
/// as a whole 2 MiB page zeroed by the kernel, and on agent sessions'
/// 200 KB prompts that zeroing took 3.7–5.2% of the router's CPU
/// (`clear_page_erms` under `do_huge_pmd_anonymous_page` in `perf`;
/// docs/benchmarks.md, "Agent sessions"). A host whose THP mode is
/// `always` gives huge pages without the `madvise`; there,
/// `MIMALLOC_ALLOW_THP=0` in the environment turns them off for the process.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Replay(args) => switchyard_commands::replay::run(args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Events(cmd) => switchyard_commands::events::run(cmd),
        Command::Demo(args) => switchyard_commands::demo::run(args),
        Command::Engines(cmd) => switchyard_commands::engines::run(cmd),
        Command::Loadgen(args) => switchyard_commands::loadgen::run(args),
        Command::Calibrate(args) => switchyard_commands::calibrate::run(args),
        Command::Serve(args) => switchyard_server::run(*args),
        Command::SimWorker(args) => switchyard_sim_worker::run(args),
        Command::Completions { shell } => completions(shell),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => {
            eprintln!("switchyard: {err:#}");
            ExitCode::FAILURE
        }
    }
}
