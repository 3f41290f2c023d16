//! `switchyard bench index trace`: the prefix index under a real trace.
//!
//! Replays a Mooncake trace (each 512-token hash id expanded into synthetic
//! token ids, hashed into router blocks exactly as the router would) as the
//! event stream a fleet of engines would publish:
//!
//! - each request queries `overlaps` and goes to the worker with the deepest
//!   match when that covers at least half the prompt, else to the next
//!   worker in turn (every request shares the trace's first block, so
//!   "deepest match" alone would send everything to one worker);
//! - that worker publishes `Stored` for the blocks it did not have;
//! - a per-worker LRU of `--capacity-blocks` evicts (tails before their
//!   prefixes) and publishes `Removed`.
//!
//! Only index calls are timed. Memory is sampled when every worker has
//! started evicting (the start of the churn phase, where removals match
//! stores) and at the end.

use serde::Serialize;
use std::cmp::Reverse;
use std::hint::black_box;
use std::path::PathBuf;
use std::time::Instant;
use switchyard_commands::data::Trace;
use switchyard_commands::stats::{rss_bytes, write_json, Latency};
use switchyard_core::hashing::{extend_local_block_hashes, sequence_hashes, DEFAULT_SEED};
use switchyard_core::index::{IndexMemory, OverlapScores, PrefixIndex, StoredBlock};
use switchyard_core::{EngineHash, LocalHash, WorkerId};
use switchyard_sim::reference::BlockLru;
use switchyard_sim::trace::{synthetic_tokens, MooncakeReader};

/// Trace-replay parameters.
#[derive(Clone, Debug, Serialize, clap::Args)]
pub struct TraceArgs {
    /// Mooncake JSONL trace (default: the bundled conversation trace).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// Workers in the simulated fleet.
    #[arg(long, default_value_t = 4)]
    pub workers: u64,
    /// Router block size in tokens.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// KV blocks each worker holds before it evicts.
    #[arg(long, default_value_t = 65_536)]
    pub capacity_blocks: usize,
    /// Replays of the trace; each later pass uses fresh hash ids, so churn
    /// continues.
    #[arg(long, default_value_t = 1)]
    pub passes: u32,
    /// Stop after this many requests per pass.
    #[arg(long)]
    pub max_requests: Option<usize>,
    /// Write the figures as JSON here.
    #[arg(long)]
    #[serde(skip)]
    pub json: Option<PathBuf>,
}

#[derive(Clone, Copy, Debug, Default, Serialize)]
struct MemorySample {
    requests: usize,
    live_pairs: usize,
    live_nodes: usize,
    index_bytes: usize,
    index: IndexMemory,
    rss_bytes: Option<u64>,
}

#[derive(Debug, Serialize)]
struct Churn {
    start: MemorySample,
    end: MemorySample,
    stored_blocks: u64,
    removed_blocks: u64,
    index_bytes_end_over_start: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    trace: String,
    requests: usize,
    events: u64,
    stored_blocks: u64,
    removed_blocks: u64,
    events_per_sec: f64,
    blocks_per_sec: f64,
    queries_per_sec: f64,
    query_us: Latency,
    query_p50_us: f64,
    query_p99_us: f64,
    hit_rate: f64,
    bytes_per_pair: f64,
    churn: Option<Churn>,
    samples: Vec<MemorySample>,
    wall_seconds: f64,
    workload: TraceArgs,
}

/// Runs the benchmark and prints its figures.
pub fn run(args: TraceArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.workers > 0, "--workers must be at least 1");
    anyhow::ensure!(args.block_size > 0, "--block-size must be at least 1");
    anyhow::ensure!(
        args.capacity_blocks > 0,
        "--capacity-blocks must be at least 1"
    );
    let trace = Trace::or_bundled(args.trace.as_deref());
    let wall = Instant::now();
    let mut index = PrefixIndex::new();
    let mut lrus: Vec<BlockLru> = (0..args.workers).map(|_| BlockLru::default()).collect();
    let mut out = OverlapScores::new();
    let (mut tokens, mut locals) = (Vec::new(), Vec::<LocalHash>::new());
    let mut query_us = Vec::new();
    let (mut event_ns, mut events, mut stored, mut removed) = (0u128, 0u64, 0u64, 0u64);
    let (mut matched, mut queried) = (0u64, 0u64);
    let mut requests = 0usize;
    let mut next_rr = 0u64;
    let mut churn_start: Option<(MemorySample, u64, u64)> = None;
    let mut evicting = vec![false; args.workers as usize];
    let mut samples = Vec::new();
    let sample = |index: &PrefixIndex, requests| MemorySample {
        requests,
        live_pairs: index.live_pairs(),
        live_nodes: index.live_nodes(),
        index_bytes: index.estimated_bytes(),
        index: index.memory(),
        rss_bytes: rss_bytes(),
    };
    for pass in 0..args.passes.max(1) {
        let reader = MooncakeReader::new(trace.open()?);
        for (n, record) in reader.enumerate() {
            if args.max_requests.is_some_and(|max| n >= max) {
                break;
            }
            let record = record.map_err(|e| anyhow::anyhow!("{trace}: {e}"))?;
            // Fresh ids per pass: the same shape of traffic, new content.
            let ids: Vec<u64> = record
                .hash_ids
                .iter()
                .map(|&h| h ^ (u64::from(pass) << 48))
                .collect();
            tokens.clear();
            synthetic_tokens(&ids, record.input_length as usize, &mut tokens);
            locals.clear();
            extend_local_block_hashes(&tokens, args.block_size, DEFAULT_SEED, &mut locals);
            if locals.is_empty() {
                continue;
            }
            let seq = sequence_hashes(&locals);

            let start = Instant::now();
            index.overlaps(black_box(&locals), &mut out);
            query_us.push(start.elapsed().as_nanos() as f64 / 1000.0);
            let best = out
                .entries
                .iter()
                .max_by_key(|e| (e.depth, Reverse(e.cached_blocks)))
                .filter(|e| 2 * e.depth as usize >= locals.len());
            let (worker, depth) = match best {
                Some(e) => (e.worker, e.depth as usize),
                None => {
                    next_rr = (next_rr + 1) % args.workers;
                    let worker = WorkerId::new(next_rr);
                    (worker, out.depth(worker) as usize)
                }
            };
            matched += depth as u64;
            queried += locals.len() as u64;

            let blocks: Vec<StoredBlock> = seq[depth..]
                .iter()
                .zip(&locals[depth..])
                .map(|(s, &l)| StoredBlock {
                    engine_hash: EngineHash(s.0),
                    local_hash: l,
                })
                .collect();
            let parent = depth.checked_sub(1).map(|d| EngineHash(seq[d].0));
            let start = Instant::now();
            black_box(index.store(worker, parent, &blocks));
            event_ns += start.elapsed().as_nanos();
            events += 1;
            stored += blocks.len() as u64;

            let lru = &mut lrus[worker.worker_id as usize];
            let tick = requests as u64;
            for (d, s) in seq.iter().enumerate() {
                lru.touch(s.0, tick, d as u32);
            }
            let mut evicted = Vec::new();
            while lru.len() > args.capacity_blocks {
                match lru.evict() {
                    Some(h) => evicted.push(EngineHash(h)),
                    None => break,
                }
            }
            if !evicted.is_empty() {
                evicting[worker.worker_id as usize] = true;
                if churn_start.is_none() && evicting.iter().all(|&e| e) {
                    churn_start = Some((sample(&index, requests), stored, removed));
                }
                let start = Instant::now();
                black_box(index.remove(worker, &evicted));
                event_ns += start.elapsed().as_nanos();
                events += 1;
                removed += evicted.len() as u64;
            }
            requests += 1;
            if requests % 1000 == 0 {
                samples.push(sample(&index, requests));
            }
        }
    }
    let end = sample(&index, requests);
    let churn = churn_start.map(|(start, s0, r0)| Churn {
        start,
        end,
        stored_blocks: stored - s0,
        removed_blocks: removed - r0,
        index_bytes_end_over_start: end.index_bytes as f64 / start.index_bytes.max(1) as f64,
    });
    let event_secs = event_ns as f64 / 1e9;
    let query_secs: f64 = query_us.iter().sum::<f64>() / 1e6;
    let latency = Latency::of(&mut query_us);
    let report = Report {
        trace: trace.to_string(),
        requests,
        events,
        stored_blocks: stored,
        removed_blocks: removed,
        events_per_sec: events as f64 / event_secs.max(1e-12),
        blocks_per_sec: (stored + removed) as f64 / event_secs.max(1e-12),
        queries_per_sec: requests as f64 / query_secs.max(1e-12),
        query_us: latency,
        query_p50_us: latency.p50,
        query_p99_us: latency.p99,
        hit_rate: matched as f64 / queried.max(1) as f64,
        bytes_per_pair: end.index_bytes as f64 / end.live_pairs.max(1) as f64,
        churn,
        samples,
        wall_seconds: wall.elapsed().as_secs_f64(),
        workload: args,
    };
    print(&report);
    if let Some(path) = &report.workload.json {
        write_json(path, &report)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

fn mib(bytes: usize) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn print(r: &Report) {
    let w = &r.workload;
    println!(
        "index trace: {} requests from {} on {} workers, {}-token blocks, {} blocks per worker",
        r.requests, r.trace, w.workers, w.block_size, w.capacity_blocks
    );
    println!(
        "events: {} ({} blocks stored, {} removed) at {:.0} events/s, {:.0} blocks/s (index time only)",
        r.events, r.stored_blocks, r.removed_blocks, r.events_per_sec, r.blocks_per_sec
    );
    println!(
        "queries: {:.0}/s, p50 {:.2} µs, p99 {:.2} µs; prefix hit rate {:.3}",
        r.queries_per_sec, r.query_p50_us, r.query_p99_us, r.hit_rate
    );
    println!("memory: {:.1} bytes per live pair", r.bytes_per_pair);
    match &r.churn {
        Some(c) => println!(
            "churn: from request {} ({} pairs, {:.1} MiB index) to {} ({} pairs, {:.1} MiB index): ×{:.3}; stored {} and removed {} blocks meanwhile",
            c.start.requests,
            c.start.live_pairs,
            mib(c.start.index_bytes),
            c.end.requests,
            c.end.live_pairs,
            mib(c.end.index_bytes),
            c.index_bytes_end_over_start,
            c.stored_blocks,
            c.removed_blocks
        ),
        None => println!("churn: the fleet never filled; lower --capacity-blocks to see eviction"),
    }
    println!("wall: {:.1} s", r.wall_seconds);
}
