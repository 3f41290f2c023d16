//! Which worker holds which stored response: a bounded, expiring map from
//! a Responses API response id to the worker that answered it, so that a
//! later `previous_response_id`, `GET /v1/responses/{id}` or
//! `POST /v1/responses/{id}/cancel` goes to that worker and no other (the
//! engines store responses in their own memory).
//!
//! Bounded: at most `capacity` entries (`--max-stored-responses`); the
//! oldest is forgotten first. Expiring: an entry older than `ttl`
//! (`--stored-response-ttl-secs`) is forgotten when next looked at or
//! when the oldest entries are swept at an insert. Every entry forgotten
//! is counted by why (`switchyard_response_map_drops_total{reason}`), and
//! the map's size is a gauge (`switchyard_response_map_entries`).
//!
//! An entry also holds the chain's session: every later turn of a
//! response chain is admitted as one session ([`ResponseMap::session_of`]).
//!
//! Ids are at most [`MAX_RESPONSE_ID_BYTES`] (longer ones are never
//! stored nor looked up). Memory: about `capacity` × (id + 64) bytes.

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
/// Default `--stored-response-ttl-secs`: a day.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);

/// Where a stored response lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Holder {
    /// The worker that answered it.
    pub worker: WorkerId,
    /// The chain's session.
    pub session: Option<SessionKey>,
}

/// Why an entry was forgotten.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Drop {
    /// The map was full: the oldest went.
    Capacity,
    /// Older than the TTL.
    Expired,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DropLabels {
    reason: &'static str,
}

/// The map and its metrics.
#[derive(Debug)]
pub struct ResponseMap {
    capacity: usize,
    ttl: Duration,
    inner: Mutex<Inner>,
    drops: Family<DropLabels, Counter>,
    dropped: [Counter; 2],
    entries: CountGauge,
}

#[derive(Debug, Default)]
struct Inner {
    by_id: HashMap<Box<str>, (Holder, Instant)>,
    /// Ids in insertion order (with their insertion time, to tell a stale
    /// queue entry from a re-inserted id).
    order: VecDeque<(Box<str>, Instant)>,
}

impl ResponseMap {
    /// An empty map of at most `capacity` entries, each kept for `ttl`.
    pub fn new(capacity: usize, ttl: Duration) -> Self {
        let drops = Family::<DropLabels, Counter>::default();
        // One statement each: a family's guard lives to the statement's end.
        let capacity_drops = drops
            .get_or_create(&DropLabels { reason: "capacity" })
            .clone();
        let expired_drops = drops
            .get_or_create(&DropLabels { reason: "expired" })
            .clone();
        let dropped = [capacity_drops, expired_drops];
        Self {
            capacity: capacity.max(1),
            ttl,
            inner: Mutex::default(),
            drops,
            dropped,
            entries: CountGauge::default(),
        }
    }

    /// Registers the metrics.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "switchyard_response_map_drops",
            "Stored-response locations forgotten, by why (capacity: the map was full; expired: older than --stored-response-ttl-secs)",
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

    /// Remembers that `id` is held by `holder`, as of `now`.
    pub fn insert(&self, id: &str, holder: Holder, now: Instant) {
        if id.is_empty() || id.len() > MAX_RESPONSE_ID_BYTES {
            return;
        }
        let mut inner = self.lock();
        // Expired entries at the front go first, then the oldest while full.
        while let Some((old, at)) = inner.order.front().cloned() {
            let live = inner.by_id.get(&old).is_some_and(|(_, t)| *t == at);
            if !live {
                inner.order.pop_front();
                continue;
            }
            let expired = now.saturating_duration_since(at) >= self.ttl;
            let full = inner.by_id.len() >= self.capacity && !inner.by_id.contains_key(id);
            if !expired && !full {
                break;
            }
            inner.order.pop_front();
            inner.by_id.remove(&old);
            self.count(if expired {
                Drop::Expired
            } else {
                Drop::Capacity
            });
        }
        let key: Box<str> = id.into();
        inner.by_id.insert(key.clone(), (holder, now));
        inner.order.push_back((key, now));
        // The queue holds at most one stale entry per live one.
        if inner.order.len() > 2 * self.capacity {
            let Inner { by_id, order } = &mut *inner;
            order.retain(|(k, t)| by_id.get(k).is_some_and(|(_, at)| at == t));
        }
        self.entries.set(inner.by_id.len() as u64);
    }

    /// The holder of `id`, if the router knows it and it has not expired.
    pub fn get(&self, id: &str, now: Instant) -> Option<Holder> {
        if id.len() > MAX_RESPONSE_ID_BYTES {
            return None;
        }
        let mut inner = self.lock();
        let (holder, at) = *inner.by_id.get(id)?;
        if now.saturating_duration_since(at) >= self.ttl {
            inner.by_id.remove(id);
            self.count(Drop::Expired);
            self.entries.set(inner.by_id.len() as u64);
            return None;
        }
        Some(holder)
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.lock().by_id.len()
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// The session of the turn that continues response `previous` held as
/// `holder`: the chain's session, or (a chain begun without one) a
/// session named after the response it continues, so every later turn of
/// the chain shares it.
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
mod tests {
    use super::*;

    fn holder(w: u64) -> Holder {
        Holder {
            worker: WorkerId::new(w),
            session: None,
        }
    }

    #[test]
    fn a_full_map_forgets_its_oldest_entry_and_counts_it() {
        let map = ResponseMap::new(2, Duration::from_secs(60));
        let t = Instant::now();
        map.insert("resp_a", holder(1), t);
        map.insert("resp_b", holder(2), t);
        map.insert("resp_c", holder(3), t);
        assert_eq!(map.len(), 2);
        assert_eq!(map.get("resp_a", t), None);
        assert_eq!(map.get("resp_c", t), Some(holder(3)));
        assert_eq!(map.drops(Drop::Capacity), 1);
        // Re-inserting a held id does not evict another.
        map.insert("resp_c", holder(4), t);
        assert_eq!(map.get("resp_b", t), Some(holder(2)));
        assert_eq!(map.get("resp_c", t), Some(holder(4)));
    }

    #[test]
    fn an_entry_expires_after_the_ttl_and_is_counted() {
        let map = ResponseMap::new(10, Duration::from_secs(60));
        let t = Instant::now();
        map.insert("resp_a", holder(1), t);
        assert_eq!(
            map.get("resp_a", t + Duration::from_secs(59)),
            Some(holder(1))
        );
        assert_eq!(map.get("resp_a", t + Duration::from_secs(60)), None);
        assert_eq!(map.drops(Drop::Expired), 1);
        // Swept at an insert, too.
        map.insert("resp_b", holder(1), t);
        map.insert("resp_c", holder(1), t + Duration::from_secs(61));
        assert_eq!(map.len(), 1);
        assert_eq!(map.drops(Drop::Expired), 2);
    }

    #[test]
    fn ids_past_the_bound_are_neither_stored_nor_looked_up() {
        let map = ResponseMap::new(10, Duration::from_secs(60));
        let long = "r".repeat(MAX_RESPONSE_ID_BYTES + 1);
        map.insert(&long, holder(1), Instant::now());
        assert!(map.is_empty());
        assert_eq!(map.get(&long, Instant::now()), None);
    }

    #[test]
    fn a_chain_keeps_one_session_from_its_second_turn_on() {
        let first = session_of("resp_1", &holder(1), None);
        let carried = Holder {
            worker: WorkerId::new(1),
            session: Some(first),
        };
        assert_eq!(session_of("resp_2", &carried, None), first);
        assert_ne!(session_of("resp_1", &holder(1), Some("api-key-1")), first);
    }
}
