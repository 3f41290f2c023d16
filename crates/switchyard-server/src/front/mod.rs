//! The front door, outermost first: everything a request passes before a
//! handler reads it.
//!
//! - [`accept`] — the accept loop: connection cap, header-read timeout,
//!   the TLS handshake when the front door serves HTTPS.
//! - [`tls`] — certificates both ways: the front door's (re-read when the
//!   files change) and the client configuration for `https://` workers.
//! - [`auth`] — credentials checked from the request head; nothing is
//!   read or computed for a caller before their key is checked.
//! - [`ratelimit`] — each key's request and token rates.
//! - [`inflight`] — the in-flight limit (503 past `--max-inflight`) and
//!   cancellation of what is still in flight at the shutdown deadline.
//! - [`upload`] — the body read whole within its size limit and deadline.
//!
//! [`crate::front_door`] puts them together around [`crate::routes`].

pub(crate) mod accept;
pub(crate) mod auth;
pub(crate) mod inflight;
pub(crate) mod ratelimit;
pub(crate) mod tls;
pub(crate) mod upload;
