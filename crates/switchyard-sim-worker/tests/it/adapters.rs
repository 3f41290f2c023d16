//! LoRA adapters over a real socket: vLLM's `/v1/models` entries with a
//! `parent`, `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` with
//! vLLM's answers, a request for an adapter that is not loaded is a 404,
//! the load takes its time, and `/metrics` counts it all.

use clap::Parser;
use serde_json::{json, Value};
use std::time::Instant;
use switchyard_sim_worker::{bind, BoundWorker, SimWorkerArgs};
use switchyard_tokenizer::Tokenizer;
use switchyard_wire::prometheus::Scrape;

async fn worker(flags: &[&str]) -> String {
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        args: SimWorkerArgs,
    }
    let mut argv = vec![
        "sim-worker",
        "--port",
        "0",
        "--num-blocks",
        "1024",
        "--model",
        "base",
    ];
    argv.extend_from_slice(flags);
    let args = Cli::parse_from(argv).args;
    let BoundWorker { listener, app, .. } = bind(&args, Tokenizer::bundled().unwrap())
        .await
        .expect("the worker starts");
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    base
}

async fn post(base: &str, path: &str, body: Value) -> (u16, String) {
    let r = reqwest::Client::new()
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .unwrap();
    (r.status().as_u16(), r.text().await.unwrap())
}

async fn models(base: &str) -> Vec<Value> {
    let v: Value = reqwest::get(format!("{base}/v1/models"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    v["data"].as_array().unwrap().clone()
}

fn metric(text: &str, name: &str) -> f64 {
    Scrape::parse(text)
        .series_value(name)
        .unwrap_or_else(|| panic!("{name} missing"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_load_unload_list_and_serve_as_vllms_do() {
    // 400 model ms at speed-up 4: each load takes 100 ms of wall time.
    let base = worker(&[
        "--speedup",
        "4",
        "--max-loras",
        "2",
        "--lora-load-ms",
        "400",
        "--lora-modules",
        "pre=/adapters/pre",
    ])
    .await;
    let listed = models(&base).await;
    assert_eq!(listed.len(), 2);
    assert_eq!(listed[1]["id"], "pre");
    assert_eq!(listed[1]["parent"], "base");
    assert_eq!(listed[1]["root"], "/adapters/pre");
    assert!(listed[0].get("parent").is_none());

    let completion = |model: &str| json!({"model": model, "prompt": [1, 2, 3, 4], "max_tokens": 2});
    let (status, body) = post(&base, "/v1/completions", completion("a")).await;
    assert_eq!(status, 404, "{body}");
    let (status, body) = post(&base, "/v1/completions", completion("pre")).await;
    assert_eq!(status, 200, "{body}");
    let answer: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(answer["model"], "pre", "an adapter's answer names it");

    let started = Instant::now();
    let (status, body) = post(
        &base,
        "/v1/load_lora_adapter",
        json!({"lora_name": "a", "lora_path": "/adapters/a"}),
    )
    .await;
    assert_eq!(
        (status, body.as_str()),
        (200, "Success: LoRA adapter 'a' added successfully.")
    );
    assert!(
        started.elapsed().as_millis() >= 100,
        "{:?}",
        started.elapsed()
    );
    let (status, body) = post(
        &base,
        "/v1/load_lora_adapter",
        json!({"lora_name": "a", "lora_path": "/adapters/a"}),
    )
    .await;
    assert_eq!(status, 400);
    assert!(body.contains("has already been loaded"), "{body}");
    let (status, _) = post(&base, "/v1/load_lora_adapter", json!({"lora_name": "b"})).await;
    assert_eq!(status, 400);
    assert_eq!(post(&base, "/v1/completions", completion("a")).await.0, 200);
    // Full (pre, a): loading b evicts pre, the least recently used.
    let (status, _) = post(
        &base,
        "/v1/load_lora_adapter",
        json!({"lora_name": "b", "lora_path": "/adapters/b"}),
    )
    .await;
    assert_eq!(status, 200);
    let ids: Vec<String> = models(&base)
        .await
        .iter()
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(ids, ["base", "a", "b"]);
    assert_eq!(
        post(&base, "/v1/completions", completion("pre")).await.0,
        404
    );

    let (status, body) = post(&base, "/v1/unload_lora_adapter", json!({"lora_name": "a"})).await;
    assert_eq!(
        (status, body.as_str()),
        (200, "Success: LoRA adapter 'a' removed successfully.")
    );
    let (status, body) = post(&base, "/v1/unload_lora_adapter", json!({"lora_name": "a"})).await;
    assert_eq!(status, 404);
    assert!(body.contains("cannot be found"), "{body}");

    let info: Value = reqwest::get(format!("{base}/get_server_info"))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(info["max_loras"], 2);
    let text = reqwest::get(format!("{base}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(metric(&text, "switchyard_engine_lora_loads_total"), 3.0);
    assert_eq!(metric(&text, "switchyard_engine_lora_unloads_total"), 1.0);
    assert_eq!(
        metric(&text, "switchyard_engine_lora_load_failures_total"),
        2.0
    );
    assert_eq!(metric(&text, "switchyard_engine_lora_evictions_total"), 1.0);
    assert_eq!(metric(&text, "switchyard_engine_lora_adapters"), 1.0);
}

#[tokio::test]
async fn without_max_loras_a_load_is_refused() {
    let base = worker(&["--no-delay"]).await;
    let (status, body) = post(
        &base,
        "/v1/load_lora_adapter",
        json!({"lora_name": "a", "lora_path": "/a"}),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("--max-loras"));
}
