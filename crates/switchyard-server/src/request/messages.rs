//! Anthropic's Messages API: `POST /v1/messages` and
//! `POST /v1/messages/count_tokens`.
//!
//! A request is read as its equivalent chat conversation (`system` first,
//! text blocks joined, `tool_result` blocks as `tool` messages, `tool_use`
//! blocks as an assistant's tool calls: [`switchyard_wire::agentic`]),
//! bounded while parsed, and rendered with the model's chat template by
//! the chat path's tokenizer: the same prompt, and so the same block
//! hashes, as the equivalent `/v1/chat/completions` request. From there it
//! is a chat request: charged, placed, forwarded unchanged (the worker
//! answers in Anthropic's shape), its stream's named events passed
//! through. The router's own errors on these paths are Anthropic's
//! (`{"type":"error","error":{...}}`, [`crate::error::anthropic_shaped`]);
//! Anthropic's `x-api-key` header is a client key like a bearer token
//! ([`crate::front::auth`]).
//!
//! `count_tokens` is answered by the router itself when it has the
//! model's tokenizer (the rendered prompt's length), else forwarded to a
//! worker serving the model; it books nothing.

use crate::error::ApiError;
use crate::request::agentic::{self, AgenticApi, AgenticDelivery};
use crate::request::context::Shared;
use crate::request::handlers::{finish_agentic, AgenticRoute};
use crate::request::prompt::{
    charge_tokens, chat_messages, request_parts, session_key, tokenize, Parsed, TokenizeJob,
};
use crate::request::responses::{any_worker_for, direct};
use axum::extract::{Request, State};
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Instant;

pub(crate) const PATH: &str = "/v1/messages";

pub(crate) async fn messages(State(state): State<Shared>, request: Request) -> Response {
    let arrival = Instant::now();
    let (headers, key, body) = request_parts(&state, request).await;
    let result = async {
        let (body, flow) = body?;
        let (parsed, asked) = agentic::parse_messages(&state, &body)?;
        let messages = chat_messages(parsed.messages)?;
        let prompt = tokenize(&state, parsed.model.as_deref(), TokenizeJob::Chat(messages)).await?;
        charge_tokens(&state, key, prompt.len() as u64, 1, asked)?;
        let session = session_key(&state, &headers, None, key);
        let delivery = AgenticDelivery {
            api: AgenticApi::Messages,
            remember: None,
            state: state.agentic.clone(),
        };
        let facts = Parsed {
            model: parsed.model,
            stream: parsed.stream,
            session: None,
            key,
            flow,
            prompt,
            asked,
        };
        let route = AgenticRoute {
            delivery: Arc::new(delivery),
            pinned: None,
        };
        Ok::<_, ApiError>((body, facts, session, route))
    }
    .await;
    finish_agentic(state, headers, AgenticApi::Messages, PATH, arrival, result).await
}

pub(crate) async fn count_tokens(State(state): State<Shared>, request: Request) -> Response {
    let (_, _, body) = request_parts(&state, request).await;
    let result = async {
        let (body, _) = body?;
        let (parsed, _) = agentic::parse_messages(&state, &body)?;
        let model = parsed.model.clone();
        let routing = state
            .models
            .for_request(&state.shared.adapters, model.as_deref());
        if routing.tokenizer.is_some() {
            let messages = chat_messages(parsed.messages)?;
            let prompt = tokenize(&state, model.as_deref(), TokenizeJob::Chat(messages)).await?;
            return Ok(
                axum::Json(serde_json::json!({"input_tokens": prompt.len()})).into_response(),
            );
        }
        let worker = any_worker_for(&state, model.as_deref())?;
        direct(
            &state,
            &worker,
            Method::POST,
            "/v1/messages/count_tokens".to_owned(),
            body,
        )
        .await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}
