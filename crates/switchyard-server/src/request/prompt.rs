//! What the handlers share before a request is handed over: its body and
//! head, the prompt's token ids (or, for a model without a tokenizer here,
//! an estimate of its length), the key's token charge and the session.
//!
//! A prompt's size is everything the engine renders into it, whatever
//! API it came through: message text, the tools a request declares and an
//! assistant's tool calls (rendered by the model's chat template, as the
//! engine renders them, so their tokens are in the ids routing hashes),
//! and what the template does not see — reasoning items, thinking blocks,
//! other non-text items, and tools or tool calls a template does not read
//! — estimated at [`crate::models::BYTES_PER_TOKEN_ESTIMATE`] bytes a
//! token ([`PromptIds::unrendered`]). The prompt limit, the key's token
//! quota, the fair share and the load view all count the whole.

use crate::error::ApiError;
use crate::front::auth::ClientKey;
use crate::front::upload::{read_whole, ReadError};
use crate::request::limits;
use crate::state::AppState;
use crate::tokenize::{Pause, INLINE_CHARS};
use axum::body::Body;
use axum::extract::Request;
use axum::http::HeaderMap;
use bytes::Bytes;
use serde::Deserialize;
use std::time::Instant;
use switchyard_core::admission::{Flow, SessionKey};
use switchyard_tokenizer::prompt::ChatPrompt;
use switchyard_tokenizer::ChatMessage;
use switchyard_wire::openai::Message;

/// the upload layer: its one buffer, taken as it is).
pub(crate) async fn read_body(state: &AppState, body: Body) -> Result<Bytes, ApiError> {
    read_whole(body, state.intake.max_body_bytes)
        .await
        .map_err(|e| match e {
            ReadError::TooLarge => ApiError::too_large(state.intake.max_body_bytes),
            ReadError::Broken => ApiError::bad_request("could not read the request body", None),
        })
}

pub(crate) fn parse<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("invalid request body: {e}"), None))
}

/// The routing facts of one request.
pub(crate) struct Parsed {
    pub(crate) model: Option<String>,
    pub(crate) stream: bool,
    /// The body's `session_id` (the `x-session-id` header wins).
    pub(crate) session: Option<String>,
    /// The client key it came with.
    pub(crate) key: Option<ClientKey>,
    /// Its tenant, band and deadline, from the key and headers (its
    /// expected output is set when it is placed, from `asked`).
    pub(crate) flow: Flow,
    /// The prompt routing reads (of a batch, its first).
    pub(crate) prompt: PromptIds,
    /// What it asks the workers to generate.
    pub(crate) asked: super::limits::Asked,
}

/// A prompt as routing knows it: its token ids, or, when its model has
/// no tokenizer here, an estimate of its length ([`crate::models`]; `ids`
/// is then empty); and the estimated tokens of what the engine renders
/// that the ids do not carry.
pub(crate) struct PromptIds {
    pub(crate) ids: Vec<u32>,
    pub(crate) estimated: Option<u32>,
    /// Tokens the engine renders beyond `ids` (reasoning, other items,
    /// tools a template does not read), estimated from their bytes.
    pub(crate) unrendered: u32,
}

impl PromptIds {
    /// Token ids alone (nothing estimated).
    pub(crate) fn of_ids(ids: Vec<u32>) -> Self {
        Self {
            ids,
            estimated: None,
            unrendered: 0,
        }
    }

    /// The prompt's whole size in tokens, as limits, charges and the load
    /// view count it.
    pub(crate) fn len(&self) -> usize {
        self.estimated
            .map_or(self.ids.len(), |n| n as usize)
            .saturating_add(self.unrendered as usize)
    }
}

/// The router's reading of chat messages
/// ([`switchyard_tokenizer::render::chat_messages`], the sim-worker's
/// too), or a 400 naming `messages`.
pub(crate) fn chat_messages(body: Vec<Message>) -> Result<Vec<ChatMessage>, ApiError> {
    switchyard_tokenizer::render::chat_messages(body)
        .map_err(|e| ApiError::bad_request(e.to_string(), Some("messages")))
}

/// The prompt's token ids with the tokenizer of the request's `model`,
/// or a 400 when it is past the prompt token limit (the tokenizer stops
/// counting soon after the limit). A model without a tokenizer here gets
/// an estimate of the prompt's length instead (the worker judges its
/// limit). A long prompt waits for a slot of the tokenizing gate, in
/// `flow`'s band and its tenant's fair share ([`crate::tokenize_gate`]).
pub(crate) async fn tokenize(
    state: &AppState,
    model: Option<&str>,
    job: TokenizeJob,
    flow: &Flow,
) -> Result<PromptIds, ApiError> {
    let started = Instant::now();
    let limit = limits::prompt_token_limit(state).0;
    let param = match &job {
        TokenizeJob::Text(_) => "prompt",
        TokenizeJob::Chat(_) => "messages",
    };
    // The size of the text the tokenizer reads: a chat's estimated as
    // rendered (its template adds to every message, empty ones included).
    let chars = match &job {
        TokenizeJob::Text(t) => t.len(),
        TokenizeJob::Chat(c) => c.rendered_size(),
    };
    let routing = state
        .prompts
        .models
        .for_request(&state.driver.adapters, model);
    let Some(tokenizer) = routing.tokenizer.clone() else {
        let unrendered = match &job {
            TokenizeJob::Chat(c) => c.unrendered_bytes,
            TokenizeJob::Text(_) => 0,
        };
        let prompt = PromptIds {
            ids: Vec::new(),
            estimated: Some(crate::models::ModelRouting::estimated_tokens(chars)),
            unrendered: crate::models::ModelRouting::estimated_tokens(unrendered),
        };
        return Ok(prompt);
    };
    // What the template will not render is counted by its bytes, and the
    // ids get what the limit leaves.
    let unrendered = match &job {
        TokenizeJob::Chat(c) => {
            crate::models::ModelRouting::estimated_tokens(c.unrendered_by(tokenizer.as_ref()))
        }
        TokenizeJob::Text(_) => 0,
    };
    let Some(max_tokens) = limit.checked_sub(unrendered as usize) else {
        return Err(limits::prompt_too_long(state, param));
    };
    let run = move |pause: Pause<'_>| match job {
        TokenizeJob::Text(t) => tokenizer.encode_within(&t, max_tokens, pause),
        TokenizeJob::Chat(c) => c.encode_within(tokenizer.as_ref(), max_tokens, pause),
    };
    let result = if chars <= INLINE_CHARS {
        run(&mut |_| {})
    } else {
        let weight = state.intake.flows.weight(flow.tenant);
        let slot = state
            .prompts
            .tokenize_gate
            .enter(flow, chars, weight)
            .await
            .map_err(|_| ApiError::tokenize_gate_full(crate::tokenize_gate::MAX_WAITING))?;
        // The slot goes with the work: freed when the tokenizing ends, not
        // when a client that went away drops this future.
        // Between pieces, the slot goes to a prompt owed it first.
        tokio::task::spawn_blocking(move || run(&mut |done| slot.pause_point(done)))
            .await
            .map_err(|_| ApiError::internal("the tokenizer task failed"))?
    };
    state
        .driver
        .metrics()
        .tokenize
        .observe(started.elapsed().as_secs_f64());
    let ids = result
        .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}"), None))?
        .ok_or_else(|| limits::prompt_too_long(state, param))?;
    Ok(PromptIds {
        unrendered,
        ..PromptIds::of_ids(ids)
    })
}

pub(crate) enum TokenizeJob {
    Text(String),
    Chat(ChatPrompt),
}

impl TokenizeJob {
    /// The chat of `messages` declaring `tools`, with `unrendered_bytes`
    /// the template will not see; a 400 for messages the router cannot
    /// read ([`chat_messages`]).
    pub(crate) fn chat(
        messages: Vec<Message>,
        tools: Option<serde_json::Value>,
        unrendered_bytes: usize,
    ) -> Result<Self, ApiError> {
        Ok(Self::Chat(ChatPrompt {
            messages: chat_messages(messages)?,
            tools,
            unrendered_bytes,
        }))
    }
}

/// What a handler has read of a request before its prompt is known: the
/// model, whether it streams, the body's session, the key, the flow and
/// what it asks to generate.
pub(crate) struct Head {
    pub(crate) model: Option<String>,
    pub(crate) stream: bool,
    pub(crate) session: Option<String>,
    pub(crate) key: Option<ClientKey>,
    pub(crate) flow: Flow,
    pub(crate) asked: limits::Asked,
}

/// Where a request's routing prompt comes from: text or a chat to
/// tokenize, or ids (or an estimate) the body already gave.
pub(crate) enum PromptSource {
    Tokenize(TokenizeJob),
    Known(PromptIds),
}

/// A batch's prompts after its first, charged but not routed on: how many,
/// and their tokens (counted or estimated).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Later {
    pub(crate) prompts: u64,
    pub(crate) tokens: u64,
}

/// The one preamble every handler shares once it has parsed its body: the
/// prompt tokenized (within the prompt limit, in the tokenizing gate's
/// turn), its tokens and `later` prompts' charged to the key, and the facts
/// the placement loop reads.
pub(crate) async fn preamble(
    state: &AppState,
    head: Head,
    prompt: PromptSource,
    later: Later,
) -> Result<Parsed, ApiError> {
    let prompt = match prompt {
        PromptSource::Tokenize(job) => {
            tokenize(state, head.model.as_deref(), job, &head.flow).await?
        }
        PromptSource::Known(ids) => ids,
    };
    let tokens = (prompt.len() as u64).saturating_add(later.tokens);
    charge_tokens(state, head.key, tokens, 1 + later.prompts, head.asked)?;
    Ok(Parsed {
        model: head.model,
        stream: head.stream,
        session: head.session,
        key: head.key,
        flow: head.flow,
        prompt,
        asked: head.asked,
    })
}

/// Charges a request to its key's token limit ([`crate::front::ratelimit`]):
/// `prompt_tokens` of all its `prompts`, and what it `asked` for each.
pub(crate) fn charge_tokens(
    state: &AppState,
    key: Option<ClientKey>,
    prompt_tokens: u64,
    prompts: u64,
    asked: limits::Asked,
) -> Result<(), ApiError> {
    let credentials = &state.intake.credentials;
    let tokens = asked.token_charge(prompt_tokens, prompts, credentials.output_allowance());
    let key = key.map_or(0, |ClientKey(k)| k);
    credentials
        .rate_limits()
        .check_tokens(key, tokens)
        .map_err(ApiError::from)
}

/// The session a request belongs to (the core's
/// [`SessionKey::of_request`]): the `x-session-id` header, else the body's
/// `session_id`; with client keys configured, the client key's own, so a
/// client cannot hold back another's session by naming its id.
pub(crate) fn session_key(
    state: &AppState,
    headers: &HeaderMap,
    body_session: Option<&str>,
    key: Option<ClientKey>,
) -> Option<SessionKey> {
    SessionKey::of_request(
        headers.get("x-session-id").and_then(|v| v.to_str().ok()),
        body_session,
        key.and_then(|k| state.intake.credentials.key_name(k)),
    )
}

/// A handler's request: its head's headers and client key, then its flow
/// (tenant, band, deadline: [`super::flow`]) and its body read whole.
/// The flow headers are resolved before the body is read, so a bad one
/// costs no read. The headers are moved out of the request, not copied
/// (axum's `HeaderMap` extractor clones them), and the body, already read
/// by the upload layer, is taken as the one buffer it is.
pub(crate) async fn request_parts(
    state: &AppState,
    request: Request,
) -> (
    HeaderMap,
    Option<ClientKey>,
    Result<(Bytes, Flow), ApiError>,
) {
    let (parts, body) = request.into_parts();
    let key = parts.extensions.get::<ClientKey>().copied();
    let arrival_ms = state.driver.now_ms();
    let read = match super::flow::resolve(state, &parts.headers, key, arrival_ms) {
        Ok(flow) => read_body(state, body).await.map(|body| (body, flow)),
        Err(e) => Err(e),
    };
    (parts.headers, key, read)
}

#[cfg(test)]
#[path = "prompt_tests.rs"]
mod tests;
