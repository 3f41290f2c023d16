//! OpenAI-style error bodies: `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

/// An error answered by the router itself (never one passed through from a
/// worker, whose bodies go back unchanged).
#[derive(Debug)]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// OpenAI's `type`.
    pub kind: &'static str,
    /// Human-readable; never contains prompt text.
    pub message: String,
    /// The offending field, when one is to blame.
    pub param: Option<&'static str>,
    /// `Retry-After`, in seconds, for 429 and 503.
    pub retry_after_secs: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            kind,
            message: message.into(),
            param: None,
            retry_after_secs: None,
        }
    }

    /// 400: malformed JSON or an invalid field.
    pub fn bad_request(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            param,
            ..Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
        }
    }

    /// 401: missing or wrong key.
    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "invalid or missing API key (Authorization: Bearer ...)",
        )
    }

    /// 404: unknown route or model.
    pub fn not_found(message: impl Into<String>, param: Option<&'static str>) -> Self {
        Self {
            param,
            ..Self::new(StatusCode::NOT_FOUND, "not_found_error", message)
        }
    }

    /// 413: body over the limit.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("request body exceeds the limit of {limit} bytes"),
        )
    }

    /// 429: the admission queue is full.
    pub fn queue_full(retry_after_ms: u64) -> Self {
        Self {
            retry_after_secs: Some(retry_after_ms.div_ceil(1000).max(1)),
            ..Self::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "the router's admission queue is full; retry later",
            )
        }
    }

    /// 503: no worker can take the request.
    pub fn no_workers(message: impl Into<String>) -> Self {
        Self {
            retry_after_secs: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                message,
            )
        }
    }

    /// 503: the router already holds `limit` requests (`--max-inflight`).
    pub fn overloaded(limit: u64) -> Self {
        Self {
            retry_after_secs: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                format!("the router is at its limit of {limit} requests in flight; retry later"),
            )
        }
    }

    /// 503: the router is shutting down.
    pub fn shutting_down() -> Self {
        Self {
            retry_after_secs: Some(1),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "service_unavailable",
                "the router is shutting down; retry on another replica",
            )
        }
    }

    /// 502: the chosen worker failed before answering.
    pub fn bad_gateway(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_GATEWAY, "upstream_error", message)
    }

    /// 504: the request timeout passed; the upstream work was cancelled.
    pub fn timeout(after: std::time::Duration) -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            format!(
                "the request did not complete within the router's request timeout of {:.1} s",
                after.as_secs_f64()
            ),
        )
    }

    /// 500: a bug or an internal failure.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", message)
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status.as_u16(),
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after_secs {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        response
    }
}
