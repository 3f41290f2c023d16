//! Tenants and priority bands through a real router and sim-workers:
//! each client key is a tenant, its band comes from the configuration or
//! `x-priority` (capped by the tenant's ceiling), and flow control's
//! decisions show in the answers and in `/metrics`.

use crate::support::{
    machine, metric, metrics_text, openai_error, router, scratch_file, sim_worker_with, wait_for,
    wait_ready, PATIENCE,
};
use serde_json::json;
use std::time::{Duration, Instant};

const CONFIG: &[u8] = br#"
busy_threshold = 0.5

[[rate_limits.keys]]
name = "checkout"
key = "sk-checkout"

[[rate_limits.keys]]
name = "batch"
key = "sk-batch"

[flow]
[[flow.tenants]]
name = "checkout"
max_band = "critical"

[[flow.tenants]]
name = "batch"
band = "sheddable"
"#;

fn send(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    headers: &[(&str, &str)],
    prompt_tokens: u32,
    max_tokens: u32,
) -> reqwest::RequestBuilder {
    let prompt: Vec<u32> = (0..prompt_tokens).map(|i| 1000 + i).collect();
    let mut request = client
        .post(format!("{base}/v1/completions"))
        .bearer_auth(key)
        .json(&json!({"model": "switchyard-sim", "prompt": prompt, "max_tokens": max_tokens}));
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    request
}

/// An unknown band, a deadline of `-1` or `0` and an oversized header are
/// a 400 naming the problem, before any work; a band above the tenant's
/// ceiling is capped, not refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_flow_headers_get_a_clear_400() {
    let _machine = machine().await;
    let worker = sim_worker_with(0, &["--speedup", "0", "--num-blocks", "1024"]);
    let config = scratch_file("tenants_headers.toml", CONFIG);
    let router = router(
        &[worker.named("w0")],
        &["--config", config.to_str().unwrap()],
    );
    let client = reqwest::Client::new();
    wait_ready(&client, &router.base).await;
    let long = "x".repeat(10_000);
    for (header, value, says) in [
        ("x-priority", "gold", "unknown priority band"),
        ("x-slo-ttft-ms", "-1", "TTFT deadline"),
        ("x-slo-ttft-ms", "0", "TTFT deadline"),
        ("x-slo-ttft-ms", "1.5", "TTFT deadline"),
        ("x-priority", long.as_str(), "over the limit"),
    ] {
        let response = send(
            &client,
            &router.base,
            "sk-checkout",
            &[(header, value)],
            8,
            2,
        )
        .send()
        .await
        .unwrap();
        assert_eq!(response.status(), 400, "{header}: {value:.20}");
        let error = openai_error(response).await;
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{header}: {message}");
        assert!(message.len() < 300, "the error echoes a bounded prefix");
    }
    // Within limits: served. `batch` asking for `critical` is capped to
    // its own band (sheddable), not refused; an idle worker takes it.
    for (key, headers) in [
        (
            "sk-checkout",
            vec![("x-priority", "critical"), ("x-slo-ttft-ms", "5000")],
        ),
        ("sk-checkout", vec![("x-priority", "1")]),
        ("sk-batch", vec![("x-priority", "critical")]),
    ] {
        let response = send(&client, &router.base, key, &headers, 8, 2)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200, "{key} {headers:?}");
    }
    let text = metrics_text(&client, &router.base).await;
    let dispatched = |tenant: &str, band: &str| {
        metric(
            &text,
            &format!(
                r#"switchyard_flow_requests_total{{tenant="{tenant}",band="{band}",outcome="dispatched"}}"#
            ),
        )
    };
    assert_eq!(dispatched("checkout", "critical"), Some(1.0), "{text}");
    assert_eq!(dispatched("checkout", "standard"), Some(1.0), "{text}");
    assert_eq!(
        dispatched("batch", "sheddable"),
        Some(1.0),
        "capped: {text}"
    );
    assert_eq!(dispatched("batch", "critical"), Some(0.0), "{text}");
}

/// While the only worker is busy with a critical tenant's long request, a
/// sheddable tenant's requests are answered 429 at once (with
/// `Retry-After`), never queued; a second critical request waits for the
/// worker and is served. The shed requests are counted per tenant and
/// band.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sheddable_requests_are_refused_at_once_while_critical_ones_wait() {
    let _machine = machine().await;
    // 64 blocks of 16 tokens: one request of 600 prompt and 400 output
    // tokens books more than half of them, so the worker is busy at the
    // 0.5 threshold until it ends (about 400 decode steps).
    let worker = sim_worker_with(
        0,
        &["--speedup", "1", "--num-blocks", "64", "--block-size", "16"],
    );
    let config = scratch_file("tenants_shed.toml", CONFIG);
    let router = router(
        &[worker.named("w0")],
        &["--config", config.to_str().unwrap(), "--block-size", "16"],
    );
    let client = reqwest::Client::new();
    wait_ready(&client, &router.base).await;
    let critical = [("x-priority", "critical")];
    let long = send(&client, &router.base, "sk-checkout", &critical, 600, 400).send();
    let long = tokio::spawn(long);
    // Wait until the router has booked it.
    wait_for("the long request to be booked", PATIENCE, async || {
        let text = metrics_text(&client, &router.base).await;
        metric(&text, r#"switchyard_worker_active_requests{worker="w0"}"#) == Some(1.0)
    })
    .await;
    let mut shed = 0;
    for _ in 0..5 {
        let started = Instant::now();
        let response = send(&client, &router.base, "sk-batch", &[], 600, 10)
            .send()
            .await
            .unwrap();
        if response.status() == 429 {
            shed += 1;
            let retry: u64 = response.headers()["retry-after"]
                .to_str()
                .unwrap()
                .parse()
                .unwrap();
            assert!(retry >= 1, "Retry-After {retry}");
            assert!(
                started.elapsed() < Duration::from_secs(5),
                "answered at once, not after a wait: {:?}",
                started.elapsed()
            );
        }
    }
    assert_eq!(
        shed, 5,
        "every sheddable request is shed while the worker is busy"
    );
    // A critical request waits (it is not shed) and is served once the
    // long one ends.
    let second = send(&client, &router.base, "sk-checkout", &critical, 600, 10)
        .send()
        .await
        .unwrap();
    assert_eq!(second.status(), 200);
    assert_eq!(long.await.unwrap().unwrap().status(), 200);
    let text = metrics_text(&client, &router.base).await;
    let count = |tenant: &str, band: &str, outcome: &str| {
        metric(
            &text,
            &format!(
                r#"switchyard_flow_requests_total{{tenant="{tenant}",band="{band}",outcome="{outcome}"}}"#
            ),
        )
    };
    assert_eq!(count("batch", "sheddable", "shed"), Some(5.0), "{text}");
    assert_eq!(
        count("batch", "sheddable", "dispatched"),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        count("checkout", "critical", "dispatched"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(count("checkout", "critical", "shed"), Some(0.0), "{text}");
    // The second critical request waited in the queue: its wait was
    // observed under its tenant and band.
    let waits = metric(
        &text,
        r#"switchyard_flow_wait_seconds_count{tenant="checkout",band="critical"}"#,
    );
    assert_eq!(waits, Some(2.0), "{text}");
}

/// A chat longer than 8 KiB is tokenized through the gate: with one slot
/// (`--tokenize-slots 1`) the router says so on `/metrics`, each long
/// prompt is counted as let through at once or after a wait, and short
/// ones never enter it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_prompts_are_tokenized_through_the_gate_and_counted() {
    let _machine = machine().await;
    let worker = sim_worker_with(0, &["--speedup", "0", "--num-blocks", "4096"]);
    let router = router(&[worker.named("w0")], &["--tokenize-slots", "1"]);
    let client = reqwest::Client::new();
    wait_ready(&client, &router.base).await;
    let chat = |words: usize| {
        let content: String = (0..words).map(|i| format!("w{i} ")).collect();
        json!({"model": "switchyard-sim", "max_tokens": 1,
               "messages": [{"role": "user", "content": content}]})
    };
    // Three long chats at once (about 20 KB each), then a short one.
    let sends = (0..3).map(|_| {
        client
            .post(format!("{}/v1/chat/completions", router.base))
            .json(&chat(4_000))
            .send()
    });
    for response in futures_util::future::join_all(sends).await {
        assert_eq!(response.unwrap().status(), 200);
    }
    let short = client
        .post(format!("{}/v1/chat/completions", router.base))
        .json(&chat(10))
        .send()
        .await
        .unwrap();
    assert_eq!(short.status(), 200);
    let text = metrics_text(&client, &router.base).await;
    let value = |series: &str| metric(&text, series).unwrap_or_else(|| panic!("{series}"));
    assert_eq!(value("switchyard_tokenize_gate_slots"), 1.0);
    assert_eq!(
        value("switchyard_tokenize_gate_immediate_total")
            + value("switchyard_tokenize_gate_waited_total"),
        3.0,
        "each long prompt once; the short one not at all"
    );
    assert_eq!(value("switchyard_tokenize_gate_busy"), 0.0);
    assert_eq!(value("switchyard_tokenize_gate_waiting"), 0.0);
    assert_eq!(value("switchyard_tokenize_gate_refused_total"), 0.0);
}
