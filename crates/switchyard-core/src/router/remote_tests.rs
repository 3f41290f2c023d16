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
    assert_eq!(r.remote().owner(RequestId(1)), Some(PEER));
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
fn any_origin_may_mark_prefill_completed_as_a_worker_does() {
    let mut r = router(1000.0);
    r.apply_remote(PEER, &add(1, 0, &[1], 16), 0.0);
    let worker_origin = ReplicaId(99);
    assert!(r
        .apply_remote(
            worker_origin,
            &SequenceEvent::MarkPrefillCompleted(RequestId(1)),
            1.0
        )
        .applied());
    let load = r.sequences().registry().load(WorkerId::new(0)).unwrap();
    assert_eq!(load.active_prefill_tokens(1.0), 0);
}

#[test]
fn bookings_of_a_silent_peer_expire_and_a_chatty_peers_do_not() {
    let mut r = router(100.0);
    r.apply_remote(PEER, &add(1, 0, &[1], 16), 0.0);
    r.apply_remote(ReplicaId(8), &add(2, 1, &[1], 16), 0.0);
    // Peer 8 keeps talking (a heartbeat); PEER goes quiet.
    assert!(r.replica_heartbeat(ReplicaId(8), 90.0));
    assert!(r.expire_silent_replicas(99.0).is_empty());
    assert_eq!(r.expire_silent_replicas(150.0), vec![RequestId(1)]);
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
    r.replica_heartbeat(ReplicaId(20), 30.0);
    assert_eq!(r.remote().replicas(), 4);
    assert_eq!(r.remote().owner(RequestId(10)), None);
    assert_eq!(r.sequences().owner(RequestId(10)), None);
    assert_eq!(r.remote().counters().evicted_replicas, 1);
}

#[test]
fn per_request_expiry_of_a_remote_booking_forgets_its_owner() {
    let mut r = router(1e9);
    r.apply_remote(PEER, &add(1, 0, &[1], 16), 0.0);
    let expiry = r.config().sequences.expiry_ms;
    assert_eq!(r.expire(expiry + 1.0), vec![RequestId(1)]);
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
