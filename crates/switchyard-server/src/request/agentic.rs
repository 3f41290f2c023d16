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
//!   (`switchyard_wire::stream_codec::named`);
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
use crate::request::limits;
use crate::response_map::{Holder, Inserted, Owner, ResponseMap};
use crate::state::AppState;
use std::sync::Arc;
use std::time::Instant;
use switchyard_core::admission::SessionKey;
use switchyard_core::WorkerId;
pub(crate) use switchyard_wire::agentic::AgenticApi;
use switchyard_wire::agentic::{MessagesRequest, ResponsesRequest};
use switchyard_wire::agentic_events;
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
}

impl AgenticDelivery {
    /// A whole answer from `worker`: a stored response's id is remembered.
    pub(crate) fn answered(&self, bytes: &[u8], worker: WorkerId) {
        if let Some(id) = agentic_events::response_id(bytes) {
            self.stored(&id, worker);
        }
    }

    /// `worker` announced the response's id (a stream's
    /// `response.created`): remembered when the worker stores it.
    pub(crate) fn stored(&self, id: &str, worker: WorkerId) {
        if let Some(remember) = &self.remember {
            remember.record(id, worker);
        }
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
        }
    }

    #[test]
    fn a_stored_answers_id_is_remembered_with_its_worker() {
        let r = delivery(AgenticApi::Responses);
        let body =
            br#"{"id":"resp_9","object":"response","usage":{"input_tokens":5,"output_tokens":7}}"#;
        r.answered(body, WorkerId::new(3));
        let map = &r.remember.as_ref().unwrap().map;
        assert_eq!(
            map.get("resp_9", None, Instant::now()).map(|h| h.worker),
            Some(WorkerId::new(3))
        );
    }
}

#[cfg(test)]
#[path = "agentic_tests.rs"]
mod router_tests;
