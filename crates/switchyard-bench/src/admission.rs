//! `switchyard bench admission`: the admission layer's hot paths.
//!
//! - `progress_update_ns` / `progress_read_ns`: one live-progress update and
//!   one read, averaged over a long loop (a single call is below the
//!   timer's resolution);
//! - `admit_event_median_ns`: `admit` plus one `on_event` (`Dispatched`) of
//!   the session-aware strategy with `--sessions` sessions retained, timed
//!   one pair at a time (timer overhead included, reported separately);
//! - `turn_cycle`: admit + dispatched + completed, for context;
//! - `bytes_per_session`: the strategy's heap estimate divided by sessions.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;
use switchyard_commands::stats::{rss_bytes, write_json, Latency};
use switchyard_core::admission::{
    progress_pair, AdmissionStrategy, KvUsage, LifecycleEvent, QueueClass, RequestFacts,
    SessionAwareConfig, SessionAwareStrategy, SessionKey,
};
use switchyard_core::{RequestId, WorkerId};

/// Workload parameters.
#[derive(Clone, Debug, Serialize, clap::Args)]
pub struct AdmissionArgs {
    /// Sessions retained by the strategy while admission is timed.
    #[arg(long, default_value_t = 100_000)]
    pub sessions: usize,
    /// Workers the sessions are spread over.
    #[arg(long, default_value_t = 8)]
    pub workers: u64,
    /// Timed admit/event pairs.
    #[arg(long, default_value_t = 100_000)]
    pub iterations: usize,
    /// Progress updates (and reads) in the averaged loops.
    #[arg(long, default_value_t = 200_000_000)]
    pub progress_ops: u64,
    /// Seed of the session draw.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Write the figures as JSON here.
    #[arg(long)]
    #[serde(skip)]
    pub json: Option<PathBuf>,
}

/// The figures.
#[derive(Clone, Debug, Serialize)]
pub struct AdmissionReport {
    /// One progress update, ns (mean over the loop).
    pub progress_update_ns: f64,
    /// One progress read, ns (mean over the loop).
    pub progress_read_ns: f64,
    /// Median of admit + one `on_event`, ns, timer overhead included.
    pub admit_event_median_ns: f64,
    /// Full distribution of the same, ns.
    pub admit_event_ns: Latency,
    /// Admit + dispatched + completed, ns.
    pub turn_cycle_ns: Latency,
    /// Cost of one `Instant::now()` pair, ns.
    pub timer_overhead_ns: f64,
    /// The strategy's heap estimate per retained session.
    pub bytes_per_session: f64,
    /// Resident-set growth per session while filling (coarse).
    pub rss_bytes_per_session: Option<f64>,
    /// Sessions retained.
    pub sessions: usize,
    /// The parameters.
    pub workload: AdmissionArgs,
}

fn facts(id: u128, session: u64, tokens: u32, now_ms: f64) -> RequestFacts<'static> {
    RequestFacts {
        id: RequestId(id),
        session: Some(SessionKey(session)),
        context_tokens: tokens,
        uncached_tokens: tokens,
        class: QueueClass(0),
        eligible: &switchyard_core::Eligible::Every,
        now_ms,
        flow: Default::default(),
    }
}

/// Times the progress pair: (update ns, read ns).
pub fn progress_figures(ops: u64) -> (f64, f64) {
    let (mut updater, reader) = progress_pair();
    let start = Instant::now();
    for i in 1..=ops {
        updater.set(black_box(i));
    }
    let update_ns = start.elapsed().as_nanos() as f64 / ops as f64;
    // Atomic loads are never merged or hoisted by the compiler, so the loop
    // performs every read; only the sum is kept opaque.
    let mut sum = 0u64;
    let start = Instant::now();
    for _ in 0..ops {
        sum = sum.wrapping_add(reader.read());
    }
    let read_ns = start.elapsed().as_nanos() as f64 / ops as f64;
    black_box(sum);
    (update_ns, read_ns)
}

/// A strategy holding `sessions` quiet sessions on `workers` workers, each
/// having completed one turn. Request ids below `sessions` are used.
pub fn populated_strategy(sessions: usize, workers: u64) -> SessionAwareStrategy {
    let mut strategy = SessionAwareStrategy::new(SessionAwareConfig {
        max_sessions: sessions.max(1),
        ..Default::default()
    })
    .expect("default settings validate");
    let workers = workers.max(1);
    for worker in 0..workers {
        strategy.observe_kv(
            WorkerId::new(worker),
            KvUsage {
                capacity_tokens: u64::MAX / 4,
                used_tokens: None,
            },
        );
    }
    let (_, reader) = progress_pair();
    let mut out = Vec::new();
    for s in 0..sessions as u64 {
        let id = RequestId(s as u128);
        strategy.admit(&facts(id.0, s, 1000, 0.0));
        strategy.on_event(
            &LifecycleEvent::Dispatched {
                id,
                worker: WorkerId::new(s % workers),
                progress: reader.clone(),
            },
            0.0,
            &mut out,
        );
        strategy.on_event(
            &LifecycleEvent::Completed {
                id,
                context_tokens: 1200,
            },
            0.0,
            &mut out,
        );
    }
    strategy
}

/// Runs the benchmark.
pub fn run(args: AdmissionArgs) -> anyhow::Result<()> {
    let (progress_update_ns, progress_read_ns) = progress_figures(args.progress_ops.max(1));

    let rss_before = rss_bytes();
    let mut strategy = populated_strategy(args.sessions, args.workers);
    let rss_after = rss_bytes();
    let sessions = strategy.sessions();
    let bytes_per_session = strategy.estimated_bytes() as f64 / sessions.max(1) as f64;
    let rss_bytes_per_session = match (rss_before, rss_after) {
        (Some(a), Some(b)) if sessions > 0 => Some(b.saturating_sub(a) as f64 / sessions as f64),
        _ => None,
    };

    let timer_overhead_ns = {
        let mut samples: Vec<f64> = (0..10_000)
            .map(|_| {
                let t = Instant::now();
                black_box(Instant::now() - t).as_nanos() as f64
            })
            .collect();
        Latency::of(&mut samples).p50
    };

    let mut rng = StdRng::seed_from_u64(args.seed);
    let (_, reader) = progress_pair();
    let mut out = Vec::new();
    let mut pair_ns = Vec::with_capacity(args.iterations);
    let mut cycle_ns = Vec::with_capacity(args.iterations);
    let workers = args.workers.max(1);
    let mut now = 1.0;
    for i in 0..args.iterations {
        let session = rng.gen_range(0..sessions.max(1) as u64);
        let id = RequestId((sessions + i) as u128);
        let f = facts(id.0, session, 1300, now);
        let dispatched = LifecycleEvent::Dispatched {
            id,
            worker: WorkerId::new(session % workers),
            progress: reader.clone(),
        };
        let completed = LifecycleEvent::Completed {
            id,
            context_tokens: 1200,
        };
        let start = Instant::now();
        black_box(strategy.admit(black_box(&f)));
        strategy.on_event(black_box(&dispatched), now, &mut out);
        let mid = Instant::now();
        strategy.on_event(black_box(&completed), now, &mut out);
        let end = Instant::now();
        out.clear();
        pair_ns.push((mid - start).as_nanos() as f64);
        cycle_ns.push((end - start).as_nanos() as f64);
        now += 0.01;
    }
    let admit_event_ns = Latency::of(&mut pair_ns);
    let report = AdmissionReport {
        progress_update_ns,
        progress_read_ns,
        admit_event_median_ns: admit_event_ns.p50,
        admit_event_ns,
        turn_cycle_ns: Latency::of(&mut cycle_ns),
        timer_overhead_ns,
        bytes_per_session,
        rss_bytes_per_session,
        sessions,
        workload: args.clone(),
    };
    println!("progress update      {:>8.2} ns", report.progress_update_ns);
    println!("progress read        {:>8.2} ns", report.progress_read_ns);
    println!(
        "admit + event        p50 {:.0} ns  p99 {:.0} ns  ({} sessions; timer {:.0} ns)",
        report.admit_event_ns.p50, report.admit_event_ns.p99, sessions, timer_overhead_ns
    );
    println!(
        "turn cycle           p50 {:.0} ns  p99 {:.0} ns",
        report.turn_cycle_ns.p50, report.turn_cycle_ns.p99
    );
    println!("bytes per session    {:>8.1}", report.bytes_per_session);
    if let Some(path) = &args.json {
        write_json(path, &report)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_benchmark_writes_every_documented_key() {
        let dir = std::env::temp_dir().join(format!("sy-adm-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("admission.json");
        run(AdmissionArgs {
            sessions: 1000,
            workers: 4,
            iterations: 1000,
            progress_ops: 1000,
            seed: 1,
            json: Some(path.clone()),
        })
        .unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for key in [
            "progress_update_ns",
            "progress_read_ns",
            "admit_event_median_ns",
            "bytes_per_session",
        ] {
            assert!(v[key].as_f64().is_some(), "missing {key}");
        }
        assert_eq!(v["sessions"], 1000);
        std::fs::remove_dir_all(dir).unwrap();
    }
}
