//! Reading a request body, once the head has passed the credential check
//! ([`crate::front::auth`]) and the in-flight limit ([`crate::front::inflight`]): a
//! route layer buffers every `POST` body before its handler runs, under
//! three bounds —
//!
//! - the size limit (`--max-body-bytes`): a declared `Content-Length` over
//!   it is refused before any byte is read, a chunked body as soon as it
//!   passes it (413);
//! - the body budget (`--max-body-bytes-total`, 4 × the size limit unless
//!   set): the bytes of every body held at once, together. A declared
//!   `Content-Length` is taken from the budget before any byte is read, a
//!   chunked body's bytes as they arrive; a body that does not fit gets a
//!   503 with `Retry-After` at once — nothing waits for room — counted in
//!   `switchyard_body_budget_refusals_total`. A body holds its bytes until
//!   its handler has answered (the response head: a stream's body is then
//!   the in-flight limit's to bound), since parsing and tokenizing it cost
//!   memory in proportion to it; `switchyard_body_budget_held_bytes` shows
//!   what is held. Without it, eight concurrent 30 MB bodies took the
//!   router from 317 to 986 MB resident;
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
use http_body::Frame;
use http_body_util::BodyExt as _;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;
use tokio::sync::Semaphore;

/// The bounds on reading one body.
#[derive(Debug)]
pub(crate) struct UploadLimits {
    /// Largest body, in bytes.
    pub max_bytes: usize,
    /// Time from the head to the body's last byte.
    pub deadline: Duration,
    /// The bytes every body held at once may take together.
    pub budget: Arc<BodyBudget>,
    /// Where 408s (and the 4xx of OpenAI requests) are counted.
    pub metrics: Arc<ServerMetrics>,
}

/// The bytes of request bodies the router holds at once, all requests
/// together: a semaphore of bytes, one permit a byte. Bytes are taken with
/// `try_acquire_many`, never waited for, and given back when the
/// [`BodyCharge`] holding them is dropped.
#[derive(Debug)]
pub(crate) struct BodyBudget {
    free: Semaphore,
    total: usize,
    metrics: Arc<ServerMetrics>,
}

/// The budget was full: the body does not fit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BudgetFull;

impl std::fmt::Display for BudgetFull {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the body budget is full")
    }
}

impl std::error::Error for BudgetFull {}

impl BodyBudget {
    /// A budget of `total` bytes (at most the semaphore's limit, some
    /// 2^61); what is held is shown in `metrics`.
    pub(crate) fn new(total: usize, metrics: Arc<ServerMetrics>) -> Arc<Self> {
        let total = total.min(Semaphore::MAX_PERMITS);
        metrics.body_budget_limit.set(total as u64);
        Arc::new(Self {
            free: Semaphore::new(total),
            total,
            metrics,
        })
    }

    /// The budget, in bytes.
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Bytes held now.
    #[cfg(test)]
    pub(crate) fn held(&self) -> usize {
        self.total - self.free.available_permits()
    }

    /// A charge of nothing yet, to grow as a body arrives.
    pub(crate) fn charge(self: &Arc<Self>) -> BodyCharge {
        BodyCharge {
            budget: self.clone(),
            bytes: 0,
        }
    }
}

/// The bytes one body holds of the [`BodyBudget`]; dropping it gives them
/// back.
#[derive(Debug)]
pub(crate) struct BodyCharge {
    budget: Arc<BodyBudget>,
    bytes: usize,
}

impl BodyCharge {
    /// Bytes held.
    pub(crate) fn bytes(&self) -> usize {
        self.bytes
    }

    /// Takes `bytes` more, at once or not at all (`BudgetFull`: the
    /// charge keeps what it held).
    pub(crate) fn grow(&mut self, bytes: usize) -> Result<(), BudgetFull> {
        // A permit count is a u32; a budget may be larger. Each part taken
        // is the charge's from then on, given back in its drop.
        let mut left = bytes;
        while left > 0 {
            let n = u32::try_from(left).unwrap_or(u32::MAX);
            match self.budget.free.try_acquire_many(n) {
                Ok(permit) => permit.forget(),
                Err(_) => {
                    // All or nothing: the parts taken go back.
                    self.budget.free.add_permits(bytes - left);
                    return Err(BudgetFull);
                }
            }
            left -= n as usize;
        }
        self.bytes += bytes;
        self.budget.metrics.body_budget_held.inc_by(bytes as u64);
        Ok(())
    }
}

impl Drop for BodyCharge {
    fn drop(&mut self) {
        self.budget.free.add_permits(self.bytes);
        self.budget
            .metrics
            .body_budget_held
            .dec_by(self.bytes as u64);
    }
}

/// A body whose data frames are charged to a [`BodyCharge`] as they
/// arrive, beyond what the charge already holds (a declared length taken
/// up front); a frame that does not fit ends the body with [`BudgetFull`].
struct Charged<B> {
    inner: B,
    charge: BodyCharge,
    /// Data bytes read so far.
    read: usize,
}

impl<B> http_body::Body for Charged<B>
where
    B: http_body::Body<Data = Bytes> + Unpin,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        let frame = match std::task::ready!(Pin::new(&mut this.inner).poll_frame(cx)) {
            Some(Ok(frame)) => frame,
            Some(Err(e)) => return Poll::Ready(Some(Err(e.into()))),
            None => return Poll::Ready(None),
        };
        if let Some(data) = frame.data_ref() {
            this.read = this.read.saturating_add(data.len());
            let beyond = this.read.saturating_sub(this.charge.bytes());
            if beyond > 0 {
                if let Err(full) = this.charge.grow(beyond) {
                    return Poll::Ready(Some(Err(full.into())));
                }
            }
        }
        Poll::Ready(Some(Ok(frame)))
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
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
    let over_budget = || {
        limits.metrics.body_budget_refusals.inc();
        if openai {
            limits.metrics.count_request(RequestStatus::Rejected);
        }
        ApiError::body_budget_full(limits.budget.total()).into_response()
    };
    // A declared length is taken whole before any byte is read; a chunked
    // body's bytes as they arrive.
    let mut charge = limits.budget.charge();
    if let Some(n) = declared {
        // Within `max_bytes` (checked above), so within `usize`.
        if charge.grow(n as usize).is_err() {
            return over_budget();
        }
    }
    let (parts, body) = request.into_parts();
    let mut body = Charged {
        inner: body,
        charge,
        read: 0,
    };
    let read = tokio::time::timeout(limits.deadline, read_whole(&mut body, limits.max_bytes)).await;
    let Charged {
        charge, read: got, ..
    } = body;
    let bytes = match read {
        Ok(Ok(bytes)) => bytes,
        Ok(Err(ReadError::TooLarge)) => {
            limits.metrics.count_limit_refusal(InputLimit::BodyBytes);
            return refuse(ApiError::too_large(limits.max_bytes));
        }
        // The budget was full when a chunk arrived.
        Ok(Err(ReadError::Broken)) if got > charge.bytes() => return over_budget(),
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
    // Held until the handler has answered: it parses and tokenizes the body.
    let response = next
        .run(Request::from_parts(parts, Body::from(bytes)))
        .await;
    drop(charge);
    response
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
        budgeted(max_bytes, 4 * max_bytes, deadline_ms)
    }

    fn budgeted(
        max_bytes: usize,
        total: usize,
        deadline_ms: u64,
    ) -> (UploadLimits, Arc<ServerMetrics>) {
        let metrics = Arc::new(ServerMetrics::new("kv"));
        (
            UploadLimits {
                max_bytes,
                deadline: Duration::from_millis(deadline_ms),
                budget: BodyBudget::new(total, metrics.clone()),
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

    #[test]
    fn a_charge_takes_all_it_asks_or_nothing_and_gives_it_back_when_dropped() {
        let metrics = Arc::new(ServerMetrics::new("kv"));
        let budget = BodyBudget::new(10, metrics.clone());
        let mut first = budget.charge();
        first.grow(6).unwrap();
        let mut second = budget.charge();
        assert_eq!(second.grow(5), Err(BudgetFull), "6 + 5 > 10");
        assert_eq!(second.bytes(), 0, "a refused charge takes nothing");
        second.grow(4).unwrap();
        assert_eq!(budget.held(), 10);
        assert_eq!(metrics.body_budget_held.get(), 10);
        assert_eq!(metrics.body_budget_limit.get(), 10);
        drop(first);
        assert_eq!(budget.held(), 4);
        assert_eq!(metrics.body_budget_held.get(), 4);
        drop(second);
        assert_eq!(budget.held(), 0);
        assert_eq!(metrics.body_budget_held.get(), 0);
    }

    #[test]
    fn a_budget_past_a_permit_count_is_charged_in_pieces() {
        let metrics = Arc::new(ServerMetrics::new("kv"));
        let big = u32::MAX as usize + 10;
        let budget = BodyBudget::new(2 * big, metrics);
        let mut charge = budget.charge();
        charge.grow(big).unwrap();
        assert_eq!(budget.held(), big);
        assert_eq!(charge.grow(big + 1), Err(BudgetFull));
        assert_eq!(budget.held(), big, "the part taken was given back");
    }

    /// A handler that answers only once `release` gives it a permit,
    /// holding its body until then; `entered` gets a permit for each body
    /// it has received.
    fn held_app(
        limits: UploadLimits,
        release: Arc<tokio::sync::Semaphore>,
        entered: Arc<tokio::sync::Semaphore>,
    ) -> axum::Router {
        let handler = move |body: Bytes| async move {
            entered.add_permits(1);
            release.acquire().await.unwrap().forget();
            format!("{}", body.len())
        };
        route_layer(
            axum::Router::new().route("/v1/completions", axum::routing::post(handler)),
            Arc::new(limits),
        )
    }

    fn declared(len: usize) -> Request {
        Request::post("/v1/completions")
            .header(header::CONTENT_LENGTH, len.to_string())
            .body(Body::from(vec![b'x'; len]))
            .unwrap()
    }

    #[tokio::test]
    async fn a_declared_body_that_does_not_fit_the_budget_gets_503_at_once_unread() {
        let (limits, metrics) = budgeted(16, 20, 5_000);
        let budget = limits.budget.clone();
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let entered = Arc::new(tokio::sync::Semaphore::new(0));
        let app = held_app(limits, release.clone(), entered.clone());
        // The first body is in its handler, holding 12 of 20 bytes.
        let first = tokio::spawn(app.clone().oneshot(declared(12)));
        entered.acquire().await.unwrap().forget();
        assert_eq!(budget.held(), 12);
        // 12 + 10 > 20: refused from the head, its body never read.
        let never = stream::pending::<Result<Bytes, std::io::Error>>();
        let request = Request::post("/v1/completions")
            .header(header::CONTENT_LENGTH, "10")
            .body(Body::from_stream(never))
            .unwrap();
        let refused = app.clone().oneshot(request).await.unwrap();
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(refused.headers()[header::RETRY_AFTER], "1");
        assert!(text(refused).await.contains("--max-body-bytes-total"));
        assert_eq!(metrics.body_budget_refusals.get(), 1);
        assert_eq!(metrics.requests(RequestStatus::Rejected), 1);
        // 12 + 8 fits.
        let second = tokio::spawn(app.clone().oneshot(declared(8)));
        entered.acquire().await.unwrap().forget();
        assert_eq!(budget.held(), 20);
        // Both answer; the budget is given back.
        release.add_permits(2);
        assert_eq!(text(first.await.unwrap().unwrap()).await, "12");
        assert_eq!(text(second.await.unwrap().unwrap()).await, "8");
        assert_eq!(budget.held(), 0);
        assert_eq!(metrics.body_budget_held.get(), 0);
        release.add_permits(1);
        let whole = app.oneshot(declared(16)).await.unwrap();
        assert_eq!(whole.status(), StatusCode::OK, "a largest body fits again");
    }

    #[tokio::test]
    async fn a_chunked_body_is_charged_as_it_arrives_and_refused_when_the_budget_fills() {
        let (limits, metrics) = budgeted(16, 20, 5_000);
        let budget = limits.budget.clone();
        let release = Arc::new(tokio::sync::Semaphore::new(0));
        let entered = Arc::new(tokio::sync::Semaphore::new(0));
        let app = held_app(limits, release.clone(), entered.clone());
        let chunked = |chunks: &'static [&'static str]| {
            let chunks = stream::iter(
                chunks
                    .iter()
                    .map(|c| Ok::<_, std::io::Error>(Bytes::from_static(c.as_bytes()))),
            );
            Request::post("/v1/completions")
                .body(Body::from_stream(chunks))
                .unwrap()
        };
        let first = tokio::spawn(app.clone().oneshot(chunked(&["abcdef", "ghijkl"])));
        entered.acquire().await.unwrap().forget();
        assert_eq!(budget.held(), 12, "charged what arrived");
        // Its first 8 bytes fit; the next 4 do not.
        let refused = app
            .clone()
            .oneshot(chunked(&["abcd", "efgh", "ijkl"]))
            .await
            .unwrap();
        assert_eq!(refused.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert!(refused.headers().contains_key(header::RETRY_AFTER));
        assert_eq!(metrics.body_budget_refusals.get(), 1);
        assert_eq!(
            budget.held(),
            12,
            "the refused body's bytes were given back"
        );
        release.add_permits(1);
        assert_eq!(text(first.await.unwrap().unwrap()).await, "12");
        assert_eq!(budget.held(), 0);
    }
}
