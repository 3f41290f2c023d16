//! LoRA adapters through the router: which adapters exist, which worker
//! has which loaded, and loading one on demand.
//!
//! - **The catalogue**: adapters from the config's `[[adapters]]` tables
//!   (`name`, `path`, `base_model`), and adapters the workers list on
//!   `/v1/models` (vLLM lists each loaded adapter as a model with
//!   `"parent"`, the base model, and `"root"`, its path), learned up to
//!   [`MAX_LEARNED`] (beyond it dropped and counted). A request whose
//!   `model` names an adapter is routed among the workers serving its base
//!   model, by the core's adapter affinity
//!   ([`switchyard_core::adapters`]), and its blocks are hashed with the
//!   adapter's seed (`seed_for(Some(name), None)`, what vLLM's KV events
//!   carry as `lora_name`).
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
//!   meanwhile wait for that load ([`PendingLoads`]). A failed load is a
//!   502 naming the adapter and the worker, counted, and the core forgets
//!   the adapter there.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::{Mutex, RwLock};
use switchyard_core::adapters::MAX_ADAPTER_NAME_BYTES;
use switchyard_core::WorkerId;
use tokio::sync::watch;

/// Adapters learned from workers' `/v1/models`, at most.
pub const MAX_LEARNED: usize = 1024;
/// Adapter cards read from one `/v1/models`, at most.
pub const MAX_CARDS: usize = 1024;
/// Longest adapter path kept (bytes).
pub const MAX_PATH_BYTES: usize = 4096;
/// Loads in flight tracked at once, at most.
pub const MAX_PENDING: usize = 4096;

/// One `[[adapters]]` table.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdapterSpec {
    /// The name requests use as their `model`.
    pub name: String,
    /// What `/v1/load_lora_adapter` is given as `lora_path`.
    pub path: String,
    /// The base model it adapts (a model the workers list); `None`: any
    /// worker.
    #[serde(default)]
    pub base_model: Option<String>,
}

impl AdapterSpec {
    /// Checks lengths and emptiness.
    pub fn validate(&self) -> Result<(), String> {
        if self.name.is_empty() || self.name.len() > MAX_ADAPTER_NAME_BYTES {
            return Err(format!(
                "adapters: a name must have 1 to {MAX_ADAPTER_NAME_BYTES} bytes"
            ));
        }
        if self.path.is_empty() || self.path.len() > MAX_PATH_BYTES {
            return Err(format!(
                "adapters.{}: path must have 1 to {MAX_PATH_BYTES} bytes",
                self.name
            ));
        }
        Ok(())
    }
}

#[derive(Clone, Debug)]
struct Entry {
    path: Box<str>,
    base: Option<Box<str>>,
}

/// How a request's `model` routes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resolved {
    /// The adapter it names.
    pub adapter: Option<String>,
    /// The model whose workers may serve it (the base model of an adapter).
    pub eligible_model: Option<String>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabel {
    result: &'static str,
}

/// A load in flight: the worker and the adapter.
type LoadKey = (WorkerId, Box<str>);

/// The catalogue, loads in flight and the counters.
#[derive(Debug)]
pub struct Adapters {
    configured: HashMap<Box<str>, Entry>,
    learned: RwLock<HashMap<Box<str>, Entry>>,
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
        let configured = specs
            .iter()
            .map(|s| {
                (
                    s.name.as_str().into(),
                    Entry {
                        path: s.path.as_str().into(),
                        base: s.base_model.as_deref().map(Into::into),
                    },
                )
            })
            .collect();
        Self {
            configured,
            learned: RwLock::default(),
            pending: Mutex::default(),
            senders: Mutex::default(),
            loads: Family::default(),
            unloads: Family::default(),
            waits: Counter::default(),
            dropped: Family::default(),
            loaded: Gauge::default(),
        }
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
            "Adapters not tracked, by reason (learned: catalogue full; table: a worker's table full; pending: too many loads in flight; invalid: a bad card)",
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
        self.configured.is_empty() && read(&self.learned).is_empty()
    }

    /// The path `/v1/load_lora_adapter` is given for `name`.
    pub(crate) fn path_of(&self, name: &str) -> Option<Box<str>> {
        self.entry(name).map(|e| e.path)
    }

    fn entry(&self, name: &str) -> Option<Entry> {
        if let Some(e) = self.configured.get(name) {
            return Some(e.clone());
        }
        read(&self.learned).get(name).cloned()
    }

    /// How a request for `model` routes.
    pub fn resolve(&self, model: Option<&str>) -> Resolved {
        let Some(model) = model else {
            return Resolved::default();
        };
        match self.entry(model) {
            Some(entry) => Resolved {
                adapter: Some(model.to_owned()),
                eligible_model: entry.base.map(Into::into),
            },
            None => Resolved {
                adapter: None,
                eligible_model: Some(model.to_owned()),
            },
        }
    }

    /// Learns a worker's `/v1/models` body: its adapters' names (returned,
    /// for the core's table) and, for adapters not configured, their path
    /// and base model. Cards are clamped: bad or oversized ones dropped.
    pub fn learn_models(&self, body: &[u8]) -> Option<Vec<String>> {
        let value: serde_json::Value = serde_json::from_slice(body).ok()?;
        let cards = value["data"].as_array()?;
        let mut names = Vec::new();
        for card in cards.iter().take(MAX_CARDS) {
            let Some(parent) = card["parent"].as_str() else {
                continue;
            };
            let Some(name) = card["id"].as_str() else {
                Self::count(&self.dropped, "invalid");
                continue;
            };
            if name.is_empty() || name.len() > MAX_ADAPTER_NAME_BYTES {
                Self::count(&self.dropped, "invalid");
                continue;
            }
            names.push(name.to_owned());
            if self.configured.contains_key(name) {
                continue;
            }
            let root = card["root"].as_str().unwrap_or_default();
            if root.is_empty() || root.len() > MAX_PATH_BYTES || parent.len() > MAX_PATH_BYTES {
                continue;
            }
            let known = read(&self.learned).contains_key(name);
            if !known {
                let mut learned = self.learned.write().unwrap_or_else(|p| p.into_inner());
                if learned.len() >= MAX_LEARNED {
                    Self::count(&self.dropped, "learned");
                } else {
                    learned.insert(
                        name.into(),
                        Entry {
                            path: root.into(),
                            base: Some(parent.into()),
                        },
                    );
                }
            }
        }
        Some(names)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_naming_an_adapter_routes_among_its_base_models_workers() {
        let a = Adapters::new(&[AdapterSpec {
            name: "sql".into(),
            path: "/adapters/sql".into(),
            base_model: Some("base".into()),
        }]);
        assert_eq!(
            a.resolve(Some("sql")),
            Resolved {
                adapter: Some("sql".into()),
                eligible_model: Some("base".into())
            }
        );
        assert_eq!(a.resolve(Some("base")).adapter, None);
        assert_eq!(a.resolve(None), Resolved::default());
        // Learned from a worker's models: name, root, parent.
        let body = br#"{"data":[{"id":"base"},{"id":"chat","parent":"base","root":"/a/chat"},{"id":"","parent":"base"},{"parent":"base"}]}"#;
        assert_eq!(a.learn_models(body).unwrap(), ["chat"]);
        assert_eq!(
            a.resolve(Some("chat")).eligible_model.as_deref(),
            Some("base")
        );
        assert_eq!(
            a.dropped
                .get_or_create(&ResultLabel { result: "invalid" })
                .get(),
            2
        );
        assert_eq!(Adapters::slots_of(br#"{"max_loras": 2}"#), Some(2));
        assert_eq!(Adapters::slots_of(b"{}"), None);
        assert!(a.learn_models(b"not json").is_none());
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
