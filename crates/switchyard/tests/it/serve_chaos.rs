//! Chaos: a router and three sim-worker processes under a steady streaming
//! load; one worker is SIGKILLed mid-run and restarted on the same port.
//! Every stream must complete whole (migrated when its worker died) and
//! the router must end with nothing booked.

use crate::support::{
    machine, metric, metric_sum, metrics_text, router, sim_worker_on, wait_metrics,
};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The client-side limit on one request.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(15);

/// How one request ended.
#[derive(Debug)]
enum Outcome {
    /// A whole, well-formed stream with this many content chunks.
    Complete,
    /// An OpenAI-style error (status, message).
    Error(u16, String),
}

/// Streams one request and checks every event; `Err` is a violation.
async fn one_request(
    client: &reqwest::Client,
    base: &str,
    chat: bool,
    prompt_seed: u32,
    max_tokens: u32,
) -> Result<Outcome, String> {
    let (path, body) = if chat {
        (
            "/v1/chat/completions",
            json!({
                "model": "switchyard-sim",
                "messages": [{"role": "user", "content": format!("chaos request {prompt_seed}: keep streaming")}],
                "max_tokens": max_tokens,
                "stream": true,
            }),
        )
    } else {
        (
            "/v1/completions",
            json!({
                "model": "switchyard-sim",
                "prompt": (prompt_seed..prompt_seed + 48).collect::<Vec<u32>>(),
                "max_tokens": max_tokens,
                "stream": true,
                "stream_options": {"include_usage": prompt_seed % 2 == 0},
            }),
        )
    };
    let response = client
        .post(format!("{base}{path}"))
        .json(&body)
        .send()
        .await
        .map_err(|e| format!("send: {e}"))?;
    let status = response.status().as_u16();
    if status != 200 {
        let body: Value = response
            .json()
            .await
            .map_err(|e| format!("status {status} without a JSON body: {e}"))?;
        let message = body["error"]["message"]
            .as_str()
            .ok_or_else(|| format!("status {status} without an OpenAI error: {body}"))?;
        return Ok(Outcome::Error(status, message.to_owned()));
    }
    let mut bytes = Vec::new();
    let mut body = response.bytes_stream();
    while let Some(chunk) = body.next().await {
        bytes.extend_from_slice(&chunk.map_err(|e| format!("body broke: {e}"))?);
    }
    let text = String::from_utf8(bytes).map_err(|_| "the stream is not UTF-8".to_owned())?;
    let (object, tokens_wanted) = if chat {
        ("chat.completion.chunk", max_tokens)
    } else {
        ("text_completion", max_tokens)
    };
    let mut done = 0;
    let mut tokens = 0;
    let mut finish = None;
    let mut identity: Option<(Value, Value, Value)> = None;
    for event in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = event
            .strip_prefix("data: ")
            .ok_or_else(|| format!("an event without data: {event:?}"))?;
        if done > 0 {
            return Err(format!("an event after [DONE]: {data}"));
        }
        if data == "[DONE]" {
            done += 1;
            continue;
        }
        let v: Value = serde_json::from_str(data)
            .map_err(|e| format!("an event is not JSON ({e}): {data}"))?;
        if let Some(error) = v.get("error") {
            let message = error["message"]
                .as_str()
                .ok_or_else(|| format!("an error event without a message: {data}"))?;
            if !text.trim_end().ends_with(data) {
                return Err(format!("the stream went on after an error event: {text}"));
            }
            return Ok(Outcome::Error(200, message.to_owned()));
        }
        if v["object"] != object {
            return Err(format!("a chunk of the wrong shape: {data}"));
        }
        let this = (v["id"].clone(), v["model"].clone(), v["created"].clone());
        match &identity {
            None => identity = Some(this),
            Some(first) if *first != this => {
                return Err(format!(
                    "a chunk with another identity {this:?} than {first:?}"
                ))
            }
            Some(_) => {}
        }
        let Some(choice) = v["choices"].get(0) else {
            if v.get("usage").is_none() {
                return Err(format!("a chunk without choices or usage: {data}"));
            }
            continue;
        };
        let content = if chat {
            choice["delta"]["content"].as_str()
        } else {
            choice["text"].as_str()
        };
        if content.is_some_and(|c| !c.is_empty()) {
            tokens += 1;
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish = Some(reason.to_owned());
        }
    }
    if done != 1 {
        return Err(format!("{done} [DONE] events in {text}"));
    }
    if tokens != tokens_wanted && finish.is_none() {
        return Err(format!(
            "{tokens} tokens of {tokens_wanted} and no finish_reason: {text}"
        ));
    }
    if tokens != tokens_wanted {
        return Err(format!(
            "{tokens} tokens of {tokens_wanted} (finish {finish:?}): {text}"
        ));
    }
    Ok(Outcome::Complete)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_survive_a_worker_killed_and_restarted_under_load() {
    let _machine = machine().await;
    // Slowed workers: a 20-40 token stream lasts about 0.5-1.5 s.
    let speed = "0.2";
    let w0 = sim_worker_on(0, speed);
    let mut w1 = sim_worker_on(0, speed);
    let w2 = sim_worker_on(0, speed);
    let router = router(
        &[w0.named("w0"), w1.named("w1"), w2.named("w2")],
        &[
            "--policy",
            "round-robin",
            "--first-token-timeout",
            "5",
            "--request-timeout",
            "12",
        ],
    );
    let base = router.base.clone();
    let client = reqwest::Client::builder()
        .timeout(CLIENT_TIMEOUT)
        .build()
        .unwrap();

    let stop = Arc::new(AtomicBool::new(false));
    // Whole streams so far, for pacing the phases below.
    let completed = Arc::new(AtomicUsize::new(0));
    let mut loops = Vec::new();
    for i in 0..8u32 {
        let client = client.clone();
        let base = base.clone();
        let stop = stop.clone();
        let completed = completed.clone();
        loops.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            let mut n = 0u32;
            while !stop.load(Ordering::Relaxed) {
                let chat = (i + n) % 2 == 0;
                let max_tokens = 20 + 10 * ((i + n) % 3);
                let started = Instant::now();
                let outcome =
                    one_request(&client, &base, chat, i * 10_000 + n * 64, max_tokens).await;
                let took = started.elapsed();
                if let Ok(Outcome::Complete) = outcome {
                    completed.fetch_add(1, Ordering::Relaxed);
                }
                outcomes.push((outcome, took));
                n += 1;
            }
            outcomes
        }));
    }

    // Load on three workers (a stream done per client loop), then SIGKILL
    // w1 mid-stream.
    wait_metrics(&client, &base, "steady load with streams on w1", |text| {
        completed.load(Ordering::Relaxed) >= 8
            && metric(text, "switchyard_worker_active_requests{worker=\"w1\"}") >= Some(1.0)
    })
    .await;
    w1.kill();
    // Load on two (the router took w1 out, and as many streams again
    // completed without it), then w1 comes back on its port.
    let before = completed.load(Ordering::Relaxed);
    wait_metrics(&client, &base, "load on the two survivors", |text| {
        completed.load(Ordering::Relaxed) >= before + 8
            && metric(text, "switchyard_worker_up{worker=\"w1\"}") == Some(0.0)
    })
    .await;
    let w1 = sim_worker_on(w1.port(), speed);
    wait_metrics(
        &client,
        &base,
        "the restarted worker to be re-admitted by the health checks",
        |text| metric(text, "switchyard_worker_up{worker=\"w1\"}") == Some(1.0),
    )
    .await;
    // Load on three again, until the restarted worker has served some of
    // it and at least 20 streams completed in all.
    wait_metrics(
        &client,
        &w1.base,
        "the restarted worker to serve the load",
        |text| {
            completed.load(Ordering::Relaxed) >= 20
                && metric_sum(text, "switchyard_engine_requests_total") >= 2.0
        },
    )
    .await;
    stop.store(true, Ordering::Relaxed);

    let mut complete = 0;
    let mut errors = Vec::new();
    for l in loops {
        for (outcome, took) in l.await.unwrap() {
            assert!(took < CLIENT_TIMEOUT, "a request took {took:?}");
            match outcome {
                Ok(Outcome::Complete) => complete += 1,
                Ok(Outcome::Error(status, message)) => errors.push((status, message)),
                Err(violation) => panic!("a malformed response: {violation}"),
            }
        }
    }
    // Two workers were always up: no request had to fail.
    assert!(errors.is_empty(), "requests failed: {errors:?}");
    assert!(complete >= 20, "only {complete} requests completed");

    let text = metrics_text(&client, &base).await;
    let migrations = metric_sum(&text, "switchyard_migrations_total");
    eprintln!("chaos: {complete} streams complete, {migrations} migrations");
    assert!(migrations >= 1.0, "no migration happened:\n{text}");

    // Nothing stays booked or queued on the router ...
    wait_metrics(&client, &base, "the router to be idle", |text| {
        metric(text, "switchyard_active_requests") == Some(0.0)
            && metric_sum(text, "switchyard_worker_active_requests") == 0.0
            && metric_sum(text, "switchyard_worker_active_prefill_tokens") == 0.0
            && metric(text, "switchyard_queue_depth") == Some(0.0)
    })
    .await;
    // ... nor runs on any worker.
    for w in [&w0, &w1, &w2] {
        wait_metrics(&client, &w.base, "the worker to run nothing", |text| {
            metric(text, "switchyard_engine_running") == Some(0.0)
        })
        .await;
    }

    // The restarted worker serves requests again.
    let mut served_by_w1 = false;
    for i in 0..9u32 {
        let response = client
            .post(format!("{base}/v1/completions"))
            .json(&json!({"prompt": (i..i + 20).collect::<Vec<u32>>(), "max_tokens": 2}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        served_by_w1 |= response.headers()["x-switchyard-worker"] == "w1";
    }
    assert!(served_by_w1, "the restarted worker takes requests");
}
