//! Data-parallel ranks in the fleet: rank-aware routing against a router
//! that sees one target per worker and leaves the rank to the worker's own
//! balancer.

use super::*;
use crate::workload::{PromptSpec, Turn};
use switchyard_core::select::PolicyKind;

fn fleet(workers: usize, dp: Option<DpConfig>) -> FleetConfig {
    let mut config = FleetConfig {
        workers,
        dp,
        ..FleetConfig::default()
    };
    config.engine.timing.speedup = 1.0;
    config.router.policy = PolicyKind::Kv;
    config
}

fn dp(size: usize, routing: DpRouting) -> Option<DpConfig> {
    Some(DpConfig { size, routing })
}

/// `groups` shared prefixes of `prefix` tokens, each asked `repeats` times
/// with its own tail, interleaved, one request every `gap_ms`.
fn shared_prefixes(groups: u32, repeats: u32, prefix: u32, gap_ms: f64) -> SessionStream {
    let list: Vec<Session> = (0..groups * repeats)
        .map(|i| {
            let group = i % groups;
            let mut prompt: Vec<u32> = (0..prefix).map(|t| group * 100_000 + t).collect();
            prompt.extend((0..64).map(|t| 10_000_000 + i * 64 + t));
            Session {
                id: u64::from(i),
                arrival_ms: f64::from(i) * gap_ms,
                think_time_ms: 0.0,
                turns: vec![Turn {
                    prompt: PromptSpec::Tokens(prompt.into()),
                    output_tokens: 8,
                    pause_ms: None,
                    spawn: Vec::new(),
                }],
                flow: crate::workload::SessionFlow::default(),
            }
        })
        .collect();
    Box::new(list.into_iter().map(Ok))
}

#[test]
fn rank_aware_routing_finds_a_prefix_on_its_rank_where_rank_blind_routing_loses_it() {
    let run = |routing| {
        simulate(
            &fleet(2, dp(4, routing)),
            shared_prefixes(16, 12, 2048, 40.0),
            |_| {},
        )
        .unwrap()
        .report
    };
    let aware = run(DpRouting::Aware);
    let blind = run(DpRouting::Blind);
    assert_eq!((aware.completed, blind.completed), (192, 192));
    assert!(
        aware.hit_rate > blind.hit_rate + 0.1,
        "aware {} against blind {}",
        aware.hit_rate,
        blind.hit_rate
    );
    assert_eq!(aware.dp_routing, Some("aware"));
    assert_eq!(blind.dp_routing, Some("blind"));
    let ranks = aware.dp.unwrap().requests_per_rank;
    assert_eq!(ranks.len(), 8);
    assert_eq!(ranks.iter().sum::<u64>(), 192);
}

#[test]
fn a_rank_blind_workers_balancer_spreads_a_burst_over_its_ranks() {
    // Eight requests at once on one worker of four ranks.
    let out = simulate(
        &fleet(1, dp(4, DpRouting::Blind)),
        shared_prefixes(8, 1, 256, 0.0),
        |_| {},
    )
    .unwrap()
    .report;
    assert_eq!(out.completed, 8);
    assert_eq!(out.dp.unwrap().requests_per_rank, vec![2, 2, 2, 2]);
}

#[test]
fn every_rank_is_a_target_of_its_own_with_rank_aware_routing() {
    let mut config = fleet(1, dp(4, DpRouting::Aware));
    config.router.policy = PolicyKind::RoundRobin;
    let out = simulate(&config, shared_prefixes(8, 1, 256, 5.0), |_| {})
        .unwrap()
        .report;
    assert_eq!(out.dp.unwrap().requests_per_rank, vec![2, 2, 2, 2]);
}

#[test]
fn a_fleet_without_ranks_reports_no_rank_figures() {
    let out = simulate(&fleet(2, None), shared_prefixes(2, 2, 256, 5.0), |_| {})
        .unwrap()
        .report;
    assert_eq!((out.dp_routing, out.dp), (None, None));
}

#[test]
fn a_bad_size_or_ranks_with_disaggregation_are_refused() {
    let err = |config: FleetConfig| {
        simulate(&config, shared_prefixes(1, 1, 64, 0.0), |_| {})
            .expect_err("refused")
            .to_string()
    };
    assert!(err(fleet(2, dp(0, DpRouting::Aware))).contains("data-parallel size must be"));
    let mut split = fleet(2, dp(2, DpRouting::Aware));
    split.disagg = Some(DisaggConfig::default());
    assert!(err(split).contains("not modelled with disaggregation"));
}
