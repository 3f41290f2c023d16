//! `switchyard bench soak`: is memory bounded under a long, heavy load?
//!
//! - [`routing`] — the routing core (index + active sequences) driven by
//!   simulated engines' real KV events, far faster than the trace, for a
//!   set number of block events (default 10 M); samples the core's own byte
//!   accounting (`Router::memory`) and this process's RSS.
//! - [`server`] (`--server`) — `switchyard serve` as a child process in
//!   front of sim-workers under a demo-like load for `--duration-secs`;
//!   samples the router process's RSS (and its `switchyard_index_bytes`).
//! - [`plateau`] — the verdict: memory in the last quarter of the samples
//!   within 5% of the second quarter. A failed verdict is a nonzero exit.

pub mod plateau;
pub mod routing;
pub mod server;

use plateau::{plateau, Plateau, PLATEAU_TOLERANCE};
use serde::Serialize;
use std::path::PathBuf;
use std::time::Duration;
use switchyard_commands::data::Trace;
use switchyard_commands::stats::write_json;
use switchyard_sim::trace::{MooncakeReader, MooncakeRecord};

/// `switchyard bench soak` arguments.
#[derive(Clone, Debug, clap::Args, Serialize)]
pub struct SoakArgs {
    /// Soak the router server (child processes over loopback) instead of the core.
    #[arg(long)]
    pub server: bool,
    /// Mooncake JSONL trace (default: the bundled conversation trace).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Core: stop after this many block events (blocks stored or removed) applied.
    #[arg(long, default_value_t = 10_000_000)]
    pub block_events: u64,
    /// Core: memory samples over the run.
    #[arg(long, default_value_t = 40)]
    pub samples: usize,
    /// Core: simulated engines.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Requests in flight (core default 256; with --server, 32).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Device KV blocks per engine (core default 16,384; with --server, 8,192).
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// Output tokens per request at most.
    #[arg(long, default_value_t = 16)]
    pub max_output_tokens: u32,
    /// Prompt tokens per request at most (longer trace prompts are cut).
    #[arg(long, default_value_t = 16_384)]
    pub max_prompt_tokens: u32,
    /// Server: how long to drive load, in seconds.
    #[arg(long, default_value_t = 300)]
    pub duration_secs: u64,
    /// Server: seconds between RSS samples.
    #[arg(long, default_value_t = 5.0)]
    pub sample_secs: f64,
    /// Server: sim-workers.
    #[arg(long, default_value_t = 4)]
    pub server_workers: usize,
    /// Server: sim-worker speed-up over the timing model.
    #[arg(long, default_value_t = 20.0)]
    pub speedup: f64,
    /// Server: requests per load round (each round has fresh content).
    #[arg(long, default_value_t = 1000)]
    pub round_requests: usize,
    /// Write the samples and the verdict as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// A plateau verdict on one memory series.
#[derive(Debug, Serialize)]
pub struct Verdict {
    /// Which series.
    pub series: &'static str,
    /// The figures; `None` when there were too few samples.
    pub plateau: Option<Plateau>,
}

#[derive(Debug, Serialize)]
struct SoakReport<T: Serialize> {
    mode: &'static str,
    tolerance: f64,
    verdicts: Vec<Verdict>,
    pass: bool,
    trace: String,
    trace_requests_per_sec: f64,
    outcome: T,
    args: SoakArgs,
}

fn load_records(trace: &Trace) -> anyhow::Result<Vec<MooncakeRecord>> {
    MooncakeReader::new(trace.open()?)
        .map(|r| r.map_err(|e| anyhow::anyhow!("{trace}: {e}")))
        .collect()
}

/// Requests per second of the trace at its own pace.
fn trace_rate(records: &[MooncakeRecord]) -> f64 {
    let first = records.first().map_or(0.0, |r| r.timestamp);
    let last = records.last().map_or(0.0, |r| r.timestamp);
    records.len() as f64 / ((last - first) / 1000.0).max(1e-9)
}

fn mib(bytes: f64) -> f64 {
    bytes / (1024.0 * 1024.0)
}

/// Judges the series; `Err` with a clear message when one fails.
fn judge(verdicts: &[Verdict]) -> Result<(), String> {
    let mut failures = Vec::new();
    for v in verdicts {
        match v.plateau {
            Some(p) if p.pass => println!(
                "plateau {}: PASS (last quarter {:.2} MiB / second quarter {:.2} MiB = {:.4}; tolerance ±{:.0}%)",
                v.series,
                mib(p.last_quarter_mean),
                mib(p.second_quarter_mean),
                p.ratio,
                PLATEAU_TOLERANCE * 100.0
            ),
            Some(p) => {
                println!(
                    "plateau {}: FAIL (last quarter {:.2} MiB / second quarter {:.2} MiB = {:.4}; tolerance ±{:.0}%)",
                    v.series,
                    mib(p.last_quarter_mean),
                    mib(p.second_quarter_mean),
                    p.ratio,
                    PLATEAU_TOLERANCE * 100.0
                );
                failures.push(format!("{} ratio {:.4}", v.series, p.ratio));
            }
            None => {
                println!("plateau {}: no verdict (too few samples)", v.series);
                failures.push(format!("{} had too few samples", v.series));
            }
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "memory did not plateau: {} (last quarter vs second quarter must be within {:.0}%)",
            failures.join(", "),
            PLATEAU_TOLERANCE * 100.0
        ))
    }
}

/// Largest share of failed requests a server soak may have and pass: a
/// memory plateau means nothing if the requests did not go through.
pub const MAX_ERROR_RATIO: f64 = 0.01;

/// The server soak's request verdict: at least one request, and failed
/// requests at most [`MAX_ERROR_RATIO`] of them.
pub fn judge_errors(requests: u64, errors: u64) -> Result<(), String> {
    if requests == 0 {
        return Err("no request was sent".to_owned());
    }
    let ratio = errors as f64 / requests as f64;
    if ratio > MAX_ERROR_RATIO {
        Err(format!(
            "{errors} of {requests} requests failed ({:.1}%; at most {:.0}% may)",
            ratio * 100.0,
            MAX_ERROR_RATIO * 100.0
        ))
    } else {
        Ok(())
    }
}

/// Runs `switchyard bench soak`.
pub fn run(args: SoakArgs) -> anyhow::Result<()> {
    check_args(&args)?;
    let trace = Trace::or_bundled(args.trace.as_deref());
    let records = load_records(&trace)?;
    let rate = trace_rate(&records);
    if args.server {
        run_server_mode(args, &records, trace.to_string(), rate)
    } else {
        run_core_mode(args, &records, trace.to_string(), rate)
    }
}

/// Refuses settings that cannot give a verdict, before any work.
fn check_args(args: &SoakArgs) -> anyhow::Result<()> {
    let min = plateau::MIN_SAMPLES;
    if args.server {
        let samples = args.duration_secs as f64 / args.sample_secs;
        anyhow::ensure!(
            args.sample_secs.is_finite() && args.sample_secs > 0.0 && samples >= min as f64,
            "--duration-secs / --sample-secs must give at least {min} samples, got {samples:.1}"
        );
        anyhow::ensure!(
            args.server_workers > 0,
            "--server-workers must be at least 1"
        );
        anyhow::ensure!(
            args.round_requests > 0,
            "--round-requests must be at least 1"
        );
    } else {
        anyhow::ensure!(
            args.samples >= min,
            "--samples must be at least {min}, got {}",
            args.samples
        );
        anyhow::ensure!(
            args.block_events >= args.samples as u64,
            "--block-events must be at least --samples ({}), got {}",
            args.samples,
            args.block_events
        );
        anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    }
    Ok(())
}

fn run_core_mode(
    args: SoakArgs,
    records: &[MooncakeRecord],
    trace: String,
    trace_requests_per_sec: f64,
) -> anyhow::Result<()> {
    let config = routing::CoreSoakConfig {
        block_events: args.block_events,
        samples: args.samples,
        workers: args.workers,
        concurrency: args.concurrency.unwrap_or(256),
        max_output_tokens: args.max_output_tokens,
        max_prompt_tokens: args.max_prompt_tokens,
        num_blocks: args.num_blocks.unwrap_or(16_384),
        ..routing::CoreSoakConfig::default()
    };
    println!(
        "soak (core): {} block events, {} engines of {} blocks, {} requests in flight, trace {trace}",
        config.block_events, config.workers, config.num_blocks, config.concurrency
    );
    println!(
        "{:>6} {:>12} {:>9} {:>9} {:>7} {:>10} {:>10} {:>10} {:>10} {:>9}",
        "wall s",
        "block events",
        "requests",
        "pairs",
        "active",
        "core MiB",
        "index MiB",
        "seqs MiB",
        "remote B",
        "RSS MiB"
    );
    let outcome = routing::run_core(&config, records, |s| {
        println!(
            "{:>6.1} {:>12} {:>9} {:>9} {:>7} {:>10.2} {:>10.2} {:>10.2} {:>10} {:>9}",
            s.wall_seconds,
            s.block_events,
            s.requests,
            s.live_pairs,
            s.active_requests,
            mib(s.core_bytes as f64),
            mib(s.memory.index.total() as f64),
            mib(s.memory.sequences.total() as f64),
            s.memory.remote,
            s.rss_bytes
                .map_or("n/a".to_owned(), |b| format!("{:.1}", mib(b as f64)))
        );
    })?;
    let core_series: Vec<f64> = outcome
        .samples
        .iter()
        .map(|s| s.core_bytes as f64)
        .collect();
    let rss_series: Vec<f64> = outcome
        .samples
        .iter()
        .filter_map(|s| s.rss_bytes.map(|b| b as f64))
        .collect();
    let rps = outcome.requests as f64 / outcome.wall_seconds.max(1e-9);
    println!(
        "{} block events ({} stored, {} removed), {} requests in {:.1} s wall: {:.0} requests/s, ×{:.0} the trace's {:.2} requests/s; refused {}, expired {}, unknown-parent drops {}",
        outcome.block_events,
        outcome.stored_blocks,
        outcome.removed_blocks,
        outcome.requests,
        outcome.wall_seconds,
        rps,
        rps / trace_requests_per_sec.max(1e-9),
        trace_requests_per_sec,
        outcome.refused,
        outcome.expired,
        outcome.index_unknown_parent
    );
    let verdicts = vec![
        Verdict {
            series: "core bytes",
            plateau: plateau(&core_series, PLATEAU_TOLERANCE),
        },
        Verdict {
            series: "process RSS",
            plateau: plateau(&rss_series, PLATEAU_TOLERANCE),
        },
    ];
    finish(
        "core",
        verdicts,
        Ok(()),
        trace,
        trace_requests_per_sec,
        outcome,
        args,
    )
}

fn run_server_mode(
    args: SoakArgs,
    records: &[MooncakeRecord],
    trace: String,
    trace_requests_per_sec: f64,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.sample_secs.is_finite() && args.sample_secs > 0.0,
        "--sample-secs must be positive"
    );
    let config = server::ServerSoakConfig {
        duration: Duration::from_secs(args.duration_secs),
        sample_every: Duration::from_secs_f64(args.sample_secs),
        workers: args.server_workers,
        concurrency: args.concurrency.unwrap_or(32),
        round_requests: args.round_requests,
        speedup: args.speedup,
        num_blocks: args.num_blocks.unwrap_or(8_192),
        max_output_tokens: args.max_output_tokens,
        max_prompt_tokens: args.max_prompt_tokens,
    };
    println!(
        "soak (server): {} s of load, {} sim-workers ({} blocks, speed-up {}), concurrency {}, trace {trace}",
        args.duration_secs, config.workers, config.num_blocks, config.speedup, config.concurrency
    );
    println!(
        "{:>8} {:>10} {:>14} {:>10}",
        "seconds", "requests", "router RSS MiB", "index MiB"
    );
    let outcome = server::run_server(&config, records, |s| {
        println!(
            "{:>8.1} {:>10} {:>14} {:>10}",
            s.seconds,
            s.requests,
            s.rss_bytes
                .map_or("n/a".to_owned(), |b| format!("{:.1}", mib(b as f64))),
            s.index_bytes
                .map_or("n/a".to_owned(), |b| format!("{:.2}", mib(b as f64)))
        );
    })?;
    println!(
        "{} requests ({} errors) in {} rounds, {:.1} s: {:.0} requests/s, ×{:.0} the trace's {:.2} requests/s",
        outcome.requests,
        outcome.errors,
        outcome.rounds,
        outcome.wall_seconds,
        outcome.requests as f64 / outcome.wall_seconds.max(1e-9),
        outcome.requests as f64 / outcome.wall_seconds.max(1e-9) / trace_requests_per_sec.max(1e-9),
        trace_requests_per_sec
    );
    let rss: Vec<f64> = outcome
        .samples
        .iter()
        .filter_map(|s| s.rss_bytes.map(|b| b as f64))
        .collect();
    let verdicts = vec![Verdict {
        series: "router RSS",
        plateau: plateau(&rss, PLATEAU_TOLERANCE),
    }];
    let requests = judge_errors(outcome.requests, outcome.errors);
    match &requests {
        Ok(()) => println!(
            "requests: PASS ({} errors of {})",
            outcome.errors, outcome.requests
        ),
        Err(why) => println!("requests: FAIL ({why})"),
    }
    finish(
        "server",
        verdicts,
        requests,
        trace,
        trace_requests_per_sec,
        outcome,
        args,
    )
}

fn finish<T: Serialize>(
    mode: &'static str,
    verdicts: Vec<Verdict>,
    requests: Result<(), String>,
    trace: String,
    trace_requests_per_sec: f64,
    outcome: T,
    args: SoakArgs,
) -> anyhow::Result<()> {
    let verdict = match (judge(&verdicts), requests) {
        (Ok(()), Ok(())) => Ok(()),
        (Err(memory), Ok(())) => Err(memory),
        (Ok(()), Err(requests)) => Err(format!("too many requests failed: {requests}")),
        (Err(memory), Err(requests)) => {
            Err(format!("{memory}; too many requests failed: {requests}"))
        }
    };
    let report = SoakReport {
        mode,
        tolerance: PLATEAU_TOLERANCE,
        pass: verdict.is_ok(),
        verdicts,
        trace,
        trace_requests_per_sec,
        outcome,
        args,
    };
    if let Some(path) = &report.args.json {
        write_json(path, &report)?;
        println!("wrote {}", path.display());
    }
    verdict.map_err(|message| anyhow::anyhow!(message))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        soak: SoakArgs,
    }

    fn args(flags: &[&str]) -> SoakArgs {
        Cli::parse_from(std::iter::once("soak").chain(flags.iter().copied())).soak
    }

    #[test]
    fn settings_that_cannot_give_a_verdict_are_refused_up_front() {
        assert!(check_args(&args(&[])).is_ok(), "the defaults");
        assert!(
            check_args(&args(&["--server"])).is_ok(),
            "the server defaults"
        );
        let why = check_args(&args(&["--block-events", "0"])).unwrap_err();
        assert!(why.to_string().contains("--block-events"), "{why}");
        let why = check_args(&args(&["--samples", "3"])).unwrap_err();
        assert!(why.to_string().contains("at least 8"), "{why}");
        let why = check_args(&args(&["--server", "--duration-secs", "10"])).unwrap_err();
        assert!(why.to_string().contains("--sample-secs"), "{why}");
    }

    #[test]
    fn a_soak_where_every_request_failed_does_not_pass() {
        assert!(judge_errors(1000, 1000).is_err());
    }

    #[test]
    fn a_soak_with_errors_above_one_percent_does_not_pass() {
        let why = judge_errors(1000, 11).unwrap_err();
        assert!(why.contains("11 of 1000"), "{why}");
        assert!(judge_errors(1000, 10).is_ok(), "exactly 1% passes");
        assert!(judge_errors(1000, 0).is_ok());
    }

    #[test]
    fn a_soak_that_sent_nothing_does_not_pass() {
        assert!(judge_errors(0, 0).is_err());
    }
}
