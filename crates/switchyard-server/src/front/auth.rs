//! Who may ask what, decided from the request head alone: the outermost
//! middleware checks the bearer credential a path needs before any later
//! layer runs, so a refused request costs its head and nothing more — no
//! body byte is read, no in-flight permit taken, nothing tokenized.
//!
//! | path | credential | when none is configured |
//! |---|---|---|
//! | `/v1/*` | a client API key (`--api-key`, `--api-key-file`), as `Authorization: Bearer` or Anthropic's `x-api-key` | open |
//! | `/admin/*` | the admin token (`--admin-token`, `--admin-token-file`) | the routes do not exist (404) |
//! | `/metrics` | the metrics key (`--metrics-key`, `--metrics-key-file`) | open |
//! | `/health`, `/ready` | none | open |
//!
//! The same check puts the router's own errors on Anthropic's paths
//! (`/v1/messages...`) in Anthropic's shape
//! ([`crate::error::anthropic_shaped`]): being outermost, it sees every
//! inner layer's errors, and no other path pays for it.
//!
//! Secrets are compared in constant time ([`subtle`]); a comparison
//! reveals at most a secret's length. Every refusal is a 401 with
//! `WWW-Authenticate: Bearer` and is counted by scope
//! (`switchyard_auth_failures_total`).
//!
//! A client key admitted, the same check takes one request from that key's
//! rate limit ([`crate::front::ratelimit`]; 429 past it, still before the body)
//! and hands the handler a [`ClientKey`] to charge its tokens to. Client
//! keys are `--api-key`/`--api-key-file` (labelled `api-key-1`, `api-key-2`,
//! … in metrics) and the named keys of `[[rate_limits.keys]]`; with no key
//! configured every client shares one `anonymous` limit.

use crate::error::ApiError;
use crate::front::ratelimit::{Limited, Limits, RateLimits};
use crate::metrics::{AuthScope, RequestStatus, ServerMetrics};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::sync::Arc;
use subtle::ConstantTimeEq as _;
use switchyard_wire::openai::ErrorBody;

/// A bearer secret. Its `Debug` never shows it.
#[derive(Clone)]
pub(crate) struct Secret(Box<[u8]>);

impl Secret {
    /// The secret `text`.
    pub(crate) fn new(text: &str) -> Self {
        Self(text.as_bytes().into())
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Secret(..)")
    }
}

/// The token of an `Authorization: Bearer TOKEN` header (scheme matched
/// without case, surrounding spaces trimmed).
pub(crate) fn bearer(headers: &HeaderMap) -> Option<&[u8]> {
    let value = headers.get(header::AUTHORIZATION)?.as_bytes();
    let (scheme, token) = value.split_at_checked(7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    Some(token.trim_ascii())
}

/// The key of an `x-api-key: KEY` header (Anthropic's clients send their
/// key so), surrounding spaces trimmed; a client key only.
pub(crate) fn x_api_key(headers: &HeaderMap) -> Option<&[u8]> {
    let key = headers.get("x-api-key")?.as_bytes().trim_ascii();
    (!key.is_empty()).then_some(key)
}

/// Which client key a request presented: its position among the router's
/// client keys (0, the `anonymous` limit, when none is configured).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ClientKey(pub usize);

/// The position of the first of `keys` that `given` is, in time that does
/// not depend on which (every key is compared).
fn position(keys: &[Secret], given: &[u8]) -> Option<usize> {
    use subtle::ConditionallySelectable as _;
    let mut found = subtle::Choice::from(0);
    let mut at = 0u64;
    for (i, key) in keys.iter().enumerate().rev() {
        let eq = key.0.as_ref().ct_eq(given);
        at = u64::conditional_select(&at, &(i as u64), eq);
        found |= eq;
    }
    bool::from(found).then_some(at as usize)
}

/// The credentials the router checks, built once at startup.
pub struct Credentials {
    client: Vec<Secret>,
    admin: Option<Secret>,
    metrics_key: Option<Secret>,
    metrics: Arc<ServerMetrics>,
    /// One bucket pair per client key (or the anonymous one).
    rate_limits: RateLimits,
    /// Output tokens charged per choice of a request that names none.
    output_allowance: u32,
    /// Each client key's name (its metrics label), by [`ClientKey`];
    /// empty when no client key is configured.
    key_names: Vec<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("client_keys", &self.client.len())
            .field("admin", &self.admin.is_some())
            .field("metrics_key", &self.metrics_key.is_some())
            .finish_non_exhaustive()
    }
}

/// Why a request may not go on.
#[derive(Debug)]
pub enum Refusal {
    /// It lacks this credential (401).
    Credential(AuthScope),
    /// Its key is over a rate limit (429).
    RateLimited(Limited),
}

impl Credentials {
    /// The credentials of `config` (secret files already read); refusals
    /// are counted in `metrics`.
    pub fn new(config: &crate::ServerConfig, metrics: Arc<ServerMetrics>) -> Self {
        let limits = &config.rate_limits;
        let unnamed: Vec<String> = (1..=config.api_keys.len())
            .map(|i| format!("api-key-{i}"))
            .collect();
        let mut client: Vec<Secret> = config
            .api_keys
            .iter()
            .map(|k| Secret::new(k.expose()))
            .collect();
        let mut labels: Vec<(&str, Limits)> = unnamed
            .iter()
            .map(|n| (n.as_str(), Limits::default()))
            .collect();
        for named in &limits.keys {
            // Secret files were read at load; a key without its secret
            // (never loaded) is left out rather than accepted empty.
            if let Some(key) = &named.key {
                client.push(Secret::new(key));
                labels.push((named.name.as_str(), named.limits()));
            }
        }
        let key_names = match client.is_empty() {
            true => Vec::new(),
            false => labels.iter().map(|(name, _)| (*name).to_owned()).collect(),
        };
        if client.is_empty() {
            labels.push(("anonymous", Limits::default()));
        }
        Self {
            client,
            admin: config.admin_token.as_ref().map(|t| Secret::new(t.expose())),
            metrics_key: config.metrics_key.as_ref().map(|k| Secret::new(k.expose())),
            metrics,
            rate_limits: RateLimits::new(labels, limits.defaults()),
            output_allowance: limits.output_allowance(),
            key_names,
        }
    }

    /// The per-key rate limits (to charge a request's tokens).
    pub fn rate_limits(&self) -> &RateLimits {
        &self.rate_limits
    }

    /// Output tokens charged per choice of a request that names no output
    /// limit (`[rate_limits] default_output_tokens`).
    pub fn output_allowance(&self) -> u32 {
        self.output_allowance
    }

    /// The name of the client key a request presented (`api-key-1`, …, or
    /// a `[[rate_limits.keys]]` name); `None` when no client key is
    /// configured (every client is one `anonymous` party).
    pub fn key_name(&self, key: ClientKey) -> Option<&str> {
        self.key_names.get(key.0).map(String::as_str)
    }

    /// Whether client keys are configured (`/v1/*` needs one).
    pub fn client_keys_required(&self) -> bool {
        !self.client.is_empty()
    }

    /// What a request to `path` must present, if anything: the scope and
    /// the secrets any one of which will do.
    fn required(&self, path: &str) -> Option<(AuthScope, &[Secret])> {
        if path.starts_with("/v1/") && !self.client.is_empty() {
            Some((AuthScope::Client, &self.client))
        } else if path == "/admin" || path.starts_with("/admin/") {
            // Without a token the admin routes do not exist: the router's
            // fallback answers 404, also without reading the body.
            self.admin
                .as_ref()
                .map(|t| (AuthScope::Admin, std::slice::from_ref(t)))
        } else if path == "/metrics" {
            self.metrics_key
                .as_ref()
                .map(|k| (AuthScope::Metrics, std::slice::from_ref(k)))
        } else {
            None
        }
    }

    /// Whether a request with `headers` may go to `path`: `Err` names
    /// the credential it lacks. A refusal is counted (and, for an OpenAI
    /// `POST`, counted as an invalid request like any other 4xx the router
    /// answers itself).
    pub fn admits(
        &self,
        method: &Method,
        path: &str,
        headers: &HeaderMap,
    ) -> Result<Option<ClientKey>, Refusal> {
        let client_route = path.starts_with("/v1/");
        let Some((scope, secrets)) = self.required(path) else {
            return match client_route {
                // No key configured: the anonymous limit.
                true => self.take_request(method, ClientKey(0)).map(Some),
                false => Ok(None),
            };
        };
        // A client key may also come as Anthropic's `x-api-key` header.
        let given = match scope {
            AuthScope::Client => bearer(headers).or_else(|| x_api_key(headers)),
            _ => bearer(headers),
        };
        match (given.and_then(|g| position(secrets, g)), scope) {
            (Some(at), AuthScope::Client) => {
                return self.take_request(method, ClientKey(at)).map(Some)
            }
            (Some(_), _) => return Ok(None),
            (None, _) => {}
        }
        self.metrics.count_auth_failure(scope);
        if scope == AuthScope::Client && method == Method::POST {
            self.metrics.count_request(RequestStatus::Invalid);
        }
        Err(Refusal::Credential(scope))
    }

    /// One request from `key`'s rate limit; a refused `POST` is counted as
    /// a rejected request.
    fn take_request(&self, method: &Method, key: ClientKey) -> Result<ClientKey, Refusal> {
        match self.rate_limits.check_request(key.0) {
            Ok(()) => Ok(key),
            Err(limited) => {
                if method == Method::POST {
                    self.metrics.count_request(RequestStatus::Rejected);
                }
                Err(Refusal::RateLimited(limited))
            }
        }
    }
}

/// Wraps `app` so that every request is checked by [`Credentials::admits`]
/// before anything else of `app` runs; apply it last (outermost).
pub(crate) fn layer(app: axum::Router, credentials: Arc<Credentials>) -> axum::Router {
    app.layer(axum::middleware::from_fn_with_state(credentials, check))
}

async fn check(
    State(credentials): State<Arc<Credentials>>,
    mut request: Request,
    next: Next,
) -> Response {
    let anthropic = crate::error::anthropic_path(request.uri().path());
    let scope = match credentials.admits(request.method(), request.uri().path(), request.headers())
    {
        Ok(key) => {
            if let Some(key) = key {
                request.extensions_mut().insert(key);
            }
            let response = next.run(request).await;
            return crate::error::anthropic_shaped(response, anthropic);
        }
        Err(Refusal::RateLimited(limited)) => {
            drop(request);
            let response = ApiError::from(limited).into_response();
            return crate::error::anthropic_shaped(response, anthropic);
        }
        Err(Refusal::Credential(scope)) => scope,
    };
    // The body is dropped unread with the request; hyper then closes the
    // connection rather than drain an upload nobody asked for.
    drop(request);
    let error = match scope {
        AuthScope::Client => ApiError::unauthorized(),
        AuthScope::Admin => ApiError::from(ErrorBody::authentication(
            "invalid or missing admin token (Authorization: Bearer ...)",
        )),
        AuthScope::Metrics => ApiError::from(ErrorBody::authentication(
            "invalid or missing metrics key (Authorization: Bearer ...)",
        )),
    };
    let mut response = error.into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    crate::error::anthropic_shaped(response, anthropic)
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use axum::http::StatusCode;
    use bytes::Bytes;
    use http_body::Frame;
    use std::pin::Pin;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::task::{Context, Poll};
    use tower::ServiceExt as _;

    #[test]
    fn a_secret_matches_itself_only() {
        let s = Secret::new("sk-good");
        let matches = |given: &[u8]| position(std::slice::from_ref(&s), given) == Some(0);
        assert!(matches(b"sk-good"));
        assert!(!matches(b"sk-goo"));
        assert!(!matches(b"sk-good!"));
        assert!(!matches(b"sk-bad!"));
        assert!(!matches(b""));
        assert_eq!(format!("{s:?}"), "Secret(..)", "Debug hides the secret");
    }

    #[test]
    fn any_of_several_keys_matches_and_none_of_them_is_refused() {
        let keys = [
            Secret::new("a-1"),
            Secret::new("b-22"),
            Secret::new("c-333"),
        ];
        for (i, given) in ["a-1", "b-22", "c-333"].iter().enumerate() {
            assert_eq!(position(&keys, given.as_bytes()), Some(i), "{given}");
        }
        assert_eq!(position(&keys, b"d-4444"), None);
        assert_eq!(position(&[], b"a-1"), None);
    }

    #[test]
    fn the_bearer_token_is_read_from_the_header() {
        let with = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(v).unwrap());
            h
        };
        assert_eq!(bearer(&with("Bearer sk-1")), Some(&b"sk-1"[..]));
        assert_eq!(bearer(&with("bearer  sk-1 ")), Some(&b"sk-1"[..]));
        assert_eq!(bearer(&with("Basic c2stMQ==")), None);
        assert_eq!(bearer(&with("Bearer")), None);
        assert_eq!(bearer(&HeaderMap::new()), None);
    }

    /// A request body that records whether anyone polled it.
    struct Untouchable(Arc<AtomicBool>);

    impl http_body::Body for Untouchable {
        type Data = Bytes;
        type Error = std::convert::Infallible;
        fn poll_frame(
            self: Pin<&mut Self>,
            _: &mut Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
            self.0.store(true, Ordering::SeqCst);
            Poll::Pending
        }
    }

    /// An app whose every route reads its whole body, behind [`layer`].
    fn guarded(config: &crate::ServerConfig, metrics: Arc<ServerMetrics>) -> axum::Router {
        let read = |body: Bytes| async move { format!("read {}", body.len()) };
        let app = axum::Router::new()
            .route("/v1/chat/completions", axum::routing::post(read))
            .route("/admin/workers", axum::routing::post(read))
            .route("/metrics", axum::routing::get(|| async { "metrics" }))
            .route("/health", axum::routing::get(|| async { "ok" }));
        layer(app, Arc::new(Credentials::new(config, metrics)))
    }

    async fn call(
        app: &axum::Router,
        method: Method,
        path: &str,
        key: Option<&str>,
    ) -> (StatusCode, bool) {
        let polled = Arc::new(AtomicBool::new(false));
        let mut request = Request::builder().method(method).uri(path);
        if let Some(key) = key {
            request = request.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        let request = request
            .body(Body::new(Untouchable(polled.clone())))
            .unwrap();
        let answer = tokio::time::timeout(
            std::time::Duration::from_secs(1),
            app.clone().oneshot(request),
        )
        .await;
        match answer {
            Ok(response) => (response.unwrap().status(), polled.load(Ordering::SeqCst)),
            // The handler waits on the never-ending body: it was read.
            Err(_) => (StatusCode::REQUEST_TIMEOUT, polled.load(Ordering::SeqCst)),
        }
    }

    #[tokio::test]
    async fn a_missing_or_wrong_key_is_refused_without_reading_the_body() {
        let config = crate::ServerConfig {
            api_keys: vec!["sk-good".into()],
            admin_token: Some("adm".into()),
            metrics_key: Some("mk".into()),
            ..crate::ServerConfig::default()
        };
        let metrics = Arc::new(ServerMetrics::new("kv"));
        let app = guarded(&config, metrics.clone());
        for (path, key) in [
            ("/v1/chat/completions", None),
            ("/v1/chat/completions", Some("sk-bad")),
            ("/v1/chat/completions", Some("adm")),
            ("/admin/workers", None),
            ("/admin/workers", Some("sk-good")),
        ] {
            let (status, polled) = call(&app, Method::POST, path, key).await;
            assert_eq!(status, StatusCode::UNAUTHORIZED, "{path} {key:?}");
            assert!(!polled, "{path} {key:?}: the body was read");
        }
        let (status, _) = call(&app, Method::GET, "/metrics", Some("sk-good")).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
        assert_eq!(metrics.auth_failures(AuthScope::Client), 3);
        assert_eq!(metrics.auth_failures(AuthScope::Admin), 2);
        assert_eq!(metrics.auth_failures(AuthScope::Metrics), 1);
        assert_eq!(metrics.requests(RequestStatus::Invalid), 3);

        // The right credential lets the request through to its body.
        let (status, polled) =
            call(&app, Method::POST, "/v1/chat/completions", Some("sk-good")).await;
        assert_eq!(status, StatusCode::REQUEST_TIMEOUT, "the handler reads on");
        assert!(polled);
        let (status, polled) = call(&app, Method::POST, "/admin/workers", Some("adm")).await;
        assert_eq!(status, StatusCode::REQUEST_TIMEOUT);
        assert!(polled);
        assert_eq!(
            call(&app, Method::GET, "/metrics", Some("mk")).await.0,
            StatusCode::OK
        );
        assert_eq!(
            call(&app, Method::GET, "/health", None).await.0,
            StatusCode::OK
        );
    }

    #[test]
    fn the_position_of_the_matching_key_is_found_among_several() {
        let keys = [Secret::new("a"), Secret::new("bb"), Secret::new("a")];
        assert_eq!(position(&keys, b"a"), Some(0), "the first of equal keys");
        assert_eq!(position(&keys, b"bb"), Some(1));
        assert_eq!(position(&keys, b"c"), None);
        assert_eq!(position(&[], b"a"), None);
    }

    #[tokio::test]
    async fn a_key_over_its_rate_limit_gets_429_before_its_body_while_another_key_is_served() {
        let config = crate::ServerConfig::from_toml(
            "api_keys = [\"sk-a\"]\n[rate_limits]\nrequests_per_second = 1\n[[rate_limits.keys]]\nname = \"team-b\"\nkey = \"sk-b\"\nrequests_per_second = 100\n",
        )
        .unwrap();
        let metrics = Arc::new(ServerMetrics::new("kv"));
        let app = guarded(&config, metrics.clone());
        let path = "/v1/chat/completions";
        // The first request of sk-a passes (a quick one: the test app has
        // no /v1/models, so 404 — past the key and the limit).
        let (status, _) = call(&app, Method::GET, "/v1/models", Some("sk-a")).await;
        assert_eq!(status, StatusCode::NOT_FOUND);
        let (status, polled) = call(&app, Method::POST, path, Some("sk-a")).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert!(!polled, "a rate-limited request's body is not read");
        assert_eq!(metrics.requests(RequestStatus::Rejected), 1);
        // team-b has its own bucket.
        for _ in 0..3 {
            let (status, _) = call(&app, Method::GET, "/v1/models", Some("sk-b")).await;
            assert_eq!(status, StatusCode::NOT_FOUND);
        }
    }

    #[tokio::test]
    async fn without_keys_every_client_shares_the_anonymous_limit() {
        let config =
            crate::ServerConfig::from_toml("[rate_limits]\nrequests_per_second = 2\n").unwrap();
        let app = guarded(&config, Arc::new(ServerMetrics::new("kv")));
        let path = "/v1/chat/completions";
        for key in [None, Some("anything")] {
            let (status, _) = call(&app, Method::GET, "/v1/models", key).await;
            assert_eq!(status, StatusCode::NOT_FOUND, "past the limit");
        }
        let (status, polled) = call(&app, Method::POST, path, None).await;
        assert_eq!(status, StatusCode::TOO_MANY_REQUESTS);
        assert!(!polled);
        // Probes are never limited.
        assert_eq!(
            call(&app, Method::GET, "/health", None).await.0,
            StatusCode::OK
        );
    }

    #[tokio::test]
    async fn without_configured_secrets_every_route_is_open() {
        let metrics = Arc::new(ServerMetrics::new("kv"));
        let app = guarded(&crate::ServerConfig::default(), metrics.clone());
        assert_eq!(
            call(&app, Method::GET, "/metrics", None).await.0,
            StatusCode::OK
        );
        let (_, polled) = call(&app, Method::POST, "/v1/chat/completions", None).await;
        assert!(polled, "no key configured: the request goes on to its body");
        assert_eq!(metrics.auth_failures(AuthScope::Client), 0);
    }
}
