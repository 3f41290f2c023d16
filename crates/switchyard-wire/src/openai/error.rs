//! The OpenAI error body: `{"error": {"message", "type", "param", "code"}}`.

use serde::{Deserialize, Serialize};

/// An error answer's body. Our servers write `code` as the HTTP status, so
/// the body alone says which status it goes with ([`Self::status`]); each
/// server wraps it in its own response type. Messages never contain prompt
/// text.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The inside of an [`ErrorBody`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Human-readable.
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `not_found_error`, ...
    #[serde(rename = "type")]
    pub kind: String,
    /// The offending request field, when one is to blame.
    #[serde(default)]
    pub param: Option<String>,
    /// Ours: the HTTP status. Other servers may send a name or nothing.
    #[serde(default)]
    pub code: Option<ErrorCode>,
}

/// An error's `code`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ErrorCode {
    /// An HTTP status (what our servers and vLLM send).
    Status(u16),
    /// A name, such as OpenAI's `model_not_found`.
    Name(String),
}

impl ErrorBody {
    /// An error of `kind` (OpenAI's `type`) answered with `status`.
    pub fn new(status: u16, kind: &str, message: impl Into<String>) -> Self {
        Self {
            error: ErrorDetail {
                message: message.into(),
                kind: kind.to_owned(),
                param: None,
                code: Some(ErrorCode::Status(status)),
            },
        }
    }

    /// The same error, blaming the request field `param`.
    pub fn with_param(mut self, param: &str) -> Self {
        self.error.param = Some(param.to_owned());
        self
    }

    /// 400 `invalid_request_error`: malformed JSON or an invalid field.
    pub fn invalid_request(message: impl Into<String>, param: Option<&str>) -> Self {
        let body = Self::new(400, "invalid_request_error", message);
        match param {
            Some(param) => body.with_param(param),
            None => body,
        }
    }

    /// 401 `authentication_error`: a missing or wrong key.
    pub fn authentication(message: impl Into<String>) -> Self {
        Self::new(401, "authentication_error", message)
    }

    /// 404 `not_found_error`: an unknown route or model.
    pub fn not_found(message: impl Into<String>, param: Option<&str>) -> Self {
        let body = Self::new(404, "not_found_error", message);
        match param {
            Some(param) => body.with_param(param),
            None => body,
        }
    }

    /// 413 `invalid_request_error`: a body over `limit` bytes.
    pub fn too_large(limit: usize) -> Self {
        Self::new(
            413,
            "invalid_request_error",
            format!("request body exceeds the limit of {limit} bytes"),
        )
    }

    /// 429 `rate_limit_error`: come back later.
    pub fn rate_limited(message: impl Into<String>) -> Self {
        Self::new(429, "rate_limit_error", message)
    }

    /// 500 `internal_error`: a bug or an internal failure.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "internal_error", message)
    }

    /// 502 `upstream_error`: the server this one relies on failed.
    pub fn upstream(message: impl Into<String>) -> Self {
        Self::new(502, "upstream_error", message)
    }

    /// 503 `service_unavailable`: nothing can take the request now.
    pub fn unavailable(message: impl Into<String>) -> Self {
        Self::new(503, "service_unavailable", message)
    }

    /// 503 `server_overloaded`: an engine's queue is full.
    pub fn overloaded(message: impl Into<String>) -> Self {
        Self::new(503, "server_overloaded", message)
    }

    /// 504 `timeout`: the request ran out of time.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(504, "timeout", message)
    }

    /// The HTTP status in `code`, when it holds one.
    pub fn status(&self) -> Option<u16> {
        match self.error.code {
            Some(ErrorCode::Status(status)) => Some(status),
            _ => None,
        }
    }

    /// The body as JSON text.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("an error body is strings and an integer: it serializes")
    }
}
