//! Counters of the KV-event plane: plain atomics, one set per worker
//! stream, rendered as Prometheus text under the names DESIGN.md lists.
//!
//! | metric | labels | meaning |
//! |---|---|---|
//! | `switchyard_kv_events_total` | `worker`, `type` | events decoded, by wire type |
//! | `switchyard_kv_events_dropped_total` | `reason` | events or messages skipped (all workers) |
//! | `switchyard_kv_event_gaps_total` | `worker` | sequence gaps seen |
//! | `switchyard_kv_event_batches_total` | `worker` | batches decoded |
//! | `switchyard_kv_event_replays_total` | `worker` | gaps filled from the replay socket |
//! | `switchyard_kv_event_resets_total` | `worker` | times the worker's index entries were cleared to resync |

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use switchyard_core::WorkerId;
use switchyard_wire::normalize::SkipReason;

/// Event types counted by `switchyard_kv_events_total{type}`.
pub const EVENT_TYPES: [&str; 4] = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "Unknown"];

/// Every `reason` label of `switchyard_kv_events_dropped_total`: message
/// framing, payload decoding, then normalization (see
/// [`switchyard_wire::normalize::SkipReason`]).
pub const DROP_REASONS: [&str; 17] = [
    "bad_framing",
    "bad_sequence",
    "invalid_msgpack",
    "invalid_batch",
    "missing_field",
    "invalid_field",
    "invalid_event",
    SkipReason::ALL[0].as_str(),
    SkipReason::ALL[1].as_str(),
    SkipReason::ALL[2].as_str(),
    SkipReason::ALL[3].as_str(),
    SkipReason::ALL[4].as_str(),
    SkipReason::ALL[5].as_str(),
    SkipReason::ALL[6].as_str(),
    SkipReason::ALL[7].as_str(),
    SkipReason::ALL[8].as_str(),
    SkipReason::ALL[9].as_str(),
];

/// Reasons in [`DROP_REASONS`] that are filtering, not bad input.
const FILTER_REASONS: [&str; 3] = ["host_tier", "disk_tier", "non_full_attention_group"];

/// Reads one counter out of a snapshot.
type CounterOf = fn(&MetricsSnapshot) -> u64;

/// Most worker streams one registry tracks; later ones share an overflow
/// entry (worker id `u64::MAX`), so the label set stays bounded.
pub const MAX_WORKERS: usize = 4096;

/// Counters of one worker's event stream. Written by its subscriber thread,
/// read by anyone.
#[derive(Debug)]
pub struct WorkerMetrics {
    worker: WorkerId,
    batches: AtomicU64,
    events: [AtomicU64; EVENT_TYPES.len()],
    dropped: [AtomicU64; DROP_REASONS.len()],
    gaps: AtomicU64,
    replays: AtomicU64,
    replayed_batches: AtomicU64,
    resets: AtomicU64,
}

/// A point-in-time copy of one worker's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Batches decoded.
    pub batches: u64,
    /// Events decoded, indexed like [`EVENT_TYPES`].
    pub events: [u64; EVENT_TYPES.len()],
    /// Drops, indexed like [`DROP_REASONS`].
    pub dropped: [u64; DROP_REASONS.len()],
    /// Sequence gaps seen.
    pub gaps: u64,
    /// Gaps filled from the replay socket.
    pub replays: u64,
    /// Batches received through replay.
    pub replayed_batches: u64,
    /// Times the worker's entries were cleared to resync.
    pub resets: u64,
}

impl MetricsSnapshot {
    /// Events of every type.
    pub fn total_events(&self) -> u64 {
        self.events.iter().sum()
    }

    /// Drops caused by bad input (filtered tiers and groups excluded).
    pub fn malformed(&self) -> u64 {
        DROP_REASONS
            .iter()
            .zip(self.dropped)
            .filter(|(reason, _)| !FILTER_REASONS.contains(reason))
            .map(|(_, n)| n)
            .sum()
    }

    /// Drops for `reason` (0 for a label not in [`DROP_REASONS`]).
    pub fn dropped(&self, reason: &str) -> u64 {
        DROP_REASONS
            .iter()
            .position(|r| *r == reason)
            .map_or(0, |i| self.dropped[i])
    }
}

impl WorkerMetrics {
    /// Fresh counters for `worker`.
    pub fn new(worker: WorkerId) -> Self {
        Self {
            worker,
            batches: AtomicU64::new(0),
            events: Default::default(),
            dropped: Default::default(),
            gaps: AtomicU64::new(0),
            replays: AtomicU64::new(0),
            replayed_batches: AtomicU64::new(0),
            resets: AtomicU64::new(0),
        }
    }

    /// The worker these counters belong to.
    pub fn worker(&self) -> WorkerId {
        self.worker
    }

    pub(crate) fn batch(&self) {
        self.batches.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn event(&self, type_name: &str) {
        let i = EVENT_TYPES
            .iter()
            .position(|t| *t == type_name)
            .unwrap_or(EVENT_TYPES.len() - 1);
        self.events[i].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn drop_for(&self, reason: &str) {
        if let Some(i) = DROP_REASONS.iter().position(|r| *r == reason) {
            self.dropped[i].fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn gap(&self) {
        self.gaps.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn replay(&self, batches: u64) {
        self.replays.fetch_add(1, Ordering::Relaxed);
        self.replayed_batches.fetch_add(batches, Ordering::Relaxed);
    }

    pub(crate) fn reset(&self) {
        self.resets.fetch_add(1, Ordering::Relaxed);
    }

    /// A copy of the counters (each read is atomic; the set may be torn).
    pub fn snapshot(&self) -> MetricsSnapshot {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        MetricsSnapshot {
            batches: load(&self.batches),
            events: std::array::from_fn(|i| load(&self.events[i])),
            dropped: std::array::from_fn(|i| load(&self.dropped[i])),
            gaps: load(&self.gaps),
            replays: load(&self.replays),
            replayed_batches: load(&self.replayed_batches),
            resets: load(&self.resets),
        }
    }
}

/// All workers' KV-event counters.
#[derive(Debug, Default)]
pub struct KvEventMetrics {
    workers: Mutex<Vec<Arc<WorkerMetrics>>>,
}

impl KvEventMetrics {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    /// The counters of `worker`, created on first use (bounded by
    /// [`MAX_WORKERS`]).
    pub fn worker(&self, worker: WorkerId) -> Arc<WorkerMetrics> {
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(found) = workers.iter().find(|w| w.worker == worker) {
            return found.clone();
        }
        let id = if workers.len() >= MAX_WORKERS {
            WorkerId::new(u64::MAX)
        } else {
            worker
        };
        if let Some(found) = workers.iter().find(|w| w.worker == id) {
            return found.clone();
        }
        let created = Arc::new(WorkerMetrics::new(id));
        workers.push(created.clone());
        created
    }

    /// Sum over all workers.
    pub fn total(&self) -> MetricsSnapshot {
        let workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        let mut total = MetricsSnapshot::default();
        for snap in workers.iter().map(|w| w.snapshot()) {
            total.batches += snap.batches;
            total.gaps += snap.gaps;
            total.replays += snap.replays;
            total.replayed_batches += snap.replayed_batches;
            total.resets += snap.resets;
            for (t, n) in total.events.iter_mut().zip(snap.events) {
                *t += n;
            }
            for (t, n) in total.dropped.iter_mut().zip(snap.dropped) {
                *t += n;
            }
        }
        total
    }

    /// Prometheus text exposition of every counter.
    pub fn render_prometheus(&self) -> String {
        let workers: Vec<_> = self
            .workers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|w| (w.worker, w.snapshot()))
            .collect();
        let mut out = String::new();
        out.push_str("# TYPE switchyard_kv_events_total counter\n");
        for (worker, snap) in &workers {
            for (t, n) in EVENT_TYPES.iter().zip(snap.events) {
                let _ = writeln!(
                    out,
                    "switchyard_kv_events_total{{worker=\"{worker}\",type=\"{t}\"}} {n}"
                );
            }
        }
        out.push_str("# TYPE switchyard_kv_events_dropped_total counter\n");
        let total = self.total();
        for (reason, n) in DROP_REASONS.iter().zip(total.dropped) {
            let _ = writeln!(
                out,
                "switchyard_kv_events_dropped_total{{reason=\"{reason}\"}} {n}"
            );
        }
        let per_worker: [(&str, CounterOf); 4] = [
            ("switchyard_kv_event_gaps_total", |s| s.gaps),
            ("switchyard_kv_event_batches_total", |s| s.batches),
            ("switchyard_kv_event_replays_total", |s| s.replays),
            ("switchyard_kv_event_resets_total", |s| s.resets),
        ];
        for (name, get) in per_worker {
            let _ = writeln!(out, "# TYPE {name} counter");
            for (worker, snap) in &workers {
                let _ = writeln!(out, "{name}{{worker=\"{worker}\"}} {}", get(snap));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drop_reasons_cover_every_decode_and_skip_reason() {
        for reason in SkipReason::ALL {
            assert!(DROP_REASONS.contains(&reason.as_str()));
        }
        for filtered in FILTER_REASONS {
            assert!(DROP_REASONS.contains(&filtered));
        }
    }

    #[test]
    fn prometheus_text_uses_the_documented_names_and_labels() {
        let registry = KvEventMetrics::new();
        let w = registry.worker(WorkerId::new(7));
        w.event("BlockStored");
        w.event("SomethingElse");
        w.drop_for("partial_block");
        w.drop_for("host_tier");
        w.gap();
        let text = registry.render_prometheus();
        assert!(text.contains("switchyard_kv_events_total{worker=\"7\",type=\"BlockStored\"} 1"));
        assert!(text.contains("switchyard_kv_events_total{worker=\"7\",type=\"Unknown\"} 1"));
        assert!(text.contains("switchyard_kv_events_dropped_total{reason=\"partial_block\"} 1"));
        assert!(text.contains("switchyard_kv_event_gaps_total{worker=\"7\"} 1"));
        assert_eq!(registry.total().malformed(), 1);
    }

    #[test]
    fn the_worker_label_set_is_bounded() {
        let registry = KvEventMetrics::new();
        for id in 0..MAX_WORKERS as u64 + 10 {
            registry.worker(WorkerId::new(id));
        }
        assert_eq!(registry.workers.lock().unwrap().len(), MAX_WORKERS + 1);
    }
}
