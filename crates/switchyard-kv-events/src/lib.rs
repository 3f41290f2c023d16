//! The KV-event plane: engines' KV-cache events over ZMQ, as vLLM and
//! SGLang publish them, into a router's prefix index.
//!
//! - [`publisher`] — the engine side (PUB with sequence numbers, a ROUTER
//!   that replays a bounded ring), as vLLM runs it; the simulated engine
//!   publishes through it.
//! - [`subscriber`] — the router side: one SUB thread per worker endpoint,
//!   gap detection and replay, decoding and normalizing
//!   (`switchyard_wire`), applying into an [`subscriber::IndexSink`].
//! - [`metrics`] — `prometheus-client` counter families, labelled by
//!   worker name, that a server registers into its `/metrics` registry.
//!
//! Data flow: engine PUB → [`subscriber::KvEventSubscriber`] (sequence
//! check, replay) → `switchyard_wire` decode and normalize → sink.

#![warn(missing_docs)]

pub mod metrics;
pub mod publisher;
pub mod subscriber;
