//! `switchyard sim-worker`: a simulated engine worker.
//!
//! - [`driver`] — the thread that owns the pure engine core, steps it in
//!   real time (model time divided by `--speedup`, to absolute deadlines)
//!   and fans tokens out at each step's end;
//! - [`http`] — the OpenAI-compatible HTTP surface (axum) and the
//!   informational endpoints routers probe;
//! - [`kv_publish`] — KV events in vLLM's wire format over the event
//!   plane's ZMQ publisher (`--kv-events`, `--kv-replay`);
//! - [`metrics`] — the `prometheus-client` registry `/metrics` encodes;
//! - [`adapters`] — LoRA adapters (`--max-loras`, `--lora-load-ms`,
//!   `--lora-modules`) and vLLM's `/v1/load_lora_adapter` and
//!   `/v1/unload_lora_adapter`;
//! - [`disagg`] — `--disagg vllm|sglang`: prefill/decode disaggregation,
//!   the handshake's fields, the KV pull between workers and its internal
//!   endpoints (`/internal/kv/pull`, `/internal/kv/release`);
//! - [`transfer`] — what a transfer carries and how it fails (the lease
//!   as it travels, the transfer's errors), shared by `disagg` and the
//!   driver;
//! - [`agentic`] — the Responses and Messages APIs, routed beside
//!   [`http`]'s; [`response_store`] — the responses it stores, bounded;
//! - [`ranks`] — `--dp-size N`: N data-parallel ranks behind one port,
//!   each its own engine, chosen by `X-data-parallel-rank` or the
//!   worker's own balancer;
//! - [`engine_flags`] — [`EngineFlags`]: the engine's flags and their one
//!   mapping to an `EngineConfig`, flattened into `sim-worker` and
//!   `replay` alike.
//!
//! With `--replica-sync nats://HOST:PORT` the worker also publishes
//! `MarkPrefillCompleted` at each routed request's first token straight
//! onto the routers' replica plane ([`switchyard_replica::WorkerMarks`]).
//!
//! Data flow: HTTP handler → tokenizer → driver command channel → engine
//! step → per-request token channel → SSE or JSON reply. KV events leave the
//! driver through a bounded sink.
//!
//! Output text: the engine draws its tokens from the tokenizer's word
//! tokens ([`switchyard_tokenizer::WordVocabulary`], found at start-up by
//! [`output_text`]) and the reply writes each one's own text, so text,
//! `token_ids`, `usage` and the KV cache agree: a client re-tokenizing the
//! answer counts `usage.completion_tokens`, and a conversation's next turn
//! hits the blocks of the answer it contains.

pub mod adapters;
pub mod agentic;
pub mod disagg;
pub mod driver;
pub mod engine_flags;
pub mod http;
pub mod kv_publish;
pub mod metrics;
pub mod ranks;
pub mod response_store;
pub mod transfer;

use anyhow::Context;
use axum::serve::ListenerExt as _;
use clap::Args;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use switchyard_engine::{Engine, EngineConfig, SyncDevice};
use switchyard_kv_events::publisher::{KvEventPublisher, PublisherConfig};
use switchyard_replica::{
    worker_id_for_name, NatsAuthArgs, NatsTransport, ReplicaConfig, ReplicaConfigError, WorkerMarks,
};
use switchyard_tokenizer::Tokenizer;

pub use engine_flags::{
    ArchitectureChoice, CheckpointChoice, EngineDefaults, EngineFlags, PreemptionChoice,
};

/// Options of `switchyard sim-worker`.
#[derive(Debug, Clone, Args)]
pub struct SimWorkerArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0: any free port; the chosen address is printed).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,
    /// Model name served at /v1/models and accepted in requests.
    #[arg(long, default_value = "switchyard-sim")]
    pub model: String,
    /// ZMQ PUB endpoint to bind for vLLM-format KV events, e.g.
    /// tcp://127.0.0.1:5557 (tcp://127.0.0.1:* picks a port; it is printed).
    #[arg(long)]
    pub kv_events: Option<String>,
    /// ZMQ ROUTER endpoint to bind for replaying buffered KV-event batches.
    #[arg(long)]
    pub kv_replay: Option<String>,
    /// KV-event batches kept for replay.
    #[arg(long, default_value_t = 10_000)]
    pub kv_replay_buffer: usize,
    /// Same as --speedup 0.
    #[arg(long)]
    pub no_delay: bool,
    /// Output tokens when a request gives no max_tokens.
    #[arg(long, default_value_t = 16)]
    pub default_max_tokens: u32,
    /// A model's tokenizer directory: tokenizer.json with its
    /// tokenizer_config.json (a Hugging Face model directory; without the
    /// config, chat requests are refused), else qwen3-tokenizer.json with
    /// qwen3-tokenizer_config.json (default: the bundled Qwen3 tokenizer,
    /// built into the binary, or the copy in $SWITCHYARD_TOKENIZER_DIR).
    #[arg(long)]
    pub tokenizer_dir: Option<PathBuf>,
    /// Publish MarkPrefillCompleted at each routed request's first token
    /// onto the routers' replica plane over NATS at this URL (requests
    /// without the router's identity headers are not marked).
    #[arg(long, value_name = "nats://HOST:PORT")]
    pub replica_sync: Option<String>,
    /// Replica-sync namespace; must match the routers'.
    #[arg(long, alias = "namespace", default_value = "default")]
    pub replica_namespace: String,
    /// Replica-sync endpoint; must match the routers'.
    #[arg(long, alias = "endpoint", default_value = "generate")]
    pub replica_endpoint: String,
    /// Require this key (Authorization: Bearer) on every route but /metrics.
    #[arg(long)]
    pub api_key: Option<switchyard_replica::Secret>,
    /// NATS authentication and TLS for the marks (`--nats-*`, as `serve`'s).
    #[command(flatten)]
    pub nats: NatsAuthArgs,
    /// Prefill/decode disaggregation (`--disagg`, `--disagg-role`, ...).
    #[command(flatten)]
    pub disagg: disagg::DisaggArgs,
    /// LoRA adapter slots, as vLLM's `--max-loras` (0: LoRA off, loads
    /// refused); a load into full slots evicts the least recently used.
    #[arg(long, default_value_t = 0)]
    pub max_loras: usize,
    /// Model milliseconds one adapter load takes (divided by `--speedup`).
    #[arg(long, default_value_t = 200.0)]
    pub lora_load_ms: f64,
    /// An adapter loaded at start-up, `NAME=PATH` (repeatable), as vLLM's
    /// `--lora-modules`.
    #[arg(long = "lora-modules", value_name = "NAME=PATH", value_parser = adapters::parse_module)]
    pub lora_modules: Vec<(String, String)>,
    /// Attention data-parallel ranks behind the one port, each its own
    /// engine (KV cache and scheduler), as vLLM's `--data-parallel-size`:
    /// a request names its rank with `X-data-parallel-rank` (else the
    /// worker's balancer picks one); rank r publishes its KV events on the
    /// `--kv-events` port plus r (and replays on the `--kv-replay` port
    /// plus r).
    #[arg(long, default_value_t = 1)]
    pub dp_size: usize,
    /// The engine's flags (`--block-size`, `--num-blocks`, `--speedup`,
    /// `--architecture`, ...), shared with `replay`; last, as its help
    /// heading holds for the flags after it.
    #[command(flatten)]
    pub engine: EngineFlags,
}

impl SimWorkerArgs {
    /// The replica plane the marks go to, when `--replica-sync` is given.
    pub fn replica_config(&self) -> Result<Option<ReplicaConfig>, ReplicaConfigError> {
        let Some(url) = &self.replica_sync else {
            return Ok(None);
        };
        let mut config = ReplicaConfig {
            nats_url: Some(url.clone()),
            namespace: self.replica_namespace.clone(),
            endpoint: self.replica_endpoint.clone(),
            ..ReplicaConfig::default()
        };
        self.nats.apply(&mut config.auth);
        config.validate()?;
        Ok(Some(config))
    }

    /// The engine configuration these flags describe: [`EngineFlags`] with
    /// the sim-worker's defaults, instant with `--no-delay`, KV events
    /// recorded when there is a publisher for them. The output vocabulary
    /// comes from the tokenizer when the worker starts ([`bind`]).
    pub fn engine_config(&self) -> EngineConfig {
        let mut config = self.engine.engine_config(EngineDefaults::sim_worker());
        if self.no_delay {
            config.timing.speedup = 0.0;
        }
        config.emit_kv_events = self.kv_events.is_some();
        config
    }
}

/// Most word tokens output text is drawn from: plenty for text that reads
/// as varied, and quick to find (the lowest ids of a BPE vocabulary).
pub const MAX_OUTPUT_WORDS: usize = 4096;
/// Fewest word tokens worth generating from; a tokenizer with fewer falls
/// back to a fixed word per id ([`http::OutputText::FixedWords`]).
pub const MIN_OUTPUT_WORDS: usize = 256;

/// Runs the worker until Ctrl-C.
pub fn run(args: SimWorkerArgs) -> anyhow::Result<()> {
    if args.kv_replay.is_some() && args.kv_events.is_none() {
        anyhow::bail!("--kv-replay needs --kv-events");
    }
    args.engine_config()
        .validate()
        .context("invalid engine configuration")?;
    args.replica_config()?;
    args.disagg
        .config()
        .map_err(anyhow::Error::msg)
        .context("invalid --disagg configuration")?;
    check_dp(&args)?;
    if args.engine.architecture == ArchitectureChoice::Hybrid && args.disagg.disagg.is_some() {
        anyhow::bail!(
            "--disagg with --architecture hybrid is not modelled (a hybrid model's SSM state is not transferred)"
        );
    }
    let tokenizer = match &args.tokenizer_dir {
        Some(dir) => Tokenizer::from_dir(dir),
        None => Tokenizer::bundled(),
    }
    .context("loading the tokenizer")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    runtime.block_on(serve(args, tokenizer))
}

/// Checks `--dp-size` against the other flags.
fn check_dp(args: &SimWorkerArgs) -> anyhow::Result<()> {
    if !(1..=ranks::MAX_DP_SIZE).contains(&args.dp_size) {
        anyhow::bail!(
            "--dp-size must be 1 to {}, got {}",
            ranks::MAX_DP_SIZE,
            args.dp_size
        );
    }
    if args.dp_size > 1 && args.disagg.disagg.is_some() {
        anyhow::bail!("--dp-size with --disagg is not modelled");
    }
    Ok(())
}

/// Rank `rank`'s endpoint: `endpoint`'s port plus the rank, or `endpoint`
/// itself for rank 0.
fn rank_endpoint(endpoint: &str, rank: usize) -> anyhow::Result<String> {
    if rank == 0 {
        return Ok(endpoint.to_owned());
    }
    let port = endpoint
        .rsplit_once(':')
        .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)))
        .and_then(|(host, port)| {
            let port = port.checked_add(u16::try_from(rank).ok()?)?;
            Some(format!("{host}:{port}"))
        });
    port.with_context(|| {
        format!("rank {rank} publishes on the port of {endpoint} plus {rank}: give a tcp://HOST:PORT with room for it")
    })
}

/// Binds rank `rank`'s KV-event publisher and starts its thread (`None`
/// without `--kv-events`). `bound` is rank 0's publisher's endpoints once
/// bound (a `*` port resolved), from which the other ranks' follow.
fn rank_publisher(
    args: &SimWorkerArgs,
    rank: usize,
    bound: &mut Option<(String, Option<String>)>,
    metrics: &Arc<metrics::Metrics>,
) -> anyhow::Result<Option<tokio::sync::mpsc::Sender<Vec<switchyard_engine::KvEvent>>>> {
    let Some(endpoint) = &args.kv_events else {
        return Ok(None);
    };
    let (events, replay) = match bound {
        None => (endpoint.clone(), args.kv_replay.clone()),
        Some((events, replay)) => (
            rank_endpoint(events, rank)?,
            replay
                .as_deref()
                .map(|r| rank_endpoint(r, rank))
                .transpose()?,
        ),
    };
    let mut publisher_config = PublisherConfig::new(events.clone(), replay);
    publisher_config.replay_buffer = args.kv_replay_buffer;
    let publisher = KvEventPublisher::bind(publisher_config)
        .with_context(|| format!("binding rank {rank}'s KV-event publisher on {events}"))?;
    let rank_label = if args.dp_size > 1 {
        format!(" rank {rank}")
    } else {
        String::new()
    };
    println!(
        "switchyard sim-worker kv-events {} replay {}{rank_label}",
        publisher.endpoint(),
        publisher.replay_endpoint().unwrap_or("-")
    );
    if bound.is_none() {
        *bound = Some((
            publisher.endpoint().to_owned(),
            publisher.replay_endpoint().map(str::to_owned),
        ));
    }
    let (tx, rx) = tokio::sync::mpsc::channel(1024);
    kv_publish::spawn(publisher, rx, metrics.clone(), rank as u32)
        .context("starting the KV-event publisher")?;
    Ok(Some(tx))
}

/// How generated tokens become text with `tokenizer`: its word tokens when
/// it has at least [`MIN_OUTPUT_WORDS`] that round-trip (byte-level BPE's
/// `" the"`, or a WordPiece vocabulary's whole words written with a space
/// in front: every token's text starts with a space, the answer's first
/// too, so streamed chunks concatenate to the whole answer), else fixed words,
/// said on stderr (clients will count other numbers of tokens than usage).
pub fn output_text(tokenizer: &Tokenizer) -> http::OutputText {
    let started = std::time::Instant::now();
    let refused = match tokenizer.word_vocabulary(MAX_OUTPUT_WORDS) {
        Ok(words) if words.len() >= MIN_OUTPUT_WORDS => {
            println!(
                "switchyard sim-worker output text: {} word tokens of the tokenizer \
                 (found and checked in {} ms); clients re-tokenizing answers count \
                 usage.completion_tokens",
                words.len(),
                started.elapsed().as_millis()
            );
            return http::OutputText::Words(Arc::new(words));
        }
        Ok(words) => format!(
            "only {} word tokens round-trip (at least {MIN_OUTPUT_WORDS} needed; a word token \
             decodes to a space and lowercase ASCII letters, as byte-level BPE's do, or is a \
             WordPiece vocabulary's whole word of two or more lowercase ASCII letters; a \
             SentencePiece vocabulary's decode without the space)",
            words.len()
        ),
        Err(err) => err.to_string(),
    };
    eprintln!(
        "switchyard sim-worker: warning: the tokenizer gives no output vocabulary ({refused}); \
         output text is a fixed word per token id, and clients that re-tokenize it \
         count other numbers of tokens than usage.completion_tokens"
    );
    http::OutputText::FixedWords
}

/// A worker listening on its address, ready to be served: the engine
/// thread, the KV-event publisher and the replica-sync marks run; the
/// HTTP app answers once `axum::serve` drives it (as [`run`] does until
/// Ctrl-C, and tests do in-process).
pub struct BoundWorker {
    /// The bound socket.
    pub listener: tokio::net::TcpListener,
    /// Every route, behind the API key when there is one.
    pub app: axum::Router,
    /// The SGLang bootstrap server's address (`--disagg sglang
    /// --disagg-role prefill`), already serving.
    pub bootstrap: Option<SocketAddr>,
}

/// Starts everything [`BoundWorker`] holds for `args`, with `tokenizer`
/// for prompts and output text ([`output_text`]).
pub async fn bind(args: &SimWorkerArgs, tokenizer: Tokenizer) -> anyhow::Result<BoundWorker> {
    let output_text = output_text(&tokenizer);
    let config = EngineConfig {
        output_vocabulary: output_text.vocabulary(),
        ..args.engine_config()
    };
    config.validate().context("invalid engine configuration")?;
    check_dp(args)?;
    let engine = Engine::new(config.clone(), SyncDevice::new(config.timing.clone()))?;
    let metrics = Arc::new(metrics::Metrics::default());
    let mut bound_events = None;
    let kv_sink = rank_publisher(args, 0, &mut bound_events, &metrics)?;
    let disagg_config = args
        .disagg
        .config()
        .map_err(anyhow::Error::msg)
        .context("invalid --disagg configuration")?
        .map(Arc::new);
    let addr: SocketAddr = format!("{}:{}", args.host, args.port)
        .parse()
        .with_context(|| format!("bad --host/--port {}:{}", args.host, args.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr()?;
    let transfers = match &disagg_config {
        None => None,
        Some(d) => Some(
            disagg::Transfers::new(
                d.clone(),
                args.api_key
                    .as_ref()
                    .map(switchyard_replica::Secret::expose),
                config.block_size,
                config.max_model_len / config.block_size + 1,
                config.timing.bytes_per_token,
                config.timing.wall_ms(1.0),
                metrics.clone(),
            )
            .context("starting the KV transfer client")?,
        ),
    };
    let driver_disagg = match (&disagg_config, &transfers) {
        (Some(d), Some(t)) => Some(driver::DriverDisagg {
            lease_ttl_ms: d.lease_ttl_ms as f64,
            max_rooms: d.max_rooms,
            releases: t.spawn_releaser(),
        }),
        _ => None,
    };
    let driver = driver::spawn_with(engine, metrics.clone(), kv_sink, driver_disagg)
        .context("starting the engine thread")?;
    // Ranks 1.. (rank 0 is the engine above): each its own engine, thread,
    // metrics and publisher.
    let ranks = if args.dp_size > 1 {
        let mut list = vec![ranks::Rank {
            driver: driver.clone(),
            metrics: metrics.clone(),
        }];
        for rank in 1..args.dp_size {
            let engine = Engine::new(config.clone(), SyncDevice::new(config.timing.clone()))?;
            let metrics = Arc::new(metrics::Metrics::default());
            let kv_sink = rank_publisher(args, rank, &mut bound_events, &metrics)?;
            let driver = driver::spawn_with(engine, metrics.clone(), kv_sink, None)
                .with_context(|| format!("starting rank {rank}'s engine thread"))?;
            list.push(ranks::Rank { driver, metrics });
        }
        println!(
            "switchyard sim-worker data-parallel ranks {} (X-data-parallel-rank)",
            args.dp_size
        );
        Some(Arc::new(ranks::Ranks::new(list)))
    } else {
        None
    };
    let marks = match args.replica_config()? {
        None => None,
        Some(replica) => {
            let url = replica.nats_url.as_deref().unwrap_or_default();
            let transport = NatsTransport::connect_with(url, &replica.auth)
                .await
                .context("starting replica-sync marks")?;
            // Routers ignore a mark's worker; this is its default name's id.
            let worker = worker_id_for_name(&local.to_string());
            Some(Arc::new(WorkerMarks::start(transport, &replica, worker)))
        }
    };
    let engine_id: Arc<str> = format!("switchyard-sim-{:016x}", rand::random::<u64>()).into();
    let mut bootstrap = None;
    let disagg_state = match (disagg_config, transfers) {
        (Some(d), Some(transfers)) => {
            let host = d.advertise_host.unwrap_or(if local.ip().is_unspecified() {
                std::net::Ipv4Addr::LOCALHOST.into()
            } else {
                local.ip()
            });
            let internal = disagg::InternalState {
                driver: driver.clone(),
                metrics: metrics.clone(),
                engine_id: engine_id.clone(),
                block_size: config.block_size,
            };
            let mut advertise = SocketAddr::new(host, local.port());
            if d.serves_bootstrap() {
                let addr = SocketAddr::new(local.ip(), d.bootstrap_port);
                let listener = tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("binding the bootstrap port {addr}"))?;
                let bound = listener.local_addr()?;
                println!("switchyard sim-worker bootstrap http://{bound}");
                let app = disagg::internal_router(internal.clone());
                let app = match &args.api_key {
                    Some(key) => http::require_key(app, key.expose()),
                    None => app,
                };
                tokio::spawn(async move { axum::serve(listener, app).await });
                advertise.set_port(bound.port());
                bootstrap = Some(bound);
            }
            // Leases and rooms expire in wall time, also while idle.
            driver.spawn_ticker(std::time::Duration::from_millis(250));
            println!(
                "switchyard sim-worker disaggregation {:?}{} engine {engine_id}",
                d.protocol,
                d.role.map(|r| format!(" role {r:?}")).unwrap_or_default()
            );
            Some((
                Arc::new(http::DisaggState {
                    config: d,
                    transfers,
                    engine_id,
                    advertise,
                }),
                internal,
            ))
        }
        _ => None,
    };
    if !(args.lora_load_ms.is_finite() && args.lora_load_ms >= 0.0) {
        anyhow::bail!("--lora-load-ms must be finite and non-negative");
    }
    if args.max_loras < args.lora_modules.len() {
        anyhow::bail!(
            "--lora-modules names {} adapters but --max-loras is {}",
            args.lora_modules.len(),
            args.max_loras
        );
    }
    let speedup = config.timing.speedup;
    let load_time = if speedup > 0.0 {
        std::time::Duration::from_secs_f64(args.lora_load_ms / speedup / 1e3)
    } else {
        std::time::Duration::ZERO
    };
    let lora = Arc::new(adapters::Adapters::new(
        args.max_loras,
        load_time,
        args.model.as_str().into(),
        metrics.clone(),
    ));
    for (name, path) in &args.lora_modules {
        lora.load(Some(name), Some(path))
            .await
            .map_err(|e| anyhow::anyhow!("--lora-modules {name}: refused: {}", e.to_json()))?;
    }
    let state = http::WorkerState {
        adapters: lora,
        responses: Arc::default(),
        model: args.model.as_str().into(),
        config: Arc::new(config),
        tokenizer: Arc::new(tokenizer),
        output_text,
        driver,
        metrics,
        default_max_tokens: args.default_max_tokens,
        next_id: Arc::new(AtomicU64::new(1)),
        id_salt: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64),
        marks,
        disagg: disagg_state.as_ref().map(|(d, _)| d.clone()),
        ranks,
    };
    let mut app = http::router(state.clone()).merge(agentic::router(state));
    if let Some((_, internal)) = disagg_state {
        app = app.merge(disagg::internal_router(internal));
    }
    let app = match &args.api_key {
        Some(key) => http::require_key(app, key.expose()),
        None => app,
    };
    let app = http::engine_server_header(app);
    Ok(BoundWorker {
        listener,
        app,
        bootstrap,
    })
}

async fn serve(args: SimWorkerArgs, tokenizer: Tokenizer) -> anyhow::Result<()> {
    let BoundWorker { listener, app, .. } = bind(&args, tokenizer).await?;
    println!(
        "switchyard sim-worker listening on http://{} (model {})",
        listener.local_addr()?,
        args.model
    );
    // Each token is one small write: without TCP_NODELAY, Nagle's algorithm
    // holds it until the client's (delayed) ACK of the previous one and
    // tokens reach clients in bursts tens of milliseconds apart. Engines'
    // servers (uvicorn under vLLM and SGLang) set it too.
    let listener = listener.tap_io(|tcp| {
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("serving HTTP")
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use switchyard_replica::{NatsAuth, Secret};

    fn parse(flags: &[&str]) -> SimWorkerArgs {
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            args: SimWorkerArgs,
        }
        Cli::try_parse_from(std::iter::once("sim-worker").chain(flags.iter().copied()))
            .unwrap()
            .args
    }

    /// The shared engine flags with the sim-worker's defaults, next to its
    /// own `--model` (a name here, not an architecture).
    #[test]
    fn the_engine_flags_take_the_sim_workers_defaults() {
        let args = parse(&[]);
        assert_eq!(
            args.engine_config(),
            EngineConfig {
                emit_kv_events: false,
                ..EngineConfig::default()
            }
        );
        let args = parse(&[
            "--model",
            "m",
            "--architecture",
            "hybrid",
            "--block-size",
            "32",
            "--kv-events",
            "tcp://127.0.0.1:*",
        ]);
        assert_eq!(args.model, "m");
        let config = args.engine_config();
        assert!(config.hybrid.is_some());
        assert_eq!(config.block_size, 32);
        assert!(config.emit_kv_events);
    }

    #[test]
    fn no_delay_makes_every_step_instant_whatever_the_speedup() {
        assert_eq!(parse(&[]).engine_config().timing.speedup, 1.0);
        assert_eq!(
            parse(&["--speedup", "4"]).engine_config().timing.speedup,
            4.0
        );
        let instant = parse(&["--speedup", "4", "--no-delay"]).engine_config();
        assert_eq!(instant.timing.speedup, 0.0);
        assert_eq!(instant.validate(), Ok(()));
    }

    /// The marks authenticate with `serve`'s `--nats-*` flags, all of them.
    #[test]
    fn the_marks_take_the_routers_nats_flags() {
        assert_eq!(parse(&["--nats-user", "w"]).replica_config(), Ok(None));
        let config = parse(&[
            "--replica-sync",
            "tls://nats.internal:4222",
            "--nats-user",
            "worker",
            "--nats-password",
            "p",
            "--nats-tls-ca",
            "/ca.pem",
            "--nats-require-tls",
        ])
        .replica_config()
        .unwrap()
        .unwrap();
        assert_eq!(
            config.auth,
            NatsAuth {
                user: Some("worker".into()),
                password: Some(Secret("p".into())),
                tls_ca_file: Some("/ca.pem".into()),
                require_tls: true,
                ..NatsAuth::default()
            }
        );
        let refused = parse(&[
            "--replica-sync",
            "nats://127.0.0.1:4222",
            "--nats-token",
            "t",
            "--nats-creds",
            "/w.creds",
        ])
        .replica_config();
        assert!(refused.is_err(), "{refused:?}");
    }
}
