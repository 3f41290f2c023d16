//! Every request ends: a stream whose client stops reading is still cut at
//! the request timeout (the worker's request cancelled, the booking
//! freed); a worker that takes a non-streaming request and never answers
//! is that worker's failure; a prompt that failed on two workers is not
//! sent to a third; and a broken stream whose request the resume cannot
//! reproduce (here: `tools`) ends with an error instead of going on under
//! another prompt.
//!
//! The workers that misbehave are fake ones in this file: loopback HTTP
//! servers that count what they receive (generation requests, and the
//! connections the router dropped).

use crate::support::{
    machine, metric, metric_sum, metrics_text, read_request, reply, router, wait_for, wait_metrics,
    NOT_FOUND, PATIENCE,
};
use serde_json::{json, Value};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How a fake worker answers generation requests (`POST /v1/...`).
#[derive(Clone, Copy)]
enum Behaviour {
    /// Reads the request and never answers; the connection stays open.
    Silent,
    /// Reads the request and closes the connection without a word.
    HangUp,
    /// A completions stream of ~1 KiB events, without end, as fast as the
    /// router takes them.
    Flood,
    /// A chat stream of three chunks, half an event, then the connection
    /// drops.
    CutChat,
    /// A short whole answer: a stream in the endpoint's shape (a resumed
    /// request is `/v1/completions`), or a chat completion.
    Good,
}

/// A fake worker: healthy on `/health`, serving `switchyard-sim`.
struct Fake {
    base: String,
    /// Generation requests read whole.
    generations: Arc<AtomicUsize>,
    /// Generation connections the router dropped while the worker was
    /// still sending.
    dropped: Arc<AtomicUsize>,
}

impl Fake {
    async fn start(behaviour: Behaviour) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let generations = Arc::new(AtomicUsize::new(0));
        let dropped = Arc::new(AtomicUsize::new(0));
        let (g, d) = (generations.clone(), dropped.clone());
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                tokio::spawn(serve(socket, behaviour, g.clone(), d.clone()));
            }
        });
        Self {
            base,
            generations,
            dropped,
        }
    }

    /// Its `--worker` spec.
    fn named(&self, name: &str) -> String {
        format!("{},name={name}", self.base)
    }

    fn generations(&self) -> usize {
        self.generations.load(Ordering::SeqCst)
    }

    fn dropped(&self) -> usize {
        self.dropped.load(Ordering::SeqCst)
    }
}

/// One SSE event as an HTTP chunk.
fn chunk(event: &Value) -> String {
    let data = format!("data: {event}\n\n");
    format!("{:x}\r\n{data}\r\n", data.len())
}

const SSE_HEAD: &str = "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n";

async fn serve(
    mut socket: TcpStream,
    behaviour: Behaviour,
    generations: Arc<AtomicUsize>,
    dropped: Arc<AtomicUsize>,
) {
    let Some((method, path, body)) = read_request(&mut socket).await else {
        return;
    };
    // What the router reads of a worker (health, models, server
    // information, metrics) is a GET, and these workers have no
    // `/tokenize`; only another POST is a generation, and only a
    // generation misbehaves.
    let out = match (method.as_str(), path.as_str()) {
        ("get", "/health" | "/get_server_info") => reply("{}"),
        ("get", "/v1/models") => reply(r#"{"object":"list","data":[{"id":"switchyard-sim"}]}"#),
        ("get", _) | ("post", "/tokenize") => NOT_FOUND.to_owned(),
        _ => {
            generations.fetch_add(1, Ordering::SeqCst);
            match behaviour {
                Behaviour::Silent => {
                    // The behaviour itself: silence for longer than any test.
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    return;
                }
                Behaviour::HangUp => return,
                Behaviour::Flood => {
                    let text = "x".repeat(1000);
                    let event = chunk(
                        &json!({"id": "cmpl-flood", "object": "text_completion", "created": 1, "model": "switchyard-sim", "choices": [{"index": 0, "text": text, "finish_reason": null}]}),
                    );
                    if socket.write_all(SSE_HEAD.as_bytes()).await.is_err() {
                        return;
                    }
                    loop {
                        if socket.write_all(event.as_bytes()).await.is_err() {
                            dropped.fetch_add(1, Ordering::SeqCst);
                            return;
                        }
                    }
                }
                Behaviour::CutChat => {
                    let mut out = String::from(SSE_HEAD);
                    for (i, word) in [" alpha", " beta", " gamma"].into_iter().enumerate() {
                        let delta = if i == 0 {
                            json!({"role": "assistant", "content": word})
                        } else {
                            json!({"content": word})
                        };
                        out.push_str(&chunk(&json!({"id": "chatcmpl-cut", "object": "chat.completion.chunk", "created": 1, "model": "switchyard-sim", "choices": [{"index": 0, "delta": delta, "finish_reason": null}]})));
                    }
                    // Half an event, then the connection drops.
                    out.push_str("10\r\ndata: {\"id\": \"ch\r\n");
                    out
                }
                Behaviour::Good if !body.contains("\"stream\":true") => reply(
                    r#"{"id":"chatcmpl-good","object":"chat.completion","created":2,"model":"switchyard-sim","choices":[{"index":0,"message":{"role":"assistant","content":" delta"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#,
                ),
                Behaviour::Good => {
                    let event = if path == "/v1/completions" {
                        json!({"id": "cmpl-good", "object": "text_completion", "created": 2, "model": "switchyard-sim", "choices": [{"index": 0, "text": " delta", "token_ids": [7], "finish_reason": "stop"}]})
                    } else {
                        json!({"id": "chatcmpl-good", "object": "chat.completion.chunk", "created": 2, "model": "switchyard-sim", "choices": [{"index": 0, "delta": {"role": "assistant", "content": " delta"}, "finish_reason": "stop"}]})
                    };
                    let mut out = String::from(SSE_HEAD);
                    out.push_str(&chunk(&event));
                    let done = "data: [DONE]\n\n";
                    out.push_str(&format!("{:x}\r\n{done}\r\n0\r\n\r\n", done.len()));
                    out
                }
            }
        }
    };
    let _ = socket.write_all(out.as_bytes()).await;
    let _ = socket.flush().await;
}

/// The `host:port` of a base URL.
fn addr(base: &str) -> String {
    base.trim_start_matches("http://").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_a_stream_has_its_booking_freed_at_the_request_timeout() {
    let _machine = machine().await;
    let flood = Fake::start(Behaviour::Flood).await;
    let router = router(&[flood.named("flood")], &["--request-timeout", "2"]);
    let client = reqwest::Client::new();

    // A raw client with a small receive window, so that the router's
    // buffers fill soon once it stops reading and the router stops
    // polling the response body.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4096).unwrap();
    let mut conn = socket
        .connect(addr(&router.base).parse().unwrap())
        .await
        .unwrap();
    let body = json!({"prompt": [1, 2, 3, 4], "max_tokens": 100_000, "stream": true}).to_string();
    let request = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: router\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    conn.write_all(request.as_bytes()).await.unwrap();
    // Read the head and the first event, then stop reading (the socket
    // stays open until the end of the test).
    let mut seen = Vec::new();
    let mut buf = [0u8; 1024];
    let started = Instant::now();
    while !String::from_utf8_lossy(&seen).contains("data: {") {
        let n = tokio::time::timeout(PATIENCE, conn.read(&mut buf))
            .await
            .expect("the first event within the patience")
            .unwrap();
        assert!(n > 0, "the router closed the stream: {seen:?}");
        seen.extend_from_slice(&buf[..n]);
    }
    assert!(String::from_utf8_lossy(&seen).starts_with("HTTP/1.1 200"));

    wait_metrics(
        &client,
        &router.base,
        "the request timeout to free the booking of the stream nobody reads",
        |text| {
            metric(text, "switchyard_request_timeouts_total") == Some(1.0)
                && metric(text, "switchyard_active_requests") == Some(0.0)
                && metric_sum(text, "switchyard_worker_active_requests") == 0.0
        },
    )
    .await;
    wait_for(
        "the worker's request to be cancelled",
        PATIENCE,
        async || flood.dropped() == 1,
    )
    .await;
    // The timeout is what ended it, not the client: the stream is
    // counted `unavailable`, not `cancelled`.
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(
            &text,
            "switchyard_requests_total{policy=\"ttft\",status=\"unavailable\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(
            &text,
            "switchyard_requests_total{policy=\"ttft\",status=\"cancelled\"}"
        ),
        Some(0.0),
        "{text}"
    );
    // Loose: the timeout is 2 s; a healthy run frees the booking then.
    assert!(started.elapsed() < PATIENCE);
    drop(conn);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_that_never_answers_a_non_streaming_request_is_that_workers_failure() {
    let _machine = machine().await;
    let silent = Fake::start(Behaviour::Silent).await;
    let good = Fake::start(Behaviour::Good).await;
    let router = router(
        &[silent.named("silent"), good.named("good")],
        &[
            "--policy",
            "round-robin",
            "--request-timeout",
            "2",
            "--first-token-timeout",
            "1",
            "--circuit-failures",
            "2",
            // No probe of the opened circuit during the test.
            "--circuit-cooldown-ms",
            "600000",
        ],
    );
    let client = reqwest::Client::new();
    let circuit = "switchyard_circuit_state{worker=\"silent\"}";
    let (mut served, mut timed_out) = (0, 0);
    for _ in 0..20 {
        let text = metrics_text(&client, &router.base).await;
        if metric(&text, circuit) == Some(1.0) {
            break;
        }
        let response = client
            .post(format!("{}/v1/chat/completions", router.base))
            .json(&json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        match response.status().as_u16() {
            200 => served += 1,
            504 => {
                let body: Value = response.json().await.unwrap();
                assert_eq!(body["error"]["type"], "timeout", "{body}");
                timed_out += 1;
            }
            other => panic!("status {other}: {}", response.text().await.unwrap()),
        }
    }
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(&text, circuit),
        Some(1.0),
        "the silent worker's circuit opened ({served} served, {timed_out} timed out): {text}"
    );
    assert_eq!(timed_out, 2, "two silences open the circuit: {text}");
    assert_eq!(
        silent.generations(),
        2,
        "no retry after the request timeout"
    );
    assert_eq!(
        metric(&text, "switchyard_upstream_failures_total"),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "switchyard_request_timeouts_total"),
        Some(2.0),
        "{text}"
    );
    // From now on every request goes to the worker that answers.
    let before = good.generations();
    for _ in 0..4 {
        let response = client
            .post(format!("{}/v1/chat/completions", router.base))
            .json(&json!({"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-switchyard-worker"], "good");
    }
    assert_eq!(good.generations(), before + 4);
    assert_eq!(silent.generations(), 2);
    wait_metrics(&client, &router.base, "nothing booked", |text| {
        metric(text, "switchyard_active_requests") == Some(0.0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prompt_that_failed_on_two_workers_is_not_sent_to_a_third() {
    let _machine = machine().await;
    let workers = [
        Fake::start(Behaviour::HangUp).await,
        Fake::start(Behaviour::HangUp).await,
        Fake::start(Behaviour::HangUp).await,
    ];
    let router = router(
        &[
            workers[0].named("a"),
            workers[1].named("b"),
            workers[2].named("c"),
        ],
        // The migration limit alone would allow all three.
        &["--migration-limit", "5"],
    );
    let client = reqwest::Client::new();
    let received = || workers.iter().map(Fake::generations).sum::<usize>();
    for (n, stream) in [false, true].into_iter().enumerate() {
        let response = client
            .post(format!("{}/v1/completions", router.base))
            .json(&json!({"prompt": [9, 8, 7, 6], "max_tokens": 4, "stream": stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 502, "stream: {stream}");
        let body: Value = response.json().await.unwrap();
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("failed on 2 workers"),
            "the client learns why it stopped: {message}"
        );
        assert_eq!(
            received(),
            2 * (n + 1),
            "two workers per request, not three"
        );
    }
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(
            &text,
            "switchyard_migrations_refused_total{reason=\"worker_limit\"}"
        ),
        Some(2.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "switchyard_migrations_total{reason=\"reset\"}"),
        Some(2.0),
        "one move per request: {text}"
    );
    assert_eq!(
        metric(&text, "switchyard_upstream_failures_total"),
        Some(4.0),
        "hang-ups are the workers' failures, each reported: {text}"
    );

    // The limit is `--max-attempt-workers`: at 3 the prompt reaches every
    // worker, and then none is left.
    let wider = crate::support::router(
        &[
            workers[0].named("a"),
            workers[1].named("b"),
            workers[2].named("c"),
        ],
        &["--migration-limit", "5", "--max-attempt-workers", "3"],
    );
    let before = received();
    let response = client
        .post(format!("{}/v1/completions", wider.base))
        .json(&json!({"prompt": [9, 8, 7, 6], "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert!(response.status().is_server_error());
    assert_eq!(received(), before + 3, "three workers with the limit at 3");
}

/// Streams a chat request; the worker that took it and the stream's text.
async fn chat_stream(client: &reqwest::Client, base: &str, body: &Value) -> (String, String) {
    let response = client
        .post(format!("{base}/v1/chat/completions"))
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let worker = response.headers()["x-switchyard-worker"]
        .to_str()
        .unwrap()
        .to_owned();
    (worker, response.text().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_with_tools_cut_mid_way_ends_with_an_error_instead_of_resuming() {
    let _machine = machine().await;
    let cutting = Fake::start(Behaviour::CutChat).await;
    let good = Fake::start(Behaviour::Good).await;
    // Round-robin, and a circuit that never opens here, so that requests
    // keep reaching the cutting worker; the tokenizer named (these fakes
    // have no /tokenize), so that only the tools stop a resume.
    let tokenizer = crate::support::bundled_tokenizer_dir();
    let router = router(
        &[cutting.named("cutting"), good.named("good")],
        &[
            "--policy",
            "round-robin",
            "--circuit-failures",
            "100",
            "--tokenizer-dir",
            &tokenizer,
        ],
    );
    let client = reqwest::Client::new();
    let plain = json!({
        "messages": [{"role": "user", "content": "what is the weather"}],
        "max_tokens": 8,
        "stream": true,
    });
    let mut with_tools = plain.clone();
    with_tools["tools"] = json!([{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]);

    // Control: the same request without tools, cut on the cutting worker,
    // is resumed on the good one.
    let mut resumed = false;
    for _ in 0..4 {
        let before = good.generations();
        let (worker, text) = chat_stream(&client, &router.base, &plain).await;
        if worker == "cutting" {
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
            assert!(text.contains(" delta"), "{text}");
            assert_eq!(good.generations(), before + 1, "resumed on the good worker");
            resumed = true;
            break;
        }
    }
    assert!(resumed, "a plain request reached the cutting worker");

    let mut ended = false;
    for _ in 0..4 {
        let before = good.generations();
        let (worker, text) = chat_stream(&client, &router.base, &with_tools).await;
        if worker != "cutting" {
            continue;
        }
        // What the cutting worker sent reached the client; then an error
        // event naming why, and no [DONE].
        assert!(text.contains(" gamma"), "{text}");
        assert!(!text.contains("[DONE]"), "{text}");
        assert!(!text.contains(" delta"), "not resumed elsewhere: {text}");
        let last = text
            .split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .last()
            .and_then(|e| e.strip_prefix("data: "))
            .expect("a last event");
        let error: Value = serde_json::from_str(last).unwrap();
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("cannot be resumed") && message.contains("tools"),
            "{message}"
        );
        assert!(!message.contains("weather"), "no prompt content: {message}");
        assert_eq!(good.generations(), before, "nothing was sent to resume it");
        ended = true;
        break;
    }
    assert!(ended, "a request with tools reached the cutting worker");
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(
            &text,
            "switchyard_migrations_refused_total{reason=\"not_resumable\"}"
        ),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "switchyard_migrations_total{reason=\"midstream\"}"),
        Some(1.0),
        "only the plain request was resumed: {text}"
    );
    wait_metrics(&client, &router.base, "nothing booked", |text| {
        metric(text, "switchyard_active_requests") == Some(0.0)
    })
    .await;
}
