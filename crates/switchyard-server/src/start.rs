//! Start-up and shutdown: the dispatcher and shared state built from a
//! [`ServerConfig`], the front door put together, the background tasks
//! (health rounds, KV-event subscribers, discovery, replica sync) started,
//! and the listener served until shutdown drains it.

use crate::{
    adapters, config, discovery, driver, fleet, front, metrics, replica, routes, tokenize,
    ServeArgs, ServerConfig,
};
use anyhow::Context as _;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use switchyard_core::admission::{AdmissionConfig, AdmissionStrategy, SessionAwareStrategy};
use switchyard_core::dispatch::{Dispatcher, DispatcherConfig};
use switchyard_core::index::ApproxConfig;
use switchyard_core::router::CacheTracking;
use switchyard_core::sequences::SequencesConfig;
use switchyard_core::RouterConfig;
use switchyard_tokenizer::Tokenizer;

/// Runs `switchyard serve` until Ctrl-C or SIGTERM.
pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    let config = args.to_config()?;
    init_logging(config.log_json);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the tokio runtime")?;
    let scheme = if config.tls_cert.is_some() {
        "https"
    } else {
        "http"
    };
    runtime.block_on(async move {
        let server = start(config).await?;
        println!("switchyard serve listening on {scheme}://{}", server.addr);
        shutdown_signal().await;
        tracing::info!("shutting down: draining in-flight requests");
        server.shutdown().await
    })
}

/// Installs the `tracing` subscriber (`RUST_LOG` filters; default `info`).
pub fn init_logging(json: bool) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending::<()>().await } } => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
}

/// A router running on the current tokio runtime.
#[derive(Debug)]
pub struct RunningServer {
    /// The bound address.
    pub addr: SocketAddr,
    /// Routing state (for in-process inspection).
    pub driver: Arc<driver::Driver>,
    stop: tokio::sync::watch::Sender<bool>,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
    background: Vec<tokio::task::JoinHandle<()>>,
    grace: Duration,
    replica: Option<switchyard_replica::ReplicaPlane>,
    inflight: Arc<front::inflight::Inflight>,
}

impl RunningServer {
    /// Stops accepting and lets in-flight requests finish for up to the
    /// grace period (`--shutdown-timeout-ms`); then cancels the rest —
    /// queued requests get a 503, streams a final SSE error event, and
    /// their upstream requests and bookings are dropped — and waits a
    /// little for those last bytes before stopping the background tasks.
    pub async fn shutdown(self) -> anyhow::Result<()> {
        /// Time for cancelled responses to flush their last frame.
        const FLUSH: Duration = Duration::from_secs(2);
        let _ = self.stop.send(true);
        let mut task = self.task;
        let result = match tokio::time::timeout(self.grace, &mut task).await {
            Ok(joined) => joined.context("server task")?.context("serving HTTP"),
            Err(_) => {
                let cancelled = self.inflight.current();
                tracing::warn!(
                    cancelled,
                    "shutdown deadline passed: cancelling in-flight requests"
                );
                self.inflight.cancel();
                match tokio::time::timeout(FLUSH, &mut task).await {
                    Ok(joined) => joined.context("server task")?.context("serving HTTP"),
                    Err(_) => {
                        task.abort();
                        Ok(())
                    }
                }
            }
        };
        for t in self.background {
            t.abort();
        }
        if let Some(plane) = self.replica {
            // The drained requests' frees go out before the plane stops.
            plane.flush(Duration::from_millis(500)).await;
            plane.shutdown().await;
        }
        result
    }
}

/// The dispatcher settings of `config` (already validated).
pub fn dispatcher_config(config: &ServerConfig) -> DispatcherConfig {
    let cache = if config.uses_events() {
        CacheTracking::Events
    } else {
        CacheTracking::Approximate(ApproxConfig::default())
    };
    let mut router = RouterConfig {
        policy: config.policy,
        policies: config.policies,
        sequences: SequencesConfig {
            block_size: config.block_size,
            expiry_ms: sequence_expiry_ms(config),
        },
        cache,
        busy_threshold: config.busy_threshold,
        max_index_blocks_per_worker: config.max_index_blocks_per_worker,
        // Replicas must not break cost ties in lockstep (they would all
        // pick the same worker until the sync catches up): with replica
        // sync on, each process mixes fresh entropy into its seed.
        seed: if config.replica.enabled() {
            config.seed ^ switchyard_replica::random_replica_id().0
        } else {
            config.seed
        },
        ..RouterConfig::default()
    };
    router.remote.silence_expiry_ms = config.replica.silence_expiry_ms;
    router.remote.max_bookings_per_replica = config.replica.max_bookings_per_peer;
    router.remote.max_sessions_per_replica = config.replica.max_sessions_per_peer;
    router.remote.max_bytes_per_replica = config.replica.max_bytes_per_peer;
    router.remote.max_total_bytes = config.replica.max_peer_bytes_total;
    router.adapters.load_ms = config.adapter_load_ms;
    DispatcherConfig {
        router,
        admission: AdmissionConfig {
            flow: config.flow.clone(),
            ..config.queue.clone()
        },
        estimator: config.estimator,
        circuit: config.circuit,
        ..DispatcherConfig::default()
    }
}

/// The router's driver for `config`: its dispatcher (with the
/// configured admission strategy) and no workers yet.
pub fn build_driver(
    config: &ServerConfig,
    metrics: Arc<metrics::ServerMetrics>,
) -> anyhow::Result<driver::Driver> {
    let strategy: Option<Box<dyn AdmissionStrategy + Send>> = match config.admission {
        config::AdmissionMode::None => None,
        config::AdmissionMode::SessionAware => Some(Box::new(
            SessionAwareStrategy::new(config.session).context("invalid session settings")?,
        )),
    };
    let dispatcher = Dispatcher::new(dispatcher_config(config), strategy)
        .context("invalid routing configuration")?;
    Ok(driver::Driver::new(dispatcher, metrics).with_adapters(
        adapters::Adapters::new(&config.adapters)
            .with_base_models(config.models.iter().map(|m| m.name.as_str())),
    ))
}

/// How long a booking may stay in the load view before the router
/// presumes it leaked and frees it: the request timeout plus a minute, and
/// never less than the core's default. The expiry is a safety net for
/// bookings whose end was never seen; every request the server handles
/// ends (and is freed) by its request timeout at the latest, so a shorter
/// expiry would drop long streams that are still running from the load
/// the selector sees. The minute covers the time between the timeout
/// firing and the booking's guard being dropped.
fn sequence_expiry_ms(config: &ServerConfig) -> f64 {
    const MARGIN_MS: f64 = 60_000.0;
    (config.request_timeout_secs * 1e3 + MARGIN_MS).max(SequencesConfig::default().expiry_ms)
}

/// Whether the router would serve anyone who can reach `addr`: it listens
/// beyond loopback and requires no client key (warned about at startup).
pub(crate) fn open_beyond_loopback(addr: SocketAddr, config: &ServerConfig) -> bool {
    !addr.ip().is_loopback() && !config.requires_client_key()
}

/// Whether `/metrics` is open to anyone while `/v1/*` needs a client key
/// (warned about at startup: the metrics name the workers and the keys and
/// count each key's requests).
pub(crate) fn metrics_open_while_keyed(config: &ServerConfig) -> bool {
    config.requires_client_key() && config.metrics_key.is_none()
}

/// Starts the router: binds, adds the workers, starts health checks and
/// the admission ticker.
pub async fn start(config: ServerConfig) -> anyhow::Result<RunningServer> {
    config.validate()?;
    let tokenizer = match &config.tokenizer_dir {
        Some(dir) => Tokenizer::from_dir(dir),
        None => Tokenizer::bundled(),
    }
    .context("loading the tokenizer")?
    .with_segment_cache(config.token_cache_ids);
    start_with_tokenizer(config, Arc::new(tokenize::HfTokenizer(tokenizer))).await
}

/// [`start`] with a given tokenizer (shared between in-process routers).
pub async fn start_with_tokenizer(
    mut config: ServerConfig,
    tokenizer: Arc<dyn tokenize::PromptTokenizer>,
) -> anyhow::Result<RunningServer> {
    config.validate()?;
    config.load_secret_files()?;
    let sources =
        discovery::Sources::new(&config).map_err(|e| anyhow::anyhow!("worker discovery: {e}"))?;
    let metrics = Arc::new(metrics::ServerMetrics::new(config.policy.name()));
    let driver = Arc::new(build_driver(&config, metrics.clone())?);
    let inflight = front::inflight::Inflight::new(config.max_inflight, metrics);
    let replica_plane = match config.replica.enabled() {
        false => None,
        true => Some(
            replica::start(&config.replica, &driver)
                .await
                .context("starting replica sync")?,
        ),
    };
    let worker_tls = front::tls::WorkerTls {
        ca_file: config.worker_ca_file.clone(),
        client_cert: config
            .worker_client_cert
            .clone()
            .zip(config.worker_client_key.clone()),
    }
    .client_config()
    .context("TLS to workers")?;
    let client =
        crate::upstream::client_with(Duration::from_millis(config.connect_timeout_ms), worker_tls);
    let interval = Duration::from_millis(config.health_interval_ms);
    let fleet = Arc::new(
        fleet::Fleet::new(
            driver.clone(),
            client.clone(),
            config.uses_events(),
            config.block_size,
            config.health_failures,
            interval.clamp(Duration::from_millis(100), Duration::from_secs(2)),
        )
        .with_worker_auth(crate::state::worker_authorization(&config))
        .with_disagg(config.disagg.is_some())
        .with_models(&config.models),
    );
    for spec in &config.workers {
        fleet
            .add(spec)
            .map_err(|e| anyhow::anyhow!("worker {}: {e}", spec.url))?;
    }
    let router_id = replica_plane
        .as_ref()
        .and_then(|p| axum::http::HeaderValue::from_str(&p.id.to_string()).ok());
    let mut state = crate::state::AppState::new(
        &config,
        driver.clone(),
        fleet.clone(),
        client,
        tokenizer,
        router_id,
    );
    // After the state: its models are what entering workers' tokenizers
    // are checked against.
    fleet.check_all().await;
    let discovery_metrics = Arc::new(discovery::DiscoveryMetrics::default());
    discovery_metrics.register(&mut state.registry);
    let state = Arc::new(state);
    let addr: SocketAddr = format!("{}:{}", config.host, config.port)
        .parse()
        .with_context(|| format!("bad host/port {}:{}", config.host, config.port))?;
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let addr = listener.local_addr()?;
    if open_beyond_loopback(addr, &config) {
        tracing::warn!(%addr, "listening beyond loopback with no API key: anyone who can reach this address can use the workers (set --api-key or --api-key-file)");
    }
    if metrics_open_while_keyed(&config) {
        tracing::warn!(%addr, "client API keys are required but /metrics is open: anyone who can reach this address can read the workers' names, the keys' names and each key's request counts (set --metrics-key or --metrics-key-file)");
    }
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let app = routes::front_door(&state, inflight.clone());
    let front_tls = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => Some(
            front::tls::FrontTls {
                cert: cert.clone(),
                key: key.clone(),
                client_ca: config.tls_client_ca_file.clone(),
            }
            .acceptor()
            .context("TLS on the front door")?,
        ),
        _ => None,
    };
    let limits = front::accept::ConnectionLimits {
        max_connections: config.max_connections,
        header_read_timeout: Duration::from_millis(config.header_read_timeout_ms),
        send_timeout: config.send_timeout(),
    };
    let task = tokio::spawn(front::accept::serve(
        listener,
        app,
        limits,
        front_tls,
        driver.metrics().clone(),
        stopped,
    ));
    let mut background = sources.spawn(&fleet, &discovery_metrics);
    let health = tokio::spawn(fleet.clone().run_health_checks(interval));
    let ticker_state = driver.clone();
    let ticker = tokio::spawn(async move {
        loop {
            let now = ticker_state.now_ms();
            // The dispatcher's own wake-up (reconcile, recheck, cooldown,
            // expiry sweep), at least 1 ms and at most 1 s ahead.
            let wait_ms = (ticker_state.next_wakeup_ms() - now).clamp(1.0, 1000.0);
            tokio::time::sleep(Duration::from_secs_f64(wait_ms / 1e3)).await;
            ticker_state.tick();
        }
    });
    background.extend([health, ticker]);
    tracing::info!(%addr, policy = config.policy.name(), workers = config.workers.len(), discovery = config.discovery.enabled(), events = config.uses_events(), replica = ?replica_plane.as_ref().map(|p| p.id.to_string()), "router started");
    Ok(RunningServer {
        addr,
        driver,
        stop,
        task,
        background,
        grace: Duration::from_millis(config.shutdown_grace_ms),
        replica: replica_plane,
        inflight,
    })
}
