//! Tenant boundaries, tried as an attacker with two client keys would
//! (A and B, each a tenant), through a real router over loopback: B
//! cannot read, chain or cancel A's stored responses (the same 404 as an
//! id never seen), cannot plant an id of its own choosing nor move one of
//! A's, cannot evict A's entries by flooding its own, pays for its tools
//! as for message text, and cannot raise its engine-side priority past
//! its band. Beside `serve_boundaries_budget` (what a key may cost the
//! router and learn from it) and `serve_security` (the front door).
//!
//! What only a worker sees (the body it is sent, the requests that reach
//! it) is read off a logging fake worker in this file; the rest runs in
//! front of sim-workers. Every wait polls with a generous deadline.

use crate::support::{
    machine, metric, metrics_text, read_request, reply, router, scratch_file, sim_worker_with,
    wait_ready, NOT_FOUND,
};
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use tokio::io::AsyncWriteExt as _;
use tokio::net::TcpListener;

/// What the fake worker was asked: method, path and body.
type Log = Arc<Mutex<Vec<(String, String, String)>>>;

/// The id the fake worker gives every response it stores (a worker that
/// repeats an id: the router must not let it move between keys).
const FIXED_ID: &str = "resp_fixed";

/// A worker serving `switchyard-sim` that logs every request and stores
/// every response under [`FIXED_ID`]. Returns its base URL and its log.
async fn logging_worker() -> (String, Log) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let log = Log::default();
    let seen = log.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let seen = seen.clone();
            tokio::spawn(async move {
                let Some((method, path, body)) = read_request(&mut socket).await else {
                    return;
                };
                let response = json!({
                    "id": FIXED_ID, "object": "response", "status": "completed", "model": "switchyard-sim",
                    "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}],
                    "usage": {"input_tokens": 5, "output_tokens": 1, "total_tokens": 6},
                });
                let chat = json!({
                    "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "switchyard-sim",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
                });
                let out = match (method.as_str(), path.as_str()) {
                    ("get", "/health" | "/get_server_info") => reply("{}"),
                    ("get", "/v1/models") => {
                        reply(r#"{"object":"list","data":[{"id":"switchyard-sim"}]}"#)
                    }
                    (_, p) if p.starts_with("/v1/responses") => {
                        seen.lock().unwrap().push((method, path, body));
                        reply(&response.to_string())
                    }
                    ("post", "/v1/chat/completions") => {
                        seen.lock().unwrap().push((method, path, body));
                        reply(&chat.to_string())
                    }
                    _ => NOT_FOUND.to_owned(),
                };
                let _ = socket.write_all(out.as_bytes()).await;
            });
        }
    });
    (base, log)
}

/// Keys A and B; B's tenant is in the sheddable band, which maps to an
/// engine priority, the standard band (A's) to none.
const FAKE_CONFIG: &[u8] = br#"
[[rate_limits.keys]]
name = "a"
key = "sk-a"

[[rate_limits.keys]]
name = "b"
key = "sk-b"

[flow]
default_band = "standard"

[[flow.bands]]
name = "critical"
engine_priority = -10

[[flow.bands]]
name = "standard"

[[flow.bands]]
name = "sheddable"
sheddable = true
engine_priority = 10

[[flow.tenants]]
name = "b"
band = "sheddable"
"#;

fn post(
    client: &reqwest::Client,
    base: &str,
    key: &str,
    path: &str,
    body: Value,
) -> reqwest::RequestBuilder {
    client
        .post(format!("{base}{path}"))
        .bearer_auth(key)
        .json(&body)
}

/// A request's status and body text.
async fn answer(request: reqwest::RequestBuilder) -> (u16, String) {
    let response = request.send().await.unwrap();
    let status = response.status().as_u16();
    (status, response.text().await.unwrap())
}

/// The error message of a 404 with the id it names replaced, so two
/// refusals can be compared for what they tell apart.
async fn not_found_message(response: reqwest::Response, id: &str) -> String {
    assert_eq!(response.status(), 404);
    let body: Value = response.json().await.unwrap();
    body["error"]["message"].as_str().unwrap().replace(id, "ID")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_keys_stored_response_does_not_exist_and_its_id_cannot_be_moved() {
    let _machine = machine().await;
    let (fake, log) = logging_worker().await;
    let config = scratch_file("boundaries_fake.toml", FAKE_CONFIG);
    let router = router(
        &[format!("{fake},name=f")],
        &["--config", config.to_str().unwrap()],
    );
    let client = reqwest::Client::new();
    let base = router.base.clone();
    wait_ready(&client, &base).await;
    let requests = || log.lock().unwrap().len();

    // A stores a response, choosing its id and an engine priority: the
    // worker is told neither.
    let stored = post(&client, &base, "sk-a", "/v1/responses", json!({
        "model": "switchyard-sim", "input": "hi", "request_id": "resp_of_my_choosing", "priority": -100,
    }))
    .send()
    .await
    .unwrap();
    assert_eq!(stored.status(), 200);
    let (_, _, sent) = log.lock().unwrap().last().cloned().unwrap();
    let sent: Value = serde_json::from_str(&sent).unwrap();
    assert_eq!(sent.get("request_id"), None, "{sent}");
    assert_eq!(
        sent.get("priority"),
        None,
        "A's band maps no priority: {sent}"
    );
    assert_eq!(sent["input"], "hi");

    // B's body priority is replaced by its band's.
    let chat = post(&client, &base, "sk-b", "/v1/chat/completions", json!({
        "model": "switchyard-sim", "messages": [{"role": "user", "content": "hi"}], "priority": -100,
    }))
    .send()
    .await
    .unwrap();
    assert_eq!(chat.status(), 200);
    let (_, _, sent) = log.lock().unwrap().last().cloned().unwrap();
    let sent: Value = serde_json::from_str(&sent).unwrap();
    assert_eq!(sent["priority"], 10, "{sent}");

    // For B, A's response does not exist: GET, cancel and a chain are the
    // 404 of an id never seen, and nothing reaches the worker.
    let before = requests();
    let unknown = "resp_never_seen";
    let baseline = not_found_message(
        client
            .get(format!("{base}/v1/responses/{unknown}"))
            .bearer_auth("sk-b")
            .send()
            .await
            .unwrap(),
        unknown,
    )
    .await;
    let get = client
        .get(format!("{base}/v1/responses/{FIXED_ID}"))
        .bearer_auth("sk-b")
        .send()
        .await
        .unwrap();
    assert_eq!(
        not_found_message(get, FIXED_ID).await,
        baseline,
        "no oracle"
    );
    let cancel = client
        .post(format!("{base}/v1/responses/{FIXED_ID}/cancel"))
        .bearer_auth("sk-b")
        .send()
        .await
        .unwrap();
    assert_eq!(cancel.status(), 404);
    let chained = post(
        &client,
        &base,
        "sk-b",
        "/v1/responses",
        json!({
            "model": "switchyard-sim", "input": "and then?", "previous_response_id": FIXED_ID,
        }),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(chained.status(), 404);
    assert_eq!(requests(), before, "B's lookups reached no worker");

    // B's own response comes back under A's id: it is answered, not
    // recorded; the id stays A's.
    let planted = post(
        &client,
        &base,
        "sk-b",
        "/v1/responses",
        json!({"model": "switchyard-sim", "input": "x"}),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(planted.status(), 200);
    let get = client
        .get(format!("{base}/v1/responses/{FIXED_ID}"))
        .bearer_auth("sk-b")
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 404, "still not B's");
    let get = client
        .get(format!("{base}/v1/responses/{FIXED_ID}"))
        .bearer_auth("sk-a")
        .send()
        .await
        .unwrap();
    assert_eq!(get.status(), 200, "still A's");
    let (method, path, _) = log.lock().unwrap().last().cloned().unwrap();
    assert_eq!(
        (method.as_str(), path.as_str()),
        ("get", "/v1/responses/resp_fixed")
    );
    let metrics = metrics_text(&client, &base).await;
    assert_eq!(
        metric(
            &metrics,
            r#"switchyard_response_map_drops_total{reason="taken"}"#
        ),
        Some(1.0),
        "{metrics}"
    );
}

/// Keys A and B; B may send 2,000 tokens a minute.
const SIM_CONFIG: &[u8] = br#"
[[rate_limits.keys]]
name = "a"
key = "sk-a"

[[rate_limits.keys]]
name = "b"
key = "sk-b"
tokens_per_minute = 2000
"#;

/// About `tokens` tokens of text (one bundled-tokenizer token a word).
fn words(tokens: usize) -> String {
    " alpha".repeat(tokens)
}

/// One request of each API whose `tools` carry `text` (as a tool's
/// description) and whose message is short; or, with `in_message`, the
/// same text as the message and no tools.
fn bodies(text: &str, in_message: bool) -> Vec<(&'static str, Value)> {
    let schema = json!({"type": "object", "properties": {"q": {"type": "string"}}});
    let message = if in_message { text } else { "Look it up." };
    let mut chat = json!({"model": "switchyard-sim", "max_tokens": 4,
        "messages": [{"role": "user", "content": message}]});
    let mut messages = json!({"model": "switchyard-sim", "max_tokens": 4,
        "messages": [{"role": "user", "content": message}]});
    let mut responses =
        json!({"model": "switchyard-sim", "max_output_tokens": 4, "input": message});
    if !in_message {
        chat["tools"] = json!([{"type": "function", "function": {"name": "lookup", "description": text, "parameters": schema}}]);
        messages["tools"] =
            json!([{"name": "lookup", "description": text, "input_schema": schema}]);
        responses["tools"] = json!([{"type": "function", "name": "lookup", "description": text, "parameters": schema}]);
    }
    vec![
        ("/v1/chat/completions", chat),
        ("/v1/messages", messages),
        ("/v1/responses", responses),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_pays_for_its_tools_and_evicts_only_its_own_stored_responses() {
    let _machine = machine().await;
    let worker = sim_worker_with(0, &["--num-blocks", "4096", "--no-delay"]);
    let config = scratch_file("boundaries_sim.toml", SIM_CONFIG);
    let router = router(
        &[worker.named("w0")],
        &[
            "--config",
            config.to_str().unwrap(),
            "--max-stored-responses-per-key",
            "3",
            "--max-prompt-tokens",
            "32768",
        ],
    );
    let client = reqwest::Client::new();
    let base = router.base.clone();
    wait_ready(&client, &base).await;

    // ~3,500 tokens under a 2,000-token minute: refused as message text
    // and as a tool's description alike, on every API; A, with no limit,
    // is served the tool form (the tools are no error of their own).
    let long = words(3_500);
    for in_message in [true, false] {
        for (path, body) in bodies(&long, in_message) {
            let (status, text) = answer(post(&client, &base, "sk-b", path, body)).await;
            assert_eq!(status, 429, "{path} (in the message: {in_message}): {text}");
            assert!(text.contains("2000 tokens per minute"), "{path}: {text}");
        }
    }
    for (path, body) in bodies(&long, false) {
        let (status, text) = answer(post(&client, &base, "sk-a", path, body)).await;
        assert_eq!(status, 200, "{path}: {text}");
    }
    // 216 KB of tools are past the 32,768-token prompt limit.
    let huge = words(216 * 1024 / 6);
    for (path, body) in bodies(&huge, false) {
        let (status, text) = answer(post(&client, &base, "sk-a", path, body)).await;
        assert_eq!(status, 400, "{path}: {text}");
        assert!(text.contains("limit of 32768 tokens"), "{path}: {text}");
    }

    // A stores one response; B stores eight with a cap of three a key:
    // B forgets its own oldest, A's stays readable and chainable.
    let store = |key: &'static str, input: String| {
        let request = post(
            &client,
            &base,
            key,
            "/v1/responses",
            json!({"model": "switchyard-sim", "input": input, "max_output_tokens": 4}),
        );
        async move {
            let response = request.send().await.unwrap();
            assert_eq!(response.status(), 200);
            let body: Value = response.json().await.unwrap();
            body["id"].as_str().unwrap().to_owned()
        }
    };
    let a_id = store("sk-a", "A's first turn".into()).await;
    let mut b_ids = Vec::new();
    for i in 0..8 {
        b_ids.push(store("sk-b", format!("B's turn {i}")).await);
    }
    let status = |key: &'static str, id: String| {
        let request = client
            .get(format!("{base}/v1/responses/{id}"))
            .bearer_auth(key);
        async move { request.send().await.unwrap().status() }
    };
    assert_eq!(status("sk-a", a_id.clone()).await, 200);
    assert_eq!(
        status("sk-b", b_ids[0].clone()).await,
        404,
        "B's oldest went"
    );
    assert_eq!(status("sk-b", b_ids[7].clone()).await, 200);
    let chained = post(&client, &base, "sk-a", "/v1/responses", json!({
        "model": "switchyard-sim", "input": "A's second turn", "previous_response_id": a_id, "max_output_tokens": 4,
    }))
    .send()
    .await
    .unwrap();
    assert_eq!(chained.status(), 200);
    let metrics = metrics_text(&client, &base).await;
    assert_eq!(
        metric(
            &metrics,
            r#"switchyard_response_map_drops_total{reason="key_capacity"}"#
        ),
        Some(5.0),
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            r#"switchyard_response_map_drops_total{reason="capacity"}"#
        ),
        Some(0.0)
    );
}
