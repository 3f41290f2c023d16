//! `bench twin --engine vllm`: given a profile measured on real engines,
//! does the simulator predict `serve` in front of them?
//!
//! - **The engines**: `--workers` vLLM servers (the CPU build, the tiny
//!   Qwen3 `bench versus` serves), started once, each on its own core, with
//!   [`NUM_BLOCKS`] KV blocks (`--num-gpu-blocks-override`, so that the
//!   trace's prompts fill the cache as a production engine's fill its
//!   own), and vLLM's CPU API-server defaults for the step budget and the
//!   running sequences ([`CHUNK_TOKENS`], [`MAX_SEQS`]) given explicitly,
//!   so that the simulator is told the same.
//! - **The profile**: `calibrate` measures every server side by side (they
//!   share the machine's cores and memory bandwidth as they do under the
//!   load), unless `--engine-profile` names one.
//! - **Each load** (`--loads`, arrival-rate multipliers of the trace
//!   slice): `replay` with the profile, once per policy (it is
//!   deterministic); `serve` in front of the servers, `--rounds` times per
//!   policy, each round on emptied prefix caches (vLLM's
//!   `/reset_prefix_cache`, which its development mode serves) behind a
//!   fresh router given the same profile, the requests sent open loop at
//!   their arrival times; the hit rate from vLLM's own counters.
//!
//! The measured figures are the rounds' medians, shown with their spread;
//! the targets ([`TTFT_P50_TOLERANCE`], [`TTFT_P90_TOLERANCE`],
//! [`HIT_RATE_MARGIN`], policies in the same order by TTFT p90) are
//! reported per load, met or not.

use super::serve::{drive, interrupted, router_args, start_router};
use super::{
    load_sessions, orders_agree, relative_difference, replay_side, router_estimator_args,
    twin_fleet,
};
use super::{Figure, Side, TwinArgs};
use crate::versus::vllm_setup;
use anyhow::Context as _;
use clap::Parser;
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;
use switchyard_commands::calibrate::{calibrate, CalibrateArgs};
use switchyard_commands::engines::vllm::VllmWorker;
use switchyard_commands::loadgen::{self, Pacing};
use switchyard_commands::stats::{median, write_json};
use switchyard_core::engine_profile::EngineProfile;
use switchyard_core::select::PolicyKind;
use switchyard_sim::fleet::FleetConfig;

/// Tokens per KV block (vLLM's CPU backend takes multiples of 32).
pub const BLOCK_SIZE: usize = 32;
/// KV blocks per server: 32,768 tokens, eight of the slice's longest
/// prompts.
pub const NUM_BLOCKS: usize = 1024;
/// The slice's longest prompt: two of vLLM's steps.
pub const MAX_PROMPT_TOKENS: u32 = 4096;
/// vLLM's step budget (`--max-num-batched-tokens`; its CPU API server's
/// default), and the calibration's longest prompt.
pub const CHUNK_TOKENS: usize = 2048;
/// vLLM's running sequences (`--max-num-seqs`; its CPU API server's
/// default).
pub const MAX_SEQS: usize = 128;
/// The default loads: light, and near the saturation of two CPU servers.
pub const DEFAULT_LOADS: [f64; 2] = [2.0, 4.0];

/// The target: predicted TTFT p50 within this relative error.
pub const TTFT_P50_TOLERANCE: f64 = 0.15;
/// The target: predicted TTFT p90 within this relative error.
pub const TTFT_P90_TOLERANCE: f64 = 0.20;
/// The target: predicted engine hit rate within this (absolute).
pub const HIT_RATE_MARGIN: f64 = 0.03;

/// One policy at one load: the prediction and every round measured.
#[derive(Clone, Debug, Serialize)]
pub struct Compared {
    /// The simulator's figures.
    pub predicted: Side,
    /// Each round's figures.
    pub rounds: Vec<Side>,
    /// Each figure's median over the rounds.
    pub measured: Side,
    /// `(predicted − measured) / measured`, TTFT p50.
    pub ttft_p50_error: f64,
    /// The same, TTFT p90.
    pub ttft_p90_error: f64,
    /// `predicted − measured`, engine hit rate.
    pub hit_rate_difference: f64,
}

/// Every policy at one load, and whether it met the targets.
#[derive(Clone, Debug, Serialize)]
pub struct LoadReport {
    /// The arrival-rate multiplier.
    pub rate_scale: f64,
    /// Requests sent.
    pub requests: usize,
    /// The last arrival, seconds after the first.
    pub span_s: f64,
    /// Per policy.
    pub policies: BTreeMap<String, Compared>,
    /// Policies by TTFT p90 in the same order on both sides (two within
    /// `ORDER_TIE` a tie).
    pub same_order_by_ttft_p90: bool,
    /// Every policy within every tolerance, and the same order.
    pub target_met: bool,
}

/// What `bench twin --engine vllm` writes to `--json`.
#[derive(Debug, Serialize)]
pub struct VllmTwinReport {
    /// The profile the simulator ran with.
    pub profile: EngineProfile,
    /// Where it came from: calibrated side by side, or the file given.
    pub profile_source: String,
    /// The profile's file (what `replay --engine-profile` takes).
    pub profile_path: PathBuf,
    /// Per load.
    pub loads: Vec<LoadReport>,
    /// The fleet the simulator ran.
    pub fleet: FleetConfig,
    /// The arguments.
    pub args: TwinArgs,
    /// Wall-clock seconds of the whole benchmark.
    pub wall_seconds: f64,
}

/// Each figure of `rounds` at its median (the counts summed).
pub fn median_side(rounds: &[Side]) -> Side {
    let of = |f: fn(&Side) -> f64| median(&rounds.iter().map(f).collect::<Vec<_>>());
    Side {
        hit_rate: of(|s| s.hit_rate),
        ttft_p50_ms: of(|s| s.ttft_p50_ms),
        ttft_p90_ms: of(|s| s.ttft_p90_ms),
        ttft_mean_ms: of(|s| s.ttft_mean_ms),
        itl_mean_ms: of(|s| s.itl_mean_ms),
        itl_p50_ms: of(|s| s.itl_p50_ms),
        e2e_p50_ms: of(|s| s.e2e_p50_ms),
        e2e_p90_ms: of(|s| s.e2e_p90_ms),
        completed: rounds.iter().map(|s| s.completed).sum(),
        errors: rounds.iter().map(|s| s.errors).sum(),
        retried: rounds.iter().map(|s| s.retried).sum(),
        resumed: rounds.iter().map(|s| s.resumed).sum(),
        transfers: 0,
        transfer_bytes: 0,
    }
}

/// Compares one policy's prediction with its rounds.
pub fn compare(predicted: Side, rounds: Vec<Side>) -> Compared {
    let measured = median_side(&rounds);
    Compared {
        // `(predicted − measured) / measured`: the measured side is the
        // reference here.
        ttft_p50_error: relative_difference(measured.ttft_p50_ms, predicted.ttft_p50_ms),
        ttft_p90_error: relative_difference(measured.ttft_p90_ms, predicted.ttft_p90_ms),
        hit_rate_difference: predicted.hit_rate - measured.hit_rate,
        predicted,
        rounds,
        measured,
    }
}

/// Whether `policies` met the targets: every one within each tolerance,
/// and the same order by TTFT p90 on both sides; the order's agreement
/// apart.
pub fn targets(policies: &BTreeMap<String, Compared>) -> (bool, bool) {
    let pairs: Vec<(&str, Side, Side)> = policies
        .iter()
        .map(|(n, c)| (n.as_str(), c.predicted, c.measured))
        .collect();
    let same_order = orders_agree(&pairs, Figure::TtftP90);
    let within = !policies.is_empty()
        && policies.values().all(|c| {
            c.ttft_p50_error.abs() <= TTFT_P50_TOLERANCE
                && c.ttft_p90_error.abs() <= TTFT_P90_TOLERANCE
                && c.hit_rate_difference.abs() <= HIT_RATE_MARGIN
        });
    (within && same_order, same_order)
}

/// Checks what only the real-engine case needs.
fn check(args: &TwinArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.workload.is_none() && args.disagg.is_none() && args.trace.is_none(),
        "--engine vllm replays the bundled conversation trace, aggregated (no --workload, --disagg or --trace yet)"
    );
    anyhow::ensure!(
        !args.replay_only,
        "--replay-only has nothing to do with --engine vllm: run `replay --engine-profile`"
    );
    anyhow::ensure!(
        args.loads().iter().all(|l| l.is_finite() && *l > 0.0),
        "--loads must be positive"
    );
    anyhow::ensure!(
        args.max_prompt_tokens() as usize + 1 < 8192,
        "--max-prompt-tokens must leave room for an answer within the servers' 8,192 tokens"
    );
    Ok(())
}

impl TwinArgs {
    /// `--loads`, else [`DEFAULT_LOADS`].
    pub fn loads(&self) -> Vec<f64> {
        if self.loads.is_empty() {
            DEFAULT_LOADS.to_vec()
        } else {
            self.loads.clone()
        }
    }
}

/// The vLLM servers' flags besides the harness's own, for `num_blocks`
/// KV blocks (what the tier's plan check starts its servers with too).
pub fn server_flags(num_blocks: usize) -> Vec<String> {
    [
        ("--num-gpu-blocks-override", num_blocks.to_string()),
        ("--max-num-batched-tokens", CHUNK_TOKENS.to_string()),
        ("--max-num-seqs", MAX_SEQS.to_string()),
    ]
    .into_iter()
    .flat_map(|(k, v)| [k.to_owned(), v])
    .collect()
}

/// `calibrate`'s options for `urls`: its defaults, prompts up to one step.
fn calibrate_args(urls: &[String], out: PathBuf) -> anyhow::Result<CalibrateArgs> {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: CalibrateArgs,
    }
    let mut argv = vec!["calibrate".to_owned()];
    for url in urls {
        argv.extend(["--worker".to_owned(), url.clone()]);
    }
    argv.extend([
        "--max-prompt-tokens".to_owned(),
        CHUNK_TOKENS.to_string(),
        "--out".to_owned(),
        out.display().to_string(),
    ]);
    Ok(Cli::try_parse_from(argv)?.args)
}

/// The simulator's fleet: the twin's, with the profile's timing and
/// vLLM's step budget and sequence cap.
fn fleet_with(args: &TwinArgs, profile: &EngineProfile) -> anyhow::Result<FleetConfig> {
    let mut fleet = twin_fleet(args)?;
    fleet.engine.timing = fleet.engine.timing.clone().with_profile(profile);
    fleet.engine.max_num_batched_tokens = CHUNK_TOKENS;
    fleet.engine.max_num_seqs = MAX_SEQS;
    Ok(fleet)
}

/// Empties every server's prefix cache (vLLM's `/reset_prefix_cache`,
/// served in its development mode: `VLLM_SERVER_DEV_MODE=1`).
pub async fn reset_prefix_caches(urls: &[String]) -> anyhow::Result<()> {
    use http_body_util::Full;
    let client = loadgen::client();
    for url in urls {
        let request = hyper::Request::post(format!("{url}/reset_prefix_cache"))
            .body(Full::new(bytes::Bytes::new()))?;
        let response = client
            .request(request)
            .await
            .with_context(|| format!("resetting {url}'s prefix cache"))?;
        anyhow::ensure!(
            response.status().is_success(),
            "{url}/reset_prefix_cache answered {} (is vLLM in development mode?)",
            response.status()
        );
    }
    Ok(())
}

/// Runs `bench twin --engine vllm`.
pub fn run(args: &TwinArgs) -> anyhow::Result<()> {
    check(args)?;
    let started = Instant::now();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let setup = vllm_setup()?;
    let workers = args.workers();
    eprintln!("starting {workers} vLLM servers (about a minute)");
    let block_size = u32::try_from(args.block_size()).context("--block-size")?;
    let servers: Vec<VllmWorker> = setup.start_workers(workers, "twin", &runtime, |o| {
        o.block_size = block_size;
        o.extra_args.extend(server_flags(args.num_blocks()));
        o.extra_env
            .push(("VLLM_SERVER_DEV_MODE".to_owned(), "1".to_owned()));
    })?;
    let urls: Vec<String> = servers.iter().map(|w| w.base.clone()).collect();
    let specs: Vec<String> = servers
        .iter()
        .enumerate()
        .map(|(i, w)| w.worker_spec(&format!("v{i}")))
        .collect();
    let scratch = std::env::temp_dir().join("switchyard-twin-vllm");
    std::fs::create_dir_all(&scratch)?;
    let (profile_path, profile_source) = match &args.engine_profile {
        Some(path) => (path.clone(), path.display().to_string()),
        None => {
            let path = scratch.join("engine.toml");
            let calibration = runtime.block_on(calibrate(&calibrate_args(&urls, path.clone())?))?;
            std::fs::write(&path, calibration.profile.to_toml())?;
            println!("wrote {}", path.display());
            (path, "calibrated side by side".to_owned())
        }
    };
    let text = std::fs::read_to_string(&profile_path)
        .with_context(|| format!("reading {}", profile_path.display()))?;
    let profile =
        EngineProfile::from_toml(&text).with_context(|| profile_path.display().to_string())?;
    let fleet = fleet_with(args, &profile)?;
    println!(
        "bench twin --engine vllm: {workers} servers × {} blocks of {} tokens, step budget {CHUNK_TOKENS}, profile {profile_source}",
        args.num_blocks(),
        args.block_size()
    );
    let router_extra = router_estimator_args(&fleet, Some(&profile_path));
    let mut loads = Vec::new();
    for rate_scale in args.loads() {
        let at = TwinArgs {
            rate_scale: Some(rate_scale),
            ..args.clone()
        };
        let sessions = load_sessions(&at)?.sessions;
        let span_s = sessions.last().map_or(0.0, |s| s.arrival_ms) / 1e3;
        println!(
            "\nload ×{rate_scale}: {} requests over {span_s:.0} s",
            sessions.len()
        );
        let mut policies = BTreeMap::new();
        for &policy in &args.policies {
            let predicted = replay_side(&fleet, policy, &sessions)?;
            let (requests, arrivals) = loadgen::session_requests(&sessions, None)?;
            let mut rounds = Vec::new();
            for round in 0..args.rounds {
                let side = runtime.block_on(async {
                    tokio::select! {
                        side = measure(policy, &at, &urls, &specs, &router_extra, requests.clone(), Pacing::Arrivals(arrivals.clone().into())) => side,
                        () = interrupted() => Err(anyhow::anyhow!("interrupted: stopped the router and the vLLM servers")),
                    }
                })?;
                println!(
                    "  {:<12} round {}: hit {:.3}  TTFT p50 {:.1} p90 {:.1}  ITL p50 {:.1} ms  ({} errors)",
                    policy.name(),
                    round + 1,
                    side.hit_rate,
                    side.ttft_p50_ms,
                    side.ttft_p90_ms,
                    side.itl_p50_ms,
                    side.errors
                );
                rounds.push(side);
            }
            let compared = compare(predicted, rounds);
            print_compared(policy, &compared);
            policies.insert(policy.name().to_owned(), compared);
        }
        let (target_met, same_order) = targets(&policies);
        println!(
            "  target at ×{rate_scale} (TTFT p50 within {:.0}%, p90 within {:.0}%, hit rate within {HIT_RATE_MARGIN}, the same order by TTFT p90): {}{}",
            TTFT_P50_TOLERANCE * 100.0,
            TTFT_P90_TOLERANCE * 100.0,
            if target_met { "met" } else { "not met" },
            if same_order { "" } else { " (the orders differ)" }
        );
        loads.push(LoadReport {
            rate_scale,
            requests: sessions.len(),
            span_s,
            policies,
            same_order_by_ttft_p90: same_order,
            target_met,
        });
    }
    drop(servers);
    let report = VllmTwinReport {
        profile,
        profile_source,
        profile_path,
        loads,
        fleet,
        args: args.clone(),
        wall_seconds: started.elapsed().as_secs_f64(),
    };
    if let Some(path) = &args.json {
        write_json(path, &report)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

/// One round of one policy: emptied caches, a fresh router in front of the
/// servers (`specs`: their `--worker` values, KV events included), the
/// requests at their arrival times.
async fn measure(
    policy: PolicyKind,
    args: &TwinArgs,
    urls: &[String],
    specs: &[String],
    router_extra: &[String],
    requests: Vec<loadgen::PreparedRequest>,
    pacing: Pacing,
) -> anyhow::Result<Side> {
    reset_prefix_caches(urls).await?;
    let mut flags = router_args(policy, args.block_size(), specs.iter().cloned(), false);
    flags.extend(router_extra.iter().cloned());
    let (router, base) = start_router(&flags)?;
    let run = drive(&base, urls, urls, requests, pacing).await;
    drop(router);
    let run = run?;
    Ok(Side::of_serve(&run.report, run.transfers, run.moved))
}

fn print_compared(policy: PolicyKind, c: &Compared) {
    let spread = |f: fn(&Side) -> f64| {
        let values: Vec<f64> = c.rounds.iter().map(f).collect();
        let lo = values.iter().copied().fold(f64::INFINITY, f64::min);
        let hi = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        format!("{lo:.1}–{hi:.1}")
    };
    println!(
        "  {:<12} predicted/measured: TTFT p50 {:.1}/{:.1} ms ({:+.0}%, rounds {}), p90 {:.1}/{:.1} ms ({:+.0}%, rounds {}), ITL p50 {:.1}/{:.1} ms, e2e p90 {:.0}/{:.0} ms, hit {:.3}/{:.3} ({:+.3})",
        policy.name(),
        c.predicted.ttft_p50_ms,
        c.measured.ttft_p50_ms,
        c.ttft_p50_error * 100.0,
        spread(|s| s.ttft_p50_ms),
        c.predicted.ttft_p90_ms,
        c.measured.ttft_p90_ms,
        c.ttft_p90_error * 100.0,
        spread(|s| s.ttft_p90_ms),
        c.predicted.itl_p50_ms,
        c.measured.itl_p50_ms,
        c.predicted.e2e_p90_ms,
        c.measured.e2e_p90_ms,
        c.predicted.hit_rate,
        c.measured.hit_rate,
        c.hit_rate_difference
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(flags: &[&str]) -> TwinArgs {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: TwinArgs,
        }
        Cli::try_parse_from(std::iter::once(&"twin").chain(flags))
            .unwrap()
            .args
    }

    fn twin(flags: &[&str]) -> TwinArgs {
        let mut all = vec!["--engine", "vllm"];
        all.extend_from_slice(flags);
        parse(&all)
    }

    fn side(ttft_p50_ms: f64, ttft_p90_ms: f64, hit_rate: f64) -> Side {
        Side {
            ttft_p50_ms,
            ttft_p90_ms,
            hit_rate,
            completed: 100,
            ..Side::default()
        }
    }

    #[test]
    fn the_real_engine_case_has_its_own_defaults() {
        let a = twin(&[]);
        assert_eq!((a.workers(), a.requests(), a.block_size()), (2, 100, 32));
        assert_eq!(
            (a.num_blocks(), a.max_prompt_tokens()),
            (NUM_BLOCKS, MAX_PROMPT_TOKENS)
        );
        assert_eq!(a.loads(), DEFAULT_LOADS);
        assert_eq!(a.rounds, 3);
        check(&a).unwrap();
        let given = twin(&["--workers", "3", "--loads", "1.5"]);
        assert_eq!((given.workers(), given.loads()), (3, vec![1.5]));
    }

    #[test]
    fn what_the_real_engine_case_does_not_run_is_refused() {
        for flags in [
            &["--workload", "agentic"][..],
            &["--disagg", "1:1"],
            &["--replay-only"],
            &["--loads", "0"],
            &["--max-prompt-tokens", "8192"],
        ] {
            assert!(check(&twin(flags)).is_err(), "{flags:?}");
        }
        // And the sim-worker case refuses the real engine's flags.
        assert!(super::super::check(&parse(&["--loads", "2"])).is_err());
    }

    /// The simulator is told what the servers are started with: the
    /// profile's curves, the KV blocks, vLLM's step budget and sequences.
    #[test]
    fn the_simulated_fleet_runs_the_servers_settings_on_the_profiles_clock() {
        let profile = EngineProfile::from_toml(
            "prefill = [4e-6, 0.014, 19.0]\ndecode = [18.0, -13.0, 23.0]\ndecode_floor_ms = 6.5\ndecode_per_sequence_ms = 0.5\n",
        )
        .unwrap();
        let a = twin(&[]);
        let fleet = fleet_with(&a, &profile).unwrap();
        assert_eq!(fleet.workers, 2);
        assert_eq!(fleet.engine.block_size, BLOCK_SIZE);
        assert_eq!(fleet.engine.num_blocks, NUM_BLOCKS);
        assert_eq!(fleet.engine.max_num_batched_tokens, CHUNK_TOKENS);
        assert_eq!(fleet.engine.max_num_seqs, MAX_SEQS);
        assert_eq!(fleet.engine.timing.prefill, profile.prefill);
        assert_eq!(fleet.engine.timing.decode_per_sequence_ms, 0.5);
        assert_eq!(fleet.engine.timing.speedup, 1.0, "the engines' own clock");
        let estimator = fleet.dispatcher(0).estimator;
        assert_eq!(estimator.chunk_tokens as usize, CHUNK_TOKENS);
        assert_eq!(estimator.decode_per_sequence_ms, 0.5);
        let flags = server_flags(NUM_BLOCKS).join(" ");
        assert_eq!(
            flags,
            "--num-gpu-blocks-override 1024 --max-num-batched-tokens 2048 --max-num-seqs 128"
        );
    }

    #[test]
    fn the_calibration_measures_every_server_up_to_one_step() {
        let urls = [
            "http://127.0.0.1:1".to_owned(),
            "http://127.0.0.1:2".to_owned(),
        ];
        let c = calibrate_args(&urls, "p.toml".into()).unwrap();
        assert_eq!(c.workers, urls);
        assert_eq!(c.max_prompt_tokens, CHUNK_TOKENS);
        assert_eq!(c.out, PathBuf::from("p.toml"));
    }

    #[test]
    fn the_measured_figures_are_the_rounds_medians() {
        let rounds = vec![
            side(90.0, 180.0, 0.30),
            side(80.0, 400.0, 0.32),
            side(100.0, 170.0, 0.31),
        ];
        let c = compare(side(72.0, 150.0, 0.33), rounds);
        assert_eq!(
            (c.measured.ttft_p50_ms, c.measured.ttft_p90_ms),
            (90.0, 180.0)
        );
        assert!((c.measured.hit_rate - 0.31).abs() < 1e-12);
        assert_eq!(c.measured.completed, 300);
        assert!((c.ttft_p50_error + 0.2).abs() < 1e-12);
        assert!((c.ttft_p90_error + 1.0 / 6.0).abs() < 1e-12);
        assert!((c.hit_rate_difference - 0.02).abs() < 1e-12);
        assert!(relative_difference(0.0, 1.0).is_nan(), "nothing measured");
    }

    #[test]
    fn the_targets_need_every_tolerance_and_the_same_order() {
        let mut policies = BTreeMap::new();
        policies.insert(
            "ttft".to_owned(),
            compare(side(90.0, 170.0, 0.32), vec![side(100.0, 200.0, 0.31)]),
        );
        policies.insert(
            "round-robin".to_owned(),
            compare(side(95.0, 190.0, 0.30), vec![side(100.0, 220.0, 0.30)]),
        );
        assert_eq!(targets(&policies), (true, true));
        // p50 16% under: missed, the order still the same.
        policies.insert(
            "ttft".to_owned(),
            compare(side(84.0, 170.0, 0.32), vec![side(100.0, 200.0, 0.31)]),
        );
        assert_eq!(targets(&policies), (false, true));
        // Within every tolerance but in the other order by p90.
        policies.insert(
            "ttft".to_owned(),
            compare(side(90.0, 200.0, 0.32), vec![side(100.0, 180.0, 0.31)]),
        );
        assert_eq!(targets(&policies), (false, false));
        // A hit rate off by more than 0.03.
        policies.insert(
            "ttft".to_owned(),
            compare(side(90.0, 170.0, 0.36), vec![side(100.0, 200.0, 0.31)]),
        );
        assert!(!targets(&policies).0);
        assert!(!targets(&BTreeMap::new()).0, "nothing measured, no claim");
    }
}
