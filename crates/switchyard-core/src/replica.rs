//! Remote bookings: peers' lifecycle events applied to the local write model.
//!
//! Several router replicas serve one fleet; each publishes its own
//! `AddRequest` / `MarkPrefillCompleted` / `Free` events and applies its
//! peers' events here, so every replica's load view includes every booking.
//! This module is the bookkeeping of who owns which remote booking, and the
//! one place where what a peer sends is checked and clamped; the bookings
//! themselves live in the same [`ActiveSequences`] as local ones, so
//! selectors see one load per worker.
//!
//! Trust model: peers are reached over an authenticated plane (NATS
//! credentials/TLS); an authenticated peer is trusted to state its own
//! origin honestly, but nothing it sends is trusted further:
//!
//! - A replica's own id is ignored ([`RemoteOutcome::Own`]): no peer can
//!   speak for it.
//! - Remote bookings are keyed by *(origin, request id)*. Each is held in
//!   the write model under a fresh local key in a space of its own (top bit
//!   set; local ids never have it), so a peer's booking can never collide
//!   with a local booking nor with another origin's booking of the same id.
//!   `Add` and `Free` act only on bookings of the origin that sends them
//!   (a batch's events must name the batch's sender; the dispatcher drops
//!   the rest as `origin_mismatch`). `MarkPrefillCompleted` names the
//!   booking's origin and may come from anyone (a worker marks its requests
//!   on every replica); it only ends a prefill early, never frees.
//! - Numbers are clamped ([`clamp_add`], [`clamp_context_tokens`]):
//!   prompt tokens to [`MAX_REMOTE_PROMPT_TOKENS`], prompt blocks to
//!   [`MAX_REMOTE_BLOCKS`], overlap to the blocks, expected prefill to
//!   [`MAX_REMOTE_PREFILL_MS`], a session's context to
//!   [`MAX_REMOTE_CONTEXT_TOKENS`]. Events for workers this replica does not
//!   have are dropped. Every drop is counted by reason ([`RemoteDrops`]).
//! - State is bounded: origins (`max_replicas`, the longest silent evicted),
//!   bookings per origin (`max_bookings_per_replica`, further `Add`s
//!   dropped), the bytes of those bookings per origin and across origins
//!   (`max_bytes_per_replica`, `max_total_bytes`: further `Add`s dropped as
//!   `bytes_full`; a booking is counted at [`BOOKING_BYTES`] plus 8 bytes a
//!   block), session bindings per origin (`max_sessions_per_replica`, the
//!   oldest evicted), and every booking by the per-request expiry.
//! - Every batch (and an empty heartbeat) refreshes its sender's last-heard
//!   time. An origin silent for `silence_expiry_ms` is presumed dead and its
//!   bookings are freed by [`RemoteBookings::expire_silent`].
//! - Lost frees do not linger: each replica periodically publishes a digest
//!   of its live bookings, in parts that each cover a range of request ids;
//!   [`RemoteBookings::apply_digest`] frees the sender's bookings in the
//!   range that the part does not list, unless they arrived within
//!   [`DIGEST_GRACE_MS`] (an `Add` published just before the digest was
//!   built is always listed; the grace only covers the instant between
//!   the digest's snapshot and its enqueueing).
//! - There is no snapshot: a replica that starts late sees only bookings made
//!   after it subscribed, and its view converges to the truth as the peers'
//!   older requests end (at most one request lifetime, or the expiry).

use crate::admission::SessionKey;
use crate::maps::{map_bytes, FxHashMap};
use crate::sequences::{ActiveSequences, AddRequest, LifecycleOutcome, SequenceEvent};
use crate::types::{ReplicaId, RequestId, WorkerId};
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;

/// Most prompt tokens a peer's booking may claim (2 Mi tokens); more is
/// clamped to this.
pub const MAX_REMOTE_PROMPT_TOKENS: u32 = 2 * 1024 * 1024;

/// Most prompt blocks a peer's booking may carry (128 Ki); the rest are
/// cut off (the booking keeps its leading blocks, its prefix).
pub const MAX_REMOTE_BLOCKS: usize = 128 * 1024;

/// Most context tokens a peer's session binding may claim (2 Mi tokens).
pub const MAX_REMOTE_CONTEXT_TOKENS: u64 = 2 * 1024 * 1024;

/// Longest expected prefill a peer's booking may claim (10 minutes); a
/// value above it, negative or not finite becomes "not modeled".
pub const MAX_REMOTE_PREFILL_MS: f64 = 600_000.0;

/// A booking that arrived this recently is kept even when a digest of its
/// origin does not list it.
pub const DIGEST_GRACE_MS: f64 = 1_000.0;

/// What one remote booking is counted at against the byte bounds, besides
/// its blocks (8 bytes each): its entries in the write model, the owner
/// map and its origin's map.
pub const BOOKING_BYTES: usize = 256;

/// The bytes a remote booking of `blocks` blocks is counted at.
pub fn booking_bytes(blocks: usize) -> usize {
    BOOKING_BYTES + 8 * blocks.min(MAX_REMOTE_BLOCKS)
}

/// Local keys of remote bookings have this bit set; local request ids
/// never do (see [`RemoteBookings`]).
pub const REMOTE_KEY_BIT: u128 = 1 << 127;

/// Clamps a peer's booking in place to the stated bounds; `true` when
/// anything changed.
pub fn clamp_add(add: &mut AddRequest) -> bool {
    let mut changed = false;
    if add.prompt_tokens > MAX_REMOTE_PROMPT_TOKENS {
        add.prompt_tokens = MAX_REMOTE_PROMPT_TOKENS;
        changed = true;
    }
    if add.blocks.len() > MAX_REMOTE_BLOCKS {
        add.blocks.truncate(MAX_REMOTE_BLOCKS);
        changed = true;
    }
    let blocks = u32::try_from(add.blocks.len()).unwrap_or(u32::MAX);
    if add.overlap_blocks > blocks {
        add.overlap_blocks = blocks;
        changed = true;
    }
    if let Some(ms) = add.expected_prefill_ms {
        if !(ms.is_finite() && (0.0..=MAX_REMOTE_PREFILL_MS).contains(&ms)) {
            add.expected_prefill_ms = None;
            changed = true;
        }
    }
    changed
}

/// A peer's session context length, clamped; `true` when it was.
pub fn clamp_context_tokens(tokens: u64) -> (u64, bool) {
    (
        tokens.min(MAX_REMOTE_CONTEXT_TOKENS),
        tokens > MAX_REMOTE_CONTEXT_TOKENS,
    )
}

/// Settings of [`RemoteBookings`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteConfig {
    /// An origin heard from neither event nor heartbeat for this long has
    /// its bookings freed.
    pub silence_expiry_ms: f64,
    /// Origins tracked at once.
    pub max_replicas: usize,
    /// Live bookings held per origin; further `Add`s are dropped.
    pub max_bookings_per_replica: usize,
    /// Session bindings remembered per origin; the oldest is evicted.
    pub max_sessions_per_replica: usize,
    /// Bytes of bookings held per origin ([`booking_bytes`]); further
    /// `Add`s are dropped.
    pub max_bytes_per_replica: usize,
    /// Bytes of bookings held across every origin; further `Add`s are
    /// dropped.
    pub max_total_bytes: usize,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            silence_expiry_ms: 300_000.0,
            max_replicas: 1024,
            max_bookings_per_replica: 262_144,
            max_sessions_per_replica: 65_536,
            max_bytes_per_replica: 128 << 20,
            max_total_bytes: 512 << 20,
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
    /// A cap too small for one booking.
    #[error("{0} must be at least 1 (a byte cap at least one booking's bytes)")]
    PerReplica(&'static str),
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
        if self.max_bookings_per_replica == 0 {
            return Err(RemoteConfigError::PerReplica("max_bookings_per_replica"));
        }
        if self.max_sessions_per_replica == 0 {
            return Err(RemoteConfigError::PerReplica("max_sessions_per_replica"));
        }
        if self.max_bytes_per_replica < BOOKING_BYTES {
            return Err(RemoteConfigError::PerReplica("max_bytes_per_replica"));
        }
        if self.max_total_bytes < BOOKING_BYTES {
            return Err(RemoteConfigError::PerReplica("max_total_bytes"));
        }
        Ok(())
    }
}

/// Why a peer's event was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropReason {
    /// An `Add` or `Free` naming an origin other than its batch's sender.
    OriginMismatch,
    /// An event (or session binding) for a worker this replica lacks.
    UnknownWorker,
    /// A `Free` or mark of a booking its stated origin does not hold here.
    UnknownBooking,
    /// An `Add` of a request its origin already booked here.
    Duplicate,
    /// An `Add` past `max_bookings_per_replica`.
    ReplicaFull,
    /// An `Add` past `max_bytes_per_replica` or `max_total_bytes`.
    BytesFull,
}

/// Peers' events dropped, by reason (they only grow).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RemoteDrops {
    /// See [`DropReason::OriginMismatch`].
    pub origin_mismatch: u64,
    /// See [`DropReason::UnknownWorker`].
    pub unknown_worker: u64,
    /// See [`DropReason::UnknownBooking`].
    pub unknown_booking: u64,
    /// See [`DropReason::Duplicate`].
    pub duplicate: u64,
    /// See [`DropReason::ReplicaFull`].
    pub replica_full: u64,
    /// See [`DropReason::BytesFull`].
    pub bytes_full: u64,
}

impl RemoteDrops {
    /// `(label, count)` for metrics, every reason.
    pub fn by_reason(&self) -> [(&'static str, u64); 6] {
        [
            ("origin_mismatch", self.origin_mismatch),
            ("unknown_worker", self.unknown_worker),
            ("unknown_booking", self.unknown_booking),
            ("duplicate", self.duplicate),
            ("replica_full", self.replica_full),
            ("bytes_full", self.bytes_full),
        ]
    }

    fn count(&mut self, reason: DropReason) {
        let slot = match reason {
            DropReason::OriginMismatch => &mut self.origin_mismatch,
            DropReason::UnknownWorker => &mut self.unknown_worker,
            DropReason::UnknownBooking => &mut self.unknown_booking,
            DropReason::Duplicate => &mut self.duplicate,
            DropReason::ReplicaFull => &mut self.replica_full,
            DropReason::BytesFull => &mut self.bytes_full,
        };
        *slot += 1;
    }

    fn since(&self, before: &Self) -> Self {
        Self {
            origin_mismatch: self.origin_mismatch - before.origin_mismatch,
            unknown_worker: self.unknown_worker - before.unknown_worker,
            unknown_booking: self.unknown_booking - before.unknown_booking,
            duplicate: self.duplicate - before.duplicate,
            replica_full: self.replica_full - before.replica_full,
            bytes_full: self.bytes_full - before.bytes_full,
        }
    }
}

/// What applying a peer's event did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RemoteOutcome {
    /// The event came from this replica itself: ignored.
    Own,
    /// A `Free` or mark of a booking its stated origin does not hold.
    NotOwner,
    /// Dropped for this reason (counted).
    Dropped(DropReason),
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
    /// Remote events that changed nothing (every drop, and duplicates
    /// the write model refused).
    pub ignored: u64,
    /// Peers' events dropped, by reason.
    pub drops: RemoteDrops,
    /// Peers' bookings and bindings with a number clamped.
    pub clamped: u64,
    /// Remote bookings freed because their origin went silent or was
    /// evicted at the cap.
    pub expired: u64,
    /// Remote bookings freed because their origin's digest omitted them.
    pub digest_freed: u64,
    /// Origins evicted at `max_replicas`.
    pub evicted_replicas: u64,
    /// Session bindings evicted at `max_sessions_per_replica`.
    pub sessions_evicted: u64,
}

impl RemoteCounters {
    /// What grew since `before` (an earlier copy of the same counters).
    pub fn since(&self, before: &Self) -> Self {
        Self {
            applied: self.applied - before.applied,
            own: self.own - before.own,
            ignored: self.ignored - before.ignored,
            drops: self.drops.since(&before.drops),
            clamped: self.clamped - before.clamped,
            expired: self.expired - before.expired,
            digest_freed: self.digest_freed - before.digest_freed,
            evicted_replicas: self.evicted_replicas - before.evicted_replicas,
            sessions_evicted: self.sessions_evicted - before.sessions_evicted,
        }
    }
}

/// One remote booking as its origin knows it.
#[derive(Debug, Clone, Copy)]
struct Held {
    /// Its key in the write model.
    key: RequestId,
    /// When it arrived here.
    added_ms: f64,
    /// What it is counted at against the byte bounds.
    bytes: usize,
}

#[derive(Debug, Default)]
struct Origin {
    last_heard_ms: f64,
    /// Bytes of its bookings ([`booking_bytes`]).
    bytes: usize,
    /// The origin's request id → its booking here.
    bookings: FxHashMap<RequestId, Held>,
    /// Sessions this origin bound, oldest first, and the same as a set.
    sessions: VecDeque<SessionKey>,
    bound: FxHashMap<SessionKey, ()>,
}

/// Who owns each remote booking, and when each origin was last heard.
///
/// `owners` holds one entry per remote booking (its origin, the origin's
/// request id and worker) and `per_worker` one count per worker that has
/// any, so both are bounded by the remote bookings held (at most
/// `max_replicas × max_bookings_per_replica`); a worker's entry goes when
/// its count is zero.
#[derive(Debug)]
pub struct RemoteBookings {
    config: RemoteConfig,
    local: Option<ReplicaId>,
    origins: FxHashMap<ReplicaId, Origin>,
    owners: FxHashMap<RequestId, (ReplicaId, RequestId, WorkerId)>,
    per_worker: FxHashMap<WorkerId, usize>,
    /// Bytes of every origin's bookings.
    total_bytes: usize,
    next_key: u128,
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
            total_bytes: 0,
            next_key: 0,
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
                ..Origin::default()
            },
        );
        true
    }

    /// Applies one event of a batch sent by `sender`, which says the
    /// booking's origin is `origin`: an `Add` or `Free` must come from its
    /// origin (else it is dropped as `origin_mismatch`); a mark may come
    /// from anyone.
    pub fn apply_from(
        &mut self,
        sender: ReplicaId,
        origin: ReplicaId,
        event: &SequenceEvent,
        sequences: &mut ActiveSequences,
        now_ms: f64,
    ) -> RemoteOutcome {
        if Some(sender) == self.local {
            self.counters.own += 1;
            return RemoteOutcome::Own;
        }
        if sender != origin && !matches!(event, SequenceEvent::MarkPrefillCompleted(_)) {
            return self.drop_event(DropReason::OriginMismatch);
        }
        self.apply(origin, event, sequences, now_ms)
    }

    /// Applies one event about a booking of `origin` to `sequences`
    /// (clamped and checked; see the module's trust model). The caller
    /// applies any side effects of an applied `Add` (such as the
    /// approximate index, with at most [`MAX_REMOTE_BLOCKS`] blocks).
    pub fn apply(
        &mut self,
        origin: ReplicaId,
        event: &SequenceEvent,
        sequences: &mut ActiveSequences,
        now_ms: f64,
    ) -> RemoteOutcome {
        if Some(origin) == self.local {
            self.counters.own += 1;
            return RemoteOutcome::Own;
        }
        let outcome = match event {
            SequenceEvent::Add(add) => {
                self.heard_from(origin, sequences, now_ms);
                self.add(origin, add, sequences, now_ms)
            }
            SequenceEvent::MarkPrefillCompleted(id) => match self.key_of(origin, *id) {
                Some(key) => {
                    RemoteOutcome::Lifecycle(sequences.mark_prefill_completed(key, now_ms))
                }
                None => {
                    self.counters.drops.count(DropReason::UnknownBooking);
                    RemoteOutcome::NotOwner
                }
            },
            SequenceEvent::Free(id) => {
                self.heard_from(origin, sequences, now_ms);
                match self.key_of(origin, *id) {
                    Some(key) => {
                        self.forget(key);
                        RemoteOutcome::Lifecycle(sequences.free(key, now_ms))
                    }
                    None => {
                        self.counters.drops.count(DropReason::UnknownBooking);
                        RemoteOutcome::NotOwner
                    }
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

    fn drop_event(&mut self, reason: DropReason) -> RemoteOutcome {
        self.counters.drops.count(reason);
        self.counters.ignored += 1;
        RemoteOutcome::Dropped(reason)
    }

    fn add(
        &mut self,
        origin: ReplicaId,
        add: &AddRequest,
        sequences: &mut ActiveSequences,
        now_ms: f64,
    ) -> RemoteOutcome {
        let Some(known) = self.origins.get(&origin) else {
            // Unreachable after `heard_from`; dropped rather than panicking.
            self.counters.drops.count(DropReason::UnknownBooking);
            return RemoteOutcome::NotOwner;
        };
        if known.bookings.contains_key(&add.request) {
            self.counters.drops.count(DropReason::Duplicate);
            return RemoteOutcome::Dropped(DropReason::Duplicate);
        }
        if known.bookings.len() >= self.config.max_bookings_per_replica {
            self.counters.drops.count(DropReason::ReplicaFull);
            return RemoteOutcome::Dropped(DropReason::ReplicaFull);
        }
        let bytes = booking_bytes(add.blocks.len());
        if known.bytes + bytes > self.config.max_bytes_per_replica
            || self.total_bytes + bytes > self.config.max_total_bytes
        {
            self.counters.drops.count(DropReason::BytesFull);
            return RemoteOutcome::Dropped(DropReason::BytesFull);
        }
        if !sequences.has_worker(add.worker) {
            self.counters.drops.count(DropReason::UnknownWorker);
            return RemoteOutcome::Dropped(DropReason::UnknownWorker);
        }
        let key = self.fresh_key(sequences);
        let mut booked = AddRequest {
            request: key,
            ..add.clone()
        };
        if clamp_add(&mut booked) {
            self.counters.clamped += 1;
        }
        let outcome = sequences.add_request(&booked, now_ms);
        if outcome == LifecycleOutcome::Applied {
            self.owners.insert(key, (origin, add.request, add.worker));
            *self.per_worker.entry(add.worker).or_insert(0) += 1;
            if let Some(known) = self.origins.get_mut(&origin) {
                known.bookings.insert(
                    add.request,
                    Held {
                        key,
                        added_ms: now_ms,
                        bytes,
                    },
                );
                known.bytes += bytes;
                self.total_bytes += bytes;
            }
        }
        RemoteOutcome::Lifecycle(outcome)
    }

    /// A key in the remote space that the write model does not hold.
    fn fresh_key(&mut self, sequences: &ActiveSequences) -> RequestId {
        loop {
            let key = RequestId(REMOTE_KEY_BIT | (self.next_key & !REMOTE_KEY_BIT));
            self.next_key = self.next_key.wrapping_add(1);
            if sequences.owner(key).is_none() {
                return key;
            }
        }
    }

    /// A session binding from `origin` (already checked: a known worker,
    /// clamped context). Returns the session that this origin bound
    /// longest ago when it is past `max_sessions_per_replica`: the caller
    /// forgets that binding.
    pub fn bind_session(&mut self, origin: ReplicaId, session: SessionKey) -> Option<SessionKey> {
        let cap = self.config.max_sessions_per_replica;
        let known = self.origins.get_mut(&origin)?;
        if known.bound.insert(session, ()).is_some() {
            return None;
        }
        known.sessions.push_back(session);
        if known.sessions.len() <= cap {
            return None;
        }
        let evicted = known.sessions.pop_front()?;
        known.bound.remove(&evicted);
        self.counters.sessions_evicted += 1;
        Some(evicted)
    }

    /// Counts `events` of a batch that claimed this replica's own id.
    pub fn note_own(&mut self, events: u64) {
        self.counters.own += events;
    }

    /// Counts a peer's session binding with its context clamped.
    pub fn note_clamped(&mut self) {
        self.counters.clamped += 1;
    }

    /// Counts a peer's event or binding dropped for `reason` outside
    /// [`Self::apply`] (a binding for an unknown worker).
    pub fn note_dropped(&mut self, reason: DropReason) {
        self.counters.drops.count(reason);
    }

    /// One part of `origin`'s digest: its live bookings with request ids in
    /// `lo..=hi` are exactly `live`. Frees the origin's bookings in that
    /// range that `live` omits and that arrived more than
    /// [`DIGEST_GRACE_MS`] ago; returns their keys. Visits the origin's
    /// bookings (at most `max_bookings_per_replica`).
    pub fn apply_digest(
        &mut self,
        origin: ReplicaId,
        lo: RequestId,
        hi: RequestId,
        live: &[RequestId],
        sequences: &mut ActiveSequences,
        now_ms: f64,
    ) -> Vec<RequestId> {
        if !self.heard_from(origin, sequences, now_ms) {
            return Vec::new();
        }
        let Some(known) = self.origins.get(&origin) else {
            return Vec::new();
        };
        let listed: FxHashMap<RequestId, ()> = live.iter().map(|id| (*id, ())).collect();
        let cutoff = now_ms - DIGEST_GRACE_MS;
        let stale: Vec<(RequestId, RequestId)> = known
            .bookings
            .iter()
            .filter(|(id, held)| {
                (lo..=hi).contains(*id) && held.added_ms <= cutoff && !listed.contains_key(*id)
            })
            .map(|(id, held)| (*id, held.key))
            .collect();
        let mut freed = Vec::with_capacity(stale.len());
        for (_, key) in stale {
            self.forget(key);
            if sequences.free(key, now_ms) == LifecycleOutcome::Applied {
                freed.push(key);
            }
        }
        self.counters.digest_freed += freed.len() as u64;
        freed
    }

    /// Frees the bookings of every origin silent for `silence_expiry_ms`
    /// and forgets the origin; returns the keys freed. Visits origins
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
    /// expiry, worker removal); `ids` are write-model keys.
    pub fn forget_all(&mut self, ids: &[RequestId]) {
        for id in ids {
            self.forget(*id);
        }
    }

    /// The write-model key of `origin`'s booking of its request `id`.
    pub fn key_of(&self, origin: ReplicaId, id: RequestId) -> Option<RequestId> {
        self.origins
            .get(&origin)
            .and_then(|o| o.bookings.get(&id))
            .map(|held| held.key)
    }

    /// The origin of the remote booking held under write-model key `key`;
    /// `None` for local or unknown keys.
    pub fn owner(&self, key: RequestId) -> Option<ReplicaId> {
        self.owners.get(&key).map(|(origin, _, _)| *origin)
    }

    /// Remote bookings held now.
    pub fn remote_requests(&self) -> usize {
        self.owners.len()
    }

    /// Remote bookings held now on `worker` (the rest of its load is local).
    pub fn remote_requests_on(&self, worker: WorkerId) -> usize {
        self.per_worker.get(&worker).copied().unwrap_or(0)
    }

    /// The write-model keys of the remote bookings held now on `worker`.
    /// Visits every remote booking: for rare events such as a worker's
    /// removal.
    pub fn requests_on(&self, worker: WorkerId) -> impl Iterator<Item = RequestId> + '_ {
        self.owners
            .iter()
            .filter(move |(_, &(_, _, w))| w == worker)
            .map(|(&key, _)| key)
    }

    /// Origins tracked now.
    pub fn replicas(&self) -> usize {
        self.origins.len()
    }

    /// Counters for metrics.
    pub fn counters(&self) -> RemoteCounters {
        self.counters
    }

    /// Heap bytes: the origin table, each origin's bookings and sessions,
    /// and the owner map.
    pub fn estimated_bytes(&self) -> usize {
        map_bytes(&self.origins)
            + self
                .origins
                .values()
                .map(|o| {
                    map_bytes(&o.bookings)
                        + map_bytes(&o.bound)
                        + o.sessions.capacity() * std::mem::size_of::<SessionKey>()
                })
                .sum::<usize>()
            + map_bytes(&self.owners)
    }

    fn forget(&mut self, key: RequestId) {
        if let Some((origin, id, _)) = self.remove_owner(key) {
            if let Some(known) = self.origins.get_mut(&origin) {
                if let Some(held) = known.bookings.remove(&id) {
                    known.bytes -= held.bytes;
                    self.total_bytes -= held.bytes;
                }
            }
        }
    }

    /// Bytes of every origin's bookings, as the byte bounds count them.
    pub fn held_bytes(&self) -> usize {
        self.total_bytes
    }

    /// Drops a booking's owner entry and its worker's count.
    fn remove_owner(&mut self, key: RequestId) -> Option<(ReplicaId, RequestId, WorkerId)> {
        let (origin, id, worker) = self.owners.remove(&key)?;
        if let Some(count) = self.per_worker.get_mut(&worker) {
            *count -= 1;
            if *count == 0 {
                self.per_worker.remove(&worker);
            }
        }
        Some((origin, id, worker))
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
        self.total_bytes -= known.bytes;
        let mut freed = Vec::with_capacity(known.bookings.len());
        for held in known.bookings.values() {
            self.remove_owner(held.key);
            if sequences.free(held.key, now_ms) == LifecycleOutcome::Applied {
                freed.push(held.key);
            }
        }
        self.counters.expired += freed.len() as u64;
        freed
    }
}
