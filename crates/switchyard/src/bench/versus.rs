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

use crate::child::Children;
use crate::demo::{free_port, start_sim_workers, Fleet};
use crate::loadgen::{self, Pacing, Report};
use crate::stats::write_json;
use anyhow::Context as _;
use clap::{Args, ValueEnum};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use switchyard_core::select::PolicyKind;

/// How long a router may take to answer its first request.
const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// SGLang's routers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Peer {
    /// The Shepherd Model Gateway (`pip install smg==1.13.0`, `smg launch`).
    Smg,
    /// SGLang's Rust router (`pip install sglang-router==0.3.2`).
    Sglang,
}

impl Peer {
    /// The pip requirement.
    pub fn requirement(self) -> &'static str {
        match self {
            Peer::Smg => "smg==1.13.0",
            Peer::Sglang => "sglang-router==0.3.2",
        }
    }

    /// The program in the venv's `bin/` that starts it.
    fn program(self) -> &'static str {
        match self {
            Peer::Smg => "smg",
            Peer::Sglang => "python3",
        }
    }

    /// Its command line in front of `workers`, listening on `port`.
    fn command(self, program: &Path, port: u16, workers: &[String]) -> Command {
        let mut c = Command::new(program);
        match self {
            Peer::Smg => {
                c.arg("launch");
            }
            Peer::Sglang => {
                c.args(["-m", "sglang_router.launch_router"]);
            }
        }
        c.args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--policy", "cache_aware", "--worker-urls"])
            .args(workers);
        c
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
    /// Switchyard's policy [default: the default policy].
    #[arg(long)]
    pub policy: Option<PolicyKind>,
    /// A `serve --config` file for Switchyard (e.g. from `replay --tune`).
    #[arg(long)]
    pub config: Option<PathBuf>,
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

/// Clock ticks per second of `/proc/PID/stat` times (`USER_HZ`, 100 on
/// every mainstream Linux architecture).
const USER_HZ: f64 = 100.0;

/// CPU seconds (user + system) process `pid` has used so far.
fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name, field 2, is in parentheses and may hold spaces.
    let after = &stat[stat.rfind(')')? + 2..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line, 11 and 12
    // after the name.
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / USER_HZ)
}

/// The child processes of one run, killed on drop.
/// Finds or installs the peer; `Err` says why it cannot be run.
fn peer_program(args: &VersusArgs) -> Result<PathBuf, String> {
    if let Some(bin) = &args.peer_bin {
        return Ok(bin.clone());
    }
    let venv = args.venv.clone().unwrap_or_else(|| {
        std::env::temp_dir().join(format!(
            "switchyard-versus-{}",
            args.peer.requirement().replace("==", "-")
        ))
    });
    let program = venv.join("bin").join(args.peer.program());
    let python = venv.join("bin").join("python3");
    let installed = || {
        Command::new(&python)
            .args(["-m", "pip", "show", "-q"])
            .arg(
                args.peer
                    .requirement()
                    .split("==")
                    .next()
                    .unwrap_or_default(),
            )
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if program.exists() && installed() {
        return Ok(program);
    }
    eprintln!(
        "installing {} into {} (pip)...",
        args.peer.requirement(),
        venv.display()
    );
    let run = |c: &mut Command, what: &str| -> Result<(), String> {
        let out = c
            .output()
            .map_err(|e| format!("{what} could not start: {e}"))?;
        if out.status.success() {
            Ok(())
        } else {
            let stderr = String::from_utf8_lossy(&out.stderr);
            let last = stderr.lines().rev().find(|l| !l.trim().is_empty());
            Err(format!("{what} failed: {}", last.unwrap_or("no message")))
        }
    };
    run(
        Command::new("python3").args(["-m", "venv"]).arg(&venv),
        "python3 -m venv",
    )?;
    run(
        Command::new(&python).args(["-m", "pip", "install", "-q", args.peer.requirement()]),
        "pip install",
    )?;
    if program.exists() && installed() {
        Ok(program)
    } else {
        Err(format!(
            "pip installed {} but {} is missing",
            args.peer.requirement(),
            program.display()
        ))
    }
}

/// Waits until `base` answers a one-token completion (the same warm-up
/// request for every router).
fn wait_ready(
    runtime: &tokio::runtime::Runtime,
    base: &str,
    children: &mut Children,
    what: &str,
) -> anyhow::Result<()> {
    let started = Instant::now();
    let body = serde_json::json!({"model": "switchyard-sim", "prompt": "warm", "max_tokens": 1});
    let warm = loadgen::PreparedRequest {
        path: "/v1/completions",
        body: serde_json::to_vec(&body)?.into(),
        session: None,
    };
    loop {
        let report = runtime.block_on(loadgen::run_load(
            base,
            vec![warm.clone()],
            Pacing::Concurrency(1),
            false,
            &[],
            false,
        ));
        if report.errors == 0 {
            return Ok(());
        }
        if let Some(router) = children.0.last_mut() {
            if let Ok(Some(status)) = router.try_wait() {
                anyhow::bail!("{what} exited ({status}) before serving");
            }
        }
        anyhow::ensure!(
            started.elapsed() < READY_TIMEOUT,
            "{what} did not serve a request within {READY_TIMEOUT:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

fn worker_args(args: &VersusArgs) -> Vec<String> {
    vec![
        "--speedup".into(),
        args.speedup.to_string(),
        "--num-blocks".into(),
        args.num_blocks.to_string(),
    ]
}

/// `serve` flags in front of `fleet`.
fn our_args(args: &VersusArgs, fleet: &Fleet) -> Vec<String> {
    let mut a: Vec<String> = ["serve", "--host", "127.0.0.1", "--port", "0"]
        .into_iter()
        .map(str::to_owned)
        .collect();
    if let Some(policy) = args.policy {
        a.extend(["--policy".into(), policy.name().into()]);
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

/// One router's run on fresh workers.
fn one_run(
    args: &VersusArgs,
    peer: Option<(Peer, &Path)>,
    requests: Vec<loadgen::PreparedRequest>,
) -> anyhow::Result<(Report, Option<f64>)> {
    let fleet = start_sim_workers(args.workers, &worker_args(args), true)?;
    let mut children = Children(Vec::new());
    let (base, what) = match peer {
        None => {
            let mut command = crate::child::this_binary()?;
            command.args(our_args(args, &fleet)).env("RUST_LOG", "warn");
            let (child, url) = crate::child::spawn_printing_url(command, "switchyard serve")?;
            children.0.push(child);
            (url, "switchyard serve".to_owned())
        }
        Some((peer, program)) => {
            let port = free_port()?;
            let child = peer
                .command(program, port, &fleet.urls)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .with_context(|| format!("starting {}", program.display()))?;
            children.0.push(child);
            (
                format!("http://127.0.0.1:{port}"),
                peer.requirement().to_owned(),
            )
        }
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
    let ours = format!(
        "switchyard ({})",
        args.policy.unwrap_or(PolicyKind::DEFAULT).name()
    );
    let peer = match peer_program(&args) {
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
        let mut order: Vec<Option<&Path>> = vec![None];
        if let Some(p) = &peer {
            order.push(Some(p.as_path()));
        }
        if round % 2 == 1 {
            order.reverse();
        }
        for program in order {
            let name = match program {
                None => ours.clone(),
                Some(_) => peer_name.clone(),
            };
            eprintln!("round {}: {name}...", round + 1);
            let (report, cpu) = one_run(&args, program.map(|p| (args.peer, p)), requests.clone())?;
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
        "{:<34} {:>5} {:>10} {:>10} {:>6} {:>8} {:>6} {:>9}",
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
            "{:<34} {:>5} {:>10.1} {:>10.1} {:>6} {:>8.1} {:>6} {:>9}",
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
                let mut v: Vec<f64> = runs
                    .iter()
                    .filter(|r| r.router == name)
                    .map(|r| f(&r.report))
                    .collect();
                v.sort_by(f64::total_cmp);
                let mid = v.len() / 2;
                match v.len() % 2 {
                    1 => v[mid],
                    _ => (v[mid - 1] + v[mid]) / 2.0,
                }
            };
            println!(
                "{:<34} {:>5} {:>10.1} {:>10.1} {:>6.3} {:>8.1}",
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
    fn each_peer_is_started_with_sglangs_cache_aware_policy_on_loopback() {
        let workers = [
            "http://127.0.0.1:1".to_owned(),
            "http://127.0.0.1:2".to_owned(),
        ];
        for (peer, head) in [
            (Peer::Smg, vec!["launch"]),
            (Peer::Sglang, vec!["-m", "sglang_router.launch_router"]),
        ] {
            let c = peer.command(Path::new("/bin/peer"), 8123, &workers);
            let argv: Vec<_> = c
                .get_args()
                .map(|a| a.to_string_lossy().into_owned())
                .collect();
            assert_eq!(argv[..head.len()], head[..]);
            let rest = &argv[head.len()..];
            assert_eq!(
                rest,
                [
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "8123",
                    "--policy",
                    "cache_aware",
                    "--worker-urls",
                    "http://127.0.0.1:1",
                    "http://127.0.0.1:2"
                ]
            );
        }
    }

    #[test]
    fn this_processs_cpu_time_is_read_and_grows_with_work() {
        let before = cpu_seconds(std::process::id()).expect("/proc/self/stat is readable");
        let mut x = 0u64;
        let started = Instant::now();
        let mut after = before;
        // Spin until a clock tick of CPU time shows (10 ms of CPU), however
        // busy the machine; a minute of wall time is far past any load.
        while after <= before && started.elapsed() < Duration::from_secs(60) {
            for _ in 0..100_000 {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
            std::hint::black_box(x);
            after = cpu_seconds(std::process::id()).unwrap();
        }
        assert!(after > before, "{before} -> {after}");
    }

    #[test]
    fn a_peer_that_cannot_be_installed_is_a_reason_not_a_panic() {
        let args = VersusArgs {
            peer: Peer::Smg,
            peer_bin: None,
            venv: Some(PathBuf::from("/proc/no-such-dir/venv")),
            policy: None,
            config: None,
            workers: 1,
            speedup: 4.0,
            num_blocks: 64,
            requests: 1,
            concurrency: 1,
            rounds: 1,
            sharegpt: None,
            json: None,
        };
        let why = peer_program(&args).unwrap_err();
        assert!(why.contains("venv"), "{why}");
    }
}
