//! `replay --tune`: searches the routing policies' settings on the given
//! trace and writes the best as a config file `switchyard serve --config`
//! reads unchanged (its `policy` and `[policies]`).
//!
//! The search is a fixed list of candidates (each policy's defaults first,
//! then a grid around them), in an order that visits every policy early, so
//! a short budget still compares them all. Candidates are simulated
//! `threads` at a time; the search stops after the batch that crosses
//! `--budget-secs` or after `--tune-trials` candidates. The simulations are
//! deterministic (seeded), so the same trace, arguments and number of
//! candidates give the same result on any machine; the figure printed at
//! the end says how many were run, to reproduce it with `--tune-trials`.
//!
//! The objective is the bar for a good policy: among candidates
//! whose engine hit rate reaches [`HIT_SHARE_TARGET`] of the pooled-LRU
//! reference, the lowest TTFT p90; when none does, the highest hit rate.

use super::{references, run_all, workload_name, ReplayArgs, WorkloadSource};
use anyhow::Context as _;
use serde::Serialize;
use std::path::Path;
use std::time::Instant;
use switchyard_core::select::{PolicyConfig, PolicyKind};
use switchyard_sim::fleet::FleetConfig;
use switchyard_sim::report::PolicyReport;

/// Share of the pooled-LRU hit rate a candidate must reach to be ranked by
/// TTFT p90.
pub const HIT_SHARE_TARGET: f64 = 0.9;

/// Default `--budget-secs`.
pub const DEFAULT_BUDGET_SECS: u64 = 600;

/// One point of the search.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// Short description, e.g. `ttft locality=2 pressure=1 turnover=0`.
    pub name: String,
    /// The policy.
    pub policy: PolicyKind,
    /// Its settings (the other policies' at their defaults).
    pub policies: PolicyConfig,
}

/// What `--write-config` writes: the part of `serve`'s config the search
/// chose. `ServerConfig` reads these keys.
#[derive(Debug, Serialize)]
struct TunedConfig {
    policy: PolicyKind,
    policies: PolicyConfig,
}

/// Every candidate, in search order: the defaults of each policy, then
/// one grid point of each policy in turn.
pub fn candidates(base: &PolicyConfig) -> Vec<Candidate> {
    let mut kv = Vec::new();
    for w in [1.0, 0.5, 2.0, 4.0, 8.0, 16.0] {
        let mut p = *base;
        p.kv.overlap_weight = w;
        p.kv.temperature = 0.0;
        kv.push(Candidate {
            name: format!("kv overlap_weight={w}"),
            policy: PolicyKind::Kv,
            policies: p,
        });
    }
    let mut ttft = Vec::new();
    let t = base.ttft;
    for locality in [t.locality_weight, 0.0, 0.5, 2.0, 4.0] {
        for pressure in [t.pressure_weight, 0.0, 1.0, 4.0] {
            for turnover in [t.turnover_weight, 0.0] {
                for interference in [t.interference_weight, 0.0] {
                    let mut p = *base;
                    p.ttft.locality_weight = locality;
                    p.ttft.pressure_weight = pressure;
                    p.ttft.turnover_weight = turnover;
                    p.ttft.interference_weight = interference;
                    let c = Candidate {
                        name: format!(
                            "ttft locality={locality} pressure={pressure} turnover={turnover} interference={interference}"
                        ),
                        policy: PolicyKind::Ttft,
                        policies: p,
                    };
                    if !ttft.contains(&c) {
                        ttft.push(c);
                    }
                }
            }
        }
    }
    let mut cache_aware = Vec::new();
    let c = base.cache_aware;
    for threshold in [c.cache_threshold, 0.1, 0.5] {
        for abs in [c.balance_abs_threshold, 16, 256] {
            let mut p = *base;
            p.cache_aware.cache_threshold = threshold;
            p.cache_aware.balance_abs_threshold = abs;
            let cand = Candidate {
                name: format!("cache-aware cache_threshold={threshold} balance_abs={abs}"),
                policy: PolicyKind::CacheAware,
                policies: p,
            };
            if !cache_aware.contains(&cand) {
                cache_aware.push(cand);
            }
        }
    }
    // The default policy's defaults first.
    let mut lists = [ttft, kv, cache_aware];
    lists.sort_by_key(|l| l.first().map(|c| c.policy != PolicyKind::DEFAULT));
    let mut out = Vec::new();
    let longest = lists.iter().map(Vec::len).max().unwrap_or(0);
    for i in 0..longest {
        for list in &lists {
            if let Some(c) = list.get(i) {
                out.push(c.clone());
            }
        }
    }
    out
}

/// The index of the best of `results` by the objective (see the module
/// doc), given the pooled-LRU hit rate.
pub fn best(results: &[(Candidate, PolicyReport)], pooled_lru: f64) -> Option<usize> {
    let qualifies = |r: &PolicyReport| r.hit_rate >= HIT_SHARE_TARGET * pooled_lru;
    let qualified = results
        .iter()
        .enumerate()
        .filter(|(_, (_, r))| qualifies(r))
        .min_by(|a, b| a.1 .1.ttft_ms.p90.total_cmp(&b.1 .1.ttft_ms.p90))
        .map(|(i, _)| i);
    qualified.or_else(|| {
        results
            .iter()
            .enumerate()
            .max_by(|a, b| a.1 .1.hit_rate.total_cmp(&b.1 .1.hit_rate))
            .map(|(i, _)| i)
    })
}

/// Writes `c` as a config file for `serve --config`.
pub fn write_config(path: &Path, c: &Candidate, provenance: &str) -> anyhow::Result<()> {
    let body = toml::to_string(&TunedConfig {
        policy: c.policy,
        policies: c.policies,
    })
    .context("encoding the tuned settings")?;
    let text = format!(
        "# Written by `switchyard replay --tune`: {provenance}.\n# Best: {}.\n# Use it with `switchyard serve --config {}` (add [[workers]] or --worker).\n\n{body}",
        c.name,
        path.display()
    );
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

/// Runs the search.
pub fn run(args: &ReplayArgs, source: &WorkloadSource, fleet: &FleetConfig) -> anyhow::Result<()> {
    let started = Instant::now();
    let (requests, refs) = references(args, source, fleet)?;
    let pooled = refs.pooled_lru_hit_rate();
    let mut queue = candidates(&fleet.router.policies);
    if let Some(n) = args.tune_trials {
        queue.truncate(n.max(1));
    }
    let total = queue.len();
    let threads = args
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let trace = workload_name(args);
    eprintln!(
        "tuning on {trace} ({requests} requests, {} workers): up to {total} candidates, budget {} s, {threads} at a time",
        fleet.workers, args.budget_secs
    );
    let mut results: Vec<(Candidate, PolicyReport)> = Vec::new();
    let mut rest = queue.into_iter().peekable();
    while rest.peek().is_some() {
        if started.elapsed().as_secs() >= args.budget_secs {
            break;
        }
        let batch: Vec<Candidate> = rest.by_ref().take(threads).collect();
        let fleets = batch
            .iter()
            .map(|c| {
                let mut f = fleet.clone();
                f.router.policy = c.policy;
                f.router.policies = c.policies;
                (c.name.clone(), f)
            })
            .collect();
        let outcomes = run_all(args, source, fleets, Some(requests))?;
        for (c, (_, o)) in batch.into_iter().zip(outcomes) {
            results.push((c, o.report));
        }
    }
    println!("{requests} requests; pooled-LRU hit rate {pooled:.3}; target hit ≥ {HIT_SHARE_TARGET} × pooled LRU = {:.3}", HIT_SHARE_TARGET * pooled);
    println!(
        "{:<52} {:>9} {:>9} {:>6} {:>7}",
        "candidate", "ttft p50", "ttft p90", "hit", "of LRU"
    );
    for (c, r) in &results {
        println!(
            "{:<52} {:>9.1} {:>9.1} {:>6.3} {:>6.0}%",
            c.name,
            r.ttft_ms.p50,
            r.ttft_ms.p90,
            r.hit_rate,
            100.0 * r.hit_rate / pooled.max(f64::MIN_POSITIVE)
        );
    }
    let Some(i) = best(&results, pooled) else {
        anyhow::bail!(
            "the budget of {} s ran out before the first candidate finished; raise --budget-secs",
            args.budget_secs
        );
    };
    let (c, r) = &results[i];
    let verdict = if r.hit_rate >= HIT_SHARE_TARGET * pooled {
        "lowest TTFT p90 of those at the hit-rate target"
    } else {
        "no candidate reached the hit-rate target; highest hit rate"
    };
    println!(
        "best ({verdict}): {} — TTFT p90 {:.1} ms, hit {:.3} ({:.0}% of pooled LRU); {} of {total} candidates in {:.0} s (reproduce with --tune-trials {})",
        c.name,
        r.ttft_ms.p90,
        r.hit_rate,
        100.0 * r.hit_rate / pooled.max(f64::MIN_POSITIVE),
        results.len(),
        started.elapsed().as_secs_f64(),
        results.len()
    );
    if let Some(path) = &args.write_config {
        let provenance = format!(
            "trace {trace}, {requests} requests, {} workers, {} of {total} candidates, TTFT p90 {:.1} ms, hit {:.3} (pooled LRU {pooled:.3})",
            fleet.workers,
            results.len(),
            r.ttft_ms.p90,
            r.hit_rate
        );
        write_config(path, c, &provenance)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(hit: f64, p90: f64) -> PolicyReport {
        let mut r = PolicyReport {
            hit_rate: hit,
            ..PolicyReport::default()
        };
        r.ttft_ms.p90 = p90;
        r
    }

    #[test]
    fn the_search_starts_with_every_policys_defaults_the_default_policy_first() {
        let base = PolicyConfig::default();
        let list = candidates(&base);
        assert_eq!(list[0].policy, PolicyKind::DEFAULT);
        let firsts: Vec<_> = list[..3].iter().map(|c| c.policy).collect();
        for p in [PolicyKind::Kv, PolicyKind::Ttft, PolicyKind::CacheAware] {
            assert!(firsts.contains(&p), "{p:?} not among the first three");
            let first_of_p = list.iter().find(|c| c.policy == p).unwrap();
            assert_eq!(
                first_of_p.policies, base,
                "{p:?}'s first candidate is its defaults"
            );
        }
        // Each grid value is searched, whatever the default: the default
        // pressure weight (4) is in the list too, and only deduplicated.
        let pressures: std::collections::BTreeSet<u64> = list
            .iter()
            .filter(|c| c.policy == PolicyKind::Ttft)
            .map(|c| c.policies.ttft.pressure_weight.to_bits())
            .collect();
        assert_eq!(
            pressures,
            [0.0f64, 1.0, 4.0, base.ttft.pressure_weight]
                .iter()
                .map(|w| w.to_bits())
                .collect(),
        );
        // No candidate twice, every one valid.
        for (i, c) in list.iter().enumerate() {
            assert!(!list[..i].contains(c), "{} twice", c.name);
            c.policies.validate().unwrap();
        }
    }

    #[test]
    fn the_best_is_the_fastest_at_the_hit_target_else_the_best_hit() {
        let c = |name: &str| Candidate {
            name: name.into(),
            policy: PolicyKind::Kv,
            policies: PolicyConfig::default(),
        };
        // pooled LRU 0.5: the target is 0.45.
        let results = vec![
            (c("fast, few hits"), report(0.30, 100.0)),
            (c("slow, many hits"), report(0.49, 300.0)),
            (c("at target"), report(0.45, 200.0)),
        ];
        assert_eq!(best(&results, 0.5), Some(2));
        let results = vec![(c("a"), report(0.30, 100.0)), (c("b"), report(0.40, 300.0))];
        assert_eq!(best(&results, 0.5), Some(1));
        assert_eq!(best(&[], 0.5), None);
    }

    #[test]
    fn the_written_config_is_a_server_config() {
        let dir = std::env::temp_dir().join(format!("tune-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tuned.toml");
        let mut policies = PolicyConfig::default();
        policies.ttft.locality_weight = 2.0;
        policies.cache_aware.balance_abs_threshold = 16;
        let c = Candidate {
            name: "ttft locality=2".into(),
            policy: PolicyKind::Ttft,
            policies,
        };
        write_config(&path, &c, "a test").unwrap();
        let config = switchyard_server::ServerConfig::from_toml_file(&path).unwrap();
        assert_eq!(config.policy, PolicyKind::Ttft);
        assert_eq!(config.policies, policies);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
