//! Which worker holds which stored response, and for whom: a bounded,
//! expiring map from a Responses API response id to the worker that
//! answered it and the key (tenant) that asked, so that a later
//! `previous_response_id`, `GET /v1/responses/{id}` or
//! `POST /v1/responses/{id}/cancel` goes to that worker and no other (the
//! engines store responses in their own memory), and only for that key.
//!
//! **Owned.** Every entry has an [`Owner`]: the client key that created
//! it (none when the router requires no keys: then every client shares
//! one space, as before keys). A lookup names its caller, and an entry of
//! another owner is not there for it ([`ResponseMap::get`] answers `None`,
//! exactly as for an id never seen: no oracle). An answer whose id
//! another owner already holds is never recorded over it
//! ([`Inserted::Taken`], counted): a key cannot move another's id to its
//! own worker by choosing the id.
//!
//! **Bounded twice.** At most `capacity` entries in all
//! (`--max-stored-responses`; the oldest is forgotten first) and at most
//! `per_key` of one key (`--max-stored-responses-per-key`): a key at its
//! own cap forgets its own oldest entry, never another's, so one key
//! cannot flood the map and push the others' entries out. (Without keys
//! every client is one space, bounded by the global cap alone.)
//! Expiring: an entry older than `ttl` (`--stored-response-ttl-secs`) is
//! forgotten when next looked at or when the oldest entries are swept at
//! an insert. Every entry forgotten is counted by why
//! (`switchyard_response_map_drops_total{reason}`: `capacity`,
//! `key_capacity`, `expired`), every answer refused for its id by
//! `reason="taken"`, and the map's size is a gauge
//! (`switchyard_response_map_entries`).
//!
//! An entry also holds the chain's session: every later turn of a
//! response chain is admitted as one session ([`session_of`]).
//!
//! Ids are at most [`MAX_RESPONSE_ID_BYTES`] (longer ones are never
//! stored nor looked up). Memory: about `capacity` × (2 × id + 96) bytes
//! (an id is queued twice: in the global order and in its owner's).

use crate::metrics::CountGauge;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use switchyard_core::admission::SessionKey;
use switchyard_core::WorkerId;
use switchyard_wire::agentic::MAX_RESPONSE_ID_BYTES;

/// Default `--max-stored-responses`.
pub const DEFAULT_CAPACITY: usize = 100_000;
/// Default `--max-stored-responses-per-key`: a tenth of the default
/// global cap, so it takes ten keys at their own caps to fill the map.
pub const DEFAULT_PER_KEY: usize = 10_000;
/// Default `--stored-response-ttl-secs`: a day.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);

/// Who created a stored response: a digest of the client key's name
/// (names are configured, so two keys never share a digest in practice;
/// the digest keeps [`Holder`] `Copy` and the replica plane's messages
/// small).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner(pub u64);

impl Owner {
    /// Keeps owner digests apart from session keys and block hashes.
    const SEED: u64 = 0x0e4e_5000_0e4e_5000;

    /// The owner for the client key named `name`.
    pub fn of_key(name: &str) -> Self {
        Self(xxhash_rust::xxh3::xxh3_64_with_seed(
            name.as_bytes(),
            Self::SEED,
        ))
    }
}

/// Where a stored response lives, and whose it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder {
    /// The worker that answered it.
    pub worker: WorkerId,
    /// The chain's session.
    pub session: Option<SessionKey>,
    /// The key that created it; `None` when the router requires no keys.
    pub owner: Option<Owner>,
}

/// Why an entry was forgotten.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drop {
    /// The map was full: the oldest went.
    Capacity,
    /// Its owner was at its own cap: the owner's oldest went.
    KeyCapacity,
    /// Older than the TTL.
    Expired,
}

impl Drop {
    const ALL: [Drop; 3] = [Drop::Capacity, Drop::KeyCapacity, Drop::Expired];

    fn label(self) -> &'static str {
        match self {
            Drop::Capacity => "capacity",
            Drop::KeyCapacity => "key_capacity",
            Drop::Expired => "expired",
        }
    }
}

/// What [`ResponseMap::insert`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inserted {
    /// Recorded (or, for an id its owner already held, refreshed).
    Stored,
    /// Another owner holds the id: nothing changed.
    Taken,
    /// An empty id, or one longer than [`MAX_RESPONSE_ID_BYTES`].
    Ignored,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DropLabels {
    reason: &'static str,
}

/// The map and its metrics.
#[derive(Debug)]
pub struct ResponseMap {
    capacity: usize,
    per_key: usize,
    ttl: Duration,
    inner: Mutex<Inner>,
    drops: Family<DropLabels, Counter>,
    dropped: [Counter; 3],
    taken: Counter,
    entries: CountGauge,
}

#[derive(Debug)]
struct Entry {
    holder: Holder,
    at: Instant,
    /// Which insert made it (the map's own count).
    seq: u64,
}

/// An id queued with the count of the insert that queued it: live while
/// its entry still has that count (a forgotten or refreshed id leaves
/// stale queue entries behind, skipped and compacted away).
type Queued = (Box<str>, u64);

#[derive(Debug, Default)]
struct OwnerQueue {
    /// Entries of this owner in the map.
    live: usize,
    /// Its ids in insertion order.
    order: VecDeque<Queued>,
}

#[derive(Debug, Default)]
struct Inner {
    by_id: HashMap<Box<str>, Entry>,
    /// Every id in insertion order.
    order: VecDeque<Queued>,
    /// Each owner's ids (only owners with a live entry).
    owners: HashMap<Option<Owner>, OwnerQueue>,
    /// Inserts so far.
    seq: u64,
}

fn is_live(by_id: &HashMap<Box<str>, Entry>, (id, seq): &Queued) -> bool {
    by_id.get(id).is_some_and(|e| e.seq == *seq)
}

impl Inner {
    /// Forgets `id`.
    fn remove(&mut self, id: &str) {
        let Some(entry) = self.by_id.remove(id) else {
            return;
        };
        let owner = entry.holder.owner;
        if let Some(q) = self.owners.get_mut(&owner) {
            q.live = q.live.saturating_sub(1);
            if q.live == 0 {
                self.owners.remove(&owner);
            }
        }
    }

    /// Pops `queue`'s oldest live id (stale ones are dropped on the way).
    fn pop_live(
        by_id: &HashMap<Box<str>, Entry>,
        queue: &mut VecDeque<Queued>,
    ) -> Option<Box<str>> {
        while let Some(queued) = queue.pop_front() {
            if is_live(by_id, &queued) {
                return Some(queued.0);
            }
        }
        None
    }

    /// Keeps each queue within twice its live entries (plus slack).
    fn compact(&mut self, owner: Option<Owner>) {
        let Inner {
            by_id,
            order,
            owners,
            ..
        } = self;
        if order.len() > 2 * by_id.len() + 16 {
            order.retain(|q| is_live(by_id, q));
        }
        if let Some(q) = owners.get_mut(&owner) {
            if q.order.len() > 2 * q.live + 16 {
                q.order.retain(|queued| is_live(by_id, queued));
            }
        }
    }
}

impl ResponseMap {
    /// An empty map of at most `capacity` entries in all and `per_key` of
    /// one owner, each kept for `ttl`.
    pub fn new(capacity: usize, per_key: usize, ttl: Duration) -> Self {
        let drops = Family::<DropLabels, Counter>::default();
        // One statement each: a family's guard lives to the statement's end.
        let dropped = Drop::ALL.map(|why| {
            drops
                .get_or_create(&DropLabels {
                    reason: why.label(),
                })
                .clone()
        });
        let taken = drops.get_or_create(&DropLabels { reason: "taken" }).clone();
        Self {
            capacity: capacity.max(1),
            per_key: per_key.max(1),
            ttl,
            inner: Mutex::default(),
            drops,
            dropped,
            taken,
            entries: CountGauge::default(),
        }
    }

    /// Registers the metrics.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "switchyard_response_map_drops",
            "Stored-response locations forgotten or refused, by why (capacity: the map was full; key_capacity: the owning key was at --max-stored-responses-per-key; expired: older than --stored-response-ttl-secs; taken: an answer's id is held by another key, not recorded)",
            self.drops.clone(),
        );
        registry.register(
            "switchyard_response_map_entries",
            "Stored responses whose worker the router knows",
            self.entries.clone(),
        );
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn count(&self, why: Drop) {
        self.dropped[why as usize].inc();
    }

    /// Entries forgotten for `why`.
    pub fn drops(&self, why: Drop) -> u64 {
        self.dropped[why as usize].get()
    }

    /// Answers not recorded because another owner held their id.
    pub fn taken(&self) -> u64 {
        self.taken.get()
    }

    fn expired(&self, at: Instant, now: Instant) -> bool {
        now.saturating_duration_since(at) >= self.ttl
    }

    /// Remembers that `id` is held by `holder`, as of `now`: a new id is
    /// recorded (its owner's oldest forgotten first when the owner is at
    /// its cap, then the oldest of all while the map is full); an id its
    /// owner holds is refreshed; an id another owner holds is left as it
    /// is ([`Inserted::Taken`]).
    pub fn insert(&self, id: &str, holder: Holder, now: Instant) -> Inserted {
        if id.is_empty() || id.len() > MAX_RESPONSE_ID_BYTES {
            return Inserted::Ignored;
        }
        let mut inner = self.lock();
        let inserted = self.insert_locked(&mut inner, id, holder, now);
        inner.compact(holder.owner);
        self.entries.set(inner.by_id.len() as u64);
        inserted
    }

    fn insert_locked(&self, inner: &mut Inner, id: &str, holder: Holder, now: Instant) -> Inserted {
        if let Some(entry) = inner.by_id.get_mut(id) {
            if self.expired(entry.at, now) {
                inner.remove(id);
                self.count(Drop::Expired);
            } else if entry.holder.owner != holder.owner {
                self.taken.inc();
                return Inserted::Taken;
            } else {
                // Refreshed: its time renewed, queued anew at the back.
                inner.seq += 1;
                let seq = inner.seq;
                *entry = Entry {
                    holder,
                    at: now,
                    seq,
                };
                let key: Box<str> = id.into();
                inner.order.push_back((key.clone(), seq));
                if let Some(q) = inner.owners.get_mut(&holder.owner) {
                    q.order.push_back((key, seq));
                }
                return Inserted::Stored;
            }
        }
        // Expired entries at the front go first (the order is by time).
        while let Some(front) = inner.order.front() {
            let live = inner.by_id.get(&front.0).filter(|e| e.seq == front.1);
            match live {
                None => {
                    inner.order.pop_front();
                }
                Some(e) if self.expired(e.at, now) => {
                    let (old, _) = inner.order.pop_front().expect("a front");
                    inner.remove(&old);
                    self.count(Drop::Expired);
                }
                Some(_) => break,
            }
        }
        // A key at its own cap forgets its own oldest (without keys, all
        // clients are one space, bounded by the global cap alone).
        let at_cap = holder.owner.is_some()
            && inner
                .owners
                .get(&holder.owner)
                .is_some_and(|q| q.live >= self.per_key);
        if at_cap {
            let Inner { by_id, owners, .. } = &mut *inner;
            let oldest = owners
                .get_mut(&holder.owner)
                .and_then(|q| Inner::pop_live(by_id, &mut q.order));
            if let Some(old) = oldest {
                inner.remove(&old);
                self.count(Drop::KeyCapacity);
            }
        }
        // Then the oldest of all while the map is full.
        while inner.by_id.len() >= self.capacity {
            let Inner { by_id, order, .. } = &mut *inner;
            let Some(old) = Inner::pop_live(by_id, order) else {
                break;
            };
            inner.remove(&old);
            self.count(Drop::Capacity);
        }
        inner.seq += 1;
        let seq = inner.seq;
        let key: Box<str> = id.into();
        inner.by_id.insert(
            key.clone(),
            Entry {
                holder,
                at: now,
                seq,
            },
        );
        inner.order.push_back((key.clone(), seq));
        let q = inner.owners.entry(holder.owner).or_default();
        q.live += 1;
        q.order.push_back((key, seq));
        Inserted::Stored
    }

    /// The holder of `id` for a caller of owner `caller`: `None` when the
    /// router does not know it, it has expired, or it is another owner's
    /// (the same answer, so a caller learns nothing of others' ids).
    pub fn get(&self, id: &str, caller: Option<Owner>, now: Instant) -> Option<Holder> {
        if id.len() > MAX_RESPONSE_ID_BYTES {
            return None;
        }
        let mut inner = self.lock();
        let entry = inner.by_id.get(id)?;
        if entry.holder.owner != caller {
            return None;
        }
        if self.expired(entry.at, now) {
            inner.remove(id);
            self.count(Drop::Expired);
            self.entries.set(inner.by_id.len() as u64);
            return None;
        }
        Some(entry.holder)
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries held for `owner`.
    pub fn len_of(&self, owner: Option<Owner>) -> usize {
        self.lock().owners.get(&owner).map_or(0, |q| q.live)
    }
}

/// The session of the turn that continues response `previous` held as
/// `holder` (the caller's own: [`ResponseMap::get`] gives no other): the
/// chain's session, or (a chain begun without one) a session named after
/// the response it continues in the caller's `namespace` (its key's
/// name), so every later turn of the chain shares it.
pub fn session_of(previous: &str, holder: &Holder, namespace: Option<&str>) -> SessionKey {
    if let Some(session) = holder.session {
        return session;
    }
    let name = format!("response-chain:{previous}");
    match namespace {
        Some(ns) => SessionKey::namespaced(ns, &name),
        None => SessionKey::from_client_id(&name),
    }
}

#[cfg(test)]
#[path = "response_map_tests.rs"]
mod tests;
