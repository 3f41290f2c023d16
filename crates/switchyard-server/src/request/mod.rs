//! One request, from the handler to the last byte, read top to bottom.
//!
//! What every handler shares is [`crate::state::AppState`].
//!
//! - [`handlers`] — `/v1/chat/completions` and `/v1/completions`: parse
//!   only the fields routing needs, tokenize, charge the key, hand over.
//! - [`responses`], [`messages`] — `/v1/responses` (with stored
//!   responses' affinity) and Anthropic's `/v1/messages`: read as their
//!   equivalent chat, then the placement loop every request takes;
//!   [`agentic`] — what the two share (their streams are the wire crate's
//!   `stream_codec::named`: forwarded unchanged, and a broken plain-text
//!   one resumed).
//! - [`codec`] — which API a request came through and so how its answer
//!   is read (the chat API's chunks, or the Responses and Messages APIs'
//!   named events): the shared path asks it and names no API.
//! - [`prompt`] — what the handlers share: the one preamble after parsing
//!   (`preamble`: the prompt's token ids, or an estimate, and the key's
//!   token charge), the session.
//! - [`limits`] — input limits, each refusal naming its limit.
//! - [`attempt`] — one request's attempts on workers: the placement loop
//!   (submit, placed, failed, moved before the deadline) that plain and
//!   disaggregated requests share.
//! - [`adapter_load`] — the request's adapter loaded on its worker first.
//! - [`disagg`] — prefill/decode-disaggregated requests: two halves, each
//!   placed through the same loop, and the engine family's protocol.
//! - [`answer`] — a worker's answer on its way to the client (its head
//!   as `crate::upstream` makes it for the client).
//! - [`stream`] — the streaming body: one relay for every API (each
//!   API's events are its codec's, `switchyard_wire::stream_codec`),
//!   forwards events and resumes a broken stream on another worker (what a failure becomes is the core's
//!   `dispatch::failure`; the bodies — can it resume, the resume request,
//!   a body's fields without a JSON tree — are the wire crate's
//!   `resume` and `body_fields`).

pub(crate) mod adapter_load;
pub(crate) mod agentic;
pub(crate) mod answer;
pub(crate) mod attempt;
pub(crate) mod codec;
pub(crate) mod disagg;
pub mod flow;
pub(crate) mod handlers;
pub mod limits;
pub(crate) mod messages;
pub(crate) mod prompt;
pub(crate) mod responses;
pub(crate) mod stream;

/// Largest single SSE event the router accepts from a worker.
pub(crate) const MAX_EVENT_BYTES: usize = 256 * 1024;
