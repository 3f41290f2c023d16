//! [`AdmissionController`]: the one value a driver calls for admission.
//!
//! How a driver drives it (the server and the simulator alike):
//!
//! 1. On arrival: [`AdmissionController::submit`] with the request's facts.
//!    `Rejected { retry_after_ms }` maps to HTTP 429 with `Retry-After`.
//!    Otherwise the request waits (ready or deferred); the driver keeps the
//!    payload under its id.
//! 2. After every submit, every `Router::mark_prefill_completed`/`free`,
//!    every `complete`/`abort`, and at [`AdmissionController::next_wakeup_ms`]
//!    (after calling [`AdmissionController::tick`]): call
//!    [`AdmissionController::poll`] with a closure that routes one request
//!    (`Router::route` with the payload's blocks, restricted to the
//!    placement's worker for `Exact`) and, when a worker is selected, books
//!    it at once (`Router::book`) so the next decision of the same poll sees
//!    the load. Each [`Placed::Selected`] carries a [`ResponseTicket`]; the
//!    driver sends the request and calls
//!    [`AdmissionController::dispatched`] (or `abort`s the ticket and frees
//!    the booking if sending fails). A
//!    [`Placed::NoWorkers`] has already ended; answer 503.
//! 3. The response path holds the ticket, updates its progress per token,
//!    and ends with [`AdmissionController::complete`] or
//!    [`AdmissionController::abort`] (client gone, worker error).
//! 4. A client that gives up while waiting: [`AdmissionController::cancel`].
//!
//! Without a strategy, no lifecycle record and no progress handle is ever
//! created: tickets are untracked and `dispatched`/`complete`/`abort` are
//! no-ops.

use super::lifecycle::{InvalidTransition, ResponseTicket, Stage, TransitionOutcome};
use super::progress::{progress_pair, ProgressReader};
use super::queue::{
    Demand, PolicyQueue, QueueConfig, QueueConfigError, QueueCounters, ShedReason, WaitState,
};
use super::tenants::{FlowConfig, FlowConfigError, FlowPolicy, TenantId};
use super::{
    Admission, AdmissionStrategy, Fallback, KvUsage, LifecycleEvent, MakeReady, Placement,
    RequestFacts, Unavailable,
};
use crate::maps::FxHashMap;
use crate::select::{Decision, SelectOutcome};
use crate::types::{RequestId, WorkerId};
use serde::{Deserialize, Serialize};

/// Settings of an [`AdmissionController`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    /// The policy queue.
    pub queue: QueueConfig,
    /// Most tracked requests (lifecycle records) at once; beyond it new
    /// requests are refused with a retry-after.
    pub max_tracked: usize,
    /// Tenants and priority bands. Not read from a configuration file
    /// with the queue's settings: `serve` takes them from its `[flow]`,
    /// `replay` from its `--tenants` mix.
    #[serde(skip)]
    pub flow: FlowConfig,
}

impl Default for AdmissionConfig {
    fn default() -> Self {
        Self {
            queue: QueueConfig::default(),
            max_tracked: 65_536,
            flow: FlowConfig::default(),
        }
    }
}

/// Why an [`AdmissionConfig`] was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum AdmissionConfigError {
    /// A queue setting.
    #[error(transparent)]
    Queue(#[from] QueueConfigError),
    /// A record cap of zero.
    #[error("max_tracked must be at least 1")]
    MaxTracked,
    /// A tenant or band setting.
    #[error("flow control: {0}")]
    Flow(#[from] FlowConfigError),
}

impl AdmissionConfig {
    /// Checks every part.
    pub fn validate(&self) -> Result<(), AdmissionConfigError> {
        self.queue.validate()?;
        if self.max_tracked == 0 {
            return Err(AdmissionConfigError::MaxTracked);
        }
        FlowPolicy::new(self.flow.clone())?;
        Ok(())
    }
}

/// Why a request was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RejectReason {
    /// Its queue class is at a limit.
    QueueFull,
    /// The lifecycle-record cap is reached.
    TrackingFull,
}

/// What [`AdmissionController::submit`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SubmitOutcome {
    /// In the ready queue: the next [`AdmissionController::poll`] offers it.
    Queued,
    /// Held by the strategy until it makes the request ready.
    Deferred,
    /// Refused: answer 429 with `Retry-After`. Nothing was retained.
    Rejected {
        /// Why.
        reason: RejectReason,
        /// Suggested `Retry-After`.
        retry_after_ms: u64,
    },
    /// The id is already waiting or tracked: nothing changed.
    Duplicate,
}

/// One result of [`AdmissionController::poll`].
#[derive(Debug)]
pub enum Placed {
    /// A worker was chosen. Book, send, then call `dispatched`.
    Selected {
        /// The right to end the request.
        ticket: ResponseTicket,
        /// The selector's decision (for `Router::book`).
        decision: Decision,
        /// Time spent waiting in the queue.
        waited_ms: f64,
    },
    /// No worker can ever take it; it has ended (answer 503).
    NoWorkers {
        /// The request.
        id: RequestId,
    },
}

/// What [`AdmissionController::cancel`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CancelOutcome {
    /// It was waiting and has left.
    Removed,
    /// It was already selected: the ticket holder owns its cancellation.
    OwnedByTicket,
    /// Not waiting here.
    Unknown,
}

/// Controller counters beyond the queue's; they only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct AdmissionCounters {
    /// `Bypass` answers.
    pub bypassed: u64,
    /// `Ready` answers.
    pub admitted_ready: u64,
    /// `Defer` answers.
    pub admitted_deferred: u64,
    /// Refusals at the record cap.
    pub rejected_tracking: u64,
    /// `MakeReady` for requests that were not deferred.
    pub stale_actions: u64,
    /// `Exact` placements that fell back.
    pub fallbacks: u64,
    /// Requests that found no eligible worker.
    pub no_workers: u64,
    /// Duplicate submits.
    pub duplicates: u64,
    /// `Reconcile` events sent.
    pub reconciles: u64,
    /// Dispatched requests put back in the queue after their worker failed
    /// them (migration).
    pub requeued: u64,
    /// Progress pairs created (zero without a strategy).
    pub progress_handles: u64,
}

#[derive(Debug)]
struct Record {
    stage: Stage,
    /// From selection until `Dispatched` hands it to the strategy.
    reader: Option<ProgressReader>,
}

/// Admission for one router: the policy queue, an optional strategy, and
/// the lifecycle records of the requests it tracks.
pub struct AdmissionController<S: AdmissionStrategy = Box<dyn AdmissionStrategy + Send>> {
    queue: PolicyQueue,
    strategy: Option<S>,
    max_tracked: usize,
    /// One per tracked request, from admission to its terminal event; only
    /// ever written when a strategy is configured.
    records: FxHashMap<RequestId, Record>,
    actions: Vec<MakeReady>,
    parked: Vec<RequestId>,
    last_reconcile_ms: Option<f64>,
    last_poll_ms: f64,
    counters: AdmissionCounters,
}

impl<S: AdmissionStrategy> std::fmt::Debug for AdmissionController<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdmissionController")
            .field("strategy", &self.strategy.as_ref().map(|s| s.name()))
            .field("waiting", &self.queue.len())
            .field("tracked", &self.records.len())
            .finish_non_exhaustive()
    }
}

impl AdmissionController {
    /// A controller with the policy queue only.
    pub fn without_strategy(config: AdmissionConfig) -> Result<Self, AdmissionConfigError> {
        Self::new(config, None)
    }
}

impl<S: AdmissionStrategy> AdmissionController<S> {
    /// A controller; `config` must validate.
    pub fn new(config: AdmissionConfig, strategy: Option<S>) -> Result<Self, AdmissionConfigError> {
        config.validate()?;
        Ok(Self {
            max_tracked: config.max_tracked,
            queue: PolicyQueue::with_flows(config.queue, FlowPolicy::new(config.flow)?)?,
            strategy,
            records: FxHashMap::default(),
            actions: Vec::new(),
            parked: Vec::new(),
            last_reconcile_ms: None,
            last_poll_ms: 0.0,
            counters: AdmissionCounters::default(),
        })
    }

    /// The strategy, when one is configured.
    pub fn strategy(&self) -> Option<&S> {
        self.strategy.as_ref()
    }

    /// The strategy, mutably (say, to inspect or adjust it between calls).
    pub fn strategy_mut(&mut self) -> Option<&mut S> {
        self.strategy.as_mut()
    }

    /// The policy queue (read-only).
    pub fn queue(&self) -> &PolicyQueue {
        &self.queue
    }

    /// The tenants and bands the queue shares by.
    pub fn flows(&self) -> &FlowPolicy {
        self.queue.flows()
    }

    /// Queue counters.
    pub fn queue_counters(&self) -> &QueueCounters {
        self.queue.counters()
    }

    /// Controller counters.
    pub fn counters(&self) -> &AdmissionCounters {
        &self.counters
    }

    /// Lifecycle records alive (always zero without a strategy).
    pub fn tracked_records(&self) -> usize {
        self.records.len()
    }

    /// Heap bytes held by the controller's own structures.
    pub fn heap_bytes(&self) -> usize {
        self.queue.heap_bytes()
            + crate::maps::map_bytes(&self.records)
            + self.actions.capacity() * std::mem::size_of::<MakeReady>()
            + self.parked.capacity() * std::mem::size_of::<RequestId>()
    }

    /// Accepts a request into the queue, asking the strategy first.
    pub fn submit(&mut self, facts: &RequestFacts<'_>) -> SubmitOutcome {
        if self.queue.contains(facts.id) || self.records.contains_key(&facts.id) {
            self.counters.duplicates += 1;
            return SubmitOutcome::Duplicate;
        }
        if !self.queue.has_room(facts.class, facts.uncached_tokens) {
            self.queue.count_rejection_of(facts.flow);
            return SubmitOutcome::Rejected {
                reason: RejectReason::QueueFull,
                retry_after_ms: self.queue.retry_after_ms(),
            };
        }
        let admission = match &mut self.strategy {
            None => Admission::Bypass,
            Some(strategy) => {
                if self.records.len() >= self.max_tracked {
                    self.counters.rejected_tracking += 1;
                    return SubmitOutcome::Rejected {
                        reason: RejectReason::TrackingFull,
                        retry_after_ms: self.queue.retry_after_ms(),
                    };
                }
                strategy.admit(facts)
            }
        };
        let state = match admission {
            Admission::Bypass => {
                self.counters.bypassed += 1;
                WaitState::Ready(Placement::Any)
            }
            Admission::Ready(placement) => {
                self.counters.admitted_ready += 1;
                WaitState::Ready(placement)
            }
            Admission::Defer => {
                self.counters.admitted_deferred += 1;
                WaitState::Deferred
            }
        };
        if admission != Admission::Bypass {
            self.records.insert(
                facts.id,
                Record {
                    stage: Stage::Pending,
                    reader: None,
                },
            );
        }
        self.queue.push_flow(
            facts.id,
            facts.class,
            facts.uncached_tokens,
            facts.flow,
            state,
            facts.now_ms,
        );
        match state {
            WaitState::Deferred => SubmitOutcome::Deferred,
            WaitState::Ready(_) => SubmitOutcome::Queued,
        }
    }

    /// Offers ready requests, in queue order, to `try_place`, which routes
    /// one request (the driver looks up its payload by id), books it on the
    /// router when a worker is selected, and returns the selector's outcome. Results are appended to `out`. A poll stops after
    /// `busy_probe_limit` consecutive "all busy" answers; busy requests keep
    /// their place.
    pub fn poll<F>(&mut self, now_ms: f64, out: &mut Vec<Placed>, mut try_place: F)
    where
        F: FnMut(RequestId, Placement) -> SelectOutcome,
    {
        self.poll_charging(now_ms, out, |id, placement, _| {
            (try_place(id, placement), None)
        });
    }

    /// [`Self::poll`] whose `try_place` also says, for a selected
    /// request, its prompt tokens the chosen worker has not cached: what
    /// its tenant is charged (with its expected output) in the fair
    /// share; `None` charges its prompt tokens as submitted. It is told
    /// the request's tenant's [`Demand`] (always within its share unless
    /// `reserve_for_light_tenants` is set).
    pub fn poll_charging<F>(&mut self, now_ms: f64, out: &mut Vec<Placed>, mut try_place: F)
    where
        F: FnMut(RequestId, Placement, Demand) -> (SelectOutcome, Option<u32>),
    {
        let weigh_demand = self.queue.flows().config().reserve_for_light_tenants > 0.0;
        self.last_poll_ms = now_ms;
        let mut busy_streak = 0;
        while busy_streak < self.queue.config().busy_probe_limit {
            let Some(popped) = self.queue.pop() else {
                break;
            };
            let id = popped.id;
            let mut placement = popped.placement;
            let demand = if weigh_demand {
                self.queue.demand(popped.tenant, now_ms)
            } else {
                Demand::WithinShare
            };
            loop {
                let (outcome, uncached) = try_place(id, placement, demand);
                let why = match outcome {
                    SelectOutcome::Selected(decision) => {
                        busy_streak = 0;
                        self.queue.dispatch_charged(id, now_ms, uncached);
                        let ticket = self.select(id, decision.worker);
                        out.push(Placed::Selected {
                            ticket,
                            decision,
                            waited_ms: (now_ms - popped.enqueued_ms).max(0.0),
                        });
                        break;
                    }
                    SelectOutcome::AllBusy => Unavailable::Busy,
                    SelectOutcome::NoWorkers => Unavailable::Invalid,
                };
                let fallback = match (placement, &mut self.strategy) {
                    (Placement::Exact(worker), Some(strategy)) => {
                        strategy.on_unavailable(id, worker, why)
                    }
                    (Placement::Exact(_), None) => Fallback::Any,
                    (Placement::Any, _) => match why {
                        Unavailable::Busy => Fallback::Wait,
                        Unavailable::Invalid => Fallback::Abort,
                    },
                };
                match fallback {
                    Fallback::Any if placement != Placement::Any => {
                        self.counters.fallbacks += 1;
                        placement = Placement::Any;
                        self.queue.set_placement(id, placement);
                    }
                    Fallback::Wait | Fallback::Any => {
                        // Held back by the light tenants' reserve with
                        // every worker open to it: so would the rest of
                        // its tenant's requests be in this poll, while a
                        // lighter tenant's may still fit.
                        if demand == Demand::OverShare
                            && why == Unavailable::Busy
                            && placement == Placement::Any
                        {
                            self.queue.hold(popped.tenant);
                        }
                        busy_streak += 1;
                        self.parked.push(id);
                        break;
                    }
                    Fallback::Abort => {
                        self.counters.no_workers += 1;
                        self.queue.remove(id);
                        self.end(id, Stage::Aborted, None, now_ms);
                        out.push(Placed::NoWorkers { id });
                        break;
                    }
                }
            }
        }
        for id in self.parked.drain(..) {
            self.queue.put_back(id);
        }
        self.queue.clear_holds();
    }

    /// Pending → selected: the ticket (with a progress updater when tracked).
    fn select(&mut self, id: RequestId, worker: WorkerId) -> ResponseTicket {
        match self.records.get_mut(&id) {
            Some(record) => {
                let (updater, reader) = progress_pair();
                self.counters.progress_handles += 1;
                record.stage = Stage::Selected;
                record.reader = Some(reader);
                ResponseTicket {
                    id,
                    worker,
                    tracked: true,
                    progress: Some(updater),
                }
            }
            None => ResponseTicket {
                id,
                worker,
                tracked: false,
                progress: None,
            },
        }
    }

    /// The selected request was sent to its worker.
    pub fn dispatched(&mut self, ticket: &ResponseTicket, now_ms: f64) -> TransitionOutcome {
        if !ticket.tracked {
            return TransitionOutcome::Untracked;
        }
        let Some(record) = self.records.get_mut(&ticket.id) else {
            return TransitionOutcome::Unknown;
        };
        if record.stage == Stage::Dispatched {
            return TransitionOutcome::Duplicate;
        }
        debug_assert!(record.stage.can_become(Stage::Dispatched));
        record.stage = Stage::Dispatched;
        let progress = record
            .reader
            .take()
            .expect("a selected record holds its progress reader until dispatch");
        let event = LifecycleEvent::Dispatched {
            id: ticket.id,
            worker: ticket.worker,
            progress,
        };
        self.deliver(&event, now_ms);
        TransitionOutcome::Applied
    }

    /// The request finished; `context_tokens` is prompt plus generated.
    /// Completing a request that was never dispatched is refused and the
    /// ticket returned.
    pub fn complete(
        &mut self,
        ticket: ResponseTicket,
        context_tokens: u64,
        now_ms: f64,
    ) -> Result<TransitionOutcome, InvalidTransition> {
        if !ticket.tracked {
            return Ok(TransitionOutcome::Untracked);
        }
        let Some(record) = self.records.get(&ticket.id) else {
            return Ok(TransitionOutcome::Unknown);
        };
        if !record.stage.can_become(Stage::Completed) {
            return Err(InvalidTransition {
                from: record.stage,
                to: Stage::Completed,
                ticket,
            });
        }
        Ok(self.end(ticket.id, Stage::Completed, Some(context_tokens), now_ms))
    }

    /// The selected or dispatched request ended without a result.
    pub fn abort(&mut self, ticket: ResponseTicket, now_ms: f64) -> TransitionOutcome {
        if !ticket.tracked {
            return TransitionOutcome::Untracked;
        }
        self.end(ticket.id, Stage::Aborted, None, now_ms)
    }

    /// The dispatched request's worker failed it: it waits again, ready for
    /// any worker (its strategy hears `Migrating`, and `Dispatched` again
    /// when it is placed), keeping its place as a tracked request — a
    /// session's migrated turn stays its current turn. The ticket is
    /// consumed; the next [`Placed::Selected`] carries a new one. A ticket
    /// of a request that was not dispatched comes back in the error.
    pub fn requeue(
        &mut self,
        ticket: ResponseTicket,
        facts: &RequestFacts<'_>,
    ) -> Result<TransitionOutcome, InvalidTransition> {
        if ticket.tracked {
            let Some(record) = self.records.get_mut(&ticket.id) else {
                return Ok(TransitionOutcome::Unknown);
            };
            if !record.stage.can_become(Stage::Pending) {
                return Err(InvalidTransition {
                    from: record.stage,
                    to: Stage::Pending,
                    ticket,
                });
            }
            record.stage = Stage::Pending;
            record.reader = None;
        }
        self.counters.requeued += 1;
        self.queue.push_flow(
            facts.id,
            facts.class,
            facts.uncached_tokens,
            facts.flow,
            WaitState::Ready(Placement::Any),
            facts.now_ms,
        );
        if ticket.tracked {
            let event = LifecycleEvent::Migrating {
                id: ticket.id,
                from: ticket.worker,
            };
            self.deliver(&event, facts.now_ms);
            Ok(TransitionOutcome::Applied)
        } else {
            Ok(TransitionOutcome::Untracked)
        }
    }

    /// A client gave up on a request that is still waiting: it leaves the
    /// queue at once (O(1)). Once selected, the ticket holder owns it.
    pub fn cancel(&mut self, id: RequestId, now_ms: f64) -> CancelOutcome {
        if self.queue.abandon(id) {
            self.end(id, Stage::Aborted, None, now_ms);
            return CancelOutcome::Removed;
        }
        if self.records.contains_key(&id) {
            CancelOutcome::OwnedByTicket
        } else {
            CancelOutcome::Unknown
        }
    }

    /// A dispatched request of `tenant` ended, or waits again: its tenant
    /// has one fewer in flight (its concurrency cap). The driver calls it
    /// once per placement that ended.
    pub fn release_flow(&mut self, tenant: TenantId) {
        self.queue.release(tenant);
    }

    /// Sheds a waiting request: it leaves the queue at once, counted for
    /// its flow, and ends (aborted, for its strategy). `false` when it
    /// was not waiting.
    pub fn shed(&mut self, id: RequestId, reason: ShedReason, now_ms: f64) -> bool {
        if !self.queue.shed(id, reason) {
            return false;
        }
        self.end(id, Stage::Aborted, None, now_ms);
        true
    }

    /// Counts a request shed before it was queued.
    pub fn count_shed(&mut self, flow: super::Flow, reason: ShedReason) {
        self.queue.count_shed(flow, reason);
    }

    /// Ends a tracked request (terminal event to the strategy); untracked
    /// ids are ignored.
    fn end(
        &mut self,
        id: RequestId,
        stage: Stage,
        context_tokens: Option<u64>,
        now_ms: f64,
    ) -> TransitionOutcome {
        if self.records.remove(&id).is_none() {
            return TransitionOutcome::Unknown;
        }
        let event = match (stage, context_tokens) {
            (Stage::Completed, Some(context_tokens)) => {
                LifecycleEvent::Completed { id, context_tokens }
            }
            _ => LifecycleEvent::Aborted { id },
        };
        self.deliver(&event, now_ms);
        TransitionOutcome::Applied
    }

    /// Sends one event to the strategy and applies its actions.
    fn deliver(&mut self, event: &LifecycleEvent, now_ms: f64) {
        let Some(strategy) = &mut self.strategy else {
            return;
        };
        let mut actions = std::mem::take(&mut self.actions);
        strategy.on_event(event, now_ms, &mut actions);
        for action in actions.drain(..) {
            if !self.queue.make_ready(action.id, action.placement) {
                self.counters.stale_actions += 1;
            }
        }
        self.actions = actions;
    }

    /// Passes the driver's view of a worker's KV cache to the strategy.
    pub fn report_kv(&mut self, worker: WorkerId, usage: KvUsage) {
        if let Some(strategy) = &mut self.strategy {
            strategy.observe_kv(worker, usage);
        }
    }

    /// Sends `Reconcile` to the strategy when it is due. Call it at
    /// [`Self::next_wakeup_ms`], then [`Self::poll`].
    pub fn tick(&mut self, now_ms: f64) {
        let Some(strategy) = &self.strategy else {
            return;
        };
        let due = match self.last_reconcile_ms {
            None => true,
            Some(last) => now_ms >= last + strategy.reconcile_interval_ms(),
        };
        if due {
            self.last_reconcile_ms = Some(now_ms);
            self.counters.reconciles += 1;
            self.deliver(&LifecycleEvent::Reconcile, now_ms);
        }
    }

    /// When the driver must next call [`Self::tick`] and [`Self::poll`]
    /// even if nothing else happens: the strategy's next reconcile, and a
    /// periodic recheck while requests are ready but every worker was busy.
    /// `None` when nothing is due.
    pub fn next_wakeup_ms(&self) -> Option<f64> {
        let reconcile = self
            .strategy
            .as_ref()
            .map(|s| match self.last_reconcile_ms {
                None => 0.0,
                Some(last) => last + s.reconcile_interval_ms(),
            });
        let recheck = (self.queue.ready_len() > 0)
            .then(|| self.last_poll_ms + self.queue.config().recheck_interval_ms);
        match (reconcile, recheck) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}
