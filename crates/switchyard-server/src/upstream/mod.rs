//! The router's HTTP to its workers: the pooled client (the proxy's and
//! the health checks'), a request's `POST` to its worker ([`Upstream::post`]:
//! the URI, the router's headers, the first-token timeout, and which
//! failure a failed send was), a worker's answer head as the client gets
//! it ([`Upstream::client_parts`]), the sends that book nothing
//! ([`Upstream::direct`]: a stored response's `GET` and cancel,
//! `count_tokens`), and what of a worker a client learns ([`disclosure`]).
//!
//! What a worker is told beside the client's body: `content-type`, the
//! attempt's id as `x-request-id`, a data-parallel rank's header (as vLLM
//! reads it), this replica's id while replica sync is on, the client's
//! `accept`, and the router's own credential (`--worker-api-key`); the
//! client's credential is never forwarded. Which worker, and what a
//! failure becomes, are the request path's ([`crate::request::attempt`]).

pub(crate) mod disclosure;

use crate::error::ApiError;
use crate::front::upload::{read_whole, ReadError};
use crate::roster::{Endpoint, WorkerInfo};
use axum::http::uri::{self, PathAndQuery};
use axum::http::{header, HeaderName, HeaderValue, Method, Request, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use disclosure::{Disclosure, WorkerName};
use http_body_util::Full;
use hyper::body::Incoming;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use std::time::Duration;
use switchyard_core::dispatch::failure::{Failure, MigrationPolicy};
use switchyard_core::RequestId;

/// Header naming the worker that served a response.
pub(crate) const WORKER_HEADER: &str = "x-switchyard-worker";

/// The pooled upstream HTTP client.
pub(crate) type UpstreamClient = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Builds the pooled HTTP/1 client shared by the proxy and health checks,
/// for `http://` workers (an `https://` one fails its handshake: no root
/// is trusted).
pub(crate) fn client(connect_timeout: Duration) -> UpstreamClient {
    client_with(connect_timeout, crate::front::tls::WorkerTls::no_roots())
}

/// [`client`] reaching `https://` workers as `tls` says
/// ([`crate::front::tls::WorkerTls::client_config`]).
pub(crate) fn client_with(connect_timeout: Duration, tls: rustls::ClientConfig) -> UpstreamClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(connect_timeout));
    connector.enforce_http(false);
    let connector = hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(connector);
    Client::builder(hyper_util::rt::TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_max_idle_per_host(4096)
        .build(connector)
}

/// How requests go to workers, and their limits there.
pub struct Upstream {
    /// The HTTP client to workers.
    pub client: UpstreamClient,
    /// `Authorization` sent to workers (`--worker-api-key`), marked
    /// sensitive; the client's own is never forwarded.
    pub worker_auth: Option<HeaderValue>,
    /// This replica's id for upstream requests, while replica sync is on.
    pub router_id: Option<HeaderValue>,
    /// Add `x-switchyard-worker` to answers.
    pub worker_header: bool,
    /// Wait for a worker's headers and first event (and each next event).
    pub first_token_timeout: Duration,
    /// A request's total time.
    pub request_timeout: Duration,
    /// Largest buffered (non-streaming) response.
    pub max_response_bytes: usize,
    /// Migration limits.
    pub migration: MigrationPolicy,
}

/// Where one `POST` goes, and as what.
pub(crate) struct Post<'a> {
    pub(crate) endpoint: &'a Endpoint,
    pub(crate) url: &'a str,
    /// The worker as the client may know it (a failure's detail reaches
    /// the client).
    pub(crate) worker: WorkerName<'a>,
    pub(crate) path: &'static str,
    /// The attempt's own id (worker-origin prefill marks, with replica
    /// sync, name the booking, not the client's id).
    pub(crate) id: RequestId,
    /// The client's `accept`.
    pub(crate) accept: Option<&'a HeaderValue>,
}

/// Why a `POST` got no answer to hand on.
pub(crate) enum PostError {
    /// The request could not be made (the worker's URL).
    Build,
    /// The worker failed it (which failure, and the detail: never prompt
    /// text).
    Failed(Failure, String),
}

impl Upstream {
    /// POSTs `body` as `to` says; a refused or broken connection, a 5xx
    /// (unless `pass_server_errors`) or (when `streaming`) no headers
    /// within the first-token timeout is the worker's failure. A
    /// non-streaming answer's head comes with the whole answer (vLLM,
    /// SGLang), so only the request timeout bounds it: a first-token
    /// timeout there would fail every answer longer than it.
    pub(crate) async fn post(
        &self,
        to: Post<'_>,
        body: Bytes,
        streaming: bool,
        pass_server_errors: bool,
    ) -> Result<hyper::Response<Incoming>, PostError> {
        let uri = upstream_uri(to.endpoint, to.url, to.path).map_err(|_| PostError::Build)?;
        let mut upstream = Request::builder()
            .method(Method::POST)
            .uri(uri)
            .header(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )
            .header(REQUEST_ID, id_header(to.id));
        // A data-parallel rank's requests name it, as vLLM reads it.
        if let Some(rank) = &to.endpoint.dp_rank {
            upstream = upstream.header(crate::roster::DP_RANK_HEADER, rank.clone());
        }
        if let Some(router_id) = &self.router_id {
            upstream = upstream.header(switchyard_replica::ROUTER_ID_HEADER, router_id.clone());
        }
        if let Some(accept) = to.accept {
            upstream = upstream.header(header::ACCEPT, accept);
        }
        // The router's own credential; the client's is never forwarded.
        if let Some(auth) = &self.worker_auth {
            upstream = upstream.header(header::AUTHORIZATION, auth.clone());
        }
        let upstream = upstream
            .body(Full::new(body))
            .map_err(|_| PostError::Build)?;
        let timeout = self.first_token_timeout;
        let request = self.client.request(upstream);
        let answered = if streaming {
            tokio::time::timeout(timeout, request).await
        } else {
            Ok(request.await)
        };
        let worker = to.worker;
        match answered {
            Err(_) => Err(PostError::Failed(
                Failure::Timeout,
                format!(
                    "{worker} sent no response headers within {:.1} s",
                    timeout.as_secs_f64()
                ),
            )),
            Ok(Err(e)) if e.is_connect() => Err(PostError::Failed(
                Failure::Connect,
                format!("{worker} refused the connection"),
            )),
            Ok(Err(_)) => Err(PostError::Failed(
                Failure::Reset,
                format!("the connection to {worker} broke"),
            )),
            Ok(Ok(response)) if response.status().is_server_error() && !pass_server_errors => {
                Err(PostError::Failed(
                    Failure::Status5xx,
                    format!("{worker} answered {}", response.status().as_u16()),
                ))
            }
            Ok(Ok(response)) => Ok(response),
        }
    }

    /// A worker's response head as the client gets it: hop-by-hop headers
    /// dropped, and under `disclosure` only the headers a client may see;
    /// then the router's own (the worker's name when `--worker-header`,
    /// the client's request id).
    pub(crate) fn client_parts(
        &self,
        mut parts: hyper::http::response::Parts,
        endpoint: &Endpoint,
        client_id: RequestId,
        disclosure: Disclosure,
    ) -> hyper::http::response::Parts {
        for name in [
            header::CONNECTION,
            header::TRANSFER_ENCODING,
            header::CONTENT_LENGTH,
            HeaderName::from_static("keep-alive"),
        ] {
            parts.headers.remove(name);
        }
        disclosure.filter_headers(&mut parts.headers);
        if self.worker_header {
            if let Some(v) = &endpoint.name_header {
                parts.headers.insert(WORKER_HEADER, v.clone());
            }
        }
        parts.headers.insert(REQUEST_ID, id_header(client_id));
        parts
    }

    /// Sends `method path` with `body` to `worker` (no booking: nothing is
    /// generated) with the router's worker credential, and answers with
    /// the worker's status and body (bounded by `--max-response-bytes`).
    pub(crate) async fn direct(
        &self,
        worker: &WorkerInfo,
        disclosure: Disclosure,
        method: Method,
        path: String,
        body: Bytes,
    ) -> Result<Response, ApiError> {
        let uri = Uri::try_from(format!("{}{path}", worker.url))
            .map_err(|_| ApiError::internal("cannot build the upstream request"))?;
        let mut request = Request::builder().method(method).uri(uri);
        if !body.is_empty() {
            request = request.header(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
        }
        if let Some(auth) = &self.worker_auth {
            request = request.header(header::AUTHORIZATION, auth.clone());
        }
        let request = request
            .body(Full::new(body))
            .map_err(|_| ApiError::internal("cannot build the upstream request"))?;
        let sent = tokio::time::timeout(self.request_timeout, self.client.request(request)).await;
        let response = match sent {
            Err(_) => return Err(ApiError::timeout(self.request_timeout)),
            Ok(Err(_)) => {
                return Err(ApiError::bad_gateway(format!(
                    "{} did not answer",
                    disclosure.worker(&worker.name)
                )))
            }
            Ok(Ok(response)) => response,
        };
        let (parts, upstream) = response.into_parts();
        let limit = self.max_response_bytes;
        let bytes = read_whole(upstream, limit).await.map_err(|e| match e {
            ReadError::TooLarge => ApiError::bad_gateway(format!(
                "the worker's response exceeds the router's limit of {limit} bytes (--max-response-bytes)"
            )),
            ReadError::Broken => ApiError::bad_gateway("the worker's response broke"),
        })?;
        let mut out = (
            StatusCode::from_u16(parts.status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY),
            bytes,
        )
            .into_response();
        if let Some(ct) = parts.headers.get(header::CONTENT_TYPE) {
            out.headers_mut().insert(header::CONTENT_TYPE, ct.clone());
        }
        if self.worker_header {
            if let Some(v) = &worker.endpoint.name_header {
                out.headers_mut().insert(WORKER_HEADER, v.clone());
            }
        }
        Ok(out)
    }
}

/// The URI of `path` on the worker at `url`: the endpoint's scheme and
/// authority (made once per worker) and the static path, nothing parsed or
/// copied; a URL with a path prefix is joined and parsed.
fn upstream_uri(
    endpoint: &Endpoint,
    url: &str,
    path: &'static str,
) -> Result<Uri, uri::InvalidUri> {
    if let Some((scheme, authority)) = &endpoint.origin {
        let mut parts = uri::Parts::default();
        parts.scheme = Some(scheme.clone());
        parts.authority = Some(authority.clone());
        parts.path_and_query = Some(PathAndQuery::from_static(path));
        if let Ok(uri) = Uri::from_parts(parts) {
            return Ok(uri);
        }
    }
    // Sized exactly: the URI takes the string's buffer as it is.
    let mut joined = String::with_capacity(url.len() + path.len());
    joined.push_str(url);
    joined.push_str(path);
    Uri::try_from(joined)
}

/// `x-request-id`.
const REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");

/// `id` as a header value, its 32 hex digits (as `RequestId` displays)
/// written on the stack: the value's own bytes are its one allocation.
pub(crate) fn id_header(id: RequestId) -> HeaderValue {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    let mut digits = [0u8; 32];
    for (i, d) in digits.iter_mut().enumerate() {
        *d = HEX[((id.0 >> (4 * (31 - i))) & 0xf) as usize];
    }
    HeaderValue::from_bytes(&digits).expect("hex digits are a valid header value")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upstream_uri_is_the_url_joined_with_the_path() {
        for url in [
            "http://127.0.0.1:8000",
            "http://worker.local",
            "https://user:pw@h:9",
            "http://h:1/prefix",
            "http://h:1/prefix/v2",
        ] {
            let endpoint = Endpoint::new("w", url);
            for path in ["/v1/completions", "/v1/chat/completions"] {
                let built = upstream_uri(&endpoint, url, path).unwrap();
                let joined: Uri = format!("{url}{path}").parse().unwrap();
                assert_eq!(built, joined, "{url} {path}");
                assert_eq!(built.to_string(), joined.to_string());
            }
        }
        assert!(Endpoint::new("w", "http://h:1").origin.is_some());
        assert!(Endpoint::new("w", "http://h:1/prefix").origin.is_none());
        assert!(upstream_uri(
            &Endpoint::new("w", "not a url"),
            "not a url",
            "/v1/completions"
        )
        .is_err());
    }

    #[test]
    fn an_id_header_is_the_ids_display() {
        for id in [
            0,
            1,
            0xabc,
            u128::MAX,
            0x0123_4567_89ab_cdef_fedc_ba98_7654_3210,
        ] {
            let id = RequestId(id);
            assert_eq!(id_header(id).to_str().unwrap(), id.to_string());
        }
    }
}
