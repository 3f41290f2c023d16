//! `switchyard sim-worker` as a real process on loopback, driven by a real
//! HTTP client.

use crate::support::{
    machine, metric, metrics_text, sim_worker_with, wait_for, wait_metrics, PATIENCE,
};
use futures_util::StreamExt;

#[tokio::test]
async fn a_streaming_request_streams_tokens_and_moves_the_metrics() {
    let _machine = machine().await;
    let worker = sim_worker_with(
        0,
        &[
            "--num-blocks",
            "1024",
            "--speedup",
            "50",
            "--preemption",
            "spill",
            "--spill-blocks",
            "64",
        ],
    );
    let client = reqwest::Client::new();
    let prompt: Vec<u32> = (1000..1400).collect();
    let body = serde_json::json!({
        "model": "switchyard-sim",
        "prompt": prompt,
        "max_tokens": 8,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let response = client
        .post(format!("{}/v1/completions", worker.base))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    assert!(response.headers()["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/event-stream"));
    let mut stream = response.bytes_stream();
    let mut text = String::new();
    let mut chunks_seen = 0;
    while let Some(chunk) = stream.next().await {
        text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
        chunks_seen += 1;
    }
    assert!(chunks_seen >= 1);
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(data.last(), Some(&"[DONE]"));
    let events: Vec<serde_json::Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    let tokens = events
        .iter()
        .filter(|e| {
            e["choices"][0]["finish_reason"].is_null()
                && !e["choices"].as_array().unwrap().is_empty()
        })
        .count();
    assert_eq!(tokens, 8);
    let usage = &events.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], 400);
    assert_eq!(usage["completion_tokens"], 8);

    let metrics = metrics_text(&client, &worker.base).await;
    assert_eq!(
        metric(&metrics, "switchyard_engine_prompt_tokens_total"),
        Some(400.0)
    );
    assert_eq!(
        metric(&metrics, "switchyard_engine_generation_tokens_total"),
        Some(8.0)
    );
    assert!(metric(&metrics, "switchyard_engine_cached_blocks") >= Some(25.0));
    // The engine's scheduling counters are exported, each a counter with
    // its help text; one request in a large pool moves none of them.
    for name in [
        "preemptions",
        "kept_out",
        "spills",
        "spill_loads",
        "spill_drops",
        "spill_fallbacks",
        "slot_compactions",
        "logits_bytes",
    ] {
        let family = format!("switchyard_engine_{name}_total");
        assert!(
            metrics.contains(&format!("# TYPE {family} counter\n"))
                && metrics.contains(&format!("# HELP {family} ")),
            "{family} in:\n{metrics}"
        );
        assert_eq!(metric(&metrics, &family), Some(0.0), "{family}");
    }

    // The same prompt again is served from the prefix cache.
    let second = client
        .post(format!("{}/v1/completions", worker.base))
        .json(&serde_json::json!({"prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .unwrap()
        .json::<serde_json::Value>()
        .await
        .unwrap();
    assert_eq!(
        second["usage"]["prompt_tokens_details"]["cached_tokens"],
        384
    );
    let metrics = metrics_text(&client, &worker.base).await;
    assert_eq!(
        metric(&metrics, "switchyard_engine_prefix_hit_tokens_total"),
        Some(384.0)
    );
}

#[tokio::test]
async fn chat_text_and_bad_input_get_openai_shaped_replies() {
    let _machine = machine().await;
    let worker = sim_worker_with(0, &["--no-delay", "--model", "m1"]);
    let client = reqwest::Client::new();
    let chat = client
        .post(format!("{}/v1/chat/completions", worker.base))
        .json(&serde_json::json!({
            "model": "m1",
            "messages": [{"role": "user", "content": "Hello!"}],
            "max_tokens": 4,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(chat.status(), 200);
    let chat: serde_json::Value = chat.json().await.unwrap();
    assert_eq!(chat["object"], "chat.completion");
    assert_eq!(chat["usage"]["completion_tokens"], 4);
    assert!(
        chat["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .len()
            > 1
    );

    for (body, status) in [
        (r#"{"prompt": "#.to_owned(), 400),
        (r#"{"prompt": [], "max_tokens": 1}"#.to_owned(), 400),
        (r#"{"prompt": "hi", "max_tokens": 0}"#.to_owned(), 400),
        (r#"{"prompt": "hi", "model": "other"}"#.to_owned(), 404),
        (
            format!(r#"{{"prompt": {:?}, "max_tokens": 1}}"#, vec![7u32; 40_000]),
            400,
        ),
    ] {
        let reply = client
            .post(format!("{}/v1/completions", worker.base))
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), status);
        let error: serde_json::Value = reply.json().await.unwrap();
        assert!(error["error"]["message"].is_string());
    }

    for path in [
        "/health",
        "/health_generate",
        "/get_server_info",
        "/get_model_info",
        "/v1/models",
    ] {
        let reply = client
            .get(format!("{}{path}", worker.base))
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 200, "{path}");
    }
}

/// A real subscriber to `worker`'s KV events (its ZMQ endpoints), applying
/// them as worker `id` to an index of every tier, once the subscription
/// delivers. A SUB socket's subscription reaches the publisher some time
/// after `connect` (ZMQ's slow joiner), and what is published before that
/// is never delivered; a subscriber learns the history by replay at the
/// first event it does receive. So the worker is prompted with fresh
/// prompts until `delivered` holds: from then on nothing is lost, whatever
/// the machine's load.
async fn subscribed(
    worker: &crate::support::Proc,
    id: switchyard_core::WorkerId,
    delivered: impl Fn(&switchyard_core::index::TieredIndex) -> bool,
) -> (
    std::sync::Arc<std::sync::Mutex<switchyard_core::index::TieredIndex>>,
    switchyard_kv_events::subscriber::KvEventSubscriber,
) {
    use std::sync::{Arc, Mutex};
    use switchyard_core::index::TieredIndex;
    use switchyard_kv_events::metrics::KvEventMetrics;
    use switchyard_kv_events::subscriber::{KvEventSubscriber, SubscriberConfig};

    let (pub_endpoint, replay_endpoint) = worker.kv.clone().expect("kv endpoints printed");
    let index = Arc::new(Mutex::new(TieredIndex::new()));
    let metrics = KvEventMetrics::new();
    let mut config = SubscriberConfig::new(id, pub_endpoint, 16);
    config.replay_endpoint = Some(replay_endpoint);
    let context = zmq::Context::new();
    let subscriber =
        KvEventSubscriber::spawn(&context, config, index.clone(), metrics.worker("w")).unwrap();
    let client = reqwest::Client::new();
    let completions = format!("{}/v1/completions", worker.base);
    let mut nudge = 0u32;
    wait_for(
        "the subscription to deliver an event",
        PATIENCE,
        async || {
            // A fresh prompt each time: a cached one stores no block.
            nudge += 1;
            let prompt: Vec<u32> = (0..64).map(|t| 500_000 + 64 * nudge + t).collect();
            let reply = client
                .post(&completions)
                .json(&serde_json::json!({"prompt": prompt, "max_tokens": 1}))
                .send()
                .await
                .unwrap();
            assert_eq!(reply.status(), 200);
            reply.bytes().await.unwrap();
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            delivered(&index.lock().unwrap())
        },
    )
    .await;
    (index, subscriber)
}

/// `/debug/kv_cache`'s engine hashes under `tier`.
async fn cached_hashes(
    client: &reqwest::Client,
    worker: &crate::support::Proc,
    tier: &str,
) -> Vec<u64> {
    let cache: serde_json::Value = client
        .get(format!("{}/debug/kv_cache", worker.base))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    cache[tier]
        .as_array()
        .unwrap()
        .iter()
        .map(|h| h.as_u64().unwrap())
        .collect()
}

/// Whether `index` holds exactly `hashes` for `id`.
fn holds_exactly(
    index: &switchyard_core::index::PrefixIndex,
    id: switchyard_core::WorkerId,
    hashes: &[u64],
) -> bool {
    index.worker_blocks(id) == hashes.len()
        && hashes
            .iter()
            .all(|&h| index.holds(id, switchyard_core::EngineHash(h)))
}

#[tokio::test]
async fn a_subscriber_to_the_workers_kv_events_ends_with_the_workers_cache() {
    let _machine = machine().await;
    use switchyard_core::WorkerId;

    // A small pool so that later prompts evict earlier ones: removals flow
    // too, and evicted blocks spill into the host tier (medium "CPU").
    let worker = sim_worker_with(
        0,
        &[
            "--no-delay",
            "--num-blocks",
            "64",
            "--host-blocks",
            "48",
            "--kv-events",
            "tcp://127.0.0.1:*",
            "--kv-replay",
            "tcp://127.0.0.1:*",
        ],
    );
    let id = WorkerId::new(7);
    let (index, subscriber) =
        subscribed(&worker, id, |index| index.device().worker_blocks(id) > 0).await;
    let client = reqwest::Client::new();
    for round in 0..6u32 {
        // Pairs of prompts share a 320-token prefix.
        let mut prompt: Vec<u32> = (0..320).map(|t| 10_000 * (round / 2) + t).collect();
        prompt.extend((0..200).map(|t| 900_000 + 1_000 * round + t));
        let reply = client
            .post(format!("{}/v1/completions", worker.base))
            .json(
                &serde_json::json!({"prompt": prompt, "max_tokens": 20, "stream": round % 2 == 0}),
            )
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 200);
        reply.bytes().await.unwrap();
    }

    wait_for(
        "the subscriber's index to match the worker's cache",
        PATIENCE,
        async || {
            let device = cached_hashes(&client, &worker, "device").await;
            let host = cached_hashes(&client, &worker, "host").await;
            assert!(!device.is_empty());
            let index = index.lock().unwrap();
            !host.is_empty()
                && holds_exactly(index.device(), id, &device)
                && holds_exactly(index.host(), id, &host)
        },
    )
    .await;
    let text = metrics_text(&client, &worker.base).await;
    assert!(metric(&text, "switchyard_engine_kv_batches_published_total") > Some(0.0));
    assert_eq!(
        metric(&text, "switchyard_engine_kv_events_dropped_total"),
        Some(0.0)
    );
    subscriber.shutdown();
}

#[tokio::test]
async fn a_subscriber_to_a_hybrid_workers_events_holds_its_ssm_checkpoints() {
    let _machine = machine().await;
    use switchyard_core::index::OverlapScores;
    use switchyard_core::{LocalHash, WorkerId};

    // Every block boundary kept, at most 24: later prompts evict earlier
    // states, so removals of the SSM group flow too.
    let worker = sim_worker_with(
        0,
        &[
            "--no-delay",
            "--architecture",
            "hybrid",
            "--checkpoints",
            "every-block",
            "--max-checkpoints",
            "24",
            "--kv-events",
            "tcp://127.0.0.1:*",
            "--kv-replay",
            "tcp://127.0.0.1:*",
        ],
    );
    let id = WorkerId::new(9);
    let (index, subscriber) = subscribed(&worker, id, |index| {
        index.checkpoint().worker_blocks(id) > 0
    })
    .await;
    let client = reqwest::Client::new();
    for round in 0..4u32 {
        let prompt: Vec<u32> = (0..160).map(|t| 10_000 * round + t).collect();
        let reply = client
            .post(format!("{}/v1/completions", worker.base))
            .json(&serde_json::json!({"prompt": prompt, "max_tokens": 4}))
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 200);
        reply.bytes().await.unwrap();
    }

    wait_for(
        "the subscriber's checkpoint index to match the worker's states",
        PATIENCE,
        async || {
            let states = cached_hashes(&client, &worker, "ssm_checkpoints").await;
            assert!(states.len() <= 24);
            states.len() == 24 && holds_exactly(index.lock().unwrap().checkpoint(), id, &states)
        },
    )
    .await;
    // The last prompt's states are the newest: the router credits it up
    // to its deepest one, the end of its last whole block.
    {
        let index = index.lock().unwrap();
        assert!(index.is_hybrid(id));
        let last: Vec<u32> = (0..160).map(|t| 30_000 + t).collect();
        let hashes: Vec<LocalHash> = switchyard_core::hashing::local_block_hashes(
            &last,
            16,
            switchyard_core::hashing::DEFAULT_SEED,
        );
        let mut device = OverlapScores::new();
        index.device().overlaps(&hashes, &mut device);
        let mut deepest = OverlapScores::new();
        index
            .checkpoint()
            .deepest_within(&hashes, |w| device.depth(w), &mut deepest);
        assert_eq!(deepest.depth(id), 10, "160 tokens: 10 blocks, all kept");
    }
    let text = metrics_text(&client, &worker.base).await;
    assert_eq!(
        metric(&text, "switchyard_engine_kv_events_dropped_total"),
        Some(0.0)
    );
    subscriber.shutdown();
}

#[tokio::test]
async fn a_subscriber_indexes_an_adapters_blocks_under_the_hashes_the_router_computes_for_it() {
    let _machine = machine().await;
    use switchyard_core::hashing::{local_block_hashes, seed_for, DEFAULT_SEED};
    use switchyard_core::index::OverlapScores;
    use switchyard_core::WorkerId;

    let worker = sim_worker_with(
        0,
        &[
            "--no-delay",
            "--max-loras",
            "1",
            "--lora-load-ms",
            "0",
            "--lora-modules",
            "sql=/adapters/sql",
            "--kv-events",
            "tcp://127.0.0.1:*",
            "--kv-replay",
            "tcp://127.0.0.1:*",
        ],
    );
    let id = WorkerId::new(11);
    let (index, subscriber) =
        subscribed(&worker, id, |index| index.device().worker_blocks(id) > 0).await;
    let client = reqwest::Client::new();
    // 160 tokens: 10 blocks of 16.
    let prompt: Vec<u32> = (0..160).map(|t| 70_000 + t).collect();
    let ask = async |model: &str| {
        let reply = client
            .post(format!("{}/v1/completions", worker.base))
            .json(&serde_json::json!({"model": model, "prompt": prompt, "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(reply.status(), 200);
        reply.bytes().await.unwrap();
    };
    // The blocks the index credits the worker with, hashed as the router
    // hashes a request's prompt (`seed_for(adapter, None)`).
    let depth = |seed: u64| {
        let hashes = local_block_hashes(&prompt, 16, seed);
        let mut scores = OverlapScores::new();
        index
            .lock()
            .unwrap()
            .device()
            .overlaps(&hashes, &mut scores);
        scores.depth(id)
    };
    let sql = seed_for(Some("sql"), None);

    ask("sql").await;
    wait_for(
        "the adapter's blocks indexed under its seed",
        PATIENCE,
        async || depth(sql) == 10,
    )
    .await;
    assert_eq!(depth(DEFAULT_SEED), 0, "not under the base model's");

    // The base model's identical prompt shares nothing with the adapter's:
    // computed again, indexed under its own seed.
    ask("switchyard-sim").await;
    wait_for(
        "the base model's blocks indexed under its seed",
        PATIENCE,
        async || depth(DEFAULT_SEED) == 10,
    )
    .await;
    assert_eq!(depth(sql), 10);
    let text = metrics_text(&client, &worker.base).await;
    assert_eq!(
        metric(&text, "switchyard_engine_prefix_hit_tokens_total"),
        Some(0.0),
        "neither found the other's KV"
    );
    // The adapter's own prompt again is a hit.
    ask("sql").await;
    wait_metrics(
        &client,
        &worker.base,
        "the adapter's repeat hits its blocks",
        |t| metric(t, "switchyard_engine_prefix_hit_tokens_total") > Some(0.0),
    )
    .await;
    assert_eq!(
        metric(
            &metrics_text(&client, &worker.base).await,
            "switchyard_engine_kv_events_dropped_total"
        ),
        Some(0.0)
    );
    subscriber.shutdown();
}

#[tokio::test]
async fn a_client_that_hangs_up_mid_stream_cancels_its_request() {
    let _machine = machine().await;
    let worker = sim_worker_with(0, &["--speedup", "1"]);
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{}/v1/completions", worker.base))
        .json(&serde_json::json!({"prompt": [5, 6, 7, 8], "max_tokens": 5000, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut stream = response.bytes_stream();
    stream.next().await.unwrap().unwrap();
    drop(stream);

    wait_metrics(
        &client,
        &worker.base,
        "the request to be cancelled",
        |text| {
            metric(
                text,
                "switchyard_engine_requests_total{status=\"cancelled\"}",
            ) == Some(1.0)
                && metric(text, "switchyard_engine_running") == Some(0.0)
        },
    )
    .await;
}

#[tokio::test]
async fn return_token_ids_adds_each_chunks_token_ids_and_only_when_asked() {
    let _machine = machine().await;
    let worker = sim_worker_with(0, &["--num-blocks", "1024", "--speedup", "0"]);
    let client = reqwest::Client::new();
    for ask in [true, false] {
        let text = client
            .post(format!("{}/v1/completions", worker.base))
            .json(&serde_json::json!({"prompt": [1, 2, 3], "max_tokens": 4, "stream": true, "return_token_ids": ask}))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap();
        let chunks: Vec<serde_json::Value> = text
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .filter(|d| *d != "[DONE]")
            .map(|d| serde_json::from_str(d).unwrap())
            .collect();
        let with_ids = chunks
            .iter()
            .filter(|c| {
                c["choices"][0]["token_ids"]
                    .as_array()
                    .is_some_and(|a| a.len() == 1)
            })
            .count();
        assert_eq!(with_ids, if ask { 4 } else { 0 }, "{text}");
    }
}
