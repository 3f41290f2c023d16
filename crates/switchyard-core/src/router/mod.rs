//! The routing core as one value: prefix index + active sequences + a
//! selector. Both drivers (the HTTP server and the fleet simulator) hold one
//! [`Router`] and call it with their own clock.
//!
//! One request's life through it:
//!
//! 1. [`Router::route`] — reads overlaps and load, asks the selector;
//! 2. [`Router::book`] — `AddRequest` on the chosen worker (and, without KV
//!    events, records the decision in the approximate index);
//! 3. [`Router::mark_prefill_completed`] at the first token;
//! 4. [`Router::free`] at the end, on error, or on disconnect.
//!
//! KV events arrive independently through [`Router::apply_kv_event`], each
//! about one cache tier (device or host, [`crate::index::TieredIndex`]); peer
//! replicas' bookings through [`Router::apply_remote`] (see
//! [`crate::replica`]).
//!
//! Submodules: `route` is the one routing decision (index read, candidates,
//! selection) over either source of loads; [`board`] publishes the loads
//! so that a route can be made outside the dispatcher's lock
//! ([`Router::pre_routes`]).

use crate::adapters::{AdapterConfig, AdapterConfigError, AdapterTable};
use crate::estimate::EstimatorConfig;
use crate::index::published::{self, IndexReader, IndexWriter};
use crate::index::{
    ApplyOutcome, ApproxConfig, ApproxConfigError, ApproxIndex, CacheTier, IndexEvent, IndexMemory,
    OverlapScores, PrefixIndex, TieredIndex,
};
use crate::replica::{RemoteBookings, RemoteConfig, RemoteConfigError, RemoteOutcome};
use crate::select::{
    build_selector, Candidate, Decision, PolicyConfig, PolicyConfigError, PolicyKind, PrefillTime,
    RoutingRequest, SelectOutcome, Selector,
};
use crate::sequences::{
    ActiveSequences, AddRequest, LifecycleOutcome, SequenceEvent, SequencesConfig,
    SequencesConfigError, SequencesMemory,
};
use crate::types::{ReplicaId, RequestId, WorkerId};
use route::{OwnLoads, RouteScratch};
use serde::{Deserialize, Serialize};

pub mod board;
mod route;

/// How the router learns what workers have cached.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CacheTracking {
    /// From the engines' KV events (exact).
    Events,
    /// Predicted from the router's own decisions (engines without events).
    Approximate(ApproxConfig),
}

/// Settings of a [`Router`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RouterConfig {
    /// The routing policy.
    pub policy: PolicyKind,
    /// Settings of every policy.
    pub policies: PolicyConfig,
    /// Active-sequence settings (block size, expiry).
    pub sequences: SequencesConfig,
    /// Exact or approximate cache tracking.
    pub cache: CacheTracking,
    /// Peer replicas' bookings (silence expiry, origin cap).
    pub remote: RemoteConfig,
    /// A worker whose active prefill tokens exceed this fraction of its
    /// `max_num_batched_tokens`, or whose decode blocks exceed this fraction
    /// of its KV blocks, is busy and skipped. `None` disables the check.
    pub busy_threshold: Option<f64>,
    /// Seed of every random choice.
    pub seed: u64,
    /// LoRA adapter affinity ([`crate::adapters`]).
    pub adapters: AdapterConfig,
    /// Most block names one worker may hold in each tier of the exact
    /// index; past it the worker's oldest are dropped (counted).
    pub max_index_blocks_per_worker: usize,
}

impl Default for RouterConfig {
    fn default() -> Self {
        Self {
            policy: PolicyKind::DEFAULT,
            policies: PolicyConfig::default(),
            sequences: SequencesConfig::default(),
            cache: CacheTracking::Events,
            remote: RemoteConfig::default(),
            busy_threshold: None,
            seed: 0,
            adapters: AdapterConfig::default(),
            max_index_blocks_per_worker: crate::index::DEFAULT_MAX_BLOCKS_PER_WORKER,
        }
    }
}

/// Why a [`RouterConfig`] was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum RouterConfigError {
    /// A policy setting.
    #[error(transparent)]
    Policy(#[from] PolicyConfigError),
    /// An active-sequence setting.
    #[error(transparent)]
    Sequences(#[from] SequencesConfigError),
    /// An approximate-index setting.
    #[error(transparent)]
    Approx(#[from] ApproxConfigError),
    /// A remote-booking setting.
    #[error(transparent)]
    Remote(#[from] RemoteConfigError),
    /// A busy threshold that is not positive.
    #[error("busy_threshold must be positive and finite, got {0}")]
    BusyThreshold(f64),
    /// An adapter setting.
    #[error(transparent)]
    Adapters(#[from] AdapterConfigError),
}

impl RouterConfig {
    /// Checks every part.
    pub fn validate(&self) -> Result<(), RouterConfigError> {
        self.policies.validate()?;
        self.sequences.validate()?;
        self.remote.validate()?;
        self.adapters.validate()?;
        if let CacheTracking::Approximate(approx) = self.cache {
            approx.validate()?;
        }
        if let Some(t) = self.busy_threshold {
            if !(t.is_finite() && t > 0.0) {
                return Err(RouterConfigError::BusyThreshold(t));
            }
        }
        Ok(())
    }
}

/// What a worker can hold, for busy thresholds and the `ttft` policy's KV
/// pressure. Unknown parts never make a worker busy or pressed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerCapacity {
    /// Tokens the engine batches per step.
    pub max_num_batched_tokens: Option<u64>,
    /// KV blocks on the device.
    pub kv_blocks: Option<u64>,
    /// KV capacity in tokens (device blocks × the engine's block size,
    /// which need not be the router's).
    pub kv_tokens: Option<u64>,
    /// Tokens per KV block of the model it serves, when that is not the
    /// router's (a fleet of several models); its bookings are counted in
    /// blocks of this size.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
}

/// Heap bytes of a [`Router`] by part, from allocated capacities.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RouterMemory {
    /// The cache index (exact, or the approximate index's tree): the
    /// device tier's.
    pub index: IndexMemory,
    /// The host-tier and SSM-checkpoint indexes (empty without either).
    pub host_index: IndexMemory,
    /// The approximate index's expiry bookkeeping (0 in exact mode).
    pub approx_extra: usize,
    /// Active sequences, the read model included.
    pub sequences: SequencesMemory,
    /// Remote-booking bookkeeping.
    pub remote: usize,
    /// Worker capacities and the routing scratch buffers.
    pub other: usize,
}

impl RouterMemory {
    /// All of it.
    pub fn total(&self) -> usize {
        self.index.total()
            + self.host_index.total()
            + self.approx_extra
            + self.sequences.total()
            + self.remote
            + self.other
    }
}

#[derive(Debug)]
enum CacheIndex {
    /// Every tier's exact index.
    Exact(Box<TieredIndex>),
    /// Exact, written by the holder of the [`IndexWriter`] (see
    /// [`Router::publish_index`]).
    Published(IndexReader),
    /// The router's own decisions, with a TTL.
    Approximate(Box<ApproxIndex>),
}

/// Time constant of each worker's recent-writes counter (ms): a booking's
/// uncached tokens count in full when booked and fade by `e` each minute.
pub const WRITES_TIME_CONSTANT_MS: f64 = 60_000.0;

/// Uncached tokens booked on a worker, fading exponentially with
/// [`WRITES_TIME_CONSTANT_MS`]: about the tokens it was given to compute
/// (and to write into its KV cache) in the last minute.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct RecentWrites {
    tokens: f64,
    at_ms: f64,
}

impl RecentWrites {
    fn at(&self, now_ms: f64) -> f64 {
        if self.tokens == 0.0 {
            // A worker never given work: no `exp` for it.
            return 0.0;
        }
        let age = (now_ms - self.at_ms).max(0.0);
        self.tokens * (-age / WRITES_TIME_CONSTANT_MS).exp()
    }

    fn add(&mut self, tokens: f64, now_ms: f64) {
        let now_ms = now_ms.max(self.at_ms);
        self.tokens = self.at(now_ms) + tokens;
        self.at_ms = now_ms;
    }
}

/// What the router keeps per worker besides its bookings and cache.
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkerSlot {
    capacity: WorkerCapacity,
    writes: RecentWrites,
    /// Offered new requests (false while its circuit is open, say).
    selectable: bool,
}

impl WorkerCapacity {
    /// Tokens per KV block on this worker: its model's, else `default`.
    fn block_size_or(&self, default: u32) -> u32 {
        self.block_size.filter(|&b| b > 0).unwrap_or(default)
    }

    /// Its KV capacity in blocks of `block_size` tokens, the size its
    /// bookings are counted in: from `kv_tokens` when known (the engine's
    /// own blocks may be of another size: vLLM's CPU build at 32 behind a
    /// router at 16), else `kv_blocks` as reported.
    pub fn kv_blocks_of(&self, block_size: u32) -> Option<u64> {
        match self.kv_tokens {
            Some(tokens) if block_size > 0 => Some(tokens / u64::from(block_size)),
            _ => self.kv_blocks,
        }
    }

    /// Its KV capacity in tokens: `kv_tokens`, else `kv_blocks` of
    /// `block_size` tokens.
    pub fn kv_tokens_or(&self, block_size: u32) -> Option<u64> {
        self.kv_tokens
            .or_else(|| self.kv_blocks?.checked_mul(u64::from(block_size)))
    }
}

/// One worker's depths for the prompt being routed (in blocks).
#[derive(Clone, Copy, Debug, Default)]
struct SlotDepths {
    /// Its device prefix (cut back to its deepest SSM state when hybrid).
    overlap: u32,
    /// Its device prefix, resumable or not.
    held: u32,
    /// Its host-tier run right after the device prefix.
    host: u32,
    /// The prompt's leading blocks already active on it.
    active: u32,
}

/// The routing core. See the module docs for the call sequence.
pub struct Router {
    config: RouterConfig,
    cache: CacheIndex,
    sequences: ActiveSequences,
    remote: RemoteBookings,
    selector: Box<dyn Selector>,
    /// Selectors of the policies that requests' models name instead of
    /// the router's (built at a model's first request; at most one per
    /// policy).
    model_selectors: Vec<(PolicyKind, Box<dyn Selector>)>,
    /// Per worker, by its registry slot ([`ActiveSequences::slot_of`]):
    /// what it can hold, what it was given lately, and whether it is
    /// offered new requests. A route reads it once per candidate, by
    /// index.
    workers: Vec<Option<WorkerSlot>>,
    scratch: RouteScratch,
    /// Changes to the loads for the board that routes outside the
    /// dispatcher's lock read ([`board`]), once [`Router::pre_routes`]
    /// made one; emptied by [`Router::take_load_changes`].
    board: Option<Vec<board::LoadChange>>,
    /// Which worker has which LoRA adapter loaded.
    adapters: AdapterTable,
}

impl std::fmt::Debug for Router {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Router")
            .field("policy", &self.selector.name())
            .field("workers", &self.workers.iter().flatten().count())
            .field("active_requests", &self.sequences.active_requests())
            .finish_non_exhaustive()
    }
}

impl AddRequest {
    /// The booking of request `id` as `decision` placed it: what
    /// [`Router::book`] applies and what a replica publishes to its peers.
    pub fn for_decision(
        id: RequestId,
        request: &RoutingRequest<'_>,
        decision: &Decision,
        expected_prefill_ms: Option<f64>,
    ) -> Self {
        Self {
            request: id,
            worker: decision.worker,
            prompt_tokens: request.prompt_tokens,
            blocks: request.blocks.to_vec(),
            overlap_blocks: decision.overlap_blocks,
            expected_prefill_ms,
        }
    }
}

impl Router {
    /// A router with no workers.
    pub fn new(config: RouterConfig) -> Result<Self, RouterConfigError> {
        config.validate()?;
        let cache = match config.cache {
            CacheTracking::Events => CacheIndex::Exact(Box::new(
                TieredIndex::with_max_blocks_per_worker(config.max_index_blocks_per_worker),
            )),
            CacheTracking::Approximate(approx) => {
                CacheIndex::Approximate(Box::new(ApproxIndex::new(approx)?))
            }
        };
        Ok(Self {
            selector: build_selector(config.policy, &config.policies, config.seed)?,
            model_selectors: Vec::new(),
            sequences: ActiveSequences::new(config.sequences)?,
            remote: RemoteBookings::new(config.remote)?,
            adapters: AdapterTable::new(config.adapters),
            config,
            cache,
            workers: Vec::new(),
            scratch: RouteScratch::default(),
            board: None,
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &RouterConfig {
        &self.config
    }

    /// The selector's policy name.
    pub fn policy_name(&self) -> &'static str {
        self.selector.name()
    }

    /// Adds (or updates the capacity of) a worker.
    pub fn add_worker(&mut self, worker: WorkerId, capacity: WorkerCapacity) {
        let block_size = capacity.block_size_or(self.config.sequences.block_size);
        self.sequences
            .add_worker_with_block_size(worker, block_size);
        let slot = self
            .sequences
            .slot_of(worker)
            .expect("a worker just added has a slot");
        if self.workers.len() <= slot {
            self.workers.resize_with(slot + 1, || None);
        }
        match &mut self.workers[slot] {
            Some(known) => known.capacity = capacity,
            none => {
                *none = Some(WorkerSlot {
                    capacity,
                    writes: RecentWrites::default(),
                    selectable: true,
                })
            }
        }
        self.post_worker(slot);
    }

    /// Journals the write model's changes so far, then `op`, for the board
    /// (when there is one), in that order: the board sees every change in
    /// the order it was made.
    fn post(&mut self, op: Option<board::BoardOp>) {
        let Some(journal) = &mut self.board else {
            return;
        };
        journal.extend(
            self.sequences
                .drain_changes()
                .map(|c| board::LoadChange(board::BoardOp::Sequences(c))),
        );
        journal.extend(op.map(board::LoadChange));
    }

    /// [`Self::post`] of the router's state of the worker in `slot`.
    fn post_worker(&mut self, slot: usize) {
        let state = self.workers.get(slot).copied().flatten();
        self.post(state.map(|state| board::BoardOp::Worker(slot, state)));
    }

    /// Moves every change to the loads since the last call, in order, to
    /// the end of `out`, for the board's writer
    /// ([`board::BoardWriter::apply`]; nothing without a board). The
    /// driver takes them before it lets go of the router, so that changes
    /// reach the board in the order they were made, and may apply them
    /// after.
    pub fn take_load_changes(&mut self, out: &mut Vec<board::LoadChange>) {
        self.post(None);
        if let Some(journal) = &mut self.board {
            out.append(journal);
        }
    }

    /// Journals the estimator's fit for `worker` for the board.
    pub(crate) fn post_fit(&mut self, worker: WorkerId, fit: Option<crate::estimate::Fit>) {
        self.post(Some(board::BoardOp::Fit(worker, fit)));
    }

    /// Starts a board of the loads (see [`board`]) and hands out its
    /// writer and what routes outside the dispatcher's lock need: from
    /// now on every change to the loads is journaled for
    /// [`Self::take_load_changes`]. `None` unless the index is published
    /// ([`Self::publish_index`]) and the policy keeps no state between
    /// decisions ([`PolicyKind::keeps_no_state`]), or when already done.
    /// `fits` are the estimator's fits so far and `estimator` its
    /// settings, which the board's routes use.
    pub fn pre_routes(
        &mut self,
        estimator: &EstimatorConfig,
        fits: impl IntoIterator<Item = (WorkerId, crate::estimate::Fit)>,
    ) -> Option<(board::PreRoutes, board::BoardWriter)> {
        let CacheIndex::Published(reader) = &self.cache else {
            return None;
        };
        if self.board.is_some() || !self.config.policy.keeps_no_state() {
            return None;
        }
        let (mut writer, readers) = board::board();
        let index = reader.factory();
        self.board = Some(Vec::new());
        self.sequences.record_changes();
        for slot in 0..self.workers.len() {
            self.post_worker(slot);
        }
        for (worker, fit) in fits {
            self.post_fit(worker, Some(fit));
        }
        let mut changes = Vec::new();
        self.take_load_changes(&mut changes);
        writer.apply(&mut changes);
        Some((
            board::PreRoutes::new(index, readers, self.config, *estimator),
            writer,
        ))
    }

    /// The worker's own state, when it is in the router.
    fn worker(&self, worker: WorkerId) -> Option<&WorkerSlot> {
        let slot = self.sequences.slot_of(worker)?;
        self.workers.get(slot)?.as_ref()
    }

    fn worker_mut(&mut self, worker: WorkerId) -> Option<&mut WorkerSlot> {
        let slot = self.sequences.slot_of(worker)?;
        self.workers.get_mut(slot)?.as_mut()
    }

    /// Tokens per KV block on `worker`: its model's, else the router's.
    pub fn block_size_of(&self, worker: WorkerId) -> u32 {
        let default = self.config.sequences.block_size;
        self.worker(worker)
            .map_or(default, |slot| slot.capacity.block_size_or(default))
    }

    /// Removes a worker: it is never selected again, its cached blocks (in
    /// both tiers) are forgotten, and its active requests are freed
    /// (returned).
    pub fn remove_worker(&mut self, worker: WorkerId) -> Vec<RequestId> {
        if let Some(slot) = self.sequences.slot_of(worker) {
            self.workers[slot] = None;
        }
        self.adapters.remove_worker(worker);
        match &mut self.cache {
            CacheIndex::Exact(index) => {
                index.remove_worker(worker);
            }
            // The writer's holder forgets it.
            CacheIndex::Published(_) => {}
            CacheIndex::Approximate(index) => index.remove_worker(worker),
        }
        self.selector.remove_worker(worker);
        for (_, selector) in &mut self.model_selectors {
            selector.remove_worker(worker);
        }
        let freed = self.sequences.remove_worker(worker);
        self.remote.forget_all(&freed);
        freed
    }

    /// Offers a worker new requests or stops offering them, keeping its
    /// cached blocks and bookings (unlike [`Router::remove_worker`]): a
    /// worker whose circuit is open is never selected, and needs no
    /// rebuilding when it closes. Workers are selectable when added.
    pub fn set_selectable(&mut self, worker: WorkerId, selectable: bool) {
        if let Some(state) = self.worker_mut(worker) {
            if state.selectable != selectable {
                state.selectable = selectable;
                if let Some(slot) = self.sequences.slot_of(worker) {
                    self.post_worker(slot);
                }
            }
        }
    }

    /// Whether a worker is in the router and may be selected.
    pub fn is_selectable(&self, worker: WorkerId) -> bool {
        self.worker(worker).is_some_and(|slot| slot.selectable)
    }

    /// Whether a worker in the router may take a new request at `now_ms`:
    /// selectable and not over the busy threshold, as a route would find
    /// it now.
    pub fn may_take(&self, worker: WorkerId, now_ms: f64) -> bool {
        self.may_take_with(worker, now_ms, 0.0)
    }

    /// [`Self::may_take`] for a request with `headroom` held back from it
    /// ([`RoutingRequest::headroom`]).
    pub fn may_take_with(&self, worker: WorkerId, now_ms: f64, headroom: f64) -> bool {
        let Some(slot) = self.sequences.slot_of(worker) else {
            return false;
        };
        let (Some(Some(state)), Some(load)) =
            (self.workers.get(slot), self.sequences.registry().slot(slot))
        else {
            return false;
        };
        state.selectable
            && !route::is_busy(
                &self.config,
                Some(state),
                load,
                load.active_prefill_tokens(now_ms),
                headroom,
            )
    }

    /// Whether a route made outside the lock for a prompt of `blocks`
    /// missed a booking made since: some worker now has more of the
    /// prompt's leading blocks active than the route counted on the one it
    /// chose, cached or active, when it read the board (`seen`: the
    /// proposal's [`Decision::overlap_blocks`]). A burst of requests
    /// sharing a fresh prefix arrives at once, so its routes read the
    /// board before the first of them is booked; each is routed again
    /// under the lock, where the bookings are current (the `ttft` policy's
    /// fan-out). The chosen worker counts too: a sibling booked there with
    /// the prefix it did not see would count the prefix's prefill twice in
    /// that worker's queue, and the burst's later siblings would find the
    /// worker that computes the prefix dearer than one that has nothing.
    /// One lookup per worker unless some worker holds the prompt's first
    /// block.
    pub fn missed_active_prefix(&mut self, seen: u32, blocks: &[crate::types::LocalHash]) -> bool {
        let mut missed = false;
        self.scratch.chain_for_depths(|chain| {
            self.sequences
                .active_prompt_depths(blocks, chain, |_, depth| {
                    missed |= depth > seen;
                });
        });
        missed
    }

    /// Applies an engine KV event about one of `worker`'s cache tiers
    /// ([`TieredIndex::apply`]: `Cleared` clears both). Events for workers
    /// the router does not route to are still indexed (a worker may publish
    /// before it is added); in approximate mode events are ignored and
    /// `None` is returned, and once the index is published they go through
    /// its writer (`None`).
    pub fn apply_kv_event(
        &mut self,
        worker: WorkerId,
        tier: CacheTier,
        event: &IndexEvent,
    ) -> Option<ApplyOutcome> {
        match &mut self.cache {
            CacheIndex::Exact(index) => Some(index.apply(worker, tier, event)),
            CacheIndex::Published(_) | CacheIndex::Approximate(_) => None,
        }
    }

    /// Moves the exact index behind a wait-free reader and hands out its
    /// writer: from now on KV events are applied through the writer (by
    /// its holder, without this router), and routing reads the index as
    /// last published, never waiting for an event being applied. `None` in
    /// approximate mode or when already published.
    pub fn publish_index(&mut self) -> Option<IndexWriter> {
        let CacheIndex::Exact(index) = &mut self.cache else {
            return None;
        };
        let (writer, reader) = published::publish(std::mem::take(index));
        self.cache = CacheIndex::Published(reader);
        Some(writer)
    }

    /// Chooses a worker for a request among `eligible` (all workers when
    /// `None`), with the default timing model for prefill durations
    /// ([`EstimatorConfig::default`]). Changes no booking: call
    /// [`Router::book`] on dispatch.
    pub fn route(
        &mut self,
        request: RoutingRequest<'_>,
        eligible: Option<&[WorkerId]>,
        now_ms: f64,
    ) -> SelectOutcome {
        self.route_with(request, eligible, &EstimatorConfig::default(), now_ms)
    }

    /// [`Router::route`] with `prefill` for the prefill durations the
    /// time-based policies weigh (the dispatcher passes its estimator).
    pub fn route_with(
        &mut self,
        request: RoutingRequest<'_>,
        eligible: Option<&[WorkerId]>,
        prefill: &dyn PrefillTime,
        now_ms: f64,
    ) -> SelectOutcome {
        let loads = OwnLoads {
            sequences: &self.sequences,
            workers: &self.workers,
        };
        let scratch = &mut self.scratch;
        match &mut self.cache {
            CacheIndex::Exact(index) => {
                scratch.read_index(request.blocks, &loads, index.device(), Some(&**index))
            }
            CacheIndex::Published(reader) => reader.with(|index| {
                scratch.read_index(request.blocks, &loads, index.device(), Some(index))
            }),
            CacheIndex::Approximate(index) => {
                index.expire(now_ms);
                scratch.read_index(request.blocks, &loads, index.index(), None);
            }
        }
        let selector = match request.model.policy.filter(|&p| p != self.config.policy) {
            None => &mut self.selector,
            Some(policy) => Self::model_selector(&mut self.model_selectors, policy, &self.config)
                .unwrap_or(&mut self.selector),
        };
        scratch.select(
            request,
            eligible,
            &loads,
            &self.config,
            &self.adapters,
            &mut **selector,
            prefill,
            now_ms,
        )
    }

    /// The selector of `policy`, a model's own, built at its first use
    /// (`None` if it cannot be built: the router's own is used instead;
    /// every policy's settings were validated with the router's config).
    fn model_selector<'s>(
        selectors: &'s mut Vec<(PolicyKind, Box<dyn Selector>)>,
        policy: PolicyKind,
        config: &RouterConfig,
    ) -> Option<&'s mut Box<dyn Selector>> {
        let at = match selectors.iter().position(|(p, _)| *p == policy) {
            Some(at) => at,
            None => {
                let selector = build_selector(policy, &config.policies, config.seed).ok()?;
                selectors.push((policy, selector));
                selectors.len() - 1
            }
        };
        Some(&mut selectors[at].1)
    }

    /// Which worker has which adapter (read).
    pub fn adapters(&self) -> &AdapterTable {
        &self.adapters
    }

    /// Which worker has which adapter (the drivers feed it).
    pub fn adapters_mut(&mut self) -> &mut AdapterTable {
        &mut self.adapters
    }

    /// `worker` as the last [`Router::route_with`] saw it (`None` when it
    /// was not a candidate then).
    pub fn last_candidate(&self, worker: WorkerId) -> Option<&Candidate> {
        self.scratch.candidates.iter().find(|c| c.worker == worker)
    }

    /// Books a routed request on its worker (`AddRequest`).
    pub fn book(
        &mut self,
        id: RequestId,
        request: RoutingRequest<'_>,
        decision: Decision,
        expected_prefill_ms: Option<f64>,
        now_ms: f64,
    ) -> LifecycleOutcome {
        self.book_request(
            &AddRequest::for_decision(id, &request, &decision, expected_prefill_ms),
            now_ms,
        )
    }

    /// Books a request described by its `AddRequest` — the form a replica
    /// publishes to its peers, so a driver with replica sync builds it once.
    pub fn book_request(&mut self, add: &AddRequest, now_ms: f64) -> LifecycleOutcome {
        let outcome = self.sequences.add_request(add, now_ms);
        if outcome == LifecycleOutcome::Applied {
            let default = self.config.sequences.block_size;
            if let Some(slot) = self.sequences.slot_of(add.worker) {
                if let Some(Some(state)) = self.workers.get_mut(slot) {
                    let block_size = state.capacity.block_size_or(default);
                    let cached = u64::from(add.overlap_blocks) * u64::from(block_size);
                    let uncached = u64::from(add.prompt_tokens).saturating_sub(cached);
                    state.writes.add(uncached as f64, now_ms);
                    self.post_worker(slot);
                }
            }
            if let CacheIndex::Approximate(index) = &mut self.cache {
                index.record(add.worker, &add.blocks, now_ms);
            }
        }
        outcome
    }

    /// The request's first token arrived.
    pub fn mark_prefill_completed(&mut self, id: RequestId, now_ms: f64) -> LifecycleOutcome {
        self.sequences.mark_prefill_completed(id, now_ms)
    }

    /// The request ended, however it ended.
    pub fn free(&mut self, id: RequestId, now_ms: f64) -> LifecycleOutcome {
        self.sequences.free(id, now_ms)
    }

    /// Frees requests past their deadline; returns them.
    pub fn expire(&mut self, now_ms: f64) -> Vec<RequestId> {
        if let CacheIndex::Approximate(index) = &mut self.cache {
            index.expire(now_ms);
        }
        let expired = self.sequences.expire(now_ms);
        self.remote.forget_all(&expired);
        expired
    }

    /// Names this replica: peer events carrying `id` are then ignored.
    pub fn set_replica_id(&mut self, id: ReplicaId) {
        self.remote.set_local(id);
    }

    /// Applies a peer replica's lifecycle event about a booking of
    /// `origin` as a remote booking (advisory, clamped; see
    /// [`crate::replica`]). An applied `Add` also feeds the approximate
    /// index, as a local booking would.
    pub fn apply_remote(
        &mut self,
        origin: ReplicaId,
        event: &SequenceEvent,
        now_ms: f64,
    ) -> RemoteOutcome {
        self.apply_remote_from(origin, origin, event, now_ms)
    }

    /// [`Self::apply_remote`] for an event in a batch sent by `sender`:
    /// an `Add` or `Free` naming another origin is dropped.
    pub fn apply_remote_from(
        &mut self,
        sender: ReplicaId,
        origin: ReplicaId,
        event: &SequenceEvent,
        now_ms: f64,
    ) -> RemoteOutcome {
        let outcome = self
            .remote
            .apply_from(sender, origin, event, &mut self.sequences, now_ms);
        if let (true, SequenceEvent::Add(add), CacheIndex::Approximate(index)) =
            (outcome.applied(), event, &mut self.cache)
        {
            let blocks = &add.blocks[..add.blocks.len().min(crate::replica::MAX_REMOTE_BLOCKS)];
            index.record(add.worker, blocks, now_ms);
        }
        outcome
    }

    /// One part of peer `origin`'s digest of its live bookings (see
    /// [`RemoteBookings::apply_digest`]); returns the keys freed.
    pub fn apply_remote_digest(
        &mut self,
        origin: ReplicaId,
        lo: RequestId,
        hi: RequestId,
        live: &[RequestId],
        now_ms: f64,
    ) -> Vec<RequestId> {
        self.remote
            .apply_digest(origin, lo, hi, live, &mut self.sequences, now_ms)
    }

    /// Remote-booking bookkeeping, for session bindings and drop counts.
    pub fn remote_mut(&mut self) -> &mut RemoteBookings {
        &mut self.remote
    }

    /// A peer is alive (an empty heartbeat batch); `false` for oneself.
    pub fn replica_heartbeat(&mut self, origin: ReplicaId, now_ms: f64) -> bool {
        self.remote.heard_from(origin, &mut self.sequences, now_ms)
    }

    /// Frees the bookings of peers silent past
    /// [`RemoteConfig::silence_expiry_ms`]; returns them.
    pub fn expire_silent_replicas(&mut self, now_ms: f64) -> Vec<RequestId> {
        self.remote.expire_silent(&mut self.sequences, now_ms)
    }

    /// Remote-booking bookkeeping (read-only).
    pub fn remote(&self) -> &RemoteBookings {
        &self.remote
    }

    /// The active-sequence model (read-only).
    pub fn sequences(&self) -> &ActiveSequences {
        &self.sequences
    }

    /// Runs `read` on the device tier's prefix index (the approximate
    /// index's own in approximate mode; the last published copy once
    /// published).
    pub fn with_index<R>(&self, read: impl FnOnce(&PrefixIndex) -> R) -> R {
        match &self.cache {
            CacheIndex::Exact(index) => read(index.device()),
            CacheIndex::Published(reader) => reader.with(|index| read(index.device())),
            CacheIndex::Approximate(index) => read(index.index()),
        }
    }

    /// Blocks the exact index dropped, in every tier, because their worker
    /// was past `max_index_blocks_per_worker` (0 in approximate mode).
    pub fn index_evicted_over_cap(&self) -> u64 {
        match &self.cache {
            CacheIndex::Exact(index) => index.evicted_over_cap(),
            CacheIndex::Published(reader) => reader.with(TieredIndex::evicted_over_cap),
            CacheIndex::Approximate(_) => 0,
        }
    }

    /// Runs `read` on the host tier's prefix index (an empty one in
    /// approximate mode, which follows no events).
    pub fn with_host_index<R>(&self, read: impl FnOnce(&PrefixIndex) -> R) -> R {
        match &self.cache {
            CacheIndex::Exact(index) => read(index.host()),
            CacheIndex::Published(reader) => reader.with(|index| read(index.host())),
            CacheIndex::Approximate(_) => read(&PrefixIndex::new()),
        }
    }

    /// Heap bytes by part: every map and queue the router owns (the
    /// selector's private state aside). Visits every active request; call
    /// it for reports, not per request.
    pub fn memory(&self) -> RouterMemory {
        let (index, host_index, approx_extra) = match &self.cache {
            CacheIndex::Exact(index) => {
                let (device, host) = index.memory();
                (device, host, 0)
            }
            CacheIndex::Published(reader) => {
                let (device, host) = reader.with(TieredIndex::memory);
                (device, host, 0)
            }
            CacheIndex::Approximate(approx) => {
                let index = approx.index().memory();
                (
                    index,
                    IndexMemory::default(),
                    approx.estimated_bytes().saturating_sub(index.total()),
                )
            }
        };
        RouterMemory {
            index,
            host_index,
            approx_extra,
            sequences: self.sequences.memory(),
            remote: self.remote.estimated_bytes(),
            other: self.workers.capacity() * std::mem::size_of::<Option<WorkerSlot>>()
                + self.scratch.heap_bytes()
                + self.adapters.estimated_bytes(),
        }
    }

    /// Estimate of heap bytes held by the index (both tiers; both copies
    /// once published) and the registry.
    pub fn estimated_bytes(&self) -> usize {
        let index = match &self.cache {
            CacheIndex::Exact(index) => index.estimated_bytes(),
            // Two copies, one per side of the reader/writer pair.
            CacheIndex::Published(reader) => 2 * reader.with(TieredIndex::estimated_bytes),
            CacheIndex::Approximate(index) => index.estimated_bytes(),
        };
        index + self.sequences.registry().estimated_bytes()
    }
}

/// Depth of `worker` in scores sorted by worker.
fn depth_of(scores: &OverlapScores, worker: WorkerId) -> u32 {
    scores
        .entries
        .binary_search_by_key(&worker, |e| e.worker)
        .map_or(0, |i| scores.entries[i].depth)
}

/// Peers' bookings applied through the router (`crate::replica`'s
/// remote-booking rules, end to end).
#[cfg(test)]
mod remote_tests;

#[cfg(test)]
mod tests;
