//! Worker failures, overload and shutdown, with real router and sim-worker
//! processes over loopback. Every wait polls with a generous timeout: a
//! slow machine makes these tests slower, never red.

use crate::support::{
    machine, metric, metrics_text, openai_error, poll, scratch_file, serve, sim_worker,
    sim_worker_on, sim_worker_with, wait_for, wait_metrics, PATIENCE,
};
use futures_util::StreamExt;
use serde_json::json;
use std::time::{Duration, Instant};

async fn complete(client: &reqwest::Client, base: &str, seed: u32) -> (u16, String) {
    let prompt: Vec<u32> = (seed * 100..seed * 100 + 48).collect();
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": prompt, "max_tokens": 2}))
        .send()
        .await
        .expect("the router answers");
    let worker = response
        .headers()
        .get("x-switchyard-worker")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    (response.status().as_u16(), worker)
}

/// An OpenAI-style error with `Retry-After`, as every overload answer is.
async fn assert_retryable_error(response: reqwest::Response) -> u16 {
    let status = response.status().as_u16();
    assert!(
        response.headers().get("retry-after").is_some(),
        "a {status} without Retry-After"
    );
    openai_error(response).await;
    status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_worker_leaves_the_router_core_and_a_restart_on_the_same_port_is_readmitted() {
    let _machine = machine().await;
    // KV events and their replay on free ports; the restart below binds the
    // same ones.
    let flags = ["--speedup", "1", "--num-blocks", "1024"];
    let any_port = [
        "--kv-events",
        "tcp://127.0.0.1:*",
        "--kv-replay",
        "tcp://127.0.0.1:*",
    ];
    let mut w0 = sim_worker_with(0, &[&flags[..], &any_port[..]].concat());
    let (events, replay) = w0.kv.clone().expect("the worker prints its KV endpoints");
    let spec = format!("{},events={events},replay={replay}", w0.named("w0"));
    let router = serve(&["--worker", &spec, "--health-interval-ms", "200"]);
    let base = router.base.clone();
    let client = reqwest::Client::new();

    // Served, and the worker's KV events fill the index.
    served_and_indexed(&client, &base).await;

    // A long stream keeps one booking active on w0 when it dies.
    let stream = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 4000, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = stream.bytes_stream();
    body.next().await.unwrap().unwrap();
    let text = metrics_text(&client, &base).await;
    assert_eq!(
        metric(&text, "switchyard_worker_active_requests{worker=\"w0\"}"),
        Some(1.0)
    );
    // Following KV events, requests were routed before the routing lock.
    let used = metric(&text, "switchyard_pre_routes_used_total").unwrap_or(0.0);
    assert!(
        used >= 1.0,
        "no route made before the lock was used:\n{text}"
    );

    w0.kill();
    // The stream ends (cut), it does not hang.
    tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(Ok(_)) = body.next().await {}
    })
    .await
    .expect("a stream from a dead worker ends");
    wait_metrics(
        &client,
        &base,
        "the dead worker is out of selection with no index entries or bookings",
        |t| {
            metric(t, "switchyard_worker_up{worker=\"w0\"}") == Some(0.0)
                && metric(t, "switchyard_index_blocks") == Some(0.0)
                && metric(t, "switchyard_worker_active_requests{worker=\"w0\"}") == Some(0.0)
                && metric(t, "switchyard_active_requests") == Some(0.0)
        },
    )
    .await;
    // Nothing routes to it: no stale entry survives.
    let response = client
        .post(format!("{base}/v1/completions"))
        .json(&json!({"prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(assert_retryable_error(response).await, 503);

    // The same URL comes back: the health checks re-admit it, a fresh
    // subscriber rebuilds its index, and it serves again.
    let same_ports = ["--kv-events", &events, "--kv-replay", &replay];
    let _w0 = sim_worker_with(w0.port(), &[&flags[..], &same_ports[..]].concat());
    wait_metrics(&client, &base, "the restarted worker is re-admitted", |t| {
        metric(t, "switchyard_worker_up{worker=\"w0\"}") == Some(1.0)
    })
    .await;
    served_and_indexed(&client, &base).await;
}

/// Sends requests (each storing new blocks) until the router has indexed
/// some: a SUB socket misses what is published before it connects, and
/// the first batch it does receive makes it replay the earlier ones.
async fn served_and_indexed(client: &reqwest::Client, base: &str) {
    let mut seed = 0;
    let mut text = String::new();
    let indexed = poll(PATIENCE, async || {
        seed += 1;
        assert_eq!(complete(client, base, seed).await, (200, "w0".to_owned()));
        text = metrics_text(client, base).await;
        metric(&text, "switchyard_index_blocks").unwrap_or(0.0) > 0.0
    })
    .await;
    assert!(
        indexed.is_some(),
        "the worker's blocks never reached the index:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn consecutive_failures_open_a_workers_circuit_and_a_probe_closes_it() {
    let _machine = machine().await;
    let mut w0 = sim_worker("0");
    let w1 = sim_worker("0");
    // Health checks are slow here: only the circuit breaker reacts.
    let router = serve(&[
        "--worker",
        &w0.named("w0"),
        "--worker",
        &w1.named("w1"),
        "--policy",
        "round-robin",
        "--health-interval-ms",
        "600000",
        "--circuit-failures",
        "3",
        "--circuit-cooldown-ms",
        "300",
    ]);
    let base = router.base.clone();
    let client = reqwest::Client::new();
    let mut served = std::collections::HashSet::new();
    for i in 0..4 {
        served.insert(complete(&client, &base, i).await.1);
    }
    assert_eq!(served.len(), 2, "both workers serve: {served:?}");

    w0.kill();
    // Round-robin keeps offering w0 until three failures open its circuit;
    // each failed attempt migrates to w1, so the client sees only w1's 200s.
    for i in 0..60 {
        let (status, worker) = complete(&client, &base, 10 + i).await;
        assert_eq!(
            (status, worker.as_str()),
            (200, "w1"),
            "a request refused by the dead w0 moves to w1 transparently"
        );
        let text = metrics_text(&client, &base).await;
        if metric(&text, "switchyard_circuit_state{worker=\"w0\"}") == Some(1.0) {
            break;
        }
    }
    let text = metrics_text(&client, &base).await;
    assert_eq!(
        metric(&text, "switchyard_circuit_state{worker=\"w0\"}"),
        Some(1.0),
        "{text}"
    );
    let failures = metric(&text, "switchyard_upstream_failures_total").unwrap_or(0.0);
    assert!(failures >= 3.0, "{failures} failures opened the circuit");
    assert_eq!(
        metric(&text, "switchyard_migrations_total{reason=\"connect\"}"),
        Some(failures),
        "every failure was a refused connection, migrated"
    );
    assert_eq!(
        metric(
            &text,
            "switchyard_circuit_transitions_total{worker=\"w0\",to=\"open\"}"
        ),
        Some(1.0)
    );
    assert_eq!(
        metric(&text, "switchyard_circuit_state{worker=\"w1\"}"),
        Some(0.0)
    );
    // The worker is still in the router (health checks have not run), but
    // while its circuit is open every request goes to w1, and a probe of
    // the dead w0 fails, re-opens the circuit and migrates to w1: the
    // client sees only w1's 200s.
    for i in 0..6 {
        let (status, worker) = complete(&client, &base, 100 + i).await;
        assert_eq!(
            (status, worker.as_str()),
            (200, "w1"),
            "an open or probing w0 never costs the client a request"
        );
    }

    // w0 comes back on the same port: after a cooldown the half-open
    // circuit lets one probe through, which succeeds and closes it.
    let _w0 = sim_worker_on(w0.port(), "0");
    let closed = poll(PATIENCE, async || {
        let _ = complete(&client, &base, 200).await;
        let text = metrics_text(&client, &base).await;
        metric(&text, "switchyard_circuit_state{worker=\"w0\"}") == Some(0.0)
    })
    .await;
    let text = metrics_text(&client, &base).await;
    assert!(closed.is_some(), "{text}");
    assert!(
        metric(
            &text,
            "switchyard_circuit_transitions_total{worker=\"w0\",to=\"half_open\"}"
        )
        .unwrap_or(0.0)
            >= 1.0
    );
    assert_eq!(
        metric(
            &text,
            "switchyard_circuit_transitions_total{worker=\"w0\",to=\"closed\"}"
        ),
        Some(1.0)
    );
    let mut served = std::collections::HashSet::new();
    for i in 0..4 {
        let (status, worker) = complete(&client, &base, 300 + i).await;
        assert_eq!(status, 200);
        served.insert(worker);
    }
    assert_eq!(served.len(), 2, "w0 serves again: {served:?}");
}

/// Resident memory of a process, in KiB.
fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_far_above_capacity_is_refused_with_retry_after_and_service_resumes() {
    let _machine = machine().await;
    let w0 = sim_worker("1");
    let w1 = sim_worker("1");
    // One request makes a worker busy and eight may wait in the queue: two
    // dispatched plus eight queued is the in-flight limit of 10, so the
    // in-flight limit (503) refuses most of the burst; a queue that fills
    // while a slot is free refuses with 429.
    let config = scratch_file(
        "queue-of-eight.toml",
        b"busy_threshold = 0.001\n[queue.queue.default_limits]\nmax_requests = 8\nmax_uncached_tokens = 100000000\n",
    );
    let router = serve(&[
        "--worker",
        &w0.named("w0"),
        "--worker",
        &w1.named("w1"),
        "--config",
        config.to_str().unwrap(),
        "--max-inflight",
        "10",
    ]);
    let base = router.base.clone();
    let pid = router.child.id();
    let baseline = rss_kib(pid).expect("the router's VmRSS");

    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(120))
        .build()
        .unwrap();
    let sampler = {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut peak = 0;
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                peak = peak.max(rss_kib(pid).unwrap_or(0));
                // The sampling period, not a wait for anything.
                std::thread::sleep(Duration::from_millis(20));
            }
            peak
        });
        (stop, handle)
    };
    let burst: Vec<_> = (0..500u32)
        .map(|i| {
            let client = client.clone();
            let url = format!("{base}/v1/completions");
            tokio::spawn(async move {
                let prompt: Vec<u32> = (i * 64..i * 64 + 64).collect();
                let response = client
                    .post(url)
                    .json(&json!({"prompt": prompt, "max_tokens": 16}))
                    .send()
                    .await
                    .expect("no request hangs or is dropped");
                match response.status().as_u16() {
                    200 => {
                        response.bytes().await.expect("a whole answer");
                        200
                    }
                    _ => assert_retryable_error(response).await,
                }
            })
        })
        .collect();
    let mut counts = std::collections::BTreeMap::new();
    for task in burst {
        *counts.entry(task.await.unwrap()).or_insert(0u32) += 1;
    }
    sampler.0.store(true, std::sync::atomic::Ordering::Relaxed);
    let peak = sampler.1.join().unwrap();
    eprintln!("burst outcomes {counts:?}; router VmRSS {baseline} KiB before, peak {peak} KiB");
    assert!(
        counts.keys().all(|s| [200, 429, 503].contains(s)),
        "{counts:?}"
    );
    assert!(counts.get(&200).copied().unwrap_or(0) >= 1, "{counts:?}");
    assert!(
        counts.get(&429).copied().unwrap_or(0) + counts.get(&503).copied().unwrap_or(0) >= 100,
        "a burst 50x over capacity is mostly refused: {counts:?}"
    );
    assert!(counts.get(&503).copied().unwrap_or(0) >= 1, "{counts:?}");
    assert!(
        peak < baseline + 256 * 1024,
        "the router's memory stays bounded: {baseline} KiB → {peak} KiB"
    );
    let text = metrics_text(&client, &base).await;
    assert_eq!(
        metric(&text, "switchyard_inflight_rejected_total"),
        Some(f64::from(counts.get(&503).copied().unwrap_or(0))),
        "every 503 is an in-flight refusal"
    );

    // After the burst: nothing is left in flight and service is normal.
    wait_metrics(&client, &base, "every gauge returns to zero", |t| {
        metric(t, "switchyard_inflight_requests") == Some(0.0)
            && metric(t, "switchyard_active_requests") == Some(0.0)
            && metric(t, "switchyard_queue_depth") == Some(0.0)
    })
    .await;
    assert_eq!(complete(&client, &base, 9999).await.0, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_sigterm_requests_past_the_shutdown_timeout_end_with_an_error_and_the_worker_is_freed() {
    let _machine = machine().await;
    let w0 = sim_worker("1");
    let mut router = serve(&["--worker", &w0.named("w0"), "--shutdown-timeout-ms", "1000"]);
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{}/v1/completions", router.base))
        .json(&json!({"prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 4000, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let mut text = String::from_utf8_lossy(&body.next().await.unwrap().unwrap()).into_owned();
    // A non-streaming request in flight too: the router buffers its answer.
    let unary = tokio::spawn({
        let client = client.clone();
        let url = format!("{}/v1/completions", router.base);
        async move {
            let response = client
                .post(url)
                .json(&json!({"prompt": (100..164).collect::<Vec<u32>>(), "max_tokens": 4000}))
                .send()
                .await;
            match response {
                Ok(r) => Ok((r.status().as_u16(), r.text().await.unwrap_or_default())),
                Err(e) => Err(e.to_string()),
            }
        }
    });
    wait_metrics(&client, &w0.base, "the worker runs both requests", |t| {
        metric(t, "switchyard_engine_running") == Some(2.0)
    })
    .await;

    let signalled = Instant::now();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &router.child.id().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    let ended = tokio::time::timeout(Duration::from_secs(30), async {
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(c) => text.push_str(&String::from_utf8_lossy(&c)),
                Err(e) => return Err(e.to_string()),
            }
        }
        Ok(())
    })
    .await
    .expect("the stream ends after the shutdown timeout, it does not hang");
    let elapsed = signalled.elapsed();
    assert!(ended.is_ok(), "the stream ends cleanly: {ended:?}");
    let last = text.trim_end().lines().last().unwrap_or_default();
    assert!(
        last.starts_with("data: {\"error\"") && last.contains("shutting down"),
        "the last event says why the stream ended: {last}"
    );
    assert!(
        !text.contains("[DONE]"),
        "the stream was cut, not completed"
    );
    assert!(
        elapsed >= Duration::from_millis(900),
        "in-flight work had its grace period: {elapsed:?}"
    );
    // The non-streaming request ends too, with a clear 503, not a hang and
    // not a 200 for work that was cancelled.
    let unary = tokio::time::timeout(Duration::from_secs(30), unary)
        .await
        .expect("the non-streaming request ends after the shutdown timeout")
        .unwrap();
    let (status, answer) = unary.expect("the router answers before it exits");
    assert_eq!(status, 503, "{answer}");
    assert!(answer.contains("shutting down"), "{answer}");
    // Both upstream requests are cancelled and the router exits.
    wait_metrics(
        &client,
        &w0.base,
        "the worker's running count returns to zero",
        |t| metric(t, "switchyard_engine_running") == Some(0.0),
    )
    .await;
    wait_for(
        "the router to exit after the shutdown",
        PATIENCE,
        async || router.child.try_wait().unwrap().is_some(),
    )
    .await;
}
