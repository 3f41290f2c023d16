//! The router's front door under clients that do not play fair, with real
//! router and sim-worker processes over loopback: uploads that declare a
//! large body and stall, heads that never end, more connections than the
//! cap. Each test states the bound it checks; every wait polls a condition
//! with a generous deadline, so a slow machine makes these tests slower,
//! never red.

use crate::support::{
    machine, metric, metrics_text, resident_bytes, router, sim_worker, sim_worker_with, wait_for,
    wait_metrics, wait_ready, PATIENCE,
};
use serde_json::json;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// `host:port` of a `http://host:port` base.
fn authority(base: &str) -> &str {
    base.trim_start_matches("http://")
}

/// A request head declaring a JSON body of `declared` bytes.
fn head(path: &str, key: Option<&str>, declared: usize) -> String {
    let auth = key.map_or(String::new(), |k| format!("authorization: Bearer {k}\r\n"));
    format!(
        "POST {path} HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\n{auth}content-length: {declared}\r\n\r\n"
    )
}

/// A client that sends `head(path, key, declared)` and then `sent` bytes of
/// its body, and stalls: it keeps the connection open (until the returned
/// task is aborted) and never sends the rest. The writer runs on its own,
/// so a router that stops reading does not block the reader; write errors
/// (the router closed the connection) end the writer quietly.
struct StalledUpload {
    reader: tokio::net::tcp::OwnedReadHalf,
    writer: tokio::task::JoinHandle<()>,
}

impl StalledUpload {
    async fn start(
        base: &str,
        path: &str,
        key: Option<&str>,
        declared: usize,
        sent: usize,
    ) -> Self {
        let stream = TcpStream::connect(authority(base))
            .await
            .expect("the router accepts");
        let (reader, mut writer) = stream.into_split();
        let head = head(path, key, declared);
        let writer = tokio::spawn(async move {
            if writer.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            let chunk = vec![b' '; 64 * 1024];
            let mut left = sent;
            while left > 0 {
                let n = left.min(chunk.len());
                if writer.write_all(&chunk[..n]).await.is_err() {
                    return;
                }
                left -= n;
            }
            // Stall, holding the connection open.
            std::future::pending::<()>().await;
            drop(writer);
        });
        Self { reader, writer }
    }

    /// The status of the router's answer, waiting up to `within`; `None`
    /// when none came (or the connection closed without one).
    async fn status(&mut self, within: Duration) -> Option<u16> {
        let mut seen = Vec::new();
        let mut buf = [0u8; 4096];
        let read = async {
            loop {
                let n = self.reader.read(&mut buf).await.ok()?;
                if n == 0 {
                    return None;
                }
                seen.extend_from_slice(&buf[..n]);
                if let Some(line) = seen
                    .split(|b| *b == b'\n')
                    .next()
                    .filter(|_| seen.contains(&b'\n'))
                {
                    let line = String::from_utf8_lossy(line);
                    return line.split_whitespace().nth(1)?.parse().ok();
                }
            }
        };
        tokio::time::timeout(within, read).await.ok().flatten()
    }
}

impl Drop for StalledUpload {
    fn drop(&mut self) {
        self.writer.abort();
    }
}

/// A chat request with `key`, answered in full.
async fn honest_chat(client: &reqwest::Client, base: &str, key: &str) -> u16 {
    let response = client
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}))
        .send()
        .await
        .expect("the router answers an honest client");
    let status = response.status().as_u16();
    let _ = response.bytes().await;
    status
}

const MIB: usize = 1024 * 1024;

/// Uploads without a credential: to `/admin/workers` with the admin API off
/// (the route does not exist) and to `/v1/chat/completions` without a key.
/// 100 connections each declare a 31 MiB body (under the 32 MiB limit, so
/// size is not why they are refused), push 1 MiB of it and stall: 100 MiB
/// would reach the router if it read them. Each gets its 404 or 401 while
/// its upload is still stalled, and an honest keyed client is served
/// meanwhile. The router's resident memory grows by less than 16 MiB over
/// its warmed-up baseline: each connection reads into at most a 64 KiB
/// buffer (6.4 MiB for all), plus the allocator's slack.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_without_a_credential_are_refused_unread_and_hold_no_memory() {
    let _machine = machine().await;
    const CONNECTIONS: usize = 100;
    const BOUND: u64 = 16 * MIB as u64;
    let w0 = sim_worker("0");
    let router = router(&[w0.named("w0")], &["--api-key", "sk-good"]);
    let client = reqwest::Client::new();
    wait_ready(&client, &router.base).await;
    // Warm up: the tokenizer, the pools, the first request's allocations.
    for _ in 0..3 {
        assert_eq!(honest_chat(&client, &router.base, "sk-good").await, 200);
    }
    let baseline = resident_bytes(&router);

    let mut uploads = Vec::new();
    for i in 0..CONNECTIONS {
        let path = if i % 2 == 0 {
            "/admin/workers"
        } else {
            "/v1/chat/completions"
        };
        uploads.push((
            path,
            StalledUpload::start(&router.base, path, None, 31 * MIB, MIB).await,
        ));
    }
    for (path, upload) in &mut uploads {
        let expected = if *path == "/admin/workers" { 404 } else { 401 };
        assert_eq!(
            upload.status(PATIENCE).await,
            Some(expected),
            "{path}: answered from the head, with the upload stalled"
        );
    }
    // Meanwhile (the stalled clients still hold their sockets) an honest
    // client is served.
    assert_eq!(honest_chat(&client, &router.base, "sk-good").await, 200);
    let grown = resident_bytes(&router).saturating_sub(baseline);
    assert!(
        grown < BOUND,
        "the router's resident memory grew by {} MiB (bound {} MiB) under {CONNECTIONS} stalled unauthenticated uploads",
        grown / MIB as u64,
        BOUND / MIB as u64
    );
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(&text, "switchyard_auth_failures_total{scope=\"client\"}"),
        Some((CONNECTIONS / 2) as f64),
        "{text}"
    );
}

/// Uploads with a valid credential that stall: to `/v1/chat/completions`
/// with the client key and to `/admin/workers` with the admin token. Each
/// is cut with a 408 at the body-read deadline (1 s here) and counted in
/// `switchyard_slow_uploads_total`; an honest client is served while they
/// stall. Their bodies are the router's to hold until the deadline, at most
/// `--max-body-bytes` (1 MiB here) each: 40 uploads of 512 KiB stay under
/// 64 MiB of resident memory over the baseline. The body budget (64 MiB
/// here) holds all 40 declared bodies and the honest client's (past it
/// they would get a 503 from their heads instead:
/// `serve_boundaries_budget`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keyed_uploads_slower_than_the_body_read_deadline_are_cut_with_408_and_counted() {
    let _machine = machine().await;
    const CONNECTIONS: usize = 40;
    const BOUND: u64 = 64 * MIB as u64;
    let w0 = sim_worker("0");
    let router = router(
        &[w0.named("w0")],
        &[
            "--api-key",
            "sk-good",
            "--admin-token",
            "adm-good",
            "--max-body-bytes",
            "1048576",
            "--max-body-bytes-total",
            "67108864",
            "--body-read-timeout-ms",
            "1000",
        ],
    );
    let client = reqwest::Client::new();
    wait_ready(&client, &router.base).await;
    for _ in 0..3 {
        assert_eq!(honest_chat(&client, &router.base, "sk-good").await, 200);
    }
    let baseline = resident_bytes(&router);

    let mut uploads = Vec::new();
    for i in 0..CONNECTIONS {
        let (path, key) = if i % 2 == 0 {
            ("/admin/workers", "adm-good")
        } else {
            ("/v1/chat/completions", "sk-good")
        };
        uploads.push(StalledUpload::start(&router.base, path, Some(key), MIB, MIB / 2).await);
    }
    assert_eq!(honest_chat(&client, &router.base, "sk-good").await, 200);
    for upload in &mut uploads {
        assert_eq!(upload.status(PATIENCE).await, Some(408));
    }
    let grown = resident_bytes(&router).saturating_sub(baseline);
    assert!(
        grown < BOUND,
        "the router's resident memory grew by {} MiB (bound {} MiB) under {CONNECTIONS} stalled keyed uploads",
        grown / MIB as u64,
        BOUND / MIB as u64
    );
    wait_metrics(&client, &router.base, "every slow upload counted", |text| {
        metric(text, "switchyard_slow_uploads_total") == Some(CONNECTIONS as f64)
    })
    .await;
    // Nothing stays in flight once they are cut.
    wait_metrics(&client, &router.base, "no request left in flight", |text| {
        metric(text, "switchyard_inflight_requests") == Some(0.0)
    })
    .await;
}

/// A client that opens a connection and never finishes its request head is
/// disconnected at the header-read timeout and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_head_that_never_ends_is_cut_at_the_header_read_timeout() {
    let _machine = machine().await;
    let w0 = sim_worker("0");
    let router = router(&[w0.named("w0")], &["--header-read-timeout-ms", "300"]);
    let client = reqwest::Client::new();
    let mut slow = TcpStream::connect(authority(&router.base)).await.unwrap();
    slow.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nhost: router\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 1024];
    let closed = tokio::time::timeout(PATIENCE, async {
        loop {
            match slow.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                // hyper may answer 408 before closing; read on to the end.
                Ok(_) => continue,
            }
        }
    })
    .await;
    assert!(closed.is_ok(), "the router closed the connection");
    wait_metrics(&client, &router.base, "the timeout counted", |text| {
        metric(text, "switchyard_header_read_timeouts_total").is_some_and(|n| n >= 1.0)
    })
    .await;
}

/// A raw connection to the router whose client reads nothing: its receive
/// buffer is as small as the kernel allows, so the router's writes to it
/// block after a few KiB.
async fn never_reading(base: &str) -> TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    socket
        .connect(authority(base).parse().unwrap())
        .await
        .expect("the router accepts")
}

/// Four keyed clients take the router's four in-flight places with
/// streaming completions far larger than any socket buffer, and never read
/// a byte: each holds its place, then loses it (and its connection) once
/// its answer has made no progress for the send timeout, counted. An honest
/// client is served afterwards, and the in-flight gauge comes back to the
/// truth: nothing held. Without the send timeout the four would hold their
/// places (and their buffered answers) until they disconnected.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_that_are_never_read_lose_their_places_at_the_send_timeout() {
    let _machine = machine().await;
    let w0 = sim_worker_with(
        0,
        &[
            "--speedup",
            "0",
            "--num-blocks",
            "20000",
            "--max-model-len",
            "200000",
        ],
    );
    let router = router(
        &[w0.named("w0")],
        &[
            "--api-key",
            "sk-good",
            "--max-inflight",
            "4",
            "--send-timeout-ms",
            "3000",
            "--max-output-tokens",
            "150000",
        ],
    );
    let client = reqwest::Client::new();
    wait_ready(&client, &router.base).await;
    let body =
        json!({"prompt": "tell me everything", "max_tokens": 150000, "stream": true}).to_string();
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut stream = never_reading(&router.base).await;
        let request = format!(
            "{}{body}",
            head("/v1/completions", Some("sk-good"), body.len())
        );
        stream.write_all(request.as_bytes()).await.unwrap();
        held.push(stream);
    }
    wait_metrics(&client, &router.base, "the four places taken", |text| {
        metric(text, "switchyard_inflight_requests") == Some(4.0)
    })
    .await;
    wait_for("an honest client to be served", PATIENCE, async || {
        honest_chat(&client, &router.base, "sk-good").await == 200
    })
    .await;
    wait_metrics(
        &client,
        &router.base,
        "the stalls counted, nothing held",
        |text| {
            metric(text, "switchyard_send_timeouts_total").is_some_and(|n| n >= 4.0)
                && metric(text, "switchyard_inflight_requests") == Some(0.0)
        },
    )
    .await;
    // The router closed each stalled connection: reading now finds the
    // answer's start and then its end, not a connection held open.
    for mut stream in held {
        let mut buf = vec![0u8; 64 * 1024];
        let ended = tokio::time::timeout(PATIENCE, async {
            loop {
                match stream.read(&mut buf).await {
                    Ok(0) | Err(_) => return,
                    Ok(_) => continue,
                }
            }
        })
        .await;
        assert!(ended.is_ok(), "a stalled connection is still open");
    }
}

/// A client that pipelines `GET /health` and reads none of the answers
/// (no key needed: the probes are open) is cut by the same rule: once the
/// router's writes to it have made no progress for the send timeout, the
/// connection is closed and counted; it is not left to the header-read
/// timeout, which is set far longer here.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pipelining_client_that_never_reads_is_cut_at_the_send_timeout() {
    let _machine = machine().await;
    let w0 = sim_worker("0");
    let router = router(
        &[w0.named("w0")],
        &[
            "--send-timeout-ms",
            "500",
            "--header-read-timeout-ms",
            "600000",
        ],
    );
    let client = reqwest::Client::new();
    wait_ready(&client, &router.base).await;
    let stream = never_reading(&router.base).await;
    let (_reader, mut writer) = stream.into_split();
    let requests = "GET /health HTTP/1.1\r\nhost: router\r\n\r\n".repeat(1024);
    let flood = tokio::spawn(async move {
        // Until the router closes the connection.
        while writer.write_all(requests.as_bytes()).await.is_ok() {}
    });
    tokio::time::timeout(PATIENCE, flood)
        .await
        .expect("the router closed the pipelining connection")
        .unwrap();
    wait_metrics(&client, &router.base, "the stall counted", |text| {
        metric(text, "switchyard_send_timeouts_total").is_some_and(|n| n >= 1.0)
            && metric(text, "switchyard_header_read_timeouts_total") == Some(0.0)
    })
    .await;
}

/// With the connection cap reached, a further connection is closed unserved
/// and counted; once one of the open connections closes, an honest client
/// is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_cap_are_closed_and_room_returns_when_one_closes() {
    let _machine = machine().await;
    let w0 = sim_worker("0");
    let router = router(
        &[w0.named("w0")],
        &[
            "--max-connections",
            "3",
            // The idle connections below must outlive the test's steps.
            "--header-read-timeout-ms",
            "600000",
        ],
    );
    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(TcpStream::connect(authority(&router.base)).await.unwrap());
    }
    // Accepted after the three (the accept loop takes the backlog in
    // order): over the cap, closed before a byte of it is read.
    let mut over = TcpStream::connect(authority(&router.base)).await.unwrap();
    let _ = over
        .write_all(b"GET /health HTTP/1.1\r\nhost: router\r\n\r\n")
        .await;
    let mut buf = [0u8; 256];
    let answer = tokio::time::timeout(PATIENCE, over.read(&mut buf))
        .await
        .expect("the router closes the connection over the cap");
    assert!(
        matches!(answer, Ok(0) | Err(_)),
        "a connection over the cap was served: {:?}",
        answer.map(|n| String::from_utf8_lossy(&buf[..n]).into_owned())
    );

    // One closes: an honest client gets its place (retrying while the
    // router has not yet seen the close).
    drop(held.pop());
    let client = reqwest::Client::new();
    wait_for("an honest request to be served", PATIENCE, async || {
        client
            .get(format!("{}/health", router.base))
            .send()
            .await
            .is_ok_and(|r| r.status() == 200)
    })
    .await;
    // Room for the scrape: the client's pooled connection may not be
    // reusable, and a new one would be over the cap.
    held.clear();
    wait_metrics(&client, &router.base, "the refusal counted", |text| {
        metric(text, "switchyard_connections_refused_total").is_some_and(|n| n >= 1.0)
            && metric(text, "switchyard_connections_limit") == Some(3.0)
    })
    .await;
}

/// A worker that requires a key serves through a router that has it
/// (`--worker-api-key`): health checks, model probes and proxied requests
/// all carry it. The worker really does refuse requests without it. Its
/// keyed clients are not told which worker served them, unless the router
/// is asked to (`--worker-header`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_authenticates_to_a_worker_that_requires_a_key_and_names_none_to_keyed_clients()
{
    let _machine = machine().await;
    let w0 = sim_worker_with(
        0,
        &[
            "--speedup",
            "0",
            "--num-blocks",
            "1024",
            "--api-key",
            "wk-secret",
        ],
    );
    let client = reqwest::Client::new();
    let direct = client
        .get(format!("{}/v1/models", w0.base))
        .send()
        .await
        .unwrap();
    assert_eq!(direct.status(), 401, "the worker requires its key");

    let router = router(
        &[w0.named("w0")],
        &["--api-key", "sk-client", "--worker-api-key", "wk-secret"],
    );
    wait_ready(&client, &router.base).await;
    let models: serde_json::Value = client
        .get(format!("{}/v1/models", router.base))
        .bearer_auth("sk-client")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(
        !models["data"].as_array().unwrap().is_empty(),
        "the model probe carried the key: {models}"
    );
    assert_eq!(honest_chat(&client, &router.base, "sk-client").await, 200);
    let streamed = client
        .post(format!("{}/v1/completions", router.base))
        .bearer_auth("sk-client")
        .json(&json!({"prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(streamed.status(), 200);
    // With client keys, answers do not name their (internal) worker.
    assert!(streamed.headers().get("x-switchyard-worker").is_none());
    assert!(streamed.text().await.unwrap().contains("[DONE]"));
    let naming = crate::support::router(
        &[w0.named("w0")],
        &[
            "--api-key",
            "sk-client",
            "--worker-api-key",
            "wk-secret",
            "--worker-header",
        ],
    );
    wait_ready(&client, &naming.base).await;
    let named = client
        .post(format!("{}/v1/completions", naming.base))
        .bearer_auth("sk-client")
        .json(&json!({"prompt": [1, 2, 3, 4], "max_tokens": 3}))
        .send()
        .await
        .unwrap();
    assert_eq!(named.status(), 200);
    assert_eq!(named.headers()["x-switchyard-worker"], "w0", "asked for");
    drop(naming);

    // A router without the worker key (even one whose client key happens
    // to be the worker's) never gets the worker into selection: its health
    // checks carry only the router's own credential.
    let keyless = crate::support::router(&[w0.named("w0")], &["--api-key", "wk-secret"]);
    let ready = client
        .get(format!("{}/ready", keyless.base))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 503, "health checks without the key fail");
}

/// Per-key rate limits through a real router: a key over its token budget
/// gets 429 (with `Retry-After`, a message naming the limit, counted by the
/// key's name) while another key is served, and a key over its request
/// rate is refused before its body is read. Tokens per minute refill at
/// 100 a minute (one every 0.6 s), so the budget a test spends stays spent
/// for the whole test however slow the machine; the request limit's refill
/// is accounted for in the bound it checks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_over_its_rate_limit_gets_429_while_another_key_is_served() {
    let _machine = machine().await;
    let worker = sim_worker("0");
    let config = crate::support::scratch_file(
        "rate_limits.toml",
        br#"
[rate_limits]
tokens_per_minute = 100

[[rate_limits.keys]]
name = "small"
key = "sk-small"

[[rate_limits.keys]]
name = "big"
key = "sk-big"
tokens_per_minute = 1000000
requests_per_second = 1
"#,
    );
    let config = config.to_str().expect("a UTF-8 path");
    let router = router(&[worker.named("w0")], &["--config", config]);
    let client = reqwest::Client::new();
    wait_ready(&client, &router.base).await;
    let send = |key: &'static str, tokens: usize| {
        let client = client.clone();
        let base = router.base.clone();
        async move {
            let prompt: Vec<u32> = (0..tokens as u32).collect();
            client
                .post(format!("{base}/v1/completions"))
                .bearer_auth(key)
                .json(&json!({"model": "switchyard-sim", "prompt": prompt, "max_tokens": 10}))
                .send()
                .await
                .expect("the router answers")
        }
    };
    // 50 + 10 of "small"'s 100 tokens: served; the next 60 are not there.
    assert_eq!(send("sk-small", 50).await.status(), 200);
    let refused = send("sk-small", 50).await;
    assert_eq!(refused.status(), 429);
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .expect("Retry-After in seconds");
    assert!((1..=60).contains(&retry_after), "Retry-After {retry_after}");
    let body: serde_json::Value = refused.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("100 tokens per minute"), "{message}");
    // A request larger than a whole minute's budget can never pass.
    let too_big = send("sk-small", 200).await;
    assert_eq!(too_big.status(), 429);
    assert!(too_big.headers().get("retry-after").is_none());
    // Meanwhile the other key is served.
    assert_eq!(send("sk-big", 50).await.status(), 200);

    // "big" may send one request a second: of 10 sent back to back, at
    // most 1 + (seconds elapsed, rounded up) pass; the rest are 429.
    let started = std::time::Instant::now();
    let mut passed = 0;
    for _ in 0..10 {
        if send("sk-big", 1).await.status() == 200 {
            passed += 1;
        }
    }
    let allowed = 1 + started.elapsed().as_secs_f64().ceil() as usize;
    assert!(
        passed <= allowed,
        "{passed} passed, at most {allowed} allowed"
    );
    let metrics = metrics_text(&client, &router.base).await;
    let tokens = metric(
        &metrics,
        r#"switchyard_rate_limited_total{key="small",limit="tokens"}"#,
    );
    assert_eq!(tokens, Some(2.0), "{metrics}");
    let requests = metric(
        &metrics,
        r#"switchyard_rate_limited_total{key="big",limit="requests"}"#,
    )
    .unwrap_or_default();
    assert_eq!(requests as usize, 10 - passed, "{metrics}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_token_limit_charges_every_prompt_every_choice_and_an_allowance_without_max_tokens() {
    let _machine = machine().await;
    let worker = sim_worker("0");
    let config = crate::support::scratch_file(
        "token_charges.toml",
        br#"
[rate_limits]
tokens_per_minute = 1000
[[rate_limits.keys]]
name = "k"
key = "sk-k"
"#,
    );
    let config = config.to_str().expect("a UTF-8 path");
    let router = router(&[worker.named("w0")], &["--config", config]);
    let client = reqwest::Client::new();
    wait_ready(&client, &router.base).await;
    let ids = |n: u32| (0..n).collect::<Vec<u32>>();
    // Each of these was charged its first prompt and one choice's
    // max_tokens (70, 110 and 10 tokens), far inside a 1000-token minute.
    let batch: Vec<Vec<u32>> = (0..20).map(|_| ids(60)).collect();
    for (body, needs) in [
        // 20 prompts of 60 tokens, 10 output tokens each: 1200 + 200.
        (json!({"prompt": batch, "max_tokens": 10}), 1400),
        // One prompt of 10 tokens, 11 choices of 100: 10 + 1100.
        (json!({"prompt": ids(10), "max_tokens": 100, "n": 11}), 1110),
        // No max_tokens: the default allowance of 1024 per choice.
        (json!({"prompt": ids(10)}), 1034),
    ] {
        let response = client
            .post(format!("{}/v1/completions", router.base))
            .bearer_auth("sk-k")
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 429, "{body}");
        assert!(response.headers().get("retry-after").is_none());
        assert!(response.headers().get("x-switchyard-worker").is_none());
        let error: serde_json::Value = response.json().await.unwrap();
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&format!("this request needs {needs} tokens")),
            "{body}: {message}"
        );
    }
    // Nothing was taken by the refusals: a request within the minute passes.
    let ok = client
        .post(format!("{}/v1/completions", router.base))
        .bearer_auth("sk-k")
        .json(&json!({"prompt": ids(10), "max_tokens": 10}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status(), 200);
}
