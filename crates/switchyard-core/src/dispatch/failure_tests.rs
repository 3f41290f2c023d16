//! What a failed attempt becomes: the decision's rules one by one, the
//! history across attempts, and `Progress` against a naive model.

use super::*;
use proptest::prelude::*;

const POLICY: MigrationPolicy = MigrationPolicy {
    limit: 3,
    max_seq_len: 1_000,
    max_workers: 2,
};

fn attempt(reason: Failure, phase: Phase, progress: &Progress) -> AttemptFailure<'_> {
    AttemptFailure {
        reason,
        phase,
        prompt_tokens: 100,
        progress,
        resumable: Ok(()),
    }
}

#[test]
fn a_reset_before_the_first_token_moves_the_request_and_reports_the_worker() {
    let mut history = FailureHistory::default();
    let none = Progress::default();
    let failed = history.fail(
        POLICY,
        attempt(Failure::Reset, Phase::BeforeFirstToken, &none),
    );
    assert_eq!(
        failed,
        Failed {
            report_worker: true,
            verdict: Verdict::Migrate
        }
    );
    assert_eq!(history.migrations(), 1);
    assert_eq!(history.take_pending(), Some(Failure::Reset));
    assert_eq!(history.take_pending(), None, "counted once");
}

#[test]
fn a_second_suspect_failure_is_the_requests_fault_and_reports_nobody() {
    let mut history = FailureHistory::default();
    let none = Progress::default();
    let first = history.fail(
        POLICY,
        attempt(Failure::Status5xx, Phase::BeforeFirstToken, &none),
    );
    assert_eq!(first.verdict, Verdict::Migrate);
    let second = history.fail(
        POLICY,
        attempt(Failure::Timeout, Phase::BeforeFirstToken, &none),
    );
    assert_eq!(
        second,
        Failed {
            report_worker: false,
            verdict: Verdict::GiveUp(GiveUp::RequestFault)
        }
    );
    assert!(
        !history.timeout_reported(true),
        "a timeout after a suspect failure is the request's too"
    );
}

#[test]
fn refused_connections_do_not_count_against_the_worker_limit() {
    let mut history = FailureHistory::default();
    let none = Progress::default();
    for _ in 0..2 {
        let failed = history.fail(
            POLICY,
            attempt(Failure::Connect, Phase::BeforeFirstToken, &none),
        );
        assert_eq!(failed.verdict, Verdict::Migrate);
    }
    // Two reached workers end it, whatever the migration limit.
    let policy = MigrationPolicy {
        limit: 10,
        ..POLICY
    };
    assert_eq!(
        history
            .fail(
                policy,
                attempt(Failure::Reset, Phase::BeforeFirstToken, &none)
            )
            .verdict,
        Verdict::Migrate
    );
    assert_eq!(
        history
            .fail(
                policy,
                attempt(Failure::Reset, Phase::BeforeFirstToken, &none)
            )
            .verdict,
        Verdict::GiveUp(GiveUp::WorkerLimit { workers: 2 })
    );
}

#[test]
fn the_migration_limit_ends_a_request_and_zero_means_none() {
    let none = Progress::default();
    let off = MigrationPolicy { limit: 0, ..POLICY };
    let failed = FailureHistory::default().fail(
        off,
        attempt(Failure::Connect, Phase::BeforeFirstToken, &none),
    );
    assert_eq!(
        failed,
        Failed {
            report_worker: true,
            verdict: Verdict::GiveUp(GiveUp::LimitReached { limit: 0 })
        }
    );
}

#[test]
fn a_broken_stream_resumes_only_within_the_length_limit_and_when_reproducible() {
    let mut progress = Progress::new(1 << 10);
    for _ in 0..950 {
        progress.observe(None, Some(&[7]), false);
    }
    let mut history = FailureHistory::default();
    // 100 prompt + 950 generated > 1,000.
    assert_eq!(
        history
            .fail(
                POLICY,
                attempt(Failure::MidStream, Phase::MidStream, &progress)
            )
            .verdict,
        Verdict::GiveUp(GiveUp::TooLong {
            len: 1_050,
            max: 1_000
        })
    );
    let short = Progress::default();
    let refused = AttemptFailure {
        resumable: Err("it uses tools"),
        ..attempt(Failure::MidStream, Phase::MidStream, &short)
    };
    assert_eq!(
        FailureHistory::default().fail(POLICY, refused).verdict,
        Verdict::GiveUp(GiveUp::NotResumable("it uses tools"))
    );
    // Before the first token the client's own request is retried: the
    // body's reproducibility does not matter.
    let before = AttemptFailure {
        phase: Phase::BeforeFirstToken,
        ..refused
    };
    assert_eq!(
        FailureHistory::default().fail(POLICY, before).verdict,
        Verdict::Migrate
    );
}

#[test]
fn an_overflowed_progress_is_not_resumable() {
    let mut progress = Progress::bounded(8, 2);
    progress.observe(None, Some(&[1, 2, 3]), false);
    assert!(progress.overflowed());
    assert_eq!(
        FailureHistory::default()
            .fail(
                POLICY,
                attempt(Failure::MidStream, Phase::MidStream, &progress)
            )
            .verdict,
        Verdict::GiveUp(GiveUp::NotResumable(
            "the generated text outgrew what the router keeps"
        ))
    );
}

#[test]
fn a_timeout_is_the_workers_only_when_it_had_the_request_long_enough() {
    let history = FailureHistory::default();
    assert!(history.timeout_reported(true));
    assert!(!history.timeout_reported(false));
}

#[test]
fn every_label_is_distinct_and_indexes_its_own_reason() {
    for (i, f) in Failure::ALL.iter().enumerate() {
        assert_eq!(f.index(), i);
    }
    let labels: std::collections::HashSet<_> = Failure::ALL.iter().map(|f| f.label()).collect();
    assert_eq!(labels.len(), Failure::ALL.len());
    let give_ups = [
        GiveUp::LimitReached { limit: 1 },
        GiveUp::TooLong { len: 2, max: 1 },
        GiveUp::NotResumable("x"),
        GiveUp::RequestFault,
        GiveUp::WorkerLimit { workers: 2 },
    ];
    for (i, g) in give_ups.iter().enumerate() {
        assert_eq!(g.index(), i);
        assert_eq!(g.label(), GiveUp::LABELS[i]);
        assert!(!g.to_string().is_empty());
    }
}

/// One chunk a stream may carry.
#[derive(Debug, Clone)]
enum Chunk {
    Ids(Vec<u32>),
    Text(String),
}

fn chunk() -> impl Strategy<Value = Chunk> {
    prop_oneof![
        proptest::collection::vec(0u32..50, 0..4).prop_map(Chunk::Ids),
        "[a-c]{0,5}".prop_map(Chunk::Text),
    ]
}

proptest! {
    /// `Progress` keeps what a naive model keeps (every id and every
    /// text piece in order) until a bound is passed; from then on it
    /// keeps nothing, and it counts a token per id and per non-empty text
    /// chunk either way.
    #[test]
    fn progress_keeps_what_a_naive_model_keeps_until_a_bound(
        chunks in proptest::collection::vec(chunk(), 0..40),
        text_cap in 0usize..24,
        max_ids in proptest::option::of(0usize..24),
    ) {
        let mut progress = match max_ids {
            Some(max) => Progress::bounded(text_cap, max),
            None => Progress::new(text_cap),
        };
        let (mut ids, mut text, mut generated, mut over) = (Vec::new(), String::new(), 0u64, false);
        for c in &chunks {
            match c {
                Chunk::Ids(new) if !new.is_empty() => {
                    progress.observe(None, Some(new), false);
                    generated += new.len() as u64;
                    if max_ids.is_some_and(|m| ids.len() + new.len() > m) {
                        over = true;
                    }
                    if !over {
                        ids.extend_from_slice(new);
                    }
                }
                Chunk::Ids(_) => progress.observe(None, Some(&[]), false),
                Chunk::Text(t) => {
                    progress.observe(Some(t), None, false);
                    if !t.is_empty() {
                        generated += 1;
                        if text.len() + t.len() > text_cap {
                            over = true;
                        }
                        if !over {
                            text.push_str(t);
                        }
                    }
                }
            }
        }
        prop_assert_eq!(progress.generated, generated);
        prop_assert_eq!(progress.overflowed(), over);
        if over {
            prop_assert!(progress.ids().is_empty());
            prop_assert_eq!(progress.take_pending_text(), "");
        } else {
            prop_assert_eq!(progress.ids(), &ids[..]);
            prop_assert_eq!(progress.take_pending_text(), text);
        }
    }
}

/// [`decide`] itself, one rule at a time (moved from the server with the
/// decision).
mod decide_specs {
    use super::super::*;

    const POLICY: MigrationPolicy = MigrationPolicy {
        limit: 3,
        max_seq_len: 100,
        max_workers: 10,
    };

    #[test]
    fn a_request_migrates_until_its_limit() {
        let p = Progress::new(64);
        for done in 0..3 {
            assert_eq!(
                decide(POLICY, done, 1, Phase::BeforeFirstToken, 10, &p, Ok(())),
                Verdict::Migrate
            );
        }
        assert_eq!(
            decide(POLICY, 3, 1, Phase::MidStream, 10, &p, Ok(())),
            Verdict::GiveUp(GiveUp::LimitReached { limit: 3 })
        );
        let off = MigrationPolicy { limit: 0, ..POLICY };
        assert!(matches!(
            decide(off, 0, 1, Phase::BeforeFirstToken, 10, &p, Ok(())),
            Verdict::GiveUp(_)
        ));
    }

    #[test]
    fn a_stream_longer_than_the_sequence_limit_is_not_resumed() {
        let mut p = Progress::new(64);
        for _ in 0..11 {
            p.observe(None, Some(&[1]), false);
        }
        assert_eq!(
            decide(POLICY, 0, 1, Phase::MidStream, 90, &p, Ok(())),
            Verdict::GiveUp(GiveUp::TooLong { len: 101, max: 100 })
        );
        // Before the first token the sequence limit does not apply.
        assert_eq!(
            decide(
                POLICY,
                0,
                1,
                Phase::BeforeFirstToken,
                200,
                &Progress::new(8),
                Ok(())
            ),
            Verdict::Migrate
        );
    }

    #[test]
    fn a_request_that_cannot_be_resumed_gives_up_mid_stream_only() {
        let p = Progress::new(64);
        let why: Result<(), &str> = Err("it asks for several choices");
        assert!(matches!(
            decide(POLICY, 0, 1, Phase::MidStream, 1, &p, why),
            Verdict::GiveUp(GiveUp::NotResumable(_))
        ));
        assert_eq!(
            decide(POLICY, 0, 1, Phase::BeforeFirstToken, 1, &p, why),
            Verdict::Migrate,
            "before the first token the request is retried as it came"
        );
    }

    #[test]
    fn a_request_is_not_sent_to_more_workers_than_the_limit() {
        let policy = MigrationPolicy {
            max_workers: 2,
            ..POLICY
        };
        let p = Progress::new(64);
        assert_eq!(
            decide(policy, 0, 1, Phase::BeforeFirstToken, 1, &p, Ok(())),
            Verdict::Migrate
        );
        for phase in [Phase::BeforeFirstToken, Phase::MidStream] {
            assert_eq!(
                decide(policy, 1, 2, phase, 1, &p, Ok(())),
                Verdict::GiveUp(GiveUp::WorkerLimit { workers: 2 }),
                "{phase:?}"
            );
        }
        // Refused connections (the worker never had the prompt) do not
        // count: migrations beyond the worker limit are still allowed.
        assert_eq!(
            decide(policy, 2, 1, Phase::BeforeFirstToken, 1, &p, Ok(())),
            Verdict::Migrate
        );
        assert!(!Failure::Connect.reached_worker());
        for reason in [
            Failure::Reset,
            Failure::Status5xx,
            Failure::Timeout,
            Failure::MidStream,
        ] {
            assert!(reason.reached_worker(), "{reason:?}");
        }
        let why = GiveUp::WorkerLimit { workers: 2 }.to_string();
        assert!(why.contains("failed on 2 workers"), "{why}");
        assert_eq!(GiveUp::WorkerLimit { workers: 2 }.label(), "worker_limit");
        assert_eq!(GiveUp::NotResumable("x").label(), "not_resumable");
    }

    #[test]
    fn progress_counts_ids_and_text_chunks_and_bounds_text() {
        let mut p = Progress::new(8);
        p.observe(Some(" a"), None, false);
        p.observe(Some(""), None, false);
        p.observe(Some(" b"), Some(&[7, 8]), false);
        assert_eq!(p.generated, 3);
        assert_eq!(p.ids(), &[7, 8]);
        assert_eq!(p.take_pending_text(), " a");
        p.observe(Some("123456789"), None, true);
        assert!(p.finished);
        assert!(matches!(
            decide(POLICY, 0, 1, Phase::MidStream, 1, &p, Ok(())),
            Verdict::GiveUp(GiveUp::NotResumable(_))
        ));
    }

    #[test]
    fn ids_past_the_sequence_limit_are_not_kept_and_the_stream_is_not_resumable() {
        // Prompt of 90 under a limit of 100: at most 10 generated ids.
        let mut p = Progress::bounded(64, 10);
        for _ in 0..10 {
            p.observe(None, Some(&[1]), false);
        }
        assert!(!p.overflowed());
        assert_eq!(p.ids().len(), 10);
        p.observe(None, Some(&[2, 3]), false);
        assert!(p.overflowed(), "the eleventh id passes the bound");
        assert!(p.ids().is_empty(), "what was kept is freed");
        p.observe(None, Some(&[4]), false);
        assert!(p.ids().is_empty(), "nothing more is recorded");
        assert_eq!(p.generated, 13, "generated tokens are still counted");
        assert_eq!(
            decide(POLICY, 0, 1, Phase::MidStream, 90, &p, Ok(())),
            Verdict::GiveUp(GiveUp::TooLong { len: 103, max: 100 })
        );
    }

    #[test]
    fn worker_sent_counts_never_overflow() {
        let mut p = Progress::new(8);
        p.generated = u64::MAX;
        p.observe(None, Some(&[1]), false);
        p.observe(Some("x"), None, false);
        assert_eq!(p.generated, u64::MAX);
        assert!(matches!(
            decide(POLICY, 0, 1, Phase::MidStream, u64::MAX, &p, Ok(())),
            Verdict::GiveUp(GiveUp::TooLong { .. })
        ));
    }

    #[test]
    fn a_second_failure_the_request_may_cause_is_the_requests_fault() {
        // The first 5xx or timeout may be the worker's: it is reported.
        assert!(!request_fault(Failure::Status5xx, 0));
        assert!(!request_fault(Failure::Timeout, 0));
        // The second, on another worker, is taken to be the request's.
        assert!(request_fault(Failure::Status5xx, 1));
        assert!(request_fault(Failure::Timeout, 1));
        // Refused and broken connections are always the worker's.
        for reason in [Failure::Connect, Failure::Reset, Failure::MidStream] {
            assert!(!request_fault(reason, 5), "{reason:?}");
        }
    }

    #[test]
    fn a_stream_keeps_what_its_sequence_limit_leaves_room_for() {
        let p = Progress::within_sequence(1_000, 600);
        assert_eq!(p.text_cap(), 32_000, "32 bytes a token of the limit");
        let mut p = p;
        p.extend_ids(&vec![7; 400]);
        assert!(!p.overflowed(), "the limit less the prompt fits");
        p.extend_ids(&[7]);
        assert!(p.overflowed(), "one more id cannot resume");
        // A prompt past the limit keeps no ids; nothing overflows a count.
        assert!(Progress::within_sequence(10, 20).text_cap() == 320);
        assert_eq!(
            Progress::within_sequence(u64::MAX, 0).text_cap(),
            usize::MAX
        );
    }
}
