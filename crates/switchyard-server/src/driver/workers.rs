//! The driver's calls on the worker table ([`crate::roster`], the one
//! table): workers joining and leaving, in or out
//! of selection, their health, capacity, roles, models and adapters, and
//! the KV events checked against their liveness. Each call takes the
//! routing lock (or, for KV events, the event writer's own lock) and,
//! where the dispatcher decides, drives it.

use crate::roster::{Role, WorkerInfo};
use rustc_hash::FxHashMap;
use std::sync::{Mutex, MutexGuard};
use switchyard_core::dispatch::Effects;
use switchyard_core::health::{CircuitConfig, CircuitConfigError, CircuitState};
use switchyard_core::index::published::IndexWriter;
use switchyard_core::index::{CacheTier, IndexEvent};
use switchyard_core::router::WorkerCapacity;
use switchyard_core::WorkerId;

use super::Driver;

/// The KV-event side of the routing state: the published indexes' writer
/// and the liveness table events are checked against, so that applying
/// an event never takes the routing lock.
pub(super) struct EventWriter {
    pub(super) index: IndexWriter,
    /// The workers in the router and the events epoch of each: a
    /// subscriber's event is applied only while its epoch is its worker's
    /// here. Mirrors the roster's `in_router` entries (as bounded as the
    /// roster), kept in step by [`Driver::set_in_router`] under this
    /// lock.
    pub(super) live: FxHashMap<WorkerId, u64>,
}

/// The event writer's lock; a panic while it was held leaves the index as
/// consistent as its own invariants make it.
pub(super) fn lock_writer(writer: &Mutex<EventWriter>) -> MutexGuard<'_, EventWriter> {
    writer.lock().unwrap_or_else(|p| p.into_inner())
}

impl Driver {
    /// A worker's loaded adapters as its `/v1/models` lists them.
    pub(crate) fn adapter_report(&self, id: WorkerId, names: &[String]) {
        let now = self.now_ms();
        let mut inner = self.lock();
        let table = inner.dispatcher.adapters_mut();
        table.set_loaded(id, names.iter().map(String::as_str), now);
        let (total, dropped) = (table.total(), table.counters().dropped);
        drop(inner);
        self.adapters.observe_table(total, dropped);
    }

    /// Marks adapter `name` as one the router cannot load (learned from a
    /// worker, not configured), or clears the mark: see
    /// [`switchyard_core::adapters::AdapterTable::set_holders_only`].
    pub(crate) fn adapter_holders_only(&self, name: &str, on: bool) {
        self.lock()
            .dispatcher
            .adapters_mut()
            .set_holders_only(name, on);
    }

    /// A worker's adapter slots (`max_loras`), when it reports them.
    pub(crate) fn adapter_slots(&self, id: WorkerId, slots: Option<usize>) {
        self.lock().dispatcher.adapters_mut().set_slots(id, slots);
    }

    /// The adapter slots the router knows of worker `id`.
    pub(crate) fn adapter_slots_of(&self, id: WorkerId) -> Option<usize> {
        self.lock().dispatcher.router().adapters().slots(id)
    }

    /// `adapter` is loaded on worker `id` now (a load the router made).
    pub(crate) fn adapter_loaded(&self, id: WorkerId, adapter: &str) {
        let now = self.now_ms();
        self.lock()
            .dispatcher
            .adapters_mut()
            .mark_loaded(id, adapter, now, now);
    }

    /// `adapter` is not (or no longer) loaded on worker `id`.
    pub(crate) fn adapter_unloaded(&self, id: WorkerId, adapter: &str) {
        self.lock()
            .dispatcher
            .adapters_mut()
            .mark_unloaded(id, adapter);
    }

    // ---- Workers ------------------------------------------------------

    /// Registers a worker (not yet in selection until `set_in_router`).
    pub fn add_worker(&self, name: &str, url: &str) -> Result<WorkerId, String> {
        // Replicas name workers by id: derive it from the name, not the order.
        let id = switchyard_replica::worker_id_for_name(name);
        self.lock().roster.insert(id, name, url)?;
        Ok(id)
    }

    /// Registers data-parallel rank `rank` of the worker at `url` as a
    /// target of its own, named `name` (its id is the worker's name's with
    /// the rank, so replicas agree on it).
    pub fn add_worker_rank(
        &self,
        name: &str,
        url: &str,
        id: WorkerId,
        rank: u32,
    ) -> Result<WorkerId, String> {
        let mut inner = self.lock();
        inner.roster.insert(id, name, url)?;
        inner.roster.set_dp_rank(id, rank);
        Ok(id)
    }

    /// Puts a worker into selection or takes it out. Taking it out drops
    /// its index entries and bookings; putting it back starts a fresh
    /// circuit and a new KV-event epoch.
    pub fn set_in_router(&self, id: WorkerId, in_router: bool) {
        // The event writer's lock first (the lock order), held across the
        // roster change: an event checked after it sees the new liveness,
        // one checked before has been applied already.
        let mut events = self.index_writer.as_ref().map(lock_writer);
        let epoch = self.drive(|inner, now| {
            let Some(info) = inner.roster.get_mut(id) else {
                return (None, Effects::default());
            };
            if info.in_router == in_router {
                return (None, Effects::default());
            }
            info.in_router = in_router;
            if in_router {
                info.failures = 0;
                info.events_epoch += 1;
                let (capacity, used, epoch) = (info.capacity, info.kv_usage, info.events_epoch);
                let fx = inner.dispatcher.add_worker(id, capacity, now);
                inner.dispatcher.report_kv(id, used);
                (Some(epoch), fx)
            } else {
                (Some(0), inner.dispatcher.remove_worker(id, now))
            }
        });
        if let (Some(events), Some(epoch)) = (events.as_mut(), epoch) {
            if in_router {
                events.live.insert(id, epoch);
            } else {
                events.live.remove(&id);
                events.index.remove_worker(id);
            }
        }
    }

    /// Sets every worker's circuit-breaker settings.
    pub fn set_circuit_config(&self, config: CircuitConfig) -> Result<(), CircuitConfigError> {
        self.lock().dispatcher.set_circuit_config(config)
    }

    /// A worker's circuit state, while it is in the router.
    pub fn circuit_state(&self, id: WorkerId) -> Option<CircuitState> {
        self.lock().dispatcher.circuit_state(id)
    }

    /// Whether a worker's circuit would take a request now.
    pub fn circuit_admits(&self, id: WorkerId) -> Option<bool> {
        self.lock().dispatcher.circuit_admits(id)
    }

    /// The epoch a KV-event subscriber started now belongs to (`None` while
    /// the worker is out of the router).
    pub fn events_epoch(&self, id: WorkerId) -> Option<u64> {
        let inner = self.lock();
        let info = inner.roster.get(id)?;
        info.in_router.then_some(info.events_epoch)
    }

    /// Applies a KV event about one of `worker`'s cache tiers from the
    /// subscriber of `epoch`; a stale subscriber's (the worker left the
    /// router since) is dropped and counted. Returns whether it was
    /// applied. Both tiers take the same path: with a published index, the
    /// writer's lock alone (the liveness check is its table's); otherwise
    /// the routing lock.
    pub fn apply_worker_event(
        &self,
        worker: WorkerId,
        epoch: u64,
        tier: CacheTier,
        event: &IndexEvent,
    ) -> bool {
        let live = match &self.index_writer {
            Some(writer) => {
                let mut writer = lock_writer(writer);
                let live = writer.live.get(&worker) == Some(&epoch);
                if live {
                    writer.index.apply(worker, tier, event);
                }
                live
            }
            None => {
                let mut inner = self.lock();
                let live = inner
                    .roster
                    .get(worker)
                    .is_some_and(|w| w.in_router && w.events_epoch == epoch);
                if live {
                    inner.dispatcher.apply_kv_event(worker, tier, event);
                }
                live
            }
        };
        if !live {
            self.metrics.stale_kv_events.inc();
        }
        live
    }

    /// Removes a worker entirely.
    pub fn remove_worker(&self, id: WorkerId) -> Option<WorkerInfo> {
        self.set_in_router(id, false);
        self.lock().roster.remove(id)
    }

    /// Sets a worker's part in a disaggregated fleet (and, for SGLang, its
    /// bootstrap port).
    pub fn set_role(&self, id: WorkerId, role: Role, bootstrap_port: Option<u16>) {
        if let Some(info) = self.lock().roster.get_mut(id) {
            info.role = role;
            info.bootstrap_port = bootstrap_port;
        }
    }

    /// A worker's role and bootstrap port.
    pub fn role_of(&self, id: WorkerId) -> Option<(Role, Option<u16>)> {
        let inner = self.lock();
        let info = inner.roster.get(id)?;
        Some((info.role, info.bootstrap_port))
    }

    /// Whether the fleet has a prefill and a decode worker
    /// ([`Roster::disaggregated`]).
    pub fn disaggregated(&self) -> bool {
        self.lock().roster.disaggregated()
    }

    /// Marks a worker draining (no new requests).
    pub fn set_draining(&self, id: WorkerId) {
        if let Some(info) = self.lock().roster.get_mut(id) {
            info.draining = true;
        }
    }

    /// Records one health-check result; returns whether the worker should
    /// now be in selection.
    pub fn health_result(&self, id: WorkerId, ok: bool, threshold: u32) -> Option<bool> {
        let mut inner = self.lock();
        let info = inner.roster.get_mut(id)?;
        if ok {
            info.failures = 0;
            Some(true)
        } else {
            info.failures = info.failures.saturating_add(1);
            Some(info.failures < threshold && info.in_router)
        }
    }

    /// One worker's row, if it is in the fleet.
    pub fn worker(&self, id: WorkerId) -> Option<WorkerInfo> {
        self.lock().roster.get(id).cloned()
    }

    /// Snapshot of the worker table, sorted by name.
    pub fn workers(&self) -> Vec<WorkerInfo> {
        self.lock().roster.sorted().into_iter().cloned().collect()
    }

    /// Sets a worker's capacity (the busy thresholds use it from its next
    /// entry into selection; the admission strategy at once).
    pub fn set_capacity(&self, id: WorkerId, capacity: WorkerCapacity) {
        let mut inner = self.lock();
        let Some(info) = inner.roster.get_mut(id) else {
            return;
        };
        info.capacity = capacity;
        let (in_router, used) = (info.in_router, info.kv_usage);
        if in_router {
            // Updates the capacity in place: places nothing new.
            let now = self.now_ms();
            let fx = inner.dispatcher.add_worker(id, capacity, now);
            self.carry_out(&mut inner, fx, now);
            inner.dispatcher.report_kv(id, used);
        }
    }

    /// Whether an admission strategy wants the workers' KV usage.
    pub fn wants_kv_usage(&self) -> bool {
        self.lock().dispatcher.admission().strategy().is_some()
    }

    /// Records a worker's measured KV usage (a fraction, clamped to 0..=1;
    /// not a number: ignored) and passes it to the admission strategy.
    pub fn set_kv_usage(&self, id: WorkerId, fraction: f64) {
        if !fraction.is_finite() {
            return;
        }
        let fraction = fraction.clamp(0.0, 1.0);
        let mut inner = self.lock();
        let Some(info) = inner.roster.get_mut(id) else {
            return;
        };
        info.kv_usage = Some(fraction);
        inner.dispatcher.report_kv(id, Some(fraction));
    }

    /// Sets a worker's model list.
    pub fn set_models(&self, id: WorkerId, models: Vec<String>) {
        if let Some(info) = self.lock().roster.get_mut(id) {
            info.models = models;
        }
    }

    /// Active requests booked on `id` (0 when unknown): this replica's
    /// and, with replica sync on, its peers'. This is the worker's load.
    pub fn active_requests(&self, id: WorkerId) -> usize {
        self.lock()
            .dispatcher
            .router()
            .sequences()
            .registry()
            .load(id)
            .map_or(0, |l| l.requests)
    }

    /// Requests booked on any worker.
    pub fn total_active_requests(&self) -> usize {
        self.lock()
            .dispatcher
            .router()
            .sequences()
            .active_requests()
    }

    /// Requests this replica booked on `id` and has not freed. Draining
    /// waits for these only — a peer's bookings end on the peer.
    pub fn local_requests(&self, id: WorkerId) -> usize {
        self.lock().dispatcher.local_requests_on(id)
    }
}
