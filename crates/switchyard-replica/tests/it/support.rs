//! What the replica plane's integration tests share: a private
//! `nats-server`, and waits that poll a condition up to a deadline instead
//! of sleeping a fixed time.

use std::time::{Duration, Instant};
use switchyard_replica::LocalNatsServer;

/// A `nats-server` on a free loopback port, killed when dropped; a missing
/// binary fails the test.
pub(crate) fn nats() -> LocalNatsServer {
    LocalNatsServer::start().unwrap_or_else(|e| {
        panic!("these tests need a real nats-server: {e:#}");
    })
}

/// [`nats`] with `config` (nats-server configuration syntax).
pub(crate) fn nats_with(config: &str) -> LocalNatsServer {
    LocalNatsServer::start_with_config(config).unwrap_or_else(|e| {
        panic!("these tests need a real nats-server: {e:#}");
    })
}

/// Polls `condition` every millisecond until it holds; panics naming
/// `what` when `within` passes first. Returns how long it took.
pub(crate) async fn wait_for(
    what: &str,
    within: Duration,
    mut condition: impl FnMut() -> bool,
) -> Duration {
    let start = Instant::now();
    while !condition() {
        assert!(start.elapsed() < within, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    start.elapsed()
}
