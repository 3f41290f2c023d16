//! Making room: keeping sequences out, preemption, spill and resume, state
//! slots and their compaction.

use super::*;

#[test]
fn a_dry_pool_preempts_the_newest_running_request_and_it_recomputes() {
    let cfg = EngineConfig {
        num_blocks: 8,
        ..config()
    };
    let mut engine = Engine::new(cfg, SyncDevice::new(TimingConfig::default())).unwrap();
    engine
        .add_request(request(1, (0..48).collect(), 40))
        .unwrap();
    engine
        .add_request(request(2, (100..148).collect(), 40))
        .unwrap();
    let reports = run_to_end(&mut engine);
    assert!(engine.counters().preemptions > 0);
    let finished: Vec<_> = reports.iter().flat_map(|r| r.finished.clone()).collect();
    assert_eq!(finished.len(), 2);
    assert!(finished.iter().all(|f| f.output_tokens == 40));
    assert_eq!(
        finished[0].request,
        RequestId(1),
        "the older request is never the victim"
    );
    assert_eq!(engine.kv().free_blocks(), 8);
}

#[test]
fn a_scripted_dry_pool_leaves_a_new_request_waiting() {
    let mut engine = Engine::new(config(), ScriptedDevice::new(TimingConfig::default())).unwrap();
    engine.device_mut().exhaust_next = 1;
    engine
        .add_request(request(1, (0..40).collect(), 1))
        .unwrap();
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert!(report.is_idle());
    assert_eq!(engine.waiting_len(), 1);
    engine.step(&mut report).unwrap();
    assert_eq!(report.finished.len(), 1);
}

#[test]
fn an_exhausted_reservation_keeps_that_sequence_out_of_the_step_and_preempts_nothing() {
    let mut engine = two_running(config(), 5);
    engine.device_mut().exhaust_next = 1;
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert_eq!(report.scheduled, 1, "request 1 was not launched");
    assert_eq!(report.tokens.len(), 1);
    assert_eq!(report.tokens[0].request, RequestId(2));
    assert_eq!(engine.counters().preemptions, 0);
    assert_eq!(engine.counters().kept_out, 1);
    assert_eq!(engine.running_len(), 2, "it keeps its place and its blocks");
    let reports = run_to_end(&mut engine);
    assert_eq!(
        finished_outputs(&reports),
        vec![(RequestId(1), 5), (RequestId(2), 5)]
    );
}

#[test]
fn only_when_nothing_can_run_is_the_newest_preempted() {
    let mut engine = two_running(config(), 5);
    engine.device_mut().exhaust_next = 2;
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert_eq!(engine.counters().preemptions, 1);
    assert_eq!(report.scheduled, 1);
    assert_eq!(report.tokens[0].request, RequestId(1), "the older runs");
    let obs = observations(&mut engine);
    assert!(obs.contains(&Observation::Preempted {
        request: RequestId(2)
    }));
    assert!(engine.device().log.contains(&Effect::ReleaseSeq {
        seq: SeqId(1),
        cache: true,
        what: Label("preempted")
    }));
    let reports = run_to_end(&mut engine);
    assert_eq!(
        finished_outputs(&reports),
        vec![(RequestId(1), 5), (RequestId(2), 5)]
    );
}

fn spill_config() -> EngineConfig {
    EngineConfig {
        preemption: Preemption::Spill,
        spill_blocks: 64,
        ..config()
    }
}

#[test]
fn a_spilled_sequence_is_saved_synchronised_released_and_loaded_back_on_resume() {
    let mut engine = two_running(spill_config(), 5);
    engine.device_mut().exhaust_next = 2;
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    // Request 2 had computed its 40 prompt tokens: they go to the host,
    // the copy is waited for, and only then are its blocks released.
    let log = &engine.device().log;
    let at = |effect: &Effect| log.iter().position(|e| e == effect).unwrap();
    let save = at(&Effect::SaveSequenceState {
        seq: SeqId(1),
        tokens: 40,
    });
    let release = at(&Effect::ReleaseSeq {
        seq: SeqId(1),
        cache: true,
        what: Label("spilled"),
    });
    assert_eq!(log[save + 1], Effect::SyncSecondary);
    assert_eq!(save + 2, release);
    assert_eq!(report.shape.saved_tokens, 40, "the save is charged");
    assert_eq!(engine.spill_used_blocks(), 3);
    assert!(observations(&mut engine).contains(&Observation::Spilled {
        request: RequestId(2),
        tokens: 40
    }));
    // Resumed: its two full blocks are still cached on the device, the
    // last 8 tokens come back from the host, and nothing is recomputed.
    engine.device_mut().log.clear();
    engine.step(&mut report).unwrap();
    assert!(engine.device().log.contains(&Effect::LoadSequenceState {
        seq: SeqId(1),
        tokens: 40,
        device_prefix_blocks: 2
    }));
    assert_eq!(report.shape.restore_tokens, 8);
    assert_eq!(report.shape.prefill_tokens, 0);
    assert_eq!(report.shape.decode_tokens, 2);
    assert_eq!(engine.device().saved_len(), 0);
    assert_eq!(engine.spill_used_blocks(), 0);
    let reports = run_to_end(&mut engine);
    assert_eq!(
        finished_outputs(&reports),
        vec![(RequestId(1), 5), (RequestId(2), 5)]
    );
    let counters = engine.counters();
    assert_eq!((counters.spills, counters.spill_loads), (1, 1));
    assert_eq!(engine.kv().used_blocks(), 0);
}

#[test]
fn a_request_cancelled_while_spilled_drops_its_saved_state() {
    let mut engine = two_running(spill_config(), 5);
    engine.device_mut().exhaust_next = 2;
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert_eq!(engine.device().saved_len(), 1);
    engine.cancel(RequestId(2)).unwrap().unwrap();
    assert!(engine
        .device()
        .log
        .contains(&Effect::DropSequenceState { seq: SeqId(1) }));
    assert_eq!(engine.device().saved_len(), 0);
    assert_eq!(engine.counters().spill_drops, 1);
    assert_eq!(engine.spill_used_blocks(), 0);
}

#[test]
fn a_spill_that_leaves_nothing_to_run_still_takes_its_copy_time() {
    let timing = TimingConfig::default();
    let mut engine = Engine::new(spill_config(), ScriptedDevice::new(timing.clone())).unwrap();
    engine
        .add_request(request(1, (0..40).collect(), 5))
        .unwrap();
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    engine.device_mut().exhaust_next = 1;
    engine.step(&mut report).unwrap();
    assert!(report.is_idle());
    assert_eq!(engine.counters().spills, 1);
    assert!((report.model_ms - timing.restore_ms(40)).abs() < 1e-12);
    let reports = run_to_end(&mut engine);
    assert_eq!(finished_outputs(&reports), vec![(RequestId(1), 5)]);
}

#[test]
fn a_full_spill_area_falls_back_to_recompute() {
    let cfg = EngineConfig {
        spill_blocks: 2,
        ..spill_config()
    };
    let mut engine = two_running(cfg, 5);
    engine.device_mut().exhaust_next = 2;
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert_eq!(engine.counters().spill_fallbacks, 1);
    assert_eq!(engine.counters().spills, 0);
    assert!(!engine
        .device()
        .log
        .iter()
        .any(|e| matches!(e, Effect::SaveSequenceState { .. })));
}

fn slot_config(slots: u32) -> EngineConfig {
    EngineConfig {
        state_slots: slots,
        ..config()
    }
}

#[test]
fn state_slots_bound_the_running_sequences() {
    let mut engine =
        Engine::new(slot_config(2), ScriptedDevice::new(TimingConfig::default())).unwrap();
    for id in 1..=3 {
        engine
            .add_request(request(
                id,
                (id as u32 * 100..id as u32 * 100 + 40).collect(),
                3,
            ))
            .unwrap();
    }
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert_eq!((engine.running_len(), engine.waiting_len()), (2, 1));
    assert_eq!(engine.state_slots().free_len(), 0);
    let reports = run_to_end(&mut engine);
    assert_eq!(finished_outputs(&reports).len(), 3);
    assert_eq!(engine.state_slots().free_len(), 2);
}

#[test]
fn a_finished_sequence_leaves_a_hole_that_compaction_closes_before_the_next_step() {
    let mut engine =
        Engine::new(slot_config(3), ScriptedDevice::new(TimingConfig::default())).unwrap();
    engine
        .add_request(request(1, (0..40).collect(), 2))
        .unwrap();
    engine
        .add_request(request(2, (100..140).collect(), 9))
        .unwrap();
    engine
        .add_request(request(3, (200..240).collect(), 9))
        .unwrap();
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    engine.step(&mut report).unwrap();
    assert_eq!(report.finished[0].request, RequestId(1), "slot 0 is free");
    engine.device_mut().log.clear();
    engine.step(&mut report).unwrap();
    let log = &engine.device().log;
    assert_eq!(
        log[..3],
        [
            Effect::CompactSlot {
                seq: SeqId(2),
                from: SlotId(2),
                to: SlotId(0)
            },
            Effect::SyncSecondary,
            Effect::DetachSlot { slot: SlotId(2) },
        ]
    );
    let slots = engine.state_slots();
    assert_eq!(slots.slot_of(SeqId(2)), Some(SlotId(0)));
    assert_eq!(slots.slot_of(SeqId(1)), Some(SlotId(1)));
    assert_eq!((slots.free_len(), slots.detached_len()), (1, 0));
    assert_eq!(engine.counters().slot_compactions, 1);
}

#[derive(Clone, Debug)]
enum Op {
    Arrive { len: u16, max_tokens: u8 },
    Cancel { pick: u8 },
    Step { dry: u8 },
}

fn op() -> impl proptest::strategy::Strategy<Value = Op> {
    use proptest::prelude::*;
    prop_oneof![
        2 => (1u16..200, 1u8..60).prop_map(|(len, max_tokens)| Op::Arrive { len, max_tokens }),
        1 => any::<u8>().prop_map(|pick| Op::Cancel { pick }),
        5 => (0u8..8).prop_map(|dry| Op::Step { dry: dry.saturating_sub(5) }),
    ]
}

proptest::proptest! {
    /// Random effect sequences — arrivals, cancels, steps with the
    /// device answering `Exhausted` at random — over a small pool with
    /// spill preemption and state slots: no slot is freed twice (the
    /// device and the table would refuse it and the step would fail),
    /// every running sequence holds exactly one slot and none stays
    /// detached, every spilled sequence is loaded back or dropped, and
    /// when all is done or cancelled no block, slot or saved state is
    /// left behind. Half the runs are a hybrid model (prompts sharing
    /// prefixes, SSM checkpoints by either policy, resumes from them):
    /// the checkpoint cache stays within its bound and every
    /// checkpoint saved is held or was evicted.
    #[test]
    fn no_slot_freed_twice_no_block_leaked_every_spill_restored_or_freed(
        ops in proptest::collection::vec(op(), 1..120),
        hybrid in proptest::option::of(proptest::bool::ANY),
    ) {
        let mut cfg = EngineConfig {
            num_blocks: 24,
            max_num_batched_tokens: 128,
            max_num_seqs: 4,
            preemption: Preemption::Spill,
            spill_blocks: 20,
            state_slots: 4,
            ..config()
        };
        if let Some(marconi) = hybrid {
            let policy = if marconi { CheckpointPolicy::Marconi } else { CheckpointPolicy::EveryBlock };
            cfg = cfg.hybrid(policy);
            cfg.hybrid.as_mut().unwrap().max_checkpoints = 5;
        }
        let mut engine = Engine::new(cfg, ScriptedDevice::new(TimingConfig::default())).unwrap();
        engine.device_mut().record = false;
        let mut next_id = 1u128;
        let mut live: Vec<RequestId> = Vec::new();
        let mut report = StepReport::default();
        let check = |engine: &Engine<ScriptedDevice>| -> Result<(), proptest::test_runner::TestCaseError> {
            let slots = engine.state_slots();
            proptest::prop_assert_eq!(slots.owned_len(), engine.running_len());
            proptest::prop_assert_eq!(slots.detached_len(), 0);
            let c = engine.counters();
            proptest::prop_assert_eq!(engine.device().saved_len() as u64, c.spills - c.spill_loads - c.spill_drops);
            proptest::prop_assert!(engine.spill_used_blocks() <= 20);
            if let Some(checkpoints) = engine.checkpoints() {
                proptest::prop_assert!(checkpoints.len() <= 5);
                proptest::prop_assert_eq!(
                    checkpoints.len() as u64,
                    c.ssm_checkpoints - c.ssm_checkpoint_evictions
                );
            }
            Ok(())
        };
        for op in ops {
            match op {
                Op::Arrive { len, max_tokens } => {
                    // A hybrid run's prompts share one of three prefixes.
                    let family = if hybrid.is_some() { next_id % 3 } else { next_id };
                    let base = (family as u32) * 1_000;
                    let prompt = (base..base + u32::from(len)).collect();
                    if engine.add_request(request(next_id, prompt, u32::from(max_tokens))).is_ok() {
                        live.push(RequestId(next_id));
                    }
                    next_id += 1;
                }
                Op::Cancel { pick } => {
                    if !live.is_empty() {
                        let id = live.remove(pick as usize % live.len());
                        engine.cancel(id).unwrap();
                    }
                }
                Op::Step { dry } => {
                    engine.device_mut().exhaust_next = u32::from(dry);
                    engine.step(&mut report).unwrap();
                    for f in &report.finished {
                        live.retain(|&r| r != f.request);
                    }
                }
            }
            check(&engine)?;
        }
        engine.device_mut().exhaust_next = 0;
        for _ in 0..5_000 {
            if !engine.has_work() {
                break;
            }
            engine.step(&mut report).unwrap();
            check(&engine)?;
        }
        proptest::prop_assert!(!engine.has_work(), "the engine drained");
        let c = engine.counters();
        proptest::prop_assert_eq!(c.spills, c.spill_loads + c.spill_drops);
        proptest::prop_assert_eq!(engine.device().saved_len(), 0);
        proptest::prop_assert_eq!(engine.spill_used_blocks(), 0);
        proptest::prop_assert_eq!(engine.kv().used_blocks(), 0);
        proptest::prop_assert_eq!(engine.state_slots().free_len(), 4);
    }
}
