//! The router's own error answers: the wire crate's OpenAI error body
//! ([`ErrorBody`], `{"error": {"message", "type", "param", "code"}}`) with
//! its HTTP status and, for 429 and 503, `Retry-After`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use switchyard_wire::openai::ErrorBody;

/// An error answered by the router itself (never one passed through from a
/// worker, whose bodies go back unchanged).
#[derive(Debug)]
pub(crate) struct ApiError {
    /// HTTP status (also the body's `code`).
    pub status: StatusCode,
    /// Its message never contains prompt text.
    body: ErrorBody,
    /// `Retry-After`, in seconds, for 429 and 503.
    pub retry_after_secs: Option<u64>,
}

impl From<ErrorBody> for ApiError {
    /// The answer of `body`, with the status its `code` names (500 when it
    /// names none).
    fn from(body: ErrorBody) -> Self {
        let status = body
            .status()
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        Self {
            status,
            body,
            retry_after_secs: None,
        }
    }
}

impl ApiError {
    fn retry_after(mut self, secs: u64) -> Self {
        self.retry_after_secs = Some(secs);
        self
    }

    /// 400: malformed JSON or an invalid field.
    pub(crate) fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ErrorBody::invalid_request(message, param).into()
    }

    /// 401: missing or wrong key.
    pub(crate) fn unauthorized() -> Self {
        ErrorBody::authentication("invalid or missing API key (Authorization: Bearer ...)").into()
    }

    /// 404: unknown route or model.
    pub(crate) fn not_found(message: impl Into<String>, param: Option<&'static str>) -> Self {
        ErrorBody::not_found(message, param).into()
    }

    /// 413: body over the limit.
    pub(crate) fn too_large(limit: usize) -> Self {
        ErrorBody::too_large(limit).into()
    }

    /// 408: the request body did not arrive within `after`.
    pub(crate) fn slow_upload(after: std::time::Duration) -> Self {
        ErrorBody::new(
            408,
            "timeout",
            format!(
                "the request body did not arrive within the router's body-read deadline of {:.1} s",
                after.as_secs_f64()
            ),
        )
        .into()
    }

    /// 429: the admission queue is full.
    pub(crate) fn queue_full(retry_after_ms: u64) -> Self {
        Self::from(ErrorBody::rate_limited(
            "the router's admission queue is full; retry later",
        ))
        .retry_after(retry_after_ms.div_ceil(1000).max(1))
    }

    /// 429: admission shed the request (its band is sheddable and the
    /// fleet is busy, or its TTFT deadline cannot be met). 429 rather
    /// than 529: the official OpenAI clients retry a 429 on their own,
    /// honouring `Retry-After`.
    pub(crate) fn shed(retry_after_ms: u64, late: bool) -> Self {
        let message = if late {
            "the request's time-to-first-token deadline cannot be met; retry later"
        } else {
            "the router is shedding this priority band under load; retry later"
        };
        Self::from(ErrorBody::rate_limited(message))
            .retry_after(retry_after_ms.div_ceil(1000).max(1))
    }

    /// 429: a rate limit of the client's key; `Retry-After` rounded up to
    /// whole seconds when waiting helps.
    pub(crate) fn rate_limited(
        message: impl Into<String>,
        retry_after: Option<std::time::Duration>,
    ) -> Self {
        let error = Self::from(ErrorBody::rate_limited(message));
        match retry_after {
            Some(wait) => error.retry_after(wait.as_secs_f64().ceil().max(1.0) as u64),
            None => error,
        }
    }

    /// 503: no worker can take the request.
    pub(crate) fn no_workers(message: impl Into<String>) -> Self {
        Self::from(ErrorBody::unavailable(message)).retry_after(1)
    }

    /// 503: the router already holds `limit` requests (`--max-inflight`).
    pub(crate) fn overloaded(limit: u64) -> Self {
        Self::from(ErrorBody::unavailable(format!(
            "the router is at its limit of {limit} requests in flight; retry later"
        )))
        .retry_after(1)
    }

    /// 503: the bodies the router holds fill its budget of `total` bytes
    /// (`--max-body-bytes-total`).
    pub(crate) fn body_budget_full(total: usize) -> Self {
        Self::from(ErrorBody::unavailable(format!(
            "the router holds as many request bodies as its budget of {total} bytes allows (--max-body-bytes-total); retry later"
        )))
        .retry_after(1)
    }

    /// 503: `waiting` long prompts already wait to be tokenized.
    pub(crate) fn tokenize_gate_full(waiting: usize) -> Self {
        Self::from(ErrorBody::unavailable(format!(
            "the router has {waiting} long prompts waiting to be tokenized; retry later"
        )))
        .retry_after(1)
    }

    /// 503: the router is shutting down.
    pub(crate) fn shutting_down() -> Self {
        Self::from(ErrorBody::unavailable(
            "the router is shutting down; retry on another replica",
        ))
        .retry_after(1)
    }

    /// 502: the chosen worker failed before answering.
    pub(crate) fn bad_gateway(message: impl Into<String>) -> Self {
        ErrorBody::upstream(message).into()
    }

    /// 410: what the request names existed and is gone for good.
    pub(crate) fn gone(message: impl Into<String>, param: Option<&'static str>) -> Self {
        let mut body = ErrorBody::new(410, "invalid_request_error", message);
        if let Some(param) = param {
            body = body.with_param(param);
        }
        body.into()
    }

    /// 501: a feature the router does not offer in this configuration.
    pub(crate) fn not_implemented(message: impl Into<String>) -> Self {
        ErrorBody::new(501, "invalid_request_error", message).into()
    }

    /// 504: the request timeout passed; the upstream work was cancelled.
    pub(crate) fn timeout(after: std::time::Duration) -> Self {
        ErrorBody::timeout(format!(
            "the request did not complete within the router's request timeout of {:.1} s",
            after.as_secs_f64()
        ))
        .into()
    }

    /// 500: a bug or an internal failure.
    pub(crate) fn internal(message: impl Into<String>) -> Self {
        ErrorBody::internal(message).into()
    }

    /// The body (as JSON: [`ErrorBody::to_json`]).
    pub(crate) fn body(&self) -> &ErrorBody {
        &self.body
    }
}

/// Marks a response as an error the router answered itself (not a
/// worker's), with its message: [`anthropic_shaped`] rewrites it.
#[derive(Clone, Debug)]
struct RouterError(String);

/// Anthropic's error body for an error of `status` with `message`
/// ([`switchyard_wire::agentic::anthropic_error`]).
pub(crate) fn anthropic_body(status: StatusCode, message: &str) -> serde_json::Value {
    switchyard_wire::agentic::anthropic_error(status.as_u16(), message)
}

/// Whether `path` is one of Anthropic's (`/v1/messages...`), whose
/// router-made errors are Anthropic's ([`anthropic_shaped`]).
pub(crate) fn anthropic_path(path: &str) -> bool {
    path.starts_with("/v1/messages")
}

/// `response` with Anthropic's error body when it is an error the router
/// answered itself (never a worker's answer) on one of Anthropic's paths
/// (`anthropic`), with the same status and headers (`Retry-After`,
/// `WWW-Authenticate`). Applied by the credential check, the outermost
/// layer ([`crate::front::auth`]), so that every error of every inner
/// layer is shaped and no other path pays for it.
pub(crate) fn anthropic_shaped(response: Response, anthropic: bool) -> Response {
    if !anthropic {
        return response;
    }
    let Some(RouterError(message)) = response.extensions().get::<RouterError>().cloned() else {
        return response;
    };
    let (mut parts, _) = response.into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    let body = anthropic_body(parts.status, &message).to_string();
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, axum::body::Body::from(body))
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let marker = RouterError(self.body.error.message.clone());
        let mut response = (self.status, axum::Json(self.body)).into_response();
        response.extensions_mut().insert(marker);
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_is_the_bodys_code_and_retry_after_only_where_it_helps() {
        let queue = ApiError::queue_full(1500);
        assert_eq!(queue.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(queue.body().status(), Some(429));
        assert_eq!(queue.retry_after_secs, Some(2));
        let bad = ApiError::bad_request("x", Some("messages"));
        assert_eq!(bad.status, StatusCode::BAD_REQUEST);
        assert_eq!(bad.body().error.param.as_deref(), Some("messages"));
        assert_eq!(bad.retry_after_secs, None);
        assert_eq!(ApiError::no_workers("x").retry_after_secs, Some(1));
        let shed = ApiError::shed(2_500, false);
        assert_eq!(shed.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(shed.retry_after_secs, Some(3));
    }
}
