//! The agentic APIs vLLM serves beside chat, as much of them as the
//! router's tests and benchmarks need: OpenAI's Responses API
//! (`POST /v1/responses`, streaming and not, stored responses continued by
//! `previous_response_id`, `GET /v1/responses/{id}`,
//! `POST /v1/responses/{id}/cancel`) and Anthropic's Messages API
//! (`POST /v1/messages`, streaming and not, and
//! `POST /v1/messages/count_tokens`).
//!
//! A request is read as its equivalent chat conversation
//! ([`switchyard_wire::agentic`], the reading the router routes by) and
//! rendered with the model's chat template, as `/v1/chat/completions`
//! renders it; the engine generates as for chat. A continued response's
//! prompt is its stored conversation (the earlier turns and their
//! answers) followed by the new input, so a chain of turns reuses its
//! cached prefix on the worker that holds it, as vLLM's does. The new
//! turn's `instructions` apply to it alone (OpenAI's rule), so they are
//! not rendered into a continued conversation.
//!
//! Stored responses live in memory ([`crate::response_store`]), at most
//! [`crate::response_store::MAX_STORED`]; the oldest is
//! forgotten first (a later `previous_response_id` naming it gets a 404).

use crate::driver::GenEvent;
use crate::http::{ErrorReply, WorkerState};
use crate::response_store::Stored;
use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use switchyard_core::hashing::seed_for;
use switchyard_engine::{FinishReason, NewRequest};
use switchyard_tokenizer::ChatMessage;
use switchyard_wire::agentic::{
    anthropic_error, MessagesRequest, ResponsesRequest, MAX_RESPONSE_ID_BYTES,
};
use switchyard_wire::agentic_events::{
    messages, response_message, response_usage, AgenticEvent, ResponsesEvents, TextItem,
};
use switchyard_wire::openai::{BodyError, BodyLimits, ErrorBody, Message};
use tokio::sync::mpsc;

/// The agentic APIs' routes, over the worker's state (merged beside
/// [`crate::http::router`]).
pub fn router(state: WorkerState) -> axum::Router {
    use axum::routing::{get, post};
    axum::Router::new()
        .route("/v1/responses", post(responses))
        .route("/v1/responses/{id}", get(get_response))
        .route("/v1/responses/{id}/cancel", post(cancel_response))
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .with_state(state)
}

/// Which API an answer is written in.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Api {
    Responses,
    Messages,
}

/// An error in the API's own shape: OpenAI's for Responses, Anthropic's
/// (`{"type":"error","error":{"type","message"}}`) for Messages.
fn error(api: Api, body: ErrorBody) -> Response {
    match api {
        Api::Responses => ErrorReply::from(body).into_response(),
        Api::Messages => {
            let status = body
                .status()
                .and_then(|s| axum::http::StatusCode::from_u16(s).ok())
                .unwrap_or(axum::http::StatusCode::INTERNAL_SERVER_ERROR);
            (
                status,
                Json(anthropic_error(status.as_u16(), &body.error.message)),
            )
                .into_response()
        }
    }
}

fn body_error(e: BodyError) -> ErrorBody {
    match e {
        BodyError::Json(e) => {
            ErrorBody::invalid_request(format!("invalid request body: {e}"), None)
        }
        BodyError::Over(o) => ErrorBody::invalid_request(
            format!("over the limit of {}", o.max),
            Some(o.limit.param()),
        ),
    }
}

/// The worker's reading of a request's chat, the router's
/// ([`switchyard_tokenizer::render::chat_messages`]); no message is none.
fn chat(messages: &[Message]) -> Result<Vec<ChatMessage>, ErrorBody> {
    if messages.is_empty() {
        return Ok(Vec::new());
    }
    switchyard_tokenizer::render::chat_messages(messages.to_vec())
        .map_err(|e| ErrorBody::invalid_request(e.to_string(), None))
}

/// The conversation's prompt ids, with the request's `tools` where the
/// template renders them (as the router renders it).
async fn render(
    state: &WorkerState,
    conversation: Vec<ChatMessage>,
    tools: Option<serde_json::Value>,
) -> Result<Vec<u32>, ErrorBody> {
    let tokenizer = state.tokenizer.clone();
    tokio::task::spawn_blocking(move || {
        let text = tokenizer.apply_chat_template_with_tools(&conversation, tools.as_ref(), true)?;
        tokenizer.encode(&text)
    })
    .await
    .map_err(|_| ErrorBody::internal("tokenizer task failed"))?
    .map_err(|e| ErrorBody::invalid_request(e.to_string(), Some("messages")))
}

/// A generation under way: its receiver and its first event.
struct Generation {
    first: Option<GenEvent>,
    rx: mpsc::Receiver<GenEvent>,
}

async fn generate(
    state: &WorkerState,
    prompt: Vec<u32>,
    max_tokens: u32,
) -> Result<Generation, ErrorBody> {
    if max_tokens == 0 {
        return Err(ErrorBody::invalid_request(
            "the output token limit must be at least 1",
            Some("max_tokens"),
        ));
    }
    let request = NewRequest {
        id: state.request_id(),
        prompt,
        max_tokens: max_tokens.min(state.config.max_model_len as u32),
        hash_seed: seed_for(None, None),
        lora_name: None,
    };
    let mut rx = state
        .driver
        .submit(request)
        .await
        .ok_or_else(|| ErrorBody::overloaded("the engine has stopped"))?;
    let first = rx
        .recv()
        .await
        .ok_or_else(|| ErrorBody::internal("the engine dropped the request"))?;
    if let GenEvent::Rejected(err) = first {
        return Err(ErrorReply::from(err).into_body());
    }
    Ok(Generation {
        first: Some(first),
        rx,
    })
}

/// What a whole generation produced.
struct Output {
    text: String,
    prompt_tokens: usize,
    cached_tokens: usize,
    output_tokens: usize,
    length: bool,
}

impl Generation {
    async fn next(&mut self) -> Option<GenEvent> {
        match self.first.take() {
            Some(e) => Some(e),
            None => self.rx.recv().await,
        }
    }

    async fn collect(mut self, state: &WorkerState) -> Result<Output, ErrorBody> {
        let mut text = String::new();
        loop {
            match self.next().await {
                Some(GenEvent::Token { token, .. }) => text.push_str(state.output_text.of(token)),
                Some(GenEvent::Finished {
                    reason,
                    prompt_tokens,
                    cached_tokens,
                    output_tokens,
                }) if reason != FinishReason::RestoreFailed => {
                    return Ok(Output {
                        text,
                        prompt_tokens,
                        cached_tokens,
                        output_tokens,
                        length: reason == FinishReason::Length,
                    })
                }
                Some(GenEvent::Captured { .. } | GenEvent::CaptureRefused(_)) => {}
                _ => return Err(ErrorBody::internal("the engine cancelled the request")),
            }
        }
    }
}

// ---- Responses -------------------------------------------------------

fn response_object(
    id: &str,
    model: &str,
    status: &str,
    previous: Option<&str>,
    text: Option<&str>,
    usage: Option<&Output>,
) -> Value {
    let output = match text {
        Some(text) => json!([response_message(&format!("msg_{}", &id[5..]), Some(text))]),
        None => json!([]),
    };
    let usage = usage.map(|o| {
        response_usage(
            o.prompt_tokens as u64,
            o.cached_tokens as u64,
            o.output_tokens as u64,
        )
    });
    json!({
        "id": id, "object": "response", "created_at": unix_now(), "model": model,
        "status": status, "output": output, "usage": usage,
        "previous_response_id": previous, "error": null, "incomplete_details": null,
        "instructions": null, "metadata": {}, "parallel_tool_calls": true,
        "tool_choice": "auto", "tools": [], "temperature": 1.0, "top_p": 1.0,
    })
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// `POST /v1/responses`.
pub(crate) async fn responses(
    State(state): State<WorkerState>,
    _headers: HeaderMap,
    body: Bytes,
) -> Response {
    match responses_inner(state, body).await {
        Ok(r) => r,
        Err(e) => error(Api::Responses, e),
    }
}

async fn responses_inner(state: WorkerState, body: Bytes) -> Result<Response, ErrorBody> {
    let request = ResponsesRequest::from_json(&body, &BodyLimits::NONE).map_err(body_error)?;
    check_model(&state, request.model.as_deref())?;
    let max_tokens = match &request.max_output_tokens {
        Some(v) => v.count("max_output_tokens")?,
        None => state.default_max_tokens,
    };
    let mut conversation = match &request.previous_response_id {
        Some(prev) => state.responses.conversation(prev).ok_or_else(|| {
            ErrorBody::not_found(
                format!("no stored response {prev:?} on this worker"),
                Some("previous_response_id"),
            )
        })?,
        None => Vec::new(),
    };
    let new = chat(request.chat())?;
    if conversation.is_empty() {
        conversation = new;
    } else {
        conversation.extend(new.into_iter().filter(|m| m.role != "system"));
    }
    let prompt = render(&state, conversation.clone(), request.tools.clone()).await?;
    let generation = generate(&state, prompt, max_tokens).await?;
    // Random, as vLLM's are: an id is no counter another client could
    // guess from its own.
    let id = format!("resp_{:032x}", rand::random::<u128>());
    let model = state.model.to_string();
    let previous = request.previous_response_id.clone();
    let store = request.store;
    if !request.stream {
        let out = generation.collect(&state).await?;
        let status = if out.length {
            "incomplete"
        } else {
            "completed"
        };
        let object = response_object(
            &id,
            &model,
            status,
            previous.as_deref(),
            Some(&out.text),
            Some(&out),
        );
        if store {
            conversation.push(ChatMessage {
                role: "assistant".into(),
                content: out.text,
                tool_calls: Vec::new(),
                reasoning: None,
            });
            state.responses.put(
                id,
                Stored {
                    conversation,
                    object: object.clone(),
                },
            );
        }
        return Ok(Json(object).into_response());
    }
    let events = responses_stream(
        state,
        generation,
        id,
        model,
        previous,
        store.then_some(conversation),
    );
    Ok(Sse::new(events.map(Ok::<Event, Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response())
}

/// The Responses event stream of `generation`; at its end the response is
/// stored when `conversation` is given.
fn responses_stream(
    state: WorkerState,
    generation: Generation,
    id: String,
    model: String,
    previous: Option<String>,
    conversation: Option<Vec<ChatMessage>>,
) -> impl futures_util::Stream<Item = Event> {
    struct S {
        state: WorkerState,
        generation: Generation,
        id: String,
        model: String,
        previous: Option<String>,
        conversation: Option<Vec<ChatMessage>>,
        text: String,
        events: ResponsesEvents,
        step: u8,
        queued: VecDeque<Event>,
    }
    impl S {
        fn push(&mut self, events: impl IntoIterator<Item = AgenticEvent>) {
            self.queued.extend(events.into_iter().map(sse));
        }
    }
    let s = S {
        state,
        generation,
        id,
        model,
        previous,
        conversation,
        text: String::new(),
        events: ResponsesEvents::default(),
        step: 0,
        queued: VecDeque::new(),
    };
    stream::unfold(s, |mut s| async move {
        loop {
            if let Some(e) = s.queued.pop_front() {
                return Some((e, s));
            }
            let item = TextItem::first(format!("msg_{}", &s.id[5..]));
            match s.step {
                0 => {
                    let r = response_object(
                        &s.id,
                        &s.model,
                        "in_progress",
                        s.previous.as_deref(),
                        None,
                        None,
                    );
                    let begun = [s.events.created(&r), s.events.in_progress(&r)];
                    s.push(begun);
                    let item = s.events.text_begins(&item);
                    s.push(item);
                    s.step = 1;
                }
                1 => match s.generation.next().await {
                    Some(GenEvent::Token { token, .. }) => {
                        let delta = s.state.output_text.of(token).to_owned();
                        s.text.push_str(&delta);
                        let e = s.events.text_delta(&item, &delta);
                        s.push([e]);
                    }
                    Some(GenEvent::Captured { .. } | GenEvent::CaptureRefused(_)) => {}
                    Some(GenEvent::Finished {
                        reason,
                        prompt_tokens,
                        cached_tokens,
                        output_tokens,
                    }) if reason != FinishReason::RestoreFailed => {
                        let out = Output {
                            text: std::mem::take(&mut s.text),
                            prompt_tokens,
                            cached_tokens,
                            output_tokens,
                            length: reason == FinishReason::Length,
                        };
                        let text = out.text.clone();
                        let done = s.events.text_done(&item, &text);
                        s.push(done);
                        let done = s.events.item_done(&item, &text);
                        s.push([done]);
                        let status = if out.length {
                            "incomplete"
                        } else {
                            "completed"
                        };
                        let r = response_object(
                            &s.id,
                            &s.model,
                            status,
                            s.previous.as_deref(),
                            Some(&text),
                            Some(&out),
                        );
                        if let Some(mut conversation) = s.conversation.take() {
                            conversation.push(ChatMessage {
                                role: "assistant".into(),
                                content: text,
                                tool_calls: Vec::new(),
                                reasoning: None,
                            });
                            s.state.responses.put(
                                s.id.clone(),
                                Stored {
                                    conversation,
                                    object: r.clone(),
                                },
                            );
                        }
                        let ended = s.events.ended(&r, out.length);
                        s.push([ended]);
                        s.step = 2;
                    }
                    _ => {
                        let e = s.events.error("the engine cancelled the request");
                        s.push([e]);
                        s.step = 2;
                    }
                },
                _ => return None,
            }
        }
    })
}

/// An event on the SSE stream.
fn sse(e: AgenticEvent) -> Event {
    Event::default().event(e.name).data(e.data_text())
}

/// `GET /v1/responses/{id}`.
pub(crate) async fn get_response(
    State(state): State<WorkerState>,
    Path(id): Path<String>,
) -> Response {
    match stored(&state, &id) {
        Ok(object) => Json(object).into_response(),
        Err(e) => error(Api::Responses, e),
    }
}

/// `POST /v1/responses/{id}/cancel`: only a response still running in
/// the background can be cancelled, and this worker answers every
/// response before storing it, so a stored one is refused with a 400
/// (OpenAI's answer for a response not created with `background`).
pub(crate) async fn cancel_response(
    State(state): State<WorkerState>,
    Path(id): Path<String>,
) -> Response {
    match stored(&state, &id) {
        Ok(_) => error(
            Api::Responses,
            ErrorBody::invalid_request(
                "only a response created with background=true can be cancelled",
                None,
            ),
        ),
        Err(e) => error(Api::Responses, e),
    }
}

fn stored(state: &WorkerState, id: &str) -> Result<Value, ErrorBody> {
    if id.len() > MAX_RESPONSE_ID_BYTES {
        return Err(ErrorBody::invalid_request(
            "the response id is too long",
            None,
        ));
    }
    state.responses.object(id).ok_or_else(|| {
        ErrorBody::not_found(format!("no stored response {id:?} on this worker"), None)
    })
}

fn check_model(state: &WorkerState, model: Option<&str>) -> Result<(), ErrorBody> {
    match model {
        Some(m) if m != &*state.model => Err(ErrorBody::new(
            404,
            "invalid_request_error",
            format!(
                "the model `{m}` does not exist; this worker serves `{}`",
                state.model
            ),
        )
        .with_param("model")),
        _ => Ok(()),
    }
}

// ---- Messages --------------------------------------------------------

/// `POST /v1/messages`.
pub(crate) async fn messages(State(state): State<WorkerState>, body: Bytes) -> Response {
    match messages_inner(state, body).await {
        Ok(r) => r,
        Err(e) => error(Api::Messages, e),
    }
}

async fn messages_inner(state: WorkerState, body: Bytes) -> Result<Response, ErrorBody> {
    let request = MessagesRequest::from_json(&body, &BodyLimits::NONE).map_err(body_error)?;
    check_model(&state, request.model.as_deref())?;
    let max_tokens = match &request.max_tokens {
        Some(v) => v.count("max_tokens")?,
        None => {
            return Err(ErrorBody::invalid_request(
                "max_tokens: Field required",
                Some("max_tokens"),
            ))
        }
    };
    let prompt = render(&state, chat(request.chat())?, request.tools.clone()).await?;
    let generation = generate(&state, prompt, max_tokens).await?;
    let id = format!("msg_{:032x}", state.request_id().0);
    let model = state.model.to_string();
    if !request.stream {
        let out = generation.collect(&state).await?;
        return Ok(Json(json!({
            "id": id, "type": "message", "role": "assistant", "model": model,
            "content": [{"type": "text", "text": out.text}],
            "stop_reason": messages::stop_reason(out.length),
            "stop_sequence": null,
            "usage": anthropic_usage(&out),
        }))
        .into_response());
    }
    let events = messages_stream(state, generation, id, model);
    Ok(Sse::new(events.map(Ok::<Event, Infallible>))
        .keep_alive(KeepAlive::default())
        .into_response())
}

fn anthropic_usage(out: &Output) -> Value {
    json!({
        "input_tokens": out.prompt_tokens.saturating_sub(out.cached_tokens),
        "cache_read_input_tokens": out.cached_tokens,
        "cache_creation_input_tokens": 0,
        "output_tokens": out.output_tokens,
    })
}

fn messages_stream(
    state: WorkerState,
    generation: Generation,
    id: String,
    model: String,
) -> impl futures_util::Stream<Item = Event> {
    stream::unfold((state, generation, 0u8), move |(state, mut generation, step)| {
        let id = id.clone();
        let model = model.clone();
        async move {
            match step {
                0 => {
                    let message = json!({"id": id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 0, "output_tokens": 0}});
                    let begun = [messages::start(&message), messages::text_block_start(0)];
                    Some((begun.map(sse).to_vec(), (state, generation, 1)))
                }
                1 => loop {
                    match generation.next().await {
                        Some(GenEvent::Token { token, .. }) => {
                            let delta = messages::text_delta(0, state.output_text.of(token));
                            return Some((vec![sse(delta)], (state, generation, 1)));
                        }
                        Some(GenEvent::Captured { .. } | GenEvent::CaptureRefused(_)) => {}
                        Some(GenEvent::Finished {
                            reason,
                            prompt_tokens,
                            cached_tokens,
                            output_tokens,
                        }) if reason != FinishReason::RestoreFailed => {
                            let out = Output {
                                text: String::new(),
                                prompt_tokens,
                                cached_tokens,
                                output_tokens,
                                length: reason == FinishReason::Length,
                            };
                            let ended = [
                                messages::block_stop(0),
                                messages::delta(out.length, anthropic_usage(&out)),
                                messages::stop(),
                            ];
                            return Some((ended.map(sse).to_vec(), (state, generation, 2)));
                        }
                        _ => {
                            let error = messages::error("the engine cancelled the request");
                            return Some((vec![sse(error)], (state, generation, 2)));
                        }
                    }
                },
                _ => None,
            }
        }
    })
    .flat_map(stream::iter)
}

/// `POST /v1/messages/count_tokens`: the prompt's length as rendered.
pub(crate) async fn count_tokens(State(state): State<WorkerState>, body: Bytes) -> Response {
    let result = async {
        let request = MessagesRequest::from_json(&body, &BodyLimits::NONE).map_err(body_error)?;
        check_model(&state, request.model.as_deref())?;
        let prompt = render(&state, chat(request.chat())?, request.tools.clone()).await?;
        Ok::<_, ErrorBody>(Json(json!({"input_tokens": prompt.len()})).into_response())
    }
    .await;
    result.unwrap_or_else(|e| error(Api::Messages, e))
}
