//! Session-aware admission in the fleet.

use super::*;
use crate::workload::{synthetic, SyntheticConfig};
use switchyard_core::admission::SessionAwareConfig;
use switchyard_core::select::PolicyKind;

fn config(session_aware: bool) -> FleetConfig {
    let mut config = FleetConfig {
        workers: 4,
        session_aware: session_aware.then(SessionAwareConfig::default),
        ..FleetConfig::default()
    };
    config.engine.timing.speedup = 4.0;
    config.router.policy = PolicyKind::Kv;
    config
}

fn workload() -> SessionStream {
    synthetic(SyntheticConfig {
        sessions: 60,
        sessions_per_sec: 10.0,
        think_time_ms: 200.0,
        ..Default::default()
    })
}

#[test]
fn session_aware_admission_completes_every_turn_and_ends() {
    let out = simulate(&config(true), workload(), |_| {}).unwrap();
    let expected: u64 = workload().map(|s| s.unwrap().turns.len() as u64).sum();
    assert_eq!(out.report.completed, expected);
    assert_eq!(out.report.errors, 0);
    assert_eq!(out.report.sessions_completed, 60);
}

#[test]
fn session_aware_admission_is_deterministic() {
    let run =
        || serde_json::to_string(&simulate(&config(true), workload(), |_| {}).unwrap()).unwrap();
    assert_eq!(run(), run());
}

#[test]
fn sticking_sessions_to_their_worker_keeps_their_prefix_cached() {
    let with = simulate(&config(true), workload(), |_| {}).unwrap().report;
    let mut rr = config(false);
    rr.router.policy = PolicyKind::RoundRobin;
    let without = simulate(&rr, workload(), |_| {}).unwrap().report;
    assert!(
        with.hit_rate > without.hit_rate,
        "session-aware kv {} vs round-robin {}",
        with.hit_rate,
        without.hit_rate
    );
}

fn in_band(stream: SessionStream, band: u8) -> SessionStream {
    Box::new(stream.map(move |s| {
        s.map(|mut s| {
            s.flow.band = Some(switchyard_core::admission::Band(band));
            s
        })
    }))
}

/// One worker that is busy early: requests wait unless they are shed.
fn flooded() -> (FleetConfig, SessionStream) {
    let mut config = FleetConfig {
        workers: 1,
        ..FleetConfig::default()
    };
    config.router.busy_threshold = Some(0.05);
    let stream = synthetic(SyntheticConfig {
        sessions: 40,
        sessions_per_sec: 200.0,
        think_time_ms: 10.0,
        ..Default::default()
    });
    (config, stream)
}

#[test]
fn a_sheddable_band_on_a_busy_fleet_is_shed_and_recorded_not_failed() {
    let (config, stream) = flooded();
    let out = simulate(&config, in_band(stream, 2), |_| {}).unwrap();
    assert!(!out.shed.is_empty(), "a flooded fleet sheds");
    assert_eq!(out.report.errors, 0, "a shed request is not an error");
    for s in &out.shed {
        assert_eq!(s.band, switchyard_core::admission::Band(2));
        assert_eq!(s.reason, switchyard_core::admission::ShedReason::Overload);
    }
    assert!(out.report.completed > 0, "what a worker took completes");
    // The same load in the standard band waits instead: nothing is shed.
    let (config, stream) = flooded();
    let out = simulate(&config, in_band(stream, 1), |_| {}).unwrap();
    assert!(out.shed.is_empty());
    assert_eq!(out.report.sessions_completed, 40);
}
