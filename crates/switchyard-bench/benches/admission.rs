//! Criterion benchmarks of the admission layer: a live-progress update and
//! read, and session-aware admit + `Dispatched` with 100,000 sessions
//! retained.
//!
//! `cargo bench -p switchyard-bench --bench admission`

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use switchyard_bench::admission::populated_strategy;
use switchyard_core::admission::{
    progress_pair, AdmissionStrategy, LifecycleEvent, QueueClass, RequestFacts, SessionKey,
};
use switchyard_core::{RequestId, WorkerId};

fn progress(c: &mut Criterion) {
    let (mut updater, reader) = progress_pair();
    let mut i = 0u64;
    c.bench_function("admission/progress_update", |b| {
        b.iter(|| {
            i += 1;
            updater.set(black_box(i));
        })
    });
    c.bench_function("admission/progress_read", |b| {
        b.iter(|| black_box(&reader).read())
    });
}

fn admit_event(c: &mut Criterion) {
    const SESSIONS: u64 = 100_000;
    let mut strategy = populated_strategy(SESSIONS as usize, 8);
    let (_, reader) = progress_pair();
    let mut out = Vec::new();
    let mut next = SESSIONS as u128;
    c.bench_function("admission/admit_dispatched_completed_100k_sessions", |b| {
        b.iter(|| {
            next += 1;
            let session = (next as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) % SESSIONS;
            let id = RequestId(next);
            let facts = RequestFacts {
                id,
                session: Some(SessionKey(session)),
                context_tokens: 1300,
                uncached_tokens: 1300,
                class: QueueClass(0),
                eligible: &switchyard_core::Eligible::Every,
                now_ms: 1.0,
                flow: Default::default(),
            };
            black_box(strategy.admit(&facts));
            let dispatched = LifecycleEvent::Dispatched {
                id,
                worker: WorkerId::new(session % 8),
                progress: reader.clone(),
            };
            strategy.on_event(&dispatched, 1.0, &mut out);
            let completed = LifecycleEvent::Completed {
                id,
                context_tokens: 1200,
            };
            strategy.on_event(&completed, 1.0, &mut out);
            out.clear();
        })
    });
}

criterion_group!(benches, progress, admit_event);
criterion_main!(benches);
