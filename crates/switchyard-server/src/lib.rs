//! `switchyard serve`: the router. An OpenAI-compatible HTTP frontend that
//! routes each request to the best worker and streams the answer back.
//!
//! Follow one request, outermost first:
//!
//! - `front` — the front door: the accept loop (connection cap,
//!   header-read timeout, TLS), the credential check from the request
//!   head, rate limits, the in-flight limit, the body read within its size
//!   limit and deadline ([`front_door`] puts them together; nothing reads a
//!   body before the key is checked).
//! - `routes` — the route table: the OpenAI endpoints, `/v1/models`,
//!   `/health`, `/ready`, `/metrics` and the admin API, and
//!   [`front_door`], the one assembly of the app (`serve`, the tests and
//!   the fuzz target drive the same layers).
//! - [`request`] — one request from its handler to its last byte: parse,
//!   tokenize, charge, the placement loop (submit, placed, failed, moved
//!   before the deadline) shared by plain and disaggregated requests, the
//!   answer, the stream that resumes on another worker when it breaks.
//! - `upstream` — HTTP to the workers: the pooled client, a request's
//!   `POST` (URI, the router's headers, the first-token timeout, which
//!   failure a failed send was), the answer head as the client gets it,
//!   and what of a worker a client learns (`upstream::disclosure`).
//! - [`driver`] — [`driver::Driver`]: the core's `Dispatcher` (every
//!   lifecycle decision: admission, routing, booking, freeing, migration,
//!   replica events, circuit breakers) behind one short-held mutex, driven
//!   with the router's clock, its effects carried out; routes made before
//!   the lock; the worker table's front end.
//!
//! Around it:
//!
//! - [`config`] — [`ServerConfig`]: TOML file, `SWITCHYARD_*` environment
//!   and flags ([`ServeArgs`], `cli`) fill one validated struct; `start` —
//!   start-up and shutdown ([`start`], [`run`], [`RunningServer`]).
//! - `fleet` — the fleet: workers joining and leaving, KV-event
//!   subscribers, health rounds; `roster` — the worker table itself;
//!   `discovery` — live discovery (`--workers-file`, `--workers-dns`).
//! - `models` — per-model routing state (`[[models]]`): tokenizer, block
//!   size, policy, hit rate (a model's tokenizer by its Hugging Face id:
//!   `switchyard_tokenizer::hub`); [`tokenize`] — where a prompt is
//!   tokenized and the tokenizer's series (the seam,
//!   [`tokenize::PromptTokenizer`], is `switchyard_tokenizer::prompt`'s);
//!   [`tokenize_gate`] — slots for tokenizing long prompts, handed out by
//!   band, then tenant fair share;
//!   `adapters` — LoRA adapters (a request's load: `request::adapter_load`).
//! - `replica` — replica sync (`--replica-sync`) over NATS.
//! - [`metrics`] — the router's counters and histograms, updated without
//!   allocating; `metrics_state` — the routing state, snapshotted at scrape time.
//! - [`response_map`] — stored responses' workers (the core's response
//!   affinity behind a lock, with its metrics).
//! - `error` — OpenAI-style errors (why an attempt failed and why a
//!   request is not moved on are the core's `dispatch::failure`).
//! - `state` — [`state::AppState`], what every handler reads, built once
//!   at start-up (it depends on no handler).
//! - [`standalone`] — the app with no workers, for property tests and fuzzing.
//!
//! Data flow: accept → credential check → in-flight permit → body read →
//! handler → tokenize → charge → `Attempts::place` (the dispatcher admits,
//! routes and books) → upstream POST → first event (else: the worker is
//! reported and the request moves, still its session's turn) → the
//! migrating stream (first token, latencies, mid-stream resume) → the
//! booking's drop finishes or aborts the request.
//!
//! Modules import each other in one direction only: `routes` →
//! `request` (`handlers` → `disagg` → `answer` → `attempt` and `stream`)
//! → `state` → `driver` (its guards: `driver::booking`) → `roster`,
//! `metrics_state`, `metrics`; `request`, `state` and `fleet` →
//! `upstream` (which imports none of them).

mod adapters;
mod cli;
pub mod config;
mod discovery;
pub mod driver;
mod error;
mod fleet;
mod front;
pub mod metrics;
mod metrics_state;
mod models;
mod replica;
pub mod request;
pub mod response_map;
mod roster;
mod routes;
pub mod standalone;
mod start;
pub mod state;
#[cfg(test)]
mod testing;
pub mod tokenize;
pub mod tokenize_gate;
mod upstream;

pub use cli::ServeArgs;
pub use config::{ServerConfig, WorkerSpec};
pub use routes::front_door;
pub use start::{
    build_driver, dispatcher_config, init_logging, run, start, start_with_tokenizer, RunningServer,
};
