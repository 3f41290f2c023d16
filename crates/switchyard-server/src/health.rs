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

use super::metrics::render_by_worker;
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

/// Applies one outcome of a request dispatched in the breaker's
/// `generation` to `worker`'s breaker and brings its selectability in
/// line. Unknown workers (removed meanwhile), workers out of the router
/// and results of an earlier generation (late) are ignored.
pub(crate) fn circuit_event(
    core: &mut Core,
    worker: WorkerId,
    event: CircuitEvent,
    generation: u64,
    now_ms: f64,
) {
    let config = core.circuit_config;
    if let Some(info) = core.workers.get_mut(&worker) {
        step(&mut core.router, info, event, generation, &config, now_ms);
    }
}

/// [`circuit_event`] on parts of the core (for callers that hold them
/// borrowed apart).
pub(crate) fn step(
    router: &mut Router,
    info: &mut WorkerInfo,
    event: CircuitEvent,
    generation: u64,
    config: &CircuitConfig,
    now_ms: f64,
) {
    if !info.in_router {
        return;
    }
    let changed = info
        .circuit
        .breaker
        .on_result(event, generation, now_ms, config);
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
/// 2 half-open) and `switchyard_circuit_transitions_total{worker,to}`, for
/// `workers` sorted by name.
pub(crate) fn render(workers: &[&WorkerInfo], out: &mut String) {
    render_by_worker(
        out,
        "switchyard_circuit_state",
        "gauge",
        "Circuit breaker per worker: 0 closed, 1 open, 2 half-open.",
        workers
            .iter()
            .map(|w| (&*w.name, w.circuit.breaker.state() as u8)),
    );
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

#[cfg(test)]
mod tests {
    use super::super::metrics::ServerMetrics;
    use super::super::state::{Booking, SharedRouter, Submission};
    use super::super::{build_router, ServerConfig};
    use std::sync::Arc;
    use switchyard_core::admission::AdmissionController;
    use switchyard_core::health::CircuitConfig;
    use switchyard_core::WorkerId;

    fn shared(workers: usize) -> (Arc<SharedRouter>, Vec<WorkerId>) {
        let config = ServerConfig {
            policy: switchyard_core::select::PolicyKind::RoundRobin,
            ..ServerConfig::default()
        };
        let admission = AdmissionController::new(config.queue.clone(), None).unwrap();
        let shared = Arc::new(SharedRouter::new(
            build_router(&config).unwrap(),
            admission,
            Arc::new(ServerMetrics::default()),
        ));
        shared.set_circuit_config(CircuitConfig {
            failure_threshold: 2,
            cooldown_ms: 60_000,
            max_cooldown_ms: 60_000,
        });
        let ids = (0..workers)
            .map(|i| {
                let id = shared
                    .add_worker(&format!("w{i}"), &format!("http://h:{i}"))
                    .unwrap();
                shared.set_in_router(id, true);
                id
            })
            .collect();
        (shared, ids)
    }

    async fn book(shared: &Arc<SharedRouter>) -> Option<Booking> {
        let id = shared.next_request_id();
        let wait = shared
            .submit(
                id,
                Submission {
                    blocks: Vec::new(),
                    prompt_tokens: 1,
                    session: None,
                    model: None,
                    exclude: &[],
                },
            )
            .ok()?;
        wait.placed().await.ok()
    }

    fn state_of(shared: &SharedRouter, id: WorkerId) -> u8 {
        shared.with_core(|core| core.workers[&id].circuit.breaker.state() as u8)
    }

    #[tokio::test]
    async fn failed_bookings_open_the_circuit_and_no_request_reaches_that_worker_again() {
        let (shared, ids) = shared(2);
        let mut failures = 0;
        while failures < 2 {
            let booking = book(&shared).await.expect("a worker is free");
            if booking.worker == ids[0] {
                booking.worker_failed();
                // Reported twice, counted once.
                booking.worker_failed();
                failures += 1;
            }
        }
        assert_eq!(state_of(&shared, ids[0]), 1, "open");
        for _ in 0..10 {
            let booking = book(&shared).await.unwrap();
            assert_eq!(booking.worker, ids[1]);
        }
        // The worker is still in the router: only selection skips it.
        assert!(shared.workers()[0].in_router);
    }

    #[tokio::test]
    async fn a_first_token_is_a_success_that_resets_the_failure_streak() {
        let (shared, ids) = shared(1);
        book(&shared).await.unwrap().worker_failed();
        book(&shared).await.unwrap().mark_first_token();
        book(&shared).await.unwrap().worker_failed();
        assert_eq!(
            state_of(&shared, ids[0]),
            0,
            "closed: the streak was broken"
        );
        book(&shared).await.unwrap().worker_failed();
        assert_eq!(state_of(&shared, ids[0]), 1, "open after two in a row");
        assert!(book(&shared).await.is_none(), "no worker can take it");
    }

    #[tokio::test]
    async fn a_worker_that_leaves_and_reenters_the_router_starts_with_a_closed_circuit() {
        let (shared, ids) = shared(1);
        book(&shared).await.unwrap().worker_failed();
        book(&shared).await.unwrap().worker_failed();
        assert_eq!(state_of(&shared, ids[0]), 1);
        shared.set_in_router(ids[0], false);
        shared.set_in_router(ids[0], true);
        assert_eq!(state_of(&shared, ids[0]), 0);
        assert!(book(&shared).await.is_some());
    }
}
