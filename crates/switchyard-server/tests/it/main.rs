//! The router server's integration tests, in one test binary (`it`): the
//! real axum app in-process, no `switchyard` binary and no worker.

mod request_bodies;
