//! The HTTP surface: OpenAI endpoints proxied to the chosen worker, the
//! operational endpoints and the admin API.
//!
//! One request: check the key → read the body (limit) → parse only the
//! fields routing needs → tokenize (chat template for chat) → block hashes
//! → admission and selection ([`SharedRouter::submit`]) → forward the
//! client's bytes unchanged to the worker → stream the worker's response
//! back frame by frame through [`ObservedBody`], which marks the first
//! token, records latencies and, when dropped, frees the booking.

use super::config::WorkerSpec;
use super::error::ApiError;
use super::metrics::RequestStatus;
use super::state::{Booking, SharedRouter, Submission, SubmitError};
use super::tokenize::{PromptTokenizer, INLINE_CHARS};
use super::workers::{Fleet, UpstreamClient};
use axum::body::Body;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::Router as AxumRouter;
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame, SizeHint};
use http_body_util::Full;
use serde::Deserialize;
use serde_json::Value;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;
use switchyard_core::admission::SessionKey;
use switchyard_tokenizer::ChatMessage;
use switchyard_wire::openai::Prompt;

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
    /// Policy name for metrics.
    pub policy: &'static str,
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
    /// This replica's id for upstream requests, while replica sync is on.
    pub router_id: Option<HeaderValue>,
}

type Shared = Arc<AppState>;

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

#[derive(Deserialize)]
struct ChatBody {
    model: Option<String>,
    messages: Vec<ChatMessageBody>,
    #[serde(default)]
    stream: bool,
    session_id: Option<String>,
}

#[derive(Deserialize)]
struct ChatMessageBody {
    role: String,
    #[serde(default)]
    content: Option<Value>,
}

#[derive(Deserialize)]
struct CompletionBody {
    model: Option<String>,
    prompt: Prompt,
    #[serde(default)]
    stream: bool,
    session_id: Option<String>,
}

/// The routing facts of one request.
struct Parsed {
    model: Option<String>,
    stream: bool,
    session: Option<String>,
    tokens: Vec<u32>,
}

fn chat_messages(body: Vec<ChatMessageBody>) -> Result<Vec<ChatMessage>, ApiError> {
    if body.is_empty() {
        return Err(ApiError::bad_request(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    let mut messages = Vec::with_capacity(body.len());
    for m in body {
        let content = match m.content {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s,
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for part in parts {
                    // Non-text parts (images) do not change the text prefix.
                    if let Some(t) = part.get("text").and_then(Value::as_str) {
                        text.push_str(t);
                    }
                }
                text
            }
            Some(_) => {
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
        .metrics
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
        let parsed: ChatBody = parse(&body)?;
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
        let parsed: CompletionBody = parse(&body)?;
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
    let metrics = state.shared.metrics.clone();
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
    let blocks = switchyard_core::hashing::local_block_hashes(
        &facts.tokens,
        state.block_size as usize,
        state.hash_seed,
    );
    let session = headers
        .get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
        .or(facts.session)
        .filter(|s| !s.is_empty())
        .map(|s| SessionKey::from_client_id(&s));
    let prompt_tokens = u32::try_from(facts.tokens.len()).unwrap_or(u32::MAX);
    let wait = state
        .shared
        .submit(
            request_id,
            Submission {
                blocks,
                prompt_tokens,
                session,
                model: facts.model.as_deref(),
            },
        )
        .map_err(|e| match e {
            SubmitError::QueueFull { retry_after_ms } => ApiError::queue_full(retry_after_ms),
            SubmitError::UnknownModel => ApiError::not_found(
                format!(
                    "the model `{}` is not served by any worker",
                    facts.model.as_deref().unwrap_or_default()
                ),
                Some("model"),
            ),
        })?;
    let booking = wait
        .placed()
        .await
        .map_err(|()| ApiError::no_workers("no worker can take the request"))?;
    let uri = format!("{}{}", booking.url, path);
    let mut upstream = Request::builder()
        .method(Method::POST)
        .uri(uri)
        .header(header::CONTENT_TYPE, "application/json")
        .header("x-request-id", request_id.to_string());
    if let Some(router_id) = &state.router_id {
        upstream = upstream.header(crate::replica::ROUTER_ID_HEADER, router_id.clone());
    }
    if let Some(accept) = headers.get(header::ACCEPT) {
        upstream = upstream.header(header::ACCEPT, accept);
    }
    let upstream = upstream
        .body(Full::new(body))
        .map_err(|_| ApiError::internal("cannot build the upstream request"))?;
    let response = match state.client.request(upstream).await {
        Ok(r) => r,
        Err(e) => {
            if e.is_connect() {
                booking.worker_failed();
            }
            tracing::warn!(request = %request_id, worker = %booking.name, error = %e, "upstream request failed");
            return Err(ApiError::bad_gateway(format!(
                "worker {} failed: {}",
                booking.name,
                if e.is_connect() {
                    "connection refused"
                } else {
                    "request failed"
                }
            )));
        }
    };
    let (mut parts, incoming) = response.into_parts();
    for name in [
        header::CONNECTION,
        header::TRANSFER_ENCODING,
        HeaderName::from_static("keep-alive"),
    ] {
        parts.headers.remove(name);
    }
    if state.worker_header {
        if let Ok(v) = HeaderValue::from_str(&booking.name) {
            parts.headers.insert(WORKER_HEADER, v);
        }
    }
    if let Ok(v) = HeaderValue::from_str(&request_id.to_string()) {
        parts.headers.insert("x-request-id", v);
    }
    tracing::debug!(
        request = %request_id,
        worker = %booking.name,
        prompt_tokens,
        overlap_blocks = booking.overlap_blocks,
        waited_ms = booking.waited_ms,
        status = parts.status.as_u16(),
        stream = facts.stream,
        "dispatched"
    );
    let observed = ObservedBody {
        inner: incoming,
        booking,
        state: state.clone(),
        arrival,
        last_frame: None,
        chunks: 0,
        prompt_tokens: u64::from(prompt_tokens),
        status_ok: parts.status.is_success(),
        stream: facts.stream,
        done: false,
    };
    Ok(Response::from_parts(parts, Body::new(observed)))
}

/// The worker's response body on its way to the client, frame by frame
/// (nothing is buffered). Owns the [`Booking`]: when the client goes away
/// axum drops this body, which drops the upstream connection (cancelling
/// the worker's request) and frees the booking.
struct ObservedBody {
    inner: hyper::body::Incoming,
    booking: Booking,
    state: Shared,
    arrival: Instant,
    last_frame: Option<Instant>,
    chunks: u64,
    prompt_tokens: u64,
    status_ok: bool,
    stream: bool,
    done: bool,
}

impl ObservedBody {
    fn end(&mut self, status: RequestStatus) {
        if self.done {
            return;
        }
        self.done = true;
        if status == RequestStatus::Ok {
            self.booking.completed(self.prompt_tokens + self.chunks);
        }
        self.state.shared.metrics.count_request(status);
    }
}

impl HttpBody for ObservedBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let Some(data) = frame.data_ref() {
                    let now = Instant::now();
                    let metrics = &this.state.shared.metrics;
                    match this.last_frame {
                        None => {
                            this.booking.mark_first_token();
                            metrics.ttft.observe((now - this.arrival).as_secs_f64());
                        }
                        Some(last) if this.stream => {
                            metrics.itl.observe((now - last).as_secs_f64())
                        }
                        Some(_) => {}
                    }
                    this.last_frame = Some(now);
                    this.chunks += if this.stream { count_events(data) } else { 0 };
                    this.booking.progress(this.chunks);
                }
            }
            Poll::Ready(None) => this.end(if this.status_ok {
                RequestStatus::Ok
            } else {
                RequestStatus::WorkerError
            }),
            Poll::Ready(Some(Err(_))) => this.end(RequestStatus::Unavailable),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

impl Drop for ObservedBody {
    fn drop(&mut self) {
        if !self.done {
            self.done = true;
            self.state
                .shared
                .metrics
                .count_request(RequestStatus::Cancelled);
            tracing::debug!(request = %self.booking.id(), "client went away: upstream cancelled");
        }
    }
}

/// SSE events in a chunk (each `data:` line is one streamed delta).
fn count_events(data: &[u8]) -> u64 {
    data.windows(5).filter(|w| *w == b"data:").count() as u64
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
    state.shared.metrics.render(&mut out, state.policy);
    state.shared.render_gauges(&mut out);
    state
        .shared
        .with_core(|core| super::replica::render(core, &mut out));
    out.push_str(&state.fleet.kv_metrics.render_prometheus());
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
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
