//! What the router reads of a vLLM worker, as vLLM really reports it: its
//! health, its models and `max_model_len` (`/v1/models`), its KV capacity
//! (`vllm:cache_config_info` on `/metrics`; vLLM has no
//! `/get_server_info`) and its KV usage (`vllm:kv_cache_usage_perc`).

use crate::support::{metric, serve, wait_metrics};
use crate::tier::{admin_workers, bounded, exclusive, metrics, sum, tier, ADMIN};
use serde_json::{json, Value};

/// A label's value on the first sample of `name` in a Prometheus text.
fn label(text: &str, name: &str, key: &str) -> Option<String> {
    let line = text.lines().find(|l| l.starts_with(&format!("{name}{{")))?;
    let start = line.find(&format!("{key}=\""))? + key.len() + 2;
    let end = line[start..].find('"')? + start;
    Some(line[start..end].to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_reads_vllms_health_models_capacity_and_usage_as_vllm_reports_them() {
    let Some(tier) = tier() else { return };
    let _one = exclusive().await;
    bounded(async {
        let mut workers = tier.start("worker-state", vec![("v0", tier.qwen3())]).await;
        let client = reqwest::Client::new();
        let engine = metrics(&client, &workers[0].base).await;
        let gpu_blocks: u64 = label(&engine, "vllm:cache_config_info", "num_gpu_blocks")
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("vLLM reports its KV blocks:\n{engine}"));

        let router = serve(&[
            "--block-size",
            "32",
            "--worker",
            &workers[0].worker_spec("v0"),
            "--health-interval-ms",
            "500",
            // Session-aware admission reads each worker's KV usage.
            "--admission",
            "session-aware",
            "--admin-token",
            ADMIN,
        ]);
        wait_metrics(&client, &router.base, "the vLLM worker in selection", |t| {
            sum(t, "switchyard_worker_up") == 1.0
        })
        .await;
        wait_metrics(&client, &router.base, "vLLM's KV usage read", |t| {
            metric(t, "switchyard_worker_kv_usage_ratio{worker=\"v0\"}").is_some()
        })
        .await;

        let list: Value = admin_workers(&client, &router.base).await;
        let w = &list["workers"][0];
        assert_eq!(w["name"], "v0", "{list}");
        assert_eq!(w["in_selection"], true, "{list}");
        assert_eq!(w["models"], json!(["tiny"]), "{list}");
        assert_eq!(w["max_model_len"], 8192, "vLLM's /v1/models card: {list}");
        assert_eq!(
            w["capacity"]["kv_blocks"].as_u64(),
            Some(gpu_blocks),
            "vLLM's num_gpu_blocks: {list}"
        );
        assert_eq!(
            w["capacity"]["kv_tokens"].as_u64(),
            Some(gpu_blocks * 32),
            "{list}"
        );

        // The prompt limit is vLLM's max_model_len: a longer prompt is
        // refused by the router itself, before any worker sees it.
        let long = "word ".repeat(9000);
        let response = client
            .post(format!("{}/v1/completions", router.base))
            .json(&json!({"model": "tiny", "prompt": long, "max_tokens": 1}))
            .send()
            .await
            .expect("the router answers");
        assert_eq!(response.status(), 400);
        assert!(response.headers().get("x-switchyard-worker").is_none());
        let before = metrics(&client, &workers[0].base).await;
        assert_eq!(
            sum(&before, "vllm:request_success_total"),
            0.0,
            "vLLM never saw it:\n{before}"
        );

        // A prompt that fits is served by vLLM.
        let response = client
            .post(format!("{}/v1/completions", router.base))
            .json(&json!({"model": "tiny", "prompt": "word ".repeat(100), "max_tokens": 2}))
            .send()
            .await
            .expect("the router answers");
        assert_eq!(response.status(), 200);

        // Dead: out of selection at its failed health checks.
        workers[0].kill();
        wait_metrics(
            &client,
            &router.base,
            "the dead worker out of selection",
            |t| sum(t, "switchyard_worker_up") == 0.0,
        )
        .await;
        let response = client
            .post(format!("{}/v1/completions", router.base))
            .json(&json!({"model": "tiny", "prompt": "hello", "max_tokens": 1}))
            .send()
            .await
            .expect("the router answers");
        assert_eq!(response.status(), 503, "no worker left to serve it");
    })
    .await;
}
