//! What a client learns of the workers behind the router.
//!
//! With client keys required (`api_keys`, or named keys of
//! `[rate_limits]`) the router is taken to face clients outside the
//! fleet, and a worker's name — its `name=`, by default its `host:port`,
//! an internal address — is not theirs to learn ([`Disclosure::Guarded`]):
//!
//! - the router's error bodies and stream error events say "a worker"
//!   where they would name one ([`Disclosure::worker`]);
//! - of a worker's response headers only those a client needs reach it
//!   ([`passes_to_clients`]): the body's type and encoding, caching,
//!   `Retry-After`, and the APIs' own (`openai-*`, `anthropic-*`,
//!   `x-ratelimit-*`); a worker's `server`, `date` or anything else of
//!   its own stays behind. The router's own `x-request-id` and
//!   `x-switchyard-*` are added afterwards.
//!
//! Without client keys ([`Disclosure::Open`]) errors name the worker and
//! its headers pass (hop-by-hop ones aside), as the operator's own tools
//! expect. Logs name workers either way. Whether responses carry
//! `x-switchyard-worker` is its own setting (`--worker-header`, off by
//! default with keys).

use axum::http::{header, HeaderMap, HeaderName};

/// How the router speaks of workers to clients
/// ([`crate::state::AppState::disclosure`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Disclosure {
    /// No client key is required: workers are named, their headers pass.
    Open,
    /// Client keys are required: no worker is named, only the headers a
    /// client needs pass.
    Guarded,
}

impl Disclosure {
    /// The disclosure of a router that requires client keys or not.
    pub(crate) fn when_keys_required(required: bool) -> Self {
        if required {
            Self::Guarded
        } else {
            Self::Open
        }
    }

    /// The worker named `name` as an error message says it: `worker NAME`,
    /// or `a worker`.
    pub(crate) fn worker(self, name: &str) -> WorkerName<'_> {
        WorkerName(match self {
            Self::Open => Some(name),
            Self::Guarded => None,
        })
    }

    /// Drops from a worker's response `headers` those that do not reach
    /// clients.
    pub(crate) fn filter_headers(self, headers: &mut HeaderMap) {
        if self == Self::Open {
            return;
        }
        let mut kept = HeaderMap::with_capacity(headers.len());
        let mut current: Option<HeaderName> = None;
        // A name comes once, before all its values.
        for (name, value) in std::mem::take(headers) {
            if let Some(name) = name {
                current = Some(name);
            }
            if let Some(name) = current.as_ref().filter(|n| passes_to_clients(n)) {
                kept.append(name.clone(), value);
            }
        }
        *headers = kept;
    }
}

/// A worker as a client's error message names it ([`Disclosure::worker`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct WorkerName<'a>(Option<&'a str>);

impl std::fmt::Display for WorkerName<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(name) => write!(f, "worker {name}"),
            None => f.write_str("a worker"),
        }
    }
}

/// Whether a worker's response header named `name` reaches clients of a
/// router that requires client keys: what a client needs to read the body
/// and to pace itself, and the APIs' own headers.
pub(crate) fn passes_to_clients(name: &HeaderName) -> bool {
    const PREFIXES: [&str; 3] = ["openai-", "anthropic-", "x-ratelimit-"];
    [
        header::CONTENT_TYPE,
        header::CONTENT_ENCODING,
        header::CACHE_CONTROL,
        header::RETRY_AFTER,
    ]
    .contains(name)
        || PREFIXES.iter().any(|p| name.as_str().starts_with(p))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn a_guarded_router_says_a_worker_where_an_open_one_names_it() {
        let name = "127.0.0.1:18022";
        assert_eq!(
            format!("{} answered 500", Disclosure::Open.worker(name)),
            "worker 127.0.0.1:18022 answered 500"
        );
        assert_eq!(
            format!("{} answered 500", Disclosure::Guarded.worker(name)),
            "a worker answered 500"
        );
        assert_eq!(
            format!(
                "the connection to {} broke",
                Disclosure::Guarded.worker(name)
            ),
            "the connection to a worker broke"
        );
        assert_eq!(Disclosure::when_keys_required(true), Disclosure::Guarded);
        assert_eq!(Disclosure::when_keys_required(false), Disclosure::Open);
    }

    #[test]
    fn clients_get_the_body_s_type_pacing_and_the_apis_own_headers_only() {
        for name in [
            "content-type",
            "content-encoding",
            "cache-control",
            "retry-after",
            "openai-processing-ms",
            "openai-version",
            "anthropic-ratelimit-requests-remaining",
            "x-ratelimit-remaining-tokens",
        ] {
            assert!(passes_to_clients(&HeaderName::from_static(name)), "{name}");
        }
        for name in [
            "server",
            "date",
            "x-request-id",
            "x-switchyard-worker",
            "x-forwarded-for",
            "set-cookie",
            "via",
            "x-powered-by",
            "content-length",
        ] {
            assert!(!passes_to_clients(&HeaderName::from_static(name)), "{name}");
        }
    }

    fn worker_headers() -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert("server", HeaderValue::from_static("uvicorn"));
        headers.insert(
            "date",
            HeaderValue::from_static("Mon, 01 Jan 2024 00:00:00 GMT"),
        );
        headers.insert(
            "content-type",
            HeaderValue::from_static("text/event-stream"),
        );
        headers.append("x-ratelimit-limit", HeaderValue::from_static("1"));
        headers.append("x-ratelimit-limit", HeaderValue::from_static("2"));
        headers.insert(
            "x-switchyard-worker",
            HeaderValue::from_static("10.0.0.7:8000"),
        );
        headers
    }

    #[test]
    fn a_guarded_router_keeps_only_the_allowed_headers_every_value_of_each() {
        let mut headers = worker_headers();
        Disclosure::Guarded.filter_headers(&mut headers);
        let names: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        assert_eq!(names, ["content-type", "x-ratelimit-limit"]);
        let limits: Vec<&str> = headers
            .get_all("x-ratelimit-limit")
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect();
        assert_eq!(limits, ["1", "2"]);
    }

    #[test]
    fn an_open_router_passes_a_worker_s_headers_unchanged() {
        let mut headers = worker_headers();
        Disclosure::Open.filter_headers(&mut headers);
        assert_eq!(headers, worker_headers());
    }
}
