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
//! | | `digest_freed` | remote bookings freed because their replica's digest no longer listed them (a lost free) |
//! | | `truncated` | own bookings whose block list was cut to fit one message |
//! | `switchyard_replica_batches_total` | `direction` = `published`, `received`, `own`, `malformed`, `split`, `oversized`, `unsigned`, `bad_signature` | messages (`split`: batches sent as several messages to stay under the payload limit; `oversized`: refused, over `max_batch_bytes`; `unsigned`, `bad_signature`: refused by a signing replica) |
//! | `switchyard_replica_digests_total` | `direction` = `published`, `received` | digest parts |
//! | `switchyard_replica_session_bindings_total` | `direction` = `published`, `applied`, `evicted` | session bindings (`evicted`: a peer's oldest, past its per-peer cap) |
//! | `switchyard_replica_dropped_total` | `reason` = `origin_mismatch`, `unknown_worker`, `unknown_booking`, `duplicate`, `replica_full`, `bytes_full` | peers' events and bindings dropped by the checks of `switchyard_core::replica` |
//! | `switchyard_replica_clamped_total` | | peers' bookings and bindings with a number clamped to its bound |
//!
//! Every field is a handle into its family, its label set created by
//! [`ReplicaMetrics::default`]: adding to one is a relaxed atomic add.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use switchyard_core::replica::{RemoteCounters, RemoteDrops};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DirectionLabels {
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

type ByDirection = Family<DirectionLabels, Counter>;

/// The plane's counters; each only grows.
#[derive(Debug)]
pub struct ReplicaMetrics {
    events: ByDirection,
    batches: ByDirection,
    sessions: ByDirection,
    digests: ByDirection,
    drops: Family<ReasonLabels, Counter>,
    /// Peers' bookings and bindings clamped.
    pub clamped: Counter,
    /// Remote bookings freed by a digest.
    pub digest_freed: Counter,
    /// Own bookings whose blocks were cut to fit a message.
    pub truncated: Counter,
    /// Batches split into several messages.
    pub batches_split: Counter,
    /// Digest parts published.
    pub digests_published: Counter,
    /// Peers' digest parts received.
    pub digests_received: Counter,
    /// Peers' session bindings evicted at the per-peer cap.
    pub sessions_evicted: Counter,
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
    /// Messages refused for their size.
    pub batches_oversized: Counter,
    /// Messages refused for lacking a signature.
    pub batches_unsigned: Counter,
    /// Messages refused for a signature that does not verify.
    pub batches_bad_signature: Counter,
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
    /// Messages refused for their size.
    pub batches_oversized: u64,
    /// Messages refused for lacking a signature.
    pub batches_unsigned: u64,
    /// Messages refused for a bad signature.
    pub batches_bad_signature: u64,
    /// Remote bookings freed by a digest.
    pub digest_freed: u64,
    /// Batches split into several messages.
    pub batches_split: u64,
    /// Digest parts published.
    pub digests_published: u64,
    /// Digest parts received.
    pub digests_received: u64,
    /// Peers' events and bindings dropped, every reason.
    pub peer_dropped: u64,
    /// Peers' bookings and bindings clamped.
    pub clamped: u64,
}

impl Default for ReplicaMetrics {
    fn default() -> Self {
        let events = ByDirection::default();
        let batches = ByDirection::default();
        let sessions = ByDirection::default();
        let digests = ByDirection::default();
        let drops = Family::<ReasonLabels, Counter>::default();
        for (reason, _) in RemoteDrops::default().by_reason() {
            let _ = drops.get_or_create(&ReasonLabels { reason });
        }
        let handle = |family: &ByDirection, direction| {
            family.get_or_create(&DirectionLabels { direction }).clone()
        };
        Self {
            clamped: Counter::default(),
            digest_freed: handle(&events, "digest_freed"),
            truncated: handle(&events, "truncated"),
            batches_split: handle(&batches, "split"),
            digests_published: handle(&digests, "published"),
            digests_received: handle(&digests, "received"),
            sessions_evicted: handle(&sessions, "evicted"),
            published: handle(&events, "published"),
            dropped: handle(&events, "dropped"),
            received: handle(&events, "received"),
            applied: handle(&events, "applied"),
            expired: handle(&events, "expired"),
            batches_published: handle(&batches, "published"),
            batches_received: handle(&batches, "received"),
            batches_own: handle(&batches, "own"),
            batches_malformed: handle(&batches, "malformed"),
            batches_oversized: handle(&batches, "oversized"),
            batches_unsigned: handle(&batches, "unsigned"),
            batches_bad_signature: handle(&batches, "bad_signature"),
            sessions_published: handle(&sessions, "published"),
            sessions_applied: handle(&sessions, "applied"),
            events,
            batches,
            sessions,
            digests,
            drops,
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
            batches_oversized: self.batches_oversized.get(),
            batches_unsigned: self.batches_unsigned.get(),
            batches_bad_signature: self.batches_bad_signature.get(),
            digest_freed: self.digest_freed.get(),
            batches_split: self.batches_split.get(),
            digests_published: self.digests_published.get(),
            digests_received: self.digests_received.get(),
            peer_dropped: RemoteDrops::default()
                .by_reason()
                .iter()
                .map(|(reason, _)| self.drops.get_or_create(&ReasonLabels { reason }).get())
                .sum(),
            clamped: self.clamped.get(),
        }
    }

    /// Adds what applying a peer's batch reported to the drop, clamp,
    /// digest and session-eviction counters.
    pub fn record_remote(&self, remote: &RemoteCounters) {
        for (reason, n) in remote.drops.by_reason() {
            if n > 0 {
                self.drops.get_or_create(&ReasonLabels { reason }).inc_by(n);
            }
        }
        self.clamped.inc_by(remote.clamped);
        self.digest_freed.inc_by(remote.digest_freed);
        self.sessions_evicted.inc_by(remote.sessions_evicted);
    }

    /// Peers' events and bindings dropped for `reason` (a label of
    /// `switchyard_replica_dropped_total`).
    pub fn dropped_for(&self, reason: &'static str) -> u64 {
        self.drops.get_or_create(&ReasonLabels { reason }).get()
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
        registry.register(
            "switchyard_replica_digests",
            "Digest parts of live bookings by direction",
            self.digests.clone(),
        );
        registry.register(
            "switchyard_replica_dropped",
            "Peers' replica events and session bindings dropped, by reason",
            self.drops.clone(),
        );
        registry.register(
            "switchyard_replica_clamped",
            "Peers' bookings and session bindings with a number clamped to its bound",
            self.clamped.clone(),
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
        for d in ["malformed", "oversized", "unsigned", "bad_signature"] {
            assert!(text.contains(&format!(
                "switchyard_replica_batches_total{{direction=\"{d}\"}} 0\n"
            )));
        }
        for reason in [
            "origin_mismatch",
            "unknown_worker",
            "unknown_booking",
            "duplicate",
            "replica_full",
            "bytes_full",
        ] {
            assert!(
                text.contains(&format!(
                    "switchyard_replica_dropped_total{{reason=\"{reason}\"}} 0\n"
                )),
                "{text}"
            );
        }
        assert!(text.contains("switchyard_replica_events_total{direction=\"digest_freed\"} 0\n"));
        assert!(text.contains("switchyard_replica_clamped_total 0\n"));
        assert!(text.contains(
            "# HELP switchyard_replica_session_bindings_total Session bindings shared between replicas.\n# TYPE switchyard_replica_session_bindings_total counter\n"
        ), "{text}");
    }
}
