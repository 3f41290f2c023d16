//! Criterion benchmarks of the router's request-path metrics: a latency
//! histogram observe and a labelled counter increment, alone and with two
//! threads updating the same metric at once. (The hand-written atomics
//! they replaced were timed beside them once; docs/router.md quotes both.)
//!
//! `cargo bench -p switchyard-bench --bench metrics`

use criterion::{black_box, criterion_group, criterion_main, Criterion};
use std::time::{Duration, Instant};
use switchyard_server::metrics::{AdmissionDecision, RequestStatus, ServerMetrics};

/// Wall time per operation while `threads` threads each run `op` `iters`
/// times on the same metric.
fn contended(threads: u32, iters: u64, op: impl Fn(u64) + Sync) -> Duration {
    let started = Instant::now();
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                for i in 0..iters {
                    op(i);
                }
            });
        }
    });
    started.elapsed()
}

/// An observation spread over the buckets (10 µs .. 40 ms).
fn seconds(i: u64) -> f64 {
    (i % 4096) as f64 * 1e-5
}

fn request_path(c: &mut Criterion) {
    let metrics = ServerMetrics::new("kv");
    let mut i = 0u64;
    c.bench_function("metrics/histogram_observe", |b| {
        b.iter(|| {
            i += 1;
            metrics.ttft.observe(black_box(seconds(i)));
        })
    });
    c.bench_function("metrics/labelled_counter_inc", |b| {
        b.iter(|| metrics.count_request(black_box(RequestStatus::Cancelled)))
    });
    c.bench_function("metrics/admission_count", |b| {
        b.iter(|| metrics.count_admissions(black_box(AdmissionDecision::Deferred), 1))
    });
    c.bench_function("metrics/histogram_observe_2_threads", |b| {
        b.iter_custom(|iters| contended(2, iters, |i| metrics.itl.observe(black_box(seconds(i)))))
    });
    c.bench_function("metrics/labelled_counter_inc_2_threads", |b| {
        b.iter_custom(|iters| {
            contended(2, iters, |_| {
                metrics.count_request(black_box(RequestStatus::Ok))
            })
        })
    });
}

criterion_group!(benches, request_path);
criterion_main!(benches);
