//! Which API a request came through, and so how the shared path reads its
//! worker's answer ([`Answer`]: whole, or a stream up to its first event):
//! the chat API's chunks (`/v1/chat/completions`, `/v1/completions`) or
//! the named events of the Responses and Messages APIs (`/v1/responses`,
//! `/v1/messages`). A handler makes its request's
//! [`Codec`]; the placement loop ([`crate::request::handlers`]), the
//! answer ([`crate::request::answer`]) and the relay
//! ([`crate::request::stream`], which runs the API's own stream codec of
//! `switchyard_wire::stream_codec`) ask it, and none of them names an
//! API.

use crate::error::ApiError;
use crate::front::upload::{read_whole, ReadError};
use crate::metrics::RequestStatus;
use crate::request::agentic::AgenticDelivery;
use crate::request::attempt::{AttemptError, Attempts};
use crate::request::MAX_EVENT_BYTES;
use crate::state::AppState;
use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::body::Incoming;
use std::sync::Arc;
use switchyard_core::dispatch::failure::Failure;
use switchyard_core::WorkerId;
use switchyard_wire::agentic::AgenticApi;
use switchyard_wire::agentic_events::{self, EventKind};
use switchyard_wire::openai::{completion_tokens, Api};
use switchyard_wire::sse::{classify_ref, ChunkRef, Event, NamedEvent, SseError, SseParser};

/// Which API a request came through: what it is counted as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ApiKind {
    /// Chat or completions.
    OpenAi(Api),
    /// Responses or Messages.
    Agentic(AgenticApi),
}

impl ApiKind {
    /// The endpoint's path.
    pub(crate) fn path(self) -> &'static str {
        match self {
            ApiKind::OpenAi(api) => api.path(),
            ApiKind::Agentic(api) => api.path(),
        }
    }

    /// Counts a request that ended with `status`: in
    /// `switchyard_requests_total`, and a Responses or Messages request
    /// by its API too.
    pub(crate) fn count(self, state: &AppState, status: RequestStatus) {
        state.driver.metrics().count_request(status);
        if let ApiKind::Agentic(api) = self {
            state.apis.api_metrics.count(api, status);
        }
    }
}

/// How a request's answer is read (see the module docs).
#[derive(Clone, Debug)]
pub(crate) enum Codec {
    /// Chat or completions: chunks (`data:` lines), relayed as
    /// `switchyard_wire::stream_codec::chat` reads them.
    Chunks(Api),
    /// Responses or Messages: named events (`event:` and `data:` lines),
    /// relayed whole as `switchyard_wire::stream_codec::named` reads them; what the API
    /// keeps of an answer ([`AgenticDelivery`]).
    Named(Arc<AgenticDelivery>),
}

impl Codec {
    /// The API the request came through.
    pub(crate) fn api(&self) -> ApiKind {
        match self {
            Codec::Chunks(api) => ApiKind::OpenAi(*api),
            Codec::Named(delivery) => ApiKind::Agentic(delivery.api),
        }
    }

    /// A streaming response read up to its first complete event, within
    /// the first-token timeout; an error event first is the worker's
    /// failure.
    pub(crate) async fn first_event(
        &self,
        attempts: &Attempts,
        worker: &str,
        response: hyper::Response<Incoming>,
    ) -> Result<Answer, AttemptError> {
        match self {
            Codec::Chunks(_) => {
                let (parts, upstream, parser, first) =
                    first_with(attempts, worker, response, SseParser::next_event_framed).await?;
                if classify_ref(first.data()) == ChunkRef::Error {
                    return Err(error_event(attempts, worker));
                }
                Ok(Answer::Stream(parts, upstream, parser, First::Chunk(first)))
            }
            Codec::Named(delivery) => {
                let (parts, upstream, parser, first) =
                    first_with(attempts, worker, response, SseParser::next_event_named).await?;
                if agentic_events::classify(delivery.api, first.data()) == EventKind::Error {
                    return Err(error_event(attempts, worker));
                }
                Ok(Answer::Stream(parts, upstream, parser, First::Named(first)))
            }
        }
    }

    /// `worker` announced a stored response's id on a stream: remembered
    /// with it (Responses, when stored).
    pub(crate) fn stored(&self, id: &str, worker: WorkerId) {
        if let Codec::Named(delivery) = self {
            delivery.stored(id, worker);
        }
    }

    /// A whole answer from `worker` (2xx when `ok`): what the API keeps of
    /// it (a stored response's id, with its worker), and the tokens it
    /// generated (0 unless `ok`).
    pub(crate) fn answered(&self, ok: bool, bytes: &[u8], worker: WorkerId) -> u64 {
        if !ok {
            return 0;
        }
        match self {
            Codec::Chunks(_) => completion_tokens(bytes),
            Codec::Named(delivery) => {
                delivery.answered(bytes, worker);
                // `usage.output_tokens` in both APIs; 0 when absent.
                agentic_events::output_tokens(bytes)
            }
        }
    }
}

/// A successful attempt.
pub(crate) enum Answer {
    /// A whole response (non-streaming, or an error status passed through).
    Buffered(hyper::http::response::Parts, Bytes),
    /// A stream whose first event has arrived.
    Stream(hyper::http::response::Parts, Incoming, SseParser, First),
}

/// A stream's first event, as its API's events are read.
pub(crate) enum First {
    /// A chunk (chat, completions).
    Chunk(Event),
    /// A named event (Responses, Messages).
    Named(NamedEvent),
}

/// An error event first: the worker's failure.
fn error_event(attempts: &Attempts, worker: &str) -> AttemptError {
    AttemptError::Retry(
        Failure::Status5xx,
        format!(
            "{} answered with an error event",
            attempts.state.disclosure().worker(worker)
        ),
    )
}

type FirstEvent<E> = (hyper::http::response::Parts, Incoming, SseParser, E);

/// A streaming response read up to its first complete event (as `next`
/// takes events), within the first-token timeout.
async fn first_with<E>(
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
