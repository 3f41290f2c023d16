//! `switchyard replay`: compare routing policies on a trace in the fleet
//! simulator.
//!
//! Every policy runs on an identical fleet with the same seed, one simulation
//! per policy, spread over the machine's cores. The output is a table on
//! stdout, a JSON file with every figure, and SVG plots.

pub mod plan;
mod plots;
pub mod replicas;
pub mod tune;

use crate::data::Trace;
use crate::tenants::TenantMix;
use anyhow::Context;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::Serialize;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
use std::time::Instant;
use switchyard_core::admission::{FlowPolicy, SessionAwareConfig};
use switchyard_core::hashing::{local_block_hashes, sequence_hashes, DEFAULT_SEED};
use switchyard_core::select::{PolicyKind, TtftConfig};
use switchyard_engine::SpecDecode;
use switchyard_sim::fleet::{
    simulate, DisaggConfig, DpConfig, DpRouting, FleetConfig, SimOutcome, TransferConfig,
    MAX_DP_SIZE,
};
use switchyard_sim::reference::References;
use switchyard_sim::report::PolicyReport;
use switchyard_sim::workload::{self, Session, SessionStream, SyntheticConfig, WorkloadLimits};
use switchyard_sim::workload::{read_sharegpt, AgentVocabulary, AgenticConfig, ShareGptOptions};
use switchyard_sim_worker::{ArchitectureChoice, EngineDefaults, EngineFlags};

/// Default arrival-rate multiplier for the traces and the synthetic
/// workload (the agent workload's is 1: its rate is its config's). For the
/// bundled trace: at 1× the default
/// fleet idles (TTFT p90 about 0.1 s for every policy); at 28× round-robin's
/// TTFT p90 passes 2 s while the fleet still keeps up, which is where the
/// choice of policy decides how the fleet holds up.
pub const DEFAULT_RATE_SCALE: f64 = 28.0;

/// Fleet profiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    /// 8 workers; engine blocks of 64 tokens, 16,384 device blocks each,
    /// speed-up 4, the DESIGN.md timing model.
    Default,
    /// The fleet of the best-known open-source replay of the conversation
    /// trace: 16 workers, blocks of 64 tokens, 16,384 device blocks each,
    /// speed-up 4.
    DynamoMocker,
}

/// Trace formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TraceFormat {
    /// Guess from the file name (`.csv` Azure, `sharegpt` in the name
    /// ShareGPT, otherwise Mooncake).
    Auto,
    /// Mooncake JSONL.
    Mooncake,
    /// Azure LLM inference 2023 CSV.
    Azure,
    /// ShareGPT multi-turn conversations (JSONL, optionally gzip), tokenized
    /// with the bundled Qwen3 tokenizer and chat template.
    Sharegpt,
    /// The built-in synthetic multi-turn generator (no file).
    Synthetic,
    /// The built-in agent workload generator (no file; its parameters
    /// from `--agentic-config`): sessions of tool calls and heavy-tailed
    /// tool outputs on shared per-kind prefixes, with sub-agents.
    Agentic,
}

/// What the routers know of hybrid workers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum HybridRouting {
    /// Credit a hybrid worker only up to its deepest SSM checkpoint.
    #[default]
    Aware,
    /// Credit its whole attention prefix (a router unaware of hybrids).
    AttentionOnly,
    /// Each policy twice, aware and attention-only.
    Both,
}

/// How the routers treat LoRA adapters (with `--adapters`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AdapterRouting {
    /// Prefer workers holding the request's adapter (the core's affinity).
    Affinity,
    /// Ignore adapters when choosing (loads still happen where it lands).
    Blind,
    /// Each policy twice: affinity, then blind (`+blind`).
    #[default]
    Both,
}

/// Flow control's fair share between tenants (with `--tenants`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fairness {
    /// Bands by strict priority, tenants by weight within a band.
    #[default]
    On,
    /// Every request first come, first served (the tenants only label
    /// the figures): the router before flow control.
    Off,
    /// Each policy twice: fair, then first come, first served (`+fifo`).
    Both,
}

/// What the routers see of data-parallel ranks (with `--dp-size` > 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum DpRoutingChoice {
    /// Every (worker, rank) is a target; the router names the rank.
    Aware,
    /// One target per worker; the worker's own balancer picks the rank
    /// (a router that does not know the ranks).
    Blind,
    /// Each policy twice: rank-aware (`+dp-aware`), then rank-blind
    /// (`+dp-blind`).
    Both,
}

fn is_one(n: &usize) -> bool {
    *n == 1
}

/// Admission strategies to run each policy with.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum AdmissionChoice {
    /// The policy queue alone.
    None,
    /// Session-aware admission (sessions of multi-turn workloads).
    SessionAware,
    /// Each policy twice, without and with session-aware admission.
    Both,
}

/// `switchyard replay` arguments. `--model` is replay's own name for
/// `--architecture`, kept as an alias here: the shared engine flags cannot
/// hold it, as a sim-worker's `--model` is its served model's name.
#[derive(Clone, Debug, clap::Args, Serialize)]
#[command(mut_arg("architecture", |arg| arg.visible_alias("model")))]
pub struct ReplayArgs {
    /// Trace file (default: the bundled Mooncake conversation trace).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Trace format, or a built-in workload (`synthetic`, `agentic`).
    #[arg(long, visible_alias = "workload", value_enum, default_value_t = TraceFormat::Auto)]
    pub format: TraceFormat,
    /// With `--workload agentic`: its parameters (TOML; every field
    /// optional, see `switchyard::agentic`) [default: the documented
    /// defaults]. `--seed` seeds it, `--max-requests` counts its sessions.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub agentic_config: Option<PathBuf>,
    /// Fleet profile; the flags below override its parts.
    #[arg(long, value_enum, default_value_t = Profile::Default)]
    pub profile: Profile,
    /// Workers in the fleet.
    #[arg(long)]
    pub workers: Option<usize>,
    /// Arrival-rate multiplier (2 = twice as fast as the trace) [default:
    /// 28 (`DEFAULT_RATE_SCALE`), 1 for the agent workload].
    #[arg(long)]
    pub rate_scale: Option<f64>,
    /// Stop after this many sessions (requests, for single-turn traces).
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Stop at the first arrival after this many seconds (after scaling).
    #[arg(long)]
    pub duration: Option<f64>,
    /// Skip requests whose prompt is longer than this many tokens (their
    /// arrival gaps stay), as `loadgen --max-prompt-tokens` does [default:
    /// none skipped].
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_prompt_tokens: Option<u32>,
    /// Cap each request's output tokens, as `loadgen --max-output-tokens`
    /// does [default: the trace's]. With both caps, `replay` runs the very
    /// requests `loadgen` sends from the same trace.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_output_tokens: Option<u32>,
    /// Policies to compare (comma-separated; default: all).
    #[arg(long, value_delimiter = ',')]
    pub policies: Vec<PolicyKind>,
    /// `kv` policy: weight of prefill work against decode load.
    #[arg(long, default_value_t = 1.0)]
    pub overlap_weight: f64,
    /// `kv` policy: softmax temperature (0 = argmin).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// `ttft` policy: weight of the recompute a choice adds to the fleet
    /// (0 = greedy on the request's time to first token).
    #[arg(long, default_value_t = TtftConfig::default().locality_weight)]
    pub locality_weight: f64,
    /// `ttft` policy: weight of KV-memory pressure (0 = ignore how full a
    /// worker is).
    #[arg(long, default_value_t = TtftConfig::default().pressure_weight)]
    pub pressure_weight: f64,
    /// `ttft` policy: weight of cache turnover (0 = ignore how fast a
    /// worker's cache is being rewritten).
    #[arg(long, default_value_t = TtftConfig::default().turnover_weight)]
    pub turnover_weight: f64,
    /// `ttft` policy: decode steps of the request's output priced at the
    /// worker's pace (0 = ignore how fast a worker decodes).
    #[arg(long, default_value_t = TtftConfig::default().decode_weight)]
    pub decode_weight: f64,
    /// `ttft` policy: weight of the stall a request's prefill imposes on
    /// the requests decoding on the worker (0 = ignore).
    #[arg(long, default_value_t = TtftConfig::default().interference_weight)]
    pub interference_weight: f64,
    /// `ttft` policy: share of its cost another worker must save to take a
    /// request from the worker holding its longest cached prefix (0 = the
    /// cheapest always wins).
    #[arg(long, default_value_t = TtftConfig::default().stickiness)]
    pub stickiness: f64,
    /// A tenant mix (TOML `[[tenants]]`: name, weight, band, rate_scale,
    /// optional trace and slo_ttft_ms): each tenant replays its trace (or
    /// the run's) at its own rate, and the figures are reported per
    /// tenant. Flow control only orders requests the router holds back,
    /// so give the fleet a `--busy-threshold`.
    #[arg(long)]
    pub tenants: Option<PathBuf>,
    /// With `--tenants`: fair sharing on, off (first come, first served),
    /// or both.
    #[arg(long, value_enum, default_value_t = Fairness::On, requires = "tenants")]
    pub fairness: Fairness,
    /// The routers hold a request back while every worker is over this
    /// share of its batch budget (prompt tokens still to prefill) or of
    /// its KV blocks (decoding); none by default, so the engines queue.
    #[arg(long)]
    pub busy_threshold: Option<f64>,
    /// Admission strategy (`both` runs each policy without and with it).
    #[arg(long, value_enum, default_value_t = AdmissionChoice::None)]
    pub admission: AdmissionChoice,
    /// Delay from an engine's KV event to the router, in ms.
    #[arg(long, default_value_t = 10.0)]
    pub kv_event_delay_ms: f64,
    /// Fit each worker's prefill-duration hints online from observed times
    /// to first token, as `serve` does (the model itself is the engines'
    /// timing model either way).
    #[arg(long)]
    pub prefill_fit: bool,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// ShareGPT and synthetic workloads: new sessions per second (the
    /// agent workload's is its config's).
    #[arg(long, default_value_t = 2.0)]
    pub sessions_per_sec: f64,
    /// ShareGPT and synthetic workloads: think time between an answer and
    /// the next turn, ms (the agent workload draws its tool gaps).
    #[arg(long, default_value_t = 5000.0)]
    pub think_time_ms: f64,
    /// Simulations run at once (default: the machine's cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Directory for the JSON and the plots.
    #[arg(long, default_value = "replay-out")]
    pub out: PathBuf,
    /// JSON report path (default: OUT/replay.json).
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Skip the plots.
    #[arg(long)]
    pub no_plots: bool,
    /// Sweep `overlap_weight` and temperature for the `kv` policy instead of
    /// comparing policies.
    #[arg(long)]
    pub sweep: bool,
    /// Search the policies' settings on this trace for the lowest TTFT p90
    /// at ≥ 90% of the pooled-LRU hit rate, instead of comparing policies.
    #[arg(long)]
    pub tune: bool,
    /// With `--tune`: stop after the batch of simulations that crosses this
    /// many seconds.
    #[arg(long, default_value_t = tune::DEFAULT_BUDGET_SECS)]
    pub budget_secs: u64,
    /// With `--tune`: simulate at most this many candidates (fixes the
    /// result independently of the machine's speed).
    #[arg(long)]
    pub tune_trials: Option<usize>,
    /// With `--tune`: write the best settings as a `serve --config` file.
    #[arg(long)]
    pub write_config: Option<PathBuf>,
    /// Find the smallest fleet that meets --slo on this workload at its
    /// rate (the first of --policies, else the default policy), instead of
    /// comparing policies; writes plan.json and plan.svg.
    #[arg(long, requires = "slo", conflicts_with_all = ["tune", "sweep"])]
    pub plan: bool,
    /// With `--plan`: the targets, `ttft_p90=MS[,itl_p90=MS]`.
    #[arg(long, value_parser = plan::parse_slo)]
    pub slo: Option<plan::Slo>,
    /// With `--plan`: the largest fleet tried.
    #[arg(long, default_value_t = 64)]
    pub max_workers: usize,
    /// With `--plan`: plan again at these multiples of the rate
    /// (comma-separated, e.g. 1,2,4: today's traffic, twice it, four
    /// times); one table each, and the fleet needed against the rate in
    /// plan-rates.svg.
    #[arg(long, value_delimiter = ',', requires = "plan")]
    pub plan_rates: Vec<f64>,
    /// No progress output on stderr.
    #[arg(long)]
    pub quiet: bool,
    /// Router replica counts to compare (e.g. `1,2,4`): runs the replica-sync
    /// study instead of comparing policies (policy `kv` unless `--policies`).
    #[arg(long, value_delimiter = ',')]
    pub replicas: Vec<usize>,
    /// With `--replicas`: booking → visibility delay between replicas, ms
    /// (comma-separated for several). Default: the p99 of `bench replica`
    /// over local NATS (6.9 ms), rounded.
    #[arg(long, value_delimiter = ',', default_values_t = vec![switchyard_sim::replicas::DEFAULT_SYNC_DELAY_MS])]
    pub sync_delay_ms: Vec<f64>,
    /// With `--replicas`: run more than one replica with sync on, off, or both.
    #[arg(long, value_enum, default_value_t = replicas::SyncChoice::Both)]
    pub replica_sync: replicas::SyncChoice,
    /// With `--replicas`: how the load balancer spreads requests over replicas.
    #[arg(long, value_enum, default_value_t = replicas::BalanceChoice::RoundRobin)]
    pub replica_balance: replicas::BalanceChoice,
    /// Prefill/decode splits to compare with the aggregated fleet of the
    /// same size, as `P:D` (comma-separated for several, e.g. `4:4,2:6`):
    /// `P` workers prefill, `D` decode, KV moving between them over the
    /// transfer link. Every split must add up to the same fleet size
    /// (it replaces `--workers`).
    #[arg(long, value_delimiter = ',', value_parser = parse_split)]
    pub disagg: Vec<(usize, usize)>,
    /// Also run each policy on the aggregated fleet with peer prefix
    /// restore: the `ttft` policy may place a request on another worker
    /// together with a restore of its longest cached prefix from the
    /// worker holding it, over the transfer link (other policies ignore
    /// it).
    #[arg(long)]
    pub peer_restore: bool,
    /// A worker fails during the run, as `AT_S:WORKER[:DOWN_S]`: at `AT_S`
    /// simulated seconds worker `WORKER` (from 0) dies with everything it
    /// held, and comes back empty `DOWN_S` seconds later (never, without
    /// it). Repeat it for several. Its requests fail as `serve`'s do: the
    /// core retries, resumes or gives them up (counted per policy).
    #[arg(long = "fail-worker", value_name = "AT_S:WORKER[:DOWN_S]", value_parser = switchyard_sim::fleet::WorkerFailure::parse)]
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub fail_worker: Vec<switchyard_sim::fleet::WorkerFailure>,
    /// Every multi-turn session is a Responses API chain: each later turn
    /// continues its previous turn's stored response, so it may only go
    /// to the worker that answered it (as `serve` routes a
    /// `previous_response_id`); a turn whose response was lost with its
    /// worker ends in an error (counted).
    #[arg(long)]
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub responses_chain: bool,
    /// With `--fail-worker`: migrations allowed per request, as `serve`'s
    /// `--migration-limit` (0: a failed request ends in an error).
    #[arg(long, default_value_t = switchyard_core::dispatch::failure::MigrationPolicy::default().limit)]
    pub migration_limit: u32,
    /// With `--disagg` or `--peer-restore`: the transfer link's bandwidth in GB/s (default
    /// 25: one 200 Gb/s RDMA NIC's line rate, an assumption).
    #[arg(long, default_value_t = switchyard_sim::fleet::TransferConfig::default().bandwidth_bytes_per_s / 1e9)]
    pub transfer_gbps: f64,
    /// With `--disagg` or `--peer-restore`: the fixed cost of a transfer
    /// in ms (default 1, an assumption).
    #[arg(long, default_value_t = switchyard_sim::fleet::TransferConfig::default().latency_ms)]
    pub transfer_latency_ms: f64,
    /// With `--architecture hybrid`: what the routers know of hybrid workers
    /// (`both` replays each policy with either view).
    #[arg(long, value_enum, default_value_t = HybridRouting::Aware)]
    pub hybrid_routing: HybridRouting,
    /// LoRA adapters in the mix: each session asks for one of N adapters
    /// (0: base model only).
    #[arg(long, default_value_t = 0)]
    pub adapters: usize,
    /// With `--adapters`: Zipf exponent of adapter popularity (0: uniform).
    #[arg(long, default_value_t = 1.0)]
    pub adapter_skew: f64,
    /// With `--adapters`: adapter slots per engine (vLLM's `--max-loras`).
    #[arg(long, default_value_t = 4)]
    pub max_loras: usize,
    /// With `--adapters`: model milliseconds to load one adapter.
    #[arg(long, default_value_t = 200.0)]
    pub lora_load_ms: f64,
    /// With `--adapters`: adapter affinity, adapter-blind routing
    /// (`+blind`), or both.
    #[arg(long, value_enum, default_value_t = AdapterRouting::Both)]
    pub adapter_routing: AdapterRouting,
    /// Attention data-parallel ranks per worker, each its own engine (its
    /// own KV cache and scheduler) behind the worker (1: none).
    #[arg(long, default_value_t = 1)]
    #[serde(skip_serializing_if = "is_one")]
    pub dp_size: usize,
    /// With `--dp-size` > 1: rank-aware routing, rank-blind routing (the
    /// worker's own balancer picks the rank), or both (the default).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dp_routing: Option<DpRoutingChoice>,
    /// The engines' flags, as `sim-worker`'s (`--block-size`, `--speedup`,
    /// `--architecture`, ...); the ones the profile sizes default to it.
    /// Last, as its help heading holds for the flags after it.
    #[command(flatten)]
    #[serde(flatten)]
    pub engine: EngineFlags,
}

impl ReplayArgs {
    /// The arrival-rate multiplier: `--rate-scale`, else 1 for the agent
    /// workload and [`DEFAULT_RATE_SCALE`] for the others.
    pub fn rate_scale(&self) -> f64 {
        self.rate_scale.unwrap_or(match self.format {
            TraceFormat::Agentic => 1.0,
            _ => DEFAULT_RATE_SCALE,
        })
    }
}

/// Parses a `P:D` split.
pub fn parse_split(text: &str) -> Result<(usize, usize), String> {
    let (p, d) = text
        .split_once(':')
        .ok_or_else(|| format!("expected P:D (prefill:decode workers), got {text:?}"))?;
    let parse = |n: &str| {
        n.trim()
            .parse::<usize>()
            .map_err(|_| format!("expected P:D with whole numbers, got {text:?}"))
    };
    let (p, d) = (parse(p)?, parse(d)?);
    if p == 0 || d == 0 {
        return Err(format!(
            "a split needs at least one worker of each role, got {text:?}"
        ));
    }
    Ok((p, d))
}

/// The JSON report.
#[derive(Debug, Serialize)]
pub struct ReplayReport {
    /// The trace replayed.
    pub trace: String,
    /// Requests (turns) completed or failed, per policy they are the same.
    pub requests: u64,
    /// Hit rate with an infinite cache.
    pub bound_hit_rate: f64,
    /// Hit rate of one LRU cache of the fleet's total capacity.
    pub pooled_lru_hit_rate: f64,
    /// Wall-clock seconds of the whole run.
    pub wall_seconds: f64,
    /// The policy `serve` runs when none is named (its figures are under
    /// `policies` when it was replayed).
    pub default_policy: &'static str,
    /// Figures per policy.
    pub policies: BTreeMap<String, PolicyReport>,
    /// The engines' speculative decoding (`null`: off); also under
    /// `fleet.engine`.
    pub spec_decode: Option<SpecDecode>,
    /// The model the engines served (`attention` or `hybrid`).
    pub engine_kind: ArchitectureChoice,
    /// A hybrid model's checkpoint policy (`null` for attention only);
    /// also under `fleet.engine.hybrid`.
    pub checkpoints: Option<&'static str>,
    /// The fleet simulated.
    pub fleet: FleetConfig,
    /// The arguments.
    pub args: ReplayArgs,
}

/// Builds the fleet the arguments describe.
pub fn fleet_config(args: &ReplayArgs) -> anyhow::Result<FleetConfig> {
    let (workers, block_size, num_blocks, speedup) = match args.profile {
        Profile::Default => (8, 64, 16_384, 4.0),
        Profile::DynamoMocker => (16, 64, 16_384, 4.0),
    };
    let defaults = EngineDefaults {
        block_size,
        num_blocks,
        speedup,
        // Trace prompts reach 126k tokens; the pool is the real limit.
        max_model_len: 1 << 20,
    };
    let mut engine = args.engine.engine_config(defaults);
    // The router needs no events from a request it never sees cached.
    engine.emit_kv_events = true;
    anyhow::ensure!(
        engine.timing.speedup > 0.0,
        "--speedup must be positive in the simulator (virtual time needs durations)"
    );
    engine
        .validate()
        .map_err(|e| anyhow::anyhow!("engine: {e}"))?;
    let workers = match args.disagg.first() {
        Some(&(p, d)) => {
            anyhow::ensure!(
                args.disagg.iter().all(|&(p2, d2)| p2 + d2 == p + d),
                "every --disagg split must have the same number of workers"
            );
            anyhow::ensure!(
                args.workers.is_none_or(|w| w == p + d),
                "--workers {} does not match --disagg {p}:{d}",
                args.workers.unwrap_or_default()
            );
            p + d
        }
        None => args.workers.unwrap_or(workers),
    };
    let mut fleet = FleetConfig {
        workers,
        engine,
        kv_event_delay_ms: args.kv_event_delay_ms,
        online_prefill_fit: args.prefill_fit,
        ..FleetConfig::default()
    };
    anyhow::ensure!(fleet.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(
        args.rate_scale() > 0.0 && args.rate_scale().is_finite(),
        "--rate-scale must be positive"
    );
    fleet.router.seed = args.seed;
    fleet.router.policies.kv.overlap_weight = args.overlap_weight;
    fleet.router.policies.kv.temperature = args.temperature;
    fleet.router.policies.ttft.locality_weight = args.locality_weight;
    fleet.router.policies.ttft.pressure_weight = args.pressure_weight;
    fleet.router.policies.ttft.turnover_weight = args.turnover_weight;
    fleet.router.policies.ttft.decode_weight = args.decode_weight;
    fleet.router.policies.ttft.interference_weight = args.interference_weight;
    fleet.router.policies.ttft.stickiness = args.stickiness;
    fleet.router.sequences.block_size = fleet.engine.block_size as u32;
    fleet.router.busy_threshold = args.busy_threshold;
    fleet.failures = args.fail_worker.clone();
    fleet.responses_chain = args.responses_chain;
    fleet.migration.limit = args.migration_limit;
    if let Some(path) = &args.tenants {
        fleet.admission.flow = TenantMix::load(path)?.flow_config(true);
        fleet.tenant_window_ms = args.duration.map(|s| s * 1e3);
    }
    if args.adapters > 0 {
        let mix = switchyard_sim::adapters::AdapterMix {
            count: args.adapters,
            skew: args.adapter_skew,
            max_loras: args.max_loras,
            load_ms: args.lora_load_ms,
            seed: args.seed,
        };
        mix.validate()
            .map_err(|e| anyhow::anyhow!("--adapters: {e}"))?;
        fleet.adapters = Some(mix);
    }
    anyhow::ensure!(
        (1..=MAX_DP_SIZE).contains(&args.dp_size),
        "--dp-size must be 1..={MAX_DP_SIZE}, got {}",
        args.dp_size
    );
    if args.dp_size > 1 {
        anyhow::ensure!(
            args.disagg.is_empty() && !args.peer_restore,
            "--dp-size is not modelled with --disagg or --peer-restore"
        );
        fleet.dp = Some(DpConfig {
            size: args.dp_size,
            routing: match args.dp_routing {
                Some(DpRoutingChoice::Blind) => DpRouting::Blind,
                _ => DpRouting::Aware,
            },
        });
    } else {
        anyhow::ensure!(
            args.dp_routing.is_none(),
            "--dp-routing needs --dp-size greater than 1"
        );
    }
    fleet
        .router
        .validate()
        .map_err(|e| anyhow::anyhow!("router: {e}"))?;
    Ok(fleet)
}

/// The link KV moves over with `--disagg` and `--peer-restore`
/// (`--transfer-gbps`, `--transfer-latency-ms`).
pub fn transfer_link(args: &ReplayArgs) -> TransferConfig {
    TransferConfig {
        bandwidth_bytes_per_s: args.transfer_gbps * 1e9,
        latency_ms: args.transfer_latency_ms,
    }
}

/// A split of `--disagg` with `prefill_workers` prefill workers, as
/// `replay` runs it (`bench twin --disagg` runs the same).
pub fn disagg_config(args: &ReplayArgs, prefill_workers: usize) -> DisaggConfig {
    DisaggConfig {
        prefill_workers,
        transfer: transfer_link(args),
        ..DisaggConfig::default()
    }
}

/// The trace `args` replay; `None` for a built-in workload.
pub(crate) fn trace(args: &ReplayArgs) -> Option<Trace> {
    (!matches!(args.format, TraceFormat::Synthetic | TraceFormat::Agentic))
        .then(|| Trace::or_bundled(args.trace.as_deref()))
}

/// How figures and messages name the workload `args` replay.
pub(crate) fn workload_name(args: &ReplayArgs) -> String {
    match (args.format, trace(args)) {
        (TraceFormat::Agentic, _) => match &args.agentic_config {
            Some(path) => format!("agentic ({})", path.display()),
            None => "agentic".to_owned(),
        },
        (_, Some(trace)) => trace.to_string(),
        (_, None) => "synthetic".to_owned(),
    }
}

fn format_of(args: &ReplayArgs, trace: Option<&Trace>) -> TraceFormat {
    let name = trace.map(Trace::file_name).unwrap_or_default();
    match (args.format, trace) {
        (TraceFormat::Auto, Some(_)) if name.ends_with(".csv") => TraceFormat::Azure,
        (TraceFormat::Auto, Some(_)) if name.contains("sharegpt") => TraceFormat::Sharegpt,
        (TraceFormat::Auto, _) => TraceFormat::Mooncake,
        (f, _) => f,
    }
}

/// A workload each simulation can open: traces are re-read per
/// simulation (streaming, bounded memory); tokenized ShareGPT sessions are
/// built once and shared; agent sessions are generated afresh each time
/// from a config and a vocabulary made once.
#[derive(Clone)]
pub enum WorkloadSource {
    /// Re-read from the trace file each time.
    Streamed,
    /// Built once.
    Shared(Arc<Vec<Session>>),
    /// Generated each time.
    Agentic {
        /// The parameters, seeded.
        config: Box<AgenticConfig>,
        /// The bundled tokenizer's words and template.
        vocabulary: Arc<AgentVocabulary>,
    },
}

impl WorkloadSource {
    /// Prepares the workload of `args` (tokenizing ShareGPT once; the
    /// agent workload's config and vocabulary).
    pub fn prepare(args: &ReplayArgs) -> anyhow::Result<Self> {
        anyhow::ensure!(
            args.agentic_config.is_none() || args.format == TraceFormat::Agentic,
            "--agentic-config needs --workload agentic"
        );
        if args.format == TraceFormat::Agentic {
            let mut config = crate::agentic::config(args.agentic_config.as_deref(), args.seed)?;
            if let Some(sessions) = args.max_requests {
                config.sessions = sessions;
            }
            return Ok(Self::Agentic {
                config: Box::new(config),
                vocabulary: crate::agentic::vocabulary()?,
            });
        }
        let trace = trace(args);
        if format_of(args, trace.as_ref()) != TraceFormat::Sharegpt {
            return Ok(Self::Streamed);
        }
        let trace = trace.expect("ShareGPT is a file format");
        let input = trace.open()?;
        let tokenizer = switchyard_tokenizer::Tokenizer::bundled()
            .map_err(|e| anyhow::anyhow!("loading the bundled tokenizer: {e}"))?;
        let sessions = read_sharegpt(
            input,
            &tokenizer,
            ShareGptOptions {
                sessions_per_sec: args.sessions_per_sec,
                think_time_ms: args.think_time_ms,
                max_sessions: args.max_requests,
                seed: args.seed,
                ..ShareGptOptions::default()
            },
        )
        .map_err(|e| anyhow::anyhow!("{trace}: {e}"))?;
        Ok(Self::Shared(Arc::new(sessions)))
    }

    /// A fresh stream of the workload with the limits of `args` applied;
    /// with `--tenants`, every tenant's stream at its own rate, merged.
    pub fn open(&self, args: &ReplayArgs) -> anyhow::Result<SessionStream> {
        let Some(path) = &args.tenants else {
            return self.open_one(args);
        };
        let mix = TenantMix::load(path)?;
        let policy = FlowPolicy::new(mix.flow_config(true)).map_err(|e| anyhow::anyhow!("{e}"))?;
        let mut streams = Vec::with_capacity(mix.tenants.len());
        for (i, tenant) in mix.tenants.iter().enumerate() {
            let mut own = args.clone();
            own.tenants = None;
            own.rate_scale = Some(tenant.rate_scale);
            if tenant.trace.is_some() {
                own.trace = tenant.trace.clone();
            }
            let stream = self
                .open_one(&own)
                .with_context(|| format!("tenant {:?}'s workload", tenant.name))?;
            let flow = mix.session_flow(&policy, i);
            streams.push(workload::tenants::for_tenant(stream, flow, i as u64 + 1));
        }
        Ok(workload::tenants::merge(streams))
    }

    fn open_one(&self, args: &ReplayArgs) -> anyhow::Result<SessionStream> {
        match self {
            Self::Streamed => open_workload(args),
            Self::Shared(sessions) => {
                let sessions = Arc::clone(sessions);
                let stream: SessionStream =
                    Box::new((0..sessions.len()).map(move |i| Ok(sessions[i].clone())));
                Ok(workload::limited(stream, limits(args)))
            }
            Self::Agentic { config, vocabulary } => {
                let stream = workload::agentic((**config).clone(), Arc::clone(vocabulary));
                Ok(workload::limited(stream, limits(args)))
            }
        }
    }
}

fn limits(args: &ReplayArgs) -> WorkloadLimits {
    WorkloadLimits {
        rate_scale: args.rate_scale(),
        max_sessions: args.max_requests,
        duration_ms: args.duration.map(|s| s * 1000.0),
        max_prompt_tokens: args.max_prompt_tokens,
        max_output_tokens: args.max_output_tokens,
    }
}

/// Opens a streamed (file or synthetic) workload, with limits applied.
pub fn open_workload(args: &ReplayArgs) -> anyhow::Result<SessionStream> {
    let trace = trace(args);
    let open = || trace.as_ref().expect("a file format").open();
    let stream = match format_of(args, trace.as_ref()) {
        TraceFormat::Synthetic => workload::synthetic(SyntheticConfig {
            seed: args.seed,
            sessions_per_sec: args.sessions_per_sec,
            think_time_ms: args.think_time_ms,
            sessions: args
                .max_requests
                .unwrap_or(SyntheticConfig::default().sessions),
            ..SyntheticConfig::default()
        }),
        TraceFormat::Sharegpt | TraceFormat::Agentic => {
            anyhow::bail!("ShareGPT and agent workloads are prepared, not streamed")
        }
        TraceFormat::Azure => workload::azure(open()?, args.seed),
        TraceFormat::Mooncake | TraceFormat::Auto => {
            workload::mooncake(open()?, workload::MOONCAKE_MAX_SPREAD_MS)
        }
    };
    Ok(workload::limited(stream, limits(args)))
}

/// The references over the same workload: infinite cache and pooled LRU of
/// the fleet's capacity, at the engine's block size.
pub fn references(
    args: &ReplayArgs,
    source: &WorkloadSource,
    fleet: &FleetConfig,
) -> anyhow::Result<(u64, References)> {
    let block_size = fleet.engine.block_size;
    // Every engine's blocks: a worker's data-parallel ranks each hold a
    // pool.
    let engines = fleet.workers * fleet.dp.map_or(1, |dp| dp.size);
    let mut refs = References::new(block_size, engines * fleet.engine.num_blocks);
    let mut requests = 0;
    for session in source.open(args)? {
        let session = session.map_err(|e| match trace(args) {
            Some(trace) => anyhow::anyhow!("{trace}: {e}"),
            None => anyhow::anyhow!("{e}"),
        })?;
        // Spawned sessions' turns after the turn that spawns them.
        for turn in session.all_turns() {
            let tokens = turn.prompt.tokens();
            let seq = sequence_hashes(&local_block_hashes(&tokens, block_size, DEFAULT_SEED));
            refs.observe(tokens.len() as u64, &seq);
            requests += 1;
        }
    }
    Ok((requests, refs))
}

/// Runs one simulation per fleet configuration, `threads` at a time, with a
/// progress bar per simulation on stderr (`total`: requests per simulation,
/// when known).
pub fn run_all(
    args: &ReplayArgs,
    source: &WorkloadSource,
    fleets: Vec<(String, FleetConfig)>,
    total: Option<u64>,
) -> anyhow::Result<Vec<(String, SimOutcome)>> {
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let bars = MultiProgress::with_draw_target(if args.quiet {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    });
    let style =
        ProgressStyle::with_template("{prefix:>16} [{bar:40}] {pos}/{len} requests {elapsed}")
            .expect("a valid template")
            .progress_chars("=> ");
    // Popped from the back: reverse so simulations start in the given order.
    let mut jobs: Vec<_> = fleets
        .into_iter()
        .enumerate()
        .map(|(i, (name, fleet))| {
            let bar = bars.add(ProgressBar::new(total.unwrap_or(0)));
            bar.set_style(style.clone());
            bar.set_prefix(name.clone());
            (i, name, fleet, bar)
        })
        .collect();
    jobs.reverse();
    let queue = Mutex::new(jobs);
    let results = Mutex::new(Vec::new());
    std::thread::scope(|scope| -> anyhow::Result<()> {
        let mut handles = Vec::new();
        for _ in 0..threads {
            handles.push(scope.spawn(|| -> anyhow::Result<()> {
                loop {
                    let Some((i, name, fleet, bar)) = queue.lock().expect("not poisoned").pop()
                    else {
                        return Ok(());
                    };
                    let workload = source.open(args)?;
                    bar.reset_elapsed();
                    let outcome = simulate(&fleet, workload, |done| bar.set_position(done))
                        .with_context(|| format!("simulating {name}"))?;
                    bar.set_position(outcome.report.completed + outcome.report.errors);
                    bar.finish();
                    results
                        .lock()
                        .expect("not poisoned")
                        .push((i, name, outcome));
                }
            }));
        }
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("a simulation thread panicked"))??;
        }
        Ok(())
    })?;
    let mut results = results.into_inner().expect("not poisoned");
    results.sort_by_key(|(i, _, _)| *i);
    Ok(results.into_iter().map(|(_, n, o)| (n, o)).collect())
}

/// Runs `switchyard replay`.
pub fn run(mut args: ReplayArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    // The report echoes the rate replayed, chosen or defaulted.
    args.rate_scale = Some(args.rate_scale());
    let fleet = fleet_config(&args)?;
    let source = WorkloadSource::prepare(&args)?;
    if args.sweep {
        return sweep(&args, &source, &fleet);
    }
    if args.tune {
        return tune::run(&args, &source, &fleet);
    }
    if args.plan {
        return plan::run(&args, &source, &fleet);
    }
    if !args.replicas.is_empty() {
        return replicas::run(&args, &source, &fleet);
    }
    let policies = if args.policies.is_empty() {
        PolicyKind::ALL.to_vec()
    } else {
        args.policies.clone()
    };
    let trace = workload_name(&args);
    if !args.quiet {
        if let Some(dp) = fleet.dp {
            eprintln!("each worker holds {} data-parallel ranks", dp.size);
        }
        eprintln!(
            "replaying {trace} on {} workers ({} blocks of {} tokens each, speed-up {}), rate ×{}, policies: {}",
            fleet.workers,
            fleet.engine.num_blocks,
            fleet.engine.block_size,
            fleet.engine.timing.speedup,
            args.rate_scale(),
            policies.iter().map(|p| p.name()).collect::<Vec<_>>().join(", ")
        );
    }
    let (requests, refs) = references(&args, &source, &fleet)?;
    let mix = args.tenants.as_deref().map(TenantMix::load).transpose()?;
    let variants: &[bool] = match args.admission {
        AdmissionChoice::None => &[false],
        AdmissionChoice::SessionAware => &[true],
        AdmissionChoice::Both => &[false, true],
    };
    let fleets = policies
        .iter()
        .flat_map(|&p| {
            variants
                .iter()
                .map(move |&session_aware| (p, session_aware))
        })
        .map(|(p, session_aware)| {
            let mut f = fleet.clone();
            f.router.policy = p;
            let mut name = p.name().to_owned();
            if session_aware {
                f.session_aware = Some(SessionAwareConfig::default());
                name.push_str("+session");
            }
            (name, f)
        })
        .flat_map(|(name, f)| {
            // With a tenant mix: fair sharing, first come first served, or both.
            let fair: &[bool] = match (&mix, args.fairness) {
                (None, _) | (Some(_), Fairness::On) => &[true],
                (Some(_), Fairness::Off) => &[false],
                (Some(_), Fairness::Both) => &[true, false],
            };
            let mix = mix.clone();
            fair.iter().map(move |&fair| {
                let mut f = f.clone();
                let mut name = name.clone();
                if let Some(mix) = &mix {
                    f.admission.flow = mix.flow_config(fair);
                    if !fair {
                        name.push_str("+fifo");
                    }
                }
                (name, f)
            })
        })
        .flat_map(|(name, f)| {
            // A hybrid fleet routed by an attention-only view too, if asked.
            let views: &[bool] = match (args.engine.architecture, args.hybrid_routing) {
                (ArchitectureChoice::Hybrid, HybridRouting::AttentionOnly) => &[true],
                (ArchitectureChoice::Hybrid, HybridRouting::Both) => &[false, true],
                _ => &[false],
            };
            views.iter().map(move |&attention_only| {
                let mut f = f.clone();
                f.attention_only_routing = attention_only;
                let name = if attention_only {
                    format!("{name}+attn-only")
                } else {
                    name.clone()
                };
                (name, f)
            })
        })
        .flat_map(|(name, f)| {
            // With an adapter mix: adapter affinity, blind routing, or both.
            let blind: &[bool] = match (args.adapters, args.adapter_routing) {
                (0, _) | (_, AdapterRouting::Affinity) => &[false],
                (_, AdapterRouting::Blind) => &[true],
                (_, AdapterRouting::Both) => &[false, true],
            };
            blind.iter().map(move |&blind| {
                let mut f = f.clone();
                f.router.adapters.blind = blind;
                let name = if blind {
                    format!("{name}+blind")
                } else {
                    name.clone()
                };
                (name, f)
            })
        })
        .flat_map(|(name, f)| {
            // With data-parallel ranks: rank-aware routing, rank-blind, or
            // both.
            let routings: &[Option<DpRouting>] = match (f.dp, args.dp_routing) {
                (None, _) => &[None],
                (Some(_), Some(DpRoutingChoice::Aware)) => &[Some(DpRouting::Aware)],
                (Some(_), Some(DpRoutingChoice::Blind)) => &[Some(DpRouting::Blind)],
                (Some(_), Some(DpRoutingChoice::Both) | None) => {
                    &[Some(DpRouting::Aware), Some(DpRouting::Blind)]
                }
            };
            routings.iter().map(move |routing| {
                let mut f = f.clone();
                let name = match (f.dp.as_mut(), routing) {
                    (Some(dp), Some(routing)) => {
                        dp.routing = *routing;
                        format!("{name}+dp-{}", routing.name())
                    }
                    _ => name.clone(),
                };
                (name, f)
            })
        })
        .flat_map(|(name, f)| {
            // The aggregated fleet, with peer restore if asked, then each
            // split of the same workers.
            let link = transfer_link(&args);
            let peer = args.peer_restore.then(|| {
                let mut lending = f.clone();
                lending.peer_restore = Some(link);
                (format!("{name}+peer"), lending)
            });
            let splits = args.disagg.iter().map(|&(p, d)| {
                let mut split = f.clone();
                split.disagg = Some(disagg_config(&args, p));
                (format!("{name} {p}P:{d}D"), split)
            });
            std::iter::once((name.clone(), f.clone()))
                .chain(peer)
                .chain(splits)
                .collect::<Vec<_>>()
        })
        .collect();
    let outcomes = run_all(&args, &source, fleets, Some(requests))?;
    let report = ReplayReport {
        trace,
        requests,
        bound_hit_rate: refs.bound_hit_rate(),
        pooled_lru_hit_rate: refs.pooled_lru_hit_rate(),
        wall_seconds: started.elapsed().as_secs_f64(),
        default_policy: PolicyKind::DEFAULT.name(),
        policies: outcomes
            .iter()
            .map(|(n, o)| (n.clone(), o.report.clone()))
            .collect(),
        spec_decode: fleet.engine.spec_decode,
        engine_kind: args.engine.architecture,
        checkpoints: fleet.engine.hybrid.map(|h| h.checkpoints.as_str()),
        fleet,
        args: args.clone(),
    };
    print_table(&report, &outcomes);
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let json = args
        .json
        .clone()
        .unwrap_or_else(|| args.out.join("replay.json"));
    crate::stats::write_json(&json, &report)?;
    println!("wrote {}", json.display());
    if !args.no_plots {
        for path in plots::write_all(&args.out, &report, &outcomes)? {
            println!("wrote {}", path.display());
        }
    }
    Ok(())
}

fn print_table(report: &ReplayReport, outcomes: &[(String, SimOutcome)]) {
    println!(
        "{} requests; hit-rate references: infinite cache {:.3}, pooled LRU of the fleet's capacity {:.3}",
        report.requests, report.bound_hit_rate, report.pooled_lru_hit_rate
    );
    println!(
        "{:<16} {:>9} {:>9} {:>9} {:>8} {:>8} {:>9} {:>6} {:>6} {:>8} {:>8} {:>6} {:>7}",
        "policy",
        "ttft mean",
        "ttft p50",
        "ttft p90",
        "itl p50",
        "itl p90",
        "e2e p90",
        "hit",
        "pred",
        "req/s",
        "tok/s",
        "cv",
        "preempt"
    );
    for (name, o) in outcomes {
        let r = &o.report;
        println!(
            "{:<16} {:>9.1} {:>9.1} {:>9.1} {:>8.1} {:>8.1} {:>9.1} {:>6.3} {:>6.3} {:>8.2} {:>8.0} {:>6.3} {:>7}",
            name,
            r.ttft_ms.mean,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.itl_ms.p50,
            r.itl_ms.p90,
            r.e2e_ms.p90,
            r.hit_rate,
            r.predicted_hit_rate,
            r.throughput_rps,
            r.output_tokens_per_sec,
            r.load_cv,
            r.preemptions
        );
    }
    println!("(times in ms; hit = engine prefix hit rate; pred = router's predicted hit rate; cv = per-worker load imbalance)");
    for (name, o) in outcomes {
        let r = &o.report;
        if let Some(a) = &r.adapters {
            println!(
                "{name}: {} adapter loads, {} of {} adapter requests waited for one",
                a.loads, a.waited, a.requests
            );
        }
        if let Some(b) = &r.bursts {
            println!(
                "{name}: {} fan-out bursts, {:.1}% computed their shared prefix once, each shared token computed {:.2} times; quiet bursts: {} of {} once",
                b.bursts,
                b.once as f64 * 100.0 / b.bursts.max(1) as f64,
                b.computed_tokens as f64 / b.shared_tokens.max(1) as f64,
                b.quiet_once,
                b.quiet
            );
        }
        if let Some(dp) = &r.dp {
            let busiest = dp.requests_per_rank.iter().max().copied().unwrap_or(0);
            let idlest = dp.requests_per_rank.iter().min().copied().unwrap_or(0);
            println!(
                "{name}: {} ranks per worker; requests per rank {idlest}..{busiest}; a rank idle while another of its worker queued {:.1}% of the run",
                dp.size,
                dp.idle_while_queued_share * 100.0
            );
        }
        if r.responses_unknown > 0 {
            println!(
                "{name}: {} turns continued a response their worker had lost (errors)",
                r.responses_unknown
            );
        }
        if let Some(f) = &r.failures {
            println!(
                "{name}: worker failures: {} attempts failed; {} requests retried, {} streams resumed, {} given up{}",
                f.failed_attempts,
                f.retried,
                f.resumed,
                f.gave_up,
                if f.gave_up_by_reason.is_empty() {
                    String::new()
                } else {
                    let why: Vec<String> = f
                        .gave_up_by_reason
                        .iter()
                        .map(|(label, n)| format!("{label} {n}"))
                        .collect();
                    format!(" ({})", why.join(", "))
                }
            );
        }
        if r.transfers + r.transfer_fallbacks > 0 {
            println!(
                "{name}: {} KV transfers, {:.2} GB moved, {} decode halves computed their prompt instead",
                r.transfers,
                r.transfer_bytes as f64 / 1e9,
                r.transfer_fallbacks
            );
        }
    }
    if outcomes.iter().any(|(_, o)| !o.report.tenants.is_empty()) {
        println!(
            "{:<24} {:<12} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>12} {:>12}",
            "policy",
            "tenant",
            "ttft p50",
            "ttft p90",
            "wait p50",
            "wait p90",
            "completed",
            "shed",
            "tokens",
            "in window"
        );
        for (name, o) in outcomes {
            for (tenant, t) in &o.report.tenants {
                println!(
                    "{:<24} {:<12} {:>9.1} {:>9.1} {:>9.1} {:>9.1} {:>9} {:>6} {:>12} {:>12}",
                    name,
                    tenant,
                    t.ttft_p50_ms,
                    t.ttft_p90_ms,
                    t.wait_p50_ms,
                    t.wait_p90_ms,
                    t.completed,
                    t.shed,
                    t.tokens_served,
                    t.tokens_served_in_window
                        .map_or_else(|| "-".to_owned(), |n| n.to_string())
                );
            }
        }
    }
    println!("wall: {:.1} s", report.wall_seconds);
}

/// `--sweep`: the `kv` policy over a grid of overlap weights and
/// temperatures; reports the best TTFT p90.
fn sweep(args: &ReplayArgs, source: &WorkloadSource, fleet: &FleetConfig) -> anyhow::Result<()> {
    let mut fleets = Vec::new();
    for w in [0.5, 1.0, 2.0, 4.0, 8.0, 16.0] {
        for t in [0.0, 0.05] {
            let mut f = fleet.clone();
            f.router.policy = PolicyKind::Kv;
            f.router.policies.kv.overlap_weight = w;
            f.router.policies.kv.temperature = t;
            fleets.push((format!("kv w={w} T={t}"), f));
        }
    }
    let outcomes = run_all(args, source, fleets, None)?;
    println!(
        "{:<16} {:>9} {:>9} {:>6}",
        "setting", "ttft p50", "ttft p90", "hit"
    );
    for (name, o) in &outcomes {
        println!(
            "{:<16} {:>9.1} {:>9.1} {:>6.3}",
            name, o.report.ttft_ms.p50, o.report.ttft_ms.p90, o.report.hit_rate
        );
    }
    if let Some((name, o)) = outcomes
        .iter()
        .min_by(|a, b| a.1.report.ttft_ms.p90.total_cmp(&b.1.report.ttft_ms.p90))
    {
        println!("best: {name} (TTFT p90 {:.1} ms)", o.report.ttft_ms.p90);
    }
    if let Some(json) = &args.json {
        let map: BTreeMap<&str, &PolicyReport> = outcomes
            .iter()
            .map(|(n, o)| (n.as_str(), &o.report))
            .collect();
        crate::stats::write_json(json, &map)?;
        println!("wrote {}", json.display());
    }
    Ok(())
}

/// `replay`'s flags parsed from a command line, for tests.
#[cfg(test)]
pub(crate) fn parse_args(argv: &[&str]) -> ReplayArgs {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: ReplayArgs,
    }
    Cli::parse_from(std::iter::once("replay").chain(argv.iter().copied())).args
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_engine::{CheckpointPolicy, EngineConfig, Preemption, TimingConfig};

    #[test]
    fn with_loadgens_caps_replay_runs_the_very_requests_loadgen_sends() {
        use switchyard_sim::workload::{mooncake_slice, TraceSlice};
        let args = parse_args(&[
            "--rate-scale",
            "28",
            "--max-requests",
            "300",
            "--max-prompt-tokens",
            "8000",
            "--max-output-tokens",
            "64",
        ]);
        let replayed: Vec<_> = open_workload(&args)
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        let trace = Trace::or_bundled(None);
        let sent = mooncake_slice(
            trace.open().unwrap(),
            &TraceSlice {
                requests: 300,
                max_prompt_tokens: 8000,
                max_output_tokens: Some(64),
                rate_scale: 28.0,
            },
        )
        .unwrap();
        assert_eq!(replayed.len(), 300);
        assert_eq!(replayed, sent);
        // The caps did something: the bundled trace has longer prompts and
        // outputs than these.
        assert!(replayed
            .iter()
            .all(|s| s.turns[0].prompt.len() <= 8000 && s.turns[0].output_tokens <= 64));
        let uncapped: Vec<_> = open_workload(&parse_args(&[
            "--rate-scale",
            "28",
            "--max-requests",
            "300",
        ]))
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
        assert!(uncapped.iter().any(|s| s.turns[0].prompt.len() > 8000));
        assert!(uncapped.iter().any(|s| s.turns[0].output_tokens > 64));
        // Unset, neither appears in replay.json's echo of the arguments.
        let json = serde_json::to_string(&parse_args(&[])).unwrap();
        assert!(
            !json.contains("max_prompt") && !json.contains("max_output"),
            "{json}"
        );
    }

    #[test]
    fn the_agent_workload_replays_the_generators_sessions_at_its_own_rate() {
        let argv = [
            "--workload",
            "agentic",
            "--max-requests",
            "3",
            "--seed",
            "5",
        ];
        let args = parse_args(&argv);
        assert_eq!(args.rate_scale(), 1.0);
        assert_eq!(workload_name(&args), "agentic");
        let source = WorkloadSource::prepare(&args).unwrap();
        let replayed: Vec<Session> = source
            .open(&args)
            .unwrap()
            .collect::<Result<_, _>>()
            .unwrap();
        // `--seed` seeds it and `--max-requests` counts its sessions.
        let mut config = crate::agentic::config(None, 5).unwrap();
        config.sessions = 3;
        let vocabulary = crate::agentic::vocabulary().unwrap();
        let generated: Vec<Session> = workload::agentic(config, vocabulary)
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(replayed, generated);
        // `--rate-scale` scales its arrivals as any workload's.
        let faster = parse_args(&[&argv[..], &["--rate-scale", "2"]].concat());
        let first = source.open(&faster).unwrap().next().unwrap().unwrap();
        assert_eq!(first.arrival_ms, generated[0].arrival_ms / 2.0);
        // The references count every call, sub-agents' included.
        let fleet = fleet_config(&args).unwrap();
        let (requests, _) = references(&args, &source, &fleet).unwrap();
        let calls: usize = generated.iter().map(|s| s.all_turns().len()).sum();
        assert_eq!(requests as usize, calls);
        // A config file belongs to the agent workload.
        let stray = parse_args(&["--agentic-config", "agents.toml"]);
        assert!(WorkloadSource::prepare(&stray).is_err());
    }

    #[test]
    fn data_parallel_ranks_reach_the_fleet_only_when_asked_and_are_checked() {
        let fleet = fleet_config(&parse_args(&[])).unwrap();
        assert_eq!(fleet.dp, None);
        // Nothing about ranks in the default figures' echo of the fleet and
        // the arguments.
        let json = serde_json::to_string(&(fleet, parse_args(&[]))).unwrap();
        assert!(!json.contains("dp"), "{json}");
        let fleet = fleet_config(&parse_args(&["--dp-size", "4"])).unwrap();
        assert_eq!(
            fleet.dp,
            Some(DpConfig {
                size: 4,
                routing: DpRouting::Aware
            })
        );
        let err = |argv: &[&str]| fleet_config(&parse_args(argv)).unwrap_err().to_string();
        assert!(err(&["--dp-routing", "blind"]).contains("needs --dp-size"));
        assert!(err(&["--dp-size", "0"]).contains("--dp-size must be"));
        assert!(err(&["--dp-size", "2", "--peer-restore"]).contains("not modelled"));
    }

    #[test]
    fn the_engines_have_no_host_tier_unless_host_blocks_are_given() {
        let fleet = fleet_config(&parse_args(&[])).unwrap();
        assert_eq!(fleet.engine.host_blocks, 0);
        let fleet = fleet_config(&parse_args(&["--host-blocks", "4096"])).unwrap();
        assert_eq!(fleet.engine.host_blocks, 4096);
        // The router prices a restore as the engines take it.
        let estimator = fleet.dispatcher(0).estimator;
        assert_eq!(
            estimator.restore_ms_per_token,
            fleet.engine.timing.restore_ms_per_token()
        );
        let wall = estimator.restore_model_ms(1000) * fleet.engine.timing.speedup;
        assert!((wall - fleet.engine.timing.restore_ms(1000)).abs() < 1e-9);
    }

    #[test]
    fn an_adapter_mix_reaches_the_fleet_only_when_asked_and_is_checked() {
        assert_eq!(fleet_config(&parse_args(&[])).unwrap().adapters, None);
        let fleet = fleet_config(&parse_args(&[
            "--adapters",
            "8",
            "--adapter-skew",
            "0.5",
            "--max-loras",
            "2",
            "--lora-load-ms",
            "400",
        ]))
        .unwrap();
        let mix = fleet.adapters.expect("a mix");
        assert_eq!(
            (mix.count, mix.skew, mix.max_loras, mix.load_ms),
            (8, 0.5, 2, 400.0)
        );
        // The routers price a load in wall ms: model ms over the speed-up.
        assert_eq!(fleet.dispatcher(0).router.adapters.load_ms, 400.0 / 4.0);
        assert!(fleet_config(&parse_args(&["--adapters", "8", "--max-loras", "0"])).is_err());
        assert!(fleet_config(&parse_args(&["--adapters", "8", "--adapter-skew=-1"])).is_err());
    }

    #[test]
    fn spec_decode_reaches_the_engines_only_when_asked_and_is_checked() {
        let fleet = fleet_config(&parse_args(&[])).unwrap();
        assert_eq!(fleet.engine.spec_decode, None);
        let fleet = fleet_config(&parse_args(&["--spec-decode", "0.7"])).unwrap();
        assert_eq!(
            fleet.engine.spec_decode,
            Some(SpecDecode {
                draft_tokens: 3,
                acceptance_rate: 0.7
            })
        );
        let args = parse_args(&["--spec-decode", "0.5", "--spec-draft-tokens", "5"]);
        let fleet = fleet_config(&args).unwrap();
        assert_eq!(fleet.engine.spec_decode.map(|s| s.draft_tokens), Some(5));
        let json = serde_json::to_value(&args).unwrap();
        assert_eq!(json["spec_decode"], 0.5);
        assert!(fleet_config(&parse_args(&["--spec-decode", "1.5"])).is_err());
        assert!(fleet_config(&parse_args(&[
            "--spec-decode",
            "0.5",
            "--spec-draft-tokens",
            "0"
        ]))
        .is_err());
    }

    #[test]
    fn a_hybrid_model_reaches_the_engines_with_its_checkpoint_policy_and_is_reported() {
        let fleet = fleet_config(&parse_args(&[])).unwrap();
        assert_eq!(fleet.engine.hybrid, None);
        assert_eq!(fleet.engine.timing.ssm, None);
        let args = parse_args(&[
            "--model",
            "hybrid",
            "--checkpoints",
            "every-block",
            "--max-checkpoints",
            "64",
        ]);
        let fleet = fleet_config(&args).unwrap();
        let hybrid = fleet.engine.hybrid.expect("a hybrid engine");
        assert_eq!(hybrid.checkpoints, CheckpointPolicy::EveryBlock);
        assert_eq!(hybrid.max_checkpoints, 64);
        assert!(fleet.engine.timing.ssm.is_some());
        assert!(fleet.engine.state_slots as usize >= fleet.engine.max_num_seqs);
        let json = serde_json::to_value(&args).unwrap();
        assert_eq!(json["architecture"], "hybrid");
        assert_eq!(json["checkpoints"], "every-block");
        // `--architecture`, as the sim-worker's, names the same.
        let same = parse_args(&["--architecture", "hybrid", "--checkpoints", "every-block"]);
        assert_eq!(same.engine.architecture, ArchitectureChoice::Hybrid);
        // A hybrid engine with a host tier is refused, with the reason.
        let error = fleet_config(&parse_args(&["--model", "hybrid", "--host-blocks", "64"]))
            .unwrap_err()
            .to_string();
        assert!(error.contains("host tier"), "{error}");
        // Spill preemption needs its area.
        assert!(fleet_config(&parse_args(&["--preemption", "spill"])).is_err());
        let fleet = fleet_config(&parse_args(&[
            "--preemption",
            "spill",
            "--spill-blocks",
            "512",
        ]))
        .unwrap();
        assert_eq!(fleet.engine.preemption, Preemption::Spill);
    }

    /// The engine flags are the sim-worker's, with the profile's fleet
    /// sizes and trace-length prompts where no flag is given.
    #[test]
    fn the_engines_take_the_profiles_sizes_unless_flags_are_given() {
        let engine = fleet_config(&parse_args(&[])).unwrap().engine;
        assert_eq!(
            (
                engine.block_size,
                engine.num_blocks,
                engine.timing.speedup,
                engine.max_model_len
            ),
            (64, 16_384, 4.0, 1 << 20)
        );
        assert!(engine.emit_kv_events);
        assert_eq!(
            engine,
            EngineConfig {
                block_size: 64,
                max_model_len: 1 << 20,
                timing: TimingConfig {
                    speedup: 4.0,
                    ..Default::default()
                },
                ..Default::default()
            }
        );
        let engine = fleet_config(&parse_args(&[
            "--block-size",
            "16",
            "--speedup",
            "8",
            "--max-model-len",
            "32768",
            "--max-num-seqs",
            "64",
        ]))
        .unwrap()
        .engine;
        assert_eq!(
            (
                engine.block_size,
                engine.timing.speedup,
                engine.max_model_len,
                engine.max_num_seqs
            ),
            (16, 8.0, 32_768, 64)
        );
        assert!(fleet_config(&parse_args(&["--speedup", "0"])).is_err());
    }
}
