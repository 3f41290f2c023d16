//! Responses chains in the simulator: a chain's later turns go where its
//! previous response is stored, through the core's response affinity.

use super::*;
use crate::workload::{PromptSpec, Turn};
use switchyard_core::select::PolicyKind;

/// `sessions` chats of `turns` turns each, every turn's prompt the whole
/// conversation so far (its earlier turns' prompts and a new 64 tokens).
fn chats(sessions: u64, turns: usize) -> Vec<Session> {
    (0..sessions)
        .map(|id| {
            let base = id as u32 * 100_000;
            Session {
                id,
                arrival_ms: id as f64 * 50.0,
                think_time_ms: 100.0,
                turns: (0..turns)
                    .map(|t| Turn {
                        prompt: PromptSpec::Tokens(
                            (0..(t as u32 + 1) * 256)
                                .map(|k| base + k)
                                .collect::<Vec<_>>()
                                .into(),
                        ),
                        output_tokens: 8,
                        pause_ms: None,
                        spawn: Vec::new(),
                    })
                    .collect(),
                flow: crate::workload::SessionFlow::default(),
            }
        })
        .collect()
}

fn run(config: &FleetConfig, list: Vec<Session>) -> PolicyReport {
    simulate(config, Box::new(list.into_iter().map(Ok)), |_| {})
        .unwrap()
        .report
}

fn fleet(policy: PolicyKind, chain: bool) -> FleetConfig {
    let mut config = FleetConfig {
        workers: 4,
        responses_chain: chain,
        ..FleetConfig::default()
    };
    config.engine.timing.speedup = 1.0;
    config.router.policy = policy;
    config
}

#[test]
fn a_chains_turns_stay_where_their_responses_are_even_under_round_robin() {
    // Round-robin scatters a session's turns: each later turn recomputes
    // its conversation elsewhere. As a chain, every later turn goes to the
    // worker holding the previous response, and finds its prefix there.
    let scattered = run(&fleet(PolicyKind::RoundRobin, false), chats(20, 4));
    let chained = run(&fleet(PolicyKind::RoundRobin, true), chats(20, 4));
    assert_eq!((scattered.completed, chained.completed), (80, 80));
    assert_eq!(chained.responses_unknown, 0);
    // Of each session's 256 + 512 + 768 + 1024 tokens, the later turns'
    // earlier blocks (256 + 512 + 768) are cached when they stay.
    let stays = (256.0 + 512.0 + 768.0) / (256.0 + 512.0 + 768.0 + 1024.0);
    assert!(
        (chained.hit_rate - stays).abs() < 0.02,
        "{} against {stays}",
        chained.hit_rate
    );
    assert!(
        scattered.hit_rate < chained.hit_rate / 2.0,
        "{}",
        scattered.hit_rate
    );
}

#[test]
fn a_chain_whose_worker_failed_ends_at_its_next_turn() {
    // Every worker but 0 fails early and comes back empty: sessions
    // answered there lost their stored responses, and their next turn
    // ends in an error; none continues on the restarted or another worker.
    let mut config = fleet(PolicyKind::RoundRobin, true);
    config.failures = (1..4)
        .map(|w| WorkerFailure {
            at_ms: 120.0,
            worker: w,
            down_ms: Some(50.0),
        })
        .collect();
    let r = run(&config, chats(8, 3));
    assert!(r.responses_unknown > 0, "{r:?}");
    assert!(r.errors >= r.responses_unknown, "{r:?}");
    // A session ends at its first error: its later turns never come.
    assert!(r.completed + r.errors < 8 * 3, "{r:?}");
    // Without the failures every turn completes.
    config.failures.clear();
    let calm = run(&config, chats(8, 3));
    assert_eq!(
        (calm.completed, calm.errors, calm.responses_unknown),
        (24, 0, 0)
    );
}

#[test]
fn a_chain_crosses_replicas_when_they_sync_and_breaks_when_they_do_not() {
    // Two replicas behind a round-robin balancer: a session's turns
    // alternate between them. Synced, each knows every stored response;
    // unsynced, a turn reaching the replica that did not route the
    // previous one finds its response unknown, and the session ends.
    let mut config = fleet(PolicyKind::RoundRobin, true);
    config.replicas.count = 2;
    let synced = run(&config, chats(6, 3));
    assert_eq!((synced.completed, synced.responses_unknown), (18, 0));
    config.replicas.sync = false;
    let apart = run(&config, chats(6, 3));
    assert!(apart.responses_unknown > 0, "{apart:?}");
    assert_eq!(apart.errors, apart.responses_unknown, "{apart:?}");
    assert!(apart.completed < 18, "{apart:?}");
}
