//! Disaggregated serving on real vLLM: `serve --disagg vllm` in front of a
//! prefill worker and a decode worker joined by vLLM's `ExampleConnector`
//! (the one KV connector of vLLM 0.32 that runs on CPU on one host: the
//! producer writes each prompt's KV to a shared directory, the consumer
//! finds it there by the prompt's tokens and loads it instead of computing
//! it). The router sends the prefill half (`max_tokens` 1,
//! `kv_transfer_params {do_remote_decode}`) to the producer, then the
//! client's request to the consumer; vLLM's own counters show the KV
//! crossing over.

use crate::support::{metric, serve, wait_metrics};
use crate::tier::{bounded, exclusive, metrics, sum, tier};
use serde_json::{json, Value};

/// vLLM's `--kv-transfer-config` for the `ExampleConnector` in `role`
/// sharing `dir`.
fn connector(role: &str, dir: &std::path::Path) -> Vec<String> {
    let config = json!({
        "kv_connector": "ExampleConnector",
        "kv_role": role,
        "kv_connector_extra_config": {"shared_storage_path": dir.display().to_string()},
    });
    vec!["--kv-transfer-config".to_owned(), config.to_string()]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_is_prefilled_on_one_vllm_and_decoded_on_the_other_with_its_kv_handed_over() {
    let Some(tier) = tier() else { return };
    let _one = exclusive().await;
    bounded(async {
        let shared = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
            .join(format!("engine-kv-share-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&shared);
        std::fs::create_dir_all(&shared).expect("the shared KV directory");
        let mut prefill = tier.qwen3();
        prefill.extra_args = connector("kv_producer", &shared);
        let mut decode = tier.qwen3();
        decode.extra_args = connector("kv_consumer", &shared);
        let workers = tier
            .start("disagg", vec![("p", prefill), ("d", decode)])
            .await;
        let router = serve(&[
            "--disagg",
            "vllm",
            "--block-size",
            "32",
            "--worker",
            &format!("{},role=prefill", workers[0].worker_spec("p")),
            "--worker",
            &format!("{},role=decode", workers[1].worker_spec("d")),
            "--health-interval-ms",
            "500",
        ]);
        let client = reqwest::Client::new();
        wait_metrics(&client, &router.base, "both vLLM workers in selection", |t| {
            sum(t, "switchyard_worker_up") == 2.0
        })
        .await;

        const REQUESTS: usize = 4;
        for i in 0..REQUESTS {
            let stream = i % 2 == 1;
            let content = format!("Request {i}: tell me how a freight yard sorts its wagons. ").repeat(12);
            let response = client
                .post(format!("{}/v1/chat/completions", router.base))
                .json(&json!({
                    "model": "tiny",
                    "messages": [{"role": "user", "content": content}],
                    "max_tokens": 8,
                    "ignore_eos": true,
                    "stream": stream,
                }))
                .send()
                .await
                .expect("the router answers");
            assert_eq!(response.status(), 200);
            assert_eq!(response.headers()["x-switchyard-worker"], "d", "the decode worker answers");
            let text = response.text().await.expect("a body");
            if stream {
                assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
            } else {
                let v: Value = serde_json::from_str(&text).expect("JSON");
                assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
            }
        }

        let p = metrics(&client, &workers[0].base).await;
        let d = metrics(&client, &workers[1].base).await;
        assert_eq!(
            sum(&p, "vllm:request_success_total"),
            REQUESTS as f64,
            "each prefill half ran on the producer:\n{p}"
        );
        assert_eq!(sum(&d, "vllm:request_success_total"), REQUESTS as f64);
        let handed = sum(&d, "vllm:external_prefix_cache_hits_total");
        let queried = sum(&d, "vllm:external_prefix_cache_queries_total");
        println!("disagg: the decode worker loaded {handed} of {queried} prompt tokens from the prefill worker's KV");
        assert!(
            handed > 0.0 && handed >= 0.8 * queried,
            "the decode worker loaded the prompts' KV instead of computing it:\n{d}"
        );
        let text = metrics(&client, &router.base).await;
        assert_eq!(
            sum(&text, "switchyard_disagg_requests_total"),
            REQUESTS as f64,
            "{text}"
        );
        assert_eq!(sum(&text, "switchyard_disagg_failures_total"), 0.0, "{text}");
        assert_eq!(metric(&text, "switchyard_active_requests"), Some(0.0));
        let _ = std::fs::remove_dir_all(&shared);
    })
    .await;
}
