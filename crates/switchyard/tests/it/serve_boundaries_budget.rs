//! What a tenant may cost the router and learn from it, with two client
//! keys (A and B) and real router and worker processes over loopback:
//! bodies held at once stay within the body budget, `count_tokens` is
//! charged to the key's token quota like a message, and with keys
//! required no error names a worker's address and none of a worker's own
//! headers reach the client. Every wait polls a condition with a generous
//! deadline, and memory is measured, not timed.

use crate::scripted_worker::{scripted_worker, Script};
use crate::support::{
    machine, metric, metrics_text, peak_resident_bytes, resident_bytes, router, scratch_file,
    serve, sim_worker_with, wait_metrics, wait_ready, PATIENCE,
};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::TcpStream;

/// Key A has no token limit; key B may send 2,000 tokens a minute.
const KEYS: &[u8] = br#"
[[rate_limits.keys]]
name = "a"
key = "sk-a"

[[rate_limits.keys]]
name = "b"
key = "sk-b"
tokens_per_minute = 2000
"#;

const MIB: u64 = 1024 * 1024;

fn keys_file() -> String {
    scratch_file("boundaries_budget_keys.toml", KEYS)
        .to_str()
        .unwrap()
        .to_owned()
}

/// A response read off a raw connection: its status, head and body.
struct RawResponse {
    status: u16,
    head: String,
    body: Vec<u8>,
}

/// Reads one HTTP/1.1 response (an interim `100 Continue` is a response
/// of its own) from `reader`, whose bytes read past the previous one are
/// in `pending`.
async fn read_response(reader: &mut OwnedReadHalf, pending: &mut Vec<u8>) -> RawResponse {
    let read = async {
        let mut buf = vec![0u8; 64 * 1024];
        let head_end = loop {
            if let Some(i) = pending.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let n = reader.read(&mut buf).await.expect("the router answers");
            assert!(n > 0, "the connection closed before a response");
            pending.extend_from_slice(&buf[..n]);
        };
        let head = String::from_utf8_lossy(&pending[..head_end]).to_lowercase();
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("a status line");
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse().unwrap());
        while pending.len() < head_end + length {
            let n = reader.read(&mut buf).await.expect("the body arrives");
            assert!(n > 0, "the connection closed mid-body");
            pending.extend_from_slice(&buf[..n]);
        }
        let body = pending[head_end..head_end + length].to_vec();
        pending.drain(..head_end + length);
        RawResponse { status, head, body }
    };
    tokio::time::timeout(PATIENCE, read)
        .await
        .expect("a response within the deadline")
}

/// A `count_tokens` body of exactly `len` bytes: one user message of
/// filler text.
fn count_tokens_body(len: usize) -> Vec<u8> {
    let open =
        br#"{"model":"switchyard-sim","max_tokens":8,"messages":[{"role":"user","content":""#;
    let close = br#""}]}"#;
    let mut body = Vec::with_capacity(len);
    body.extend_from_slice(open);
    let words = b"the quick brown fox jumps over the lazy dog ";
    while body.len() < len - close.len() {
        let room = len - close.len() - body.len();
        body.extend_from_slice(&words[..room.min(words.len())]);
    }
    body.extend_from_slice(close);
    body
}

/// An upload of a `count_tokens` body that waits for the router's go
/// (`Expect: 100-continue`): the router either takes the body's declared
/// length from its budget and reads it (`100 Continue`), or refuses it
/// from the head.
struct Upload {
    reader: OwnedReadHalf,
    writer: OwnedWriteHalf,
    pending: Vec<u8>,
}

impl Upload {
    /// Sends the head of a `len`-byte body with key `key`; the router's
    /// first answer: `Ok(upload)` on `100 Continue`, else the response.
    async fn start(base: &str, key: &str, len: usize) -> Result<Self, RawResponse> {
        let stream = TcpStream::connect(base.trim_start_matches("http://"))
            .await
            .expect("the router accepts");
        let (mut reader, mut writer) = stream.into_split();
        let head = format!(
            "POST /v1/messages/count_tokens HTTP/1.1\r\nhost: router\r\nx-api-key: {key}\r\ncontent-type: application/json\r\ncontent-length: {len}\r\nexpect: 100-continue\r\n\r\n"
        );
        writer.write_all(head.as_bytes()).await.unwrap();
        let mut pending = Vec::new();
        let first = read_response(&mut reader, &mut pending).await;
        if first.status != 100 {
            return Err(first);
        }
        Ok(Self {
            reader,
            writer,
            pending,
        })
    }

    /// Sends `bytes` of the body.
    async fn send(&mut self, bytes: &[u8]) {
        self.writer.write_all(bytes).await.unwrap();
    }

    /// The router's answer, once the body is whole.
    async fn answer(mut self) -> RawResponse {
        read_response(&mut self.reader, &mut self.pending).await
    }
}

/// Eight clients of key A upload ~30 MB `count_tokens` bodies at once
/// against a body budget of 64 MiB. The first two fit (60 MB) and are
/// read; while they are held the other six are refused from their heads
/// with a 503 and `Retry-After` (nothing waits), counted in
/// `switchyard_body_budget_refusals_total`. The two, made whole together,
/// are parsed and tokenized side by side and answered (here 400: 30 MB of
/// text is past the prompt token limit); the budget is given back. The
/// router's resident memory at its peak grew by less than 512 MiB (eight
/// times the budget) over its baseline: 250 to 280 MiB measured, where a
/// budget that lets all eight in took it up by 670 to 1,200 MiB.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_30_mb_count_tokens_bodies_at_once_stay_within_the_body_budget() {
    let _machine = machine().await;
    const BODY: usize = 30_000_000;
    const BUDGET: u64 = 64 * MIB;
    const BOUND: u64 = 8 * BUDGET;
    let budget = BUDGET.to_string();
    let config = keys_file();
    let router = serve(&[
        "--config",
        &config,
        "--max-body-bytes-total",
        &budget,
        "--body-read-timeout-ms",
        "600000",
    ]);
    let client = reqwest::Client::new();
    // Warm up: the tokenizer, the pools, the first request's allocations.
    for _ in 0..3 {
        let response = client
            .post(format!("{}/v1/messages/count_tokens", router.base))
            .header("x-api-key", "sk-a")
            .json(&json!({"model": "switchyard-sim", "max_tokens": 8, "messages": [{"role": "user", "content": "hello"}]}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
    }
    let baseline = resident_bytes(&router);
    let body = count_tokens_body(BODY);

    let mut admitted = Vec::new();
    let mut refused = Vec::new();
    for _ in 0..8 {
        match Upload::start(&router.base, "sk-a", BODY).await {
            Ok(mut upload) => {
                // All but the last byte: the body is held, not yet whole.
                upload.send(&body[..BODY - 1]).await;
                admitted.push(upload);
            }
            Err(response) => refused.push(response),
        }
    }
    assert_eq!(admitted.len(), 2, "two 30 MB bodies fit 64 MiB");
    assert_eq!(refused.len(), 6);
    for response in &refused {
        assert_eq!(response.status, 503, "{}", response.head);
        assert!(
            response.head.contains("retry-after: 1"),
            "{}",
            response.head
        );
        let error: Value = serde_json::from_slice(&response.body).unwrap();
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains("--max-body-bytes-total"), "{error}");
    }
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(&text, "switchyard_body_budget_refusals_total"),
        Some(6.0),
        "{text}"
    );
    assert_eq!(
        metric(&text, "switchyard_body_budget_held_bytes"),
        Some(2.0 * BODY as f64),
        "{text}"
    );
    assert_eq!(
        metric(&text, "switchyard_body_budget_bytes"),
        Some(BUDGET as f64),
        "{text}"
    );

    // Both whole at once: parsed and tokenized side by side.
    for upload in &mut admitted {
        upload.send(&body[BODY - 1..]).await;
    }
    for upload in admitted {
        let answer = upload.answer().await;
        let error: Value = serde_json::from_slice(&answer.body).unwrap();
        assert_eq!(answer.status, 400, "past the prompt token limit: {error}");
    }
    wait_metrics(&client, &router.base, "the budget given back", |text| {
        metric(text, "switchyard_body_budget_held_bytes") == Some(0.0)
    })
    .await;
    let grown = peak_resident_bytes(&router).saturating_sub(baseline);
    assert!(
        grown < BOUND,
        "the router's resident memory peaked {} MiB over its baseline (bound {} MiB)",
        grown / MIB,
        BOUND / MIB
    );
    // Room again: a body of the largest size is read.
    let mut upload = Upload::start(&router.base, "sk-a", BODY)
        .await
        .unwrap_or_else(|r| panic!("refused with {}: the budget was given back", r.status));
    upload.send(&body).await;
    assert_eq!(upload.answer().await.status, 400);
}

/// About 3,500 tokens: over key B's whole minute of 2,000.
fn long_text() -> String {
    "the quick brown fox jumps over the lazy dog. ".repeat(350)
}

/// `count_tokens` costs the router a tokenization, as a message does, and
/// is charged like one: key A counts about 3,500 tokens, while key B
/// (2,000 tokens a minute) gets the very 429 it gets for the same message
/// — Anthropic's `rate_limit_error` — before any worker is asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_count_tokens_over_the_keys_token_quota_gets_the_messages_429() {
    let _machine = machine().await;
    let config = keys_file();
    let router = serve(&["--config", &config]);
    let client = reqwest::Client::new();
    let body = json!({"model": "switchyard-sim", "max_tokens": 8, "messages": [{"role": "user", "content": long_text()}]});
    let send = async |path: &str, key: &str| {
        let response = client
            .post(format!("{}{path}", router.base))
            .header("x-api-key", key)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json::<Value>().await.unwrap())
    };
    let (status, counted) = send("/v1/messages/count_tokens", "sk-a").await;
    assert_eq!(status, 200, "{counted}");
    let tokens = counted["input_tokens"].as_u64().unwrap();
    assert!((3000..4000).contains(&tokens), "{tokens} tokens");

    let (status, counting) = send("/v1/messages/count_tokens", "sk-b").await;
    assert_eq!(status, 429, "{counting}");
    let (status, message) = send("/v1/messages", "sk-b").await;
    assert_eq!(status, 429, "{message}");
    assert_eq!(counting["error"]["type"], "rate_limit_error", "{counting}");
    assert_eq!(counting["error"]["type"], message["error"]["type"]);
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(
            &text,
            "switchyard_rate_limited_total{key=\"b\",limit=\"tokens\"}"
        ),
        Some(2.0),
        "both refusals counted against key b: {text}"
    );
    // The default body budget: four bodies of the largest size.
    assert_eq!(
        metric(&text, "switchyard_body_budget_bytes"),
        Some((4 * 32 * MIB) as f64),
        "{text}"
    );
}

/// The text of a response, with its headers as `name: value` lines.
async fn head_and_text(response: reqwest::Response) -> (u16, String, String) {
    let status = response.status().as_u16();
    let head = response
        .headers()
        .iter()
        .map(|(k, v)| format!("{k}: {}\n", v.to_str().unwrap_or("?")))
        .collect();
    (status, head, response.text().await.unwrap())
}

/// With keys required, a worker that fails (answers 500) is "a worker"
/// in every error the client gets — a completion, a chat stream, a
/// Messages request — never its address, which is its name here (no
/// `name=`); without keys the same error names it, as before. A worker's
/// own `server` header does not reach a keyed router's clients, while the
/// body's `content-type` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_client_keys_no_error_names_a_worker_and_only_a_clients_headers_pass() {
    let _machine = machine().await;
    let client = reqwest::Client::new();
    let failing = scripted_worker(Script::Status500).await;
    let address = failing.trim_start_matches("http://").to_owned();
    let config = keys_file();
    let keyed = serve(&[
        "--config",
        &config,
        "--worker",
        &failing,
        "--migration-limit",
        "0",
        // Every request below fails on it: its circuit must stay closed.
        "--circuit-failures",
        "10",
    ]);
    let open = router(std::slice::from_ref(&failing), &["--migration-limit", "0"]);
    wait_ready(&client, &keyed.base).await;
    wait_ready(&client, &open.base).await;

    let completion = json!({"model": "switchyard-sim", "prompt": "hello", "max_tokens": 4});
    let chat = json!({"model": "switchyard-sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": true});
    let message = json!({"model": "switchyard-sim", "max_tokens": 4, "messages": [{"role": "user", "content": "hello"}]});
    for (path, body) in [
        ("/v1/completions", &completion),
        ("/v1/chat/completions", &chat),
        ("/v1/messages", &message),
    ] {
        let response = client
            .post(format!("{}{path}", keyed.base))
            .bearer_auth("sk-a")
            .json(body)
            .send()
            .await
            .unwrap();
        let (status, head, text) = head_and_text(response).await;
        assert_eq!(status, 502, "{path}: {text}");
        assert!(text.contains("a worker answered 500"), "{path}: {text}");
        for told in [&text, &head] {
            assert!(!told.contains(&address), "{path} names {address}: {told}");
            assert!(!told.contains("127.0.0.1"), "{path}: {told}");
        }
    }
    let response = client
        .post(format!("{}/v1/completions", open.base))
        .json(&completion)
        .send()
        .await
        .unwrap();
    let (status, _, text) = head_and_text(response).await;
    assert_eq!(status, 502, "{text}");
    assert!(
        text.contains(&format!("worker {address} answered 500")),
        "without keys the operator's error names the worker: {text}"
    );
    drop((keyed, open));

    // A worker's own headers: the sim-worker answers with uvicorn's
    // `server`, as vLLM and SGLang do.
    let sim = sim_worker_with(0, &["--speedup", "0", "--num-blocks", "1024"]);
    let direct = client
        .get(format!("{}/v1/models", sim.base))
        .send()
        .await
        .unwrap();
    assert_eq!(direct.headers()["server"], "uvicorn");
    let keyed = serve(&["--config", &config, "--worker", &sim.base]);
    wait_ready(&client, &keyed.base).await;
    let streamed = json!({"model": "switchyard-sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": true});
    let whole = json!({"model": "switchyard-sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4});
    for (body, content_type) in [
        (&whole, "application/json"),
        (&streamed, "text/event-stream"),
    ] {
        let response = client
            .post(format!("{}/v1/chat/completions", keyed.base))
            .bearer_auth("sk-b")
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let headers = response.headers().clone();
        let _ = response.bytes().await;
        assert!(
            headers["content-type"]
                .to_str()
                .unwrap()
                .starts_with(content_type),
            "{headers:?}"
        );
        assert!(!headers.contains_key("server"), "{headers:?}");
        assert!(headers.contains_key("x-request-id"), "the router's own");
        assert!(!headers.contains_key("x-switchyard-worker"), "{headers:?}");
    }
}
