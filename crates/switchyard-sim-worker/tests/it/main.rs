//! The sim-worker's integration tests: workers served in-process on real
//! loopback sockets, one module per concern.

mod adapters;
mod chat_template;
mod disagg;
mod dp;
mod output_text;
mod support;
mod wordpiece;
