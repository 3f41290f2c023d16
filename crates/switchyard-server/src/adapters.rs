//! LoRA adapters through the router: which adapters exist, which worker
//! has which loaded, and loading one on demand.
//!
//! - **The catalogue**: adapters from the config's `[[adapters]]` tables
//!   (`name`, `path`, `base_model`), and adapters the workers list on
//!   `/v1/models` (vLLM lists each loaded adapter as a model with
//!   `"parent"`, the base model, and `"root"`, its path), learned up to
//!   [`MAX_LEARNED`] (beyond it dropped and counted) when consistent with
//!   the fleet: its parent a configured model (or, without `[[models]]`
//!   tables, a base model on the same list), its own name no base model's
//!   (a card never shadows a base model). A learned adapter is forgotten
//!   [`LEARNED_TTL`] after the last worker listed it, and is served only
//!   where it is loaded: the router loads on demand only adapters whose
//!   path an operator configured. A request whose
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
use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, RwLock};
use std::time::{Duration, Instant};
use switchyard_core::adapters::MAX_ADAPTER_NAME_BYTES;
use switchyard_core::WorkerId;
use tokio::sync::watch;

/// Adapters learned from workers' `/v1/models`, at most.
pub(crate) const MAX_LEARNED: usize = 1024;
/// Adapter cards read from one `/v1/models`, at most.
pub(crate) const MAX_CARDS: usize = 1024;
/// Longest adapter path kept (bytes).
pub(crate) const MAX_PATH_BYTES: usize = 4096;
/// How long a learned adapter (or a base model name) stays known after
/// the last worker listed it: a few health rounds.
pub(crate) const LEARNED_TTL: Duration = Duration::from_secs(60);
/// Loads in flight tracked at once, at most.
pub(crate) const MAX_PENDING: usize = 4096;

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

/// An adapter learned from workers' `/v1/models`.
#[derive(Clone, Debug)]
struct Learned {
    /// Its base model, as the first worker that listed it said.
    base: Box<str>,
    /// When a worker last listed it.
    seen: Instant,
}

/// What one worker's `/v1/models` taught ([`Adapters::learn_models`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Learnt {
    /// The catalogue's adapters the worker has loaded.
    pub loaded: Vec<String>,
    /// Adapters learned from it for the first time.
    pub new: Vec<String>,
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
    /// The `[[models]]` tables' names: the base models, when configured.
    base_models: HashSet<Box<str>>,
    learned: RwLock<HashMap<Box<str>, Learned>>,
    /// Base model names workers list, and when last listed.
    bases: RwLock<HashMap<Box<str>, Instant>>,
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
            base_models: HashSet::new(),
            learned: RwLock::default(),
            bases: RwLock::default(),
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
        self.base_models = names.into_iter().map(Into::into).collect();
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
        self.configured.is_empty() && read(&self.learned).is_empty()
    }

    /// The path `/v1/load_lora_adapter` is given for `name`: only a
    /// configured adapter's (a learned one is never loaded by the router).
    pub(crate) fn path_of(&self, name: &str) -> Option<Box<str>> {
        self.configured.get(name).map(|e| e.path.clone())
    }

    /// The base model of adapter `name` (`Some(None)`: a configured
    /// adapter of any model); `None`: not an adapter.
    fn base_of(&self, name: &str) -> Option<Option<Box<str>>> {
        if let Some(e) = self.configured.get(name) {
            return Some(e.base.clone());
        }
        read(&self.learned).get(name).map(|l| Some(l.base.clone()))
    }

    /// Every adapter a request may name, by name: the configured ones and
    /// those learned, each with its base model when it has one.
    pub fn listed(&self) -> Vec<(String, Option<String>)> {
        let mut out: Vec<(String, Option<String>)> = self
            .configured
            .iter()
            .map(|(name, e)| (name.to_string(), e.base.as_deref().map(str::to_owned)))
            .collect();
        out.extend(
            read(&self.learned)
                .iter()
                .filter(|(name, _)| !self.configured.contains_key(&**name))
                .map(|(name, l)| (name.to_string(), Some(l.base.to_string()))),
        );
        out.sort();
        out
    }

    /// How a request for `model` routes.
    pub fn resolve(&self, model: Option<&str>) -> Resolved {
        let Some(model) = model else {
            return Resolved::default();
        };
        match self.base_of(model) {
            Some(base) => Resolved {
                adapter: Some(model.to_owned()),
                eligible_model: base.map(Into::into),
            },
            None => Resolved {
                adapter: None,
                eligible_model: Some(model.to_owned()),
            },
        }
    }

    /// Learns a worker's `/v1/models` body (read at `now`): the adapters
    /// it has loaded, for the core's table, and the adapters learned from
    /// it for the first time. A card with a `parent` is an adapter when it
    /// is configured, or else when it is consistent with the fleet: its
    /// parent is a configured model (`[[models]]`), or without such tables
    /// a base model on the same list; and it shadows no base model (its id
    /// is no configured model and no base any worker lists). Anything
    /// else is dropped and counted. A learned adapter is served only where
    /// it is loaded: the router never loads it elsewhere, as no operator
    /// gave its path.
    pub fn learn_models(&self, body: &[u8], now: Instant) -> Option<Learnt> {
        let value: serde_json::Value = serde_json::from_slice(body).ok()?;
        let cards = value["data"].as_array()?;
        let cards = &cards[..cards.len().min(MAX_CARDS)];
        // This worker's base models: cards without a parent.
        let own_bases: Vec<&str> = cards
            .iter()
            .filter(|c| c["parent"].is_null())
            .filter_map(|c| c["id"].as_str())
            .filter(|id| !id.is_empty() && id.len() <= MAX_ADAPTER_NAME_BYTES)
            .collect();
        self.saw_bases(&own_bases, now);
        let mut learnt = Learnt::default();
        for card in cards {
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
            if self.configured.contains_key(name) {
                learnt.loaded.push(name.to_owned());
                continue;
            }
            if self.is_base(name) {
                Self::count(&self.dropped, "shadow");
                continue;
            }
            let consistent = match self.base_models.is_empty() {
                true => own_bases.contains(&parent),
                false => self.base_models.contains(parent),
            };
            if !consistent {
                Self::count(&self.dropped, "unknown_base");
                continue;
            }
            let mut learned = self.learned.write().unwrap_or_else(|p| p.into_inner());
            let full = learned.len() >= MAX_LEARNED;
            match learned.get_mut(name) {
                // First writer's base; every announcement keeps it alive.
                Some(known) => known.seen = now,
                None if full => {
                    Self::count(&self.dropped, "learned");
                    continue;
                }
                None => {
                    learned.insert(
                        name.into(),
                        Learned {
                            base: parent.into(),
                            seen: now,
                        },
                    );
                    learnt.new.push(name.to_owned());
                }
            }
            learnt.loaded.push(name.to_owned());
        }
        Some(learnt)
    }

    /// Records base model names a worker lists; a learned adapter of the
    /// same name is forgotten (a base model is never shadowed).
    fn saw_bases(&self, names: &[&str], now: Instant) {
        let mut bases = self.bases.write().unwrap_or_else(|p| p.into_inner());
        for &name in names {
            let full = bases.len() >= MAX_LEARNED;
            match bases.get_mut(name) {
                Some(seen) => *seen = now,
                None if full => {
                    Self::count(&self.dropped, "base");
                }
                None => {
                    bases.insert(name.into(), now);
                }
            }
        }
        drop(bases);
        let mut learned = self.learned.write().unwrap_or_else(|p| p.into_inner());
        for &name in names {
            if learned.remove(name).is_some() {
                Self::count(&self.dropped, "shadow");
            }
        }
    }

    /// Whether `name` is a base model: configured, or listed by a worker.
    fn is_base(&self, name: &str) -> bool {
        self.base_models.contains(name) || read(&self.bases).contains_key(name)
    }

    /// Forgets learned adapters and base names no worker has listed for
    /// [`LEARNED_TTL`] at `now`: the adapters forgotten (counted
    /// `expired`), whose holders-only marks the caller clears.
    pub fn sweep(&self, now: Instant) -> Vec<Box<str>> {
        let fresh = |seen: &Instant| now.saturating_duration_since(*seen) < LEARNED_TTL;
        self.bases
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|_, seen| fresh(seen));
        let mut learned = self.learned.write().unwrap_or_else(|p| p.into_inner());
        let expired: Vec<Box<str>> = learned
            .iter()
            .filter(|(_, l)| !fresh(&l.seen))
            .map(|(name, _)| name.clone())
            .collect();
        for name in &expired {
            learned.remove(name);
            Self::count(&self.dropped, "expired");
        }
        expired
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
        // Learned from a worker's models: name and parent.
        let now = Instant::now();
        let body = br#"{"data":[{"id":"base"},{"id":"chat","parent":"base","root":"/a/chat"},{"id":"","parent":"base"},{"parent":"base"}]}"#;
        let learnt = a.learn_models(body, now).unwrap();
        assert_eq!(
            (learnt.loaded, learnt.new),
            (vec!["chat".into()], vec!["chat".into()])
        );
        assert_eq!(
            a.resolve(Some("chat")).eligible_model.as_deref(),
            Some("base")
        );
        assert_eq!(dropped(&a, "invalid"), 2);
        // Known now: listed again, it is loaded there, not new.
        let learnt = a.learn_models(body, now).unwrap();
        assert_eq!((learnt.loaded, learnt.new), (vec!["chat".into()], vec![]));
        assert_eq!(
            a.listed(),
            [
                ("chat".to_owned(), Some("base".to_owned())),
                ("sql".to_owned(), Some("base".to_owned()))
            ]
        );
        // Only a configured adapter has a path the router loads.
        assert_eq!(a.path_of("sql").as_deref(), Some("/adapters/sql"));
        assert_eq!(a.path_of("chat"), None);
        assert_eq!(Adapters::slots_of(br#"{"max_loras": 2}"#), Some(2));
        assert_eq!(Adapters::slots_of(b"{}"), None);
        assert!(a.learn_models(b"not json", now).is_none());
    }

    fn dropped(a: &Adapters, result: &'static str) -> u64 {
        a.dropped.get_or_create(&ResultLabel { result }).get()
    }

    #[test]
    fn a_card_that_would_shadow_a_base_model_or_name_no_base_is_not_learned() {
        let now = Instant::now();
        let a = Adapters::default();
        // Worker 1 serves "base"; worker 2 announces an "adapter" named
        // "base" (of its own "other"): requests for "base" must not follow it.
        a.learn_models(br#"{"data":[{"id":"base"}]}"#, now).unwrap();
        let poison = br#"{"data":[{"id":"other"},{"id":"base","parent":"other","root":"/evil"}]}"#;
        assert_eq!(a.learn_models(poison, now).unwrap(), Learnt::default());
        assert_eq!(a.resolve(Some("base")).adapter, None);
        assert_eq!(dropped(&a, "shadow"), 1);
        // Nor a card whose parent the worker does not serve.
        let orphan = br#"{"data":[{"id":"other"},{"id":"x","parent":"elsewhere"}]}"#;
        assert_eq!(a.learn_models(orphan, now).unwrap(), Learnt::default());
        assert_eq!(dropped(&a, "unknown_base"), 1);
        // A learned adapter whose name a worker later lists as a base
        // model is forgotten: the base wins.
        a.learn_models(
            br#"{"data":[{"id":"base"},{"id":"sql","parent":"base"}]}"#,
            now,
        )
        .unwrap();
        assert!(a.resolve(Some("sql")).adapter.is_some());
        a.learn_models(br#"{"data":[{"id":"sql"}]}"#, now).unwrap();
        assert_eq!(a.resolve(Some("sql")).adapter, None);
        assert_eq!(dropped(&a, "shadow"), 2);

        // With [[models]] tables, a parent must be one of them.
        let a = Adapters::default().with_base_models(["qwen"]);
        let body = br#"{"data":[{"id":"llama"},{"id":"a","parent":"llama"},{"id":"b","parent":"qwen"},{"id":"qwen","parent":"llama"}]}"#;
        assert_eq!(a.learn_models(body, now).unwrap().loaded, ["b"]);
        assert_eq!(dropped(&a, "unknown_base"), 1);
        assert_eq!(dropped(&a, "shadow"), 1);
    }

    #[test]
    fn what_no_worker_lists_any_more_is_forgotten() {
        let start = Instant::now();
        let a = Adapters::default();
        let body = br#"{"data":[{"id":"base"},{"id":"chat","parent":"base"}]}"#;
        a.learn_models(body, start).unwrap();
        // Listed again within the expiry: kept.
        let later = start + LEARNED_TTL / 2;
        a.learn_models(body, later).unwrap();
        assert!(a.sweep(start + LEARNED_TTL).is_empty());
        assert!(a.resolve(Some("chat")).adapter.is_some());
        // Then never again.
        let expired = a.sweep(later + LEARNED_TTL);
        assert_eq!(expired, vec![Box::<str>::from("chat")]);
        assert_eq!(a.resolve(Some("chat")).adapter, None);
        assert!(a.is_empty());
        assert_eq!(dropped(&a, "expired"), 1);
        assert!(!a.is_base("base"), "base names expire too");
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
