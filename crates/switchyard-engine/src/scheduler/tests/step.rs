//! A request's way through steps: prefix sharing, chunked prefill, adapters,
//! output tokens, logits, hybrid checkpoints, refusals, cancels, releases,
//! quiesce and shutdown.

use super::*;

/// Runs `prompts` one after the other (one output token each) on a
/// hybrid engine with 4-token blocks, keeping checkpoints by `policy`.
fn hybrid_run(policy: CheckpointPolicy, prompts: &[Vec<u32>]) -> Engine<ScriptedDevice> {
    let cfg = EngineConfig {
        block_size: 4,
        max_num_seqs: 8,
        ..config()
    }
    .hybrid(policy);
    let mut engine = Engine::new(cfg, ScriptedDevice::new(TimingConfig::default())).unwrap();
    for (i, prompt) in prompts.iter().enumerate() {
        engine
            .add_request(request(i as u128 + 1, prompt.clone(), 1))
            .unwrap();
        run_to_end(&mut engine);
    }
    engine
}

#[test]
fn a_hybrid_engine_resumes_only_from_an_ssm_checkpoint() {
    // A: 5 blocks; B and C share A's first 4 blocks, then diverge.
    let a: Vec<u32> = (0..20).collect();
    let tail = |from: u32| (0..16).chain(from..from + 8).collect::<Vec<u32>>();
    let (b, c) = (tail(100), tail(200));

    // Marconi keeps A's prompt end (block 5), not block 4: B finds 4
    // attention blocks cached and no state within them, recomputes,
    // and keeps the branch point (block 4) and its own end (block 6).
    // C resumes from B's branch point.
    let engine = hybrid_run(
        CheckpointPolicy::Marconi,
        &[a.clone(), b.clone(), c.clone()],
    );
    let counters = engine.counters();
    assert_eq!(
        counters.ssm_checkpoints, 4,
        "ends of A, B and C, and B's branch point"
    );
    assert_eq!(counters.ssm_resumes, 1);
    assert_eq!(
        counters.ssm_unusable_hit_tokens, 16,
        "B's 4 cached blocks, recomputed"
    );
    assert_eq!(counters.prefix_hit_tokens, 16, "C's resumed prefix");
    let log = &engine.device().log;
    let load = log
        .iter()
        .find(|e| matches!(e, Effect::LoadCheckpoint { .. }))
        .expect("C loads the branch point's state");
    assert!(matches!(load, Effect::LoadCheckpoint { tokens: 16, .. }));
    let mut events = Vec::new();
    let mut engine = engine;
    engine.drain_kv_events(&mut events);
    let stored = events
        .iter()
        .filter(|e| matches!(e, KvEvent::CheckpointStored { .. }))
        .count();
    assert_eq!(stored, 4, "every checkpoint is published");

    // Every block: B resumes from A's block-4 state at once.
    let engine = hybrid_run(CheckpointPolicy::EveryBlock, &[a, b]);
    let counters = engine.counters();
    assert_eq!(counters.ssm_resumes, 1);
    assert_eq!(counters.ssm_unusable_hit_tokens, 0);
    assert_eq!(
        counters.ssm_checkpoints,
        5 + 2,
        "A's 5 blocks, B's 2 new ones"
    );
    // A KV transfer would need the SSM state moved too: refused.
    let mut engine = engine;
    let lease = LeaseRef {
        id: crate::lease::LeaseId(1),
        token: 7,
    };
    assert_eq!(
        engine.add_rendezvous_request(request(9, (0..24).collect(), 1), lease),
        Err(AdmitError::HybridTransfer)
    );
}

#[test]
fn a_hybrid_models_prefill_costs_its_attention_share_plus_its_ssm_layers() {
    let plain = TimingConfig::default();
    let hybrid = TimingConfig {
        ssm: Some(crate::timing::SsmTiming::default()),
        ..TimingConfig::default()
    };
    // Long prompts: seven eighths of the quadratic term are gone.
    let [a, _, _] = plain.prefill;
    let saved = plain.prefill_ms(16_000) - hybrid.prefill_ms(16_000);
    assert!((saved - 0.875 * a * 16_000f64.powi(2)).abs() < 1e-6);
    let [_, b, c] = plain.prefill;
    assert!((hybrid.prefill_ms(1) - (0.125 * (plain.prefill[0] + b) + c + 0.875 * b)).abs() < 1e-9);
    assert!(hybrid.decode_ms(1.0) <= plain.decode_ms(1.0));
}

#[test]
fn the_second_of_two_requests_sharing_a_prefix_computes_only_its_suffix() {
    let timing = TimingConfig::default();
    let mut engine = Engine::new(config(), SyncDevice::new(timing.clone())).unwrap();
    let shared: Vec<u32> = (0..1000).collect();
    let mut first = shared.clone();
    first.extend(5000..5100);
    let mut second = shared.clone();
    second.extend(7000..7100);

    engine.add_request(request(1, first, 1)).unwrap();
    let reports = run_to_end(&mut engine);
    assert_eq!(reports[0].shape.prefill_tokens, 1100);

    engine.add_request(request(2, second, 1)).unwrap();
    let reports = run_to_end(&mut engine);
    // 62 full blocks (992 tokens) of the shared prefix are cached.
    assert_eq!(reports[0].shape.prefill_tokens, 1100 - 992);
    assert!((reports[0].model_ms - timing.prefill_ms(108)).abs() < 1e-9);
    assert_eq!(engine.counters().prefix_hit_tokens, 992);
    assert_eq!(engine.kv().free_blocks(), 256);
}

#[test]
fn a_request_behind_one_computing_its_prefix_waits_for_it_instead_of_computing_it_again() {
    // Two requests sharing 1,000 tokens arrive together (a fan-out): the
    // first is prefilled, and the budget left in that step would let the
    // second start too, computing the same prefix a second time.
    let mut engine = Engine::new(config(), SyncDevice::new(TimingConfig::default())).unwrap();
    let shared: Vec<u32> = (0..1000).collect();
    let mut first = shared.clone();
    first.extend(5000..5100);
    let mut second = shared;
    second.extend(7000..7100);
    engine.add_request(request(1, first, 2)).unwrap();
    engine.add_request(request(2, second, 2)).unwrap();
    let reports = run_to_end(&mut engine);
    // The first step computes the first request alone; the second waits
    // one step and computes only its suffix.
    assert_eq!(reports[0].shape.prefill_tokens, 1100);
    assert_eq!(reports[1].shape.prefill_tokens, 1100 - 992);
    let counters = engine.counters();
    assert_eq!(counters.prefix_hit_tokens, 992);
    assert_eq!(counters.prefix_in_flight_waits, 1);
    // A request with another prefix is not held back.
    engine
        .add_request(request(3, (0..1100).collect(), 2))
        .unwrap();
    engine
        .add_request(request(4, (20_000..21_100).collect(), 2))
        .unwrap();
    let reports = run_to_end(&mut engine);
    // Request 3 finds the 992 shared tokens cached; 4 starts beside it.
    assert_eq!(reports[0].shape.prefill_tokens, 1100 - 992 + 1100);
    assert_eq!(engine.counters().prefix_in_flight_waits, 1);
}

#[test]
fn an_adapters_blocks_are_its_own_and_its_events_name_it() {
    use switchyard_core::hashing::seed_for;
    let mut engine = Engine::new(config(), SyncDevice::new(TimingConfig::default())).unwrap();
    // 70 tokens: 4 full 16-token blocks (64 tokens) and 6 more.
    let prompt: Vec<u32> = (0..70).collect();
    let under = |id: u128, lora: Option<&str>| NewRequest {
        hash_seed: seed_for(lora, None),
        lora_name: lora.map(Arc::from),
        ..request(id, prompt.clone(), 1)
    };
    // Each request alone; returns (prefill tokens, cached tokens).
    let mut serve = |request: NewRequest| {
        engine.add_request(request).unwrap();
        let reports = run_to_end(&mut engine);
        let finished = reports.iter().flat_map(|r| &r.finished).next().unwrap();
        (reports[0].shape.prefill_tokens, finished.cached_tokens)
    };
    assert_eq!(serve(under(1, None)), (70, 0), "base: cold");
    assert_eq!(
        serve(under(2, Some("sql"))),
        (70, 0),
        "sql: not the base's KV"
    );
    assert_eq!(
        serve(under(3, Some("sql"))),
        (6, 64),
        "sql again: its 4 blocks"
    );
    assert_eq!(serve(under(4, Some("chat"))), (70, 0), "chat: not sql's KV");
    assert_eq!(serve(under(5, None)), (6, 64), "base again: its 4 blocks");
    assert_eq!(engine.counters().prefix_hit_tokens, 128);
    assert_eq!(
        engine.kv().cached_blocks(),
        12,
        "4 blocks each of base, sql, chat"
    );

    // Each computation published its blocks under its adapter's name.
    let mut events = Vec::new();
    engine.drain_kv_events(&mut events);
    let stored: Vec<(usize, Option<&str>)> = events
        .iter()
        .filter_map(|e| match e {
            KvEvent::BlockStored {
                block_hashes,
                lora_name,
                ..
            } => Some((block_hashes.len(), lora_name.as_deref())),
            _ => None,
        })
        .collect();
    assert_eq!(stored, vec![(4, None), (4, Some("sql")), (4, Some("chat"))]);
}

#[test]
fn an_output_vocabulary_supplies_every_generated_token_deterministically() {
    let vocabulary: std::sync::Arc<[u32]> = vec![279, 3_015, 42_000].into();
    let cfg = EngineConfig {
        output_vocabulary: Some(vocabulary.clone()),
        ..config()
    };
    let generate = |cfg: EngineConfig| {
        let mut engine = Engine::new(cfg, SyncDevice::new(TimingConfig::default())).unwrap();
        engine
            .add_request(request(1, (0..40).collect(), 64))
            .unwrap();
        let tokens: Vec<u32> = run_to_end(&mut engine)
            .iter()
            .flat_map(|r| r.tokens.iter().map(|t| t.token))
            .collect();
        tokens
    };
    let drawn = generate(cfg.clone());
    assert_eq!(drawn.len(), 64);
    assert!(drawn.iter().all(|t| vocabulary.contains(t)), "{drawn:?}");
    assert!(vocabulary.iter().all(|v| drawn.contains(v)), "{drawn:?}");
    assert_eq!(generate(cfg), drawn);
    // Without one, the ids are what they always were.
    let default: Vec<u32> = (0..64)
        .map(|i| synthetic_token(RequestId(1), i, None))
        .collect();
    assert_eq!(generate(config()), default);
    assert!(default.iter().all(|t| (100..32_100).contains(t)));
}

#[test]
fn a_long_prompt_is_prefilled_in_chunks_within_the_token_budget() {
    let cfg = EngineConfig {
        max_num_batched_tokens: 512,
        ..config()
    };
    let mut engine = Engine::new(cfg, SyncDevice::new(TimingConfig::default())).unwrap();
    engine
        .add_request(request(1, (0..1200).collect(), 2))
        .unwrap();
    let reports = run_to_end(&mut engine);
    let prefill: Vec<u64> = reports.iter().map(|r| r.shape.prefill_tokens).collect();
    assert_eq!(prefill, vec![512, 512, 176, 0]);
    assert_eq!(
        reports[2].tokens.len(),
        1,
        "the first token comes with the last chunk"
    );
    assert_eq!(reports[3].finished.len(), 1);
    assert_eq!(reports[3].finished[0].output_tokens, 2);
}

#[test]
fn cancelling_a_running_request_frees_its_blocks() {
    let mut engine = Engine::new(config(), SyncDevice::new(TimingConfig::default())).unwrap();
    engine
        .add_request(request(1, (0..100).collect(), 50))
        .unwrap();
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert!(engine.kv().used_blocks() > 0);
    let finished = engine.cancel(RequestId(1)).unwrap().unwrap();
    assert_eq!(finished.reason, FinishReason::Cancelled);
    assert_eq!(engine.kv().free_blocks(), 256);
    assert!(!engine.has_work());
    assert_eq!(
        engine.cancel(RequestId(1)),
        Ok(None),
        "cancelling twice is harmless"
    );
}

#[test]
fn bad_requests_are_refused_with_a_reason() {
    let mut engine = Engine::new(config(), SyncDevice::new(TimingConfig::default())).unwrap();
    assert_eq!(
        engine.add_request(request(1, vec![], 1)),
        Err(AdmitError::EmptyPrompt)
    );
    assert_eq!(
        engine.add_request(request(1, vec![1], 0)),
        Err(AdmitError::NoOutput)
    );
    assert!(matches!(
        engine.add_request(request(1, vec![1; 5000], 1)),
        Err(AdmitError::TooLong { .. })
    ));
    engine.add_request(request(1, vec![1], 1)).unwrap();
    assert_eq!(
        engine.add_request(request(1, vec![1], 1)),
        Err(AdmitError::Duplicate(RequestId(1)))
    );
}

#[test]
fn the_ahead_device_rolls_back_lookahead_blocks_when_a_request_finishes() {
    let mut engine = Engine::new(config(), AheadDevice::new(TimingConfig::default(), 1)).unwrap();
    engine
        .add_request(request(1, (0..32).collect(), 1))
        .unwrap();
    let reports = run_to_end(&mut engine);
    assert_eq!(reports.len(), 1);
    assert_eq!(engine.kv().free_blocks(), 256);
    assert_eq!(
        engine.kv().cached_blocks(),
        2,
        "the lookahead block was never offered to the cache"
    );
}

#[test]
fn every_release_names_its_caller() {
    let mut engine = Engine::new(config(), ScriptedDevice::new(TimingConfig::default())).unwrap();
    engine
        .add_request(request(1, (0..40).collect(), 1))
        .unwrap();
    engine
        .add_request(request(2, (100..140).collect(), 9))
        .unwrap();
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    engine.cancel(RequestId(2)).unwrap();
    let whats: Vec<_> = engine
        .device()
        .log
        .iter()
        .filter_map(|e| match e {
            Effect::ReleaseSeq { seq, what, .. } => Some((*seq, what.0)),
            _ => None,
        })
        .collect();
    assert_eq!(whats, vec![(SeqId(0), "finished"), (SeqId(1), "cancelled")]);
}

#[test]
fn sampling_rows_read_their_logits_back_at_the_models_width() {
    let cfg = EngineConfig {
        read_logits: true,
        vocab_size: 1_000,
        ..config()
    };
    let timing = TimingConfig::default();
    let mut engine = Engine::new(cfg, ScriptedDevice::new(timing.clone())).unwrap();
    engine
        .add_request(request(1, (0..40).collect(), 2))
        .unwrap();
    engine
        .add_request(request(2, (100..140).collect(), 2))
        .unwrap();
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert!(engine.device().log.contains(&Effect::ReadLogits {
        rows: 2,
        vocab: 1_000,
        elem_bytes: 2
    }));
    let expected = timing.step_ms(&report.shape) + timing.host_copy_ms(4_000);
    assert!((report.model_ms - expected).abs() < 1e-9);
    assert_eq!(engine.counters().logits_bytes, 4_000);
}

#[test]
fn logits_of_another_width_than_the_models_are_a_device_error() {
    let cfg = EngineConfig {
        read_logits: true,
        ..config()
    };
    let mut engine = Engine::new(cfg, ScriptedDevice::new(TimingConfig::default())).unwrap();
    engine.device_mut().logits_width = Some(4);
    engine
        .add_request(request(1, (0..40).collect(), 2))
        .unwrap();
    let mut report = StepReport::default();
    assert_eq!(
        engine.step(&mut report),
        Err(EngineError::Device(DeviceError::LogitsWidth {
            expected: 2,
            got: 4
        }))
    );
}

#[test]
fn without_read_logits_nothing_is_copied_to_the_host() {
    let mut engine = two_running(config(), 2);
    run_to_end(&mut engine);
    assert!(!engine
        .device()
        .log
        .iter()
        .any(|e| matches!(e, Effect::ReadLogits { .. })));
}

#[test]
fn a_quiesced_engine_refuses_steps_but_cancels_and_a_shut_down_one_refuses_all() {
    let mut engine = two_running(config(), 5);
    engine.quiesce().unwrap();
    let mut report = StepReport::default();
    assert_eq!(
        engine.step(&mut report),
        Err(EngineError::Device(DeviceError::Quiesced {
            effect: Label("reserve_kv")
        }))
    );
    engine.cancel(RequestId(1)).unwrap().unwrap();
    engine.shutdown().unwrap();
    let err = engine.cancel(RequestId(2)).unwrap_err();
    assert_eq!(
        err.to_string(),
        "device layer: the device is shut down and refuses release_seq"
    );
    assert!(
        matches!(
            engine.step(&mut report),
            Err(EngineError::Device(DeviceError::ShutDown { .. }))
        ),
        "request 2 is still held, and the device refuses to run it"
    );
    let log = &engine.device().log;
    let at = |effect: &Effect| log.iter().position(|e| e == effect).unwrap();
    assert!(at(&Effect::Quiesce) < at(&Effect::EpShutdown));
}
