//! Every input bounded, with the bound stated: bodies of the largest
//! accepted size built to cost the router memory (token ids; a million
//! empty messages) are refused with a 400 naming the limit, and the
//! router's peak memory grows by less than [`PEAK_GROWTH_BOUND`] times the
//! body; `n` and `max_tokens` past their limits are refused naming them,
//! whatever JSON form they take, before any worker sees them; the prompt
//! token limit defaults to the worker's `max_model_len`.

use crate::support::{machine, metric, router, sim_worker_with, wait_for, PATIENCE};
use serde_json::json;

/// The router's default body limit (`--max-body-bytes`).
const MAX_BODY_BYTES: usize = 32 * 1024 * 1024;

/// How much a refused body of the largest accepted size may raise the
/// router's peak resident memory, in multiples of the body's size.
/// Reading the body costs up to two bodies (its frames, then the one
/// buffer they are copied into); the bounded parser stops at the first
/// element past a limit, so parsing adds almost nothing. Measured (debug
/// build, 2026-12-01): 2.00x for 32 MiB of token ids, 1.03-1.08x for a
/// million empty messages (29 MB), 1.06x for 32 MiB of numbers as `n`.
/// The same bodies against the router before the bounds: 14x, 82x (2.4 GB:
/// the chat rendered and tokenized) and 17x.
const PEAK_GROWTH_BOUND: f64 = 3.0;

/// The same for a text prompt, which the router tokenizes to count: the
/// text as a string (one body more) and, for a chat, the rendered template
/// (its copy of the messages and the growing output: two to three more);
/// the tokenizer itself, which costs some 100 bytes per byte of text at
/// once, works a 64 KiB piece at a time and stops at the first piece past
/// the limit. Measured (debug build, 2026-12-01): 2.1-3.3x for 32 MiB of
/// text, 6.0x for a chat of one 29 MB message. Before: 65-102x and 64x,
/// and 30 to 90 seconds of tokenizing.
const TEXT_PEAK_GROWTH_BOUND: f64 = 8.0;

/// `VmHWM` (peak resident) of process `pid`, in bytes.
fn peak_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("reading /proc");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM in /proc/PID/status");
    kb * 1024
}

/// Resets the peak to the current resident size (Linux's `clear_refs` 5),
/// so that the next [`peak_bytes`] measures one request alone.
fn reset_peak(pid: u32) {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").expect("resetting VmHWM");
}

/// Posts `body` to `path` and returns the router's peak growth over it in
/// bytes, with the status and the answer's body.
async fn peak_growth_of(
    client: &reqwest::Client,
    base: &str,
    pid: u32,
    path: &str,
    body: Vec<u8>,
) -> (u64, u16, String) {
    reset_peak(pid);
    let before = peak_bytes(pid);
    let response = client
        .post(format!("{base}{path}"))
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await
        .unwrap();
    let status = response.status().as_u16();
    let answer = response.text().await.unwrap();
    (peak_bytes(pid).saturating_sub(before), status, answer)
}

/// Waits until the router serves (its worker in selection, its
/// `/v1/models` read).
async fn ready(client: &reqwest::Client, base: &str) {
    wait_for("the router to be ready", PATIENCE, async || {
        client
            .get(format!("{base}/ready"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_of_the_largest_size_built_to_cost_memory_are_refused_within_a_bound() {
    let _machine = machine().await;
    let worker = sim_worker_with(0, &["--speedup", "0", "--num-blocks", "1024"]);
    let router = router(&[worker.named("w0")], &[]);
    let pid = router.child.id();
    let client = reqwest::Client::new();
    ready(&client, &router.base).await;

    // (a) Token ids, two bytes each, up to the body limit: 16 million ids.
    let mut ids = Vec::with_capacity(MAX_BODY_BYTES);
    ids.extend_from_slice(b"{\"prompt\":[");
    while ids.len() + 4 < MAX_BODY_BYTES {
        ids.extend_from_slice(b"1,");
    }
    ids.extend_from_slice(b"1]}");
    let size = ids.len();
    let (growth, status, answer) =
        peak_growth_of(&client, &router.base, pid, "/v1/completions", ids).await;
    let error: serde_json::Value = serde_json::from_str(&answer).unwrap();
    eprintln!(
        "token ids: {size} bytes, peak grew {growth} bytes ({:.2}x)",
        growth as f64 / size as f64
    );
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["error"]["param"], "prompt");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("limit of 32768 tokens (the largest max_model_len the workers report)"),
        "{message}"
    );
    assert!(
        (growth as f64) < PEAK_GROWTH_BOUND * size as f64,
        "the peak grew by {growth} bytes for a body of {size}"
    );

    // (b) A million empty messages (30 bytes each): refused at 4096.
    let mut chat = Vec::with_capacity(MAX_BODY_BYTES);
    chat.extend_from_slice(b"{\"messages\":[");
    for i in 0..1_000_000 {
        if i > 0 {
            chat.push(b',');
        }
        chat.extend_from_slice(br#"{"role":"user","content":""}"#);
    }
    chat.extend_from_slice(b"]}");
    let size = chat.len();
    assert!(size <= MAX_BODY_BYTES);
    let (growth, status, answer) =
        peak_growth_of(&client, &router.base, pid, "/v1/chat/completions", chat).await;
    let error: serde_json::Value = serde_json::from_str(&answer).unwrap();
    eprintln!(
        "a million empty messages: {size} bytes, peak grew {growth} bytes ({:.2}x)",
        growth as f64 / size as f64
    );
    assert_eq!(status, 400, "{error}");
    assert_eq!(error["error"]["param"], "messages");
    let message = error["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("limit of 4096 (--max-messages)"),
        "{message}"
    );
    assert!(
        (growth as f64) < PEAK_GROWTH_BOUND * size as f64,
        "the peak grew by {growth} bytes for a body of {size}"
    );

    // (c) A list of 16 million numbers where `n` belongs: judged "not a
    // count" in one pass (the router once copied such a value into a
    // generic tree first) and refused naming `n`.
    let mut n = Vec::with_capacity(MAX_BODY_BYTES);
    n.extend_from_slice(b"{\"prompt\":[1],\"n\":[");
    while n.len() + 40 < MAX_BODY_BYTES {
        n.extend_from_slice(b"0,");
    }
    n.extend_from_slice(b"0],\"max_tokens\":4000000000}");
    let size = n.len();
    let (growth, status, answer) =
        peak_growth_of(&client, &router.base, pid, "/v1/completions", n).await;
    eprintln!(
        "a list as n: {size} bytes, peak grew {growth} bytes ({:.2}x)",
        growth as f64 / size as f64
    );
    assert_eq!(status, 400, "{answer}");
    assert!(answer.contains("\"param\":\"n\""), "{answer}");
    assert!(
        (growth as f64) < PEAK_GROWTH_BOUND * size as f64,
        "the peak grew by {growth} bytes for a body of {size}"
    );

    // (d) A text prompt of the largest size, and (e) a chat of one message
    // as large: refused once the tokens counted pass the limit.
    let words = "lorem ipsum dolor sit amet, consectetur adipiscing elit ";
    let text = words.repeat((MAX_BODY_BYTES - 64) / words.len());
    for (path, body, param) in [
        ("/v1/completions", json!({ "prompt": text }), "prompt"),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": text}]}),
            "messages",
        ),
    ] {
        let body = body.to_string().into_bytes();
        let size = body.len();
        let (growth, status, answer) = peak_growth_of(&client, &router.base, pid, path, body).await;
        eprintln!(
            "a text {param}: {size} bytes, peak grew {growth} bytes ({:.2}x)",
            growth as f64 / size as f64
        );
        assert_eq!(status, 400, "{answer}");
        let error: serde_json::Value = serde_json::from_str(&answer).unwrap();
        assert_eq!(error["error"]["param"], param);
        let message = error["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("longer than the limit of 32768 tokens"),
            "{message}"
        );
        assert!(
            (growth as f64) < TEXT_PEAK_GROWTH_BOUND * size as f64,
            "the peak grew by {growth} bytes for a body of {size}"
        );
    }

    // Every limit counted, and the router still serves.
    let metrics = client
        .get(format!("{}/metrics", router.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for (limit, count) in [("prompt_tokens", 3.0), ("messages", 1.0)] {
        let series = format!("switchyard_input_limit_refusals_total{{limit=\"{limit}\"}}");
        assert_eq!(metric(&metrics, &series), Some(count), "{series}");
    }
    let ok = client
        .post(format!("{}/v1/completions", router.base))
        .json(&json!({"prompt": [1, 2, 3], "max_tokens": 2}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n_max_tokens_and_prompt_length_are_refused_past_their_limits() {
    let _machine = machine().await;
    // The worker reports max_model_len 2048: the router's default prompt
    // token limit, and its default output token limit.
    let worker = sim_worker_with(
        0,
        &[
            "--speedup",
            "0",
            "--num-blocks",
            "1024",
            "--max-model-len",
            "2048",
        ],
    );
    let router = router(&[worker.named("w0")], &["--max-n", "4"]);
    let client = reqwest::Client::new();
    ready(&client, &router.base).await;
    let post = async |path: &str, body: serde_json::Value| {
        let response = client
            .post(format!("{}{path}", router.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        (status, response.json::<serde_json::Value>().await.unwrap())
    };
    let m = json!([{"role": "user", "content": "hi"}]);
    let source = "(the largest max_model_len the workers report)";
    for (path, body, param, says) in [
        (
            "/v1/completions",
            json!({"prompt": [1], "n": 5}),
            "n",
            "`n` is 5, over the limit of 4 (--max-n)".to_owned(),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": m, "n": 5}),
            "n",
            "over the limit of 4 (--max-n)".to_owned(),
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "max_tokens": 2049}),
            "max_tokens",
            format!("`max_tokens` is 2049, over the limit of 2048 tokens {source}"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": m, "max_completion_tokens": 2049}),
            "max_completion_tokens",
            format!("over the limit of 2048 tokens {source}"),
        ),
        (
            "/v1/completions",
            json!({"prompt": vec![7u32; 2049]}),
            "prompt",
            format!("limit of 2048 tokens {source}"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "hello ".repeat(2100)}),
            "prompt",
            format!("the prompt is longer than the limit of 2048 tokens {source}"),
        ),
    ] {
        let (status, error) = post(path, body).await;
        assert_eq!(status, 400, "{path}: {error}");
        assert_eq!(error["error"]["param"], param, "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(&says), "{message}");
    }
    // At the limits: forwarded (the sim-worker generates one choice per
    // request: its own 400 shows the router let n = 4 through).
    let (status, answer) = post("/v1/completions", json!({"prompt": [7], "n": 4})).await;
    assert_eq!(status, 400, "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.contains("one choice per request"), "{message}");
    let (status, answer) = post(
        "/v1/completions",
        json!({"prompt": vec![7u32; 2000], "max_tokens": 48}),
    )
    .await;
    assert_eq!(status, 200, "{answer}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counts_as_floats_or_strings_are_held_to_their_limits_and_never_reach_the_worker() {
    let _machine = machine().await;
    let worker = sim_worker_with(0, &["--speedup", "0", "--num-blocks", "1024"]);
    let router = router(
        &[worker.named("w0")],
        &["--max-n", "16", "--max-output-tokens", "4096"],
    );
    let client = reqwest::Client::new();
    ready(&client, &router.base).await;
    let m = json!([{"role": "user", "content": "hi"}]);
    for (path, body, param, says) in [
        (
            "/v1/completions",
            json!({"prompt": [1], "n": 64.0}),
            "n",
            "`n` is 64, over the limit of 16 (--max-n)",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "n": "64"}),
            "n",
            "`n` is 64, over the limit of 16",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": m, "n": 64.0}),
            "n",
            "`n` is 64",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "best_of": "64"}),
            "best_of",
            "`best_of` is 64",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "max_tokens": 1e8}),
            "max_tokens",
            "`max_tokens` is 100000000, over the limit of 4096 tokens (--max-output-tokens)",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "max_tokens": "100000000"}),
            "max_tokens",
            "`max_tokens` is 100000000",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": m, "max_completion_tokens": 1e8}),
            "max_completion_tokens",
            "`max_completion_tokens` is 100000000",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": m, "max_tokens": "100000000"}),
            "max_tokens",
            "`max_tokens` is 100000000",
        ),
        (
            "/v1/completions",
            json!({"prompt": [1], "n": 1.5}),
            "n",
            "`n` must be an integer",
        ),
    ] {
        let response = client
            .post(format!("{}{path}", router.base))
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = response.status().as_u16();
        let reached = response.headers().get("x-switchyard-worker").cloned();
        let error: serde_json::Value = response.json().await.unwrap();
        assert_eq!(status, 400, "{body}: {error}");
        assert_eq!(reached, None, "{body} reached a worker");
        assert_eq!(error["error"]["param"], param, "{error}");
        let message = error["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
    }
    // The worker never saw one of them: it admitted no prompt token yet.
    let worker_metrics = client
        .get(format!("{}/metrics", worker.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert_eq!(
        metric(&worker_metrics, "switchyard_engine_prompt_tokens_total"),
        Some(0.0)
    );
    let metrics = client
        .get(format!("{}/metrics", router.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for (limit, count) in [("n", 4.0), ("output_tokens", 4.0)] {
        let series = format!("switchyard_input_limit_refusals_total{{limit=\"{limit}\"}}");
        assert_eq!(metric(&metrics, &series), Some(count), "{series}");
    }
    // Within the limits, the same forms are served (the body forwarded as
    // sent; the sim-worker reads counts as the engines do).
    let ok = client
        .post(format!("{}/v1/completions", router.base))
        .json(&json!({"prompt": [1, 2, 3], "max_tokens": "2", "n": 1.0}))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status().as_u16(), 200);
    assert!(ok.headers().contains_key("x-switchyard-worker"));
    let answer: serde_json::Value = ok.json().await.unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 2, "{answer}");
}
