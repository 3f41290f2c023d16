//! The replica plane's integration tests, in one test binary (`it`): replica
//! planes in this process over a real `nats-server`, no router process.

mod support;

mod nats_sync;
mod security;
