//! What the Responses API (`/v1/responses`) and Anthropic's Messages API
//! (`/v1/messages`) share on their way through the router, beside the
//! chat path they reuse: the request is read as its equivalent chat
//! conversation ([`switchyard_wire::agentic`], bounded while parsed),
//! tokenized with the model's chat template by the chat path's own
//! [`tokenize`](crate::request::prompt::tokenize), charged, and placed and
//! forwarded by the chat path's placement loop
//! ([`crate::request::handlers`]); this module adds what differs:
//!
//! - the answer's usage (`output_tokens`) and, for a stored response, its
//!   id, remembered with its worker ([`crate::response_map`]);
//! - named events (`event: ...` lines kept) forwarded unchanged
//!   ([`crate::request::named_stream`]);
//! - a broken stream of plain text resumed on another worker, its
//!   completion chunks rewritten into the API's events, and anything else
//!   ended with the API's error event saying why
//!   ([`switchyard_wire::resume::agentic`]).
//!
//! Before the first event any request of either API is retried on another
//! worker as chat requests are, except a Responses turn that continues a
//! stored response: it may go only to the worker that stores it.

use crate::error::ApiError;
use crate::metrics::InputLimit;
pub(crate) use crate::request::agentic_state::{AgenticApi, AgenticState};
use crate::request::context::AppState;
use crate::request::limits;
use crate::response_map::{Holder, Inserted, Owner, ResponseMap};
use serde::Deserialize;
use std::sync::Arc;
use std::time::Instant;
use switchyard_core::admission::SessionKey;
use switchyard_core::WorkerId;
use switchyard_wire::agentic::{MessagesRequest, ResponsesRequest};
use switchyard_wire::openai::{BodyError, Limit};

/// Where a stored response's id is remembered once it is known.
#[derive(Debug)]
pub(crate) struct Remember {
    pub(crate) map: Arc<ResponseMap>,
    /// Peers are told (with replica sync on).
    pub(crate) driver: Option<Arc<crate::driver::Driver>>,
    /// The chain's session, carried to its next turn.
    pub(crate) session: Option<SessionKey>,
    /// The key that asked: the only one the response is found for.
    pub(crate) owner: Option<Owner>,
}

impl Remember {
    /// Records that `worker` stores response `id`, unless another key
    /// holds that id (then nothing moves: counted by the map), and tells
    /// the peers.
    pub(crate) fn record(&self, id: &str, worker: WorkerId) {
        let holder = Holder {
            worker,
            session: self.session,
            owner: self.owner,
        };
        if self.map.insert(id, holder, Instant::now()) != Inserted::Stored {
            tracing::warn!(
                worker = %worker,
                "a worker answered with a response id another key holds (or an invalid one): not recorded"
            );
            return;
        }
        if let Some(driver) = &self.driver {
            driver.publish_stored_response(id, holder);
        }
    }
}

/// What the shared delivery needs to know of an agentic request.
#[derive(Debug)]
pub(crate) struct AgenticDelivery {
    pub(crate) api: AgenticApi,
    /// A Responses request whose answer the worker stores: its id is
    /// remembered with the worker.
    pub(crate) remember: Option<Remember>,
    pub(crate) state: Arc<AgenticState>,
}

/// What one streamed event means to the router.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum EventKind {
    /// `response.created`: the response's id.
    Created(String),
    /// Generated text.
    Delta,
    /// The last event of a complete answer.
    End,
    /// An error event (the stream ends after it).
    Error,
    /// Anything else (forwarded, nothing to note).
    Other,
}

#[derive(Deserialize)]
struct Typed<'a> {
    #[serde(default, borrow, rename = "type")]
    kind: Option<std::borrow::Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Created {
    response: Identified,
}

#[derive(Deserialize)]
struct Identified {
    #[serde(default)]
    id: Option<String>,
}

#[derive(Deserialize)]
struct Usage {
    #[serde(default)]
    usage: Option<OutputTokens>,
}

#[derive(Deserialize)]
struct OutputTokens {
    #[serde(default)]
    output_tokens: Option<u64>,
}

impl AgenticDelivery {
    /// The event's meaning, from its data's `type`.
    pub(crate) fn classify(&self, data: &str) -> EventKind {
        let Ok(Typed { kind: Some(kind) }) = serde_json::from_str::<Typed<'_>>(data) else {
            return EventKind::Other;
        };
        match (self.api, kind.as_ref()) {
            (_, "error") => EventKind::Error,
            (AgenticApi::Responses, "response.created") => {
                match serde_json::from_str::<Created>(data) {
                    Ok(Created {
                        response: Identified { id: Some(id) },
                    }) => EventKind::Created(id),
                    _ => EventKind::Other,
                }
            }
            (AgenticApi::Responses, "response.output_text.delta")
            | (AgenticApi::Messages, "content_block_delta") => EventKind::Delta,
            (AgenticApi::Responses, "response.completed" | "response.incomplete")
            | (AgenticApi::Messages, "message_stop") => EventKind::End,
            (AgenticApi::Responses, "response.failed") => EventKind::Error,
            _ => EventKind::Other,
        }
    }

    /// A whole answer's output tokens (`usage.output_tokens` in both
    /// APIs; 0 when absent).
    pub(crate) fn output_tokens(bytes: &[u8]) -> u64 {
        serde_json::from_slice::<Usage>(bytes)
            .ok()
            .and_then(|u| u.usage)
            .and_then(|u| u.output_tokens)
            .unwrap_or(0)
    }

    /// A whole answer from `worker`: a stored response's id is remembered.
    pub(crate) fn answered(&self, bytes: &[u8], worker: WorkerId) {
        if let Some(remember) = &self.remember {
            if let Ok(Identified { id: Some(id) }) = serde_json::from_slice::<Identified>(bytes) {
                remember.record(&id, worker);
            }
        }
    }

    /// The event that ends a broken stream, in the API's own shape;
    /// `sequence` numbers a Responses event.
    pub(crate) fn error_event(&self, message: &str, sequence: u64) -> Vec<u8> {
        use switchyard_wire::agentic_events::{messages, ResponsesEvents};
        let e = match self.api {
            AgenticApi::Messages => messages::error(message),
            AgenticApi::Responses => ResponsesEvents::from_sequence(sequence).error(message),
        };
        switchyard_wire::sse::NamedEvent::new(Some(e.name), &e.data_text()).into_bytes()
    }
}

/// A body error of an agentic request: limits named as for chat, with the
/// field that holds the list (`input` for Responses).
fn body_error(state: &AppState, e: BodyError, list: &'static str) -> ApiError {
    match e {
        BodyError::Json(e) => ApiError::bad_request(format!("invalid request body: {e}"), None),
        BodyError::Over(over) => {
            let (limit, message) = match over.limit {
                Limit::ContentParts => (
                    InputLimit::ContentParts,
                    format!(
                        "the request's messages have more content blocks than the limit of {} (--max-content-parts)",
                        over.max
                    ),
                ),
                _ => (
                    InputLimit::Messages,
                    format!(
                        "the request has more messages than the limit of {} (--max-messages)",
                        over.max
                    ),
                ),
            };
            limits::refuse(state, limit, message, list)
        }
    }
}

/// A `/v1/responses` body parsed within the limits, and what it asks for.
pub(crate) fn parse_responses(
    state: &AppState,
    body: &[u8],
) -> Result<(ResponsesRequest, limits::Asked), ApiError> {
    let parsed = ResponsesRequest::from_json(body, &limits::body_limits(state))
        .map_err(|e| body_error(state, e, "input"))?;
    let asked = limits::check_counts(
        state,
        [(&None, ""), (&None, "")],
        [
            (&parsed.max_output_tokens, "max_output_tokens"),
            (&None, ""),
        ],
    )?;
    Ok((parsed, asked))
}

/// A `/v1/messages` body parsed within the limits, and what it asks for.
pub(crate) fn parse_messages(
    state: &AppState,
    body: &[u8],
) -> Result<(MessagesRequest, limits::Asked), ApiError> {
    let parsed = MessagesRequest::from_json(body, &limits::body_limits(state))
        .map_err(|e| body_error(state, e, "messages"))?;
    let asked = limits::check_counts(
        state,
        [(&None, ""), (&None, "")],
        [(&parsed.max_tokens, "max_tokens"), (&None, "")],
    )?;
    Ok((parsed, asked))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::response_map::DEFAULT_TTL;

    fn delivery(api: AgenticApi) -> AgenticDelivery {
        AgenticDelivery {
            api,
            remember: Some(Remember {
                map: Arc::new(ResponseMap::new(8, 8, DEFAULT_TTL)),
                driver: None,
                session: None,
                owner: None,
            }),
            state: Arc::new(AgenticState::new(ResponseMap::new(8, 8, DEFAULT_TTL))),
        }
    }

    #[test]
    fn events_are_read_by_their_type() {
        let r = delivery(AgenticApi::Responses);
        assert_eq!(
            r.classify(r#"{"type":"response.created","sequence_number":0,"response":{"id":"resp_1","output":[]}}"#),
            EventKind::Created("resp_1".into())
        );
        assert_eq!(
            r.classify(r#"{"type":"response.output_text.delta","delta":"x"}"#),
            EventKind::Delta
        );
        assert_eq!(
            r.classify(r#"{"type":"response.completed","response":{}}"#),
            EventKind::End
        );
        assert_eq!(
            r.classify(r#"{"type":"response.failed","response":{}}"#),
            EventKind::Error
        );
        assert_eq!(r.classify("not json"), EventKind::Other);
        let m = delivery(AgenticApi::Messages);
        assert_eq!(
            m.classify(r#"{"type":"content_block_delta","index":0,"delta":{}}"#),
            EventKind::Delta
        );
        assert_eq!(m.classify(r#"{"type":"message_stop"}"#), EventKind::End);
        assert_eq!(
            m.classify(r#"{"type":"error","error":{}}"#),
            EventKind::Error
        );
        assert_eq!(m.classify(r#"{"type":"ping"}"#), EventKind::Other);
    }

    #[test]
    fn a_whole_answer_gives_its_output_tokens_and_its_id_is_remembered() {
        let r = delivery(AgenticApi::Responses);
        let body =
            br#"{"id":"resp_9","object":"response","usage":{"input_tokens":5,"output_tokens":7}}"#;
        assert_eq!(AgenticDelivery::output_tokens(body), 7);
        assert_eq!(AgenticDelivery::output_tokens(b"garbage"), 0);
        r.answered(body, WorkerId::new(3));
        let map = &r.remember.as_ref().unwrap().map;
        assert_eq!(
            map.get("resp_9", None, Instant::now()).map(|h| h.worker),
            Some(WorkerId::new(3))
        );
    }

    #[test]
    fn a_broken_stream_ends_with_an_error_event_of_its_api() {
        let m = String::from_utf8(delivery(AgenticApi::Messages).error_event("gone", 0)).unwrap();
        assert!(m.starts_with("event: error\ndata: {"), "{m}");
        assert!(m.contains(r#""type":"error""#) && m.contains(r#""message":"gone""#));
        let r = String::from_utf8(delivery(AgenticApi::Responses).error_event("gone", 4)).unwrap();
        assert!(r.contains(r#""sequence_number":4"#), "{r}");
    }
}

#[cfg(test)]
#[path = "agentic_tests.rs"]
mod router_tests;
