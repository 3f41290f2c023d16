//! The router's Prometheus metrics: a tiny lock-free registry.
//!
//! Why not the `prometheus` or `metrics` crate: the label sets here are
//! small and fixed (statuses, admission decisions) or keyed by the worker
//! table the router already owns, so plain atomics plus one text renderer
//! cover it with no dependency and no allocation on the request path — the
//! same style as [`switchyard_kv_events::metrics`], whose text is appended.
//!
//! Names follow DESIGN.md "Interfaces".

use super::migration::Failure;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds (seconds) of the latency histograms' buckets.
const LATENCY_BUCKETS: [f64; 20] = [
    0.000_01, 0.000_025, 0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// A fixed-bucket histogram of seconds; `observe` is a few relaxed atomic adds.
#[derive(Debug, Default)]
pub struct Histogram {
    buckets: [AtomicU64; LATENCY_BUCKETS.len()],
    count: AtomicU64,
    sum_nanos: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, seconds: f64) {
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

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.count.load(Ordering::Relaxed)
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cumulative = 0;
        for (bound, bucket) in LATENCY_BUCKETS.iter().zip(&self.buckets) {
            cumulative += bucket.load(Ordering::Relaxed);
            let _ = writeln!(out, "{name}_bucket{{le=\"{bound}\"}} {cumulative}");
        }
        let count = self.count();
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {count}");
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(out, "{name}_sum {sum}\n{name}_count {count}");
    }
}

/// How a request ended, as the `status` label of `switchyard_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    /// The worker answered 2xx and the body was delivered.
    Ok,
    /// The worker answered with an error status (passed through).
    WorkerError,
    /// Refused by the router: bad input, bad key, unknown model (4xx).
    Invalid,
    /// Refused for overload: admission queue full (429) or the in-flight
    /// limit reached (503).
    Rejected,
    /// No worker could take it, or the worker failed (502/503).
    Unavailable,
    /// The client went away first.
    Cancelled,
}

impl RequestStatus {
    const ALL: [RequestStatus; 6] = [
        RequestStatus::Ok,
        RequestStatus::WorkerError,
        RequestStatus::Invalid,
        RequestStatus::Rejected,
        RequestStatus::Unavailable,
        RequestStatus::Cancelled,
    ];

    fn label(self) -> &'static str {
        match self {
            RequestStatus::Ok => "ok",
            RequestStatus::WorkerError => "worker_error",
            RequestStatus::Invalid => "invalid",
            RequestStatus::Rejected => "rejected",
            RequestStatus::Unavailable => "unavailable",
            RequestStatus::Cancelled => "cancelled",
        }
    }
}

/// Admission outcomes, as the `decision` label.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdmissionDecision {
    /// Queued ready.
    Queued,
    /// Deferred by the strategy.
    Deferred,
    /// Refused (429).
    Rejected,
    /// Left the queue because the client gave up.
    Cancelled,
}

impl AdmissionDecision {
    const ALL: [AdmissionDecision; 4] = [
        AdmissionDecision::Queued,
        AdmissionDecision::Deferred,
        AdmissionDecision::Rejected,
        AdmissionDecision::Cancelled,
    ];

    fn label(self) -> &'static str {
        match self {
            AdmissionDecision::Queued => "queued",
            AdmissionDecision::Deferred => "deferred",
            AdmissionDecision::Rejected => "rejected",
            AdmissionDecision::Cancelled => "cancelled",
        }
    }
}

/// Router-wide metrics; per-worker gauges are read from the routing core at
/// render time (see [`crate::gauges::Snapshot`]).
#[derive(Debug, Default)]
pub struct ServerMetrics {
    requests: [AtomicU64; 6],
    admission: [AtomicU64; 4],
    /// Arrival to first body byte from the worker.
    pub ttft: Histogram,
    /// Between consecutive streamed chunks.
    pub itl: Histogram,
    /// One routing decision (route + book) under the router's lock,
    /// tokenization excluded: a dispatcher call's time shared between the
    /// decisions it made.
    pub routing_decision: Histogram,
    /// Prompt to token ids (chat template included).
    pub tokenize: Histogram,
    /// Worker failures reported by the proxy (`Booking::worker_failed`).
    pub upstream_failures: AtomicU64,
    /// Requests freed by a worker's removal rather than by their own end.
    pub freed_by_removal: AtomicU64,
    migrations: [AtomicU64; 5],
    /// Requests that failed on a worker and could not be migrated (limit
    /// reached, too long, not resumable, or no other worker).
    pub migrations_exhausted: AtomicU64,
    /// Requests cancelled by the request timeout.
    pub request_timeouts: AtomicU64,
    /// KV events from a subscriber whose worker left the router since.
    pub stale_kv_events: AtomicU64,
    /// `POST /v1/...` requests holding an in-flight permit.
    pub inflight: AtomicU64,
    /// The in-flight limit (`--max-inflight`).
    pub inflight_limit: AtomicU64,
    /// Requests refused at the in-flight limit (503).
    pub inflight_rejected: AtomicU64,
}

impl ServerMetrics {
    /// Counts a finished request.
    pub fn count_request(&self, status: RequestStatus) {
        let i = RequestStatus::ALL
            .iter()
            .position(|s| *s == status)
            .unwrap_or(0);
        self.requests[i].fetch_add(1, Ordering::Relaxed);
    }

    /// Requests counted with `status`.
    pub fn requests(&self, status: RequestStatus) -> u64 {
        let i = RequestStatus::ALL
            .iter()
            .position(|s| *s == status)
            .unwrap_or(0);
        self.requests[i].load(Ordering::Relaxed)
    }

    /// Counts one migration of a request away from a failed worker.
    pub fn count_migration(&self, reason: Failure) {
        self.migrations[reason.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Migrations counted with `reason`.
    pub fn migrations(&self, reason: Failure) -> u64 {
        self.migrations[reason.index()].load(Ordering::Relaxed)
    }

    /// Counts `n` admission outcomes.
    pub fn count_admissions(&self, decision: AdmissionDecision, n: u32) {
        let i = AdmissionDecision::ALL
            .iter()
            .position(|d| *d == decision)
            .unwrap_or(0);
        self.admission[i].fetch_add(u64::from(n), Ordering::Relaxed);
    }

    /// Appends the router-wide series to `out`.
    pub fn render(&self, out: &mut String, policy: &str) {
        out.push_str("# HELP switchyard_requests_total Requests by routing policy and how they ended.\n# TYPE switchyard_requests_total counter\n");
        for (status, n) in RequestStatus::ALL.iter().zip(&self.requests) {
            let _ = writeln!(
                out,
                "switchyard_requests_total{{policy=\"{policy}\",status=\"{}\"}} {}",
                status.label(),
                n.load(Ordering::Relaxed)
            );
        }
        out.push_str("# HELP switchyard_admission_decisions_total Admission outcomes.\n# TYPE switchyard_admission_decisions_total counter\n");
        for (decision, n) in AdmissionDecision::ALL.iter().zip(&self.admission) {
            let _ = writeln!(
                out,
                "switchyard_admission_decisions_total{{decision=\"{}\"}} {}",
                decision.label(),
                n.load(Ordering::Relaxed)
            );
        }
        self.ttft.render(
            out,
            "switchyard_time_to_first_token_seconds",
            "Arrival at the router to the first response byte from the worker.",
        );
        self.itl.render(
            out,
            "switchyard_inter_token_latency_seconds",
            "Time between consecutive streamed chunks.",
        );
        self.routing_decision.render(
            out,
            "switchyard_routing_decision_seconds",
            "Worker selection and booking, tokenization excluded.",
        );
        self.tokenize.render(
            out,
            "switchyard_tokenize_seconds",
            "Prompt to token ids, chat template included.",
        );
        render_one(
            out,
            "switchyard_upstream_failures_total",
            "counter",
            "Worker failures seen by the proxy (refused, reset, 5xx, timeout, broken stream), each reported to the worker's circuit breaker.",
            self.upstream_failures.load(Ordering::Relaxed),
        );
        render_one(
            out,
            "switchyard_requests_freed_by_removal_total",
            "counter",
            "Bookings dropped because their worker was removed.",
            self.freed_by_removal.load(Ordering::Relaxed),
        );
        out.push_str("# HELP switchyard_migrations_total Requests moved to another worker after a failure, by reason.\n# TYPE switchyard_migrations_total counter\n");
        for reason in Failure::ALL {
            let _ = writeln!(
                out,
                "switchyard_migrations_total{{reason=\"{}\"}} {}",
                reason.label(),
                self.migrations(reason)
            );
        }
        render_one(
            out,
            "switchyard_migrations_exhausted_total",
            "counter",
            "Failed requests that could not be migrated (limit, length, or no other worker).",
            self.migrations_exhausted.load(Ordering::Relaxed),
        );
        render_one(
            out,
            "switchyard_request_timeouts_total",
            "counter",
            "Requests cancelled by the request timeout.",
            self.request_timeouts.load(Ordering::Relaxed),
        );
        render_one(
            out,
            "switchyard_kv_events_stale_total",
            "counter",
            "KV events dropped because their worker left the router after the subscriber started.",
            self.stale_kv_events.load(Ordering::Relaxed),
        );
        render_one(
            out,
            "switchyard_inflight_requests",
            "gauge",
            "OpenAI requests in the router (queued, waiting or streaming).",
            self.inflight.load(Ordering::Relaxed),
        );
        render_one(
            out,
            "switchyard_inflight_limit",
            "gauge",
            "The in-flight limit (--max-inflight).",
            self.inflight_limit.load(Ordering::Relaxed),
        );
        render_one(
            out,
            "switchyard_inflight_rejected_total",
            "counter",
            "Requests refused with 503 at the in-flight limit.",
            self.inflight_rejected.load(Ordering::Relaxed),
        );
    }
}

/// Appends one unlabelled sample with its HELP and TYPE lines.
pub(crate) fn render_one(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    value: impl std::fmt::Display,
) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
    );
}

/// Appends one metric family with a `worker` label: its HELP and TYPE lines,
/// then one sample per row, in row order.
pub(crate) fn render_by_worker<W: std::fmt::Display, V: std::fmt::Display>(
    out: &mut String,
    name: &str,
    kind: &str,
    help: &str,
    rows: impl IntoIterator<Item = (W, V)>,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    for (worker, value) in rows {
        let _ = writeln!(out, "{name}{{worker=\"{worker}\"}} {value}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_renders_cumulative_buckets_sum_and_count() {
        let h = Histogram::default();
        h.observe(0.0001);
        h.observe(0.002);
        h.observe(100.0);
        let mut out = String::new();
        h.render(&mut out, "x_seconds", "help");
        assert!(out.contains("x_seconds_bucket{le=\"0.0001\"} 1\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{le=\"0.0025\"} 2\n"), "{out}");
        assert!(out.contains("x_seconds_bucket{le=\"+Inf\"} 3\n"), "{out}");
        assert!(out.contains("x_seconds_count 3\n"), "{out}");
    }

    #[test]
    fn every_status_label_is_rendered_even_at_zero() {
        let m = ServerMetrics::default();
        m.count_request(RequestStatus::Rejected);
        let mut out = String::new();
        m.render(&mut out, "kv");
        assert!(out.contains("switchyard_requests_total{policy=\"kv\",status=\"rejected\"} 1"));
        assert!(out.contains("switchyard_requests_total{policy=\"kv\",status=\"ok\"} 0"));
        assert!(out.contains("switchyard_migrations_total{reason=\"midstream\"} 0"));
    }
}
