//! `switchyard bench contention`: routing decisions while KV events arrive
//! from several workers at once — how long a decision waits for event
//! application.
//!
//! The router's own shared state ([`switchyard_server::build_driver`], the
//! structure `serve` routes with) holds `workers` workers. `event_workers`
//! threads each play one worker's KV-event stream: a stored chain of
//! `event_blocks` blocks (a quarter of it one of a few shared prefixes),
//! and, once the worker holds `resident` chains, the removal of its oldest,
//! paced at `event_rate` events a second per thread. `routing_threads`
//! measuring threads (one, by default) place requests whose prompts are
//! stored chains (so the overlap lookup walks real paths), time each
//! placement (lookup, selection, booking and the lock around them, as
//! `switchyard_routing_decision_seconds` times it), and free it.
//!
//! Quiet rounds (no event threads) alternate with loaded rounds, so the
//! ratio of their percentiles is the cost of contention on this machine.
//! Where the time of a slow decision goes is read from the placing
//! thread's own context switches around it (`/proc/thread-self/status`,
//! Linux): a voluntary switch means it slept waiting for a lock, an
//! involuntary one that the scheduler preempted it for another thread;
//! decisions with neither are timed apart ("uninterrupted"). Last, a fixed
//! computation as long as the median quiet decision is timed the same way:
//! the machine's own tail for work of that length, the floor under the
//! decisions' p99.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use switchyard_commands::stats::{write_json, Latency};
use switchyard_core::index::{CacheTier, IndexEvent, StoredBlock};
use switchyard_core::{EngineHash, LocalHash, WorkerId};
use switchyard_server::driver::booking::WaitHandle;
use switchyard_server::driver::{Driver, Request};
use switchyard_server::ServerConfig;

/// Options of `bench contention`.
#[derive(Debug, Clone, clap::Args)]
pub struct ContentionArgs {
    /// Workers in the router.
    #[arg(long, default_value_t = 64)]
    pub workers: usize,
    /// Workers whose KV events are applied concurrently (one thread each).
    #[arg(long, default_value_t = 8)]
    pub event_workers: usize,
    /// KV events per second per event thread.
    #[arg(long, default_value_t = 1000)]
    pub event_rate: u32,
    /// Blocks per stored chain.
    #[arg(long, default_value_t = 64)]
    pub event_blocks: usize,
    /// Chains each worker holds before it starts removing its oldest.
    #[arg(long, default_value_t = 256)]
    pub resident: usize,
    /// Timed placements per round.
    #[arg(long, default_value_t = 20_000)]
    pub decisions: usize,
    /// Threads placing requests at once (each books and frees its own,
    /// so with more than one, decisions also meet each other's bookings).
    #[arg(long, default_value_t = 1)]
    pub routing_threads: usize,
    /// Rounds of each kind (quiet, loaded), alternating.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Write the figures as JSON here.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write every timed decision here, in the order they were made, as
    /// CSV (`round,decision,micros,interruption`): where the slow ones
    /// fall (every n-th decision, in bursts, at random).
    #[arg(long)]
    pub samples: Option<PathBuf>,
}

#[derive(Debug, Serialize)]
struct Figures {
    workers: usize,
    event_workers: usize,
    event_rate: u32,
    routing_threads: usize,
    quiet: Decisions,
    loaded: Decisions,
    events_applied_per_sec: f64,
    event_apply_micros: Latency,
    /// A fixed computation as long as the median quiet decision, timed the
    /// same way on one thread with nothing else of ours running: the tail
    /// this machine adds to any work of that length (interrupts, the
    /// hypervisor, other tenants), which no change to the router removes.
    floor_micros: Latency,
    /// Decisions whose route was made before the routing lock and used
    /// (`switchyard_pre_routes_used_total`), and those made again under it.
    pre_routes_used: u64,
    pre_routes_rerouted: u64,
}

/// `iters` steps of a dependent floating-point chain: fixed work, no
/// memory, no locks.
fn spin(iters: u64) -> f64 {
    let mut a = 1.0f64;
    for _ in 0..iters {
        a = std::hint::black_box(a * 1.000_000_1 + 0.5);
    }
    a
}

/// Times `n` runs of [`spin`] calibrated to take about `micros`, each
/// between the same `/proc` reads a decision sits between.
fn machine_floor(micros: f64, n: usize) -> Latency {
    let time = |iters| {
        let start = Instant::now();
        std::hint::black_box(spin(iters));
        start.elapsed().as_secs_f64() * 1e6
    };
    // Calibrate on the quickest of a few runs of a long chain.
    let probe = 100_000;
    let per_iter = (0..5).map(|_| time(probe)).fold(f64::INFINITY, f64::min) / probe as f64;
    let iters = (micros / per_iter.max(1e-6)).round().max(1.0) as u64;
    let mut samples: Vec<f64> = (0..n)
        .map(|_| {
            let _ = context_switches();
            let t = time(iters);
            let _ = context_switches();
            t
        })
        .collect();
    Latency::of(&mut samples)
}

/// The local hashes of chain `n` of prefix group `group`.
fn chain(group: u64, n: u64, blocks: usize) -> Vec<LocalHash> {
    let shared = blocks / 4;
    (0..blocks as u64)
        .map(|i| {
            if (i as usize) < shared {
                LocalHash(0x5EED_0000_0000 | (group << 16) | i)
            } else {
                LocalHash((n << 20) | i | (1 << 63))
            }
        })
        .collect()
}

fn stored(hashes: &[LocalHash], worker: usize) -> IndexEvent {
    IndexEvent::Stored {
        parent: None,
        blocks: hashes
            .iter()
            .map(|h| StoredBlock {
                engine_hash: EngineHash(h.0 ^ (worker as u64) << 48),
                local_hash: *h,
            })
            .collect(),
    }
}

/// One worker's event stream until `stop`; returns the apply times (µs).
fn play_events(
    shared: Arc<Driver>,
    worker: WorkerId,
    slot: usize,
    args: ContentionArgs,
    stop: Arc<AtomicBool>,
    applied: Arc<AtomicU64>,
) -> Vec<f64> {
    let mut rng = StdRng::seed_from_u64(slot as u64);
    let epoch = shared.events_epoch(worker).unwrap_or(0);
    let period = Duration::from_secs_f64(1.0 / f64::from(args.event_rate.max(1)));
    let mut resident = std::collections::VecDeque::new();
    let mut times = Vec::new();
    let mut next = Instant::now();
    let mut n = (slot as u64) << 32;
    while !stop.load(Ordering::Relaxed) {
        let event = if resident.len() >= args.resident && rng.gen_bool(0.5) {
            let old: Vec<LocalHash> = resident.pop_front().unwrap_or_default();
            IndexEvent::Removed {
                blocks: old
                    .iter()
                    .map(|h| EngineHash(h.0 ^ (slot as u64) << 48))
                    .collect(),
            }
        } else {
            n += 1;
            let hashes = chain(rng.gen_range(0..4), n, args.event_blocks);
            let event = stored(&hashes, slot);
            resident.push_back(hashes);
            event
        };
        let start = Instant::now();
        shared.apply_worker_event(worker, epoch, CacheTier::Device, &event);
        times.push(start.elapsed().as_secs_f64() * 1e6);
        applied.fetch_add(1, Ordering::Relaxed);
        next += period;
        if let Some(wait) = next.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
    }
    times
}

/// What happened to a placing thread during one decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Interruption {
    /// Neither slept nor was preempted.
    None,
    /// Slept (a voluntary context switch: it waited for a lock).
    Slept,
    /// Preempted by the scheduler (an involuntary one), and maybe slept too.
    Preempted,
}

/// The calling thread's context switches so far: (voluntary,
/// involuntary), from `/proc/thread-self/status`. Zeros where there is no
/// such file (not Linux).
fn context_switches() -> (u64, u64) {
    let Ok(status) = std::fs::read_to_string("/proc/thread-self/status") else {
        return (0, 0);
    };
    let count = |key: &str| {
        status
            .lines()
            .find_map(|line| line.strip_prefix(key))
            .and_then(|rest| rest.trim().parse().ok())
            .unwrap_or(0)
    };
    (
        count("voluntary_ctxt_switches:"),
        count("nonvoluntary_ctxt_switches:"),
    )
}

/// One timed placement.
#[derive(Debug, Clone, Copy)]
struct Sample {
    micros: f64,
    interruption: Interruption,
}

/// Places `n` requests one after another on this thread; returns their
/// times.
fn place_on_thread(
    shared: &Arc<Driver>,
    n: usize,
    blocks: usize,
    seed: u64,
) -> anyhow::Result<Vec<Sample>> {
    // The placement is handed over inside `submit` when a worker can take
    // the request at once (always here); the runtime only reads it.
    let runtime = tokio::runtime::Builder::new_current_thread().build()?;
    let mut rng = StdRng::seed_from_u64(seed);
    let mut samples = Vec::with_capacity(n);
    for _ in 0..n {
        let hashes = chain(rng.gen_range(0..4), rng.gen_range(1..2000), blocks);
        let request = Request {
            blocks: hashes,
            prompt_tokens: (blocks * 16) as u32,
            session: None,
            model: None,
            adapter: None,
            settings: Default::default(),
            flow: Default::default(),
            pinned: None,
        };
        let id = shared.next_request_id();
        let (slept, preempted) = context_switches();
        let start = Instant::now();
        let handle = WaitHandle::submit(shared, id, request)
            .map_err(|e| anyhow::anyhow!("submit refused: {e:?}"))?;
        let micros = start.elapsed().as_secs_f64() * 1e6;
        let (slept_after, preempted_after) = context_switches();
        let interruption = if preempted_after > preempted {
            Interruption::Preempted
        } else if slept_after > slept {
            Interruption::Slept
        } else {
            Interruption::None
        };
        samples.push(Sample {
            micros,
            interruption,
        });
        let mut booking = runtime
            .block_on(handle.placed())
            .map_err(|_| anyhow::anyhow!("no worker took a request"))?;
        booking.completed(u64::from(blocks as u32 * 16 + 1));
    }
    Ok(samples)
}

/// Places `n` requests from `threads` threads at once (`n / threads`
/// each); returns all their times.
fn place(
    shared: &Arc<Driver>,
    n: usize,
    blocks: usize,
    threads: usize,
    rng: &mut StdRng,
) -> anyhow::Result<Vec<Sample>> {
    let threads = threads.max(1);
    let handles: Vec<_> = (0..threads)
        .map(|_| {
            let (shared, seed) = (shared.clone(), rng.gen());
            std::thread::spawn(move || place_on_thread(&shared, n / threads, blocks, seed))
        })
        .collect();
    let mut samples = Vec::with_capacity(n);
    for handle in handles {
        samples.extend(
            handle
                .join()
                .map_err(|_| anyhow::anyhow!("a placing thread panicked"))??,
        );
    }
    Ok(samples)
}

/// Decisions summarized: all of them, the uninterrupted ones, and the
/// shares that slept or were preempted.
#[derive(Debug, Serialize)]
struct Decisions {
    all_micros: Latency,
    uninterrupted_micros: Latency,
    slept_share: f64,
    preempted_share: f64,
}

impl Decisions {
    fn of(samples: &[Sample]) -> Self {
        let share = |kind| {
            samples.iter().filter(|s| s.interruption == kind).count() as f64
                / samples.len().max(1) as f64
        };
        let mut all: Vec<f64> = samples.iter().map(|s| s.micros).collect();
        let mut clean: Vec<f64> = samples
            .iter()
            .filter(|s| s.interruption == Interruption::None)
            .map(|s| s.micros)
            .collect();
        Self {
            all_micros: Latency::of(&mut all),
            uninterrupted_micros: Latency::of(&mut clean),
            slept_share: share(Interruption::Slept),
            preempted_share: share(Interruption::Preempted),
        }
    }
}

/// Runs the benchmark.
pub fn run(args: ContentionArgs) -> anyhow::Result<()> {
    use anyhow::Context;
    // Opened first: a path that cannot be written fails before the run.
    let samples_file = args
        .samples
        .as_ref()
        .map(|path| {
            std::fs::File::create(path).with_context(|| format!("writing {}", path.display()))
        })
        .transpose()?;
    // Exact tracking: the index is the workers' KV events, as with
    // `events=` on every worker.
    let config = ServerConfig {
        cache: switchyard_server::config::CacheMode::Events,
        ..ServerConfig::default()
    };
    let metrics = Arc::new(switchyard_server::metrics::ServerMetrics::new(
        config.policy.name(),
    ));
    let shared = Arc::new(switchyard_server::build_driver(&config, metrics.clone())?);
    let workers: Vec<WorkerId> = (0..args.workers.max(1))
        .map(|i| {
            let id = shared
                .add_worker(&format!("w{i}"), &format!("http://w{i}.invalid:1"))
                .map_err(|e| anyhow::anyhow!(e))?;
            shared.set_in_router(id, true);
            Ok(id)
        })
        .collect::<anyhow::Result<_>>()?;
    // Warm the index: each event worker's resident chains.
    for (slot, &worker) in workers.iter().take(args.event_workers).enumerate() {
        let epoch = shared.events_epoch(worker).unwrap_or(0);
        for n in 0..args.resident as u64 {
            let hashes = chain(n % 4, (1 << 40) | n, args.event_blocks);
            shared.apply_worker_event(worker, epoch, CacheTier::Device, &stored(&hashes, slot));
        }
    }
    let mut rng = StdRng::seed_from_u64(7);
    let (mut quiet, mut loaded, mut applies) = (Vec::new(), Vec::new(), Vec::new());
    let mut loaded_secs = 0.0;
    let applied = Arc::new(AtomicU64::new(0));
    let round = |rng: &mut StdRng| {
        place(
            &shared,
            args.decisions,
            args.event_blocks,
            args.routing_threads,
            rng,
        )
    };
    for _ in 0..args.rounds.max(1) {
        quiet.extend(round(&mut rng)?);
        let stop = Arc::new(AtomicBool::new(false));
        let threads: Vec<_> = workers
            .iter()
            .take(args.event_workers)
            .enumerate()
            .map(|(slot, &worker)| {
                let (shared, args, stop, applied) =
                    (shared.clone(), args.clone(), stop.clone(), applied.clone());
                std::thread::spawn(move || play_events(shared, worker, slot, args, stop, applied))
            })
            .collect();
        let started = Instant::now();
        loaded.extend(round(&mut rng)?);
        loaded_secs += started.elapsed().as_secs_f64();
        stop.store(true, Ordering::Relaxed);
        for thread in threads {
            applies.extend(
                thread
                    .join()
                    .map_err(|_| anyhow::anyhow!("an event thread panicked"))?,
            );
        }
    }
    let quiet_figures = Decisions::of(&quiet);
    let floor_micros = machine_floor(quiet_figures.all_micros.p50, args.decisions);
    let figures = Figures {
        workers: args.workers,
        event_workers: args.event_workers,
        event_rate: args.event_rate,
        routing_threads: args.routing_threads.max(1),
        quiet: quiet_figures,
        loaded: Decisions::of(&loaded),
        events_applied_per_sec: applied.load(Ordering::Relaxed) as f64 / loaded_secs.max(1e-9),
        event_apply_micros: Latency::of(&mut applies),
        floor_micros,
        pre_routes_used: metrics.pre_routes_used.get(),
        pre_routes_rerouted: metrics.pre_routes_rerouted.get(),
    };
    println!(
        "{} workers; {} event threads at {} events/s each ({:.0} events/s applied while loaded); {} routing thread(s)",
        figures.workers,
        figures.event_workers,
        figures.event_rate,
        figures.events_applied_per_sec,
        figures.routing_threads
    );
    println!("{:<44} {:>8} {:>8} {:>8}", "(µs)", "p50", "p90", "p99");
    for (name, l) in [
        ("routing decision, quiet", &figures.quiet.all_micros),
        ("  uninterrupted", &figures.quiet.uninterrupted_micros),
        (
            "routing decision, under KV events",
            &figures.loaded.all_micros,
        ),
        ("  uninterrupted", &figures.loaded.uninterrupted_micros),
        (
            "fixed work as long as a median decision",
            &figures.floor_micros,
        ),
        (
            "KV event application (with lock wait)",
            &figures.event_apply_micros,
        ),
    ] {
        println!("{name:<44} {:>8.2} {:>8.2} {:>8.2}", l.p50, l.p90, l.p99);
    }
    for (name, d) in [
        ("quiet", &figures.quiet),
        ("under KV events", &figures.loaded),
    ] {
        println!(
            "decisions {name}: {:.2}% slept on a lock, {:.2}% preempted",
            d.slept_share * 100.0,
            d.preempted_share * 100.0
        );
    }
    println!(
        "routed before the routing lock: {} decisions used that route, {} were routed again under it",
        figures.pre_routes_used, figures.pre_routes_rerouted
    );
    println!(
        "loaded / quiet: p50 {:.2}x, p99 {:.2}x",
        figures.loaded.all_micros.p50 / figures.quiet.all_micros.p50,
        figures.loaded.all_micros.p99 / figures.quiet.all_micros.p99
    );
    if let Some(path) = &args.json {
        write_json(path, &figures)?;
    }
    if let (Some(file), Some(path)) = (samples_file, &args.samples) {
        // Each placing thread makes `decisions / threads` of a round's.
        let threads = args.routing_threads.max(1);
        write_samples(file, &quiet, &loaded, args.decisions / threads * threads)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    Ok(())
}

/// The raw samples as CSV; rounds are numbered in the order they ran
/// (quiet and loaded alternate, quiet first).
fn write_samples(
    file: std::fs::File,
    quiet: &[Sample],
    loaded: &[Sample],
    per_round: usize,
) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(file);
    writeln!(out, "round,decision,micros,interruption")?;
    let per_round = per_round.max(1);
    let rounds = quiet.chunks(per_round).zip(loaded.chunks(per_round));
    for (n, (quiet, loaded)) in rounds.enumerate() {
        for (round, samples) in [(2 * n, quiet), (2 * n + 1, loaded)] {
            for (i, s) in samples.iter().enumerate() {
                let interruption = match s.interruption {
                    Interruption::None => "none",
                    Interruption::Slept => "slept",
                    Interruption::Preempted => "preempted",
                };
                writeln!(out, "{round},{i},{:.3},{interruption}", s.micros)?;
            }
        }
    }
    out.flush()
}
