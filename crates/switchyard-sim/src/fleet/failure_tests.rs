//! Worker failures in the simulator: the requests a dead worker had take
//! the core's decision (retried, resumed, given up) as `serve`'s do.

use super::*;
use crate::workload::{PromptSpec, Turn};
use switchyard_core::dispatch::failure::MigrationPolicy;
use switchyard_core::select::PolicyKind;

fn one_turn(id: u64, arrival_ms: f64, prompt_tokens: u32, output_tokens: u32) -> Session {
    Session {
        id,
        arrival_ms,
        think_time_ms: 0.0,
        turns: vec![Turn {
            prompt: PromptSpec::Tokens(
                (0..prompt_tokens)
                    .map(|t| t + id as u32 * 10_000)
                    .collect::<Vec<_>>()
                    .into(),
            ),
            output_tokens,
            pause_ms: None,
            spawn: Vec::new(),
        }],
        flow: crate::workload::SessionFlow::default(),
    }
}

/// `n` one-turn requests every `gap_ms`, 200-token prompts, 50 tokens out.
fn steady(n: u64, gap_ms: f64) -> Vec<Session> {
    (0..n)
        .map(|i| one_turn(i, i as f64 * gap_ms, 200, 50))
        .collect()
}

fn fleet(workers: usize, failures: Vec<WorkerFailure>) -> FleetConfig {
    let mut config = FleetConfig {
        workers,
        failures,
        ..FleetConfig::default()
    };
    config.engine.timing.speedup = 1.0;
    config.router.policy = PolicyKind::Ttft;
    config
}

fn run(config: &FleetConfig, list: Vec<Session>) -> PolicyReport {
    simulate(config, Box::new(list.into_iter().map(Ok)), |_| {})
        .unwrap()
        .report
}

fn down(at_ms: f64, worker: usize, down_ms: Option<f64>) -> WorkerFailure {
    WorkerFailure {
        at_ms,
        worker,
        down_ms,
    }
}

#[test]
fn a_worker_that_dies_under_load_loses_no_request_the_core_lets_move() {
    let config = fleet(2, vec![down(150.0, 0, None)]);
    let r = run(&config, steady(40, 10.0));
    let f = r.failures.expect("counted");
    assert!(f.resumed > 0, "streams under way were resumed: {f:?}");
    assert!(f.failed_attempts >= f.resumed + f.retried, "{f:?}");
    assert_eq!(f.gave_up, 0, "one failure each is within the limits");
    assert_eq!((r.completed, r.errors), (40, 0));
    // A resumed stream's answer is counted whole, once.
    let output = r.output_tokens_per_sec * r.makespan_s;
    assert!((output - 40.0 * 50.0).abs() < 1e-6, "{output}");
}

#[test]
fn a_resumed_stream_keeps_its_first_token_and_its_client_sees_the_gap() {
    let request = || vec![one_turn(0, 0.0, 200, 100)];
    let calm = run(&fleet(2, Vec::new()), request());
    assert_eq!(calm.failures, None, "no failures, no figures");
    // Its worker dies after its first token (about 20 ms) and before its
    // last (about 600 ms); the other worker's death changes nothing.
    let (hit, missed): (Vec<_>, Vec<_>) = [0, 1]
        .map(|w| run(&fleet(2, vec![down(100.0, w, None)]), request()))
        .into_iter()
        .partition(|r| r.failures.as_ref().is_some_and(|f| f.resumed == 1));
    let (hit, missed) = (&hit[0], &missed[0]);
    assert_eq!(missed.failures.as_ref().map(|f| f.failed_attempts), Some(0));
    assert_eq!(
        (missed.ttft_ms.mean, missed.e2e_ms.mean),
        (calm.ttft_ms.mean, calm.e2e_ms.mean)
    );
    assert_eq!(hit.completed, 1);
    assert_eq!(
        hit.ttft_ms.mean, calm.ttft_ms.mean,
        "the client's first token stands"
    );
    assert!(
        hit.e2e_ms.mean > calm.e2e_ms.mean,
        "the resume re-prefills prompt and generated tokens: {} against {}",
        hit.e2e_ms.mean,
        calm.e2e_ms.mean
    );
    assert!(
        hit.itl_ms.mean > calm.itl_ms.mean,
        "one long gap between tokens"
    );
}

#[test]
fn requests_placed_on_a_dead_worker_are_refused_and_moved_until_its_circuit_opens() {
    // Down before anything arrives: nothing runs there, every placement
    // on it is a refused connection, and it counts toward no worker limit.
    let config = fleet(3, vec![down(0.0, 1, None)]);
    let r = run(&config, steady(30, 20.0));
    let f = r.failures.expect("counted");
    assert!(f.failed_attempts > 0, "{f:?}");
    assert_eq!(
        f.retried, f.failed_attempts,
        "each refused one moved: {f:?}"
    );
    assert_eq!((f.resumed, f.gave_up), (0, 0));
    assert_eq!((r.completed, r.errors), (30, 0));
    assert!(
        f.failed_attempts <= u64::from(config.dispatcher(0).circuit.failure_threshold) + 1,
        "the circuit opens and the router stops choosing it: {f:?}"
    );
}

#[test]
fn with_migration_off_every_request_a_failure_hits_ends_in_an_error() {
    let mut config = fleet(2, vec![down(150.0, 0, None)]);
    config.migration = MigrationPolicy {
        limit: 0,
        ..MigrationPolicy::default()
    };
    let r = run(&config, steady(40, 10.0));
    let f = r.failures.expect("counted");
    assert!(f.gave_up > 0);
    assert_eq!(
        f.gave_up_by_reason.into_iter().collect::<Vec<_>>(),
        [("limit", f.gave_up)]
    );
    assert_eq!((f.retried, f.resumed), (0, 0));
    assert_eq!(f.gave_up, f.failed_attempts);
    assert_eq!(r.errors, f.gave_up);
    assert_eq!(r.completed + r.errors, 40);
}

#[test]
fn a_worker_back_up_serves_again() {
    let config = fleet(2, vec![down(100.0, 0, Some(200.0))]);
    // Arrivals go on for 20 s, well past the breaker's cooldown.
    let out = simulate(
        &config,
        Box::new(steady(200, 100.0).into_iter().map(Ok)),
        |_| {},
    )
    .unwrap();
    assert_eq!((out.report.completed, out.report.errors), (200, 0));
    let tokens = &out.timeline.tokens[0];
    let bucket = out.timeline.bucket_ms;
    let late: u64 = tokens
        .iter()
        .enumerate()
        .filter(|(i, _)| *i as f64 * bucket >= 10_000.0)
        .map(|(_, t)| t)
        .sum();
    assert!(late > 0, "worker 0 computes again after its restart");
}

#[test]
fn a_run_with_failures_is_a_pure_function_of_its_configuration() {
    let config = fleet(3, vec![down(120.0, 0, Some(500.0)), down(300.0, 2, None)]);
    assert_eq!(
        run(&config, steady(60, 10.0)),
        run(&config, steady(60, 10.0))
    );
}

#[test]
fn failures_the_fleet_cannot_have_are_refused_with_why() {
    let refused =
        |config: &FleetConfig| match simulate(config, Box::new(std::iter::empty()), |_| {}) {
            Err(SimError::Failures(why)) => why,
            other => panic!("{:?}", other.map(|o| o.report)),
        };
    assert!(refused(&fleet(2, vec![down(0.0, 2, None)])).contains("the fleet has 2"));
    assert!(refused(&fleet(2, vec![down(-1.0, 0, None)])).contains(">= 0"));
    assert!(refused(&fleet(2, vec![down(0.0, 0, Some(0.0))])).contains("> 0"));
    let mut disagg = fleet(2, vec![down(0.0, 0, None)]);
    disagg.disagg = Some(DisaggConfig {
        prefill_workers: 1,
        ..DisaggConfig::default()
    });
    assert!(refused(&disagg).contains("disaggregation"));
}

#[test]
fn a_failure_reads_as_at_seconds_worker_and_time_down() {
    assert_eq!(WorkerFailure::parse("30:2"), Ok(down(30_000.0, 2, None)));
    assert_eq!(
        WorkerFailure::parse("1.5:0:10"),
        Ok(down(1_500.0, 0, Some(10_000.0)))
    );
    for bad in [
        "", "30", "x:1", "30:-1", "30:1:y", "-2:1", "1:2:3:4", "nan:1",
    ] {
        assert!(WorkerFailure::parse(bad).is_err(), "{bad:?}");
    }
}
