//! LoRA adapters end to end: a router process in front of two sim-worker
//! processes with one adapter slot each (`--max-loras 1`) and several
//! adapters. Requests for an adapter go to the worker that has it; a
//! request for an adapter no worker has is loaded on demand (the worker's
//! only adapter unloaded first), and `/metrics` on both sides counts it.

use crate::support::{
    completion, machine, metric, metric_sum, metrics_text, router, scratch_file, sim_worker_with,
    wait_metrics, Proc,
};
use serde_json::{json, Value};

/// Forty token ids from `prompt` for `model`: the status and the worker.
async fn ask(client: &reqwest::Client, base: &str, model: &str, prompt: u32) -> (u16, String) {
    ask_tokens(
        client,
        base,
        model,
        &(prompt..prompt + 40).collect::<Vec<u32>>(),
    )
    .await
}

async fn adapters_of(client: &reqwest::Client, base: &str) -> Vec<String> {
    let models: Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    models["data"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m.get("parent").is_some())
        .map(|m| m["id"].as_str().unwrap().to_owned())
        .collect()
}

/// A sim-worker with one adapter slot holding `adapter`, loading others
/// in `load_ms`, with `extra` flags.
fn adapter_worker(adapter: &str, load_ms: &str, extra: &[&str]) -> Proc {
    let module = format!("{adapter}=/adapters/{adapter}");
    let mut flags = vec![
        "--speedup",
        "4",
        "--num-blocks",
        "1024",
        "--max-loras",
        "1",
        "--lora-load-ms",
        load_ms,
        "--lora-modules",
        module.as_str(),
    ];
    flags.extend_from_slice(extra);
    sim_worker_with(0, &flags)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_follow_their_adapter_and_a_missing_one_is_loaded_on_demand() {
    let _machine = machine().await;
    let worker = |adapter: &str| adapter_worker(adapter, "200", &[]);
    let w0 = worker("a");
    let w1 = worker("b");
    let config = scratch_file(
        "adapters.toml",
        br#"
[[adapters]]
name = "a"
path = "/adapters/a"
base_model = "switchyard-sim"

[[adapters]]
name = "b"
path = "/adapters/b"
base_model = "switchyard-sim"

[[adapters]]
name = "c"
path = "/adapters/c"
base_model = "switchyard-sim"
"#,
    );
    let router = router(
        &[w0.named("w0"), w1.named("w1")],
        &["--config", config.to_str().unwrap()],
    );
    let base = router.base.clone();
    let client = reqwest::Client::new();
    wait_metrics(&client, &base, "both workers' adapters learned", |m| {
        metric(m, "switchyard_adapters_loaded") == Some(2.0)
    })
    .await;

    for i in 0..4 {
        assert_eq!(ask(&client, &base, "a", i * 100).await, (200, "w0".into()));
        assert_eq!(ask(&client, &base, "b", i * 100).await, (200, "w1".into()));
    }
    // The base model still goes anywhere; an unknown model is a 404.
    assert_eq!(ask(&client, &base, "switchyard-sim", 7).await.0, 200);
    assert_eq!(ask(&client, &base, "nope", 7).await.0, 404);

    // Nobody has c: loaded on one worker, in place of its only adapter.
    let (status, holder) = ask(&client, &base, "c", 5_000).await;
    assert_eq!(status, 200);
    let holder_base = if holder == "w0" { &w0.base } else { &w1.base };
    assert_eq!(adapters_of(&client, holder_base).await, ["c"]);
    // The next request for c goes there, with nothing to load.
    assert_eq!(ask(&client, &base, "c", 6_000).await, (200, holder.clone()));

    let text = metrics_text(&client, &base).await;
    assert_eq!(
        metric(&text, "switchyard_adapter_loads_total{result=\"ok\"}"),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "switchyard_adapter_unloads_total{result=\"ok\"}"),
        Some(1.0)
    );
    assert_eq!(metric_sum(&text, "switchyard_adapter_loads_total"), 1.0);
    let worker_text = metrics_text(&client, holder_base).await;
    assert_eq!(
        metric(&worker_text, "switchyard_engine_lora_loads_total"),
        Some(2.0)
    );
    assert_eq!(
        metric(&worker_text, "switchyard_engine_lora_unloads_total"),
        Some(1.0)
    );
    assert_eq!(
        metric(&worker_text, "switchyard_engine_lora_adapters"),
        Some(1.0)
    );
}

/// `prompt` (token ids) for `model` on `base`: its status and the worker
/// that served it.
async fn ask_tokens(
    client: &reqwest::Client,
    base: &str,
    model: &str,
    prompt: &[u32],
) -> (u16, String) {
    let body = json!({"model": model, "prompt": prompt, "max_tokens": 2});
    let (status, worker, _) = completion(client, base, &body).await;
    (status, worker)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_repeated_adapter_prompt_follows_the_worker_whose_events_published_its_blocks() {
    let _machine = machine().await;
    // Two workers, both holding adapter a, publishing KV events to the
    // router.
    let events = [
        "--kv-events",
        "tcp://127.0.0.1:*",
        "--kv-replay",
        "tcp://127.0.0.1:*",
    ];
    let worker = || adapter_worker("a", "0", &events);
    let workers = [worker(), worker()];
    let specs: Vec<String> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| w.named_with_events(&format!("w{i}")))
        .collect();
    let config = scratch_file(
        "adapters-affinity.toml",
        br#"
[[adapters]]
name = "a"
path = "/adapters/a"
base_model = "switchyard-sim"
"#,
    );
    let router = router(&specs, &["--config", config.to_str().unwrap()]);
    let base = router.base.clone();
    let client = reqwest::Client::new();
    wait_metrics(&client, &base, "both workers' adapters learned", |m| {
        metric(m, "switchyard_adapters_loaded") == Some(2.0)
    })
    .await;

    // Four 160-token prompts (10 blocks each) under adapter a, each sent
    // straight to one worker: only that worker's events tell the router
    // it holds them. The holders are not an alternation (a round robin
    // over idle workers would match one).
    let holders = [1, 1, 0, 0];
    let prompts: Vec<Vec<u32>> = (0..4u32)
        .map(|p| (0..160).map(|t| 100_000 * (p + 1) + t).collect())
        .collect();
    for (prompt, &holder) in prompts.iter().zip(&holders) {
        let (status, _) = ask_tokens(&client, &workers[holder].base, "a", prompt).await;
        assert_eq!(status, 200);
    }
    wait_metrics(&client, &base, "the workers' adapter blocks indexed", |m| {
        metric(m, "switchyard_index_blocks") >= Some(40.0)
    })
    .await;

    // The router hashes each prompt with adapter a's seed, as the workers'
    // events (lora_name "a") were hashed: each goes back to its holder.
    for _ in 0..2 {
        for (i, (prompt, holder)) in prompts.iter().zip(holders).enumerate() {
            assert_eq!(
                ask_tokens(&client, &base, "a", prompt).await,
                (200, format!("w{holder}")),
                "prompt {i} follows its blocks"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_adapter_cards_neither_shadow_a_base_model_nor_get_loaded_elsewhere() {
    let _machine = machine().await;
    // w0 serves "other" and announces an adapter card named
    // "switchyard-sim" (the model w1 serves) with a path of its choosing,
    // and an adapter "sql" nobody configured; w1 serves switchyard-sim.
    let w0 = sim_worker_with(
        0,
        &[
            "--model",
            "other",
            "--max-loras",
            "2",
            "--lora-modules",
            "switchyard-sim=/somewhere/else",
            "--lora-modules",
            "sql=/adapters/sql",
        ],
    );
    let w1 = sim_worker_with::<&str>(0, &[]);
    let w2 = sim_worker_with(0, &["--model", "other", "--max-loras", "2"]);
    let router = router(
        &[w0.named("w0"), w1.named("w1"), w2.named("w2")],
        &["--policy", "round-robin"],
    );
    let base = router.base.clone();
    let client = reqwest::Client::new();
    wait_metrics(&client, &base, "the poisoning card refused", |m| {
        metric(m, "switchyard_adapter_dropped_total{result=\"shadow\"}") >= Some(1.0)
    })
    .await;
    // switchyard-sim stays a base model: its requests go to w1, never to
    // the worker that named an adapter after it.
    for i in 0..6 {
        assert_eq!(
            ask(&client, &base, "switchyard-sim", i * 100).await,
            (200, "w1".into())
        );
    }
    // "sql" is learned (its parent, "other", is w0's base model) and runs
    // only where it is loaded: round-robin would otherwise send every
    // other request to w2, and have w2 load a path w0 chose.
    let asks = (0..8u32).map(|i| {
        let (client, base) = (client.clone(), base.clone());
        async move { ask(&client, &base, "sql", 1_000 + i * 100).await }
    });
    for answer in futures_util::future::join_all(asks).await {
        assert_eq!(answer, (200, "w0".into()));
    }
    assert!(adapters_of(&client, &w2.base).await.is_empty());
    let text = metrics_text(&client, &base).await;
    assert_eq!(
        metric_sum(&text, "switchyard_adapter_loads_total"),
        0.0,
        "{text}"
    );
}
