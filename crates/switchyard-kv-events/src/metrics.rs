//! Counters of the KV-event plane, as `prometheus-client` families that a
//! server registers into its registry ([`KvEventMetrics::register`]) under
//! the names DESIGN.md lists. The `worker` label is the worker's name.
//!
//! | metric | labels | meaning |
//! |---|---|---|
//! | `switchyard_kv_events_total` | `worker`, `type` | events decoded, by wire type |
//! | `switchyard_kv_events_applied_total` | `worker`, `tier` | events passed to the index, by cache tier (`device`, `host`) |
//! | `switchyard_kv_events_dropped_total` | `reason` | events or messages skipped (all workers) |
//! | `switchyard_kv_event_gaps_total` | `worker` | sequence gaps seen |
//! | `switchyard_kv_event_batches_total` | `worker` | batches decoded |
//! | `switchyard_kv_event_replays_total` | `worker` | gaps filled from the replay socket (the history before first contact included) |
//! | `switchyard_kv_event_resets_total` | `worker` | times the worker's index entries were cleared to resync |
//!
//! A worker's label sets are created once, when its counters are
//! ([`KvEventMetrics::worker`]); the subscriber thread then only adds to
//! atomics through the handles it holds.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use std::sync::{Arc, Mutex};
use switchyard_core::index::CacheTier;
use switchyard_wire::normalize::SkipReason;

/// Event types counted by `switchyard_kv_events_total{type}`.
pub const EVENT_TYPES: [&str; 4] = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "Unknown"];

/// Every `reason` label of `switchyard_kv_events_dropped_total`: message
/// framing, payload decoding, then normalization (see
/// [`switchyard_wire::normalize::SkipReason`]).
pub const DROP_REASONS: [&str; 22] = [
    "bad_framing",
    "bad_sequence",
    "invalid_msgpack",
    "invalid_batch",
    "missing_field",
    "invalid_field",
    "invalid_event",
    "over_decode_budget",
    "too_many_events",
    "replay_over_bytes",
    // A batch naming a data-parallel rank the worker did not declare, or
    // another rank than the stream's (each rank publishes on its own port).
    "dp_rank_out_of_range",
    "dp_rank_mismatch",
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
const FILTER_REASONS: [&str; 3] = [
    "host_tier_without_tokens",
    "disk_tier",
    "non_full_attention_group",
];

/// Most worker streams one registry tracks; later ones share the entry
/// named [`OVERFLOW_WORKER`], so the label set stays bounded.
pub const MAX_WORKERS: usize = 4096;

/// The `worker` label of the counters shared by workers past
/// [`MAX_WORKERS`].
pub const OVERFLOW_WORKER: &str = "_overflow";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WorkerLabels {
    worker: Arc<str>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EventLabels {
    worker: Arc<str>,
    r#type: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    worker: Arc<str>,
    tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// Counters of one worker's event stream: handles into the registry's
/// families, so the subscriber thread that writes them only adds to
/// atomics. Drops are counted for the whole plane (their family has no
/// `worker` label): every worker's handles share one set.
#[derive(Debug)]
pub struct WorkerMetrics {
    name: Arc<str>,
    batches: Counter,
    events: [Counter; EVENT_TYPES.len()],
    /// Indexed like [`CacheTier::ALL`].
    applied: [Counter; CacheTier::ALL.len()],
    dropped: [Counter; DROP_REASONS.len()],
    gaps: Counter,
    replays: Counter,
    /// Not exported: the tests and `events listen` read it.
    replayed_batches: Counter,
    resets: Counter,
}

/// A point-in-time sum of the plane's counters ([`KvEventMetrics::total`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MetricsSnapshot {
    /// Batches decoded.
    pub batches: u64,
    /// Events decoded, indexed like [`EVENT_TYPES`].
    pub events: [u64; EVENT_TYPES.len()],
    /// Events passed to the index, indexed like [`CacheTier::ALL`].
    pub applied: [u64; CacheTier::ALL.len()],
    /// Drops, indexed like [`DROP_REASONS`].
    pub dropped: [u64; DROP_REASONS.len()],
    /// Sequence gaps seen.
    pub gaps: u64,
    /// Gaps filled from the replay socket.
    pub replays: u64,
    /// Batches received through replay.
    pub replayed_batches: u64,
    /// Times the workers' entries were cleared to resync.
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
    /// The name these counters are labelled with.
    pub fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn batch(&self) {
        self.batches.inc();
    }

    pub(crate) fn event(&self, type_name: &str) {
        let i = EVENT_TYPES
            .iter()
            .position(|t| *t == type_name)
            .unwrap_or(EVENT_TYPES.len() - 1);
        self.events[i].inc();
    }

    pub(crate) fn applied(&self, tier: CacheTier) {
        self.applied[tier as usize].inc();
    }

    pub(crate) fn drop_for(&self, reason: &str) {
        if let Some(i) = DROP_REASONS.iter().position(|r| *r == reason) {
            self.dropped[i].inc();
        }
    }

    pub(crate) fn gap(&self) {
        self.gaps.inc();
    }

    pub(crate) fn replay(&self, batches: u64) {
        self.replays.inc();
        self.replayed_batches.inc_by(batches);
    }

    pub(crate) fn reset(&self) {
        self.resets.inc();
    }
}

/// The KV-event plane's families, and every worker's handles into them.
#[derive(Debug)]
pub struct KvEventMetrics {
    events: Family<EventLabels, Counter>,
    applied: Family<TierLabels, Counter>,
    dropped: Family<ReasonLabels, Counter>,
    gaps: Family<WorkerLabels, Counter>,
    batches: Family<WorkerLabels, Counter>,
    replays: Family<WorkerLabels, Counter>,
    resets: Family<WorkerLabels, Counter>,
    /// The drop counters, one per [`DROP_REASONS`] entry, shared by every
    /// worker.
    dropped_handles: [Counter; DROP_REASONS.len()],
    workers: Mutex<Vec<Arc<WorkerMetrics>>>,
}

impl Default for KvEventMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl KvEventMetrics {
    /// Empty families; every drop reason is exported (at zero) from the
    /// start.
    pub fn new() -> Self {
        let dropped = Family::<ReasonLabels, Counter>::default();
        let dropped_handles =
            DROP_REASONS.map(|reason| dropped.get_or_create(&ReasonLabels { reason }).clone());
        Self {
            events: Family::default(),
            applied: Family::default(),
            dropped,
            gaps: Family::default(),
            batches: Family::default(),
            replays: Family::default(),
            resets: Family::default(),
            dropped_handles,
            workers: Mutex::new(Vec::new()),
        }
    }

    /// Registers the plane's families into `registry` (they stay shared
    /// with `self`: later counts show in every registry they are in).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "switchyard_kv_events",
            "KV events decoded, by worker and wire type",
            self.events.clone(),
        );
        registry.register(
            "switchyard_kv_events_applied",
            "KV events passed to the prefix index, by worker and cache tier",
            self.applied.clone(),
        );
        registry.register(
            "switchyard_kv_events_dropped",
            "KV events or messages skipped, by reason (all workers)",
            self.dropped.clone(),
        );
        registry.register(
            "switchyard_kv_event_gaps",
            "Sequence gaps seen in the worker's event stream",
            self.gaps.clone(),
        );
        registry.register(
            "switchyard_kv_event_batches",
            "KV-event batches decoded from the worker",
            self.batches.clone(),
        );
        registry.register(
            "switchyard_kv_event_replays",
            "Gaps filled from the worker's replay socket (the history before first contact included)",
            self.replays.clone(),
        );
        registry.register(
            "switchyard_kv_event_resets",
            "Times the worker's index entries were cleared to resync",
            self.resets.clone(),
        );
    }

    /// The plane's families alone as Prometheus text (what
    /// `events listen --metrics` prints).
    pub fn encode_text(&self) -> String {
        let mut registry = Registry::default();
        self.register(&mut registry);
        let mut out = String::new();
        prometheus_client::encoding::prometheus_text::encode(&mut out, &registry)
            .expect("writing to a String cannot fail");
        out
    }

    /// The counters of the worker named `name`, created on first use with
    /// their label sets (bounded by [`MAX_WORKERS`]); a worker that comes
    /// back under the same name gets the same counters.
    pub fn worker(&self, name: &str) -> Arc<WorkerMetrics> {
        let mut workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(found) = workers.iter().find(|w| &*w.name == name) {
            return found.clone();
        }
        let name = if workers.len() >= MAX_WORKERS {
            OVERFLOW_WORKER
        } else {
            name
        };
        if let Some(found) = workers.iter().find(|w| &*w.name == name) {
            return found.clone();
        }
        let created = Arc::new(self.create(name.into()));
        workers.push(created.clone());
        created
    }

    fn create(&self, name: Arc<str>) -> WorkerMetrics {
        let worker = WorkerLabels {
            worker: name.clone(),
        };
        let handle = |family: &Family<WorkerLabels, Counter>| family.get_or_create(&worker).clone();
        WorkerMetrics {
            batches: handle(&self.batches),
            events: EVENT_TYPES.map(|r#type| {
                self.events
                    .get_or_create(&EventLabels {
                        worker: name.clone(),
                        r#type,
                    })
                    .clone()
            }),
            applied: CacheTier::ALL.map(|tier| {
                self.applied
                    .get_or_create(&TierLabels {
                        worker: name.clone(),
                        tier: tier.as_str(),
                    })
                    .clone()
            }),
            dropped: self.dropped_handles.clone(),
            gaps: handle(&self.gaps),
            replays: handle(&self.replays),
            replayed_batches: Counter::default(),
            resets: handle(&self.resets),
            name,
        }
    }

    /// Sum over all workers (each read is atomic; the set may be torn).
    pub fn total(&self) -> MetricsSnapshot {
        let workers = self.workers.lock().unwrap_or_else(|p| p.into_inner());
        let mut total = MetricsSnapshot {
            dropped: std::array::from_fn(|i| self.dropped_handles[i].get()),
            ..MetricsSnapshot::default()
        };
        for w in workers.iter() {
            total.batches += w.batches.get();
            total.gaps += w.gaps.get();
            total.replays += w.replays.get();
            total.replayed_batches += w.replayed_batches.get();
            total.resets += w.resets.get();
            for (t, n) in total.events.iter_mut().zip(&w.events) {
                *t += n.get();
            }
            for (t, n) in total.applied.iter_mut().zip(&w.applied) {
                *t += n.get();
            }
        }
        total
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
        let w = registry.worker("w7");
        w.event("BlockStored");
        w.event("SomethingElse");
        w.drop_for("partial_block");
        w.drop_for("host_tier_without_tokens");
        w.applied(CacheTier::Host);
        w.gap();
        let text = registry.encode_text();
        assert!(text.contains("switchyard_kv_events_total{worker=\"w7\",type=\"BlockStored\"} 1\n"));
        assert!(text.contains("switchyard_kv_events_total{worker=\"w7\",type=\"Unknown\"} 1\n"));
        assert!(text.contains("switchyard_kv_events_dropped_total{reason=\"partial_block\"} 1\n"));
        assert!(text.contains("switchyard_kv_events_dropped_total{reason=\"bad_framing\"} 0\n"));
        assert!(text.contains("switchyard_kv_event_gaps_total{worker=\"w7\"} 1\n"));
        assert!(
            text.contains("switchyard_kv_events_applied_total{worker=\"w7\",tier=\"host\"} 1\n")
        );
        assert!(
            text.contains("switchyard_kv_events_applied_total{worker=\"w7\",tier=\"device\"} 0\n")
        );
        assert_eq!(registry.total().malformed(), 1);
        assert_eq!(registry.total().applied, [0, 1, 0]);
    }

    #[test]
    fn every_family_has_help_and_type() {
        let registry = KvEventMetrics::new();
        registry.worker("w");
        let text = registry.encode_text();
        for family in [
            "switchyard_kv_events_total",
            "switchyard_kv_events_applied_total",
            "switchyard_kv_events_dropped_total",
            "switchyard_kv_event_gaps_total",
            "switchyard_kv_event_batches_total",
            "switchyard_kv_event_replays_total",
            "switchyard_kv_event_resets_total",
        ] {
            assert!(
                text.contains(&format!("# HELP {family} ")),
                "{family}:\n{text}"
            );
            assert!(
                text.contains(&format!("# TYPE {family} counter\n")),
                "{family}:\n{text}"
            );
        }
    }

    #[test]
    fn a_worker_name_is_an_escaped_label_value() {
        let registry = KvEventMetrics::new();
        registry.worker("gpu \"a\"\\0").gap();
        let text = registry.encode_text();
        assert!(
            text.contains("switchyard_kv_event_gaps_total{worker=\"gpu \\\"a\\\"\\\\0\"} 1\n"),
            "{text}"
        );
    }

    #[test]
    fn a_worker_back_under_its_name_keeps_its_counters() {
        let registry = KvEventMetrics::new();
        registry.worker("a").gap();
        registry.worker("a").gap();
        assert_eq!(registry.total().gaps, 2);
        assert!(registry
            .encode_text()
            .contains("switchyard_kv_event_gaps_total{worker=\"a\"} 2\n"));
    }

    #[test]
    fn the_worker_label_set_is_bounded() {
        let registry = KvEventMetrics::new();
        for id in 0..MAX_WORKERS + 10 {
            registry.worker(&format!("w{id}"));
        }
        assert_eq!(registry.workers.lock().unwrap().len(), MAX_WORKERS + 1);
    }

    /// What the subscriber thread does per event, with a counting
    /// allocator (`allocation-counter` counts this thread's allocations).
    #[test]
    fn counting_events_does_not_allocate() {
        let registry = KvEventMetrics::new();
        let w = registry.worker("w");
        let counted = allocation_counter::measure(|| {
            for _ in 0..10_000 {
                w.batch();
                for t in EVENT_TYPES {
                    w.event(t);
                }
                w.applied(CacheTier::Device);
                w.drop_for("partial_block");
                w.gap();
                w.replay(2);
                w.reset();
            }
        });
        assert_eq!(counted.count_total, 0, "{counted:?}");
        let control = allocation_counter::measure(|| {
            std::hint::black_box(vec![0u8; 8]);
        });
        assert_eq!(
            control.count_total, 1,
            "the counting allocator is installed"
        );
        assert_eq!(registry.total().events[0], 10_000);
    }
}
