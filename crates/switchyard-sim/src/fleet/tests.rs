//! The fleet simulator end to end: timing, routing, the host tier, adapters,
//! speculative decoding, disaggregation and peer restore, sessions, refusals
//! and errors, determinism.

use super::*;
use crate::workload::{PromptSpec, Turn};
use std::collections::BTreeMap;
use switchyard_core::select::PolicyKind;

fn sessions(list: Vec<Session>) -> SessionStream {
    Box::new(list.into_iter().map(Ok))
}

fn one_turn(id: u64, arrival_ms: f64, prompt: Vec<u32>, output_tokens: u32) -> Session {
    Session {
        id,
        arrival_ms,
        think_time_ms: 0.0,
        turns: vec![Turn {
            prompt: PromptSpec::Tokens(prompt.into()),
            output_tokens,
            pause_ms: None,
            spawn: Vec::new(),
        }],
        flow: crate::workload::SessionFlow::default(),
    }
}

fn fleet(workers: usize, policy: PolicyKind) -> FleetConfig {
    let mut config = FleetConfig {
        workers,
        ..FleetConfig::default()
    };
    config.engine.timing.speedup = 1.0;
    config.router.policy = policy;
    config
}

#[test]
fn adapter_affinity_loads_fewer_adapters_and_waits_less_than_blind_routing() {
    let run = |policy: PolicyKind, blind: bool| {
        let mut config = fleet(4, policy);
        config.adapters = Some(crate::adapters::AdapterMix {
            count: 4,
            skew: 0.0,
            max_loras: 1,
            load_ms: 200.0,
            seed: 7,
        });
        config.router.adapters.blind = blind;
        let list = (0..200)
            .map(|i| {
                one_turn(
                    i,
                    i as f64 * 20.0,
                    (0..64).map(|t| t + i as u32 * 64).collect(),
                    4,
                )
            })
            .collect();
        simulate(&config, sessions(list), |_| {}).unwrap().report
    };
    for policy in [PolicyKind::Ttft, PolicyKind::LeastLoaded] {
        let affinity = run(policy, false);
        let blind = run(policy, true);
        let (a, b) = (affinity.adapters.unwrap(), blind.adapters.unwrap());
        assert_eq!((affinity.completed, blind.completed), (200, 200));
        assert_eq!((a.requests, b.requests), (200, 200));
        assert!(a.loads * 4 < b.loads, "{policy:?}: {a:?} against {b:?}");
        assert!(
            affinity.ttft_ms.p90 < blind.ttft_ms.p90,
            "{policy:?}: {} against {}",
            affinity.ttft_ms.p90,
            blind.ttft_ms.p90
        );
    }
    assert_eq!(fleet(1, PolicyKind::Ttft).adapters, None);
}

#[test]
fn one_request_on_one_worker_takes_the_timing_models_time() {
    let config = fleet(1, PolicyKind::Kv);
    let prompt: Vec<u32> = (0..100).collect();
    let out = simulate(&config, sessions(vec![one_turn(0, 0.0, prompt, 3)]), |_| {}).unwrap();
    let r = &out.report;
    // One prefill step of 100 tokens: 4.209989e-7·100² + 1.518344e-2·100 + 16.50142.
    let prefill = 4.209989e-7 * 1e4 + 1.518344e-2 * 100.0 + 16.50142;
    assert!(
        (r.ttft_ms.mean - prefill).abs() < 1e-9,
        "{}",
        r.ttft_ms.mean
    );
    // Two decode steps at almost-empty KV usage: about 5.74 ms each.
    let decode = r.e2e_ms.mean - r.ttft_ms.mean;
    assert!((2.0 * 5.74..2.0 * 5.8).contains(&decode), "{decode}");
    assert_eq!((r.completed, r.errors), (1, 0));
    assert_eq!(r.hit_rate, 0.0);
}

#[test]
fn speculative_decoding_at_full_acceptance_decodes_in_fewer_steps_with_the_same_tokens() {
    let run = |spec: Option<switchyard_engine::SpecDecode>| {
        let mut config = fleet(1, PolicyKind::Kv);
        config.engine.spec_decode = spec;
        let prompt: Vec<u32> = (0..100).collect();
        simulate(&config, sessions(vec![one_turn(0, 0.0, prompt, 9)]), |_| {})
            .unwrap()
            .report
    };
    let plain = run(None);
    let spec = run(Some(switchyard_engine::SpecDecode {
        draft_tokens: 3,
        acceptance_rate: 1.0,
    }));
    assert_eq!(plain.spec_decode, None);
    // 9 tokens: a prefill, then 8 decode steps or 2 of 1 + 3 drafts.
    assert_eq!((plain.engine_steps, spec.engine_steps), (9, 3));
    assert_eq!(spec.completed, 1);
    let f = spec.spec_decode.expect("counted");
    assert_eq!((f.draft_tokens_proposed, f.draft_tokens_accepted), (6, 6));
    assert_eq!((f.acceptance, f.rollbacks), (1.0, 0));
    // Each token of a step is charged its share: the mean ITL is the
    // decode time per output token, shorter than one step.
    assert!(spec.itl_ms.p50 > 0.0);
    assert!(spec.itl_ms.mean < plain.itl_ms.mean);
    assert!(spec.e2e_ms.mean < plain.e2e_ms.mean);
}

#[test]
fn a_disaggregated_request_prefills_transfers_then_decodes_from_the_restored_prefix() {
    let mut config = fleet(2, PolicyKind::Kv);
    config.disagg = Some(DisaggConfig {
        prefill_workers: 1,
        ..DisaggConfig::default()
    });
    let prompt: Vec<u32> = (0..100).collect();
    let out = simulate(&config, sessions(vec![one_turn(0, 0.0, prompt, 3)]), |_| {}).unwrap();
    let r = &out.report;
    assert_eq!((r.completed, r.errors), (1, 0));
    // Six full blocks of 16 tokens at 128 KiB a token moved once.
    assert_eq!((r.transfers, r.transfer_fallbacks), (1, 0));
    assert_eq!(r.transfer_bytes, 96 * 131_072);
    let prefill = |t: f64| 4.209989e-7 * t * t + 1.518344e-2 * t + 16.50142;
    let transfer = 1.0 + 96.0 * 131_072.0 / 25e9 * 1e3;
    // The client's first token: the prefill of 100 tokens, the
    // transfer, then the decode worker computing the 4 tokens past the
    // restored blocks; a waiting engine looks again every floor step.
    let floor = config.engine.timing.decode_floor_ms;
    let least = prefill(100.0) + transfer + prefill(4.0);
    assert!(
        (least..least + floor + 1e-9).contains(&r.ttft_ms.mean),
        "{} not within a floor step of {least}",
        r.ttft_ms.mean
    );
    // Two decode steps after it, on the decode worker.
    let decode = r.e2e_ms.mean - r.ttft_ms.mean;
    assert!((2.0 * 5.74..2.0 * 5.8).contains(&decode), "{decode}");
    // Each worker ran its half: the prefill worker computed the prompt,
    // the decode worker only the suffix and the output.
    let served: Vec<u64> = out.timeline.tokens.iter().map(|w| w.iter().sum()).collect();
    assert_eq!(served, vec![100, 4 + 2]);
}

#[test]
fn a_disaggregated_fleet_ends_every_lease_and_loses_no_request() {
    let mut config = fleet(4, PolicyKind::Kv);
    config.disagg = Some(DisaggConfig {
        prefill_workers: 2,
        ..DisaggConfig::default()
    });
    let turns: Vec<Session> = (0..40)
        .map(|i| {
            let prompt: Vec<u32> = (0..(64 + (i % 7) * 50))
                .map(|t| t + (i % 3) * 10_000)
                .collect();
            one_turn(u64::from(i), f64::from(i) * 5.0, prompt, 1 + i % 5)
        })
        .collect();
    let mut leases_at_end = None;
    let fleet_run = Simulation::new(&config, sessions(turns)).unwrap();
    let out = fleet_run
        .run(&mut |_| {}, |f| {
            leases_at_end = Some(
                f.workers
                    .iter()
                    .map(|w| w.engine.leases_held())
                    .sum::<usize>(),
            );
        })
        .unwrap();
    let r = &out.report;
    assert_eq!((r.completed, r.errors), (40, 0));
    assert_eq!(r.transfers + r.transfer_fallbacks, 40);
    assert_eq!(leases_at_end, Some(0), "every lease released");
    assert!(r.hit_rate > 0.0, "prefixes shared on the prefill pool");
}

#[test]
fn with_peer_restore_a_busy_holder_lends_its_prefix_and_every_lease_ends() {
    // A long shared prefix: the first request caches it on one worker,
    // then a burst of requests extending it arrives at once.
    let shared: Vec<u32> = (0..4_096).collect();
    let mut turns = vec![one_turn(0, 0.0, shared.clone(), 1)];
    for i in 1..24u32 {
        let mut prompt = shared.clone();
        prompt.extend((0..64).map(|t| 100_000 + i * 100 + t));
        turns.push(one_turn(u64::from(i), 500.0, prompt, 4));
    }
    let run = |peer: bool| {
        let mut config = fleet(4, PolicyKind::Ttft);
        config.peer_restore = peer.then(TransferConfig::default);
        let mut leases = None;
        let out = Simulation::new(&config, sessions(turns.clone()))
            .unwrap()
            .run(&mut |_| {}, |f| {
                leases = Some(
                    f.workers
                        .iter()
                        .map(|w| w.engine.leases_held())
                        .sum::<usize>(),
                );
            })
            .unwrap();
        (out.report, leases)
    };
    let (plain, _) = run(false);
    let (lent, leases) = run(true);
    assert_eq!(plain.transfers, 0);
    assert!(lent.transfers > 0, "some requests were lent the prefix");
    assert_eq!((lent.completed, lent.errors), (24, 0));
    assert_eq!(leases, Some(0), "every lease released");
    // What moved is prefix the other workers would have computed.
    // The burst spreads over idle workers instead of queueing on the
    // holder or recomputing the prefix (simulated time: deterministic).
    assert!(
        lent.ttft_ms.mean < plain.ttft_ms.mean,
        "{:?} vs {:?}",
        lent.ttft_ms,
        plain.ttft_ms
    );
    assert!(lent.load_cv < plain.load_cv);
    assert_eq!(
        lent.hit_rate, plain.hit_rate,
        "restored blocks count as cached"
    );
}

#[test]
fn a_disaggregation_needs_a_worker_of_each_role() {
    for prefill_workers in [0, 2] {
        let mut config = fleet(2, PolicyKind::Kv);
        config.disagg = Some(DisaggConfig {
            prefill_workers,
            ..DisaggConfig::default()
        });
        let err = simulate(&config, sessions(vec![]), |_| {}).err().unwrap();
        assert!(err.to_string().contains("one of each role"), "{err}");
    }
}

#[test]
fn a_repeated_prompt_goes_where_its_prefix_is_cached() {
    let config = fleet(2, PolicyKind::Kv);
    let prompt: Vec<u32> = (0..100).collect();
    let out = simulate(
        &config,
        sessions(vec![
            one_turn(0, 0.0, prompt.clone(), 3),
            one_turn(1, 1000.0, prompt, 3),
        ]),
        |_| {},
    )
    .unwrap();
    // The second request reuses the 6 full 16-token blocks: 96 of 200
    // prompt tokens, and the router predicted exactly that.
    assert!(
        (out.report.hit_rate - 96.0 / 200.0).abs() < 1e-12,
        "{}",
        out.report.hit_rate
    );
    assert_eq!(out.report.predicted_hit_rate, out.report.hit_rate);
    // Round-robin sends it to the other, cold worker.
    let config = fleet(2, PolicyKind::RoundRobin);
    let prompt: Vec<u32> = (0..100).collect();
    let out = simulate(
        &config,
        sessions(vec![
            one_turn(0, 0.0, prompt.clone(), 3),
            one_turn(1, 1000.0, prompt, 3),
        ]),
        |_| {},
    )
    .unwrap();
    assert_eq!(out.report.hit_rate, 0.0);
}

#[test]
fn an_engines_host_tier_reaches_the_routers_host_index() {
    // One worker with room for 16 device blocks (256 tokens) and a host
    // tier of 64: ten distinct 200-token prompts evict one another, and
    // evicted blocks spill into the host tier.
    let mut config = fleet(1, PolicyKind::Ttft);
    config.engine.num_blocks = 16;
    config.engine.host_blocks = 64;
    config.kv_event_delay_ms = 0.0;
    let turns = (0..10u32)
        .map(|i| {
            let prompt = (i * 1000..i * 1000 + 200).collect();
            one_turn(u64::from(i), f64::from(i) * 1000.0, prompt, 2)
        })
        .collect();
    let mut last = (0, 0, 0);
    Simulation::new(&config, sessions(turns))
        .unwrap()
        .run(&mut |_| {}, |fleet: &Simulation| {
            let router = fleet.replicas[0].dispatcher.router();
            last = (
                router.with_host_index(|h| h.live_pairs()),
                fleet.workers[0].engine.kv().host_blocks(),
                router.with_host_index(|h| h.counters().unknown_parent),
            );
        })
        .unwrap();
    let (indexed, engine, dropped) = last;
    assert!(engine > 0, "the engine spilled nothing");
    assert_eq!(indexed, engine, "every host block is indexed");
    assert_eq!(dropped, 0, "every spill found its parent");
}

#[test]
fn a_sessions_next_turn_waits_for_the_previous_one_and_its_think_time() {
    let config = fleet(1, PolicyKind::Kv);
    let first: Vec<u32> = (0..64).collect();
    let mut second = first.clone();
    second.extend(1000..1064);
    let session = Session {
        id: 0,
        arrival_ms: 0.0,
        think_time_ms: 5000.0,
        turns: vec![
            Turn {
                prompt: PromptSpec::Tokens(first.into()),
                output_tokens: 2,
                pause_ms: None,
                spawn: Vec::new(),
            },
            Turn {
                prompt: PromptSpec::Tokens(second.into()),
                output_tokens: 2,
                pause_ms: None,
                spawn: Vec::new(),
            },
        ],
        flow: crate::workload::SessionFlow::default(),
    };
    let out = simulate(&config, sessions(vec![session]), |_| {}).unwrap();
    assert_eq!(out.report.completed, 2);
    assert_eq!(out.report.sessions_completed, 1);
    // Makespan covers both turns and the think time between them.
    assert!(
        out.report.makespan_s > 5.0 && out.report.makespan_s < 5.2,
        "{}",
        out.report.makespan_s
    );
    // The second turn hits the first turn's 4 full blocks: 64 of 192.
    assert!(
        (out.report.hit_rate - 64.0 / 192.0).abs() < 1e-12,
        "{}",
        out.report.hit_rate
    );
}

/// A session of `turns` turns on one prompt of `len` tokens opened by
/// `first`, each turn `pause_ms` before the next.
fn chain(id: u64, first: u32, len: u32, turns: usize, pause_ms: f64) -> Session {
    Session {
        id,
        arrival_ms: 0.0,
        think_time_ms: 0.0,
        turns: (0..turns as u32)
            .map(|k| Turn {
                pause_ms: Some(pause_ms),
                ..Turn::new(
                    PromptSpec::Tokens((first..first + len + 16 * k).collect()),
                    2,
                )
            })
            .collect(),
        flow: crate::workload::SessionFlow::default(),
    }
}

/// When each (session, turn) arrived, over a whole run.
fn arrivals(config: &FleetConfig, list: Vec<Session>) -> (SimOutcome, BTreeMap<(u64, usize), f64>) {
    let mut seen = BTreeMap::new();
    let outcome = Simulation::new(config, sessions(list))
        .unwrap()
        .run(&mut |_| {}, |f: &Simulation| {
            for p in f.payloads.values() {
                seen.entry((p.session, p.turn)).or_insert(p.arrival_ms);
            }
            for r in f.in_flight.values() {
                seen.entry((r.session, r.turn)).or_insert(r.arrival_ms);
            }
        })
        .unwrap();
    (outcome, seen)
}

#[test]
fn spawned_sessions_arrive_together_and_their_parent_waits_for_them_all() {
    let config = fleet(2, PolicyKind::Ttft);
    let mut parent = chain(0, 0, 64, 2, 500.0);
    parent.turns[0].spawn = vec![chain(1, 5000, 64, 2, 100.0), chain(2, 9000, 64, 3, 100.0)];
    let (out, at) = arrivals(&config, vec![parent]);
    assert_eq!(out.report.completed, 2 + 2 + 3);
    assert_eq!(out.report.sessions_completed, 3);
    // The siblings arrive at one instant, after the parent's first turn.
    assert_eq!(at[&(1, 0)], at[&(2, 0)]);
    assert!(at[&(1, 0)] > at[&(0, 0)]);
    // The parent's next turn waits for the longer sibling's last turn and
    // then its own pause.
    assert!(at[&(0, 1)] > at[&(2, 2)] + 500.0, "{at:?}");
    assert!(at[&(0, 1)] > at[&(1, 1)] + 500.0, "{at:?}");
}

/// Eight sub-agents spawned by one turn, their first prompts sharing a
/// fresh 6,016-token prefix the parent never sent. (With a 1,024-token
/// prefix `ttft` computes it on two workers: a second prefill that short
/// costs less than the queue behind the first.)
fn burst_of_eight() -> Session {
    let mut parent = chain(0, 0, 64, 2, 10.0);
    parent.turns[0].spawn = (1..=8u32)
        .map(|k| {
            let mut prompt: Vec<u32> = (20_000..26_016).collect();
            prompt.extend(30_000 + 100 * k..30_040 + 100 * k);
            Session {
                id: u64::from(k),
                arrival_ms: 0.0,
                think_time_ms: 0.0,
                turns: vec![Turn::new(PromptSpec::Tokens(prompt.into()), 2)],
                flow: crate::workload::SessionFlow::default(),
            }
        })
        .collect();
    parent
}

#[test]
fn a_burst_placed_on_one_worker_computes_its_shared_prefix_once_and_one_spread_does_not() {
    let figures = |policy| {
        let out = simulate(&fleet(4, policy), sessions(vec![burst_of_eight()]), |_| {}).unwrap();
        assert_eq!(out.report.sessions_completed, 9);
        out.report.bursts.expect("one burst")
    };
    let placed = figures(PolicyKind::Ttft);
    assert_eq!(placed.bursts, 1);
    assert_eq!(
        placed.shared_tokens, 6016,
        "the shared prefix, in whole blocks"
    );
    assert_eq!((placed.once, placed.quiet, placed.quiet_once), (1, 1, 1));
    assert_eq!(placed.computed_tokens, 6016, "one member computed it");

    let spread = figures(PolicyKind::RoundRobin);
    assert_eq!((spread.bursts, spread.once, spread.quiet_once), (1, 0, 0));
    // Two members on each of four workers: each worker computes it once,
    // its second member waiting for the first's blocks.
    assert_eq!(spread.computed_tokens, 4 * 6016);
}

#[test]
fn a_workload_without_fan_out_reports_no_bursts() {
    let out = simulate(
        &fleet(2, PolicyKind::Ttft),
        sessions(vec![chain(0, 0, 64, 3, 10.0)]),
        |_| {},
    )
    .unwrap();
    assert_eq!(out.report.bursts, None);
}

#[test]
fn a_failed_spawned_session_still_releases_its_parent() {
    let mut config = fleet(1, PolicyKind::Ttft);
    config.engine.num_blocks = 8;
    let mut parent = chain(0, 0, 32, 2, 10.0);
    // Longer than the engine's whole pool: refused.
    parent.turns[0].spawn = vec![chain(1, 5000, 4000, 2, 10.0)];
    let (out, at) = arrivals(&config, vec![parent]);
    assert_eq!(out.report.errors, 1);
    assert_eq!(out.report.completed, 2);
    assert!(
        at.contains_key(&(0, 1)) && !at.contains_key(&(1, 1)),
        "{at:?}"
    );
}

#[test]
fn a_request_the_engine_refuses_is_counted_not_lost() {
    let mut config = fleet(1, PolicyKind::Kv);
    config.engine.num_blocks = 4;
    let big: Vec<u32> = (0..1000).collect();
    let out = simulate(&config, sessions(vec![one_turn(0, 0.0, big, 3)]), |_| {}).unwrap();
    assert_eq!((out.report.completed, out.report.errors), (0, 1));
}

#[test]
fn the_same_seed_gives_the_same_figures() {
    let run = || {
        let mut config = fleet(3, PolicyKind::PowerOfTwo);
        config.router.seed = 11;
        let workload = crate::workload::synthetic(crate::workload::SyntheticConfig {
            sessions: 40,
            sessions_per_sec: 20.0,
            think_time_ms: 100.0,
            ..Default::default()
        });
        let out = simulate(&config, workload, |_| {}).unwrap();
        serde_json::to_string(&out).unwrap()
    };
    let first = run();
    assert_eq!(first, run());
    assert!(first.contains("\"completed\""));
}

#[test]
fn zero_workers_is_a_clear_error() {
    let config = fleet(0, PolicyKind::Kv);
    let err = simulate(&config, sessions(vec![]), |_| {}).unwrap_err();
    assert_eq!(err.to_string(), "the fleet needs at least one worker");
}

#[test]
fn a_malformed_trace_line_stops_the_run_with_its_line_number() {
    let text = "{\"timestamp\": 0, \"input_length\": 10, \"output_length\": 5, \"hash_ids\": [0]}\nnot json\n";
    let workload = crate::workload::mooncake(text.as_bytes(), 3000.0);
    let err = simulate(&fleet(1, PolicyKind::Kv), workload, |_| {}).unwrap_err();
    assert!(err.to_string().starts_with("line 2"), "{err}");
}
