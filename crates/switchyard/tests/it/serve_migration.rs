//! Request lifecycle over real sockets: migration away from a failing
//! worker (before the first token and mid-stream), the request timeout,
//! and client disconnects, checked down to the workers' running counts.
//!
//! The failing workers are small scripted HTTP servers on loopback (a real
//! socket, a scripted reply); the healthy ones are sim-worker processes.

use crate::scripted_worker::{scripted_worker, Script};
use crate::sim_worker_apis::events as named_events;
use crate::support::{
    bundled_tokenizer_dir, machine, metric, metric_sum, metrics_text, poll, router, served_by,
    sim_worker, wait_metrics, Proc, PATIENCE,
};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::time::Duration;

fn sse_events(text: &str) -> Vec<String> {
    text.split("\n\n")
        .filter(|e| !e.trim().is_empty())
        .map(|e| e.strip_prefix("data: ").unwrap_or(e).to_owned())
        .collect()
}

/// A scripted worker named `name` beside a healthy sim-worker named
/// `good`, behind a round-robin router with `extra` flags: (the sim-worker,
/// the router); keep both alive for the test.
async fn beside_a_good_worker(script: Script, name: &str, extra: &[&str]) -> (Proc, Proc) {
    let scripted = scripted_worker(script).await;
    let good = sim_worker("0");
    let mut flags = vec!["--policy", "round-robin"];
    flags.extend_from_slice(extra);
    let router = router(
        &[format!("{scripted},name={name}"), good.named("good")],
        &flags,
    );
    (good, router)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_before_the_first_token_is_retried_elsewhere_transparently() {
    let _machine = machine().await;
    let (_good, router) = beside_a_good_worker(Script::Status500, "bad", &[]).await;
    let client = reqwest::Client::new();
    for stream in [false, true, false, true] {
        let response = client
            .post(format!("{}/v1/completions", router.base))
            .json(&json!({"prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": stream}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-switchyard-worker"], "good");
        let text = response.text().await.unwrap();
        if stream {
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        } else {
            let v: Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["object"], "text_completion");
        }
    }
    let text = metrics_text(&client, &router.base).await;
    assert!(
        metric(&text, "switchyard_migrations_total{reason=\"status_5xx\"}") >= Some(1.0),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streaming_answer_cut_before_its_end_is_retried_whole() {
    let _machine = machine().await;
    let (_good, router) = beside_a_good_worker(Script::CutJson, "cut", &[]).await;
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let response = client
            .post(format!("{}/v1/completions", router.base))
            .json(&json!({"prompt": [1, 2, 3, 4], "max_tokens": 3}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-switchyard-worker"], "good");
        let v: Value = response.json().await.unwrap();
        assert_eq!(v["object"], "text_completion", "{v}");
    }
    let text = metrics_text(&client, &router.base).await;
    assert!(
        metric(&text, "switchyard_migrations_total{reason=\"reset\"}") >= Some(1.0),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_silent_past_the_first_token_timeout_loses_the_stream_to_another() {
    let _machine = machine().await;
    let (_good, router) =
        beside_a_good_worker(Script::Silent, "silent", &["--first-token-timeout", "0.5"]).await;
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let started = std::time::Instant::now();
        let response = client
            .post(format!("{}/v1/completions", router.base))
            .json(&json!({"prompt": [1, 2, 3, 4], "max_tokens": 3, "stream": true}))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        assert_eq!(response.headers()["x-switchyard-worker"], "good");
        let text = response.text().await.unwrap();
        assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
        // Well under the silent worker's hour; loose for a loaded machine.
        assert!(started.elapsed() < Duration::from_secs(20));
    }
    let text = metrics_text(&client, &router.base).await;
    assert!(
        metric(&text, "switchyard_migrations_total{reason=\"timeout\"}") >= Some(1.0),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_stream_cut_mid_way_resumes_on_another_worker_in_its_own_shape() {
    let _machine = machine().await;
    let (_good, router) = beside_a_good_worker(Script::CutChatStream, "cutting", &[]).await;
    let client = reqwest::Client::new();
    // Round-robin: one of the first two requests starts on the cutting worker.
    let mut resumed = None;
    for _ in 0..6 {
        let response = client
            .post(format!("{}/v1/chat/completions", router.base))
            .json(&json!({
                "model": "switchyard-sim",
                "messages": [{"role": "user", "content": "tell me about yards"}],
                "max_tokens": 10,
                "stream": true,
                "stream_options": {"include_usage": true},
            }))
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let worker = response.headers()["x-switchyard-worker"].clone();
        let text = response.text().await.unwrap();
        if worker == "cutting" {
            resumed = Some(text);
            break;
        }
    }
    let text = resumed.expect("a request started on the cutting worker");
    let events = sse_events(&text);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{text}");
    assert_eq!(events.iter().filter(|e| *e == "[DONE]").count(), 1);
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|_| panic!("not JSON: {e}")))
        .collect();
    let mut content = 0;
    let mut finish = None;
    let mut usage = None;
    for c in &chunks {
        assert_eq!(c["id"], "chatcmpl-scripted", "{c}");
        assert_eq!(c["object"], "chat.completion.chunk", "{c}");
        assert_eq!(c["created"], 1234, "{c}");
        if let Some(choice) = c["choices"].get(0) {
            if choice["delta"]["content"]
                .as_str()
                .is_some_and(|s| !s.is_empty())
            {
                content += 1;
            }
            if let Some(f) = choice["finish_reason"].as_str() {
                finish = Some(f.to_owned());
            }
        }
        if c.get("usage").is_some() {
            usage = Some(c["usage"].clone());
        }
    }
    assert_eq!(content, 10, "3 tokens before the cut, 7 after: {text}");
    assert_eq!(finish.as_deref(), Some("length"));
    let usage = usage.expect("the usage chunk survives the rewrite");
    assert_eq!(usage["completion_tokens"], 10, "{usage}");
    let metrics = metrics_text(&client, &router.base).await;
    // Resumed by token ids: the sim-worker's /tokenize agreed with the
    // router's (bundled, not configured) tokenizer.
    assert_eq!(
        metric(
            &metrics,
            "switchyard_model_tokenizer_checked{model=\"default\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "switchyard_migrations_total{reason=\"midstream\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    wait_idle(&client, &router).await;
}

/// The SSE events of the first of a few round-robin chat streams of
/// `content` through `router` that starts on the worker named `cutting`.
async fn a_stream_cut_mid_way(
    client: &reqwest::Client,
    router: &Proc,
    content: &str,
) -> Vec<String> {
    let body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 10, "stream": true});
    sse_events(&cut_on_the_cutting_worker(client, router, "/v1/chat/completions", &body).await)
}

/// The body of the first of a few round-robin streams of `body` at
/// `path` through `router` that starts on the worker named `cutting`.
async fn cut_on_the_cutting_worker(
    client: &reqwest::Client,
    router: &Proc,
    path: &str,
    body: &Value,
) -> String {
    for _ in 0..6 {
        let response = client
            .post(format!("{}{path}", router.base))
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
        let worker = response.headers()["x-switchyard-worker"].clone();
        let text = response.text().await.unwrap();
        if worker == "cutting" {
            return text;
        }
    }
    panic!("no request started on the cutting worker");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_is_resumed_by_token_ids_only_when_they_are_known_to_be_the_engines() {
    let _machine = machine().await;
    let client = reqwest::Client::new();
    let checked = "switchyard_model_tokenizer_checked{model=\"default\"}";
    let midstream = "switchyard_migrations_total{reason=\"midstream\"}";
    // A sim-worker's /tokenize agrees with the bundled tokenizer, so a cut
    // stream is resumed on it (the resume test above). Here the other
    // worker's engine tokenizes the probe differently: the router's ids
    // are not that engine's, and the cut stream ends with an error that
    // says so.
    let cutting = scripted_worker(Script::CutChatStream).await;
    let foreign = scripted_worker(Script::ForeignTokenizer).await;
    let router_of = |extra: &[&str]| {
        let mut flags = vec!["--policy", "round-robin"];
        flags.extend_from_slice(extra);
        router(
            &[
                format!("{cutting},name=cutting"),
                format!("{foreign},name=foreign"),
            ],
            &flags,
        )
    };
    let router = router_of(&[]);
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(metric(&text, checked), Some(-1.0), "{text}");
    let events = a_stream_cut_mid_way(&client, &router, "x").await;
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    let message = last["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("tokenizes differently"),
        "the client learns why: {message}"
    );
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(metric(&text, midstream).unwrap_or(0.0), 0.0, "{text}");
    drop(router);

    // Told the tokenizer, the router takes the operator's word over the
    // probe: the same cut stream is resumed on the other worker.
    let tokenizer = bundled_tokenizer_dir();
    let router = router_of(&["--tokenizer-dir", &tokenizer]);
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(metric(&text, checked), Some(1.0), "{text}");
    let events = a_stream_cut_mid_way(&client, &router, "x").await;
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    assert!(events.iter().any(|e| e.contains(" omega")), "{events:?}");
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(metric(&text, midstream), Some(1.0), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_another_worker_a_cut_stream_ends_with_an_error_event() {
    let _machine = machine().await;
    let cutting = scripted_worker(Script::CutChatStream).await;
    // The tokenizer named, so that only the missing worker stops it.
    let tokenizer = bundled_tokenizer_dir();
    let router = router(
        &[format!("{cutting},name=cutting")],
        &["--tokenizer-dir", &tokenizer],
    );
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{}/v1/chat/completions", router.base))
        .json(&json!({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    let events = sse_events(&text);
    assert!(!events.iter().any(|e| e == "[DONE]"), "{text}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert!(last["error"]["message"].is_string(), "{text}");
    assert_eq!(
        events.len(),
        4,
        "three forwarded chunks, then the error: {text}"
    );
    let metrics = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(&metrics, "switchyard_migrations_exhausted_total"),
        Some(1.0),
        "{metrics}"
    );
    assert_eq!(
        metric_sum(&metrics, "switchyard_migrations_total"),
        0.0,
        "no other worker took it, so no migration happened: {metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_with_several_choices_cut_after_one_finished_ends_with_an_error_event() {
    let _machine = machine().await;
    let cutting = scripted_worker(Script::CutTwoChoiceStream).await;
    let router = router(&[format!("{cutting},name=cutting")], &[]);
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{}/v1/completions", router.base))
        .json(&json!({"prompt": "x", "n": 2, "max_tokens": 10, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    let events = sse_events(&text);
    assert!(
        !events.iter().any(|e| e == "[DONE]"),
        "choice 1 never finished, so the stream is not complete: {text}"
    );
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert!(last["error"]["message"].is_string(), "{text}");
    let metrics = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(
            &metrics,
            "switchyard_requests_total{policy=\"ttft\",status=\"ok\"}"
        )
        .unwrap_or(0.0),
        0.0,
        "{metrics}"
    );
    assert_eq!(
        metric(
            &metrics,
            "switchyard_requests_total{policy=\"ttft\",status=\"unavailable\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_fails_two_workers_with_5xx_is_its_own_fault_and_stops_there() {
    let _machine = machine().await;
    let a = scripted_worker(Script::Status500).await;
    let b = scripted_worker(Script::Status500).await;
    let c = scripted_worker(Script::Status500).await;
    let router = router(
        &[
            format!("{a},name=a"),
            format!("{b},name=b"),
            format!("{c},name=c"),
        ],
        &["--migration-limit", "5"],
    );
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{}/v1/completions", router.base))
        .json(&json!({"prompt": "a prompt that crashes every engine", "max_tokens": 4}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 502);
    let body: Value = response.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("answered 500") && message.contains("request's fault"),
        "the client learns which worker answered what, and why it stopped: {message}"
    );
    let metrics = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(&metrics, "switchyard_upstream_failures_total"),
        Some(1.0),
        "only the first worker is reported; the second failure is the request's: {metrics}"
    );
    assert_eq!(
        metric_sum(&metrics, "switchyard_migrations_total"),
        1.0,
        "one migration, and none to the third worker: {metrics}"
    );
}

/// Router and worker both idle: nothing booked, nothing running.
async fn assert_all_idle(client: &reqwest::Client, router: &str, worker: &str) {
    let (mut r, mut w) = (String::new(), String::new());
    let idle = poll(PATIENCE, async || {
        r = metrics_text(client, router).await;
        w = metrics_text(client, worker).await;
        metric(&r, "switchyard_active_requests") == Some(0.0)
            && metric_sum(&r, "switchyard_worker_active_requests") == 0.0
            && metric(&w, "switchyard_engine_running") == Some(0.0)
            && metric(&w, "switchyard_engine_waiting") == Some(0.0)
    })
    .await;
    assert!(idle.is_some(), "router:\n{r}\nworker:\n{w}");
}

/// Waits until the worker runs a request.
async fn wait_running(client: &reqwest::Client, worker: &str) {
    wait_metrics(client, worker, "the worker to run the request", |text| {
        metric(text, "switchyard_engine_running") >= Some(1.0)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_request_timeout_cancels_the_worker_and_answers_504_or_an_error_event() {
    let _machine = machine().await;
    // About 100 ms a token: 2000 tokens would take minutes.
    let worker = sim_worker("0.05");
    let router = router(&[worker.named("w0")], &["--request-timeout", "1.5"]);
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", router.base);

    let started = std::time::Instant::now();
    let response = client
        .post(&url)
        .json(&json!({"prompt": [1, 2, 3], "max_tokens": 2000}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 504);
    let body: Value = response.json().await.unwrap();
    assert_eq!(body["error"]["type"], "timeout", "{body}");
    // Generating all 2000 tokens would take over 200 s; the bound is loose
    // for a loaded CI machine.
    assert!(started.elapsed() < Duration::from_secs(30));
    assert_all_idle(&client, &router.base, &worker.base).await;

    let response = client
        .post(&url)
        .json(&json!({"prompt": [1, 2, 3], "max_tokens": 2000, "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 200);
    let text = response.text().await.unwrap();
    let events = sse_events(&text);
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    assert_eq!(last["error"]["code"], 504, "{text}");
    assert!(!events.iter().any(|e| e == "[DONE]"));
    assert_all_idle(&client, &router.base, &worker.base).await;
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(&text, "switchyard_request_timeouts_total"),
        Some(2.0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_goes_away_cancels_the_workers_request() {
    let _machine = machine().await;
    let worker = sim_worker("0.05");
    let router = router(&[worker.named("w0")], &[]);
    let client = reqwest::Client::new();
    let url = format!("{}/v1/completions", router.base);

    // Non-streaming: the client gives up while the worker generates.
    let pending = tokio::spawn({
        let client = client.clone();
        let url = url.clone();
        async move {
            client
                .post(&url)
                .json(&json!({"prompt": [1, 2, 3], "max_tokens": 2000}))
                .send()
                .await
        }
    });
    wait_running(&client, &worker.base).await;
    pending.abort();
    assert_all_idle(&client, &router.base, &worker.base).await;

    // Streaming: the client reads one chunk and hangs up.
    let response = client
        .post(&url)
        .json(&json!({"prompt": [4, 5, 6], "max_tokens": 2000, "stream": true}))
        .send()
        .await
        .unwrap();
    let mut body = response.bytes_stream();
    body.next().await.unwrap().unwrap();
    wait_running(&client, &worker.base).await;
    drop(body);
    assert_all_idle(&client, &router.base, &worker.base).await;
    let text = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(
            &text,
            "switchyard_requests_total{policy=\"ttft\",status=\"cancelled\"}"
        ),
        Some(2.0),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_over_the_migration_length_limit_is_not_resumed() {
    let _machine = machine().await;
    let (_good, router) = beside_a_good_worker(
        Script::CutChatStream,
        "cutting",
        &["--migration-max-seq-len", "8"],
    )
    .await;
    let client = reqwest::Client::new();
    let content = "a prompt longer than eight tokens, surely";
    let events = a_stream_cut_mid_way(&client, &router, content).await;
    assert!(!events.iter().any(|e| e == "[DONE]"), "{events:?}");
    let last: Value = serde_json::from_str(events.last().unwrap()).unwrap();
    let message = last["error"]["message"].as_str().unwrap();
    assert!(message.contains("migration limit of 8"), "{message}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_non_streaming_answer_over_the_buffer_limit_gets_a_clear_502() {
    let _machine = machine().await;
    let worker = sim_worker("0");
    let router = router(&[worker.named("w0")], &["--max-response-bytes", "64"]);
    let client = reqwest::Client::new();
    let response = client
        .post(format!("{}/v1/completions", router.base))
        .json(&json!({"prompt": [1, 2, 3], "max_tokens": 40}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), 502);
    let body: Value = response.json().await.unwrap();
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("--max-response-bytes"), "{message}");
    // Streams are not buffered: the same request streams fine.
    let response = client
        .post(format!("{}/v1/completions", router.base))
        .json(&json!({"prompt": [1, 2, 3], "max_tokens": 40, "stream": true}))
        .send()
        .await
        .unwrap();
    assert!(response.text().await.unwrap().ends_with("data: [DONE]\n\n"));
}

/// Migrations counted for `reason`.
async fn migrations(client: &reqwest::Client, base: &str, reason: &str) -> f64 {
    let text = metrics_text(client, base).await;
    metric(
        &text,
        &format!("switchyard_migrations_total{{reason=\"{reason}\"}}"),
    )
    .unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_migrated_turn_stays_its_sessions_turn_and_the_session_follows_it() {
    let _machine = machine().await;
    // A failing worker beside a sim-worker at model speed (a 400-token
    // answer streams for more than two seconds), session-aware admission.
    let scripted = scripted_worker(Script::Status500).await;
    let good = sim_worker("1");
    let router = router(
        &[
            format!("{scripted},name=bad"),
            format!("{},name=good", good.base),
        ],
        &["--policy", "round-robin", "--admission", "session-aware"],
    );
    let client = reqwest::Client::new();
    let base = router.base.clone();
    let turn = |session: String, max_tokens: u32| {
        let client = client.clone();
        let base = base.clone();
        async move {
            let response = client
                .post(format!("{base}/v1/completions"))
                .header("x-session-id", session)
                .json(&json!({"prompt": [1, 2, 3, 4, 5, 6, 7, 8], "max_tokens": max_tokens, "stream": true}))
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 200);
            let worker = served_by(&response);
            let text = response.text().await.unwrap();
            assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
            worker
        }
    };
    let deferred = |text: &str| {
        metric(
            text,
            "switchyard_admission_decisions_total{decision=\"deferred\"}",
        )
        .unwrap_or(0.0)
    };
    // Find a session whose first turn started on the failing worker (the
    // round-robin alternates) and moved: one more 5xx migration, seen
    // long before the turn ends.
    let mut session = None;
    for i in 0..6 {
        let before = migrations(&client, &base, "status_5xx").await;
        let name = format!("chat-{i}");
        let first = tokio::spawn(turn(name.clone(), 400));
        let moved = loop {
            if migrations(&client, &base, "status_5xx").await > before {
                break true;
            }
            if first.is_finished() {
                break migrations(&client, &base, "status_5xx").await > before;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        if moved {
            session = Some((name, first, before + 1.0));
            break;
        }
        first.await.unwrap();
    }
    let (name, first, after_first) = session.expect("a first turn started on the failing worker");
    // The next turn arrives while the migrated turn streams: it is still
    // the session's turn, so the next one is deferred until it ends...
    let deferred_before = deferred(&metrics_text(&client, &base).await);
    let second = tokio::spawn(turn(name, 4));
    wait_metrics(&client, &base, "the next turn to be deferred", |text| {
        deferred(text) == deferred_before + 1.0
    })
    .await;
    // ...then goes where it finished: straight to `good`, no migration.
    assert_eq!(first.await.unwrap(), "good");
    assert_eq!(
        second.await.unwrap(),
        "good",
        "the session re-pinned to its new worker"
    );
    assert_eq!(
        migrations(&client, &base, "status_5xx").await,
        after_first,
        "the next turn was not sent to the failed worker first"
    );
}

/// Waits until `router` has no request under way.
async fn wait_idle(client: &reqwest::Client, router: &Proc) {
    wait_metrics(client, &router.base, "the router to be idle", |text| {
        metric(text, "switchyard_active_requests") == Some(0.0)
    })
    .await;
}

/// The named events of the first of a few round-robin streams of `body`
/// at `path` through `router` that starts on the worker named `cutting`.
async fn an_agentic_stream_cut_mid_way(
    client: &reqwest::Client,
    router: &Proc,
    path: &str,
    body: &Value,
) -> Vec<(String, Value)> {
    named_events(&cut_on_the_cutting_worker(client, router, path, body).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_messages_stream_cut_mid_way_resumes_as_one_message_and_a_tools_one_ends_with_the_error()
{
    let _machine = machine().await;
    let (_good, router) = beside_a_good_worker(Script::CutAgenticStream, "cutting", &[]).await;
    let client = reqwest::Client::new();
    let body = json!({
        "model": "switchyard-sim", "max_tokens": 10, "stream": true,
        "messages": [{"role": "user", "content": "tell me about yards"}],
    });
    let events = an_agentic_stream_cut_mid_way(&client, &router, "/v1/messages", &body).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let count = |name: &str| names.iter().filter(|n| **n == name).count();
    assert_eq!(count("message_start"), 1, "{names:?}");
    assert_eq!(count("content_block_start"), 1, "{names:?}");
    assert_eq!(
        count("content_block_delta"),
        10,
        "3 before the cut, 7 after: {names:?}"
    );
    assert_eq!(count("content_block_stop"), 1, "{names:?}");
    assert_eq!(count("error"), 0, "{events:?}");
    assert_eq!(
        &names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    for (name, data) in &events {
        assert_eq!(data["type"], name.as_str(), "{data}");
        if name == "content_block_delta" {
            assert_eq!(data["index"], 0, "{data}");
            assert_eq!(data["delta"]["type"], "text_delta", "{data}");
        }
    }
    let delta = &events[events.len() - 2].1;
    assert_eq!(delta["delta"]["stop_reason"], "max_tokens", "{delta}");
    assert_eq!(delta["usage"]["output_tokens"], 10, "{delta}");
    let metrics = metrics_text(&client, &router.base).await;
    assert_eq!(
        metric(
            &metrics,
            "switchyard_migrations_total{reason=\"midstream\"}"
        ),
        Some(1.0),
        "{metrics}"
    );
    // With tools the stream is not resumed: the error event says why.
    let mut tools = body.clone();
    tools["tools"] = json!([{"name": "lookup", "input_schema": {"type": "object"}}]);
    let events = an_agentic_stream_cut_mid_way(&client, &router, "/v1/messages", &tools).await;
    let (name, last) = events.last().unwrap();
    assert_eq!(name, "error", "{events:?}");
    let message = last["error"]["message"].as_str().unwrap_or_default();
    assert!(message.contains("tools"), "{message}");
    wait_idle(&client, &router).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unstored_responses_stream_cut_mid_way_resumes_as_one_response_and_a_stored_one_ends_with_the_error(
) {
    let _machine = machine().await;
    let (_good, router) = beside_a_good_worker(Script::CutAgenticStream, "cutting", &[]).await;
    let client = reqwest::Client::new();
    let body = json!({
        "model": "switchyard-sim", "max_output_tokens": 10, "stream": true, "store": false,
        "input": "tell me about yards",
    });
    let events = an_agentic_stream_cut_mid_way(&client, &router, "/v1/responses", &body).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let count = |name: &str| names.iter().filter(|n| **n == name).count();
    assert_eq!(count("response.created"), 1, "{names:?}");
    assert_eq!(count("response.output_text.delta"), 10, "{names:?}");
    assert_eq!(count("error"), 0, "{events:?}");
    assert_eq!(
        &names[names.len() - 4..],
        [
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.incomplete"
        ],
        "at max_output_tokens the response is incomplete, as the worker says it"
    );
    let mut text = String::new();
    for (i, (name, data)) in events.iter().enumerate() {
        assert_eq!(data["type"], name.as_str(), "{data}");
        assert_eq!(data["sequence_number"], i, "{data}");
        if name == "response.output_text.delta" {
            assert_eq!(data["item_id"], "msg_scripted", "{data}");
            text.push_str(data["delta"].as_str().unwrap());
        }
    }
    let response = &events.last().unwrap().1["response"];
    assert_eq!(response["id"], "resp_scripted", "{response}");
    assert_eq!(response["output"][0]["content"][0]["text"], text.as_str());
    assert_eq!(response["usage"]["output_tokens"], 10, "{response}");
    // A stored response is not resumed elsewhere: the error says why.
    let mut stored = body.clone();
    stored["store"] = json!(true);
    let events = an_agentic_stream_cut_mid_way(&client, &router, "/v1/responses", &stored).await;
    let (name, last) = events.last().unwrap();
    assert_eq!(name, "error", "{events:?}");
    let message = last["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("stored") && message.contains("store: false"),
        "{message}"
    );
    assert_eq!(last["sequence_number"], events.len() - 1, "{last}");
    wait_idle(&client, &router).await;
}
