//! `replay --tune` to `serve --config`: the file the tuner writes is a
//! router config, and the router it starts runs the policy the tuner chose.

use crate::support::*;
use std::process::Command;

#[tokio::test]
async fn the_config_replay_tune_writes_starts_a_router_running_the_chosen_policy() {
    let _machine = machine().await;
    let path = scratch_file("tuned.toml", b"");
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["replay", "--format", "synthetic", "--max-requests", "30"])
        .args(["--tune", "--tune-trials", "3", "--threads", "1", "--quiet"])
        .arg("--write-config")
        .arg(&path)
        .output()
        .expect("switchyard replay runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "replay --tune failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // "best (...): <policy> <settings> — TTFT p90 ..."
    let best = stdout
        .lines()
        .find_map(|l| l.strip_prefix("best ("))
        .and_then(|l| l.split_once("): "))
        .map(|(_, rest)| {
            rest.split_whitespace()
                .next()
                .unwrap_or_default()
                .to_owned()
        })
        .unwrap_or_else(|| panic!("no best line in:\n{stdout}"));
    let text = std::fs::read_to_string(&path).expect("the config was written");
    assert!(
        text.contains(&format!("policy = \"{best}\"")),
        "the file names the best policy {best}:\n{text}"
    );

    let worker = sim_worker("0");
    let config = path.to_str().expect("a UTF-8 path");
    let router = router(&[worker.named("w0")], &["--config", config]);
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{}/v1/completions", router.base))
        .json(&serde_json::json!({"model": "switchyard-sim", "prompt": [1, 2, 3, 4], "max_tokens": 2}))
        .send()
        .await
        .expect("the router answers");
    assert_eq!(response.status(), 200);
    let series = format!("switchyard_requests_total{{policy=\"{best}\",status=\"ok\"}}");
    wait_metrics(&client, &router.base, &series, |t| {
        metric(t, &series) == Some(1.0)
    })
    .await;
}

/// `replay --dp-size N`: each policy once rank-aware and once rank-blind,
/// each row of `replay.json` saying which, with what its ranks did.
#[tokio::test]
async fn replay_with_data_parallel_ranks_runs_each_policy_aware_and_blind() {
    let _machine = machine().await;
    let out_dir = scratch_file("dp-replay.marker", b"").with_file_name("dp-replay-out");
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["replay", "--format", "synthetic", "--max-requests", "30"])
        .args([
            "--workers",
            "2",
            "--dp-size",
            "3",
            "--policies",
            "kv,round-robin",
        ])
        .args(["--threads", "1", "--quiet", "--no-plots", "--out"])
        .arg(&out_dir)
        .output()
        .expect("switchyard replay runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("replay.json")).unwrap()).unwrap();
    let rows = report["policies"].as_object().unwrap();
    let mut names: Vec<&str> = rows.keys().map(String::as_str).collect();
    names.sort_unstable();
    assert_eq!(
        names,
        [
            "kv+dp-aware",
            "kv+dp-blind",
            "round-robin+dp-aware",
            "round-robin+dp-blind"
        ]
    );
    for (name, row) in rows {
        let routing = name.rsplit("+dp-").next().unwrap();
        assert_eq!(row["dp_routing"], routing, "{name}");
        assert_eq!(row["dp"]["size"], 3, "{name}");
        let per_rank = row["dp"]["requests_per_rank"].as_array().unwrap();
        assert_eq!(per_rank.len(), 6, "{name}");
        let started: u64 = per_rank.iter().map(|n| n.as_u64().unwrap()).sum();
        assert_eq!(started, row["completed"].as_u64().unwrap(), "{name}");
    }
    // `--dp-routing` without ranks is refused.
    let refused = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["replay", "--format", "synthetic", "--dp-routing", "aware"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("--dp-routing needs --dp-size"));
}

/// `replay --fail-worker`: every policy's row counts what the failures
/// did, and every request either completed or ended in an error.
#[tokio::test]
async fn replay_with_a_failed_worker_counts_retries_resumes_and_give_ups_per_policy() {
    let _machine = machine().await;
    let out_dir = scratch_file("fail-replay.marker", b"").with_file_name("fail-replay-out");
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["replay", "--max-requests", "600", "--workers", "4"])
        .args(["--policies", "ttft,round-robin", "--fail-worker", "5:1:10"])
        .args(["--threads", "1", "--quiet", "--no-plots", "--out"])
        .arg(&out_dir)
        .output()
        .expect("switchyard replay runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("worker failures:"), "{stdout}");
    let report: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out_dir.join("replay.json")).unwrap()).unwrap();
    for (name, row) in report["policies"].as_object().unwrap() {
        let f = &row["failures"];
        let n = |k: &str| {
            f[k].as_u64()
                .unwrap_or_else(|| panic!("{name}: {k} in {f}"))
        };
        assert!(n("failed_attempts") > 0, "{name}: {f}");
        assert!(
            n("retried") + n("resumed") + n("gave_up") <= n("failed_attempts"),
            "{name}: {f}"
        );
        let ended = row["completed"].as_u64().unwrap() + row["errors"].as_u64().unwrap();
        assert_eq!(ended, 600, "{name}: nothing lost");
        assert!(row["errors"].as_u64().unwrap() >= n("gave_up"), "{name}");
    }
    // A worker the fleet does not have is refused with why.
    let refused = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args(["replay", "--max-requests", "10", "--workers", "2"])
        .args(["--fail-worker", "1:2", "--no-plots", "--quiet", "--out"])
        .arg(out_dir.with_file_name("fail-replay-refused"))
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("the fleet has 2"),
        "{}",
        String::from_utf8_lossy(&refused.stderr)
    );
}

/// `replay --plan`: the smallest fleet that met the target is named in
/// `plan.json`, it met it, the size below it (simulated) missed it, and
/// the plot is written.
/// `replay --plan --slo ttft_p90=500` on the bundled trace's first 400
/// requests with `extra` flags, into a fresh directory named after `name`:
/// the directory, what it printed, and `plan.json`.
fn plan_run(name: &str, extra: &[&str]) -> (std::path::PathBuf, String, serde_json::Value) {
    let out_dir = std::env::temp_dir().join(format!("switchyard-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out_dir);
    let out = Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "replay",
            "--max-requests",
            "400",
            "--quiet",
            "--threads",
            "2",
        ])
        .args(["--plan", "--slo", "ttft_p90=500"])
        .args(extra)
        .arg("--out")
        .arg(&out_dir)
        .output()
        .expect("switchyard replay runs");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "replay --plan {extra:?} failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let plan = serde_json::from_slice(&std::fs::read(out_dir.join("plan.json")).unwrap()).unwrap();
    (out_dir, stdout, plan)
}

#[tokio::test]
async fn replay_plan_names_the_smallest_fleet_that_meets_the_slo() {
    let _machine = machine().await;
    let (out_dir, stdout, plan) = plan_run("plan", &["--max-workers", "16"]);
    let rows = plan["rows"].as_array().expect("rows");
    let met = |n: u64| {
        rows.iter()
            .find(|r| r["workers"] == n)
            .map(|r| r["met"].as_bool().unwrap())
    };
    let n = plan["workers"]
        .as_u64()
        .unwrap_or_else(|| panic!("no fleet met the target:\n{stdout}"));
    assert_eq!(met(n), Some(true), "{stdout}");
    if n > 1 {
        assert_eq!(
            met(n - 1),
            Some(false),
            "the size below was simulated and missed:\n{stdout}"
        );
    }
    assert!(
        rows.iter()
            .filter(|r| r["met"] == true)
            .all(|r| r["workers"].as_u64().unwrap() >= n),
        "{stdout}"
    );
    assert!(stdout.contains(&format!("smallest fleet that meets it: {n} workers")));
    let svg = std::fs::read_to_string(out_dir.join("plan.svg")).unwrap();
    assert!(svg.contains("SLO attainment against fleet size"));
    std::fs::remove_dir_all(&out_dir).unwrap();
}

/// `replay --plan --plan-rates`: a search per multiple of the rate, the
/// first at the top of `plan.json` as without the flag, each in `rates`;
/// more traffic never needs fewer workers; and the fleet needed against
/// the rate is drawn.
#[tokio::test]
async fn replay_plan_at_several_rates_needs_no_fewer_workers_for_more_traffic() {
    let _machine = machine().await;
    let (out_dir, stdout, plan) = plan_run("plan-rates", &["--plan-rates", "0.5,1,2"]);
    let rates = plan["rates"].as_array().expect("rates");
    let multiples: Vec<f64> = rates
        .iter()
        .map(|r| r["multiple"].as_f64().unwrap())
        .collect();
    assert_eq!(multiples, [0.5, 1.0, 2.0]);
    let base = plan["rate_scale"].as_f64().unwrap();
    for r in rates {
        let expected = base * r["multiple"].as_f64().unwrap() / 0.5;
        assert!(
            (r["rate_scale"].as_f64().unwrap() - expected).abs() < 1e-9,
            "{r}"
        );
    }
    assert_eq!(plan["workers"], rates[0]["workers"], "the first at the top");
    let needed: Vec<u64> = rates
        .iter()
        .map(|r| r["workers"].as_u64().expect("each rate met by some fleet"))
        .collect();
    assert!(needed.windows(2).all(|w| w[0] <= w[1]), "{needed:?}");
    assert!(
        needed[2] > needed[0],
        "four times the traffic needs more: {needed:?}"
    );
    assert_eq!(stdout.matches("smallest fleet that meets it").count(), 3);
    let svg = std::fs::read_to_string(out_dir.join("plan-rates.svg")).unwrap();
    assert!(svg.contains("workers needed against the arrival rate"));
    std::fs::remove_dir_all(&out_dir).unwrap();
}
