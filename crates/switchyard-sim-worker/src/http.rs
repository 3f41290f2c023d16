//! The sim-worker's OpenAI-compatible HTTP surface.
//!
//! Bodies are parsed from bytes into the wire crate's OpenAI types
//! ([`switchyard_wire::openai`]) so that every malformed request gets an
//! OpenAI-style error body ([`ErrorBody`]) with the right status, never a
//! panic or a plain-text reply; answers and chunks are written with the
//! same types the router reads. Prompt contents never reach logs or
//! metrics.

use super::disagg::{self, DisaggConfig, DisaggProtocol, LeaseHandle, Plan, Transfers};
use super::driver::{Capture, DriverHandle, GenEvent};
use super::metrics::{DisaggFailure, Metrics};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::stream::{self, Stream};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::{json, Value};
use std::borrow::Cow;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};
use switchyard_core::hashing::{seed_for, DEFAULT_SEED};
use switchyard_core::{ReplicaId, RequestId};
use switchyard_engine::scheduler::AdmitError;
use switchyard_engine::{EngineConfig, FinishReason, NewRequest};
use switchyard_replica::{routed_request_id, WorkerMarks, REQUEST_ID_HEADER, ROUTER_ID_HEADER};
use switchyard_tokenizer::{Tokenizer, WordVocabulary};
use switchyard_wire::openai::{
    Api, ChatCompletionRequest, Choice, ChoiceDelta, ChoiceMessage, Completion, CompletionRequest,
    ErrorBody, MessageContent, Prompt, Usage,
};
use tokio::sync::mpsc;

/// Everything a handler needs.
#[derive(Clone)]
pub struct WorkerState {
    /// Served model name.
    pub model: Arc<str>,
    /// The engine's configuration (for info endpoints and limits).
    pub config: Arc<EngineConfig>,
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// How generated tokens are written; the engine draws from its
    /// vocabulary ([`OutputText::vocabulary`]).
    pub output_text: OutputText,
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
    /// Prefill/decode disaggregation (`--disagg`), when on.
    pub disagg: Option<Arc<DisaggState>>,
    /// LoRA adapters (`--max-loras`, [`crate::adapters`]).
    pub adapters: Arc<crate::adapters::Adapters>,
    /// Data-parallel ranks (`--dp-size` > 1); `None`: one engine, the
    /// `driver` and `metrics` above.
    pub ranks: Option<Arc<crate::ranks::Ranks>>,
    /// Stored responses (`/v1/responses`, [`crate::agentic`]).
    pub responses: Arc<crate::response_store::ResponseStore>,
}

/// What the handlers need for `--disagg`.
#[derive(Debug)]
pub struct DisaggState {
    /// The configuration.
    pub config: Arc<DisaggConfig>,
    /// The decode side's client.
    pub transfers: Transfers,
    /// This worker's engine id (`remote_engine_id`).
    pub engine_id: Arc<str>,
    /// Where decode workers reach this one (`remote_host`, `remote_port`).
    pub advertise: std::net::SocketAddr,
}

/// The router of every endpoint but the agentic APIs'
/// ([`crate::agentic::router`], merged beside it by the caller).
pub fn router(state: WorkerState) -> Router {
    Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/tokenize", post(tokenize))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .route("/health", get(health))
        .route("/health_generate", get(health_generate))
        .route("/get_server_info", get(server_info))
        .route("/get_model_info", get(model_info))
        .route("/metrics", get(metrics))
        .route("/debug/kv_cache", get(kv_cache))
        .fallback(not_found)
        .with_state(state)
}

/// `app` answering with `server: uvicorn` on every response, as vLLM's
/// and SGLang's API servers (uvicorn) do: a header of the engine's own,
/// which a router facing outside clients does not pass on.
pub fn engine_server_header(app: Router) -> Router {
    app.layer(axum::middleware::map_response(
        |mut response: Response| async move {
            response
                .headers_mut()
                .insert(header::SERVER, header::HeaderValue::from_static("uvicorn"));
            response
        },
    ))
}

/// `app` requiring `Authorization: Bearer KEY` (`--api-key`) on every
/// route but `/metrics`, as an engine started with an API key does: a
/// missing or wrong key gets a 401 before the body is read.
pub fn require_key(app: Router, key: &str) -> Router {
    let key: Arc<[u8]> = key.as_bytes().into();
    app.layer(axum::middleware::from_fn(
        move |request: axum::extract::Request, next: axum::middleware::Next| {
            let key = key.clone();
            async move {
                use subtle::ConstantTimeEq as _;
                let given = request
                    .headers()
                    .get(header::AUTHORIZATION)
                    .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
                    .map(<[u8]>::trim_ascii);
                let ok = given.is_some_and(|g| bool::from(g.ct_eq(&key)));
                if ok || request.uri().path() == "/metrics" {
                    next.run(request).await
                } else {
                    ErrorReply::from(ErrorBody::authentication(
                        "invalid or missing API key (Authorization: Bearer ...)",
                    ))
                    .into_response()
                }
            }
        },
    ))
}

/// An OpenAI-style error reply: the wire body and the status its `code`
/// names.
#[derive(Debug)]
pub struct ErrorReply {
    status: StatusCode,
    body: ErrorBody,
}

impl From<ErrorBody> for ErrorReply {
    fn from(body: ErrorBody) -> Self {
        let status = body
            .status()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Self { status, body }
    }
}

impl ErrorReply {
    /// The error's body.
    pub fn into_body(self) -> ErrorBody {
        self.body
    }
}

impl IntoResponse for ErrorReply {
    fn into_response(self) -> Response {
        (self.status, Json(self.body)).into_response()
    }
}

impl From<AdmitError> for ErrorReply {
    fn from(err: AdmitError) -> Self {
        let message = err.to_string();
        match err {
            AdmitError::QueueFull(_) => ErrorBody::overloaded(message),
            AdmitError::Duplicate(_) => ErrorBody::internal(message),
            AdmitError::NoOutput => ErrorBody::invalid_request(message, Some("max_tokens")),
            AdmitError::EmptyPrompt | AdmitError::TooLong { .. } => {
                ErrorBody::invalid_request(message, Some("prompt"))
            }
            AdmitError::HybridTransfer => {
                ErrorBody::invalid_request(message, Some("kv_transfer_params"))
            }
        }
        .into()
    }
}

async fn not_found() -> ErrorReply {
    ErrorBody::not_found("no such endpoint", None).into()
}

fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ErrorReply> {
    serde_json::from_slice(body)
        .map_err(|e| ErrorBody::invalid_request(format!("invalid request body: {e}"), None).into())
}

/// This worker generates one choice per request.
fn check_n(n: u32) -> Result<(), ErrorReply> {
    if n == 1 {
        Ok(())
    } else {
        Err(ErrorBody::invalid_request(
            format!("n = {n} is not supported; this worker generates one choice per request"),
            Some("n"),
        )
        .into())
    }
}

struct Job {
    api: Api,
    id: RequestId,
    /// The router's id for the request, when a replica-syncing router
    /// sent it: marked at the first token.
    routed: Option<(ReplicaId, RequestId)>,
    model: Arc<str>,
    /// The LoRA adapter it runs under (`None`: the base model): its KV is
    /// the adapter's own, hashed with the adapter's seed and published
    /// under its name.
    lora_name: Option<Arc<str>>,
    created: u64,
    stream: bool,
    include_usage: bool,
    /// Add `token_ids` to choices.
    return_token_ids: bool,
    output_text: OutputText,
    /// The client's `X-Request-Id`.
    client_id: Option<String>,
    /// A vLLM prefill: the answer carries `kv_transfer_params`.
    vllm_prefill: bool,
}

impl WorkerState {
    /// The model a request names: the base (`None` too) or a loaded LoRA
    /// adapter, as the name to answer with and the adapter (`None`: the
    /// base); anything else is a 404.
    fn check_model(&self, model: Option<&str>) -> Result<(Arc<str>, Option<Arc<str>>), ErrorReply> {
        match model {
            Some(m) if m != &*self.model && self.adapters.touch(m) => {
                let name: Arc<str> = m.into();
                Ok((name.clone(), Some(name)))
            }
            Some(m) if m != &*self.model => Err(ErrorBody::new(
                404,
                "invalid_request_error",
                format!(
                    "the model `{m}` does not exist; this worker serves `{}`",
                    self.model
                ),
            )
            .with_param("model")
            .into()),
            _ => Ok((self.model.clone(), None)),
        }
    }

    /// The state a generation request runs with: with data-parallel
    /// ranks, the rank its `X-data-parallel-rank` names or the worker's
    /// balancer picks; a 400 for a header naming no rank of this worker.
    fn on_rank(self, headers: &HeaderMap) -> Result<Self, ErrorReply> {
        let Some(ranks) = &self.ranks else {
            crate::ranks::requested_rank(headers, 1)?;
            return Ok(self);
        };
        let rank = ranks.choose(headers)?.clone();
        Ok(Self {
            driver: rank.driver,
            metrics: rank.metrics,
            ..self
        })
    }

    pub(crate) fn request_id(&self) -> RequestId {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        RequestId((u128::from(self.id_salt) << 64) | u128::from(n))
    }
}

/// The router's request id, when the request carries a replica-syncing
/// router's identity headers.
fn routed(headers: &HeaderMap) -> Option<(ReplicaId, RequestId)> {
    let text = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
    routed_request_id(text(ROUTER_ID_HEADER), text(REQUEST_ID_HEADER))
}

/// What a request asks of this worker's disaggregation (`Plain` when off);
/// a malformed field is a 400 and a counted failure.
fn disagg_plan(state: &WorkerState, body: &Bytes) -> Result<Plan, ErrorReply> {
    let Some(d) = &state.disagg else {
        return Ok(Plan::Plain);
    };
    let max_blocks = state.config.max_model_len / state.config.block_size + 1;
    disagg::plan(&d.config, body, max_blocks).map_err(|e| {
        state
            .metrics
            .count_disagg_failure(DisaggFailure::InvalidParams);
        ErrorBody::invalid_request(e.message, Some(e.param)).into()
    })
}

/// `X-Request-Id` when it is a short printable id (vLLM's proxy sends
/// the same one to the prefill and the decode worker).
fn client_request_id(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-request-id")
        .and_then(|v| v.to_str().ok())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.bytes().all(|b| b.is_ascii_graphic()))
        .map(str::to_owned)
}

async fn completions(
    State(state): State<WorkerState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ErrorReply> {
    let state = state.on_rank(&headers)?;
    let plan = disagg_plan(&state, &body)?;
    let body: CompletionRequest = parse(&body)?;
    let (model, lora_name) = state.check_model(body.model.as_deref())?;
    check_n(body.n()?)?;
    let include_usage = body.include_usage()?;
    let return_token_ids = body.return_token_ids()?;
    let max_tokens = body.max_tokens()?;
    let prompt = match body.prompt {
        Prompt::Tokens(ids) => ids,
        Prompt::Text(text) => encode(&state, text).await?,
        Prompt::TokenBatches(mut batch) if batch.len() == 1 => batch.remove(0),
        Prompt::Texts(mut texts) if texts.len() == 1 => encode(&state, texts.remove(0)).await?,
        Prompt::Texts(_) | Prompt::TokenBatches(_) => {
            return Err(ErrorBody::invalid_request(
                "batched prompts are not supported; send one prompt per request",
                Some("prompt"),
            )
            .into())
        }
    };
    let job = Job {
        api: Api::Completions,
        id: state.request_id(),
        routed: routed(&headers),
        model,
        lora_name,
        created: unix_now(),
        stream: body.stream,
        include_usage,
        return_token_ids,
        output_text: state.output_text.clone(),
        client_id: client_request_id(&headers),
        vllm_prefill: false,
    };
    let max_tokens = max_tokens.unwrap_or(state.default_max_tokens);
    run(state, job, prompt, max_tokens, plan).await
}

async fn chat_completions(
    State(state): State<WorkerState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ErrorReply> {
    let state = state.on_rank(&headers)?;
    let plan = disagg_plan(&state, &body)?;
    let body: ChatCompletionRequest = parse(&body)?;
    let (model, lora_name) = state.check_model(body.model.as_deref())?;
    check_n(body.n()?)?;
    let include_usage = body.include_usage()?;
    let return_token_ids = body.return_token_ids()?;
    let max_tokens = body.max_tokens()?.unwrap_or(state.default_max_tokens);
    // The worker's reading: text, or text parts only (it has no encoder
    // for anything else), read as the router reads them.
    let text_only = body.messages.iter().all(|m| match &m.content {
        Some(MessageContent::Parts(parts)) => parts.iter().all(|p| p.is_text()),
        _ => true,
    });
    if !text_only {
        return Err(ErrorBody::invalid_request(
            "only text content parts are supported",
            Some("messages"),
        )
        .into());
    }
    // An assistant turn's tool calls are rendered, as vLLM (and the
    // router, which must hash the same ids) renders them.
    let messages = switchyard_tokenizer::render::chat_messages(body.messages)
        .map_err(|e| ErrorBody::invalid_request(e.to_string(), Some("messages")))?;
    let tools = body.tools;
    let tokenizer = state.tokenizer.clone();
    let prompt = tokio::task::spawn_blocking(move || {
        // With the declared tools, where the template renders them.
        let text = tokenizer.apply_chat_template_with_tools(&messages, tools.as_ref(), true)?;
        tokenizer.encode(&text)
    })
    .await
    .map_err(|_| ErrorBody::internal("tokenizer task failed"))?
    .map_err(|e| ErrorBody::invalid_request(e.to_string(), Some("messages")))?;
    let job = Job {
        api: Api::Chat,
        id: state.request_id(),
        routed: routed(&headers),
        model,
        lora_name,
        created: unix_now(),
        stream: body.stream,
        include_usage,
        return_token_ids,
        output_text: state.output_text.clone(),
        client_id: client_request_id(&headers),
        vllm_prefill: false,
    };
    run(state, job, prompt, max_tokens, plan).await
}

async fn encode(state: &WorkerState, text: String) -> Result<Vec<u32>, ErrorReply> {
    let tokenizer = state.tokenizer.clone();
    tokio::task::spawn_blocking(move || tokenizer.encode(&text))
        .await
        .map_err(|_| ErrorBody::internal("tokenizer task failed"))?
        .map_err(|e| ErrorBody::invalid_request(e.to_string(), Some("prompt")).into())
}

async fn run(
    state: WorkerState,
    mut job: Job,
    prompt: Vec<u32>,
    max_tokens: u32,
    plan: Plan,
) -> Result<Response, ErrorReply> {
    if max_tokens == 0 {
        return Err(AdmitError::NoOutput.into());
    }
    let limit = state.config.max_model_len as u32;
    let mut request = NewRequest {
        id: job.id,
        prompt,
        max_tokens: max_tokens.min(limit),
        // vLLM hashes an adapter's blocks with the adapter: as the router
        // does (`seed_for(lora_name, cache_salt)`), so that its prediction
        // and the published blocks agree.
        hash_seed: seed_for(job.lora_name.as_deref(), None),
        lora_name: job.lora_name.clone(),
    };
    let stopped = || ErrorReply::from(ErrorBody::overloaded("the engine has stopped"));
    let mut rx = match (plan, &state.disagg) {
        (Plan::Prefill { room }, Some(d)) => {
            if d.config.protocol == DisaggProtocol::Vllm {
                if job.stream {
                    state
                        .metrics
                        .count_disagg_failure(DisaggFailure::InvalidParams);
                    return Err(ErrorBody::invalid_request(
                        "a prefill for a remote decode (do_remote_decode) is answered whole:                          send stream false",
                        Some("stream"),
                    )
                    .into());
                }
                job.vllm_prefill = true;
            }
            // The prefill computes the prompt and one token, as vLLM's and
            // SGLang's prefill workers do; the decode worker generates.
            request.max_tokens = 1;
            let capture = Capture {
                token: rand::random::<u128>(),
                room,
            };
            state
                .driver
                .submit_capturing(request, Some(capture))
                .await
                .ok_or_else(stopped)?
        }
        (Plan::Decode(source), Some(d)) => {
            let id = request.id;
            let (rx, admitted) = state
                .driver
                .submit_rendezvous(request)
                .await
                .ok_or_else(stopped)?;
            // Refused (a full queue): the lease stays at the prefill
            // worker for a retry elsewhere.
            let own_blocks = admitted?;
            // The transfer runs on its own: a client hanging up meanwhile
            // is noticed at its first token, and the lease is still
            // released.
            let transfers = d.transfers.clone();
            let driver = state.driver.clone();
            tokio::spawn(async move {
                match transfers.pull(&source, own_blocks).await {
                    Ok(pulled) => driver.deliver(id, pulled.kv, pulled.release).await,
                    Err(error) => driver.transfer_failed(id, error).await,
                }
            });
            rx
        }
        _ => state.driver.submit(request).await.ok_or_else(stopped)?,
    };
    // The first event tells whether the engine took the request.
    let first = rx
        .recv()
        .await
        .ok_or_else(|| ErrorReply::from(ErrorBody::internal("the engine dropped the request")))?;
    match first {
        GenEvent::Rejected(err) => return Err(err.into()),
        GenEvent::TransferFailed(err) => return Err(err.error_body().into()),
        GenEvent::Finished {
            reason: FinishReason::RestoreFailed,
            ..
        } => {
            return Err(ErrorBody::upstream(
                "the transferred KV does not hold this request's prompt",
            )
            .into())
        }
        _ => {}
    }
    if let (Some(marks), Some((router, id)), GenEvent::Token { .. }) =
        (&state.marks, job.routed, &first)
    {
        // Never blocks; a full queue drops and counts the mark.
        let _ = marks.prefill_completed(router, id);
    }
    if job.stream {
        Ok(stream_response(job, first, rx).into_response())
    } else {
        collect_response(job, first, rx, state.disagg.as_deref()).await
    }
}

/// The `kv_transfer_params` of a vLLM prefill's answer: naming this
/// worker's lease, or `null` when nothing was captured (a prompt shorter
/// than a block: the decode worker computes it all).
fn prefill_answer(
    job: &Job,
    disagg: Option<&DisaggState>,
    captured: Option<(switchyard_engine::lease::LeaseRef, Vec<u64>)>,
    refused: Option<DisaggFailure>,
) -> Result<Value, ErrorReply> {
    match (captured, refused, disagg) {
        (Some((lease, block_ids)), _, Some(d)) => {
            let request_id = job
                .client_id
                .clone()
                .unwrap_or_else(|| format!("{}-{}", job.api.id_prefix(), job.id));
            Ok(disagg::prefill_params(
                d.advertise.ip(),
                d.advertise.port(),
                &d.engine_id,
                &request_id,
                LeaseHandle(lease),
                &block_ids,
            ))
        }
        (None, Some(DisaggFailure::NothingCached), _) => Ok(Value::Null),
        _ => Err(ErrorBody::overloaded(
            "the prefill's KV could not be held for a remote decode (the lease table is full)",
        )
        .into()),
    }
}

/// How the worker writes a generated token as text.
#[derive(Clone, Debug)]
pub enum OutputText {
    /// The tokenizer's word tokens, which the engine draws from: any
    /// answer re-encodes to exactly its ids.
    Words(Arc<WordVocabulary>),
    /// A fixed word per id, for a tokenizer without enough word tokens:
    /// the text re-encodes to other ids, and usually another count.
    FixedWords,
}

impl OutputText {
    /// The ids the engine must draw output tokens from (`None`: any).
    pub fn vocabulary(&self) -> Option<Arc<[u32]>> {
        match self {
            Self::Words(words) => Some(words.ids().into()),
            Self::FixedWords => None,
        }
    }

    /// The text of generated token `token`. An id outside the word
    /// vocabulary (the engine never draws one) gets its fixed word.
    pub fn of(&self, token: u32) -> &str {
        match self {
            Self::Words(words) => words.text(token).unwrap_or_else(|| fixed_word(token)),
            Self::FixedWords => fixed_word(token),
        }
    }
}

/// A fixed word per token id, when the tokenizer has no word vocabulary.
fn fixed_word(token: u32) -> &'static str {
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

fn usage(prompt_tokens: usize, cached_tokens: usize, output_tokens: usize) -> Usage {
    Usage::new(
        prompt_tokens as u64,
        cached_tokens as u64,
        output_tokens as u64,
    )
}

/// An answer or chunk of `job` with `choices`.
fn completion<'a>(job: &'a Job, object: &'static str, choices: Vec<Choice<'a>>) -> Completion<'a> {
    Completion {
        id: Cow::Owned(format!("{}-{}", job.api.id_prefix(), job.id)),
        object: Cow::Borrowed(object),
        created: job.created,
        model: Cow::Borrowed(&job.model),
        choices,
        usage: None,
    }
}

async fn collect_response(
    job: Job,
    first: GenEvent,
    mut rx: mpsc::Receiver<GenEvent>,
    disagg: Option<&DisaggState>,
) -> Result<Response, ErrorReply> {
    let mut text = String::new();
    let mut token_ids = Vec::new();
    let mut captured = None;
    let mut refused = None;
    let mut event = Some(first);
    loop {
        match event.take() {
            Some(GenEvent::Captured { lease, block_ids }) => captured = Some((lease, block_ids)),
            Some(GenEvent::CaptureRefused(why)) => refused = Some(why),
            Some(GenEvent::TransferFailed(err)) => return Err(err.error_body().into()),
            Some(GenEvent::Token { token, .. }) => {
                text.push_str(job.output_text.of(token));
                token_ids.push(token);
            }
            Some(GenEvent::Finished {
                reason: FinishReason::RestoreFailed,
                ..
            }) => {
                return Err(ErrorBody::internal(
                    "the engine cancelled the request: a host-tier restore failed",
                )
                .into())
            }
            Some(GenEvent::Finished {
                reason,
                prompt_tokens,
                cached_tokens,
                output_tokens,
            }) => {
                let finish_reason = Some(Cow::Borrowed(finish_reason(reason)));
                let token_ids = job.return_token_ids.then_some(token_ids);
                let choice = match job.api {
                    Api::Completions => Choice {
                        text: Some(Cow::Owned(text)),
                        finish_reason,
                        token_ids,
                        ..Choice::default()
                    },
                    Api::Chat => Choice {
                        message: Some(ChoiceMessage {
                            role: Cow::Borrowed("assistant"),
                            content: Some(Cow::Owned(text)),
                        }),
                        finish_reason,
                        token_ids,
                        ..Choice::default()
                    },
                };
                let body = Completion {
                    usage: Some(usage(prompt_tokens, cached_tokens, output_tokens)),
                    ..completion(&job, job.api.object(), vec![choice])
                };
                if !job.vllm_prefill {
                    return Ok(Json(body).into_response());
                }
                let params = prefill_answer(&job, disagg, captured, refused)?;
                let mut body = serde_json::to_value(&body)
                    .map_err(|_| ErrorBody::internal("answer serialization failed"))?;
                body["kv_transfer_params"] = params;
                return Ok(Json(body).into_response());
            }
            Some(GenEvent::Rejected(err)) => return Err(err.into()),
            None => {}
        }
        event = Some(rx.recv().await.ok_or_else(|| {
            ErrorReply::from(ErrorBody::internal("the engine dropped the request"))
        })?);
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
        usage: Usage,
    },
    Done,
    Closed,
}

fn chunk<'a>(
    job: &'a Job,
    token: Option<u32>,
    role: bool,
    finish: Option<&'static str>,
) -> Completion<'a> {
    let text = token.map(|t| Cow::Borrowed(job.output_text.of(t)));
    let mut choice = Choice {
        finish_reason: finish.map(Cow::Borrowed),
        token_ids: token.filter(|_| job.return_token_ids).map(|t| vec![t]),
        ..Choice::default()
    };
    match job.api {
        Api::Completions => choice.text = Some(text.unwrap_or_default()),
        Api::Chat => {
            choice.delta = Some(ChoiceDelta {
                role: role.then_some(Cow::Borrowed("assistant")),
                content: text,
            })
        }
    }
    completion(job, job.api.chunk_object(), vec![choice])
}

fn usage_chunk(job: &Job, usage: Usage) -> Completion<'_> {
    Completion {
        usage: Some(usage),
        ..completion(job, job.api.chunk_object(), Vec::new())
    }
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
                let mut event = match pending.take() {
                    Some(e) => Some(e),
                    None => rx.recv().await,
                };
                // A streamed prefill (SGLang's, whose answer the router
                // discards) says nothing of its capture.
                while let Some(GenEvent::Captured { .. } | GenEvent::CaptureRefused(_)) = event {
                    event = rx.recv().await;
                }
                match event {
                    Some(GenEvent::Token { token, .. }) => {
                        let data = chunk(&job, Some(token), !started && job.api == Api::Chat, None);
                        Some((
                            Event::default().data(data.to_json()),
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
                    | Some(GenEvent::TransferFailed(_))
                    | Some(GenEvent::Captured { .. })
                    | Some(GenEvent::CaptureRefused(_))
                    | None => {
                        let data = ErrorBody::internal("the engine cancelled the request");
                        Some((Event::default().data(data.to_json()), StreamState::Done))
                    }
                    Some(GenEvent::Finished {
                        reason,
                        prompt_tokens,
                        cached_tokens,
                        output_tokens,
                    }) => {
                        let data = chunk(&job, None, false, Some(finish_reason(reason))).to_json();
                        let next = if job.include_usage {
                            StreamState::Usage {
                                usage: usage(prompt_tokens, cached_tokens, output_tokens),
                                job,
                            }
                        } else {
                            StreamState::Done
                        };
                        Some((Event::default().data(data), next))
                    }
                }
            }
            StreamState::Usage { job, usage } => Some((
                Event::default().data(usage_chunk(&job, usage).to_json()),
                StreamState::Done,
            )),
            StreamState::Done => Some((Event::default().data("[DONE]"), StreamState::Closed)),
            StreamState::Closed => None,
        }
    });
    Sse::new(events.map(Ok::<Event, Infallible>)).keep_alive(KeepAlive::default())
}

async fn models(State(state): State<WorkerState>) -> Json<Value> {
    let mut data = vec![json!({
        "id": &*state.model,
        "object": "model",
        "created": 0,
        "owned_by": "switchyard",
        "root": &*state.model,
        "max_model_len": state.config.max_model_len,
    })];
    // LoRA adapters as vLLM lists them: `parent` names the base model.
    for (name, path) in state.adapters.list() {
        data.push(json!({
            "id": &*name,
            "object": "model",
            "created": 0,
            "owned_by": "switchyard",
            "root": &*path,
            "parent": &*state.model,
        }));
    }
    Json(json!({ "object": "list", "data": data }))
}

/// vLLM's `POST /tokenize` body for a text prompt. Its
/// `add_special_tokens` is accepted and changes nothing: the bundled
/// tokenizer adds no special token (Qwen3 has no BOS), so the ids are
/// those a completion of the prompt reads.
#[derive(serde::Deserialize)]
struct TokenizeRequest {
    #[serde(default)]
    model: Option<String>,
    prompt: String,
}

/// vLLM's `POST /tokenize` (text prompts only): the prompt's token ids as
/// a completion of it would read them, `{"count", "max_model_len",
/// "tokens"}`. The router asks it to check that it tokenizes as the
/// engine does.
async fn tokenize(
    State(state): State<WorkerState>,
    body: Bytes,
) -> Result<Json<Value>, ErrorReply> {
    let body: TokenizeRequest = parse(&body)?;
    state.check_model(body.model.as_deref())?;
    let tokens = encode(&state, body.prompt).await?;
    Ok(Json(json!({
        "count": tokens.len(),
        "max_model_len": state.config.max_model_len,
        "tokens": tokens,
    })))
}

/// vLLM's load/unload body (`lora_int_id` is accepted and ignored).
#[derive(serde::Deserialize)]
struct LoraBody {
    lora_name: Option<String>,
    lora_path: Option<String>,
}

fn lora_body(state: &WorkerState, body: &Bytes) -> Result<LoraBody, ErrorReply> {
    parse::<LoraBody>(body).inspect_err(|_| {
        state.metrics.lora_load_failures.inc();
    })
}

async fn load_lora_adapter(
    State(state): State<WorkerState>,
    body: Bytes,
) -> Result<Response, ErrorReply> {
    let body = lora_body(&state, &body)?;
    let text = state
        .adapters
        .load(body.lora_name.as_deref(), body.lora_path.as_deref())
        .await
        .map_err(ErrorReply::from)?;
    Ok((StatusCode::OK, text).into_response())
}

async fn unload_lora_adapter(
    State(state): State<WorkerState>,
    body: Bytes,
) -> Result<Response, ErrorReply> {
    let body: LoraBody = parse(&body)?;
    let text = state
        .adapters
        .unload(body.lora_name.as_deref())
        .map_err(ErrorReply::from)?;
    Ok((StatusCode::OK, text).into_response())
}

async fn health() -> StatusCode {
    StatusCode::OK
}

async fn health_generate(State(state): State<WorkerState>) -> Result<StatusCode, ErrorReply> {
    let request = NewRequest {
        id: state.request_id(),
        prompt: vec![151_644, 872, 198],
        max_tokens: 1,
        hash_seed: DEFAULT_SEED,
        lora_name: None,
    };
    let mut rx = state
        .driver
        .submit(request)
        .await
        .ok_or_else(|| ErrorReply::from(ErrorBody::overloaded("the engine has stopped")))?;
    while let Some(event) = rx.recv().await {
        match event {
            GenEvent::Finished {
                reason: FinishReason::Length,
                ..
            } => return Ok(StatusCode::OK),
            GenEvent::Token { .. } | GenEvent::Captured { .. } | GenEvent::CaptureRefused(_) => {}
            GenEvent::Rejected(err) => return Err(err.into()),
            GenEvent::Finished { .. } | GenEvent::TransferFailed(_) => break,
        }
    }
    Err(ErrorReply::from(ErrorBody::overloaded(
        "the engine did not generate",
    )))
}

async fn server_info(State(state): State<WorkerState>) -> Json<Value> {
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
        // Not in vLLM's API (its --max-loras is a start-up flag): what a
        // router reads to respect this worker's adapter slots.
        "max_loras": state.adapters.max_loras(),
        // SGLang's name: its data-parallel ranks (each with the blocks
        // above).
        "dp_size": state.ranks.as_ref().map_or(1, |r| r.len()),
    }))
}

async fn model_info(State(state): State<WorkerState>) -> Json<Value> {
    Json(json!({
        "model_path": &*state.model,
        "tokenizer_path": &*state.model,
        "is_generation": true,
        "max_model_len": state.config.max_model_len,
    }))
}

async fn metrics(State(state): State<WorkerState>) -> Response {
    (
        [(header::CONTENT_TYPE, super::metrics::CONTENT_TYPE)],
        match &state.ranks {
            Some(ranks) => ranks.encode_metrics(),
            None => state.metrics.encode(),
        },
    )
        .into_response()
}

/// The worker's cached blocks by engine hash, per tier: what a subscriber's
/// index should hold once it has applied every published event.
async fn kv_cache(State(state): State<WorkerState>) -> Result<Json<Value>, ErrorReply> {
    let cached = state
        .driver
        .snapshot()
        .await
        .ok_or_else(|| ErrorReply::from(ErrorBody::overloaded("the engine has stopped")))?;
    let tier = |m: switchyard_engine::Medium| -> Vec<u64> {
        cached
            .blocks
            .iter()
            .filter(|(medium, _)| *medium == m)
            .map(|(_, h)| h.0)
            .collect()
    };
    Ok(Json(json!({
        "block_size": state.config.block_size,
        "device": tier(switchyard_engine::Medium::Device),
        "host": tier(switchyard_engine::Medium::Host),
        "ssm_checkpoints": cached.ssm_checkpoints.iter().map(|h| h.0).collect::<Vec<u64>>(),
    })))
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}
