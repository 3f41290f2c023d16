//! The sim-worker's OpenAI-compatible HTTP surface.
//!
//! Bodies are parsed by hand from bytes so that every malformed request gets
//! an OpenAI-style error body (`{"error": {"message", "type", "param",
//! "code"}}`) with the right status, never a panic or a plain-text reply.
//! Prompt contents never reach logs or metrics.

use super::driver::{DriverHandle, GenEvent};
use super::metrics::Metrics;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use switchyard_core::hashing::DEFAULT_SEED;
use switchyard_core::RequestId;
use switchyard_engine::scheduler::AdmitError;
use switchyard_engine::{EngineConfig, FinishReason, NewRequest};
use switchyard_replica::{routed_request_id, WorkerMarks, REQUEST_ID_HEADER, ROUTER_ID_HEADER};
use switchyard_tokenizer::{ChatMessage, Tokenizer};
use switchyard_wire::openai::Prompt;
use tokio::sync::mpsc;

/// Everything a handler needs.
#[derive(Clone)]
pub struct AppState {
    /// Served model name.
    pub model: Arc<str>,
    /// The engine's configuration (for info endpoints and limits).
    pub config: Arc<EngineConfig>,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// The driver.
    pub driver: DriverHandle,
    /// Metrics.
    pub metrics: Arc<Metrics>,
    /// `max_tokens` when a request gives none.
    pub default_max_tokens: u32,
    /// Source of request ids.
    pub next_id: Arc<AtomicU64>,
    /// Random high bits of request ids (unique across restarts).
    pub id_salt: u64,
    /// Replica-sync marks (`--replica-sync`), when on.
    pub marks: Option<Arc<WorkerMarks>>,
}

/// The router of every endpoint.
pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/health_generate", get(health_generate))
        .route("/get_server_info", get(server_info))
        .route("/get_model_info", get(model_info))
        .route("/metrics", get(metrics))
        .route("/debug/kv_cache", get(kv_cache))
        .fallback(not_found)
        .with_state(state)
}

/// An OpenAI-style error reply.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    kind: &'static str,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            kind: "invalid_request_error",
            message: message.into(),
            param,
        }
    }

    fn unavailable(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::SERVICE_UNAVAILABLE,
            kind: "server_overloaded",
            message: message.into(),
            param: None,
        }
    }

    fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            kind: "internal_error",
            message: message.into(),
            param: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status.as_u16(),
            }
        });
        (self.status, Json(body)).into_response()
    }
}

impl From<AdmitError> for ApiError {
    fn from(err: AdmitError) -> Self {
        match err {
            AdmitError::QueueFull(_) => ApiError::unavailable(err.to_string()),
            AdmitError::Duplicate(_) => ApiError::internal(err.to_string()),
            AdmitError::NoOutput => ApiError::bad_request(err.to_string(), Some("max_tokens")),
            AdmitError::EmptyPrompt | AdmitError::TooLong { .. } => {
                ApiError::bad_request(err.to_string(), Some("prompt"))
            }
        }
    }
}

async fn not_found() -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        kind: "not_found_error",
        message: "no such endpoint".into(),
        param: None,
    }
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: bool,
}

#[derive(Deserialize)]
struct CompletionBody {
    model: Option<String>,
    prompt: Prompt,
    max_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    /// vLLM's flag: each streamed choice carries the `token_ids` it adds.
    #[serde(default)]
    return_token_ids: bool,
}

#[derive(Deserialize)]
struct ChatBody {
    model: Option<String>,
    messages: Vec<ChatMessageBody>,
    max_tokens: Option<u32>,
    max_completion_tokens: Option<u32>,
    #[serde(default)]
    stream: bool,
    stream_options: Option<StreamOptions>,
    /// vLLM's flag: each streamed choice carries the `token_ids` it adds.
    #[serde(default)]
    return_token_ids: bool,
}

#[derive(Deserialize)]
struct ChatMessageBody {
    role: String,
    #[serde(default)]
    content: Option<Value>,
}

fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}"), None))
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Completions,
    Chat,
}

struct Job {
    api: Api,
    id: RequestId,
    /// The router's id for the request, when a replica-syncing router
    /// sent it: marked at the first token.
    routed: Option<RequestId>,
    model: Arc<str>,
    created: u64,
    stream: bool,
    include_usage: bool,
    /// Add `token_ids` to streamed choices.
    return_token_ids: bool,
}

impl AppState {
    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            Some(m) if m != &*self.model => Err(ApiError {
                status: StatusCode::NOT_FOUND,
                kind: "invalid_request_error",
                message: format!(
                    "the model `{m}` does not exist; this worker serves `{}`",
                    self.model
                ),
                param: Some("model"),
            }),
            _ => Ok(()),
        }
    }

    fn request_id(&self) -> RequestId {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        RequestId((u128::from(self.id_salt) << 64) | u128::from(n))
    }
}

/// The router's request id, when the request carries a replica-syncing
/// router's identity headers.
fn routed(headers: &HeaderMap) -> Option<RequestId> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    routed_request_id(text(ROUTER_ID_HEADER), text(REQUEST_ID_HEADER))
}

async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body: CompletionBody = parse(&body)?;
    state.check_model(body.model.as_deref())?;
    let prompt = match body.prompt {
        Prompt::Tokens(ids) => ids,
        Prompt::Text(text) => encode(&state, text).await?,
        Prompt::TokenBatches(mut batch) if batch.len() == 1 => batch.remove(0),
        Prompt::Texts(mut texts) if texts.len() == 1 => encode(&state, texts.remove(0)).await?,
        Prompt::Texts(_) | Prompt::TokenBatches(_) => {
            return Err(ApiError::bad_request(
                "batched prompts are not supported; send one prompt per request",
                Some("prompt"),
            ))
        }
    };
    let job = Job {
        api: Api::Completions,
        id: state.request_id(),
        routed: routed(&headers),
        model: state.model.clone(),
        created: unix_now(),
        stream: body.stream,
        include_usage: body.stream_options.is_some_and(|o| o.include_usage),
        return_token_ids: body.return_token_ids,
    };
    run(
        state.clone(),
        job,
        prompt,
        body.max_tokens.unwrap_or(state.default_max_tokens),
    )
    .await
}

async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body: ChatBody = parse(&body)?;
    state.check_model(body.model.as_deref())?;
    if body.messages.is_empty() {
        return Err(ApiError::bad_request(
            "messages must not be empty",
            Some("messages"),
        ));
    }
    let mut messages = Vec::with_capacity(body.messages.len());
    for m in body.messages {
        let content = match m.content {
            None | Some(Value::Null) => String::new(),
            Some(Value::String(s)) => s,
            Some(Value::Array(parts)) => {
                let mut text = String::new();
                for part in parts {
                    match part.get("text").and_then(Value::as_str) {
                        Some(t) if part.get("type").and_then(Value::as_str) == Some("text") => {
                            text.push_str(t)
                        }
                        _ => {
                            return Err(ApiError::bad_request(
                                "only text content parts are supported",
                                Some("messages"),
                            ))
                        }
                    }
                }
                text
            }
            Some(_) => {
                return Err(ApiError::bad_request(
                    "message content must be a string or a list of text parts",
                    Some("messages"),
                ))
            }
        };
        messages.push(ChatMessage {
            role: m.role,
            content,
        });
    }
    let tokenizer = state.tokenizer.clone();
    let prompt = tokio::task::spawn_blocking(move || {
        let text = tokenizer.apply_chat_template(&messages, true)?;
        tokenizer.encode(&text)
    })
    .await
    .map_err(|_| ApiError::internal("tokenizer task failed"))?
    .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))?;
    let job = Job {
        api: Api::Chat,
        id: state.request_id(),
        routed: routed(&headers),
        model: state.model.clone(),
        created: unix_now(),
        stream: body.stream,
        include_usage: body.stream_options.is_some_and(|o| o.include_usage),
        return_token_ids: body.return_token_ids,
    };
    let max_tokens = body
        .max_completion_tokens
        .or(body.max_tokens)
        .unwrap_or(state.default_max_tokens);
    run(state, job, prompt, max_tokens).await
}

async fn encode(state: &AppState, text: String) -> Result<Vec<u32>, ApiError> {
    let tokenizer = state.tokenizer.clone();
    tokio::task::spawn_blocking(move || tokenizer.encode(&text))
        .await
        .map_err(|_| ApiError::internal("tokenizer task failed"))?
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("prompt")))
}

async fn run(
    state: AppState,
    job: Job,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> Result<Response, ApiError> {
    if max_tokens == 0 {
        return Err(AdmitError::NoOutput.into());
    }
    let limit = state.config.max_model_len as u32;
    let request = NewRequest {
        id: job.id,
        prompt,
        max_tokens: max_tokens.min(limit),
        hash_seed: DEFAULT_SEED,
    };
    let mut rx = state
        .driver
        .submit(request)
        .await
        .ok_or_else(|| ApiError::unavailable("the engine has stopped"))?;
    // The first event tells whether the engine took the request.
    let first = rx
        .recv()
        .await
        .ok_or_else(|| ApiError::internal("the engine dropped the request"))?;
    if let GenEvent::Rejected(err) = first {
        return Err(err.into());
    }
    if let (Some(marks), Some(id), GenEvent::Token { .. }) = (&state.marks, job.routed, &first) {
        // Never blocks; a full queue drops and counts the mark.
        let _ = marks.prefill_completed(id);
    }
    if job.stream {
        Ok(stream_response(job, first, rx).into_response())
    } else {
        collect_response(job, first, rx).await
    }
}

/// Synthetic output text: a fixed word per token id.
fn token_text(token: u32) -> &'static str {
    const WORDS: [&str; 32] = [
        " the",
        " switch",
        " yard",
        " routes",
        " a",
        " request",
        " to",
        " the",
        " worker",
        " with",
        " its",
        " prefix",
        " cached",
        ",",
        " and",
        " tokens",
        " stream",
        " back",
        " in",
        " order",
        ".",
        " Blocks",
        " are",
        " evicted",
        " tail",
        " first",
        " so",
        " prefixes",
        " survive",
        " long",
        " enough",
        "\n",
    ];
    WORDS[token as usize % WORDS.len()]
}

fn finish_reason(reason: FinishReason) -> &'static str {
    match reason {
        FinishReason::Length => "length",
        FinishReason::Cancelled => "abort",
        FinishReason::RestoreFailed => "error",
    }
}

fn usage(prompt_tokens: usize, cached_tokens: usize, output_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": output_tokens,
        "total_tokens": prompt_tokens + output_tokens,
        "prompt_tokens_details": { "cached_tokens": cached_tokens },
    })
}

async fn collect_response(
    job: Job,
    first: GenEvent,
    mut rx: mpsc::Receiver<GenEvent>,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut event = Some(first);
    loop {
        match event.take() {
            Some(GenEvent::Token { token, .. }) => text.push_str(token_text(token)),
            Some(GenEvent::Finished {
                reason: FinishReason::RestoreFailed,
                ..
            }) => {
                return Err(ApiError::internal(
                    "the engine cancelled the request: a host-tier restore failed",
                ))
            }
            Some(GenEvent::Finished {
                reason,
                prompt_tokens,
                cached_tokens,
                output_tokens,
            }) => {
                let usage = usage(prompt_tokens, cached_tokens, output_tokens);
                let body = match job.api {
                    Api::Completions => json!({
                        "id": format!("cmpl-{}", job.id),
                        "object": "text_completion",
                        "created": job.created,
                        "model": &*job.model,
                        "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish_reason(reason)}],
                        "usage": usage,
                    }),
                    Api::Chat => json!({
                        "id": format!("chatcmpl-{}", job.id),
                        "object": "chat.completion",
                        "created": job.created,
                        "model": &*job.model,
                        "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": null, "finish_reason": finish_reason(reason)}],
                        "usage": usage,
                    }),
                };
                return Ok(Json(body).into_response());
            }
            Some(GenEvent::Rejected(err)) => return Err(err.into()),
            None => {}
        }
        event = Some(
            rx.recv()
                .await
                .ok_or_else(|| ApiError::internal("the engine dropped the request"))?,
        );
    }
}

enum StreamState {
    Open {
        job: Job,
        pending: Option<GenEvent>,
        rx: mpsc::Receiver<GenEvent>,
        started: bool,
    },
    Usage {
        job: Job,
        usage: Value,
    },
    Done,
    Closed,
}

fn chunk(job: &Job, token: Option<u32>, role: bool, finish: Option<&str>) -> Value {
    let delta_text = token.map(token_text);
    let mut chunk = match job.api {
        Api::Completions => json!({
            "id": format!("cmpl-{}", job.id),
            "object": "text_completion",
            "created": job.created,
            "model": &*job.model,
            "choices": [{"index": 0, "text": delta_text.unwrap_or(""), "logprobs": null, "finish_reason": finish}],
        }),
        Api::Chat => {
            let mut delta = serde_json::Map::new();
            if role {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = delta_text {
                delta.insert("content".into(), json!(t));
            }
            json!({
                "id": format!("chatcmpl-{}", job.id),
                "object": "chat.completion.chunk",
                "created": job.created,
                "model": &*job.model,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
            })
        }
    };
    if let (true, Some(token)) = (job.return_token_ids, token) {
        chunk["choices"][0]["token_ids"] = json!([token]);
    }
    chunk
}

fn usage_chunk(job: &Job, usage: Value) -> Value {
    let object = match job.api {
        Api::Completions => "text_completion",
        Api::Chat => "chat.completion.chunk",
    };
    let prefix = match job.api {
        Api::Completions => "cmpl",
        Api::Chat => "chatcmpl",
    };
    json!({
        "id": format!("{prefix}-{}", job.id),
        "object": object,
        "created": job.created,
        "model": &*job.model,
        "choices": [],
        "usage": usage,
    })
}

fn stream_response(
    job: Job,
    first: GenEvent,
    rx: mpsc::Receiver<GenEvent>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let state = StreamState::Open {
        job,
        pending: Some(first),
        rx,
        started: false,
    };
    let events = stream::unfold(state, |state| async move {
        match state {
            StreamState::Open {
                job,
                mut pending,
                mut rx,
                started,
            } => {
                let event = match pending.take() {
                    Some(e) => Some(e),
                    None => rx.recv().await,
                };
                match event {
                    Some(GenEvent::Token { token, .. }) => {
                        let data = chunk(&job, Some(token), !started && job.api == Api::Chat, None);
                        Some((
                            Event::default().data(data.to_string()),
                            StreamState::Open {
                                job,
                                pending: None,
                                rx,
                                started: true,
                            },
                        ))
                    }
                    Some(GenEvent::Finished {
                        reason: FinishReason::RestoreFailed,
                        ..
                    })
                    | Some(GenEvent::Rejected(_))
                    | None => {
                        let data = json!({"error": {"message": "the engine cancelled the request", "type": "internal_error", "param": null, "code": 500}});
                        Some((Event::default().data(data.to_string()), StreamState::Done))
                    }
                    Some(GenEvent::Finished {
                        reason,
                        prompt_tokens,
                        cached_tokens,
                        output_tokens,
                    }) => {
                        let data = chunk(&job, None, false, Some(finish_reason(reason)));
                        let next = if job.include_usage {
                            StreamState::Usage {
                                usage: usage(prompt_tokens, cached_tokens, output_tokens),
                                job,
                            }
                        } else {
                            StreamState::Done
                        };
                        Some((Event::default().data(data.to_string()), next))
                    }
                }
            }
            StreamState::Usage { job, usage } => Some((
                Event::default().data(usage_chunk(&job, usage).to_string()),
                StreamState::Done,
            )),
            StreamState::Done => Some((Event::default().data("[DONE]"), StreamState::Closed)),
            StreamState::Closed => None,
        }
    });
    Sse::new(events.map(Ok::<Event, Infallible>)).keep_alive(KeepAlive::default())
}

async fn models(State(state): State<AppState>) -> Json<Value> {
    Json(json!({
        "object": "list",
        "data": [{
            "id": &*state.model,
            "object": "model",
            "created": 0,
            "owned_by": "switchyard",
            "root": &*state.model,
            "max_model_len": state.config.max_model_len,
        }],
    }))
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn health_generate(State(state): State<AppState>) -> Result<StatusCode, ApiError> {
    let request = NewRequest {
        id: state.request_id(),
        prompt: vec![151_644, 872, 198],
        max_tokens: 1,
        hash_seed: DEFAULT_SEED,
    };
    let mut rx = state
        .driver
        .submit(request)
        .await
        .ok_or_else(|| ApiError::unavailable("the engine has stopped"))?;
    while let Some(event) = rx.recv().await {
        match event {
            GenEvent::Finished {
                reason: FinishReason::Length,
                ..
            } => return Ok(StatusCode::OK),
            GenEvent::Token { .. } => {}
            GenEvent::Rejected(err) => return Err(err.into()),
            GenEvent::Finished { .. } => break,
        }
    }
    Err(ApiError::unavailable("the engine did not generate"))
}

async fn server_info(State(state): State<AppState>) -> Json<Value> {
    let c = &state.config;
    Json(json!({
        "model_path": &*state.model,
        "served_model_name": &*state.model,
        "engine": "switchyard-sim",
        "version": env!("CARGO_PKG_VERSION"),
        "block_size": c.block_size,
        "page_size": c.block_size,
        "num_gpu_blocks": c.num_blocks,
        "num_cpu_blocks": c.host_blocks,
        "max_num_seqs": c.max_num_seqs,
        "max_running_requests": c.max_num_seqs,
        "max_num_batched_tokens": c.max_num_batched_tokens,
        "max_model_len": c.max_model_len,
        "context_length": c.max_model_len,
        "max_total_num_tokens": c.num_blocks * c.block_size,
        "speedup": c.timing.speedup,
    }))
}

async fn model_info(State(state): State<AppState>) -> Json<Value> {
    Json(json!({
        "model_path": &*state.model,
        "tokenizer_path": &*state.model,
        "is_generation": true,
        "max_model_len": state.config.max_model_len,
    }))
}

async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(),
    )
        .into_response()
}

/// The worker's cached blocks by engine hash, per tier: what a subscriber's
/// index should hold once it has applied every published event.
async fn kv_cache(State(state): State<AppState>) -> Result<Json<Value>, ApiError> {
    let cached = state
        .driver
        .snapshot()
        .await
        .ok_or_else(|| ApiError::unavailable("the engine has stopped"))?;
    let tier = |m: switchyard_engine::Medium| -> Vec<u64> {
        cached
            .iter()
            .filter(|(medium, _)| *medium == m)
            .map(|(_, h)| h.0)
            .collect()
    };
    Ok(Json(json!({
        "block_size": state.config.block_size,
        "device": tier(switchyard_engine::Medium::Device),
        "host": tier(switchyard_engine::Medium::Host),
    })))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
