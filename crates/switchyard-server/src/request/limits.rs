//! Input limits: every part of a request body that costs the router memory
//! or time in proportion to its size is bounded, and each bound is stated
//! in the refusal.
//!
//! | limit | default | refused |
//! |---|---|---|
//! | body bytes (`--max-body-bytes`) | 32 MiB | 413 before parsing |
//! | prompt tokens (`--max-prompt-tokens`) | the largest `max_model_len` the workers report, else 131 072 | 400, `param: prompt` (chat: `messages`) |
//! | messages (`--max-messages`) | 4096 | 400, `param: messages` |
//! | content parts, all messages (`--max-content-parts`) | 16 384 | 400, `param: messages` |
//! | `n`, `best_of` (`--max-n`) | 16 | 400, `param:` the field |
//! | `max_tokens` / `max_completion_tokens` (`--max-output-tokens`) | the prompt token limit | 400, `param:` the field |
//! | a count that is no integer (`1.5`, `"many"`, `-1`, a list) | — | 400, `param:` the field |
//!
//! Token-id prompts, messages and content parts are bounded while the body
//! is parsed ([`BodyLimits`]): parsing stops at the first element past a
//! bound, so a refused body costs the body and the bounded part parsed. A
//! batch keeps only its first prompt (the one the request is routed by);
//! the others are checked against the token limit and dropped. Text
//! prompts and chats (as rendered) are bounded while tokenized: the
//! tokenizer encodes a long text a piece at a time and stops at the first
//! piece past the limit, so a text far over it costs about the limit's
//! work, not the text's.
//!
//! Counts (`n`, `best_of`, `max_tokens`, `max_completion_tokens`) are
//! **normalised for the check, never rewritten**: each is read as the
//! integer vLLM and SGLang read (their request models declare the fields
//! `int` in pydantic's lax mode, which takes `64.0`, `1e8` and `"64"` as
//! integers and refuses `1.5`), so a limit binds whatever JSON form the
//! count takes, and the body is forwarded as the client sent it. A value
//! that is no integer in any form the router reads (a fraction, a
//! negative, a string such as `"1e8"` or `"+64"`, a list, an object) is
//! refused with a 400 naming the field rather than forwarded. Every
//! refusal past a limit is counted in
//! `switchyard_input_limit_refusals_total{limit}`.

use crate::config::FALLBACK_MAX_PROMPT_TOKENS;
use crate::error::ApiError;
use crate::metrics::InputLimit;
use crate::state::AppState;
use switchyard_wire::openai::{
    BodyError, BodyLimits, ChatCompletionRequest, CompletionRequest, Lenient, Limit,
};

/// The prompt token limit in force and where it comes from (for the
/// refusal's message).
pub(crate) fn prompt_token_limit(state: &AppState) -> (usize, &'static str) {
    if let Some(max) = state.intake.limits.prompt_tokens {
        return (max, "--max-prompt-tokens");
    }
    match state.fleet.max_model_len() {
        Some(len) => (
            usize::try_from(len).unwrap_or(usize::MAX),
            "the largest max_model_len the workers report",
        ),
        None => (
            FALLBACK_MAX_PROMPT_TOKENS,
            "the router's default; set --max-prompt-tokens",
        ),
    }
}

pub(crate) fn body_limits(state: &AppState) -> BodyLimits {
    BodyLimits {
        prompt_tokens: prompt_token_limit(state).0,
        messages: state.intake.limits.messages,
        content_parts: state.intake.limits.content_parts,
        first_prompt_only: true,
    }
}

pub(crate) fn refuse(
    state: &AppState,
    limit: InputLimit,
    message: String,
    param: &'static str,
) -> ApiError {
    state.driver.metrics().count_limit_refusal(limit);
    ApiError::bad_request(message, Some(param))
}

fn body_error(state: &AppState, error: BodyError) -> ApiError {
    match error {
        BodyError::Json(e) => ApiError::bad_request(format!("invalid request body: {e}"), None),
        BodyError::Over(over) => {
            let (limit, message) = match over.limit {
                Limit::PromptTokens => {
                    let (max, source) = prompt_token_limit(state);
                    (
                        InputLimit::PromptTokens,
                        format!("a prompt is longer than the limit of {max} tokens ({source})"),
                    )
                }
                Limit::Messages => (
                    InputLimit::Messages,
                    format!(
                        "the chat has more messages than the limit of {} (--max-messages)",
                        over.max
                    ),
                ),
                Limit::ContentParts => (
                    InputLimit::ContentParts,
                    format!(
                        "the chat's messages have more content parts than the limit of {} (--max-content-parts)",
                        over.max
                    ),
                ),
            };
            refuse(state, limit, message, over.limit.param())
        }
    }
}

pub(crate) use switchyard_core::admission::ask::Asked;
use switchyard_core::admission::ask::{AskLimits, OverAsk};

/// A count field's value: `None` when absent or `null`, a 400 naming it
/// when it is not a count in any form the engines read as one (a JSON
/// integer, an integral float such as `64.0`, a string such as `"64"`:
/// [`Lenient`]'s reading).
fn read_count(field: &Option<Lenient<u32>>, name: &'static str) -> Result<Option<u32>, ApiError> {
    field
        .as_ref()
        .map(|v| v.count(name))
        .transpose()
        .map_err(ApiError::from)
}

/// `n`, `best_of` and the output token fields against their limits
/// (the core's [`Asked::within`]), whatever JSON form each takes: each is
/// read as the integer the engines read (so `64.0` and `"64"` are 64 and
/// past a limit of 16), and a value that is no count in any form is
/// refused naming it (before any limit is checked).
pub(crate) fn check_counts(
    state: &AppState,
    choices: [(&Option<Lenient<u32>>, &'static str); 2],
    outputs: [(&Option<Lenient<u32>>, &'static str); 2],
) -> Result<Asked, ApiError> {
    let read = |(field, name)| read_count(field, name).map(|count| (count, name));
    let choices = [read(choices[0])?, read(choices[1])?];
    let outputs = [read(outputs[0])?, read(outputs[1])?];
    let (max, source) = match state.intake.limits.output_tokens {
        Some(max) => (max as usize, "--max-output-tokens"),
        None => prompt_token_limit(state),
    };
    let limits = AskLimits {
        choices: state.intake.limits.n,
        output_tokens: max as u64,
    };
    Asked::within(&choices, &outputs, limits).map_err(|over| {
        let OverAsk {
            field, value, max, ..
        } = over;
        match over.output {
            false => {
                let message = format!("`{field}` is {value}, over the limit of {max} (--max-n)");
                refuse(state, InputLimit::N, message, field)
            }
            true => {
                let message =
                    format!("`{field}` is {value}, over the limit of {max} tokens ({source})");
                refuse(state, InputLimit::OutputTokens, message, field)
            }
        }
    })
}

/// A `/v1/completions` body, parsed within the limits, and what it asks
/// for.
pub(crate) fn parse_completion(
    state: &AppState,
    body: &[u8],
) -> Result<(CompletionRequest, Asked), ApiError> {
    let parsed = CompletionRequest::from_json(body, &body_limits(state))
        .map_err(|e| body_error(state, e))?;
    let asked = check_counts(
        state,
        [(&parsed.n, "n"), (&parsed.best_of, "best_of")],
        [(&parsed.max_tokens, "max_tokens"), (&None, "")],
    )?;
    Ok((parsed, asked))
}

/// A `/v1/chat/completions` body, parsed within the limits, and what it
/// asks for.
pub(crate) fn parse_chat(
    state: &AppState,
    body: &[u8],
) -> Result<(ChatCompletionRequest, Asked), ApiError> {
    let parsed = ChatCompletionRequest::from_json(body, &body_limits(state))
        .map_err(|e| body_error(state, e))?;
    let asked = check_counts(
        state,
        [(&parsed.n, "n"), (&None, "")],
        [
            (&parsed.max_tokens, "max_tokens"),
            (&parsed.max_completion_tokens, "max_completion_tokens"),
        ],
    )?;
    Ok((parsed, asked))
}

/// A 400 for a text prompt or a chat (as rendered) whose tokens passed the
/// prompt token limit; `param` is the field that held it.
pub(crate) fn prompt_too_long(state: &AppState, param: &'static str) -> ApiError {
    let (max, source) = prompt_token_limit(state);
    let message = format!("the prompt is longer than the limit of {max} tokens ({source})");
    refuse(state, InputLimit::PromptTokens, message, param)
}

#[cfg(test)]
mod tests {
    use crate::fleet::Fleet;
    use crate::metrics::{InputLimit, ServerMetrics};
    use crate::tokenize::PromptTokenizer;
    use crate::upstream::client as upstream_client;
    use crate::{build_driver, routes::app, state::AppState, ServerConfig};
    use axum::body::Body;
    use http_body_util::BodyExt as _;
    use serde_json::{json, Value};
    use std::sync::Arc;
    use std::time::Duration;
    use switchyard_tokenizer::{ChatMessage, TokenizerError};
    use tower::ServiceExt as _;

    /// One token per byte of text; a chat is its contents.
    struct ByteTokens;

    impl PromptTokenizer for ByteTokens {
        fn encode(&self, text: &str) -> Result<Vec<u32>, TokenizerError> {
            Ok(text.bytes().map(u32::from).collect())
        }
        fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, TokenizerError> {
            Ok(messages
                .iter()
                .flat_map(|m| m.content.bytes().map(u32::from))
                .collect())
        }
    }

    /// The app of a router with no workers, configured by `config`:
    /// a request within the limits ends in 503 (no worker).
    fn router(config: ServerConfig) -> (axum::Router, Arc<ServerMetrics>) {
        let metrics = Arc::new(ServerMetrics::new(config.policy.name()));
        let driver = Arc::new(build_driver(&config, metrics.clone()).unwrap());
        let client = upstream_client(Duration::from_millis(100));
        let fleet = Arc::new(Fleet::new(
            driver.clone(),
            client.clone(),
            false,
            config.block_size,
            config.health_failures,
            Duration::from_millis(100),
        ));
        let state = AppState::new(&config, driver, fleet, client, Arc::new(ByteTokens), None);
        (app(Arc::new(state)), metrics)
    }

    async fn post(app: &axum::Router, path: &str, body: Value) -> (u16, Value) {
        let request = axum::http::Request::post(path)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        let status = response.status().as_u16();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    fn limited() -> ServerConfig {
        ServerConfig {
            max_prompt_tokens: Some(4),
            max_messages: 2,
            max_content_parts: 3,
            max_n: 2,
            max_output_tokens: Some(10),
            ..ServerConfig::default()
        }
    }

    /// Asserts a 400 naming `param` and the limit's value, counted under
    /// `limit`.
    async fn refused(
        app: &axum::Router,
        metrics: &ServerMetrics,
        path: &str,
        body: Value,
        param: &str,
        limit: InputLimit,
        says: &str,
    ) {
        let before = metrics.limit_refusals(limit);
        let (status, answer) = post(app, path, body.clone()).await;
        assert_eq!(status, 400, "{body}: {answer}");
        assert_eq!(answer["error"]["param"], param, "{answer}");
        assert_eq!(answer["error"]["type"], "invalid_request_error");
        let message = answer["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{body}: {message}");
        assert_eq!(metrics.limit_refusals(limit), before + 1, "{body}");
    }

    #[tokio::test]
    async fn each_limit_refuses_with_a_400_naming_it_and_counts_it() {
        let (app, metrics) = router(limited());
        let completions = "/v1/completions";
        let chat = "/v1/chat/completions";
        let m = json!({"role": "user", "content": "a"});
        use InputLimit::*;
        for (path, body, param, limit, says) in [
            (
                completions,
                json!({"prompt": [1, 2, 3, 4, 5]}),
                "prompt",
                PromptTokens,
                "limit of 4 tokens (--max-prompt-tokens)",
            ),
            (
                completions,
                json!({"prompt": [[1], [1, 2, 3, 4, 5]]}),
                "prompt",
                PromptTokens,
                "limit of 4 tokens",
            ),
            (
                completions,
                json!({"prompt": "abcde"}),
                "prompt",
                PromptTokens,
                "the prompt is longer than the limit of 4 tokens",
            ),
            (
                chat,
                json!({"messages": [{"role": "user", "content": "abcde"}]}),
                "messages",
                PromptTokens,
                "longer than the limit of 4 tokens",
            ),
            (
                chat,
                json!({"messages": [m, m, m]}),
                "messages",
                Messages,
                "limit of 2 (--max-messages)",
            ),
            (
                chat,
                json!({"messages": [{"role": "user", "content": [{}, {}, {}, {}]}]}),
                "messages",
                ContentParts,
                "limit of 3 (--max-content-parts)",
            ),
            (
                completions,
                json!({"prompt": [1], "n": 3}),
                "n",
                N,
                "`n` is 3, over the limit of 2 (--max-n)",
            ),
            (chat, json!({"messages": [m], "n": 3}), "n", N, "limit of 2"),
            (
                completions,
                json!({"prompt": [1], "max_tokens": 11}),
                "max_tokens",
                OutputTokens,
                "`max_tokens` is 11, over the limit of 10 tokens (--max-output-tokens)",
            ),
            (
                chat,
                json!({"messages": [m], "max_completion_tokens": 11}),
                "max_completion_tokens",
                OutputTokens,
                "limit of 10",
            ),
        ] {
            refused(&app, &metrics, path, body, param, limit, says).await;
        }
        // At the limits, in every form a count takes: no refusal, so no
        // worker (503).
        for (path, body) in [
            (
                completions,
                json!({"prompt": [1, 2, 3, 4], "n": 2, "max_tokens": 10}),
            ),
            (
                completions,
                json!({"prompt": [1], "n": 2.0, "best_of": "2", "max_tokens": "10.0"}),
            ),
            (
                chat,
                json!({"messages": [m], "n": "2", "max_completion_tokens": 1e1}),
            ),
            (completions, json!({"prompt": [[1, 2, 3, 4], [1, 2, 3, 4]]})),
            (
                completions,
                json!({"prompt": "abcd", "n": null, "max_tokens": null}),
            ),
            (
                chat,
                json!({"messages": [m, {"role": "user", "content": [{}, {}, {"text": "b"}]}], "max_tokens": 10}),
            ),
        ] {
            let (status, answer) = post(&app, path, body.clone()).await;
            assert_eq!(status, 503, "{body}: {answer}");
        }
    }

    #[tokio::test]
    async fn a_count_past_its_limit_is_refused_whatever_json_form_it_takes() {
        let (app, metrics) = router(limited());
        let completions = "/v1/completions";
        let chat = "/v1/chat/completions";
        let m = json!({"role": "user", "content": "a"});
        use InputLimit::*;
        for (path, body, param, limit, says) in [
            (
                completions,
                json!({"prompt": [1], "n": 64.0}),
                "n",
                N,
                "`n` is 64, over the limit of 2 (--max-n)",
            ),
            (
                completions,
                json!({"prompt": [1], "n": "64"}),
                "n",
                N,
                "`n` is 64, over the limit of 2",
            ),
            (
                chat,
                json!({"messages": [m], "n": "3.0"}),
                "n",
                N,
                "`n` is 3",
            ),
            (
                completions,
                json!({"prompt": [1], "best_of": 3}),
                "best_of",
                N,
                "`best_of` is 3, over the limit of 2 (--max-n)",
            ),
            (
                completions,
                json!({"prompt": [1], "best_of": "3"}),
                "best_of",
                N,
                "`best_of` is 3",
            ),
            (
                completions,
                json!({"prompt": [1], "max_tokens": 1e8}),
                "max_tokens",
                OutputTokens,
                "`max_tokens` is 100000000, over the limit of 10 tokens (--max-output-tokens)",
            ),
            (
                completions,
                json!({"prompt": [1], "max_tokens": "100000000"}),
                "max_tokens",
                OutputTokens,
                "`max_tokens` is 100000000",
            ),
            (
                chat,
                json!({"messages": [m], "max_completion_tokens": 11.0}),
                "max_completion_tokens",
                OutputTokens,
                "`max_completion_tokens` is 11",
            ),
            (
                chat,
                json!({"messages": [m], "max_tokens": "11"}),
                "max_tokens",
                OutputTokens,
                "`max_tokens` is 11",
            ),
        ] {
            refused(&app, &metrics, path, body, param, limit, says).await;
        }
        // A value that is no count in any form: refused naming it (not a
        // limit: counted as an invalid request only).
        for (path, body, param) in [
            (completions, json!({"prompt": [1], "n": 1.5}), "n"),
            (completions, json!({"prompt": [1], "n": "many"}), "n"),
            (completions, json!({"prompt": [1], "n": [2]}), "n"),
            (
                completions,
                json!({"prompt": [1], "best_of": -1}),
                "best_of",
            ),
            (
                completions,
                json!({"prompt": [1], "max_tokens": -1}),
                "max_tokens",
            ),
            (
                completions,
                json!({"prompt": [1], "max_tokens": "1e8"}),
                "max_tokens",
            ),
            (
                completions,
                json!({"prompt": [1], "max_tokens": 1e20}),
                "max_tokens",
            ),
            (
                chat,
                json!({"messages": [m], "max_completion_tokens": {}}),
                "max_completion_tokens",
            ),
            (
                chat,
                json!({"messages": [m], "max_tokens": true}),
                "max_tokens",
            ),
        ] {
            let before = metrics.limit_refusals(N) + metrics.limit_refusals(OutputTokens);
            let (status, answer) = post(&app, path, body.clone()).await;
            assert_eq!(status, 400, "{body}: {answer}");
            assert_eq!(answer["error"]["param"], param, "{answer}");
            let message = answer["error"]["message"].as_str().unwrap();
            assert!(
                message.contains(&format!(
                    "`{param}` must be an integer from 0 to 4294967295"
                )),
                "{body}: {message}"
            );
            let after = metrics.limit_refusals(N) + metrics.limit_refusals(OutputTokens);
            assert_eq!(after, before, "{body}");
        }
    }

    #[tokio::test]
    async fn without_a_configured_or_reported_limit_the_fallback_is_in_force() {
        let (app, metrics) = router(ServerConfig::default());
        let limit = crate::config::FALLBACK_MAX_PROMPT_TOKENS;
        refused(
            &app,
            &metrics,
            "/v1/completions",
            json!({"prompt": [1], "max_tokens": limit + 1}),
            "max_tokens",
            InputLimit::OutputTokens,
            &format!(
                "over the limit of {limit} tokens (the router's default; set --max-prompt-tokens)"
            ),
        )
        .await;
        let ids = vec![0u32; limit + 1];
        refused(
            &app,
            &metrics,
            "/v1/completions",
            json!({ "prompt": ids }),
            "prompt",
            InputLimit::PromptTokens,
            &format!("limit of {limit} tokens"),
        )
        .await;
    }
}
