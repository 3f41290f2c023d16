//! LoRA adapters through the router: which adapters exist, which worker
//! has which loaded, and loading one on demand.
//!
//! - **The catalogue** is the core's
//!   ([`switchyard_core::adapters::catalogue`]: the configured
//!   `[[adapters]]` and those learned from workers' `/v1/models`, bounded
//!   and expiring, each refusal counted by why); here it is read under a
//!   lock, fed the cards of each worker's `/v1/models` (vLLM lists each
//!   loaded adapter as a model with `"parent"`, the base model, and
//!   `"root"`, its path) on the router's clock, and its drops exported in
//!   `switchyard_adapter_dropped_total`. A request whose `model` names an
//!   adapter is routed among the workers serving its base model, by the
//!   core's adapter affinity ([`switchyard_core::adapters`]), and its
//!   blocks are hashed with the adapter's seed (`seed_for(Some(name),
//!   None)`, what vLLM's KV events carry as `lora_name`).
//! - **What each worker has loaded**: read from its `/v1/models` on every
//!   health-check round (the adapters with a `parent`), and its slots from
//!   `/get_server_info`'s `max_loras` (the sim-worker, SGLang) or, for a
//!   worker without that endpoint (vLLM), from the `max_lora` label of
//!   `vllm:lora_requests_info` on its `/metrics`, which vLLM exports once
//!   it has served a request (read each round until found, while any
//!   adapter is known), into the core's bounded per-worker table. A
//!   worker whose slots stay unknown is never unloaded by the router.
//! - **Loading on demand**: when the core places a request on a worker
//!   without its adapter, the dispatch says so
//!   ([`switchyard_core::adapters::AdapterLoad`]); before forwarding, the
//!   router unloads the worker's coldest adapter when its slots are full
//!   (`POST /v1/unload_lora_adapter`) and loads the adapter
//!   (`POST /v1/load_lora_adapter {"lora_name", "lora_path"}`; vLLM
//!   answers once it is loaded; its "has already been loaded" 400 counts
//!   as loaded). Requests placed on the worker for the same adapter
//!   meanwhile wait for that load ([`Adapters::waiter`]). A failed load is
//!   a 502 naming the adapter and the worker, counted, and the core
//!   forgets the adapter there.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::{Mutex, RwLock};
pub(crate) use switchyard_core::adapters::catalogue::{AdapterSpec, Learnt, Resolved, MAX_LEARNED};
use switchyard_core::adapters::catalogue::{Card, Catalogue, Dropped, MAX_CARDS};
use switchyard_core::WorkerId;
use tokio::sync::watch;

/// Loads in flight tracked at once, at most.
pub(crate) const MAX_PENDING: usize = 4096;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

/// A load in flight: the worker and the adapter.
type LoadKey = (WorkerId, Box<str>);

/// The catalogue, loads in flight and the counters.
#[derive(Debug)]
pub struct Adapters {
    catalogue: RwLock<Catalogue>,
    pending: Mutex<HashMap<LoadKey, watch::Receiver<Option<bool>>>>,
    senders: Mutex<HashMap<LoadKey, watch::Sender<Option<bool>>>>,
    loads: Family<ResultLabel, Counter>,
    unloads: Family<ResultLabel, Counter>,
    waits: Counter,
    dropped: Family<ResultLabel, Counter>,
    loaded: Gauge,
}

impl Default for Adapters {
    fn default() -> Self {
        Self::new(&[])
    }
}

impl Adapters {
    /// A catalogue of the configured adapters (already validated).
    pub fn new(specs: &[AdapterSpec]) -> Self {
        Self {
            catalogue: RwLock::new(Catalogue::new(specs)),
            pending: Mutex::default(),
            senders: Mutex::default(),
            loads: Family::default(),
            unloads: Family::default(),
            waits: Counter::default(),
            dropped: Family::default(),
            loaded: Gauge::default(),
        }
    }

    /// The same catalogue, knowing the configured models (`[[models]]`
    /// names): a learned adapter's parent must be one of them.
    pub fn with_base_models<'a>(mut self, names: impl IntoIterator<Item = &'a str>) -> Self {
        let catalogue = self.catalogue.get_mut().unwrap_or_else(|p| p.into_inner());
        *catalogue = std::mem::take(catalogue).with_base_models(names);
        self
    }

    /// Registers `switchyard_adapter_*`.
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "switchyard_adapter_loads",
            "LoRA adapter loads the router made on workers, by result (ok, failed)",
            self.loads.clone(),
        );
        registry.register(
            "switchyard_adapter_unloads",
            "LoRA adapter unloads the router made to free a full worker's slot, by result",
            self.unloads.clone(),
        );
        registry.register(
            "switchyard_adapter_load_waits",
            "Requests that waited for a load of their adapter already under way",
            self.waits.clone(),
        );
        registry.register(
            "switchyard_adapter_dropped",
            "Adapters not tracked, by reason (learned: catalogue full; table: a worker's table full; pending: too many loads in flight; invalid: a bad card; shadow: a card named as a base model; unknown_base: its parent is no base model of the fleet; expired: no worker listed it for a minute; base: too many base model names)",
            self.dropped.clone(),
        );
        registry.register(
            "switchyard_adapters_loaded",
            "LoRA adapters loaded over the fleet, as the router knows them",
            self.loaded.clone(),
        );
    }

    pub(crate) fn count_load(&self, ok: bool) {
        Self::count(&self.loads, if ok { "ok" } else { "failed" });
    }

    pub(crate) fn count_unload(&self, ok: bool) {
        Self::count(&self.unloads, if ok { "ok" } else { "failed" });
    }

    pub(crate) fn count_wait(&self) {
        self.waits.inc();
    }

    fn count(family: &Family<ResultLabel, Counter>, result: &'static str) {
        family.get_or_create(&ResultLabel { result }).inc();
    }

    /// Whether no adapter is known, configured or learned (then no
    /// worker's slots matter).
    pub fn is_empty(&self) -> bool {
        read(&self.catalogue).is_empty()
    }

    /// The path `/v1/load_lora_adapter` is given for `name`: only a
    /// configured adapter's (a learned one is never loaded by the router).
    pub(crate) fn path_of(&self, name: &str) -> Option<Box<str>> {
        read(&self.catalogue).path_of(name)
    }

    /// Every adapter a request may name, by name, with its base model.
    pub fn listed(&self) -> Vec<(String, Option<String>)> {
        read(&self.catalogue).listed()
    }

    /// How a request for `model` routes.
    pub fn resolve(&self, model: Option<&str>) -> Resolved {
        read(&self.catalogue).resolve(model)
    }

    /// Learns a worker's `/v1/models` body, read at `now_ms` (the core's
    /// [`Catalogue::learn`]); `None` when it is no model list.
    pub fn learn_models(&self, body: &[u8], now_ms: f64) -> Option<Learnt> {
        let value: serde_json::Value = serde_json::from_slice(body).ok()?;
        let cards: Vec<Card<'_>> = value["data"]
            .as_array()?
            .iter()
            .take(MAX_CARDS)
            // A `parent` that is no string makes a card neither a base
            // model nor an adapter: it is skipped.
            .filter(|c| c["parent"].is_null() || c["parent"].is_string())
            .map(|c| Card {
                id: c["id"].as_str(),
                parent: c["parent"].as_str(),
            })
            .collect();
        let mut catalogue = write(&self.catalogue);
        let learnt = catalogue.learn(&cards, now_ms);
        self.mirror_drops(&catalogue);
        Some(learnt)
    }

    /// Forgets learned adapters and base names no worker has listed
    /// lately ([`Catalogue::sweep`]): the adapters forgotten, whose
    /// holders-only marks the caller clears.
    pub fn sweep(&self, now_ms: f64) -> Vec<Box<str>> {
        let mut catalogue = write(&self.catalogue);
        let expired = catalogue.sweep(now_ms);
        self.mirror_drops(&catalogue);
        expired
    }

    /// `switchyard_adapter_dropped_total` follows the catalogue's counts.
    fn mirror_drops(&self, catalogue: &Catalogue) {
        for why in Dropped::ALL {
            let c = self.dropped.get_or_create(&ResultLabel {
                result: why.label(),
            });
            c.inc_by(catalogue.dropped(why).saturating_sub(c.get()));
        }
    }

    /// A worker's slots from its server information: `max_loras` (the
    /// sim-worker), else, when LoRA is on (`enable_lora`), SGLang's
    /// `max_loaded_loras` (adapters held at once, when limited) or
    /// `max_loras_per_batch` (SGLang 0.5.23's `/server_info`).
    pub fn slots_of(body: &[u8]) -> Option<usize> {
        let value: serde_json::Value = serde_json::from_slice(body).ok()?;
        let sglang = || {
            (value["enable_lora"] == true)
                .then(|| {
                    value["max_loaded_loras"]
                        .as_u64()
                        .or(value["max_loras_per_batch"].as_u64())
                })
                .flatten()
        };
        value["max_loras"]
            .as_u64()
            .or_else(sglang)
            .map(|n| n.min(MAX_CARDS as u64) as usize)
    }

    /// Sets the loaded-adapters gauge and mirrors the core table's drops.
    pub(crate) fn observe_table(&self, total: usize, table_dropped: u64) {
        self.loaded.set(total as i64);
        let c = self.dropped.get_or_create(&ResultLabel { result: "table" });
        c.inc_by(table_dropped.saturating_sub(c.get()));
    }

    /// A load the core planned on `worker` is under way: requests placed
    /// there for the same adapter wait for it. Called with the routing
    /// lock held, before anyone is told of the placement.
    pub(crate) fn begin(&self, worker: WorkerId, adapter: &str) {
        let key = (worker, Box::<str>::from(adapter));
        let mut senders = lock(&self.senders);
        if senders.len() >= MAX_PENDING {
            Self::count(&self.dropped, "pending");
            return;
        }
        let (tx, rx) = watch::channel(None);
        senders.insert(key.clone(), tx);
        lock(&self.pending).insert(key, rx);
    }

    pub(crate) fn finish(&self, worker: WorkerId, adapter: &str, ok: bool) {
        let key = (worker, Box::<str>::from(adapter));
        lock(&self.pending).remove(&key);
        if let Some(tx) = lock(&self.senders).remove(&key) {
            let _ = tx.send(Some(ok));
        }
    }

    pub(crate) fn waiter(
        &self,
        worker: WorkerId,
        adapter: &str,
    ) -> Option<watch::Receiver<Option<bool>>> {
        lock(&self.pending)
            .get(&(worker, Box::<str>::from(adapter)))
            .cloned()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn read<T>(m: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    m.read().unwrap_or_else(|p| p.into_inner())
}

fn write<T>(m: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    m.write().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dropped(a: &Adapters, result: &'static str) -> u64 {
        a.dropped.get_or_create(&ResultLabel { result }).get()
    }

    #[test]
    fn a_workers_model_list_feeds_the_catalogue_and_its_drops_are_exported() {
        let a = Adapters::new(&[AdapterSpec {
            name: "sql".into(),
            path: "/adapters/sql".into(),
            base_model: Some("base".into()),
        }]);
        let body = br#"{"data":[{"id":"base"},{"id":"chat","parent":"base","root":"/a/chat"},{"id":"","parent":"base"},{"parent":"base"},{"id":7,"parent":"base"}]}"#;
        let learnt = a.learn_models(body, 0.0).unwrap();
        assert_eq!(
            (learnt.loaded, learnt.new),
            (vec!["chat".into()], vec!["chat".into()])
        );
        assert_eq!(
            a.resolve(Some("chat")).eligible_model.as_deref(),
            Some("base")
        );
        assert_eq!(dropped(&a, "invalid"), 3);
        // Listed again: its bad cards are counted again.
        a.learn_models(body, 0.0).unwrap();
        assert_eq!(dropped(&a, "invalid"), 6);
        assert_eq!(a.path_of("sql").as_deref(), Some("/adapters/sql"));
        assert!(a.learn_models(b"not json", 0.0).is_none());
        assert!(a.learn_models(br#"{"data":{}}"#, 0.0).is_none());
        // Forgotten when no worker lists it, on the router's clock.
        let expired = a.sweep(switchyard_core::adapters::catalogue::LEARNED_TTL_MS);
        assert_eq!(expired, vec![Box::<str>::from("chat")]);
        assert_eq!(dropped(&a, "expired"), 1);
        assert_eq!(a.listed(), [("sql".to_owned(), Some("base".to_owned()))]);
    }

    #[test]
    fn a_card_whose_parent_is_no_string_is_neither_a_base_nor_an_adapter() {
        let a = Adapters::default();
        let odd = br#"{"data":[{"id":"base"},{"id":"odd","parent":5}]}"#;
        assert_eq!(a.learn_models(odd, 0.0).unwrap(), Learnt::default());
        // Not taken for a base name: an adapter of that name is learned.
        let listed = br#"{"data":[{"id":"base"},{"id":"odd","parent":"base"}]}"#;
        assert_eq!(a.learn_models(listed, 0.0).unwrap().new, ["odd"]);
        assert_eq!(dropped(&a, "shadow"), 0);
    }

    #[test]
    fn a_workers_slots_are_read_from_its_server_info() {
        assert_eq!(Adapters::slots_of(br#"{"max_loras": 2}"#), Some(2));
        assert_eq!(Adapters::slots_of(b"{}"), None);
    }

    #[test]
    fn sglangs_slots_are_read_only_when_its_lora_is_on() {
        // SGLang 0.5.23's /server_info (a real one, trimmed) without LoRA.
        let off = br#"{"enable_lora": null, "max_loaded_loras": null, "max_loras_per_batch": 8, "page_size": 32}"#;
        assert_eq!(Adapters::slots_of(off), None);
        let on = br#"{"enable_lora": true, "max_loaded_loras": null, "max_loras_per_batch": 8}"#;
        assert_eq!(Adapters::slots_of(on), Some(8));
        let limited = br#"{"enable_lora": true, "max_loaded_loras": 2, "max_loras_per_batch": 8}"#;
        assert_eq!(Adapters::slots_of(limited), Some(2));
    }
}
