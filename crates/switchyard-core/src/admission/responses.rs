//! Response affinity: which worker holds which stored response, and for
//! whom. A bounded, expiring table from a Responses API response id to the
//! worker that answered it and the key (tenant) that asked, so that a later
//! turn continuing it (`previous_response_id`), or a read or cancel of it,
//! goes to that worker and no other (the engines store responses in their
//! own memory), and only for that key: the driver places such a turn with
//! [`Eligible::one`](crate::Eligible::one) of the holder's worker.
//! Beside sessions: a chain's turns are one session ([`session_of`]).
//!
//! **Owned.** Every entry has an [`Owner`]: the client key that created
//! it (none when the driver requires no keys: then every client shares
//! one space). A lookup names its caller, and an entry of another owner is
//! not there for it ([`ResponseAffinity::get`] answers `None`, exactly as
//! for an id never seen: no oracle). An answer whose id another owner
//! already holds is never recorded over it ([`Inserted::Taken`], counted):
//! a key cannot move another's id to its own worker by choosing the id.
//!
//! **Bounded twice.** At most `capacity` entries in all (the oldest is
//! forgotten first) and at most `per_key` of one key: a key at its own
//! cap forgets its own oldest entry, never another's, so one key cannot
//! flood the table and push the others' entries out. (Without keys every
//! client is one space, bounded by the global cap alone.) Expiring: an
//! entry older than `ttl_ms` is forgotten when next looked at or when the
//! oldest entries are swept at an insert. Every entry forgotten is counted
//! by why ([`Forgotten`]), every answer refused for its id too
//! ([`ResponseAffinity::taken`]).
//!
//! Ids are at most [`MAX_RESPONSE_ID_BYTES`] (longer ones are never stored
//! nor looked up). Memory: about `capacity` × (2 × id + 96) bytes (an id
//! is queued twice: in the global order and in its owner's). Time is the
//! driver's (`now_ms`), as everywhere in the core.

use crate::admission::SessionKey;
use crate::maps::FxHashMap;
use crate::WorkerId;
use std::collections::VecDeque;

/// Longest response id kept or looked up, in bytes: vLLM's ids are
/// `resp_` and 32 hex digits.
pub const MAX_RESPONSE_ID_BYTES: usize = 128;

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
pub enum Forgotten {
    /// The map was full: the oldest went.
    Capacity,
    /// Its owner was at its own cap: the owner's oldest went.
    KeyCapacity,
    /// Older than the TTL.
    Expired,
}

impl Forgotten {
    /// Every reason, in [`Forgotten::label`] order.
    pub const ALL: [Forgotten; 3] = [
        Forgotten::Capacity,
        Forgotten::KeyCapacity,
        Forgotten::Expired,
    ];

    /// Its metric label.
    pub fn label(self) -> &'static str {
        match self {
            Forgotten::Capacity => "capacity",
            Forgotten::KeyCapacity => "key_capacity",
            Forgotten::Expired => "expired",
        }
    }
}

/// What [`ResponseAffinity::insert`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Inserted {
    /// Recorded (or, for an id its owner already held, refreshed).
    Stored,
    /// Another owner holds the id: nothing changed.
    Taken,
    /// An empty id, or one longer than [`MAX_RESPONSE_ID_BYTES`].
    Ignored,
}

/// The table (see the module docs).
#[derive(Debug)]
pub struct ResponseAffinity {
    capacity: usize,
    per_key: usize,
    ttl_ms: f64,
    by_id: FxHashMap<Box<str>, Entry>,
    /// Every id in insertion order.
    order: VecDeque<Queued>,
    /// Each owner's ids (only owners with a live entry).
    owners: FxHashMap<Option<Owner>, OwnerQueue>,
    /// Inserts so far.
    seq: u64,
    dropped: [u64; 3],
    taken: u64,
}

#[derive(Debug)]
struct Entry {
    holder: Holder,
    at_ms: f64,
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

fn is_live(by_id: &FxHashMap<Box<str>, Entry>, (id, seq): &Queued) -> bool {
    by_id.get(id).is_some_and(|e| e.seq == *seq)
}

/// The oldest live id of `queue` (stale ones are dropped on the way).
fn pop_live(by_id: &FxHashMap<Box<str>, Entry>, queue: &mut VecDeque<Queued>) -> Option<Box<str>> {
    while let Some(queued) = queue.pop_front() {
        if is_live(by_id, &queued) {
            return Some(queued.0);
        }
    }
    None
}

impl ResponseAffinity {
    /// An empty table of at most `capacity` entries in all and `per_key`
    /// of one owner, each kept for `ttl_ms`.
    pub fn new(capacity: usize, per_key: usize, ttl_ms: f64) -> Self {
        Self {
            capacity: capacity.max(1),
            per_key: per_key.max(1),
            ttl_ms,
            by_id: FxHashMap::default(),
            order: VecDeque::new(),
            owners: FxHashMap::default(),
            seq: 0,
            dropped: [0; 3],
            taken: 0,
        }
    }

    /// Entries forgotten for `why` so far.
    pub fn drops(&self, why: Forgotten) -> u64 {
        self.dropped[why as usize]
    }

    /// Answers not recorded because another owner held their id.
    pub fn taken(&self) -> u64 {
        self.taken
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// Entries held for `owner`.
    pub fn len_of(&self, owner: Option<Owner>) -> usize {
        self.owners.get(&owner).map_or(0, |q| q.live)
    }

    fn expired(&self, at_ms: f64, now_ms: f64) -> bool {
        now_ms - at_ms >= self.ttl_ms
    }

    fn forget(&mut self, id: &str, why: Forgotten) {
        let Some(entry) = self.by_id.remove(id) else {
            return;
        };
        self.dropped[why as usize] += 1;
        let owner = entry.holder.owner;
        if let Some(q) = self.owners.get_mut(&owner) {
            q.live = q.live.saturating_sub(1);
            if q.live == 0 {
                self.owners.remove(&owner);
            }
        }
    }

    /// Keeps each queue within twice its live entries (plus slack).
    fn compact(&mut self, owner: Option<Owner>) {
        let Self {
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

    /// Remembers that `id` is held by `holder`, as of `now_ms`: a new id
    /// is recorded (its owner's oldest forgotten first when the owner is
    /// at its cap, then the oldest of all while the table is full); an id
    /// its owner holds is refreshed; an id another owner holds is left as
    /// it is ([`Inserted::Taken`]).
    pub fn insert(&mut self, id: &str, holder: Holder, now_ms: f64) -> Inserted {
        if id.is_empty() || id.len() > MAX_RESPONSE_ID_BYTES {
            return Inserted::Ignored;
        }
        let inserted = self.insert_checked(id, holder, now_ms);
        self.compact(holder.owner);
        inserted
    }

    fn insert_checked(&mut self, id: &str, holder: Holder, now_ms: f64) -> Inserted {
        if let Some(entry) = self.by_id.get(id) {
            if self.expired(entry.at_ms, now_ms) {
                self.forget(id, Forgotten::Expired);
            } else if entry.holder.owner != holder.owner {
                self.taken += 1;
                return Inserted::Taken;
            } else {
                // Refreshed: its time renewed, queued anew at the back.
                self.seq += 1;
                let seq = self.seq;
                self.by_id.insert(
                    id.into(),
                    Entry {
                        holder,
                        at_ms: now_ms,
                        seq,
                    },
                );
                let key: Box<str> = id.into();
                self.order.push_back((key.clone(), seq));
                if let Some(q) = self.owners.get_mut(&holder.owner) {
                    q.order.push_back((key, seq));
                }
                return Inserted::Stored;
            }
        }
        // Expired entries at the front go first (the order is by time).
        while let Some(front) = self.order.front() {
            let live = self.by_id.get(&front.0).filter(|e| e.seq == front.1);
            match live {
                None => {
                    self.order.pop_front();
                }
                Some(e) if self.expired(e.at_ms, now_ms) => {
                    let (old, _) = self.order.pop_front().expect("a front");
                    self.forget(&old, Forgotten::Expired);
                }
                Some(_) => break,
            }
        }
        // A key at its own cap forgets its own oldest (without keys, all
        // clients are one space, bounded by the global cap alone).
        let at_cap = holder.owner.is_some()
            && self
                .owners
                .get(&holder.owner)
                .is_some_and(|q| q.live >= self.per_key);
        if at_cap {
            let Self { by_id, owners, .. } = &mut *self;
            let oldest = owners
                .get_mut(&holder.owner)
                .and_then(|q| pop_live(by_id, &mut q.order));
            if let Some(old) = oldest {
                self.forget(&old, Forgotten::KeyCapacity);
            }
        }
        // Then the oldest of all while the table is full.
        while self.by_id.len() >= self.capacity {
            let Self { by_id, order, .. } = &mut *self;
            let Some(old) = pop_live(by_id, order) else {
                break;
            };
            self.forget(&old, Forgotten::Capacity);
        }
        self.seq += 1;
        let seq = self.seq;
        let key: Box<str> = id.into();
        self.by_id.insert(
            key.clone(),
            Entry {
                holder,
                at_ms: now_ms,
                seq,
            },
        );
        self.order.push_back((key.clone(), seq));
        let q = self.owners.entry(holder.owner).or_default();
        q.live += 1;
        q.order.push_back((key, seq));
        Inserted::Stored
    }

    /// The holder of `id` for a caller of owner `caller`: `None` when the
    /// table does not know it, it has expired, or it is another owner's
    /// (the same answer, so a caller learns nothing of others' ids).
    pub fn get(&mut self, id: &str, caller: Option<Owner>, now_ms: f64) -> Option<Holder> {
        if id.len() > MAX_RESPONSE_ID_BYTES {
            return None;
        }
        let entry = self.by_id.get(id)?;
        if entry.holder.owner != caller {
            return None;
        }
        if self.expired(entry.at_ms, now_ms) {
            self.forget(id, Forgotten::Expired);
            return None;
        }
        Some(entry.holder)
    }
}

/// Where the worker holding a stored response stands in the fleet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Standing {
    /// In selection: it may take the request.
    InSelection,
    /// In the fleet but out of selection (unhealthy, or down).
    OutOfSelection,
    /// No longer in the fleet.
    Gone,
}

/// Where a request that continues (or reads) stored response `id` may go:
/// the one decision `serve` answers with (a 404, 410 or 503 for the last
/// three) and the simulator's Responses chains replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Located {
    /// To the holder's worker, and no other.
    At(Holder),
    /// Not known for this caller (never seen, forgotten, or another
    /// owner's).
    Unknown,
    /// Its worker has left the fleet.
    WorkerGone(Holder),
    /// Its worker is out of selection for now.
    WorkerOutOfSelection(Holder),
}

impl ResponseAffinity {
    /// [`ResponseAffinity::get`], then where the holder's worker stands
    /// (`standing`, asked only of a known holder).
    pub fn locate(
        &mut self,
        id: &str,
        caller: Option<Owner>,
        now_ms: f64,
        standing: impl FnOnce(WorkerId) -> Standing,
    ) -> Located {
        located(self.get(id, caller, now_ms), standing)
    }
}

/// The decision of [`ResponseAffinity::locate`] for a holder already
/// looked up (a driver that must not ask about workers while it holds the
/// table's lock).
pub fn located(holder: Option<Holder>, standing: impl FnOnce(WorkerId) -> Standing) -> Located {
    let Some(holder) = holder else {
        return Located::Unknown;
    };
    match standing(holder.worker) {
        Standing::InSelection => Located::At(holder),
        Standing::OutOfSelection => Located::WorkerOutOfSelection(holder),
        Standing::Gone => Located::WorkerGone(holder),
    }
}

/// The session of the turn that continues response `previous` held as
/// `holder` (the caller's own: [`ResponseAffinity::get`] gives no other): the
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
#[path = "responses_tests.rs"]
mod tests;
