//! Speculative decoding: drafts verified, accepted or rolled back, and the
//! deterministic acceptance draws.

use super::*;

fn spec_config(draft_tokens: u32, acceptance_rate: f64) -> EngineConfig {
    EngineConfig {
        spec_decode: Some(crate::config::SpecDecode {
            draft_tokens,
            acceptance_rate,
        }),
        ..config()
    }
}

/// One request of `prompt_len` tokens, prefilled (one output token).
fn one_decoding(cfg: EngineConfig, prompt_len: u32, max_tokens: u32) -> Engine<ScriptedDevice> {
    let mut engine = Engine::new(cfg, ScriptedDevice::new(TimingConfig::default())).unwrap();
    engine
        .add_request(request(7, (0..prompt_len).collect(), max_tokens))
        .unwrap();
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert_eq!(report.tokens.len(), 1, "the prefill samples one token");
    engine.device_mut().log.clear();
    engine
}

fn expected_outputs(request: u128, max_tokens: u32) -> Vec<u32> {
    (0..max_tokens)
        .map(|i| synthetic_token(RequestId(request), i, None))
        .collect()
}

#[test]
fn at_full_acceptance_a_decode_step_emits_one_token_plus_every_draft() {
    let mut engine = one_decoding(spec_config(3, 1.0), 40, 9);
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert_eq!(report.tokens.len(), 4);
    assert_eq!(report.shape.decode_tokens, 1);
    assert_eq!(report.shape.draft_tokens, 3);
    let seq = SeqId(0);
    assert_eq!(
        engine.device().log,
        vec![
            // 41 tokens, the last not computed yet, plus 3 drafts.
            Effect::ReserveKv { seq, tokens: 44 },
            Effect::LaunchStep {
                shape: report.shape
            },
            Effect::ReadStepResult,
            // Nothing rejected: no rollback; the ring moves to 44.
            Effect::SaveHiddenCatchup { seq, tokens: 44 },
        ]
    );
    let mut outputs = vec![synthetic_token(RequestId(7), 0, None)];
    outputs.extend(report.tokens.iter().map(|t| t.token));
    let reports = run_to_end(&mut engine);
    assert_eq!(
        reports.iter().map(|r| r.tokens.len()).collect::<Vec<_>>(),
        vec![4],
        "9 tokens: 1 + 4 + 4, never past max_tokens"
    );
    outputs.extend(
        reports
            .iter()
            .flat_map(|r| r.tokens.iter().map(|t| t.token)),
    );
    assert_eq!(
        outputs,
        expected_outputs(7, 9),
        "the same text as without drafts"
    );
    let c = engine.counters();
    assert_eq!((c.draft_tokens_proposed, c.draft_tokens_accepted), (6, 6));
    assert_eq!((c.spec_rollbacks, c.generated_tokens), (0, 9));
    assert_eq!(engine.kv().used_blocks(), 0);
}

#[test]
fn at_zero_acceptance_a_decode_step_emits_one_token_and_rolls_back_every_draft() {
    // 47 prompt tokens: the drafts spill into a fourth block of 16.
    let mut engine = one_decoding(spec_config(3, 0.0), 47, 8);
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert_eq!(report.tokens.len(), 1);
    let seq = SeqId(0);
    assert_eq!(
        engine.device().log,
        vec![
            Effect::ReserveKv { seq, tokens: 51 },
            Effect::LaunchStep {
                shape: report.shape
            },
            Effect::ReadStepResult,
            Effect::RollbackOverrun {
                seq,
                keep_tokens: 48
            },
            Effect::SaveHiddenCatchup { seq, tokens: 48 },
        ]
    );
    assert_eq!(engine.kv().used_blocks(), 3, "the drafts' block went back");
    let c = engine.counters();
    assert_eq!((c.spec_rollbacks, c.spec_rollback_blocks), (1, 1));
    let reports = run_to_end(&mut engine);
    assert!(reports.iter().all(|r| r.tokens.len() == 1));
    let mut outputs = vec![
        synthetic_token(RequestId(7), 0, None),
        report.tokens[0].token,
    ];
    outputs.extend(
        reports
            .iter()
            .flat_map(|r| r.tokens.iter().map(|t| t.token)),
    );
    assert_eq!(outputs, expected_outputs(7, 8));
    let c = engine.counters();
    // Drafts shrink as max_tokens nears: 3, 3, 3, 3, 2, 1, then none.
    assert_eq!((c.draft_tokens_proposed, c.draft_tokens_accepted), (15, 0));
    assert_eq!(c.spec_rollbacks, 6);
    assert_eq!(engine.kv().used_blocks(), 0);
}

#[test]
fn acceptance_draws_are_deterministic_and_follow_the_rate() {
    let mut accepted = 0;
    for request in 0..2_000u128 {
        let k = accepted_drafts(RequestId(request), 5, 1, 0.7);
        assert_eq!(k, accepted_drafts(RequestId(request), 5, 1, 0.7));
        assert_eq!(accepted_drafts(RequestId(request), 5, 4, 1.0), 4);
        assert_eq!(accepted_drafts(RequestId(request), 5, 4, 0.0), 0);
        accepted += k;
    }
    assert!(
        (1_300..1_500).contains(&accepted),
        "{accepted} of 2000 at 0.7"
    );
}

#[test]
fn an_exhausted_over_run_falls_back_to_a_plain_step_if_one_position_fits() {
    let mut engine = one_decoding(spec_config(3, 1.0), 40, 9);
    engine.device_mut().exhaust_next = 1;
    let mut report = StepReport::default();
    engine.step(&mut report).unwrap();
    assert_eq!(report.tokens.len(), 1);
    let seq = SeqId(0);
    assert_eq!(
        engine.device().log[..2],
        [
            Effect::ReserveKv { seq, tokens: 44 },
            Effect::ReserveKv { seq, tokens: 41 },
        ]
    );
    assert_eq!(report.shape.draft_tokens, 0);
    assert!(
        !engine
            .device()
            .log
            .iter()
            .any(|e| matches!(e, Effect::SaveHiddenCatchup { .. })),
        "a plain step keeps no catch-up entry"
    );
    let c = engine.counters();
    assert_eq!((c.spec_fallbacks, c.kept_out), (1, 0));

    // Neither fits: the existing Exhausted rule.
    engine.device_mut().exhaust_next = 2;
    engine.step(&mut report).unwrap();
    assert!(report.tokens.is_empty());
    let c = engine.counters();
    assert_eq!((c.spec_fallbacks, c.kept_out), (2, 1));
}

#[test]
fn a_reserve_ahead_device_rolls_back_rejected_drafts_and_lookahead_without_a_leak() {
    let cfg = EngineConfig {
        block_size: 4,
        num_blocks: 64,
        ..spec_config(4, 0.5)
    };
    let mut engine = Engine::new(cfg, AheadDevice::new(TimingConfig::default(), 1)).unwrap();
    for id in 1..=4u128 {
        let base = id as u32 * 1_000;
        engine
            .add_request(request(id, (base..base + 10 + id as u32 * 3).collect(), 17))
            .unwrap();
    }
    let reports = run_to_end(&mut engine);
    for id in 1..=4u128 {
        let outputs: Vec<u32> = reports
            .iter()
            .flat_map(|r| r.tokens.iter())
            .filter(|t| t.request == RequestId(id))
            .map(|t| t.token)
            .collect();
        assert_eq!(outputs, expected_outputs(id, 17));
    }
    let c = engine.counters();
    assert!(c.spec_rollbacks > 0 && c.draft_tokens_accepted > 0);
    assert_eq!(engine.kv().used_blocks(), 0);
}

proptest::proptest! {
    /// Random acceptance rates, draft counts, lengths and dry
    /// reservations over a small pool: every request emits exactly its
    /// max_tokens, the text does not depend on the drafts, and no block
    /// is leaked by the rollbacks once all requests are done.
    #[test]
    fn speculative_decoding_leaks_no_block_and_emits_exactly_max_tokens(
        rate in 0.0f64..=1.0,
        drafts in 1u32..=6,
        requests in proptest::collection::vec((1u32..90, 1u32..40), 1..6),
        dry in proptest::collection::vec(0u32..3, 0..40),
    ) {
        let cfg = EngineConfig {
            block_size: 4,
            num_blocks: 48,
            max_num_batched_tokens: 64,
            ..spec_config(drafts, rate)
        };
        let mut engine = Engine::new(cfg, ScriptedDevice::new(TimingConfig::default())).unwrap();
        engine.device_mut().record = false;
        let start = engine.kv().used_blocks();
        for (i, &(len, max_tokens)) in requests.iter().enumerate() {
            let base = i as u32 * 1_000;
            engine.add_request(request(i as u128 + 1, (base..base + len).collect(), max_tokens)).unwrap();
        }
        let mut outputs: Vec<Vec<u32>> = vec![Vec::new(); requests.len()];
        let mut report = StepReport::default();
        let mut finished = 0;
        for round in 0..5_000 {
            if !engine.has_work() {
                break;
            }
            engine.device_mut().exhaust_next = dry.get(round).copied().unwrap_or(0);
            engine.step(&mut report).unwrap();
            for t in &report.tokens {
                let out = &mut outputs[t.request.0 as usize - 1];
                proptest::prop_assert_eq!(t.index as usize, out.len());
                out.push(t.token);
            }
            for f in &report.finished {
                proptest::prop_assert_eq!(f.output_tokens, requests[f.request.0 as usize - 1].1 as usize);
                finished += 1;
            }
        }
        proptest::prop_assert!(!engine.has_work(), "the engine drained");
        proptest::prop_assert_eq!(finished, requests.len());
        for (i, out) in outputs.iter().enumerate() {
            proptest::prop_assert_eq!(out, &expected_outputs(i as u128 + 1, requests[i].1));
        }
        proptest::prop_assert_eq!(engine.kv().used_blocks(), start);
        let c = engine.counters();
        proptest::prop_assert!(c.draft_tokens_accepted <= c.draft_tokens_proposed);
    }
}
