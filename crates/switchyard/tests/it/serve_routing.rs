//! The router as a real process in front of real sim-worker processes,
//! driven over loopback by a real HTTP client.

use crate::support::{
    machine, metric, metrics_text, router, served_by, sim_worker, sim_worker_with, wait_metrics,
};
use futures_util::StreamExt;
use serde_json::json;
use std::collections::HashSet;
use std::time::Duration;
use switchyard_wire::prometheus::Scrape;

/// Streams one request to its end; returns (status, worker, SSE events, saw [DONE]).
async fn stream_completion(
    client: &reqwest::Client,
    base: &str,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> Result<(u16, String, usize, bool), String> {
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"model": "switchyard-sim", "prompt": prompt, "max_tokens": max_tokens, "stream": true}))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    let status = response.status().as_u16();
    let worker = response
        .headers()
        .get("x-switchyard-worker")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let mut body = response.bytes_stream();
    let mut text = Vec::new();
    while let Some(chunk) = body.next().await {
        match chunk {
            Ok(c) => text.extend_from_slice(&c),
            Err(_) => break,
        }
    }
    let text = String::from_utf8_lossy(&text);
    let events = text.matches("data:").count();
    Ok((status, worker, events, text.contains("data: [DONE]")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_stream_through_the_router_and_survive_a_worker_dying_mid_run() {
    let _machine = machine().await;
    let w0 = sim_worker("20");
    let w1 = sim_worker("20");
    let router = router(&[w0.named("w0"), w1.named("w1")], &["--policy", "kv"]);
    let base = router.base.clone();
    let client = reqwest::Client::new();

    // Models are the union of the workers'.
    let models: serde_json::Value = client
        .get(format!("{base}/v1/models"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "switchyard-sim");

    // Non-streaming chat: the worker's JSON comes back with the worker named.
    let response = client
        .post(format!("{base}/v1/chat/completions"))
        .json(&json!({
            "model": "switchyard-sim",
            "messages": [{"role": "user", "content": "Route me somewhere with a warm cache."}],
            "max_tokens": 4,
        }))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let worker = served_by(&response);
    assert!(worker == "w0" || worker == "w1", "{worker}");
    let body: serde_json::Value = response.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");

    // Streaming completion with token ids.
    let (status, _, events, done) = stream_completion(&client, &base, (0..300).collect(), 6)
        .await
        .unwrap();
    assert_eq!(status, 200);
    assert!(events >= 6 && done, "events {events}, done {done}");

    // A steady streaming load; kill w0 while it runs.
    let mut tasks = Vec::new();
    for i in 0..12u32 {
        let client = client.clone();
        let base = base.clone();
        tasks.push(tokio::spawn(async move {
            let prompt: Vec<u32> = (i * 1000..i * 1000 + 200).collect();
            stream_completion(&client, &base, prompt, 400).await
        }));
    }
    wait_metrics(&client, &w0.base, "w0 to run some of the load", |t| {
        metric(t, "switchyard_engine_running") >= Some(1.0)
    })
    .await;
    let mut w0 = w0;
    w0.kill();
    let mut finished = 0;
    for task in tasks {
        // No request hangs: each ends (completed or cut) well within the timeout.
        let outcome = tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .expect("no request hangs after a worker dies")
            .unwrap();
        if let Ok((200, _, _, true)) = outcome {
            finished += 1;
        }
    }
    assert!(finished >= 1, "the surviving worker's requests complete");

    // The dead worker is not selected again.
    let mut seen = HashSet::new();
    for i in 0..10u32 {
        let response = client
            .post(format!("{base}/v1/completions"))
            .json(&json!({"prompt": (i * 7..i * 7 + 40).collect::<Vec<u32>>(), "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        if status == 200 {
            seen.insert(served_by(&response));
        } else {
            // At most the first request after the kill may find w0 before
            // the proxy or the health check takes it out.
            assert!(i == 0 && status == 502, "status {status} on request {i}");
        }
    }
    assert_eq!(seen, HashSet::from(["w1".to_owned()]));

    // Every booking is freed.
    wait_metrics(&client, &base, "every booking to be freed", |text| {
        metric(text, "switchyard_active_requests") == Some(0.0)
            && metric(text, "switchyard_worker_active_requests{worker=\"w1\"}") == Some(0.0)
            && metric(text, "switchyard_queue_depth") == Some(0.0)
    })
    .await;
    // Declared dead by its health checks (two failures, 200 ms apart):
    // waited for, since how long the run above took since the kill depends
    // on the workers' speed and the machine's load.
    wait_metrics(&client, &base, "w0 to be declared dead", |text| {
        metric(text, "switchyard_worker_up{worker=\"w0\"}") == Some(0.0)
    })
    .await;
    drop(w1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_disconnects_mid_stream_frees_its_booking() {
    let _machine = machine().await;
    let w0 = sim_worker("5");
    let router = router(&[w0.named("w0")], &[]);
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{}/v1/completions", router.base))
        .json(&json!({"prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 2000, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = response.bytes_stream();
    body.next().await.unwrap().unwrap();
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(metric(&text, "switchyard_active_requests"), Some(1.0));
    drop(body);
    wait_metrics(
        &client,
        &router.base,
        "the booking to be freed when the client goes away",
        |text| metric(text, "switchyard_active_requests") == Some(0.0),
    )
    .await;
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(
            &text,
            "switchyard_requests_total{policy=\"ttft\",status=\"cancelled\"}"
        ),
        Some(1.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn same_session_turns_are_serialized_on_one_worker_with_session_aware_admission() {
    let _machine = machine().await;
    let w0 = sim_worker("5");
    let w1 = sim_worker("5");
    let router = router(
        &[w0.named("w0"), w1.named("w1")],
        &["--admission", "session-aware"],
    );
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", router.base);
    let turn = |max_tokens: u32| {
        client
            .post(&url)
            .header("x-session-id", "conversation-1")
            .json(&json!({"prompt": (0..100).collect::<Vec<u32>>(), "max_tokens": max_tokens, "stream": true}))
            .send()
    };
    let first = turn(60).await.unwrap();
    let first_worker = served_by(&first);
    let started = std::time::Instant::now();
    let second = tokio::spawn({
        let client = client.clone();
        let url = url.clone();
        async move {
            let response = client
                .post(&url)
                .header("x-session-id", "conversation-1")
                .json(&json!({"prompt": (0..120).collect::<Vec<u32>>(), "max_tokens": 2}))
                .send()
                .await
                .unwrap();
            (std::time::Instant::now(), served_by(&response))
        }
    });
    // Read the first turn to its end, noting when its last token (the
    // chunk with its finish reason) arrived: the router frees the turn
    // only after that, when the worker's stream ends, so a second turn
    // placed while the first was running would answer before it. (The
    // end of the client's read is no bound: the router may free the turn
    // and place the next one while the last bytes are still on their way.)
    let mut first = first;
    let (mut seen, mut first_finished) = (Vec::new(), None);
    while let Some(chunk) = first.chunk().await.unwrap() {
        seen.extend_from_slice(&chunk);
        let finished = String::from_utf8_lossy(&seen).contains("\"finish_reason\":\"");
        if first_finished.is_none() && finished {
            first_finished = Some(std::time::Instant::now());
        }
    }
    let first_finished = first_finished.expect("the first turn ends with a finish reason");
    let (second_started, second_worker) = second.await.unwrap();
    // Each instant is taken by the task that read it, and on a loaded
    // machine either task may read late (CI once saw the second's answer
    // read 1.2 ms before the first's last chunk, 84 ms in). A second turn
    // placed while the first ran would answer within its own short
    // prefill, long before the first's 60 tokens end: it must come after
    // the first's last chunk, give or take a tenth of the first's time.
    let slack = (first_finished - started) / 10;
    assert!(
        second_started + slack >= first_finished,
        "the second turn answered {:?} after the first began, before the first's last token ({:?})",
        second_started - started,
        first_finished - started
    );
    assert_eq!(
        second_worker, first_worker,
        "the session stays on its worker"
    );
    // The strategy's deferral of the second turn is exported.
    let text = metrics_text(&client, &router.base).await;
    let deferred = Scrape::parse(&text)
        .value(
            "switchyard_admission_strategy_events_total",
            &[("event", "deferred_turns")],
        )
        .unwrap_or_else(|| panic!("no deferral series in /metrics:\n{text}"));
    assert!(deferred > 0.0, "the second turn was deferred: {text}");
    // With a strategy on, the health checks read each worker's KV usage
    // from its /metrics and feed it to the strategy; it is exported too.
    wait_metrics(
        &client,
        &router.base,
        "both workers' KV usage to be read",
        |text| {
            ["w0", "w1"].iter().all(|w| {
                metric(
                    text,
                    &format!("switchyard_worker_kv_usage_ratio{{worker=\"{w}\"}}"),
                )
                .is_some_and(|v| (0.0..=1.0).contains(&v))
            })
        },
    )
    .await;
}

/// `bench twin` end to end on a tiny slice: both sides run for every
/// policy, the serve side through real router and sim-worker processes,
/// and the JSON carries the documented keys. No figure is asserted beyond
/// "present and sane": the comparison itself is the benchmark's job.
#[test]
fn bench_twin_runs_both_sides_and_writes_the_documented_json() {
    let dir = std::env::temp_dir().join(format!("twin-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("twin.json");
    let status = std::process::Command::new(env!("CARGO_BIN_EXE_switchyard"))
        .args([
            "bench",
            "twin",
            "--requests",
            "12",
            "--workers",
            "2",
            "--policies",
            "kv,round-robin",
            "--speedup",
            "20",
            "--rate-scale",
            "200",
            "--json",
        ])
        .arg(&json)
        .env("RUST_LOG", "warn")
        .stdout(std::process::Stdio::null())
        .status()
        .expect("the switchyard binary runs");
    assert!(status.success());
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for policy in ["kv", "round-robin"] {
        for side in ["replay", "serve"] {
            let s = &report["policies"][policy][side];
            for key in ["hit_rate", "ttft_p50_ms", "ttft_p90_ms"] {
                let v = s[key]
                    .as_f64()
                    .unwrap_or_else(|| panic!("{policy}.{side}.{key}: {s}"));
                assert!(v.is_finite() && v >= 0.0, "{policy}.{side}.{key} = {v}");
            }
            assert_eq!(s["completed"], 12, "{policy}.{side}: {s}");
            assert_eq!(s["errors"], 0, "{policy}.{side}: {s}");
        }
    }
    assert!(report["verdict"]["order_by_ttft_p90"]["replay"].is_array());
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversations_earlier_messages_are_tokenized_once() {
    let _machine = machine().await;
    let w0 = sim_worker("20");
    let router = router(&[w0.named("w0")], &["--policy", "kv"]);
    let client = reqwest::Client::new();
    let question =
        "Which prompt prefixes does each worker hold in its KV cache, and how loaded is it?";
    let answer =
        "Every worker reports its KV events; the router keeps an index of the blocks they hold.";
    let mut messages = vec![json!({"role": "user", "content": question})];
    for turn in 0..3 {
        let response = client
            .post(format!("{}/v1/chat/completions", router.base))
            .json(&json!({"model": "switchyard-sim", "messages": messages, "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "turn {turn}");
        messages.push(json!({"role": "assistant", "content": format!("{turn}: {answer}")}));
        messages.push(json!({"role": "user", "content": format!("{turn}: {question}")}));
    }
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(metric(&text, "switchyard_tokenizer_fast_path"), Some(1.0));
    // Turns of 1, 3 and 5 messages: 9 segments looked up; the second turn
    // finds its first message, the third its first three. One more lookup,
    // a miss: the probe text tokenized when the worker entered, to check
    // that its engine tokenizes alike.
    assert_eq!(
        metric(&text, "switchyard_tokenizer_segment_cache_lookups_total"),
        Some(10.0)
    );
    assert_eq!(
        metric(&text, "switchyard_tokenizer_segment_cache_hits_total"),
        Some(4.0)
    );
    assert_eq!(
        metric(&text, "switchyard_tokenizer_segment_cache_hit_ratio"),
        Some(4.0 / 10.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_sub_agents_sharing_a_fresh_prompt_lands_on_one_worker() {
    let _machine = machine().await;
    // Three sim-workers publishing KV events, the router on its defaults.
    let events = [
        "--speedup",
        "1",
        "--num-blocks",
        "4096",
        "--kv-events",
        "tcp://127.0.0.1:*",
        "--kv-replay",
        "tcp://127.0.0.1:*",
    ];
    let workers: Vec<_> = (0..3).map(|_| sim_worker_with(0, &events)).collect();
    let specs: Vec<String> = workers
        .iter()
        .enumerate()
        .map(|(i, w)| w.named_with_events(&format!("w{i}")))
        .collect();
    let router = router(&specs, &[]);
    let client = reqwest::Client::new();
    // Four bursts of eight chat requests sent at once; each burst shares a
    // fresh system prompt of about 6,000 tokens (its words numbered by the
    // burst) and differs only in a short user message: sub-agents started
    // from their parent's context before any KV event names a worker.
    for burst in 0..4 {
        let system: String = (0..3000)
            .map(|i| format!("b{burst}w{i} "))
            .collect::<String>();
        let sends = (0..8).map(|agent| {
            let (client, base, system) = (client.clone(), router.base.clone(), system.clone());
            async move {
                let response = client
                    .post(format!("{base}/v1/chat/completions"))
                    .json(&json!({
                        "model": "switchyard-sim",
                        "messages": [
                            {"role": "system", "content": system},
                            {"role": "user", "content": format!("sub-agent {agent}: check part {agent}")},
                        ],
                        "max_tokens": 4,
                    }))
                    .send()
                    .await
                    .unwrap();
                assert_eq!(response.status(), 200, "burst {burst}, agent {agent}");
                served_by(&response)
            }
        });
        let placed: Vec<String> = futures_util::future::join_all(sends).await;
        let distinct: HashSet<&String> = placed.iter().collect();
        assert_eq!(distinct.len(), 1, "burst {burst} was spread: {placed:?}");
    }
}
