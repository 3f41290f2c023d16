//! The KV-event plane's integration tests, in one test binary (`it`): real
//! ZMQ sockets on loopback, no router and no engine.

mod support;

mod hostile_publisher;
mod publish_subscribe;
