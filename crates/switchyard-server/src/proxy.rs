//! The HTTP surface: OpenAI endpoints proxied to the chosen worker, the
//! operational endpoints and the admin API.
//!
//! One request: check the key → read the body (limit) → parse only the
//! fields routing needs → tokenize (chat template for chat) → block hashes
//! → admission and selection ([`SharedRouter::submit`]) → forward the
//! client's bytes unchanged to the worker → wait for its first event
//! (streaming) or its whole answer (non-streaming, buffered up to
//! `max_response_bytes`). A worker that fails before that point (refused,
//! reset, 5xx, first-token timeout) is reported, its booking freed, and the
//! request retried elsewhere ([`Attempts`]); a stream then flows through
//! [`MigratingStream`], which resumes it on another worker if it breaks.
//! The whole request is bounded by the request timeout (504).

use super::attempt::{AttemptError, Attempts};
use super::booking::Booking;
use super::config::WorkerSpec;
use super::error::ApiError;
use super::metrics::RequestStatus;
use super::migration::{Failure, MigrationPolicy, Phase, Progress};
use super::shared::SharedRouter;
use super::stream::{MigratingStream, StreamStart};
use super::tokenize::{PromptTokenizer, INLINE_CHARS};
use super::workers::{Fleet, UpstreamClient};
use axum::body::Body;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router as AxumRouter;
use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use prometheus_client::encoding::prometheus_text;
use prometheus_client::registry::Registry;
use serde::Deserialize;
use serde_json::Value;
use std::sync::Arc;
use std::time::{Duration, Instant};
use switchyard_core::admission::SessionKey;
use switchyard_tokenizer::ChatMessage;
use switchyard_wire::openai::{
    Api, ChatCompletionRequest, CompletionRequest, Message, MessageContent, Prompt,
};
use switchyard_wire::sse::{classify, Chunk, SseParser};

/// Largest single SSE event the router accepts from a worker.
pub const MAX_EVENT_BYTES: usize = 256 * 1024;

/// Header naming the worker that served a response.
pub const WORKER_HEADER: &str = "x-switchyard-worker";

/// Everything a handler reads.
pub struct AppState {
    /// Routing state.
    pub shared: Arc<SharedRouter>,
    /// Workers.
    pub fleet: Arc<Fleet>,
    /// Upstream client.
    pub client: UpstreamClient,
    /// Tokenizer for routing.
    pub tokenizer: Arc<dyn PromptTokenizer>,
    /// What `/metrics` encodes: the router's families and the routing
    /// state ([`SharedRouter::register_metrics`]) and the KV-event plane's.
    pub registry: Registry,
    /// Router block size.
    pub block_size: u32,
    /// Seed of block hashes (no LoRA, no salt).
    pub hash_seed: u64,
    /// Add `x-switchyard-worker`.
    pub worker_header: bool,
    /// Client keys (empty: none required).
    pub api_keys: Vec<String>,
    /// Admin token (none: admin API off).
    pub admin_token: Option<String>,
    /// Body limit.
    pub max_body_bytes: usize,
    /// Migration limits.
    pub migration: MigrationPolicy,
    /// Wait for a worker's headers and first event (and each next event).
    pub first_token_timeout: Duration,
    /// A request's total time.
    pub request_timeout: Duration,
    /// Largest buffered (non-streaming) response.
    pub max_response_bytes: usize,
    /// This replica's id for upstream requests, while replica sync is on.
    pub router_id: Option<HeaderValue>,
}

impl AppState {
    /// The state of a router configured by `config` (already validated);
    /// `router_id` is this replica's id while replica sync is on.
    pub fn new(
        config: &super::ServerConfig,
        shared: Arc<SharedRouter>,
        fleet: Arc<Fleet>,
        client: UpstreamClient,
        tokenizer: Arc<dyn PromptTokenizer>,
        router_id: Option<HeaderValue>,
    ) -> Self {
        let mut registry = Registry::default();
        shared.register_metrics(&mut registry);
        fleet.kv_metrics.register(&mut registry);
        Self {
            shared,
            fleet,
            client,
            tokenizer,
            registry,
            block_size: config.block_size,
            hash_seed: switchyard_core::hashing::seed_for(None, None),
            worker_header: config.worker_header,
            api_keys: config.api_keys.clone(),
            admin_token: config.admin_token.clone(),
            max_body_bytes: config.max_body_bytes,
            migration: MigrationPolicy {
                limit: config.migration_limit,
                max_seq_len: config.migration_max_seq_len,
            },
            first_token_timeout: Duration::from_secs_f64(config.first_token_timeout_secs),
            request_timeout: Duration::from_secs_f64(config.request_timeout_secs),
            max_response_bytes: config.max_response_bytes,
            router_id,
        }
    }
}

pub(crate) type Shared = Arc<AppState>;

/// The axum router for `state`.
pub fn app(state: Shared) -> AxumRouter {
    let limit = state.max_body_bytes;
    AxumRouter::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { "ok" }))
        .route("/ready", get(ready))
        .route("/metrics", get(metrics))
        .route("/admin/workers", get(admin_list).post(admin_add))
        .route("/admin/workers/{name}", delete(admin_remove))
        .fallback(|| async { ApiError::not_found("no such route", None) })
        .layer(axum::extract::DefaultBodyLimit::max(limit))
        .with_state(state)
}

fn check_key(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    if state.api_keys.is_empty() {
        return Ok(());
    }
    let given = bearer(headers).ok_or_else(ApiError::unauthorized)?;
    if state.api_keys.iter().any(|k| k == given) {
        Ok(())
    } else {
        Err(ApiError::unauthorized())
    }
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

fn body_bytes(body: Result<Bytes, BytesRejection>, limit: usize) -> Result<Bytes, ApiError> {
    body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::too_large(limit)
        } else {
            ApiError::bad_request("could not read the request body", None)
        }
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
    session: Option<String>,
    tokens: Vec<u32>,
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

async fn tokenize(state: &AppState, job: TokenizeJob) -> Result<Vec<u32>, ApiError> {
    let started = Instant::now();
    let chars = match &job {
        TokenizeJob::Text(t) => t.len(),
        TokenizeJob::Chat(m) => m.iter().map(|m| m.content.len()).sum(),
    };
    let tokenizer = state.tokenizer.clone();
    let run = move || match job {
        TokenizeJob::Text(t) => tokenizer.encode(&t),
        TokenizeJob::Chat(m) => tokenizer.encode_chat(&m),
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
    result.map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}"), None))
}

enum TokenizeJob {
    Text(String),
    Chat(Vec<ChatMessage>),
}

async fn chat_completions(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = Instant::now();
    let result = async {
        check_key(&state, &headers)?;
        let body = body_bytes(body, state.max_body_bytes)?;
        let parsed: ChatCompletionRequest = parse(&body)?;
        let messages = chat_messages(parsed.messages)?;
        let tokens = tokenize(&state, TokenizeJob::Chat(messages)).await?;
        let facts = Parsed {
            model: parsed.model,
            stream: parsed.stream,
            session: parsed.session_id,
            tokens,
        };
        Ok::<_, ApiError>((body, facts))
    }
    .await;
    finish(state, headers, "/v1/chat/completions", arrival, result).await
}

async fn completions(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let arrival = Instant::now();
    let result = async {
        check_key(&state, &headers)?;
        let body = body_bytes(body, state.max_body_bytes)?;
        let parsed: CompletionRequest = parse(&body)?;
        // A batch is routed by its first prompt: one worker serves it all.
        let tokens = match parsed.prompt {
            Prompt::Tokens(ids) => ids,
            Prompt::TokenBatches(batch) => batch.into_iter().next().unwrap_or_default(),
            Prompt::Text(text) => tokenize(&state, TokenizeJob::Text(text)).await?,
            Prompt::Texts(texts) => match texts.into_iter().next() {
                Some(text) => tokenize(&state, TokenizeJob::Text(text)).await?,
                None => Vec::new(),
            },
        };
        let facts = Parsed {
            model: parsed.model,
            stream: parsed.stream,
            session: parsed.session_id,
            tokens,
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
    let request_id = state.shared.next_request_id();
    let session = headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or(facts.session.clone())
        .filter(|s| !s.is_empty())
        .map(|s| SessionKey::from_client_id(&s));
    let deadline = tokio::time::Instant::from_std(arrival) + state.request_timeout;
    let attempts = Attempts::new(
        state.clone(),
        request_id,
        facts.model.clone(),
        headers.get(header::ACCEPT).cloned(),
        deadline,
    );
    let metrics = state.shared.metrics().clone();
    let timeout = state.request_timeout;
    match tokio::time::timeout_at(
        deadline,
        first_phase(attempts, session, path, arrival, body, facts),
    )
    .await
    {
        Ok(result) => result,
        Err(_) => {
            metrics.request_timeouts.inc();
            tracing::info!(request = %request_id, "request timed out before its first token: upstream cancelled");
            Err(ApiError::timeout(timeout))
        }
    }
}

/// Attempts until one worker produces a first event (streaming) or a whole
/// response (non-streaming); each failure reports the worker and moves the
/// request elsewhere (still its session's turn), up to the migration limit.
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
    let wait = attempts.submit(&facts.tokens, session)?;
    let mut booking = attempts.placed(wait).await?;
    loop {
        let sent = attempts
            .send(&booking, path, body.clone(), facts.stream)
            .await;
        let outcome = match sent {
            Ok(response) if facts.stream && response.status().is_success() => {
                first_event(&attempts, &booking.name, response).await
            }
            Ok(response) => buffered(&attempts, response).await,
            Err(e) => Err(e),
        };
        match outcome {
            Ok(Answer::Buffered(parts, bytes)) => {
                let ok = parts.status.is_success();
                let mut booking = booking;
                booking.mark_first_token();
                state
                    .shared
                    .metrics()
                    .ttft
                    .observe(arrival.elapsed().as_secs_f64());
                if ok {
                    // The session's context grows by what was generated.
                    let completion = completion_tokens(&bytes);
                    booking.progress(completion);
                    booking.completed(prompt_tokens.saturating_add(completion));
                }
                state.shared.metrics().count_request(if ok {
                    RequestStatus::Ok
                } else {
                    RequestStatus::WorkerError
                });
                let parts = attempts.client_parts(parts, &booking);
                log_dispatch(&booking, &attempts, prompt_tokens, facts.stream);
                return Ok(Response::from_parts(parts, Body::from(bytes)));
            }
            Ok(Answer::Stream(parts, upstream, parser, first)) => {
                let parts = attempts.client_parts(parts, &booking);
                log_dispatch(&booking, &attempts, prompt_tokens, facts.stream);
                let api = if path == "/v1/chat/completions" {
                    Api::Chat
                } else {
                    Api::Completions
                };
                let stream = MigratingStream::new(StreamStart {
                    attempts,
                    api,
                    booking,
                    upstream,
                    parser,
                    first,
                    prompt: facts.tokens,
                    original: body,
                    arrival,
                });
                return Ok(Response::from_parts(parts, stream.into_body()));
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
                    Ok(failed) => booking = attempts.migrate(failed, None).await?,
                    Err(give_up) => {
                        return Err(ApiError::bad_gateway(format!("{detail}; {give_up}")))
                    }
                }
            }
        }
    }
}

fn log_dispatch(booking: &Booking, attempts: &Attempts, prompt_tokens: u64, stream: bool) {
    tracing::debug!(
        request = %attempts.client_id,
        worker = %booking.name,
        prompt_tokens,
        overlap_blocks = booking.overlap_blocks,
        waited_ms = booking.waited_ms,
        migrations = attempts.migrations,
        stream,
        "dispatched"
    );
}

/// `usage.completion_tokens` of a whole (non-streaming) answer; 0 when the
/// worker sent none. Only that field is parsed.
fn completion_tokens(body: &[u8]) -> u64 {
    #[derive(Deserialize)]
    struct Usage {
        #[serde(default)]
        completion_tokens: u64,
    }
    #[derive(Deserialize)]
    struct Answer {
        usage: Option<Usage>,
    }
    serde_json::from_slice::<Answer>(body)
        .ok()
        .and_then(|a| a.usage)
        .map_or(0, |u| u.completion_tokens)
}

/// A successful attempt.
enum Answer {
    /// A whole response (non-streaming, or an error status passed through).
    Buffered(hyper::http::response::Parts, Bytes),
    /// A stream whose first event has arrived.
    Stream(hyper::http::response::Parts, Incoming, SseParser, String),
}

/// Reads a streaming response up to its first complete event, within the
/// first-token timeout.
async fn first_event(
    attempts: &Attempts,
    worker: &str,
    response: hyper::Response<Incoming>,
) -> Result<Answer, AttemptError> {
    let (parts, mut upstream) = response.into_parts();
    let mut parser = SseParser::new(MAX_EVENT_BYTES);
    let read = async {
        loop {
            match parser.next_event() {
                Ok(Some(event)) => return Ok(event),
                Ok(None) => {}
                Err(e) => return Err(AttemptError::Retry(Failure::Reset, e.to_string())),
            }
            match upstream.frame().await {
                Some(Ok(frame)) => {
                    if let Ok(data) = frame.into_data() {
                        parser.push(&data);
                    }
                }
                Some(Err(_)) => {
                    return Err(AttemptError::Retry(
                        Failure::Reset,
                        "the worker's stream broke before its first event".into(),
                    ))
                }
                None => {
                    return Err(AttemptError::Retry(
                        Failure::Reset,
                        "the worker's stream ended before its first event".into(),
                    ))
                }
            }
        }
    };
    let timeout = attempts.state.first_token_timeout;
    let first = tokio::time::timeout(timeout, read).await.map_err(|_| {
        AttemptError::Retry(
            Failure::Timeout,
            format!(
                "worker {worker} sent no first event within {:.1} s",
                timeout.as_secs_f64()
            ),
        )
    })??;
    if classify(&first) == Chunk::Error {
        return Err(AttemptError::Retry(
            Failure::Status5xx,
            format!("worker {worker} answered with an error event"),
        ));
    }
    Ok(Answer::Stream(parts, upstream, parser, first))
}

/// Buffers a whole response (bounded by `max_response_bytes`).
async fn buffered(
    attempts: &Attempts,
    response: hyper::Response<Incoming>,
) -> Result<Answer, AttemptError> {
    let limit = attempts.state.max_response_bytes;
    let (parts, upstream) = response.into_parts();
    match http_body_util::Limited::new(upstream, limit).collect().await {
        Ok(body) => Ok(Answer::Buffered(parts, body.to_bytes())),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(AttemptError::Fatal(ApiError::bad_gateway(format!(
                "the worker's response exceeds the router's limit of {limit} bytes (--max-response-bytes)"
            ))))
        }
        Err(_) => Err(AttemptError::Retry(
            Failure::Reset,
            "the worker's response broke before it was complete".into(),
        )),
    }
}

async fn models(State(state): State<Shared>, headers: HeaderMap) -> Result<Response, ApiError> {
    check_key(&state, &headers)?;
    let mut names: Vec<String> = state
        .shared
        .workers()
        .into_iter()
        .filter(|w| w.in_router)
        .flat_map(|w| w.models)
        .collect();
    names.sort();
    names.dedup();
    let data: Vec<Value> = names
        .into_iter()
        .map(|id| serde_json::json!({"id": id, "object": "model", "created": 0, "owned_by": "switchyard"}))
        .collect();
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

fn check_admin(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    match &state.admin_token {
        None => Err(ApiError::not_found(
            "the admin API is off (start the router with --admin-token)",
            None,
        )),
        Some(token) if bearer(headers) == Some(token.as_str()) => Ok(()),
        Some(_) => Err(ApiError::unauthorized()),
    }
}

async fn admin_list(State(state): State<Shared>, headers: HeaderMap) -> Result<Response, ApiError> {
    check_admin(&state, &headers)?;
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
                "active_requests": state.shared.active_requests(w.id),
            })
        })
        .collect();
    Ok(axum::Json(serde_json::json!({ "workers": list })).into_response())
}

async fn admin_add(
    State(state): State<Shared>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    check_admin(&state, &headers)?;
    let body = body_bytes(body, state.max_body_bytes)?;
    let spec: WorkerSpec = parse(&body)?;
    state
        .fleet
        .add(&spec)
        .map_err(|e| ApiError::bad_request(e, None))?;
    let fleet = state.fleet.clone();
    tokio::spawn(async move { fleet.check_all().await });
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
    headers: HeaderMap,
    Path(name): Path<String>,
    Query(query): Query<RemoveQuery>,
) -> Result<Response, ApiError> {
    check_admin(&state, &headers)?;
    if state.fleet.remove(&name, query.drain) {
        Ok(StatusCode::NO_CONTENT.into_response())
    } else {
        Err(ApiError::not_found(
            format!("no worker named {name:?}"),
            None,
        ))
    }
}
