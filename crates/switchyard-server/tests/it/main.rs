//! The router server's integration tests, in one test binary (`it`): the
//! server in-process (no `switchyard` binary) on real sockets, or its axum
//! app driven without a socket.

mod scripted_worker;
mod support;

mod allocations;
mod deploy;
mod discovery;
mod request_bodies;
mod shutdown;
