//! Contract tests of the admission controller and its strategy API, and a
//! property test driving random admit/event/cancel sequences.

use super::*;
use crate::maps::FxHashMap;
use crate::select::{Decision, SelectOutcome};
use proptest::prelude::*;
use std::collections::HashSet;

fn w(id: u64) -> WorkerId {
    WorkerId::new(id)
}

fn facts(id: u128, session: Option<u64>, now_ms: f64) -> RequestFacts<'static> {
    RequestFacts {
        id: RequestId(id),
        session: session.map(SessionKey),
        context_tokens: 100,
        uncached_tokens: 100,
        class: QueueClass(0),
        eligible: &crate::types::Eligible::Every,
        now_ms,
        flow: Default::default(),
    }
}

fn selected(worker: WorkerId) -> SelectOutcome {
    SelectOutcome::Selected(Decision {
        worker,
        overlap_blocks: 0,
        peer: None,
    })
}

/// Wraps a strategy and panics on any breach of the calling contract.
#[derive(Debug)]
struct Recorder<S> {
    inner: S,
    admitted: HashSet<RequestId>,
    tracked: HashSet<RequestId>,
    dispatched: HashSet<RequestId>,
    ended: HashSet<RequestId>,
    reconciles: Vec<f64>,
    /// Extra actions to emit on the next event (stale-action tests).
    inject: Vec<MakeReady>,
}

impl<S> Recorder<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            admitted: HashSet::new(),
            tracked: HashSet::new(),
            dispatched: HashSet::new(),
            ended: HashSet::new(),
            reconciles: Vec::new(),
            inject: Vec::new(),
        }
    }
}

impl<S: AdmissionStrategy> AdmissionStrategy for Recorder<S> {
    fn name(&self) -> &'static str {
        "recorder"
    }

    fn admit(&mut self, facts: &RequestFacts<'_>) -> Admission {
        assert!(
            self.admitted.insert(facts.id),
            "admit twice for {}",
            facts.id
        );
        let admission = self.inner.admit(facts);
        if admission != Admission::Bypass {
            self.tracked.insert(facts.id);
        }
        admission
    }

    fn on_event(&mut self, event: &LifecycleEvent, now_ms: f64, out: &mut Vec<MakeReady>) {
        match event {
            LifecycleEvent::Dispatched { id, .. } => {
                assert!(self.tracked.contains(id), "event for untracked {id}");
                assert!(!self.ended.contains(id), "dispatched after its end: {id}");
                assert!(self.dispatched.insert(*id), "dispatched twice: {id}");
            }
            LifecycleEvent::Completed { id, .. } => {
                assert!(self.dispatched.contains(id), "completed undispatched {id}");
                assert!(self.ended.insert(*id), "second terminal event for {id}");
            }
            LifecycleEvent::Aborted { id } => {
                assert!(self.tracked.contains(id), "event for untracked {id}");
                assert!(self.ended.insert(*id), "second terminal event for {id}");
            }
            LifecycleEvent::Migrating { id, .. } => {
                assert!(!self.ended.contains(id), "migrating after its end: {id}");
                // Dispatched once per placement: the next one is legal.
                assert!(self.dispatched.remove(id), "migrating undispatched {id}");
            }
            LifecycleEvent::Reconcile => self.reconciles.push(now_ms),
        }
        self.inner.on_event(event, now_ms, out);
        out.append(&mut self.inject);
    }

    fn reconcile_interval_ms(&self) -> f64 {
        self.inner.reconcile_interval_ms()
    }

    fn on_unavailable(&mut self, id: RequestId, worker: WorkerId, why: Unavailable) -> Fallback {
        self.inner.on_unavailable(id, worker, why)
    }

    fn observe_kv(&mut self, worker: WorkerId, usage: KvUsage) {
        self.inner.observe_kv(worker, usage)
    }

    fn tracked_requests(&self) -> usize {
        self.inner.tracked_requests()
    }
}

type Controller = AdmissionController<Recorder<SessionAwareStrategy>>;

fn controller(session: SessionAwareConfig) -> Controller {
    let strategy = Recorder::new(SessionAwareStrategy::new(session).unwrap());
    AdmissionController::new(AdmissionConfig::default(), Some(strategy)).unwrap()
}

fn recorder(c: &Controller) -> &Recorder<SessionAwareStrategy> {
    c.strategy().unwrap()
}

/// Polls once with a fixed answer; returns the tickets and unroutable ids.
fn poll_all(
    c: &mut Controller,
    now: f64,
    mut answer: impl FnMut(RequestId, Placement) -> SelectOutcome,
) -> (Vec<ResponseTicket>, Vec<RequestId>) {
    let mut out = Vec::new();
    c.poll(now, &mut out, &mut answer);
    let mut tickets = Vec::new();
    let mut gone = Vec::new();
    for placed in out {
        match placed {
            Placed::Selected { ticket, .. } => tickets.push(ticket),
            Placed::NoWorkers { id } => gone.push(id),
        }
    }
    (tickets, gone)
}

fn any_to(worker: WorkerId) -> impl FnMut(RequestId, Placement) -> SelectOutcome {
    move |_, placement| match placement {
        Placement::Any => selected(worker),
        Placement::Exact(w) => selected(w),
    }
}

#[test]
fn admit_is_called_exactly_once_per_request() {
    let mut c = controller(Default::default());
    assert_eq!(c.submit(&facts(1, Some(1), 0.0)), SubmitOutcome::Queued);
    assert_eq!(c.submit(&facts(1, Some(1), 0.0)), SubmitOutcome::Duplicate);
    assert_eq!(c.submit(&facts(2, Some(1), 0.0)), SubmitOutcome::Deferred);
    assert_eq!(c.submit(&facts(2, Some(1), 0.0)), SubmitOutcome::Duplicate);
    assert_eq!(c.submit(&facts(3, None, 0.0)), SubmitOutcome::Queued);
    // A deferred request made ready is not admitted again.
    let (tickets, _) = poll_all(&mut c, 1.0, any_to(w(1)));
    for t in tickets {
        c.dispatched(&t, 1.0);
        c.complete(t, 200, 2.0).unwrap();
    }
    let (tickets, _) = poll_all(&mut c, 3.0, any_to(w(1)));
    assert_eq!(tickets.len(), 1);
    assert_eq!(tickets[0].id(), RequestId(2));
    assert_eq!(recorder(&c).admitted.len(), 3);
    assert_eq!(c.counters().duplicates, 2);
}

#[test]
fn each_tracked_request_gets_exactly_one_terminal_event() {
    let mut c = controller(Default::default());
    for id in 1..=4 {
        c.submit(&facts(id, Some(id as u64), 0.0));
    }
    // 1 completes, 2 is aborted by its ticket, 3 is cancelled while waiting,
    // 4 finds no worker.
    assert_eq!(c.cancel(RequestId(3), 0.0), CancelOutcome::Removed);
    assert_eq!(c.cancel(RequestId(3), 0.0), CancelOutcome::Unknown);
    let (mut tickets, gone) = poll_all(&mut c, 1.0, |id, _| {
        if id == RequestId(4) {
            SelectOutcome::NoWorkers
        } else {
            selected(w(1))
        }
    });
    assert_eq!(gone, vec![RequestId(4)]);
    let t2 = tickets.pop().unwrap();
    let t1 = tickets.pop().unwrap();
    assert_eq!(c.cancel(t1.id(), 1.0), CancelOutcome::OwnedByTicket);
    assert_eq!(c.dispatched(&t1, 1.0), TransitionOutcome::Applied);
    assert_eq!(
        c.complete(t1, 300, 2.0).unwrap(),
        TransitionOutcome::Applied
    );
    assert_eq!(c.abort(t2, 2.0), TransitionOutcome::Applied);
    let r = recorder(&c);
    assert_eq!(r.ended.len(), 4);
    assert_eq!(c.tracked_records(), 0);
    assert_eq!(c.strategy().unwrap().tracked_requests(), 0);
}

#[test]
fn duplicate_stale_and_unknown_events_and_actions_are_harmless() {
    let mut c = controller(Default::default());
    c.submit(&facts(1, Some(1), 0.0));
    c.submit(&facts(2, None, 0.0));
    let (mut tickets, _) = poll_all(&mut c, 1.0, any_to(w(1)));
    let untracked = tickets.pop().unwrap();
    let t1 = tickets.pop().unwrap();
    assert!(!untracked.is_tracked());
    // Completing before dispatch is refused and the ticket comes back.
    let refused = c.complete(t1, 10, 1.0).unwrap_err();
    assert_eq!(
        (refused.from, refused.to),
        (Stage::Selected, Stage::Completed)
    );
    let t1 = refused.ticket;
    assert_eq!(c.dispatched(&t1, 1.0), TransitionOutcome::Applied);
    assert_eq!(c.dispatched(&t1, 1.0), TransitionOutcome::Duplicate);
    // Actions for requests that are not deferred are ignored and counted.
    c.strategy_mut().unwrap().inject = vec![
        MakeReady {
            id: RequestId(1),
            placement: Placement::Any,
        },
        MakeReady {
            id: RequestId(77),
            placement: Placement::Any,
        },
    ];
    assert_eq!(c.complete(t1, 10, 2.0).unwrap(), TransitionOutcome::Applied);
    assert_eq!(c.counters().stale_actions, 2);
    assert_eq!(c.dispatched(&untracked, 2.0), TransitionOutcome::Untracked);
    assert_eq!(c.abort(untracked, 2.0), TransitionOutcome::Untracked);
    assert_eq!(c.cancel(RequestId(1), 3.0), CancelOutcome::Unknown);
    let (tickets, _) = poll_all(&mut c, 3.0, any_to(w(1)));
    assert!(tickets.is_empty());
    assert_eq!(recorder(&c).ended.len(), 1);
}

#[test]
fn reconcile_arrives_while_anything_is_deferred() {
    let mut c = controller(SessionAwareConfig {
        reconcile_interval_ms: 100.0,
        ..Default::default()
    });
    c.submit(&facts(1, Some(1), 0.0));
    assert_eq!(c.submit(&facts(2, Some(1), 0.0)), SubmitOutcome::Deferred);
    let (mut tickets, _) = poll_all(&mut c, 0.0, any_to(w(1)));
    let t1 = tickets.pop().unwrap();
    c.dispatched(&t1, 0.0);
    // The driver sleeps until each wake-up while request 2 is deferred.
    let mut now = 0.0;
    while now < 1_000.0 {
        now = c
            .next_wakeup_ms()
            .expect("a wake-up while something is deferred");
        c.tick(now);
    }
    let reconciles = &recorder(&c).reconciles;
    assert!(reconciles.len() >= 10);
    assert!(reconciles.windows(2).all(|p| p[1] - p[0] <= 100.0));
    assert_eq!(c.queue().deferred_len(), 1);
}

#[test]
fn an_exact_worker_that_became_invalid_falls_back_as_the_strategy_defines() {
    for affinity in [Affinity::Strict, Affinity::Soft] {
        let mut c = controller(SessionAwareConfig {
            affinity,
            ..Default::default()
        });
        c.submit(&facts(1, Some(1), 0.0));
        let (mut t, _) = poll_all(&mut c, 0.0, any_to(w(1)));
        let t1 = t.pop().unwrap();
        c.dispatched(&t1, 0.0);
        c.complete(t1, 200, 1.0).unwrap();
        // Worker 1 is gone: the pinned placement falls back to any worker.
        c.submit(&facts(2, Some(1), 2.0));
        let mut asked = Vec::new();
        let (mut t, _) = poll_all(&mut c, 2.0, |_, placement| {
            asked.push(placement);
            match placement {
                Placement::Exact(_) => SelectOutcome::NoWorkers,
                Placement::Any => selected(w(2)),
            }
        });
        assert_eq!(asked, vec![Placement::Exact(w(1)), Placement::Any]);
        let t2 = t.pop().unwrap();
        assert_eq!(t2.worker(), w(2));
        c.dispatched(&t2, 2.0);
        c.complete(t2, 300, 3.0).unwrap();
        // The session re-pinned to worker 2. When it is busy, strict waits
        // and soft goes elsewhere.
        c.submit(&facts(3, Some(1), 4.0));
        let (t, _) = poll_all(&mut c, 4.0, |_, placement| match placement {
            Placement::Exact(w2) if w2 == w(2) => SelectOutcome::AllBusy,
            _ => selected(w(3)),
        });
        match affinity {
            Affinity::Strict => {
                assert!(t.is_empty());
                assert_eq!(c.queue().ready_len(), 1);
            }
            Affinity::Soft => assert_eq!(t[0].worker(), w(3)),
        }
        for ticket in t {
            c.abort(ticket, 5.0);
        }
    }
}

#[test]
fn cancellation_passes_to_the_ticket_at_selection() {
    let mut c = controller(Default::default());
    c.submit(&facts(1, Some(1), 0.0));
    assert_eq!(c.cancel(RequestId(1), 0.0), CancelOutcome::Removed);
    c.submit(&facts(2, Some(2), 0.0));
    let (mut t, _) = poll_all(&mut c, 0.0, any_to(w(1)));
    let mut ticket = t.pop().unwrap();
    assert_eq!(c.cancel(RequestId(2), 0.0), CancelOutcome::OwnedByTicket);
    c.dispatched(&ticket, 0.0);
    ticket.progress().unwrap().advance(5);
    assert_eq!(c.abort(ticket, 1.0), TransitionOutcome::Applied);
    assert_eq!(c.cancel(RequestId(2), 0.0), CancelOutcome::Unknown);
}

#[test]
fn a_full_queue_refuses_with_a_retry_after_and_retains_nothing() {
    let mut c: AdmissionController = AdmissionController::without_strategy(AdmissionConfig {
        queue: QueueConfig {
            default_limits: ClassLimits {
                max_requests: 1,
                max_uncached_tokens: 1_000,
            },
            ..Default::default()
        },
        ..Default::default()
    })
    .unwrap();
    assert_eq!(c.submit(&facts(1, None, 0.0)), SubmitOutcome::Queued);
    assert_eq!(
        c.submit(&facts(2, None, 0.0)),
        SubmitOutcome::Rejected {
            reason: RejectReason::QueueFull,
            retry_after_ms: 1_000
        }
    );
    assert_eq!(c.queue().len(), 1);
    assert_eq!(c.queue_counters().rejected_full, 1);
}

#[test]
fn the_record_cap_refuses_tracked_requests_before_they_are_admitted() {
    let strategy = Recorder::new(SessionAwareStrategy::new(Default::default()).unwrap());
    let mut c = AdmissionController::new(
        AdmissionConfig {
            max_tracked: 1,
            ..Default::default()
        },
        Some(strategy),
    )
    .unwrap();
    c.submit(&facts(1, Some(1), 0.0));
    assert!(matches!(
        c.submit(&facts(2, Some(2), 0.0)),
        SubmitOutcome::Rejected {
            reason: RejectReason::TrackingFull,
            ..
        }
    ));
    assert!(!c.strategy().unwrap().admitted.contains(&RequestId(2)));
}

#[test]
fn without_a_strategy_no_records_or_progress_handles_exist_and_memory_stays_flat() {
    let mut c = AdmissionController::without_strategy(AdmissionConfig::default()).unwrap();
    let mut out = Vec::with_capacity(16);
    let mut cycle = |c: &mut AdmissionController, id: u128| {
        c.submit(&facts(id, Some(1), id as f64));
        out.clear();
        c.poll(id as f64, &mut out, |_, _| selected(w(1)));
        for placed in out.drain(..) {
            let Placed::Selected { mut ticket, .. } = placed else {
                panic!("routable");
            };
            assert!(ticket.progress().is_none());
            assert_eq!(c.dispatched(&ticket, 0.0), TransitionOutcome::Untracked);
            assert_eq!(
                c.complete(ticket, 1, 0.0).unwrap(),
                TransitionOutcome::Untracked
            );
        }
    };
    for id in 0..100 {
        cycle(&mut c, id);
    }
    let warm = c.heap_bytes();
    for id in 100..100_000 {
        cycle(&mut c, id);
    }
    assert_eq!(c.heap_bytes(), warm);
    assert_eq!(c.tracked_records(), 0);
    assert_eq!(c.counters().progress_handles, 0);
    assert_eq!(c.next_wakeup_ms(), None);
}

#[test]
fn a_request_waits_while_every_worker_is_busy_and_goes_when_capacity_frees() {
    use crate::router::{Router, RouterConfig, WorkerCapacity};
    use crate::select::{PolicyKind, RoutingRequest};
    use crate::types::LocalHash;
    let mut router = Router::new(RouterConfig {
        busy_threshold: Some(0.5),
        policy: PolicyKind::RoundRobin,
        ..Default::default()
    })
    .unwrap();
    for id in 1..=2 {
        let capacity = WorkerCapacity {
            max_num_batched_tokens: Some(1000),
            kv_blocks: None,
            kv_tokens: None,
            block_size: None,
        };
        router.add_worker(w(id), capacity);
    }
    // The driver owns payloads, by id.
    let blocks: Vec<LocalHash> = (1..=40).map(LocalHash).collect(); // 640 tokens
    let payloads: FxHashMap<RequestId, Vec<LocalHash>> =
        (1..=3).map(|id| (RequestId(id), blocks.clone())).collect();
    let mut c = AdmissionController::without_strategy(AdmissionConfig::default()).unwrap();
    let mut out = Vec::new();
    let mut drive = |c: &mut AdmissionController, router: &mut Router, now: f64| {
        out.clear();
        c.poll(now, &mut out, |id, placement| {
            let request = RoutingRequest {
                prompt_tokens: 640,
                blocks: &payloads[&id],
                adapter: None,
                model: Default::default(),
                headroom: 0.0,
            };
            let exact;
            let eligible = match placement {
                Placement::Any => None,
                Placement::Exact(worker) => {
                    exact = [worker];
                    Some(&exact[..])
                }
            };
            // Book at once, so the next decision of this poll sees the load.
            let outcome = router.route(request, eligible, now);
            if let SelectOutcome::Selected(decision) = outcome {
                router.book(id, request, decision, None, now);
            }
            outcome
        });
        let mut started = Vec::new();
        for placed in out.drain(..) {
            if let Placed::Selected { ticket, .. } = placed {
                c.dispatched(&ticket, now);
                started.push(ticket);
            }
        }
        started
    };
    for id in 1..=3 {
        c.submit(&facts(id, None, 0.0));
    }
    let first = drive(&mut c, &mut router, 0.0);
    assert_eq!(first.len(), 2);
    assert_eq!(c.queue().ready_len(), 1);
    assert_eq!(c.next_wakeup_ms(), Some(50.0));
    // A recheck with nothing freed keeps it waiting.
    assert!(drive(&mut c, &mut router, 50.0).is_empty());
    // The first token of request 1 frees its worker's prefill room.
    router.mark_prefill_completed(first[0].id(), 60.0);
    let third = drive(&mut c, &mut router, 60.0);
    assert_eq!(third.len(), 1);
    assert_eq!(third[0].worker(), first[0].worker());
    assert!(c.queue().is_empty());
    for t in first.into_iter().chain(third) {
        router.free(t.id(), 70.0);
        c.complete(t, 700, 70.0).unwrap();
    }
}

#[derive(Clone, Debug)]
enum Op {
    Submit {
        session: Option<u64>,
        tokens: u32,
    },
    Poll {
        answers: Vec<u8>,
    },
    Dispatch(usize),
    Complete(usize),
    Abort(usize),
    Cancel(usize),
    Tick(f64),
    ReportKv {
        worker: u64,
        capacity: u64,
        used: Option<u64>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (proptest::option::of(0u64..4), 1u32..3000)
            .prop_map(|(session, tokens)| Op::Submit { session, tokens }),
        3 => proptest::collection::vec(0u8..10, 1..6).prop_map(|answers| Op::Poll { answers }),
        2 => any::<usize>().prop_map(Op::Dispatch),
        2 => any::<usize>().prop_map(Op::Complete),
        1 => any::<usize>().prop_map(Op::Abort),
        1 => any::<usize>().prop_map(Op::Cancel),
        1 => (1.0f64..5_000.0).prop_map(Op::Tick),
        1 => (0u64..3, 500u64..20_000, proptest::option::of(0u64..25_000))
            .prop_map(|(worker, capacity, used)| Op::ReportKv { worker, capacity, used }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn random_admit_event_and_cancel_sequences_lose_nothing_and_leave_nothing(
        ops in proptest::collection::vec(op(), 1..120),
        strict in any::<bool>(),
    ) {
        let mut c = controller(SessionAwareConfig {
            affinity: if strict { Affinity::Strict } else { Affinity::Soft },
            ..Default::default()
        });
        let mut now = 0.0;
        let mut next_id = 0u128;
        let mut accepted: Vec<RequestId> = Vec::new();
        let mut tickets: Vec<(ResponseTicket, bool)> = Vec::new();
        let mut ever_selected: HashSet<RequestId> = HashSet::new();
        let mut ended: HashSet<RequestId> = HashSet::new();
        let end = |id: RequestId, ended: &mut HashSet<RequestId>| {
            assert!(ended.insert(id), "{id} ended twice");
        };
        let mut out = Vec::new();
        let take_placed = |out: &mut Vec<Placed>,
                               tickets: &mut Vec<(ResponseTicket, bool)>,
                               ever: &mut HashSet<RequestId>,
                               ended: &mut HashSet<RequestId>| {
            for placed in out.drain(..) {
                match placed {
                    Placed::Selected { ticket, .. } => {
                        assert!(ever.insert(ticket.id()), "{} selected twice", ticket.id());
                        tickets.push((ticket, false));
                    }
                    Placed::NoWorkers { id } => end(id, ended),
                }
            }
        };
        for op in ops {
            match op {
                Op::Submit { session, tokens } => {
                    next_id += 1;
                    let f = RequestFacts {
                        context_tokens: tokens,
                        uncached_tokens: tokens,
                        ..facts(next_id, session, now)
                    };
                    match c.submit(&f) {
                        SubmitOutcome::Queued | SubmitOutcome::Deferred => {
                            accepted.push(RequestId(next_id))
                        }
                        other => panic!("unexpected {other:?}"),
                    }
                }
                Op::Poll { answers } => {
                    let mut i = 0;
                    c.poll(now, &mut out, |_, placement| {
                        let a = answers[i % answers.len()];
                        i += 1;
                        match (a, placement) {
                            (0..=1, _) => SelectOutcome::AllBusy,
                            (2, _) => SelectOutcome::NoWorkers,
                            (_, Placement::Exact(w)) => selected(w),
                            (a, Placement::Any) => selected(WorkerId::new(a as u64 % 3)),
                        }
                    });
                    take_placed(&mut out, &mut tickets, &mut ever_selected, &mut ended);
                }
                Op::Dispatch(i) if !tickets.is_empty() => {
                    let i = i % tickets.len();
                    let (ticket, dispatched) = &mut tickets[i];
                    let outcome = c.dispatched(ticket, now);
                    prop_assert!(matches!(
                        outcome,
                        TransitionOutcome::Applied | TransitionOutcome::Duplicate | TransitionOutcome::Untracked
                    ));
                    *dispatched = true;
                    if let Some(p) = ticket.progress() {
                        p.advance(7);
                    }
                }
                Op::Complete(i) if !tickets.is_empty() => {
                    let i = i % tickets.len();
                    let (ticket, dispatched) = tickets.swap_remove(i);
                    let id = ticket.id();
                    match c.complete(ticket, 5_000, now) {
                        Ok(_) => end(id, &mut ended),
                        Err(refused) => {
                            prop_assert!(!dispatched);
                            tickets.push((refused.ticket, dispatched));
                        }
                    }
                }
                Op::Abort(i) if !tickets.is_empty() => {
                    let (ticket, _) = tickets.swap_remove(i % tickets.len());
                    let id = ticket.id();
                    c.abort(ticket, now);
                    end(id, &mut ended);
                }
                Op::Cancel(i) if !accepted.is_empty() => {
                    let id = accepted[i % accepted.len()];
                    if c.cancel(id, now) == CancelOutcome::Removed {
                        end(id, &mut ended);
                    }
                }
                Op::Tick(dt) => {
                    now += dt;
                    c.tick(now);
                }
                Op::ReportKv { worker, capacity, used } => c.report_kv(
                    WorkerId::new(worker),
                    KvUsage { capacity_tokens: capacity, used_tokens: used },
                ),
                _ => {}
            }
        }
        // Drain: every worker free, time runs on (forced resumes), every
        // ticket completes.
        for _ in 0..200 {
            for (ticket, _) in tickets.drain(..) {
                let id = ticket.id();
                c.dispatched(&ticket, now);
                c.complete(ticket, 100, now).unwrap();
                end(id, &mut ended);
            }
            if c.queue().is_empty() {
                break;
            }
            now += 1_000_000.0;
            c.tick(now);
            c.poll(now, &mut out, |_, placement| match placement {
                Placement::Exact(w) => selected(w),
                Placement::Any => selected(WorkerId::new(0)),
            });
            take_placed(&mut out, &mut tickets, &mut ever_selected, &mut ended);
        }
        prop_assert!(tickets.is_empty());
        prop_assert!(c.queue().is_empty());
        // No request lost: each accepted one ended exactly once.
        let accepted: HashSet<RequestId> = accepted.into_iter().collect();
        prop_assert_eq!(&ended, &accepted);
        prop_assert_eq!(c.tracked_records(), 0);
        prop_assert_eq!(c.strategy().unwrap().tracked_requests(), 0);
        let r = recorder(&c);
        prop_assert_eq!(&r.ended, &r.tracked);
        // Past the inactivity expiry the strategy forgets every session.
        now += 10_000_000.0;
        c.tick(now);
        let s = &recorder(&c).inner;
        prop_assert_eq!(s.sessions(), 0);
        prop_assert_eq!(s.paused_sessions(), 0);
        for worker in 0..3 {
            prop_assert_eq!(s.resident_tokens(WorkerId::new(worker)), 0);
        }
    }
}

#[test]
fn a_namespaced_session_is_its_clients_own() {
    let a = SessionKey::namespaced("team-a", "chat-1");
    assert_eq!(a, SessionKey::namespaced("team-a", "chat-1"));
    assert_ne!(a, SessionKey::namespaced("team-b", "chat-1"));
    assert_ne!(a, SessionKey::from_client_id("chat-1"));
    // Where the name ends and the id begins is not ambiguous.
    assert_ne!(
        SessionKey::namespaced("ab", "c"),
        SessionKey::namespaced("a", "bc")
    );
}

#[test]
fn a_requests_session_is_its_headers_else_its_bodys_within_its_keys_namespace() {
    let of = SessionKey::of_request;
    assert_eq!(
        of(Some("h"), Some("b"), None),
        Some(SessionKey::from_client_id("h"))
    );
    assert_eq!(
        of(None, Some("b"), None),
        Some(SessionKey::from_client_id("b"))
    );
    assert_eq!(
        of(None, Some("b"), Some("team-a")),
        Some(SessionKey::namespaced("team-a", "b"))
    );
    // An empty id is none (an empty header does not fall back to the body).
    assert_eq!(of(Some(""), Some("b"), None), None);
    assert_eq!(of(None, Some(""), None), None);
    assert_eq!(of(None, None, Some("team-a")), None);
}
