//! Reading a request body, once the head has passed the credential check
//! ([`crate::front::auth`]) and the in-flight limit ([`crate::front::inflight`]): a
//! route layer buffers every `POST` body before its handler runs, under
//! two bounds —
//!
//! - the size limit (`--max-body-bytes`): a declared `Content-Length` over
//!   it is refused before any byte is read, a chunked body as soon as it
//!   passes it (413);
//! - the body-read deadline (`--body-read-timeout-ms`), from the head on: a
//!   client that uploads slower is cut with a 408 and counted
//!   (`switchyard_slow_uploads_total`), so a stalled upload holds its
//!   connection, permit and partial body for a bounded time.
//!
//! Handlers then read ([`read_whole`]) a body that is already whole. Only
//! matched routes read bodies: an unknown path gets its 404 unread.

use crate::error::ApiError;
use crate::metrics::{InputLimit, RequestStatus, ServerMetrics};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use http_body_util::BodyExt as _;
use std::sync::Arc;
use std::time::Duration;

/// The bounds on reading one body.
#[derive(Debug)]
pub(crate) struct UploadLimits {
    /// Largest body, in bytes.
    pub max_bytes: usize,
    /// Time from the head to the body's last byte.
    pub deadline: Duration,
    /// Where 408s (and the 4xx of OpenAI requests) are counted.
    pub metrics: Arc<ServerMetrics>,
}

/// Wraps the routes of `app` (not its fallback) so that a `POST` body is
/// read whole, within `limits`, before the handler runs.
pub(crate) fn route_layer<S>(app: axum::Router<S>, limits: Arc<UploadLimits>) -> axum::Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    app.route_layer(axum::middleware::from_fn_with_state(limits, read_body))
}

async fn read_body(
    State(limits): State<Arc<UploadLimits>>,
    request: Request,
    next: Next,
) -> Response {
    if request.method() != Method::POST {
        return next.run(request).await;
    }
    let openai = request.uri().path().starts_with("/v1/");
    let refuse = |error: ApiError| {
        if openai {
            limits.metrics.count_request(RequestStatus::Invalid);
        }
        error.into_response()
    };
    let declared = request
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > limits.max_bytes as u64) {
        limits.metrics.count_limit_refusal(InputLimit::BodyBytes);
        return refuse(ApiError::too_large(limits.max_bytes));
    }
    let (parts, body) = request.into_parts();
    let bytes =
        match tokio::time::timeout(limits.deadline, read_whole(body, limits.max_bytes)).await {
            Ok(Ok(bytes)) => bytes,
            Ok(Err(ReadError::TooLarge)) => {
                limits.metrics.count_limit_refusal(InputLimit::BodyBytes);
                return refuse(ApiError::too_large(limits.max_bytes));
            }
            // The client broke off or sent a malformed body.
            Ok(Err(ReadError::Broken)) => {
                return refuse(ApiError::bad_request(
                    "could not read the request body",
                    None,
                ))
            }
            Err(_) => {
                limits.metrics.slow_uploads.inc();
                return refuse(ApiError::slow_upload(limits.deadline));
            }
        };
    next.run(Request::from_parts(parts, Body::from(bytes)))
        .await
}

/// Why a body could not be read whole.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadError {
    /// It is longer than the limit.
    TooLarge,
    /// It broke off, or a frame failed.
    Broken,
}

/// Reads `body` whole, up to `limit` bytes (trailers ignored). A body of
/// one data frame — a client's small request, an upload this layer has
/// already read, most workers' answers — is returned as that frame's
/// bytes, neither copied nor collected into a list first; several frames
/// are joined into one buffer.
pub(crate) async fn read_whole<B>(body: B, limit: usize) -> Result<Bytes, ReadError>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut body = http_body_util::Limited::new(body, limit);
    let mut first: Option<Bytes> = None;
    let mut joined: Option<BytesMut> = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| {
            if e.is::<http_body_util::LengthLimitError>() {
                ReadError::TooLarge
            } else {
                ReadError::Broken
            }
        })?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        if data.is_empty() {
            continue;
        }
        if let Some(joined) = &mut joined {
            joined.extend_from_slice(&data);
        } else if let Some(head) = first.take() {
            let mut both = BytesMut::with_capacity(head.len() + data.len());
            both.extend_from_slice(&head);
            both.extend_from_slice(&data);
            joined = Some(both);
        } else {
            first = Some(data);
        }
    }
    Ok(match joined {
        Some(joined) => joined.freeze(),
        None => first.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;
    use bytes::Bytes;
    use futures_util::stream;
    use futures_util::StreamExt as _;
    use tower::ServiceExt as _;

    fn app(limits: UploadLimits) -> axum::Router {
        let echo = |body: Bytes| async move { format!("{}", body.len()) };
        route_layer(
            axum::Router::new().route("/v1/completions", axum::routing::post(echo)),
            Arc::new(limits),
        )
    }

    fn limits(max_bytes: usize, deadline_ms: u64) -> (UploadLimits, Arc<ServerMetrics>) {
        let metrics = Arc::new(ServerMetrics::new("kv"));
        (
            UploadLimits {
                max_bytes,
                deadline: Duration::from_millis(deadline_ms),
                metrics: metrics.clone(),
            },
            metrics,
        )
    }

    async fn text(response: Response) -> String {
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        String::from_utf8_lossy(&bytes).into_owned()
    }

    #[tokio::test]
    async fn a_body_within_the_limits_reaches_the_handler_whole() {
        let (limits, _) = limits(16, 5_000);
        let chunks = stream::iter(["abc", "defg"].map(|c| Ok::<_, std::io::Error>(Bytes::from(c))));
        let request = Request::post("/v1/completions")
            .body(Body::from_stream(chunks))
            .unwrap();
        let response = app(limits).oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        assert_eq!(text(response).await, "7");
    }

    #[tokio::test]
    async fn a_declared_length_over_the_limit_is_refused_unread() {
        let (limits, metrics) = limits(16, 5_000);
        // A body that never ends: reading any of it would hang the test.
        let never = stream::pending::<Result<Bytes, std::io::Error>>();
        let request = Request::post("/v1/completions")
            .header(header::CONTENT_LENGTH, "1000000")
            .body(Body::from_stream(never))
            .unwrap();
        let response = app(limits).oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(metrics.requests(RequestStatus::Invalid), 1);
    }

    #[tokio::test]
    async fn a_chunked_body_over_the_limit_is_refused() {
        let (limits, _) = limits(4, 5_000);
        let chunks = stream::iter(["abc", "defg"].map(|c| Ok::<_, std::io::Error>(Bytes::from(c))));
        let request = Request::post("/v1/completions")
            .body(Body::from_stream(chunks))
            .unwrap();
        let response = app(limits).oneshot(request).await.unwrap();
        assert_eq!(response.status(), StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[tokio::test]
    async fn a_body_slower_than_the_deadline_is_cut_with_408_and_counted() {
        let (limits, metrics) = limits(1 << 20, 50);
        let stalls =
            stream::iter([Ok::<_, std::io::Error>(Bytes::from("{\"pro"))]).chain(stream::pending());
        let request = Request::post("/v1/completions")
            .body(Body::from_stream(stalls))
            .unwrap();
        let response = tokio::time::timeout(Duration::from_secs(30), app(limits).oneshot(request))
            .await
            .expect("the deadline ends the read")
            .unwrap();
        assert_eq!(response.status(), StatusCode::REQUEST_TIMEOUT);
        assert!(text(response).await.contains("body-read deadline"));
        assert_eq!(metrics.slow_uploads.get(), 1);
        assert_eq!(metrics.requests(RequestStatus::Invalid), 1);
    }
}
