use super::*;
use crate::admission::{SessionAwareConfig, SessionAwareStrategy};
use crate::select::{Candidate, PolicyKind};
use proptest::prelude::*;

fn w(id: u64) -> WorkerId {
    WorkerId::new(id)
}

const CAPACITY: WorkerCapacity = WorkerCapacity {
    max_num_batched_tokens: Some(8192),
    kv_blocks: Some(1024),
    kv_tokens: Some(1024 * 16),
    block_size: None,
};

pub(super) fn dispatcher_with(
    config: DispatcherConfig,
    session_aware: bool,
    workers: u64,
) -> Dispatcher {
    let strategy = session_aware.then(|| {
        Box::new(SessionAwareStrategy::new(SessionAwareConfig::default()).unwrap())
            as Box<dyn AdmissionStrategy + Send>
    });
    let mut d = Dispatcher::new(config, strategy).unwrap();
    for id in 1..=workers {
        let fx = d.add_worker(w(id), CAPACITY, 0.0);
        assert!(fx.is_empty());
    }
    d
}

fn dispatcher(workers: u64) -> Dispatcher {
    dispatcher_with(DispatcherConfig::default(), false, workers)
}

fn round_robin() -> DispatcherConfig {
    let mut config = DispatcherConfig::default();
    config.router.policy = PolicyKind::RoundRobin;
    config
}

pub(super) fn submission(first_block: u64, blocks: u64) -> Submission {
    Submission {
        blocks: (first_block..first_block + blocks).map(LocalHash).collect(),
        prompt_tokens: blocks as u32 * 16,
        ..Submission::default()
    }
}

fn in_session(mut s: Submission, session: u64) -> Submission {
    s.session = Some(SessionKey(session));
    s
}

/// The events of `fx` for peers, without their workers.
fn events(fx: &Effects) -> Vec<SequenceEvent> {
    fx.publish.iter().map(|p| p.event.clone()).collect()
}

/// Submits and expects an immediate dispatch.
pub(super) fn place(d: &mut Dispatcher, id: u128, s: Submission, now: f64) -> Dispatch {
    let (admitted, mut fx) = d.submit(RequestId(id), s, now).unwrap();
    assert_eq!(admitted, Admitted::Queued);
    assert_eq!(fx.dispatch.len(), 1, "{fx:?}");
    fx.dispatch.pop().unwrap()
}

#[test]
fn a_request_is_dispatched_booked_with_a_prefill_hint_and_freed_when_it_finishes() {
    let mut d = dispatcher(2);
    let sent = place(&mut d, 1, submission(0, 64), 0.0);
    assert_eq!(sent.id, RequestId(1));
    assert_eq!(
        sent.booking,
        RequestId(1),
        "the first booking is the request id"
    );
    assert_eq!(
        d.router().sequences().owner(RequestId(1)),
        Some(sent.worker)
    );
    // The booking carries the model's prefill time for its 1024 tokens:
    // its prefill load decays before the first token.
    let load = d.router().sequences().registry().load(sent.worker).unwrap();
    assert_eq!(load.active_prefill_tokens(0.0), 1024);
    let expected = d.estimator().config().model_ms(1024);
    assert_eq!(load.active_prefill_tokens(expected + 1.0), 0);
    let fx = d.finish(RequestId(1), 1024 + 10, 50.0);
    assert!(fx.publish.is_empty(), "no replica sync, nothing published");
    assert_eq!(d.router().sequences().active_requests(), 0);
    assert_eq!(d.requests(), 0);
}

#[test]
fn a_first_token_marks_the_prefill_once_and_a_sole_prefill_teaches_the_estimator() {
    let mut config = DispatcherConfig::default();
    config.estimator.min_samples = 2;
    config.estimator.window = 2;
    let mut d = dispatcher_with(config, false, 1);
    for (i, tokens_blocks) in [(1u128, 10u64), (2, 40)] {
        let sent = place(&mut d, i, submission(i as u64 * 1000, tokens_blocks), 0.0);
        let model = d.estimator().config().model_ms(tokens_blocks * 16);
        // Observed: twice the model.
        let fx = d.first_token(sent.id, 2.0 * model);
        assert!(fx.is_empty(), "{fx:?}");
        let again = d.first_token(sent.id, 3.0 * model);
        assert!(again.is_empty());
        d.finish(sent.id, 1, 3.0 * model).dispatch.is_empty();
    }
    let fit = d.estimator().fit(w(1)).expect("two sole-prefill samples");
    assert!((fit.scale - 2.0).abs() < 1e-9, "{fit:?}");
    // A request placed while another prefills is not a sample.
    let a = place(&mut d, 3, submission(5000, 8), 100.0);
    let b = place(&mut d, 4, submission(6000, 8), 100.0);
    let _ = d.first_token(b.id, 10_000.0);
    let _ = d.first_token(a.id, 10_000.0);
    assert_eq!(d.estimator().fit(w(1)).unwrap().samples, 2);
}

#[test]
fn with_replica_sync_each_change_of_ours_is_published_once() {
    let mut d = dispatcher(1);
    d.set_replica(ReplicaId(7));
    let (_, fx) = d.submit(RequestId(1), submission(0, 4), 0.0).unwrap();
    let add = match fx.publish.as_slice() {
        [Published {
            event: SequenceEvent::Add(add),
            ..
        }] => add.clone(),
        other => panic!("{other:?}"),
    };
    assert_eq!(add.request, RequestId(1));
    assert!(add.expected_prefill_ms.is_some(), "peers get the hint too");
    assert!(fx.bindings.is_empty(), "no strategy, no session bindings");
    let fx = d.first_token(RequestId(1), 5.0);
    assert_eq!(
        events(&fx),
        vec![SequenceEvent::MarkPrefillCompleted(RequestId(1))]
    );
    let fx = d.finish(RequestId(1), 70, 9.0);
    assert_eq!(events(&fx), vec![SequenceEvent::Free(RequestId(1))]);
    // Ending it again publishes nothing.
    assert!(d.finish(RequestId(1), 70, 9.0).publish.is_empty());
}

#[test]
fn a_free_is_published_only_for_a_booking_that_was_still_ours() {
    let mut d = dispatcher(1);
    d.set_replica(ReplicaId(7));
    let _ = d.submit(RequestId(1), submission(0, 4), 0.0).unwrap();
    let fx = d.remove_worker(w(1), 1.0);
    assert_eq!(
        fx.publish,
        vec![Published {
            worker: w(1),
            event: SequenceEvent::Free(RequestId(1))
        }]
    );
    assert_eq!(fx.counts.freed_by_removal, 1);
    // The handler ends the request later: nothing more goes out.
    let fx = d.abort(RequestId(1), 2.0);
    assert!(fx.publish.is_empty(), "{fx:?}");
    assert_eq!(d.requests(), 0);
}

#[test]
fn a_migrated_request_never_returns_to_a_worker_that_failed_it() {
    let mut d = dispatcher_with(round_robin(), false, 3);
    d.set_replica(ReplicaId(1));
    let first = place(&mut d, 1, submission(0, 4), 0.0);
    let mut failed = vec![first.worker];
    let mut booking = RequestId(100);
    for round in 0..2 {
        let _ = d.worker_failed(RequestId(1), 1.0);
        let fx = d.migrate(RequestId(1), booking, None, 1.0).expect("placed");
        assert!(events(&fx).contains(&SequenceEvent::Free(if round == 0 {
            RequestId(1)
        } else {
            RequestId(booking.0 - 1)
        })));
        let [sent] = fx.dispatch.as_slice() else {
            panic!("{fx:?}")
        };
        assert_eq!(sent.booking, booking, "a migration books afresh");
        assert!(!failed.contains(&sent.worker), "{failed:?} {sent:?}");
        failed.push(sent.worker);
        booking = RequestId(booking.0 + 1);
    }
    // Every worker failed it: it can go nowhere and has ended.
    let _ = d.worker_failed(RequestId(1), 2.0);
    let fx = d.migrate(RequestId(1), booking, None, 2.0).unwrap();
    assert_eq!(fx.no_worker, vec![RequestId(1)]);
    assert_eq!(d.requests(), 0);
    assert_eq!(d.router().sequences().active_requests(), 0);
    assert_eq!(
        d.migrate(RequestId(1), booking, None, 3.0).unwrap_err(),
        MigrateError::Unknown
    );
}

#[test]
fn a_migrated_turn_stays_the_sessions_turn_and_the_session_repins_where_it_lands() {
    let mut d = dispatcher_with(round_robin(), true, 2);
    // Turn 1 of session 9 goes to the first worker.
    let turn1 = place(&mut d, 1, in_session(submission(0, 4), 9), 0.0);
    // Turn 2 arrives while turn 1 runs: deferred.
    let (admitted, fx) = d
        .submit(RequestId(2), in_session(submission(0, 8), 9), 1.0)
        .unwrap();
    assert_eq!(admitted, Admitted::Deferred);
    assert!(fx.dispatch.is_empty());
    // Turn 1's worker fails it; it moves to the other worker.
    let _ = d.worker_failed(RequestId(1), 2.0);
    let fx = d.migrate(RequestId(1), RequestId(11), None, 2.0).unwrap();
    let [moved] = fx.dispatch.as_slice() else {
        panic!("{fx:?}")
    };
    assert_ne!(moved.worker, turn1.worker);
    assert!(
        d.placement_of(RequestId(2)).is_none(),
        "turn 2 still waits for the migrated turn"
    );
    // Turn 1 completes on its new worker: turn 2 goes there too.
    let _ = d.first_token(RequestId(1), 3.0);
    let fx = d.finish(RequestId(1), 80, 4.0);
    let [next] = fx.dispatch.as_slice() else {
        panic!("{fx:?}")
    };
    assert_eq!(next.id, RequestId(2));
    assert_eq!(next.worker, moved.worker, "the session re-pinned");
    let strategy = d.admission().strategy().unwrap();
    assert!(strategy.event_counts().contains(&("migrated_turns", 1)));
}

#[test]
fn consecutive_failures_open_a_circuit_and_a_released_probe_frees_its_slot() {
    let mut config = round_robin();
    config.circuit = CircuitConfig {
        failure_threshold: 2,
        cooldown_ms: 100,
        max_cooldown_ms: 100,
    };
    let mut d = dispatcher_with(config, false, 2);
    let mut opened = false;
    let mut id = 0;
    while !opened {
        id += 1;
        let sent = place(&mut d, id, submission(id as u64 * 10, 1), 0.0);
        if sent.worker == w(1) {
            let fx = d.worker_failed(sent.id, 0.0);
            opened = fx
                .circuits
                .iter()
                .any(|c| c.worker == w(1) && c.to == CircuitState::Open);
            // Reported twice, counted once.
            assert!(d.worker_failed(sent.id, 0.0).is_empty());
        }
        let _ = d.abort(sent.id, 0.0);
    }
    assert_eq!(d.circuit_state(w(1)), Some(CircuitState::Open));
    for i in 0..6 {
        let sent = place(&mut d, 1000 + i, submission(5000 + i as u64, 1), 10.0);
        assert_eq!(sent.worker, w(2), "an open circuit takes nothing");
        let _ = d.abort(sent.id, 10.0);
    }
    assert!(d.next_wakeup_ms() <= 100.0);
    let fx = d.tick(100.0);
    assert!(fx
        .circuits
        .iter()
        .any(|c| c.worker == w(1) && c.to == CircuitState::HalfOpen));
    // The probe is placed, then dropped with no verdict: the slot is free
    // again and the next request may probe.
    let mut probe = None;
    for i in 0..2 {
        let sent = place(&mut d, 2000 + i, submission(9000 + i as u64, 1), 101.0);
        if sent.worker == w(1) {
            probe = Some(sent.id);
        } else {
            let _ = d.abort(sent.id, 101.0);
        }
    }
    let probe = probe.expect("round-robin reaches the half-open worker");
    assert_eq!(d.circuit_admits(w(1)), Some(false), "one probe at a time");
    let _ = d.abort(probe, 102.0);
    assert_eq!(d.circuit_admits(w(1)), Some(true));
}

#[test]
fn a_waiting_request_that_is_aborted_leaves_the_queue_and_is_counted() {
    let mut config = DispatcherConfig::default();
    config.router.busy_threshold = Some(0.5);
    let mut d = dispatcher_with(config, false, 1);
    // 5,000 prompt tokens is over half of 8,192 batched tokens: busy.
    let big = Submission {
        blocks: Vec::new(),
        prompt_tokens: 5_000,
        ..Submission::default()
    };
    let _ = place(&mut d, 1, big.clone(), 0.0);
    let (admitted, fx) = d.submit(RequestId(2), big, 0.0).unwrap();
    assert_eq!(admitted, Admitted::Queued);
    assert!(fx.dispatch.is_empty(), "every worker is busy");
    let fx = d.abort(RequestId(2), 1.0);
    assert_eq!(fx.counts.cancelled, 1);
    assert_eq!(d.admission().queue().len(), 0);
}

#[test]
fn a_booking_past_its_deadline_ends_its_request_and_keeps_nothing() {
    let mut config = DispatcherConfig::default();
    config.router.sequences.expiry_ms = 1_000.0;
    let mut d = dispatcher_with(config, true, 1);
    let _ = place(&mut d, 1, in_session(submission(0, 4), 3), 0.0);
    let fx = d.tick(5_000.0);
    assert_eq!(fx.counts.expired, 1);
    assert_eq!(d.requests(), 0);
    assert_eq!(d.admission().tracked_records(), 0);
    // Its session's next turn is not stuck behind it.
    let next = place(&mut d, 2, in_session(submission(0, 8), 3), 5_001.0);
    assert_eq!(next.id, RequestId(2));
}

#[test]
fn refusals_retain_nothing() {
    let mut config = DispatcherConfig::default();
    config.admission.queue.class_limits = Vec::new();
    config.admission.queue.default_limits.max_requests = 1;
    config.router.busy_threshold = Some(0.5);
    let mut d = dispatcher_with(config, false, 1);
    let big = Submission {
        prompt_tokens: 5_000,
        ..Submission::default()
    };
    let _ = place(&mut d, 1, big.clone(), 0.0);
    let _ = d.submit(RequestId(2), big.clone(), 0.0).unwrap();
    assert!(matches!(
        d.submit(RequestId(3), big.clone(), 0.0),
        Err(Refused::Full { .. })
    ));
    assert_eq!(
        d.submit(RequestId(1), big, 0.0).unwrap_err(),
        Refused::Duplicate
    );
    assert_eq!(d.requests(), 2);
}

#[test]
fn peers_bookings_count_in_the_load_and_our_own_events_are_ignored() {
    let mut d = dispatcher(2);
    d.set_replica(ReplicaId(1));
    let peer_add = AddRequest {
        request: RequestId(500),
        worker: w(1),
        prompt_tokens: 64,
        blocks: Vec::new(),
        overlap_blocks: 0,
        expected_prefill_ms: None,
    };
    let (applied, _) = d.apply_replica_batch(
        ReplicaId(2),
        [(ReplicaId(2), SequenceEvent::Add(peer_add.clone()))],
        [],
        None,
        0.0,
    );
    assert_eq!(applied.applied, 1);
    let own = AddRequest {
        request: RequestId(501),
        ..peer_add
    };
    let (applied, _) = d.apply_replica_batch(
        ReplicaId(1),
        [(ReplicaId(1), SequenceEvent::Add(own))],
        [],
        None,
        0.0,
    );
    assert_eq!(applied.applied, 0, "our own echo");
    assert_eq!(d.router().sequences().active_requests(), 1);
    assert_eq!(d.local_requests_on(w(1)), 0);
    // The next request avoids the peer's busy worker.
    let sent = place(&mut d, 1, submission(0, 4), 0.0);
    assert_eq!(sent.worker, w(2));
    assert_eq!(d.local_requests_on(w(2)), 1);
}

#[test]
fn a_peer_booking_and_freeing_a_local_requests_id_leaves_the_local_booking_alone() {
    let mut d = dispatcher(2);
    d.set_replica(ReplicaId(1));
    let sent = place(&mut d, 77, submission(0, 4), 0.0);
    let peer = ReplicaId(2);
    let forged = AddRequest {
        request: RequestId(77),
        worker: w(2),
        prompt_tokens: 64,
        blocks: Vec::new(),
        overlap_blocks: 0,
        expected_prefill_ms: None,
    };
    let (applied, _) = d.apply_replica_batch(
        peer,
        [
            (peer, SequenceEvent::Add(forged)),
            (peer, SequenceEvent::Free(RequestId(77))),
            (peer, SequenceEvent::Free(RequestId(77))),
            // Marks name the booking's origin: this one names ours.
            (
                ReplicaId(1),
                SequenceEvent::MarkPrefillCompleted(RequestId(77)),
            ),
        ],
        [],
        None,
        1.0,
    );
    assert_eq!(applied.applied, 2, "the peer's own add and free");
    assert_eq!(applied.remote.drops.unknown_booking, 1);
    assert_eq!(applied.remote.own, 1);
    assert_eq!(
        d.router().sequences().owner(RequestId(77)),
        Some(sent.worker)
    );
    assert_eq!(d.local_requests_on(sent.worker), 1);
    assert_eq!(d.router().remote().remote_requests(), 0);
}

#[test]
fn a_peers_session_bindings_are_capped_per_peer_and_unknown_workers_dropped() {
    let mut config = DispatcherConfig::default();
    config.router.remote.max_sessions_per_replica = 2;
    let mut d = dispatcher_with(config, true, 2);
    d.set_replica(ReplicaId(1));
    let peer = ReplicaId(2);
    let bind = |session: u64, worker: WorkerId, context_tokens: u64| SessionBound {
        session: SessionKey(session),
        worker,
        context_tokens,
    };
    let (applied, _) = d.apply_replica_batch(
        peer,
        [],
        [
            bind(1, w(1), 10),
            bind(2, w(2), u64::MAX),
            bind(3, w(1), 10),
            bind(4, w(9), 10),
        ],
        None,
        0.0,
    );
    assert_eq!(applied.sessions, 3);
    assert_eq!(applied.remote.sessions_evicted, 1);
    assert_eq!(applied.remote.drops.unknown_worker, 1);
    assert_eq!(applied.remote.clamped, 1);
    let counts = d.admission().strategy().unwrap().event_counts();
    let count = |label| counts.iter().find(|(k, _)| *k == label).unwrap().1;
    assert_eq!(count("remote_bindings"), 3);
    // Session 1, the peer's oldest binding, was forgotten by the strategy.
    assert_eq!(count("remote_bindings_forgotten"), 1);
}

#[test]
fn with_a_strategy_and_sync_a_sessions_dispatch_is_a_binding_for_peers() {
    let mut d = dispatcher_with(DispatcherConfig::default(), true, 1);
    d.set_replica(ReplicaId(1));
    let (_, fx) = d
        .submit(RequestId(1), in_session(submission(0, 4), 5), 0.0)
        .unwrap();
    assert_eq!(
        fx.bindings,
        vec![SessionBound {
            session: SessionKey(5),
            worker: w(1),
            context_tokens: 64
        }]
    );
}

#[test]
fn bad_settings_are_refused_naming_the_part() {
    let config = DispatcherConfig {
        sweep_interval_ms: 0.0,
        ..DispatcherConfig::default()
    };
    assert_eq!(
        Dispatcher::new(config, None).unwrap_err(),
        DispatcherConfigError::SweepInterval(0.0)
    );
    let mut config = DispatcherConfig::default();
    config.estimator.speedup = -1.0;
    let err = Dispatcher::new(config, None).unwrap_err();
    assert!(err.to_string().starts_with("estimator:"), "{err}");
}

/// One step of the lifecycle model.
#[derive(Clone, Debug)]
enum Op {
    Submit { session: Option<u8>, blocks: u8 },
    FirstToken(u8),
    Finish(u8),
    Abort(u8),
    Fail(u8),
    Migrate(u8),
    Tick(u16),
    RemoveWorker(u8),
    AddWorker(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (proptest::option::of(0u8..4), 1u8..40)
            .prop_map(|(session, blocks)| Op::Submit { session, blocks }),
        3 => any::<u8>().prop_map(Op::FirstToken),
        3 => any::<u8>().prop_map(Op::Finish),
        1 => any::<u8>().prop_map(Op::Abort),
        1 => any::<u8>().prop_map(Op::Fail),
        1 => any::<u8>().prop_map(Op::Migrate),
        1 => (0u16..3000).prop_map(Op::Tick),
        1 => (1u8..=3).prop_map(Op::RemoveWorker),
        1 => (1u8..=3).prop_map(Op::AddWorker),
    ]
}

proptest! {
    /// Against a reference model of who is placed where: every placed
    /// request holds exactly one live booking on the worker the dispatcher
    /// reports, nothing else is booked, replica events balance (each
    /// published `Add` is freed exactly once, by a `Free` or by its
    /// worker's removal), and once every request has ended nothing is left
    /// anywhere.
    #[test]
    fn bookings_follow_placements_and_nothing_leaks(
        ops in proptest::collection::vec(op(), 1..120),
        session_aware in any::<bool>(),
        busy in any::<bool>(),
    ) {
        let mut config = DispatcherConfig::default();
        config.router.sequences.expiry_ms = 2_000.0;
        if busy {
            config.router.busy_threshold = Some(0.1);
        }
        let mut d = dispatcher_with(config, session_aware, 3);
        d.set_replica(ReplicaId(1));
        let mut now = 0.0;
        let mut next_id: u128 = 0;
        // request → (booking, worker), for placed requests; ids submitted.
        let mut placed: std::collections::HashMap<RequestId, (RequestId, WorkerId)> =
            Default::default();
        let mut known: Vec<RequestId> = Vec::new();
        let mut open_adds: std::collections::HashSet<RequestId> = Default::default();
        // Placed requests whose worker left: their bookings are gone.
        let mut orphans: std::collections::HashSet<(RequestId, RequestId)> = Default::default();
        let apply = |fx: Effects,
                         placed: &mut std::collections::HashMap<RequestId, (RequestId, WorkerId)>,
                         open_adds: &mut std::collections::HashSet<RequestId>| {
            for sent in fx.dispatch {
                placed.insert(sent.id, (sent.booking, sent.worker));
            }
            for id in fx.no_worker {
                placed.remove(&id);
            }
            for published in fx.publish {
                match published.event {
                    SequenceEvent::Add(add) => {
                        assert!(open_adds.insert(add.request), "added twice");
                    }
                    SequenceEvent::Free(id) => {
                        assert!(open_adds.remove(&id), "freed without an add");
                    }
                    SequenceEvent::MarkPrefillCompleted(id) => {
                        assert!(open_adds.contains(&id), "marked after its free");
                    }
                }
            }
        };
        let pick = |known: &[RequestId], i: u8| -> Option<RequestId> {
            (!known.is_empty()).then(|| known[i as usize % known.len()])
        };
        for op in ops {
            now += 1.0;
            match op {
                Op::Submit { session, blocks } => {
                    next_id += 1;
                    let mut s = submission(u64::from(blocks) % 7, u64::from(blocks));
                    s.session = session.map(|k| SessionKey(u64::from(k)));
                    if let Ok((_, fx)) = d.submit(RequestId(next_id), s, now) {
                        known.push(RequestId(next_id));
                        apply(fx, &mut placed, &mut open_adds);
                    }
                }
                Op::FirstToken(i) => if let Some(id) = pick(&known, i) {
                    apply(d.first_token(id, now), &mut placed, &mut open_adds);
                },
                Op::Finish(i) => if let Some(id) = pick(&known, i) {
                    apply(d.finish(id, 100, now), &mut placed, &mut open_adds);
                    placed.remove(&id);
                    known.retain(|&k| k != id);
                },
                Op::Abort(i) => if let Some(id) = pick(&known, i) {
                    apply(d.abort(id, now), &mut placed, &mut open_adds);
                    placed.remove(&id);
                    known.retain(|&k| k != id);
                },
                Op::Fail(i) => if let Some(id) = pick(&known, i) {
                    apply(d.worker_failed(id, now), &mut placed, &mut open_adds);
                },
                Op::Migrate(i) => if let Some(id) = pick(&known, i) {
                    next_id += 1;
                    if let Ok(fx) = d.migrate(id, RequestId(next_id), None, now) {
                        placed.remove(&id);
                        apply(fx, &mut placed, &mut open_adds);
                    }
                },
                Op::Tick(ms) => {
                    now += f64::from(ms);
                    let fx = d.tick(now);
                    apply(fx, &mut placed, &mut open_adds);
                    // Expired requests are gone from the dispatcher.
                    placed.retain(|id, _| d.placement_of(*id).is_some());
                    known.retain(|&id| d.placement_of(id).is_some() || d.requests.contains_key(&id));
                    // Expired bookings are not published; peers expire them too.
                    open_adds.retain(|b| d.router().sequences().owner(*b).is_some());
                },
                Op::RemoveWorker(k) => {
                    let worker = w(u64::from(k));
                    orphans.extend(
                        placed.iter().filter(|(_, p)| p.1 == worker).map(|(&id, p)| (id, p.0)),
                    );
                    apply(d.remove_worker(worker, now), &mut placed, &mut open_adds);
                },
                Op::AddWorker(k) => {
                    apply(d.add_worker(w(u64::from(k)), CAPACITY, now), &mut placed, &mut open_adds);
                },
            }
            known.retain(|id| d.requests.contains_key(id));
            placed.retain(|id, _| d.requests.contains_key(id));
            // Every placed request: the dispatcher agrees, and its booking
            // is live on that worker unless the worker was removed since.
            for (&id, &(booking, worker)) in &placed {
                prop_assert_eq!(d.placement_of(id), Some(worker));
                let owner = d.router().sequences().owner(booking);
                if orphans.contains(&(id, booking)) {
                    prop_assert_eq!(owner, None);
                } else {
                    prop_assert_eq!(owner, Some(worker));
                }
            }
            // Nothing else is booked.
            let live = placed
                .values()
                .filter(|(b, _)| d.router().sequences().owner(*b).is_some())
                .count();
            prop_assert_eq!(d.router().sequences().active_requests(), live);
        }
        for id in known.clone() {
            apply(d.abort(id, now), &mut placed, &mut open_adds);
        }
        // Whatever was admitted but deferred ends too.
        prop_assert_eq!(d.requests(), 0);
        prop_assert_eq!(d.router().sequences().active_requests(), 0);
        prop_assert_eq!(d.admission().tracked_records(), 0);
        prop_assert_eq!(d.admission().queue().len(), 0);
        prop_assert!(open_adds.iter().all(|b| d.router().sequences().owner(*b).is_none()));
        prop_assert!(open_adds.is_empty(), "adds never freed: {:?}", open_adds);
    }
}

fn for_adapter(mut s: Submission, adapter: &str) -> Submission {
    s.adapter = Some(adapter.into());
    s
}

#[test]
fn a_request_for_an_adapter_goes_where_it_is_loaded_and_a_missing_one_is_loaded_once() {
    for policy in [PolicyKind::Ttft, PolicyKind::Kv, PolicyKind::RoundRobin] {
        let mut config = DispatcherConfig::default();
        config.router.policy = policy;
        config.router.adapters.load_ms = 400.0;
        let mut d = dispatcher_with(config, false, 3);
        d.adapters_mut().set_loaded(w(2), ["a"], 0.0);
        let sent = place(&mut d, 1, for_adapter(submission(0, 8), "a"), 0.0);
        assert_eq!(sent.worker, w(2), "{policy:?}");
        assert_eq!(sent.adapter_load, None);
        // Nobody has "b": one worker is told to load it, and the next
        // request for "b", when the load is most of the way in, follows
        // it there with nothing to load.
        let first = place(&mut d, 2, for_adapter(submission(100, 8), "b"), 1.0);
        let load = first.adapter_load.clone().expect("a load");
        assert_eq!(&*load.adapter, "b");
        assert_eq!(load.unload, None);
        assert!(d.router().adapters().has(first.worker, "b"));
        let second = place(&mut d, 3, for_adapter(submission(200, 8), "b"), 300.0);
        assert_eq!(second.worker, first.worker, "{policy:?}");
        assert_eq!(second.adapter_load, None);
        assert_eq!(d.router().adapters().counters().loads_planned, 1);
    }
}

#[test]
fn a_busy_adapter_holder_is_passed_over_when_its_queue_outlasts_a_load() {
    let mut config = DispatcherConfig::default();
    config.router.adapters.load_ms = 50.0;
    let mut d = dispatcher_with(config, false, 2);
    d.adapters_mut().set_loaded(w(1), ["a"], 0.0);
    d.adapters_mut().set_loaded(w(2), ["z"], 0.0);
    // Worker 1 gets a long base-model prefill queue.
    for id in 0..6u128 {
        let s = Submission {
            eligible: crate::types::Eligible::Only(vec![w(1)]),
            ..submission(1_000 * id as u64 + 1_000, 256)
        };
        place(&mut d, 100 + id, s, 0.0);
    }
    let sent = place(&mut d, 1, for_adapter(submission(0, 8), "a"), 0.0);
    assert_eq!(sent.worker, w(2), "a 50 ms load beats a long queue");
    assert!(sent.adapter_load.is_some());
}

#[test]
fn an_adapter_nobody_may_load_goes_only_where_it_is_loaded_however_busy() {
    for policy in [
        PolicyKind::Ttft,
        PolicyKind::LeastLoaded,
        PolicyKind::RoundRobin,
    ] {
        let mut config = DispatcherConfig::default();
        config.router.policy = policy;
        config.router.adapters.load_ms = 50.0;
        let mut d = dispatcher_with(config, false, 2);
        d.adapters_mut().set_loaded(w(1), ["a"], 0.0);
        assert!(d.adapters_mut().set_holders_only("a", true));
        // As above, a long queue on the holder would send a loadable
        // adapter elsewhere with a load.
        for id in 0..6u128 {
            let s = Submission {
                eligible: crate::types::Eligible::Only(vec![w(1)]),
                ..submission(1_000 * id as u64 + 1_000, 256)
            };
            place(&mut d, 100 + id, s, 0.0);
        }
        for id in 1..4 {
            let sent = place(&mut d, id, for_adapter(submission(0, 8), "a"), 0.0);
            assert_eq!(sent.worker, w(1), "{policy:?}");
            assert_eq!(sent.adapter_load, None, "{policy:?}");
        }
        assert_eq!(d.router().adapters().counters().loads_planned, 0);
        // Cleared, it is loadable again.
        assert!(!d.adapters_mut().set_holders_only("a", false));
        assert!(!d.router().adapters().holders_only("a"));
    }
}

#[test]
fn a_full_worker_is_told_to_unload_its_coldest_adapter_and_blind_routing_ignores_adapters() {
    let mut config = DispatcherConfig::default();
    config.router.policy = PolicyKind::RoundRobin;
    let mut d = dispatcher_with(config.clone(), false, 1);
    d.adapters_mut().set_slots(w(1), Some(1));
    d.adapters_mut().set_loaded(w(1), ["a"], 0.0);
    let sent = place(&mut d, 1, for_adapter(submission(0, 8), "b"), 0.0);
    let load = sent.adapter_load.expect("a load");
    assert_eq!(load.unload.as_deref(), Some("a"));
    assert!(!d.router().adapters().has(w(1), "a"));

    config.router.adapters.blind = true;
    let mut d = dispatcher_with(config, false, 2);
    d.adapters_mut().set_loaded(w(2), ["a"], 0.0);
    let workers: Vec<WorkerId> = (0..4)
        .map(|i| {
            place(
                &mut d,
                i,
                for_adapter(submission(i as u64 * 100, 8), "a"),
                0.0,
            )
            .worker
        })
        .collect();
    assert!(
        workers.contains(&w(1)),
        "blind round-robin uses both: {workers:?}"
    );
}

#[test]
fn a_load_policy_leaves_a_hot_adapters_holder_once_it_is_far_busier() {
    let mut config = DispatcherConfig::default();
    config.router.policy = PolicyKind::LeastLoaded;
    let mut d = dispatcher_with(config, false, 2);
    d.adapters_mut().set_loaded(w(1), ["a"], 0.0);
    let mut placed = Vec::new();
    for id in 0..8u128 {
        placed.push(
            place(
                &mut d,
                id,
                for_adapter(submission(id as u64 * 100, 4), "a"),
                0.0,
            )
            .worker,
        );
    }
    // The holder takes requests until it has 5 more than the idle worker
    // (the slack is 4); then the adapter is loaded on the other worker.
    assert_eq!(&placed[..5], &[w(1); 5]);
    assert_eq!(placed[5], w(2));
    assert!(d.router().adapters().has(w(2), "a"));
}

/// A route made outside the lock that chose `worker`.
fn proposal(worker: WorkerId, overlap_blocks: u32) -> Proposal {
    Proposal {
        decision: crate::select::Decision {
            worker,
            overlap_blocks,
            peer: None,
        },
        candidate: Candidate {
            overlap_blocks,
            held_prefix_blocks: overlap_blocks,
            kv_capacity_blocks: Some(1024),
            ..crate::select::test_support::candidate(worker.worker_id)
        },
    }
}

/// Submits `submission` as request `id` with a route made outside the
/// lock to `worker`, counting `seen` prompt blocks there.
fn propose(
    d: &mut Dispatcher,
    id: u128,
    submission: Submission,
    worker: WorkerId,
    seen: u32,
    now_ms: f64,
) -> (Admitted, Effects) {
    d.submit_proposed(
        RequestId(id),
        submission,
        Some(proposal(worker, seen)),
        now_ms,
    )
    .unwrap()
}

/// Proposals used as the decision, and routed again under the lock.
fn proposals(fx: &Effects) -> (u32, u32) {
    (fx.counts.proposals_used, fx.counts.proposals_rerouted)
}

#[test]
fn a_proposal_is_the_decision_of_a_request_placed_at_once() {
    let mut d = dispatcher(3);
    // The locked route would choose any of the three idle workers; the
    // proposal names worker 2 with 3 blocks cached, and that is booked.
    let (_, fx) = propose(&mut d, 1, submission(0, 8), w(2), 3, 0.0);
    assert_eq!(fx.dispatch.len(), 1);
    assert_eq!(
        (fx.dispatch[0].worker, fx.dispatch[0].overlap_blocks),
        (w(2), 3)
    );
    assert_eq!(
        (
            fx.counts.decisions,
            fx.counts.proposals_used,
            fx.counts.proposals_rerouted
        ),
        (1, 1, 0)
    );
    assert_eq!(d.placement_of(RequestId(1)), Some(w(2)));
    assert_eq!(d.router().sequences().owner(RequestId(1)), Some(w(2)));
}

#[test]
fn a_proposal_for_a_worker_that_may_not_take_the_request_is_routed_again_under_the_lock() {
    let mut d = dispatcher(2);
    // Not among the request's eligible workers.
    let mut only_one = submission(0, 8);
    only_one.eligible = crate::types::Eligible::Only(vec![w(1)]);
    let (_, fx) = propose(&mut d, 1, only_one, w(2), 0, 0.0);
    assert_eq!(fx.dispatch[0].worker, w(1));
    assert_eq!(proposals(&fx), (0, 1));
    // No longer selectable (its circuit opened after the route was made).
    d.router.set_selectable(w(2), false);
    let (_, fx) = propose(&mut d, 2, submission(100, 8), w(2), 0, 1.0);
    assert_eq!(fx.dispatch[0].worker, w(1));
    assert_eq!(fx.counts.proposals_rerouted, 1);
    // Removed from the router meanwhile.
    let _ = d.remove_worker(w(2), 2.0);
    let (_, fx) = propose(&mut d, 3, submission(200, 8), w(2), 0, 3.0);
    assert_eq!(fx.dispatch[0].worker, w(1));
    assert_eq!(fx.counts.proposals_rerouted, 1);
}

#[test]
fn a_proposal_of_a_request_that_waits_is_set_aside_and_it_is_routed_when_placed() {
    let mut config = DispatcherConfig::default();
    config.router.busy_threshold = Some(0.5);
    let mut d = dispatcher_with(config, false, 1);
    // 8,192 uncached tokens fill the only worker's prefill budget.
    let _ = place(&mut d, 1, submission(0, 512), 0.0);
    let (admitted, fx) = propose(&mut d, 2, submission(1000, 8), w(1), 0, 1.0);
    assert_eq!(admitted, Admitted::Queued);
    assert!(fx.dispatch.is_empty(), "the worker is busy: {fx:?}");
    assert_eq!(proposals(&fx), (0, 1));
    // Its first token frees the budget: the waiting request is routed
    // afresh, under the lock.
    let fx = d.first_token(RequestId(1), 2.0);
    assert_eq!(fx.dispatch.len(), 1);
    assert_eq!(fx.dispatch[0].id, RequestId(2));
    assert_eq!((fx.counts.decisions, fx.counts.proposals_used), (1, 0));
}

/// A fan-out: `n` requests sharing `shared` fresh prompt blocks (no worker
/// has cached them), each with two blocks of its own.
fn fan_out(n: u64, shared: u64) -> Vec<Submission> {
    (0..n)
        .map(|i| {
            let mut s = submission(0, shared);
            s.blocks
                .extend([LocalHash(1_000_000 + 2 * i), LocalHash(1_000_001 + 2 * i)]);
            s.prompt_tokens += 32;
            s
        })
        .collect()
}

#[test]
fn a_burst_sharing_a_fresh_prefix_is_placed_where_its_first_request_is_prefilled() {
    // Eight requests sharing ~6,000 tokens, sent at once to three idle
    // workers before any KV event: the first is placed anywhere, the rest
    // follow it, booked with the prefix as cached, so the worker's prefill
    // backlog counts the prefix once.
    let mut d = dispatcher(3);
    let placed: Vec<Dispatch> = fan_out(8, 375)
        .into_iter()
        .enumerate()
        .map(|(i, s)| place(&mut d, i as u128 + 1, s, 0.0))
        .collect();
    let first = placed[0].worker;
    assert!(placed.iter().all(|p| p.worker == first), "{placed:?}");
    assert_eq!(placed[0].overlap_blocks, 0);
    assert!(placed[1..].iter().all(|p| p.overlap_blocks == 375));
    let load = d.router().sequences().registry().load(first).unwrap();
    assert_eq!(load.active_prefill_tokens(0.0), 375 * 16 + 8 * 32);
}

#[test]
fn a_proposal_that_missed_a_siblings_booking_is_routed_again_under_the_lock() {
    // The first of a burst is booked; the second's route, made outside the
    // lock before that booking was on the board, chose another idle worker.
    let mut d = dispatcher(3);
    let mut burst = fan_out(2, 64).into_iter();
    let first = place(&mut d, 1, burst.next().unwrap(), 0.0).worker;
    let elsewhere = [w(1), w(2), w(3)]
        .into_iter()
        .find(|&x| x != first)
        .unwrap();
    let (_, fx) = propose(&mut d, 2, burst.next().unwrap(), elsewhere, 0, 0.0);
    assert_eq!(
        (fx.dispatch[0].worker, fx.dispatch[0].overlap_blocks),
        (first, 64)
    );
    assert_eq!(proposals(&fx), (0, 1));
    // A proposal for the worker already prefilling the prefix stands.
    let (_, fx) = propose(&mut d, 3, fan_out(4, 64).pop().unwrap(), first, 64, 0.0);
    assert_eq!(proposals(&fx), (1, 0));
    // One for that worker made before the prefix was in flight there
    // (seen: nothing) is routed again: booked with the prefix uncached, it
    // would count the prefix's prefill twice in that worker's queue.
    let backlog = |d: &Dispatcher| {
        let load = d.router().sequences().registry().load(first).unwrap();
        load.active_prefill_tokens(0.0)
    };
    let before = backlog(&d);
    let (_, fx) = propose(&mut d, 4, fan_out(5, 64).pop().unwrap(), first, 0, 0.0);
    assert_eq!(
        (fx.dispatch[0].worker, fx.dispatch[0].overlap_blocks),
        (first, 64)
    );
    assert_eq!(proposals(&fx), (0, 1));
    assert_eq!(backlog(&d) - before, 32, "only its own suffix is new");
}

#[test]
fn a_request_goes_to_any_worker_to_those_listed_or_to_none() {
    use crate::types::Eligible;
    let mut d = dispatcher_with(round_robin(), false, 2);
    let mut nowhere = submission(0, 8);
    nowhere.eligible = Eligible::none();
    let (_, fx) = d.submit(RequestId(1), nowhere, 0.0).unwrap();
    assert!(fx.dispatch.is_empty(), "nothing may take it");
    assert_eq!(fx.no_worker, [RequestId(1)], "it ends, placed nowhere");
    for round in 0..2 {
        let mut second = submission(100 * (round + 1), 8);
        second.eligible = Eligible::one(w(2));
        let id = RequestId(10 + u128::from(round));
        let (_, fx) = d.submit(id, second, 1.0).unwrap();
        assert_eq!(fx.dispatch[0].worker, w(2), "only the one listed");
    }
    let (_, fx) = d.submit(RequestId(20), submission(500, 8), 2.0).unwrap();
    assert_eq!(fx.dispatch.len(), 1, "every worker: placed");
    assert!(Eligible::Every.allows(w(7)) && !Eligible::none().allows(w(7)));
    assert_eq!(Eligible::one(w(7)).listed(), Some(&[w(7)][..]));
    assert_eq!(Eligible::Every.listed(), None);
}
