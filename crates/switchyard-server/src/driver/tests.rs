use super::*;
use crate::config::AdmissionMode;
use crate::driver::booking::{Booking, WaitHandle};
use crate::testing::{book_remotely, place, request, shared_with};
use crate::ServerConfig;
use std::sync::Arc;
use switchyard_core::health::{CircuitConfig, CircuitState};
use switchyard_core::index::{CacheTier, IndexEvent};
use switchyard_core::select::PolicyKind;
use switchyard_core::select::RoutingRequest;
use switchyard_core::{LocalHash, WorkerId};

fn round_robin() -> ServerConfig {
    ServerConfig {
        policy: PolicyKind::RoundRobin,
        ..ServerConfig::default()
    }
}

/// A one-block request placed on whichever worker takes it.
async fn booked(driver: &Arc<Driver>) -> Booking {
    place(driver, request(&[], 1))
        .await
        .expect("a worker takes it")
}

#[test]
fn request_ids_are_distinct_and_share_no_predictable_part() {
    let (driver, _) = shared_with(&ServerConfig::default(), &["a"]);
    let ids: Vec<u128> = (0..2_000).map(|_| driver.next_request_id().0).collect();
    let distinct: std::collections::HashSet<u128> = ids.iter().copied().collect();
    assert_eq!(distinct.len(), ids.len());
    assert!(ids
        .iter()
        .all(|&id| id != 0 && id & switchyard_core::replica::REMOTE_KEY_BIT == 0));
    // A start-time salt and a counter would repeat the high half and
    // step the low half by one; 128 random bits do neither.
    let highs: std::collections::HashSet<u64> = ids.iter().map(|&id| (id >> 64) as u64).collect();
    assert!(highs.len() > 1_990, "{} distinct high halves", highs.len());
    let steps = ids
        .windows(2)
        .filter(|w| w[1].wrapping_sub(w[0]) == 1)
        .count();
    assert_eq!(steps, 0);
    // Still a valid header value: 32 lowercase hex digits.
    let text = RequestId(ids[0]).to_string();
    assert_eq!(text.len(), 32);
    assert!(text.bytes().all(|b| b.is_ascii_hexdigit()));
}

#[tokio::test]
async fn a_migrated_request_never_goes_back_to_a_worker_that_failed_it() {
    let (driver, _) = shared_with(&round_robin(), &["a", "b", "c"]);
    // Failing every worker in turn must not open their circuits.
    with_circuit(&driver, 100, 60_000);
    for _ in 0..4 {
        let mut booking = place(&driver, request(&[], 4)).await.unwrap();
        let mut failed = Vec::new();
        for _ in 0..2 {
            booking.worker_failed();
            failed.push(booking.worker);
            let wait = booking.migrate(None).unwrap();
            booking = wait.placed().await.unwrap();
            assert!(!failed.contains(&booking.worker), "{failed:?}");
        }
        // The last worker fails it too: no worker can take it.
        booking.worker_failed();
        assert!(booking.migrate(None).unwrap().placed().await.is_err());
        assert_eq!(driver.total_active_requests(), 0);
    }
}

/// The default router following KV events (an exact, published index).
fn following_events() -> ServerConfig {
    ServerConfig {
        cache: crate::config::CacheMode::Events,
        ..ServerConfig::default()
    }
}

#[test]
fn without_kv_events_every_route_is_made_under_the_lock() {
    let (driver, _) = shared_with(&ServerConfig::default(), &["a"]);
    assert!(
        driver.pre.is_none(),
        "the approximate index is the router's own"
    );
    let (driver, _) = shared_with(
        &ServerConfig {
            policy: PolicyKind::CacheAware,
            ..following_events()
        },
        &["a"],
    );
    assert!(driver.pre.is_none(), "cache-aware keeps its own tree");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn requests_placed_from_many_threads_are_routed_before_the_lock_and_all_booked() {
    let (driver, ids) = shared_with(&following_events(), &["a", "b", "c", "d"]);
    assert!(
        driver.pre.is_some(),
        "the default policy routes outside the lock when it follows KV events"
    );
    let placing = (0..8u64).map(|t| {
        let driver = driver.clone();
        tokio::spawn(async move {
            // Every other booking is freed at once: frees and
            // bookings of all threads interleave.
            let mut bookings = Vec::new();
            for n in 0..100u64 {
                let blocks: Vec<u64> = (0..4).map(|b| t * 1_000 + n * 10 + b).collect();
                let booking = place(&driver, request(&blocks, 70)).await.unwrap();
                if n % 2 == 0 {
                    bookings.push(booking);
                }
            }
            bookings
        })
    });
    let mut bookings = Vec::new();
    for task in placing {
        bookings.extend(task.await.unwrap());
    }
    assert_eq!(bookings.len(), 400);
    assert_eq!(driver.total_active_requests(), 400);
    let on = |id| bookings.iter().filter(|b| b.worker == id).count();
    assert!(ids.iter().all(|&id| on(id) > 0), "load spreads");
    let metrics = driver.metrics();
    let (used, rerouted) = (
        metrics.pre_routes_used.get(),
        metrics.pre_routes_rerouted.get(),
    );
    assert_eq!(
        used + rerouted,
        800,
        "every request was routed before the lock"
    );
    assert!(used > 0);
    drop(bookings);
    assert_eq!(driver.total_active_requests(), 0);
    // Every change reached the board, in order: it shows no load left.
    let pre = driver.pre.as_ref().unwrap();
    let mut router = pre.routes.router();
    let blocks: Vec<LocalHash> = (0..4).map(LocalHash).collect();
    let routing = RoutingRequest {
        prompt_tokens: 70,
        blocks: &blocks,
        adapter: None,
        model: Default::default(),
        headroom: 0.0,
    };
    assert!(router.route(routing, None, driver.now_ms()).is_some());
    let seen = router.last_candidates();
    assert_eq!(seen.len(), 4);
    for c in seen {
        assert_eq!(
            (
                c.active_requests,
                c.active_decode_blocks,
                c.active_prefill_tokens
            ),
            (0, 0, 0),
            "{c:?}"
        );
    }
}

#[tokio::test]
async fn a_fleet_whose_models_split_the_workers_routes_under_the_lock() {
    let (driver, ids) = shared_with(&following_events(), &["a", "b"]);
    driver.set_models(ids[0], vec!["m1".into()]);
    driver.set_models(ids[1], vec!["m2".into()]);
    let for_m2 = || Request {
        model: Some("m2"),
        ..request(&[1, 2], 40)
    };
    // The first request finds out that not every worker may take it.
    let first = place(&driver, for_m2()).await.unwrap();
    assert_eq!(first.worker, ids[1]);
    let metrics = driver.metrics();
    let counts = || {
        (
            metrics.pre_routes_used.get(),
            metrics.pre_routes_rerouted.get(),
        )
    };
    let after_first = counts();
    assert_eq!(after_first.0 + after_first.1, 1, "{after_first:?}");
    for _ in 0..5 {
        let booking = place(&driver, for_m2()).await.unwrap();
        assert_eq!(booking.worker, ids[1]);
    }
    assert_eq!(counts(), after_first, "none routed before the lock");
}

#[tokio::test]
async fn local_requests_leave_out_peers_bookings_on_the_worker() {
    let (driver, ids) = shared_with(&ServerConfig::default(), &["a"]);
    book_remotely(&driver, 1_000, ids[0]);
    book_remotely(&driver, 1_001, ids[0]);
    assert_eq!(driver.active_requests(ids[0]), 2, "the load counts them");
    assert_eq!(driver.local_requests(ids[0]), 0);
    let booking = place(&driver, request(&[], 4)).await.unwrap();
    assert_eq!(driver.active_requests(ids[0]), 3);
    assert_eq!(driver.local_requests(ids[0]), 1);
    drop(booking);
    assert_eq!(driver.local_requests(ids[0]), 0);
}

#[tokio::test]
async fn removing_a_worker_counts_only_this_replicas_bookings_as_freed() {
    let (driver, ids) = shared_with(&ServerConfig::default(), &["a"]);
    book_remotely(&driver, 1_000, ids[0]);
    let booking = place(&driver, request(&[], 4)).await.unwrap();
    driver.set_in_router(ids[0], false);
    assert_eq!(
        driver.metrics().freed_by_removal.get(),
        1,
        "the peer's booking is the peer's to free"
    );
    assert_eq!(driver.active_requests(ids[0]), 0);
    drop(booking);
}

#[tokio::test]
async fn kv_events_count_only_while_their_subscriber_s_epoch_is_the_worker_s() {
    let config = ServerConfig {
        cache: crate::config::CacheMode::Events,
        ..ServerConfig::default()
    };
    let (driver, ids) = shared_with(&config, &["a"]);
    let stored = |hashes: &[u64]| IndexEvent::Stored {
        parent: None,
        blocks: hashes
            .iter()
            .map(|&h| switchyard_core::index::StoredBlock {
                engine_hash: switchyard_core::EngineHash(h),
                local_hash: LocalHash(h),
            })
            .collect(),
    };
    let overlap = |driver: Arc<Driver>| async move {
        place(&driver, request(&[1, 2, 3], 48))
            .await
            .unwrap()
            .overlap_blocks
    };
    let first = driver.events_epoch(ids[0]).unwrap();
    assert!(driver.apply_worker_event(ids[0], first, CacheTier::Device, &stored(&[1, 2])));
    assert_eq!(overlap(driver.clone()).await, 2, "routing sees the event");
    // Out of the router: its index entries go, and its events are stale.
    driver.set_in_router(ids[0], false);
    assert_eq!(driver.events_epoch(ids[0]), None);
    assert!(!driver.apply_worker_event(ids[0], first, CacheTier::Device, &stored(&[1])));
    // Back in, under a new epoch: the old subscriber's events still are.
    driver.set_in_router(ids[0], true);
    let second = driver.events_epoch(ids[0]).unwrap();
    assert_ne!(second, first);
    assert!(!driver.apply_worker_event(ids[0], first, CacheTier::Device, &stored(&[1, 2, 3])));
    assert_eq!(driver.metrics().stale_kv_events.get(), 2);
    assert_eq!(overlap(driver.clone()).await, 0, "nothing of the old epoch");
    assert!(driver.apply_worker_event(ids[0], second, CacheTier::Device, &stored(&[1, 2, 3])));
    assert_eq!(overlap(driver.clone()).await, 3);
    // A worker the router never knew: dropped and counted too.
    let unknown = WorkerId::new(9_999);
    assert!(!driver.apply_worker_event(unknown, 1, CacheTier::Device, &stored(&[1])));
    assert_eq!(driver.metrics().stale_kv_events.get(), 3);
}

/// Breakers that open after `threshold` failures for 1 ms (or a minute).
fn with_circuit(driver: &Driver, threshold: u32, cooldown_ms: u64) {
    driver
        .set_circuit_config(CircuitConfig {
            failure_threshold: threshold,
            cooldown_ms,
            max_cooldown_ms: cooldown_ms,
        })
        .unwrap();
}

/// One worker whose circuit is half-open (its one failure opened it,
/// and the 1 ms cooldown is over).
async fn half_open_worker() -> (Arc<Driver>, WorkerId) {
    let (driver, ids) = shared_with(&ServerConfig::default(), &["a"]);
    with_circuit(&driver, 1, 1);
    let booking = place(&driver, request(&[], 4)).await.unwrap();
    booking.worker_failed();
    drop(booking);
    // Sleeping is a lower bound: any machine gets past the cooldown.
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    driver.tick();
    assert_eq!(driver.circuit_state(ids[0]), Some(CircuitState::HalfOpen));
    (driver, ids[0])
}

#[tokio::test]
async fn a_probe_placed_but_dropped_before_its_handler_took_it_frees_the_probe_slot() {
    let (driver, worker) = half_open_worker().await;
    // Placed at once (the probe is dispatched), then the client goes
    // away before the handler reads the placement.
    let wait = WaitHandle::submit(&driver, RequestId(2), request(&[], 4)).unwrap();
    assert_eq!(driver.circuit_admits(worker), Some(false));
    drop(wait);
    assert_eq!(driver.total_active_requests(), 0);
    assert_eq!(
        driver.circuit_admits(worker),
        Some(true),
        "the circuit may probe again"
    );
    let probe = place(&driver, request(&[], 4))
        .await
        .expect("the next request is the probe");
    assert_eq!(probe.worker, worker);
}

#[tokio::test]
async fn a_late_result_of_a_request_dispatched_before_the_opening_is_ignored() {
    let (driver, ids) = shared_with(&ServerConfig::default(), &["a"]);
    with_circuit(&driver, 1, 1);
    let mut early = place(&driver, request(&[], 4)).await.unwrap();
    let failing = place(&driver, request(&[], 4)).await.unwrap();
    failing.worker_failed();
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    driver.tick();
    let probe = place(&driver, request(&[], 4)).await.unwrap();
    // The early request's first token is not the probe's success.
    early.mark_first_token();
    assert_eq!(driver.circuit_state(ids[0]), Some(CircuitState::HalfOpen));
    // Nor does its end free the probe slot.
    drop(early);
    assert_eq!(driver.circuit_admits(ids[0]), Some(false));
    drop((failing, probe));
}

#[tokio::test]
async fn failed_bookings_open_the_circuit_and_no_request_reaches_that_worker_again() {
    let (driver, ids) = shared_with(&round_robin(), &["w0", "w1"]);
    with_circuit(&driver, 2, 60_000);
    let mut failures = 0;
    while failures < 2 {
        let booking = place(&driver, request(&[], 1))
            .await
            .expect("a worker is free");
        if booking.worker == ids[0] {
            booking.worker_failed();
            // Reported twice, counted once.
            booking.worker_failed();
            failures += 1;
        }
    }
    assert_eq!(driver.circuit_state(ids[0]), Some(CircuitState::Open));
    for _ in 0..10 {
        let booking = booked(&driver).await;
        assert_eq!(booking.worker, ids[1]);
    }
    // The worker is still in the router: only selection skips it.
    let info = driver
        .workers()
        .into_iter()
        .find(|w| w.id == ids[0])
        .unwrap();
    assert!(info.in_router);
    assert_eq!(info.circuit, CircuitState::Open);
    assert_eq!(info.circuit_transitions[CircuitState::Open as usize], 1);
}

#[tokio::test]
async fn a_first_token_is_a_success_that_resets_the_failure_streak() {
    let (driver, ids) = shared_with(&ServerConfig::default(), &["w0"]);
    with_circuit(&driver, 2, 60_000);
    booked(&driver).await.worker_failed();
    booked(&driver).await.mark_first_token();
    booked(&driver).await.worker_failed();
    assert_eq!(
        driver.circuit_state(ids[0]),
        Some(CircuitState::Closed),
        "the streak was broken"
    );
    booked(&driver).await.worker_failed();
    assert_eq!(driver.circuit_state(ids[0]), Some(CircuitState::Open));
    assert!(
        place(&driver, request(&[], 1)).await.is_none(),
        "no worker can take it"
    );
}

#[tokio::test]
async fn a_worker_that_leaves_and_reenters_the_router_starts_with_a_closed_circuit() {
    let (driver, ids) = shared_with(&ServerConfig::default(), &["w0"]);
    with_circuit(&driver, 2, 60_000);
    booked(&driver).await.worker_failed();
    booked(&driver).await.worker_failed();
    assert_eq!(driver.circuit_state(ids[0]), Some(CircuitState::Open));
    driver.set_in_router(ids[0], false);
    driver.set_in_router(ids[0], true);
    assert_eq!(driver.circuit_state(ids[0]), Some(CircuitState::Closed));
    let info = driver.workers().remove(0);
    assert_eq!(
        info.circuit_transitions[CircuitState::Closed as usize],
        1,
        "the reset out of open counts as a close"
    );
    assert!(place(&driver, request(&[], 1)).await.is_some());
}

#[test]
fn a_booking_still_running_at_the_request_timeout_stays_in_the_load_view() {
    for request_timeout_secs in [1.0, 600.0, 3_600.0] {
        let config = ServerConfig {
            request_timeout_secs,
            ..ServerConfig::default()
        };
        let expiry_ms = crate::dispatcher_config(&config).router.sequences.expiry_ms;
        assert!(
            expiry_ms >= request_timeout_secs * 1e3 + 60_000.0,
            "{expiry_ms} for a {request_timeout_secs} s timeout"
        );
    }
}

/// Session-aware routing state over two workers.
fn sessions() -> (Arc<Driver>, Vec<WorkerId>) {
    let config = ServerConfig {
        admission: AdmissionMode::SessionAware,
        policy: PolicyKind::RoundRobin,
        ..ServerConfig::default()
    };
    shared_with(&config, &["a", "b"])
}

fn turn(session: u64, blocks: &[u64]) -> Request<'static> {
    Request {
        session: Some(SessionKey(session)),
        ..request(blocks, blocks.len() as u32 * 16)
    }
}

#[tokio::test]
async fn a_migrated_turn_stays_its_sessions_turn_and_the_session_follows_it() {
    let (driver, _) = sessions();
    let mut first = place(&driver, turn(9, &[1, 2])).await.unwrap();
    first.mark_first_token();
    // The next turn arrives while the first runs: it waits.
    let next = WaitHandle::submit(&driver, driver.next_request_id(), turn(9, &[1, 2, 3])).unwrap();
    // The first turn's worker fails it mid-stream; it moves.
    first.worker_failed();
    let failed = first.worker;
    let mut moved = first.migrate(None).unwrap().placed().await.unwrap();
    assert_ne!(moved.worker, failed);
    tokio::task::yield_now().await;
    assert_eq!(
        driver.snapshot().queue_depth,
        1,
        "the next turn still waits for the migrated one"
    );
    // The migrated turn completes: the next turn goes where it ended.
    moved.mark_first_token();
    moved.completed(48);
    let worker = moved.worker;
    drop(moved);
    let next = next.placed().await.unwrap();
    assert_eq!(next.worker, worker, "the session re-pinned");
    let counts = driver.snapshot().strategy.unwrap().1;
    assert!(counts.contains(&("migrated_turns", 1)), "{counts:?}");
}

#[tokio::test]
async fn a_shed_request_is_answered_like_a_full_queue_with_its_retry_after() {
    let mut config = ServerConfig::default();
    config.flow.refuse_late = true;
    let (driver, _) = shared_with(&config, &["a"]);
    // A deadline already passed: no prefill estimate can meet it.
    let mut late = request(&[1, 2, 3], 4_000);
    late.flow.deadline_ms = Some(0.0);
    let id = driver.next_request_id();
    let wait = WaitHandle::submit(&driver, id, late).unwrap();
    let unplaced = wait.placed().await.unwrap_err();
    assert_eq!(
        unplaced,
        crate::driver::booking::Unplaced::Shed {
            retry_after_ms: 1_000,
            late: true,
        }
    );
    // Without a deadline the same request is placed.
    assert!(place(&driver, request(&[1, 2, 3], 4_000)).await.is_some());
}
