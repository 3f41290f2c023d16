//! The fleet simulator with one router replica reproduces, figure for
//! figure, the single-router simulator it grew out of.
//!
//! `tests/fixtures/single_router_golden.json` was written by the single-router
//! simulator (before replicas existed) for these exact workloads and seeds.
//! Regenerate it only for an intended behaviour change:
//! `SWITCHYARD_BLESS=1 cargo test -p switchyard-sim --test it single_router_golden`.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::BufReader;
use std::path::PathBuf;
use switchyard_core::admission::SessionAwareConfig;
use switchyard_core::select::PolicyKind;
use switchyard_sim::fleet::{simulate, FleetConfig};
use switchyard_sim::replicas::ReplicasConfig;
use switchyard_sim::workload::{self, SessionStream, SyntheticConfig, WorkloadLimits};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn mooncake(requests: usize) -> SessionStream {
    let path = root().join("../../data/traces/mooncake_conversation.jsonl");
    let file = File::open(&path).expect("the bundled Mooncake trace");
    workload::limited(
        workload::mooncake(BufReader::new(file), 3_000.0),
        WorkloadLimits {
            rate_scale: 28.0,
            max_sessions: Some(requests),
            ..WorkloadLimits::default()
        },
    )
}

fn synthetic(seed: u64) -> SessionStream {
    workload::synthetic(SyntheticConfig {
        seed,
        sessions: 40,
        sessions_per_sec: 20.0,
        think_time_ms: 100.0,
        ..SyntheticConfig::default()
    })
}

/// The replay command's default fleet: 8 workers, 64-token blocks.
fn replay_fleet(policy: PolicyKind, seed: u64) -> FleetConfig {
    let mut fleet = FleetConfig::default();
    fleet.engine.block_size = 64;
    fleet.engine.num_blocks = 16_384;
    fleet.engine.max_model_len = 1 << 20;
    fleet.engine.timing.speedup = 4.0;
    fleet.router.policy = policy;
    fleet.router.seed = seed;
    fleet
}

fn small_fleet(policy: PolicyKind, seed: u64, session_aware: bool) -> FleetConfig {
    let mut fleet = FleetConfig {
        workers: 3,
        session_aware: session_aware.then(SessionAwareConfig::default),
        ..FleetConfig::default()
    };
    fleet.engine.timing.speedup = 1.0;
    fleet.router.policy = policy;
    fleet.router.seed = seed;
    fleet
}

fn run_all() -> BTreeMap<String, serde_json::Value> {
    let mut out = BTreeMap::new();
    let mut record = |name: String, mut fleet: FleetConfig, workload: SessionStream| {
        fleet.replicas = ReplicasConfig {
            count: 1,
            ..ReplicasConfig::default()
        };
        let outcome = simulate(&fleet, workload, |_| {}).expect("simulates");
        out.insert(
            name,
            serde_json::to_value(&outcome.report).expect("serializes"),
        );
    };
    for policy in [
        PolicyKind::Kv,
        PolicyKind::RoundRobin,
        PolicyKind::CacheAware,
    ] {
        record(
            format!("mooncake-300/{}", policy.name()),
            replay_fleet(policy, 0),
            mooncake(300),
        );
    }
    for (policy, seed) in [
        (PolicyKind::Kv, 11),
        (PolicyKind::PowerOfTwo, 11),
        (PolicyKind::LeastLoaded, 3),
    ] {
        record(
            format!("synthetic/{}/seed-{seed}", policy.name()),
            small_fleet(policy, seed, false),
            synthetic(seed),
        );
    }
    record(
        "synthetic/kv+session/seed-5".into(),
        small_fleet(PolicyKind::Kv, 5, true),
        synthetic(5),
    );
    out
}

#[test]
fn one_replica_reproduces_the_single_router_simulator() {
    let path = root().join("tests/fixtures/single_router_golden.json");
    let figures = run_all();
    if std::env::var_os("SWITCHYARD_BLESS").is_some() {
        let text = serde_json::to_string_pretty(&figures).expect("serializes");
        std::fs::write(&path, text + "\n").expect("writes the fixture");
        return;
    }
    // Compared as text: the JSON writer prints every f64 exactly (shortest
    // round-trip form), while parsing it back may move the last digit.
    let golden = std::fs::read_to_string(&path).expect("the golden fixture");
    for (name, figures) in &figures {
        let line = serde_json::to_string(figures).expect("serializes");
        let expected = golden_entry(&golden, name);
        assert_eq!(
            line, expected,
            "{name} differs from the single-router figures"
        );
    }
    assert_eq!(golden.matches("\"completed\"").count(), figures.len());
}

/// One workload's figures from the fixture, compacted to one line.
fn golden_entry(golden: &str, name: &str) -> String {
    let key = format!("  \"{name}\": ");
    let start = golden
        .find(&key)
        .unwrap_or_else(|| panic!("{name} is missing from the fixture"))
        + key.len();
    let end = start + golden[start..].find("\n  }").expect("an object ends") + 4;
    golden[start..end]
        .lines()
        .map(str::trim)
        .collect::<Vec<_>>()
        .join("")
        .replace("\": ", "\":")
}
