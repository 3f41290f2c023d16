//! Worker health in the server: the shell around
//! [`switchyard_core::health::CircuitBreaker`].
//!
//! Two mechanisms, two consequences:
//!
//! - **Passive** (this module): request outcomes feed each worker's
//!   breaker — a failure from [`super::state::Booking::worker_failed`], a
//!   success at the first token, a dispatch, a booking that ended with no
//!   verdict. An open circuit makes the worker unselectable
//!   ([`switchyard_core::Router::set_selectable`]) but keeps its prefix
//!   index and bookings: a transient failure streak costs no cache.
//! - **Active** ([`super::workers::Fleet::check_all`]): `health_failures`
//!   consecutive failed `GET /health` declare the worker dead. A dead
//!   worker leaves the routing core entirely (index entries and active
//!   sequences dropped, KV-event subscriber stopped); a passing check
//!   re-admits it with a fresh breaker and a fresh subscriber that clears
//!   and rebuilds its index.
//!
//! Everything here runs under the core's lock and is a few field updates.

use super::state::{Core, WorkerInfo};
use std::fmt::Write as _;
use switchyard_core::health::{
    CircuitBreaker, CircuitConfig, CircuitEvent, CircuitState, Transitions,
};
use switchyard_core::{Router, WorkerId};

/// A worker's breaker and its transition counters (reset with the worker).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct WorkerCircuit {
    /// The breaker.
    pub breaker: CircuitBreaker,
    /// Transitions into each state, indexed by `CircuitState as usize`.
    pub transitions: [u64; 3],
}

impl WorkerCircuit {
    fn count(&mut self, changed: Transitions) {
        for to in changed.iter() {
            self.transitions[to as usize] += 1;
        }
    }
}

/// Applies one request outcome to `worker`'s breaker and brings its
/// selectability in line. Unknown workers (removed meanwhile) and workers
/// out of the router are ignored.
pub(crate) fn circuit_event(core: &mut Core, worker: WorkerId, event: CircuitEvent, now_ms: f64) {
    let config = core.circuit_config;
    if let Some(info) = core.workers.get_mut(&worker) {
        step(&mut core.router, info, event, &config, now_ms);
    }
}

/// [`circuit_event`] on parts of the core (for callers that hold them
/// borrowed apart).
pub(crate) fn step(
    router: &mut Router,
    info: &mut WorkerInfo,
    event: CircuitEvent,
    config: &CircuitConfig,
    now_ms: f64,
) {
    if !info.in_router {
        return;
    }
    let changed = info.circuit.breaker.on_event(event, now_ms, config);
    settle(router, info, changed);
}

/// Ends the cooldowns that are over (half-open circuits admit a probe).
pub(crate) fn poll_circuits(core: &mut Core, now_ms: f64) {
    let Core {
        router, workers, ..
    } = core;
    for info in workers.values_mut() {
        if info
            .circuit
            .breaker
            .open_until_ms()
            .is_some_and(|t| t <= now_ms)
        {
            let changed = info.circuit.breaker.poll(now_ms);
            settle(router, info, changed);
        }
    }
}

/// The earliest end of a cooldown, for the ticker.
pub(crate) fn next_cooldown_end(core: &Core) -> Option<f64> {
    core.workers
        .values()
        .filter_map(|w| w.circuit.breaker.open_until_ms())
        .min_by(f64::total_cmp)
}

/// Counts and logs `changed` and sets the worker's selectability.
fn settle(router: &mut Router, info: &mut WorkerInfo, changed: Transitions) {
    info.circuit.count(changed);
    for to in changed.iter() {
        match to {
            CircuitState::Open => tracing::warn!(
                worker = %info.name,
                cooldown_until_ms = info.circuit.breaker.open_until_ms().unwrap_or_default(),
                "circuit open: worker out of selection"
            ),
            CircuitState::HalfOpen => {
                tracing::info!(worker = %info.name, "circuit half-open: one probe request")
            }
            CircuitState::Closed => tracing::info!(worker = %info.name, "circuit closed"),
        }
    }
    let selectable = info.in_router && info.circuit.breaker.admits();
    router.set_selectable(info.id, selectable);
}

/// Appends `switchyard_circuit_state{worker}` (0 closed, 1 open,
/// 2 half-open) and `switchyard_circuit_transitions_total{worker,to}`.
pub(crate) fn render(workers: &mut [&WorkerInfo], out: &mut String) {
    workers.sort_unstable_by(|a, b| a.name.cmp(&b.name));
    out.push_str("# HELP switchyard_circuit_state Circuit breaker per worker: 0 closed, 1 open, 2 half-open.\n# TYPE switchyard_circuit_state gauge\n");
    for w in workers.iter() {
        let _ = writeln!(
            out,
            "switchyard_circuit_state{{worker=\"{}\"}} {}",
            w.name,
            w.circuit.breaker.state() as u8
        );
    }
    out.push_str("# HELP switchyard_circuit_transitions_total Circuit breaker transitions per worker, by the state entered.\n# TYPE switchyard_circuit_transitions_total counter\n");
    for w in workers.iter() {
        for to in CircuitState::ALL {
            let _ = writeln!(
                out,
                "switchyard_circuit_transitions_total{{worker=\"{}\",to=\"{}\"}} {}",
                w.name,
                to.label(),
                w.circuit.transitions[to as usize]
            );
        }
    }
}
