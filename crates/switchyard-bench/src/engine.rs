//! `switchyard bench engine`: scheduler steps per minute on one core.
//!
//! A steady workload: `concurrency` requests in flight, each finished one
//! replaced at once; prompts share one of a few system prefixes; KV events
//! are on and drained every step, as a driver would.

use anyhow::Context;
use clap::Args;
use serde_json::json;
use std::time::Instant;
use switchyard_core::hashing::DEFAULT_SEED;
use switchyard_core::RequestId;
use switchyard_engine::{Engine, EngineConfig, NewRequest, StepReport, SyncDevice};

/// Options of `bench engine`.
#[derive(Debug, Args)]
pub struct EngineBench {
    /// Scheduler steps to time.
    #[arg(long, default_value_t = 300_000)]
    pub steps: u64,
    /// Requests kept in flight.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Prompt length in tokens (half of it a shared prefix).
    #[arg(long, default_value_t = 1024)]
    pub prompt_tokens: u32,
    /// Output tokens per request.
    #[arg(long, default_value_t = 256)]
    pub output_tokens: u32,
    /// Write the figures as JSON to this path.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
}

/// Runs the benchmark and prints (and optionally writes) its figures.
pub fn run(opts: EngineBench) -> anyhow::Result<()> {
    let config = EngineConfig::default();
    let device = SyncDevice::new(config.timing.clone());
    let mut engine = Engine::new(config, device)?;
    let mut next = 0u64;
    let mut add = |engine: &mut Engine<SyncDevice>| {
        next += 1;
        let shared = opts.prompt_tokens / 2;
        let prefix = (next % 4) as u32;
        let mut prompt: Vec<u32> = (0..shared).map(|t| prefix * 1_000_000 + t).collect();
        prompt.extend(
            (0..opts.prompt_tokens - shared)
                .map(|t| (next as u32).wrapping_mul(7919) ^ (t + 50_000_000)),
        );
        engine.add_request(NewRequest {
            id: RequestId(u128::from(next)),
            prompt,
            max_tokens: opts.output_tokens,
            hash_seed: DEFAULT_SEED,
            lora_name: None,
        })
    };
    for _ in 0..opts.concurrency {
        add(&mut engine)?;
    }
    let mut report = StepReport::default();
    let mut events = Vec::new();
    let mut tokens = 0u64;
    let mut model_ms = 0.0;
    let start = Instant::now();
    for _ in 0..opts.steps {
        engine.step(&mut report)?;
        engine.drain_kv_events(&mut events);
        events.clear();
        tokens += report.tokens.len() as u64;
        model_ms += report.model_ms;
        for _ in 0..report.finished.len() {
            add(&mut engine)?;
        }
    }
    let wall = start.elapsed().as_secs_f64();
    let steps_per_minute = opts.steps as f64 / wall * 60.0;
    let counters = engine.counters();
    let figures = json!({
        "steps": opts.steps,
        "wall_seconds": wall,
        "steps_per_minute": steps_per_minute,
        "mean_step_us": wall * 1e6 / opts.steps as f64,
        "tokens_per_step": tokens as f64 / opts.steps as f64,
        "model_seconds_simulated": model_ms / 1e3,
        "preemptions": counters.preemptions,
        "prefix_hit_ratio": counters.prefix_hit_tokens as f64 / counters.prompt_tokens.max(1) as f64,
        "workload": {
            "concurrency": opts.concurrency,
            "prompt_tokens": opts.prompt_tokens,
            "output_tokens": opts.output_tokens,
            "num_blocks": engine.config().num_blocks,
            "block_size": engine.config().block_size,
        },
    });
    println!("{}", serde_json::to_string_pretty(&figures)?);
    if let Some(path) = opts.json {
        std::fs::write(&path, serde_json::to_vec_pretty(&figures)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}
