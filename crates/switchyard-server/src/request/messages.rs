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
//! worker serving the model; it books nothing, but its prompt is charged
//! to the key's token limit ([`crate::front::ratelimit`]) like a
//! message's, with no output.

use crate::error::ApiError;
use crate::request::agentic::{self, AgenticApi, AgenticDelivery};
use crate::request::codec::{ApiKind, Codec};
use crate::request::handlers::{finish, Ready};
use crate::request::limits::Asked;
use crate::request::prompt::{
    preamble, request_parts, session_key, Head, Later, PromptSource, TokenizeJob,
};
use crate::request::responses::any_worker_for;
use crate::state::App;
use axum::extract::{Request, State};
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use std::time::Instant;

pub(crate) async fn messages(State(state): State<App>, request: Request) -> Response {
    let arrival = Instant::now();
    let (headers, key, body) = request_parts(&state, request).await;
    let result = async {
        let (body, flow) = body?;
        let (parsed, asked) = agentic::parse_messages(&state, &body)?;
        let job = TokenizeJob::chat(parsed.messages, parsed.tools, parsed.unrendered_bytes)?;
        let head = Head {
            model: parsed.model,
            stream: parsed.stream,
            session: None,
            key,
            flow,
            asked,
        };
        let facts = preamble(&state, head, PromptSource::Tokenize(job), Later::default()).await?;
        let session = session_key(&state, &headers, None, key);
        let delivery = AgenticDelivery {
            api: AgenticApi::Messages,
            remember: None,
        };
        Ok::<_, ApiError>(Ready {
            body,
            facts,
            session,
            codec: Codec::Named(Arc::new(delivery)),
            pinned: None,
        })
    }
    .await;
    finish(
        state,
        headers,
        ApiKind::Agentic(AgenticApi::Messages),
        arrival,
        result,
    )
    .await
}

/// `count_tokens`: the prompt is tokenized (or, for a model without a
/// tokenizer here, its length estimated) and charged to the key's token
/// limit like a request's prompt with no output — counting costs the
/// router a tokenization, as a message does, so a key over its quota
/// gets the same 429 — then answered here or by a worker.
pub(crate) async fn count_tokens(State(state): State<App>, request: Request) -> Response {
    let (_, key, body) = request_parts(&state, request).await;
    let result = async {
        let (body, flow) = body?;
        let (parsed, _) = agentic::parse_messages(&state, &body)?;
        let model = parsed.model.clone();
        let job = TokenizeJob::chat(parsed.messages, parsed.tools, parsed.unrendered_bytes)?;
        let head = Head {
            model: parsed.model,
            stream: false,
            session: None,
            key,
            flow,
            asked: NO_OUTPUT,
        };
        let prompt = preamble(&state, head, PromptSource::Tokenize(job), Later::default())
            .await?
            .prompt;
        if prompt.estimated.is_none() {
            return Ok(
                axum::Json(serde_json::json!({"input_tokens": prompt.len()})).into_response(),
            );
        }
        let worker = any_worker_for(&state, model.as_deref())?;
        let disclosure = state.disclosure();
        (state.upstream)
            .direct(
                &worker,
                disclosure,
                Method::POST,
                "/v1/messages/count_tokens".to_owned(),
                body,
            )
            .await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// What `count_tokens` asks to generate: nothing.
const NO_OUTPUT: Asked = Asked {
    choices: 1,
    output_tokens: Some(0),
};

#[cfg(test)]
mod tests {
    use crate::fleet::Fleet;
    use crate::metrics::ServerMetrics;
    use crate::state::AppState;
    use crate::tokenize::HfTokenizer;
    use crate::upstream::client as upstream_client;
    use crate::ServerConfig;
    use axum::body::Body;
    use axum::http::StatusCode;
    use http_body_util::BodyExt as _;
    use serde_json::{json, Value};
    use std::sync::Arc;
    use std::time::Duration;
    use switchyard_tokenizer::Tokenizer;
    use tower::ServiceExt as _;

    /// A router with the bundled tokenizer and no workers (count_tokens
    /// is answered by the router itself), configured by `toml`.
    fn app(toml: &str) -> axum::Router {
        let config = ServerConfig::from_toml(toml).unwrap();
        let metrics = Arc::new(ServerMetrics::new(config.policy.name()));
        let driver = Arc::new(crate::build_driver(&config, metrics).unwrap());
        let client = upstream_client(Duration::from_secs(1));
        let fleet = Arc::new(Fleet::new(
            driver.clone(),
            client.clone(),
            false,
            config.block_size,
            3,
            Duration::from_secs(1),
        ));
        let tokenizer = Arc::new(HfTokenizer(Tokenizer::bundled().unwrap()));
        let state = AppState::new(&config, driver, fleet, client, tokenizer, None);
        crate::routes::app(Arc::new(state))
    }

    async fn count(app: &axum::Router, key: &str, text: &str) -> (StatusCode, Value) {
        let body = json!({
            "model": "m",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": text}],
        });
        let request = axum::http::Request::post("/v1/messages/count_tokens")
            .header("x-api-key", key)
            .header("content-type", "application/json")
            .body(Body::from(body.to_string()))
            .unwrap();
        let response = app.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        (status, serde_json::from_slice(&bytes).unwrap())
    }

    const KEYS: &str = r#"
[[rate_limits.keys]]
name = "a"
key = "sk-a"

[[rate_limits.keys]]
name = "b"
key = "sk-b"
tokens_per_minute = 2000
"#;

    #[tokio::test]
    async fn counting_tokens_is_charged_to_the_keys_token_limit_like_a_prompt() {
        let app = app(KEYS);
        let long = "the quick brown fox jumps over the lazy dog. ".repeat(350);
        let (status, answer) = count(&app, "sk-a", &long).await;
        assert_eq!(status, StatusCode::OK, "{answer}");
        let tokens = answer["input_tokens"].as_u64().unwrap();
        assert!((3000..4500).contains(&tokens), "{tokens} tokens");
        // Over a whole minute's budget: the message's 429, in Anthropic's shape.
        let (status, answer) = count(&app, "sk-b", &long).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{answer}");
        assert_eq!(answer["error"]["type"], "rate_limit_error", "{answer}");
        // Within it, counted and charged: 1500 + 1500 > 2000.
        let half = "the quick brown fox jumps over the lazy dog. ".repeat(150);
        let (status, answer) = count(&app, "sk-b", &half).await;
        assert_eq!(status, StatusCode::OK, "{answer}");
        let (status, _) = count(&app, "sk-b", &half).await;
        assert_eq!(
            status,
            StatusCode::TOO_MANY_REQUESTS,
            "the first count was charged"
        );
    }
}
