//! LoRA adapters: which worker has which adapter loaded, and where a
//! request for an adapter should go.
//!
//! A request for an adapter can run only on a worker that has the adapter
//! loaded; loading it takes time (vLLM's `/v1/load_lora_adapter`, a copy
//! of the adapter's weights onto the device) and a slot (`--max-loras`).
//! The [`AdapterTable`] is the router's view of that, one bounded set per
//! worker, fed by the drivers: the server from each worker's `/v1/models`
//! (adapters are the entries with a `parent`) and from the loads and
//! unloads it made; the simulator from its engines. The routing decision
//! itself is made by the [`crate::router::Router`]: a worker without the
//! adapter is priced its load time ([`AdapterConfig::load_ms`]) by the
//! `ttft` policy, in the same milliseconds as its prefill; every other
//! policy is given only the workers that have it when any does, plus the
//! workers with more than [`AdapterConfig::affinity_slack_requests`] fewer
//! active requests than the least busy holder (filter, then fall back to
//! all; without the slack, a hot adapter piles onto its holders: measured
//! in `replay`, docs/simulator.md). When the chosen worker lacks the adapter, the
//! [`crate::dispatch::Dispatch`] carries an [`AdapterLoad`]: load it there
//! first, after unloading the coldest adapter when the worker's slots are
//! full.
//!
//! Bounds: at most [`AdapterConfig::max_per_worker`] adapters a worker
//! (what a worker reports beyond it is dropped and counted), names of at
//! most [`MAX_ADAPTER_NAME_BYTES`] bytes (longer ones are refused and
//! counted), and a worker's slots clamped to the same cap.
//!
//! Which adapters a request may name at all, and the base model whose
//! workers may serve each, is the [`catalogue`]'s.

pub mod catalogue;

use crate::maps::FxHashMap;
use crate::types::WorkerId;
use serde::{Deserialize, Serialize};

/// Longest adapter name kept (bytes).
pub const MAX_ADAPTER_NAME_BYTES: usize = 256;
/// Adapters marked holders-only ([`AdapterTable::holders_only`]), at most.
pub const MAX_HOLDERS_ONLY: usize = 4096;

/// How long a planned load that the driver has neither confirmed nor
/// failed survives refreshes that do not list it (a worker slower to load
/// than [`AdapterConfig::load_ms`]), in ms.
pub const UNCONFIRMED_LOAD_TTL_MS: f64 = 120_000.0;

/// Settings of adapter-affinity routing.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdapterConfig {
    /// Expected wall milliseconds to load an adapter onto a worker: what
    /// routing a request to a worker without its adapter costs it.
    pub load_ms: f64,
    /// Adapters tracked per worker at most.
    pub max_per_worker: usize,
    /// Adapter-blind routing: every worker is priced as if it had the
    /// adapter (loads still happen where the request lands). For
    /// comparisons only.
    pub blind: bool,
    /// For the policies that do not price time: a worker without the
    /// adapter stays a candidate while it has more than this many fewer
    /// active requests than the least busy holder (a load is worth a few
    /// requests of queue), so a hot adapter spreads instead of piling onto
    /// its holders.
    pub affinity_slack_requests: usize,
}

impl Default for AdapterConfig {
    fn default() -> Self {
        Self {
            load_ms: 500.0,
            max_per_worker: 64,
            blind: false,
            affinity_slack_requests: 4,
        }
    }
}

/// Why an [`AdapterConfig`] was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum AdapterConfigError {
    /// A load time that is negative or not finite.
    #[error("adapters.load_ms must be finite and non-negative, got {0}")]
    LoadMs(f64),
    /// No room for any adapter.
    #[error("adapters.max_per_worker must be at least 1")]
    MaxPerWorker,
}

impl AdapterConfig {
    /// Checks every setting.
    pub fn validate(&self) -> Result<(), AdapterConfigError> {
        if !(self.load_ms.is_finite() && self.load_ms >= 0.0) {
            return Err(AdapterConfigError::LoadMs(self.load_ms));
        }
        if self.max_per_worker == 0 {
            return Err(AdapterConfigError::MaxPerWorker);
        }
        Ok(())
    }
}

/// Load an adapter on the chosen worker before sending the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdapterLoad {
    /// The adapter to load.
    pub adapter: Box<str>,
    /// Unload this one first: the worker's slots are full and it is the
    /// least recently used there.
    pub unload: Option<Box<str>>,
}

/// Counters of an [`AdapterTable`] (monotonic).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AdapterCounters {
    /// Adapters a worker reported beyond [`AdapterConfig::max_per_worker`].
    pub dropped: u64,
    /// Names refused for their length.
    pub refused_names: u64,
    /// Loads planned by placements.
    pub loads_planned: u64,
    /// Unloads planned by placements (a full worker's coldest adapter).
    pub unloads_planned: u64,
    /// Holders-only marks refused: [`MAX_HOLDERS_ONLY`] were set.
    pub holders_only_dropped: u64,
}

#[derive(Clone, Debug)]
struct Loaded {
    name: Box<str>,
    /// When it is (or was) ready: a planned load is ready `load_ms` after
    /// it was planned.
    ready_ms: f64,
    /// Last placement that used it (recency for unloading).
    used_ms: f64,
    /// When a placement planned its load and the driver has not yet said
    /// how it went (`None`: reported by the worker, or confirmed).
    planned_ms: Option<f64>,
}

#[derive(Clone, Debug, Default)]
struct WorkerAdapters {
    loaded: Vec<Loaded>,
    /// Adapter slots, when the worker reported them.
    slots: Option<usize>,
}

impl WorkerAdapters {
    fn find(&self, name: &str) -> Option<usize> {
        self.loaded.iter().position(|l| &*l.name == name)
    }
}

/// Per worker, the adapters it has loaded (bounded).
#[derive(Clone, Debug)]
pub struct AdapterTable {
    config: AdapterConfig,
    workers: FxHashMap<WorkerId, WorkerAdapters>,
    /// Adapters the driver may not load: served only where loaded.
    holders_only: crate::maps::FxHashSet<Box<str>>,
    counters: AdapterCounters,
}

impl AdapterTable {
    /// An empty table.
    pub fn new(config: AdapterConfig) -> Self {
        Self {
            config,
            workers: FxHashMap::default(),
            holders_only: Default::default(),
            counters: AdapterCounters::default(),
        }
    }

    /// Marks `adapter` as one the driver cannot load (the server knows no
    /// path for it: a worker announced it, no operator configured it), or
    /// clears the mark: a request for a marked adapter goes only to a
    /// worker that has it loaded, whatever the policy, and never plans a
    /// load. Returns whether the mark is set (at most
    /// [`MAX_HOLDERS_ONLY`]: beyond, refused and counted).
    pub fn set_holders_only(&mut self, adapter: &str, on: bool) -> bool {
        if !on {
            self.holders_only.remove(adapter);
            return false;
        }
        if self.holders_only.contains(adapter) {
            return true;
        }
        if self.holders_only.len() >= MAX_HOLDERS_ONLY || adapter.len() > MAX_ADAPTER_NAME_BYTES {
            self.counters.holders_only_dropped += 1;
            return false;
        }
        self.holders_only.insert(adapter.into());
        true
    }

    /// Whether `adapter` is served only where it is loaded.
    pub fn holders_only(&self, adapter: &str) -> bool {
        self.holders_only.contains(adapter)
    }

    /// The settings.
    pub fn config(&self) -> &AdapterConfig {
        &self.config
    }

    /// Counters.
    pub fn counters(&self) -> AdapterCounters {
        self.counters
    }

    /// Adapters tracked on `worker` (the loaded ones and those being loaded).
    pub fn loaded(&self, worker: WorkerId) -> impl Iterator<Item = &str> + '_ {
        self.workers
            .get(&worker)
            .into_iter()
            .flat_map(|w| w.loaded.iter().map(|l| &*l.name))
    }

    /// Adapters tracked over the fleet.
    pub fn total(&self) -> usize {
        self.workers.values().map(|w| w.loaded.len()).sum()
    }

    /// Whether `worker` has `adapter` (loaded or being loaded).
    pub fn has(&self, worker: WorkerId, adapter: &str) -> bool {
        self.workers
            .get(&worker)
            .is_some_and(|w| w.find(adapter).is_some())
    }

    /// What routing a request for `adapter` to `worker` at `now_ms` costs in
    /// wall ms before its prefill can start: 0 when it is loaded, the rest
    /// of a load under way, the full load time otherwise.
    pub fn load_cost_ms(&self, worker: WorkerId, adapter: &str, now_ms: f64) -> f64 {
        if self.config.blind {
            return 0.0;
        }
        match self
            .workers
            .get(&worker)
            .and_then(|w| w.find(adapter).map(|i| &w.loaded[i]))
        {
            Some(l) => (l.ready_ms - now_ms).max(0.0),
            None => self.config.load_ms,
        }
    }

    /// `worker`'s adapter slots, when known.
    pub fn slots(&self, worker: WorkerId) -> Option<usize> {
        self.workers.get(&worker)?.slots
    }

    /// Sets `worker`'s adapter slots (`None`: unknown, never full), clamped
    /// to [`AdapterConfig::max_per_worker`].
    pub fn set_slots(&mut self, worker: WorkerId, slots: Option<usize>) {
        let cap = self.config.max_per_worker;
        self.workers.entry(worker).or_default().slots = slots.map(|s| s.min(cap));
    }

    /// Replaces `worker`'s adapters by what it reports (its `/v1/models`).
    /// Adapters it still has keep their recency; a load this router planned
    /// and the worker does not list yet is kept until it is due. Beyond the
    /// cap the rest are dropped and counted.
    pub fn set_loaded<'a>(
        &mut self,
        worker: WorkerId,
        names: impl IntoIterator<Item = &'a str>,
        now_ms: f64,
    ) {
        let cap = self.config.max_per_worker;
        let entry = self.workers.entry(worker).or_default();
        let old = std::mem::take(&mut entry.loaded);
        for name in names {
            if name.is_empty() || name.len() > MAX_ADAPTER_NAME_BYTES {
                self.counters.refused_names += 1;
                continue;
            }
            if entry.find(name).is_some() {
                continue;
            }
            if entry.loaded.len() >= cap {
                self.counters.dropped += 1;
                continue;
            }
            let used_ms = old
                .iter()
                .find(|l| &*l.name == name)
                .map_or(f64::NEG_INFINITY, |l| l.used_ms);
            entry.loaded.push(Loaded {
                name: name.into(),
                ready_ms: f64::NEG_INFINITY,
                used_ms,
                planned_ms: None,
            });
        }
        let pending = |l: &Loaded| {
            l.ready_ms > now_ms
                || l.planned_ms
                    .is_some_and(|p| now_ms - p < UNCONFIRMED_LOAD_TTL_MS)
        };
        for pending in old.into_iter().filter(pending) {
            if entry.find(&pending.name).is_none() && entry.loaded.len() < cap {
                entry.loaded.push(pending);
            }
        }
    }

    /// `worker` has loaded `adapter` (or will have at `ready_ms`).
    pub fn mark_loaded(&mut self, worker: WorkerId, adapter: &str, ready_ms: f64, now_ms: f64) {
        if adapter.is_empty() || adapter.len() > MAX_ADAPTER_NAME_BYTES {
            self.counters.refused_names += 1;
            return;
        }
        let cap = self.config.max_per_worker;
        let entry = self.workers.entry(worker).or_default();
        match entry.find(adapter) {
            Some(i) => {
                entry.loaded[i].ready_ms = ready_ms;
                entry.loaded[i].used_ms = now_ms;
                entry.loaded[i].planned_ms = None;
            }
            None if entry.loaded.len() < cap => entry.loaded.push(Loaded {
                name: adapter.into(),
                ready_ms,
                used_ms: now_ms,
                planned_ms: None,
            }),
            None => self.counters.dropped += 1,
        }
    }

    /// `worker` no longer has `adapter`.
    pub fn mark_unloaded(&mut self, worker: WorkerId, adapter: &str) {
        if let Some(entry) = self.workers.get_mut(&worker) {
            entry.loaded.retain(|l| &*l.name != adapter);
        }
    }

    /// Forgets `worker`.
    pub fn remove_worker(&mut self, worker: WorkerId) {
        self.workers.remove(&worker);
    }

    /// The least recently used adapter on `worker` other than `except`.
    pub fn coldest(&self, worker: WorkerId, except: &str) -> Option<&str> {
        self.workers
            .get(&worker)?
            .loaded
            .iter()
            .filter(|l| &*l.name != except)
            .min_by(|a, b| a.used_ms.total_cmp(&b.used_ms))
            .map(|l| &*l.name)
    }

    /// Whether `worker`'s known slots are all taken.
    pub fn is_full(&self, worker: WorkerId) -> bool {
        self.workers
            .get(&worker)
            .is_some_and(|w| w.slots.is_some_and(|s| w.loaded.len() >= s))
    }

    /// A request for `adapter` was placed on `worker` at `now_ms`: touches
    /// it, or plans its load (after unloading the coldest adapter when the
    /// worker's slots are full) and records the load as under way.
    pub fn place(&mut self, worker: WorkerId, adapter: &str, now_ms: f64) -> Option<AdapterLoad> {
        if adapter.is_empty() || adapter.len() > MAX_ADAPTER_NAME_BYTES {
            self.counters.refused_names += 1;
            return None;
        }
        if let Some(entry) = self.workers.get_mut(&worker) {
            if let Some(i) = entry.find(adapter) {
                entry.loaded[i].used_ms = now_ms;
                return None;
            }
        }
        if self.holders_only(adapter) {
            // Nothing to load it from.
            return None;
        }
        let full = self.is_full(worker)
            || self
                .workers
                .get(&worker)
                .is_some_and(|w| w.loaded.len() >= self.config.max_per_worker);
        let unload: Option<Box<str>> = if full {
            self.coldest(worker, adapter).map(Into::into)
        } else {
            None
        };
        if let Some(victim) = &unload {
            self.mark_unloaded(worker, victim);
            self.counters.unloads_planned += 1;
        }
        self.counters.loads_planned += 1;
        self.mark_loaded(worker, adapter, now_ms + self.config.load_ms, now_ms);
        if let Some(entry) = self.workers.get_mut(&worker) {
            if let Some(i) = entry.find(adapter) {
                entry.loaded[i].planned_ms = Some(now_ms);
            }
        }
        Some(AdapterLoad {
            adapter: adapter.into(),
            unload,
        })
    }

    /// Heap bytes, roughly.
    pub fn estimated_bytes(&self) -> usize {
        self.holders_only.allocation_size()
            + self.holders_only.iter().map(|n| n.len()).sum::<usize>()
            + crate::maps::map_bytes(&self.workers)
            + self
                .workers
                .values()
                .map(|w| {
                    w.loaded.capacity() * std::mem::size_of::<Loaded>()
                        + w.loaded.iter().map(|l| l.name.len()).sum::<usize>()
                })
                .sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn w(id: u64) -> WorkerId {
        WorkerId::new(id)
    }

    fn table(cap: usize) -> AdapterTable {
        AdapterTable::new(AdapterConfig {
            load_ms: 100.0,
            max_per_worker: cap,
            ..AdapterConfig::default()
        })
    }

    #[test]
    fn a_worker_without_the_adapter_costs_its_load_time_and_a_load_under_way_its_rest() {
        let mut t = table(4);
        t.set_loaded(w(1), ["a"], 0.0);
        assert_eq!(t.load_cost_ms(w(1), "a", 0.0), 0.0);
        assert_eq!(t.load_cost_ms(w(2), "a", 0.0), 100.0);
        assert_eq!(
            t.place(w(2), "a", 10.0),
            Some(AdapterLoad {
                adapter: "a".into(),
                unload: None
            })
        );
        assert_eq!(t.load_cost_ms(w(2), "a", 60.0), 50.0);
        assert_eq!(t.load_cost_ms(w(2), "a", 200.0), 0.0);
        assert_eq!(t.place(w(2), "a", 20.0), None, "already under way");
        // A refresh that does not list it yet keeps the planned load.
        t.set_loaded(w(2), std::iter::empty(), 30.0);
        assert!(t.has(w(2), "a"));
        // Due but not confirmed: a slow load survives a refresh ...
        t.set_loaded(w(2), std::iter::empty(), 500.0);
        assert!(t.has(w(2), "a"));
        // ... until the driver says it is loaded: then the worker's list
        // is the truth.
        t.mark_loaded(w(2), "a", 600.0, 600.0);
        t.set_loaded(w(2), std::iter::empty(), 700.0);
        assert!(!t.has(w(2), "a"));
        // An unconfirmed load is forgotten after its time to live.
        t.place(w(3), "b", 0.0);
        t.set_loaded(w(3), std::iter::empty(), UNCONFIRMED_LOAD_TTL_MS + 1.0);
        assert!(!t.has(w(3), "b"));
    }

    #[test]
    fn a_full_worker_unloads_its_least_recently_used_adapter_first() {
        let mut t = table(8);
        t.set_slots(w(1), Some(2));
        t.set_loaded(w(1), ["a", "b"], 0.0);
        t.place(w(1), "b", 1.0);
        t.place(w(1), "a", 2.0);
        let plan = t.place(w(1), "c", 3.0).unwrap();
        assert_eq!(plan.unload.as_deref(), Some("b"));
        assert!(t.has(w(1), "a") && t.has(w(1), "c") && !t.has(w(1), "b"));
        assert_eq!(t.counters().unloads_planned, 1);
    }

    #[test]
    fn what_a_worker_reports_is_bounded_and_counted() {
        let mut t = table(2);
        let long = "x".repeat(MAX_ADAPTER_NAME_BYTES + 1);
        t.set_loaded(w(1), ["a", "a", "b", "c", "", long.as_str()], 0.0);
        assert_eq!(t.loaded(w(1)).count(), 2);
        assert_eq!(t.counters().dropped, 1);
        assert_eq!(t.counters().refused_names, 2);
        t.set_slots(w(1), Some(1_000));
        // Clamped to the cap: full at two.
        assert!(t.is_full(w(1)));
    }

    #[test]
    fn holders_only_marks_are_bounded_and_plan_no_load() {
        let mut t = AdapterTable::new(AdapterConfig::default());
        for i in 0..MAX_HOLDERS_ONLY {
            assert!(t.set_holders_only(&format!("a{i}"), true));
        }
        assert!(t.set_holders_only("a0", true), "already marked");
        assert!(!t.set_holders_only("one-more", true));
        assert!(!t.set_holders_only(&"x".repeat(MAX_ADAPTER_NAME_BYTES + 1), true));
        assert_eq!(t.counters().holders_only_dropped, 2);
        assert_eq!(t.place(w(1), "a1", 0.0), None, "nothing to load it from");
        assert!(!t.has(w(1), "a1"));
        t.set_holders_only("a1", false);
        assert!(t.place(w(1), "a1", 0.0).is_some());
    }

    #[test]
    fn blind_routing_prices_nothing() {
        let t = AdapterTable::new(AdapterConfig {
            blind: true,
            ..AdapterConfig::default()
        });
        assert_eq!(t.load_cost_ms(w(1), "a", 0.0), 0.0);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Report(u64, Vec<u8>),
        Slots(u64, Option<usize>),
        Place(u64, u8),
        Unload(u64, u8),
        Remove(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0..3u64, proptest::collection::vec(0..8u8, 0..10)).prop_map(|(w, n)| Op::Report(w, n)),
            (0..3u64, proptest::option::of(0..6usize)).prop_map(|(w, s)| Op::Slots(w, s)),
            (0..3u64, 0..8u8).prop_map(|(w, a)| Op::Place(w, a)),
            (0..3u64, 0..8u8).prop_map(|(w, a)| Op::Unload(w, a)),
            (0..3u64).prop_map(Op::Remove),
        ]
    }

    proptest! {
        /// Whatever the reports and placements: no worker holds more than
        /// the cap or its slots after a placement, no name twice, and a
        /// placement leaves the adapter on the worker.
        #[test]
        fn every_worker_stays_within_its_cap_and_slots(ops in proptest::collection::vec(op(), 1..80)) {
            let cap = 4;
            let mut t = table(cap);
            for (step, op) in ops.into_iter().enumerate() {
                let now = step as f64 * 10.0;
                match op {
                    Op::Report(wk, names) => {
                        let names: Vec<String> = names.iter().map(|n| format!("a{n}")).collect();
                        t.set_loaded(w(wk), names.iter().map(String::as_str), now);
                    }
                    Op::Slots(wk, s) => t.set_slots(w(wk), s),
                    Op::Place(wk, a) => {
                        let name = format!("a{a}");
                        let before = t.loaded(w(wk)).count();
                        let was_full = t.is_full(w(wk));
                        let had = t.has(w(wk), &name);
                        let plan = t.place(w(wk), &name, now);
                        prop_assert!(t.has(w(wk), &name));
                        prop_assert_eq!(plan.is_none(), had);
                        if let Some(plan) = plan {
                            if was_full && before > 0 {
                                prop_assert!(plan.unload.is_some());
                            }
                            if let Some(victim) = &plan.unload {
                                prop_assert!(!t.has(w(wk), victim));
                            }
                        }
                    }
                    Op::Unload(wk, a) => {
                        let name = format!("a{a}");
                        t.mark_unloaded(w(wk), &name);
                        prop_assert!(!t.has(w(wk), &name));
                    }
                    Op::Remove(wk) => t.remove_worker(w(wk)),
                }
                for wk in 0..3 {
                    let names: Vec<&str> = t.loaded(w(wk)).collect();
                    prop_assert!(names.len() <= cap);
                    let mut sorted = names.clone();
                    sorted.sort_unstable();
                    sorted.dedup();
                    prop_assert_eq!(sorted.len(), names.len());
                }
            }
        }
    }
}
