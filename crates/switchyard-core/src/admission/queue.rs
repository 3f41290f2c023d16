//! The policy queue: requests waiting for a worker (ready) or for their
//! strategy (deferred), in a configured order, under per-class limits.
//!
//! Storage is one map from request id to its entry (the truth) plus, per
//! (priority band, tenant), a binary heap of ready ids ordered by
//! `(deadline, key, arrival seq)`; [`PolicyQueue::pop`] chooses the band
//! (strict priority) and the tenant (lowest virtual time: a weighted fair
//! share in tokens) before the heap. Removing a request — dispatch, or a
//! client that gave up — is one map removal; its heap entry goes stale and
//! is skipped when popped (O(1) + amortized O(log n)), and the heaps are
//! compacted when stale entries outnumber live ones.

use super::tenants::{Band, Flow, FlowPolicy, TenantId, ACTIVE_WINDOW_MS};
use super::{Placement, QueueClass};
use crate::maps::FxHashMap;
use crate::types::RequestId;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// The order in which ready requests are offered to workers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum QueueOrder {
    /// First come, first served.
    #[default]
    Fcfs,
    /// Last come, first served.
    Lcfs,
    /// Weighted shortest processing time: fewest uncached prompt tokens first
    /// (ties in arrival order).
    Wspt,
}

/// Limits of one queue class; a request beyond either is refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ClassLimits {
    /// Waiting requests (ready plus deferred).
    pub max_requests: usize,
    /// Sum of the waiting requests' uncached tokens.
    pub max_uncached_tokens: u64,
}

impl Default for ClassLimits {
    fn default() -> Self {
        Self {
            max_requests: 4096,
            max_uncached_tokens: 16 << 20,
        }
    }
}

/// Settings of the [`PolicyQueue`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QueueConfig {
    /// Order of the ready queue.
    pub order: QueueOrder,
    /// Limits of classes without an entry in `class_limits`. A request
    /// whose driver names no class is in its tenant's, so these hold per
    /// tenant: one tenant's backlog cannot fill the queue for the others.
    pub default_limits: ClassLimits,
    /// Limits of class `i` at index `i`.
    pub class_limits: Vec<ClassLimits>,
    /// While requests wait, the driver rechecks at least this often even if
    /// no capacity event arrives.
    pub recheck_interval_ms: f64,
    /// One poll stops after this many consecutive "all busy" answers (the
    /// rest of the queue would most likely be busy too).
    pub busy_probe_limit: usize,
    /// Bounds of the suggested `Retry-After` for refused requests.
    pub min_retry_after_ms: u64,
    /// See `min_retry_after_ms`.
    pub max_retry_after_ms: u64,
}

impl Default for QueueConfig {
    fn default() -> Self {
        Self {
            order: QueueOrder::Fcfs,
            default_limits: ClassLimits::default(),
            class_limits: Vec::new(),
            recheck_interval_ms: 50.0,
            busy_probe_limit: 4,
            min_retry_after_ms: 1_000,
            max_retry_after_ms: 60_000,
        }
    }
}

/// Why a [`QueueConfig`] was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum QueueConfigError {
    /// A recheck interval that is not positive.
    #[error("recheck_interval_ms must be positive and finite, got {0}")]
    RecheckInterval(f64),
    /// A probe limit of zero.
    #[error("busy_probe_limit must be at least 1")]
    BusyProbeLimit,
    /// Retry-after bounds out of order.
    #[error("min_retry_after_ms ({min}) must be at most max_retry_after_ms ({max})")]
    RetryAfter {
        /// The lower bound.
        min: u64,
        /// The upper bound.
        max: u64,
    },
}

impl QueueConfig {
    /// Checks ranges and relations.
    pub fn validate(&self) -> Result<(), QueueConfigError> {
        if !(self.recheck_interval_ms.is_finite() && self.recheck_interval_ms > 0.0) {
            return Err(QueueConfigError::RecheckInterval(self.recheck_interval_ms));
        }
        if self.busy_probe_limit == 0 {
            return Err(QueueConfigError::BusyProbeLimit);
        }
        if self.min_retry_after_ms > self.max_retry_after_ms {
            return Err(QueueConfigError::RetryAfter {
                min: self.min_retry_after_ms,
                max: self.max_retry_after_ms,
            });
        }
        Ok(())
    }

    fn limits(&self, class: QueueClass) -> ClassLimits {
        self.class_limits
            .get(class.0 as usize)
            .copied()
            .unwrap_or(self.default_limits)
    }
}

/// Counters for metrics; they only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct QueueCounters {
    /// Requests accepted into the queue.
    pub enqueued: u64,
    /// Requests that left for a worker.
    pub dispatched: u64,
    /// Requests refused because their class was full.
    pub rejected_full: u64,
    /// Waiting requests whose client gave up.
    pub abandoned: u64,
    /// Requests that entered deferred storage.
    pub deferrals: u64,
    /// Deferred requests made ready.
    pub made_ready: u64,
    /// Waiting requests removed for another reason (unroutable, aborted by
    /// their strategy).
    pub removed: u64,
    /// Ready requests put back because every worker was busy.
    pub busy_requeues: u64,
    /// Requests shed (sheddable band under overload, or late); also
    /// counted per flow.
    pub shed: u64,
}

/// Whether a waiting request may be routed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitState {
    /// In the ready queue with this placement.
    Ready(Placement),
    /// Held for its strategy.
    Deferred,
}

#[derive(Clone, Copy, Debug)]
struct Entry {
    class: QueueClass,
    uncached_tokens: u32,
    seq: u64,
    enqueued_ms: f64,
    state: WaitState,
    /// Popped and not yet put back or removed.
    out: bool,
    /// Its tenant and band, within the policy's range.
    flow: Flow,
}

#[derive(Clone, Copy, Debug, Default)]
struct ClassUsage {
    requests: usize,
    uncached_tokens: u64,
}

/// A waiting request taken from the head of the ready queue.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Popped {
    /// The request.
    pub id: RequestId,
    /// Where it may go.
    pub placement: Placement,
    /// When it entered the queue.
    pub enqueued_ms: f64,
    /// Its tenant.
    pub tenant: TenantId,
}

/// How much a popped request's tenant asks of the fleet, for
/// [`super::FlowConfig::reserve_for_light_tenants`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Demand {
    /// It was served no more than its share of the recent tokens, or no
    /// other tenant is active: it may fill a worker to the busy threshold.
    WithinShare,
    /// It was served more than its share while another tenant is active:
    /// it leaves the light tenants' reserve free.
    OverShare,
}

/// Why a request was shed: ended at once rather than left to wait.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ShedReason {
    /// Its band is sheddable and no worker took it at once.
    Overload,
    /// Its TTFT deadline cannot be met (with `refuse_late`).
    Late,
}

/// Counters of one (tenant, band); they only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct FlowCounters {
    /// Requests accepted into the queue.
    pub enqueued: u64,
    /// Requests that left for a worker.
    pub dispatched: u64,
    /// Tokens charged at dispatch (uncached prompt plus expected output).
    pub tokens_dispatched: u64,
    /// Requests shed under overload (sheddable band).
    pub shed: u64,
    /// Requests shed because their deadline could not be met.
    pub late: u64,
    /// Requests refused because their queue class was full.
    pub refused: u64,
    /// Requests dispatched after their deadline had passed.
    pub missed_deadline: u64,
}

/// One (tenant, band)'s queue figures, for metrics.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct FlowStats {
    /// The tenant.
    #[serde(skip)]
    pub tenant: TenantId,
    /// The band.
    #[serde(skip)]
    pub band: Band,
    /// Requests of it waiting now (ready and deferred).
    pub waiting: usize,
    /// Its virtual time in the band: tokens charged per unit of weight,
    /// lifted when it becomes backlogged.
    pub virtual_time: f64,
    /// Its counters.
    pub counters: FlowCounters,
}

/// A heap item: (deadline key, order key, arrival seq, id), smallest first.
type Item = Reverse<(u64, u64, u64, RequestId)>;

/// One (band, tenant): its ready requests and its place in the fair share.
#[derive(Debug, Default)]
struct Lane {
    heap: BinaryHeap<Item>,
    /// Ready entries, including popped ones.
    ready: usize,
    /// Popped ready entries (not in `heap`).
    out: usize,
    /// Ready and deferred entries.
    waiting: usize,
    /// Tokens charged per unit of weight (lifted on becoming backlogged).
    vtime: f64,
    counters: FlowCounters,
}

impl Lane {
    fn available(&self) -> bool {
        self.ready > self.out
    }
}

/// `tokens` charged `elapsed_ms` ago, decayed with a time constant of
/// [`ACTIVE_WINDOW_MS`].
fn decayed(tokens: f64, elapsed_ms: f64) -> f64 {
    if tokens == 0.0 {
        return 0.0;
    }
    tokens * (-elapsed_ms.max(0.0) / ACTIVE_WINDOW_MS).exp()
}

/// A deadline as a key that sorts like the time (none: last).
fn deadline_key(deadline_ms: Option<f64>) -> u64 {
    match deadline_ms {
        Some(d) if d.is_finite() => {
            let bits = d.to_bits();
            if bits >> 63 == 1 {
                !bits
            } else {
                bits | (1 << 63)
            }
        }
        _ => u64::MAX,
    }
}

/// Ready and deferred requests. It stores ids and lengths only.
///
/// Ready requests are kept per (band, tenant) "lane". [`Self::pop`]
/// offers the highest band with an available request (strict priority);
/// within it, the tenant with the lowest virtual time (tokens charged at
/// dispatch divided by its weight; ties to the lower tenant id) among
/// those below their concurrency cap; within the tenant, the earliest
/// deadline (none last), then the configured order, then arrival. A
/// tenant that becomes backlogged in a band is lifted to the smallest
/// virtual time of that band's backlogged tenants (or to the band's last
/// served virtual time when none is), so idle time banks no credit. With
/// one tenant and one band this is the configured order alone.
#[derive(Debug)]
pub struct PolicyQueue {
    config: QueueConfig,
    flows: FlowPolicy,
    entries: FxHashMap<RequestId, Entry>,
    /// `band * tenants + tenant`.
    lanes: Vec<Lane>,
    /// Per band: tenants with ready requests (in any order).
    backlogged: Vec<Vec<u16>>,
    /// Per band: the virtual time last served (the floor for a tenant
    /// that becomes backlogged while no other is).
    band_floor: Vec<f64>,
    /// Per tenant: requests dispatched and not yet released.
    in_flight: Vec<u32>,
    /// Heap items over every lane, live and stale.
    heap_items: usize,
    ready: usize,
    usage: Vec<ClassUsage>,
    next_seq: u64,
    /// Moving average of the wait of dispatched requests.
    wait_ewma_ms: Option<f64>,
    /// Per tenant: tokens charged at dispatch, decaying with a time
    /// constant of [`ACTIVE_WINDOW_MS`], and when they were last updated
    /// (`-inf`: never dispatched to).
    recent: Vec<(f64, f64)>,
    /// Tenants [`Self::pop`] skips for the rest of a poll.
    held: Vec<u16>,
    counters: QueueCounters,
}

impl PolicyQueue {
    /// An empty queue with the default flow policy (one tenant); `config`
    /// must validate.
    pub fn new(config: QueueConfig) -> Result<Self, QueueConfigError> {
        Self::with_flows(config, FlowPolicy::default())
    }

    /// An empty queue sharing by `flows`' tenants and bands.
    pub fn with_flows(config: QueueConfig, flows: FlowPolicy) -> Result<Self, QueueConfigError> {
        config.validate()?;
        let (bands, tenants) = (flows.band_count(), flows.tenant_count());
        Ok(Self {
            // A slot per listed class and per tenant (a request's class
            // is its tenant's unless the driver names one).
            usage: vec![ClassUsage::default(); (config.class_limits.len() + 1).max(tenants)],
            config,
            entries: FxHashMap::default(),
            lanes: (0..bands * tenants).map(|_| Lane::default()).collect(),
            backlogged: vec![Vec::new(); bands],
            band_floor: vec![0.0; bands],
            in_flight: vec![0; tenants],
            flows,
            heap_items: 0,
            ready: 0,
            next_seq: 0,
            wait_ewma_ms: None,
            recent: vec![(0.0, f64::NEG_INFINITY); tenants],
            held: Vec::new(),
            counters: QueueCounters::default(),
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &QueueConfig {
        &self.config
    }

    /// The tenants and bands it shares by.
    pub fn flows(&self) -> &FlowPolicy {
        &self.flows
    }

    /// Waiting requests (ready and deferred).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether nothing waits.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Ready requests (including any popped and not yet put back).
    pub fn ready_len(&self) -> usize {
        self.ready
    }

    /// Deferred requests.
    pub fn deferred_len(&self) -> usize {
        self.entries.len() - self.ready
    }

    /// Whether `id` waits here.
    pub fn contains(&self, id: RequestId) -> bool {
        self.entries.contains_key(&id)
    }

    /// The state of a waiting request.
    pub fn state(&self, id: RequestId) -> Option<WaitState> {
        self.entries.get(&id).map(|e| e.state)
    }

    /// The flow a waiting request was queued with (tenant and band
    /// brought within the policy's range).
    pub fn flow_of(&self, id: RequestId) -> Option<Flow> {
        self.entries.get(&id).map(|e| e.flow)
    }

    /// Counters.
    pub fn counters(&self) -> &QueueCounters {
        &self.counters
    }

    /// Requests of `tenant` dispatched and not yet released.
    pub fn in_flight(&self, tenant: TenantId) -> u32 {
        self.in_flight.get(tenant.0 as usize).copied().unwrap_or(0)
    }

    /// Every (tenant, band)'s figures, tenants first then bands.
    pub fn flow_stats(&self) -> Vec<FlowStats> {
        let tenants = self.flows.tenant_count();
        let mut out = Vec::with_capacity(self.lanes.len());
        for t in 0..tenants {
            for b in 0..self.flows.band_count() {
                let lane = &self.lanes[b * tenants + t];
                out.push(FlowStats {
                    tenant: TenantId(t as u16),
                    band: Band(b as u8),
                    waiting: lane.waiting,
                    virtual_time: lane.vtime,
                    counters: lane.counters,
                });
            }
        }
        out
    }

    /// Heap bytes held (map table, lanes and their heaps).
    pub fn heap_bytes(&self) -> usize {
        crate::maps::map_bytes(&self.entries)
            + self.lanes.capacity() * std::mem::size_of::<Lane>()
            + self
                .lanes
                .iter()
                .map(|l| l.heap.capacity() * std::mem::size_of::<Item>())
                .sum::<usize>()
            + self
                .backlogged
                .iter()
                .map(|b| b.capacity() * 2)
                .sum::<usize>()
    }

    fn usage_slot(&self, class: QueueClass) -> usize {
        (class.0 as usize).min(self.usage.len() - 1)
    }

    /// `flow` with its tenant and band within the policy's range: an
    /// unknown tenant is the default one, an unknown band the lowest.
    pub fn normalize(&self, mut flow: Flow) -> Flow {
        if flow.tenant.0 as usize >= self.flows.tenant_count() {
            flow.tenant = TenantId(0);
        }
        if flow.band.0 as usize >= self.flows.band_count() {
            flow.band = Band((self.flows.band_count() - 1) as u8);
        }
        flow
    }

    fn lane_of(&self, flow: &Flow) -> usize {
        flow.band.0 as usize * self.flows.tenant_count() + flow.tenant.0 as usize
    }

    /// Whether a request of `class` with `uncached_tokens` fits its class
    /// limits now.
    pub fn has_room(&self, class: QueueClass, uncached_tokens: u32) -> bool {
        let limits = self.config.limits(class);
        let usage = &self.usage[self.usage_slot(class)];
        usage.requests < limits.max_requests
            && usage.uncached_tokens + uncached_tokens as u64 <= limits.max_uncached_tokens
    }

    /// A suggested `Retry-After` for a refused request: the recent average
    /// wait of dispatched requests, within the configured bounds.
    pub fn retry_after_ms(&self) -> u64 {
        let wait = self.wait_ewma_ms.unwrap_or(0.0).ceil() as u64;
        wait.clamp(
            self.config.min_retry_after_ms,
            self.config.max_retry_after_ms,
        )
    }

    /// Counts a refusal (the caller checked [`Self::has_room`]).
    pub fn count_rejection(&mut self) {
        self.counters.rejected_full += 1;
    }

    /// Counts a refusal of a request of `flow`.
    pub fn count_rejection_of(&mut self, flow: Flow) {
        self.counters.rejected_full += 1;
        let lane = self.lane_of(&self.normalize(flow));
        self.lanes[lane].counters.refused += 1;
    }

    /// Counts a request of `flow` shed before it was queued.
    pub fn count_shed(&mut self, flow: Flow, reason: ShedReason) {
        self.counters.shed += 1;
        let lane = self.lane_of(&self.normalize(flow));
        let c = &mut self.lanes[lane].counters;
        match reason {
            ShedReason::Overload => c.shed += 1,
            ShedReason::Late => c.late += 1,
        }
    }

    /// Adds a request of the default flow (see [`Self::push_flow`]).
    pub fn push(
        &mut self,
        id: RequestId,
        class: QueueClass,
        uncached_tokens: u32,
        state: WaitState,
        now_ms: f64,
    ) -> bool {
        self.push_flow(id, class, uncached_tokens, Flow::default(), state, now_ms)
    }

    /// Adds a request; the caller checked room and that `id` is absent.
    /// Returns `false` (and changes nothing) when `id` already waits.
    pub fn push_flow(
        &mut self,
        id: RequestId,
        class: QueueClass,
        uncached_tokens: u32,
        flow: Flow,
        state: WaitState,
        now_ms: f64,
    ) -> bool {
        if self.entries.contains_key(&id) {
            return false;
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        let entry = Entry {
            class,
            uncached_tokens,
            seq,
            enqueued_ms: now_ms,
            state,
            out: false,
            flow: self.normalize(flow),
        };
        self.entries.insert(id, entry);
        let slot = self.usage_slot(class);
        self.usage[slot].requests += 1;
        self.usage[slot].uncached_tokens += uncached_tokens as u64;
        self.counters.enqueued += 1;
        let lane = self.lane_of(&entry.flow);
        self.lanes[lane].waiting += 1;
        self.lanes[lane].counters.enqueued += 1;
        match state {
            WaitState::Ready(_) => {
                self.become_ready(&entry);
                self.push_heap(id, &entry);
            }
            WaitState::Deferred => self.counters.deferrals += 1,
        }
        true
    }

    /// One more ready entry in its lane; a lane that becomes backlogged
    /// is lifted to its band's smallest backlogged virtual time.
    fn become_ready(&mut self, entry: &Entry) {
        self.ready += 1;
        let lane = self.lane_of(&entry.flow);
        self.lanes[lane].ready += 1;
        if self.lanes[lane].ready == 1 {
            let band = entry.flow.band.0 as usize;
            let tenants = self.flows.tenant_count();
            let floor = self.backlogged[band]
                .iter()
                .map(|&t| self.lanes[band * tenants + t as usize].vtime)
                .reduce(f64::min)
                .unwrap_or(self.band_floor[band]);
            let lane = &mut self.lanes[lane];
            lane.vtime = lane.vtime.max(floor);
            self.backlogged[band].push(entry.flow.tenant.0);
        }
    }

    fn push_heap(&mut self, id: RequestId, entry: &Entry) {
        let key = match self.config.order {
            QueueOrder::Fcfs => 0,
            QueueOrder::Lcfs => u64::MAX - entry.seq,
            QueueOrder::Wspt => entry.uncached_tokens as u64,
        };
        let lane = self.lane_of(&entry.flow);
        self.lanes[lane].heap.push(Reverse((
            deadline_key(entry.flow.deadline_ms),
            key,
            entry.seq,
            id,
        )));
        self.heap_items += 1;
    }

    /// Moves a deferred request to the ready queue. `false` when `id` is not
    /// deferred (stale or duplicate action): nothing changes.
    pub fn make_ready(&mut self, id: RequestId, placement: Placement) -> bool {
        let Some(entry) = self.entries.get_mut(&id) else {
            return false;
        };
        if entry.state != WaitState::Deferred {
            return false;
        }
        entry.state = WaitState::Ready(placement);
        let entry = *entry;
        self.counters.made_ready += 1;
        self.become_ready(&entry);
        self.push_heap(id, &entry);
        true
    }

    /// Changes the placement of a popped request (a fallback).
    pub fn set_placement(&mut self, id: RequestId, placement: Placement) {
        if let Some(entry) = self.entries.get_mut(&id) {
            if let WaitState::Ready(_) = entry.state {
                entry.state = WaitState::Ready(placement);
            }
        }
    }

    /// Whether [`Self::pop`] passes `tenant` by: at its concurrency cap, or
    /// held for the rest of the poll ([`Self::hold`]).
    fn skipped(&self, tenant: u16) -> bool {
        self.flows
            .max_concurrency(TenantId(tenant))
            .is_some_and(|cap| self.in_flight[tenant as usize] >= cap)
            || self.held.contains(&tenant)
    }

    /// Skips `tenant` in [`Self::pop`] until [`Self::clear_holds`] (the
    /// poll's end): its request found every worker busy at the light
    /// tenants' reserve, and so would the rest of its requests.
    pub fn hold(&mut self, tenant: TenantId) {
        if !self.held.contains(&tenant.0) {
            self.held.push(tenant.0);
        }
    }

    /// Ends every [`Self::hold`].
    pub fn clear_holds(&mut self) {
        self.held.clear();
    }

    /// Takes the next ready request (see the type's docs for the order).
    /// It stays counted as waiting until [`Self::put_back`] or
    /// [`Self::remove`]; the next pop offers the next candidate.
    pub fn pop(&mut self) -> Option<Popped> {
        let tenants = self.flows.tenant_count();
        let fair = self.flows.config().fair_share;
        for band in 0..self.backlogged.len() {
            let mut best: Option<(f64, u16)> = None;
            for i in 0..self.backlogged[band].len() {
                let t = self.backlogged[band][i];
                let lane = band * tenants + t as usize;
                if !self.lanes[lane].available() || self.skipped(t) {
                    continue;
                }
                // Fair: the lowest virtual time. Without fair sharing:
                // the lane whose next request comes first in the order
                // (deadline, order key, arrival), whoever sent it.
                let key = if fair {
                    self.lanes[lane].vtime
                } else {
                    match self.live_head(lane) {
                        Some(seq) => seq as f64,
                        None => continue,
                    }
                };
                if best.is_none_or(|(v, bt)| key < v || (key == v && t < bt)) {
                    best = Some((key, t));
                }
            }
            let best = best.map(|(key, t)| {
                let vtime = if fair {
                    key
                } else {
                    self.lanes[band * tenants + t as usize].vtime
                };
                (vtime, t)
            });
            let Some((vtime, t)) = best else {
                continue;
            };
            let lane = band * tenants + t as usize;
            while let Some(Reverse((_, _, seq, id))) = self.lanes[lane].heap.pop() {
                self.heap_items -= 1;
                let Some(entry) = self.entries.get_mut(&id) else {
                    continue;
                };
                let WaitState::Ready(placement) = entry.state else {
                    continue;
                };
                if entry.seq != seq || entry.out {
                    continue;
                }
                entry.out = true;
                let enqueued_ms = entry.enqueued_ms;
                self.lanes[lane].out += 1;
                self.band_floor[band] = self.band_floor[band].max(vtime);
                return Some(Popped {
                    id,
                    placement,
                    enqueued_ms,
                    tenant: TenantId(t),
                });
            }
            // Unreachable while the counts hold (an available lane has a
            // live item); never loop on it.
            debug_assert!(false, "lane {lane} counted available with no live item");
        }
        None
    }

    /// The arrival rank of `lane`'s next live request (the head of its own
    /// order), dropping stale items on top: without fair sharing a band
    /// serves the lane whose head came first, whoever sent it.
    fn live_head(&mut self, lane: usize) -> Option<u64> {
        while let Some(&Reverse((_, _, seq, id))) = self.lanes[lane].heap.peek() {
            let live = self
                .entries
                .get(&id)
                .is_some_and(|e| matches!(e.state, WaitState::Ready(_)) && e.seq == seq && !e.out);
            if live {
                return Some(seq);
            }
            self.lanes[lane].heap.pop();
            self.heap_items -= 1;
        }
        None
    }

    /// Returns a popped request to its place in the order.
    pub fn put_back(&mut self, id: RequestId) {
        if let Some(entry) = self.entries.get_mut(&id) {
            if entry.out {
                entry.out = false;
                let entry = *entry;
                let lane = self.lane_of(&entry.flow);
                self.lanes[lane].out -= 1;
                self.counters.busy_requeues += 1;
                self.push_heap(id, &entry);
            }
        }
    }

    fn take(&mut self, id: RequestId) -> Option<Entry> {
        let entry = self.entries.remove(&id)?;
        let slot = self.usage_slot(entry.class);
        self.usage[slot].requests -= 1;
        self.usage[slot].uncached_tokens -= entry.uncached_tokens as u64;
        let lane = self.lane_of(&entry.flow);
        self.lanes[lane].waiting -= 1;
        if let WaitState::Ready(_) = entry.state {
            self.ready -= 1;
            let l = &mut self.lanes[lane];
            l.ready -= 1;
            if entry.out {
                l.out -= 1;
            }
            if l.ready == 0 {
                let band = &mut self.backlogged[entry.flow.band.0 as usize];
                if let Some(i) = band.iter().position(|&t| t == entry.flow.tenant.0) {
                    band.swap_remove(i);
                }
            }
        }
        let stale = self.heap_items.saturating_sub(self.ready);
        if stale > self.ready + 1024 {
            let entries = &self.entries;
            let mut items = 0;
            for lane in &mut self.lanes {
                lane.heap.retain(|Reverse((_, _, seq, id))| {
                    entries.get(id).is_some_and(|e| {
                        e.seq == *seq && !e.out && matches!(e.state, WaitState::Ready(_))
                    })
                });
                items += lane.heap.len();
            }
            self.heap_items = items;
        }
        Some(entry)
    }

    /// A request left for a worker: removes it, learns its wait and
    /// charges its tenant its prompt tokens as queued (see
    /// [`Self::dispatch_charged`]).
    pub fn dispatch(&mut self, id: RequestId, now_ms: f64) -> bool {
        self.dispatch_charged(id, now_ms, None)
    }

    /// A request left for a worker: removes it, learns its wait, counts
    /// it in flight for its tenant (until [`Self::release`]) and charges
    /// the tenant's virtual time `uncached_tokens` (the prompt tokens it
    /// was queued with when `None`) plus its expected output, divided by
    /// the tenant's weight.
    pub fn dispatch_charged(
        &mut self,
        id: RequestId,
        now_ms: f64,
        uncached_tokens: Option<u32>,
    ) -> bool {
        let Some(entry) = self.take(id) else {
            return false;
        };
        let wait = (now_ms - entry.enqueued_ms).max(0.0);
        self.wait_ewma_ms = Some(match self.wait_ewma_ms {
            None => wait,
            Some(avg) => 0.9 * avg + 0.1 * wait,
        });
        self.counters.dispatched += 1;
        let cost = u64::from(uncached_tokens.unwrap_or(entry.uncached_tokens))
            + u64::from(entry.flow.expected_output_tokens);
        let weight = self.flows.weight(entry.flow.tenant);
        let lane = self.lane_of(&entry.flow);
        let l = &mut self.lanes[lane];
        l.vtime += cost as f64 / weight;
        l.counters.dispatched += 1;
        l.counters.tokens_dispatched += cost;
        if entry.flow.deadline_ms.is_some_and(|d| now_ms > d) {
            l.counters.missed_deadline += 1;
        }
        let t = entry.flow.tenant.0 as usize;
        self.in_flight[t] = self.in_flight[t].saturating_add(1);
        let (tokens, at) = self.recent[t];
        self.recent[t] = (decayed(tokens, now_ms - at) + cost as f64, now_ms);
        true
    }

    /// How much `tenant` asks of the fleet at `now_ms`: over its share
    /// when another tenant is active (in flight, or dispatched to within
    /// [`ACTIVE_WINDOW_MS`]) and `tenant` was recently served more tokens
    /// (charged as in the fair share, decaying over the window) than its
    /// weight's share of the active tenants'.
    pub fn demand(&self, tenant: TenantId, now_ms: f64) -> Demand {
        let t = tenant.0 as usize;
        let Some(&(own, at)) = self.recent.get(t) else {
            return Demand::WithinShare;
        };
        let own = decayed(own, now_ms - at);
        let mut others = false;
        let mut total = own;
        let mut weights = self.flows.weight(tenant);
        for (u, &(tokens, at)) in self.recent.iter().enumerate() {
            if u == t || (self.in_flight[u] == 0 && now_ms - at > ACTIVE_WINDOW_MS) {
                continue;
            }
            others = true;
            total += decayed(tokens, now_ms - at);
            weights += self.flows.weight(TenantId(u as u16));
        }
        if others && own > self.flows.weight(tenant) / weights * total {
            Demand::OverShare
        } else {
            Demand::WithinShare
        }
    }

    /// A dispatched request of `tenant` ended (completed, aborted,
    /// expired, or waits again): one fewer in flight.
    pub fn release(&mut self, tenant: TenantId) {
        if let Some(n) = self.in_flight.get_mut(tenant.0 as usize) {
            *n = n.saturating_sub(1);
        }
    }

    /// The client gave up on a waiting request: it leaves at once.
    pub fn abandon(&mut self, id: RequestId) -> bool {
        let found = self.take(id).is_some();
        if found {
            self.counters.abandoned += 1;
        }
        found
    }

    /// Removes a waiting request for any other reason.
    pub fn remove(&mut self, id: RequestId) -> bool {
        let found = self.take(id).is_some();
        if found {
            self.counters.removed += 1;
        }
        found
    }

    /// Sheds a waiting request: it leaves at once, counted for its flow.
    pub fn shed(&mut self, id: RequestId, reason: ShedReason) -> bool {
        let Some(entry) = self.take(id) else {
            return false;
        };
        self.count_shed(entry.flow, reason);
        true
    }

    /// Whether [`Self::pop`] would offer a request now: one is ready, not
    /// popped, and its tenant is under its concurrency cap.
    pub fn offerable(&self) -> bool {
        let tenants = self.flows.tenant_count();
        self.backlogged.iter().enumerate().any(|(b, lanes)| {
            lanes
                .iter()
                .any(|&t| self.lanes[b * tenants + t as usize].available() && !self.skipped(t))
        })
    }

    /// Ready requests of sheddable bands (none are popped between polls).
    pub fn sheddable_ready(&self) -> usize {
        let tenants = self.flows.tenant_count();
        (0..self.backlogged.len())
            .filter(|&b| self.flows.is_sheddable(Band(b as u8)))
            .flat_map(|b| {
                self.backlogged[b]
                    .iter()
                    .map(move |&t| b * tenants + t as usize)
            })
            .map(|lane| self.lanes[lane].ready - self.lanes[lane].out)
            .sum()
    }

    /// The ids of the ready, not popped requests of sheddable bands, in
    /// no particular order (the caller sheds them).
    pub fn sheddable_ids(&self, out: &mut Vec<RequestId>) {
        let tenants = self.flows.tenant_count();
        for b in 0..self.backlogged.len() {
            if !self.flows.is_sheddable(Band(b as u8)) {
                continue;
            }
            for &t in &self.backlogged[b] {
                let lane = &self.lanes[b * tenants + t as usize];
                for Reverse((_, _, seq, id)) in lane.heap.iter() {
                    if self.entries.get(id).is_some_and(|e| {
                        e.seq == *seq && !e.out && matches!(e.state, WaitState::Ready(_))
                    }) {
                        out.push(*id);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue(order: QueueOrder) -> PolicyQueue {
        PolicyQueue::new(QueueConfig {
            order,
            ..Default::default()
        })
        .unwrap()
    }

    fn fill(q: &mut PolicyQueue, uncached: &[u32]) {
        for (i, &u) in uncached.iter().enumerate() {
            let ready = WaitState::Ready(Placement::Any);
            assert!(q.push(RequestId(i as u128), QueueClass(0), u, ready, i as f64));
        }
    }

    fn drain(q: &mut PolicyQueue) -> Vec<u128> {
        let mut out = Vec::new();
        while let Some(p) = q.pop() {
            q.dispatch(p.id, 10.0);
            out.push(p.id.0);
        }
        out
    }

    #[test]
    fn fcfs_lcfs_and_wspt_order_the_ready_queue() {
        let sizes = [30, 10, 20, 10];
        let mut q = queue(QueueOrder::Fcfs);
        fill(&mut q, &sizes);
        assert_eq!(drain(&mut q), vec![0, 1, 2, 3]);
        let mut q = queue(QueueOrder::Lcfs);
        fill(&mut q, &sizes);
        assert_eq!(drain(&mut q), vec![3, 2, 1, 0]);
        let mut q = queue(QueueOrder::Wspt);
        fill(&mut q, &sizes);
        assert_eq!(drain(&mut q), vec![1, 3, 2, 0]);
        assert!(q.is_empty());
    }

    #[test]
    fn an_abandoned_request_leaves_at_once_and_is_never_popped() {
        let mut q = queue(QueueOrder::Fcfs);
        fill(&mut q, &[1, 1, 1]);
        assert!(q.abandon(RequestId(1)));
        assert!(!q.abandon(RequestId(1)));
        assert_eq!(q.len(), 2);
        assert_eq!(drain(&mut q), vec![0, 2]);
        assert_eq!(q.counters().abandoned, 1);
    }

    #[test]
    fn class_limits_count_requests_and_uncached_tokens() {
        let mut q = PolicyQueue::new(QueueConfig {
            default_limits: ClassLimits {
                max_requests: 2,
                max_uncached_tokens: 100,
            },
            class_limits: vec![ClassLimits {
                max_requests: 10,
                max_uncached_tokens: 50,
            }],
            ..Default::default()
        })
        .unwrap();
        let ready = WaitState::Ready(Placement::Any);
        assert!(q.has_room(QueueClass(0), 50));
        assert!(!q.has_room(QueueClass(0), 51));
        q.push(RequestId(1), QueueClass(0), 50, ready, 0.0);
        assert!(!q.has_room(QueueClass(0), 1));
        // Unlisted classes share the default limits.
        q.push(RequestId(2), QueueClass(7), 10, ready, 0.0);
        q.push(RequestId(3), QueueClass(9), 10, WaitState::Deferred, 0.0);
        assert!(!q.has_room(QueueClass(8), 1));
        q.remove(RequestId(3));
        assert!(q.has_room(QueueClass(8), 90));
        assert!(!q.has_room(QueueClass(8), 91));
    }

    #[test]
    fn deferred_requests_wait_until_made_ready_and_stale_actions_are_ignored() {
        let mut q = queue(QueueOrder::Fcfs);
        q.push(RequestId(1), QueueClass(0), 1, WaitState::Deferred, 0.0);
        assert_eq!(q.pop(), None);
        assert!(q.make_ready(RequestId(1), Placement::Any));
        assert!(!q.make_ready(RequestId(1), Placement::Any));
        assert!(!q.make_ready(RequestId(9), Placement::Any));
        assert_eq!(drain(&mut q), vec![1]);
    }

    #[test]
    fn a_put_back_request_keeps_its_place() {
        let mut q = queue(QueueOrder::Fcfs);
        fill(&mut q, &[1, 1]);
        let head = q.pop().unwrap();
        q.put_back(head.id);
        assert_eq!(drain(&mut q), vec![0, 1]);
    }

    #[test]
    fn retry_after_follows_recent_waits_within_bounds() {
        let mut q = queue(QueueOrder::Fcfs);
        assert_eq!(q.retry_after_ms(), 1_000);
        q.push(
            RequestId(1),
            QueueClass(0),
            1,
            WaitState::Ready(Placement::Any),
            0.0,
        );
        q.pop();
        q.dispatch(RequestId(1), 5_000.0);
        assert_eq!(q.retry_after_ms(), 5_000);
    }

    #[test]
    fn stale_heap_entries_are_compacted() {
        let mut q = queue(QueueOrder::Fcfs);
        let ready = WaitState::Ready(Placement::Any);
        for i in 0..3000 {
            q.push(RequestId(i), QueueClass(0), 0, ready, 0.0);
        }
        for i in 0..2990 {
            q.abandon(RequestId(i));
        }
        assert!(q.heap_items < 2000);
        assert_eq!(
            q.heap_items,
            q.lanes.iter().map(|l| l.heap.len()).sum::<usize>()
        );
        assert_eq!(q.ready_len(), 10);
    }

    #[test]
    fn bad_settings_are_refused() {
        let bad = QueueConfig {
            min_retry_after_ms: 10,
            max_retry_after_ms: 5,
            ..Default::default()
        };
        assert!(matches!(
            PolicyQueue::new(bad),
            Err(QueueConfigError::RetryAfter { .. })
        ));
        let bad = QueueConfig {
            recheck_interval_ms: 0.0,
            ..Default::default()
        };
        assert!(bad.validate().is_err());
    }
}
