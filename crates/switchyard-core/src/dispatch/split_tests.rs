//! Disaggregated requests through the dispatcher: which half goes where,
//! when the decode half is placed, which failures retry which half, and
//! that a split never outlives its halves.

use super::*;
use crate::admission::{SessionAwareConfig, SessionAwareStrategy};
use proptest::prelude::*;

const CAPACITY: WorkerCapacity = WorkerCapacity {
    max_num_batched_tokens: Some(8192),
    kv_blocks: Some(1024),
    kv_tokens: Some(1024 * 16),
    block_size: None,
};

fn w(id: u64) -> WorkerId {
    WorkerId::new(id)
}

/// Workers 1 and 2 prefill, 3 and 4 decode.
fn fleet(session_aware: bool) -> Dispatcher {
    let strategy = session_aware.then(|| {
        Box::new(SessionAwareStrategy::new(SessionAwareConfig::default()).unwrap())
            as Box<dyn AdmissionStrategy + Send>
    });
    let mut d = Dispatcher::new(DispatcherConfig::default(), strategy).unwrap();
    for id in 1..=4 {
        let _ = d.add_worker(w(id), CAPACITY, 0.0);
    }
    d
}

fn plan(pairing: Pairing) -> SplitPlan {
    SplitPlan {
        pairing,
        prefill_pool: crate::types::Eligible::Only(vec![w(1), w(2)]),
        decode_pool: crate::types::Eligible::Only(vec![w(3), w(4)]),
        transfer_limit: 2,
    }
}

fn prompt(session: Option<u64>) -> Submission {
    Submission {
        blocks: (0..8).map(LocalHash).collect(),
        prompt_tokens: 8 * 16,
        session: session.map(SessionKey),
        ..Submission::default()
    }
}

const ID: RequestId = RequestId(7);

#[test]
fn a_request_after_prefill_prefills_then_decodes_each_in_its_pool() {
    let mut d = fleet(false);
    let (admitted, fx) = d
        .submit_split(ID, prompt(None), plan(Pairing::AfterPrefill), 0.0)
        .unwrap();
    assert_eq!(admitted, Admitted::Queued);
    let [sent] = fx.dispatch.as_slice() else {
        panic!("only the prefill half at first: {fx:?}")
    };
    assert_eq!(sent.id, prefill_half(ID));
    assert_eq!(sent.half, Some(Half::Prefill));
    assert!([w(1), w(2)].contains(&sent.worker));
    assert_eq!(request_of(sent.id), ID);
    assert_eq!(d.splits(), 1);
    assert_eq!(d.pairing_of(sent.id), Some(Pairing::AfterPrefill));

    let fx = d.handed_over(ID, 10.0);
    let [decode] = fx.dispatch.as_slice() else {
        panic!("the decode half once the prefill handed over: {fx:?}")
    };
    assert_eq!(decode.id, ID);
    assert_eq!(decode.half, Some(Half::Decode));
    assert!([w(3), w(4)].contains(&decode.worker));
    assert_eq!(
        d.placement_of(prefill_half(ID)),
        None,
        "the prefill half ended"
    );
    assert_eq!(d.router().sequences().active_requests(), 1);

    let _ = d.first_token(ID, 12.0);
    let _ = d.finish(ID, 8 * 16 + 20, 30.0);
    assert_eq!((d.requests(), d.splits()), (0, 0));
    assert_eq!(d.router().sequences().active_requests(), 0);
}

#[test]
fn a_request_together_places_both_halves_at_once() {
    let mut d = fleet(false);
    let (_, fx) = d
        .submit_split(ID, prompt(None), plan(Pairing::Together), 0.0)
        .unwrap();
    let halves: Vec<_> = fx.dispatch.iter().map(|s| (s.id, s.half)).collect();
    assert_eq!(
        halves,
        vec![
            (prefill_half(ID), Some(Half::Prefill)),
            (ID, Some(Half::Decode))
        ]
    );
    // The prefill answers after the decode's end: the split is gone with
    // the decode, the prefill half ends on its own.
    let _ = d.finish(ID, 200, 5.0);
    assert_eq!(d.requests(), 1);
    let _ = d.handed_over(ID, 6.0);
    assert_eq!((d.requests(), d.splits()), (0, 0));
}

#[test]
fn the_decode_half_carries_the_session_so_a_turn_ends_with_its_answer() {
    let mut d = fleet(true);
    let (_, fx) = d
        .submit_split(ID, prompt(Some(9)), plan(Pairing::AfterPrefill), 0.0)
        .unwrap();
    assert_eq!(fx.dispatch.len(), 1);
    let (_, fx) = d
        .submit_split(
            RequestId(8),
            prompt(Some(9)),
            plan(Pairing::AfterPrefill),
            1.0,
        )
        .unwrap();
    assert_eq!(
        fx.dispatch.len(),
        1,
        "the next turn's prefill carries no session: it may run"
    );
    let fx = d.handed_over(ID, 2.0);
    assert_eq!(fx.dispatch.len(), 1, "turn 1's decode");
    let fx = d.handed_over(RequestId(8), 3.0);
    assert!(
        fx.dispatch.is_empty(),
        "turn 2's decode waits for turn 1's answer: {fx:?}"
    );
    let _ = d.first_token(ID, 4.0);
    let fx = d.finish(ID, 200, 5.0);
    let [next] = fx.dispatch.as_slice() else {
        panic!("{fx:?}")
    };
    assert_eq!((next.id, next.half), (RequestId(8), Some(Half::Decode)));
}

#[test]
fn which_failures_retry_which_half() {
    use HalfFailure::{Transfer, Worker};
    for pairing in [Pairing::AfterPrefill, Pairing::Together] {
        for failure in [Worker, Transfer] {
            assert_eq!(
                recovery(pairing, Half::Prefill, failure),
                Recovery {
                    move_half: true,
                    redo_prefill: false
                }
            );
        }
        assert_eq!(
            recovery(pairing, Half::Decode, Transfer),
            Recovery {
                move_half: false,
                redo_prefill: true
            }
        );
    }
    assert!(!recovery(Pairing::AfterPrefill, Half::Decode, Worker).redo_prefill);
    assert!(recovery(Pairing::Together, Half::Decode, Worker).redo_prefill);
}

#[test]
fn a_failed_transfer_prefills_again_keeping_the_decode_until_the_limit() {
    let mut d = fleet(false);
    let _ = d
        .submit_split(ID, prompt(None), plan(Pairing::AfterPrefill), 0.0)
        .unwrap();
    let fx = d.handed_over(ID, 1.0);
    let decode = fx.dispatch[0].worker;
    for attempt in 1..=2 {
        let fx = d.redo_prefill(ID, true, 2.0 * attempt as f64).unwrap();
        let [again] = fx.dispatch.as_slice() else {
            panic!("{fx:?}")
        };
        assert_eq!(again.half, Some(Half::Prefill));
        let fx = d.handed_over(ID, 2.0 * attempt as f64 + 1.0);
        assert!(
            fx.dispatch.is_empty(),
            "the decode half stays booked: {fx:?}"
        );
        assert_eq!(d.placement_of(ID), Some(decode));
    }
    assert_eq!(
        d.redo_prefill(ID, true, 9.0).unwrap_err(),
        SplitError::Transfers(3)
    );
    let _ = d.abort(ID, 9.0);
    assert_eq!((d.requests(), d.splits()), (0, 0));
    assert_eq!(
        d.redo_prefill(ID, true, 10.0).unwrap_err(),
        SplitError::Unknown
    );
}

#[test]
fn a_half_no_worker_can_take_ends_both_halves() {
    let mut d = fleet(false);
    let mut nowhere = plan(Pairing::Together);
    nowhere.prefill_pool = crate::types::Eligible::Only(vec![w(99)]);
    let (_, fx) = d.submit_split(ID, prompt(None), nowhere, 0.0).unwrap();
    assert!(fx.dispatch.is_empty(), "the decode is never sent: {fx:?}");
    let mut ended = fx.no_worker.clone();
    ended.sort();
    assert_eq!(ended, vec![ID, prefill_half(ID)]);
    assert_eq!((d.requests(), d.splits()), (0, 0));
    assert_eq!(d.router().sequences().active_requests(), 0);
}

#[test]
fn a_refused_split_retains_nothing() {
    let mut config = DispatcherConfig::default();
    config.admission.queue.class_limits = Vec::new();
    config.admission.queue.default_limits.max_requests = 2;
    config.router.busy_threshold = Some(0.5);
    let mut d = Dispatcher::new(config, None).unwrap();
    let _ = d.add_worker(w(1), CAPACITY, 0.0);
    let one = SplitPlan {
        pairing: Pairing::Together,
        prefill_pool: crate::types::Eligible::Only(vec![w(1)]),
        decode_pool: crate::types::Eligible::Only(vec![w(1)]),
        transfer_limit: 0,
    };
    let big = Submission {
        prompt_tokens: 5_000,
        ..Submission::default()
    };
    // The prefill half fills the worker and the decode half waits; the
    // next split's prefill half takes the queue's last place and its
    // decode half finds it full: neither stays.
    let _ = d.submit_split(ID, big.clone(), one.clone(), 0.0).unwrap();
    let before = d.requests();
    assert!(matches!(
        d.submit_split(RequestId(8), big.clone(), one.clone(), 0.0),
        Err(Refused::Full { .. })
    ));
    assert_eq!(
        d.submit_split(ID, big.clone(), one.clone(), 0.0)
            .unwrap_err(),
        Refused::Duplicate
    );
    assert_eq!(
        d.submit_split(prefill_half(RequestId(8)), big, one, 0.0)
            .unwrap_err(),
        Refused::Duplicate,
        "a prefill half's id is not a request's"
    );
    assert_eq!(d.requests(), before);
    assert_eq!(d.splits(), 1);
}

#[derive(Clone, Debug)]
enum Op {
    Submit(bool),
    HandOver(u8),
    Redo(u8, bool),
    Finish(u8),
    Abort(u8),
    AbortPrefill(u8),
    Tick(u16),
    RemoveWorker(u8),
    AddWorker(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => any::<bool>().prop_map(Op::Submit),
        3 => any::<u8>().prop_map(Op::HandOver),
        1 => (any::<u8>(), any::<bool>()).prop_map(|(i, t)| Op::Redo(i, t)),
        2 => any::<u8>().prop_map(Op::Finish),
        1 => any::<u8>().prop_map(Op::Abort),
        1 => any::<u8>().prop_map(Op::AbortPrefill),
        1 => (0u16..3000).prop_map(Op::Tick),
        1 => (1u8..=4).prop_map(Op::RemoveWorker),
        1 => (1u8..=4).prop_map(Op::AddWorker),
    ]
}

proptest! {
    /// Whatever happens to its halves, a split lives only while one of them
    /// does (never more splits than requests); a dispatched half is its
    /// pool's; and once every request has ended nothing is left.
    #[test]
    fn a_split_never_outlives_its_halves(
        ops in proptest::collection::vec(op(), 1..100),
        session_aware in any::<bool>(),
    ) {
        let mut config = DispatcherConfig::default();
        config.router.sequences.expiry_ms = 2_000.0;
        let strategy = session_aware.then(|| {
            Box::new(SessionAwareStrategy::new(SessionAwareConfig::default()).unwrap())
                as Box<dyn AdmissionStrategy + Send>
        });
        let mut d = Dispatcher::new(config, strategy).unwrap();
        for id in 1..=4 {
            let _ = d.add_worker(w(id), CAPACITY, 0.0);
        }
        let mut now = 0.0;
        let mut known: Vec<RequestId> = Vec::new();
        let check = |fx: &Effects| {
            for sent in &fx.dispatch {
                let pool = match sent.half {
                    Some(Half::Prefill) => [w(1), w(2)],
                    Some(Half::Decode) => [w(3), w(4)],
                    None => panic!("a whole request among splits: {sent:?}"),
                };
                assert!(pool.contains(&sent.worker), "{sent:?}");
            }
        };
        for op in ops {
            now += 10.0;
            let pick = |i: u8| (!known.is_empty()).then(|| known[i as usize % known.len()]);
            let fx = match op {
                Op::Submit(together) => {
                    let id = RequestId(known.len() as u128 + 1);
                    known.push(id);
                    let pairing = if together { Pairing::Together } else { Pairing::AfterPrefill };
                    let session = (id.0 % 3 == 0).then_some(id.0 as u64 % 2);
                    d.submit_split(id, prompt(session), plan(pairing), now)
                        .map(|(_, fx)| fx)
                        .unwrap_or_default()
                }
                Op::HandOver(i) => pick(i).map(|id| d.handed_over(id, now)).unwrap_or_default(),
                Op::Redo(i, t) => pick(i)
                    .and_then(|id| d.redo_prefill(id, t, now).ok())
                    .unwrap_or_default(),
                Op::Finish(i) => pick(i).map(|id| d.finish(id, 300, now)).unwrap_or_default(),
                Op::Abort(i) => pick(i).map(|id| d.abort(id, now)).unwrap_or_default(),
                Op::AbortPrefill(i) => pick(i)
                    .map(|id| d.abort(prefill_half(id), now))
                    .unwrap_or_default(),
                Op::Tick(dt) => {
                    now += f64::from(dt);
                    d.tick(now)
                }
                Op::RemoveWorker(k) => d.remove_worker(w(u64::from(k)), now),
                Op::AddWorker(k) => d.add_worker(w(u64::from(k)), CAPACITY, now),
            };
            check(&fx);
            prop_assert!(d.splits() <= d.requests(), "{} splits, {} requests", d.splits(), d.requests());
        }
        for id in known.clone() {
            let fx = d.abort(prefill_half(id), now);
            check(&fx);
            let fx = d.abort(id, now);
            check(&fx);
        }
        prop_assert_eq!(d.requests(), 0);
        prop_assert_eq!(d.splits(), 0);
        prop_assert_eq!(d.router().sequences().active_requests(), 0);
    }
}
