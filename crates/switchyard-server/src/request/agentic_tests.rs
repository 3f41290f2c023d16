//! The Responses and Messages APIs through the router: the routing
//! prefix they share with chat, stored responses' affinity, Anthropic's
//! credentials and errors, sessions and metrics. Workers are axum servers
//! on real loopback sockets.

use crate::driver::Driver;
use crate::fleet::Fleet;
use crate::metrics::{RequestStatus, ServerMetrics};
use crate::request::agentic::{parse_messages, parse_responses, AgenticApi};
use crate::request::limits::parse_chat;
use crate::request::prompt::{tokenize, TokenizeJob};
use crate::routes::app;
use crate::state::{App, AppState};
use crate::tokenize::HfTokenizer;
use crate::upstream::client as upstream_client;
use crate::ServerConfig;
use axum::body::Body;
use axum::extract::Path;
use axum::http::{HeaderMap, StatusCode};
use axum::routing::{get, post};
use http_body_util::BodyExt as _;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use switchyard_core::admission::{
    Admission, AdmissionStrategy, LifecycleEvent, MakeReady, Placement, RequestFacts, SessionKey,
};
use switchyard_core::dispatch::Dispatcher;
use switchyard_core::WorkerId;
use switchyard_tokenizer::Tokenizer;
use tower::ServiceExt as _;

/// What the test workers saw: (worker, path, the request's headers as
/// text).
type Seen = Arc<Mutex<Vec<(String, String, String)>>>;

/// A worker named `name` on a loopback socket: `/v1/responses` answers
/// with a fresh id of its own (`resp_<name>_<n>`), whole or as a stream;
/// `GET /v1/responses/{id}` answers the id and its name; `/v1/messages`
/// answers a message. Records every request it gets.
async fn worker(name: &'static str, seen: Seen) -> String {
    let next = Arc::new(AtomicU64::new(0));
    let record = move |path: &str, headers: &HeaderMap| {
        let text = format!("{headers:?}").to_ascii_lowercase();
        seen.lock()
            .unwrap()
            .push((name.to_owned(), path.to_owned(), text));
    };
    let (r1, r2, r3) = (record.clone(), record.clone(), record);
    let app = axum::Router::new()
        .route(
            "/v1/responses",
            post(move |headers: HeaderMap, body: String| {
                let id = format!("resp_{name}_{}", next.fetch_add(1, Ordering::Relaxed));
                r1("/v1/responses", &headers);
                async move {
                    let object = json!({"id": id, "object": "response", "status": "completed",
                        "output": [], "usage": {"input_tokens": 4, "output_tokens": 3, "total_tokens": 7}});
                    if body.contains("\"stream\":true") {
                        let events = format!(
                            "event: response.created\ndata: {}\n\nevent: response.output_text.delta\ndata: {}\n\nevent: response.completed\ndata: {}\n\n",
                            json!({"type": "response.created", "sequence_number": 0, "response": object}),
                            json!({"type": "response.output_text.delta", "sequence_number": 1, "delta": "hi"}),
                            json!({"type": "response.completed", "sequence_number": 2, "response": object}),
                        );
                        ([("content-type", "text/event-stream")], events).into_response()
                    } else {
                        axum::Json(object).into_response()
                    }
                }
            }),
        )
        .route(
            "/v1/responses/{id}",
            get(move |Path(id): Path<String>, headers: HeaderMap| async move {
                r2("/v1/responses/{id}", &headers);
                axum::Json(json!({"id": id, "served_by": name}))
            }),
        )
        .route(
            "/v1/messages",
            post(move |headers: HeaderMap| async move {
                r3("/v1/messages", &headers);
                axum::Json(json!({"id": "msg_1", "type": "message", "role": "assistant",
                    "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
                    "usage": {"input_tokens": 4, "output_tokens": 2}}))
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

use axum::response::IntoResponse as _;

/// Admits everything and records each request's session; places each
/// on the worker in `.1` when set (as a strategy whose session is bound
/// there would).
#[derive(Default)]
struct Sessions(
    Arc<Mutex<Vec<Option<SessionKey>>>>,
    Arc<Mutex<Option<WorkerId>>>,
);

impl AdmissionStrategy for Sessions {
    fn name(&self) -> &'static str {
        "sessions"
    }
    fn admit(&mut self, facts: &RequestFacts<'_>) -> Admission {
        self.0.lock().unwrap().push(facts.session);
        match *self.1.lock().unwrap() {
            Some(w) => Admission::Ready(Placement::Exact(w)),
            None => Admission::Ready(Placement::Any),
        }
    }
    fn on_event(&mut self, _: &LifecycleEvent, _: f64, _: &mut Vec<MakeReady>) {}
    fn reconcile_interval_ms(&self) -> f64 {
        1e9
    }
    fn tracked_requests(&self) -> usize {
        0
    }
}

struct Router {
    state: App,
    driver: Arc<Driver>,
    ids: Vec<WorkerId>,
    sessions: Arc<Mutex<Vec<Option<SessionKey>>>>,
    /// Where the strategy places every request (`None`: anywhere).
    exact: Arc<Mutex<Option<WorkerId>>>,
}

/// A router configured by `config`, with the bundled tokenizer, in front
/// of workers at `urls` (named w0, w1, ...), all in selection.
fn router(config: &ServerConfig, urls: &[String]) -> Router {
    let sessions = Sessions::default();
    let recorded = sessions.0.clone();
    let exact = sessions.1.clone();
    let dispatcher =
        Dispatcher::new(crate::dispatcher_config(config), Some(Box::new(sessions))).unwrap();
    let driver = Arc::new(Driver::new(
        dispatcher,
        Arc::new(ServerMetrics::new(config.policy.name())),
    ));
    let mut ids = Vec::new();
    for (i, url) in urls.iter().enumerate() {
        let id = driver.add_worker(&format!("w{i}"), url).unwrap();
        driver.set_in_router(id, true);
        ids.push(id);
    }
    let client = upstream_client(Duration::from_secs(2));
    let fleet = Arc::new(Fleet::new(
        driver.clone(),
        client.clone(),
        false,
        config.block_size,
        3,
        Duration::from_secs(1),
    ));
    let tokenizer = HfTokenizer(Tokenizer::bundled().unwrap());
    let state = Arc::new(AppState::new(
        config,
        driver.clone(),
        fleet,
        client,
        Arc::new(tokenizer),
        None,
    ));
    Router {
        state,
        driver,
        ids,
        sessions: recorded,
        exact,
    }
}

fn named() -> ServerConfig {
    ServerConfig {
        worker_header: Some(true),
        ..ServerConfig::default()
    }
}

/// POSTs (or GETs, when `body` is null) `path` through the router: status,
/// the worker header, the body as JSON (or text as a JSON string).
async fn call(
    state: &App,
    path: &str,
    body: Value,
    headers: &[(&str, &str)],
) -> (StatusCode, String, Value) {
    let mut request = if body.is_null() {
        axum::http::Request::get(path)
    } else {
        axum::http::Request::post(path).header("content-type", "application/json")
    };
    for (k, v) in headers {
        request = request.header(*k, *v);
    }
    let body = if body.is_null() {
        Body::empty()
    } else {
        Body::from(body.to_string())
    };
    let response = app(state.clone())
        .oneshot(request.body(body).unwrap())
        .await
        .unwrap();
    let status = response.status();
    let worker = response
        .headers()
        .get("x-switchyard-worker")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let bytes = response.into_body().collect().await.unwrap().to_bytes();
    let value = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, worker, value)
}

/// The local block hashes (block size 16) of the prompt a body of `api`
/// is routed by: parsed, read as chat, tokenized with the chat template
/// exactly as the handlers do.
async fn routing_blocks(state: &AppState, api: &str, body: &Value) -> Vec<u64> {
    let bytes = body.to_string().into_bytes();
    let job = match api {
        "chat" => {
            let chat = parse_chat(state, &bytes).unwrap().0;
            TokenizeJob::chat(chat.messages, chat.tools, 0)
        }
        "messages" => {
            let m = parse_messages(state, &bytes).unwrap().0;
            TokenizeJob::chat(m.messages, m.tools, m.unrendered_bytes)
        }
        _ => {
            let r = parse_responses(state, &bytes).unwrap().0;
            TokenizeJob::chat(r.messages, r.tools, r.unrendered_bytes)
        }
    };
    let prompt = tokenize(
        state,
        None,
        job.unwrap(),
        &switchyard_core::admission::Flow::default(),
    )
    .await
    .unwrap();
    assert_eq!(prompt.unrendered, 0, "everything rendered");
    switchyard_core::hashing::local_block_hashes(&prompt.ids, 16, state.prompts.hash_seed)
        .into_iter()
        .map(|h| h.0)
        .collect()
}

#[tokio::test]
async fn a_chat_messages_text_parts_route_as_their_texts_joined_by_a_newline() {
    let r = router(&named(), &[]);
    // The parts come first, so that what follows them fills whole blocks.
    let answer = "The one that served its previous turn, since its cache holds it. ".repeat(8);
    let chat = |first: Value| {
        json!({"model": "m", "messages": [
            {"role": "user", "content": first},
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "Why?"},
        ]})
    };
    let parts = json!([{"type": "text", "text": "Thanks."}, {"type": "text", "text": "And next?"}]);
    let by_parts = routing_blocks(&r.state, "chat", &chat(parts)).await;
    let joined = routing_blocks(&r.state, "chat", &chat(json!("Thanks.\nAnd next?"))).await;
    let glued = routing_blocks(&r.state, "chat", &chat(json!("Thanks.And next?"))).await;
    assert!(by_parts.len() >= 2, "a prompt of {} blocks", by_parts.len());
    assert_eq!(
        by_parts, joined,
        "vLLM joins a message's text parts with a newline"
    );
    assert_ne!(by_parts, glued);
}

#[tokio::test]
async fn chat_messages_and_responses_route_the_same_conversation_by_the_same_blocks() {
    let r = router(&named(), &[]);
    let system = "You are a careful assistant who answers in full sentences. ".repeat(4);
    let question = "Which worker holds the prefix of this conversation, and why? ".repeat(3);
    let answer = "The one that served its previous turn, since its cache holds it.";
    let result = "{\"worker\": \"w2\", \"blocks\": 12}";
    let chat = json!({"model": "m", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": question},
        // One assistant turn: its text and its tool call (vLLM merges a
        // Responses message item and the function call after it so).
        {"role": "assistant", "content": answer, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": result},
        {"role": "user", "content": [{"type": "text", "text": "Thanks. And next?"}]},
    ]});
    let messages = json!({"model": "m", "max_tokens": 8, "system": [{"type": "text", "text": system}], "messages": [
        {"role": "user", "content": question},
        {"role": "assistant", "content": [{"type": "text", "text": answer}, {"type": "tool_use", "id": "c1", "name": "lookup", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": result}, {"type": "text", "text": "Thanks. And next?"}]},
    ]});
    let responses = json!({"model": "m", "instructions": system, "input": [
        {"role": "user", "content": question},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": answer}]},
        {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": result},
        {"role": "user", "content": [{"type": "input_text", "text": "Thanks. And next?"}]},
    ]});
    let by_chat = routing_blocks(&r.state, "chat", &chat).await;
    assert!(by_chat.len() >= 8, "a prompt of {} blocks", by_chat.len());
    // Tools, declared the way each API declares them, render alike (into
    // the system turn, after its text and before every other message).
    let with_tools = |mut body: Value, tools: Value| {
        body["tools"] = tools;
        body
    };
    let schema = json!({"type": "object", "properties": {"q": {"type": "string"}}});
    let chat_tools = with_tools(
        chat.clone(),
        json!([{"type": "function", "function": {"name": "lookup", "description": "Finds a worker.", "parameters": schema, "strict": true}}]),
    );
    let tooled = routing_blocks(&r.state, "chat", &chat_tools).await;
    assert!(
        tooled.len() > by_chat.len(),
        "the tools take {} blocks",
        tooled.len() - by_chat.len()
    );
    let messages_tools = with_tools(
        messages.clone(),
        json!([{"name": "lookup", "description": "Finds a worker.", "input_schema": schema, "strict": true}]),
    );
    assert_eq!(
        routing_blocks(&r.state, "messages", &messages_tools).await,
        tooled
    );
    let responses_tools = with_tools(
        responses.clone(),
        json!([{"type": "function", "name": "lookup", "description": "Finds a worker.", "parameters": schema, "strict": true}]),
    );
    assert_eq!(
        routing_blocks(&r.state, "responses", &responses_tools).await,
        tooled
    );
    assert_eq!(
        routing_blocks(&r.state, "messages", &messages).await,
        by_chat
    );
    assert_eq!(
        routing_blocks(&r.state, "responses", &responses).await,
        by_chat
    );
    // A string input is one user message, as in chat.
    let short_chat = json!({"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]});
    let short_responses = json!({"instructions": system, "input": question});
    assert_eq!(
        routing_blocks(&r.state, "responses", &short_responses).await,
        routing_blocks(&r.state, "chat", &short_chat).await
    );
}

#[tokio::test]
async fn every_turn_of_a_response_chain_goes_to_the_worker_that_stores_its_previous_response() {
    let seen = Seen::default();
    let mut urls = Vec::new();
    for name in ["a", "b", "c"] {
        urls.push(worker(name, seen.clone()).await);
    }
    let r = router(&named(), &urls);
    let (status, first_worker, first) =
        call(&r.state, "/v1/responses", json!({"input": "Hello"}), &[]).await;
    assert_eq!(status, StatusCode::OK, "{first}");
    let mut previous = first["id"].as_str().unwrap().to_owned();
    for turn in 0..12 {
        // Streamed and whole turns alternate.
        let stream = turn % 2 == 0;
        let (status, worker, answer) = call(
            &r.state,
            "/v1/responses",
            json!({"input": [{"role": "user", "content": format!("turn {turn}")}], "previous_response_id": previous, "stream": stream}),
            &[],
        )
        .await;
        assert_eq!(status, StatusCode::OK, "{answer}");
        assert_eq!(worker, first_worker, "turn {turn} left the chain's worker");
        previous = if stream {
            let text = answer.as_str().unwrap();
            assert!(
                text.starts_with("event: response.created\ndata: "),
                "{text}"
            );
            let data = text.lines().nth(1).unwrap().trim_start_matches("data: ");
            let created: Value = serde_json::from_str(data).unwrap();
            created["response"]["id"].as_str().unwrap().to_owned()
        } else {
            answer["id"].as_str().unwrap().to_owned()
        };
    }
    let (status, worker, got) = call(
        &r.state,
        &format!("/v1/responses/{previous}"),
        Value::Null,
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(worker, first_worker);
    assert_eq!(got["id"], previous.as_str());
    // Every request of the chain reached that worker only.
    let prefix = format!("resp_{}_", got["served_by"].as_str().unwrap());
    assert!(previous.starts_with(&prefix), "{previous} from {prefix}");
    let workers: Vec<String> = seen.lock().unwrap().iter().map(|s| s.0.clone()).collect();
    assert_eq!(workers.len(), 14);
    assert!(workers.iter().all(|w| *w == workers[0]), "{workers:?}");
    // The chain is one session from its second turn on.
    let sessions = r.sessions.lock().unwrap().clone();
    assert_eq!(sessions[0], None);
    assert!(sessions[1].is_some());
    assert!(
        sessions[1..].iter().all(|s| *s == sessions[1]),
        "{sessions:?}"
    );
    assert_eq!(r.state.apis.stored_responses.len(), 13);
    assert_eq!(
        r.state
            .apis
            .api_metrics
            .counted(AgenticApi::Responses, RequestStatus::Ok),
        13
    );
}

#[tokio::test]
async fn an_unknown_response_is_a_404_and_one_whose_worker_left_is_a_410_never_another_worker() {
    let seen = Seen::default();
    let urls = vec![
        worker("a", seen.clone()).await,
        worker("b", seen.clone()).await,
    ];
    let r = router(&named(), &urls);
    let (status, _, body) = call(
        &r.state,
        "/v1/responses",
        json!({"input": "x", "previous_response_id": "resp_unknown"}),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
    assert_eq!(body["error"]["param"], "previous_response_id");
    let (status, _, _) = call(&r.state, "/v1/responses/resp_unknown", Value::Null, &[]).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, _, _) = call(&r.state, "/v1/responses/..%2Fadmin", Value::Null, &[]).await;
    assert_eq!(status, StatusCode::NOT_FOUND);

    let (_, worker, first) = call(&r.state, "/v1/responses", json!({"input": "x"}), &[]).await;
    let id = first["id"].as_str().unwrap().to_owned();
    let holder = r.ids[if worker == "w0" { 0 } else { 1 }];
    // A strategy placing the turn elsewhere (its session bound to the
    // other worker) does not move it off the worker that stores it.
    let other = r.ids[if worker == "w0" { 1 } else { 0 }];
    *r.exact.lock().unwrap() = Some(other);
    let (status, pinned_to, body) = call(
        &r.state,
        "/v1/responses",
        json!({"input": "z", "previous_response_id": id}),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(pinned_to, worker);
    *r.exact.lock().unwrap() = None;
    // Out of selection (unhealthy): a 503 to retry, not another worker.
    r.driver.set_in_router(holder, false);
    let (status, _, body) = call(
        &r.state,
        "/v1/responses",
        json!({"input": "y", "previous_response_id": id}),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    // Gone from the fleet: a 410.
    r.driver.remove_worker(holder);
    let before = seen.lock().unwrap().len();
    let (status, _, body) = call(
        &r.state,
        "/v1/responses",
        json!({"input": "y", "previous_response_id": id}),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::GONE, "{body}");
    let (status, _, _) = call(&r.state, &format!("/v1/responses/{id}"), Value::Null, &[]).await;
    assert_eq!(status, StatusCode::GONE);
    assert_eq!(
        seen.lock().unwrap().len(),
        before,
        "no other worker was asked"
    );
    // A request with store=false is not remembered.
    let stored = r.state.apis.stored_responses.len();
    let (status, _, _) = call(
        &r.state,
        "/v1/responses",
        json!({"input": "x", "store": false}),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(r.state.apis.stored_responses.len(), stored);
}

#[tokio::test]
async fn anthropic_clients_present_x_api_key_and_get_anthropic_errors_from_the_router() {
    let seen = Seen::default();
    let urls = vec![worker("a", seen.clone()).await];
    let config = ServerConfig {
        api_keys: vec!["sk-ant".into()],
        worker_api_key: Some("wk-router".into()),
        worker_header: Some(true),
        ..ServerConfig::default()
    };
    let r = router(&config, &urls);
    let body =
        json!({"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]});
    let (status, _, refused) = call(&r.state, "/v1/messages", body.clone(), &[]).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(refused["type"], "error", "{refused}");
    assert_eq!(refused["error"]["type"], "authentication_error");
    let (status, _, answer) = call(
        &r.state,
        "/v1/messages",
        body.clone(),
        &[("x-api-key", "sk-ant"), ("anthropic-version", "2023-06-01")],
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["type"], "message");
    let head = seen.lock().unwrap()[0].2.clone();
    assert!(
        !head.contains("sk-ant"),
        "the client's key reached the worker: {head}"
    );
    assert!(head.contains("bearer wk-router"), "{head}");
    // The router's own refusals are Anthropic's; chat's stay OpenAI's.
    let key = [("x-api-key", "sk-ant")];
    let (status, _, bad) = call(&r.state, "/v1/messages", json!({"messages": []}), &key).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(bad["error"]["type"], "invalid_request_error", "{bad}");
    assert_eq!(bad["type"], "error");
    let (status, _, chat) = call(
        &r.state,
        "/v1/chat/completions",
        json!({"messages": []}),
        &key,
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(chat.get("type").is_none(), "{chat}");
    // count_tokens: the rendered prompt's length, answered by the router.
    let (status, _, counted) = call(&r.state, "/v1/messages/count_tokens", body, &key).await;
    assert_eq!(status, StatusCode::OK, "{counted}");
    assert!(counted["input_tokens"].as_u64().unwrap() > 3);
    assert_eq!(
        seen.lock().unwrap().len(),
        1,
        "count_tokens asked no worker"
    );
    assert_eq!(
        r.state
            .apis
            .api_metrics
            .counted(AgenticApi::Messages, RequestStatus::Ok),
        1
    );
    assert_eq!(
        r.state
            .apis
            .api_metrics
            .counted(AgenticApi::Messages, RequestStatus::Invalid),
        1
    );
}

#[tokio::test]
async fn lists_past_the_limits_are_refused_before_any_work() {
    let config = ServerConfig {
        max_messages: 2,
        max_content_parts: 2,
        ..named()
    };
    let r = router(&config, &[]);
    let three = json!([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "user", "content": "c"}]);
    let (status, _, body) = call(&r.state, "/v1/responses", json!({"input": three}), &[]).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(body["error"]["param"], "input", "{body}");
    let blocks = json!([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}]);
    let (status, _, body) = call(
        &r.state,
        "/v1/messages",
        json!({"max_tokens": 4, "messages": blocks}),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("--max-content-parts"),
        "{body}"
    );
    let (status, _, body) = call(
        &r.state,
        "/v1/responses",
        json!({"input": "x", "max_output_tokens": 1e12}),
        &[],
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert_eq!(body["error"]["param"], "max_output_tokens");
}
