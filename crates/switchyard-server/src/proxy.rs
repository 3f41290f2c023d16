//! The HTTP surface: OpenAI endpoints proxied to the chosen worker, the
//! operational endpoints and the admin API.
//!
//! One request: the key was checked from its head ([`crate::auth`]) and
//! its body read whole within its limit and deadline ([`crate::upload`])
//! before a handler runs → parse only the fields routing needs → tokenize (chat template for chat) → block hashes
//! → admission and selection ([`SharedRouter::submit`]) → forward the
//! client's bytes unchanged to the worker → wait for its first event
//! (streaming) or its whole answer (non-streaming, buffered up to
//! `max_response_bytes`). A worker that fails before that point (refused,
//! reset, 5xx, first-token timeout) is reported, its booking freed, and the
//! request retried elsewhere ([`Attempts`]); a stream then flows through
//! [`MigratingStream`], which resumes it on another worker if it breaks.
//! The whole request is bounded by the request timeout (504).

use super::answer::{buffered, deliver, first_event, queue_timeout, Delivery};
use super::attempt::{AttemptError, Attempts};
use super::auth::ClientKey;
use super::config::WorkerSpec;
use super::context::{AppState, Shared};
use super::error::ApiError;
use super::limits;
use super::metrics::RequestStatus;
use super::migration::{Phase, Progress};
use super::tokenize::{rendered_size_estimate, INLINE_CHARS};
use super::upload::{read_whole, ReadError, UploadLimits};
use axum::body::Body;
use axum::extract::{Path, Query, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router as AxumRouter;
use bytes::Bytes;
use prometheus_client::encoding::prometheus_text;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;
use std::time::Instant;
use switchyard_core::admission::SessionKey;
use switchyard_tokenizer::ChatMessage;
use switchyard_wire::openai::{Message, MessageContent, Prompt};

/// The axum router for `state`: [`routes`] behind the credential check
/// ([`crate::auth`]). The server adds the in-flight limit between the two
/// ([`crate::front_door`]).
pub fn app(state: Shared) -> AxumRouter {
    let credentials = state.credentials.clone();
    super::auth::layer(routes(state), credentials)
}

/// The routes, each `POST` body read whole within its limit and deadline
/// ([`crate::upload`]) before its handler runs. The admin routes exist only
/// while an admin token is configured.
pub fn routes(state: Shared) -> AxumRouter {
    let limit = state.max_body_bytes;
    let uploads = Arc::new(UploadLimits {
        max_bytes: limit,
        deadline: state.body_read_timeout,
        metrics: state.shared.metrics().clone(),
    });
    let mut routes = AxumRouter::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics));
    if state.admin_api {
        routes = routes
            .route("/admin/workers", get(admin_list).post(admin_add))
            .route("/admin/workers/{name}", delete(admin_remove));
    }
    // Every handler reads its body with `read_body` (within the same
    // limit), so axum's `DefaultBodyLimit` (an extension inserted into
    // every request) has nothing to limit.
    let routes = super::upload::route_layer(routes, uploads);
    routes.fallback(no_route).with_state(state)
}

/// A handler's body, read whole within the body limit (already read by
/// the upload layer: its one buffer, taken as it is).
async fn read_body(state: &AppState, body: Body) -> Result<Bytes, ApiError> {
    read_whole(body, state.max_body_bytes)
        .await
        .map_err(|e| match e {
            ReadError::TooLarge => ApiError::too_large(state.max_body_bytes),
            ReadError::Broken => ApiError::bad_request("could not read the request body", None),
        })
}

fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}"), None))
}

/// The routing facts of one request.
struct Parsed {
    model: Option<String>,
    stream: bool,
    /// The body's `session_id` (the `x-session-id` header wins).
    session: Option<String>,
    /// The client key it came with.
    key: Option<ClientKey>,
    tokens: Vec<u32>,
    /// The prompt's estimated length when its model has no tokenizer
    /// here (`tokens` is then empty).
    estimated_tokens: Option<u32>,
}

/// A prompt as routing knows it: its token ids, or, when its model has
/// no tokenizer here, an estimate of its length ([`crate::models`]).
struct PromptIds {
    ids: Vec<u32>,
    estimated: Option<u32>,
}

impl PromptIds {
    fn len(&self) -> usize {
        self.estimated.map_or(self.ids.len(), |n| n as usize)
    }
}

/// The router's reading of chat messages: text content as is, the text
/// of every content part that has one (images and other parts do not
/// change the text prefix), no content as empty.
fn chat_messages(body: Vec<Message>) -> Result<Vec<ChatMessage>, ApiError> {
    if body.is_empty() {
        return Err(ApiError::bad_request(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    let mut messages = Vec::with_capacity(body.len());
    for m in body {
        let content = match m.content {
            None => String::new(),
            Some(MessageContent::Text(s)) => s,
            Some(MessageContent::Parts(parts)) => {
                parts.into_iter().filter_map(|p| p.text).collect()
            }
            Some(MessageContent::Invalid) => {
                return Err(ApiError::bad_request(
                    "message content must be a string or a list of content parts",
                    Some("messages"),
                ))
            }
        };
        messages.push(ChatMessage {
            role: m.role,
            content,
        });
    }
    Ok(messages)
}

/// The prompt's token ids with the tokenizer of the request's `model`,
/// or a 400 when it is past the prompt token limit (the tokenizer stops
/// counting soon after the limit). A model without a tokenizer here gets
/// an estimate of the prompt's length instead (the worker judges its
/// limit).
async fn tokenize(
    state: &AppState,
    model: Option<&str>,
    job: TokenizeJob,
) -> Result<PromptIds, ApiError> {
    let started = Instant::now();
    let max_tokens = limits::prompt_token_limit(state).0;
    let param = match &job {
        TokenizeJob::Text(_) => "prompt",
        TokenizeJob::Chat(_) => "messages",
    };
    // The size of the text the tokenizer reads: a chat's estimated as
    // rendered (its template adds to every message, empty ones included).
    let chars = match &job {
        TokenizeJob::Text(t) => t.len(),
        TokenizeJob::Chat(m) => rendered_size_estimate(m),
    };
    let routing = state.models.for_request(&state.shared.adapters, model);
    let Some(tokenizer) = routing.tokenizer.clone() else {
        return Ok(PromptIds {
            ids: Vec::new(),
            estimated: Some(crate::models::ModelRouting::estimated_tokens(chars)),
        });
    };
    let run = move || match job {
        TokenizeJob::Text(t) => tokenizer.encode_within(&t, max_tokens),
        TokenizeJob::Chat(m) => tokenizer.encode_chat_within(&m, max_tokens),
    };
    let result = if chars <= INLINE_CHARS {
        run()
    } else {
        tokio::task::spawn_blocking(run)
            .await
            .map_err(|_| ApiError::internal("the tokenizer task failed"))?
    };
    state
        .shared
        .metrics()
        .tokenize
        .observe(started.elapsed().as_secs_f64());
    let ids = result
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}"), None))?
        .ok_or_else(|| limits::prompt_too_long(state, param))?;
    Ok(PromptIds {
        ids,
        estimated: None,
    })
}

enum TokenizeJob {
    Text(String),
    Chat(Vec<ChatMessage>),
}

/// Charges a request to its key's token limit ([`crate::ratelimit`]):
/// `prompt_tokens` of all its `prompts`, and what it `asked` for each.
fn charge_tokens(
    state: &AppState,
    key: Option<ClientKey>,
    prompt_tokens: u64,
    prompts: u64,
    asked: limits::Asked,
) -> Result<(), ApiError> {
    let credentials = &state.credentials;
    let tokens = crate::ratelimit::token_charge(
        prompt_tokens,
        prompts,
        asked.choices,
        asked.output_tokens,
        credentials.output_allowance(),
    );
    let key = key.map_or(0, |ClientKey(k)| k);
    credentials
        .rate_limits()
        .check_tokens(key, tokens)
        .map_err(ApiError::from)
}

/// The session a request belongs to: the `x-session-id` header, else the
/// body's `session_id` (empty: none). With client keys configured a
/// session is the client key's own ([`SessionKey::namespaced`] by the
/// key's name), so a client cannot hold back another's session by naming
/// its id; without, every client shares one space of ids.
fn session_key(
    state: &AppState,
    headers: &HeaderMap,
    body_session: Option<&str>,
    key: Option<ClientKey>,
) -> Option<SessionKey> {
    let id = headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .or(body_session)
        .filter(|s| !s.is_empty())?;
    match key.and_then(|k| state.credentials.key_name(k)) {
        Some(name) => Some(SessionKey::namespaced(name, id)),
        None => Some(SessionKey::from_client_id(id)),
    }
}

/// A handler's request: its head's headers and client key, its body read
/// whole. The headers are moved out of the request, not copied (axum's
/// `HeaderMap` extractor clones them), and the body, already read by the
/// upload layer, is taken as the one buffer it is.
async fn request_parts(
    state: &AppState,
    request: Request,
) -> (HeaderMap, Option<ClientKey>, Result<Bytes, ApiError>) {
    let (parts, body) = request.into_parts();
    let key = parts.extensions.get::<ClientKey>().copied();
    let body = read_body(state, body).await;
    (parts.headers, key, body)
}

async fn chat_completions(State(state): State<Shared>, request: Request) -> Response {
    let arrival = Instant::now();
    let (headers, key, body) = request_parts(&state, request).await;
    let result = async {
        let body = body?;
        let (parsed, asked) = limits::parse_chat(&state, &body)?;
        let messages = chat_messages(parsed.messages)?;
        let prompt = tokenize(&state, parsed.model.as_deref(), TokenizeJob::Chat(messages)).await?;
        charge_tokens(&state, key, prompt.len() as u64, 1, asked)?;
        let facts = Parsed {
            model: parsed.model,
            stream: parsed.stream,
            session: parsed.session_id,
            key,
            tokens: prompt.ids,
            estimated_tokens: prompt.estimated,
        };
        Ok::<_, ApiError>((body, facts))
    }
    .await;
    finish(state, headers, "/v1/chat/completions", arrival, result).await
}

async fn completions(State(state): State<Shared>, request: Request) -> Response {
    let arrival = Instant::now();
    let (headers, key, body) = request_parts(&state, request).await;
    let result = async {
        let body = body?;
        let (parsed, asked) = limits::parse_completion(&state, &body)?;
        // A batch is routed by its first prompt: one worker serves it all.
        // Token ids were bounded while parsing; text while tokenized (a
        // batch's later texts are the worker's to judge).
        let model = parsed.model.as_deref();
        let ids = |ids| PromptIds {
            ids,
            estimated: None,
        };
        let prompt = match parsed.prompt {
            Prompt::Tokens(i) => ids(i),
            Prompt::TokenBatches(batch) => ids(batch.into_iter().next().unwrap_or_default()),
            Prompt::Text(text) => tokenize(&state, model, TokenizeJob::Text(text)).await?,
            Prompt::Texts(texts) => match texts.into_iter().next() {
                Some(text) => tokenize(&state, model, TokenizeJob::Text(text)).await?,
                None => ids(Vec::new()),
            },
        };
        // Every prompt of a batch is charged: token ids as counted while
        // parsing, later texts (not tokenized here) by the estimate used
        // for a model without a tokenizer.
        let later = parsed.later_prompts;
        let later_tokens = later.token_ids.saturating_add(u64::from(
            crate::models::ModelRouting::estimated_tokens(
                usize::try_from(later.text_bytes).unwrap_or(usize::MAX),
            ),
        ));
        let prompt_tokens = (prompt.len() as u64).saturating_add(later_tokens);
        charge_tokens(&state, key, prompt_tokens, 1 + later.count, asked)?;
        let facts = Parsed {
            model: parsed.model,
            stream: parsed.stream,
            session: parsed.session_id,
            key,
            tokens: prompt.ids,
            estimated_tokens: prompt.estimated,
        };
        Ok::<_, ApiError>((body, facts))
    }
    .await;
    finish(state, headers, "/v1/completions", arrival, result).await
}

async fn finish(
    state: Shared,
    headers: HeaderMap,
    path: &'static str,
    arrival: Instant,
    parsed: Result<(Bytes, Parsed), ApiError>,
) -> Response {
    let metrics = state.shared.metrics().clone();
    // A request dropped before its response head (the client went away,
    // or shutdown) is counted `Cancelled` once, by the in-flight
    // middleware ([`super::inflight`]), not here.
    let response = match parsed {
        Ok((body, facts)) => proxy(state, headers, path, arrival, body, facts).await,
        Err(e) => Err(e),
    };
    match response {
        Ok(response) => response,
        Err(e) => {
            metrics.count_request(match e.status {
                StatusCode::TOO_MANY_REQUESTS => RequestStatus::Rejected,
                s if s.is_server_error() => RequestStatus::Unavailable,
                _ => RequestStatus::Invalid,
            });
            e.into_response()
        }
    }
}

async fn proxy(
    state: Shared,
    headers: HeaderMap,
    path: &'static str,
    arrival: Instant,
    body: Bytes,
    facts: Parsed,
) -> Result<Response, ApiError> {
    let session = session_key(&state, &headers, facts.session.as_deref(), facts.key);
    if let Some(mode) = state.disagg {
        if state.shared.disaggregated() {
            return super::disagg::serve(
                mode,
                state,
                &headers,
                Delivery {
                    path,
                    arrival,
                    prompt: facts.tokens,
                    estimated_prompt_tokens: facts.estimated_tokens,
                    original: body,
                    stream: facts.stream,
                },
                facts.model,
                session,
            )
            .await;
        }
    }
    let request_id = state.shared.next_request_id();
    let deadline = tokio::time::Instant::from_std(arrival) + state.request_timeout;
    let mut facts = facts;
    let attempts = Attempts::new(
        state.clone(),
        request_id,
        facts.model.take(),
        headers.get(header::ACCEPT).cloned(),
        deadline,
    )
    .estimated_prompt(facts.estimated_tokens);
    first_phase(attempts, session, path, arrival, body, facts).await
}

/// Attempts until one worker produces a first event (streaming) or a whole
/// response (non-streaming); each failure reports the worker and moves the
/// request elsewhere (still its session's turn), up to the migration limit.
/// The request timeout bounds every wait: for placement (a 504, no worker
/// to blame) and for the worker's answer (a 504, and the worker reported
/// when it had the request for at least the first-token timeout: a worker
/// that accepts requests and never answers them must not stay
/// selectable).
async fn first_phase(
    mut attempts: Attempts,
    session: Option<SessionKey>,
    path: &'static str,
    arrival: Instant,
    body: Bytes,
    facts: Parsed,
) -> Result<Response, ApiError> {
    let state = attempts.state.clone();
    let prompt_tokens = facts.tokens.len() as u64;
    let deadline = attempts.deadline;
    let wait = attempts.submit(&facts.tokens, session)?;
    let placed = tokio::time::timeout_at(deadline, attempts.placed(wait)).await;
    let mut booking = match placed {
        Ok(placed) => placed?,
        Err(_) => return Err(queue_timeout(&attempts)),
    };
    loop {
        let sent_at = tokio::time::Instant::now();
        let attempt = async {
            let sent = attempts
                .send(&booking, path, body.clone(), facts.stream)
                .await;
            match sent {
                Ok(response) if facts.stream && response.status().is_success() => {
                    first_event(&attempts, &booking.name, response).await
                }
                Ok(response) => buffered(&attempts, response).await,
                Err(e) => Err(e),
            }
        };
        let answered = tokio::time::timeout_at(deadline, attempt).await;
        let Ok(outcome) = answered else {
            // The upstream request is dropped with the booking.
            let fair = sent_at.elapsed() >= state.first_token_timeout;
            return Err(attempts.timed_out_on(booking, fair));
        };
        match outcome {
            Ok(answer) => {
                return Ok(deliver(
                    attempts,
                    booking,
                    answer,
                    Delivery {
                        path,
                        arrival,
                        prompt: facts.tokens,
                        estimated_prompt_tokens: facts.estimated_tokens,
                        original: body,
                        stream: facts.stream,
                    },
                ))
            }
            Err(AttemptError::Fatal(e)) => return Err(e),
            Err(AttemptError::Retry(reason, detail)) => {
                tracing::warn!(request = %attempts.client_id, worker = %booking.name, reason = reason.label(), %detail, "attempt failed before the first token");
                let progress = Progress::default();
                match attempts.fail(
                    booking,
                    reason,
                    Phase::BeforeFirstToken,
                    prompt_tokens,
                    &progress,
                    Ok(()),
                ) {
                    Ok(failed) => {
                        let moved =
                            tokio::time::timeout_at(deadline, attempts.migrate(failed, None)).await;
                        booking = match moved {
                            Ok(moved) => moved?,
                            Err(_) => return Err(queue_timeout(&attempts)),
                        };
                    }
                    Err(give_up) => {
                        return Err(ApiError::bad_gateway(format!("{detail}; {give_up}")))
                    }
                }
            }
        }
    }
}

/// 404 for a path no route matches (its body is never read).
async fn no_route(State(state): State<Shared>, uri: axum::http::Uri) -> ApiError {
    let admin = uri.path() == "/admin" || uri.path().starts_with("/admin/");
    if admin && !state.admin_api {
        ApiError::not_found(
            "no such route: the admin API is off (start the router with --admin-token)",
            None,
        )
    } else {
        ApiError::not_found("no such route", None)
    }
}

async fn models(State(state): State<Shared>) -> Result<Response, ApiError> {
    let mut names: Vec<String> = state
        .shared
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
    for (id, parent) in state.shared.adapters.listed() {
        data.push(serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "switchyard", "parent": parent}));
    }
    Ok(axum::Json(serde_json::json!({"object": "list", "data": data})).into_response())
}

async fn ready(State(state): State<Shared>) -> Response {
    let up = state
        .shared
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

async fn metrics(State(state): State<Shared>) -> Response {
    let mut out = String::with_capacity(16 * 1024);
    match prometheus_text::encode(&mut out, &state.registry) {
        Ok(()) => ([(header::CONTENT_TYPE, prometheus_text::CONTENT_TYPE)], out).into_response(),
        Err(_) => ApiError::internal("cannot encode the metrics").into_response(),
    }
}

async fn admin_list(State(state): State<Shared>) -> Result<Response, ApiError> {
    let list: Vec<Value> = state
        .shared
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
                "active_requests": state.shared.active_requests(w.id),
                // What the router read of the worker (null: not reported).
                "max_model_len": state.fleet.model_len_of(w.id),
                "capacity": w.capacity,
                "kv_usage": w.kv_usage,
                "adapter_slots": state.shared.adapter_slots_of(w.id),
            })
        })
        .collect();
    Ok(axum::Json(serde_json::json!({ "workers": list })).into_response())
}

async fn admin_add(State(state): State<Shared>, request: Request) -> Result<Response, ApiError> {
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
    State(state): State<Shared>,
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
    use crate::metrics::ServerMetrics;
    use crate::shared::SharedRouter;
    use crate::tokenize::PromptTokenizer;
    use crate::workers::{upstream_client, Fleet};
    use crate::ServerConfig;
    use http_body_util::BodyExt as _;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use switchyard_core::admission::{
        Admission, AdmissionStrategy, LifecycleEvent, MakeReady, Placement, RequestFacts,
    };
    use switchyard_core::dispatch::Dispatcher;
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
    ) -> (Shared, Arc<SharedRouter>) {
        let dispatcher = Dispatcher::new(crate::dispatcher_config(config), Some(strategy)).unwrap();
        let shared = Arc::new(SharedRouter::new(
            dispatcher,
            Arc::new(ServerMetrics::new(config.policy.name())),
        ));
        let id = shared.add_worker("w", url).unwrap();
        shared.set_in_router(id, true);
        let client = upstream_client(Duration::from_secs(1));
        let fleet = Arc::new(Fleet::new(
            shared.clone(),
            client.clone(),
            false,
            config.block_size,
            3,
            Duration::from_secs(1),
        ));
        let state = Arc::new(AppState::new(
            config,
            shared.clone(),
            fleet,
            client,
            Arc::new(NoText),
            None,
        ));
        (state, shared)
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
        let (state, shared) = state_with_worker(&config, &url, Box::new(strategy));
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
        assert_eq!(shared.total_active_requests(), 0);
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
