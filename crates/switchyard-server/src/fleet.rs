//! The fleet: adding and removing workers, KV-event subscribers, health
//! checks and model lists.
//!
//! A worker enters selection after its first good `GET /health` (its
//! `/v1/models` and its KV capacity are read then: `/get_server_info`, or
//! for vLLM, which serves none, `vllm:cache_config_info` on `/metrics`),
//! leaves it after `health_failures` consecutive bad checks (declared
//! dead), and is put back when checks pass
//! again — a worker restarted on the same URL included. Leaving selection
//! drops its index and active-sequence entries (`Router::remove_worker`)
//! and stops its KV-event subscriber; entering starts a fresh one, whose
//! first contact clears the worker's entries and rebuilds them (from the
//! replay socket when there is one). Events a stopped subscriber still
//! delivers are dropped by epoch ([`WorkerEventSink`]). Request failures
//! (refused, reset, 5xx, timeout, broken stream) feed the passive circuit
//! breakers instead (the core's dispatcher keeps one per worker). A draining worker takes no new
//! requests and is removed once this replica has none in flight on it
//! (peers' bookings, with replica sync on, do not hold it back: they end on
//! the peers). Each worker's `max_model_len` (vLLM's and the sim-worker's
//! model cards carry one) is kept too: the largest is the default prompt
//! token limit ([`Fleet::max_model_len`]).

use super::config::WorkerSpec;
use crate::driver::Driver;
use crate::upstream::UpstreamClient;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::header::HeaderValue;
use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use switchyard_core::index::{CacheTier, IndexEvent};
use switchyard_core::router::WorkerCapacity;
use switchyard_core::WorkerId;
use switchyard_kv_events::metrics::KvEventMetrics;
use switchyard_kv_events::subscriber::{IndexSink, KvEventSubscriber, SubscriberConfig};
use switchyard_wire::engine_metrics::{
    kv_usage_fraction, vllm_lora_slots, KvCapacity, ServerInfoCache,
};
use switchyard_wire::prometheus::Scrape;

/// Adds, removes and watches workers.
pub struct Fleet {
    driver: Arc<Driver>,
    client: UpstreamClient,
    zmq: zmq::Context,
    subscribers: Mutex<HashMap<WorkerId, KvEventSubscriber>>,
    /// Subscriber settings of workers with KV events (and the worker's
    /// name, their metrics' `worker` label), started while the worker is
    /// in the router.
    event_configs: Mutex<HashMap<WorkerId, (String, SubscriberConfig)>>,
    /// KV-event counters, labelled by worker name.
    pub kv_metrics: KvEventMetrics,
    uses_events: bool,
    /// The router's block size.
    block_size: u32,
    /// The block size of each `[[models]]` table that names one: a worker
    /// serving the model runs at it (unless its spec says `block-size=`).
    model_block_sizes: rustc_hash::FxHashMap<String, u32>,
    /// The block sizes workers' specs declare (`block-size=N`).
    declared_block_sizes: Mutex<HashMap<WorkerId, u32>>,
    health_failures: u32,
    health_timeout: Duration,
    /// `Authorization` for health checks and probes (`--worker-api-key`).
    worker_auth: Option<HeaderValue>,
    /// Each worker's `max_model_len`, for those that report one.
    model_lens: Mutex<HashMap<WorkerId, u64>>,
    /// The largest of `model_lens` (0: none), read per request.
    max_model_len: AtomicU64,
    /// Whether workers may have roles (`--disagg`).
    disagg: bool,
    /// Workers that serve no `/get_server_info` (vLLM) and whose LoRA
    /// slots are not known yet: read from their `/metrics` each round
    /// (a subset of the workers).
    slots_from_metrics: Mutex<HashSet<WorkerId>>,
    /// The models whose tokenizers each entering worker's engine is
    /// asked to confirm ([`Self::check_tokenizers`]); set once the
    /// handlers' state exists.
    models: std::sync::OnceLock<Arc<crate::models::Models>>,
}

impl std::fmt::Debug for Fleet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Fleet").finish_non_exhaustive()
    }
}

impl Fleet {
    /// A fleet with no workers yet.
    pub fn new(
        driver: Arc<Driver>,
        client: UpstreamClient,
        uses_events: bool,
        block_size: u32,
        health_failures: u32,
        health_timeout: Duration,
    ) -> Self {
        Self {
            driver,
            client,
            zmq: zmq::Context::new(),
            subscribers: Mutex::new(HashMap::new()),
            event_configs: Mutex::new(HashMap::new()),
            kv_metrics: KvEventMetrics::new(),
            uses_events,
            block_size,
            model_block_sizes: Default::default(),
            declared_block_sizes: Mutex::new(HashMap::new()),
            health_failures,
            health_timeout,
            worker_auth: None,
            model_lens: Mutex::new(HashMap::new()),
            max_model_len: AtomicU64::new(0),
            disagg: false,
            slots_from_metrics: Mutex::new(HashSet::new()),
            models: std::sync::OnceLock::new(),
        }
    }

    /// The same fleet, sending `auth` as `Authorization` on its health
    /// checks and probes.
    pub fn with_worker_auth(mut self, auth: Option<HeaderValue>) -> Self {
        self.worker_auth = auth;
        self
    }

    /// The same fleet, knowing the `[[models]]` tables' block sizes: a
    /// worker whose `/v1/models` names such a model runs at its block size.
    pub fn with_models(mut self, models: &[crate::models::ModelSpec]) -> Self {
        self.model_block_sizes = crate::models::block_sizes(models);
        self
    }

    /// A worker's block size: its spec's, else that of the first model it
    /// serves with a `[[models]]` block size, else the router's.
    fn block_size_of(&self, id: WorkerId, models: &[String]) -> u32 {
        if let Some(&declared) = lock(&self.declared_block_sizes).get(&id) {
            return declared;
        }
        crate::models::worker_block_size(&self.model_block_sizes, models).unwrap_or(self.block_size)
    }

    /// From now on, each worker that enters selection is asked whether its
    /// engine tokenizes as `models` do ([`Self::check_tokenizers`]).
    pub fn check_tokenizers_of(&self, models: Arc<crate::models::Models>) {
        let _ = self.models.set(models);
    }

    /// Asks the engine at `url`, for each model it serves (`served`, the
    /// first [`MAX_TOKENIZER_CHECKS`] whose tokenizer still wants a
    /// check), to tokenize [`crate::models::TOKENIZER_PROBE`] (vLLM's
    /// `POST /tokenize`); an engine that answers with other ids than the
    /// router's marks the model's ids as not the engine's, one that
    /// answers with the same marks them agreed. A worker without
    /// `/tokenize` changes nothing.
    async fn check_tokenizers(&self, name: &str, url: &str, served: &[String]) {
        let Some(models) = self.models.get() else {
            return;
        };
        // By entry (one label each): models without a table share one.
        let mut checked: Vec<Arc<str>> = Vec::new();
        for model in served {
            if checked.len() >= MAX_TOKENIZER_CHECKS {
                break;
            }
            let routing = models.get(Some(model));
            if checked.contains(&routing.label) || !routing.wants_engine_check() {
                continue;
            }
            checked.push(routing.label.clone());
            let Some(tokenizer) = &routing.tokenizer else {
                continue;
            };
            let Ok(ours) = tokenizer.encode(crate::models::TOKENIZER_PROBE) else {
                continue;
            };
            let probe = serde_json::json!({
                "model": model,
                "prompt": crate::models::TOKENIZER_PROBE,
                "add_special_tokens": false,
            });
            let Some(body) = self.post_json(url, "/tokenize", &probe).await else {
                tracing::debug!(worker = %name, model = %model, "no /tokenize: the model's tokenizer is not checked against this engine");
                continue;
            };
            #[derive(serde::Deserialize)]
            struct Tokenized {
                tokens: Vec<u32>,
            }
            let Ok(theirs) = serde_json::from_slice::<Tokenized>(&body) else {
                tracing::warn!(worker = %name, model = %model, "the worker's /tokenize answer has no token ids: the model's tokenizer is not checked against this engine");
                continue;
            };
            let agrees = theirs.tokens == ours;
            let before = routing.engine_checked(agrees);
            if !agrees && before != crate::models::IdsTrust::Disagrees {
                tracing::warn!(worker = %name, model = %model, ours = ours.len(), theirs = theirs.tokens.len(), "the worker's engine tokenizes differently from the router: the model's prefix hashes will not match its KV events, and its streams are not resumed on another worker (give the model's tokenizer in a [[models]] table)");
            } else if agrees && before == crate::models::IdsTrust::Unchecked {
                tracing::info!(worker = %name, model = %model, "the worker's engine tokenizes as the router does");
            }
        }
    }

    /// Lets workers have roles (`serve --disagg`); without it a worker
    /// with role `prefill` or `decode` is refused.
    pub fn with_disagg(mut self, disagg: bool) -> Self {
        self.disagg = disagg;
        self
    }

    /// The largest `max_model_len` the registered workers reported on
    /// `/v1/models` (None when none reports one): the prompt token limit
    /// when none is configured. The largest, not the smallest: a prompt
    /// longer than every worker's context fits nowhere, while one that fits
    /// some worker of a mixed fleet is that worker's to judge.
    pub fn max_model_len(&self) -> Option<u64> {
        Some(self.max_model_len.load(Ordering::Relaxed)).filter(|&n| n > 0)
    }

    /// The `max_model_len` worker `id` reported, if any.
    pub fn model_len_of(&self, id: WorkerId) -> Option<u64> {
        lock(&self.model_lens).get(&id).copied()
    }

    fn set_model_len(&self, id: WorkerId, len: Option<u64>) {
        let mut lens = lock(&self.model_lens);
        match len {
            Some(len) => lens.insert(id, len),
            None => lens.remove(&id),
        };
        let largest = lens.values().copied().max().unwrap_or(0);
        self.max_model_len.store(largest, Ordering::Relaxed);
    }

    /// Registers a worker; it enters selection (and its KV-event
    /// subscriber starts) at its first good health check.
    pub fn add(&self, spec: &WorkerSpec) -> Result<WorkerId, String> {
        spec.validate().map_err(|e| e.to_string())?;
        if let Some(b) = spec.block_size {
            if b != self.block_size && !self.model_block_sizes.values().any(|&m| m == b) {
                return Err(format!(
                    "block-size {b} differs from the router's {} and from every [[models]] table's",
                    self.block_size
                ));
            }
        }
        let name = spec.display_name();
        if spec.role != crate::roster::Role::Both && !self.disagg {
            return Err(format!(
                "role={} needs a router started with --disagg vllm|sglang",
                spec.role.label()
            ));
        }
        let ranks = spec.ranks();
        if ranks > 1 {
            return self.add_ranks(spec, &name, ranks);
        }
        let id = self.driver.add_worker(&name, &spec.url)?;
        self.register(spec, id, &name, spec.events.clone(), spec.replay.clone());
        tracing::info!(worker = %name, url = %spec.url, events = spec.events.is_some(), "worker added");
        Ok(id)
    }

    /// What follows a target's registration: its role, declared block
    /// size and KV-event stream.
    fn register(
        &self,
        spec: &WorkerSpec,
        id: WorkerId,
        name: &str,
        events: Option<String>,
        replay: Option<String>,
    ) {
        self.driver.set_role(id, spec.role, spec.bootstrap_port);
        if let Some(b) = spec.block_size {
            lock(&self.declared_block_sizes).insert(id, b);
        }
        if let (Some(events), true) = (events, self.uses_events) {
            let mut config = SubscriberConfig::new(id, events, self.block_size);
            config.replay_endpoint = replay;
            config.dp_size = spec.ranks();
            lock(&self.event_configs).insert(id, (name.to_owned(), config));
        }
    }

    /// Registers each data-parallel rank of a worker as a target of its
    /// own: `NAME/r`, id the worker's with rank `r`, its requests naming
    /// the rank, its events read from the `events=` port plus `r`. All or
    /// none: a rank refused takes the ones before it out again.
    fn add_ranks(&self, spec: &WorkerSpec, name: &str, ranks: u32) -> Result<WorkerId, String> {
        let base = switchyard_replica::worker_id_for_name(name).worker_id;
        let mut added = Vec::with_capacity(ranks as usize);
        for rank in 0..ranks {
            let rank_name = format!("{name}/{rank}");
            let id = WorkerId::with_rank(base, rank);
            if let Err(e) = self.driver.add_worker_rank(&rank_name, &spec.url, id, rank) {
                for id in added {
                    self.drop_worker(id);
                }
                return Err(e);
            }
            // The spec was validated: every rank's port fits.
            let at = |endpoint: &Option<String>| {
                endpoint
                    .as_deref()
                    .and_then(|e| crate::config::rank_endpoint(e, rank))
            };
            self.register(spec, id, &rank_name, at(&spec.events), at(&spec.replay));
            added.push(id);
        }
        tracing::info!(worker = %name, url = %spec.url, ranks, events = spec.events.is_some(), "worker added with its data-parallel ranks");
        Ok(WorkerId::with_rank(base, 0))
    }

    /// Registers a worker ([`Fleet::add`]) and starts a round of health
    /// checks at once ([`Fleet::check_soon`]), so it enters selection
    /// without waiting for the next interval: how the admin API adds a
    /// worker (discovery adds a batch, then checks once).
    pub fn join(self: &Arc<Self>, spec: &WorkerSpec) -> Result<WorkerId, String> {
        let id = self.add(spec)?;
        self.check_soon();
        Ok(id)
    }

    /// Starts a round of health checks now, beside the periodic ones: new
    /// workers enter selection at their first good check. A batch of adds
    /// ([`Fleet::add`] each) is followed by one call.
    pub fn check_soon(self: &Arc<Self>) {
        let fleet = self.clone();
        tokio::spawn(async move { fleet.check_all().await });
    }

    /// Every registered worker, sorted by name.
    pub fn workers(&self) -> Vec<super::roster::WorkerInfo> {
        self.driver.workers()
    }

    /// Puts a worker into the router and starts a fresh KV-event
    /// subscriber for this entry, reading its events at `block_size`.
    fn enter(&self, id: WorkerId, block_size: u32) {
        self.driver.set_in_router(id, true);
        let Some(epoch) = self.driver.events_epoch(id) else {
            return;
        };
        let Some((name, mut config)) = lock(&self.event_configs).get(&id).cloned() else {
            return;
        };
        config.block_size = block_size;
        let sink: Arc<dyn IndexSink> = Arc::new(WorkerEventSink {
            driver: self.driver.clone(),
            worker: id,
            epoch,
        });
        match KvEventSubscriber::spawn(&self.zmq, config, sink, self.kv_metrics.worker(&name)) {
            Ok(sub) => {
                if let Some(old) = lock(&self.subscribers).insert(id, sub) {
                    stop_off_thread(old);
                }
            }
            Err(e) => {
                tracing::error!(worker = %id, error = %e, "cannot start the KV-event subscriber: out of selection");
                self.driver.set_in_router(id, false);
            }
        }
    }

    /// Takes a worker out of the router (index and bookings dropped) and
    /// stops its subscriber.
    fn leave(&self, id: WorkerId) {
        self.driver.set_in_router(id, false);
        if let Some(sub) = lock(&self.subscribers).remove(&id) {
            stop_off_thread(sub);
        }
    }

    /// Removes a worker now, or drains it first.
    /// A worker declared with `dp-size` is removed by its name, all its
    /// ranks (`NAME/r`) with it, or one rank by the rank's name.
    pub fn remove(&self, name: &str, drain: bool) -> bool {
        let targets: Vec<_> = self
            .driver
            .workers()
            .into_iter()
            .filter(|w| is_target_of(&w.name, name))
            .collect();
        for info in &targets {
            if drain && self.driver.local_requests(info.id) > 0 {
                self.driver.set_draining(info.id);
                tracing::info!(worker = %info.name, "worker draining");
            } else {
                self.drop_worker(info.id);
            }
        }
        !targets.is_empty()
    }

    fn drop_worker(&self, id: WorkerId) {
        self.leave(id);
        lock(&self.event_configs).remove(&id);
        lock(&self.declared_block_sizes).remove(&id);
        self.set_model_len(id, None);
        lock(&self.slots_from_metrics).remove(&id);
        let removed = self.driver.remove_worker(id);
        if let Some(info) = removed {
            tracing::info!(worker = %info.name, "worker removed");
        }
    }

    /// One round of health checks over every worker. The requests go out
    /// concurrently ([`MAX_CONCURRENT_CHECKS`] workers at once, each
    /// request within the health timeout), so one slow worker delays no
    /// other's check; workers then enter selection in the roster's order,
    /// whatever order their answers came in, and the per-round reads
    /// follow.
    pub async fn check_all(&self) {
        // Futures gathered in loops, not iterator adaptors: closures there
        // would make this future's type too general to spawn.
        let workers = self.driver.workers();
        let mut checks = Vec::with_capacity(workers.len());
        for info in &workers {
            checks.push(self.check_one(info));
        }
        let checked = bounded_concurrently(checks).await;
        let mut follow_ups = Vec::with_capacity(workers.len());
        for (info, entry) in workers.iter().zip(checked) {
            let Some(entering) = entry else {
                continue;
            };
            if let Some(block_size) = entering {
                self.enter(info.id, block_size);
                tracing::info!(worker = %info.name, "worker healthy: in selection");
            }
            follow_ups.push(self.follow_up(info));
        }
        bounded_concurrently(follow_ups).await;
        self.sweep_adapters();
    }

    /// One worker's health check and what follows from it: `None` when it
    /// is not healthy (it leaves selection once it has failed enough
    /// checks) or is draining (dropped once idle); `Some(Some(block
    /// size))` when it is healthy and out of selection, with what the
    /// router reads of it read (it enters in [`Self::check_all`]);
    /// `Some(None)` when it is healthy and in selection.
    async fn check_one(&self, info: &crate::roster::WorkerInfo) -> Option<Option<u32>> {
        let ok = self.get(&info.url, "/health").await.is_some();
        if info.draining {
            if self.driver.local_requests(info.id) == 0 {
                self.drop_worker(info.id);
            }
            return None;
        }
        let keep = self
            .driver
            .health_result(info.id, ok, self.health_failures)
            .unwrap_or(false);
        if ok && !info.in_router {
            let mut served = Vec::new();
            if let Some((models, max_model_len)) = self.models_of(&info.url).await {
                served.clone_from(&models);
                self.driver.set_models(info.id, models);
                self.set_model_len(info.id, max_model_len);
            }
            // Its bookings are counted, and its events read, in its
            // model's blocks.
            let block_size = self.block_size_of(info.id, &served);
            let own = (block_size != self.block_size).then_some(block_size);
            let server_info = self.server_info(&info.url).await;
            if let Some(ranks) = server_info.as_deref().and_then(reported_dp_size) {
                if ranks > 1 && info.endpoint.dp_rank.is_none() {
                    tracing::warn!(worker = %info.name, ranks, "the worker reports data-parallel ranks (dp_size) but was declared without dp-size: the router sees one target where there are that many caches; declare dp-size to route each rank");
                }
            }
            match self.capacity_of(info, server_info.as_deref()).await {
                Some(capacity) => self.driver.set_capacity(
                    info.id,
                    WorkerCapacity {
                        block_size: own,
                        ..capacity
                    },
                ),
                None if own.is_some() => self.driver.set_capacity(
                    info.id,
                    WorkerCapacity {
                        block_size: own,
                        ..WorkerCapacity::default()
                    },
                ),
                None => {}
            }
            // LoRA slots, when the worker reports them; vLLM's come
            // later, from its /metrics.
            match &server_info {
                Some(body) => {
                    let slots = crate::adapters::Adapters::slots_of(body);
                    self.driver.adapter_slots(info.id, slots);
                }
                None => {
                    lock(&self.slots_from_metrics).insert(info.id);
                }
            }
            self.check_tokenizers(&info.name, &info.url, &served).await;
            return Some(Some(block_size));
        } else if !keep && info.in_router {
            self.leave(info.id);
            tracing::warn!(worker = %info.name, "worker failed its health checks: declared dead, out of the router");
        }
        ok.then_some(None)
    }

    /// What the router reads of a healthy worker every round: its loaded
    /// LoRA adapters, and from its `/metrics` its KV usage and (vLLM) its
    /// adapter slots, when wanted.
    async fn follow_up(&self, info: &crate::roster::WorkerInfo) {
        if let Some(body) = self.get(&info.url, "/v1/models").await {
            let now = self.driver.now_ms();
            if let Some(learnt) = self.driver.adapters.learn_models(&body, now) {
                for name in &learnt.new {
                    self.driver.adapter_holders_only(name, true);
                }
                self.driver.adapter_report(info.id, &learnt.loaded);
            }
        }
        let wants_usage = self.driver.wants_kv_usage();
        let wants_slots =
            !self.driver.adapters.is_empty() && lock(&self.slots_from_metrics).contains(&info.id);
        if wants_usage || wants_slots {
            if let Some(body) = self.get(&info.url, "/metrics").await {
                let scrape = Scrape::parse_bytes(&body);
                if wants_usage {
                    if let Some(fraction) = kv_usage_fraction(&scrape) {
                        self.driver.set_kv_usage(info.id, fraction);
                    }
                }
                if wants_slots {
                    if let Some(slots) = vllm_lora_slots(&scrape) {
                        self.driver.adapter_slots(info.id, Some(slots));
                        lock(&self.slots_from_metrics).remove(&info.id);
                    }
                }
            }
        }
    }

    /// Learned adapters no worker lists any more are forgotten.
    fn sweep_adapters(&self) {
        for name in self.driver.adapters.sweep(self.driver.now_ms()) {
            self.driver.adapter_holders_only(&name, false);
        }
    }

    /// Health checks forever, every `interval`.
    pub async fn run_health_checks(self: Arc<Self>, interval: Duration) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            self.check_all().await;
        }
    }

    /// The base model names on a worker's `/v1/models` (cards without a
    /// `parent`: an adapter's card is the adapter catalogue's to judge,
    /// [`crate::adapters`]) and the smallest `max_model_len` of its model
    /// cards (None when none has one).
    async fn models_of(&self, url: &str) -> Option<(Vec<String>, Option<u64>)> {
        let body = self.get(url, "/v1/models").await?;
        let value: serde_json::Value = serde_json::from_slice(&body).ok()?;
        let cards = value["data"].as_array()?;
        let models = cards
            .iter()
            .filter(|m| m["parent"].is_null())
            .filter_map(|m| m["id"].as_str().map(str::to_owned))
            .take(256)
            .collect();
        let max_model_len = cards
            .iter()
            .filter_map(|m| m["max_model_len"].as_u64())
            .filter(|&n| n > 0)
            .min();
        Some((models, max_model_len))
    }

    /// The engine's server information: `/server_info` (SGLang; since
    /// 0.5.23 its `/get_server_info` is deprecated and logs a warning at
    /// every call), else `/get_server_info` (older SGLang, the
    /// sim-worker); `None` from a worker that serves neither (vLLM).
    async fn server_info(&self, url: &str) -> Option<Bytes> {
        match self.get(url, "/server_info").await {
            Some(body) => Some(body),
            None => self.get(url, "/get_server_info").await,
        }
    }

    /// Capacity from the server information `server_info` (SGLang's and
    /// the sim-worker's field names), else, for a worker that serves none
    /// (vLLM), the KV blocks and block size of `vllm:cache_config_info` on
    /// its `/metrics` (one engine's for a data-parallel rank); unknown parts
    /// stay unknown and never make it busy. The sim-worker reports one
    /// rank's cache in its server information.
    async fn capacity_of(
        &self,
        info: &crate::roster::WorkerInfo,
        server_info: Option<&[u8]>,
    ) -> Option<WorkerCapacity> {
        let Some(body) = server_info else {
            let body = self.get(&info.url, "/metrics").await?;
            let mut kv = KvCapacity::from_vllm(&Scrape::parse_bytes(&body))?;
            // vLLM's page has a cache per data-parallel engine: a rank
            // routed as a target of its own holds one of them.
            if info.endpoint.dp_rank.is_some() {
                kv = kv.per_engine();
            } else if kv.engines > 1 {
                tracing::warn!(worker = %info.name, ranks = kv.engines, "the worker's /metrics reports data-parallel engines but it was declared without dp-size: the router sees one target where there are that many caches; declare dp-size to route each rank");
            }
            return Some(WorkerCapacity {
                max_num_batched_tokens: None,
                kv_blocks: Some(kv.blocks),
                kv_tokens: kv.tokens(),
                block_size: None,
            });
        };
        let v: serde_json::Value = serde_json::from_slice(body).ok()?;
        // SGLang reports its KV capacity in tokens; otherwise blocks times
        // the engine's page (block) size, when it names one.
        let cache = ServerInfoCache::read(&v);
        Some(WorkerCapacity {
            max_num_batched_tokens: v["max_num_batched_tokens"].as_u64(),
            kv_blocks: cache.blocks,
            kv_tokens: cache.tokens(),
            block_size: None,
        })
    }

    /// GET `url` + `path`; the body when the status is 2xx within the timeout.
    async fn get(&self, url: &str, path: &str) -> Option<Bytes> {
        self.fetch(hyper::Request::get(format!("{url}{path}")), Bytes::new())
            .await
    }

    /// POST `body` as JSON to `url` + `path`; the answer's body when the
    /// status is 2xx within the timeout.
    async fn post_json(&self, url: &str, path: &str, body: &serde_json::Value) -> Option<Bytes> {
        let request = hyper::Request::post(format!("{url}{path}"))
            .header(hyper::header::CONTENT_TYPE, "application/json");
        self.fetch(request, Bytes::from(serde_json::to_vec(body).ok()?))
            .await
    }

    /// Sends `request` with `body` (and the worker key); the answer's body
    /// when the status is 2xx within the health timeout.
    async fn fetch(
        &self,
        mut request: hyper::http::request::Builder,
        body: Bytes,
    ) -> Option<Bytes> {
        if let Some(auth) = &self.worker_auth {
            request = request.header(hyper::header::AUTHORIZATION, auth.clone());
        }
        let request = request.body(Full::new(body)).ok()?;
        let fetch = async {
            let response = self.client.request(request).await.ok()?;
            if !response.status().is_success() {
                return None;
            }
            // Bounded: models lists, health bodies and `/metrics` pages
            // are small (a vLLM page is about 55 KB).
            let body = http_body_util::Limited::new(response.into_body(), 1 << 20);
            body.collect().await.ok().map(|b| b.to_bytes())
        };
        tokio::time::timeout(self.health_timeout, fetch)
            .await
            .ok()?
    }
}

/// Runs `tasks` at most [`MAX_CONCURRENT_CHECKS`] at a time: their
/// outputs, in the tasks' order.
async fn bounded_concurrently<F: std::future::Future>(tasks: Vec<F>) -> Vec<F::Output> {
    use futures_util::StreamExt as _;
    let mut running = futures_util::stream::FuturesUnordered::new();
    let mut outputs = Vec::with_capacity(tasks.len());
    for (i, task) in tasks.into_iter().enumerate() {
        if running.len() >= MAX_CONCURRENT_CHECKS {
            outputs.extend(running.next().await);
        }
        running.push(async move { (i, task.await) });
    }
    while let Some(done) = running.next().await {
        outputs.push(done);
    }
    outputs.sort_by_key(|(i, _)| *i);
    outputs.into_iter().map(|(_, output)| output).collect()
}

/// Workers checked at once in a health round (each request is bounded by
/// the health timeout, so a slow worker delays no other).
const MAX_CONCURRENT_CHECKS: usize = 64;
/// Most models of one worker whose tokenizers are checked as it enters.
const MAX_TOKENIZER_CHECKS: usize = 8;

/// The data-parallel ranks a worker's `/get_server_info` reports (SGLang's
/// `dp_size`; the sim-worker's too), when it reports them.
pub(crate) fn reported_dp_size(body: &[u8]) -> Option<u64> {
    let value: serde_json::Value = serde_json::from_slice(body).ok()?;
    value["dp_size"].as_u64().filter(|&n| n >= 1)
}

/// Whether the target named `target` is the worker declared as `name`: the
/// worker itself, or one of its data-parallel ranks (`NAME/r`).
pub(crate) fn is_target_of(target: &str, name: &str) -> bool {
    target == name
        || target
            .strip_prefix(name)
            .and_then(|rest| rest.strip_prefix('/'))
            .is_some_and(|r| !r.is_empty() && r.bytes().all(|b| b.is_ascii_digit()))
}

/// Applies one subscriber's events to the routing core while the entry it
/// was started for lasts ([`Driver::apply_worker_event`]).
struct WorkerEventSink {
    driver: Arc<Driver>,
    worker: WorkerId,
    epoch: u64,
}

impl IndexSink for WorkerEventSink {
    fn apply(&self, worker: WorkerId, tier: CacheTier, event: &IndexEvent) {
        debug_assert_eq!(worker, self.worker, "one sink per worker");
        self.driver
            .apply_worker_event(self.worker, self.epoch, tier, event);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Joining takes up to one poll interval: off the async threads.
fn stop_off_thread(sub: KvEventSubscriber) {
    std::thread::spawn(move || sub.shutdown());
}

impl Drop for Fleet {
    fn drop(&mut self) {
        let subs: Vec<_> = self
            .subscribers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain()
            .map(|(_, s)| s)
            .collect();
        if !subs.is_empty() {
            std::thread::spawn(move || subs.into_iter().for_each(KvEventSubscriber::shutdown));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{
        book_remotely, fleet_over, fleet_with, loopback_spec, place, request, shared_with,
    };
    use crate::ServerConfig;

    /// The lines of a real vLLM 0.32.0 (CPU build) `/metrics` page that
    /// the poller reads.
    const VLLM_METRICS: &str = r#"# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0
vllm:cache_config_info{_block_size_resolved="True",block_size="32",cache_dtype="auto",cache_hit_alignment_tokens="None",effective_attention_block_size="32",enable_mamba_shared_prefix_checkpoint="False",enable_prefix_caching="True",engine="0",gpu_memory_utilization="0.92",hash_block_size="None",is_attention_free="False",kv_cache_dtype_skip_layers="[]",kv_cache_layout="None",kv_cache_max_concurrency="256.0",kv_cache_memory_bytes="1073741824",kv_cache_size_tokens="1048576",kv_offloading_backend="native",kv_offloading_size="None",kv_sharing_fast_prefill="False",mamba_block_size="None",mamba_cache_dtype="auto",mamba_cache_mode="none",mamba_page_size_padded="None",mamba_ssm_cache_dtype="float32",num_cpu_blocks="None",num_gpu_blocks="32768",num_gpu_blocks_override="None",prefix_cache_retention_interval="0",prefix_caching_hash_algo="sha256",prefix_match_unit="None",replayssm_buffer_len="16",skip_page_size_padded="None",sliding_window="None",swa_bounded_replay="True",use_kda_recoverssm="False",use_replayssm="False",user_specified_block_size="True"} 1.0
"#;

    /// A worker on loopback that answers as vLLM does: healthy, one model
    /// card, `404` on `/get_server_info`, and `metrics` on `/metrics` (404
    /// without). Returns its port.
    async fn vllm_like_worker(metrics: Option<&'static str>) -> u16 {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match socket.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let head = String::from_utf8_lossy(&head);
                    let path = head.split_whitespace().nth(1).unwrap_or("/");
                    let models = r#"{"object":"list","data":[{"id":"tiny","object":"model","max_model_len":4096}]}"#;
                    let (status, body) = match (path, metrics) {
                        ("/health", _) => ("200 OK", ""),
                        ("/v1/models", _) => ("200 OK", models),
                        ("/metrics", Some(page)) => ("200 OK", page),
                        _ => ("404 Not Found", ""),
                    };
                    let reply = format!(
                        "HTTP/1.1 {status}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = socket.write_all(reply.as_bytes()).await;
                });
            }
        });
        port
    }

    /// A fleet of the worker at `port`, after one round of health checks.
    async fn checked_worker(port: u16) -> crate::roster::WorkerInfo {
        let config = ServerConfig::default();
        let (driver, _) = shared_with(&config, &[]);
        let fleet = Fleet::new(
            driver.clone(),
            crate::upstream::client(Duration::from_secs(2)),
            false,
            config.block_size,
            3,
            Duration::from_secs(5),
        );
        fleet.add(&loopback_spec("vllm", port)).unwrap();
        fleet.check_all().await;
        driver.workers().remove(0)
    }

    #[tokio::test]
    async fn a_vllm_worker_gets_its_kv_capacity_from_its_metrics_cache_config() {
        let worker = checked_worker(vllm_like_worker(Some(VLLM_METRICS)).await).await;
        assert!(worker.in_router);
        assert_eq!(worker.models, ["tiny"]);
        assert_eq!(
            worker.capacity,
            WorkerCapacity {
                max_num_batched_tokens: None,
                kv_blocks: Some(32768),
                kv_tokens: Some(32768 * 32),
                block_size: None,
            }
        );
    }

    #[tokio::test]
    async fn a_worker_with_neither_server_info_nor_cache_config_has_no_capacity() {
        let bare = checked_worker(vllm_like_worker(None).await).await;
        assert!(bare.in_router);
        assert_eq!(bare.capacity, WorkerCapacity::default());
        let no_info = "vllm:kv_cache_usage_perc{engine=\"0\"} 0.5\n";
        let usage_only = checked_worker(vllm_like_worker(Some(no_info)).await).await;
        assert_eq!(usage_only.capacity, WorkerCapacity::default());
    }

    /// A fleet of one worker in selection (nothing listens at its URL).
    fn fleet() -> (Fleet, Arc<Driver>, WorkerId) {
        let (fleet, driver, ids) = fleet_with(&["w"]);
        (fleet, driver, ids[0])
    }

    #[tokio::test]
    async fn kv_event_metrics_are_labelled_by_the_workers_name() {
        let (driver, _) = shared_with(&ServerConfig::default(), &[]);
        let fleet = fleet_over(&driver, true);
        let spec = WorkerSpec {
            url: "http://127.0.0.1:9".into(),
            name: Some("gpu \"0\"".into()),
            events: Some("tcp://127.0.0.1:9".into()),
            replay: None,
            block_size: None,
            role: Default::default(),
            bootstrap_port: None,
            dp_size: None,
        };
        let id = fleet.add(&spec).unwrap();
        fleet.enter(id, 16);
        let text = fleet.kv_metrics.encode_text();
        fleet.leave(id);
        assert!(
            text.contains("switchyard_kv_event_resets_total{worker=\"gpu \\\"0\\\"\"} "),
            "{text}"
        );
        assert!(
            !text.contains(&format!("worker=\"{id}\"")),
            "never the numeric id:\n{text}"
        );
    }

    #[tokio::test]
    async fn a_worker_with_data_parallel_ranks_is_one_target_per_rank_each_naming_its_rank() {
        let (driver, _) = shared_with(&ServerConfig::default(), &[]);
        let fleet = fleet_over(&driver, true);
        let spec =
            WorkerSpec::parse("http://127.0.0.1:9,name=moe,dp-size=3,events=tcp://127.0.0.1:5557")
                .unwrap();
        let first = fleet.add(&spec).unwrap();
        let workers = fleet.workers();
        let names: Vec<&str> = workers.iter().map(|w| &*w.name).collect();
        assert_eq!(names, ["moe/0", "moe/1", "moe/2"]);
        for (rank, w) in workers.iter().enumerate() {
            // One worker id, the rank beside it; the requests name the rank.
            assert_eq!(w.id, WorkerId::with_rank(first.worker_id, rank as u32));
            assert_eq!(&*w.url, "http://127.0.0.1:9");
            let header = w.endpoint.dp_rank.as_ref().unwrap();
            assert_eq!(header.to_str().unwrap(), rank.to_string());
            // Each rank's events from its own port.
            let configs = lock(&fleet.event_configs);
            let (name, sub) = &configs[&w.id];
            assert_eq!(name, &*w.name);
            assert_eq!(sub.endpoint, format!("tcp://127.0.0.1:{}", 5557 + rank));
            assert_eq!((sub.worker, sub.dp_size), (w.id, 3));
        }
        // A worker of one rank names none.
        let single = fleet
            .add(&WorkerSpec::parse("http://127.0.0.1:10").unwrap())
            .unwrap();
        assert!(driver
            .workers()
            .iter()
            .any(|w| w.id == single && w.endpoint.dp_rank.is_none()));
        // The worker's name removes every rank; a second declaration of the
        // same name is refused whole.
        assert!(fleet.add(&spec).is_err());
        assert_eq!(fleet.workers().len(), 4);
        assert!(fleet.remove("moe", false));
        assert_eq!(fleet.workers().len(), 1);
    }

    #[test]
    fn the_ranks_a_worker_reports_are_read_from_its_server_info() {
        assert_eq!(
            reported_dp_size(br#"{"dp_size": 8, "page_size": 16}"#),
            Some(8)
        );
        assert_eq!(reported_dp_size(br#"{"dp_size": 1}"#), Some(1));
        for none in [
            &br#"{"page_size": 16}"#[..],
            br#"{"dp_size": 0}"#,
            br#"{"dp_size": -2}"#,
            b"nope",
        ] {
            assert_eq!(reported_dp_size(none), None);
        }
        assert!(is_target_of("moe/3", "moe") && is_target_of("moe", "moe"));
        assert!(
            !is_target_of("moe/x", "moe")
                && !is_target_of("moe/", "moe")
                && !is_target_of("moe2/0", "moe")
        );
    }

    #[tokio::test]
    async fn a_role_needs_disagg_and_is_kept_in_the_roster() {
        let (driver, _) = shared_with(&ServerConfig::default(), &[]);
        let fleet = |disagg| fleet_over(&driver, false).with_disagg(disagg);
        let spec = WorkerSpec::parse("http://127.0.0.1:9,name=p,role=prefill,bootstrap-port=8998")
            .unwrap();
        let err = fleet(false).add(&spec).unwrap_err();
        assert!(err.contains("--disagg"), "{err}");
        assert!(driver.workers().is_empty());
        let id = fleet(true).add(&spec).unwrap();
        assert_eq!(
            driver.role_of(id),
            Some((crate::roster::Role::Prefill, Some(8998)))
        );
    }

    #[tokio::test]
    async fn draining_a_worker_with_only_peers_bookings_removes_it_at_once() {
        let (fleet, driver, id) = fleet();
        book_remotely(&driver, 1_000, id);
        assert!(fleet.remove("w", true));
        assert!(driver.workers().is_empty(), "nothing of ours to wait for");
    }

    #[tokio::test]
    async fn a_draining_worker_is_removed_once_this_replicas_requests_end_whatever_peers_hold() {
        let (fleet, driver, id) = fleet();
        let booking = place(&driver, request(&[], 4)).await.unwrap();
        book_remotely(&driver, 1_000, id);
        assert!(fleet.remove("w", true));
        assert!(driver.workers()[0].draining);
        fleet.check_all().await;
        assert_eq!(driver.workers().len(), 1, "our request is still in flight");
        drop(booking);
        fleet.check_all().await;
        assert!(
            driver.workers().is_empty(),
            "the peer's booking does not hold the drain"
        );
    }
}
