//! `switchyard events ...`: inspect engines' KV events (the plane itself is
//! the `switchyard-kv-events` crate).
//!
//! - [`json`] — a decoded batch as the JSON `events decode` prints.

pub mod json;

use anyhow::Context as _;
use clap::{Args, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use switchyard_core::index::TieredIndex;
use switchyard_core::WorkerId;
use switchyard_wire::kv_events::{decode_batch, Format};

/// `switchyard events ...`: inspect engine KV events.
#[derive(Debug, Subcommand)]
pub enum EventsCommand {
    /// Decode one msgpack payload file and print it as JSON.
    Decode(DecodeArgs),
    /// Subscribe to an engine's KV events and print a live summary.
    Listen(ListenArgs),
}

/// Payload shapes to accept.
#[derive(Clone, Copy, Debug, Default, ValueEnum)]
pub enum FormatArg {
    /// Any shape either engine sends.
    #[default]
    Auto,
    /// vLLM's shapes.
    Vllm,
    /// SGLang's shapes.
    Sglang,
}

impl From<FormatArg> for Format {
    fn from(arg: FormatArg) -> Self {
        match arg {
            FormatArg::Auto => Format::Auto,
            FormatArg::Vllm => Format::Vllm,
            FormatArg::Sglang => Format::Sglang,
        }
    }
}

/// Arguments of `events decode`.
#[derive(Debug, Args)]
pub struct DecodeArgs {
    /// Which engine's shapes to accept.
    #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
    pub format: FormatArg,
    /// A file holding one msgpack payload (the third frame of a message).
    pub file: PathBuf,
}

/// Arguments of `events listen`.
#[derive(Debug, Args)]
pub struct ListenArgs {
    /// The engine's PUB endpoint, e.g. `tcp://127.0.0.1:5557`.
    #[arg(long)]
    pub endpoint: String,
    /// The engine's replay ROUTER endpoint.
    #[arg(long)]
    pub replay: Option<String>,
    /// The router block size the events must match.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,
    /// Which engine's shapes to accept.
    #[arg(long, value_enum, default_value_t = FormatArg::Auto)]
    pub format: FormatArg,
    /// ZMQ topic prefix to subscribe to.
    #[arg(long, default_value = "")]
    pub topic: String,
    /// Stop after this many seconds (default: run until interrupted).
    #[arg(long)]
    pub duration: Option<f64>,
    /// Seconds between summary lines.
    #[arg(long, default_value_t = 2.0)]
    pub interval: f64,
    /// Print the Prometheus text of the counters when done (their `worker`
    /// label is the endpoint).
    #[arg(long)]
    pub metrics: bool,
}

/// Runs an `events` subcommand.
pub fn run(cmd: EventsCommand) -> anyhow::Result<()> {
    match cmd {
        EventsCommand::Decode(args) => decode(args),
        EventsCommand::Listen(args) => listen(args),
    }
}

fn decode(args: DecodeArgs) -> anyhow::Result<()> {
    let bytes = std::fs::read(&args.file)
        .with_context(|| format!("cannot read {}", args.file.display()))?;
    let batch = decode_batch(&bytes, args.format.into())
        .with_context(|| format!("{}: malformed KV-event batch", args.file.display()))?;
    println!(
        "{}",
        serde_json::to_string_pretty(&json::batch_json(&batch))?
    );
    Ok(())
}

fn listen(args: ListenArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.block_size > 0, "--block-size must be positive");
    anyhow::ensure!(
        args.interval.is_finite() && args.interval > 0.0,
        "--interval must be a positive number of seconds"
    );
    let worker = WorkerId::new(0);
    let index = Arc::new(Mutex::new(TieredIndex::new()));
    let registry = switchyard_kv_events::metrics::KvEventMetrics::new();
    let mut config = switchyard_kv_events::subscriber::SubscriberConfig::new(
        worker,
        &args.endpoint,
        args.block_size,
    );
    config.replay_endpoint = args.replay.clone();
    config.format = args.format.into();
    config.topic = args.topic.clone();
    let context = zmq::Context::new();
    let sub = switchyard_kv_events::subscriber::KvEventSubscriber::spawn(
        &context,
        config,
        index.clone(),
        registry.worker(&args.endpoint),
    )?;
    let started = Instant::now();
    let end = args
        .duration
        .filter(|d| d.is_finite() && *d >= 0.0)
        .map(|d| started + Duration::from_secs_f64(d));
    let interval = Duration::from_secs_f64(args.interval);
    loop {
        let now = Instant::now();
        let wake = match end {
            Some(end) if end <= now => break,
            Some(end) => (now + interval).min(end),
            None => now + interval,
        };
        std::thread::sleep(wake - now);
        print_summary(started, &registry, &index);
    }
    sub.shutdown();
    if args.metrics {
        print!("{}", registry.encode_text());
    }
    Ok(())
}

fn print_summary(
    started: Instant,
    registry: &switchyard_kv_events::metrics::KvEventMetrics,
    index: &Mutex<TieredIndex>,
) {
    let t = registry.total();
    let (blocks, host_blocks) = index
        .lock()
        .map(|i| (i.device().live_pairs(), i.host().live_pairs()))
        .unwrap_or((0, 0));
    println!(
        "t={:.1}s batches={} events={} stored={} removed={} cleared={} gaps={} replays={} resets={} malformed={} filtered={} index_blocks={} host_index_blocks={}",
        started.elapsed().as_secs_f64(),
        t.batches,
        t.total_events(),
        t.events[0],
        t.events[1],
        t.events[2],
        t.gaps,
        t.replays,
        t.resets,
        t.malformed(),
        t.dropped.iter().sum::<u64>() - t.malformed(),
        blocks,
        host_blocks,
    );
}
