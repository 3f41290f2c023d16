//! The load board: what a route reads of the workers besides their caches
//! (each one's load, capacity, recent writes, selectability, prefill fit
//! and active prompt blocks), published so that a route can be made
//! outside the dispatcher's lock and never wait for a booking, a free or
//! a first token.
//!
//! - [`Board`] is that read model; the `left-right` crate keeps two copies
//!   of it, as it does for the prefix index
//!   ([`crate::index::published`]): the [`BoardWriter`] applies every
//!   change to one while routes read the other, and swaps them once no
//!   route is left in the old one. A route never waits; the writer waits
//!   for routes instead (a few microseconds at most), and every change is
//!   applied to both copies.
//! - The changes are the write model's own ([`SequenceChange`], journaled
//!   by [`ActiveSequences`](crate::sequences::ActiveSequences) in the
//!   order they happened), the router's per-worker state and the
//!   estimator's fits ([`LoadChange`]). The driver takes them from the
//!   router before it lets go of the dispatcher's lock
//!   ([`super::Router::take_load_changes`]), so they stay in order, and
//!   applies them after, so that applying them never holds that lock.
//!   Nothing on the board is decided here: it is a copy.
//! - [`PreRouter`] routes on it: the same index read and the same
//!   candidate building as the router's own route (`super::route`), with
//!   a selector of its own. Its answer is a [`Proposal`]: the dispatcher
//!   uses it when it places the request at once and the worker may still
//!   take it, and routes under its lock otherwise
//!   ([`crate::dispatch::Dispatcher::submit_proposed`]).
//! - What a route reads may be torn (one worker's load newer than
//!   another's) and a booking made meanwhile by another thread is not
//!   seen: load is advisory, as it is between router replicas.
//! - Cost: each booking's and free's prompt-block counts are changed twice
//!   more (once per copy), about 20,000 instructions a request at 64-block
//!   prompts (`bench contention` under callgrind). The simulator keeps no
//!   board: one thread, nothing to wait for.

use super::route::{Loads, RouteScratch};
use super::{RouterConfig, WorkerSlot};
use crate::adapters::AdapterTable;
use crate::estimate::{EstimatorConfig, Fit, Fits};
use crate::index::TieredIndex;
use crate::maps::FxHashMap;
use crate::select::{build_selector, Candidate, Decision, RoutingRequest, SelectOutcome, Selector};
use crate::sequences::{active_depth, count_blocks, uncount_blocks, SequenceChange, WorkerLoad};
use crate::types::{LocalHash, SequenceHash, WorkerId};
use left_right::{Absorb, ReadHandle, ReadHandleFactory, WriteHandle};
use std::sync::atomic::{AtomicU64, Ordering};

/// One worker on the board.
#[derive(Clone, Debug)]
struct BoardSlot {
    load: WorkerLoad,
    /// Capacity, recent writes, selectability (`None` until the router
    /// sets them).
    worker: Option<WorkerSlot>,
    fit: Option<Fit>,
    /// Active requests holding each prompt block, as the write model
    /// counts them.
    refs: FxHashMap<SequenceHash, u32>,
}

/// The routes' read model of every worker's load, by registry slot.
#[derive(Clone, Debug, Default)]
pub struct Board {
    slots: Vec<Option<BoardSlot>>,
    by_worker: FxHashMap<WorkerId, usize>,
    /// Workers with a fit: while none has one, pricing a prefill looks
    /// nothing up.
    fitted: usize,
}

/// A change to the loads, on its way from the router
/// ([`super::Router::take_load_changes`]) to the board's writer
/// ([`BoardWriter::apply`]).
#[derive(Debug)]
pub struct LoadChange(pub(crate) BoardOp);

/// A change to the board, applied to both copies in turn.
#[derive(Debug)]
pub(crate) enum BoardOp {
    /// The write model's.
    Sequences(SequenceChange),
    /// The router's state of the worker in `slot`.
    Worker(usize, WorkerSlot),
    /// The estimator's fit for `worker`.
    Fit(WorkerId, Option<Fit>),
}

impl Board {
    fn apply(&mut self, op: &BoardOp) {
        match op {
            BoardOp::Sequences(SequenceChange::Load { slot, load }) => {
                if self.slots.len() <= *slot {
                    self.slots.resize_with(slot + 1, || None);
                }
                match &mut self.slots[*slot] {
                    Some(known) if known.load.worker == load.worker => known.load = *load,
                    other => {
                        if let Some(old) = other.take() {
                            self.by_worker.remove(&old.load.worker);
                            self.fitted -= usize::from(old.fit.is_some());
                        }
                        *other = Some(BoardSlot {
                            load: *load,
                            worker: None,
                            fit: None,
                            refs: FxHashMap::default(),
                        });
                        self.by_worker.insert(load.worker, *slot);
                    }
                }
            }
            BoardOp::Sequences(SequenceChange::AddBlocks { slot, blocks }) => {
                if let Some(known) = self.slot_mut(*slot) {
                    count_blocks(&mut known.refs, blocks);
                }
            }
            BoardOp::Sequences(SequenceChange::FreeBlocks { slot, blocks }) => {
                if let Some(known) = self.slot_mut(*slot) {
                    uncount_blocks(&mut known.refs, blocks);
                    if known.refs.is_empty() {
                        // Give memory back after a burst, as the write
                        // model does.
                        known.refs.shrink_to(64);
                    }
                }
            }
            BoardOp::Sequences(SequenceChange::Removed { slot }) => {
                if let Some(old) = self.slots.get_mut(*slot).and_then(Option::take) {
                    self.by_worker.remove(&old.load.worker);
                    self.fitted -= usize::from(old.fit.is_some());
                }
            }
            BoardOp::Worker(slot, state) => {
                if let Some(known) = self.slot_mut(*slot) {
                    known.worker = Some(*state);
                }
            }
            BoardOp::Fit(worker, fit) => {
                if let Some(&slot) = self.by_worker.get(worker) {
                    if let Some(known) = self.slot_mut(slot) {
                        let had = known.fit.is_some();
                        known.fit = *fit;
                        self.fitted = self.fitted + usize::from(fit.is_some()) - usize::from(had);
                    }
                }
            }
        }
    }

    fn slot_mut(&mut self, slot: usize) -> Option<&mut BoardSlot> {
        self.slots.get_mut(slot)?.as_mut()
    }

    fn slot(&self, slot: usize) -> Option<&BoardSlot> {
        self.slots.get(slot)?.as_ref()
    }
}

impl Absorb<LoadChange> for Board {
    fn absorb_first(&mut self, change: &mut LoadChange, _: &Self) {
        self.apply(&change.0);
    }

    fn sync_with(&mut self, first: &Self) {
        self.clone_from(first);
    }
}

impl Loads for Board {
    fn slot_count(&self) -> usize {
        self.slots.len()
    }

    fn load(&self, slot: usize) -> Option<&WorkerLoad> {
        self.slot(slot).map(|s| &s.load)
    }

    fn worker(&self, slot: usize) -> Option<&WorkerSlot> {
        self.slot(slot)?.worker.as_ref()
    }

    fn slot_of(&self, worker: WorkerId) -> Option<usize> {
        self.by_worker.get(&worker).copied()
    }

    fn active_depths(
        &self,
        blocks: &[LocalHash],
        chain: &mut Vec<SequenceHash>,
        each: &mut dyn FnMut(usize, u32),
    ) {
        chain.clear();
        for (slot, known) in self.slots.iter().enumerate() {
            let Some(known) = known else { continue };
            if let Some(depth) = active_depth(&known.refs, blocks, chain) {
                each(slot, depth);
            }
        }
    }
}

/// The estimator as the board knows it: its settings and each worker's
/// fit.
struct BoardPrefill<'a> {
    config: &'a EstimatorConfig,
    board: &'a Board,
}

impl Fits for BoardPrefill<'_> {
    fn settings(&self) -> &EstimatorConfig {
        self.config
    }

    fn fit_of(&self, worker: WorkerId) -> Option<Fit> {
        if self.board.fitted == 0 {
            return None;
        }
        self.board.slot(self.board.slot_of(worker)?)?.fit
    }
}

/// The board's writing side (one; `Send`, not shared: the driver keeps it
/// behind a lock of its own, so that applying changes never holds the
/// dispatcher's).
pub struct BoardWriter {
    handle: WriteHandle<Board, LoadChange>,
}

impl std::fmt::Debug for BoardWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoardWriter").finish_non_exhaustive()
    }
}

impl BoardWriter {
    /// Applies `changes` (in the order the router made them; emptied) and
    /// makes them visible to routes. Waits for routes still reading the
    /// copy it is about to change, never the other way round.
    pub fn apply(&mut self, changes: &mut Vec<LoadChange>) {
        if changes.is_empty() {
            return;
        }
        self.handle.extend(changes.drain(..));
        self.handle.publish();
    }
}

/// An empty board's writer and a factory of its readers.
pub(crate) fn board() -> (BoardWriter, ReadHandleFactory<Board>) {
    let (mut handle, reader) = left_right::new_from_empty(Board::default());
    handle.publish();
    (BoardWriter { handle }, reader.factory())
}

/// A route made outside the dispatcher's lock: the decision and the
/// candidate it chose, as they were on the board.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Proposal {
    /// The decision.
    pub decision: Decision,
    /// The chosen worker as the route saw it (for the estimator's sample).
    pub candidate: Candidate,
}

/// Everything needed to route outside the dispatcher's lock, shared by
/// every placing thread ([`crate::dispatch::Dispatcher::pre_routes`]);
/// each takes a [`PreRouter`] of its own from it.
pub struct PreRoutes {
    index: ReadHandleFactory<TieredIndex>,
    board: ReadHandleFactory<Board>,
    config: RouterConfig,
    estimator: EstimatorConfig,
    /// Seeds each new pre-router's selector differently.
    made: AtomicU64,
}

impl std::fmt::Debug for PreRoutes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreRoutes")
            .field("policy", &self.config.policy)
            .finish_non_exhaustive()
    }
}

impl PreRoutes {
    pub(crate) fn new(
        index: ReadHandleFactory<TieredIndex>,
        board: ReadHandleFactory<Board>,
        config: RouterConfig,
        estimator: EstimatorConfig,
    ) -> Self {
        Self {
            index,
            board,
            config,
            estimator,
            made: AtomicU64::new(0),
        }
    }

    /// A pre-router of its own for one placing thread.
    pub fn router(&self) -> PreRouter {
        let n = self.made.fetch_add(1, Ordering::Relaxed);
        let seed = self
            .config
            .seed
            .wrapping_add(n.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        PreRouter {
            index: self.index.handle(),
            board: self.board.handle(),
            selector: build_selector(self.config.policy, &self.config.policies, seed)
                .expect("the router's own policy settings were validated"),
            config: self.config,
            estimator: self.estimator,
            adapters: AdapterTable::new(self.config.adapters),
            scratch: RouteScratch::default(),
        }
    }
}

/// One placing thread's router over the published index and board
/// (`Send`, not shared).
pub struct PreRouter {
    index: ReadHandle<TieredIndex>,
    board: ReadHandle<Board>,
    selector: Box<dyn Selector>,
    config: RouterConfig,
    estimator: EstimatorConfig,
    /// Empty: requests for an adapter are routed under the lock.
    adapters: AdapterTable,
    scratch: RouteScratch,
}

impl std::fmt::Debug for PreRouter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreRouter").finish_non_exhaustive()
    }
}

impl PreRouter {
    /// The candidates of the last route, as the board showed them.
    pub fn last_candidates(&self) -> &[Candidate] {
        &self.scratch.candidates
    }

    /// Routes `request` among `eligible` (every worker when `None`) on the
    /// published index and board, never waiting for a writer. `None` for
    /// what must be routed under the lock: a request for an adapter
    /// (which workers hold it changes with every placement), one whose
    /// model names another policy, and a route that chose no worker.
    pub fn route(
        &mut self,
        request: RoutingRequest<'_>,
        eligible: Option<&[WorkerId]>,
        now_ms: f64,
    ) -> Option<Proposal> {
        if request.adapter.is_some()
            || request
                .model
                .policy
                .is_some_and(|p| p != self.config.policy)
        {
            return None;
        }
        let board = self.board.enter()?;
        let scratch = &mut self.scratch;
        {
            let index = self.index.enter()?;
            scratch.read_index(request.blocks, &*board, index.device(), Some(&index));
        }
        let prefill = BoardPrefill {
            config: &self.estimator,
            board: &board,
        };
        let outcome = scratch.select(
            request,
            eligible,
            &*board,
            &self.config,
            &self.adapters,
            &mut *self.selector,
            &prefill,
            now_ms,
        );
        let SelectOutcome::Selected(decision) = outcome else {
            return None;
        };
        let candidate = *scratch
            .candidates
            .iter()
            .find(|c| c.worker == decision.worker)?;
        Some(Proposal {
            decision,
            candidate,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::{CacheTier, IndexEvent, StoredBlock};
    use crate::router::{Router, WorkerCapacity};
    use crate::select::{ModelSettings, PrefillTime};
    use crate::sequences::AddRequest;
    use crate::types::{EngineHash, RequestId};
    use proptest::prelude::*;

    fn w(id: u64) -> WorkerId {
        WorkerId::new(id)
    }

    /// A prompt: the first `len` blocks of one of a few shared chains.
    fn blocks(chain: u64, len: u64) -> Vec<LocalHash> {
        (0..len).map(|i| LocalHash(chain * 1_000 + i)).collect()
    }

    fn capacity(kv: bool) -> WorkerCapacity {
        WorkerCapacity {
            max_num_batched_tokens: Some(4096),
            kv_blocks: kv.then_some(64),
            kv_tokens: kv.then_some(64 * 16),
            block_size: None,
        }
    }

    /// A router with its index and loads published, and a pre-router.
    struct Published {
        router: Router,
        index: crate::index::published::IndexWriter,
        board: BoardWriter,
        pre: PreRouter,
    }

    impl Published {
        fn new() -> Self {
            let mut router = Router::new(RouterConfig::default()).unwrap();
            let index = router.publish_index().unwrap();
            let (routes, board) = router
                .pre_routes(&EstimatorConfig::default(), std::iter::empty())
                .unwrap();
            let pre = routes.router();
            Self {
                router,
                index,
                board,
                pre,
            }
        }

        /// The router's changes to the loads so far, applied to the board.
        fn publish(&mut self) {
            let mut changes = Vec::new();
            self.router.take_load_changes(&mut changes);
            self.board.apply(&mut changes);
        }
    }

    fn routing(blocks: &[LocalHash]) -> RoutingRequest<'_> {
        RoutingRequest {
            prompt_tokens: blocks.len() as u32 * 16 + 5,
            blocks,
            adapter: None,
            model: ModelSettings::default(),
            headroom: 0.0,
        }
    }

    /// The candidates of a route under the lock and of one on the board.
    fn both(
        router: &mut Router,
        pre: &mut PreRouter,
        blocks: &[LocalHash],
        now: f64,
    ) -> (Vec<Candidate>, Vec<Candidate>) {
        let _ = router.route_with(routing(blocks), None, &EstimatorConfig::default(), now);
        let _ = pre.route(routing(blocks), None, now);
        (
            router.scratch.candidates.clone(),
            pre.scratch.candidates.clone(),
        )
    }

    #[derive(Clone, Debug)]
    enum Op {
        AddWorker(u64, bool),
        RemoveWorker(u64),
        Selectable(u64, bool),
        Book(u128, u64, u64, u64, u32),
        Mark(u128),
        Free(u128),
        Expire,
        Stored(u64, u64, u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (1..6u64, any::<bool>()).prop_map(|(k, kv)| Op::AddWorker(k, kv)),
            (1..6u64).prop_map(Op::RemoveWorker),
            (1..6u64, any::<bool>()).prop_map(|(k, s)| Op::Selectable(k, s)),
            (0..40u128, 1..6u64, 0..3u64, 1..8u64, 0..4u32)
                .prop_map(|(id, k, c, len, o)| Op::Book(id, k, c, len, o)),
            (0..40u128).prop_map(Op::Mark),
            (0..40u128).prop_map(Op::Free),
            Just(Op::Expire),
            (1..6u64, 0..3u64, 1..8u64).prop_map(|(k, c, len)| Op::Stored(k, c, len)),
        ]
    }

    proptest! {
        /// One truth: whatever the router's loads went through, a route on
        /// the published board builds exactly the candidates the router's
        /// own route builds from its write model, once published.
        #[test]
        fn a_route_on_the_board_sees_what_the_routers_own_route_sees(
            ops in proptest::collection::vec(op(), 1..60),
            publish_every in 1..5usize,
        ) {
            let mut p = Published::new();
            let mut now = 0.0;
            for (i, op) in ops.iter().enumerate() {
                // Bookings' prefills (50 ms expected) are still running at
                // the next few steps.
                now += 10.0;
                match *op {
                    Op::AddWorker(k, kv) => p.router.add_worker(w(k), capacity(kv)),
                    Op::RemoveWorker(k) => {
                        p.router.remove_worker(w(k));
                        p.index.remove_worker(w(k));
                    }
                    Op::Selectable(k, s) => p.router.set_selectable(w(k), s),
                    Op::Book(id, k, c, len, overlap) => {
                        let _ = p.router.book_request(
                            &AddRequest {
                                request: RequestId(id),
                                worker: w(k),
                                prompt_tokens: len as u32 * 16 + 3,
                                blocks: blocks(c, len),
                                overlap_blocks: overlap,
                                expected_prefill_ms: Some(50.0),
                            },
                            now,
                        );
                    }
                    Op::Mark(id) => {
                        let _ = p.router.mark_prefill_completed(RequestId(id), now);
                    }
                    Op::Free(id) => {
                        let _ = p.router.free(RequestId(id), now);
                    }
                    Op::Expire => {
                        let _ = p.router.expire(now + 400_000.0);
                    }
                    Op::Stored(k, c, len) => p.index.apply(
                        w(k),
                        CacheTier::Device,
                        &IndexEvent::Stored {
                            parent: None,
                            blocks: blocks(c, len)
                                .into_iter()
                                .map(|b| StoredBlock {
                                    engine_hash: EngineHash(b.0),
                                    local_hash: b,
                                })
                                .collect(),
                        },
                    ),
                }
                if i % publish_every == 0 || i + 1 == ops.len() {
                    p.publish();
                    for (c, len) in [(0, 7), (1, 3), (2, 1)] {
                        let (own, board) = both(&mut p.router, &mut p.pre, &blocks(c, len), now);
                        prop_assert_eq!(own, board);
                    }
                }
            }
        }
    }

    #[test]
    fn a_route_sees_the_loads_as_last_published_and_never_waits_for_the_writer() {
        let mut p = Published::new();
        p.router.add_worker(w(1), capacity(true));
        p.router.add_worker(w(2), capacity(true));
        p.publish();
        let booked = AddRequest {
            request: RequestId(1),
            worker: w(1),
            prompt_tokens: 16 * 4,
            blocks: blocks(0, 4),
            overlap_blocks: 0,
            expected_prefill_ms: None,
        };
        assert_eq!(
            p.router.book_request(&booked, 0.0),
            crate::sequences::LifecycleOutcome::Applied
        );
        // Booked but not yet published: the board still has worker 1 idle.
        let _ = p.pre.route(routing(&blocks(0, 4)), None, 0.0);
        let one = |pre: &PreRouter| {
            *pre.scratch
                .candidates
                .iter()
                .find(|c| c.worker == w(1))
                .unwrap()
        };
        assert_eq!(
            (
                one(&p.pre).active_requests,
                one(&p.pre).active_prompt_blocks
            ),
            (0, 0)
        );
        p.publish();
        let _ = p.pre.route(routing(&blocks(0, 4)), None, 0.0).unwrap();
        assert_eq!(
            (
                one(&p.pre).active_requests,
                one(&p.pre).active_prompt_blocks
            ),
            (1, 4)
        );
        // The fresh booking's prefill makes worker 1 the slower choice for
        // another prompt.
        let other = p.pre.route(routing(&blocks(100, 4)), None, 0.0).unwrap();
        assert_eq!(other.decision.worker, w(2));
        assert_eq!(other.candidate.worker, w(2));
    }

    #[test]
    fn a_route_on_the_board_prices_prefills_with_the_estimators_fits() {
        let mut p = Published::new();
        p.router.add_worker(w(1), capacity(true));
        p.router.add_worker(w(2), capacity(true));
        let fit = Fit {
            scale: 3.0,
            offset_ms: 7.0,
            samples: 20,
        };
        p.router.post_fit(w(1), Some(fit));
        p.publish();
        let config = EstimatorConfig::default();
        let board = p.pre.board.enter().unwrap();
        let prefill = BoardPrefill {
            config: &config,
            board: &board,
        };
        assert_eq!(
            prefill.prefill_ms(w(1), 1_000),
            3.0 * config.model_ms(1_000) + 7.0
        );
        assert_eq!(prefill.prefill_ms(w(2), 1_000), config.model_ms(1_000));
        assert_eq!(
            prefill.decode_step_ms(w(1), 0.5),
            3.0 * config.decode_model_ms(0.5)
        );
    }

    #[test]
    fn requests_for_an_adapter_or_another_policy_are_left_to_the_lock() {
        let mut p = Published::new();
        p.router.add_worker(w(1), capacity(true));
        p.publish();
        let pre = &mut p.pre;
        let prompt = blocks(0, 2);
        let mut adapter = routing(&prompt);
        adapter.adapter = Some("sql-lora");
        assert!(pre.route(adapter, None, 0.0).is_none());
        let mut other = routing(&prompt);
        other.model.policy = Some(crate::select::PolicyKind::Kv);
        assert!(pre.route(other, None, 0.0).is_none());
        assert!(pre.route(routing(&prompt), None, 0.0).is_some());
    }

    #[test]
    fn only_policies_without_state_route_outside_the_lock() {
        for policy in crate::select::PolicyKind::ALL {
            let mut router = Router::new(RouterConfig {
                policy,
                ..RouterConfig::default()
            })
            .unwrap();
            assert!(
                router
                    .pre_routes(&EstimatorConfig::default(), std::iter::empty())
                    .is_none(),
                "{policy:?}: the index is not published yet"
            );
            let _index = router.publish_index().unwrap();
            let routes = router.pre_routes(&EstimatorConfig::default(), std::iter::empty());
            assert_eq!(routes.is_some(), policy.keeps_no_state(), "{policy:?}");
        }
    }
}
