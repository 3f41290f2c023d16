//! `switchyard demo`: sim-workers and the router on loopback, driven by the
//! load generator, once with `kv` and once with `round-robin`.
//!
//! Each policy gets a fresh fleet (child processes of this same binary), so
//! neither run inherits the other's warm caches.

use crate::child::Children;
use crate::loadgen::{self, Pacing, Report};
use crate::stats::write_json;
use clap::Args;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};
use switchyard_core::select::PolicyKind;
use switchyard_server::{self, ServerConfig, WorkerSpec};

/// Options of `switchyard demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Sim-workers to start.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Requests per policy, from the start of the trace.
    #[arg(long, default_value_t = 1000)]
    pub requests: usize,
    /// Requests in flight (enough to keep the fleet busy).
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Output-token cap per request.
    #[arg(long, default_value_t = 32)]
    pub max_output_tokens: u32,
    /// Sim-worker speed-up over the timing model.
    #[arg(long, default_value_t = 10.0)]
    pub speedup: f64,
    /// KV blocks per sim-worker (1M tokens: conversations' earlier turns
    /// stay cached long enough for placement to matter).
    #[arg(long, default_value_t = 65_536)]
    pub num_blocks: usize,
    /// Mooncake trace [default: the bundled conversation trace].
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The policy compared against round-robin.
    #[arg(long, default_value_t = PolicyKind::DEFAULT)]
    pub policy: PolicyKind,
    /// Workers publish no KV events; the router predicts their caches.
    #[arg(long)]
    pub approximate: bool,
    /// Write both reports here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Sim-worker child processes, killed on drop: their URLs and, unless
/// approximate, their KV-event and replay endpoints.
pub struct SimWorkers {
    pub children: Children,
    pub urls: Vec<String>,
    pub events: Vec<Option<(String, String)>>,
}

/// A loopback port free a moment ago (the worker binds it right after).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// Starts `args.workers` sim-workers (this binary) with `args`' speed-up,
/// pool size and KV-event choice.
pub fn start_fleet(args: &DemoArgs) -> anyhow::Result<SimWorkers> {
    let worker_args = [
        "--speedup".to_owned(),
        args.speedup.to_string(),
        "--num-blocks".to_owned(),
        args.num_blocks.to_string(),
    ];
    start_sim_workers(args.workers, &worker_args, !args.approximate)
}

/// Starts `count` sim-workers (this binary) on loopback with
/// `worker_args`, each publishing KV events (with replay) on free ports
/// when `kv_events`; returns once each has printed its address (it binds
/// before printing).
pub fn start_sim_workers(
    count: usize,
    worker_args: &[String],
    kv_events: bool,
) -> anyhow::Result<SimWorkers> {
    let mut fleet = SimWorkers {
        children: Children::default(),
        urls: Vec::new(),
        events: Vec::new(),
    };
    for _ in 0..count {
        let events = if kv_events {
            Some((
                format!("tcp://127.0.0.1:{}", free_port()?),
                format!("tcp://127.0.0.1:{}", free_port()?),
            ))
        } else {
            None
        };
        let mut command = crate::child::this_binary()?;
        command.args(["sim-worker", "--host", "127.0.0.1", "--port", "0"]);
        if let Some((pub_endpoint, replay)) = &events {
            command.args(["--kv-events", pub_endpoint, "--kv-replay", replay]);
        }
        command.args(worker_args);
        fleet.events.push(events);
        let (child, url) = crate::child::spawn_printing_url(command, "a sim-worker")?;
        fleet.children.0.push(child);
        fleet.urls.push(url);
    }
    Ok(fleet)
}

async fn one_policy(
    args: &DemoArgs,
    policy: PolicyKind,
    tokenizer: Arc<dyn switchyard_server::tokenize::PromptTokenizer>,
    requests: Vec<loadgen::PreparedRequest>,
) -> anyhow::Result<Report> {
    let fleet = start_fleet(args)?;
    let config = ServerConfig {
        port: 0,
        policy,
        workers: fleet
            .urls
            .iter()
            .enumerate()
            .zip(&fleet.events)
            .map(|((i, url), events)| WorkerSpec {
                url: url.clone(),
                name: Some(format!("worker-{i}")),
                events: events.as_ref().map(|e| e.0.clone()),
                replay: events.as_ref().map(|e| e.1.clone()),
                block_size: None,
                role: Default::default(),
                bootstrap_port: None,
                dp_size: None,
            })
            .collect(),
        health_interval_ms: 500,
        ..ServerConfig::default()
    };
    let router = switchyard_server::start_with_tokenizer(config, tokenizer).await?;
    let base = format!("http://{}", router.addr);
    let report = loadgen::run_load(
        &base,
        requests,
        Pacing::Concurrency(args.concurrency),
        true,
        &fleet.urls,
        true,
    )
    .await;
    router.shutdown().await?;
    drop(fleet);
    Ok(report)
}

/// Runs `switchyard demo`.
pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.workers > 0, "--workers must be positive");
    let started = Instant::now();
    let trace = crate::data::Trace::or_bundled(args.trace.as_deref());
    let requests =
        loadgen::mooncake_requests(&trace, args.requests, args.max_output_tokens, 32_000, None)?;
    let tokenizer: Arc<dyn switchyard_server::tokenize::PromptTokenizer> = Arc::new(
        switchyard_server::tokenize::HfTokenizer(switchyard_tokenizer::Tokenizer::bundled()?),
    );
    println!(
        "switchyard demo: {} sim-workers (speedup {}, {} KV blocks each, {}), {} requests of {} at concurrency {}",
        args.workers,
        args.speedup,
        args.num_blocks,
        if args.approximate { "approximate cache tracking" } else { "KV events over ZMQ" },
        requests.len(),
        trace,
        args.concurrency
    );
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut reports = Vec::new();
    for policy in [args.policy, PolicyKind::RoundRobin] {
        let report = runtime.block_on(one_policy(
            &args,
            policy,
            tokenizer.clone(),
            requests.clone(),
        ))?;
        loadgen::print_report(&format!("policy {policy}"), &report);
        reports.push((policy, report));
    }
    println!(
        "\nside by side        {:>14} {:>14}",
        reports[0].0.name(),
        reports[1].0.name()
    );
    let row = |name: &str, f: &dyn Fn(&Report) -> String| {
        println!(
            "{name:<19} {:>14} {:>14}",
            f(&reports[0].1),
            f(&reports[1].1)
        );
    };
    row("requests", &|r| r.requests.to_string());
    row("errors", &|r| r.errors.to_string());
    row("TTFT p50 ms", &|r| format!("{:.1}", r.ttft_ms.p50));
    row("TTFT p90 ms", &|r| format!("{:.1}", r.ttft_ms.p90));
    row("e2e p50 ms", &|r| format!("{:.1}", r.e2e_ms.p50));
    row("throughput req/s", &|r| format!("{:.1}", r.throughput_rps));
    row("hit rate", &|r| {
        r.hit_rate
            .map_or("n/a".into(), |h| format!("{:.1}%", h * 100.0))
    });
    println!("finished in {:.1} s", started.elapsed().as_secs_f64());
    if let Some(path) = &args.json {
        let value: serde_json::Map<String, serde_json::Value> = reports
            .iter()
            .map(|(p, r)| {
                (
                    p.name().to_owned(),
                    serde_json::to_value(r).unwrap_or_default(),
                )
            })
            .collect();
        write_json(path, &value)?;
    }
    // Let the fleet's sockets close before exiting.
    std::thread::sleep(Duration::from_millis(50));
    Ok(())
}
