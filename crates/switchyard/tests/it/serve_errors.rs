//! Every error the router answers itself is an OpenAI-style JSON body with
//! the right status, over a real socket.

use crate::support::{
    machine, metric, openai_error, router, scratch_file, sim_worker, wait_metrics, PATIENCE,
};
use serde_json::json;

async fn expect_error(response: reqwest::Response, status: u16) -> serde_json::Value {
    assert_eq!(response.status().as_u16(), status);
    openai_error(response).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_style_errors_with_the_right_status() {
    let _machine = machine().await;
    let w0 = sim_worker("0");
    let router = router(
        &[w0.named("w0")],
        &["--api-key", "sk-good", "--max-body-bytes", "4096"],
    );
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", router.base);
    let post = |body: String| {
        client
            .post(&url)
            .bearer_auth("sk-good")
            .header("content-type", "application/json")
            .body(body)
            .send()
    };

    // 400: malformed JSON, and a field of the wrong shape.
    expect_error(post("{not json".into()).await.unwrap(), 400).await;
    let body = expect_error(
        post(json!({"messages": []}).to_string()).await.unwrap(),
        400,
    )
    .await;
    assert_eq!(body["error"]["param"], "messages");
    expect_error(
        post(json!({"messages": "hi"}).to_string()).await.unwrap(),
        400,
    )
    .await;

    // 401: no key, wrong key.
    let response = client
        .post(&url)
        .json(&json!({"messages": [{"role": "user", "content": "x"}]}))
        .send()
        .await
        .unwrap();
    expect_error(response, 401).await;
    let response = client
        .post(&url)
        .bearer_auth("sk-bad")
        .json(&json!({}))
        .send()
        .await
        .unwrap();
    expect_error(response, 401).await;

    // 404: unknown model, unknown route.
    let body = json!({"model": "no-such-model", "messages": [{"role": "user", "content": "x"}]});
    let body = expect_error(post(body.to_string()).await.unwrap(), 404).await;
    assert_eq!(body["error"]["param"], "model");
    let response = client
        .get(format!("{}/v2/nothing", router.base))
        .send()
        .await
        .unwrap();
    expect_error(response, 404).await;

    // 413: a body over the limit.
    let big = json!({"messages": [{"role": "user", "content": "x".repeat(10_000)}]});
    expect_error(post(big.to_string()).await.unwrap(), 413).await;

    // A good request still works with the key.
    let ok = json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2});
    assert_eq!(post(ok.to_string()).await.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_live_worker_requests_get_503_or_502() {
    let _machine = machine().await;
    // A worker URL nobody listens on: it never enters selection.
    let router = router(&["http://127.0.0.1:9,name=ghost".to_owned()], &[]);
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{}/v1/completions", router.base))
        .json(&json!({"prompt": [1, 2, 3], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert!(response.headers().get("retry-after").is_some());
    expect_error(response, 503).await;
    let ready = client
        .get(format!("{}/ready", router.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_admission_queue_answers_429_with_retry_after() {
    let _machine = machine().await;
    let w0 = sim_worker("1");
    // Any booked request makes the worker busy; one request may wait.
    let config = scratch_file(
        "queue-of-one.toml",
        b"busy_threshold = 0.001\n[queue.queue.default_limits]\nmax_requests = 1\nmax_uncached_tokens = 1000000\n",
    );
    let router = router(&[w0.named("w0")], &["--config", config.to_str().unwrap()]);
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", router.base);
    let long = json!({"prompt": (0..64).collect::<Vec<u32>>(), "max_tokens": 200, "stream": true});
    let first = client.post(&url).json(&long).send().await.unwrap();
    assert_eq!(first.status(), 200);
    // The second waits in the queue (the worker is busy) ...
    let second = tokio::spawn({
        let client = client.clone();
        let url = url.clone();
        async move {
            client
                .post(&url)
                .json(&json!({"prompt": [5, 6, 7], "max_tokens": 1}))
                .send()
                .await
        }
    });
    wait_metrics(
        &client,
        &router.base,
        "the second request to queue",
        |text| metric(text, "switchyard_queue_depth") == Some(1.0),
    )
    .await;
    // ... and the third finds the queue full.
    let third = client
        .post(&url)
        .json(&json!({"prompt": [8, 9, 10], "max_tokens": 1}))
        .send()
        .await
        .unwrap();
    assert!(third.headers().get("retry-after").is_some());
    expect_error(third, 429).await;
    // Ending the first lets the queued one through.
    drop(first);
    let second = tokio::time::timeout(PATIENCE, second)
        .await
        .expect("the queued request is dispatched when room frees")
        .unwrap()
        .unwrap();
    assert_eq!(second.status(), 200);
}
