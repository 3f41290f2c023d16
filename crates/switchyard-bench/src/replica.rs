//! `switchyard bench replica`: the replica plane over a local NATS server.
//!
//! Two replicas (each a core `Dispatcher` with its own NATS connection,
//! publisher and subscriber) in one process. Replica A publishes the plane's
//! traffic directly — the add, mark and free a replica publishes for each
//! request — so the figures are the plane's alone (the request path that
//! produces these events is measured by `bench proxy` and `bench twin`):
//!
//! - throughput: A publishes `--requests` requests' events (three each) as
//!   fast as its queue takes them; replica B applies them. `events_per_sec`
//!   is events applied on B over the time from the first enqueue to the
//!   last apply; `published_per_sec` the same for A's publishing;
//! - visibility latency: `--probes` bookings from A, one at a time, each
//!   timed from just before the enqueue on A until B has applied it (batch
//!   delay included: a lone event waits up to `batch_max_delay_ms`).
//!
//! Starts its own `nats-server` (the Debian package) unless `--nats` names one.

use anyhow::Context as _;
use serde::Serialize;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use switchyard_commands::stats::{write_json, Latency};
use switchyard_core::dispatch::{Dispatcher, DispatcherConfig};
use switchyard_core::router::WorkerCapacity;
use switchyard_core::sequences::AddRequest;
use switchyard_core::{LocalHash, ReplicaId, RequestId, WorkerId};
use switchyard_replica::{
    DispatcherSink, LocalNatsServer, NatsTransport, ReplicaConfig, ReplicaPlane,
};

/// Workload parameters.
#[derive(Clone, Debug, Serialize, clap::Args)]
pub struct ReplicaArgs {
    /// A running NATS server; by default a private `nats-server` is started.
    #[arg(long)]
    pub nats: Option<String>,
    /// Requests in the throughput run (three events each).
    #[arg(long, default_value_t = 200_000)]
    pub requests: u64,
    /// Prompt blocks per booking.
    #[arg(long, default_value_t = 8)]
    pub blocks: u64,
    /// Workers the bookings spread over.
    #[arg(long, default_value_t = 8)]
    pub workers: u64,
    /// Bookings timed one at a time for visibility latency.
    #[arg(long, default_value_t = 2_000)]
    pub probes: usize,
    /// Most events per batch.
    #[arg(long, default_value_t = 128)]
    pub batch_max_events: usize,
    /// Longest wait for a batch to fill, ms.
    #[arg(long, default_value_t = 1.0)]
    pub batch_max_delay_ms: f64,
    /// Write the figures as JSON here.
    #[arg(long)]
    #[serde(skip)]
    pub json: Option<PathBuf>,
}

/// The figures.
#[derive(Clone, Debug, Serialize)]
pub struct ReplicaReport {
    /// Events applied on the peer per second (throughput run).
    pub events_per_sec: f64,
    /// Events published per second (throughput run).
    pub published_per_sec: f64,
    /// Events in the throughput run.
    pub events: u64,
    /// Events dropped anywhere (should be zero: the run paces itself).
    pub dropped: u64,
    /// Batches published in the throughput run.
    pub batches: u64,
    /// Booking on A → applied on B, µs.
    pub visibility_us: Latency,
    /// The parameters.
    pub workload: ReplicaArgs,
}

/// Runs the benchmark and prints the figures.
pub fn run(args: ReplicaArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let report = runtime.block_on(measure(&args))?;
    println!(
        "replica plane over NATS: {} events ({} requests x 3, {} blocks each)",
        report.events, args.requests, args.blocks
    );
    println!(
        "  applied on the peer: {:.0} events/s; published: {:.0} events/s; {} batches; {} dropped",
        report.events_per_sec, report.published_per_sec, report.batches, report.dropped
    );
    let v = report.visibility_us;
    println!(
        "  booking -> visible on the peer: p50 {:.0} us, p90 {:.0} us, p99 {:.0} us (mean {:.0} us, {} probes)",
        v.p50, v.p90, v.p99, v.mean, args.probes
    );
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

/// A replica's dispatcher over `workers` workers, as the plane's sink.
fn sink(workers: u64, id: ReplicaId, epoch: Instant) -> DispatcherSink {
    let mut dispatcher =
        Dispatcher::new(DispatcherConfig::default(), None).expect("default config validates");
    for w in 0..workers {
        let _ = dispatcher.add_worker(WorkerId::new(w), WorkerCapacity::default(), 0.0);
    }
    // Nothing waits in either dispatcher: a peer's batch places nothing.
    DispatcherSink::new(Arc::new(Mutex::new(dispatcher)), id, epoch, Box::new(drop))
}

fn booking(id: u64, args: &ReplicaArgs) -> AddRequest {
    AddRequest {
        request: RequestId(id as u128),
        worker: WorkerId::new(id % args.workers.max(1)),
        prompt_tokens: (args.blocks * 16) as u32,
        blocks: (0..args.blocks)
            .map(|b| LocalHash(id.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ b))
            .collect(),
        overlap_blocks: 0,
        expected_prefill_ms: None,
    }
}

async fn measure(args: &ReplicaArgs) -> anyhow::Result<ReplicaReport> {
    let server = match &args.nats {
        Some(_) => None,
        None => Some(LocalNatsServer::start()?),
    };
    let url = args
        .nats
        .clone()
        .or_else(|| server.as_ref().map(LocalNatsServer::url))
        .expect("a URL or a server");
    let config = ReplicaConfig {
        nats_url: Some(url.clone()),
        endpoint: "bench".into(),
        batch_max_events: args.batch_max_events,
        batch_max_delay_ms: args.batch_max_delay_ms,
        ..ReplicaConfig::default()
    };
    config.validate()?;
    let epoch = Instant::now();
    let (id_a, id_b) = (ReplicaId(0xa), ReplicaId(0xb));
    let connect = || async {
        NatsTransport::connect(&url)
            .await
            .with_context(|| format!("connecting to {url}"))
    };
    let a = ReplicaPlane::start(
        Arc::new(connect().await?),
        &config,
        id_a,
        sink(args.workers, id_a, epoch),
    )
    .await?;
    let b = ReplicaPlane::start(
        Arc::new(connect().await?),
        &config,
        id_b,
        sink(args.workers, id_b, epoch),
    )
    .await?;

    // Throughput: book, mark, free; pace so the queue never overflows.
    let events = args.requests * 3;
    let window = (config.queue_capacity as u64).saturating_sub(1024).max(1);
    let start = Instant::now();
    let mut enqueued = 0u64;
    for id in 0..args.requests {
        let add = booking(id, args);
        while enqueued - a.metrics.published.get() + 3 > window {
            tokio::task::yield_now().await;
        }
        let _ = a.publisher.added(&add, None);
        let _ = a.publisher.prefill_completed(add.request, add.worker);
        let _ = a.publisher.freed(add.request, add.worker);
        enqueued += 3;
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut published_at = None;
    loop {
        let m = a.metrics.snapshot();
        if published_at.is_none() && m.published + m.dropped >= events {
            published_at = Some(start.elapsed());
        }
        if b.metrics.applied.get() >= events - m.dropped {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the peer applied {} of {events} events in 120 s",
            b.metrics.applied.get()
        );
        tokio::time::sleep(Duration::from_micros(200)).await;
    }
    let applied_in = start.elapsed();
    let published_in = published_at.unwrap_or(applied_in);
    let throughput = a.metrics.snapshot();

    // Visibility latency, one booking at a time.
    let mut samples = Vec::with_capacity(args.probes);
    for probe in 0..args.probes as u64 {
        let add = booking(args.requests + probe, args);
        let before = b.metrics.applied.get();
        let t0 = Instant::now();
        let _ = a.publisher.added(&add, None);
        while b.metrics.applied.get() == before {
            anyhow::ensure!(t0.elapsed() < Duration::from_secs(10), "a probe was lost");
            tokio::task::yield_now().await;
        }
        samples.push(t0.elapsed().as_secs_f64() * 1e6);
        let _ = a.publisher.freed(add.request, add.worker);
        // Let the free land before the next probe.
        let target = before + 2;
        while b.metrics.applied.get() < target {
            anyhow::ensure!(t0.elapsed() < Duration::from_secs(10), "a free was lost");
            tokio::task::yield_now().await;
        }
    }
    a.shutdown().await;
    b.shutdown().await;
    Ok(ReplicaReport {
        events_per_sec: events as f64 / applied_in.as_secs_f64(),
        published_per_sec: events as f64 / published_in.as_secs_f64(),
        events,
        dropped: throughput.dropped,
        batches: throughput.batches_published,
        visibility_us: Latency::of(&mut samples),
        workload: args.clone(),
    })
}
