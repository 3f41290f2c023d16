//! `switchyard bench versus`: the same multi-turn load through Switchyard
//! and through SGLang's routers, each in front of its own fresh engines,
//! side by side in one run.
//!
//! The peers (`--peer smg,sglang`) are installed with pip into virtual
//! environments of their own (`smg==1.13.0`, the Shepherd Model Gateway,
//! and `sglang-router==0.3.2`, SGLang's Rust router; both with `--policy
//! cache_aware`, SGLang's cache-aware policy). When pip cannot install one
//! (no network, no `python3 -m venv`), it is skipped with the reason and
//! the others' figures are still printed. `--peer-bin` runs an installed
//! peer.
//!
//! The engines (`--engine`):
//! - `sim` (default): sim-workers (`--speedup 4 --num-blocks 4096`, KV
//!   events on);
//! - `vllm`: vLLM's CPU build (the pinned environment of
//!   [`switchyard_commands::engines::env`], installed when missing), each server bound to
//!   its own core, serving the tiny random-weight Qwen3 made by
//!   [`switchyard_commands::engines::models`] at 32 tokens a block with prefix caching and
//!   ZMQ KV events on; Switchyard reads its events, the peers route on text
//!   as they always do.
//!
//! Each run: the engines as child processes, the router under test in
//! front of them, one warm-up request, then the bundled ShareGPT
//! conversations (streamed, each turn the whole conversation so far) from
//! the load generator here — or, with `--workload agentic`, agent sessions
//! paced as `loadgen --workload agentic` paces them. Figures: TTFT p50/p90 at the client, the
//! engines' prefix hit rate from their own counters (the sim-workers', or
//! vLLM's `vllm:prefix_cache_hits_total` over
//! `vllm:prefix_cache_queries_total`), so every router is measured the
//! same way, and completed requests per second. Rounds alternate the
//! order of the routers.
//!
//! `--policy` and `--admission` may be repeated: every combination runs as
//! its own Switchyard variant in each round, so settings are compared with
//! each other and with the peers in the same run (e.g. `--admission none
//! --admission session-aware`).
//!
//! `--tenants FILE` runs a tenant mix instead (see [`tenants`]): each
//! router gets the mix's arrivals, Switchyard with flow control configured
//! from the file and SGLang's gateway with its priority scheduler.

pub use super::peer::Peer;
use super::peer::{cpu_seconds, for_peer, launch, median, peer_program, wait_ready, SIM_MODEL};
use clap::{Args, ValueEnum};
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::Duration;
use switchyard_commands::child::Children;
use switchyard_commands::demo::{start_sim_workers, SimWorkers};
use switchyard_commands::engines::env::VllmEnv;
use switchyard_commands::engines::models::TinyModels;
use switchyard_commands::engines::vllm::{VllmOptions, VllmWorker, READY_TIMEOUT};
use switchyard_commands::loadgen::{self, LoadWorkload, Pacing, Report};
use switchyard_commands::stats::write_json;
use switchyard_core::select::PolicyKind;
use switchyard_server::config::AdmissionMode;

#[path = "versus_tenants.rs"]
mod tenants;

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

/// The engines behind every router.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Engine {
    /// Switchyard's sim-workers.
    Sim,
    /// vLLM's CPU build with a tiny random-weight Qwen3.
    Vllm,
}

/// What `--engine vllm` runs with: the environment's Python and the
/// models (`bench versus` and `bench twin`).
pub(crate) struct VllmSetup {
    python: PathBuf,
    models: TinyModels,
    logs: PathBuf,
}

impl VllmSetup {
    /// `n` servers of the tiny Qwen3 (served as [`VLLM_MODEL`], 32 tokens
    /// a block, 8,192 a sequence), server `i` on core `i` modulo the
    /// cores, each's options changed by `tweak`; logs `run-wI.log`. Waits
    /// until every one serves.
    pub(crate) fn start_workers(
        &self,
        n: usize,
        run: &str,
        runtime: &tokio::runtime::Runtime,
        tweak: impl Fn(&mut VllmOptions),
    ) -> anyhow::Result<Vec<VllmWorker>> {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        let mut workers = (0..n)
            .map(|i| {
                let mut options = VllmOptions::new(&self.models.qwen3(), VLLM_MODEL);
                options.block_size = VLLM_BLOCK_SIZE;
                options.max_model_len = 8192;
                options.cpu = Some(i % cores);
                tweak(&mut options);
                let log = self.logs.join(format!("{run}-w{i}.log"));
                VllmWorker::spawn(&self.python, &options, &log)
            })
            .collect::<anyhow::Result<Vec<_>>>()?;
        for w in &mut workers {
            runtime.block_on(w.ready(READY_TIMEOUT))?;
        }
        Ok(workers)
    }
}

/// The model the tiny Qwen3 is served as.
pub(crate) const VLLM_MODEL: &str = "tiny";
/// Tokens per KV block of the vLLM servers (a multiple of 32 on CPU).
pub(crate) const VLLM_BLOCK_SIZE: u32 = 32;

/// Options of `bench versus`.
#[derive(Debug, Clone, Args)]
pub struct VersusArgs {
    /// The engines behind each router.
    #[arg(long, value_enum, default_value_t = Engine::Sim)]
    pub engine: Engine,
    /// The peer routers (repeat or comma-separate: smg, sglang) [default: smg].
    #[arg(long, value_enum, value_delimiter = ',')]
    pub peer: Vec<Peer>,
    /// Run this installed peer program instead of installing one:
    /// PEER=PATH (`smg=/venv/bin/smg`; a `python3` with `sglang_router` for
    /// sglang), or PATH when there is one peer; repeat.
    #[arg(long)]
    pub peer_bin: Vec<String>,
    /// Virtual environment for a peer: PEER=DIR, or DIR when there is one
    /// peer; repeat [default: TMPDIR/switchyard-versus-REQUIREMENT]; reused
    /// when it already has the peer.
    #[arg(long)]
    pub venv: Vec<String>,
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
    /// Engines behind each router [default: 4 sim-workers, 2 vLLM servers
    /// (one a core)].
    #[arg(long)]
    pub workers: Option<usize>,
    /// Sim-worker speed-up over the timing model.
    #[arg(long, default_value_t = 4.0)]
    pub speedup: f64,
    /// KV blocks per sim-worker.
    #[arg(long, default_value_t = 4096)]
    pub num_blocks: usize,
    /// Conversation turns sent through each router [default: 1500 to
    /// sim-workers, 400 to vLLM].
    #[arg(long)]
    pub requests: Option<usize>,
    /// Requests in flight [default: 16 to sim-workers, 8 to vLLM].
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Output tokens per turn at most.
    #[arg(long, default_value_t = 64)]
    pub max_output_tokens: u32,
    /// Rounds (each runs every router, alternating the order).
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// ShareGPT conversations [default: the bundled sharegpt_multiturn_3000].
    #[arg(long)]
    pub sharegpt: Option<PathBuf>,
    /// A built-in workload instead of the ShareGPT conversations:
    /// `agentic`, sent as `loadgen --workload agentic` sends it (sessions
    /// open at their arrivals; `--requests` takes whole sessions until it
    /// is reached). The engines' limits hold: give an `--agentic-config`
    /// whose `context_cap_tokens` fits them (a sim-worker's
    /// `--max-model-len` is 32,768 by default; the default cap is 200,000).
    #[arg(long, value_enum, conflicts_with_all = ["sharegpt", "tenants", "concurrency"])]
    pub workload: Option<LoadWorkload>,
    /// With `--workload agentic`: its parameters (TOML), as `replay
    /// --agentic-config` takes them.
    #[arg(long, requires = "workload")]
    pub agentic_config: Option<PathBuf>,
    /// With `--workload agentic`: its seed, as `replay --seed`.
    #[arg(long, default_value_t = 0, requires = "workload")]
    pub seed: u64,
    /// Write every run's figures here as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// A tenant mix (`loadgen --tenants`'s file) to send through every
    /// router instead of ShareGPT conversations: Switchyard with the mix's
    /// tenants, bands and weights; smg with its priority scheduler and each
    /// tenant's band as `x-smg-priority`.
    #[arg(long, conflicts_with_all = ["config", "requests", "concurrency", "sharegpt"])]
    pub tenants: Option<PathBuf>,
    /// With `--tenants`: the protected tenant(s) on their own, run the same
    /// way, for the ratio of each one's TTFT p90 in the mix to alone.
    #[arg(long, requires = "tenants")]
    pub tenants_alone: Option<PathBuf>,
    /// With `--tenants`: seconds of arrivals to send.
    #[arg(long, default_value_t = 60.0, requires = "tenants")]
    pub duration: f64,
    /// With `--tenants`: Switchyard's busy threshold (flow control orders
    /// only what the router holds back).
    #[arg(long, default_value_t = 0.6, requires = "tenants")]
    pub busy_threshold: f64,
    /// With `--tenants`: send the prompts as token ids, as `loadgen
    /// --tenants` does, instead of as text: neither the router nor the
    /// sim-workers tokenize, so the run measures routing and flow control
    /// without the tokenizing CPU that text prompts cost on the benchmark's
    /// own machine. Switchyard only (smg refuses token-id prompts): needs
    /// `--no-peer`.
    #[arg(long, requires = "tenants")]
    pub prompt_ids: bool,
    /// Save each run's `/metrics` pages here when its load is done: the
    /// router's (`RUN-router.prom`, Switchyard only: a peer's page is not
    /// on its serving port) and each engine's (`RUN-wI.prom`), to see where
    /// a run's time went (flow waits, tokenizing, engines behind their
    /// timing model). With `--tenants`, the router's page also when the
    /// arrivals end (`RUN-window-router.prom`): the tokens each tenant was
    /// dispatched within the window.
    #[arg(long)]
    pub keep_metrics: Option<PathBuf>,
}

impl VersusArgs {
    fn workers(&self) -> usize {
        self.workers.unwrap_or(match self.engine {
            Engine::Sim => 4,
            Engine::Vllm => 2,
        })
    }

    fn requests(&self) -> usize {
        self.requests.unwrap_or(match self.engine {
            Engine::Sim => 1500,
            Engine::Vllm => 400,
        })
    }

    fn concurrency(&self) -> usize {
        self.concurrency.unwrap_or(match self.engine {
            Engine::Sim => 16,
            Engine::Vllm => 8,
        })
    }

    fn model(&self) -> &'static str {
        match self.engine {
            Engine::Sim => SIM_MODEL,
            Engine::Vllm => VLLM_MODEL,
        }
    }
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

/// One router's engines, stopped when dropped.
enum Engines {
    Sim(SimWorkers),
    Vllm(Vec<VllmWorker>),
}

impl Engines {
    /// Fresh engines for one run.
    fn start(
        args: &VersusArgs,
        vllm: Option<&VllmSetup>,
        runtime: &tokio::runtime::Runtime,
        run: &str,
    ) -> anyhow::Result<Self> {
        match vllm {
            None => Ok(Self::Sim(start_sim_workers(
                args.workers(),
                &worker_args(args),
                true,
            )?)),
            Some(setup) => Ok(Self::Vllm(setup.start_workers(
                args.workers(),
                run,
                runtime,
                |_| {},
            )?)),
        }
    }

    /// The engines' base URLs.
    fn urls(&self) -> Vec<String> {
        match self {
            Self::Sim(fleet) => fleet.urls.clone(),
            Self::Vllm(workers) => workers.iter().map(|w| w.base.clone()).collect(),
        }
    }

    /// Their `serve --worker` specs, KV-event endpoints included.
    fn specs(&self) -> Vec<String> {
        match self {
            Self::Sim(fleet) => fleet
                .urls
                .iter()
                .zip(&fleet.events)
                .enumerate()
                .map(|(i, (url, events))| match events {
                    Some((events, replay)) => {
                        format!("{url},name=w{i},events={events},replay={replay}")
                    }
                    None => format!("{url},name=w{i}"),
                })
                .collect(),
            Self::Vllm(workers) => workers
                .iter()
                .enumerate()
                .map(|(i, w)| w.worker_spec(&format!("w{i}")))
                .collect(),
        }
    }
}

/// `serve` flags for `variant` in front of `engines`.
fn our_args(
    args: &VersusArgs,
    variant: Variant,
    engines: &Engines,
    extra: &[String],
) -> Vec<String> {
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
    match engines {
        // The workers' speed, as an operator configures it for the estimator.
        Engines::Sim(_) => a.extend(["--prefill-speedup".into(), args.speedup.to_string()]),
        Engines::Vllm(_) => a.extend(["--block-size".into(), VLLM_BLOCK_SIZE.to_string()]),
    }
    for spec in engines.specs() {
        a.extend(["--worker".into(), spec]);
    }
    a.extend(extra.iter().cloned());
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

/// How one run offers its load and what the routers are started with
/// beyond the comparison's settings.
struct RunLoad {
    /// Closed loop, agent sessions, or the arrivals of a tenant mix.
    pacing: Pacing,
    /// More `serve` flags.
    ours: Vec<String>,
    /// More flags for the peer.
    peer: Vec<String>,
}

/// One router's run on fresh engines.
fn one_run(
    args: &VersusArgs,
    vllm: Option<&VllmSetup>,
    contender: Contender<'_>,
    requests: Vec<loadgen::PreparedRequest>,
    run: &str,
    load: RunLoad,
) -> anyhow::Result<(Report, Option<f64>)> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let engines = Engines::start(args, vllm, &runtime, run)?;
    let urls = engines.urls();
    let mut children = Children(Vec::new());
    let (base, what) = match contender {
        Contender::Ours(variant) => {
            let mut command = switchyard_commands::child::this_binary()?;
            command
                .args(our_args(args, variant, &engines, &load.ours))
                .env("RUST_LOG", "warn");
            let (child, url) =
                switchyard_commands::child::spawn_printing_url(command, "switchyard serve")?;
            children.0.push(child);
            (url, "switchyard serve".to_owned())
        }
        Contender::Peer(peer, program) => (
            launch(peer, program, &urls, &load.peer, &mut children)?,
            peer.requirement().to_owned(),
        ),
    };
    wait_ready(&runtime, &base, args.model(), &mut children, &what)?;
    let pid = children.0.last().map(Child::id);
    let cpu_before = pid.and_then(cpu_seconds);
    // A tenant mix's window: the router's page once the arrivals end, while
    // every tenant still has requests waiting (the tokens each was served
    // by then are its share under saturation).
    if let (Some(dir), Contender::Ours(_), Pacing::Arrivals(_)) =
        (&args.keep_metrics, contender, &load.pacing)
    {
        let (dir, run, base) = (dir.clone(), run.to_owned(), base.clone());
        let window = Duration::from_secs_f64(args.duration);
        runtime.spawn(async move {
            tokio::time::sleep(window).await;
            let window_run = format!("{run}-window");
            if let Err(e) = keep_metrics(&dir, &window_run, Some(&base), &[]).await {
                eprintln!("--keep-metrics: {e:#}");
            }
        });
    }
    let report = runtime.block_on(loadgen::run_load(
        &base,
        requests,
        load.pacing,
        true,
        &urls,
        false,
    ));
    let cpu_after = pid.and_then(cpu_seconds);
    if let Some(dir) = &args.keep_metrics {
        let router = matches!(contender, Contender::Ours(_)).then_some(base.as_str());
        runtime.block_on(keep_metrics(dir, run, router, &urls))?;
    }
    let cpu_ms_per_request = match (cpu_before, cpu_after) {
        (Some(b), Some(a)) if report.requests > 0 => Some((a - b) * 1e3 / report.requests as f64),
        _ => None,
    };
    drop(children);
    drop(engines);
    Ok((report, cpu_ms_per_request))
}

/// Writes the `/metrics` pages of `router` (when given) and of each of
/// `engines` into `dir` as `RUN-router.prom` and `RUN-wI.prom`; a page
/// that cannot be read is reported and skipped.
async fn keep_metrics(
    dir: &Path,
    run: &str,
    router: Option<&str>,
    engines: &[String],
) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir)?;
    let client = loadgen::client();
    let pages = router
        .map(|url| ("router".to_owned(), url))
        .into_iter()
        .chain(
            engines
                .iter()
                .enumerate()
                .map(|(i, url)| (format!("w{i}"), url.as_str())),
        );
    for (name, url) in pages {
        let url = format!("{}/metrics", url.trim_end_matches('/'));
        match loadgen::get_text(&client, &url).await {
            Some(page) => std::fs::write(dir.join(format!("{run}-{name}.prom")), page)?,
            None => eprintln!("--keep-metrics: could not read {url}"),
        }
    }
    Ok(())
}

/// Installs (when missing) vLLM's environment and makes the tiny models.
pub(crate) fn vllm_setup() -> anyhow::Result<VllmSetup> {
    let env = VllmEnv::setup(None)?;
    let scratch = std::env::temp_dir().join("switchyard-versus-vllm");
    let models = TinyModels::make(&env.python(), &scratch.join("models"))?;
    Ok(VllmSetup {
        python: env.python(),
        models,
        logs: scratch.join("logs"),
    })
}

/// Runs `bench versus`.
pub fn run(args: VersusArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.workers() > 0 && args.requests() > 0 && args.concurrency() > 0 && args.rounds > 0,
        "--workers, --requests, --concurrency and --rounds must be positive"
    );
    if args.tenants.is_some() {
        return tenants::run(&args);
    }
    let (requests, pacing) = match args.workload {
        Some(LoadWorkload::Agentic) => {
            let config =
                switchyard_commands::agentic::config(args.agentic_config.as_deref(), args.seed)?;
            let vocabulary = switchyard_commands::agentic::vocabulary()?;
            let (requests, plan) = loadgen::agentic_requests(
                config,
                &vocabulary,
                args.requests(),
                args.max_output_tokens,
                1.0,
                Some(args.model()),
            )?;
            (requests, Pacing::Sessions(std::sync::Arc::new(plan)))
        }
        None => {
            let sharegpt = match &args.sharegpt {
                Some(p) => p.clone(),
                None => {
                    switchyard_commands::data::data_path("traces/sharegpt_multiturn_3000.jsonl.gz")?
                }
            };
            let requests = loadgen::sharegpt_requests(
                &sharegpt,
                args.requests(),
                args.max_output_tokens,
                Some(args.model()),
            )?;
            (requests, Pacing::Concurrency(args.concurrency()))
        }
    };
    let vllm = match args.engine {
        Engine::Sim => None,
        Engine::Vllm => Some(vllm_setup()?),
    };
    let variants = Variant::all(&args.policy, &args.admission);
    let peers = find_peers(&args)?;
    let mut runs = Vec::new();
    for round in 0..args.rounds {
        for (i, (name, contender)) in contenders(&args, &variants, &peers, round)
            .into_iter()
            .enumerate()
        {
            eprintln!("round {}: {name}...", round + 1);
            let run = format!("round{}-{i}", round + 1);
            let load = RunLoad {
                pacing: pacing.clone(),
                ours: Vec::new(),
                peer: Vec::new(),
            };
            let (report, cpu) = one_run(
                &args,
                vllm.as_ref(),
                contender,
                requests.clone(),
                &run,
                load,
            )?;
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

/// The peers to compare with, found or installed (those that cannot be
/// are skipped with the reason).
fn find_peers(args: &VersusArgs) -> anyhow::Result<Vec<(Peer, PathBuf)>> {
    let mut wanted = if args.peer.is_empty() {
        vec![Peer::Smg]
    } else {
        args.peer.clone()
    };
    wanted.dedup();
    let mut peers: Vec<(Peer, PathBuf)> = Vec::new();
    if !args.no_peer {
        for &peer in &wanted {
            let bin = for_peer(&args.peer_bin, peer, wanted.len())?;
            let venv = for_peer(&args.venv, peer, wanted.len())?;
            match peer_program(peer, bin.as_deref(), venv.as_deref()) {
                Ok(program) => peers.push((peer, program)),
                Err(why) => eprintln!("skipping {}: {why}", peer.requirement()),
            }
        }
    }
    Ok(peers)
}

/// Every router of round `round` (0-based) with its row name: Switchyard's
/// variants, then the peers; odd rounds in reverse order.
fn contenders<'a>(
    args: &VersusArgs,
    variants: &[Variant],
    peers: &'a [(Peer, PathBuf)],
    round: usize,
) -> Vec<(String, Contender<'a>)> {
    let mut order: Vec<(String, Contender<'a>)> = variants
        .iter()
        .map(|&v| (v.name(args.config.as_deref()), Contender::Ours(v)))
        .collect();
    order.extend(peers.iter().map(|(p, program)| {
        (
            format!("{} (cache_aware)", p.requirement()),
            Contender::Peer(*p, program.as_path()),
        )
    }));
    if round % 2 == 1 {
        order.reverse();
    }
    order
}

fn print_table(args: &VersusArgs, runs: &[RunFigures]) {
    let engines = match args.engine {
        Engine::Sim => format!(
            "sim-workers (--speedup {} --num-blocks {})",
            args.speedup, args.num_blocks
        ),
        Engine::Vllm => format!(
            "vLLM {} CPU servers (tiny Qwen3, {VLLM_BLOCK_SIZE} tokens a block, one core each)",
            switchyard_commands::engines::env::VLLM_VERSION
        ),
    };
    let load = match args.workload {
        Some(LoadWorkload::Agentic) => format!(
            "agent sessions up to {} calls (seed {}{})",
            args.requests(),
            args.seed,
            args.agentic_config
                .as_ref()
                .map(|p| format!(", {}", p.display()))
                .unwrap_or_default()
        ),
        None => format!(
            "{} ShareGPT turns, concurrency {}",
            args.requests(),
            args.concurrency()
        ),
    };
    println!("{load}, {} {engines} per router", args.workers());
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
    println!("(TTFT in ms at the client; hit = the engines' own prefix hit rate over the run; cpu ms/rq = the router process's CPU time per request; med = median over rounds)");
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
