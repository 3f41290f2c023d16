//! The HTTP surface: the route table (the OpenAI endpoints of
//! [`crate::request::handlers`]), the operational endpoints (`/v1/models`,
//! `/health`, `/ready`, `/metrics`) and the admin API.

use crate::config::WorkerSpec;
use crate::error::ApiError;
use crate::front::inflight::Inflight;
use crate::front::upload::UploadLimits;
use crate::request::handlers::{chat_completions, completions};
use crate::request::prompt::{parse, read_body};
use crate::state::App;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router as AxumRouter;
use prometheus_client::encoding::prometheus_text;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;

/// The router's app as it is served, and the one assembly `serve`, the
/// tests and the fuzz target drive: the credential check first (from the
/// head: a refused request costs nothing more), then the in-flight limit
/// ([`crate::front::inflight`]), then the [`routes`], each reading its
/// body within its limit and deadline (the check also puts the router's
/// own errors on Anthropic's paths in Anthropic's shape:
/// [`crate::error::anthropic_shaped`]).
pub fn front_door(state: &App, inflight: Arc<Inflight>) -> AxumRouter {
    let routes = crate::front::inflight::layer(routes(state.clone()), inflight);
    crate::front::auth::layer(routes, state.intake.credentials.clone())
}

/// [`front_door`] with an in-flight limit of the default's size, for
/// tests that drive the app without starting a server.
#[cfg(test)]
pub(crate) fn app(state: App) -> AxumRouter {
    let limit = crate::ServerConfig::default().max_inflight;
    let inflight = Inflight::new(limit, state.driver.metrics().clone());
    front_door(&state, inflight)
}

/// The routes, each `POST` body read whole within its limit and deadline
/// ([`crate::front::upload`]) before its handler runs. The admin routes exist only
/// while an admin token is configured.
pub(crate) fn routes(state: App) -> AxumRouter {
    let limit = state.intake.max_body_bytes;
    let uploads = Arc::new(UploadLimits {
        max_bytes: limit,
        deadline: state.intake.body_read_timeout,
        budget: state.intake.body_budget.clone(),
        metrics: state.driver.metrics().clone(),
    });
    let mut routes = AxumRouter::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/responses", post(crate::request::responses::responses))
        .route(
            "/v1/responses/{id}",
            get(crate::request::responses::get_response),
        )
        .route(
            "/v1/responses/{id}/cancel",
            post(crate::request::responses::cancel_response),
        )
        .route("/v1/messages", post(crate::request::messages::messages))
        .route(
            "/v1/messages/count_tokens",
            post(crate::request::messages::count_tokens),
        )
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics));
    if state.intake.admin_api {
        routes = routes
            .route("/admin/workers", get(admin_list).post(admin_add))
            .route("/admin/workers/{name}", delete(admin_remove));
    }
    // Every handler reads its body with `read_body` (within the same
    // limit), so axum's `DefaultBodyLimit` (an extension inserted into
    // every request) has nothing to limit.
    let routes = crate::front::upload::route_layer(routes, uploads);
    routes.fallback(no_route).with_state(state)
}

/// A handler's body, read whole within the body limit (already read by
/// 404 for a path no route matches (its body is never read).
async fn no_route(State(state): State<App>, uri: axum::http::Uri) -> ApiError {
    let admin = uri.path() == "/admin" || uri.path().starts_with("/admin/");
    if admin && !state.intake.admin_api {
        ApiError::not_found(
            "no such route: the admin API is off (start the router with --admin-token)",
            None,
        )
    } else {
        ApiError::not_found("no such route", None)
    }
}

async fn models(State(state): State<App>) -> Result<Response, ApiError> {
    let mut names: Vec<String> = state
        .driver
        .workers()
        .into_iter()
        .filter(|w| w.in_router)
        .flat_map(|w| w.models)
        .collect();
    names.sort();
    names.dedup();
    let mut data: Vec<Value> = names
        .into_iter()
        .map(|id| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "switchyard"}))
        .collect();
    // The adapters requests may name: configured ones (loaded on demand)
    // and those learned from workers, with their base model as `parent`,
    // as vLLM lists them.
    for (id, parent) in state.driver.adapters.listed() {
        data.push(serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "switchyard", "parent": parent}));
    }
    Ok(axum::Json(serde_json::json!({"object": "list", "data": data})).into_response())
}

async fn ready(State(state): State<App>) -> Response {
    let up = state
        .driver
        .workers()
        .iter()
        .filter(|w| w.in_router && !w.draining)
        .count();
    if up > 0 {
        (StatusCode::OK, format!("ready: {up} workers\n")).into_response()
    } else {
        ApiError::no_workers("no healthy worker").into_response()
    }
}

async fn metrics(State(state): State<App>) -> Response {
    let mut out = String::with_capacity(16 * 1024);
    match prometheus_text::encode(&mut out, &state.registry) {
        Ok(()) => ([(header::CONTENT_TYPE, prometheus_text::CONTENT_TYPE)], out).into_response(),
        Err(_) => ApiError::internal("cannot encode the metrics").into_response(),
    }
}

async fn admin_list(State(state): State<App>) -> Result<Response, ApiError> {
    let list: Vec<Value> = state
        .driver
        .workers()
        .into_iter()
        .map(|w| {
            serde_json::json!({
                "name": &*w.name,
                "url": &*w.url,
                "models": w.models,
                "in_selection": w.in_router,
                "draining": w.draining,
                "role": w.role.label(),
                "bootstrap_port": w.bootstrap_port,
                "active_requests": state.driver.active_requests(w.id),
                // What the router read of the worker (null: not reported).
                "max_model_len": state.fleet.model_len_of(w.id),
                "capacity": w.capacity,
                "kv_usage": w.kv_usage,
                "adapter_slots": state.driver.adapter_slots_of(w.id),
            })
        })
        .collect();
    Ok(axum::Json(serde_json::json!({ "workers": list })).into_response())
}

async fn admin_add(State(state): State<App>, request: Request) -> Result<Response, ApiError> {
    let body = read_body(&state, request.into_body()).await?;
    let spec: WorkerSpec = parse(&body)?;
    state
        .fleet
        .join(&spec)
        .map_err(|e| ApiError::bad_request(e, None))?;
    Ok((
        StatusCode::CREATED,
        axum::Json(serde_json::json!({"name": spec.display_name()})),
    )
        .into_response())
}

#[derive(Deserialize)]
struct RemoveQuery {
    #[serde(default)]
    drain: bool,
}

async fn admin_remove(
    State(state): State<App>,
    Path(name): Path<String>,
    Query(query): Query<RemoveQuery>,
) -> Result<Response, ApiError> {
    if state.fleet.remove(&name, query.drain) {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::not_found(
            format!("no worker named {name:?}"),
            None,
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::Driver;
    use crate::fleet::Fleet;
    use crate::metrics::ServerMetrics;
    use crate::state::AppState;
    use crate::tokenize::PromptTokenizer;
    use crate::upstream::client as upstream_client;
    use crate::ServerConfig;
    use axum::body::Body;
    use http_body_util::BodyExt as _;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use switchyard_core::admission::SessionKey;
    use switchyard_core::admission::{
        Admission, AdmissionStrategy, LifecycleEvent, MakeReady, Placement, RequestFacts,
    };
    use switchyard_core::dispatch::Dispatcher;
    use switchyard_tokenizer::ChatMessage;
    use switchyard_tokenizer::TokenizerError;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tower::ServiceExt as _;

    /// Tracks every request and records what it hears.
    #[derive(Default)]
    struct Recorder {
        events: Arc<Mutex<Vec<String>>>,
    }

    impl AdmissionStrategy for Recorder {
        fn name(&self) -> &'static str {
            "recorder"
        }
        fn admit(&mut self, _: &RequestFacts<'_>) -> Admission {
            Admission::Ready(Placement::Any)
        }
        fn on_event(&mut self, event: &LifecycleEvent, _: f64, _: &mut Vec<MakeReady>) {
            let line = match event {
                LifecycleEvent::Dispatched { .. } => "dispatched".to_owned(),
                LifecycleEvent::Completed { context_tokens, .. } => {
                    format!("completed {context_tokens}")
                }
                LifecycleEvent::Aborted { .. } => "aborted".to_owned(),
                LifecycleEvent::Migrating { .. } => "migrating".to_owned(),
                LifecycleEvent::Reconcile => return,
            };
            self.events.lock().unwrap().push(line);
        }
        fn reconcile_interval_ms(&self) -> f64 {
            1e9
        }
        fn tracked_requests(&self) -> usize {
            0
        }
    }

    /// Token-id prompts only: nothing to tokenize.
    struct NoText;

    impl PromptTokenizer for NoText {
        fn encode(&self, _: &str) -> Result<Vec<u32>, TokenizerError> {
            Ok(Vec::new())
        }
        fn encode_chat(&self, _: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError> {
            Ok(Vec::new())
        }
    }

    /// The request heads a test worker received.
    type Heads = Arc<Mutex<Vec<String>>>;

    /// A worker on a real loopback socket that answers every request with
    /// `body` (one connection at a time, closed after its answer) and
    /// records each request's head.
    async fn worker(body: &'static str) -> (String, Heads) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let heads = Heads::default();
        let record = heads.clone();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                let mut seen = Vec::new();
                let mut buf = [0u8; 4096];
                // Read the head and the declared body, then answer.
                loop {
                    let n = socket.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        break;
                    }
                    seen.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&seen);
                    if let Some(end) = text.find("\r\n\r\n") {
                        let length = text[..end]
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length:")
                                    .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                            })
                            .unwrap_or(0);
                        if seen.len() >= end + 4 + length {
                            record.lock().unwrap().push(text[..end].to_owned());
                            break;
                        }
                    }
                }
                let answer = format!(
                    "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                );
                let _ = socket.write_all(answer.as_bytes()).await;
            }
        });
        (url, heads)
    }

    /// The state of a router configured by `config` whose one worker, at
    /// `url`, is in selection; `strategy` admits.
    fn state_with_worker(
        config: &ServerConfig,
        url: &str,
        strategy: Box<dyn AdmissionStrategy + Send>,
    ) -> (App, Arc<Driver>) {
        let dispatcher = Dispatcher::new(crate::dispatcher_config(config), Some(strategy)).unwrap();
        let driver = Arc::new(Driver::new(
            dispatcher,
            Arc::new(ServerMetrics::new(config.policy.name())),
        ));
        let id = driver.add_worker("w", url).unwrap();
        driver.set_in_router(id, true);
        let client = upstream_client(Duration::from_secs(1));
        let fleet = Arc::new(Fleet::new(
            driver.clone(),
            client.clone(),
            false,
            config.block_size,
            3,
            Duration::from_secs(1),
        ));
        let state = Arc::new(AppState::new(
            config,
            driver.clone(),
            fleet,
            client,
            Arc::new(NoText),
            None,
        ));
        (state, driver)
    }

    const ANSWER: &str = r#"{"id":"cmpl-1","object":"text_completion","created":0,"model":"m","choices":[{"index":0,"text":"abcdefg","finish_reason":"length"}],"usage":{"prompt_tokens":4,"completion_tokens":7,"total_tokens":11}}"#;

    #[tokio::test]
    async fn a_non_streaming_answer_completes_with_prompt_plus_completion_tokens() {
        let (url, _) = worker(ANSWER).await;
        let config = ServerConfig::default();
        let events: Arc<Mutex<Vec<String>>> = Arc::default();
        let strategy = Recorder {
            events: events.clone(),
        };
        let (state, driver) = state_with_worker(&config, &url, Box::new(strategy));
        let request = axum::http::Request::post("/v1/completions")
            .header("content-type", "application/json")
            .body(Body::from(
                r#"{"prompt":[1,2,3,4],"max_tokens":7,"stream":false,"session_id":"s"}"#,
            ))
            .unwrap();
        let response = app(state).oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let body = response.into_body().collect().await.unwrap().to_bytes();
        assert!(String::from_utf8_lossy(&body).contains("abcdefg"));
        assert_eq!(
            *events.lock().unwrap(),
            vec!["dispatched".to_owned(), "completed 11".to_owned()],
            "the session's context grows by the answer's completion tokens"
        );
        assert_eq!(driver.total_active_requests(), 0);
    }

    #[tokio::test]
    async fn the_worker_gets_the_routers_key_and_never_the_clients() {
        let (url, heads) = worker(ANSWER).await;
        let config = ServerConfig {
            api_keys: vec!["sk-client".into()],
            worker_api_key: Some("wk-router".into()),
            ..ServerConfig::default()
        };
        let (state, _) = state_with_worker(&config, &url, Box::new(Recorder::default()));
        let request = axum::http::Request::post("/v1/completions")
            .header("content-type", "application/json")
            .header("authorization", "Bearer sk-client")
            .body(Body::from(r#"{"prompt":[1,2,3,4],"max_tokens":7}"#))
            .unwrap();
        let response = app(state).oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let heads = heads.lock().unwrap();
        assert_eq!(heads.len(), 1);
        let head = heads[0].to_ascii_lowercase();
        assert_eq!(
            head.matches("authorization:").count(),
            1,
            "one credential: {head}"
        );
        assert!(head.contains("authorization: bearer wk-router"), "{head}");
        assert!(
            !head.contains("sk-client"),
            "the client's key leaked: {head}"
        );
    }

    /// Admits everything and records the session of each request.
    #[derive(Default)]
    struct SessionRecorder {
        sessions: Arc<Mutex<Vec<Option<SessionKey>>>>,
    }

    impl AdmissionStrategy for SessionRecorder {
        fn name(&self) -> &'static str {
            "session-recorder"
        }
        fn admit(&mut self, facts: &RequestFacts<'_>) -> Admission {
            self.sessions.lock().unwrap().push(facts.session);
            Admission::Ready(Placement::Any)
        }
        fn on_event(&mut self, _: &LifecycleEvent, _: f64, _: &mut Vec<MakeReady>) {}
        fn reconcile_interval_ms(&self) -> f64 {
            1e9
        }
        fn tracked_requests(&self) -> usize {
            0
        }
    }

    /// The session each of `requests` (a client key, the `x-session-id`
    /// header, the body's `session_id`) is admitted under, by a router
    /// with `config`.
    async fn sessions_of(
        config: ServerConfig,
        requests: &[(&str, Option<&str>, Option<&str>)],
    ) -> Vec<Option<SessionKey>> {
        let (url, _) = worker(ANSWER).await;
        let recorder = SessionRecorder::default();
        let sessions = recorder.sessions.clone();
        let (state, _) = state_with_worker(&config, &url, Box::new(recorder));
        for (key, header, body_session) in requests {
            let mut request = axum::http::Request::post("/v1/completions")
                .header("content-type", "application/json")
                .header("authorization", format!("Bearer {key}"));
            if let Some(id) = header {
                request = request.header("x-session-id", *id);
            }
            let body = match body_session {
                Some(id) => format!(r#"{{"prompt":[1,2,3,4],"max_tokens":7,"session_id":"{id}"}}"#),
                None => r#"{"prompt":[1,2,3,4],"max_tokens":7}"#.to_owned(),
            };
            let response = app(state.clone())
                .oneshot(request.body(Body::from(body)).unwrap())
                .await
                .unwrap();
            assert_eq!(response.status(), StatusCode::OK);
        }
        let sessions = sessions.lock().unwrap().clone();
        sessions
    }

    #[tokio::test]
    async fn with_client_keys_a_session_id_names_a_session_of_its_own_key_only() {
        let keyed = ServerConfig {
            api_keys: vec!["sk-a".into(), "sk-b".into()],
            ..ServerConfig::default()
        };
        let got = sessions_of(
            keyed,
            &[
                ("sk-a", Some("chat-1"), None),
                ("sk-b", Some("chat-1"), None),
                ("sk-a", None, Some("chat-1")),
                ("sk-a", Some(""), None),
            ],
        )
        .await;
        let a = SessionKey::namespaced("api-key-1", "chat-1");
        let b = SessionKey::namespaced("api-key-2", "chat-1");
        assert_ne!(a, b);
        assert_eq!(got, [Some(a), Some(b), Some(a), None]);
        // Without client keys every client shares one space of ids, as
        // peer replicas of an older version key them.
        let open = sessions_of(ServerConfig::default(), &[("any", Some("chat-1"), None)]).await;
        assert_eq!(open, [Some(SessionKey::from_client_id("chat-1"))]);
    }

    #[tokio::test]
    async fn without_an_admin_token_the_admin_routes_do_not_exist() {
        let (url, _) = worker(ANSWER).await;
        for (token, expected) in [(None, StatusCode::NOT_FOUND), (Some("adm"), StatusCode::OK)] {
            let config = ServerConfig {
                admin_token: token.map(Into::into),
                ..ServerConfig::default()
            };
            let (state, _) = state_with_worker(&config, &url, Box::new(Recorder::default()));
            let request = axum::http::Request::get("/admin/workers")
                .header("authorization", "Bearer adm")
                .body(Body::empty())
                .unwrap();
            let response = app(state).oneshot(request).await.unwrap();
            assert_eq!(response.status(), expected, "admin token {token:?}");
        }
    }
}
