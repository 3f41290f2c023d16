//! `switchyard bench versus --peer smg|sglang`: the same multi-turn load
//! through Switchyard and through one of SGLang's routers, each in front of
//! its own fresh sim-workers, side by side in one run.
//!
//! The peer is installed with pip into a virtual environment of its own
//! (`smg==1.13.0`, the Shepherd Model Gateway, or `sglang-router==0.3.2`,
//! SGLang's Rust router; both with `--policy cache_aware`, SGLang's
//! cache-aware policy). When pip cannot install it (no network, no
//! `python3 -m venv`), the peer is skipped with the reason and Switchyard's
//! own figures are still printed. `--peer-bin` runs an installed peer.
//!
//! Each run: `--workers` sim-workers (`--speedup 4 --num-blocks 4096`,
//! KV events on, as the measurements were made) as child
//! processes, the router under test in front of them, one warm-up request,
//! then the bundled ShareGPT conversations (1,500 turns, concurrency 16,
//! streamed) from the load generator here. Figures: TTFT p50/p90 at the
//! client, the engines' prefix hit rate (from the sim-workers' own
//! counters, so both routers are measured the same way), completed
//! requests per second. Rounds alternate which router goes first.
//!
//! `--policy` and `--admission` may be repeated: every combination runs as
//! its own Switchyard variant in each round, so settings are compared with
//! each other and with the peer in the same run (e.g. `--admission none
//! --admission session-aware`).

pub use super::peer::Peer;
use super::peer::{cpu_seconds, launch, median, peer_program, wait_ready};
use crate::child::Children;
use crate::demo::{start_sim_workers, Fleet};
use crate::loadgen::{self, Pacing, Report};
use crate::stats::write_json;
use clap::Args;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::Child;
use switchyard_core::select::PolicyKind;
use switchyard_server::config::AdmissionMode;

/// One Switchyard setting under test: a policy and an admission strategy
/// (`None`: the config's, else the defaults).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Variant {
    /// `serve --policy`.
    pub policy: Option<PolicyKind>,
    /// `serve --admission`.
    pub admission: Option<AdmissionMode>,
}

impl Variant {
    /// Every combination of the given policies and admission strategies.
    pub fn all(policies: &[PolicyKind], admissions: &[AdmissionMode]) -> Vec<Variant> {
        let policies: Vec<Option<PolicyKind>> = if policies.is_empty() {
            vec![None]
        } else {
            policies.iter().copied().map(Some).collect()
        };
        let admissions: Vec<Option<AdmissionMode>> = if admissions.is_empty() {
            vec![None]
        } else {
            admissions.iter().copied().map(Some).collect()
        };
        policies
            .iter()
            .flat_map(|&policy| {
                admissions
                    .iter()
                    .map(move |&admission| Variant { policy, admission })
            })
            .collect()
    }

    /// The variant's row name, e.g. `switchyard (kv, session-aware)`; with
    /// a config file and no policy flag, the file names the policy.
    pub fn name(&self, config: Option<&Path>) -> String {
        let policy = match (self.policy, config) {
            (Some(p), _) => p.name().to_owned(),
            (None, Some(file)) => file
                .file_name()
                .unwrap_or(file.as_os_str())
                .to_string_lossy()
                .into_owned(),
            (None, None) => PolicyKind::DEFAULT.name().to_owned(),
        };
        match self.admission {
            None => format!("switchyard ({policy})"),
            Some(a) => format!("switchyard ({policy}, {})", admission_name(a)),
        }
    }
}

/// `serve --admission`'s spelling of a strategy.
fn admission_name(a: AdmissionMode) -> &'static str {
    match a {
        AdmissionMode::None => "none",
        AdmissionMode::SessionAware => "session-aware",
    }
}

/// Options of `bench versus`.
#[derive(Debug, Clone, Args)]
pub struct VersusArgs {
    /// The peer router.
    #[arg(long, value_enum, default_value_t = Peer::Smg)]
    pub peer: Peer,
    /// Run this peer program instead of installing one (`smg`, or a
    /// `python3` that has `sglang_router`).
    #[arg(long)]
    pub peer_bin: Option<PathBuf>,
    /// Virtual environment for the peer [default: TMPDIR/switchyard-versus-PEER];
    /// reused when it already has the peer.
    #[arg(long)]
    pub venv: Option<PathBuf>,
    /// Switchyard's policy [default: the default policy]; repeat to run
    /// several side by side.
    #[arg(long)]
    pub policy: Vec<PolicyKind>,
    /// Switchyard's admission strategy [default: the config's, else none];
    /// repeat to run several side by side.
    #[arg(long, value_enum)]
    pub admission: Vec<AdmissionMode>,
    /// A `serve --config` file for Switchyard (e.g. from `replay --tune`).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Run Switchyard's variants only, no peer.
    #[arg(long, conflicts_with = "peer_bin")]
    pub no_peer: bool,
    /// Sim-workers behind each router.
    #[arg(long, default_value_t = 4)]
    pub workers: usize,
    /// Sim-worker speed-up over the timing model.
    #[arg(long, default_value_t = 4.0)]
    pub speedup: f64,
    /// KV blocks per sim-worker.
    #[arg(long, default_value_t = 4096)]
    pub num_blocks: usize,
    /// Conversation turns sent through each router.
    #[arg(long, default_value_t = 1500)]
    pub requests: usize,
    /// Requests in flight.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// Rounds (each runs both routers, alternating which goes first).
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// ShareGPT conversations [default: the bundled sharegpt_multiturn_3000].
    #[arg(long)]
    pub sharegpt: Option<PathBuf>,
    /// Write every run's figures here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One router's figures in one run.
#[derive(Debug, Clone, Serialize)]
pub struct RunFigures {
    /// Which router.
    pub router: String,
    /// The round.
    pub round: usize,
    /// The load generator's report.
    pub report: Report,
    /// CPU time the router process used per request during the load, ms
    /// (user + system, from `/proc`; `None` where it cannot be read).
    pub router_cpu_ms_per_request: Option<f64>,
}

fn worker_args(args: &VersusArgs) -> Vec<String> {
    vec![
        "--speedup".into(),
        args.speedup.to_string(),
        "--num-blocks".into(),
        args.num_blocks.to_string(),
    ]
}

/// `serve` flags for `variant` in front of `fleet`.
fn our_args(args: &VersusArgs, variant: Variant, fleet: &Fleet) -> Vec<String> {
    let mut a: Vec<String> = ["serve", "--host", "127.0.0.1", "--port", "0"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    if let Some(policy) = variant.policy {
        a.extend(["--policy".into(), policy.name().into()]);
    }
    if let Some(admission) = variant.admission {
        a.extend(["--admission".into(), admission_name(admission).into()]);
    }
    if let Some(config) = &args.config {
        a.extend(["--config".into(), config.display().to_string()]);
    }
    // The workers' speed, as an operator configures it for the estimator.
    a.extend(["--prefill-speedup".into(), args.speedup.to_string()]);
    for (i, (url, events)) in fleet.urls.iter().zip(&fleet.events).enumerate() {
        let mut spec = format!("{url},name=w{i}");
        if let Some((events, replay)) = events {
            spec.push_str(&format!(",events={events},replay={replay}"));
        }
        a.extend(["--worker".into(), spec]);
    }
    a
}

/// The router under test in one run.
#[derive(Debug, Clone, Copy)]
enum Contender<'a> {
    /// Switchyard with these settings.
    Ours(Variant),
    /// The peer, run by this program.
    Peer(Peer, &'a Path),
}

/// One router's run on fresh workers.
fn one_run(
    args: &VersusArgs,
    contender: Contender<'_>,
    requests: Vec<loadgen::PreparedRequest>,
) -> anyhow::Result<(Report, Option<f64>)> {
    let fleet = start_sim_workers(args.workers, &worker_args(args), true)?;
    let mut children = Children(Vec::new());
    let (base, what) = match contender {
        Contender::Ours(variant) => {
            let mut command = crate::child::this_binary()?;
            command
                .args(our_args(args, variant, &fleet))
                .env("RUST_LOG", "warn");
            let (child, url) = crate::child::spawn_printing_url(command, "switchyard serve")?;
            children.0.push(child);
            (url, "switchyard serve".to_owned())
        }
        Contender::Peer(peer, program) => (
            launch(peer, program, &fleet.urls, &mut children)?,
            peer.requirement().to_owned(),
        ),
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    wait_ready(&runtime, &base, &mut children, &what)?;
    let pid = children.0.last().map(Child::id);
    let cpu_before = pid.and_then(cpu_seconds);
    let report = runtime.block_on(loadgen::run_load(
        &base,
        requests,
        Pacing::Concurrency(args.concurrency),
        true,
        &fleet.urls,
        false,
    ));
    let cpu_after = pid.and_then(cpu_seconds);
    let cpu_ms_per_request = match (cpu_before, cpu_after) {
        (Some(b), Some(a)) if report.requests > 0 => Some((a - b) * 1e3 / report.requests as f64),
        _ => None,
    };
    drop(children);
    drop(fleet);
    Ok((report, cpu_ms_per_request))
}

/// Runs `bench versus`.
pub fn run(args: VersusArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.workers > 0 && args.requests > 0 && args.concurrency > 0 && args.rounds > 0,
        "--workers, --requests, --concurrency and --rounds must be positive"
    );
    let sharegpt = match &args.sharegpt {
        Some(p) => p.clone(),
        None => crate::data::data_path("traces/sharegpt_multiturn_3000.jsonl.gz")?,
    };
    let requests =
        loadgen::sharegpt_requests(&sharegpt, args.requests, 64, Some("switchyard-sim"))?;
    let variants = Variant::all(&args.policy, &args.admission);
    let installed = if args.no_peer {
        Err("--no-peer".to_owned())
    } else {
        peer_program(args.peer, args.peer_bin.as_deref(), args.venv.as_deref())
    };
    let peer = match installed {
        Err(_) if args.no_peer => None,
        Ok(p) => Some(p),
        Err(why) => {
            eprintln!(
                "skipping {}: {why}; running Switchyard alone",
                args.peer.requirement()
            );
            None
        }
    };
    let peer_name = format!("{} (cache_aware)", args.peer.requirement());
    let mut runs = Vec::new();
    for round in 0..args.rounds {
        let mut order: Vec<Contender<'_>> = variants.iter().map(|&v| Contender::Ours(v)).collect();
        if let Some(p) = &peer {
            order.push(Contender::Peer(args.peer, p.as_path()));
        }
        if round % 2 == 1 {
            order.reverse();
        }
        for contender in order {
            let name = match contender {
                Contender::Ours(v) => v.name(args.config.as_deref()),
                Contender::Peer(..) => peer_name.clone(),
            };
            eprintln!("round {}: {name}...", round + 1);
            let (report, cpu) = one_run(&args, contender, requests.clone())?;
            runs.push(RunFigures {
                router: name,
                round: round + 1,
                report,
                router_cpu_ms_per_request: cpu,
            });
        }
    }
    print_table(&args, &runs);
    if let Some(path) = &args.json {
        write_json(path, &runs)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn print_table(args: &VersusArgs, runs: &[RunFigures]) {
    println!(
        "{} ShareGPT turns, concurrency {}, {} sim-workers (--speedup {} --num-blocks {}) per router",
        args.requests, args.concurrency, args.workers, args.speedup, args.num_blocks
    );
    println!(
        "{:<42} {:>5} {:>10} {:>10} {:>6} {:>8} {:>6} {:>9}",
        "router", "round", "TTFT p50", "TTFT p90", "hit", "req/s", "errors", "cpu ms/rq"
    );
    for r in runs {
        let hit = r
            .report
            .hit_rate
            .map_or_else(|| "n/a".to_owned(), |h| format!("{h:.3}"));
        let cpu = r
            .router_cpu_ms_per_request
            .map_or_else(|| "n/a".to_owned(), |c| format!("{c:.2}"));
        println!(
            "{:<42} {:>5} {:>10.1} {:>10.1} {:>6} {:>8.1} {:>6} {:>9}",
            r.router,
            r.round,
            r.report.ttft_ms.p50,
            r.report.ttft_ms.p90,
            hit,
            r.report.throughput_rps,
            r.report.errors,
            cpu
        );
    }
    if args.rounds > 1 {
        let mut names: Vec<&str> = runs.iter().map(|r| r.router.as_str()).collect();
        names.dedup();
        names.sort_unstable();
        names.dedup();
        for name in names {
            let of = |f: fn(&Report) -> f64| {
                let v: Vec<f64> = runs
                    .iter()
                    .filter(|r| r.router == name)
                    .map(|r| f(&r.report))
                    .collect();
                median(&v)
            };
            println!(
                "{:<42} {:>5} {:>10.1} {:>10.1} {:>6.3} {:>8.1}",
                name,
                "med",
                of(|r| r.ttft_ms.p50),
                of(|r| r.ttft_ms.p90),
                of(|r| r.hit_rate.unwrap_or(f64::NAN)),
                of(|r| r.throughput_rps)
            );
        }
    }
    println!("(TTFT in ms at the client; hit = the sim-workers' prefix hit rate over the run; cpu ms/rq = the router process's CPU time per request; med = median over rounds)");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_policy_runs_with_every_admission_strategy_under_its_own_name() {
        let none = Variant::all(&[], &[]);
        assert_eq!(none.len(), 1);
        assert_eq!(
            none[0].name(None),
            format!("switchyard ({})", PolicyKind::DEFAULT.name())
        );
        assert_eq!(
            none[0].name(Some(Path::new("/tmp/tuned.toml"))),
            "switchyard (tuned.toml)"
        );
        let all = Variant::all(
            &[PolicyKind::Kv, PolicyKind::CacheAware],
            &[AdmissionMode::None, AdmissionMode::SessionAware],
        );
        let names: Vec<String> = all.iter().map(|v| v.name(None)).collect();
        assert_eq!(
            names,
            [
                "switchyard (kv, none)",
                "switchyard (kv, session-aware)",
                "switchyard (cache-aware, none)",
                "switchyard (cache-aware, session-aware)",
            ]
        );
    }
}
