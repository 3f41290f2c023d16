//! A worker's successful answer on its way to the client: the first
//! event of a stream ([`first_event`]) or a whole answer ([`buffered`]),
//! and the client's response made of it ([`deliver`]). Shared by the
//! handlers ([`crate::routes`]) and the halves of a disaggregated request
//! (`disagg`).

use crate::driver::booking::Booking;
use crate::error::ApiError;
use crate::front::upload::{read_whole, ReadError};
use crate::metrics::RequestStatus;
use crate::request::attempt::{AttemptError, Attempts};
use crate::request::codec::Codec;
use crate::request::named_stream::NamedStart;
use crate::request::stream::{MigratingStream, StreamStart};
use crate::request::MAX_EVENT_BYTES;
use axum::body::Body;
use axum::response::IntoResponse;
use axum::response::Response;
use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use std::time::Instant;
use switchyard_core::dispatch::failure::Failure;
use switchyard_wire::sse::{Event, NamedEvent, SseError, SseParser};

/// What [`deliver`] needs of the request besides its attempts.
#[derive(Clone)]
pub(crate) struct Delivery {
    /// How its answer is read: the API it came through.
    pub(crate) codec: Codec,
    pub(crate) arrival: Instant,
    /// The prompt's token ids (empty when its model has no tokenizer
    /// here).
    pub(crate) prompt: Vec<u32>,
    /// The prompt's estimated length when its model has no tokenizer
    /// here.
    pub(crate) estimated_prompt_tokens: Option<u32>,
    /// The client's body (a resumed stream's request is made from it).
    pub(crate) original: Bytes,
    pub(crate) stream: bool,
}

/// The client's response for a worker's successful answer: a buffered
/// one ends the booking (finished when 2xx), a stream flows through
/// [`MigratingStream`].
pub(crate) fn deliver(
    attempts: Attempts,
    booking: Booking,
    answer: Answer,
    request: Delivery,
) -> Response {
    let state = attempts.state.clone();
    let Delivery {
        codec,
        arrival,
        prompt,
        estimated_prompt_tokens,
        original,
        stream,
    } = request;
    let prompt_tokens = estimated_prompt_tokens.map_or(prompt.len() as u64, u64::from);
    match answer {
        Answer::Buffered(parts, bytes) => {
            let ok = parts.status.is_success();
            let mut booking = booking;
            booking.mark_first_token();
            state
                .driver
                .metrics()
                .ttft
                .observe(arrival.elapsed().as_secs_f64());
            // The session's context grows by what was generated.
            let completion = codec.answered(ok, &bytes, booking.worker);
            if ok {
                booking.progress(completion);
                booking.completed(prompt_tokens.saturating_add(completion));
            }
            codec.api().count(
                &state,
                if ok {
                    RequestStatus::Ok
                } else {
                    RequestStatus::WorkerError
                },
            );
            let parts = attempts.client_parts(parts, &booking);
            log_dispatch(&booking, &attempts, prompt_tokens, stream);
            Response::from_parts(parts, Body::from(bytes))
        }
        Answer::Named(parts, upstream, parser, first) => {
            let parts = attempts.client_parts(parts, &booking);
            log_dispatch(&booking, &attempts, prompt_tokens, stream);
            let Codec::Named(agentic) = codec else {
                // Named events are read for the agentic APIs only.
                drop(booking);
                return ApiError::internal("a named stream without its API").into_response();
            };
            let body = crate::request::named_stream::into_body(NamedStart {
                attempts,
                booking,
                upstream,
                parser,
                first,
                agentic,
                prompt_tokens,
                prompt,
                original,
                arrival,
            });
            Response::from_parts(parts, body)
        }
        Answer::Stream(parts, upstream, parser, first) => {
            let parts = attempts.client_parts(parts, &booking);
            log_dispatch(&booking, &attempts, prompt_tokens, stream);
            let Codec::Chunks(api) = codec else {
                // Chunks are read for the chat API only.
                drop(booking);
                return ApiError::internal("a chat stream without its API").into_response();
            };
            let stream = MigratingStream::new(StreamStart {
                attempts,
                api,
                booking,
                upstream,
                parser,
                first,
                prompt,
                original,
                arrival,
            });
            Response::from_parts(parts, stream.into_body())
        }
    }
}

pub(crate) fn log_dispatch(
    booking: &Booking,
    attempts: &Attempts,
    prompt_tokens: u64,
    stream: bool,
) {
    tracing::debug!(
        request = %attempts.client_id,
        worker = %booking.name,
        prompt_tokens,
        overlap_blocks = booking.overlap_blocks,
        waited_ms = booking.waited_ms,
        migrations = attempts.failures.migrations(),
        stream,
        "dispatched"
    );
}

/// A successful attempt.
pub(crate) enum Answer {
    /// A whole response (non-streaming, or an error status passed through).
    Buffered(hyper::http::response::Parts, Bytes),
    /// A stream whose first event has arrived.
    Stream(hyper::http::response::Parts, Incoming, SseParser, Event),
    /// A stream of named events (Responses, Messages) whose first event
    /// has arrived.
    Named(
        hyper::http::response::Parts,
        Incoming,
        SseParser,
        NamedEvent,
    ),
}

pub(crate) fn error_event(attempts: &Attempts, worker: &str) -> AttemptError {
    AttemptError::Retry(
        Failure::Status5xx,
        format!(
            "{} answered with an error event",
            attempts.state.disclosure().worker(worker)
        ),
    )
}

pub(crate) type FirstEvent<E> = (hyper::http::response::Parts, Incoming, SseParser, E);

/// A streaming response read up to its first complete event (as `next`
/// takes events), within the first-token timeout.
pub(crate) async fn first_with<E>(
    attempts: &Attempts,
    worker: &str,
    response: hyper::Response<Incoming>,
    next: fn(&mut SseParser) -> Result<Option<E>, SseError>,
) -> Result<FirstEvent<E>, AttemptError> {
    let (parts, mut upstream) = response.into_parts();
    let mut parser = SseParser::new(MAX_EVENT_BYTES);
    let read = async {
        loop {
            match next(&mut parser) {
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
    let timeout = attempts.state.upstream.first_token_timeout;
    let first = tokio::time::timeout(timeout, read).await.map_err(|_| {
        AttemptError::Retry(
            Failure::Timeout,
            format!(
                "{} sent no first event within {:.1} s",
                attempts.state.disclosure().worker(worker),
                timeout.as_secs_f64()
            ),
        )
    })??;
    Ok((parts, upstream, parser, first))
}

/// Buffers a whole response (bounded by `max_response_bytes`).
pub(crate) async fn buffered(
    attempts: &Attempts,
    response: hyper::Response<Incoming>,
) -> Result<Answer, AttemptError> {
    let limit = attempts.state.upstream.max_response_bytes;
    let (parts, upstream) = response.into_parts();
    match read_whole(upstream, limit).await {
        Ok(body) => Ok(Answer::Buffered(parts, body)),
        Err(ReadError::TooLarge) => Err(AttemptError::Fatal(ApiError::bad_gateway(format!(
            "the worker's response exceeds the router's limit of {limit} bytes (--max-response-bytes)"
        )))),
        Err(ReadError::Broken) => Err(AttemptError::Retry(
            Failure::Reset,
            "the worker's response broke before it was complete".into(),
        )),
    }
}
