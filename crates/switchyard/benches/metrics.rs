//! Criterion benchmarks of the router's request-path metrics: a latency
//! histogram observe and a labelled counter increment, alone and with two
//! threads updating the same metric at once.
//!
//! `cargo bench -p switchyard --bench metrics`

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

/// The hand-written metrics this layer replaced (`switchyard-server`'s
/// `metrics.rs` before prometheus-client), kept here for a side-by-side
/// figure.
mod old {
    use std::sync::atomic::{AtomicU64, Ordering};

    const LATENCY_BUCKETS: [f64; 20] = switchyard_server::metrics::LATENCY_BUCKETS;

    #[derive(Default)]
    pub(crate) struct Histogram {
        buckets: [AtomicU64; LATENCY_BUCKETS.len()],
        count: AtomicU64,
        sum_nanos: AtomicU64,
    }

    impl Histogram {
        pub(crate) fn observe(&self, seconds: f64) {
            let seconds = if seconds.is_finite() {
                seconds.max(0.0)
            } else {
                0.0
            };
            if let Some(i) = LATENCY_BUCKETS.iter().position(|&b| seconds <= b) {
                self.buckets[i].fetch_add(1, Ordering::Relaxed);
            }
            self.count.fetch_add(1, Ordering::Relaxed);
            self.sum_nanos
                .fetch_add((seconds * 1e9) as u64, Ordering::Relaxed);
        }
    }

    use switchyard_server::metrics::RequestStatus;

    #[derive(Default)]
    pub(crate) struct Requests([AtomicU64; 6]);

    impl Requests {
        pub(crate) fn count_request(&self, status: RequestStatus) {
            let i = RequestStatus::ALL
                .iter()
                .position(|s| *s == status)
                .unwrap_or(0);
            self.0[i].fetch_add(1, Ordering::Relaxed);
        }
    }
}

fn old_request_path(c: &mut Criterion) {
    let histogram = old::Histogram::default();
    let requests = old::Requests::default();
    let mut i = 0u64;
    c.bench_function("metrics_old/histogram_observe", |b| {
        b.iter(|| {
            i += 1;
            histogram.observe(black_box(seconds(i)));
        })
    });
    c.bench_function("metrics_old/labelled_counter_inc", |b| {
        b.iter(|| requests.count_request(black_box(RequestStatus::Cancelled)))
    });
    c.bench_function("metrics_old/histogram_observe_2_threads", |b| {
        b.iter_custom(|iters| contended(2, iters, |i| histogram.observe(black_box(seconds(i)))))
    });
    c.bench_function("metrics_old/labelled_counter_inc_2_threads", |b| {
        b.iter_custom(|iters| {
            contended(2, iters, |_| {
                requests.count_request(black_box(RequestStatus::Ok))
            })
        })
    });
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

criterion_group!(benches, request_path, old_request_path);
criterion_main!(benches);
