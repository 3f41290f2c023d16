//! Several router replicas in front of one fleet: their views, their sync,
//! and what no sync costs.

use super::*;
use crate::replicas::{Balance, ReplicasConfig};
use crate::workload::{synthetic, PromptSpec, SyntheticConfig, Turn};
use switchyard_core::admission::SessionAwareConfig;
use switchyard_core::select::PolicyKind;

fn config(replicas: usize, sync: bool, sync_delay_ms: f64) -> FleetConfig {
    let mut config = FleetConfig {
        workers: 4,
        replicas: ReplicasConfig {
            count: replicas,
            sync,
            sync_delay_ms,
            balance: Balance::RoundRobin,
        },
        ..FleetConfig::default()
    };
    config.engine.timing.speedup = 4.0;
    config.router.policy = PolicyKind::Kv;
    config
}

fn workload() -> SessionStream {
    synthetic(SyntheticConfig {
        sessions: 60,
        sessions_per_sec: 20.0,
        think_time_ms: 50.0,
        ..Default::default()
    })
}

/// Per worker: requests, decode blocks, prefill tokens, active prompt blocks.
type Loads = Vec<(WorkerId, usize, usize, u64, usize)>;

/// Everything a replica's selector reads from shared state: per-worker
/// requests, decode blocks, prefill tokens now and active prompt blocks;
/// the index's live pairs.
fn view(router: &switchyard_core::Router, now_ms: f64) -> (Loads, usize) {
    let sequences = router.sequences();
    let loads = sequences
        .registry()
        .loads()
        .map(|l| {
            (
                l.worker,
                l.requests,
                l.decode_blocks,
                l.active_prefill_tokens(now_ms),
                sequences.active_blocks(l.worker),
            )
        })
        .collect();
    (loads, router.with_index(|index| index.live_pairs()))
}

fn run(
    config: &FleetConfig,
    workload: SessionStream,
    check: impl FnMut(&Simulation),
) -> SimOutcome {
    Simulation::new(config, workload)
        .unwrap()
        .run(&mut |_| {}, check)
        .unwrap()
}

#[test]
fn with_sync_at_delay_zero_every_replica_sees_the_same_state_after_every_event() {
    let mut events = 0u64;
    let mut busy_views = 0u64;
    let out = run(&config(3, true, 0.0), workload(), |fleet| {
        events += 1;
        let first = view(fleet.replicas[0].dispatcher.router(), fleet.now);
        for r in &fleet.replicas[1..] {
            assert_eq!(
                view(r.dispatcher.router(), fleet.now),
                first,
                "at {} ms",
                fleet.now
            );
        }
        // And the shared view is the truth: every booking anywhere.
        let booked: u64 = fleet.workers.iter().map(|w| w.booked).sum();
        assert_eq!(
            fleet.replicas[0]
                .dispatcher
                .router()
                .sequences()
                .active_requests() as u64,
            booked
        );
        busy_views += u64::from(booked > 0);
    });
    assert!(
        events > 1000 && busy_views > 100,
        "{events} events, {busy_views} busy"
    );
    assert_eq!(out.replicas.view_error_requests, 0.0);
    assert!(out.replicas.routed_per_replica.iter().all(|&n| n > 50));
    assert_eq!(out.report.errors, 0);
}

#[test]
fn a_delayed_sync_frees_every_booking_everywhere_and_ignores_nothing() {
    let mut last_active = Vec::new();
    let out = run(&config(4, true, 7.0), workload(), |fleet| {
        last_active = fleet
            .replicas
            .iter()
            .map(|r| r.dispatcher.router().sequences().active_requests())
            .collect();
    });
    assert_eq!(last_active, vec![0; 4]);
    assert_eq!(out.replicas.remote_ignored, 0);
    // Each of 3 peers applies add, mark and free of every request.
    let requests: u64 = out.replicas.routed_per_replica.iter().sum();
    assert_eq!(out.replicas.remote_applied, requests * 3 * 3);
    assert!(out.replicas.view_error_requests > 0.0);
}

#[test]
fn without_sync_peers_learn_nothing_but_kv_events_still_reach_every_replica() {
    let mut pairs = Vec::new();
    let out = run(&config(2, false, 7.0), workload(), |fleet| {
        pairs = fleet
            .replicas
            .iter()
            .map(|r| r.dispatcher.router().with_index(|index| index.live_pairs()))
            .collect();
    });
    assert_eq!(out.replicas.remote_applied, 0);
    assert!(pairs[0] > 0);
    assert_eq!(pairs[0], pairs[1]);
}

/// Rounds of two equal requests 5 ms apart on two workers, each round
/// done before the next: a replica that sees the first booking sends the
/// second request to the other worker; without sync the two replicas
/// choose independently and often pick the same one.
fn pairs(rounds: u64) -> SessionStream {
    let sessions: Vec<Session> = (0..rounds * 2)
        .map(|i| Session {
            id: i,
            arrival_ms: (i / 2) as f64 * 2_000.0 + (i % 2) as f64 * 5.0,
            think_time_ms: 0.0,
            turns: vec![Turn {
                prompt: PromptSpec::Random {
                    seed: i,
                    tokens: 2048,
                },
                output_tokens: 64,
                pause_ms: None,
                spawn: Vec::new(),
            }],
            flow: crate::workload::SessionFlow::default(),
        })
        .collect();
    Box::new(sessions.into_iter().map(Ok))
}

#[test]
fn without_sync_load_balance_is_measurably_worse() {
    let fleet = |sync| {
        let mut c = config(2, sync, 1.0);
        c.workers = 2;
        c
    };
    let on = run(&fleet(true), pairs(40), |_| {});
    let off = run(&fleet(false), pairs(40), |_| {});
    // With sync every second request of a pair sees the first one's
    // booking and goes to the idle worker.
    assert_eq!(on.replicas.excess_requests, 0.0);
    assert!(
        off.replicas.excess_requests >= 0.1,
        "excess without sync: {}",
        off.replicas.excess_requests
    );
    // A collision batches two prefills on one worker: slower first tokens.
    assert!(
        off.report.ttft_ms.p90 > on.report.ttft_ms.p90,
        "TTFT p90 {} (off) vs {} (on)",
        off.report.ttft_ms.p90,
        on.report.ttft_ms.p90
    );
    assert_eq!((on.report.completed, off.report.completed), (80, 80));
}

#[test]
fn replicas_with_random_balance_are_deterministic_for_a_seed() {
    let run = || {
        let mut c = config(3, true, 7.0);
        c.replicas.balance = Balance::Random;
        c.router.seed = 9;
        serde_json::to_string(&simulate(&c, workload(), |_| {}).unwrap()).unwrap()
    };
    assert_eq!(run(), run());
}

#[test]
fn with_session_aware_admission_a_sessions_turns_stay_on_one_replica() {
    let mut c = config(3, true, 7.0);
    c.session_aware = Some(SessionAwareConfig::default());
    let mut sticky = true;
    let out = run(&c, workload(), |fleet| {
        for (id, f) in &fleet.in_flight {
            let session = (id.0 >> 32) as u64;
            if let Some(&r) = fleet.session_replica.get(&session) {
                sticky &= r == f.replica;
            }
        }
    });
    assert!(sticky);
    let expected: u64 = workload().map(|s| s.unwrap().turns.len() as u64).sum();
    assert_eq!(out.report.completed, expected);
}
