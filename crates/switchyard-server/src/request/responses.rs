//! OpenAI's Responses API: `POST /v1/responses`,
//! `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`.
//!
//! A request is read as its equivalent chat conversation (`instructions`
//! as the system message, then `input`: a string as a user message,
//! message items as messages, function calls and their outputs as an
//! assistant's tool calls and `tool` messages: [`switchyard_wire::agentic`]),
//! bounded while parsed, rendered with the model's chat template by the
//! chat path's tokenizer (the same prefix as the equivalent chat request),
//! charged, placed and forwarded unchanged; its stream's named events are
//! passed through.
//!
//! Stored responses live on the worker that answered them (vLLM keeps
//! them in its memory). The router remembers which worker that is
//! ([`crate::response_map`], bounded and expiring) from the answer's id
//! (a whole answer's `id`, a stream's `response.created`), and sends to
//! that worker, and no other:
//!
//! - a request whose `previous_response_id` names it (pinned: never
//!   moved to another worker, even before its first token; its prompt is
//!   only the new input, the rest being on that worker);
//! - `GET /v1/responses/{id}` and `POST /v1/responses/{id}/cancel`.
//!
//! A stored response is its creator's: with client keys required, only
//! the key that created it finds it, and for any other key it does not
//! exist — `GET`, cancel and `previous_response_id` answer the same 404
//! as for an id never seen, before anything else is looked at or sent
//! ([`crate::response_map::Owner`]). A response the router does not know
//! for the caller (another key's, never answered through it, or
//! forgotten: capacity or TTL) is a 404; one whose worker has left the
//! fleet is a 410; one whose worker is unhealthy for now is a 503. A
//! chain is one session from its second turn on (the session the client
//! named for it, else one named after the response the chain continues,
//! in the caller's own namespace: [`crate::response_map::session_of`]).
//!
//! A client's `request_id` (which vLLM takes as the response's id) never
//! reaches a worker (`switchyard_wire::engine_body`), and a worker's
//! answer with an id another key holds is not recorded: a key cannot
//! plant its conversation under another's id.

use crate::error::ApiError;
use crate::front::auth::ClientKey;
use crate::request::agentic::{self, AgenticApi, AgenticDelivery, Remember};
use crate::request::codec::{ApiKind, Codec};
use crate::request::handlers::{finish, Ready};
use crate::request::prompt::{
    preamble, request_parts, session_key, Head, Later, PromptIds, PromptSource, TokenizeJob,
};
use crate::response_map::{session_of, Holder, Owner};
use crate::roster::WorkerInfo;
use crate::state::{App, AppState};
use axum::extract::{Path, Request, State};
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use std::sync::Arc;
use std::time::Instant;
use switchyard_core::admission::responses::{located, Located, Standing};
use switchyard_wire::agentic::MAX_RESPONSE_ID_BYTES;

const PATH: &str = "/v1/responses";

pub(crate) async fn responses(State(state): State<App>, request: Request) -> Response {
    let arrival = Instant::now();
    let (headers, key, body) = request_parts(&state, request).await;
    let result = async {
        let (body, flow) = body?;
        let (parsed, asked) = agentic::parse_responses(&state, &body)?;
        let named = session_key(&state, &headers, parsed.session_id.as_deref(), key);
        let owner = caller(&state, key);
        let (pinned, session) = match &parsed.previous_response_id {
            Some(previous) => {
                let (holder, _) =
                    locate_waiting(&state, previous, owner, "previous_response_id").await?;
                let namespace = key.and_then(|k| state.intake.credentials.key_name(k));
                let chain = session_of(previous, &holder, namespace);
                (Some(holder.worker), Some(named.unwrap_or(chain)))
            }
            None => (None, named),
        };
        let prompt = if parsed.messages.is_empty() {
            // Only items that make no message (a continued chain's image,
            // say): the prompt routing reads is empty.
            if pinned.is_none() {
                return Err(ApiError::bad_request(
                    "`input` has no message or text",
                    Some("input"),
                ));
            }
            let tools = parsed
                .tools
                .as_ref()
                .and_then(|t| serde_json::to_vec(t).ok());
            let bytes = parsed.unrendered_bytes + tools.map_or(0, |t| t.len());
            PromptSource::Known(PromptIds {
                unrendered: crate::models::ModelRouting::estimated_tokens(bytes),
                ..PromptIds::of_ids(Vec::new())
            })
        } else {
            let job = TokenizeJob::chat(parsed.messages, parsed.tools, parsed.unrendered_bytes)?;
            PromptSource::Tokenize(job)
        };
        let head = Head {
            model: parsed.model,
            stream: parsed.stream,
            session: None,
            key,
            flow,
            asked,
        };
        let facts = preamble(&state, head, prompt, Later::default()).await?;
        let delivery = AgenticDelivery {
            api: AgenticApi::Responses,
            remember: parsed.store.then(|| Remember {
                map: state.apis.stored_responses.clone(),
                driver: Some(state.driver.clone()),
                session,
                owner,
            }),
        };
        Ok::<_, ApiError>(Ready {
            body,
            facts,
            session,
            codec: Codec::Named(Arc::new(delivery)),
            pinned,
        })
    }
    .await;
    finish(
        state,
        headers,
        ApiKind::Agentic(AgenticApi::Responses),
        arrival,
        result,
    )
    .await
}

/// The owner a caller with `key` may see stored responses of: its key's
/// (none when the router requires no keys).
pub(crate) fn caller(state: &AppState, key: Option<ClientKey>) -> Option<Owner> {
    key.and_then(|k| state.intake.credentials.key_name(k))
        .map(Owner::of_key)
}

/// `GET /v1/responses/{id}`: the stored response, from its worker.
pub(crate) async fn get_response(
    State(state): State<App>,
    Path(id): Path<String>,
    request: Request,
) -> Response {
    let owner = caller(&state, request.extensions().get::<ClientKey>().copied());
    stored(state, id, owner, Method::GET, "").await
}

/// `POST /v1/responses/{id}/cancel`: passed to the worker that has it.
pub(crate) async fn cancel_response(
    State(state): State<App>,
    Path(id): Path<String>,
    request: Request,
) -> Response {
    // The body (none is expected) is read within the limit and dropped.
    let (_, key, body) = request_parts(&state, request).await;
    if let Err(e) = body {
        return e.into_response();
    }
    let owner = caller(&state, key);
    stored(state, id, owner, Method::POST, "/cancel").await
}

async fn stored(
    state: App,
    id: String,
    owner: Option<Owner>,
    method: Method,
    suffix: &str,
) -> Response {
    let result = async {
        if !valid_id(&id) {
            return Err(ApiError::not_found(
                "no such response: an id is at most 128 letters, digits, `_` or `-`",
                None,
            ));
        }
        let (_, worker) = locate_waiting(&state, &id, owner, "response_id").await?;
        let disclosure = state.disclosure();
        (state.upstream)
            .direct(
                &worker,
                disclosure,
                method,
                format!("{PATH}/{id}{suffix}"),
                Bytes::new(),
            )
            .await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// An id that may be put in a path as it is.
fn valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= MAX_RESPONSE_ID_BYTES
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// How long a replica with replica sync on waits for a peer's word of a
/// response it does not know before answering 404: a client may send a
/// chain's next turn to another replica before the previous turn's entry
/// has crossed the plane (a millisecond or two on one network).
const PEER_GRACE: std::time::Duration = std::time::Duration::from_millis(100);

/// [`locate`], waiting up to [`PEER_GRACE`] for an unknown id when peers
/// may be about to tell (replica sync on).
async fn locate_waiting(
    state: &AppState,
    id: &str,
    owner: Option<Owner>,
    param: &'static str,
) -> Result<(Holder, WorkerInfo), ApiError> {
    let known = || {
        state
            .apis
            .stored_responses
            .get(id, owner, Instant::now())
            .is_some()
    };
    if state.upstream.router_id.is_some() && !known() {
        let until = tokio::time::Instant::now() + PEER_GRACE;
        while tokio::time::Instant::now() < until {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            if known() {
                break;
            }
        }
    }
    locate(state, id, owner, param)
}

/// Where response `id` of `owner` is stored, and its worker: the core's
/// decision ([`located`]) answered as a 404 when the router does not know
/// it for that owner (another's is not there for it), a 410 when its
/// worker has left the fleet, a 503 while its worker is out of selection
/// (unhealthy).
fn locate(
    state: &AppState,
    id: &str,
    owner: Option<Owner>,
    param: &'static str,
) -> Result<(Holder, WorkerInfo), ApiError> {
    let holder = state.apis.stored_responses.get(id, owner, Instant::now());
    let mut row = None;
    let decision = located(holder, |w| match state.driver.worker(w) {
        None => Standing::Gone,
        Some(info) => {
            let in_selection = info.in_router;
            row = Some(info);
            if in_selection {
                Standing::InSelection
            } else {
                Standing::OutOfSelection
            }
        }
    });
    let gone = || {
        ApiError::gone(
            format!("response {id:?} was stored by a worker that has left the fleet"),
            Some(param),
        )
    };
    match decision {
        Located::At(holder) => row.map(|worker| (holder, worker)).ok_or_else(gone),
        Located::Unknown => Err(ApiError::not_found(
            format!(
                "response {id:?} is not known to the router: it was not answered through it, or it was forgotten (--max-stored-responses, --stored-response-ttl-secs)"
            ),
            Some(param),
        )),
        Located::WorkerGone(_) => Err(gone()),
        Located::WorkerOutOfSelection(_) => {
            let name = row.map(|w| w.name).unwrap_or_default();
            Err(ApiError::no_workers(format!(
                "response {id:?} is stored by {}, which is out of selection (unhealthy); retry later",
                state.disclosure().worker(&name)
            )))
        }
    }
}

/// A worker in selection that serves `model` (for a request that books
/// nothing: `count_tokens` without a tokenizer here).
pub(crate) fn any_worker_for(
    state: &AppState,
    model: Option<&str>,
) -> Result<WorkerInfo, ApiError> {
    state
        .driver
        .workers()
        .into_iter()
        .find(|w| {
            w.in_router
                && !w.draining
                && model.is_none_or(|m| w.models.is_empty() || w.models.iter().any(|n| n == m))
        })
        .ok_or_else(|| ApiError::no_workers("no worker serves the model"))
}
