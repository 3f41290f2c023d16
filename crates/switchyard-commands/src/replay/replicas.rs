//! `switchyard replay --replicas 1,2,4`: how routing quality degrades when
//! several router replicas share one fleet and learn of each other's
//! bookings late, or never.
//!
//! For each policy (default: `kv`) and each replica count, one simulation
//! per sync setting: one replica (sync is moot), then, for more, sync on at
//! each `--sync-delay-ms` and sync off. Same workload, fleet and seed
//! throughout. The model (per-replica routing cores, the load balancer, what
//! a delay means) is `switchyard_sim::replicas`.

use super::{references, run_all, AdmissionChoice, ReplayArgs, WorkloadSource};
use crate::stats::write_json;
use serde::Serialize;
use std::time::Instant;
use switchyard_core::admission::SessionAwareConfig;
use switchyard_core::select::PolicyKind;
use switchyard_sim::fleet::{FleetConfig, SimOutcome};
use switchyard_sim::replicas::{Balance, ReplicaStats, ReplicasConfig};
use switchyard_sim::report::{Latency, PolicyReport};

/// Which sync settings to run for more than one replica.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum SyncChoice {
    /// Sync on, at each delay.
    On,
    /// Sync off.
    Off,
    /// Both.
    Both,
}

/// How the load balancer spreads requests over replicas.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum BalanceChoice {
    /// Each request to the next replica.
    RoundRobin,
    /// Each request to a random replica (seeded).
    Random,
}

/// One simulation's figures.
#[derive(Debug, Serialize)]
pub struct ReplicaRun {
    /// Policy name.
    pub policy: String,
    /// Router replicas.
    pub replicas: usize,
    /// Whether replicas shared bookings (always true for one replica).
    pub sync: bool,
    /// Delay of shared bookings (null without sync or with one replica).
    pub sync_delay_ms: Option<f64>,
    /// Time to first token.
    pub ttft_ms: Latency,
    /// Engine prefix hit rate.
    pub hit_rate: f64,
    /// Per-worker load imbalance (coefficient of variation of tokens computed).
    pub load_cv: f64,
    /// Replica view error and placement excess.
    pub replica_stats: ReplicaStats,
    /// Every figure of the run.
    pub report: PolicyReport,
}

/// The JSON report of `replay --replicas`.
#[derive(Debug, Serialize)]
pub struct ReplicaReport {
    /// The trace replayed.
    pub trace: String,
    /// Requests per simulation.
    pub requests: u64,
    /// Wall-clock seconds of the whole run.
    pub wall_seconds: f64,
    /// One entry per simulation, in table order.
    pub runs: Vec<ReplicaRun>,
    /// The fleet (replica settings vary per run).
    pub fleet: FleetConfig,
    /// The arguments.
    pub args: ReplayArgs,
}

/// The simulations `args` asks for: name, fleet, and the run's key.
fn variants(args: &ReplayArgs, fleet: &FleetConfig) -> anyhow::Result<Vec<(String, FleetConfig)>> {
    anyhow::ensure!(
        args.replicas.iter().all(|&n| n >= 1),
        "--replicas counts must be at least 1"
    );
    anyhow::ensure!(
        args.sync_delay_ms
            .iter()
            .all(|d| d.is_finite() && *d >= 0.0),
        "--sync-delay-ms must be finite and >= 0"
    );
    anyhow::ensure!(
        !args.sync_delay_ms.is_empty() || args.replica_sync == SyncChoice::Off,
        "--sync-delay-ms needs at least one value with sync on"
    );
    let session_aware = match args.admission {
        AdmissionChoice::None => false,
        AdmissionChoice::SessionAware => true,
        AdmissionChoice::Both => {
            anyhow::bail!("--replicas takes --admission none or session-aware, not both")
        }
    };
    let policies = if args.policies.is_empty() {
        vec![PolicyKind::Kv]
    } else {
        args.policies.clone()
    };
    let balance = match args.replica_balance {
        BalanceChoice::RoundRobin => Balance::RoundRobin,
        BalanceChoice::Random => Balance::Random,
    };
    let mut out = Vec::new();
    for &policy in &policies {
        for &count in &args.replicas {
            let mut settings = Vec::new();
            if count == 1 {
                settings.push((true, args.sync_delay_ms.first().copied().unwrap_or(0.0)));
            } else {
                if args.replica_sync != SyncChoice::Off {
                    settings.extend(args.sync_delay_ms.iter().map(|&d| (true, d)));
                }
                if args.replica_sync != SyncChoice::On {
                    settings.push((false, 0.0));
                }
            }
            for (sync, delay) in settings {
                let mut f = fleet.clone();
                f.router.policy = policy;
                f.session_aware = session_aware.then(SessionAwareConfig::default);
                f.replicas = ReplicasConfig {
                    count,
                    sync,
                    sync_delay_ms: delay,
                    balance,
                };
                f.replicas.validate()?;
                let name = format!(
                    "{}{} ×{count} {}",
                    policy.name(),
                    if session_aware { "+session" } else { "" },
                    sync_label(count, sync, delay)
                );
                out.push((name, f));
            }
        }
    }
    Ok(out)
}

fn sync_label(count: usize, sync: bool, delay: f64) -> String {
    match (count, sync) {
        (1, _) => "-".to_owned(),
        (_, true) => format!("{delay} ms"),
        (_, false) => "off".to_owned(),
    }
}

/// Runs `switchyard replay --replicas ...`.
pub fn run(args: &ReplayArgs, source: &WorkloadSource, fleet: &FleetConfig) -> anyhow::Result<()> {
    let started = Instant::now();
    let fleets = variants(args, fleet)?;
    let trace = super::workload_name(args);
    if !args.quiet {
        eprintln!(
            "replaying {trace} on {} workers, rate ×{}, {} simulations (replicas {:?}, sync delay {:?} ms)",
            fleet.workers,
            args.rate_scale(),
            fleets.len(),
            args.replicas,
            args.sync_delay_ms
        );
    }
    let (requests, _) = references(args, source, fleet)?;
    let keys: Vec<(String, usize, bool, f64)> = fleets
        .iter()
        .map(|(_, f)| {
            (
                format!(
                    "{}{}",
                    f.router.policy.name(),
                    if f.session_aware.is_some() {
                        "+session"
                    } else {
                        ""
                    }
                ),
                f.replicas.count,
                f.replicas.sync,
                f.replicas.sync_delay_ms,
            )
        })
        .collect();
    let outcomes = run_all(args, source, fleets, Some(requests))?;
    let runs: Vec<ReplicaRun> = keys
        .into_iter()
        .zip(outcomes)
        .map(|((policy, replicas, sync, delay), (_, o))| to_run(policy, replicas, sync, delay, o))
        .collect();
    let report = ReplicaReport {
        trace,
        requests,
        wall_seconds: started.elapsed().as_secs_f64(),
        runs,
        fleet: fleet.clone(),
        args: args.clone(),
    };
    print_table(&report);
    std::fs::create_dir_all(&args.out)
        .map_err(|e| anyhow::anyhow!("creating {}: {e}", args.out.display()))?;
    let json = args
        .json
        .clone()
        .unwrap_or_else(|| args.out.join("replicas.json"));
    write_json(&json, &report)?;
    println!("wrote {}", json.display());
    Ok(())
}

fn to_run(policy: String, replicas: usize, sync: bool, delay: f64, o: SimOutcome) -> ReplicaRun {
    ReplicaRun {
        policy,
        replicas,
        sync: sync || replicas == 1,
        sync_delay_ms: (sync && replicas > 1).then_some(delay),
        ttft_ms: o.report.ttft_ms,
        hit_rate: o.report.hit_rate,
        load_cv: o.report.load_cv,
        replica_stats: o.replicas,
        report: o.report,
    }
}

fn print_table(report: &ReplicaReport) {
    println!("{} requests per simulation", report.requests);
    println!(
        "{:<14} {:>8} {:>8} {:>9} {:>9} {:>6} {:>6} {:>9} {:>7}",
        "policy", "replicas", "sync", "ttft p50", "ttft p90", "hit", "cv", "view err", "excess"
    );
    for r in &report.runs {
        let sync = match r.sync_delay_ms {
            Some(d) => format!("{d} ms"),
            None if r.replicas == 1 => "-".to_owned(),
            None => "off".to_owned(),
        };
        println!(
            "{:<14} {:>8} {:>8} {:>9.1} {:>9.1} {:>6.3} {:>6.3} {:>9.2} {:>7.2}",
            r.policy,
            r.replicas,
            sync,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.hit_rate,
            r.load_cv,
            r.replica_stats.view_error_requests,
            r.replica_stats.excess_requests
        );
    }
    println!("(times in ms; hit = engine prefix hit rate; cv = per-worker load imbalance; view err = mean |active requests a replica sees − booked fleet-wide| at a decision; excess = mean active requests on the chosen worker above the least-loaded one)");
    println!("wall: {:.1} s", report.wall_seconds);
}

#[cfg(test)]
mod tests {
    use super::super::parse_args as parse;
    use super::*;

    #[test]
    fn one_replica_runs_once_and_more_run_with_and_without_sync() {
        let args = parse(&["--replicas", "1,2,4", "--sync-delay-ms", "0,7"]);
        let fleet = super::super::fleet_config(&args).unwrap();
        let names: Vec<String> = variants(&args, &fleet)
            .unwrap()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        assert_eq!(
            names,
            vec![
                "kv ×1 -",
                "kv ×2 0 ms",
                "kv ×2 7 ms",
                "kv ×2 off",
                "kv ×4 0 ms",
                "kv ×4 7 ms",
                "kv ×4 off"
            ]
        );
    }

    #[test]
    fn the_default_delay_is_the_simulators() {
        let args = parse(&["--replicas", "2"]);
        assert_eq!(
            args.sync_delay_ms,
            vec![switchyard_sim::replicas::DEFAULT_SYNC_DELAY_MS]
        );
    }

    #[test]
    fn bad_replica_flags_get_clear_errors() {
        let fleet = FleetConfig::default();
        let zero = parse(&["--replicas", "0,2"]);
        assert!(variants(&zero, &fleet)
            .unwrap_err()
            .to_string()
            .contains("at least 1"));
        let both = parse(&["--replicas", "2", "--admission", "both"]);
        assert!(variants(&both, &fleet)
            .unwrap_err()
            .to_string()
            .contains("not both"));
        let negative = parse(&["--replicas", "2", "--sync-delay-ms=-1"]);
        assert!(variants(&negative, &fleet)
            .unwrap_err()
            .to_string()
            .contains(">= 0"));
    }
}
