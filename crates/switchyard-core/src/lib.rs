//! The routing brain of Switchyard, sans I/O.
//!
//! Nothing in this crate performs I/O, spawns a task, sleeps or reads a clock:
//! every time-dependent call takes `now_ms` (milliseconds on any monotonic
//! clock the driver chooses). The HTTP server and the fleet simulator are two
//! drivers of this same code, which is what makes every decision reproducible
//! in a unit test.
//!
//! Modules, in the order a request meets them:
//!
//! - [`types`] — identities shared by every module: workers, requests, hashes.
//! - [`hashing`] — token ids to local block hashes and chained sequence hashes
//!   (xxh3-64; LoRA name and cache salt fold into the seed).
//! - [`index`] — the prefix index: which workers hold which prefix blocks, fed
//!   by engine KV events ([`index::PrefixIndex`]) or by the router's own
//!   decisions with a TTL ([`index::ApproxIndex`]).
//! - [`sequences`] — active sequences: the write model (worker table, request
//!   index, per-worker active sequences) and the derived read model
//!   ([`sequences::PromptRegistry`]) that selectors read.
//! - [`select`] — the cost function and the routing policies behind one
//!   [`select::Selector`] trait.
//! - [`router`] — the four above as one value ([`router::Router`]) with the
//!   call sequence both drivers follow; [`router::board`] publishes the
//!   loads so that the server routes outside its lock.
//! - [`replica`] — peer replicas' bookings applied to the write model as
//!   advisory remote bookings, expired when their origin goes silent.
//! - [`health`] — passive failure detection: a circuit breaker per worker
//!   that the driver feeds with request outcomes and asks before selection.
//! - [`admission`] — in front of the router: the policy queue (requests wait
//!   when every worker is busy), the admission-strategy API, request
//!   lifecycle records and live progress, and the session-aware strategy,
//!   behind one [`admission::AdmissionController`].
//! - [`engine_profile`] — an engine's measured timing curves and capacity
//!   (TOML, `switchyard calibrate`'s output) and the least-squares fit that
//!   makes them; read by the simulated engine and the router's estimator.
//! - [`estimate`] — prefill-duration hints: the configured timing model,
//!   fitted online per worker from observed times to first token.
//! - [`adapters`] — which worker has which LoRA adapter loaded; the router
//!   prices a missing one by its load time and a placement says when to
//!   load it; which adapters a request may name (`adapters::catalogue`).
//! - [`membership`] — live discovery's decision: which workers one
//!   discovery source adds and drains (it drains only what it added).
//! - [`eligibility`] — which workers may take a request: by its model,
//!   draining, and a disaggregated fleet's pools ([`eligibility::Role`]).
//! - [`dispatch`] — the request lifecycle as one value,
//!   [`dispatch::Dispatcher`]: router, admission, the request table, the
//!   estimator and the circuit breakers, driven by pure calls (submit,
//!   first token, finish, abort, migrate, tick, KV events, peers' batches)
//!   that return the driver's [`dispatch::Effects`]; a disaggregated
//!   request's two halves too (`submit_split`, `handed_over`,
//!   `redo_prefill`, [`dispatch::recovery`]) and what a failed attempt
//!   becomes ([`dispatch::failure`]: moved, resumed or given up). The server and the
//!   simulator are its two drivers.
//!
//! Data flow for one request: the driver hashes the prompt (`hashing`) and
//! submits it to the `dispatch`er; `admission` queues it (and may defer
//! it); when it is offered, the selector reads overlaps from `index` and
//! load from the registry and picks a worker; the dispatcher books it in
//! `sequences` (`AddRequest` with a prefill hint from `estimate`) and hands
//! the driver a dispatch; the driver reports the first token and the end,
//! and the dispatcher marks and frees the booking. Engine KV events flow
//! into `index` independently.

#![warn(missing_docs)]

pub mod adapters;
pub mod admission;
pub mod dispatch;
pub mod eligibility;
pub mod engine_profile;
pub mod estimate;
pub mod hashing;
pub mod health;
pub mod index;
mod maps;
pub mod membership;
pub mod replica;
pub mod router;
pub mod select;
pub mod sequences;
pub mod types;

pub use router::{Router, RouterConfig};
pub use types::{Eligible, EngineHash, LocalHash, ReplicaId, RequestId, SequenceHash, WorkerId};
