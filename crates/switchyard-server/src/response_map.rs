//! The router's response affinity: the core's table
//! ([`switchyard_core::admission::responses`]: which worker holds which
//! stored response, for whom; owned, bounded twice, expiring) behind a
//! lock, on the server's clock, with its metrics. A later
//! `previous_response_id`, `GET /v1/responses/{id}` or
//! `POST /v1/responses/{id}/cancel` goes to the worker this map names and
//! no other, and only for the key that created it.
//!
//! Caps: `--max-stored-responses` in all, `--max-stored-responses-per-key`
//! of one key, `--stored-response-ttl-secs`. Every entry forgotten is
//! counted by why (`switchyard_response_map_drops_total{reason}`:
//! `capacity`, `key_capacity`, `expired`), every answer refused for its id
//! by `reason="taken"`, and the map's size is a gauge
//! (`switchyard_response_map_entries`).

use crate::metrics::CountGauge;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::registry::Registry;
use std::sync::Mutex;
use std::time::{Duration, Instant};
use switchyard_core::admission::responses::ResponseAffinity;

pub use switchyard_core::admission::responses::{session_of, Forgotten, Holder, Inserted, Owner};

/// Default `--max-stored-responses`.
pub const DEFAULT_CAPACITY: usize = 100_000;
/// Default `--max-stored-responses-per-key`: a tenth of the default
/// global cap, so it takes ten keys at their own caps to fill the map.
pub const DEFAULT_PER_KEY: usize = 10_000;
/// Default `--stored-response-ttl-secs`: a day.
pub const DEFAULT_TTL: Duration = Duration::from_secs(24 * 3600);

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DropLabels {
    reason: &'static str,
}

/// The table behind its lock, and its metrics.
#[derive(Debug)]
pub struct ResponseMap {
    /// The server clock's zero: the table's `now_ms` is time since it.
    epoch: Instant,
    inner: Mutex<Inner>,
    drops: Family<DropLabels, Counter>,
    dropped: [Counter; 3],
    taken: Counter,
    entries: CountGauge,
}

#[derive(Debug)]
struct Inner {
    table: ResponseAffinity,
    /// The table's counts the metrics already have.
    counted: [u64; 3],
    counted_taken: u64,
}

impl ResponseMap {
    /// An empty map of at most `capacity` entries in all and `per_key` of
    /// one owner, each kept for `ttl`.
    pub fn new(capacity: usize, per_key: usize, ttl: Duration) -> Self {
        let drops = Family::<DropLabels, Counter>::default();
        // One statement each: a family's guard lives to the statement's end.
        let dropped = Forgotten::ALL.map(|why| {
            drops
                .get_or_create(&DropLabels {
                    reason: why.label(),
                })
                .clone()
        });
        let taken = drops.get_or_create(&DropLabels { reason: "taken" }).clone();
        Self {
            epoch: Instant::now(),
            inner: Mutex::new(Inner {
                table: ResponseAffinity::new(capacity, per_key, ttl.as_secs_f64() * 1e3),
                counted: [0; 3],
                counted_taken: 0,
            }),
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

    fn ms(&self, now: Instant) -> f64 {
        now.saturating_duration_since(self.epoch).as_secs_f64() * 1e3
    }

    /// Runs `f` on the table, then brings the metrics up to its counts.
    fn with<T>(&self, f: impl FnOnce(&mut ResponseAffinity) -> T) -> T {
        let mut inner = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let out = f(&mut inner.table);
        for why in Forgotten::ALL {
            let now = inner.table.drops(why);
            self.dropped[why as usize].inc_by(now - inner.counted[why as usize]);
            inner.counted[why as usize] = now;
        }
        let taken = inner.table.taken();
        self.taken.inc_by(taken - inner.counted_taken);
        inner.counted_taken = taken;
        self.entries.set(inner.table.len() as u64);
        out
    }

    /// Entries forgotten for `why`.
    pub fn drops(&self, why: Forgotten) -> u64 {
        self.dropped[why as usize].get()
    }

    /// Answers not recorded because another owner held their id.
    pub fn taken(&self) -> u64 {
        self.taken.get()
    }

    /// Remembers that `id` is held by `holder`, as of `now`
    /// ([`ResponseAffinity::insert`]).
    pub fn insert(&self, id: &str, holder: Holder, now: Instant) -> Inserted {
        let now_ms = self.ms(now);
        self.with(|table| table.insert(id, holder, now_ms))
    }

    /// The holder of `id` for a caller of owner `caller`
    /// ([`ResponseAffinity::get`]: `None` for another owner's, as for an
    /// unknown id).
    pub fn get(&self, id: &str, caller: Option<Owner>, now: Instant) -> Option<Holder> {
        let now_ms = self.ms(now);
        self.with(|table| table.get(id, caller, now_ms))
    }

    /// Entries held.
    pub fn len(&self) -> usize {
        self.with(|table| table.len())
    }

    /// Whether none is.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Entries held for `owner`.
    pub fn len_of(&self, owner: Option<Owner>) -> usize {
        self.with(|table| table.len_of(owner))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use switchyard_core::WorkerId;

    /// The metrics follow the table: an expiry on the server's clock and a
    /// refused answer are counted once each, and the size is the gauge.
    #[test]
    fn the_map_counts_what_its_table_forgets_and_refuses() {
        let map = ResponseMap::new(10, 10, Duration::from_secs(60));
        let t = Instant::now();
        let holder = |owner| Holder {
            worker: WorkerId::new(1),
            session: None,
            owner,
        };
        let (a, b) = (Some(Owner(1)), Some(Owner(2)));
        assert_eq!(map.insert("resp_a", holder(a), t), Inserted::Stored);
        assert_eq!(map.insert("resp_a", holder(b), t), Inserted::Taken);
        assert_eq!(map.taken(), 1);
        assert_eq!(
            map.get("resp_a", a, t + Duration::from_secs(59)),
            Some(holder(a))
        );
        assert_eq!(map.get("resp_a", a, t + Duration::from_secs(61)), None);
        assert_eq!(map.drops(Forgotten::Expired), 1);
        assert!(map.is_empty());
        assert_eq!(map.entries.get(), 0);
        let mut text = String::new();
        let mut registry = Registry::default();
        map.register(&mut registry);
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("switchyard_response_map_drops_total{reason=\"expired\"} 1"));
        assert!(text.contains("switchyard_response_map_drops_total{reason=\"taken\"} 1"));
    }
}
