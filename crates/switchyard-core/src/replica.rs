//! Remote bookings: peers' lifecycle events applied to the local write model.
//!
//! Several router replicas serve one fleet; each publishes its own
//! `AddRequest` / `MarkPrefillCompleted` / `Free` events and applies its
//! peers' events here, so every replica's load view includes every booking.
//! This module is the bookkeeping of who owns which remote booking; the
//! bookings themselves live in the same [`ActiveSequences`] as local ones, so
//! selectors see one load per worker.
//!
//! Semantics (advisory, as DESIGN.md's "Replica sync" asks):
//!
//! - A replica's own events are ignored ([`RemoteOutcome::Own`]).
//! - `Add` and `Free` take effect only for the replica that booked the
//!   request: a peer cannot free a local booking or another peer's.
//!   `MarkPrefillCompleted` is accepted from any origin, so a worker can mark
//!   its requests done on every replica directly.
//! - Every event (and an empty heartbeat) refreshes its origin's last-heard
//!   time. An origin silent for `silence_expiry_ms` is presumed dead and its
//!   bookings are freed by [`RemoteBookings::expire_silent`]. Remote bookings
//!   are also subject to the write model's own per-request expiry.
//! - Origins are bounded (`max_replicas`): a new origin at the cap evicts the
//!   longest-silent one, freeing its bookings (counted).
//! - There is no snapshot: a replica that starts late sees only bookings made
//!   after it subscribed, and its view converges to the truth as the peers'
//!   older requests end (at most one request lifetime, or the expiry).

use crate::maps::{map_bytes, FxHashMap};
use crate::sequences::{ActiveSequences, LifecycleOutcome, SequenceEvent};
use crate::types::{ReplicaId, RequestId, WorkerId};
use serde::{Deserialize, Serialize};

/// Settings of [`RemoteBookings`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteConfig {
    /// An origin heard from neither event nor heartbeat for this long has
    /// its bookings freed.
    pub silence_expiry_ms: f64,
    /// Origins tracked at once.
    pub max_replicas: usize,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            silence_expiry_ms: 300_000.0,
            max_replicas: 1024,
        }
    }
}

/// Why a [`RemoteConfig`] was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RemoteConfigError {
    /// Expiry not positive.
    #[error("silence_expiry_ms must be positive and finite, got {0}")]
    Expiry(f64),
    /// No origin could be tracked.
    #[error("max_replicas must be at least 1")]
    MaxReplicas,
}

impl RemoteConfig {
    /// Checks ranges.
    pub fn validate(&self) -> Result<(), RemoteConfigError> {
        if !(self.silence_expiry_ms.is_finite() && self.silence_expiry_ms > 0.0) {
            return Err(RemoteConfigError::Expiry(self.silence_expiry_ms));
        }
        if self.max_replicas == 0 {
            return Err(RemoteConfigError::MaxReplicas);
        }
        Ok(())
    }
}

/// What applying a peer's event did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteOutcome {
    /// The event came from this replica itself: ignored.
    Own,
    /// A `Free` (or a second `Add`) for a request the origin did not book.
    NotOwner,
    /// The write model's outcome.
    Lifecycle(LifecycleOutcome),
}

impl RemoteOutcome {
    /// Whether the event changed state.
    pub fn applied(self) -> bool {
        self == RemoteOutcome::Lifecycle(LifecycleOutcome::Applied)
    }
}

/// Counters for metrics; they only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteCounters {
    /// Remote events that changed state.
    pub applied: u64,
    /// Own events received and ignored.
    pub own: u64,
    /// Remote events that changed nothing (duplicate, unknown, not owner).
    pub ignored: u64,
    /// Remote bookings freed because their origin went silent or was
    /// evicted at the cap.
    pub expired: u64,
    /// Origins evicted at `max_replicas`.
    pub evicted_replicas: u64,
}

#[derive(Debug)]
struct Origin {
    last_heard_ms: f64,
    bookings: FxHashMap<RequestId, ()>,
}

/// Who owns each remote booking, and when each origin was last heard.
///
/// `owners` holds one entry per remote booking (origin and worker) and
/// `per_worker` one count per worker that has any, so both are bounded by
/// the remote bookings held; a worker's entry goes when its count is zero.
#[derive(Debug)]
pub struct RemoteBookings {
    config: RemoteConfig,
    local: Option<ReplicaId>,
    origins: FxHashMap<ReplicaId, Origin>,
    owners: FxHashMap<RequestId, (ReplicaId, WorkerId)>,
    per_worker: FxHashMap<WorkerId, usize>,
    counters: RemoteCounters,
}

impl RemoteBookings {
    /// No remote bookings; `config` must validate.
    pub fn new(config: RemoteConfig) -> Result<Self, RemoteConfigError> {
        config.validate()?;
        Ok(Self {
            config,
            local: None,
            origins: FxHashMap::default(),
            owners: FxHashMap::default(),
            per_worker: FxHashMap::default(),
            counters: RemoteCounters::default(),
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &RemoteConfig {
        &self.config
    }

    /// This replica's id: events carrying it are ignored.
    pub fn set_local(&mut self, local: ReplicaId) {
        self.local = Some(local);
    }

    /// This replica's id, once set.
    pub fn local(&self) -> Option<ReplicaId> {
        self.local
    }

    /// Records that `origin` is alive (an event or an empty heartbeat).
    /// Returns `false` for this replica's own id.
    pub fn heard_from(
        &mut self,
        origin: ReplicaId,
        sequences: &mut ActiveSequences,
        now_ms: f64,
    ) -> bool {
        if Some(origin) == self.local {
            return false;
        }
        if let Some(known) = self.origins.get_mut(&origin) {
            known.last_heard_ms = known.last_heard_ms.max(now_ms);
            return true;
        }
        if self.origins.len() >= self.config.max_replicas {
            let oldest = self
                .origins
                .iter()
                .min_by(|a, b| a.1.last_heard_ms.total_cmp(&b.1.last_heard_ms))
                .map(|(id, _)| *id);
            if let Some(oldest) = oldest {
                self.drop_origin(oldest, sequences, now_ms);
                self.counters.evicted_replicas += 1;
            }
        }
        self.origins.insert(
            origin,
            Origin {
                last_heard_ms: now_ms,
                bookings: FxHashMap::default(),
            },
        );
        true
    }

    /// Applies one event from `origin` to `sequences`. The caller applies
    /// any side effects of an applied `Add` (such as the approximate index).
    pub fn apply(
        &mut self,
        origin: ReplicaId,
        event: &SequenceEvent,
        sequences: &mut ActiveSequences,
        now_ms: f64,
    ) -> RemoteOutcome {
        if !self.heard_from(origin, sequences, now_ms) {
            self.counters.own += 1;
            return RemoteOutcome::Own;
        }
        let outcome = match event {
            SequenceEvent::Add(add) => {
                let outcome = sequences.add_request(add, now_ms);
                if outcome == LifecycleOutcome::Applied {
                    self.owners.insert(add.request, (origin, add.worker));
                    *self.per_worker.entry(add.worker).or_insert(0) += 1;
                    if let Some(known) = self.origins.get_mut(&origin) {
                        known.bookings.insert(add.request, ());
                    }
                }
                RemoteOutcome::Lifecycle(outcome)
            }
            SequenceEvent::MarkPrefillCompleted(id) => {
                RemoteOutcome::Lifecycle(sequences.mark_prefill_completed(*id, now_ms))
            }
            SequenceEvent::Free(id) => {
                if self.owner(*id) == Some(origin) {
                    self.forget(*id);
                    RemoteOutcome::Lifecycle(sequences.free(*id, now_ms))
                } else {
                    RemoteOutcome::NotOwner
                }
            }
        };
        if outcome.applied() {
            self.counters.applied += 1;
        } else {
            self.counters.ignored += 1;
        }
        outcome
    }

    /// Frees the bookings of every origin silent for `silence_expiry_ms`
    /// and forgets the origin; returns the requests freed. Visits origins
    /// only (at most `max_replicas`).
    pub fn expire_silent(
        &mut self,
        sequences: &mut ActiveSequences,
        now_ms: f64,
    ) -> Vec<RequestId> {
        let deadline = now_ms - self.config.silence_expiry_ms;
        let silent: Vec<ReplicaId> = self
            .origins
            .iter()
            .filter(|(_, o)| o.last_heard_ms <= deadline)
            .map(|(id, _)| *id)
            .collect();
        let mut freed = Vec::new();
        for origin in silent {
            freed.extend(self.drop_origin(origin, sequences, now_ms));
        }
        freed
    }

    /// Forgets requests the write model freed on its own (per-request
    /// expiry, worker removal).
    pub fn forget_all(&mut self, ids: &[RequestId]) {
        for id in ids {
            self.forget(*id);
        }
    }

    /// The origin of a remote booking; `None` for local or unknown requests.
    pub fn owner(&self, id: RequestId) -> Option<ReplicaId> {
        self.owners.get(&id).map(|(origin, _)| *origin)
    }

    /// Remote bookings held now.
    pub fn remote_requests(&self) -> usize {
        self.owners.len()
    }

    /// Remote bookings held now on `worker` (the rest of its load is local).
    pub fn remote_requests_on(&self, worker: WorkerId) -> usize {
        self.per_worker.get(&worker).copied().unwrap_or(0)
    }

    /// The remote bookings held now on `worker`. Visits every remote
    /// booking: for rare events such as a worker's removal.
    pub fn requests_on(&self, worker: WorkerId) -> impl Iterator<Item = RequestId> + '_ {
        self.owners
            .iter()
            .filter(move |(_, &(_, w))| w == worker)
            .map(|(&id, _)| id)
    }

    /// Origins tracked now.
    pub fn replicas(&self) -> usize {
        self.origins.len()
    }

    /// Counters for metrics.
    pub fn counters(&self) -> RemoteCounters {
        self.counters
    }

    /// Heap bytes: the origin table, each origin's bookings and the owner map.
    pub fn estimated_bytes(&self) -> usize {
        map_bytes(&self.origins)
            + self
                .origins
                .values()
                .map(|o| map_bytes(&o.bookings))
                .sum::<usize>()
            + map_bytes(&self.owners)
    }

    fn forget(&mut self, id: RequestId) {
        if let Some((origin, _)) = self.remove_owner(id) {
            if let Some(known) = self.origins.get_mut(&origin) {
                known.bookings.remove(&id);
            }
        }
    }

    /// Drops a booking's owner entry and its worker's count.
    fn remove_owner(&mut self, id: RequestId) -> Option<(ReplicaId, WorkerId)> {
        let (origin, worker) = self.owners.remove(&id)?;
        if let Some(count) = self.per_worker.get_mut(&worker) {
            *count -= 1;
            if *count == 0 {
                self.per_worker.remove(&worker);
            }
        }
        Some((origin, worker))
    }

    fn drop_origin(
        &mut self,
        origin: ReplicaId,
        sequences: &mut ActiveSequences,
        now_ms: f64,
    ) -> Vec<RequestId> {
        let Some(known) = self.origins.remove(&origin) else {
            return Vec::new();
        };
        let mut freed = Vec::with_capacity(known.bookings.len());
        for id in known.bookings.keys() {
            self.remove_owner(*id);
            if sequences.free(*id, now_ms) == LifecycleOutcome::Applied {
                freed.push(*id);
            }
        }
        self.counters.expired += freed.len() as u64;
        freed
    }
}
