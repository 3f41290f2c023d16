//! Which API a request came through, and so how the shared path reads its
//! worker's answer: the chat API's chunks (`/v1/chat/completions`,
//! `/v1/completions`) or the named events of the Responses and Messages
//! APIs (`/v1/responses`, `/v1/messages`). A handler makes its request's
//! [`Codec`]; the placement loop ([`crate::request::handlers`]), the
//! answer ([`crate::request::answer`]) and the streams
//! ([`crate::request::stream`], [`crate::request::named_stream`]) ask it,
//! and none of them names an API.

use crate::metrics::RequestStatus;
use crate::request::agentic::{AgenticDelivery, EventKind};
use crate::request::answer::{error_event, first_with, Answer};
use crate::request::attempt::{AttemptError, Attempts};
use crate::state::AppState;
use hyper::body::Incoming;
use std::sync::Arc;
use switchyard_core::WorkerId;
use switchyard_wire::agentic::AgenticApi;
use switchyard_wire::agentic_events;
use switchyard_wire::openai::{completion_tokens, Api};
use switchyard_wire::sse::{classify_ref, ChunkRef, SseParser};

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
            state.api_metrics.count(api, status);
        }
    }
}

/// How a request's answer is read (see the module docs).
#[derive(Clone, Debug)]
pub(crate) enum Codec {
    /// Chat or completions: chunks (`data:` lines), relayed by
    /// [`crate::request::stream`].
    Chunks(Api),
    /// Responses or Messages: named events (`event:` and `data:` lines),
    /// forwarded whole by [`crate::request::named_stream`]; what the API
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
                Ok(Answer::Stream(parts, upstream, parser, first))
            }
            Codec::Named(delivery) => {
                let (parts, upstream, parser, first) =
                    first_with(attempts, worker, response, SseParser::next_event_named).await?;
                if delivery.classify(first.data()) == EventKind::Error {
                    return Err(error_event(attempts, worker));
                }
                Ok(Answer::Named(parts, upstream, parser, first))
            }
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
