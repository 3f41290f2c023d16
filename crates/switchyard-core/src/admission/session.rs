//! The session-aware strategy (`--admission session-aware`).
//!
//! - Requests without a session bypass: nothing is retained for them.
//! - Turns of one session are serialized: while a turn is admitted or
//!   running, later turns are deferred (in arrival order) and made ready
//!   when it completes or aborts.
//! - A session sticks to the worker that served its last turn while that
//!   worker is eligible. `Strict` affinity waits for a busy pinned worker;
//!   `Soft` falls back to any worker. A worker that became invalid always
//!   falls back to any worker, and the session re-pins where it lands.
//! - KV pressure: each worker's usage is the engine's report (corrected by
//!   the strategy's own changes since) or, without one, the sum of its
//!   sessions' footprints (context + `buffer_per_session`) plus live
//!   progress of running turns. Above `pause_threshold` of capacity the
//!   strategy pauses sessions between turns, smallest first, until usage is
//!   at `pause_target`; if that is not enough it marks running sessions,
//!   smallest first, to pause when their turn ends. A paused session's next
//!   turn is deferred. Paused sessions resume best-fit (the largest that
//!   fits) while a worker's usage stays at or below
//!   `pause_target − resume_hysteresis` (the gap is the hysteresis: a
//!   session just paused is not resumed by the same reconcile); one paused
//!   longer than `resume_timeout_ms` is forced back.
//! - State is bounded: at `max_sessions` the least recently active quiet
//!   session is evicted; quiet sessions expire after `session_expiry_ms`.
//!   A tenant other than the default one holds at most
//!   `max_sessions_per_tenant`: at its cap its own least recently active
//!   quiet session is evicted (never another tenant's), and with none
//!   quiet its new session bypasses, so one key cannot crowd out the
//!   others' sessions.
//!
//! No operation scans all retained sessions: admission and events touch one
//! session and ordered indexes (`BTreeSet`s keyed by footprint, a queue
//! ordered by last activity); `Reconcile` visits workers, expired entries,
//! and only the sessions it pauses or resumes.

use super::progress::ProgressReader;
use super::{
    Admission, AdmissionStrategy, Fallback, KvUsage, LifecycleEvent, MakeReady, Placement,
    RequestFacts, SessionKey, TenantId, Unavailable,
};
use crate::maps::FxHashMap;
use crate::types::{RequestId, WorkerId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeSet, VecDeque};

/// How firmly a session sticks to its worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Affinity {
    /// Wait for the pinned worker while it is busy.
    Strict,
    /// Prefer the pinned worker; go elsewhere when it is busy.
    #[default]
    Soft,
}

/// Settings of the [`SessionAwareStrategy`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SessionAwareConfig {
    /// Strict or soft worker affinity.
    pub affinity: Affinity,
    /// Fraction of a worker's KV capacity above which sessions are paused.
    pub pause_threshold: f64,
    /// Pausing stops once usage is at or below this fraction.
    pub pause_target: f64,
    /// Paused sessions resume while usage stays at or below
    /// `pause_target − resume_hysteresis`.
    pub resume_hysteresis: f64,
    /// Tokens added to each session's context as its footprint (room for the
    /// next turn's growth).
    pub buffer_per_session: u64,
    /// A session paused longer than this is forced back.
    pub resume_timeout_ms: f64,
    /// A quiet session inactive longer than this is forgotten.
    pub session_expiry_ms: f64,
    /// Most sessions retained.
    pub max_sessions: usize,
    /// Most sessions retained for one tenant (the default tenant, which
    /// requests of no configured tenant share, is bounded by
    /// `max_sessions` alone).
    pub max_sessions_per_tenant: usize,
    /// How often `Reconcile` is wanted.
    pub reconcile_interval_ms: f64,
}

impl Default for SessionAwareConfig {
    fn default() -> Self {
        Self {
            affinity: Affinity::Soft,
            pause_threshold: 0.95,
            pause_target: 0.80,
            resume_hysteresis: 0.10,
            buffer_per_session: 100,
            resume_timeout_ms: 1_800_000.0,
            session_expiry_ms: 1_800_000.0,
            max_sessions: 1_000_000,
            max_sessions_per_tenant: 100_000,
            reconcile_interval_ms: 1_000.0,
        }
    }
}

/// Why a [`SessionAwareConfig`] was refused.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SessionConfigError {
    /// A fraction outside (0, 1].
    #[error("{name} must be in (0, 1], got {value}")]
    Fraction {
        /// The setting.
        name: &'static str,
        /// Its value.
        value: f64,
    },
    /// `pause_target` above `pause_threshold`.
    #[error("pause_target ({target}) must be at most pause_threshold ({threshold})")]
    TargetAboveThreshold {
        /// `pause_target`.
        target: f64,
        /// `pause_threshold`.
        threshold: f64,
    },
    /// A hysteresis that leaves no resume level.
    #[error("resume_hysteresis must be in [0, pause_target), got {0}")]
    Hysteresis(f64),
    /// A duration that is not positive.
    #[error("{name} must be positive and finite, got {value}")]
    Duration {
        /// The setting.
        name: &'static str,
        /// Its value.
        value: f64,
    },
    /// A session cap of zero.
    #[error("max_sessions and max_sessions_per_tenant must be at least 1")]
    MaxSessions,
}

impl SessionAwareConfig {
    /// Checks ranges and relations.
    pub fn validate(&self) -> Result<(), SessionConfigError> {
        for (name, value) in [
            ("pause_threshold", self.pause_threshold),
            ("pause_target", self.pause_target),
        ] {
            if !(value > 0.0 && value <= 1.0) {
                return Err(SessionConfigError::Fraction { name, value });
            }
        }
        if self.pause_target > self.pause_threshold {
            return Err(SessionConfigError::TargetAboveThreshold {
                target: self.pause_target,
                threshold: self.pause_threshold,
            });
        }
        if !(self.resume_hysteresis >= 0.0 && self.resume_hysteresis < self.pause_target) {
            return Err(SessionConfigError::Hysteresis(self.resume_hysteresis));
        }
        for (name, value) in [
            ("resume_timeout_ms", self.resume_timeout_ms),
            ("session_expiry_ms", self.session_expiry_ms),
            ("reconcile_interval_ms", self.reconcile_interval_ms),
        ] {
            if !(value.is_finite() && value > 0.0) {
                return Err(SessionConfigError::Duration { name, value });
            }
        }
        if self.max_sessions == 0 || self.max_sessions_per_tenant == 0 {
            return Err(SessionConfigError::MaxSessions);
        }
        Ok(())
    }
}

/// Counters for metrics; they only grow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SessionCounters {
    /// Requests without a session.
    pub bypassed: u64,
    /// Requests bypassed because the session cap was reached and no quiet
    /// session could be evicted.
    pub bypassed_full: u64,
    /// Turns deferred (serialization or pause).
    pub deferred_turns: u64,
    /// Sessions paused between turns.
    pub pauses: u64,
    /// Running sessions marked to pause when their turn ends.
    pub marked: u64,
    /// Paused sessions resumed by capacity.
    pub resumes: u64,
    /// Paused sessions forced back by `resume_timeout_ms`.
    pub forced_resumes: u64,
    /// Sessions forgotten after inactivity.
    pub expired: u64,
    /// Sessions evicted at the cap.
    pub evicted: u64,
    /// Sessions evicted at their tenant's cap (for one of its own).
    pub evicted_tenant: u64,
    /// Requests bypassed because their tenant was at its cap with no
    /// quiet session of its own to evict.
    pub bypassed_tenant_full: u64,
    /// Duplicate, stale or unknown events ignored.
    pub stale_events: u64,
    /// Running turns whose worker failed them, waiting to be placed again.
    pub migrated_turns: u64,
    /// Peer replicas' session bindings that re-pinned or created a session.
    pub remote_bindings: u64,
    /// Peer bindings ignored: a local turn in flight, a paused session, or
    /// the session cap with nothing to evict.
    pub remote_bindings_ignored: u64,
    /// Peers' bindings forgotten because their replica bound more
    /// sessions than its cap.
    pub remote_bindings_forgotten: u64,
}

/// The turn a session has in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Turn {
    None,
    /// Admitted (or made ready), not yet dispatched.
    Admitted(RequestId),
    Running(RequestId),
}

#[derive(Debug)]
struct Session {
    /// Where its KV prefix lives.
    worker: Option<WorkerId>,
    /// Context tokens after its last completed turn (or the running turn's
    /// prompt): its footprint is this plus the buffer.
    context_tokens: u64,
    turn: Turn,
    /// Deferred turns, in arrival order.
    waiting: VecDeque<RequestId>,
    paused_since: Option<f64>,
    pause_after_turn: bool,
    last_active_ms: f64,
    /// Whose it is (the default tenant for a peer's binding).
    tenant: TenantId,
    /// Footprint counted in its worker's `resident` (0 when not counted).
    counted: u64,
    /// Whether `(counted, key)` is in its worker's idle index (saves a
    /// B-tree search on every event that does not change it).
    in_idle: bool,
}

impl Session {
    fn is_quiet(&self) -> bool {
        self.turn == Turn::None && self.waiting.is_empty()
    }
}

#[derive(Debug, Default)]
struct WorkerKv {
    capacity_tokens: u64,
    reported: Option<u64>,
    /// `resident` when the engine last reported.
    resident_at_report: u64,
    /// Footprints of unpaused sessions pinned here.
    resident: u64,
    /// Quiet, unpaused sessions pinned here: pause candidates, smallest first.
    idle: BTreeSet<(u64, SessionKey)>,
    /// Running turns' progress.
    running: FxHashMap<RequestId, (SessionKey, ProgressReader)>,
}

impl WorkerKv {
    fn usage(&self) -> u64 {
        match self.reported {
            Some(reported) => (reported + self.resident).saturating_sub(self.resident_at_report),
            None => {
                self.resident
                    + self
                        .running
                        .values()
                        .map(|(_, progress)| progress.read())
                        .sum::<u64>()
            }
        }
    }
}

/// Serializes session turns, keeps sessions on their worker, and pauses and
/// resumes them under KV pressure. See the module docs.
#[derive(Debug)]
pub struct SessionAwareStrategy {
    config: SessionAwareConfig,
    sessions: FxHashMap<SessionKey, Session>,
    /// Tracked requests and their session.
    requests: FxHashMap<RequestId, SessionKey>,
    workers: FxHashMap<WorkerId, WorkerKv>,
    /// Paused sessions by footprint, for best-fit resume.
    paused: BTreeSet<(u64, SessionKey)>,
    /// `(paused_since, session)` in pause order; stale entries are skipped.
    pause_order: VecDeque<(f64, SessionKey)>,
    /// `(last_active_ms, session)` of quiet sessions in activity order;
    /// stale entries (the session has been active since) are skipped.
    expiry: VecDeque<(f64, SessionKey)>,
    /// Each tenant's sessions (tenants with any), for its own cap.
    tenants: FxHashMap<TenantId, TenantSessions>,
    now_ms: f64,
    counters: SessionCounters,
}

/// One tenant's share of the sessions.
#[derive(Debug, Default)]
struct TenantSessions {
    /// Sessions retained.
    count: usize,
    /// `(last_active_ms, session)` of its quiet sessions in activity
    /// order, as [`SessionAwareStrategy::expiry`] (stale entries skipped).
    expiry: VecDeque<(f64, SessionKey)>,
}

impl SessionAwareStrategy {
    /// A strategy with no sessions; `config` must validate.
    pub fn new(config: SessionAwareConfig) -> Result<Self, SessionConfigError> {
        config.validate()?;
        Ok(Self {
            config,
            sessions: FxHashMap::default(),
            requests: FxHashMap::default(),
            workers: FxHashMap::default(),
            paused: BTreeSet::new(),
            pause_order: VecDeque::new(),
            expiry: VecDeque::new(),
            tenants: FxHashMap::default(),
            now_ms: 0.0,
            counters: SessionCounters::default(),
        })
    }

    /// The settings in force.
    pub fn config(&self) -> &SessionAwareConfig {
        &self.config
    }

    /// Sessions retained.
    pub fn sessions(&self) -> usize {
        self.sessions.len()
    }

    /// Sessions paused now.
    pub fn paused_sessions(&self) -> usize {
        self.paused.len()
    }

    /// The worker a session is pinned to.
    pub fn session_worker(&self, session: SessionKey) -> Option<WorkerId> {
        self.sessions.get(&session).and_then(|s| s.worker)
    }

    /// Whether a session is paused.
    pub fn is_paused(&self, session: SessionKey) -> bool {
        self.sessions
            .get(&session)
            .is_some_and(|s| s.paused_since.is_some())
    }

    /// Estimated KV tokens in use on a worker.
    pub fn worker_usage(&self, worker: WorkerId) -> Option<u64> {
        self.workers.get(&worker).map(WorkerKv::usage)
    }

    /// Footprints of the unpaused sessions pinned to a worker.
    pub fn resident_tokens(&self, worker: WorkerId) -> u64 {
        self.workers.get(&worker).map_or(0, |kv| kv.resident)
    }

    /// Counters.
    pub fn counters(&self) -> &SessionCounters {
        &self.counters
    }

    /// Estimate of heap bytes held: map tables, queue buffers, and set
    /// entries (a B-tree node holds up to 11 entries; counted at 2/3 full).
    pub fn estimated_bytes(&self) -> usize {
        let set_entry = std::mem::size_of::<(u64, SessionKey)>() * 3 / 2;
        let idle: usize = self.workers.values().map(|w| w.idle.len()).sum();
        crate::maps::map_bytes(&self.sessions)
            + crate::maps::map_bytes(&self.requests)
            + crate::maps::map_bytes(&self.workers)
            + (idle + self.paused.len()) * set_entry
            + (self.expiry.capacity() + self.pause_order.capacity())
                * std::mem::size_of::<(f64, SessionKey)>()
    }

    fn footprint(&self, session: &Session) -> u64 {
        session.context_tokens + self.config.buffer_per_session
    }

    /// Keeps a session's counted footprint and idle-index entry in step with
    /// its state. Call after any change to a session.
    fn settle(&mut self, key: SessionKey) {
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        let footprint = session.context_tokens + self.config.buffer_per_session;
        let want = if session.paused_since.is_none() && session.worker.is_some() {
            footprint
        } else {
            0
        };
        let was = session.counted;
        session.counted = want;
        let idle_now = want > 0 && session.is_quiet();
        let was_idle = std::mem::replace(&mut session.in_idle, idle_now);
        let worker = session.worker;
        if let Some(worker) = worker {
            if want == was && was_idle == idle_now {
                return;
            }
            let kv = self.workers.entry(worker).or_default();
            kv.resident = (kv.resident + want).saturating_sub(was);
            if was_idle {
                kv.idle.remove(&(was, key));
            }
            if idle_now {
                kv.idle.insert((want, key));
            }
        }
    }

    /// Takes a session's footprint off its worker before it moves.
    fn unpin(&mut self, key: SessionKey) {
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        let was = std::mem::take(&mut session.counted);
        let was_idle = std::mem::take(&mut session.in_idle);
        if let Some(worker) = session.worker {
            if let Some(kv) = self.workers.get_mut(&worker) {
                kv.resident = kv.resident.saturating_sub(was);
                if was_idle {
                    kv.idle.remove(&(was, key));
                }
            }
        }
    }

    fn touch(&mut self, key: SessionKey) {
        let now = self.now_ms;
        if let Some(session) = self.sessions.get_mut(&key) {
            session.last_active_ms = now;
            if session.is_quiet() {
                self.expiry.push_back((now, key));
                if let Some(t) = self.tenants.get_mut(&session.tenant) {
                    t.expiry.push_back((now, key));
                }
            }
        }
    }

    /// Makes room for a new session of `tenant`: its own least recently
    /// active quiet session goes when it is at its cap (the default tenant
    /// has none); `false` when it is at its cap with none quiet.
    fn room_for(&mut self, tenant: TenantId) -> bool {
        if tenant == TenantId::default() {
            return true;
        }
        let Some(t) = self.tenants.get_mut(&tenant) else {
            return true;
        };
        if t.count < self.config.max_sessions_per_tenant {
            return true;
        }
        while let Some((at, key)) = self
            .tenants
            .get_mut(&tenant)
            .and_then(|t| t.expiry.pop_front())
        {
            if self.quiet_since(key) == Some(at) {
                self.forget(key);
                self.counters.evicted_tenant += 1;
                return true;
            }
        }
        false
    }

    /// Retains a new session of `tenant`.
    fn insert(&mut self, key: SessionKey, session: Session) {
        let t = self.tenants.entry(session.tenant).or_default();
        t.count += 1;
        self.sessions.insert(key, session);
    }

    /// Evicts the least recently active quiet session.
    fn evict_one(&mut self) -> bool {
        while let Some((at, key)) = self.expiry.pop_front() {
            if self.quiet_since(key) == Some(at) {
                self.forget(key);
                self.counters.evicted += 1;
                return true;
            }
        }
        false
    }

    fn quiet_since(&self, key: SessionKey) -> Option<f64> {
        self.sessions
            .get(&key)
            .filter(|s| s.is_quiet())
            .map(|s| s.last_active_ms)
    }

    fn forget(&mut self, key: SessionKey) {
        self.unpin(key);
        if let Some(session) = self.sessions.remove(&key) {
            if let Some(t) = self.tenants.get_mut(&session.tenant) {
                t.count = t.count.saturating_sub(1);
                if t.count == 0 {
                    self.tenants.remove(&session.tenant);
                }
            }
            if session.paused_since.is_some() {
                let footprint = self.footprint(&session);
                self.paused.remove(&(footprint, key));
            }
        }
    }

    fn placement_for(&self, session: &Session, facts: Option<&RequestFacts<'_>>) -> Placement {
        match session.worker {
            Some(worker) if facts.is_none_or(|f| f.allows(worker)) => Placement::Exact(worker),
            _ => Placement::Any,
        }
    }

    /// A session's turn ended: pause it if marked, else start its next
    /// deferred turn, else it becomes quiet.
    fn after_turn(&mut self, key: SessionKey, out: &mut Vec<MakeReady>) {
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        if std::mem::take(&mut session.pause_after_turn) && session.paused_since.is_none() {
            self.pause(key);
        } else if session.paused_since.is_none() {
            if let Some(next) = session.waiting.pop_front() {
                session.turn = Turn::Admitted(next);
                let placement = self.placement_for(&self.sessions[&key], None);
                out.push(MakeReady {
                    id: next,
                    placement,
                });
            }
        }
        self.settle(key);
        self.touch(key);
    }

    fn pause(&mut self, key: SessionKey) {
        self.unpin(key);
        let now = self.now_ms;
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        session.paused_since = Some(now);
        let footprint = session.context_tokens + self.config.buffer_per_session;
        self.paused.insert((footprint, key));
        self.pause_order.push_back((now, key));
        self.counters.pauses += 1;
    }

    /// Resumes a paused session on `worker` (or where it was), starting its
    /// next deferred turn.
    fn resume(&mut self, key: SessionKey, worker: Option<WorkerId>, out: &mut Vec<MakeReady>) {
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        if session.paused_since.take().is_none() {
            return;
        }
        let footprint = session.context_tokens + self.config.buffer_per_session;
        self.paused.remove(&(footprint, key));
        if worker.is_some() {
            session.worker = worker;
        }
        if session.turn == Turn::None {
            if let Some(next) = session.waiting.pop_front() {
                session.turn = Turn::Admitted(next);
                let placement = self.placement_for(&self.sessions[&key], None);
                out.push(MakeReady {
                    id: next,
                    placement,
                });
            }
        }
        self.settle(key);
        self.touch(key);
    }

    fn reconcile(&mut self, out: &mut Vec<MakeReady>) {
        let now = self.now_ms;
        // Inactivity expiry: only entries that are due are visited.
        while let Some(&(at, key)) = self.expiry.front() {
            if at + self.config.session_expiry_ms > now {
                break;
            }
            self.expiry.pop_front();
            if self.quiet_since(key) == Some(at) {
                self.forget(key);
                self.counters.expired += 1;
            }
        }
        // Compact stale activity entries if they dominate.
        let sessions = &self.sessions;
        let live = |&(at, key): &(f64, SessionKey)| {
            sessions
                .get(&key)
                .is_some_and(|s| s.is_quiet() && s.last_active_ms == at)
        };
        if self.expiry.len() > 2 * self.sessions.len() + 1024 {
            self.expiry.retain(live);
        }
        for t in self.tenants.values_mut() {
            if t.expiry.len() > 2 * t.count + 64 {
                t.expiry.retain(live);
            }
        }
        // Forced resumes.
        while let Some(&(since, key)) = self.pause_order.front() {
            let current = self.sessions.get(&key).and_then(|s| s.paused_since);
            if current != Some(since) {
                self.pause_order.pop_front();
                continue;
            }
            if since + self.config.resume_timeout_ms > now {
                break;
            }
            self.pause_order.pop_front();
            self.resume(key, None, out);
            self.counters.forced_resumes += 1;
        }
        let workers: Vec<WorkerId> = self.workers.keys().copied().collect();
        for &worker in &workers {
            self.relieve(worker);
        }
        for &worker in &workers {
            self.refill(worker, out);
        }
    }

    /// Pauses sessions on an over-full worker.
    fn relieve(&mut self, worker: WorkerId) {
        let Some(kv) = self.workers.get(&worker) else {
            return;
        };
        let capacity = kv.capacity_tokens as f64;
        if capacity <= 0.0 || (kv.usage() as f64) <= self.config.pause_threshold * capacity {
            return;
        }
        let target = self.config.pause_target * capacity;
        while let Some(&(_, key)) = self.workers[&worker].idle.first() {
            if self.workers[&worker].usage() as f64 <= target {
                return;
            }
            self.pause(key);
        }
        let kv = &self.workers[&worker];
        let mut usage = kv.usage() as f64;
        if usage <= target {
            return;
        }
        let mut running: Vec<(u64, SessionKey)> = kv
            .running
            .values()
            .filter_map(|(key, _)| {
                let s = self.sessions.get(key)?;
                (!s.pause_after_turn).then_some((s.counted, *key))
            })
            .collect();
        running.sort_unstable();
        for (footprint, key) in running {
            if usage <= target {
                break;
            }
            if let Some(session) = self.sessions.get_mut(&key) {
                session.pause_after_turn = true;
                self.counters.marked += 1;
                usage -= footprint as f64;
            }
        }
    }

    /// Resumes paused sessions best-fit into a worker's free room.
    fn refill(&mut self, worker: WorkerId, out: &mut Vec<MakeReady>) {
        let Some(kv) = self.workers.get(&worker) else {
            return;
        };
        let capacity = kv.capacity_tokens as f64;
        if capacity <= 0.0 {
            return;
        }
        let level = (self.config.pause_target - self.config.resume_hysteresis) * capacity;
        loop {
            let usage = self.workers[&worker].usage() as f64;
            let room = level - usage;
            if room < 1.0 {
                return;
            }
            let Some(&(_, key)) = self
                .paused
                .range(..=(room as u64, SessionKey(u64::MAX)))
                .next_back()
            else {
                return;
            };
            self.resume(key, Some(worker), out);
            self.counters.resumes += 1;
        }
    }
}

impl AdmissionStrategy for SessionAwareStrategy {
    fn name(&self) -> &'static str {
        "session-aware"
    }

    fn admit(&mut self, facts: &RequestFacts<'_>) -> Admission {
        let Some(key) = facts.session else {
            self.counters.bypassed += 1;
            return Admission::Bypass;
        };
        self.now_ms = self.now_ms.max(facts.now_ms);
        if !self.sessions.contains_key(&key) {
            if !self.room_for(facts.flow.tenant) {
                self.counters.bypassed_tenant_full += 1;
                return Admission::Bypass;
            }
            if self.sessions.len() >= self.config.max_sessions && !self.evict_one() {
                self.counters.bypassed_full += 1;
                return Admission::Bypass;
            }
            self.insert(
                key,
                Session {
                    worker: None,
                    context_tokens: facts.context_tokens as u64,
                    turn: Turn::None,
                    waiting: VecDeque::new(),
                    paused_since: None,
                    pause_after_turn: false,
                    last_active_ms: facts.now_ms,
                    tenant: facts.flow.tenant,
                    counted: 0,
                    in_idle: false,
                },
            );
        }
        self.requests.insert(facts.id, key);
        let session = self.sessions.get_mut(&key).expect("inserted above");
        session.last_active_ms = facts.now_ms;
        let admission = if session.turn != Turn::None || session.paused_since.is_some() {
            session.waiting.push_back(facts.id);
            self.counters.deferred_turns += 1;
            Admission::Defer
        } else {
            session.turn = Turn::Admitted(facts.id);
            Admission::Ready(self.placement_for(&self.sessions[&key], Some(facts)))
        };
        // No longer quiet: out of the idle index (its footprint stays).
        self.settle(key);
        admission
    }

    fn on_event(&mut self, event: &LifecycleEvent, now_ms: f64, out: &mut Vec<MakeReady>) {
        self.now_ms = self.now_ms.max(now_ms);
        match event {
            LifecycleEvent::Dispatched {
                id,
                worker,
                progress,
            } => {
                let Some(&key) = self.requests.get(id) else {
                    self.counters.stale_events += 1;
                    return;
                };
                let Some(session) = self.sessions.get_mut(&key) else {
                    self.counters.stale_events += 1;
                    return;
                };
                if session.turn != Turn::Admitted(*id) {
                    self.counters.stale_events += 1;
                    return;
                }
                session.turn = Turn::Running(*id);
                if session.worker != Some(*worker) {
                    self.unpin(key);
                    if let Some(session) = self.sessions.get_mut(&key) {
                        session.worker = Some(*worker);
                    }
                }
                self.settle(key);
                self.workers
                    .entry(*worker)
                    .or_default()
                    .running
                    .insert(*id, (key, progress.clone()));
            }
            LifecycleEvent::Completed { id, context_tokens } => {
                self.end_turn(*id, Some(*context_tokens), out);
            }
            LifecycleEvent::Aborted { id } => self.end_turn(*id, None, out),
            LifecycleEvent::Migrating { id, from } => self.migrating(*id, *from),
            LifecycleEvent::Reconcile => self.reconcile(out),
        }
    }

    fn reconcile_interval_ms(&self) -> f64 {
        self.config.reconcile_interval_ms
    }

    fn on_unavailable(&mut self, _id: RequestId, _worker: WorkerId, why: Unavailable) -> Fallback {
        match (why, self.config.affinity) {
            (Unavailable::Busy, Affinity::Strict) => Fallback::Wait,
            _ => Fallback::Any,
        }
    }

    fn observe_remote_binding(
        &mut self,
        session: SessionKey,
        worker: WorkerId,
        context_tokens: u64,
        now_ms: f64,
    ) {
        self.now_ms = self.now_ms.max(now_ms);
        match self.sessions.get(&session) {
            // What this replica is doing with the session now wins.
            Some(s) if !s.is_quiet() || s.paused_since.is_some() => {
                self.counters.remote_bindings_ignored += 1;
                return;
            }
            Some(_) => self.unpin(session),
            None => {
                if self.sessions.len() >= self.config.max_sessions && !self.evict_one() {
                    self.counters.remote_bindings_ignored += 1;
                    return;
                }
                self.insert(
                    session,
                    Session {
                        worker: None,
                        context_tokens,
                        turn: Turn::None,
                        waiting: VecDeque::new(),
                        paused_since: None,
                        pause_after_turn: false,
                        last_active_ms: self.now_ms,
                        tenant: TenantId::default(),
                        counted: 0,
                        in_idle: false,
                    },
                );
            }
        }
        let s = self
            .sessions
            .get_mut(&session)
            .expect("present or inserted");
        s.worker = Some(worker);
        s.context_tokens = context_tokens;
        self.counters.remote_bindings += 1;
        self.settle(session);
        self.touch(session);
    }

    fn forget_remote_binding(&mut self, session: SessionKey) {
        let quiet = self
            .sessions
            .get(&session)
            .is_some_and(|s| s.is_quiet() && s.paused_since.is_none());
        if quiet {
            self.forget(session);
            self.counters.remote_bindings_forgotten += 1;
        }
    }

    fn observe_kv(&mut self, worker: WorkerId, usage: KvUsage) {
        let kv = self.workers.entry(worker).or_default();
        kv.capacity_tokens = usage.capacity_tokens;
        kv.reported = usage.used_tokens;
        kv.resident_at_report = kv.resident;
    }

    fn tracked_requests(&self) -> usize {
        self.requests.len()
    }

    fn event_counts(&self) -> Vec<(&'static str, u64)> {
        let c = &self.counters;
        vec![
            ("bypassed", c.bypassed),
            ("bypassed_full", c.bypassed_full),
            ("deferred_turns", c.deferred_turns),
            ("pauses", c.pauses),
            ("marked", c.marked),
            ("resumes", c.resumes),
            ("forced_resumes", c.forced_resumes),
            ("expired", c.expired),
            ("evicted", c.evicted),
            ("evicted_tenant", c.evicted_tenant),
            ("bypassed_tenant_full", c.bypassed_tenant_full),
            ("stale_events", c.stale_events),
            ("migrated_turns", c.migrated_turns),
            ("remote_bindings", c.remote_bindings),
            ("remote_bindings_forgotten", c.remote_bindings_forgotten),
        ]
    }
}

impl SessionAwareStrategy {
    /// A running turn's worker failed it: it is still the session's turn
    /// (later turns keep waiting), no longer running on `from`; its next
    /// `Dispatched` re-pins the session where it lands.
    fn migrating(&mut self, id: RequestId, from: WorkerId) {
        let Some(&key) = self.requests.get(&id) else {
            self.counters.stale_events += 1;
            return;
        };
        let Some(session) = self.sessions.get_mut(&key) else {
            self.counters.stale_events += 1;
            return;
        };
        if session.turn != Turn::Running(id) {
            self.counters.stale_events += 1;
            return;
        }
        session.turn = Turn::Admitted(id);
        if let Some(kv) = self.workers.get_mut(&from) {
            kv.running.remove(&id);
        }
        self.counters.migrated_turns += 1;
        self.settle(key);
    }

    fn end_turn(&mut self, id: RequestId, context_tokens: Option<u64>, out: &mut Vec<MakeReady>) {
        let Some(key) = self.requests.remove(&id) else {
            self.counters.stale_events += 1;
            return;
        };
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        match session.turn {
            Turn::Admitted(turn) | Turn::Running(turn) if turn == id => {
                session.turn = Turn::None;
                if let Some(context_tokens) = context_tokens {
                    session.context_tokens = context_tokens;
                }
                if let Some(worker) = session.worker {
                    if let Some(kv) = self.workers.get_mut(&worker) {
                        kv.running.remove(&id);
                    }
                }
                self.after_turn(key, out);
            }
            _ => {
                // A deferred turn that never ran.
                if let Some(pos) = session.waiting.iter().position(|&w| w == id) {
                    session.waiting.remove(pos);
                }
                self.settle(key);
                self.touch(key);
            }
        }
    }
}

#[cfg(test)]
#[path = "session_tests.rs"]
mod tests;
