//! Shutdown of the router server, in-process (`switchyard_server::start`)
//! in front of a scripted worker on a real socket.

use crate::scripted_worker::{scripted_worker, Script};
use crate::support::{metric, metrics_text, wait_for, PATIENCE};
use serde_json::json;
use switchyard_server::{config::WorkerSpec, ServerConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_cancelled_at_shutdown_counts_once_as_cancelled() {
    let silent = scripted_worker(Script::Silent).await;
    let config = ServerConfig {
        port: 0,
        workers: vec![WorkerSpec::parse(&format!("{silent},name=silent")).unwrap()],
        shutdown_grace_ms: 100,
        health_interval_ms: 100,
        ..ServerConfig::default()
    };
    let running = switchyard_server::start(config).await.unwrap();
    let base = format!("http://{}", running.addr);
    let client = reqwest::Client::new();
    wait_for("the router to be ready", PATIENCE, async || {
        client
            .get(format!("{base}/ready"))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    // Non-streaming, on a worker that never answers: it waits for the
    // worker when the shutdown deadline cancels it.
    let request = tokio::spawn(
        client
            .post(format!("{base}/v1/completions"))
            .json(&json!({"prompt": "x", "max_tokens": 4}))
            .send(),
    );
    wait_for("the request to be booked", PATIENCE, async || {
        metric(
            &metrics_text(&client, &base).await,
            "switchyard_active_requests",
        ) == Some(1.0)
    })
    .await;
    let metrics = running.driver.metrics().clone();
    running.shutdown().await.unwrap();
    let response = request.await.unwrap().unwrap();
    assert_eq!(response.status(), 503);
    assert_eq!(
        metrics.requests(switchyard_server::metrics::RequestStatus::Cancelled),
        1
    );
}
