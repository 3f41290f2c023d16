//! The OpenAI endpoints: `/v1/chat/completions` and `/v1/completions`.
//!
//! One request: the key was checked from its head ([`crate::front::auth`])
//! and its body read whole within its limit and deadline
//! ([`crate::front::upload`]) before a handler runs → parse only the
//! fields routing needs → tokenize (chat template for chat) → charge the
//! key → hand over: [`Attempts`] places it (admission and selection in
//! the dispatcher), forwards the client's bytes unchanged to the worker
//! and waits for its first event (streaming) or its whole answer
//! (non-streaming, buffered up to `max_response_bytes`). A worker that
//! fails before that point (refused, reset, 5xx, first-token timeout) is
//! reported, its booking freed, and the request moved elsewhere; a stream
//! then flows through [`crate::request::stream`], which resumes it on
//! another worker if it breaks. The whole request is bounded by the
//! request timeout (504). A disaggregated request goes the same way, as
//! two halves ([`crate::request::disagg`]).

use crate::error::ApiError;
use crate::metrics::RequestStatus;
use crate::request::answer::{deliver, Delivery};
use crate::request::attempt::{AttemptError, Attempts};
use crate::request::codec::{buffered, ApiKind, Codec};
use crate::request::limits;
use crate::request::prompt::{
    preamble, request_parts, session_key, Head, Later, Parsed, PromptIds, PromptSource, TokenizeJob,
};
use crate::state::{App, AppState};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use std::time::Instant;
use switchyard_core::admission::{Flow, SessionKey};
use switchyard_core::WorkerId;
use switchyard_wire::engine_body::engine_body;
use switchyard_wire::openai::{Api, Prompt};

pub(crate) async fn chat_completions(State(state): State<App>, request: Request) -> Response {
    let arrival = Instant::now();
    let (headers, key, body) = request_parts(&state, request).await;
    let result = async {
        let (body, flow) = body?;
        let (parsed, asked) = limits::parse_chat(&state, &body)?;
        let job = TokenizeJob::chat(parsed.messages, parsed.tools, 0)?;
        let head = Head {
            model: parsed.model,
            stream: parsed.stream,
            session: parsed.session_id,
            key,
            flow,
            asked,
        };
        let facts = preamble(&state, head, PromptSource::Tokenize(job), Later::default()).await?;
        Ok::<_, ApiError>(ready(&state, &headers, body, facts, Api::Chat))
    }
    .await;
    finish(state, headers, ApiKind::OpenAi(Api::Chat), arrival, result).await
}

pub(crate) async fn completions(State(state): State<App>, request: Request) -> Response {
    let arrival = Instant::now();
    let (headers, key, body) = request_parts(&state, request).await;
    let result = async {
        let (body, flow) = body?;
        let (parsed, asked) = limits::parse_completion(&state, &body)?;
        // A batch is routed by its first prompt: one worker serves it all.
        // Token ids were bounded while parsing; text while tokenized (a
        // batch's later texts are the worker's to judge).
        let known = |ids| PromptSource::Known(PromptIds::of_ids(ids));
        let text = |text| PromptSource::Tokenize(TokenizeJob::Text(text));
        let prompt = match parsed.prompt {
            Prompt::Tokens(ids) => known(ids),
            Prompt::TokenBatches(batch) => known(batch.into_iter().next().unwrap_or_default()),
            Prompt::Text(t) => text(t),
            Prompt::Texts(texts) => texts
                .into_iter()
                .next()
                .map_or_else(|| known(Vec::new()), text),
        };
        // Every prompt of a batch is charged: token ids as counted while
        // parsing, later texts (not tokenized here) by the estimate used
        // for a model without a tokenizer.
        let others = parsed.later_prompts;
        let later = Later {
            prompts: others.count,
            tokens: others.token_ids.saturating_add(u64::from(
                crate::models::ModelRouting::estimated_tokens(
                    usize::try_from(others.text_bytes).unwrap_or(usize::MAX),
                ),
            )),
        };
        let head = Head {
            model: parsed.model,
            stream: parsed.stream,
            session: parsed.session_id,
            key,
            flow,
            asked,
        };
        let facts = preamble(&state, head, prompt, later).await?;
        Ok::<_, ApiError>(ready(&state, &headers, body, facts, Api::Completions))
    }
    .await;
    finish(
        state,
        headers,
        ApiKind::OpenAi(Api::Completions),
        arrival,
        result,
    )
    .await
}

/// A chat or completions request [`Ready`]: its session from the
/// `x-session-id` header or the body's `session_id`.
fn ready(state: &AppState, headers: &HeaderMap, body: Bytes, facts: Parsed, api: Api) -> Ready {
    let session = session_key(state, headers, facts.session.as_deref(), facts.key);
    Ready {
        body,
        facts,
        session,
        codec: Codec::Chunks(api),
        pinned: None,
    }
}

/// What a handler has made of its request: the body, its routing facts,
/// its session, how its answer is read, and the one worker it may go to
/// (a Responses turn continuing a response that worker stores).
pub(crate) struct Ready {
    pub(crate) body: Bytes,
    pub(crate) facts: Parsed,
    pub(crate) session: Option<SessionKey>,
    pub(crate) codec: Codec,
    pub(crate) pinned: Option<WorkerId>,
}

/// Every handler's tail: a request made [`Ready`] placed and forwarded;
/// an error the router answers itself counted as `api`'s.
pub(crate) async fn finish(
    state: App,
    headers: HeaderMap,
    api: ApiKind,
    arrival: Instant,
    ready: Result<Ready, ApiError>,
) -> Response {
    // A request dropped before its response head (the client went away,
    // or shutdown) is counted `Cancelled` once, by the in-flight
    // middleware ([`crate::front::inflight`]), not here.
    let response = match ready {
        Ok(ready) => proxy(state.clone(), headers, arrival, ready).await,
        Err(e) => Err(e),
    };
    match response {
        Ok(response) => response,
        Err(e) => {
            api.count(&state, error_status(&e));
            e.into_response()
        }
    }
}

/// How a request the router answered with `e` ended.
fn error_status(e: &ApiError) -> RequestStatus {
    match e.status {
        StatusCode::TOO_MANY_REQUESTS => RequestStatus::Rejected,
        s if s.is_server_error() => RequestStatus::Unavailable,
        _ => RequestStatus::Invalid,
    }
}

/// Places and forwards a request made [`Ready`].
async fn proxy(
    state: App,
    headers: HeaderMap,
    arrival: Instant,
    ready: Ready,
) -> Result<Response, ApiError> {
    let Ready {
        body,
        facts,
        session,
        codec,
        pinned,
    } = ready;
    let flow = Flow {
        expected_output_tokens: facts.asked.expected_output_tokens(),
        ..facts.flow
    };
    // The band speaks for the request's priority at the engine too, and
    // a client's `request_id` stays with the router
    // (`switchyard_wire::engine_body`).
    let priority = state.intake.flows.engine_priority(flow.band);
    let body = match engine_body(&body, priority) {
        Ok(None) => body,
        Ok(Some(rewritten)) => Bytes::from(rewritten),
        Err(e) => {
            let message = format!("invalid request body: {e}");
            return Err(ApiError::bad_request(message, None));
        }
    };
    let unrendered = facts.prompt.unrendered;
    let request = Delivery {
        codec,
        arrival,
        prompt: facts.prompt.ids,
        estimated_prompt_tokens: facts.prompt.estimated,
        original: body,
        stream: facts.stream,
    };
    if let Some(mode) = state.apis.disagg {
        if state.driver.disaggregated() {
            if let Codec::Named(_) = request.codec {
                return Err(ApiError::not_implemented(
                    "the Responses and Messages APIs are not served through a disaggregated fleet; use /v1/chat/completions",
                ));
            }
            return crate::request::disagg::serve(
                mode,
                state,
                &headers,
                request,
                facts.model,
                session,
            )
            .await;
        }
    }
    let request_id = state.driver.next_request_id();
    let deadline = tokio::time::Instant::from_std(arrival) + state.upstream.request_timeout;
    let attempts = Attempts::new(
        state.clone(),
        request_id,
        facts.model,
        headers.get(header::ACCEPT).cloned(),
        deadline,
    )
    .estimated_prompt(request.estimated_prompt_tokens)
    .unrendered_prompt(unrendered)
    .flow(flow)
    .pinned_to(pinned);
    first_phase(attempts, session, request).await
}

/// The placement loop ([`Attempts`]) until one worker produces a first
/// event (streaming) or a whole response (non-streaming); each failure
/// reports the worker and moves the request elsewhere (still its
/// session's turn), up to the migration limit. The request timeout bounds
/// every wait: for placement (a 504, no worker to blame) and for the
/// worker's answer (a 504, and the worker reported when it had the
/// request for at least the first-token timeout: a worker that accepts
/// requests and never answers them must not stay selectable).
async fn first_phase(
    mut attempts: Attempts,
    session: Option<SessionKey>,
    request: Delivery,
) -> Result<Response, ApiError> {
    let prompt_tokens = request.prompt.len() as u64;
    let deadline = attempts.deadline;
    let mut booking = attempts.place(&request.prompt, session).await?;
    loop {
        let sent_at = tokio::time::Instant::now();
        let attempt = async {
            let sent = attempts
                .send(
                    &booking,
                    request.codec.api().path(),
                    request.original.clone(),
                    request.stream,
                )
                .await;
            match sent {
                Ok(response) if request.stream && response.status().is_success() => {
                    request
                        .codec
                        .first_event(&attempts, &booking.name, response)
                        .await
                }
                Ok(response) => buffered(&attempts, response).await,
                Err(e) => Err(e),
            }
        };
        let answered = tokio::time::timeout_at(deadline, attempt).await;
        let Ok(outcome) = answered else {
            // The upstream request is dropped with the booking.
            return Err(attempts.timed_out_since(booking, sent_at));
        };
        match outcome {
            Ok(answer) => return Ok(deliver(attempts, booking, answer, request)),
            Err(AttemptError::Fatal(e)) => return Err(e),
            Err(AttemptError::Retry(reason, detail)) => {
                tracing::warn!(request = %attempts.client_id, worker = %booking.name, reason = reason.label(), %detail, "attempt failed before the first token");
                booking = attempts
                    .move_on(booking, reason, &detail, prompt_tokens)
                    .await?;
            }
        }
    }
}
