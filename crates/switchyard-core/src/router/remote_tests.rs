use super::{Router, RouterConfig, WorkerCapacity};
use crate::replica::*;
use crate::sequences::AddRequest;
use crate::sequences::{ActiveSequences, SequenceEvent};
use crate::types::{LocalHash, WorkerId};
use crate::types::{ReplicaId, RequestId};
use proptest::prelude::*;

const PEER: ReplicaId = ReplicaId(7);
const ME: ReplicaId = ReplicaId(1);

fn router(silence_expiry_ms: f64) -> Router {
    let mut r = Router::new(RouterConfig {
        remote: RemoteConfig {
            silence_expiry_ms,
            max_replicas: 4,
            ..RemoteConfig::default()
        },
        ..RouterConfig::default()
    })
    .unwrap();
    r.set_replica_id(ME);
    for id in 0..3 {
        r.add_worker(WorkerId::new(id), WorkerCapacity::default());
    }
    r
}

fn add(id: u128, worker: u64, blocks: &[u64], prompt_tokens: u32) -> SequenceEvent {
    SequenceEvent::Add(AddRequest {
        request: RequestId(id),
        worker: WorkerId::new(worker),
        prompt_tokens,
        blocks: blocks.iter().map(|&b| LocalHash(b)).collect(),
        overlap_blocks: 0,
        expected_prefill_ms: None,
    })
}

/// `(requests, decode blocks, prefill tokens at now)` per worker, in worker order.
fn loads(r: &ActiveSequences, now_ms: f64) -> Vec<(WorkerId, usize, usize, u64)> {
    let mut out: Vec<_> = r
        .registry()
        .loads()
        .map(|l| {
            (
                l.worker,
                l.requests,
                l.decode_blocks,
                l.active_prefill_tokens(now_ms),
            )
        })
        .collect();
    out.sort();
    out
}

#[test]
fn a_replica_ignores_its_own_events() {
    let mut r = router(1000.0);
    assert_eq!(
        r.apply_remote(ME, &add(1, 0, &[1, 2], 32), 0.0),
        RemoteOutcome::Own
    );
    assert_eq!(r.sequences().active_requests(), 0);
    assert_eq!(r.remote().counters().own, 1);
    assert_eq!(r.remote().replicas(), 0);
}

#[test]
fn a_peers_booking_counts_in_the_local_load_until_the_peer_frees_it() {
    let mut r = router(1000.0);
    assert!(r.apply_remote(PEER, &add(1, 2, &[1, 2], 40), 0.0).applied());
    let key = r.remote().key_of(PEER, RequestId(1)).unwrap();
    assert_eq!(r.remote().owner(key), Some(PEER));
    assert_ne!(key, RequestId(1), "held under a key of its own");
    let load = r.sequences().registry().load(WorkerId::new(2)).unwrap();
    assert_eq!((load.requests, load.decode_blocks), (1, 3));
    assert!(r
        .apply_remote(
            PEER,
            &SequenceEvent::MarkPrefillCompleted(RequestId(1)),
            1.0
        )
        .applied());
    assert!(r
        .apply_remote(PEER, &SequenceEvent::Free(RequestId(1)), 2.0)
        .applied());
    assert_eq!(r.sequences().active_requests(), 0);
    assert_eq!(r.remote().remote_requests(), 0);
}

#[test]
fn a_peer_cannot_free_a_local_booking_or_another_peers() {
    let mut r = router(1000.0);
    r.apply_remote(PEER, &add(1, 0, &[1], 16), 0.0);
    let other = ReplicaId(8);
    assert_eq!(
        r.apply_remote(other, &SequenceEvent::Free(RequestId(1)), 1.0),
        RemoteOutcome::NotOwner
    );
    assert_eq!(r.sequences().active_requests(), 1);
}

#[test]
fn any_sender_may_mark_a_booking_of_the_origin_it_names_as_a_worker_does() {
    let mut r = router(1000.0);
    r.apply_remote(PEER, &add(1, 0, &[1], 16), 0.0);
    let worker_origin = ReplicaId(99);
    // Naming itself as the booking's origin finds nothing.
    assert_eq!(
        r.apply_remote(
            worker_origin,
            &SequenceEvent::MarkPrefillCompleted(RequestId(1)),
            1.0
        ),
        RemoteOutcome::NotOwner
    );
    assert!(r
        .apply_remote_from(
            worker_origin,
            PEER,
            &SequenceEvent::MarkPrefillCompleted(RequestId(1)),
            1.0
        )
        .applied());
    let load = r.sequences().registry().load(WorkerId::new(0)).unwrap();
    assert_eq!(load.active_prefill_tokens(1.0), 0);
    // A worker's mark refreshes neither its own nor the booking's origin.
    assert_eq!(r.remote().replicas(), 1);
}

#[test]
fn bookings_of_a_silent_peer_expire_and_a_chatty_peers_do_not() {
    let mut r = router(100.0);
    r.apply_remote(PEER, &add(1, 0, &[1], 16), 0.0);
    r.apply_remote(ReplicaId(8), &add(2, 1, &[1], 16), 0.0);
    // Peer 8 keeps talking (a heartbeat); PEER goes quiet.
    assert!(r.replica_heartbeat(ReplicaId(8), 90.0));
    assert!(r.expire_silent_replicas(99.0).is_empty());
    let key = r.remote().key_of(PEER, RequestId(1)).unwrap();
    assert_eq!(r.expire_silent_replicas(150.0), vec![key]);
    assert_eq!(r.sequences().active_requests(), 1);
    assert_eq!(r.remote().counters().expired, 1);
    assert_eq!(r.remote().replicas(), 1);
}

#[test]
fn the_longest_silent_origin_is_evicted_at_the_cap_and_its_bookings_freed() {
    let mut r = router(1e9);
    for origin in 10..14u64 {
        r.apply_remote(
            ReplicaId(origin),
            &add(origin as u128, 0, &[1], 16),
            origin as f64,
        );
    }
    assert_eq!(r.remote().replicas(), 4);
    let key = r.remote().key_of(ReplicaId(10), RequestId(10)).unwrap();
    r.replica_heartbeat(ReplicaId(20), 30.0);
    assert_eq!(r.remote().replicas(), 4);
    assert_eq!(r.remote().owner(key), None);
    assert_eq!(r.sequences().owner(key), None);
    assert_eq!(r.remote().counters().evicted_replicas, 1);
}

#[test]
fn per_request_expiry_of_a_remote_booking_forgets_its_owner() {
    let mut r = router(1e9);
    r.apply_remote(PEER, &add(1, 0, &[1], 16), 0.0);
    let expiry = r.config().sequences.expiry_ms;
    let key = r.remote().key_of(PEER, RequestId(1)).unwrap();
    assert_eq!(r.expire(expiry + 1.0), vec![key]);
    assert_eq!(r.remote().remote_requests(), 0);
}

#[test]
fn remote_bookings_are_counted_per_worker_until_freed_or_expired() {
    let mut r = router(100.0);
    r.apply_remote(PEER, &add(1, 0, &[1], 16), 0.0);
    r.apply_remote(PEER, &add(2, 0, &[2], 16), 0.0);
    r.apply_remote(ReplicaId(8), &add(3, 1, &[3], 16), 0.0);
    assert_eq!(r.remote().remote_requests_on(WorkerId::new(0)), 2);
    assert_eq!(r.remote().remote_requests_on(WorkerId::new(1)), 1);
    assert_eq!(r.remote().remote_requests_on(WorkerId::new(2)), 0);
    r.apply_remote(PEER, &SequenceEvent::Free(RequestId(1)), 1.0);
    assert_eq!(r.remote().remote_requests_on(WorkerId::new(0)), 1);
    r.replica_heartbeat(ReplicaId(8), 90.0);
    r.expire_silent_replicas(150.0);
    assert_eq!(r.remote().remote_requests_on(WorkerId::new(0)), 0);
    assert_eq!(r.remote().remote_requests_on(WorkerId::new(1)), 1);
    r.remove_worker(WorkerId::new(1));
    assert_eq!(r.remote().remote_requests_on(WorkerId::new(1)), 0);
}

#[test]
fn a_bad_remote_config_is_refused() {
    assert!(RemoteConfig {
        silence_expiry_ms: 0.0,
        ..RemoteConfig::default()
    }
    .validate()
    .is_err());
    assert!(RemoteConfig {
        max_replicas: 0,
        ..RemoteConfig::default()
    }
    .validate()
    .is_err());
}

#[derive(Clone, Debug)]
enum Op {
    Add {
        worker: u64,
        blocks: Vec<u64>,
        extra: u32,
    },
    Mark(usize),
    Free(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3u64, proptest::collection::vec(0..6u64, 0..5), 0..16u32)
            .prop_map(|(worker, blocks, extra)| Op::Add { worker, blocks, extra }),
        1 => (0..64usize).prop_map(Op::Mark),
        2 => (0..64usize).prop_map(Op::Free),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// The peer's own model and a replica fed the peer's event stream agree
    /// on every worker's load after every event.
    #[test]
    fn applying_a_peers_event_stream_yields_the_peers_own_loads(ops in proptest::collection::vec(op(), 1..80)) {
        let mut peer = ActiveSequences::new(RouterConfig::default().sequences).unwrap();
        for id in 0..3 {
            peer.add_worker(WorkerId::new(id));
        }
        let mut replica = router(1e9);
        let mut next_id = 0u128;
        let mut booked: Vec<RequestId> = Vec::new();
        for (step, op) in ops.into_iter().enumerate() {
            let now = step as f64;
            let event = match op {
                Op::Add { worker, blocks, extra } => {
                    next_id += 1;
                    booked.push(RequestId(next_id));
                    add(next_id, worker, &blocks, blocks.len() as u32 * 16 + extra)
                }
                Op::Mark(i) if !booked.is_empty() => {
                    SequenceEvent::MarkPrefillCompleted(booked[i % booked.len()])
                }
                Op::Free(i) if !booked.is_empty() => {
                    SequenceEvent::Free(booked[i % booked.len()])
                }
                _ => continue,
            };
            peer.apply(&event, now);
            replica.apply_remote(PEER, &event, now);
            prop_assert_eq!(loads(&peer, now), loads(replica.sequences(), now));
        }
        prop_assert_eq!(replica.remote().remote_requests(), peer.active_requests());
    }
}

// ---- What a peer sends is checked and clamped -----------------------

fn add_with(id: u128, worker: u64, blocks: usize, prompt_tokens: u32) -> AddRequest {
    AddRequest {
        request: RequestId(id),
        worker: WorkerId::new(worker),
        prompt_tokens,
        blocks: (0..blocks as u64).map(LocalHash).collect(),
        overlap_blocks: 0,
        expected_prefill_ms: None,
    }
}

#[test]
fn an_event_for_an_unknown_worker_is_dropped_and_counted() {
    let mut r = router(1000.0);
    assert_eq!(
        r.apply_remote(PEER, &add(1, 42, &[1], 16), 0.0),
        RemoteOutcome::Dropped(DropReason::UnknownWorker)
    );
    assert_eq!(r.sequences().active_requests(), 0);
    assert_eq!(r.remote().counters().drops.unknown_worker, 1);
    assert_eq!(r.remote().key_of(PEER, RequestId(1)), None);
}

#[test]
fn a_booking_with_more_blocks_than_the_bound_keeps_its_leading_blocks() {
    let mut r = router(1000.0);
    let huge = add_with(1, 0, MAX_REMOTE_BLOCKS + 5, u32::MAX);
    assert!(r
        .apply_remote(PEER, &SequenceEvent::Add(huge), 0.0)
        .applied());
    let load = r.sequences().registry().load(WorkerId::new(0)).unwrap();
    // Its blocks, plus the partial block the clamped prompt length implies.
    assert!(
        load.decode_blocks <= MAX_REMOTE_BLOCKS + 1,
        "{}",
        load.decode_blocks
    );
    assert_eq!(
        load.active_prefill_tokens(0.0),
        u64::from(MAX_REMOTE_PROMPT_TOKENS)
    );
    assert_eq!(r.remote().counters().clamped, 1);
}

#[test]
fn a_batch_event_naming_another_origin_cannot_book_or_free_for_it() {
    let mut r = router(1000.0);
    let other = ReplicaId(8);
    r.apply_remote(PEER, &add(1, 0, &[1], 16), 0.0);
    // `other` sends a batch whose events claim to be PEER's.
    assert_eq!(
        r.apply_remote_from(other, PEER, &SequenceEvent::Free(RequestId(1)), 1.0),
        RemoteOutcome::Dropped(DropReason::OriginMismatch)
    );
    assert_eq!(
        r.apply_remote_from(other, PEER, &add(2, 0, &[1], 16), 1.0),
        RemoteOutcome::Dropped(DropReason::OriginMismatch)
    );
    assert_eq!(r.sequences().active_requests(), 1);
    assert_eq!(r.remote().counters().drops.origin_mismatch, 2);
    // A batch claiming this replica's own id changes nothing either.
    assert_eq!(
        r.apply_remote_from(ME, ME, &add(3, 0, &[1], 16), 1.0),
        RemoteOutcome::Own
    );
    assert_eq!(r.sequences().active_requests(), 1);
}

#[test]
fn two_origins_booking_the_same_request_id_hold_two_bookings_each_freed_only_by_its_origin() {
    let mut r = router(1000.0);
    let other = ReplicaId(8);
    assert!(r.apply_remote(PEER, &add(1, 0, &[1], 16), 0.0).applied());
    assert!(r.apply_remote(other, &add(1, 1, &[2], 16), 0.0).applied());
    assert_eq!(r.sequences().active_requests(), 2);
    assert!(r
        .apply_remote(other, &SequenceEvent::Free(RequestId(1)), 1.0)
        .applied());
    assert_eq!(r.remote().remote_requests_on(WorkerId::new(0)), 1);
    assert_eq!(r.remote().remote_requests_on(WorkerId::new(1)), 0);
    // The second free from `other` finds nothing of its own.
    assert_eq!(
        r.apply_remote(other, &SequenceEvent::Free(RequestId(1)), 2.0),
        RemoteOutcome::NotOwner
    );
    assert_eq!(r.remote().counters().drops.unknown_booking, 1);
    assert!(r.remote().key_of(PEER, RequestId(1)).is_some());
}

#[test]
fn bookings_past_the_per_origin_cap_are_dropped_and_counted() {
    let mut r = Router::new(RouterConfig {
        remote: RemoteConfig {
            max_bookings_per_replica: 2,
            ..RemoteConfig::default()
        },
        ..RouterConfig::default()
    })
    .unwrap();
    r.set_replica_id(ME);
    r.add_worker(WorkerId::new(0), WorkerCapacity::default());
    for id in 1..=3 {
        r.apply_remote(PEER, &add(id, 0, &[1], 16), 0.0);
    }
    assert_eq!(r.remote().remote_requests(), 2);
    assert_eq!(r.remote().counters().drops.replica_full, 1);
    // Another origin has a cap of its own.
    assert!(r
        .apply_remote(ReplicaId(8), &add(1, 0, &[1], 16), 0.0)
        .applied());
}

#[test]
fn bookings_past_the_byte_caps_are_dropped_and_counted_and_frees_give_the_bytes_back() {
    let big = booking_bytes(100);
    let mut r = Router::new(RouterConfig {
        remote: RemoteConfig {
            silence_expiry_ms: 1_000.0,
            max_bytes_per_replica: 2 * big,
            max_total_bytes: 3 * big,
            ..RemoteConfig::default()
        },
        ..RouterConfig::default()
    })
    .unwrap();
    r.set_replica_id(ME);
    r.add_worker(WorkerId::new(0), WorkerCapacity::default());
    let blocks: Vec<u64> = (0..100).collect();
    let other = ReplicaId(8);
    // Two big bookings fill PEER's share; a third is refused.
    for id in 1..=3 {
        r.apply_remote(PEER, &add(id, 0, &blocks, 1600), 0.0);
    }
    assert_eq!(r.remote().remote_requests(), 2);
    assert_eq!(r.remote().counters().drops.bytes_full, 1);
    // Another origin fills what is left of the total, then is refused.
    for id in 1..=2 {
        r.apply_remote(other, &add(id, 0, &blocks, 1600), 0.0);
    }
    assert_eq!(r.remote().counters().drops.bytes_full, 2);
    assert_eq!(r.remote().held_bytes(), 3 * big);
    // A free gives its bytes back to both bounds.
    assert!(r
        .apply_remote(PEER, &SequenceEvent::Free(RequestId(1)), 1.0)
        .applied());
    assert_eq!(r.remote().held_bytes(), 2 * big);
    assert!(r
        .apply_remote(other, &add(2, 0, &blocks, 1600), 1.0)
        .applied());
    // Silent origins give back everything.
    r.expire_silent_replicas(10_000.0);
    assert_eq!(r.remote().remote_requests(), 0);
    assert_eq!(r.remote().held_bytes(), 0);
}

#[test]
fn a_byte_cap_below_one_booking_is_refused() {
    let config = RemoteConfig {
        max_total_bytes: BOOKING_BYTES - 1,
        ..RemoteConfig::default()
    };
    assert_eq!(
        config.validate(),
        Err(RemoteConfigError::PerReplica("max_total_bytes"))
    );
}

#[test]
fn a_digest_frees_the_senders_unlisted_bookings_in_its_range_past_the_grace() {
    let mut r = router(1e9);
    for id in 1..=4 {
        r.apply_remote(PEER, &add(id, 0, &[id as u64], 16), 0.0);
    }
    r.apply_remote(ReplicaId(8), &add(2, 1, &[1], 16), 0.0);
    // Request 4 arrived within the grace of the digest: kept.
    r.apply_remote(PEER, &add(5, 0, &[5], 16), 2_000.0);
    let now = 2_000.0 + DIGEST_GRACE_MS / 2.0;
    // The part covers 0..=4 and lists 1 and 3: 2 and 4 are stale.
    let freed = r.apply_remote_digest(
        PEER,
        RequestId(0),
        RequestId(4),
        &[RequestId(1), RequestId(3)],
        now,
    );
    assert_eq!(freed.len(), 2);
    assert!(r.remote().key_of(PEER, RequestId(2)).is_none());
    assert!(r.remote().key_of(PEER, RequestId(4)).is_none());
    assert!(r.remote().key_of(PEER, RequestId(1)).is_some());
    assert!(r.remote().key_of(PEER, RequestId(5)).is_some());
    // Another origin's booking of the same id is untouched.
    assert!(r.remote().key_of(ReplicaId(8), RequestId(2)).is_some());
    assert_eq!(r.remote().counters().digest_freed, 2);
    // An empty digest over every id frees 1 and 3; the young booking 5
    // survives the grace, then goes.
    let all = (RequestId(0), RequestId(u128::MAX));
    assert_eq!(r.apply_remote_digest(PEER, all.0, all.1, &[], now).len(), 2);
    assert!(r.remote().key_of(PEER, RequestId(5)).is_some());
    assert_eq!(
        r.apply_remote_digest(PEER, all.0, all.1, &[], 3_001.0)
            .len(),
        1
    );
    assert_eq!(r.remote().remote_requests(), 1);
    // A digest claiming this replica's id frees nothing.
    assert!(r.apply_remote_digest(ME, all.0, all.1, &[], 9e9).is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    /// Whatever numbers a peer's booking carries, the load it adds stays
    /// within the bounds, and freeing it leaves nothing behind.
    #[test]
    fn a_peers_numbers_are_clamped_to_the_stated_bounds(
        prompt_tokens in any::<u32>(),
        overlap_blocks in any::<u32>(),
        blocks in 0usize..40,
        expected in prop_oneof![Just(None), any::<f64>().prop_map(Some)],
        worker in 0u64..5,
    ) {
        let mut r = router(1e9);
        let mut a = add_with(1, worker, blocks, prompt_tokens);
        a.overlap_blocks = overlap_blocks;
        a.expected_prefill_ms = expected;
        let outcome = r.apply_remote(PEER, &SequenceEvent::Add(a), 0.0);
        if worker >= 3 {
            prop_assert_eq!(outcome, RemoteOutcome::Dropped(DropReason::UnknownWorker));
            prop_assert_eq!(r.sequences().active_requests(), 0);
            return Ok(());
        }
        prop_assert!(outcome.applied());
        let load = r.sequences().registry().load(WorkerId::new(worker)).unwrap();
        prop_assert!(load.active_prefill_tokens(0.0) <= u64::from(MAX_REMOTE_PROMPT_TOKENS));
        prop_assert!(load.decode_blocks <= blocks + 1);
        // The modeled prefill is finite and at most the bound.
        let later = load.active_prefill_tokens(MAX_REMOTE_PREFILL_MS + 1.0);
        prop_assert!(later <= u64::from(MAX_REMOTE_PROMPT_TOKENS));
        prop_assert!(r.apply_remote(PEER, &SequenceEvent::Free(RequestId(1)), 1.0).applied());
        prop_assert_eq!(r.sequences().active_requests(), 0);
        prop_assert_eq!(r.remote().remote_requests(), 0);
    }

    /// Events from many origins over overlapping request ids: every
    /// origin's view is exactly its own stream, and no origin's free
    /// removes another's booking.
    #[test]
    fn origins_never_touch_each_others_bookings(
        ops in proptest::collection::vec((0u64..3, 0u128..6, any::<bool>()), 1..80)
    ) {
        let mut r = router(1e9);
        let mut truth: std::collections::BTreeSet<(u64, u128)> = Default::default();
        for (step, (origin, id, is_add)) in ops.into_iter().enumerate() {
            let origin_id = ReplicaId(100 + origin);
            let event = if is_add {
                add(id, origin % 3, &[id as u64], 16)
            } else {
                SequenceEvent::Free(RequestId(id))
            };
            // A forger sends the same event in origin's name: nothing.
            let forged = r.apply_remote_from(ReplicaId(99), origin_id, &event, step as f64);
            prop_assert_eq!(forged, RemoteOutcome::Dropped(DropReason::OriginMismatch));
            r.apply_remote(origin_id, &event, step as f64);
            if is_add { truth.insert((origin, id)); } else { truth.remove(&(origin, id)); }
            prop_assert_eq!(r.remote().remote_requests(), truth.len());
            for o in 0..3u64 {
                for i in 0..6u128 {
                    let held = r.remote().key_of(ReplicaId(100 + o), RequestId(i)).is_some();
                    prop_assert_eq!(held, truth.contains(&(o, i)));
                }
            }
        }
    }
}
