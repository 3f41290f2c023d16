use super::*;
use crate::index::StoredBlock;
use crate::select::ModelSettings;
use crate::types::{EngineHash, LocalHash};

fn w(id: u64) -> WorkerId {
    WorkerId::new(id)
}

fn router(config: RouterConfig) -> Router {
    let mut r = Router::new(config).unwrap();
    for id in 1..=3 {
        r.add_worker(
            w(id),
            WorkerCapacity {
                max_num_batched_tokens: Some(1000),
                kv_blocks: Some(100),
                kv_tokens: None,
                block_size: None,
            },
        );
    }
    r
}

fn prompt(blocks: &[LocalHash]) -> RoutingRequest<'_> {
    RoutingRequest {
        prompt_tokens: blocks.len() as u32 * 16,
        blocks,
        adapter: None,
        model: Default::default(),
        headroom: 0.0,
    }
}

fn selected(outcome: SelectOutcome) -> Decision {
    match outcome {
        SelectOutcome::Selected(d) => d,
        other => panic!("expected a selection, got {other:?}"),
    }
}

#[test]
fn kv_capacity_is_counted_in_the_blocks_bookings_are_counted_in() {
    // vLLM's CPU build at 32 tokens a block behind a router at 16: 100
    // engine blocks hold 200 of the router's.
    let engine = WorkerCapacity {
        max_num_batched_tokens: None,
        kv_blocks: Some(100),
        kv_tokens: Some(3200),
        block_size: None,
    };
    assert_eq!(engine.kv_blocks_of(16), Some(200));
    assert_eq!(engine.kv_tokens_or(16), Some(3200));
    // Without a token count, the blocks are taken as reported.
    let blocks_only = WorkerCapacity {
        kv_tokens: None,
        ..engine
    };
    assert_eq!(blocks_only.kv_blocks_of(16), Some(100));
    assert_eq!(blocks_only.kv_tokens_or(16), Some(1600));
    assert_eq!(WorkerCapacity::default().kv_tokens_or(16), None);
}

#[test]
fn a_models_block_size_prices_its_cached_blocks_and_counts_its_bookings() {
    // Worker 4 serves a model whose engine holds 32 tokens a block.
    let mut r = router(RouterConfig::default());
    r.add_worker(
        w(4),
        WorkerCapacity {
            block_size: Some(32),
            ..WorkerCapacity::default()
        },
    );
    assert_eq!((r.block_size_of(w(4)), r.block_size_of(w(1))), (32, 16));
    r.apply_kv_event(w(4), CacheTier::Device, &chain(None, &[(41, 1), (42, 2)]));
    let blocks: Vec<LocalHash> = (1..=3).map(LocalHash).collect();
    let request = RoutingRequest {
        prompt_tokens: 100,
        blocks: &blocks,
        adapter: None,
        model: ModelSettings {
            block_size: Some(32),
            policy: None,
        },
        headroom: 0.0,
    };
    let d = selected(r.route(request, Some(&[w(4)]), 0.0));
    assert_eq!((d.worker, d.overlap_blocks), (w(4), 2));
    r.book(RequestId(1), request, d, None, 0.0);
    // Two cached blocks of 32 tokens: 100 − 64 left to prefill (at the
    // router's 16 it would have been 100 − 32).
    let load = r.sequences().registry().load(w(4)).unwrap();
    assert_eq!(load.active_prefill_tokens(0.0), 36);
}

#[test]
fn a_model_may_route_with_its_own_policy() {
    // The router's policy is kv (cache first); the model's is round
    // robin, which ignores the cache.
    let mut r = router(RouterConfig {
        policy: PolicyKind::Kv,
        ..Default::default()
    });
    let blocks: Vec<LocalHash> = (1..=4).map(LocalHash).collect();
    r.apply_kv_event(
        w(2),
        CacheTier::Device,
        &chain(None, &[(21, 1), (22, 2), (23, 3), (24, 4)]),
    );
    let mut own = prompt(&blocks);
    own.model.policy = Some(PolicyKind::RoundRobin);
    let picks: Vec<WorkerId> = (0..3)
        .map(|_| selected(r.route(own, None, 0.0)).worker)
        .collect();
    let mut distinct = picks.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        3,
        "round robin visits every worker: {picks:?}"
    );
    // The router's own policy still goes where the cache is.
    for _ in 0..3 {
        assert_eq!(selected(r.route(prompt(&blocks), None, 0.0)).worker, w(2));
    }
    // A removed worker leaves the model's selector too.
    r.remove_worker(w(3));
    for _ in 0..4 {
        assert_ne!(selected(r.route(own, None, 0.0)).worker, w(3));
    }
}

#[test]
fn a_published_index_routes_by_its_writers_events_and_counts_both_copies() {
    let mut r = router(RouterConfig::default());
    let blocks: Vec<LocalHash> = (1..=8).map(LocalHash).collect();
    let event = IndexEvent::Stored {
        parent: None,
        blocks: blocks
            .iter()
            .map(|&l| StoredBlock {
                engine_hash: EngineHash(l.0 + 100),
                local_hash: l,
            })
            .collect(),
    };
    r.apply_kv_event(w(1), CacheTier::Device, &event);
    let mut writer = r.publish_index().expect("an exact index");
    assert!(r.publish_index().is_none(), "published once");
    // What was there before is still read; events now go through the writer.
    assert_eq!(selected(r.route(prompt(&blocks), None, 0.0)).worker, w(1));
    assert_eq!(r.apply_kv_event(w(3), CacheTier::Device, &event), None);
    writer.remove_worker(w(1));
    writer.apply(w(3), CacheTier::Device, &event);
    let d = selected(r.route(prompt(&blocks), None, 0.0));
    assert_eq!((d.worker, d.overlap_blocks), (w(3), 8));
    // Both copies of every tier (the host and checkpoint tiers are
    // `host_index` together).
    let memory = r.memory();
    assert_eq!(
        r.estimated_bytes() - r.sequences().registry().estimated_bytes(),
        2 * (memory.index.total() + memory.host_index.total())
    );
    assert_eq!(
        memory.index.total(),
        r.with_index(PrefixIndex::estimated_bytes)
    );
}

use crate::index::stored_chain as chain;

fn candidate_of(r: &Router, worker: WorkerId) -> Candidate {
    *r.scratch
        .candidates
        .iter()
        .find(|c| c.worker == worker)
        .expect("a candidate")
}

#[test]
fn a_hybrid_worker_is_credited_only_up_to_its_deepest_ssm_checkpoint() {
    let mut r = router(RouterConfig::default());
    let blocks: Vec<LocalHash> = (1..=8).map(LocalHash).collect();
    let whole = |base: u64| (1..=8).map(|l| (base + l, l)).collect::<Vec<_>>();
    // w1 (hybrid): the whole prompt's attention blocks, SSM states kept
    // at blocks 3 and 8 — then the one at 8 evicted.
    r.apply_kv_event(w(1), CacheTier::Device, &chain(None, &whole(10)));
    r.apply_kv_event(w(1), CacheTier::Checkpoint, &chain(Some(12), &[(13, 3)]));
    r.apply_kv_event(w(1), CacheTier::Checkpoint, &chain(Some(17), &[(18, 8)]));
    r.apply_kv_event(
        w(1),
        CacheTier::Checkpoint,
        &IndexEvent::Removed {
            blocks: vec![EngineHash(18)],
        },
    );
    // w2 (hybrid): the whole prompt, no checkpoint left at all.
    r.apply_kv_event(w(2), CacheTier::Device, &chain(None, &whole(20)));
    r.apply_kv_event(w(2), CacheTier::Checkpoint, &chain(Some(21), &[(22, 2)]));
    r.apply_kv_event(w(2), CacheTier::Device, &IndexEvent::Cleared);
    r.apply_kv_event(w(2), CacheTier::Device, &chain(None, &whole(20)));
    // w3 (attention only): five blocks, credited as they are.
    r.apply_kv_event(w(3), CacheTier::Device, &chain(None, &whole(30)[..5]));
    r.route(prompt(&blocks), None, 0.0);
    assert_eq!(candidate_of(&r, w(1)).overlap_blocks, 3);
    assert_eq!(candidate_of(&r, w(2)).overlap_blocks, 0);
    assert_eq!(candidate_of(&r, w(3)).overlap_blocks, 5);
    // What each holds on its device, resumable or not.
    assert_eq!(candidate_of(&r, w(1)).held_prefix_blocks, 8);
    assert_eq!(candidate_of(&r, w(2)).held_prefix_blocks, 8);
    assert_eq!(candidate_of(&r, w(3)).held_prefix_blocks, 5);
}

#[test]
fn a_host_tier_run_right_after_the_device_prefix_is_the_candidates_host_overlap() {
    let mut r = router(RouterConfig::default());
    let blocks: Vec<LocalHash> = (1..=8).map(LocalHash).collect();
    // w1: blocks 1-2 on the device, 3-5 spilled to the host tier under
    // the device's block 2.
    r.apply_kv_event(w(1), CacheTier::Device, &chain(None, &[(11, 1), (12, 2)]));
    r.apply_kv_event(
        w(1),
        CacheTier::Host,
        &chain(Some(12), &[(13, 3), (14, 4), (15, 5)]),
    );
    // w2: block 1 on the device; blocks 3-4 in the host tier but not
    // block 2: the gap stops the run before it starts.
    r.apply_kv_event(w(2), CacheTier::Device, &chain(None, &[(21, 1)]));
    r.apply_kv_event(w(2), CacheTier::Host, &chain(None, &[(22, 9)]));
    r.apply_kv_event(
        w(2),
        CacheTier::Host,
        &chain(None, &[(31, 1), (32, 2), (33, 3), (34, 4)]),
    );
    r.apply_kv_event(
        w(2),
        CacheTier::Host,
        &IndexEvent::Removed {
            blocks: vec![EngineHash(32)],
        },
    );
    // w3: the whole prompt on the device, nothing in a host tier.
    r.apply_kv_event(
        w(3),
        CacheTier::Device,
        &chain(None, &(1..=8).map(|l| (40 + l, l)).collect::<Vec<_>>()),
    );
    r.route(prompt(&blocks), None, 0.0);
    let (c1, c2, c3) = (
        candidate_of(&r, w(1)),
        candidate_of(&r, w(2)),
        candidate_of(&r, w(3)),
    );
    assert_eq!((c1.overlap_blocks, c1.host_overlap_blocks), (2, 3));
    assert_eq!((c2.overlap_blocks, c2.host_overlap_blocks), (1, 0));
    assert_eq!((c3.overlap_blocks, c3.host_overlap_blocks), (8, 0));
    // Host blocks from the root count only past the device prefix: w2's
    // host copy of block 1 is no credit.
    r.apply_kv_event(w(2), CacheTier::Host, &chain(Some(31), &[(32, 2)]));
    r.route(prompt(&blocks), None, 0.0);
    assert_eq!(candidate_of(&r, w(2)).host_overlap_blocks, 3);
}

#[test]
fn the_ttft_policy_prefers_a_cheap_restore_to_a_recompute() {
    let mut r = router(RouterConfig {
        policy: PolicyKind::Ttft,
        ..Default::default()
    });
    let blocks: Vec<LocalHash> = (1..=8).map(LocalHash).collect();
    r.apply_kv_event(
        w(1),
        CacheTier::Device,
        &chain(None, &[(11, 1), (12, 2), (13, 3), (14, 4)]),
    );
    r.apply_kv_event(w(2), CacheTier::Device, &chain(None, &[(21, 1)]));
    r.apply_kv_event(
        w(2),
        CacheTier::Host,
        &chain(Some(21), &(2..=8).map(|l| (20 + l, l)).collect::<Vec<_>>()),
    );
    let d = selected(r.route(prompt(&blocks), None, 0.0));
    // The booking records the device overlap only.
    assert_eq!((d.worker, d.overlap_blocks), (w(2), 1));
    // Other policies weigh the device overlap alone.
    let mut kv = router(RouterConfig {
        policy: PolicyKind::Kv,
        ..Default::default()
    });
    for (worker, tier, event) in [
        (
            w(1),
            CacheTier::Device,
            chain(None, &[(11, 1), (12, 2), (13, 3), (14, 4)]),
        ),
        (w(2), CacheTier::Device, chain(None, &[(21, 1)])),
        (
            w(2),
            CacheTier::Host,
            chain(Some(21), &(2..=8).map(|l| (20 + l, l)).collect::<Vec<_>>()),
        ),
    ] {
        kv.apply_kv_event(worker, tier, &event);
    }
    assert_eq!(selected(kv.route(prompt(&blocks), None, 0.0)).worker, w(1));
}

#[test]
fn a_removed_worker_leaves_both_tiers_and_host_bytes_are_counted() {
    let mut r = router(RouterConfig::default());
    let before = r.estimated_bytes();
    r.apply_kv_event(w(1), CacheTier::Device, &chain(None, &[(11, 1)]));
    r.apply_kv_event(w(1), CacheTier::Host, &chain(Some(11), &[(12, 2)]));
    assert!(r.with_host_index(|h| h.live_pairs()) == 1);
    assert!(r.memory().host_index.total() > 0);
    assert!(r.estimated_bytes() > before);
    r.remove_worker(w(1));
    assert!(!r.with_index(|d| d.knows(w(1))));
    assert!(!r.with_host_index(|h| h.knows(w(1))));
    assert_eq!(r.with_host_index(|h| h.live_nodes()), 0);
}

#[test]
fn a_published_index_applies_host_events_through_its_writer() {
    let mut r = router(RouterConfig::default());
    let blocks: Vec<LocalHash> = (1..=4).map(LocalHash).collect();
    let mut writer = r.publish_index().expect("an exact index");
    writer.apply(w(1), CacheTier::Device, &chain(None, &[(11, 1)]));
    writer.apply(w(1), CacheTier::Host, &chain(Some(11), &[(12, 2), (13, 3)]));
    r.route(prompt(&blocks), None, 0.0);
    let c = candidate_of(&r, w(1));
    assert_eq!((c.overlap_blocks, c.host_overlap_blocks), (1, 2));
    writer.apply(w(1), CacheTier::Device, &IndexEvent::Cleared);
    r.route(prompt(&blocks), None, 0.0);
    let c = candidate_of(&r, w(1));
    assert_eq!((c.overlap_blocks, c.host_overlap_blocks), (0, 0));
}

#[test]
fn kv_events_steer_requests_to_the_worker_with_the_prefix() {
    let mut r = router(RouterConfig::default());
    let blocks: Vec<LocalHash> = (1..=8).map(LocalHash).collect();
    let stored: Vec<StoredBlock> = blocks
        .iter()
        .map(|&l| StoredBlock {
            engine_hash: EngineHash(l.0 + 100),
            local_hash: l,
        })
        .collect();
    r.apply_kv_event(
        w(2),
        CacheTier::Device,
        &IndexEvent::Stored {
            parent: None,
            blocks: stored,
        },
    );
    let d = selected(r.route(prompt(&blocks), None, 0.0));
    assert_eq!(
        d,
        Decision {
            worker: w(2),
            overlap_blocks: 8,
            peer: None,
        }
    );
    // Only the eligible workers are considered.
    let d = selected(r.route(prompt(&blocks), Some(&[w(1), w(3)]), 0.0));
    assert_ne!(d.worker, w(2));
}

#[test]
fn booking_adds_load_that_steers_the_next_request_away() {
    let mut r = router(RouterConfig::default());
    let a: Vec<LocalHash> = (1..=8).map(LocalHash).collect();
    let first = selected(r.route(prompt(&a), None, 0.0));
    r.book(RequestId(1), prompt(&a), first, None, 0.0);
    let b: Vec<LocalHash> = (20..28).map(LocalHash).collect();
    let second = selected(r.route(prompt(&b), None, 0.0));
    assert_ne!(second.worker, first.worker);
    assert_eq!(r.free(RequestId(1), 1.0), LifecycleOutcome::Applied);
    assert_eq!(r.sequences().active_requests(), 0);
}

#[test]
fn recent_writes_count_a_bookings_uncached_tokens_and_fade_by_e_a_minute() {
    let mut writes = RecentWrites::default();
    writes.add(1000.0, 0.0);
    assert_eq!(writes.at(0.0), 1000.0);
    let faded = writes.at(WRITES_TIME_CONSTANT_MS);
    assert!(
        (faded - 1000.0 / std::f64::consts::E).abs() < 1e-9,
        "{faded}"
    );
    writes.add(500.0, WRITES_TIME_CONSTANT_MS);
    assert!((writes.at(WRITES_TIME_CONSTANT_MS) - (faded + 500.0)).abs() < 1e-9);
    // A clock that steps back never inflates the count.
    assert!(writes.at(0.0) <= faded + 500.0 + 1e-9);

    // Through the router: only the uncached part of a booking counts.
    let mut r = router(RouterConfig::default());
    let blocks: Vec<LocalHash> = (1..=8).map(LocalHash).collect();
    let decision = Decision {
        worker: w(1),
        overlap_blocks: 3,
        peer: None,
    };
    r.book(RequestId(1), prompt(&blocks), decision, None, 0.0);
    let writes_of = |r: &Router, id| r.worker(id).map(|s| s.writes.at(0.0));
    assert_eq!(writes_of(&r, w(1)), Some((8 - 3) as f64 * 16.0));
    assert_eq!(writes_of(&r, w(2)), Some(0.0));
    let known = r.workers.iter().flatten().count();
    r.remove_worker(w(1));
    assert!(r.worker(w(1)).is_none(), "a removed worker is forgotten");
    assert_eq!(
        r.workers.iter().flatten().count(),
        known - 1,
        "and its slot is emptied"
    );
}

#[test]
fn busy_workers_are_skipped_and_all_busy_waits() {
    let mut r = router(RouterConfig {
        busy_threshold: Some(0.5),
        policy: PolicyKind::RoundRobin,
        ..Default::default()
    });
    let big: Vec<LocalHash> = (1..=40).map(LocalHash).collect(); // 640 tokens > 500
    for id in 1..=3 {
        let d = selected(r.route(prompt(&big), None, 0.0));
        assert_eq!(d.worker, w(id));
        r.book(RequestId(id.into()), prompt(&big), d, None, 0.0);
    }
    assert_eq!(r.route(prompt(&big), None, 0.0), SelectOutcome::AllBusy);
    r.mark_prefill_completed(RequestId(2), 1.0);
    assert_eq!(selected(r.route(prompt(&big), None, 1.0)).worker, w(2));
}

#[test]
fn a_removed_worker_is_never_selected_and_its_bookings_are_freed() {
    let mut r = router(RouterConfig {
        policy: PolicyKind::RoundRobin,
        ..Default::default()
    });
    let a: Vec<LocalHash> = (1..=2).map(LocalHash).collect();
    r.book(
        RequestId(7),
        prompt(&a),
        Decision {
            worker: w(2),
            overlap_blocks: 0,
            peer: None,
        },
        None,
        0.0,
    );
    assert_eq!(r.remove_worker(w(2)), vec![RequestId(7)]);
    for _ in 0..10 {
        assert_ne!(selected(r.route(prompt(&a), None, 0.0)).worker, w(2));
    }
    assert_eq!(r.free(RequestId(7), 0.0), LifecycleOutcome::UnknownRequest);
}

#[test]
fn an_unselectable_worker_keeps_its_cache_but_is_never_chosen_until_selectable_again() {
    let mut r = router(RouterConfig::default());
    let blocks: Vec<LocalHash> = (1..=4).map(LocalHash).collect();
    let stored: Vec<StoredBlock> = blocks
        .iter()
        .map(|&l| StoredBlock {
            engine_hash: EngineHash(l.0),
            local_hash: l,
        })
        .collect();
    r.apply_kv_event(
        w(2),
        CacheTier::Device,
        &IndexEvent::Stored {
            parent: None,
            blocks: stored,
        },
    );
    r.set_selectable(w(2), false);
    assert!(!r.is_selectable(w(2)));
    for _ in 0..10 {
        assert_ne!(selected(r.route(prompt(&blocks), None, 0.0)).worker, w(2));
    }
    assert_eq!(
        r.route(prompt(&blocks), Some(&[w(2)]), 0.0),
        SelectOutcome::NoWorkers
    );
    r.set_selectable(w(2), true);
    assert_eq!(
        selected(r.route(prompt(&blocks), None, 0.0)),
        Decision {
            worker: w(2),
            overlap_blocks: 4,
            peer: None,
        }
    );
    // Unknown workers are not remembered.
    r.set_selectable(w(9), false);
    assert!(!r.is_selectable(w(9)));
    r.add_worker(w(9), WorkerCapacity::default());
    assert!(r.is_selectable(w(9)));
}

#[test]
fn a_worker_added_in_a_removed_workers_slot_inherits_nothing_from_it() {
    let mut r = router(RouterConfig::default());
    let blocks: Vec<LocalHash> = (1..=8).map(LocalHash).collect();
    let to_2 = Decision {
        worker: w(2),
        overlap_blocks: 0,
        peer: None,
    };
    r.book(RequestId(1), prompt(&blocks), to_2, None, 0.0);
    r.set_selectable(w(2), false);
    let slot = r.sequences().slot_of(w(2));
    r.remove_worker(w(2));
    r.add_worker(
        w(7),
        WorkerCapacity {
            block_size: Some(32),
            ..WorkerCapacity::default()
        },
    );
    assert_eq!(r.sequences().slot_of(w(7)), slot, "the slot is reused");
    assert!(r.is_selectable(w(7)));
    assert!(!r.is_selectable(w(2)));
    assert_eq!(r.block_size_of(w(7)), 32);
    assert_eq!(r.worker(w(7)).map(|s| s.writes.at(0.0)), Some(0.0));
    // Its capacity, not the removed worker's, decides when it is busy:
    // none is known, so it is never busy and takes the request.
    assert_eq!(
        selected(r.route(prompt(&blocks), Some(&[w(7)]), 0.0)).worker,
        w(7)
    );
}

#[test]
fn without_events_the_router_predicts_from_its_own_decisions() {
    let mut r = router(RouterConfig {
        cache: CacheTracking::Approximate(ApproxConfig::default()),
        ..Default::default()
    });
    let a: Vec<LocalHash> = (1..=8).map(LocalHash).collect();
    let first = selected(r.route(prompt(&a), None, 0.0));
    assert_eq!(first.overlap_blocks, 0);
    r.book(RequestId(1), prompt(&a), first, None, 0.0);
    r.free(RequestId(1), 10.0);
    let again = selected(r.route(prompt(&a), None, 20.0));
    assert_eq!(
        again,
        Decision {
            worker: first.worker,
            overlap_blocks: 8,
            peer: None,
        }
    );
    assert!(r
        .apply_kv_event(w(1), CacheTier::Device, &IndexEvent::Cleared)
        .is_none());
    // Past the TTL the prediction is gone.
    let later = selected(r.route(prompt(&a), None, 200_000.0));
    assert_eq!(later.overlap_blocks, 0);
}

#[test]
fn memory_accounts_for_bookings_and_sums_its_parts() {
    let mut r = router(RouterConfig::default());
    let empty = r.memory();
    let blocks: Vec<LocalHash> = (1..=64).map(LocalHash).collect();
    for id in 0..100u128 {
        let d = selected(r.route(prompt(&blocks), None, 0.0));
        r.book(RequestId(id), prompt(&blocks), d, Some(5.0), 0.0);
    }
    let busy = r.memory();
    assert!(busy.sequences.requests >= 100 * 64 * 8, "{busy:?}");
    assert!(busy.sequences.expiry_queue > empty.sequences.expiry_queue);
    assert!(busy.sequences.prefill > 0 && busy.sequences.registry > 0);
    assert_eq!(
        busy.total(),
        busy.index.total()
            + busy.host_index.total()
            + busy.approx_extra
            + busy.sequences.total()
            + busy.remote
            + busy.other
    );
    for id in 0..100u128 {
        r.free(RequestId(id), 1.0);
    }
    // Freed bookings give their block lists back.
    assert!(r.memory().sequences.requests < busy.sequences.requests);
}

#[test]
fn bad_settings_are_refused() {
    let bad = RouterConfig {
        busy_threshold: Some(0.0),
        ..Default::default()
    };
    assert_eq!(
        Router::new(bad).unwrap_err(),
        RouterConfigError::BusyThreshold(0.0)
    );
}
