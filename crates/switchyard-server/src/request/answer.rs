//! A worker's successful answer on its way to the client: the client's
//! response made of it ([`deliver`]) — a whole answer, or a stream whose
//! first event the request's codec read ([`crate::request::codec`]).
//! Shared by the handlers ([`crate::routes`]) and the halves of a
//! disaggregated request (`disagg`).

use crate::driver::booking::Booking;
use crate::error::ApiError;
use crate::metrics::RequestStatus;
use crate::request::attempt::Attempts;
use crate::request::codec::{Answer, Codec, First};
use crate::request::stream::{Relay, RelayStart};
use axum::body::Body;
use axum::response::IntoResponse;
use axum::response::Response;
use bytes::Bytes;
use std::time::Instant;
use switchyard_wire::stream_codec::chat::Chunks;
use switchyard_wire::stream_codec::named::Named;

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
/// one ends the booking (finished when 2xx), a stream flows through the
/// relay ([`Relay`]).
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
        Answer::Stream(parts, upstream, parser, first) => {
            let parts = attempts.client_parts(parts, &booking);
            log_dispatch(&booking, &attempts, prompt_tokens, stream);
            let client = attempts.client_id;
            let start = RelayStart {
                attempts,
                booking,
                upstream,
                parser,
                prompt,
                prompt_tokens,
                original,
                arrival,
            };
            let body = match (&codec, first) {
                (&Codec::Chunks(api), First::Chunk(first)) => {
                    Relay::body(codec, |_| Chunks::new(api, client), start, first)
                }
                (Codec::Named(agentic), First::Named(first)) => {
                    let (api, stored) = (agentic.api, agentic.remember.is_some());
                    let named = |kept: &_| Named::new(api, stored, kept, client);
                    Relay::body(codec, named, start, first)
                }
                // A codec reads its own API's events only.
                _ => return ApiError::internal("a stream read by another API").into_response(),
            };
            Response::from_parts(parts, body)
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
