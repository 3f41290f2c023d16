//! What `/metrics` shows of the routing state: a [`Snapshot`] read under the
//! router's lock in one go ([`crate::shared::SharedRouter::snapshot`]), and
//! its rendering. Per-worker series are labelled by the worker's name.

use crate::metrics::{render_by_worker, render_one};
use std::fmt::Write as _;
use std::sync::Arc;
use switchyard_core::health::CircuitState;
use switchyard_replica::ReplicaMetrics;

/// One worker's row.
#[derive(Debug, Clone)]
pub struct WorkerRow {
    /// Its name.
    pub name: Arc<str>,
    /// Uncached prefill tokens booked on it now.
    pub prefill_tokens: u64,
    /// KV blocks its active requests hold.
    pub decode_blocks: usize,
    /// Requests booked on it (this replica's and its peers').
    pub requests: usize,
    /// Of those, this replica's.
    pub local_requests: usize,
    /// Of those, its peers'.
    pub remote_requests: usize,
    /// In selection.
    pub up: bool,
    /// Measured KV usage, when read.
    pub kv_usage: Option<f64>,
    /// Its circuit's state.
    pub circuit: CircuitState,
    /// Circuit transitions into each state.
    pub circuit_transitions: [u64; 3],
}

/// The routing state at one instant.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Every worker, sorted by name.
    pub workers: Vec<WorkerRow>,
    /// Requests booked on any worker.
    pub active_requests: usize,
    /// Live (block, worker) pairs in the prefix index.
    pub index_blocks: usize,
    /// Estimated heap bytes of the index and the registry.
    pub index_bytes: usize,
    /// Requests waiting in the admission queue.
    pub queue_depth: usize,
    /// The admission strategy's name and event counters, when one is on.
    pub strategy: Option<(&'static str, Vec<(&'static str, u64)>)>,
    /// The replica plane's counters, with sync on.
    pub replica: Option<Arc<ReplicaMetrics>>,
}

impl Snapshot {
    /// Appends every series of the snapshot to `out`.
    pub fn render(&self, out: &mut String) {
        let rows = &self.workers;
        let name = |r: &WorkerRow| r.name.clone();
        render_by_worker(
            out,
            "switchyard_worker_active_prefill_tokens",
            "gauge",
            "Uncached prefill tokens booked on the worker.",
            rows.iter().map(|r| (name(r), r.prefill_tokens)),
        );
        render_by_worker(
            out,
            "switchyard_worker_active_decode_blocks",
            "gauge",
            "KV blocks held by the worker's active requests.",
            rows.iter().map(|r| (name(r), r.decode_blocks)),
        );
        render_by_worker(
            out,
            "switchyard_worker_active_requests",
            "gauge",
            "Requests booked on the worker and not yet freed.",
            rows.iter().map(|r| (name(r), r.requests)),
        );
        render_by_worker(
            out,
            "switchyard_worker_up",
            "gauge",
            "1 while the worker is in selection.",
            rows.iter().map(|r| (name(r), u8::from(r.up))),
        );
        render_by_worker(
            out,
            "switchyard_worker_kv_usage_ratio",
            "gauge",
            "Fraction of the worker's KV cache in use, from its /metrics (read while an admission strategy is on).",
            rows.iter().filter_map(|r| Some((name(r), r.kv_usage?))),
        );
        render_by_worker(
            out,
            "switchyard_circuit_state",
            "gauge",
            "Circuit breaker per worker: 0 closed, 1 open, 2 half-open.",
            rows.iter().map(|r| (name(r), r.circuit as u8)),
        );
        out.push_str("# HELP switchyard_circuit_transitions_total Circuit breaker transitions per worker, by the state entered.\n# TYPE switchyard_circuit_transitions_total counter\n");
        for r in rows {
            for to in CircuitState::ALL {
                let _ = writeln!(
                    out,
                    "switchyard_circuit_transitions_total{{worker=\"{}\",to=\"{}\"}} {}",
                    r.name,
                    to.label(),
                    r.circuit_transitions[to as usize]
                );
            }
        }
        let family = "switchyard_worker_active_requests_by_origin";
        let _ = writeln!(
            out,
            "# HELP {family} Requests booked on the worker, by the replica that booked them (local: this one).\n# TYPE {family} gauge"
        );
        for r in rows {
            let _ = writeln!(
                out,
                "{family}{{worker=\"{w}\",origin=\"local\"}} {}\n{family}{{worker=\"{w}\",origin=\"remote\"}} {}",
                r.local_requests,
                r.remote_requests,
                w = r.name,
            );
        }
        render_one(
            out,
            "switchyard_active_requests",
            "gauge",
            "Requests booked on any worker.",
            self.active_requests,
        );
        render_one(
            out,
            "switchyard_index_blocks",
            "gauge",
            "Live (block, worker) pairs in the prefix index.",
            self.index_blocks,
        );
        render_one(
            out,
            "switchyard_index_bytes",
            "gauge",
            "Estimated heap bytes of the index and the registry.",
            self.index_bytes,
        );
        render_one(
            out,
            "switchyard_queue_depth",
            "gauge",
            "Requests waiting in the admission queue.",
            self.queue_depth,
        );
        if let Some((strategy, counts)) = &self.strategy {
            out.push_str(
                "# HELP switchyard_admission_strategy_events_total Events of the admission strategy (deferrals, pauses, resumes, migrated turns, expiries).\n# TYPE switchyard_admission_strategy_events_total counter\n",
            );
            for (event, n) in counts {
                let _ = writeln!(
                    out,
                    "switchyard_admission_strategy_events_total{{strategy=\"{strategy}\",event=\"{event}\"}} {n}"
                );
            }
        }
        if let Some(replica) = &self.replica {
            out.push_str(&replica.render());
        }
    }
}
