//! Counters of the replica plane, as `prometheus-client` families that a
//! server registers into its registry ([`ReplicaMetrics::register`]).
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
//!
//! Every field is a handle into its family, its label set created by
//! [`ReplicaMetrics::default`]: adding to one is a relaxed atomic add.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: &'static str,
}

type ByDirection = Family<DirectionLabels, Counter>;

/// The plane's counters; each only grows.
#[derive(Debug)]
pub struct ReplicaMetrics {
    events: ByDirection,
    batches: ByDirection,
    sessions: ByDirection,
    /// Events published.
    pub published: Counter,
    /// Events dropped.
    pub dropped: Counter,
    /// Peers' events received.
    pub received: Counter,
    /// Peers' events applied.
    pub applied: Counter,
    /// Remote bookings expired.
    pub expired: Counter,
    /// Batches published (heartbeats included).
    pub batches_published: Counter,
    /// Peers' batches received.
    pub batches_received: Counter,
    /// Own batches received and ignored.
    pub batches_own: Counter,
    /// Messages that did not decode.
    pub batches_malformed: Counter,
    /// Session bindings published.
    pub sessions_published: Counter,
    /// Peers' session bindings applied.
    pub sessions_applied: Counter,
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

impl Default for ReplicaMetrics {
    fn default() -> Self {
        let events = ByDirection::default();
        let batches = ByDirection::default();
        let sessions = ByDirection::default();
        let handle = |family: &ByDirection, direction| {
            family.get_or_create(&DirectionLabels { direction }).clone()
        };
        Self {
            published: handle(&events, "published"),
            dropped: handle(&events, "dropped"),
            received: handle(&events, "received"),
            applied: handle(&events, "applied"),
            expired: handle(&events, "expired"),
            batches_published: handle(&batches, "published"),
            batches_received: handle(&batches, "received"),
            batches_own: handle(&batches, "own"),
            batches_malformed: handle(&batches, "malformed"),
            sessions_published: handle(&sessions, "published"),
            sessions_applied: handle(&sessions, "applied"),
            events,
            batches,
            sessions,
        }
    }
}

impl ReplicaMetrics {
    /// Reads every counter.
    pub fn snapshot(&self) -> ReplicaSnapshot {
        ReplicaSnapshot {
            published: self.published.get(),
            dropped: self.dropped.get(),
            received: self.received.get(),
            applied: self.applied.get(),
            expired: self.expired.get(),
            batches_published: self.batches_published.get(),
            batches_received: self.batches_received.get(),
            batches_own: self.batches_own.get(),
            batches_malformed: self.batches_malformed.get(),
        }
    }

    /// Registers the plane's families into `registry` (shared with `self`).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "switchyard_replica_events",
            "Replica-sync lifecycle events by direction",
            self.events.clone(),
        );
        registry.register(
            "switchyard_replica_batches",
            "Replica-sync messages by direction",
            self.batches.clone(),
        );
        registry.register(
            "switchyard_replica_session_bindings",
            "Session bindings shared between replicas",
            self.sessions.clone(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::encoding::prometheus_text::encode;

    #[test]
    fn every_direction_is_exported_even_at_zero() {
        let m = ReplicaMetrics::default();
        m.dropped.inc_by(3);
        let mut registry = Registry::default();
        m.register(&mut registry);
        let mut text = String::new();
        encode(&mut text, &registry).unwrap();
        for d in ["published", "received", "applied", "expired"] {
            assert!(text.contains(&format!(
                "switchyard_replica_events_total{{direction=\"{d}\"}} 0\n"
            )));
        }
        assert!(text.contains("switchyard_replica_events_total{direction=\"dropped\"} 3\n"));
        assert!(text.contains("switchyard_replica_batches_total{direction=\"malformed\"} 0\n"));
        assert!(text.contains(
            "# HELP switchyard_replica_session_bindings_total Session bindings shared between replicas.\n# TYPE switchyard_replica_session_bindings_total counter\n"
        ), "{text}");
    }
}
