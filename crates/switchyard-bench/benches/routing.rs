//! Criterion benchmarks of the routing core's hot paths: hashing, prefix
//! index queries and event application, and one request through the
//! dispatcher (admission, routing decision, booking, free).
//!
//! `cargo bench -p switchyard-bench --bench routing`

use criterion::{black_box, criterion_group, criterion_main, BatchSize, Criterion};
use switchyard_bench::micro::{build, generate, MicroArgs};
use switchyard_core::dispatch::{Dispatcher, DispatcherConfig, Submission};
use switchyard_core::hashing::{local_block_hashes, DEFAULT_SEED};
use switchyard_core::index::{CacheTier, IndexEvent, OverlapScores, PrefixIndex, StoredBlock};
use switchyard_core::router::{Router, RouterConfig, WorkerCapacity};
use switchyard_core::select::{PolicyKind, RoutingRequest, SelectOutcome};
use switchyard_core::{EngineHash, LocalHash, RequestId, WorkerId};

fn micro_args() -> MicroArgs {
    MicroArgs {
        pairs: 100_000,
        depth: 64,
        workers: 4,
        prefix_ratio: 0.25,
        prefix_groups: 4,
        iterations: 0,
        seed: 42,
        json: None,
    }
}

fn hashing(c: &mut Criterion) {
    let tokens: Vec<u32> = (0..4096).map(|i| (i * 7919) % 151_643).collect();
    c.bench_function("hashing/local_block_hashes_4096_tokens_bs16", |b| {
        b.iter(|| local_block_hashes(black_box(&tokens), 16, DEFAULT_SEED))
    });
}

fn index(c: &mut Criterion) {
    let seqs = generate(&micro_args());
    let mut index = build(&seqs);
    let mut out = OverlapScores::new();
    let mut i = 0;
    c.bench_function("index/overlaps_hit_depth64", |b| {
        b.iter(|| {
            i = (i + 7919) % seqs.len();
            index.overlaps(black_box(&seqs[i].locals), &mut out);
        })
    });
    let garbage: Vec<LocalHash> = (0..64).map(|d| LocalHash(0x0BAD_C0DE_0000 | d)).collect();
    c.bench_function("index/overlaps_miss_depth64", |b| {
        b.iter(|| index.overlaps(black_box(&garbage), &mut out))
    });
    let mut j = 0;
    c.bench_function("index/remove_then_store_64_block_sequence", |b| {
        b.iter(|| {
            j = (j + 1) % seqs.len();
            let s = &seqs[j];
            index.remove(s.worker, &s.engine_hashes);
            index.store(s.worker, None, &s.blocks);
        })
    });
}

/// What each worker reports: the simulated engine's defaults (the `ttft`
/// policy weighs KV usage and cache turnover against it).
const CAPACITY: WorkerCapacity = WorkerCapacity {
    max_num_batched_tokens: Some(8192),
    kv_blocks: Some(16_384),
    kv_tokens: Some(16_384 * 16),
    block_size: None,
};

/// The fleet both lifecycle benches run on: 64 workers.
fn fleet_workers() -> Vec<WorkerId> {
    (0..64).map(WorkerId::new).collect()
}

/// A 64-block prompt; prompts with the same seed share every block.
fn prompt(seed: u64) -> Vec<LocalHash> {
    (0..64).map(|d| LocalHash(seed << 16 | d)).collect()
}

/// The cached state both lifecycle benches start from: 4,096 sequences
/// (512 distinct prompts) stored round-robin over the workers, applied
/// through `apply` (the router's or the dispatcher's KV-event entry).
fn fill_caches(workers: &[WorkerId], mut apply: impl FnMut(WorkerId, &IndexEvent)) {
    for s in 0..4096u64 {
        let blocks: Vec<StoredBlock> = prompt(s % 512)
            .into_iter()
            .map(|l| StoredBlock {
                engine_hash: EngineHash(l.0),
                local_hash: l,
            })
            .collect();
        apply(
            workers[(s % 64) as usize],
            &IndexEvent::Stored {
                parent: None,
                blocks,
            },
        );
    }
}

/// The router alone on the same fleet: route, book, free — the work the
/// dispatcher wraps (its admission, request table, estimator and effects
/// are the difference between the two figures).
fn bare_router(c: &mut Criterion) {
    // `kv` keeps the name the figures were first published under; `ttft`
    // is timed beside it.
    bare_router_with(
        c,
        PolicyKind::Kv,
        "router/route_book_free_64_workers_64_blocks",
    );
    bare_router_with(
        c,
        PolicyKind::Ttft,
        "router/route_book_free_64_workers_64_blocks_ttft",
    );
}

fn bare_router_with(c: &mut Criterion, policy: PolicyKind, name: &str) {
    let config = RouterConfig {
        policy,
        ..RouterConfig::default()
    };
    let mut router = Router::new(config).expect("defaults are valid");
    let workers = fleet_workers();
    for &w in &workers {
        router.add_worker(w, CAPACITY);
    }
    fill_caches(&workers, |w, event| {
        router.apply_kv_event(w, CacheTier::Device, event);
    });
    for r in 0..256u64 {
        let locals = prompt(r % 700);
        let req = RoutingRequest {
            prompt_tokens: 1024,
            blocks: &locals,
            adapter: None,
            model: Default::default(),
            headroom: 0.0,
        };
        if let SelectOutcome::Selected(d) = router.route(req, None, 0.0) {
            router.book(
                RequestId(u128::from(r) + 1_000_000),
                req,
                d,
                Some(50.0),
                0.0,
            );
        }
    }
    let mut n = 0u64;
    c.bench_function(name, |b| {
        b.iter_batched(
            || {
                n += 1;
                (n, prompt(n % 600))
            },
            |(id, locals)| {
                let req = RoutingRequest {
                    prompt_tokens: 1024,
                    blocks: &locals,
                    adapter: None,
                    model: Default::default(),
                    headroom: 0.0,
                };
                if let SelectOutcome::Selected(d) = router.route(req, None, 1.0) {
                    router.book(RequestId(u128::from(id)), req, d, Some(50.0), 1.0);
                    router.free(RequestId(u128::from(id)), 2.0);
                }
            },
            BatchSize::SmallInput,
        )
    });
}

/// The request lifecycle on 64 workers, each holding a few thousand cached
/// sequences and some active requests: one 64-block request submitted
/// (admission, selection, booking with a prefill hint) and finished (free),
/// as the server and the simulator drive the core's dispatcher.
fn decision(c: &mut Criterion) {
    let mut dispatcher =
        Dispatcher::new(DispatcherConfig::default(), None).expect("defaults are valid");
    let workers = fleet_workers();
    for &w in &workers {
        let _ = dispatcher.add_worker(w, CAPACITY, 0.0);
    }
    fill_caches(&workers, |w, event| {
        dispatcher.apply_kv_event(w, CacheTier::Device, event);
    });
    let submission = |locals: Vec<LocalHash>| Submission {
        blocks: locals,
        prompt_tokens: 1024,
        ..Submission::default()
    };
    for r in 0..256u64 {
        let placed = dispatcher.submit(
            RequestId(u128::from(r) + 1_000_000),
            submission(prompt(r % 700)),
            0.0,
        );
        assert!(matches!(placed, Ok((_, fx)) if fx.dispatch.len() == 1));
    }
    let mut n = 0u64;
    c.bench_function("dispatcher/submit_finish_64_workers_64_blocks", |b| {
        b.iter_batched(
            || {
                n += 1;
                (RequestId(u128::from(n)), submission(prompt(n % 600)))
            },
            |(id, request)| {
                let placed = dispatcher.submit(id, request, 1.0);
                let finished = dispatcher.finish(id, 1024, 2.0);
                black_box((placed, finished))
            },
            BatchSize::SmallInput,
        )
    });
}

/// FxHash as the prefix index's child maps use it on a `u64` key: the key
/// times a public constant, rotated. Its inverse, to make keys whose hashes
/// are chosen.
const FX_K: u64 = 0xf135_7aea_2e62_a9c5;

fn fx_inverse() -> u64 {
    // Newton's iteration for the inverse of an odd number modulo 2^64.
    let mut x = FX_K;
    for _ in 0..6 {
        x = x.wrapping_mul(2u64.wrapping_sub(FX_K.wrapping_mul(x)));
    }
    x
}

/// `n` keys whose FxHash agrees in its low 32 bits (the bucket in any
/// table up to 2^32 buckets) and its top 7 (hashbrown's control byte):
/// what a client choosing its prompts could find by brute force, about
/// 2^(log2 buckets + 7) block hashes tried for each.
fn colliding_keys(n: usize) -> Vec<u64> {
    use std::hash::BuildHasher as _;
    let inverse = fx_inverse();
    (0..n as u64)
        .map(|i| {
            let hash = (0x55u64 << 57) | ((i + 1) << 32) | 0x1234_5678;
            let key = hash.rotate_right(26).wrapping_mul(inverse);
            debug_assert_eq!(rustc_hash::FxBuildHasher.hash_one(key), hash);
            key
        })
        .collect()
}

/// A node with `n` children whose local hashes are `keys` (the children a
/// shared system prompt collects), and lookups through it: a prompt whose
/// next block is not there (every other client's), and one whose next
/// block is (the last child stored).
fn siblings(c: &mut Criterion) {
    use std::hash::BuildHasher as _;
    let worker = WorkerId::new(1);
    for n in [256usize, 4096] {
        let random: Vec<u64> = (0..n as u64)
            .map(|i| rustc_hash::FxBuildHasher.hash_one(i ^ 0x9e37_79b9_7f4a_7c15))
            .collect();
        for (kind, keys) in [("random", random), ("colliding", colliding_keys(n))] {
            let mut index = PrefixIndex::new();
            let root = StoredBlock {
                engine_hash: EngineHash(1),
                local_hash: LocalHash(7),
            };
            index.store(worker, None, &[root]);
            for (i, &key) in keys.iter().enumerate() {
                let child = StoredBlock {
                    engine_hash: EngineHash(100 + i as u64),
                    local_hash: LocalHash(key),
                };
                index.store(worker, Some(EngineHash(1)), &[child]);
            }
            let mut out = OverlapScores::new();
            // Other clients' next blocks: 1024 random hashes in turn.
            let absent: Vec<[LocalHash; 2]> = (0..1024u64)
                .map(|i| {
                    [
                        LocalHash(7),
                        LocalHash(rustc_hash::FxBuildHasher.hash_one(!i)),
                    ]
                })
                .collect();
            let mut turn = 0;
            c.bench_function(
                &format!("index/siblings_{n}_{kind}/next_block_absent"),
                |b| {
                    b.iter(|| {
                        turn = (turn + 1) % absent.len();
                        index.overlaps(black_box(&absent[turn]), &mut out)
                    })
                },
            );
            let present = [LocalHash(7), LocalHash(keys[n - 1])];
            c.bench_function(
                &format!("index/siblings_{n}_{kind}/next_block_present"),
                |b| b.iter(|| index.overlaps(black_box(&present), &mut out)),
            );
        }
    }
}

criterion_group!(benches, hashing, index, siblings, bare_router, decision);
criterion_main!(benches);
