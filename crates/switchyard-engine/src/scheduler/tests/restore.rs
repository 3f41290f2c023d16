//! The restore protocol: from the host tier, and from another engine's
//! capture (rendezvous).

use super::*;

/// An engine with a host tier ([`host_config`]) on the scripted device.
fn host_engine() -> Engine<ScriptedDevice> {
    Engine::new(host_config(), ScriptedDevice::new(TimingConfig::default())).unwrap()
}

fn host_config() -> EngineConfig {
    EngineConfig {
        num_blocks: 64,
        host_blocks: 256,
        min_restore_tokens: 16,
        ..config()
    }
}

/// Fills the host tier with `prompt`'s blocks: run it, then flush the device.
fn spill_prompt<D: DeviceLayer>(engine: &mut Engine<D>, prompt: &[u32]) {
    engine
        .add_request(request(900, prompt.to_vec(), 1))
        .unwrap();
    run_to_end(engine);
    engine
        .add_request(request(901, (50_000..50_000 + 63 * 16).collect(), 1))
        .unwrap();
    run_to_end(engine);
}

#[test]
fn a_host_tier_hit_is_restored_then_acknowledged_then_observed() {
    let mut engine = host_engine();
    let prompt: Vec<u32> = (0..640).collect();
    spill_prompt(&mut engine, &prompt);
    observations(&mut engine);
    engine.device_mut().log.clear();
    engine.add_request(request(1, prompt.clone(), 1)).unwrap();
    let reports = run_to_end(&mut engine);
    let obs = observations(&mut engine);
    assert!(
        obs.contains(&Observation::Restored {
            request: RequestId(1),
            candidate_prefix_tokens: 608
        }),
        "{obs:?}"
    );
    // One prompt block survived on the device; 38 came back from the
    // host; the last block is computed (no logits are cached).
    assert_eq!(reports[0].shape.prefill_tokens, 16);
    assert_eq!(reports[0].shape.restore_tokens, 608);
    let log = &engine.device().log;
    let restore_at = log
        .iter()
        .position(|e| matches!(e, Effect::Restore { .. }))
        .unwrap();
    let ack_at = log
        .iter()
        .position(|e| matches!(e, Effect::AckRestore { .. }))
        .unwrap();
    assert!(restore_at < ack_at);
    assert_eq!(engine.counters().restores.restored, 1);
}

/// An engine with a 640-token prompt spilled to its host tier and
/// request 2 holding most of its device for `outputs` tokens; request 1
/// (that prompt) queued behind it.
fn restore_behind_a_long_request(outputs: u32) -> Engine<ScriptedDevice> {
    let mut engine = host_engine();
    let prompt: Vec<u32> = (0..640).collect();
    spill_prompt(&mut engine, &prompt);
    engine
        .add_request(request(2, (90_000..90_000 + 40 * 16).collect(), outputs))
        .unwrap();
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    engine.add_request(request(1, prompt, 1)).unwrap();
    engine
}

#[test]
fn a_restore_without_device_capacity_is_deferred_with_its_source_pinned() {
    let mut engine = restore_behind_a_long_request(200);
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    let obs = observations(&mut engine);
    assert!(obs.contains(&Observation::RestoreDecided {
        request: RequestId(1),
        decision: RestoreDecision::SequenceCapacityNotReady {
            candidate_prefix_tokens: 624
        }
    }));
    assert_eq!(engine.waiting_len(), 1);
    // Cancelling drops the deferral, which unpins the source.
    engine.cancel(RequestId(1)).unwrap();
    assert_eq!(engine.counters().restores.sequence_capacity_not_ready, 1);
}

#[test]
fn a_deferred_restore_is_retried_from_its_retained_source() {
    let mut engine = restore_behind_a_long_request(5);
    engine.device_mut().log.clear();
    observations(&mut engine);
    run_to_end(&mut engine);
    let obs = observations(&mut engine);
    let decided: Vec<_> = obs
        .iter()
        .filter_map(|o| match o {
            Observation::RestoreDecided {
                request: RequestId(1),
                decision,
            } => Some(*decision),
            _ => None,
        })
        .collect();
    // Deferred while request 2 held the device, then restored: the
    // same 39 blocks each time (the retained source), nothing re-read.
    let deferred = RestoreDecision::SequenceCapacityNotReady {
        candidate_prefix_tokens: 624,
    };
    assert_eq!(decided[0], deferred, "{decided:?}");
    assert_eq!(
        decided.last(),
        Some(&RestoreDecision::Restore {
            candidate_prefix_tokens: 624
        })
    );
    assert!(
        decided[..decided.len() - 1].iter().all(|d| *d == deferred),
        "{decided:?}"
    );
    assert!(obs.contains(&Observation::Restored {
        request: RequestId(1),
        candidate_prefix_tokens: 624
    }));
    let tickets: Vec<_> = engine
        .device()
        .log
        .iter()
        .filter_map(|e| match e {
            Effect::Restore { ticket, .. } => Some(*ticket),
            _ => None,
        })
        .collect();
    assert_eq!(tickets.len(), 1);
    assert_eq!(
        (tickets[0].device_prefix_tokens, tickets[0].blocks),
        (0, 39)
    );
    assert_eq!(engine.counters().restores.retained_source_lost, 0);
}

#[test]
fn a_refused_acknowledgement_cancels_that_request_and_nothing_else() {
    let mut engine = host_engine();
    let prompt: Vec<u32> = (0..640).collect();
    spill_prompt(&mut engine, &prompt);
    observations(&mut engine);
    engine.device_mut().fail_next_ack = true;
    engine.add_request(request(1, prompt, 1)).unwrap();
    engine
        .add_request(request(2, (70_000..70_000 + 64).collect(), 4))
        .unwrap();
    let reports = run_to_end(&mut engine);
    let finished: Vec<_> = reports.iter().flat_map(|r| r.finished.clone()).collect();
    let reason = |id| {
        finished
            .iter()
            .find(|f| f.request == RequestId(id))
            .map(|f| f.reason)
    };
    assert_eq!(reason(1), Some(FinishReason::RestoreFailed));
    assert_eq!(reason(2), Some(FinishReason::Length), "the step went on");
    let obs = observations(&mut engine);
    assert!(obs.contains(&Observation::RestoreFailed {
        request: RequestId(1),
        error: Some(RestoreError::AcknowledgeFailed)
    }));
    assert!(!obs
        .iter()
        .any(|o| matches!(o, Observation::Restored { .. })));
    assert_eq!(engine.counters().restores.failed, 1);
    assert_eq!(engine.kv().used_blocks(), 0, "every block came back");
}

#[test]
fn a_restore_report_the_block_table_contradicts_cancels_the_request() {
    let mut engine = host_engine();
    let prompt: Vec<u32> = (0..640).collect();
    spill_prompt(&mut engine, &prompt);
    observations(&mut engine);
    // A report consistent with itself (one block fewer, sixteen tokens
    // fewer) that the block manager's table does not bear out.
    engine.device_mut().tamper_restore = Some(|out: RestoreOutput| RestoreOutput {
        restored_tokens: out.restored_tokens - 16,
        blocks_installed: out.blocks_installed - 1,
        ..out
    });
    engine.add_request(request(1, prompt, 1)).unwrap();
    let reports = run_to_end(&mut engine);
    assert_eq!(reports[0].finished[0].reason, FinishReason::RestoreFailed);
    let obs = observations(&mut engine);
    assert!(
        obs.iter().any(|o| matches!(
            o,
            Observation::RestoreFailed {
                error: Some(RestoreError::TableMismatch { .. }),
                ..
            }
        )),
        "{obs:?}"
    );
    assert!(!engine
        .device()
        .log
        .iter()
        .any(|e| matches!(e, Effect::AckRestore { .. })));
}

/// A prefill engine that has computed `prompt` and captured it.
fn captured(prompt: &[u32]) -> (Engine<ScriptedDevice>, LeaseRef) {
    let mut source = Engine::new(config(), ScriptedDevice::new(TimingConfig::default())).unwrap();
    source
        .add_request(request(900, prompt.to_vec(), 1))
        .unwrap();
    run_to_end(&mut source);
    let (lease, blocks) = source
        .capture(prompt, DEFAULT_SEED, 0xfeed, 1_000.0)
        .unwrap();
    assert_eq!(blocks, prompt.len() / 16);
    (source, lease)
}

fn decode_engine() -> Engine<ScriptedDevice> {
    Engine::new(config(), ScriptedDevice::new(TimingConfig::default())).unwrap()
}

#[test]
fn a_decode_engine_restores_a_capture_then_acknowledges_then_observes() {
    let prompt: Vec<u32> = (0..640).collect();
    let (mut source, lease) = captured(&prompt);
    let mut target = decode_engine();
    target
        .add_rendezvous_request(request(1, prompt.clone(), 2), lease)
        .unwrap();
    target
        .add_request(request(2, (5_000..5_064).collect(), 1))
        .unwrap();
    // The transfer has not arrived: request 2, behind it, goes first.
    let mut report = StepReport::default();
    target.step(&mut report).unwrap();
    assert_eq!(report.finished.len(), 1);
    assert_eq!(report.finished[0].request, RequestId(2));
    target.step(&mut report).unwrap();
    assert!(report.is_idle(), "still waiting");
    assert_eq!(target.counters().restores.request_state_not_ready, 1);
    // The driver moves the capture over.
    let transfer = source.read_lease(lease).unwrap();
    target.deliver_rendezvous(RequestId(1), transfer).unwrap();
    target.device_mut().log.clear();
    observations(&mut target);
    let reports = run_to_end(&mut target);
    // 39 blocks restored, the last block computed (no logits cached),
    // and the restore is not charged to the step: the transfer was.
    assert_eq!(reports[0].shape.prefill_tokens, 16);
    assert_eq!(reports[0].shape.restore_tokens, 0);
    let obs = observations(&mut target);
    let restored_at = obs
        .iter()
        .position(|o| {
            *o == Observation::Restored {
                request: RequestId(1),
                candidate_prefix_tokens: 624,
            }
        })
        .expect("restored");
    assert_eq!(
        obs[restored_at + 1],
        Observation::RendezvousDone {
            request: RequestId(1),
            lease: lease.id,
            restored: true
        }
    );
    let log = &target.device().log;
    let restore_at = log
        .iter()
        .position(|e| {
            matches!(
                e,
                Effect::Restore {
                    rendezvous: true,
                    ..
                }
            )
        })
        .unwrap();
    let ack_at = log
        .iter()
        .position(|e| matches!(e, Effect::AckRestore { .. }))
        .unwrap();
    assert!(restore_at < ack_at);
    // The driver releases the lease once; a second release is refused.
    source.release_lease(lease).unwrap();
    assert_eq!(source.release_lease(lease), Err(LeaseError::Unknown));
    assert_eq!(source.leases_held(), 0);
}

#[test]
fn a_rendezvous_holding_another_prompt_cancels_the_request() {
    let (mut source, lease) = captured(&(0..640).collect::<Vec<u32>>());
    let mut target = decode_engine();
    let other: Vec<u32> = (10_000..10_640).collect();
    target
        .add_rendezvous_request(request(1, other, 1), lease)
        .unwrap();
    target
        .deliver_rendezvous(RequestId(1), source.read_lease(lease).unwrap())
        .unwrap();
    let reports = run_to_end(&mut target);
    assert_eq!(reports[0].finished[0].reason, FinishReason::RestoreFailed);
    let obs = observations(&mut target);
    assert!(obs.contains(&Observation::RestoreFailed {
        request: RequestId(1),
        error: Some(RestoreError::SourceMismatch)
    }));
    assert!(obs.contains(&Observation::RendezvousDone {
        request: RequestId(1),
        lease: lease.id,
        restored: false
    }));
    assert_eq!(target.kv().used_blocks(), 0);
}

#[test]
fn deliveries_are_checked_before_they_are_kept() {
    let prompt: Vec<u32> = (0..64).collect();
    let (mut source, lease) = captured(&prompt);
    let mut target = decode_engine();
    let transfer = source.read_lease(lease).unwrap();
    assert_eq!(
        target.deliver_rendezvous(RequestId(1), transfer.clone()),
        Err(DeliverError::UnknownRequest)
    );
    target.add_request(request(2, prompt.clone(), 1)).unwrap();
    assert_eq!(
        target.deliver_rendezvous(RequestId(2), transfer.clone()),
        Err(DeliverError::NotAwaited)
    );
    target
        .add_rendezvous_request(request(1, prompt, 1), lease)
        .unwrap();
    let short = LeasedKv {
        tokens: transfer.tokens[..10].to_vec(),
        ..transfer.clone()
    };
    assert!(matches!(
        target.deliver_rendezvous(RequestId(1), short),
        Err(DeliverError::Malformed { .. })
    ));
    target
        .deliver_rendezvous(RequestId(1), transfer.clone())
        .unwrap();
    assert_eq!(
        target.deliver_rendezvous(RequestId(1), transfer),
        Err(DeliverError::AlreadyDelivered)
    );
}

proptest::proptest! {
    /// Whatever happens to rendezvous requests — delivered or not,
    /// cancelled while waiting, the device failing the restore or
    /// refusing its acknowledgement — each ends its lease exactly once
    /// (one `RendezvousDone`), and none that restored produces a token
    /// before its restore was acknowledged.
    #[test]
    fn each_rendezvous_request_ends_its_lease_exactly_once(
        plan in proptest::collection::vec((0u8..5, proptest::bool::ANY), 1..6),
    ) {
        let prompt: Vec<u32> = (0..320).collect();
        let (mut source, lease) = captured(&prompt);
        let transfer = source.read_lease(lease).unwrap();
        let mut target = decode_engine();
        for (i, &(fate, _)) in plan.iter().enumerate() {
            let id = RequestId(i as u128 + 1);
            target.add_rendezvous_request(request(id.0, prompt.clone(), 2), lease).unwrap();
            if fate != 0 {
                target.deliver_rendezvous(id, transfer.clone()).unwrap();
            }
        }
        let mut obs = Vec::new();
        let mut report = StepReport::default();
        for round in 0..40 {
            if let Some(&(fate, fail_ack)) = plan.get(round) {
                target.device_mut().fail_next_ack = fail_ack;
                target.device_mut().fail_next_restore = fate == 4;
                if fate == 0 {
                    target.cancel(RequestId(round as u128 + 1)).unwrap();
                }
            }
            target.step(&mut report).unwrap();
            target.drain_observations(&mut obs);
            // A token means the request ran: its lease was resolved
            // first (restored and acknowledged, or given up).
            for token in &report.tokens {
                let resolved = obs.iter().any(|o| matches!(o, Observation::RendezvousDone { request, .. } if *request == token.request));
                proptest::prop_assert!(resolved, "{:?} ran with its lease unresolved", token.request);
            }
        }
        for i in 0..plan.len() {
            let id = RequestId(i as u128 + 1);
            let dones = obs.iter().filter(|o| matches!(o, Observation::RendezvousDone { request, .. } if *request == id)).count();
            proptest::prop_assert_eq!(dones, 1, "{:?}", id);
            let restored = obs.iter().any(|o| matches!(o, Observation::Restored { request, .. } if *request == id));
            let done_restored = obs.iter().any(|o| matches!(o, Observation::RendezvousDone { request, restored: true, .. } if *request == id));
            proptest::prop_assert_eq!(restored, done_restored);
        }
        // Acknowledged restores and `Restored` observations agree.
        let acks = target.device().log.iter().filter(|e| matches!(e, Effect::AckRestore { .. })).count();
        let refused = target.counters().restores.failed as usize;
        let restored = obs.iter().filter(|o| matches!(o, Observation::Restored { .. })).count();
        proptest::prop_assert!(restored <= acks && acks <= restored + refused);
        proptest::prop_assert_eq!(target.kv().used_blocks(), 0);
    }
}

#[test]
fn a_prompt_with_nothing_on_the_host_is_no_reusable_entry() {
    let mut engine = host_engine();
    engine
        .add_request(request(1, (0..64).collect(), 1))
        .unwrap();
    run_to_end(&mut engine);
    assert_eq!(engine.counters().restores.no_reusable_entry, 1);
}

#[test]
fn an_invalid_restore_output_cancels_the_request_instead_of_falling_back() {
    let mut engine = host_engine();
    let prompt: Vec<u32> = (0..640).collect();
    spill_prompt(&mut engine, &prompt);
    observations(&mut engine);
    engine.device_mut().tamper_restore = Some(|out: RestoreOutput| RestoreOutput {
        restored_tokens: out.prompt_tokens,
        ..out
    });
    engine.add_request(request(1, prompt, 1)).unwrap();
    let reports = run_to_end(&mut engine);
    assert_eq!(reports[0].finished[0].reason, FinishReason::RestoreFailed);
    let obs = observations(&mut engine);
    assert!(obs.contains(&Observation::RestoreFailed {
        request: RequestId(1),
        error: Some(RestoreError::NoSuffixLeft)
    }));
    assert!(!obs
        .iter()
        .any(|o| matches!(o, Observation::Restored { .. })));
    assert_eq!(engine.kv().free_blocks(), 64);
    assert!(!engine
        .device()
        .log
        .iter()
        .any(|e| matches!(e, Effect::AckRestore { .. })));
}

#[test]
fn a_device_failure_during_restore_cancels_the_request() {
    let mut engine = host_engine();
    let prompt: Vec<u32> = (0..640).collect();
    spill_prompt(&mut engine, &prompt);
    engine.device_mut().fail_next_restore = true;
    engine.add_request(request(1, prompt, 1)).unwrap();
    let reports = run_to_end(&mut engine);
    assert_eq!(reports[0].finished[0].reason, FinishReason::RestoreFailed);
    assert_eq!(engine.counters().restores.failed, 1);
}
