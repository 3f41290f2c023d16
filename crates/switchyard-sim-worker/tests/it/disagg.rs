//! `--disagg vllm|sglang` end to end: a prefill and a decode sim-worker
//! in-process on ephemeral loopback ports, driven as vLLM's toy proxy and
//! SGLang's PD router drive theirs (the golden bodies in
//! `tests/fixtures/disagg`), and the failures a router must see.

use crate::support::{metric, serve_worker, Worker};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// A sim-worker with `flags`, its SGLang bootstrap server (when it serves
/// one) on a free port.
async fn worker(flags: &[&str]) -> Worker {
    serve_worker(&[&["--bootstrap-port", "0"], flags].concat()).await
}

/// An SGLang worker in `role` (`prefill` or `decode`), with `flags`.
async fn sglang_worker(role: &str, flags: &[&str]) -> Worker {
    worker(&[&["--disagg", "sglang", "--disagg-role", role], flags].concat()).await
}

fn fixture(name: &str) -> Value {
    let path = format!(
        "{}/tests/fixtures/disagg/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap()
}

/// vLLM's toy proxy: the prefill request for a client's body (the
/// router's, `switchyard_wire::disagg`; its own test checks it against
/// the fixture written from vLLM's proxy).
fn proxy_prefill_body(client: &Value) -> Value {
    let client = serde_json::to_vec(client).unwrap();
    let body = switchyard_wire::disagg::vllm_prefill_body(&client).unwrap();
    serde_json::from_slice(&body).unwrap()
}

/// vLLM's toy proxy: the decode request, from the client's body and the
/// prefill answer.
fn proxy_decode_body(client: &Value, prefill_answer: &Value) -> Value {
    let mut body = client.clone();
    if let Some(params) = prefill_answer
        .get("kv_transfer_params")
        .filter(|p| !p.is_null())
    {
        body["kv_transfer_params"] = params.clone();
    }
    body
}

/// Polls until `series` reads `want` (a generous deadline for a loaded
/// machine).
async fn wait_metric(base: &str, series: &str, want: f64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let got = metric(base, series).await;
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{series} at {base} is {got}, want {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Asserts that `series` at `base` reads `want`, allowing for the driver
/// copying the engine's counters into `/metrics` at the end of the step
/// whose tokens may have reached the client first (a loaded machine lets a
/// scrape in between).
async fn assert_metric(base: &str, series: &str, want: f64) {
    wait_metric(base, series, want).await;
}

/// Asserts that the prefill worker at `base` has captured KV once and
/// holds that one lease.
async fn assert_captured_once_and_held(base: &str) {
    assert_metric(base, "switchyard_engine_leases_held", 1.0).await;
    assert_metric(base, "switchyard_engine_disagg_captures_total", 1.0).await;
}

/// Asserts that the worker at `base` has counted `want` transfer failures
/// for `reason`.
async fn assert_failures(base: &str, reason: &str, want: f64) {
    let series = format!("switchyard_engine_disagg_failures_total{{reason=\"{reason}\"}}");
    assert_metric(base, &series, want).await;
}

/// Waits until the prefill worker at `base` holds no lease, then asserts
/// that it has released `released` in all.
async fn assert_every_lease_released(base: &str, released: f64) {
    wait_metric(base, "switchyard_engine_leases_held", 0.0).await;
    assert_metric(
        base,
        "switchyard_engine_leases_total{event=\"released\"}",
        released,
    )
    .await;
}

fn post(url: String, body: &Value) -> reqwest::RequestBuilder {
    reqwest::Client::new().post(url).json(body)
}

/// A `/v1/completions` request of `body` to the worker at `base`.
fn completions(base: &str, body: &Value) -> reqwest::RequestBuilder {
    post(format!("{base}/v1/completions"), body)
}

/// A `/v1/chat/completions` request of `body` to the worker at `base`.
fn chat_completions(base: &str, body: &Value) -> reqwest::RequestBuilder {
    post(format!("{base}/v1/chat/completions"), body)
}

/// vLLM's toy proxy: the decode request to the worker at `base`, for the
/// client's body and the prefill answer.
fn proxy_decode(base: &str, client: &Value, prefill_answer: &Value) -> reqwest::RequestBuilder {
    completions(base, &proxy_decode_body(client, prefill_answer))
}

/// Asserts that the decode worker at `base` has pulled KV `transfers`
/// times, `bytes` bytes in all.
async fn assert_transferred(base: &str, transfers: f64, bytes: f64) {
    assert_metric(base, "switchyard_engine_disagg_transfers_total", transfers).await;
    assert_metric(base, "switchyard_engine_disagg_transfer_bytes_total", bytes).await;
}

/// `request`'s answer, a JSON body.
async fn json_answer(request: reqwest::RequestBuilder) -> Value {
    request.send().await.unwrap().json().await.unwrap()
}

/// A streamed answer: its text pieces' count and its usage chunk.
async fn read_stream(response: reqwest::Response) -> (usize, Value) {
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    let mut pieces = 0;
    let mut usage = Value::Null;
    for data in text.lines().filter_map(|l| l.strip_prefix("data: ")) {
        if data == "[DONE]" {
            continue;
        }
        let chunk: Value = serde_json::from_str(data).unwrap();
        assert!(chunk.get("error").is_none(), "{chunk}");
        if let Some(choice) = chunk["choices"].as_array().and_then(|c| c.first()) {
            let piece = choice["text"]
                .as_str()
                .or(choice["delta"]["content"].as_str());
            if piece.is_some_and(|p| !p.is_empty()) {
                pieces += 1;
            }
        }
        if chunk["usage"].is_object() {
            usage = chunk["usage"].clone();
        }
    }
    (pieces, usage)
}

/// SGLang's request (the fixture, streamed) naming `prefill`'s bootstrap
/// port; its room is the caller's.
fn sglang_request_to(prefill: &Worker) -> Value {
    let bootstrap = prefill
        .bootstrap
        .expect("the prefill serves a bootstrap port");
    let mut body = fixture("sglang_request");
    body["bootstrap_port"] = json!(bootstrap.port());
    body
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_u64() => "unsigned",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// The proxy's transformations reproduce the golden bodies.
#[test]
fn the_proxy_sequence_reproduces_the_golden_vllm_bodies() {
    let client = fixture("vllm_client_request");
    assert_eq!(proxy_prefill_body(&client), fixture("vllm_prefill_request"));
    assert_eq!(
        proxy_decode_body(&client, &fixture("vllm_prefill_response")),
        fixture("vllm_decode_request")
    );
}

/// vLLM's sequence: prefill (one token, `kv_transfer_params` in the
/// answer), then the decode streams from the transferred KV; the prefill's
/// lease is released once the decode has restored it.
#[tokio::test]
async fn vllm_prefill_then_streamed_decode_restores_the_transferred_kv() {
    let prefill = worker(&["--disagg", "vllm"]).await;
    let decode = worker(&["--disagg", "vllm"]).await;
    let client = fixture("vllm_client_request");

    let response = completions(&prefill.base, &proxy_prefill_body(&client))
        .header("X-Request-Id", "req-0001")
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["usage"]["completion_tokens"], 1);
    let prompt_tokens = answer["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens >= 64, "a prompt of several blocks");

    // The answer's kv_transfer_params: the golden keys, types, constants.
    let params = &answer["kv_transfer_params"];
    let golden = &fixture("vllm_prefill_response")["kv_transfer_params"];
    let keys = |v: &Value| {
        let mut k: Vec<(String, &str)> = v
            .as_object()
            .unwrap()
            .iter()
            .map(|(k, v)| (k.clone(), json_type(v)))
            .collect();
        k.sort();
        k
    };
    assert_eq!(keys(params), keys(golden));
    for constant in [
        "do_remote_prefill",
        "do_remote_decode",
        "tp_size",
        "remote_host",
    ] {
        assert_eq!(params[constant], golden[constant], "{constant}");
    }
    assert_eq!(params["remote_port"], prefill.port);
    assert_eq!(params["remote_request_id"], "req-0001");
    let blocks = params["remote_block_ids"].as_array().unwrap().len() as u64;
    assert_eq!(blocks, prompt_tokens / 16);
    let transferred_bytes = (blocks * 16 * 128 * 1024) as f64;
    assert_captured_once_and_held(&prefill.base).await;

    // The decode: the client's body (streamed, with usage) and the params.
    let response = proxy_decode(&decode.base, &client, &answer)
        .header("X-Request-Id", "req-0001")
        .send()
        .await
        .unwrap();
    let (pieces, usage) = read_stream(response).await;
    assert_eq!(pieces, 24);
    assert_eq!(usage["completion_tokens"], 24);
    assert_eq!(usage["prompt_tokens"], prompt_tokens);
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, blocks * 16, "the prompt's blocks came by transfer");
    let d = &decode.base;
    assert_metric(
        d,
        "switchyard_engine_restores_total{decision=\"restored\"}",
        1.0,
    )
    .await;
    assert_transferred(d, 1.0, transferred_bytes).await;
    assert_every_lease_released(&prefill.base, 1.0).await;
    assert_metric(
        &prefill.base,
        "switchyard_engine_disagg_pulls_served_total",
        1.0,
    )
    .await;

    // The same prompt again: the decode worker caches it now, so the
    // transfer moves nothing (the lease is still pulled and released).
    let again = prefill_at(&prefill.base, &client).await;
    let response = proxy_decode(&decode.base, &client, &again)
        .send()
        .await
        .unwrap();
    let (pieces, usage) = read_stream(response).await;
    assert_eq!(
        (pieces, usage["completion_tokens"].as_u64()),
        (24, Some(24))
    );
    assert_transferred(d, 2.0, transferred_bytes).await;
    assert_every_lease_released(&prefill.base, 2.0).await;

    // Presenting a released lease again is refused: it was used once.
    let response = proxy_decode(&decode.base, &client, &answer)
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 404);
}

/// SGLang's sequence: the same body to the prefill and the decode worker;
/// the decode, sent first, waits for the room (the engine's
/// `RequestStateNotReady`) and streams once the KV has arrived.
#[tokio::test]
async fn sglang_decode_waits_for_the_room_and_streams_from_its_kv() {
    let prefill = sglang_worker("prefill", &[]).await;
    let decode = sglang_worker("decode", &[]).await;
    let mut body = sglang_request_to(&prefill);
    body["bootstrap_room"] = json!(rand_room());

    let decoding = tokio::spawn(chat_completions(&decode.base, &body).send());
    // What the test specifies: the decode is there before the prefill.
    wait_metric(
        &decode.base,
        "switchyard_engine_restores_total{decision=\"request_state_not_ready\"}",
        1.0,
    )
    .await;
    let prefill_answer = chat_completions(&prefill.base, &body).send().await.unwrap();
    // The router discards it; it is a well-formed stream of one token.
    let (prefill_pieces, _) = read_stream(prefill_answer).await;
    assert_eq!(prefill_pieces, 1);

    let (pieces, usage) = read_stream(decoding.await.unwrap().unwrap()).await;
    assert_eq!(pieces, 16);
    assert_eq!(usage["completion_tokens"], 16);
    let prompt_tokens = usage["prompt_tokens"].as_u64().unwrap();
    let cached = usage["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert_eq!(cached, prompt_tokens / 16 * 16);
    assert_metric(
        &decode.base,
        "switchyard_engine_restores_total{decision=\"restored\"}",
        1.0,
    )
    .await;
    assert_every_lease_released(&prefill.base, 1.0).await;

    // Both at once, as the router sends them.
    body["bootstrap_room"] = json!(rand_room());
    let (p, d) = tokio::join!(
        chat_completions(&prefill.base, &body).send(),
        chat_completions(&decode.base, &body).send(),
    );
    read_stream(p.unwrap()).await;
    let (pieces, _) = read_stream(d.unwrap()).await;
    assert_eq!(pieces, 16);
    assert_every_lease_released(&prefill.base, 2.0).await;
}

/// vLLM's prefill request for `client` at `base`, answered.
async fn prefill_at(base: &str, client: &Value) -> Value {
    let response = completions(base, &proxy_prefill_body(client))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    response.json().await.unwrap()
}

fn rand_room() -> u64 {
    // Distinct per call and below 2^63, as a router's random room.
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    (n.wrapping_mul(0x9e37_79b9_7f4a_7c15)) >> 1
}

/// A wrong token, an expired lease, a prefill worker gone, malformed
/// parameters and a room nobody holds: each a clear HTTP error and a
/// counted failure, and nothing left waiting in the decode engine.
#[tokio::test]
async fn transfer_failures_are_answered_and_counted() {
    let prefill = worker(&["--disagg", "vllm"]).await;
    // Its leases expire while the test watches.
    let short_lived = worker(&["--disagg", "vllm", "--lease-ttl-ms", "300"]).await;
    let decode = worker(&["--disagg", "vllm"]).await;
    let client = fixture("vllm_client_request");
    let decode_with = |answer: Value| {
        let request = proxy_decode(&decode.base, &client, &answer);
        async move { request.send().await.unwrap() }
    };
    let error_of = |response: reqwest::Response| async move {
        let status = response.status().as_u16();
        let body: Value = response.json().await.unwrap();
        assert!(body["error"]["message"].is_string(), "{body}");
        (status, body)
    };

    // A wrong token: refused like an unknown lease, the lease untouched.
    let answer = prefill_at(&prefill.base, &client).await;
    let mut forged = answer.clone();
    let lease = answer["kv_transfer_params"]["switchyard_lease"]
        .as_str()
        .unwrap();
    let (id, token) = lease.split_once('.').unwrap();
    let flipped = if token.starts_with('0') { "1" } else { "0" };
    forged["kv_transfer_params"]["switchyard_lease"] =
        json!(format!("{id}.{flipped}{}", &token[1..]));
    let (status, _) = error_of(decode_with(forged).await).await;
    assert_eq!(status, 404);
    assert_metric(
        &prefill.base,
        "switchyard_engine_disagg_pulls_unknown_total",
        1.0,
    )
    .await;
    assert_failures(&decode.base, "unknown_lease", 1.0).await;
    assert_metric(&prefill.base, "switchyard_engine_leases_held", 1.0).await;

    // A lease expires unreleased; presenting it then is a 404.
    let expiring = prefill_at(&short_lived.base, &client).await;
    wait_metric(
        &short_lived.base,
        "switchyard_engine_leases_total{event=\"expired\"}",
        1.0,
    )
    .await;
    assert_metric(&short_lived.base, "switchyard_engine_leases_held", 0.0).await;
    let (status, _) = error_of(decode_with(expiring).await).await;
    assert_eq!(status, 404);

    // Malformed parameters: a 400 naming the field, before any pull.
    let mut malformed = answer.clone();
    malformed["kv_transfer_params"]["remote_port"] = json!(70_000);
    let (status, body) = error_of(decode_with(malformed).await).await;
    assert_eq!(status, 400);
    assert_eq!(body["error"]["param"], "kv_transfer_params");
    assert_failures(&decode.base, "invalid_params", 1.0).await;

    // The prefill worker gone: a port nobody listens on.
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let mut gone = prefill_at(&prefill.base, &client).await;
    gone["kv_transfer_params"]["remote_port"] = json!(closed);
    let (status, _) = error_of(decode_with(gone).await).await;
    assert_eq!(status, 502);
    assert_failures(&decode.base, "unreachable", 1.0).await;

    // A decode presenting a lease on another prompt's KV: the engine's
    // validation cancels it (never a silent recompute), and the lease is
    // still released.
    let released = metric(
        &prefill.base,
        "switchyard_engine_leases_total{event=\"released\"}",
    )
    .await;
    let mut other = proxy_decode_body(&client, &prefill_at(&prefill.base, &client).await);
    other["prompt"] = json!(format!(
        "Another prompt entirely. {}",
        client["prompt"].as_str().unwrap()
    ));
    let response = completions(&decode.base, &other).send().await.unwrap();
    assert_eq!(error_of(response).await.0, 502);
    assert_metric(
        &decode.base,
        "switchyard_engine_restores_total{decision=\"failed\"}",
        1.0,
    )
    .await;
    wait_metric(
        &prefill.base,
        "switchyard_engine_leases_total{event=\"released\"}",
        released + 1.0,
    )
    .await;

    // A prompt shorter than a block captures nothing: null parameters, and
    // the decode worker computes the prompt itself.
    let mut short = proxy_prefill_body(&client);
    short["prompt"] = json!("Hi");
    let answer = json_answer(completions(&prefill.base, &short)).await;
    assert_eq!(answer["kv_transfer_params"], Value::Null, "{answer}");
    assert_failures(&prefill.base, "nothing_cached", 1.0).await;

    // A streamed prefill for vLLM is refused: its answer carries the params.
    let mut streamed = proxy_prefill_body(&client);
    streamed["stream"] = json!(true);
    let response = completions(&prefill.base, &streamed).send().await.unwrap();
    assert_eq!(error_of(response).await.0, 400);

    // Nothing waits in the decode engine for a transfer that failed.
    wait_metric(&decode.base, "switchyard_engine_waiting", 0.0).await;
    wait_metric(&decode.base, "switchyard_engine_running", 0.0).await;
}

/// A prefill worker holds each room once and at most `--max-rooms` of
/// them; a refused capture is counted, and the request still answered
/// (SGLang's router discards the prefill's answer; its decode times out).
#[tokio::test]
async fn sglang_rooms_are_bounded_and_held_once() {
    let prefill = sglang_worker("prefill", &["--max-rooms", "1"]).await;
    let mut body = sglang_request_to(&prefill);
    body["stream"] = json!(false);
    let room = rand_room();
    for (room, reason) in [
        (room, None),
        (room, Some("room_conflict")),
        (rand_room(), Some("rooms_full")),
    ] {
        body["bootstrap_room"] = json!(room);
        let response = chat_completions(&prefill.base, &body).send().await.unwrap();
        assert_eq!(response.status(), 200);
        if let Some(reason) = reason {
            assert_failures(&prefill.base, reason, 1.0).await;
        }
    }
    assert_captured_once_and_held(&prefill.base).await;
}

/// An SGLang decode whose room never fills times out with a 504.
#[tokio::test]
async fn an_sglang_room_nobody_fills_times_out() {
    let prefill = sglang_worker("prefill", &[]).await;
    let decode = sglang_worker("decode", &["--bootstrap-timeout-ms", "300"]).await;
    let mut body = sglang_request_to(&prefill);
    body["stream"] = json!(false);
    body["bootstrap_room"] = json!(rand_room());
    let response = chat_completions(&decode.base, &body).send().await.unwrap();
    assert_eq!(response.status(), 504);
    assert_failures(&decode.base, "timeout", 1.0).await;
    wait_metric(&decode.base, "switchyard_engine_waiting", 0.0).await;
}

/// With `--api-key`, the internal endpoints need the key like every other
/// route, and workers sharing it pull from each other.
#[tokio::test]
async fn with_an_api_key_the_pull_needs_it_and_peers_send_it() {
    let keyed = ["--disagg", "vllm", "--api-key", "fleet-key"];
    let prefill = worker(&keyed).await;
    let decode = worker(&keyed).await;
    let client = fixture("vllm_client_request");
    let answer = json_answer(
        completions(&prefill.base, &proxy_prefill_body(&client)).bearer_auth("fleet-key"),
    )
    .await;
    let lease = answer["kv_transfer_params"]["switchyard_lease"].clone();
    let unkeyed = post(
        format!("{}/internal/kv/pull", prefill.base),
        &json!({ "lease": lease }),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(unkeyed.status(), 401);
    let response = proxy_decode(&decode.base, &client, &answer)
        .bearer_auth("fleet-key")
        .send()
        .await
        .unwrap();
    let (pieces, _) = read_stream(response).await;
    assert_eq!(pieces, 24);
    wait_metric(&prefill.base, "switchyard_engine_leases_held", 0.0).await;
}
