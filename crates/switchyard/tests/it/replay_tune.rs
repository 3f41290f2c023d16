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
