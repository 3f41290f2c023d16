//! Heap allocations per request on the router's request path, counted by
//! a counting global allocator (`allocation-counter`, which counts the
//! current thread's allocations only).
//!
//! The router runs alone on one thread (a current-thread tokio runtime:
//! its accept loop, connections, handlers, upstream client and stream
//! tasks all run there); a keep-alive worker and the client run on the
//! test's own runtime. So what is counted is the router's whole work for a
//! request — the client's connection, the body, routing, the upstream
//! request, the answer — and nothing of the worker's or the client's.
//!
//! Four loads, each after a warm-up: a 128-token-id completion and a fresh
//! ~470-character chat message, each non-streaming and streaming (16
//! content events and `[DONE]`). A chat message is tokenized by the bundled
//! tokenizer, whose allocations are most of a chat request's; they are
//! counted apart (the same messages tokenized on this thread) and the bound
//! is on the rest, the router's own. Run with `--nocapture` to see the
//! figures; the test fails when a path allocates more than its bound, so a
//! change that adds copies to the request path is noticed.

use bytes::Bytes;
use serde_json::json;
use std::sync::mpsc as std_mpsc;
use std::time::Duration;
use switchyard_server::tokenize::{HfTokenizer, PromptTokenizer as _};
use switchyard_server::{ServerConfig, WorkerSpec};
use switchyard_tokenizer::ChatMessage;
use tokio::sync::mpsc;

/// Requests measured per load (after as many again to warm up).
const REQUESTS: usize = 100;

/// Content events per streamed answer.
const EVENTS: usize = 16;

/// One load's figures.
#[derive(Debug, Clone, Copy)]
struct PerRequest {
    allocations: f64,
    bytes: f64,
}

/// The loads, in the order they run: (label, chat, stream, bound on the
/// router's own allocations per request, the tokenizer's not counted).
/// Measured (debug build): 76, 123, 74 and 110; before the request path
/// stopped copying (issue #16 part 4) they were 105, 252, 98 and 234.
const LOADS: [(&str, bool, bool, f64); 4] = [
    ("completion, token ids, non-streaming", false, false, 90.0),
    ("completion, token ids, streaming", false, true, 140.0),
    ("chat text, non-streaming", true, false, 90.0),
    ("chat text, streaming", true, true, 130.0),
];

const TEXT: &str =
    "Switchyard routes each request to the worker that will serve it soonest and cheapest. \
    It knows which prompt prefixes every worker holds in its KV cache, how loaded each worker is, \
    and which session a turn belongs to. Please summarise in one sentence why a cache-aware router \
    lowers time to first token for multi-turn chats, and name one risk of routing by cache alone.";

fn message(i: usize) -> String {
    format!("{i} {TEXT}")
}

fn body(i: usize, chat: bool, stream: bool) -> Bytes {
    let value = if chat {
        json!({"model": "switchyard-sim", "messages": [{"role": "user", "content": message(i)}], "max_tokens": EVENTS, "stream": stream})
    } else {
        let prompt: Vec<u32> = (0..128u32).map(|t| t + (i as u32 % 64) * 7).collect();
        json!({"model": "switchyard-sim", "prompt": prompt, "max_tokens": EVENTS, "stream": stream})
    };
    serde_json::to_vec(&value).unwrap().into()
}

/// A keep-alive worker serving `switchyard-sim`: a whole JSON answer, or
/// `EVENTS` content events (one body frame each) and `[DONE]`.
async fn worker() -> String {
    use axum::body::Body;
    use axum::routing::{get, post};
    async fn generate(uri: axum::http::Uri, body: Bytes) -> axum::response::Response {
        let chat = uri.path() == "/v1/chat/completions";
        let stream = std::str::from_utf8(&body).is_ok_and(|b| b.contains("\"stream\":true"));
        if !stream {
            let answer = if chat {
                json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "switchyard-sim", "choices": [{"index": 0, "message": {"role": "assistant", "content": "a b c d e f g h i j k l m n o p"}, "finish_reason": "length"}], "usage": {"prompt_tokens": 128, "completion_tokens": EVENTS, "total_tokens": 128 + EVENTS}})
            } else {
                json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "switchyard-sim", "choices": [{"index": 0, "text": "a b c d e f g h i j k l m n o p", "finish_reason": "length"}], "usage": {"prompt_tokens": 128, "completion_tokens": EVENTS, "total_tokens": 128 + EVENTS}})
            };
            return axum::response::Response::builder()
                .header("content-type", "application/json")
                .body(Body::from(answer.to_string()))
                .unwrap();
        }
        let mut events: Vec<Result<Bytes, std::convert::Infallible>> = (0..EVENTS)
            .map(|i| {
                let finish = (i + 1 == EVENTS).then_some("length");
                let e = if chat {
                    json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "switchyard-sim", "choices": [{"index": 0, "delta": {"content": " w"}, "finish_reason": finish}]})
                } else {
                    json!({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "switchyard-sim", "choices": [{"index": 0, "text": " w", "token_ids": [1000 + i], "finish_reason": finish}]})
                };
                Ok(Bytes::from(format!("data: {e}\n\n")))
            })
            .collect();
        events.push(Ok(Bytes::from_static(b"data: [DONE]\n\n")));
        axum::response::Response::builder()
            .header("content-type", "text/event-stream")
            .body(Body::from_stream(futures_util::stream::iter(events)))
            .unwrap()
    }
    let app = axum::Router::new()
        .route("/health", get(|| async { "ok" }))
        .route(
            "/v1/models",
            get(|| async {
                axum::Json(json!({"object": "list", "data": [{"id": "switchyard-sim"}]}))
            }),
        )
        .route("/v1/completions", post(generate))
        .route("/v1/chat/completions", post(generate));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    base
}

/// Runs the router on a thread of its own and measures its allocations
/// between the client's phase marks: one count per phase.
fn router_thread(
    worker: String,
    addr: std_mpsc::Sender<String>,
    mut marks: mpsc::UnboundedReceiver<()>,
) -> std::thread::JoinHandle<Vec<allocation_counter::AllocationInfo>> {
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let config = ServerConfig {
            host: "127.0.0.1".into(),
            port: 0,
            // No health check inside a measured phase.
            health_interval_ms: 3_600_000,
            workers: vec![WorkerSpec::parse(&worker).unwrap()],
            ..ServerConfig::default()
        };
        let server = runtime
            .block_on(switchyard_server::start(config))
            .expect("the router starts");
        addr.send(format!("http://{}", server.addr)).unwrap();
        let mut phases = Vec::new();
        loop {
            let mut open = true;
            let info = allocation_counter::measure(|| {
                open = runtime.block_on(marks.recv()).is_some();
            });
            if !open {
                break;
            }
            phases.push(info);
        }
        let _ = runtime.block_on(server.shutdown());
        phases
    })
}

async fn send(client: &reqwest::Client, base: &str, i: usize, chat: bool, stream: bool) {
    let path = if chat {
        "/v1/chat/completions"
    } else {
        "/v1/completions"
    };
    let response = client
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body(i, chat, stream))
        .send()
        .await
        .expect("the router answers");
    assert!(response.status().is_success(), "{}", response.status());
    let bytes = response.bytes().await.expect("the whole answer");
    if stream {
        assert!(bytes.ends_with(b"data: [DONE]\n\n"));
    }
}

#[test]
fn allocations_per_request_on_the_request_path() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let worker = runtime.block_on(worker());
    let (addr_tx, addr_rx) = std_mpsc::channel();
    let (marks, marks_rx) = mpsc::unbounded_channel();
    let router = router_thread(worker, addr_tx, marks_rx);
    let base = addr_rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the router's address");
    let client = reqwest::Client::new();
    // The first message of each load's measured requests.
    let mut measured_from = Vec::new();
    runtime.block_on(async {
        let mut i = 0;
        for (_, chat, stream, _) in LOADS {
            // Warm-up, then the measured requests; a mark ends each.
            for phase in 0..2 {
                if phase == 1 {
                    measured_from.push(i);
                }
                for _ in 0..REQUESTS {
                    send(&client, &base, i, chat, stream).await;
                    i += 1;
                }
                marks.send(()).unwrap();
            }
        }
    });
    drop(marks);
    let phases = router.join().expect("the router thread");
    let tokenizer = HfTokenizer(switchyard_tokenizer::Tokenizer::bundled().unwrap());
    let mut over = Vec::new();
    for (((label, chat, _, bound), info), first) in LOADS
        .iter()
        .zip(phases.iter().skip(1).step_by(2))
        .zip(measured_from)
    {
        let total = PerRequest {
            allocations: info.count_total as f64 / REQUESTS as f64,
            bytes: info.bytes_total as f64 / REQUESTS as f64,
        };
        let tokenizing = if *chat {
            let messages: Vec<Vec<ChatMessage>> = (first..first + REQUESTS)
                .map(|i| {
                    vec![ChatMessage {
                        role: "user".into(),
                        content: message(i),
                        tool_calls: Vec::new(),
                        reasoning: None,
                    }]
                })
                .collect();
            let info = allocation_counter::measure(|| {
                for m in &messages {
                    let ids = tokenizer.encode_chat_within(m, 1 << 17).unwrap();
                    std::hint::black_box(ids);
                }
            });
            PerRequest {
                allocations: info.count_total as f64 / REQUESTS as f64,
                bytes: info.bytes_total as f64 / REQUESTS as f64,
            }
        } else {
            PerRequest {
                allocations: 0.0,
                bytes: 0.0,
            }
        };
        let own = total.allocations - tokenizing.allocations;
        println!(
            "{label}: {:.1} allocations ({:.0} bytes) per request; the tokenizer's {:.1} ({:.0} bytes); the router's own {own:.1} ({:.0} bytes)",
            total.allocations,
            total.bytes,
            tokenizing.allocations,
            tokenizing.bytes,
            total.bytes - tokenizing.bytes
        );
        if own > *bound {
            over.push(format!("{label}: {own:.1} > {bound}"));
        }
    }
    assert!(
        over.is_empty(),
        "allocations per request over their bounds: {over:?}"
    );
}
