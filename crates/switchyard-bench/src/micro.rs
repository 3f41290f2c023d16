//! `switchyard bench index micro`: the standard indexer micro-workload.
//!
//! Sequences of `depth` blocks (16 tokens each) are assigned to `workers`
//! round-robin; each sequence belongs to one of `prefix_groups` groups drawn
//! at random, and its first `prefix_ratio` of blocks is its group's shared
//! prefix (shared across workers too); the rest is unique. `pairs / depth`
//! sequences are stored, then each operation is timed one call at a time:
//!
//! - store: remove a sequence (untimed), store it again (timed);
//! - remove: remove (timed), store again (untimed);
//! - overlaps hit: a stored sequence's hashes;
//! - overlaps miss: `depth` hashes the index has never seen.
//!
//! Each timing includes one `Instant::now()` pair; its own cost is measured
//! and reported as `timer_overhead_ns` rather than subtracted.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;
use switchyard_commands::stats::{write_json, Latency};
use switchyard_core::hashing::sequence_hashes;
use switchyard_core::index::{OverlapScores, PrefixIndex, StoredBlock};
use switchyard_core::{EngineHash, LocalHash, WorkerId};

/// Workload parameters.
#[derive(Clone, Debug, Serialize, clap::Args)]
pub struct MicroArgs {
    /// Blocks stored in all, as sequences of `depth` blocks.
    #[arg(long, default_value_t = 100_000)]
    pub pairs: usize,
    /// Blocks per sequence.
    #[arg(long, default_value_t = 64)]
    pub depth: usize,
    /// Workers, assigned round-robin.
    #[arg(long, default_value_t = 4)]
    pub workers: u64,
    /// Fraction of each sequence that is its group's shared prefix.
    #[arg(long, default_value_t = 0.25)]
    pub prefix_ratio: f64,
    /// Number of prefix groups.
    #[arg(long, default_value_t = 4)]
    pub prefix_groups: u64,
    /// Timed calls per operation.
    #[arg(long, default_value_t = 10_000)]
    pub iterations: usize,
    /// Seed of the group draw.
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Write the figures as JSON here.
    #[arg(long)]
    #[serde(skip)]
    pub json: Option<PathBuf>,
}

/// One generated sequence.
#[derive(Clone, Debug)]
pub struct Sequence {
    /// Its worker.
    pub worker: WorkerId,
    /// Local hashes, root first.
    pub locals: Vec<LocalHash>,
    /// The chain as a `Stored` event would carry it (engine hash = sequence
    /// hash, as vLLM's chained block hashes are).
    pub blocks: Vec<StoredBlock>,
    /// Engine hashes, for `Removed`.
    pub engine_hashes: Vec<EngineHash>,
}

/// Generates the workload's sequences: as many as it takes for the live
/// (block, worker) pairs to reach `pairs` (shared prefixes count once per
/// worker).
pub fn generate(args: &MicroArgs) -> Vec<Sequence> {
    let mut rng = StdRng::seed_from_u64(args.seed);
    let depth = args.depth.max(1);
    let workers = args.workers.max(1);
    let prefix = ((depth as f64 * args.prefix_ratio).round() as usize).min(depth);
    let mut prefixes_held = std::collections::HashSet::new();
    let mut live = 0;
    let mut seqs = Vec::new();
    while live < args.pairs.max(1) {
        let i = seqs.len() as u64;
        let group = rng.gen_range(0..args.prefix_groups.max(1));
        let worker = WorkerId::new(i % workers);
        live += depth - prefix;
        if prefixes_held.insert((worker, group)) {
            live += prefix;
        }
        let locals: Vec<LocalHash> = (0..depth as u64)
            .map(|d| {
                if (d as usize) < prefix {
                    LocalHash(0xFEED << 48 | (group & 0xFFFF_FFFF) << 16 | (d & 0xFFFF))
                } else {
                    LocalHash(i << 32 | d)
                }
            })
            .collect();
        let seq = sequence_hashes(&locals);
        let blocks = seq
            .iter()
            .zip(&locals)
            .map(|(s, &l)| StoredBlock {
                engine_hash: EngineHash(s.0),
                local_hash: l,
            })
            .collect();
        seqs.push(Sequence {
            worker,
            locals,
            blocks,
            engine_hashes: seq.iter().map(|s| EngineHash(s.0)).collect(),
        });
    }
    seqs
}

/// Builds an index holding every sequence.
pub fn build(seqs: &[Sequence]) -> PrefixIndex {
    let mut index = PrefixIndex::new();
    for s in seqs {
        index.store(s.worker, None, &s.blocks);
    }
    index
}

#[derive(Debug, Serialize)]
struct OpsPerSec {
    store: f64,
    remove: f64,
    overlaps_hit: f64,
    overlaps_miss: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    store_p50_us: f64,
    store_p99_us: f64,
    remove_p50_us: f64,
    remove_p99_us: f64,
    overlaps_hit_p50_us: f64,
    overlaps_hit_p99_us: f64,
    overlaps_miss_p50_us: f64,
    overlaps_miss_p99_us: f64,
    store_per_block_p50_ns: f64,
    remove_per_block_p50_ns: f64,
    ops_per_sec: OpsPerSec,
    bytes_per_pair: f64,
    sequences: usize,
    live_pairs: usize,
    live_nodes: usize,
    index_bytes: usize,
    timer_overhead_ns: f64,
    workload: MicroArgs,
}

fn time_us(f: impl FnOnce()) -> f64 {
    let start = Instant::now();
    f();
    start.elapsed().as_nanos() as f64 / 1000.0
}

/// Runs the benchmark and prints its figures.
pub fn run(args: MicroArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.depth > 0, "--depth must be at least 1");
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.prefix_ratio),
        "--prefix-ratio must be in [0, 1]"
    );
    let seqs = generate(&args);
    let mut index = build(&seqs);
    let live_pairs = index.live_pairs();
    let live_nodes = index.live_nodes();
    let index_bytes = index.estimated_bytes();
    let n = seqs.len();
    let iters = args.iterations.max(1);

    let mut timer = Vec::with_capacity(iters);
    for _ in 0..iters {
        timer.push(time_us(|| {}) * 1000.0);
    }
    let timer = Latency::of(&mut timer);

    let mut store = Vec::with_capacity(iters);
    let mut remove = Vec::with_capacity(iters);
    for i in 0..iters {
        let s = &seqs[i % n];
        index.remove(s.worker, &s.engine_hashes);
        store.push(time_us(|| {
            black_box(index.store(s.worker, None, &s.blocks));
        }));
    }
    for i in 0..iters {
        let s = &seqs[i % n];
        remove.push(time_us(|| {
            black_box(index.remove(s.worker, &s.engine_hashes));
        }));
        index.store(s.worker, None, &s.blocks);
    }
    let mut out = OverlapScores::new();
    let mut hit = Vec::with_capacity(iters);
    let mut rng = StdRng::seed_from_u64(args.seed ^ 0x5eed);
    for _ in 0..iters {
        let s = &seqs[rng.gen_range(0..n)];
        hit.push(time_us(|| {
            index.overlaps(black_box(&s.locals), &mut out);
        }));
        anyhow::ensure!(
            out.max_depth() as usize == s.locals.len(),
            "a stored sequence did not fully match: the index is broken"
        );
    }
    let garbage: Vec<LocalHash> = (0..args.depth as u64)
        .map(|d| LocalHash(0x0BAD_C0DE_0000_0000 | d))
        .collect();
    let mut miss = Vec::with_capacity(iters);
    for _ in 0..iters {
        miss.push(time_us(|| {
            index.overlaps(black_box(&garbage), &mut out);
        }));
    }
    let (store, remove, hit, miss) = (
        Latency::of(&mut store),
        Latency::of(&mut remove),
        Latency::of(&mut hit),
        Latency::of(&mut miss),
    );
    let per_block = |l: &Latency| l.p50 * 1000.0 / args.depth as f64;
    let report = Report {
        store_p50_us: store.p50,
        store_p99_us: store.p99,
        remove_p50_us: remove.p50,
        remove_p99_us: remove.p99,
        overlaps_hit_p50_us: hit.p50,
        overlaps_hit_p99_us: hit.p99,
        overlaps_miss_p50_us: miss.p50,
        overlaps_miss_p99_us: miss.p99,
        store_per_block_p50_ns: per_block(&store),
        remove_per_block_p50_ns: per_block(&remove),
        ops_per_sec: OpsPerSec {
            store: 1e6 / store.mean,
            remove: 1e6 / remove.mean,
            overlaps_hit: 1e6 / hit.mean,
            overlaps_miss: 1e6 / miss.mean,
        },
        bytes_per_pair: index_bytes as f64 / live_pairs.max(1) as f64,
        sequences: n,
        live_pairs,
        live_nodes,
        index_bytes,
        timer_overhead_ns: timer.p50,
        workload: args,
    };
    print(&report);
    if let Some(path) = &report.workload.json {
        write_json(path, &report)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn print(r: &Report) {
    let w = &r.workload;
    println!(
        "index micro: {} sequences × {} blocks, {} workers, {:.0}% prefix in {} groups; {} live (block, worker) pairs, {} nodes",
        r.sequences,
        w.depth,
        w.workers,
        w.prefix_ratio * 100.0,
        w.prefix_groups,
        r.live_pairs,
        r.live_nodes
    );
    println!(
        "{:<16} {:>10} {:>10} {:>14}",
        "operation", "p50 µs", "p99 µs", "ops/s"
    );
    let rows = [
        (
            "store (event)",
            r.store_p50_us,
            r.store_p99_us,
            r.ops_per_sec.store,
        ),
        (
            "remove (event)",
            r.remove_p50_us,
            r.remove_p99_us,
            r.ops_per_sec.remove,
        ),
        (
            "overlaps hit",
            r.overlaps_hit_p50_us,
            r.overlaps_hit_p99_us,
            r.ops_per_sec.overlaps_hit,
        ),
        (
            "overlaps miss",
            r.overlaps_miss_p50_us,
            r.overlaps_miss_p99_us,
            r.ops_per_sec.overlaps_miss,
        ),
    ];
    for (name, p50, p99, ops) in rows {
        println!("{name:<16} {p50:>10.3} {p99:>10.3} {ops:>14.0}");
    }
    println!(
        "per block: store {:.1} ns, remove {:.1} ns (p50 / depth); {:.1} bytes per live pair ({} bytes); timer overhead {:.0} ns per call, included above",
        r.store_per_block_p50_ns, r.remove_per_block_p50_ns, r.bytes_per_pair, r.index_bytes, r.timer_overhead_ns
    );
}
