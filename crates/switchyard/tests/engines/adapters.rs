//! LoRA on demand against real vLLM (`--enable-lora --max-loras 1`): the
//! router learns a worker's adapters from vLLM's `/v1/models`, sends an
//! adapter's requests to its holder, and loads an adapter held nowhere
//! through vLLM's own `/v1/load_lora_adapter`, first unloading the
//! worker's adapter through `/v1/unload_lora_adapter` when its one slot is
//! taken.

use crate::support::{metric, scratch_file, wait_for, PATIENCE};
use crate::tier::{admin_workers, bounded, exclusive, metrics, serve_in_front, tier, ADMIN};
use serde_json::{json, Value};
use switchyard_commands::engines::vllm::{LoraOptions, VllmWorker};

/// The model ids a server lists on `/v1/models`.
async fn listed(client: &reqwest::Client, base: &str) -> Vec<String> {
    let v: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .expect("/v1/models answers")
        .json()
        .await
        .expect("JSON");
    v["data"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["id"].as_str().map(str::to_owned))
        .collect()
}

/// A one-token completion for `model` through the router: the worker that
/// served it.
async fn served_by(client: &reqwest::Client, router: &str, model: &str) -> String {
    let response = client
        .post(format!("{router}/v1/completions"))
        .json(&json!({"model": model, "prompt": "a short request for an adapter", "max_tokens": 1}))
        .send()
        .await
        .expect("the router answers");
    let status = response.status();
    let worker = response
        .headers()
        .get("x-switchyard-worker")
        .map(|h| h.to_str().expect("ASCII").to_owned());
    let body = response.text().await.unwrap_or_default();
    assert_eq!(status, 200, "{model}: {body}");
    worker.expect("the router names the worker")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_go_to_their_holder_and_are_loaded_and_unloaded_through_vllm() {
    let Some(tier) = tier() else { return };
    let _one = exclusive().await;
    bounded(async {
        let lora = |modules: Vec<(String, std::path::PathBuf)>| {
            let mut options = tier.qwen3();
            options.lora = Some(LoraOptions {
                max_loras: 1,
                max_rank: 8,
                modules,
            });
            options
        };
        let workers = tier
            .start(
                "adapters",
                vec![
                    (
                        "v0",
                        lora(vec![("lora-a".into(), tier.models.qwen3_lora('a'))]),
                    ),
                    ("v1", lora(vec![])),
                ],
            )
            .await;
        let config = scratch_file(
            "engines-adapters.toml",
            format!(
                "[[adapters]]\nname = \"lora-b\"\npath = \"{}\"\nbase_model = \"tiny\"\n\n\
                 [[adapters]]\nname = \"lora-c\"\npath = \"{}\"\nbase_model = \"tiny\"\n",
                tier.models.qwen3_lora('b').display(),
                tier.models.qwen3_lora('c').display()
            )
            .as_bytes(),
        );
        let flags = vec![
            "--block-size".to_owned(),
            "32".to_owned(),
            "--config".to_owned(),
            config.display().to_string(),
            "--health-interval-ms".to_owned(),
            "500".to_owned(),
            "--admin-token".to_owned(),
            ADMIN.to_owned(),
        ];
        let client = reqwest::Client::new();
        let router = serve_in_front(&client, &workers, flags).await;

        // vLLM's /v1/models card for lora-a (parent: tiny) is learned.
        let models = listed(&client, &router.base).await;
        assert!(
            models.contains(&"lora-a".to_owned()) && models.contains(&"tiny".to_owned()),
            "the router lists vLLM's adapter: {models:?}"
        );
        // Its requests go to the worker that holds it.
        for _ in 0..4 {
            assert_eq!(served_by(&client, &router.base, "lora-a").await, "v0");
        }
        // vLLM reports its LoRA slots (`vllm:lora_requests_info{max_lora}`)
        // once it has served a request: one to each worker that has not.
        for w in &workers {
            let engine = metrics(&client, &w.base).await;
            if !engine.contains("vllm:lora_requests_info{") {
                let r = client
                    .post(format!("{}/v1/completions", w.base))
                    .json(&json!({"model": "tiny", "prompt": "warm", "max_tokens": 1}))
                    .send()
                    .await
                    .expect("vLLM answers");
                assert_eq!(r.status(), 200);
            }
        }
        wait_for(
            "both workers' LoRA slots read from vLLM",
            PATIENCE,
            async || {
                let list: Value = admin_workers(&client, &router.base).await;
                list["workers"]
                    .as_array()
                    .is_some_and(|ws| ws.iter().all(|w| w["adapter_slots"] == 1))
            },
        )
        .await;

        // lora-b and lora-c are loaded nowhere: the router loads each
        // through vLLM's endpoint on the worker it picks; with one slot
        // per worker, the second (at the latest) first unloads what its
        // worker holds.
        let on_b = served_by(&client, &router.base, "lora-b").await;
        let holder_b = &workers[if on_b == "v0" { 0 } else { 1 }];
        assert!(
            listed(&client, &holder_b.base)
                .await
                .contains(&"lora-b".to_owned()),
            "vLLM at {on_b} loaded lora-b"
        );
        let on_c = served_by(&client, &router.base, "lora-c").await;
        let holder_c: &VllmWorker = &workers[if on_c == "v0" { 0 } else { 1 }];
        let held = listed(&client, &holder_c.base).await;
        assert!(
            held.contains(&"lora-c".to_owned()),
            "vLLM at {on_c} loaded lora-c: {held:?}"
        );
        assert_eq!(
            held.iter().filter(|m| m.starts_with("lora-")).count(),
            1,
            "one slot: vLLM at {on_c} holds lora-c alone: {held:?}"
        );

        let text = metrics(&client, &router.base).await;
        assert!(
            metric(&text, "switchyard_adapter_loads_total{result=\"ok\"}") >= Some(2.0),
            "{text}"
        );
        assert!(
            metric(&text, "switchyard_adapter_unloads_total{result=\"ok\"}") >= Some(1.0),
            "{text}"
        );
        assert_eq!(
            metric(&text, "switchyard_adapter_loads_total{result=\"failed\"}").unwrap_or(0.0),
            0.0,
            "{text}"
        );
    })
    .await;
}
