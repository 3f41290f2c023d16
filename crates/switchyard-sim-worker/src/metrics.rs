//! The sim-worker's Prometheus metrics (names as in DESIGN.md "Interfaces").
//!
//! The driver writes a snapshot after every step; `/metrics` reads it
//! without locking the engine.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use switchyard_engine::{DeviceLayer, Engine};

/// Shared counters and gauges.
#[derive(Debug, Default)]
pub struct Metrics {
    kv_usage_bits: AtomicU64,
    prompt_tokens: AtomicU64,
    prefix_hit_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    running: AtomicU64,
    waiting: AtomicU64,
    preemptions: AtomicU64,
    cached_blocks: AtomicU64,
    host_blocks: AtomicU64,
    steps: AtomicU64,
    paced_micros: AtomicU64,
    pacing_dropped_micros: AtomicU64,
    pacing_resyncs: AtomicU64,
    restores: [AtomicU64; 5],
    /// KV events emitted.
    pub kv_events: AtomicU64,
    /// KV events dropped because the publisher lagged or failed.
    pub kv_events_dropped: AtomicU64,
    /// KV-event batches published over ZMQ.
    pub kv_batches_published: AtomicU64,
    requests: Mutex<Vec<(&'static str, u64)>>,
}

const RESTORE_LABELS: [&str; 5] = [
    "no_reusable_entry",
    "sequence_capacity_not_ready",
    "native_restore_skipped",
    "restored",
    "failed",
];

impl Metrics {
    /// Counts a request leaving with `status` (a fixed label set).
    pub fn count_request(&self, status: &'static str) {
        let mut requests = self
            .requests
            .lock()
            .expect("metrics lock is never poisoned");
        match requests.iter_mut().find(|(s, _)| *s == status) {
            Some((_, n)) => *n += 1,
            None => requests.push((status, 1)),
        }
    }

    /// Counts one paced step: the wall time the timing model gave it and
    /// the schedule given up before it (see the driver's `MAX_LAG`).
    pub fn record_pacing(&self, paced: std::time::Duration, dropped: std::time::Duration) {
        self.paced_micros
            .fetch_add(paced.as_micros() as u64, Ordering::Relaxed);
        if !dropped.is_zero() {
            self.pacing_dropped_micros
                .fetch_add(dropped.as_micros() as u64, Ordering::Relaxed);
            self.pacing_resyncs.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Copies the engine's counters and gauges.
    pub fn observe<D: DeviceLayer>(&self, engine: &Engine<D>) {
        let c = engine.counters();
        let set = |a: &AtomicU64, v: u64| a.store(v, Ordering::Relaxed);
        set(&self.kv_usage_bits, engine.kv_usage().to_bits());
        set(&self.prompt_tokens, c.prompt_tokens);
        set(&self.prefix_hit_tokens, c.prefix_hit_tokens);
        set(&self.generation_tokens, c.generated_tokens);
        set(&self.running, engine.running_len() as u64);
        set(&self.waiting, engine.waiting_len() as u64);
        set(&self.preemptions, c.preemptions);
        set(&self.cached_blocks, engine.kv().cached_blocks() as u64);
        set(&self.host_blocks, engine.kv().host_blocks() as u64);
        set(&self.steps, c.steps);
        let r = c.restores;
        for (slot, v) in self.restores.iter().zip([
            r.no_reusable_entry,
            r.sequence_capacity_not_ready,
            r.native_restore_skipped,
            r.restored,
            r.failed,
        ]) {
            set(slot, v);
        }
    }

    /// Prometheus text exposition.
    pub fn render(&self) -> String {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut out = String::with_capacity(2048);
        let mut metric = |name: &str, kind: &str, help: &str, value: String| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}"
            );
        };
        metric(
            "switchyard_engine_kv_usage_ratio",
            "gauge",
            "Used over total device KV blocks.",
            f64::from_bits(get(&self.kv_usage_bits)).to_string(),
        );
        for (name, help, v) in [
            (
                "switchyard_engine_prompt_tokens_total",
                "Prompt tokens admitted.",
                &self.prompt_tokens,
            ),
            (
                "switchyard_engine_prefix_hit_tokens_total",
                "Prompt tokens served from the prefix cache.",
                &self.prefix_hit_tokens,
            ),
            (
                "switchyard_engine_generation_tokens_total",
                "Output tokens generated.",
                &self.generation_tokens,
            ),
            (
                "switchyard_engine_preemptions_total",
                "Requests preempted (recompute).",
                &self.preemptions,
            ),
            (
                "switchyard_engine_steps_total",
                "Scheduler steps that computed something.",
                &self.steps,
            ),
            (
                "switchyard_engine_kv_events_total",
                "KV events emitted.",
                &self.kv_events,
            ),
            (
                "switchyard_engine_kv_events_dropped_total",
                "KV events dropped because the publisher lagged or failed.",
                &self.kv_events_dropped,
            ),
            (
                "switchyard_engine_kv_batches_published_total",
                "KV-event batches published over ZMQ.",
                &self.kv_batches_published,
            ),
        ] {
            metric(name, "counter", help, get(v).to_string());
        }
        for (name, help, v) in [
            (
                "switchyard_engine_paced_seconds_total",
                "Wall time the timing model gave the steps run (model time / speed-up).",
                &self.paced_micros,
            ),
            (
                "switchyard_engine_pacing_dropped_seconds_total",
                "Schedule the driver fell too far behind to catch up on and gave up: the worker ran that much slower than its model.",
                &self.pacing_dropped_micros,
            ),
        ] {
            metric(name, "counter", help, (get(v) as f64 / 1e6).to_string());
        }
        metric(
            "switchyard_engine_pacing_resyncs_total",
            "counter",
            "Times the driver gave up schedule (see switchyard_engine_pacing_dropped_seconds_total).",
            get(&self.pacing_resyncs).to_string(),
        );
        for (name, help, v) in [
            (
                "switchyard_engine_running",
                "Requests running.",
                &self.running,
            ),
            (
                "switchyard_engine_waiting",
                "Requests waiting.",
                &self.waiting,
            ),
            (
                "switchyard_engine_cached_blocks",
                "Device blocks holding a cached prefix block.",
                &self.cached_blocks,
            ),
            (
                "switchyard_engine_host_cached_blocks",
                "Host-tier blocks.",
                &self.host_blocks,
            ),
        ] {
            metric(name, "gauge", help, get(v).to_string());
        }
        let _ = writeln!(
            out,
            "# HELP switchyard_engine_restores_total Host-tier restore outcomes by decision.\n# TYPE switchyard_engine_restores_total counter"
        );
        for (label, v) in RESTORE_LABELS.iter().zip(&self.restores) {
            let _ = writeln!(
                out,
                "switchyard_engine_restores_total{{decision=\"{label}\"}} {}",
                get(v)
            );
        }
        let _ = writeln!(
            out,
            "# HELP switchyard_engine_requests_total Requests by final status.\n# TYPE switchyard_engine_requests_total counter"
        );
        let requests = self
            .requests
            .lock()
            .expect("metrics lock is never poisoned")
            .clone();
        for (status, n) in requests {
            let _ = writeln!(
                out,
                "switchyard_engine_requests_total{{status=\"{status}\"}} {n}"
            );
        }
        out
    }
}
