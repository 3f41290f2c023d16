use super::*;
use crate::index::OverlapScores;
use proptest::prelude::*;
use std::collections::HashMap;

fn w(id: u64) -> WorkerId {
    WorkerId::new(id)
}

fn r(id: u128) -> RequestId {
    RequestId(id)
}

fn model() -> ActiveSequences {
    ActiveSequences::new(SequencesConfig {
        block_size: 4,
        expiry_ms: 1000.0,
    })
    .unwrap()
}

fn add(id: u128, worker: u64, blocks: &[u64], prompt_tokens: u32) -> AddRequest {
    AddRequest {
        request: r(id),
        worker: w(worker),
        prompt_tokens,
        blocks: blocks.iter().map(|&b| LocalHash(b)).collect(),
        overlap_blocks: 0,
        expected_prefill_ms: None,
    }
}

fn prompt_overlap(s: &ActiveSequences, worker: u64, blocks: &[u64]) -> u32 {
    let mut out = OverlapScores::new();
    let hashes: Vec<LocalHash> = blocks.iter().map(|&b| LocalHash(b)).collect();
    s.active_prompt_overlaps(&hashes, &mut Vec::new(), &mut out);
    out.depth(w(worker))
}

#[test]
fn shared_prompt_blocks_count_once_per_worker() {
    let mut s = model();
    s.add_worker(w(1));
    s.add_request(&add(1, 1, &[1, 2, 3], 12), 0.0);
    s.add_request(&add(2, 1, &[1, 2, 4], 14), 0.0);
    let load = s.registry().load(w(1)).unwrap();
    // Blocks 1, 2 shared; 3 and 4 own; request 2 has a partial tail block.
    assert_eq!(load.decode_blocks, 5);
    assert_eq!(load.requests, 2);
    assert_eq!(prompt_overlap(&s, 1, &[1, 2, 4, 9]), 3);
    s.check_invariants();
}

#[test]
fn freeing_returns_every_block_the_request_held() {
    let mut s = model();
    s.add_worker(w(1));
    s.add_request(&add(1, 1, &[1, 2, 3], 13), 0.0);
    s.add_request(&add(2, 1, &[1, 2], 8), 0.0);
    assert_eq!(s.free(r(1), 1.0), LifecycleOutcome::Applied);
    assert_eq!(s.registry().load(w(1)).unwrap().decode_blocks, 2);
    assert_eq!(prompt_overlap(&s, 1, &[1, 2, 3]), 2);
    assert_eq!(s.free(r(2), 1.0), LifecycleOutcome::Applied);
    let load = s.registry().load(w(1)).unwrap();
    assert_eq!((load.decode_blocks, load.requests), (0, 0));
    assert_eq!(load.active_prefill_tokens(1.0), 0);
    assert_eq!(prompt_overlap(&s, 1, &[1]), 0);
    s.check_invariants();
}

#[test]
fn freeing_twice_is_harmless() {
    let mut s = model();
    s.add_worker(w(1));
    s.add_request(&add(1, 1, &[1], 4), 0.0);
    assert_eq!(s.free(r(1), 0.0), LifecycleOutcome::Applied);
    assert_eq!(s.free(r(1), 0.0), LifecycleOutcome::UnknownRequest);
    assert_eq!(s.free(r(9), 0.0), LifecycleOutcome::UnknownRequest);
    assert_eq!(s.counters().ignored, 2);
    s.check_invariants();
}

#[test]
fn duplicate_and_stale_events_change_nothing() {
    let mut s = model();
    s.add_worker(w(1));
    s.add_worker(w(2));
    assert_eq!(
        s.add_request(&add(1, 1, &[1], 4), 0.0),
        LifecycleOutcome::Applied
    );
    // The same id again, even for another worker, stays with its owner.
    assert_eq!(
        s.add_request(&add(1, 2, &[1], 4), 0.0),
        LifecycleOutcome::Duplicate
    );
    assert_eq!(s.owner(r(1)), Some(w(1)));
    assert_eq!(
        s.mark_prefill_completed(r(1), 1.0),
        LifecycleOutcome::Applied
    );
    assert_eq!(
        s.mark_prefill_completed(r(1), 1.0),
        LifecycleOutcome::Duplicate
    );
    assert_eq!(
        s.mark_prefill_completed(r(5), 1.0),
        LifecycleOutcome::UnknownRequest
    );
    assert_eq!(
        s.add_request(&add(3, 7, &[1], 4), 0.0),
        LifecycleOutcome::UnknownWorker
    );
    s.check_invariants();
}

#[test]
fn an_empty_prompt_books_no_blocks() {
    let mut s = model();
    s.add_worker(w(1));
    assert_eq!(
        s.add_request(&add(1, 1, &[], 0), 0.0),
        LifecycleOutcome::Applied
    );
    let load = s.registry().load(w(1)).unwrap();
    assert_eq!((load.decode_blocks, load.requests), (0, 1));
    assert_eq!(s.free(r(1), 0.0), LifecycleOutcome::Applied);
}

#[test]
fn prefill_tokens_exclude_the_expected_cached_prefix_and_drop_at_the_first_token() {
    let mut s = model();
    s.add_worker(w(1));
    let mut a = add(1, 1, &[1, 2, 3], 13);
    a.overlap_blocks = 2;
    s.add_request(&a, 0.0);
    assert_eq!(
        s.registry().load(w(1)).unwrap().active_prefill_tokens(0.0),
        5
    );
    s.mark_prefill_completed(r(1), 1.0);
    let load = s.registry().load(w(1)).unwrap();
    assert_eq!(load.active_prefill_tokens(1.0), 0);
    // Its blocks stay booked until it is freed.
    assert_eq!(load.decode_blocks, 4);
}

#[test]
fn requests_older_than_the_deadline_expire() {
    let mut s = model();
    s.add_worker(w(1));
    s.add_request(&add(1, 1, &[1], 4), 0.0);
    s.add_request(&add(2, 1, &[2], 4), 500.0);
    assert!(s.expire(999.0).is_empty());
    assert_eq!(s.expire(1000.0), vec![r(1)]);
    assert_eq!(s.owner(r(1)), None);
    assert_eq!(s.owner(r(2)), Some(w(1)));
    s.free(r(2), 1100.0);
    assert!(s.expire(5000.0).is_empty());
    assert_eq!(s.counters().expired, 1);
    s.check_invariants();
}

#[test]
fn the_expiry_queue_stays_bounded_without_a_sweep() {
    // Requests freed as they end leave their expiry entries behind; with no
    // `expire` call in between, 10,000 of them with one still active keep
    // the queue within its bound (twice the live requests plus 1,024).
    let mut s = model();
    s.add_worker(w(1));
    s.add_request(&add(0, 1, &[9], 4), 0.0);
    for id in 1..=10_000u128 {
        s.add_request(&add(id, 1, &[1, 2], 8), id as f64 * 1e-3);
        assert_eq!(s.free(r(id), id as f64 * 1e-3), LifecycleOutcome::Applied);
    }
    let entry = std::mem::size_of::<(f64, RequestId)>();
    let bound = 2 * s.active_requests() + 1024 + 1;
    assert!(
        s.memory().expiry_queue <= bound.next_power_of_two() * entry,
        "{} bytes for {} live requests",
        s.memory().expiry_queue,
        s.active_requests()
    );
    // The live request still expires on time.
    assert_eq!(s.expire(1000.0), vec![r(0)]);
    s.check_invariants();
}

#[test]
fn removing_a_worker_frees_its_requests() {
    let mut s = model();
    s.add_worker(w(1));
    s.add_worker(w(2));
    s.add_request(&add(1, 1, &[1], 4), 0.0);
    s.add_request(&add(2, 2, &[1], 4), 0.0);
    assert_eq!(s.remove_worker(w(1)), vec![r(1)]);
    assert_eq!(s.owner(r(1)), None);
    assert!(s.registry().load(w(1)).is_none());
    assert_eq!(prompt_overlap(&s, 1, &[1]), 0);
    assert_eq!(prompt_overlap(&s, 2, &[1]), 1);
    assert_eq!(s.free(r(1), 0.0), LifecycleOutcome::UnknownRequest);
    s.check_invariants();
}

#[test]
fn a_bad_config_is_refused() {
    let zero = SequencesConfig {
        block_size: 0,
        ..Default::default()
    };
    assert_eq!(
        ActiveSequences::new(zero).unwrap_err(),
        SequencesConfigError::BlockSize
    );
    let never = SequencesConfig {
        expiry_ms: -1.0,
        ..Default::default()
    };
    assert!(ActiveSequences::new(never).is_err());
}

#[derive(Clone, Debug)]
enum Op {
    Add {
        id: u128,
        worker: u64,
        blocks: Vec<u64>,
        extra: u32,
        hint: Option<u16>,
    },
    Mark(u128),
    Free(u128),
    Expire,
    RemoveWorker(u64),
    AddWorker(u64),
    Tick(u16),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..12u128, 0..4u64, proptest::collection::vec(0..3u64, 0..5), 0..4u32, proptest::option::of(0..500u16))
            .prop_map(|(id, worker, blocks, extra, hint)| Op::Add { id, worker, blocks, extra, hint }),
        2 => (0..12u128).prop_map(Op::Mark),
        3 => (0..12u128).prop_map(Op::Free),
        1 => Just(Op::Expire),
        1 => (0..4u64).prop_map(Op::RemoveWorker),
        1 => (0..4u64).prop_map(Op::AddWorker),
        2 => (0..400u16).prop_map(Op::Tick),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn active_sequences_keep_their_invariants(ops in proptest::collection::vec(op(), 1..100)) {
        let mut s = model();
        // Reference: request → (worker, prefix blocks).
        let mut reference: HashMap<u128, (u64, Vec<u64>)> = HashMap::new();
        let mut workers: std::collections::HashSet<u64> = (0..3).collect();
        for id in 0..3 { s.add_worker(w(id)); }
        let mut now = 0.0;
        let mut booked_at: HashMap<u128, f64> = HashMap::new();
        for op in ops {
            match op {
                Op::Add { id, worker, blocks, extra, hint } => {
                    let prompt = blocks.len() as u32 * 4 + extra;
                    let mut a = add(id, worker, &blocks, prompt);
                    a.expected_prefill_ms = hint.map(f64::from);
                    let outcome = s.add_request(&a, now);
                    let expected = if !workers.contains(&worker) {
                        LifecycleOutcome::UnknownWorker
                    } else if let std::collections::hash_map::Entry::Vacant(e) = reference.entry(id) {
                        e.insert((worker, blocks));
                        booked_at.insert(id, now);
                        LifecycleOutcome::Applied
                    } else {
                        LifecycleOutcome::Duplicate
                    };
                    prop_assert_eq!(outcome, expected);
                }
                Op::Mark(id) => { s.mark_prefill_completed(r(id), now); }
                Op::Free(id) => {
                    let outcome = s.free(r(id), now);
                    let expected = if reference.remove(&id).is_some() {
                        LifecycleOutcome::Applied
                    } else {
                        LifecycleOutcome::UnknownRequest
                    };
                    prop_assert_eq!(outcome, expected);
                }
                Op::Expire => {
                    let mut expired: Vec<u128> = s.expire(now).into_iter().map(|r| r.0).collect();
                    expired.sort();
                    let mut want: Vec<u128> = reference.keys()
                        .filter(|id| booked_at[id] <= now - 1000.0).copied().collect();
                    want.sort();
                    prop_assert_eq!(&expired, &want);
                    for id in want { reference.remove(&id); }
                }
                Op::RemoveWorker(worker) => {
                    let mut freed: Vec<u128> = s.remove_worker(w(worker)).into_iter().map(|r| r.0).collect();
                    freed.sort();
                    let mut want: Vec<u128> = reference.iter()
                        .filter(|(_, (wk, _))| *wk == worker).map(|(id, _)| *id).collect();
                    want.sort();
                    prop_assert_eq!(&freed, &want);
                    for id in want { reference.remove(&id); }
                    workers.remove(&worker);
                }
                Op::AddWorker(worker) => { s.add_worker(w(worker)); workers.insert(worker); }
                Op::Tick(ms) => now += f64::from(ms),
            }
            s.check_invariants();
            prop_assert_eq!(s.active_requests(), reference.len());
            for (id, (worker, _)) in &reference {
                prop_assert_eq!(s.owner(r(*id)), Some(w(*worker)));
            }
            // Membership answers equal a recount of active prefixes.
            for worker in 0..4u64 {
                for query in [vec![0, 1, 2, 0], vec![1, 1], vec![2, 0, 1]] {
                    let want = reference.values()
                        .filter(|(wk, _)| *wk == worker)
                        .map(|(_, b)| b.iter().zip(&query).take_while(|(a, q)| a == q).count())
                        .max().unwrap_or(0) as u32;
                    prop_assert_eq!(prompt_overlap(&s, worker, &query), want);
                }
            }
        }
        let ids: Vec<u128> = reference.keys().copied().collect();
        for id in ids { prop_assert_eq!(s.free(r(id), now), LifecycleOutcome::Applied); }
        prop_assert_eq!(s.active_requests(), 0);
        for load in s.registry().loads() {
            prop_assert_eq!(load.decode_blocks, 0);
            prop_assert_eq!(load.requests, 0);
            prop_assert_eq!(load.active_prefill_tokens(now), 0);
            prop_assert_eq!(load.prefill.count, 0);
            prop_assert_eq!(s.active_blocks(load.worker), 0);
        }
    }
}
