//! Counters of the replica plane, rendered as Prometheus text.
//!
//! | metric | labels | meaning |
//! |---|---|---|
//! | `switchyard_replica_events_total` | `direction` = `published` | events handed to the transport |
//! | | `dropped` | events dropped: queue full, or an in-flight publish cut by shutdown or a transport error |
//! | | `received` | events in peers' batches (own batches excluded) |
//! | | `applied` | peers' events that changed the local model |
//! | | `expired` | remote bookings freed because their replica went silent |
//! | `switchyard_replica_batches_total` | `direction` = `published`, `received`, `own`, `malformed` | messages |
//! | `switchyard_replica_session_bindings_total` | `direction` = `published`, `applied` | session bindings |

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};

/// Plain atomics; every counter only grows.
#[derive(Debug, Default)]
pub struct ReplicaMetrics {
    /// Events published.
    pub published: AtomicU64,
    /// Events dropped.
    pub dropped: AtomicU64,
    /// Peers' events received.
    pub received: AtomicU64,
    /// Peers' events applied.
    pub applied: AtomicU64,
    /// Remote bookings expired.
    pub expired: AtomicU64,
    /// Batches published (heartbeats included).
    pub batches_published: AtomicU64,
    /// Peers' batches received.
    pub batches_received: AtomicU64,
    /// Own batches received and ignored.
    pub batches_own: AtomicU64,
    /// Messages that did not decode.
    pub batches_malformed: AtomicU64,
    /// Session bindings published.
    pub sessions_published: AtomicU64,
    /// Peers' session bindings applied.
    pub sessions_applied: AtomicU64,
}

/// A point-in-time copy of [`ReplicaMetrics`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReplicaSnapshot {
    /// Events published.
    pub published: u64,
    /// Events dropped.
    pub dropped: u64,
    /// Peers' events received.
    pub received: u64,
    /// Peers' events applied.
    pub applied: u64,
    /// Remote bookings expired.
    pub expired: u64,
    /// Batches published.
    pub batches_published: u64,
    /// Peers' batches received.
    pub batches_received: u64,
    /// Own batches ignored.
    pub batches_own: u64,
    /// Malformed messages.
    pub batches_malformed: u64,
}

impl ReplicaMetrics {
    /// Adds `n` to one of the counters.
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Reads every counter.
    pub fn snapshot(&self) -> ReplicaSnapshot {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        ReplicaSnapshot {
            published: r(&self.published),
            dropped: r(&self.dropped),
            received: r(&self.received),
            applied: r(&self.applied),
            expired: r(&self.expired),
            batches_published: r(&self.batches_published),
            batches_received: r(&self.batches_received),
            batches_own: r(&self.batches_own),
            batches_malformed: r(&self.batches_malformed),
        }
    }

    /// Prometheus text exposition of every counter.
    pub fn render(&self) -> String {
        let r = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let mut out = String::new();
        out.push_str(
            "# HELP switchyard_replica_events_total Replica-sync lifecycle events by direction.\n",
        );
        out.push_str("# TYPE switchyard_replica_events_total counter\n");
        for (direction, counter) in [
            ("published", &self.published),
            ("dropped", &self.dropped),
            ("received", &self.received),
            ("applied", &self.applied),
            ("expired", &self.expired),
        ] {
            let _ = writeln!(
                out,
                "switchyard_replica_events_total{{direction=\"{direction}\"}} {}",
                r(counter)
            );
        }
        out.push_str(
            "# HELP switchyard_replica_batches_total Replica-sync messages by direction.\n",
        );
        out.push_str("# TYPE switchyard_replica_batches_total counter\n");
        for (direction, counter) in [
            ("published", &self.batches_published),
            ("received", &self.batches_received),
            ("own", &self.batches_own),
            ("malformed", &self.batches_malformed),
        ] {
            let _ = writeln!(
                out,
                "switchyard_replica_batches_total{{direction=\"{direction}\"}} {}",
                r(counter)
            );
        }
        out.push_str("# HELP switchyard_replica_session_bindings_total Session bindings shared between replicas.\n");
        out.push_str("# TYPE switchyard_replica_session_bindings_total counter\n");
        for (direction, counter) in [
            ("published", &self.sessions_published),
            ("applied", &self.sessions_applied),
        ] {
            let _ = writeln!(
                out,
                "switchyard_replica_session_bindings_total{{direction=\"{direction}\"}} {}",
                r(counter)
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_direction_is_rendered_even_at_zero() {
        let m = ReplicaMetrics::default();
        ReplicaMetrics::add(&m.dropped, 3);
        let text = m.render();
        for d in ["published", "received", "applied", "expired"] {
            assert!(text.contains(&format!(
                "switchyard_replica_events_total{{direction=\"{d}\"}} 0"
            )));
        }
        assert!(text.contains("switchyard_replica_events_total{direction=\"dropped\"} 3"));
    }
}
