//! `switchyard bench twin`: does `replay` predict what `serve` does?
//!
//! One slice of a Mooncake trace — [`mooncake_slice`]: the first N
//! servable records, equal timestamps spread over the trace's ~3 s steps
//! and every arrival divided by the rate scale — runs twice per policy on
//! one fleet configuration (built by `replay`'s own [`fleet_config`]):
//!
//! - in virtual time through the fleet simulator, as `switchyard replay`
//!   runs it;
//! - in real time through `switchyard serve` (a child process) in front of
//!   N `switchyard sim-worker` children with the same engine settings
//!   ([`sim_worker_args`]), publishing KV events over ZMQ, driven open loop
//!   by the load generator at the same arrival times ([`serve`]).
//!
//! Both sides get the same sessions; the serve side's requests are made
//! from them by [`loadgen::session_requests`]. Neither side is tuned: the
//! figures say how far the real router is from its simulation today.
//!
//! The disaggregated case (`--disagg P:D`): the simulator runs the split
//! `replay --disagg P:D` runs ([`disagg_config`]); the router runs `serve
//! --disagg vllm` with the first P workers `role=prefill` and the rest
//! `role=decode`, as the simulator numbers them; every sim-worker speaks
//! vLLM's protocol over the same transfer link ([`sim_worker_disagg_args`]).
//! The hit rate compared is the prefill workers' on both sides (the
//! simulator counts a split prompt's hit on its prefill half).

pub(crate) mod serve;
pub mod vllm;

pub use crate::versus::Engine;
use anyhow::Context as _;
use clap::{Args, Parser};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;
use switchyard_commands::data::Trace;
use switchyard_commands::loadgen::{self, LoadWorkload, Pacing};
use switchyard_commands::replay::{disagg_config, fleet_config, parse_split, ReplayArgs};
use switchyard_commands::stats::write_json;
use switchyard_core::estimate::EstimatorConfig;
use switchyard_core::select::PolicyKind;
use switchyard_engine::EngineConfig;
use switchyard_sim::fleet::{simulate, DisaggConfig, FleetConfig, TransferConfig, WorkerFailure};
use switchyard_sim::report::PolicyReport;
use switchyard_sim::workload::{
    self, mooncake_slice, AgentVocabulary, AgenticConfig, Session, TraceSlice, WorkloadLimits,
};
use switchyard_sim_worker::engine_flags::ProfileArg;

/// Engine speed-up of the twin's fleet. With the default arrivals on 4
/// workers, 1 (model time is wall time) is where the policies part: in the
/// simulator round-robin's TTFT p90 is about 1 s and `kv`'s about 0.5 s; at
/// 2 the three are within 20% of each other and their order says little.
pub const DEFAULT_SPEEDUP: f64 = 1.0;

/// Arrival-rate multiplier: the first 1,000 servable requests of the
/// conversation trace span 366 s; ×6 plays them in about a minute.
pub const DEFAULT_RATE_SCALE: f64 = 6.0;

/// The target: each policy's hit rate within this relative difference.
pub const HIT_RATE_TOLERANCE: f64 = 0.10;

/// The failure case's target: completed, migrated and failed requests
/// within this relative difference of each other on both sides (or
/// within [`FAILURE_COUNT_SLACK`] requests, for counts too small for a
/// share to mean anything).
pub const FAILURE_COUNT_TOLERANCE: f64 = 0.05;

/// Counts this close are equal whatever their ratio (a failure that hits
/// 3 requests on one side and 4 on the other agrees).
pub const FAILURE_COUNT_SLACK: u64 = 2;

/// `--fail-worker` as the twin takes it: `AT_S:WORKER`, for good (a
/// sim-worker killed is not restarted on the serve side).
fn parse_twin_failure(spec: &str) -> Result<WorkerFailure, String> {
    let failure = WorkerFailure::parse(spec)?;
    if failure.down_ms.is_some() {
        return Err(
            "the twin fails a worker for good: give AT_S:WORKER, without a time down".to_owned(),
        );
    }
    Ok(failure)
}

/// Options of `switchyard bench twin`.
#[derive(Debug, Clone, Args, Serialize)]
pub struct TwinArgs {
    /// The engines of the serve side: `sim` (sim-workers with the
    /// simulator's timing) or `vllm` (vLLM's CPU build, calibrated first;
    /// see [`vllm`]).
    #[arg(long, value_enum, default_value_t = Engine::Sim)]
    pub engine: Engine,
    /// Requests: the first N servable records of the trace [default: 1000;
    /// 100 with `--engine vllm`].
    #[arg(long)]
    pub requests: Option<usize>,
    /// Workers on both sides [default: 4; 2 with `--engine vllm`].
    #[arg(long)]
    pub workers: Option<usize>,
    /// Engine speed-up over the timing model, on both sides.
    #[arg(long, default_value_t = DEFAULT_SPEEDUP)]
    pub speedup: f64,
    /// Arrival-rate multiplier (2 = twice as fast as the trace), on both
    /// sides [default: 6 for the trace, 1 for `--workload agentic`].
    #[arg(long)]
    pub rate_scale: Option<f64>,
    /// Policies to compare (comma-separated).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "ttft,kv,cache-aware,round-robin"
    )]
    pub policies: Vec<PolicyKind>,
    /// Engine (and router) block size in tokens [default: 64; 32 with
    /// `--engine vllm`].
    #[arg(long)]
    pub block_size: Option<usize>,
    /// Device KV blocks per worker [default: 16,384; 1,024 with `--engine
    /// vllm`, given to vLLM as `--num-gpu-blocks-override`].
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// Records with longer prompts are skipped [default: 32,000, as
    /// `loadgen`; 4,096 with `--engine vllm`].
    #[arg(long)]
    pub max_prompt_tokens: Option<u32>,
    /// Cap on each request's output tokens (default: the trace's).
    #[arg(long)]
    pub max_output_tokens: Option<u32>,
    /// Simulator only: delay from an engine's KV event to the router, ms
    /// (`replay`'s default; the real one is whatever ZMQ and the router take).
    #[arg(long, default_value_t = 10.0)]
    pub kv_event_delay_ms: f64,
    /// Both sides: keep the engines' prefill model as is instead of fitting
    /// it per worker from observed times to first token (`serve` fits by
    /// default; the twin's replay side fits too, to match it).
    #[arg(long)]
    pub no_prefill_fit: bool,
    /// Mooncake trace [default: the bundled conversation trace].
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// A built-in workload instead of the trace. `agentic`: the agent
    /// sessions `replay --workload agentic` simulates, sent as `loadgen
    /// --workload agentic` sends them (each call after the previous answer
    /// and its tool gap, sub-agents together); `--requests` takes whole
    /// sessions until it is reached, and every context is capped at
    /// `--max-prompt-tokens` (the router's and sim-workers' limits).
    #[arg(long, value_enum, conflicts_with_all = ["trace", "disagg"])]
    pub workload: Option<LoadWorkload>,
    /// With `--workload agentic`: its parameters (TOML), as `replay
    /// --agentic-config` takes them.
    #[arg(long, requires = "workload")]
    pub agentic_config: Option<PathBuf>,
    /// With `--workload agentic`: its seed, as `replay --seed`.
    #[arg(long, default_value_t = 0, requires = "workload")]
    pub seed: u64,
    /// The disaggregated case: `P:D`, P prefill and D decode workers
    /// (P + D = --workers). The simulator runs `replay --disagg P:D`, the
    /// router `serve --disagg vllm` with worker roles, the sim-workers
    /// `--disagg vllm`; the hit rate compared is the prefill workers'.
    #[arg(long, value_parser = parse_split)]
    pub disagg: Option<(usize, usize)>,
    /// With `--disagg`: the transfer link's bandwidth in GB/s, on both sides
    /// (`replay`'s default).
    #[arg(long, default_value_t = TransferConfig::default().bandwidth_bytes_per_s / 1e9)]
    pub transfer_gbps: f64,
    /// With `--disagg`: the fixed cost of a transfer in model ms, on both
    /// sides (`replay`'s default).
    #[arg(long, default_value_t = TransferConfig::default().latency_ms)]
    pub transfer_latency_ms: f64,
    /// The engines' timing (a profile `calibrate` wrote): with the
    /// sim-workers, both sides step on it; with `--engine vllm`, the
    /// simulator does, instead of calibrating the servers first.
    #[arg(long, value_name = "FILE")]
    pub engine_profile: Option<PathBuf>,
    /// With `--engine vllm`: the loads, as arrival-rate multipliers of the
    /// trace (comma-separated) [default: 2,4: light, and near saturation
    /// of two CPU workers].
    #[arg(long, value_delimiter = ',', conflicts_with = "rate_scale")]
    pub loads: Vec<f64>,
    /// With `--engine vllm`: real-time runs per policy and load; the
    /// figures are their medians, with their spread. With `--fail-worker`:
    /// serve runs per policy; the figures are their medians and the counts
    /// compared the median run's (by migrated requests), every run's shown.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// The failure case: worker `WORKER` (from 0) dies `AT_S` seconds
    /// into the load, for good — on the serve side its sim-worker process
    /// is killed, on the replay side `replay --fail-worker AT_S:WORKER`
    /// kills its engine — and the sides' completed, migrated and failed
    /// counts are compared (within [`FAILURE_COUNT_TOLERANCE`]).
    #[arg(long, value_name = "AT_S:WORKER", value_parser = parse_twin_failure)]
    pub fail_worker: Option<WorkerFailure>,
    /// With `--fail-worker`: simulator runs per policy, each routing with
    /// its own seed (the router's, then the next ones); compared by the
    /// median run, as the serve side's rounds are. Which requests are in
    /// flight on the failed worker when it dies follows the routing's
    /// tie-breaking draws, which one seed fixes to one sample.
    #[arg(long, default_value_t = 9)]
    pub replay_seeds: usize,
    /// Run the simulator side only (seconds, no processes).
    #[arg(long)]
    pub replay_only: bool,
    /// Write the figures here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// One side's figures for one policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Side {
    /// Engine prefix hit rate: cached / prompt tokens over the run (in the
    /// disaggregated case, the prefill workers').
    pub hit_rate: f64,
    /// TTFT median, ms.
    pub ttft_p50_ms: f64,
    /// TTFT 90th percentile, ms.
    pub ttft_p90_ms: f64,
    /// TTFT mean, ms.
    pub ttft_mean_ms: f64,
    /// Inter-token latency mean, ms.
    pub itl_mean_ms: f64,
    /// Inter-token latency median, ms.
    pub itl_p50_ms: f64,
    /// End-to-end latency median, ms.
    pub e2e_p50_ms: f64,
    /// End-to-end latency 90th percentile, ms.
    pub e2e_p90_ms: f64,
    /// Requests completed.
    pub completed: u64,
    /// Requests that failed.
    pub errors: u64,
    /// The failure case: requests moved to another worker before their
    /// first token after theirs failed (`serve`'s
    /// `switchyard_migrations_total` but `midstream`).
    pub retried: u64,
    /// The failure case: streams resumed on another worker after theirs
    /// failed (`switchyard_migrations_total{reason="midstream"}`).
    pub resumed: u64,
    /// Disaggregated case: KV transfers from prefill to decode workers.
    pub transfers: u64,
    /// Disaggregated case: the bytes they moved (modeled: the tokens of
    /// the blocks a decode worker lacked × bytes per token).
    pub transfer_bytes: u64,
}

impl Side {
    /// Requests moved to another worker, retried or resumed.
    pub fn migrated(&self) -> u64 {
        self.retried + self.resumed
    }

    fn of_replay(r: &PolicyReport) -> Self {
        Self {
            hit_rate: r.hit_rate,
            ttft_p50_ms: r.ttft_ms.p50,
            ttft_p90_ms: r.ttft_ms.p90,
            ttft_mean_ms: r.ttft_ms.mean,
            itl_mean_ms: r.itl_ms.mean,
            itl_p50_ms: r.itl_ms.p50,
            e2e_p50_ms: r.e2e_ms.p50,
            e2e_p90_ms: r.e2e_ms.p90,
            completed: r.completed,
            errors: r.errors,
            retried: r.failures.as_ref().map_or(0, |f| f.retried),
            resumed: r.failures.as_ref().map_or(0, |f| f.resumed),
            transfers: r.transfers,
            transfer_bytes: r.transfer_bytes,
        }
    }

    fn of_serve(r: &loadgen::Report, transfers: serve::Transfers, moved: serve::Moved) -> Self {
        Self {
            hit_rate: r.hit_rate.unwrap_or(f64::NAN),
            ttft_p50_ms: r.ttft_ms.p50,
            ttft_p90_ms: r.ttft_ms.p90,
            ttft_mean_ms: r.ttft_ms.mean,
            itl_mean_ms: r.itl_ms.mean,
            itl_p50_ms: r.itl_ms.p50,
            e2e_p50_ms: r.e2e_ms.p50,
            e2e_p90_ms: r.e2e_ms.p90,
            completed: (r.requests - r.errors) as u64,
            errors: r.errors as u64,
            retried: moved.retried,
            resumed: moved.resumed,
            transfers: transfers.count,
            transfer_bytes: transfers.bytes,
        }
    }
}

/// Both sides of one policy.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Pair {
    /// The simulator, virtual time.
    pub replay: Side,
    /// The router and sim-worker processes, real time (`None`: `--replay-only`);
    /// over several rounds, [`median_rounds`].
    pub serve: Option<Side>,
    /// The failure case over `--rounds` rounds: every round's serve side,
    /// in the order run (empty for one round).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub serve_rounds: Vec<Side>,
    /// The failure case over `--replay-seeds` seeds: every seed's
    /// simulator side, in seed order (empty for one seed).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replay_rounds: Vec<Side>,
}

/// Several runs of the failure case as one side (the serve side's rounds,
/// or the simulator's seeds): each figure at its median over the runs (as
/// `--engine vllm` reports them), and the counts of the run whose
/// migrated count is the median (the lower of the two middle ones for an
/// even count), so completed, migrated and failed are one run's. A count
/// depends on the queue on the failed worker at the instant it dies: a
/// real run's varies with its timing, the simulator's with the routing's
/// tie-breaking draws (one seed, one sample), so each side is its median
/// run.
pub fn median_rounds(rounds: &[Side]) -> Option<Side> {
    let mut sorted: Vec<&Side> = rounds.iter().collect();
    sorted.sort_by_key(|s| s.migrated());
    let run = **sorted.get(sorted.len().saturating_sub(1) / 2)?;
    Some(Side {
        completed: run.completed,
        errors: run.errors,
        retried: run.retried,
        resumed: run.resumed,
        transfers: run.transfers,
        transfer_bytes: run.transfer_bytes,
        ..vllm::median_side(rounds)
    })
}

/// Policies in order of one figure on one side.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Orders {
    /// The simulator's order.
    pub replay: Vec<String>,
    /// The server's order.
    pub serve: Vec<String>,
    /// Whether they agree: no two policies in one order on one side and
    /// the other order on the other, two figures within [`ORDER_TIE`] of
    /// each other being a tie on that side (the written orders break ties
    /// by name).
    pub same: bool,
}

/// Two policies' figures within this relative difference are a tie for
/// the orders' agreement: a simulator often gives two policies the very
/// same figures (both send every call where its context is), and the
/// real-time side then parts them by noise.
pub const ORDER_TIE: f64 = 0.02;

/// Which figure to order policies by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Figure {
    /// TTFT p90, lowest first.
    TtftP90,
    /// Engine hit rate, highest first.
    HitRate,
}

impl Figure {
    /// `side`'s figure, smaller better.
    fn key(self, side: &Side) -> f64 {
        match self {
            Figure::TtftP90 => side.ttft_p90_ms,
            Figure::HitRate => -side.hit_rate,
        }
    }
}

/// The policies of `sides` ordered best first by `figure` (ties by name,
/// so an order is always defined).
pub fn order_by(sides: &[(&str, Side)], figure: Figure) -> Vec<String> {
    let mut v: Vec<(&str, f64)> = sides.iter().map(|(n, s)| (*n, figure.key(s))).collect();
    v.sort_by(|a, b| a.1.total_cmp(&b.1).then(a.0.cmp(b.0)));
    v.into_iter().map(|(n, _)| n.to_owned()).collect()
}

/// How `a` compares with `b` by `figure` (`Less`: `a` is better), `Equal`
/// when within [`ORDER_TIE`] of each other.
fn strict_order(a: &Side, b: &Side, figure: Figure) -> std::cmp::Ordering {
    let (x, y) = (figure.key(a), figure.key(b));
    if (x - y).abs() <= ORDER_TIE * x.abs().max(y.abs()) {
        std::cmp::Ordering::Equal
    } else {
        x.total_cmp(&y)
    }
}

/// Whether no two policies are ordered one way by `replay` and the other
/// way by `serve` (`pairs`: each policy's replay and serve side).
fn orders_agree(pairs: &[(&str, Side, Side)], figure: Figure) -> bool {
    pairs.iter().enumerate().all(|(i, (_, ra, sa))| {
        pairs[i + 1..].iter().all(|(_, rb, sb)| {
            let (r, s) = (strict_order(ra, rb, figure), strict_order(sa, sb, figure));
            r == std::cmp::Ordering::Equal || s == std::cmp::Ordering::Equal || r == s
        })
    })
}

/// `(serve − replay) / replay`; NaN when replay is zero.
pub fn relative_difference(replay: f64, serve: f64) -> f64 {
    if replay == 0.0 {
        f64::NAN
    } else {
        (serve - replay) / replay
    }
}

/// The comparison of both sides over every policy.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Verdict {
    /// Per policy, the relative hit-rate difference (serve against replay).
    pub hit_rate_relative_difference: BTreeMap<String, f64>,
    /// Every policy's hit rate within [`HIT_RATE_TOLERANCE`].
    pub hit_rates_within_tolerance: bool,
    /// Policies by TTFT p90 on both sides.
    pub order_by_ttft_p90: Orders,
    /// Policies by hit rate on both sides.
    pub order_by_hit_rate: Orders,
    /// The failure case (`--fail-worker`): every policy's completed,
    /// migrated and failed counts agree ([`counts_agree`]); `None`
    /// without a failure.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure_counts_agree: Option<bool>,
    /// All of the above.
    pub target_met: bool,
}

/// Whether two counts of the same thing agree: within
/// [`FAILURE_COUNT_TOLERANCE`] of the larger, or within
/// [`FAILURE_COUNT_SLACK`] requests.
pub fn counts_agree(replay: u64, serve: u64) -> bool {
    let gap = replay.abs_diff(serve);
    gap <= FAILURE_COUNT_SLACK || gap as f64 <= FAILURE_COUNT_TOLERANCE * replay.max(serve) as f64
}

/// A policy's completed, migrated and failed counts agree on both sides.
fn failure_counts_agree(replay: &Side, serve: &Side) -> bool {
    counts_agree(replay.completed, serve.completed)
        && counts_agree(replay.migrated(), serve.migrated())
        && counts_agree(replay.errors, serve.errors)
}

/// Compares the sides of `pairs` (policies with no serve side are left
/// out); `failing`: the failure case, whose counts are compared too.
pub fn verdict(pairs: &BTreeMap<String, Pair>, failing: bool) -> Verdict {
    let both: Vec<(&str, Side, Side)> = pairs
        .iter()
        .filter_map(|(n, p)| p.serve.map(|s| (n.as_str(), p.replay, s)))
        .collect();
    let replay: Vec<(&str, Side)> = both.iter().map(|(n, r, _)| (*n, *r)).collect();
    let serve: Vec<(&str, Side)> = both.iter().map(|(n, _, s)| (*n, *s)).collect();
    let orders = |figure| Orders {
        replay: order_by(&replay, figure),
        serve: order_by(&serve, figure),
        same: orders_agree(&both, figure),
    };
    let differences: BTreeMap<String, f64> = both
        .iter()
        .map(|(n, r, s)| ((*n).to_owned(), relative_difference(r.hit_rate, s.hit_rate)))
        .collect();
    let within =
        !differences.is_empty() && differences.values().all(|d| d.abs() <= HIT_RATE_TOLERANCE);
    let (by_ttft, by_hit) = (orders(Figure::TtftP90), orders(Figure::HitRate));
    let counts = (failing && !both.is_empty())
        .then(|| both.iter().all(|(_, r, s)| failure_counts_agree(r, s)));
    Verdict {
        target_met: within && by_ttft.same && by_hit.same && counts != Some(false),
        failure_counts_agree: counts,
        hit_rate_relative_difference: differences,
        hit_rates_within_tolerance: within,
        order_by_ttft_p90: by_ttft,
        order_by_hit_rate: by_hit,
    }
}

impl TwinArgs {
    /// `--requests` or its default for the engine.
    pub fn requests(&self) -> usize {
        self.requests.unwrap_or(match self.engine {
            Engine::Sim => 1000,
            Engine::Vllm => 100,
        })
    }

    /// `--workers` or its default for the engine.
    pub fn workers(&self) -> usize {
        self.workers.unwrap_or(match self.engine {
            Engine::Sim => 4,
            Engine::Vllm => 2,
        })
    }

    /// `--block-size` or its default for the engine.
    pub fn block_size(&self) -> usize {
        self.block_size.unwrap_or(match self.engine {
            Engine::Sim => 64,
            Engine::Vllm => vllm::BLOCK_SIZE,
        })
    }

    /// `--num-blocks` or its default for the engine.
    pub fn num_blocks(&self) -> usize {
        self.num_blocks.unwrap_or(match self.engine {
            Engine::Sim => 16_384,
            Engine::Vllm => vllm::NUM_BLOCKS,
        })
    }

    /// `--max-prompt-tokens` or its default for the engine.
    pub fn max_prompt_tokens(&self) -> u32 {
        self.max_prompt_tokens.unwrap_or(match self.engine {
            Engine::Sim => 32_000,
            Engine::Vllm => vllm::MAX_PROMPT_TOKENS,
        })
    }

    /// `--rate-scale`, else [`DEFAULT_RATE_SCALE`] for the trace and 1
    /// for the agent workload (its sessions already arrive at the rate
    /// its parameters give).
    pub fn rate_scale(&self) -> f64 {
        self.rate_scale.unwrap_or(match self.workload {
            Some(LoadWorkload::Agentic) => 1.0,
            None => DEFAULT_RATE_SCALE,
        })
    }
}

/// The fleet both sides run: `replay`'s own configuration for these flags.
pub fn twin_fleet(args: &TwinArgs) -> anyhow::Result<FleetConfig> {
    #[derive(Parser)]
    struct Replay {
        #[command(flatten)]
        args: ReplayArgs,
    }
    let flags = replay_flags(args);
    let replay = Replay::try_parse_from(std::iter::once("replay".to_owned()).chain(flags))
        .context("building replay's arguments")?;
    let mut fleet = fleet_config(&replay.args)?;
    fleet.online_prefill_fit = !args.no_prefill_fit;
    fleet.disagg = replay
        .args
        .disagg
        .first()
        .map(|&(prefill, _)| disagg_config(&replay.args, prefill));
    if let Some(disagg) = &fleet.disagg {
        disagg
            .validate(fleet.workers)
            .map_err(|e| anyhow::anyhow!("--disagg: {e}"))?;
    }
    Ok(fleet)
}

/// The `switchyard replay` flags that give the twin's fleet.
fn replay_flags(args: &TwinArgs) -> Vec<String> {
    [
        ("--workers", args.workers().to_string()),
        ("--block-size", args.block_size().to_string()),
        ("--num-blocks", args.num_blocks().to_string()),
        ("--speedup", args.speedup.to_string()),
        ("--rate-scale", args.rate_scale().to_string()),
        ("--kv-event-delay-ms", args.kv_event_delay_ms.to_string()),
    ]
    .into_iter()
    .chain(
        args.engine_profile
            .iter()
            .map(|path| ("--engine-profile", path.display().to_string())),
    )
    .chain(
        args.fail_worker
            .iter()
            .map(|f| ("--fail-worker", format!("{}:{}", f.at_ms / 1e3, f.worker))),
    )
    .chain(args.disagg.into_iter().flat_map(|(p, d)| {
        [
            ("--disagg", format!("{p}:{d}")),
            ("--transfer-gbps", args.transfer_gbps.to_string()),
            (
                "--transfer-latency-ms",
                args.transfer_latency_ms.to_string(),
            ),
        ]
    }))
    .flat_map(|(k, v)| [k.to_owned(), v])
    .collect()
}

/// `switchyard sim-worker` flags that make a worker take part in the
/// simulator's disaggregation `disagg`: vLLM's protocol (each request says
/// which half it is, so prefill and decode workers get the same flags; the
/// router assigns the roles) over the same link — a transfer waits the
/// same latency plus bytes over bandwidth, in model ms divided by the
/// speed-up, on both sides — and leases held as long (the simulator's
/// virtual ms are the server's wall ms).
pub fn sim_worker_disagg_args(disagg: &DisaggConfig) -> anyhow::Result<Vec<String>> {
    let ttl = disagg.lease_ttl_ms;
    anyhow::ensure!(
        ttl.is_finite() && ttl >= 1.0 && ttl.fract() == 0.0,
        "the sim-worker holds leases for whole milliseconds, not {ttl}"
    );
    let flags = [
        ("--disagg", "vllm".to_owned()),
        (
            "--kv-transfer-bandwidth",
            disagg.transfer.bandwidth_bytes_per_s.to_string(),
        ),
        (
            "--kv-transfer-latency-ms",
            disagg.transfer.latency_ms.to_string(),
        ),
        ("--lease-ttl-ms", (ttl as u64).to_string()),
    ];
    Ok(flags
        .into_iter()
        .flat_map(|(k, v)| [k.to_owned(), v])
        .collect())
}

/// `switchyard serve` flags that give the router the simulator's prefill
/// estimator (the engines' timing model, and the online fit on or off): a
/// platform team configures its router with its engines' model the same
/// way.
pub fn estimator_args(estimator: &EstimatorConfig) -> Vec<String> {
    let [a, b, c] = estimator.prefill_curve;
    // `FLAG=VALUE`: a calibrated curve may open with a negative
    // coefficient, which as a separate argument would read as a flag.
    let mut args = vec![
        format!("--prefill-curve={a:e},{b:e},{c:e}"),
        format!("--prefill-speedup={}", estimator.speedup),
        format!("--prefill-chunk-tokens={}", estimator.chunk_tokens),
        format!(
            "--restore-ms-per-token={:e}",
            estimator.restore_ms_per_token
        ),
    ];
    if !estimator.online {
        args.push("--no-prefill-fit".to_owned());
    }
    args
}

/// `switchyard sim-worker` flags that give an engine configured as
/// `engine` (KV events on; endpoints are added by the caller), stepping on
/// `profile`'s timing when given: the engine flags' own inverse
/// (`EngineFlags::describing_profiled`), which refuses settings the
/// sim-worker has no flag for (timing polynomials outside a profile, ...).
pub fn sim_worker_args(
    engine: &EngineConfig,
    profile: Option<&ProfileArg>,
) -> anyhow::Result<Vec<String>> {
    anyhow::ensure!(
        engine.emit_kv_events,
        "the twin's engines publish KV events"
    );
    let flags = switchyard_sim_worker::EngineFlags::describing_profiled(engine, profile.cloned())
        .map_err(|why| anyhow::anyhow!("a sim-worker cannot run this engine: {why}"))?;
    Ok(flags.to_args())
}

/// `serve` flags that give the router the simulator's estimator: the
/// profile (for the decode step and its per-sequence cost, which no
/// other flag carries), then [`estimator_args`].
fn router_estimator_args(fleet: &FleetConfig, profile: Option<&std::path::Path>) -> Vec<String> {
    let mut args = Vec::new();
    if let Some(path) = profile {
        args.extend(["--engine-profile".to_owned(), path.display().to_string()]);
    }
    args.extend(estimator_args(&fleet.dispatcher(0).estimator));
    args
}

/// `--engine-profile` read, for the sim-workers' case.
fn sim_profile(args: &TwinArgs) -> anyhow::Result<Option<ProfileArg>> {
    args.engine_profile
        .as_deref()
        .map(|path| ProfileArg::read(&path.display().to_string()).map_err(anyhow::Error::msg))
        .transpose()
}

/// The slice both sides replay.
fn slice(args: &TwinArgs) -> TraceSlice {
    TraceSlice {
        requests: args.requests(),
        max_prompt_tokens: args.max_prompt_tokens(),
        max_output_tokens: args.max_output_tokens,
        rate_scale: args.rate_scale(),
    }
}

/// What both sides replay.
struct TwinLoad {
    /// The trace's name, or the built-in workload's.
    name: String,
    /// The sessions as the simulator takes them.
    sessions: Vec<Session>,
    /// The agent workload they were made from (`None`: a trace).
    agents: Option<(AgenticConfig, Arc<AgentVocabulary>)>,
}

fn load_sessions(args: &TwinArgs) -> anyhow::Result<TwinLoad> {
    if args.workload == Some(LoadWorkload::Agentic) {
        let (config, vocabulary) = agent_workload(args)?;
        let limits = WorkloadLimits {
            rate_scale: args.rate_scale(),
            max_output_tokens: args.max_output_tokens,
            ..WorkloadLimits::default()
        };
        let stream = workload::agentic(config.clone(), Arc::clone(&vocabulary));
        let sessions = workload::limited(stream, limits)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| anyhow::anyhow!("the agent workload: {e}"))?;
        let name = match &args.agentic_config {
            Some(path) => format!("agentic ({})", path.display()),
            None => "agentic".to_owned(),
        };
        return Ok(TwinLoad {
            name,
            sessions,
            agents: Some((config, vocabulary)),
        });
    }
    let trace = Trace::or_bundled(args.trace.as_deref());
    let sessions =
        mooncake_slice(trace.open()?, &slice(args)).map_err(|e| anyhow::anyhow!("{trace}: {e}"))?;
    anyhow::ensure!(!sessions.is_empty(), "{trace}: no servable requests");
    Ok(TwinLoad {
        name: trace.to_string(),
        sessions,
        agents: None,
    })
}

/// The agent workload's parameters for the twin: the seeded config with
/// every context capped at `--max-prompt-tokens`, and as many sessions
/// as `loadgen` takes whole for `--requests` calls.
fn agent_workload(args: &TwinArgs) -> anyhow::Result<(AgenticConfig, Arc<AgentVocabulary>)> {
    let mut config =
        switchyard_commands::agentic::config(args.agentic_config.as_deref(), args.seed)?;
    config.context_cap_tokens = config.context_cap_tokens.min(args.max_prompt_tokens());
    config
        .validate()
        .map_err(|e| anyhow::anyhow!("the agent workload with --max-prompt-tokens: {e}"))?;
    let vocabulary = switchyard_commands::agentic::vocabulary()?;
    config.sessions = loadgen::agent_sessions_taken(config.clone(), &vocabulary, args.requests());
    Ok((config, vocabulary))
}

/// The serve side's requests and pacing for what [`load_sessions`] gave:
/// a trace's at their arrival times, the agent workload's as sessions of
/// dependent calls.
fn serve_load(
    args: &TwinArgs,
    load: &TwinLoad,
) -> anyhow::Result<(Vec<loadgen::PreparedRequest>, Pacing)> {
    let sessions = &load.sessions;
    if let Some((config, vocabulary)) = &load.agents {
        let (requests, plan) = loadgen::agentic_requests(
            config.clone(),
            vocabulary,
            usize::MAX,
            args.max_output_tokens.unwrap_or(u32::MAX),
            args.rate_scale(),
            None,
        )?;
        anyhow::ensure!(
            plan.starts.len() == sessions.len(),
            "the agent workload gave {} sessions to serve and {} to replay",
            plan.starts.len(),
            sessions.len()
        );
        return Ok((requests, Pacing::Sessions(Arc::new(plan))));
    }
    let (requests, arrivals) = loadgen::session_requests(sessions, None)?;
    Ok((requests, Pacing::Arrivals(arrivals.into())))
}

fn check(args: &TwinArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.requests() > 0, "--requests must be at least 1");
    anyhow::ensure!(args.workers() > 0, "--workers must be at least 1");
    anyhow::ensure!(args.rounds > 0, "--rounds must be at least 1");
    anyhow::ensure!(args.replay_seeds > 0, "--replay-seeds must be at least 1");
    if args.engine == Engine::Sim {
        anyhow::ensure!(args.loads.is_empty(), "--loads goes with --engine vllm");
    }
    anyhow::ensure!(
        args.speedup.is_finite() && args.speedup > 0.0,
        "--speedup must be positive (the simulator needs durations)"
    );
    anyhow::ensure!(
        args.rate_scale().is_finite() && args.rate_scale() > 0.0,
        "--rate-scale must be positive"
    );
    anyhow::ensure!(!args.policies.is_empty(), "--policies names none");
    if let Some((p, d)) = args.disagg {
        anyhow::ensure!(
            p + d == args.workers(),
            "--disagg {p}:{d} splits {} workers but --workers is {}: give --workers {}",
            p + d,
            args.workers(),
            p + d
        );
    }
    for (i, p) in args.policies.iter().enumerate() {
        anyhow::ensure!(
            !args.policies[..i].contains(p),
            "--policies names {p} twice"
        );
    }
    if let Some(f) = &args.fail_worker {
        anyhow::ensure!(
            args.engine == Engine::Sim && args.disagg.is_none(),
            "--fail-worker goes with the sim-workers' aggregated case"
        );
        anyhow::ensure!(
            f.worker < args.workers(),
            "--fail-worker names worker {} of {} (0..{})",
            f.worker,
            args.workers(),
            args.workers() - 1
        );
    }
    Ok(())
}

/// The simulator side of one policy.
fn replay_side(
    fleet: &FleetConfig,
    policy: PolicyKind,
    sessions: &[Session],
) -> anyhow::Result<Side> {
    let mut f = fleet.clone();
    f.router.policy = policy;
    let sessions = sessions.to_vec();
    let outcome = simulate(&f, Box::new(sessions.into_iter().map(Ok)), |_| {})
        .with_context(|| format!("simulating {policy}"))?;
    Ok(Side::of_replay(&outcome.report))
}

/// The simulator's side over `seeds` routing seeds (the fleet's, then the
/// next ones): the median run ([`median_rounds`]) and every seed's side
/// (empty for one seed).
fn seeded_replay_side(
    fleet: &FleetConfig,
    policy: PolicyKind,
    sessions: &[Session],
    seeds: usize,
) -> anyhow::Result<(Side, Vec<Side>)> {
    let runs = (0..seeds as u64)
        .map(|i| {
            let mut seeded = fleet.clone();
            seeded.router.seed = fleet.router.seed.wrapping_add(i);
            replay_side(&seeded, policy, sessions)
        })
        .collect::<anyhow::Result<Vec<Side>>>()?;
    let side = median_rounds(&runs).context("at least one seed")?;
    Ok((side, if runs.len() > 1 { runs } else { Vec::new() }))
}

/// Everything `bench twin` measured, as written to `--json`.
#[derive(Debug, Serialize)]
pub struct TwinReport {
    /// Per policy, both sides (DESIGN.md "Interfaces").
    pub policies: BTreeMap<String, Pair>,
    /// How the sides compare.
    pub verdict: Verdict,
    /// Per policy, how well the real-time run kept its clocks.
    pub serve_runs: BTreeMap<String, serve::ServeHealth>,
    /// The trace (or built-in workload) replayed.
    pub trace: String,
    /// Requests in the slice (every session's calls).
    pub requests: usize,
    /// Last arrival, seconds after the first (after scaling).
    pub arrival_span_s: f64,
    /// The fleet both sides ran.
    pub fleet: FleetConfig,
    /// The arguments.
    pub args: TwinArgs,
    /// Wall-clock seconds of the whole benchmark.
    pub wall_seconds: f64,
}

/// Runs `switchyard bench twin`.
pub fn run(args: TwinArgs) -> anyhow::Result<()> {
    check(&args)?;
    if args.engine == Engine::Vllm {
        return vllm::run(&args);
    }
    let started = Instant::now();
    let profile = sim_profile(&args)?;
    let fleet = twin_fleet(&args)?;
    let load = load_sessions(&args)?;
    let (trace, sessions) = (load.name.clone(), &load.sessions);
    let calls: usize = sessions.iter().map(|s| s.all_turns().len()).sum();
    let span_s = sessions.last().map_or(0.0, |s| s.arrival_ms) / 1e3;
    let case = match &fleet.disagg {
        Some(d) => format!(
            "disaggregated case, {}P:{}D (vLLM protocol on the serve side; link {} GB/s + {} ms; hit rate: the prefill workers')",
            d.prefill_workers,
            fleet.workers - d.prefill_workers,
            d.transfer.bandwidth_bytes_per_s / 1e9,
            d.transfer.latency_ms
        ),
        None => "aggregated case".to_owned(),
    };
    println!(
        "bench twin, {case}: {calls} requests in {} sessions of {} (prompts ≤ {} tokens), arrivals ×{} over {:.1} s; {} workers × {} blocks of {} tokens, speed-up {}",
        sessions.len(),
        trace,
        args.max_prompt_tokens(),
        args.rate_scale(),
        span_s,
        fleet.workers,
        fleet.engine.num_blocks,
        fleet.engine.block_size,
        fleet.engine.timing.speedup
    );
    println!(
        "  replay side: switchyard replay {} on the same slice{}",
        replay_flags(&args).join(" "),
        if fleet.online_prefill_fit {
            ", prefill hints fitted online as serve fits them"
        } else {
            ", prefill hints from the engines' model (--no-prefill-fit)"
        }
    );
    let mut pairs = BTreeMap::new();
    // The failure case's count depends on the routing's draws: the
    // simulator runs over `--replay-seeds` seeds and is its median run.
    let seeds = match args.fail_worker {
        Some(_) => args.replay_seeds,
        None => 1,
    };
    for &policy in &args.policies {
        let (side, runs) = seeded_replay_side(&fleet, policy, sessions, seeds)?;
        println!(
            "  replay {:<12} hit {:.3}  TTFT p50 {:.1} p90 {:.1} ms{}",
            policy.name(),
            side.hit_rate,
            side.ttft_p50_ms,
            side.ttft_p90_ms,
            transfers_note(&fleet, &side)
        );
        pairs.insert(
            policy.name().to_owned(),
            Pair {
                replay: side,
                replay_rounds: runs,
                ..Pair::default()
            },
        );
    }
    let mut health = BTreeMap::new();
    if !args.replay_only {
        let (requests, pacing) = serve_load(&args, &load)?;
        let mut worker_args = sim_worker_args(&fleet.engine, profile.as_ref())?;
        if let Some(disagg) = &fleet.disagg {
            worker_args.extend(sim_worker_disagg_args(disagg)?);
        }
        let setup = serve::ServeSetup {
            workers: fleet.workers,
            prefill_workers: fleet.disagg.as_ref().map(|d| d.prefill_workers),
            block_size: fleet.engine.block_size,
            worker_args,
            router_args: router_estimator_args(&fleet, profile.as_ref().map(|p| p.path.as_path())),
            requests,
            pacing,
            span_s,
            fail: args
                .fail_worker
                .map(|f| (std::time::Duration::from_secs_f64(f.at_ms / 1e3), f.worker)),
        };
        // The failure case's count depends on the instant's queues: it
        // runs `--rounds` times and compares the median run.
        let rounds = if args.fail_worker.is_some() {
            args.rounds
        } else {
            1
        };
        let mut runs: BTreeMap<String, Vec<Side>> = BTreeMap::new();
        for round in 1..=rounds {
            if rounds > 1 {
                println!("  serve round {round} of {rounds}");
            }
            serve::run_all(&setup, &args.policies, |policy, run| {
                let side = Side::of_serve(&run.report, run.transfers, run.moved);
                if let Some(why) = &run.report.hit_rate_unavailable {
                    eprintln!("  serve {}: no hit rate: {why}", policy.name());
                }
                println!(
                    "  serve  {:<12} hit {:.3}  TTFT p50 {:.1} p90 {:.1} ms{}  ({} errors; sim-workers gave up {:.2}% of their schedule; sends late by p99 {:.1} ms)",
                    policy.name(),
                    side.hit_rate,
                    side.ttft_p50_ms,
                    side.ttft_p90_ms,
                    transfers_note(&fleet, &side),
                    side.errors,
                    run.health.dropped_fraction * 100.0,
                    run.health.send_lag_p99_ms,
                );
                runs.entry(policy.name().to_owned()).or_default().push(side);
                health.insert(policy.name().to_owned(), run.health);
            })?;
        }
        for (name, sides) in runs {
            if let Some(pair) = pairs.get_mut(&name) {
                pair.serve = median_rounds(&sides);
                if sides.len() > 1 {
                    pair.serve_rounds = sides;
                }
            }
        }
    }
    let verdict = verdict(&pairs, args.fail_worker.is_some());
    if fleet.disagg.is_some() {
        println!("\n{case}: hit rates are the prefill workers'");
    }
    print_table(&pairs, &verdict);
    let report = TwinReport {
        policies: pairs,
        verdict,
        serve_runs: health,
        trace,
        requests: calls,
        arrival_span_s: span_s,
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

/// In the disaggregated case, a side's transfers for its progress line.
fn transfers_note(fleet: &FleetConfig, side: &Side) -> String {
    if fleet.disagg.is_none() {
        return String::new();
    }
    format!(
        "  {} transfers, {:.2} GB",
        side.transfers,
        side.transfer_bytes as f64 / 1e9
    )
}

fn print_table(pairs: &BTreeMap<String, Pair>, verdict: &Verdict) {
    println!(
        "\n{:<12} {:>11} {:>10} {:>9} {:>19} {:>19}",
        "policy", "hit replay", "hit serve", "hit diff", "TTFT p50 rep/serve", "TTFT p90 rep/serve"
    );
    for (name, p) in pairs {
        let r = &p.replay;
        match &p.serve {
            Some(s) => println!(
                "{:<12} {:>11.3} {:>10.3} {:>8.1}% {:>9.1}/{:<9.1} {:>9.1}/{:<9.1}",
                name,
                r.hit_rate,
                s.hit_rate,
                relative_difference(r.hit_rate, s.hit_rate) * 100.0,
                r.ttft_p50_ms,
                s.ttft_p50_ms,
                r.ttft_p90_ms,
                s.ttft_p90_ms
            ),
            None => println!(
                "{:<12} {:>11.3} {:>10} {:>9} {:>9.1}/{:<9} {:>9.1}/{:<9}",
                name, r.hit_rate, "-", "-", r.ttft_p50_ms, "-", r.ttft_p90_ms, "-"
            ),
        }
    }
    if verdict.hit_rate_relative_difference.is_empty() {
        return;
    }
    let line = |what: &str, o: &Orders| {
        println!(
            "order by {what}: replay {} | serve {} — {}",
            o.replay.join(" > "),
            o.serve.join(" > "),
            if o.same { "agree" } else { "DISAGREE" }
        );
    };
    line("TTFT p90 (best first)", &verdict.order_by_ttft_p90);
    line("hit rate (best first)", &verdict.order_by_hit_rate);
    if let Some(agree) = verdict.failure_counts_agree {
        for (name, p) in pairs {
            if let Some(s) = &p.serve {
                let r = &p.replay;
                println!(
                    "{name}: completed {}/{}, migrated {}/{} (retried {}/{}, resumed {}/{}), failed {}/{} (replay/serve)",
                    r.completed,
                    s.completed,
                    r.migrated(),
                    s.migrated(),
                    r.retried,
                    s.retried,
                    r.resumed,
                    s.resumed,
                    r.errors,
                    s.errors
                );
                for (runs, what) in [
                    (&p.replay_rounds, "replay's seeds"),
                    (&p.serve_rounds, "serve's runs"),
                ] {
                    if runs.is_empty() {
                        continue;
                    }
                    let each: Vec<String> = runs.iter().map(|s| s.migrated().to_string()).collect();
                    println!(
                        "  {what} migrated {} (the median run's counts above)",
                        each.join(", ")
                    );
                }
            }
        }
        println!(
            "failure case: completed, migrated and failed within {:.0}% (or {} requests) on every policy: {}",
            FAILURE_COUNT_TOLERANCE * 100.0,
            FAILURE_COUNT_SLACK,
            if agree { "agree" } else { "DISAGREE" }
        );
    }
    println!(
        "target (each hit rate within {:.0}%, no two policies in opposite orders; figures within {:.0}% a tie): {}",
        HIT_RATE_TOLERANCE * 100.0,
        ORDER_TIE * 100.0,
        if verdict.target_met { "met" } else { "not met" }
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_sim_worker::SimWorkerArgs;

    #[derive(Parser)]
    struct Twin {
        #[command(flatten)]
        args: TwinArgs,
    }

    fn args(flags: &[&str]) -> TwinArgs {
        Twin::try_parse_from(std::iter::once("twin").chain(flags.iter().copied()))
            .unwrap()
            .args
    }

    /// A profile of non-default timing, per-sequence cost included, in a
    /// file (its path).
    fn profile_file() -> String {
        let path = std::env::temp_dir().join(format!(
            "switchyard-twin-profile-{}.toml",
            std::process::id()
        ));
        std::fs::write(
            &path,
            "prefill = [2e-6, 0.03, 40.0]\ndecode = [-5.0, 20.0, 9.0]\ndecode_floor_ms = 2.0\ndecode_per_sequence_ms = 0.4\nblock_size = 16\nnum_blocks = 512\n",
        )
        .unwrap();
        path.display().to_string()
    }

    fn side(hit_rate: f64, ttft_p90_ms: f64) -> Side {
        Side {
            hit_rate,
            ttft_p90_ms,
            ..Side::default()
        }
    }

    #[test]
    fn several_failure_rounds_are_their_medians_with_the_median_runs_counts() {
        let run = |resumed, ttft_p90_ms, completed| Side {
            resumed,
            completed,
            ..side(0.2, ttft_p90_ms)
        };
        // Runs in the order run: migrated 84, 68, 98.
        let rounds = [
            run(84, 300.0, 1000),
            run(68, 100.0, 999),
            run(98, 200.0, 998),
        ];
        let one = median_rounds(&rounds).unwrap();
        assert_eq!(one.migrated(), 84, "the median run's migrated count");
        assert_eq!(one.completed, 1000, "and that run's other counts");
        assert_eq!(one.ttft_p90_ms, 200.0, "each figure its own median");
        // An even count takes the lower middle run; none, nothing.
        let two = median_rounds(&rounds[..2]).unwrap();
        assert_eq!(two.migrated(), 68);
        assert_eq!(median_rounds(&[]), None);
    }

    #[test]
    fn the_defaults_compare_four_policies_on_four_workers() {
        let a = args(&[]);
        assert_eq!(
            a.policies,
            vec![
                PolicyKind::Ttft,
                PolicyKind::Kv,
                PolicyKind::CacheAware,
                PolicyKind::RoundRobin
            ]
        );
        assert_eq!((a.requests(), a.workers()), (1000, 4));
        check(&a).unwrap();
        assert!(check(&args(&["--speedup", "0"])).is_err());
        assert!(check(&args(&["--rate-scale=-1"])).is_err());
        assert!(check(&args(&["--policies", "kv,round-robin,kv"])).is_err());
    }

    #[test]
    fn the_fleet_is_replays_own_for_the_same_flags() {
        let a = args(&["--workers", "3", "--speedup", "8", "--block-size", "16"]);
        let fleet = twin_fleet(&a).unwrap();
        assert_eq!(fleet.workers, 3);
        assert_eq!(fleet.engine.block_size, 16);
        assert_eq!(fleet.engine.timing.speedup, 8.0);
        assert_eq!(fleet.router.sequences.block_size, 16);
        assert_eq!(fleet.kv_event_delay_ms, 10.0);
        assert!(fleet.online_prefill_fit, "as serve, by default");
        assert!(
            !twin_fleet(&args(&["--no-prefill-fit"]))
                .unwrap()
                .online_prefill_fit
        );
    }

    /// One truth for the prefill estimator: the flags handed to the router
    /// parse back, through `serve`'s own options, into exactly the
    /// simulator's estimator settings.
    #[test]
    fn the_router_gets_the_simulators_prefill_estimator() {
        #[derive(Parser)]
        struct Serve {
            #[command(flatten)]
            args: switchyard_server::ServeArgs,
        }
        let profile = profile_file();
        for extra in [
            &[][..],
            &["--no-prefill-fit"][..],
            &["--engine-profile", &profile][..],
        ] {
            let a = args(extra);
            let profile = sim_profile(&a).unwrap();
            let fleet = twin_fleet(&a).unwrap();
            let expected = fleet.dispatcher(0).estimator;
            let flags = router_estimator_args(&fleet, profile.as_ref().map(|p| p.path.as_path()));
            let serve =
                Serve::try_parse_from(std::iter::once("serve".to_owned()).chain(flags)).unwrap();
            assert_eq!(serve.args.to_config().unwrap().estimator, expected);
        }
        // A calibrated curve can bend down (vLLM's CPU build gave
        // -1.3e-6·T² + 2.9e-2·T + 19.0): its flags parse all the same.
        let mut bent = twin_fleet(&args(&[])).unwrap().dispatcher(0).estimator;
        bent.prefill_curve = [-1.3061e-6, 2.879e-2, 19.027];
        let serve =
            Serve::try_parse_from(std::iter::once("serve".to_owned()).chain(estimator_args(&bent)))
                .unwrap();
        assert_eq!(serve.args.to_config().unwrap().estimator, bent);
    }

    /// One truth for the engine settings: the flags handed to each
    /// sim-worker parse back, through the sim-worker's own options, into
    /// exactly the simulator's engine configuration.
    #[test]
    fn sim_workers_get_the_simulators_engine_configuration() {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: SimWorkerArgs,
        }
        let profile = profile_file();
        for flags in [
            &[][..],
            &["--block-size", "16", "--num-blocks", "4096"][..],
            &["--engine-profile", &profile, "--num-blocks", "2048"][..],
        ] {
            let a = args(flags);
            let profile = sim_profile(&a).unwrap();
            let fleet = twin_fleet(&a).unwrap();
            let mut argv = vec!["sim-worker".to_owned()];
            argv.extend(sim_worker_args(&fleet.engine, profile.as_ref()).unwrap());
            argv.extend(["--kv-events".to_owned(), "tcp://127.0.0.1:*".to_owned()]);
            let parsed = Cli::try_parse_from(argv).unwrap().args;
            assert_eq!(parsed.engine_config(), fleet.engine);
        }
    }

    /// The router the server builds from its defaults chooses as the
    /// simulator's does: same policy settings, seed and busy threshold.
    #[test]
    fn the_server_and_the_simulator_route_with_the_same_settings() {
        let fleet = twin_fleet(&args(&[])).unwrap();
        let server = switchyard_server::ServerConfig::default();
        assert_eq!(server.policies, fleet.router.policies);
        assert_eq!(server.seed, fleet.router.seed);
        assert_eq!(server.busy_threshold, fleet.router.busy_threshold);
        assert_eq!(server.queue, fleet.admission);
    }

    #[test]
    fn a_custom_timing_polynomial_is_refused_rather_than_silently_dropped() {
        let mut engine = twin_fleet(&args(&[])).unwrap().engine;
        engine.timing.decode = [0.0, 0.0, 2.0];
        assert!(sim_worker_args(&engine, None).is_err());
    }

    #[test]
    fn a_split_must_add_up_to_the_workers() {
        check(&args(&["--disagg", "2:2"])).unwrap();
        check(&args(&["--disagg", "1:2", "--workers", "3"])).unwrap();
        let why = check(&args(&["--disagg", "1:2"])).unwrap_err().to_string();
        assert!(why.contains("--workers 3"), "{why}");
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: TwinArgs,
        }
        for bad in ["0:4", "4", "2:x"] {
            assert!(
                Cli::try_parse_from(["twin", "--disagg", bad]).is_err(),
                "{bad}"
            );
        }
    }

    /// One truth for the split: the twin's simulator side runs exactly the
    /// `DisaggConfig` that `replay --disagg P:D` builds for the same flags,
    /// link included.
    #[test]
    fn the_disaggregated_fleet_is_replays_own_split() {
        #[derive(Parser)]
        struct Replay {
            #[command(flatten)]
            args: ReplayArgs,
        }
        let flags = [
            "--disagg",
            "3:1",
            "--transfer-gbps",
            "50",
            "--transfer-latency-ms",
            "2.5",
        ];
        let fleet = twin_fleet(&args(&flags)).unwrap();
        let replay = Replay::try_parse_from(
            ["replay", "--workers", "4"]
                .into_iter()
                .chain(flags.iter().copied()),
        )
        .unwrap();
        let expected = disagg_config(&replay.args, 3);
        assert_eq!(fleet.disagg, Some(expected));
        assert_eq!(expected.prefill_workers, 3);
        assert_eq!(expected.transfer.bandwidth_bytes_per_s, 50e9);
        assert_eq!(expected.transfer.latency_ms, 2.5);
        assert_eq!(fleet.workers, 4);
        // replay's defaults when no link is named; none without --disagg.
        let fleet = twin_fleet(&args(&["--disagg", "2:2"])).unwrap();
        let disagg = fleet.disagg.unwrap();
        assert_eq!(disagg.transfer, TransferConfig::default());
        assert_eq!(disagg.lease_ttl_ms, DisaggConfig::default().lease_ttl_ms);
        assert_eq!(twin_fleet(&args(&[])).unwrap().disagg, None);
    }

    /// The sim-workers' disaggregation flags parse back, through the
    /// sim-worker's own options, into vLLM's protocol with the simulator's
    /// link and lease lifetime, beside the unchanged engine configuration.
    #[test]
    fn sim_workers_get_the_simulators_disaggregation() {
        use switchyard_sim_worker::disagg::DisaggProtocol;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: SimWorkerArgs,
        }
        for flags in [
            &["--disagg", "2:2"][..],
            &[
                "--disagg",
                "1:3",
                "--transfer-gbps",
                "3.2",
                "--transfer-latency-ms",
                "0.25",
            ][..],
        ] {
            let fleet = twin_fleet(&args(flags)).unwrap();
            let disagg = fleet.disagg.unwrap();
            let mut argv = vec!["sim-worker".to_owned()];
            argv.extend(sim_worker_args(&fleet.engine, None).unwrap());
            argv.extend(sim_worker_disagg_args(&disagg).unwrap());
            argv.extend(["--kv-events".to_owned(), "tcp://127.0.0.1:*".to_owned()]);
            let parsed = Cli::try_parse_from(argv).unwrap().args;
            assert_eq!(parsed.engine_config(), fleet.engine);
            let worker = parsed.disagg.config().unwrap().expect("disaggregation on");
            assert_eq!(worker.protocol, DisaggProtocol::Vllm);
            assert_eq!(worker.role, None, "vLLM workers take the role per request");
            assert_eq!(
                worker.bandwidth_bytes_per_s,
                disagg.transfer.bandwidth_bytes_per_s
            );
            assert_eq!(worker.latency_ms, disagg.transfer.latency_ms);
            assert_eq!(worker.lease_ttl_ms as f64, disagg.lease_ttl_ms);
            for bytes in [0, 4096, 1 << 30] {
                assert_eq!(
                    worker.transfer_ms(bytes),
                    disagg.transfer.transfer_ms(bytes)
                );
            }
        }
    }

    #[test]
    fn a_lease_of_a_fraction_of_a_millisecond_is_refused_rather_than_rounded() {
        let disagg = DisaggConfig {
            lease_ttl_ms: 1500.5,
            ..DisaggConfig::default()
        };
        assert!(sim_worker_disagg_args(&disagg).is_err());
    }

    #[test]
    fn a_replay_only_disaggregated_run_transfers_every_prompt() {
        let a = args(&["--requests", "20", "--workers", "2", "--disagg", "1:1"]);
        check(&a).unwrap();
        let fleet = twin_fleet(&a).unwrap();
        let sessions = load_sessions(&a).unwrap().sessions;
        let s = replay_side(&fleet, PolicyKind::Kv, &sessions).unwrap();
        assert_eq!((s.completed, s.errors), (20, 0));
        assert!(s.transfers > 0 && s.transfer_bytes > 0, "{s:?}");
        assert!((0.0..=1.0).contains(&s.hit_rate));
        let aggregated = twin_fleet(&args(&["--requests", "20", "--workers", "2"])).unwrap();
        let s = replay_side(&aggregated, PolicyKind::Kv, &sessions).unwrap();
        assert_eq!((s.transfers, s.transfer_bytes), (0, 0));
    }

    #[test]
    fn policies_are_ordered_best_first_with_ties_by_name() {
        let sides = [
            ("round-robin", side(0.08, 900.0)),
            ("kv", side(0.19, 200.0)),
            ("cache-aware", side(0.27, 200.0)),
        ];
        assert_eq!(
            order_by(&sides, Figure::TtftP90),
            ["cache-aware", "kv", "round-robin"]
        );
        assert_eq!(
            order_by(&sides, Figure::HitRate),
            ["cache-aware", "kv", "round-robin"]
        );
    }

    #[test]
    fn the_target_needs_close_hit_rates_and_equal_orders() {
        let pair = |r: Side, s: Side| Pair {
            replay: r,
            serve: Some(s),
            ..Pair::default()
        };
        let mut pairs = BTreeMap::new();
        pairs.insert("kv".to_owned(), pair(side(0.20, 100.0), side(0.19, 150.0)));
        pairs.insert(
            "round-robin".to_owned(),
            pair(side(0.10, 500.0), side(0.105, 700.0)),
        );
        let v = verdict(&pairs, false);
        assert!(v.target_met, "{v:?}");
        assert!((v.hit_rate_relative_difference["kv"] + 0.05).abs() < 1e-12);
        // 15% lower on one policy misses the target though orders agree.
        pairs.insert("kv".to_owned(), pair(side(0.20, 100.0), side(0.17, 150.0)));
        let v = verdict(&pairs, false);
        assert!(!v.hit_rates_within_tolerance && v.order_by_ttft_p90.same);
        assert!(!v.target_met);
        // Swapped TTFT order misses it too.
        pairs.insert("kv".to_owned(), pair(side(0.20, 100.0), side(0.20, 800.0)));
        let v = verdict(&pairs, false);
        assert!(v.hit_rates_within_tolerance && !v.order_by_ttft_p90.same);
        assert!(!v.target_met);
        // A tie on one side (within 2%) agrees with either order on the
        // other; beyond it, an opposite order does not.
        pairs.insert("kv".to_owned(), pair(side(0.20, 100.0), side(0.20, 150.0)));
        pairs.insert(
            "cache-aware".to_owned(),
            pair(side(0.10, 500.0), side(0.105, 140.0)),
        );
        pairs.insert(
            "round-robin".to_owned(),
            pair(side(0.10, 500.0), side(0.105, 700.0)),
        );
        let v = verdict(&pairs, false);
        assert!(
            !v.order_by_ttft_p90.same,
            "cache-aware beats kv only on serve"
        );
        pairs.insert(
            "cache-aware".to_owned(),
            pair(side(0.10, 100.0), side(0.105, 140.0)),
        );
        let v = verdict(&pairs, false);
        assert!(
            v.order_by_ttft_p90.same && v.order_by_hit_rate.same,
            "{v:?}"
        );
        assert!(v.target_met, "{v:?}");
        assert_eq!(
            v.order_by_ttft_p90.replay,
            ["cache-aware", "kv", "round-robin"],
            "the written order breaks the tie by name"
        );
        // Replay only: nothing to compare, no claim.
        let mut replay_only = BTreeMap::new();
        replay_only.insert("kv".to_owned(), Pair::default());
        assert!(!verdict(&replay_only, false).target_met);
    }

    #[test]
    fn the_failure_case_compares_completed_migrated_and_failed_counts() {
        assert!(counts_agree(100, 104) && counts_agree(104, 100));
        assert!(!counts_agree(100, 106));
        assert!(counts_agree(1, 3), "a gap of two requests is noise");
        assert!(!counts_agree(1, 4));
        let counted = |completed, resumed, errors| Side {
            completed,
            retried: 2,
            resumed,
            errors,
            ..side(0.2, 100.0)
        };
        let mut pairs = BTreeMap::new();
        pairs.insert(
            "kv".to_owned(),
            Pair {
                replay: counted(290, 40, 10),
                serve: Some(counted(292, 41, 8)),
                ..Pair::default()
            },
        );
        let v = verdict(&pairs, true);
        assert_eq!(v.failure_counts_agree, Some(true));
        assert!(v.target_met, "{v:?}");
        assert_eq!(verdict(&pairs, false).failure_counts_agree, None);
        pairs.get_mut("kv").unwrap().serve = Some(counted(290, 20, 10));
        let v = verdict(&pairs, true);
        assert_eq!(v.failure_counts_agree, Some(false));
        assert!(!v.target_met, "half the migrations is a miss");
    }

    #[test]
    fn a_twin_failure_is_for_good_and_reaches_the_replay_side() {
        assert!(parse_twin_failure("20:1").is_ok());
        assert!(parse_twin_failure("20:1:5")
            .unwrap_err()
            .contains("for good"));
        let a = args(&["--fail-worker", "12.5:1", "--workers", "3"]);
        let fleet = twin_fleet(&a).unwrap();
        assert_eq!(
            fleet.failures,
            [WorkerFailure {
                at_ms: 12_500.0,
                worker: 1,
                down_ms: None
            }]
        );
        assert!(check(&args(&["--fail-worker", "1:3", "--workers", "3"])).is_err());
        assert!(check(&args(&["--fail-worker", "1:0", "--engine", "vllm"])).is_err());
    }

    #[test]
    fn the_agent_workload_serves_the_calls_it_simulates_within_the_prompt_cap() {
        let a = args(&[
            "--workload",
            "agentic",
            "--requests",
            "60",
            "--max-prompt-tokens",
            "20000",
        ]);
        check(&a).unwrap();
        assert_eq!(a.rate_scale(), 1.0, "the workload's own arrival rate");
        let load = load_sessions(&a).unwrap();
        let (name, sessions) = (load.name.as_str(), &load.sessions);
        assert_eq!(name, "agentic");
        let turns: Vec<_> = sessions.iter().flat_map(|s| s.all_turns()).collect();
        assert!(
            turns.len() >= 60,
            "whole sessions until --requests: {}",
            turns.len()
        );
        assert!(turns
            .iter()
            .all(|t| t.prompt.len() + t.output_tokens <= 20000));
        let (requests, pacing) = serve_load(&a, &load).unwrap();
        assert_eq!(requests.len(), turns.len(), "one call per simulated turn");
        let Pacing::Sessions(plan) = pacing else {
            panic!("agent calls are paced as sessions");
        };
        assert_eq!(plan.starts.len(), sessions.len());
        for (&(_, at), session) in plan.starts.iter().zip(sessions) {
            assert_eq!(at, session.arrival_ms);
        }
        // The trace keeps its own pacing and rate.
        assert_eq!(args(&[]).rate_scale(), DEFAULT_RATE_SCALE);
        assert!(
            Twin::try_parse_from(["twin", "--workload", "agentic", "--trace", "t.jsonl"]).is_err()
        );
    }

    #[test]
    fn the_failure_cases_simulator_side_is_its_median_seed() {
        let a = args(&[
            "--requests",
            "200",
            "--workers",
            "3",
            "--fail-worker",
            "3:1",
        ]);
        assert_eq!(a.replay_seeds, 9, "nine seeds unless told");
        assert!(check(&args(&["--fail-worker", "3:1", "--replay-seeds", "0"])).is_err());
        let fleet = twin_fleet(&a).unwrap();
        let sessions = load_sessions(&a).unwrap().sessions;
        let policy = PolicyKind::Ttft;
        // One seed: the simulator as it always ran, no runs listed.
        let (one, none) = seeded_replay_side(&fleet, policy, &sessions, 1).unwrap();
        assert_eq!(one, replay_side(&fleet, policy, &sessions).unwrap());
        assert!(none.is_empty());
        // Five seeds: each the fleet's seed plus its index, and the side
        // the run whose migrated count is the median.
        let (median, runs) = seeded_replay_side(&fleet, policy, &sessions, 5).unwrap();
        assert_eq!(runs.len(), 5);
        for (i, run) in runs.iter().enumerate() {
            let mut seeded = fleet.clone();
            seeded.router.seed = fleet.router.seed + i as u64;
            assert_eq!(*run, replay_side(&seeded, policy, &sessions).unwrap());
        }
        let mut migrated: Vec<u64> = runs.iter().map(|r| r.migrated()).collect();
        migrated.sort_unstable();
        assert_eq!(median.migrated(), migrated[2]);
        assert_eq!(runs[0], one, "the first seed is the fleet's own");
    }

    #[test]
    fn a_replay_only_run_on_a_tiny_slice_simulates_every_policy() {
        let a = args(&["--requests", "20", "--workers", "2"]);
        let fleet = twin_fleet(&a).unwrap();
        let sessions = load_sessions(&a).unwrap().sessions;
        assert_eq!(sessions.len(), 20);
        for policy in a.policies {
            let s = replay_side(&fleet, policy, &sessions).unwrap();
            assert_eq!((s.completed, s.errors), (20, 0));
            assert!(s.ttft_p90_ms > 0.0);
        }
    }
}
