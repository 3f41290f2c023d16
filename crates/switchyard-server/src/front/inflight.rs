//! Overload and shutdown: a bounded in-flight count over every route but
//! the probes, and cancellation of whatever is still in flight when the
//! shutdown deadline passes.
//!
//! A middleware takes a [`Permit`] for each request — after its credential
//! was checked ([`crate::front::auth`]) and before its body is read
//! ([`crate::front::upload`]) — or answers 503 with `Retry-After` and an
//! OpenAI-style error when `max_inflight` requests are already in the
//! router (queued, waiting for the worker, streaming, or an admin call).
//! Only `/health`, `/ready` and `/metrics` go without one: they read no
//! body, do bounded work, and are how an operator sees an overloaded
//! router (the connection cap still bounds them). The permit lives in the
//! response body ([`GuardedBody`]), so a streaming answer counts until its
//! last byte. Together with the admission queue's own limit (429) this
//! bounds the router's memory under any burst: each request holds at most
//! its body (`max_body_bytes`, read within the body-read deadline), its
//! routing facts (the prompt's token ids) and either a buffered answer
//! (`max_response_bytes`) or a stream's buffers (one SSE event of
//! [`crate::request::MAX_EVENT_BYTES`] plus 36 bytes a token of the
//! migration sequence limit, see [`crate::request::stream`]).
//!
//! [`Inflight::cancel`] (shutdown, after the grace period) makes every
//! guarded request end now: a request still waiting for a worker gets a
//! 503; a streaming response gets a final SSE `data: {"error": ...}` event
//! and ends cleanly; any other body is cut. Ending drops the proxied body,
//! which drops the upstream connection (the worker cancels the request)
//! and frees the booking.

use crate::error::ApiError;
use crate::metrics::{RequestStatus, ServerMetrics};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http_body::{Body as HttpBody, Frame};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use tokio_util::sync::{CancellationToken, WaitForCancellationFutureOwned};

/// The in-flight limit and the shutdown switch, shared by every request.
#[derive(Debug)]
pub struct Inflight {
    limit: u64,
    metrics: Arc<ServerMetrics>,
    cancel: CancellationToken,
}

impl Inflight {
    /// A limit of `limit` concurrent requests (at least 1); the count and
    /// the refusals are kept in `metrics`.
    pub fn new(limit: usize, metrics: Arc<ServerMetrics>) -> Arc<Self> {
        let limit = (limit as u64).max(1);
        metrics.inflight_limit.set(limit);
        Arc::new(Self {
            limit,
            metrics,
            cancel: CancellationToken::new(),
        })
    }

    /// A permit, or `None` at the limit (counted).
    pub fn try_acquire(self: &Arc<Self>) -> Option<Permit> {
        let taken = self
            .metrics
            .inflight
            .inner()
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < self.limit).then_some(n + 1)
            })
            .is_ok();
        if taken {
            Some(Permit(self.clone()))
        } else {
            self.metrics.inflight_rejected.inc();
            None
        }
    }

    /// Requests holding a permit now.
    pub fn current(&self) -> u64 {
        self.metrics.inflight.inner().load(Ordering::Acquire)
    }

    /// Ends every guarded request now and refuses new ones.
    pub fn cancel(&self) {
        self.cancel.cancel();
    }

    /// Whether [`Self::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.is_cancelled()
    }
}

/// One request's place in the in-flight count; dropping it gives the place
/// back.
#[derive(Debug)]
pub struct Permit(Arc<Inflight>);

impl Drop for Permit {
    fn drop(&mut self) {
        self.0
            .metrics
            .inflight
            .inner()
            .fetch_sub(1, Ordering::AcqRel);
    }
}

/// Wraps `app` so that every request but the probes (`/health`, `/ready`,
/// `/metrics`) is counted, limited and cancellable. `switchyard_requests_total`
/// counts OpenAI requests (`POST /v1/...`) only.
pub(crate) fn layer(app: axum::Router, inflight: Arc<Inflight>) -> axum::Router {
    app.layer(axum::middleware::from_fn_with_state(inflight, guard))
}

async fn guard(State(inflight): State<Arc<Inflight>>, request: Request, next: Next) -> Response {
    let path = request.uri().path();
    if matches!(path, "/health" | "/ready" | "/metrics") {
        return next.run(request).await;
    }
    let openai = request.method() == Method::POST && path.starts_with("/v1/");
    let refuse = |error: ApiError| {
        if openai {
            inflight.metrics.count_request(RequestStatus::Rejected);
        }
        error.into_response()
    };
    if inflight.is_cancelled() {
        return refuse(ApiError::shutting_down());
    }
    let Some(permit) = inflight.try_acquire() else {
        return refuse(ApiError::overloaded(inflight.limit));
    };
    let cancelled = inflight.cancel.clone().cancelled_owned();
    // The one place a request dropped before its response head is counted
    // `Cancelled`: the client went away (this future is dropped) or the
    // router shut down (the handler is dropped below). A response counts
    // its own status; a body cut later counts in its own drop.
    let mut unanswered = CountCancelled(openai.then(|| inflight.metrics.clone()));
    tokio::select! {
        response = next.run(request) => {
            unanswered.0 = None;
            let sse = response
                .headers()
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .is_some_and(|v| v.starts_with("text/event-stream"));
            response.map(|inner| {
                Body::new(GuardedBody {
                    inner: Some(inner),
                    cancelled: Box::pin(inflight.cancel.clone().cancelled_owned()),
                    sse,
                    _permit: permit,
                })
            })
        }
        () = cancelled => {
            // The handler (and its place in the admission queue) is
            // dropped; `unanswered` counts it.
            ApiError::shutting_down().into_response()
        }
    }
}

/// Counts [`RequestStatus::Cancelled`] when dropped armed.
struct CountCancelled(Option<Arc<ServerMetrics>>);

impl Drop for CountCancelled {
    fn drop(&mut self) {
        if let Some(metrics) = self.0.take() {
            metrics.count_request(RequestStatus::Cancelled);
        }
    }
}

/// A response body that holds its [`Permit`] to the end and ends early,
/// cleanly, when the router shuts down.
struct GuardedBody {
    /// `None` once cancelled (the proxied body is dropped at once).
    inner: Option<Body>,
    cancelled: Pin<Box<WaitForCancellationFutureOwned>>,
    sse: bool,
    _permit: Permit,
}

/// The last SSE event of a stream cut by shutdown.
const SHUTDOWN_EVENT: &str = "data: {\"error\":{\"message\":\"the router is shutting down; the response was cut\",\"type\":\"service_unavailable\",\"param\":null,\"code\":503}}\n\n";

impl HttpBody for GuardedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let this = self.get_mut();
        let Some(inner) = this.inner.as_mut() else {
            return Poll::Ready(None);
        };
        if this.cancelled.as_mut().poll(cx).is_ready() {
            this.inner = None;
            return Poll::Ready(if this.sse {
                Some(Ok(Frame::data(Bytes::from_static(
                    SHUTDOWN_EVENT.as_bytes(),
                ))))
            } else {
                Some(Err(axum::Error::new("the router is shutting down")))
            });
        }
        Pin::new(inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.as_ref().is_none_or(HttpBody::is_end_stream)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        match &self.inner {
            // Cancellation may append an event to a stream.
            Some(_) if self.sse => http_body::SizeHint::default(),
            Some(inner) => inner.size_hint(),
            None => http_body::SizeHint::with_exact(0),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permits_are_bounded_counted_and_returned_on_drop() {
        let metrics = Arc::new(ServerMetrics::new("kv"));
        let inflight = Inflight::new(2, metrics.clone());
        let a = inflight.try_acquire().expect("first");
        let b = inflight.try_acquire().expect("second");
        assert!(
            inflight.try_acquire().is_none(),
            "the third is over the limit"
        );
        assert_eq!(inflight.current(), 2);
        assert_eq!(metrics.inflight_rejected.get(), 1);
        drop(a);
        assert_eq!(inflight.current(), 1);
        let _c = inflight
            .try_acquire()
            .expect("a returned permit is reusable");
        drop(b);
        assert_eq!(inflight.current(), 1);
    }

    fn cancelled_count(metrics: &ServerMetrics) -> u64 {
        metrics.requests(RequestStatus::Cancelled)
    }

    /// A router whose generation endpoint never answers, behind the guard.
    fn never_answering(inflight: Arc<Inflight>) -> axum::Router {
        let app = axum::Router::new().route(
            "/v1/completions",
            axum::routing::post(std::future::pending::<&'static str>),
        );
        layer(app, inflight)
    }

    fn post() -> Request {
        Request::builder()
            .method(Method::POST)
            .uri("/v1/completions")
            .body(Body::empty())
            .unwrap()
    }

    #[tokio::test]
    async fn a_request_cancelled_at_shutdown_is_counted_once() {
        use tower::ServiceExt as _;
        let metrics = Arc::new(ServerMetrics::new("kv"));
        let inflight = Inflight::new(4, metrics.clone());
        let call = tokio::spawn(never_answering(inflight.clone()).oneshot(post()));
        while inflight.current() == 0 {
            tokio::task::yield_now().await;
        }
        inflight.cancel();
        let response = call.await.unwrap().unwrap();
        assert_eq!(response.status(), 503);
        assert_eq!(cancelled_count(&metrics), 1);
        assert_eq!(inflight.current(), 0);
    }

    #[tokio::test]
    async fn a_request_whose_client_went_away_is_counted_once() {
        use tower::ServiceExt as _;
        let metrics = Arc::new(ServerMetrics::new("kv"));
        let inflight = Inflight::new(4, metrics.clone());
        let call = tokio::spawn(never_answering(inflight.clone()).oneshot(post()));
        while inflight.current() == 0 {
            tokio::task::yield_now().await;
        }
        call.abort();
        let _ = call.await;
        assert_eq!(cancelled_count(&metrics), 1);
        assert_eq!(inflight.current(), 0);
    }

    #[tokio::test]
    async fn the_limit_covers_every_route_but_the_probes() {
        use tower::ServiceExt as _;
        let metrics = Arc::new(ServerMetrics::new("kv"));
        let inflight = Inflight::new(1, metrics.clone());
        let _held = inflight.try_acquire().expect("the one place");
        let app = layer(
            axum::Router::new()
                .route("/admin/workers", axum::routing::post(|| async { "added" }))
                .route("/v1/models", axum::routing::get(|| async { "models" }))
                .route("/health", axum::routing::get(|| async { "ok" }))
                .route("/ready", axum::routing::get(|| async { "ready" }))
                .route("/metrics", axum::routing::get(|| async { "metrics" })),
            inflight,
        );
        let call = |method: Method, path: &'static str| {
            let app = app.clone();
            async move {
                let request = Request::builder()
                    .method(method)
                    .uri(path)
                    .body(Body::empty())
                    .unwrap();
                app.oneshot(request).await.unwrap().status()
            }
        };
        assert_eq!(call(Method::POST, "/admin/workers").await, 503);
        assert_eq!(call(Method::GET, "/v1/models").await, 503);
        for probe in ["/health", "/ready", "/metrics"] {
            assert_eq!(call(Method::GET, probe).await, 200, "{probe}");
        }
        assert_eq!(metrics.inflight_rejected.get(), 2);
        assert_eq!(
            metrics.requests(RequestStatus::Rejected),
            0,
            "only OpenAI POSTs count in switchyard_requests_total"
        );
    }

    #[test]
    fn a_limit_of_zero_still_admits_one() {
        let inflight = Inflight::new(0, Arc::new(ServerMetrics::new("kv")));
        assert!(inflight.try_acquire().is_some());
    }
}
